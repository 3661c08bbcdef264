"""Elementwise regression losses: mse, l1, smooth-l1 and huber (ops/loss.py's), with an optional
weight broadcast by index arithmetic (``(i // w_div) % w_mod``), reduced to a scalar in two stages
(per-program partial sums, then ``reduce.sum_partials_`` in a fixed order: bitwise repeatable).
Inputs are flat and contiguous (the op layer makes them so); fp32 arithmetic, fp64 for fp64 inputs.
Unused operands are passed as None (their constexpr switch drops them).
"""
import math

import torch
import triton
import triton.language as tl

from .. import runtime
from .elementwise import _pow2, cdiv
from .launch import launch
from .reduce import sum_partials_

NONE, MEAN, SUM = (tl.constexpr(i) for i in range(3))
MSE, L1, SMOOTH_L1, HUBER = (tl.constexpr(i) for i in range(4))
_REDUCTIONS = {"none": NONE.value, "mean": MEAN.value, "sum": SUM.value}
_KINDS = {"mse": MSE.value, "l1": L1.value, "smooth_l1": SMOOTH_L1.value, "huber": HUBER.value}


@triton.jit
def _pointwise_loss(d, beta, KIND: tl.constexpr):
    # d = x - y.  mse: d^2;  l1: |d|;
    # smooth_l1(beta): 0.5 d^2 / beta if |d| < beta else |d| - 0.5 beta;
    # huber(delta = beta): 0.5 d^2 if |d| < delta else delta (|d| - 0.5 delta)
    ad = tl.abs(d)
    if KIND == MSE:
        return d * d
    elif KIND == L1:
        return ad
    elif KIND == SMOOTH_L1:
        return tl.where(ad < beta, 0.5 * d * d / beta, ad - 0.5 * beta)
    else:
        return tl.where(ad < beta, 0.5 * d * d, beta * (ad - 0.5 * beta))


@triton.jit
def _pointwise_grad(d, beta, KIND: tl.constexpr):
    # d loss / d x:  mse: 2 d;  l1: sign(d);  smooth_l1: d / beta inside, sign(d) outside;
    # huber: d inside, delta sign(d) outside  (d loss / d y is the negative)
    sgn = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    if KIND == MSE:
        return 2.0 * d
    elif KIND == L1:
        return sgn
    elif KIND == SMOOTH_L1:
        return tl.where(tl.abs(d) < beta, d / beta, sgn)
    else:
        return tl.where(tl.abs(d) < beta, d, beta * sgn)


@triton.jit(do_not_specialize=["beta"])
def _loss_fwd_kernel(x_ptr, y_ptr, w_ptr, out_ptr, psum_ptr, pcnt_ptr, n, per_prog, w_div, w_mod, beta,
                     KIND: tl.constexpr, HAS_W: tl.constexpr, WSUM: tl.constexpr, REDUCE: tl.constexpr,
                     CD: tl.constexpr, BLOCK: tl.constexpr):
    # l = w * loss(x - y) per element (w broadcast: index (i // w_div) % w_mod); reduction none
    # stores l, otherwise each program stores the sum of its per_prog elements (and with WSUM the
    # sum of their weights, for PyTorch's mse/l1 weighted mean = sum(w l) / sum(w)).
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * per_prog
    hi = tl.minimum(lo + per_prog, n)
    acc = tl.zeros((BLOCK,), CD)
    wacc = tl.zeros((BLOCK,), CD)
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < hi
        x = tl.load(x_ptr + i, mask=m, other=0.0).to(CD)
        y = tl.load(y_ptr + i, mask=m, other=0.0).to(CD)
        l = _pointwise_loss(x - y, beta, KIND)
        if HAS_W:
            w = tl.load(w_ptr + (i // w_div) % w_mod, mask=m, other=0.0).to(CD)
            l = l * w
            wacc += w
        if REDUCE == NONE:
            tl.store(out_ptr + i, l.to(out_ptr.dtype.element_ty), mask=m)
        else:
            acc += tl.where(m, l, 0.0)
    if REDUCE != NONE:
        tl.store(psum_ptr + pid, tl.sum(acc, axis=0))
        if WSUM:
            tl.store(pcnt_ptr + pid, tl.sum(wacc, axis=0))


# Backward of L = reduce(w * loss(x - y)) with upstream g: per element for 'none'; for 'sum' g;
# for 'mean' g / n, or g / sum(w) for a weight-normalised mean (L = sum(w l) / sum(w)):
#   dx = g w loss'(x - y),  dy = -dx
#   dw_elem = g loss(x - y)  (none, sum, unweighted mean: g already scaled),
#   weighted mean: dw_elem = g (loss(x - y) - L) / sum(w)   (summed to w's shape afterwards)
@triton.jit(do_not_specialize=["beta", "scale"])
def _loss_bwd_kernel(x_ptr, y_ptr, w_ptr, g_ptr, cnt_ptr, out_ptr, dx_ptr, dy_ptr, dw_ptr, n, w_div, w_mod,
                     beta, scale,
                     KIND: tl.constexpr, HAS_W: tl.constexpr, G_FULL: tl.constexpr, W_MEAN: tl.constexpr,
                     NEED_X: tl.constexpr, NEED_Y: tl.constexpr, NEED_W: tl.constexpr, CD: tl.constexpr,
                     BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(CD)
    y = tl.load(y_ptr + i, mask=m, other=0.0).to(CD)
    if G_FULL:
        g = tl.load(g_ptr + i, mask=m, other=0.0).to(CD)
    else:
        g0 = tl.load(g_ptr).to(CD) * scale
        if W_MEAN:
            g0 = g0 / tl.load(cnt_ptr).to(CD)
        g = tl.zeros((BLOCK,), CD) + g0
    d = x - y
    if NEED_W:
        l = _pointwise_loss(d, beta, KIND)
        if W_MEAN:
            l = l - tl.load(out_ptr).to(CD)
        tl.store(dw_ptr + i, (g * l).to(dw_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        g = g * tl.load(w_ptr + (i // w_div) % w_mod, mask=m, other=0.0).to(CD)
    dx = g * _pointwise_grad(d, beta, KIND)
    if NEED_X:
        tl.store(dx_ptr + i, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if NEED_Y:
        tl.store(dy_ptr + i, (-dx).to(dy_ptr.dtype.element_ty), mask=m)


def _cd(*dtypes):
    return tl.float64 if torch.float64 in dtypes else tl.float32


def _config(n):
    """(BLOCK, num_warps) of a flat loss kernel over n elements."""
    block = _pow2(min(max(n, 1), 1 << 16)) if runtime.INTERPRETER else 2048
    return block, 4 if block <= 2048 else (8 if block <= 8192 else 16)


def loss_fwd(x, y, w, w_div, w_mod, kind, beta, reduction, out_dtype, weight_norm=True):
    """x, y contiguous with n elements; w (or None) indexed by (i // w_div) % w_mod. Returns
    (loss, wsum): the per-element loss (reduction 'none', flat) or a 0-d tensor, and for a
    weighted mean normalised by the weights (``weight_norm``: sum(w l) / sum(w), PyTorch's
    mse/l1) the 0-d sum of the (broadcast) weights, else None (a weighted mean is then
    sum(w l) / n, PyTorch's huber)."""
    n = x.numel()
    kind, red = _KINDS[kind], _REDUCTIONS[reduction]
    cd = _cd(x.dtype, y.dtype)
    acc = torch.float64 if cd == tl.float64 else torch.float32
    block, warps = _config(n)
    if red == NONE.value:
        out = runtime.empty((n,), out_dtype)
        if n:
            launch(_loss_fwd_kernel, (cdiv(n, block),), x, y, w, out, None, None, n, block, w_div, w_mod,
                   float(beta), KIND=kind, HAS_W=w is not None, WSUM=False, REDUCE=red, CD=cd, BLOCK=block,
                   num_warps=warps)
        return out, None
    target = 1 if runtime.INTERPRETER else 8 * runtime.num_sms()
    per_prog = max(block, cdiv(cdiv(max(n, 1), target), block) * block)
    P = cdiv(n, per_prog)
    psum = runtime.empty((max(P, 1),), acc)
    norm = w is not None and weight_norm and red == MEAN.value
    pcnt = runtime.empty((max(P, 1),), acc) if norm else None
    out = runtime.empty((), out_dtype)
    if n:
        launch(_loss_fwd_kernel, (P,), x, y, w, None, psum, pcnt, n, per_prog, w_div, w_mod,
               float(beta), KIND=kind, HAS_W=w is not None, WSUM=norm, REDUCE=red, CD=cd, BLOCK=block,
               num_warps=warps)
    if norm:
        wsum = runtime.empty((), acc)
        sum_partials_(out, psum, P, 1.0, pcnt, wsum)
        return out, wsum
    sum_partials_(out, psum, P, 1.0 if red == SUM.value else (1.0 / n if n else math.nan))
    return out, None


def loss_bwd(dx, dy, dw_full, x, y, w, w_div, w_mod, g, wsum, out, kind, beta, reduction):
    """Gradients of loss_fwd: any of dx, dy, dw_full (n elements, before summing to w's shape)
    may be None; ``wsum`` is not None exactly for a weight-normalised mean (see loss_fwd), ``out``
    is the forward's loss (read for the weights' gradient of such a mean)."""
    n = x.numel()
    if n == 0:
        return
    w_mean = wsum is not None
    scale = 1.0 / n if reduction == "mean" and not w_mean else 1.0
    block, warps = _config(n)
    need_w = dw_full is not None
    launch(_loss_bwd_kernel, (cdiv(n, block),), x, y, w, g, wsum, out if need_w and w_mean else None,
           dx, dy, dw_full, n, w_div, w_mod, float(beta), float(scale),
           KIND=_KINDS[kind], HAS_W=w is not None, G_FULL=reduction == "none", W_MEAN=w_mean, NEED_X=dx is not None,
           NEED_Y=dy is not None, NEED_W=need_w, CD=_cd(x.dtype, y.dtype), BLOCK=block, num_warps=warps)
