"""``softmax``, ``log_softmax`` and ``cross_entropy`` (fused: no probabilities materialised in the
forward) with PyTorch's names and argument order, forward beside backward, over any dim of a tensor
with any strides (viewed as (outer, R, inner) around the dim); the kernels are
``kernels/softmax.py``'s."""
from __future__ import annotations

import itertools
import math
import numbers

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import softmax as K
from ..tensor import Tensor
from . import _autocast
from ._util import check_float_input, check_reduction, check_tensor, dense, normalize_dim
from .elementwise import to


def _collapse(shape, strides):
    """(size, stride) of dims collapsed into one, or None when their strides do not allow it."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    if not dims:
        return math.prod(shape), 0
    for (_, a), (sb, b) in itertools.pairwise(dims):
        if a != b * sb:
            return None
    return math.prod(shape), dims[-1][1]


def _ori(buf, dim):
    """View ``buf`` as (outer, R, inner) around ``dim``: (buf, outer, R, inner, strides), copying
    to a dense buffer when the dims before or after ``dim`` do not collapse."""
    if buf.dim() == 0:
        return buf, 1, 1, 1, (0, 0, 0)
    shape, strides = buf.shape, buf.stride()
    before = _collapse(shape[:dim], strides[:dim])
    after = _collapse(shape[dim + 1:], strides[dim + 1:])
    if before is None or after is None:
        buf = dense(buf)
        return _ori(buf, dim)
    return buf, before[0], shape[dim], after[0], (before[1], strides[dim], after[1])


def _dense_ori(shape, dim):
    """(outer, R, inner) strides of a contiguous tensor of ``shape``."""
    if not shape:
        return (0, 0, 0)
    inner = math.prod(shape[dim + 1:])
    return (shape[dim] * inner, inner, 1)


def _softmax_backward(node, g):
    y = node.saved[0]
    a = node.attrs
    dim = a["dim"]
    gbuf, _, _, _, gs = _ori(g._data, dim)
    dx = Tensor(runtime.empty(a["shape"], a["dtype"]))
    K.softmax_bwd(dx._data, y, gbuf, a["outer"], a["R"], a["inner"], a["ys"], gs, _dense_ori(a["shape"], dim),
                  a["log"])
    return dx


def _softmax(x, dim, dtype, log, op):
    check_tensor(x, "input", op)
    x = x if dtype is not None else _autocast.fp32(x)[0]
    if dim is None:
        raise TypeError(f"{op}: dim must be given (implicit dim choice is deprecated in PyTorch)")
    if dtype is not None:
        x = to(x, dtype)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point input, got dtype {x.dtype}")
    dim = normalize_dim(dim, x.ndim, op)
    xbuf, outer, R, inner, xs = _ori(x._data, dim)
    y = Tensor(runtime.empty(x.shape, x.dtype))
    ys = _dense_ori(x.shape, dim)
    K.softmax_fwd(y._data, xbuf, outer, R, inner, xs, ys, log)
    if needs_grad(x):
        record(y, (x,), _softmax_backward, saved=(y._data,), dim=dim, outer=outer, R=R, inner=inner, ys=ys,
               shape=x.shape, dtype=x.dtype, log=log)
    return y


def softmax(x, dim=None, dtype=None):
    """exp(x) / sum(exp(x)) along ``dim`` (max-subtracted: stable for large logits)."""
    return _softmax(x, dim, dtype, False, "softmax")


def log_softmax(x, dim=None, dtype=None):
    """x - logsumexp(x) along ``dim``."""
    return _softmax(x, dim, dtype, True, "log_softmax")


# ---- cross_entropy ------------------------------------------------------------------------------

def _cross_entropy_backward(node, g):
    xbuf, t, lse, count = node.saved
    a = node.attrs
    reduction = a["reduction"]
    gbuf = g._data
    if reduction == "none" and not gbuf.is_contiguous():
        gbuf = dense(gbuf)
    dx = Tensor(runtime.empty(a["shape"], a["dtype"]))
    K.cross_entropy_bwd(dx._data, xbuf, t, lse, gbuf, count, a["outer"], a["C"], a["inner"], a["xs"],
                        _dense_ori(a["shape"], 1 if len(a["shape"]) > 1 else 0), reduction, a["ignore_index"],
                        a["smoothing"])
    return dx, None


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",  # noqa: A002
                  label_smoothing=0.0):
    """Cross-entropy between ``input`` logits (C,), (N, C) or (N, C, d1, ...) and integer class
    ``target`` () / (N,) / (N, d1, ...), with ``ignore_index`` and ``label_smoothing`` as
    PyTorch. A target outside [0, C) other than ``ignore_index`` raises IndexError, as PyTorch
    does, but at the next host read (``loss.item()``, ``flame.check_errors()``): the kernel flags it,
    so no call syncs with the device."""
    op = "cross_entropy"
    check_float_input(input, "input", op)
    check_tensor(target, "target", op)
    (input,) = _autocast.fp32(input)  # noqa: A001
    check_reduction(reduction, op)
    if weight is not None:
        raise NotImplementedError(f"{op}: per-class weight is not supported; use reduction='none' and weight "
                                  "the per-sample losses")
    if target.dtype.is_floating_point:
        raise TypeError(f"{op}: only class-index targets are supported (int64/int32), got dtype {target.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: target must be int64 or int32 class indices, got dtype {target.dtype}")
    if input.ndim == 0:
        raise ValueError(f"{op}: input must have a class dim, got a 0-d tensor")
    want = () if input.ndim == 1 else (input.shape[0],) + tuple(input.shape[2:])
    if tuple(target.shape) != want:
        raise ValueError(f"{op}: expected target of shape {want} for input of shape {input.shape}, "
                         f"got target of shape {target.shape}")
    if (not isinstance(label_smoothing, numbers.Real) or isinstance(label_smoothing, bool)
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    cdim = 1 if input.ndim > 1 else 0
    xbuf, outer, C, inner, xs = _ori(input._data, cdim)
    if C == 0 and outer * inner:
        raise ValueError(f"{op}: input of shape {input.shape} has no classes")
    tbuf = target._data if target._data.is_contiguous() else dense(target._data)
    loss, lse, count = K.cross_entropy_fwd(xbuf, tbuf, outer, C, inner, xs, reduction, int(ignore_index),
                                           float(label_smoothing), input.dtype)
    out = Tensor(loss.view(tuple(target.shape)) if reduction == "none" else loss)
    if needs_grad(input):
        record(out, (input, None), _cross_entropy_backward, saved=(xbuf, tbuf, lse, count), outer=outer, C=C,
               inner=inner, xs=xs, shape=input.shape, dtype=input.dtype, reduction=reduction,
               ignore_index=int(ignore_index), smoothing=float(label_smoothing))
    return out
