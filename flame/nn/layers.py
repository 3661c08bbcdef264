"""Layers with PyTorch's constructor arguments, parameter names and default initialisation."""
from __future__ import annotations

import math
import numbers
from collections import OrderedDict

import torch

from .. import runtime
from ..autograd import needs_grad
from ..kernels import elementwise as KE
from ..ops import norms as N
from ..ops.conv2d import conv2d
from ..ops.dropout import dropout
from ..ops.elementwise import gelu, silu
from ..ops.matmul import linear
from ..ops.shape import narrow
from ..tensor import Tensor, check_dtype
from . import init
from .module import Module, Parameter


def empty_parameter(shape, dtype=None, device=None, channels_last=False) -> Parameter:
    """An uninitialised parameter; ``channels_last`` lays a 4-D (out, in, kh, kw) weight out as
    (out, kh, kw, in) in memory, the layout the implicit-GEMM convolution reads contiguously.
    ``device="meta"``: a parameter without storage (shape, strides and dtype only), as on PyTorch's
    meta device: a model built so is planned, or has its memory placed and then loaded
    (``flame.models.placement``); the initialisers leave it as it is; it cannot run."""
    meta = device is not None and torch.device(device).type == "meta"
    if not meta:
        runtime.resolve_device(device)
    dtype = check_dtype(dtype or runtime.get_default_dtype())
    if not dtype.is_floating_point:
        raise TypeError(f"parameters must be floating point, got {dtype}")
    shape = tuple(shape)
    if channels_last:
        _, i, kh, kw = shape
        strides = (kh * kw * i, 1, kw * i, i)
    else:
        strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    if meta:
        return Parameter(Tensor(torch.empty_strided(shape, strides, dtype=dtype, device="meta")))
    return Parameter(Tensor(runtime.empty_strided(shape, strides, dtype)))


def _register_bias(module, bias: bool, n: int, dtype, device):
    if bias:
        module.bias = empty_parameter((n,), dtype, device)
    else:
        module.register_parameter("bias", None)


def _default_init(weight, bias, fan_in):
    """PyTorch's default for Linear and Conv: W kaiming_uniform_(a=sqrt(5)), i.e. uniform in
    +-1/sqrt(fan_in), and b uniform in +-1/sqrt(fan_in)."""
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        init.uniform_(bias, -bound, bound)


def _check_input(x, layer):
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: input must be a flame Tensor, got {type(x).__name__}")


class Identity(Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class Linear(Module):
    """y = x W^T + b with W of shape (out_features, in_features); PyTorch's init: W and b uniform in
    +-1/sqrt(in_features) (kaiming_uniform_ with a = sqrt(5))."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        _register_bias(self, bias, out_features, dtype, device)
        self.reset_parameters()

    def reset_parameters(self):
        _default_init(self.weight, self.bias, self.in_features)

    def forward(self, x, residual=None):
        """``x W^T + b``, plus ``residual`` if given (a residual connection, added by the GEMM's epilogue)."""
        return self.forward_with(x, self.weight, self.bias, residual)

    def forward_with(self, x, weight, bias, residual=None):
        """``forward`` with another weight and bias of this layer's input width (``linears``: a packed group's)."""
        _check_input(x, "Linear")
        xs = x._data.shape
        if not xs or xs[-1] != self.in_features:
            raise RuntimeError(f"Linear: input of shape {x.shape} does not end in in_features={self.in_features} "
                               f"(weight shape {self.weight.shape})")
        return linear(x, weight, bias, residual=residual)  # one GEMM, bias and residual in its epilogue

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(layers) -> bool:
    """Give ``Linear`` layers of one input width one buffer: their weights become consecutive row
    blocks of one (sum of out_features, in_features) buffer (their biases, all or none, of one
    vector), values, names, ``requires_grad`` and modules unchanged, so that ``linears`` runs them
    as one GEMM (the q, k and v projections of one input: one launch instead of three, and a wider
    GEMM). Layers that are not all plain ``Linear``s of one dtype and input width on flame's device
    (an fp8 weight, a LoRA wrapper) are left as they are. Returns whether it packed them."""
    layers = list(layers)
    if len(layers) < 2 or not all(type(m) is Linear and type(m.weight) is Parameter for m in layers):
        return False
    w0, b0 = layers[0].weight._data, layers[0].bias
    if not (w0.device == runtime.device and all(
            m.weight._data.dtype == w0.dtype and m.in_features == layers[0].in_features
            and m.weight._data.device == w0.device and (m.bias is None) == (b0 is None)
            and (b0 is None or m.bias.dtype == b0.dtype) for m in layers)):
        return False
    rows = sum(m.out_features for m in layers)
    weights = runtime.empty((rows, layers[0].in_features), w0.dtype)
    biases = None if b0 is None else runtime.empty((rows,), b0.dtype)
    start = 0
    for m in layers:
        end = start + m.out_features
        for name, buf in (("weight", weights), ("bias", biases)):
            old = getattr(m, name)
            if buf is not None:
                part = buf[start:end]
                KE.copy_(part, old._data)
                setattr(m, name, Parameter(Tensor(part), requires_grad=old.requires_grad))
        start = end
    return True


def _packing(layers, weights, biases):
    """``(rows, sizes)``: the (rows, in) buffer that ``pack_linears`` gave ``layers`` (their weight
    buffers ``weights``, bias buffers ``biases``) and each layer's out_features, or None when their
    weights (and biases) are not consecutive row blocks of one buffer (never packed, or replaced)."""
    first, b0 = weights[0], biases[0]
    if first.dim() != 2:
        return None
    k, size = first.shape[1], first.element_size()
    offset = 0
    for t, bt in zip(weights, biases):
        if (t.dtype != first.dtype or t.dim() != 2 or t.stride() != (k, 1) or t.shape[1] != k
                or t.data_ptr() != first.data_ptr() + offset * k * size or (bt is None) != (b0 is None)
                or (bt is not None and (bt.dtype != b0.dtype or bt.stride() != (1,)
                                        or bt.data_ptr() != b0.data_ptr() + offset * bt.element_size()))):
            return None
        offset += t.shape[0]
    return offset, tuple(t.shape[0] for t in weights)


def linears(x, layers) -> list:
    """``[layer(x) for layer in layers]``: one GEMM over the packed weight of layers that
    ``pack_linears`` packed (each output a view of its columns) when nothing needs a gradient
    (inference; training runs each layer, as its gradients need), else each layer's own forward.
    Whether they are packed is kept per their buffers' addresses (a cast or a replaced weight is
    looked at again); nothing of theirs is held between calls."""
    layers = tuple(layers)
    if not all(type(m) is Linear for m in layers) or needs_grad(x, *(t for m in layers for t in (m.weight, m.bias))):
        return [m(x) for m in layers]
    weights = [m.weight._data for m in layers]
    biases = [None if m.bias is None else m.bias._data for m in layers]
    key = (weights[0].dtype, *(t.data_ptr() for t in weights), *(0 if t is None else t.data_ptr() for t in biases))
    kept = layers[0].__dict__.get("_packed")
    if kept is None or kept[0] != key:
        kept = (key, _packing(layers, weights, biases))
        object.__setattr__(layers[0], "_packed", kept)
    if kept[1] is None:
        return [m(x) for m in layers]
    rows, sizes = kept[1]
    k = weights[0].shape[1]
    weight = Tensor(weights[0].as_strided((rows, k), (k, 1)))
    bias = None if biases[0] is None else Tensor(biases[0].as_strided((rows,), (1,)))
    y = layers[0].forward_with(x, weight, bias)
    outs, start = [], 0
    for n in sizes:
        outs.append(narrow(y, -1, start, n))
        start += n
    return outs


def _pair(v):
    return (int(v), int(v)) if isinstance(v, numbers.Integral) else tuple(int(x) for x in v)


class Conv2d(Module):
    """2-D convolution over (N, C, H, W) with PyTorch's arguments, weight (out, in / groups, kh, kw)
    and init (kaiming_uniform_ with a = sqrt(5), bias uniform in +-1/sqrt(fan_in)). The output is
    channels-last (see ``F.conv2d``). The weight is stored channels-last (``(out, kh, kw, in)`` in
    memory, as PyTorch's ``channels_last`` format): loading a state dict copies into that layout."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        super().__init__()
        if padding_mode != "zeros":
            raise ValueError(f"Conv2d: only padding_mode='zeros' is supported, got {padding_mode!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                             f"divisible by groups ({groups})")
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        self.weight = empty_parameter((out_channels, in_channels // groups, *self.kernel_size), dtype, device,
                             channels_last=True)
        _register_bias(self, bias, out_channels, dtype, device)
        self.reset_parameters()

    def reset_parameters(self):
        _default_init(self.weight, self.bias, self.weight.shape[1] * self.kernel_size[0] * self.kernel_size[1])

    def forward(self, x):
        _check_input(x, "Conv2d")
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, groups={self.groups}, bias={self.bias is not None}")


class _Norm(Module):
    """Shared by the norm layers: an optional affine ``weight`` (ones) and ``bias`` (zeros) of
    ``shape``, registered as None when absent (PyTorch's names and init)."""

    def _affine(self, shape, weight: bool, bias: bool, dtype, device):
        for name, wanted in (("weight", weight), ("bias", weight and bias)):
            if wanted:
                setattr(self, name, empty_parameter(shape, dtype, device))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)


class GroupNorm(_Norm):
    """GroupNorm over (N, C, *) with per-channel affine weight (ones) and bias (zeros)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError("num_channels must be divisible by num_groups")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self._affine((num_channels,), affine, True, dtype, device)

    def forward(self, x):
        _check_input(x, "GroupNorm")
        return N.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


class LayerNorm(_Norm):
    """LayerNorm over the trailing ``normalized_shape`` dims; weight ones, bias zeros."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self._affine(self.normalized_shape, elementwise_affine, bias, dtype, device)

    def forward(self, x):
        _check_input(x, "LayerNorm")
        return N.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_Norm):
    """RMSNorm over the trailing ``normalized_shape`` dims; weight ones; ``eps=None`` means the
    input dtype's machine epsilon (as torch)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self._affine(self.normalized_shape, elementwise_affine, False, dtype, device)

    def forward(self, x):
        _check_input(x, "RMSNorm")
        return N.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SiLU(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x):
        return silu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return gelu(x, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class Dropout(Module):
    """Inverted dropout with a Philox mask (deterministic under ``flame.manual_seed``); identity in eval mode."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p

    def forward(self, x):
        return dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class Sequential(Module):
    """Children applied in order; built from modules or an OrderedDict of named modules."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, m in args[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, idx):
        mods = list(self._modules.items())
        if isinstance(idx, slice):
            return Sequential(OrderedDict(mods[idx]))
        return mods[idx][1]

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules registered as children named '0', '1', ..."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range")
        return self._modules[str(idx % n)]

    def __setitem__(self, idx, module):
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range")
        self.add_module(str(idx % n), module)

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules):
        for m in modules:
            self.append(m)
        return self

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList has no forward(); iterate over it")
