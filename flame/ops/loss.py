"""Losses with PyTorch's names and argument order: ``cross_entropy`` (fused: no probabilities
materialised in the forward; the softmax kernels, over ``ops/softmax.py``'s (outer, R, inner)
views), ``mse_loss``, ``l1_loss``, ``smooth_l1_loss`` and ``huber_loss``; each forward sits beside
its backward rule.

The regression losses take ``reduction`` ('none' | 'mean' | 'sum'); mse, l1 and huber take an
optional ``weight`` broadcastable to the input (PyTorch requires the input's shape), with
PyTorch's semantics: for 'mean', mse and l1 give sum(w l) / sum(w) and huber gives mean(w l).
Per-sample weighting such as min-SNR is a (B, 1, ...) weight with huber's or 'sum' reduction,
or ``reduction='none'`` reduced per sample.
"""
from __future__ import annotations

import math
import numbers

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import softmax as K
from ..tensor import Tensor, broadcast_shapes, promote_types
from . import _autocast
from ._util import check_tensor
from .reduce import sum_to_shape
from .softmax import _dense, _dense_ori, _ori

_REDUCTIONS = ("none", "mean", "sum")


def _check_float_input(x, name, op):
    check_tensor(x, name, op)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point {name}, got dtype {x.dtype}")


def _check_reduction(reduction, op):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


# ---- cross_entropy ------------------------------------------------------------------------------

def _cross_entropy_backward(node, g):
    xbuf, t, lse, count = node.saved
    a = node.attrs
    reduction = a["reduction"]
    gbuf = g._data
    if reduction == "none" and not gbuf.is_contiguous():
        gbuf = _dense(gbuf)
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
    _check_float_input(input, "input", op)
    check_tensor(target, "target", op)
    (input,) = _autocast.fp32(input)  # noqa: A001
    _check_reduction(reduction, op)
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
    tbuf = target._data if target._data.is_contiguous() else _dense(target._data)
    loss, lse, count = K.cross_entropy_fwd(xbuf, tbuf, outer, C, inner, xs, reduction, int(ignore_index),
                                           float(label_smoothing), input.dtype)
    out = Tensor(loss.view(tuple(target.shape)) if reduction == "none" else loss)
    if needs_grad(input):
        record(out, (input, None), _cross_entropy_backward, saved=(xbuf, tbuf, lse, count), outer=outer, C=C,
               inner=inner, xs=xs, shape=input.shape, dtype=input.dtype, reduction=reduction,
               ignore_index=int(ignore_index), smoothing=float(label_smoothing))
    return out


# ---- regression losses --------------------------------------------------------------------------

def _weight_index(wshape, shape):
    """(w_div, w_mod) with weight[(i // w_div) % w_mod] = expanded weight at flat index i, or None
    when the weight's varying dims are not one run (then the expanded weight is materialised)."""
    wshape = (1,) * (len(shape) - len(wshape)) + tuple(wshape)
    vary = [d for d in range(len(shape)) if wshape[d] != 1]
    if not vary:
        return max(1, math.prod(shape)), 1
    lo, hi = vary[0], vary[-1]
    if any(wshape[d] != shape[d] for d in range(lo, hi + 1)):
        return None
    return math.prod(shape[hi + 1:]), math.prod(shape[lo:hi + 1])


def _loss_backward(node, g):
    x, y, w, wsum, out = node.saved
    a = node.attrs
    need_x, need_y, need_w = node.needs_input_grad
    gbuf = g._data
    if a["reduction"] == "none" and not gbuf.is_contiguous():
        gbuf = _dense(gbuf)
    dx = Tensor(runtime.empty(a["shape"], a["xdtype"])) if need_x else None
    dy = Tensor(runtime.empty(a["shape"], a["ydtype"])) if need_y else None
    dwf = Tensor(runtime.empty(a["shape"], a["wdtype"])) if need_w else None
    K.loss_bwd(dx._data if need_x else None, dy._data if need_y else None, dwf._data if need_w else None,
               x, y, w, a["w_div"], a["w_mod"], gbuf, wsum, out, a["kind"], a["beta"], a["reduction"])
    dw = None
    if need_w:
        dw = sum_to_shape(dwf, a["wshape"])
    return dx, dy, dw


def _pointwise_loss(kind, x, y, reduction, beta, weight, op, weight_norm=True):
    _check_float_input(x, "input", op)
    _check_float_input(y, "target", op)
    _check_reduction(reduction, op)
    x, y, weight = _autocast.fp32(x, y, weight)
    if x.shape != y.shape:
        raise ValueError(f"{op}: input and target must have the same shape, got {x.shape} and {y.shape}")
    if x.device != y.device:
        raise RuntimeError(f"{op}: input is on {x.device} but target is on {y.device}")
    out_dtype = promote_types(x.dtype, y.dtype)
    wbuf, w_div, w_mod = None, 1, 1
    if weight is not None:
        _check_float_input(weight, "weight", op)
        try:
            shape = broadcast_shapes(weight.shape, x.shape)
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(f"{op}: weight of shape {weight.shape} does not broadcast to the input's shape {x.shape}")
        out_dtype = promote_types(out_dtype, weight.dtype)
        idx = _weight_index(weight.shape, x.shape)
        if idx is None:
            wbuf = _dense(weight._data.expand(x.shape))
            w_div, w_mod = 1, max(1, x.numel())
        else:
            w_div, w_mod = idx
            wbuf = weight._data if weight._data.is_contiguous() else _dense(weight._data)
    xbuf = x._data if x._data.is_contiguous() else _dense(x._data)
    ybuf = y._data if y._data.is_contiguous() else _dense(y._data)
    loss, wsum = K.loss_fwd(xbuf, ybuf, wbuf, w_div, w_mod, kind, beta, reduction, out_dtype, weight_norm)
    out = Tensor(loss.view(x.shape) if reduction == "none" else loss)
    if needs_grad(x, y, weight):
        record(out, (x, y, weight), _loss_backward, saved=(xbuf, ybuf, wbuf, wsum, loss), kind=kind, beta=beta,
               reduction=reduction, w_div=w_div, w_mod=w_mod, shape=x.shape, xdtype=x.dtype, ydtype=y.dtype,
               wdtype=weight.dtype if weight is not None else None,
               wshape=weight.shape if weight is not None else None)
    return out


def _check_beta(beta, name, op, positive):
    if not isinstance(beta, numbers.Real) or isinstance(beta, bool) or beta < 0 or (positive and beta == 0):
        need = "positive" if positive else "non-negative"
        raise ValueError(f"{op}: {name} must be a {need} number, got {beta!r}")
    return float(beta)


def mse_loss(input, target, reduction="mean", weight=None):  # noqa: A002
    """Mean squared error (x - y)^2, reduced by ``reduction``; optional ``weight`` (see module doc)."""
    return _pointwise_loss("mse", input, target, reduction, 0.0, weight, "mse_loss")


def l1_loss(input, target, reduction="mean", weight=None):  # noqa: A002
    """Absolute error |x - y|, reduced by ``reduction``."""
    return _pointwise_loss("l1", input, target, reduction, 0.0, weight, "l1_loss")


def smooth_l1_loss(input, target, reduction="mean", beta=1.0):  # noqa: A002
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (d = x - y); beta == 0 is l1_loss."""
    beta = _check_beta(beta, "beta", "smooth_l1_loss", False)
    if beta == 0.0:
        return _pointwise_loss("l1", input, target, reduction, 0.0, None, "smooth_l1_loss")
    return _pointwise_loss("smooth_l1", input, target, reduction, beta, None, "smooth_l1_loss")


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):  # noqa: A002
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta) (d = x - y). With ``weight``,
    'mean' is mean(w * l) (PyTorch's huber_loss; min-SNR weighting with a (B, 1, ...) weight)."""
    delta = _check_beta(delta, "delta", "huber_loss", True)
    return _pointwise_loss("huber", input, target, reduction, delta, weight, "huber_loss", weight_norm=False)
