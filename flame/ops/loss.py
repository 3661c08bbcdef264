"""Regression losses with PyTorch's names and argument order: ``mse_loss``, ``l1_loss``,
``smooth_l1_loss`` and ``huber_loss`` (``cross_entropy`` is the softmax family's:
``ops/softmax.py``); each forward sits beside its backward rule.

The regression losses take ``reduction`` ('none' | 'mean' | 'sum'); mse, l1 and huber take an
optional ``weight`` broadcastable to the input (PyTorch requires the input's shape), with
PyTorch's semantics: for 'mean', mse and l1 give sum(w l) / sum(w) and huber gives mean(w l).
Per-sample weighting such as min-SNR is a (B, 1, ...) weight with huber's or 'sum' reduction,
or ``reduction='none'`` reduced per sample.
"""
from __future__ import annotations

import math
import numbers

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import loss as K
from ..tensor import Tensor, broadcast_shapes, promote_types
from . import _autocast
from ._util import check_float_input, check_reduction, dense
from .reduce import sum_to_shape

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
        gbuf = dense(gbuf)
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
    check_float_input(x, "input", op)
    check_float_input(y, "target", op)
    check_reduction(reduction, op)
    x, y, weight = _autocast.fp32(x, y, weight)
    if x.shape != y.shape:
        raise ValueError(f"{op}: input and target must have the same shape, got {x.shape} and {y.shape}")
    if x.device != y.device:
        raise RuntimeError(f"{op}: input is on {x.device} but target is on {y.device}")
    out_dtype = promote_types(x.dtype, y.dtype)
    wbuf, w_div, w_mod = None, 1, 1
    if weight is not None:
        check_float_input(weight, "weight", op)
        try:
            shape = broadcast_shapes(weight.shape, x.shape)
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(f"{op}: weight of shape {weight.shape} does not broadcast to the input's shape {x.shape}")
        out_dtype = promote_types(out_dtype, weight.dtype)
        idx = _weight_index(weight.shape, x.shape)
        if idx is None:
            wbuf = dense(weight._data.expand(x.shape))
            w_div, w_mod = 1, max(1, x.numel())
        else:
            w_div, w_mod = idx
            wbuf = weight._data if weight._data.is_contiguous() else dense(weight._data)
    xbuf = x._data if x._data.is_contiguous() else dense(x._data)
    ybuf = y._data if y._data.is_contiguous() else dense(y._data)
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
