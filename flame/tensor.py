"""``Tensor``: a torch buffer (storage, shape, strides) plus the autograd bookkeeping.

The torch buffer is used for memory only; every value-touching operation is a flame op that
launches a Triton kernel. Views (reshape of contiguous data, transpose, permute, narrow, expand)
are torch views of the same storage and cost no kernel.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from . import runtime
from .autograd import RemovableHandle, run_backward

float32 = torch.float32
float64 = torch.float64
float16 = torch.float16
bfloat16 = torch.bfloat16
int32 = torch.int32
int64 = torch.int64
bool_ = torch.bool

SUPPORTED_DTYPES = (float32, float64, float16, bfloat16, int32, int64, bool_)
FLOAT_DTYPES = (float32, float64, float16, bfloat16)

_ids = itertools.count()


def check_dtype(dtype) -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"flame supports dtypes {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}")
    return dtype


def _category(dtype):
    if dtype == bool_:
        return 0
    return 2 if dtype.is_floating_point else 1


def promote_types(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """PyTorch's promotion lattice restricted to flame's dtypes."""
    if a == b:
        return a
    ca, cb = _category(a), _category(b)
    if ca != cb:
        return a if ca > cb else b
    if ca == 2:
        if float64 in (a, b):
            return float64
        return float32  # fp16+bf16, fp16+fp32, bf16+fp32
    if ca == 1:
        return int64
    return bool_


def result_type(*operands) -> torch.dtype:
    """Result dtype of an op over Tensors and Python scalars, following PyTorch's rules:
    dimensioned tensors decide; zero-dim tensors and then Python scalars only raise the category
    (a float scalar turns an integer result into the default float dtype)."""
    if len(operands) == 2:  # fast paths: two dimensioned tensors of one dtype; a float tensor and a number
        a, b = operands
        if isinstance(a, Tensor) and a.ndim:
            if isinstance(b, Tensor):
                if b.ndim and a.dtype == b.dtype:
                    return a.dtype
            elif type(b) in (int, float) and a.dtype.is_floating_point:
                return a.dtype
    dim_dtype = zero_dtype = None
    scalar_cat = -1
    for x in operands:
        if isinstance(x, Tensor):
            if x.ndim > 0:
                dim_dtype = x.dtype if dim_dtype is None else promote_types(dim_dtype, x.dtype)
            else:
                zero_dtype = x.dtype if zero_dtype is None else promote_types(zero_dtype, x.dtype)
        elif isinstance(x, bool):
            scalar_cat = max(scalar_cat, 0)
        elif isinstance(x, int):
            scalar_cat = max(scalar_cat, 1)
        elif isinstance(x, (float, np.floating)):
            scalar_cat = max(scalar_cat, 2)
    dtype = dim_dtype
    if zero_dtype is not None and (dtype is None or _category(zero_dtype) > _category(dtype)):
        dtype = zero_dtype
    if scalar_cat >= 0:
        scalar_dtype = (bool_, int64, runtime.get_default_dtype())[scalar_cat]
        if dtype is None or scalar_cat > _category(dtype):
            dtype = scalar_dtype
    if dtype is None:
        raise TypeError("result_type needs at least one Tensor or scalar")
    return dtype


def broadcast_shapes(*shapes) -> tuple:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, d in enumerate(s, ndim - len(s)):
            if d != 1:
                if out[i] != 1 and out[i] != d:
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} are not broadcastable "
                                     f"(dim {i - ndim}: {out[i]} vs {d})")
                out[i] = d
    return tuple(out)


class Tensor:
    """An n-dimensional array on flame's device, optionally tracked by autograd."""

    __slots__ = ("_data", "_requires_grad", "_node", "id", "_hooks", "_post_hooks", "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def __init__(self, data: torch.Tensor, requires_grad: bool = False):
        self._data = data
        self._node = None
        self._hooks = None
        self._post_hooks = None
        self.id = next(_ids)
        self._requires_grad = False
        if requires_grad:
            self.requires_grad = True

    # ---- metadata ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self._data.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def ndim(self) -> int:
        return self._data.dim()

    def dim(self) -> int:
        return self._data.dim()

    def numel(self) -> int:
        return self._data.numel()

    def stride(self, dim=None):
        return self._data.stride() if dim is None else self._data.stride(dim)

    def is_contiguous(self) -> bool:
        return self._data.is_contiguous()

    def element_size(self) -> int:
        return self._data.element_size()

    def data_ptr(self) -> int:
        return self._data.data_ptr()

    def is_floating_point(self) -> bool:
        """As torch.Tensor.is_floating_point (a method)."""
        return self.dtype.is_floating_point

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ---- autograd ---------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool):
        if value and not self.dtype.is_floating_point:
            raise RuntimeError(f"only floating-point tensors can require gradients, got dtype {self.dtype}")
        if not value and self._node is not None:
            raise RuntimeError("requires_grad can only be changed on leaf tensors; use detach()")
        self._requires_grad = bool(value)

    def requires_grad_(self, value: bool = True) -> Tensor:
        self.requires_grad = value
        return self

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def grad_fn(self):
        return self._node

    _NO_GRAD_ATTRIBUTE = ("flame tensors have no .grad: gradients live in the GradientMap that backward() "
                          "returns (grads = loss.backward(); grads[w]), or use flame.grad(loss, w)")

    @property
    def grad(self):
        raise AttributeError(self._NO_GRAD_ATTRIBUTE)

    @grad.setter
    def grad(self, value):
        raise AttributeError(self._NO_GRAD_ATTRIBUTE)

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's memory, outside the graph."""
        return Tensor(self._data)

    def backward(self, grad: Tensor | None = None, retain_graph: bool = False):
        """Backpropagate from this tensor; returns a ``GradientMap`` of leaf gradients."""
        grads, _ = run_backward(self, grad, retain_graph=retain_graph)
        return grads

    def register_hook(self, fn) -> RemovableHandle:
        """``fn(grad)`` runs when this tensor's gradient is computed; a non-None return replaces it."""
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self._node is not None:
            if self._node.hooks is None:
                self._node.hooks = []
            hooks = self._node.hooks
        else:
            if self._hooks is None:
                self._hooks = []
            hooks = self._hooks
        hooks.append(fn)
        return RemovableHandle(hooks, fn)

    def register_post_accumulate_grad_hook(self, fn) -> RemovableHandle:
        """For leaves: ``fn(tensor, grad)`` runs after the gradient is stored in the GradientMap."""
        if self._node is not None:
            raise RuntimeError("post accumulate grad hooks can only be registered on leaf tensors")
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self._post_hooks is None:
            self._post_hooks = []
        self._post_hooks.append(fn)
        return RemovableHandle(self._post_hooks, fn)

    # ---- host transfer ----------------------------------------------------------------
    def to_torch(self) -> torch.Tensor:
        """The underlying torch tensor (zero-copy, shares memory)."""
        return self._data

    # Every host read is refused inside a captured function (runtime.graph_rule), then raises what a
    # kernel reported since the last check (runtime.check_errors), except repr: printing never raises
    # a kernel's error, and the flags stay set for the next read.
    def numpy(self) -> np.ndarray:
        _reading("Tensor.numpy")
        return self._host()

    def _host(self) -> np.ndarray:
        src = self.to(float32) if self.dtype == bfloat16 else self
        return src._data.detach().cpu().numpy().copy()

    def tolist(self):
        _reading("Tensor.tolist")
        return self._host().tolist()

    def item(self):
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to a scalar")
        _reading("Tensor.item")
        return self._data.reshape(()).item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        if self.numel() != 1:
            raise RuntimeError(f"boolean value of a Tensor with {self.numel()} elements is ambiguous")
        return bool(self.item())

    def __index__(self):
        if self.dtype.is_floating_point or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __repr__(self):
        runtime.graph_rule("host read", "Tensor.__repr__, printing values")
        values = np.array2string(self._host(), separator=", ", precision=4, threshold=200, edgeitems=3,
                                 prefix="tensor(")
        extras = []
        if self.dtype not in (float32, int64, bool_):
            extras.append(f"dtype={self.dtype}")
        if self._node is not None:
            extras.append(f"grad_fn=<{self._node.name}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        tail = "".join(", " + e for e in extras)
        return f"tensor({values}{tail})"

    __hash__ = object.__hash__

    # ---- operators (defined in flame.ops; bound below) ---------------------------------


def _reading(action):
    runtime.graph_rule("host read", action)
    runtime.check_errors()


def _bind_methods():
    from .ops import creation, index, shape
    from .ops import elementwise as ew
    from .ops import reduce as red
    from .ops.matmul import matmul

    def rbinary(fn):
        return lambda self, other: fn(other, self)

    methods = {
        "__add__": ew.add, "__radd__": ew.add, "__sub__": ew.sub, "__rsub__": rbinary(ew.sub),
        "__mul__": ew.mul, "__rmul__": ew.mul, "__truediv__": ew.div, "__rtruediv__": rbinary(ew.div),
        "__pow__": ew.pow, "__rpow__": rbinary(ew.pow), "__neg__": ew.neg, "__abs__": ew.abs,
        "__matmul__": matmul, "__rmatmul__": rbinary(matmul),
        "__eq__": ew.eq, "__ne__": ew.ne, "__lt__": ew.lt, "__le__": ew.le, "__gt__": ew.gt, "__ge__": ew.ge,
        "__getitem__": shape.getitem,
        "add": ew.add, "sub": ew.sub, "mul": ew.mul, "div": ew.div, "pow": ew.pow, "neg": ew.neg,
        "abs": ew.abs, "exp": ew.exp, "log": ew.log, "sqrt": ew.sqrt, "rsqrt": ew.rsqrt, "sin": ew.sin,
        "cos": ew.cos, "tanh": ew.tanh, "sigmoid": ew.sigmoid, "relu": ew.relu, "clamp": ew.clamp,
        "maximum": ew.maximum, "minimum": ew.minimum, "eq": ew.eq, "ne": ew.ne, "lt": ew.lt, "le": ew.le,
        "gt": ew.gt, "ge": ew.ge, "to": ew.to, "float": lambda self: ew.to(self, float32),
        "half": lambda self: ew.to(self, float16), "bfloat16": lambda self: ew.to(self, bfloat16),
        "double": lambda self: ew.to(self, float64), "long": lambda self: ew.to(self, int64),
        "int": lambda self: ew.to(self, int32), "clone": shape.clone, "contiguous": shape.contiguous,
        "sum": red.sum, "mean": red.mean, "max": red.max, "min": red.min, "var": red.var,
        "reshape": shape.reshape, "view": shape.reshape, "permute": shape.permute,
        "transpose": shape.transpose, "narrow": shape.narrow, "expand": shape.expand,
        "expand_as": lambda self, other: shape.expand(self, other.shape),
        "broadcast_to": shape.expand, "unsqueeze": shape.unsqueeze, "squeeze": shape.squeeze,
        "flatten": shape.flatten, "split": shape.split, "chunk": shape.chunk, "t": shape.t,
        "gather": index.gather, "index_select": index.index_select, "matmul": matmul,
        "zero_": creation.zero_, "fill_": creation.fill_,
    }
    for name, fn in methods.items():
        setattr(Tensor, name, fn)
    Tensor.T = property(shape.t)
    Tensor.mT = property(lambda self: shape.transpose(self, -2, -1))
