"""Normalisation ops: ``group_norm`` (optionally with a fused SiLU), ``layer_norm`` and
``rms_norm``, with PyTorch's argument order, and ``layer_norm_modulated`` (LayerNorm without
affine, then a per-sample scale and shift: Flux's AdaLayerNormZero); each forward sits beside its
backward rule.

GroupNorm reads NCHW and channels-last inputs in place and writes its output in the same memory
format; statistics (mean, rstd) are saved in fp32 (fp64 for fp64 inputs). Weight and bias
gradients come from deterministic two-stage reductions (see ``flame.kernels.norms``).
"""
from __future__ import annotations

import itertools
import math
import numbers

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels import norms as K
from ..tensor import Tensor
from . import _autocast
from ._util import argument_error, check_tensor

_ACTIVATIONS = (None, "silu")


def _check_param(p, name, shape, x, op):
    if p is None:
        return None
    if isinstance(p, Tensor) and p._data.dim() == 1 and len(shape) == 1:  # fast path: a (C,) parameter
        buf = p._data
        if buf.shape[0] == shape[0] and buf.dtype.is_floating_point and buf.device == x._data.device:
            return p
    if not isinstance(p, Tensor):
        raise argument_error(p, name, op, "a flame Tensor or None")
    if not p.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be floating point, got dtype {p.dtype}")
    if tuple(p.shape) != tuple(shape):
        raise ValueError(f"{op}: expected {name} of shape {tuple(shape)} for input of shape {x.shape}, "
                         f"got {name} of shape {p.shape}")
    if p.device != x.device:
        raise RuntimeError(f"{op}: {name} is on {p.device} but the input is on {x.device}")
    return p


def _check_input(x, op):
    check_tensor(x, "input", op)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point input, got dtype {x.dtype}")


def _check_eps(eps, op):
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"{op}: eps must be a finite non-negative number, got {eps!r}")
    return float(eps)


def _flat(p):
    """A parameter's buffer as dense memory (the kernels index it with unit stride), or None."""
    if p is None:
        return None
    buf = p._data
    return buf if buf.is_contiguous() else _dense(buf)


def _dense(buf):
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def _zeros(shape, dtype):
    t = runtime.empty(tuple(shape), dtype)
    KE.fill_(t, 0.0)
    return Tensor(t)


# ---- group_norm -------------------------------------------------------------------------------

def _gn_view(buf):
    """(buf, (s_n, s_c, s_s)) viewing ``buf`` (N, C, *spatial) as (N, C, S) in place when the
    spatial dims collapse to one stride; otherwise a contiguous copy."""
    shape, strides = buf.shape, buf.stride()
    if buf.is_contiguous():
        S = strides[1] if len(shape) > 2 else 1
        return buf, (strides[0], S, 1)
    sp = [(s, st) for s, st in zip(shape[2:], strides[2:]) if s != 1]
    ok = all(a[1] == b[1] * b[0] for a, b in itertools.pairwise(sp))
    if not ok:
        buf = _dense(buf)
        strides = buf.stride()
        sp = [(s, st) for s, st in zip(shape[2:], strides[2:]) if s != 1]
    s_s = sp[-1][1] if sp else 1
    return buf, (strides[0], strides[1], s_s)


def _channels_last(shape, xs):
    """Does an (N, C, S) view with strides ``xs`` keep channels innermost (C > 1)?"""
    return shape[1] > 1 and xs[1] == 1 and math.prod(shape[2:]) > 1


def _like_format(shape, dtype, channels_last):
    """Empty buffer of ``shape``: channels-last strides when ``channels_last``, else contiguous."""
    if not channels_last:
        return runtime.empty(tuple(shape), dtype)
    C = shape[1]
    strides = [0] * len(shape)
    strides[1] = 1
    acc = C
    for d in range(len(shape) - 1, 1, -1):
        strides[d] = acc
        acc *= shape[d]
    strides[0] = acc
    return runtime.empty_strided(tuple(shape), tuple(strides), dtype)


def _group_norm_backward(node, g):
    x, w, b, mean, rstd = node.saved
    a = node.attrs
    N, C, S, G = a["N"], a["C"], a["S"], a["G"]
    need_x, need_w, need_b = node.needs_input_grad
    xbuf, xs = x, a["xs"]
    gbuf, gs = _gn_view(g._data)
    dx = dw = db = None
    if need_x:
        dx = Tensor(_like_format(a["shape"], a["dtype"], a["cl"]))
    if need_w or need_b:
        dw = runtime.empty((C,), w.dtype if w is not None else a["dtype"])
        db = runtime.empty((C,), b.dtype if b is not None else a["dtype"])
    if N * C * S == 0:
        if dw is not None:
            KE.fill_(dw, 0.0)
            KE.fill_(db, 0.0)
    else:
        dxbuf = None
        dxs = (0, 0, 0)
        if dx is not None:
            dxbuf, dxs = _gn_view(dx._data)
        K.group_norm_bwd(dxbuf, dw, db, gbuf, xbuf, w, b, mean, rstd, N, C, S, G, a["act"], xs, gs, dxs)
    return (dx, Tensor(dw) if need_w else None, Tensor(db) if need_b else None)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, activation=None):
    """GroupNorm over (N, C, *spatial) with ``num_groups`` groups of C / num_groups channels,
    optional per-channel affine ``weight``/``bias`` (C,), and an optional fused ``activation``
    (``"silu"``) applied to the normalised output. NCHW and channels-last inputs are read in place
    and the output keeps the input's memory format."""
    op = "group_norm"
    _check_input(x, op)
    x, weight, bias = _autocast.fp32(x, weight, bias)
    shape = x.shape
    if len(shape) < 2:
        raise ValueError(f"{op}: expected an input of shape (N, C, *), got shape {shape}")
    if type(num_groups) is not int and (not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool)):
        raise ValueError(f"{op}: num_groups must be a positive int, got {num_groups!r}")
    if num_groups <= 0:
        raise ValueError(f"{op}: num_groups must be a positive int, got {num_groups!r}")
    N, C = shape[0], shape[1]
    G = int(num_groups)
    if C % G:
        raise ValueError(f"{op}: expected number of channels in input ({C}) to be divisible by num_groups ({G}); "
                         f"input shape {shape}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    weight = _check_param(weight, "weight", (C,), x, op)
    bias = _check_param(bias, "bias", (C,), x, op)
    eps = _check_eps(eps, op)
    S = math.prod(shape[2:])
    act = activation == "silu"
    xbuf, xs = _gn_view(x._data)
    cl = _channels_last(shape, xs)
    dtype = xbuf.dtype
    y = Tensor(_like_format(shape, dtype, cl))
    wbuf = _flat(weight)
    bbuf = _flat(bias)
    if N * C * S == 0:
        mean = rstd = None
    else:
        ys = (C * S, 1, C) if cl else (C * S, S, 1)  # the strides _like_format gave y
        mean, rstd = K.group_norm_fwd(y._data, xbuf, wbuf, bbuf, N, C, S, G, eps, act, xs, ys)
    if needs_grad(x, weight, bias):
        record(y, (x, weight, bias), _group_norm_backward, saved=(xbuf, wbuf, bbuf, mean, rstd),
               N=N, C=C, S=S, G=G, act=act, xs=xs, cl=cl, shape=shape, dtype=dtype)
    return y


# ---- layer_norm / rms_norm ----------------------------------------------------------------------

def _normalized_shape(normalized_shape, x, op):
    if type(normalized_shape) is int and x.ndim and x.shape[-1] == normalized_shape:
        return (normalized_shape,)
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        ns = (int(normalized_shape),)
    else:
        try:
            ns = tuple(int(s) for s in normalized_shape)
        except TypeError:
            raise TypeError(f"{op}: normalized_shape must be an int or a sequence of ints, "
                            f"got {normalized_shape!r}") from None
    if not ns:
        raise ValueError(f"{op}: normalized_shape must name at least one dim")
    if len(ns) > x.ndim or tuple(x.shape[x.ndim - len(ns):]) != ns:
        raise ValueError(f"{op}: given normalized_shape={list(ns)}, expected input with shape [*, "
                         f"{', '.join(str(s) for s in ns)}], but got input of size {list(x.shape)}")
    return ns


def _rows(buf, D):
    """(buf, row stride) viewing ``buf`` as rows of D unit-stride elements; copies if needed."""
    if buf.is_contiguous():
        return buf, D
    M = buf.numel() // D if D else 0
    try:
        view = buf.view(M, D)
    except RuntimeError:
        view = _dense(buf).view(M, D)
    if D > 1 and view.stride(1) != 1:
        view = _dense(view)
    return view, view.stride(0)


def _layer_norm_backward(node, g):
    x2, w, mean, rstd = node.saved
    a = node.attrs
    M, D, rms = a["M"], a["D"], a["rms"]
    need = node.needs_input_grad
    need_x, need_w = need[0], need[1]
    need_b = len(need) > 2 and need[2]
    g2, gs = _rows(g._data, D)
    dx = Tensor(runtime.empty(a["shape"], a["dtype"])) if need_x else None
    dxv = dx._data if need_x else None
    dw = runtime.empty(a["wshape"], w.dtype) if need_w else None
    db = runtime.empty(a["wshape"], a["bdtype"]) if need_b else None
    K.layer_norm_bwd(dxv, dw, db, g2, x2, w, mean, rstd, M, D, rms, a["xs"], gs,
                     D if need_x else 0)
    grads = (dx, Tensor(dw) if need_w else None)
    if not rms:
        grads += (Tensor(db) if need_b else None,)
    return grads


def _norm_common(x, normalized_shape, weight, bias, eps, rms, op):
    _check_input(x, op)
    if not rms:  # PyTorch's CUDA autocast runs layer_norm in fp32 but keeps rms_norm in the input dtype
        x, weight, bias = _autocast.fp32(x, weight, bias)
    xd = x._data
    key = None
    if type(normalized_shape) in (int, tuple):  # hashable (a list: a call not kept)
        key = (rms, xd.shape, xd.stride(), xd.dtype, normalized_shape, eps, _layout(weight), _layout(bias))
    kept = _norm_signatures.get(key)
    if kept is None:
        kept = _norm_signature(key, x, normalized_shape, weight, bias, eps, rms, op)
    ns, M, D, xs, eps, dense_params = kept
    if xs is None:  # rows that need a copy
        x2, xs = _rows(xd, D)
    else:
        x2 = xd
    dtype = xd.dtype
    y = runtime.empty(xd.shape, dtype)
    if dense_params:
        wbuf = None if weight is None else weight._data
        bbuf = None if bias is None else bias._data
    else:
        wbuf, bbuf = _flat(weight), _flat(bias)
    if D == 0:
        mean, rstd = None, runtime.empty((M,), torch.float32)
    else:
        mean, rstd = K.layer_norm_fwd(y, x2, wbuf, bbuf, M, D, eps, rms, xs, D)
    y = Tensor(y)
    inputs = (x, weight) if rms else (x, weight, bias)
    if needs_grad(*inputs):
        record(y, inputs, _layer_norm_backward, saved=(x2, wbuf, mean, rstd),
               M=M, D=D, rms=rms, xs=xs, shape=xd.shape, dtype=dtype, wshape=ns,
               bdtype=bias.dtype if bias is not None else dtype)
    return y


def _layout(p):
    """A parameter's part of a norm's call signature: None, its buffer's shape, strides, dtype and device,
    or False for what is no Tensor (never kept: its check raises)."""
    if p is None:
        return None
    if not isinstance(p, Tensor):
        return False
    buf = p._data
    return buf.shape, buf.stride(), buf.dtype, buf.device


def _norm_signature(key, x, normalized_shape, weight, bias, eps, rms, op):
    """What ``_norm_common`` takes from its call signature ``key`` (None: one not kept), after checking
    it: ``(normalized shape, M rows, D elements a row, row stride or None where the rows need a copy,
    eps as a float, whether the parameters are dense)``, kept in ``_norm_signatures``."""
    ns = _normalized_shape(normalized_shape, x, op)
    _check_param(weight, "weight", ns, x, op)
    _check_param(bias, "bias", ns, x, op)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    eps = _check_eps(eps, op)
    D = math.prod(ns)
    xd = x._data
    M = xd.numel() // D if D else 0
    xs = D if xd.is_contiguous() else None
    kept = ns, M, D, xs, eps, all(p is None or p._data.is_contiguous() for p in (weight, bias))
    if key is not None:
        if len(_norm_signatures) >= _MAX_SIGNATURES:
            _norm_signatures.clear()
        _norm_signatures[key] = kept
    return kept


_norm_signatures: dict = {}  # _norm_common's call signatures -> _norm_signature's answer
_MAX_SIGNATURES = 4096


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing ``normalized_shape`` dims (biased variance, as PyTorch)."""
    return _norm_common(x, normalized_shape, weight, bias, eps, False, "layer_norm")


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """RMSNorm over the trailing ``normalized_shape`` dims: x / sqrt(mean(x^2) + eps) * weight;
    ``eps=None`` uses the input dtype's machine epsilon, as ``torch.nn.functional.rms_norm``."""
    return _norm_common(x, normalized_shape, weight, None, eps, True, "rms_norm")


# ---- layer_norm_modulated -----------------------------------------------------------------------

# y = xhat * (1 + scale[b]) + shift[b], xhat = (x - mean) * rstd over each row of C:
#   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) with dxhat = dy * (1 + scale[b]),
#   dshift[b] = sum_l dy, dscale[b] = sum_l dy * xhat (fp32 partials, reduced in a fixed order);
# both come from one (B, 2, C) buffer (kernels/norms.py: layer_norm_modulated_bwd).
def _layer_norm_modulated_backward(node, g):
    x, scale, mean, rstd = node.saved
    need_x, need_shift, need_scale = node.needs_input_grad
    gb = g._data if g._data.stride(-1) == 1 else _dense(g._data)
    dx = runtime.empty(tuple(x.shape), x.dtype) if need_x else None
    dmod = runtime.empty((x.shape[0], 2, x.shape[2]), node.attrs["mod_dtype"]) if need_shift or need_scale else None
    K.layer_norm_modulated_bwd(dx, dmod, gb, x, scale, mean, rstd)
    return (Tensor(dx) if need_x else None, Tensor(dmod[:, 0]) if need_shift else None,
            Tensor(dmod[:, 1]) if need_scale else None)


def layer_norm_modulated(x, shift, scale, eps=1e-6):
    """``LayerNorm(x) * (1 + scale[:, None, :]) + shift[:, None, :]`` without affine parameters
    (AdaLayerNormZero's and AdaLayerNormContinuous's normalisation): ``x`` (B, L, C) with any
    batch and row strides and a contiguous last dim, ``shift`` and ``scale`` (B, C) with any
    strides (columns of a modulation output, read in place), C up to 8192. Statistics in fp32,
    output dense (B, L, C) in x's dtype; one launch forward, backward one plus one reduction for
    the modulation's gradients."""
    op = "layer_norm_modulated"
    _check_input(x, op)
    if x.ndim != 3:
        raise ValueError(f"{op}: expected an input of shape (B, L, C), got shape {x.shape}")
    B, L, C = x.shape
    if C > 1 and x.stride(2) != 1:
        raise ValueError(f"{op}: the last dim of the input must be contiguous (stride 1), got strides {x.stride()}")
    if C > K.MAX_MODULATED_C:
        raise ValueError(f"{op}: rows of up to {K.MAX_MODULATED_C} channels are supported, got C = {C}")
    for name, t in (("shift", shift), ("scale", scale)):
        check_tensor(t, name, op)
        if tuple(t.shape) != (B, C):
            raise ValueError(f"{op}: expected {name} of shape (B, C) = ({B}, {C}) for input of shape {x.shape}, "
                             f"got {name} of shape {t.shape}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{op}: {name} must be floating point, got dtype {t.dtype}")
        if t.device != x.device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but the input is on {x.device}")
    if shift.dtype != scale.dtype:
        raise TypeError(f"{op}: shift and scale must have one dtype, got {shift.dtype} and {scale.dtype}")
    eps = _check_eps(eps, op)
    y = Tensor(runtime.empty((B, L, C), x.dtype))
    mean, rstd = K.layer_norm_modulated_fwd(y._data, x._data, shift._data, scale._data, eps)
    if needs_grad(x, shift, scale):
        record(y, (x, shift, scale), _layer_norm_modulated_backward, saved=(x._data, scale._data, mean, rstd),
               mod_dtype=shift.dtype)
    return y
