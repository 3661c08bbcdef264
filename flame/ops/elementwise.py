"""Elementwise ops with NumPy broadcasting: unary math, binary arithmetic, comparisons, where,
clamp and casts. Each op's backward rule sits right under it; all run through the two map
kernels of ``flame.kernels.elementwise``."""
from __future__ import annotations

import math
import threading

import torch

from .. import runtime, tune
from ..autograd import needs_grad, record
from ..kernels import elementwise as K
from ..kernels.launch import Plan
from ..tensor import Tensor, broadcast_shapes, check_dtype, result_type
from ._util import argument_error, check_tensor, is_scalar, new


def map_op(op, operands, out_dtype, s0=0.0, s1=0.0) -> Tensor:
    """Run elementwise ``op`` over broadcast tensor ``operands``; returns a new tensor laid out as
    the first operand that has the full shape (PyTorch's rule for elementwise outputs): the same
    strides when that operand is dense (a channels-last activation stays channels-last, so the map
    runs as one contiguous pass and the next conv needs no layout copy), else contiguous.

    A map of one or two operands is memoised per signature (op, output dtype, each operand's dtype,
    shape and strides, ``_recipes``): a repeated one allocates its output as the first did and
    launches the kernel plan kept with it, without broadcasting shapes or keying the plan again."""
    if not isinstance(op, int):
        op = op.value
    n = len(operands)
    b1 = None
    if n == 1:
        b0 = operands[0]._data
        bufs = (b0,)
        key = (op, out_dtype, b0.dtype, b0.shape, b0.stride())
    elif n == 2:
        b0, b1 = operands[0]._data, operands[1]._data
        bufs = (b0, b1)
        key = (op, out_dtype, b0.dtype, b0.shape, b0.stride(), b1.dtype, b1.shape, b1.stride())
    else:
        bufs, key = [t._data for t in operands], None
    recipe = _recipes.get(key) if key is not None else None
    if recipe is not None:
        like, shape, expanded, plan, pinned = recipe
        out = runtime.empty(shape, out_dtype) if like is None else runtime.empty_like(bufs[like], out_dtype)
        if pinned is not None and _aligned(out, b0, b1):
            plan = pinned
        K.run_map(plan, out, [b.expand(shape) if e else b for b, e in zip(bufs, expanded)] if expanded else bufs, op,
                  s0, s1)
        return Tensor(out)
    shape = bufs[0].shape
    if any(b.shape != shape for b in bufs):
        shape = broadcast_shapes(*(b.shape for b in bufs))
    like = next((i for i, b in enumerate(bufs) if b.shape == shape), None)  # the first operand of the full shape
    out = runtime.empty(tuple(shape), out_dtype) if like is None else runtime.empty_like(bufs[like], out_dtype)
    expanded = tuple(b.shape != shape for b in bufs)
    inputs = [b.expand(shape) if e else b for b, e in zip(bufs, expanded)]
    if key is None:
        K.map_(out, inputs, op, s0, s1)
        return Tensor(out)
    plan = K.map_plan(out, inputs, op)
    if plan is None:  # tuning on first use: map_'s entry point
        K.map_(out, inputs, op, s0, s1)
        return Tensor(out)
    if len(_recipes) >= _MAX_RECIPES:
        _recipes.clear()
    pinned = _pinned(plan)
    _recipes[key] = (like, tuple(shape), expanded if any(expanded) else (), plan, pinned)
    if pinned is not None and _aligned(out, b0, b1):  # the twin's kernel is found on this first call, as the plan's
        plan = pinned
    K.run_map(plan, out, inputs, op, s0, s1)
    return Tensor(out)


def _aligned(out, b0, b1):
    """Whether ``out``, ``b0`` and ``b1`` (None for a map of one operand) start 16-byte aligned."""
    return (out.data_ptr() | b0.data_ptr() | (0 if b1 is None else b1.data_ptr())) & 15 == 0


def _pinned(plan):
    """Kernel plan ``plan`` launching through a pinned ``launch.Plan``: one compiled kernel and no key
    of its arguments per launch, for the calls of a signature whose buffers are all 16-byte aligned
    (the signature fixes their dtypes). None for a plan without a launch and for an integer map (its
    scalars' widths key its launches)."""
    if not isinstance(plan, tuple) or plan[4].by_width:
        return None
    kernel, grid, ints, meta, _ = plan
    return kernel, grid, ints, meta, Plan(kernel, meta, pinned=True)


# map_op signature -> (operand laid out like, output shape, which operands expand, kernel plan, its pinned twin)
_recipes: dict = {}
_MAX_RECIPES = 4096  # signatures before the memo starts afresh
tune.register_cache(_recipes.clear)  # the kernel plans follow tune's overrides and resets


# ---- unary ------------------------------------------------------------------------------------

def _unary(name, op, grad_op, save_output, keeps_int=False):
    """Build a unary op whose gradient is ``grad_op(g, saved)`` with saved = output or input."""

    def backward(node, g):
        return map_op(grad_op, (g, node.saved[0]), g.dtype)

    backward.__name__ = f"{name}_backward"

    def fn(x):
        check_tensor(x, "input", name)
        dtype = x._data.dtype
        if not (keeps_int or dtype.is_floating_point):
            dtype = result_type(x, 1.0)
        y = map_op(op, (x,), dtype)
        if needs_grad(x):
            record(y, (x,), backward, saved=(y if save_output else x,))
        return y

    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name}."
    return fn


abs = _unary("abs", K.ABS, K.ABS_BWD, save_output=False, keeps_int=True)  # noqa: A001
exp = _unary("exp", K.EXP, K.MUL, save_output=True)
log = _unary("log", K.LOG, K.DIV, save_output=False)
sqrt = _unary("sqrt", K.SQRT, K.SQRT_BWD, save_output=True)
rsqrt = _unary("rsqrt", K.RSQRT, K.RSQRT_BWD, save_output=True)
sin = _unary("sin", K.SIN, K.SIN_BWD, save_output=False)
cos = _unary("cos", K.COS, K.COS_BWD, save_output=False)
tanh = _unary("tanh", K.TANH, K.TANH_BWD, save_output=True)
sigmoid = _unary("sigmoid", K.SIGMOID, K.SIGMOID_BWD, save_output=True)
relu = _unary("relu", K.RELU, K.RELU_BWD, save_output=True, keeps_int=True)
silu = _unary("silu", K.SILU, K.SILU_BWD, save_output=False)
_gelu_exact = _unary("gelu", K.GELU, K.GELU_BWD, save_output=False)
_gelu_tanh = _unary("gelu_tanh", K.GELU_TANH, K.GELU_TANH_BWD, save_output=False)


def gelu(x, approximate: str = "none"):
    """GELU, exact (erf) by default or the tanh approximation with ``approximate='tanh'``."""
    if approximate == "none":
        return _gelu_exact(x)
    if approximate == "tanh":
        return _gelu_tanh(x)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# y = h * gelu(x) with (h, x) the two halves of the input's last dim:
#   dh = g * gelu(x),  dx = g * h * gelu'(x)  (kernels/elementwise.py: geglu_backward_)
def _geglu_backward(node, g):
    (inp,) = node.saved
    grad = new(inp.shape, g.dtype)
    K.geglu_backward_(grad._data, g._data, inp._data)
    return grad


def geglu(x):
    """GEGLU: split the last dim into halves ``(hidden, gate)`` and return ``hidden * gelu(gate)``
    (exact GELU), one fused map forward and one pass backward (SDXL's feed-forward activation)."""
    check_tensor(x, "input", "geglu")
    if not x.dtype.is_floating_point:
        raise TypeError(f"geglu: expected a floating-point tensor, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"geglu: the last dimension must be even (split into hidden and gate), got shape {x.shape}")
    hidden, gate = K.geglu_halves(x._data)
    y = new(hidden.shape, x.dtype)
    K.map_(y._data, [hidden, gate], K.GEGLU)
    if needs_grad(x):
        record(y, (x,), _geglu_backward, saved=(x,))
    return y


def _neg_backward(node, g):
    return map_op(K.NEG, (g,), g.dtype)


def neg(x):
    check_tensor(x, "input", "neg")
    if x.dtype == torch.bool:
        raise TypeError("neg: negation of a bool tensor is not supported; use logical_not")
    y = map_op(K.NEG, (x,), x.dtype)
    if needs_grad(x):
        record(y, (x,), _neg_backward)
    return y


# ---- binary arithmetic -------------------------------------------------------------------------

def _operands(a, b, name):
    """Validate and split the two operands: at least one tensor; scalars become kernel scalars."""
    ta, tb = isinstance(a, Tensor), isinstance(b, Tensor)
    for x, arg in ((a, "input"), (b, "other")):
        if not isinstance(x, Tensor) and not is_scalar(x):
            raise argument_error(x, f"{arg} operand", name, "a flame Tensor or a number")
    if not ta and not tb:
        raise TypeError(f"{name}: at least one operand must be a flame Tensor, "
                        f"got {type(a).__name__} and {type(b).__name__}")
    return ta, tb


def _scalar_for(value, dtype):
    return float(value) if dtype.is_floating_point else int(value)


def _binary(name, op, rop, a, b, dtype=None):
    """Forward of a binary op: returns (out, ta, tb)."""
    if type(a) is Tensor:  # the usual calls first: result_type's rule without its general walk
        da = a._data
        if type(b) is Tensor:
            db = b._data
            if da.dtype == db.dtype and da.dim() and db.dim():  # two dimensioned tensors of one dtype
                return map_op(op, (a, b), dtype or da.dtype), True, True
        elif type(b) in (int, float) and da.dtype.is_floating_point:  # a float tensor and a number
            return map_op(op, (a,), dtype or da.dtype, float(b)), True, False
    ta, tb = _operands(a, b, name)
    cdtype = result_type(a, b)
    out_dtype = dtype or cdtype
    if ta and tb:
        return map_op(op, (a, b), out_dtype), ta, tb
    if ta:
        return map_op(op, (a,), out_dtype, _scalar_for(b, cdtype)), ta, tb
    return map_op(rop, (b,), out_dtype, _scalar_for(a, cdtype)), ta, tb


def _add_backward(node, g):
    return g, g


def add(a, b):
    """a + b with broadcasting; either may be a Python scalar."""
    out, ta, tb = _binary("add", K.ADD, K.ADD, a, b)
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (a if ta else None, b if tb else None), _add_backward)
    return out


def _sub_backward(node, g):
    need_a, need_b = node.needs_input_grad
    return g if need_a else None, map_op(K.NEG, (g,), g.dtype) if need_b else None


def sub(a, b):
    """a - b with broadcasting; either may be a Python scalar."""
    out, ta, tb = _binary("sub", K.SUB, K.RSUB, a, b)
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (a if ta else None, b if tb else None), _sub_backward)
    return out


def _mul_backward(node, g):
    a, b = node.saved  # tensors or Python scalars
    need_a, need_b = node.needs_input_grad
    return (_times(g, b) if need_a else None), (_times(g, a) if need_b else None)


def _times(g, x):
    return map_op(K.MUL, (g, x), g.dtype) if isinstance(x, Tensor) else map_op(K.MUL, (g,), g.dtype, float(x))


def mul(a, b):
    """a * b with broadcasting; either may be a Python scalar."""
    out, ta, tb = _binary("mul", K.MUL, K.MUL, a, b)
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (a if ta else None, b if tb else None), _mul_backward, saved=(a, b))
    return out


def _div_backward(node, g):
    _a, b, y = node.saved
    need_a, need_b = node.needs_input_grad
    ga = gb = None
    if need_a:  # d(a/b)/da = 1/b
        ga = map_op(K.DIV, (g, b), g.dtype) if isinstance(b, Tensor) else map_op(K.DIV, (g,), g.dtype, float(b))
    if need_b:  # d(a/b)/db = -y/b
        gb = map_op(K.DIV_BWD_B, (g, y, b), g.dtype)
    return ga, gb


def div(a, b):
    """True division a / b (integer inputs give a floating result)."""
    dtype = result_type(a, b)
    if not dtype.is_floating_point:
        dtype = result_type(a, b, 1.0)
    out, ta, tb = _binary("div", K.DIV, K.RDIV, a, b, dtype)
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (a if ta else None, b if tb else None), _div_backward, saved=(a, b, out))
    return out


def _pow_backward(node, g):
    a, b, y = node.saved
    need_a, need_b = node.needs_input_grad
    ga = gb = None
    if need_a:  # d(a^b)/da = b a^(b-1)
        ga = (map_op(K.POW_BWD_BASE, (g, a, b), g.dtype) if isinstance(b, Tensor)
              else map_op(K.POW_BWD_BASE, (g, a), g.dtype, float(b)))
    if need_b:  # d(a^b)/db = y log(a)
        gb = (map_op(K.POW_BWD_EXP, (g, y, a), g.dtype) if isinstance(a, Tensor)
              else map_op(K.SCALE_MUL, (g, y), g.dtype, math.log(a) if a > 0 else float("nan")))
    return ga, gb


def pow(a, b):  # noqa: A001
    """a ** b with broadcasting; either may be a Python scalar."""
    out, ta, tb = _binary("pow", K.POW, K.RPOW, a, b)
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (a if ta else None, b if tb else None), _pow_backward, saved=(a, b, out))
    return out


def _extremum(name, op, grad_op):
    def backward(node, g):
        a, b = node.saved
        need_a, need_b = node.needs_input_grad
        return (map_op(grad_op, (g, a, b), g.dtype) if need_a else None,
                map_op(grad_op, (g, b, a), g.dtype) if need_b else None)

    backward.__name__ = f"{name}_backward"

    def fn(a, b):
        check_tensor(a, "input", name)
        check_tensor(b, "other", name)
        out = map_op(op, (a, b), result_type(a, b))
        if needs_grad(a, b):
            record(out, (a, b), backward, saved=(a, b))
        return out

    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name} of two tensors (NaN propagates; ties split the gradient evenly)."
    return fn


maximum = _extremum("maximum", K.MAXIMUM, K.MAXIMUM_BWD)
minimum = _extremum("minimum", K.MINIMUM, K.MINIMUM_BWD)


# y = x + value * t1 * t2:  dx = g,  dt1 = value * g * t2,  dt2 = value * g * t1 (maps of the
# broadcast shape; the engine sums each down to its input's shape, e.g. a gate's (B, 1, C))
def _addcmul_backward(node, g):
    t1, t2 = node.saved
    value = node.attrs["value"]
    need_x, need_1, need_2 = node.needs_input_grad
    return (g if need_x else None,
            map_op(K.SCALE_MUL, (g, t2), g.dtype, value) if need_1 else None,
            map_op(K.SCALE_MUL, (g, t1), g.dtype, value) if need_2 else None)


def addcmul(x, tensor1, tensor2, value=1.0):
    """``x + value * tensor1 * tensor2`` with broadcasting (``torch.addcmul``), one map forward: a
    gated residual ``x + gate[:, None, :] * y`` is ``addcmul(x, gate[:, None, :], y)``."""
    for t, name in ((x, "input"), (tensor1, "tensor1"), (tensor2, "tensor2")):
        check_tensor(t, name, "addcmul")
    if not is_scalar(value):
        raise argument_error(value, "value", "addcmul", "a number")
    dtype = result_type(x, tensor1, tensor2)
    if not dtype.is_floating_point and not float(value).is_integer():
        raise TypeError(f"addcmul: for integral inputs ({dtype}) value must be an integer, got {value!r}")
    out = map_op(K.ADDCMUL, (x, tensor1, tensor2), dtype, _scalar_for(value, dtype))
    need_1, need_2 = needs_grad(tensor1), needs_grad(tensor2)
    if need_1 or need_2 or needs_grad(x):
        record(out, (x, tensor1, tensor2), _addcmul_backward, saved=(tensor1 if need_2 else None,
                                                                    tensor2 if need_1 else None), value=float(value))
    return out


# ---- comparisons (no gradient) -----------------------------------------------------------------

_MIRROR = {K.EQ: K.EQ, K.NE: K.NE, K.LT: K.GT, K.GT: K.LT, K.LE: K.GE, K.GE: K.LE}


def _comparison(name, op):
    def fn(a, b):
        ta, tb = _operands(a, b, name)
        cdtype = result_type(a, b)
        if ta and tb:
            return map_op(op, (a, b), torch.bool)
        if ta:
            return map_op(op, (a,), torch.bool, _scalar_for(b, cdtype))
        return map_op(_MIRROR[op], (b,), torch.bool, _scalar_for(a, cdtype))

    fn.__name__ = name
    fn.__doc__ = f"Elementwise comparison ({name}); returns a bool tensor."
    return fn


eq = _comparison("eq", K.EQ)
ne = _comparison("ne", K.NE)
lt = _comparison("lt", K.LT)
le = _comparison("le", K.LE)
gt = _comparison("gt", K.GT)
ge = _comparison("ge", K.GE)


# ---- where, clamp, cast -------------------------------------------------------------------------

def _where_backward(node, g):
    (cond,) = node.saved
    need_a, need_b = node.needs_input_grad[1:]
    return (None,
            map_op(K.WHERE, (cond, g), g.dtype, 0.0) if need_a else None,
            map_op(K.WHERE_INV, (cond, g), g.dtype, 0.0) if need_b else None)


def where(condition, a, b):
    """Elements of ``a`` where ``condition`` is true, else of ``b`` (tensors or scalars, broadcast)."""
    check_tensor(condition, "condition", "where")
    if condition.dtype != torch.bool:
        raise TypeError(f"where: condition must be a bool tensor, got dtype {condition.dtype}")
    ta, tb = isinstance(a, Tensor), isinstance(b, Tensor)
    for x, name in ((a, "input"), (b, "other")):
        if not isinstance(x, Tensor) and not is_scalar(x):
            raise argument_error(x, name, "where", "a flame Tensor or a number")
    dtype = result_type(a, b)
    if ta and tb:
        out = map_op(K.WHERE, (condition, a, b), dtype)
    elif ta:
        out = map_op(K.WHERE, (condition, a), dtype, _scalar_for(b, dtype))
    elif tb:
        out = map_op(K.WHERE_INV, (condition, b), dtype, _scalar_for(a, dtype))
    else:
        out = map_op(K.WHERE, (condition,), dtype, _scalar_for(a, dtype), _scalar_for(b, dtype))
    if needs_grad(a if ta else None, b if tb else None):
        record(out, (None, a if ta else None, b if tb else None), _where_backward, saved=(condition,))
    return out


def _clamp_backward(node, g):
    (x,) = node.saved
    lo, hi = node.attrs["bounds"]
    return map_op(K.CLAMP_BWD, (g, x), g.dtype, lo, hi)


def clamp(x, min=None, max=None):  # noqa: A002
    """Clamp every element into [min, max] (either bound may be None)."""
    check_tensor(x, "input", "clamp")
    if min is None and max is None:
        raise ValueError("clamp: at least one of min or max must not be None")
    if x.dtype.is_floating_point:
        lo = -math.inf if min is None else float(min)
        hi = math.inf if max is None else float(max)
    else:
        info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
        if info is None:
            raise TypeError("clamp: bool tensors are not supported")
        lo = info.min if min is None else int(min)
        hi = info.max if max is None else int(max)
    y = map_op(K.CLAMP, (x,), x.dtype, lo, hi)
    if needs_grad(x):
        record(y, (x,), _clamp_backward, saved=(x,), bounds=(lo, hi))
    return y


def _to_backward(node, g):
    return g  # the engine casts the gradient back to the input's dtype


class _Copies(threading.local):
    current = None  # a class default: no AttributeError per read in a thread that never entered a region


_copies = _Copies()  # the parameter copies of this thread's ParameterCasts region


def parameter_copies(copies):
    """Make ``copies`` (``{(tensor id, dtype): its copy}``, views of one buffer, or None) this thread's
    parameter copies (``flame.amp.ParameterCasts``); returns the previous ones."""
    prev = _copies.current
    _copies.current = copies
    return prev


def parameter_copy(t, dtype):
    """The copy of ``t`` in ``dtype`` that the current ``ParameterCasts`` region made (a view of
    its buffer with ``t``'s shape and strides), or None."""
    copies = _copies.current
    return None if copies is None else copies.get((t.id, dtype))


def to(x, *args, dtype=None, device=None, copy=False):
    """Cast to ``dtype`` (a copy kernel; inside a ``ParameterCasts`` region a parameter's cast is
    its copy there, which the region's other casts of it share); ``device`` may only name flame's
    own device."""
    dtype = runtime.to_args(args, dtype, device)
    if dtype is None or (dtype == x.dtype and not copy):
        return x
    check_dtype(dtype)
    made = None if copy else parameter_copy(x, dtype)
    y = Tensor(made) if made is not None else map_op(K.IDENTITY, (x,), dtype)
    if dtype.is_floating_point and needs_grad(x):
        record(y, (x,), _to_backward)
    return y


def add_(dst: Tensor, src: Tensor) -> Tensor:
    """In place ``dst += src`` (src broadcast to dst), outside the graph (gradient accumulation)."""
    if needs_grad(dst, src):
        raise RuntimeError("add_: in-place ops on tensors that require grad are not recorded; use no_grad()")
    bufs = [dst._data, src._data if src.shape == dst.shape else src._data.expand(dst.shape)]
    K.map_(dst._data, bufs, K.ADD)
    return dst


def cast_params(weight, bias, n_out, dtype, op, error=RuntimeError):
    """A layer's weight and optional bias (checked to be ``(n_out,)``) cast once to the
    activations' ``dtype``; the casts are recorded, so fp32 master parameters get fp32 gradients."""
    if bias is not None:
        check_tensor(bias, "bias", op)
        bd = bias._data
        if bd.shape != (n_out,):
            raise error(f"{op}: bias must have shape ({n_out},), got {bias.shape}")
        if bd.dtype != dtype:
            bias = to(bias, dtype)
    if weight._data.dtype != dtype:
        weight = to(weight, dtype)
    return weight, bias
