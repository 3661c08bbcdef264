"""Softmax, log-softmax and cross-entropy.

Softmax-like kernels view their input as (outer, R, inner) with any strides and reduce over R:
"row" r of the ROWS = outer * inner rows starts at (r // inner) * s_outer + (r % inner) * s_inner
and steps by s_r, so softmax over the last dim (inner == 1) and over any other dim (the class dim
of an (N, C, H, W) cross-entropy) share one kernel with no transpose. A program owns BLOCK_ROWS
rows; a row that fits one block is read once, a longer one is streamed twice with an online
(running max, rescaled sum) log-sum-exp. Statistics are fp32 (fp64 for fp64 inputs).

Cross-entropy never materialises probabilities in its forward: it stores the per-row loss (or a
per-program partial sum and valid count) and the row's log-sum-exp; the backward recomputes
softmax from the saved log-sum-exp. Reductions to a scalar are two-stage and deterministic. A
target outside [0, C) that is not ignore_index gives a NaN loss and sets a device error flag,
raised at the next host read (``runtime.check_errors``): no host sync per call.

Launch configs come from ``flame.tune`` (kernels "softmax_fwd", "softmax_bwd": key (ROWS, R),
fields BLOCK_ROWS, BLOCK_R, num_warps; "cross_entropy_fwd", "cross_entropy_bwd": key (ROWS, C),
fields BLOCK_ROWS, BLOCK_C, num_warps), a tuning table's entry on the GPU or the heuristics here;
memoised per shape and dtype (``tune.memoised``). A block longer than the
row's length rounded up to a power of two is cut to it; whether a softmax row is read whole
(SINGLE) follows from its block.
"""
import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from .elementwise import _pow2, cdiv
from .launch import launch
from .reduce import sum_partials_

NONE, MEAN, SUM = (tl.constexpr(i) for i in range(3))
_BAD_TARGET = runtime.device_error(IndexError, "cross_entropy: a target is outside [0, C) and is not ignore_index "
                                               "(that row's loss is NaN)")  # the forward kernel's error flag


@triton.jit
def _row_base(rows, INNER, s_o, s_i):
    r = rows.to(tl.int64)
    return (r // INNER) * s_o + (r % INNER) * s_i


@triton.jit
def _online_lse(x_ptr, xbase, rm, R, s_r, CD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                WANT_SUM: tl.constexpr):
    # Streamed log-sum-exp of each row: per-lane running max m and rescaled sum s,
    #   m' = max(m, x), s' = s * exp(m - m') + exp(x - m'); lanes merged at the end.
    # Returns (row max, row sum of exp(x - max), row sum of x (if WANT_SUM)).
    cols = tl.arange(0, BLOCK_R)
    m = tl.full((BLOCK_ROWS, BLOCK_R), float("-inf"), CD)
    s = tl.zeros((BLOCK_ROWS, BLOCK_R), CD)
    sx = tl.zeros((BLOCK_ROWS, BLOCK_R), CD)
    for r0 in range(0, R, BLOCK_R):
        cc = (r0 + cols).to(tl.int64)
        msk = rm[:, None] & (cc < R)[None, :]
        x = tl.load(x_ptr + xbase[:, None] + (cc * s_r)[None, :], mask=msk, other=float("-inf")).to(CD)
        m_new = tl.maximum(m, x)
        finite = m_new != float("-inf")
        alpha = tl.where(finite, tl.exp(m - m_new), 0.0)
        s = s * alpha + tl.where(finite, tl.exp(x - m_new), 0.0)
        m = m_new
        if WANT_SUM:
            sx += tl.where(msk, x, 0.0)
    mx = tl.max(m, axis=1)
    fin = mx != float("-inf")
    scale = tl.where(fin[:, None] & (m != float("-inf")), tl.exp(m - mx[:, None]), 0.0)
    tot = tl.sum(s * scale, axis=1)
    tot = tl.where(fin, tot, 0.0)
    return mx, tot, tl.sum(sx, axis=1)


@triton.jit
def _softmax_fwd_kernel(x_ptr, y_ptr, ROWS, R, INNER, xs_o, xs_r, xs_i, ys_o, ys_r, ys_i,
                        LOG: tl.constexpr, CD: tl.constexpr, SINGLE: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    # softmax: y = exp(x - max) / sum(exp(x - max));  log_softmax: y = x - max - log(sum(exp(x - max)))
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rm = rows < ROWS
    xbase = _row_base(rows, INNER, xs_o, xs_i)
    ybase = _row_base(rows, INNER, ys_o, ys_i)
    cols = tl.arange(0, BLOCK_R).to(tl.int64)
    if SINGLE:
        msk = rm[:, None] & (cols < R)[None, :]
        x = tl.load(x_ptr + xbase[:, None] + (cols * xs_r)[None, :], mask=msk, other=float("-inf")).to(CD)
        mx = tl.max(x, axis=1)
        e = tl.where(msk, tl.exp(x - mx[:, None]), 0.0)
        tot = tl.sum(e, axis=1)
        if LOG:
            y = x - mx[:, None] - tl.log(tot)[:, None]
        else:
            y = e / tot[:, None]
        tl.store(y_ptr + ybase[:, None] + (cols * ys_r)[None, :], y.to(y_ptr.dtype.element_ty), mask=msk)
    else:
        mx, tot, _ = _online_lse(x_ptr, xbase, rm, R, xs_r, CD, BLOCK_ROWS, BLOCK_R, False)
        lse = mx + tl.log(tot)
        for r0 in range(0, R, BLOCK_R):
            cc = r0 + cols
            msk = rm[:, None] & (cc < R)[None, :]
            x = tl.load(x_ptr + xbase[:, None] + (cc * xs_r)[None, :], mask=msk, other=0.0).to(CD)
            y = x - lse[:, None]
            if not LOG:
                y = tl.exp(y)
            tl.store(y_ptr + ybase[:, None] + (cc * ys_r)[None, :], y.to(y_ptr.dtype.element_ty), mask=msk)


# Backward, with y the saved output and g = dL/dy:
#   softmax:     dx = y * (g - sum_r(g * y))
#   log_softmax: dx = g - exp(y) * sum_r(g)
@triton.jit
def _softmax_bwd_kernel(y_ptr, g_ptr, dx_ptr, ROWS, R, INNER, ys_o, ys_r, ys_i, gs_o, gs_r, gs_i,
                        ds_o, ds_r, ds_i,
                        LOG: tl.constexpr, CD: tl.constexpr, SINGLE: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rm = rows < ROWS
    ybase = _row_base(rows, INNER, ys_o, ys_i)
    gbase = _row_base(rows, INNER, gs_o, gs_i)
    dbase = _row_base(rows, INNER, ds_o, ds_i)
    cols = tl.arange(0, BLOCK_R).to(tl.int64)
    if SINGLE:
        msk = rm[:, None] & (cols < R)[None, :]
        y = tl.load(y_ptr + ybase[:, None] + (cols * ys_r)[None, :], mask=msk, other=0.0).to(CD)
        g = tl.load(g_ptr + gbase[:, None] + (cols * gs_r)[None, :], mask=msk, other=0.0).to(CD)
        if LOG:
            dx = g - tl.exp(y) * tl.sum(g, axis=1)[:, None]
        else:
            dx = y * (g - tl.sum(g * y, axis=1)[:, None])
        tl.store(dx_ptr + dbase[:, None] + (cols * ds_r)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=msk)
    else:
        acc = tl.zeros((BLOCK_ROWS, BLOCK_R), CD)
        for r0 in range(0, R, BLOCK_R):
            cc = r0 + cols
            msk = rm[:, None] & (cc < R)[None, :]
            g = tl.load(g_ptr + gbase[:, None] + (cc * gs_r)[None, :], mask=msk, other=0.0).to(CD)
            if LOG:
                acc += g
            else:
                acc += g * tl.load(y_ptr + ybase[:, None] + (cc * ys_r)[None, :], mask=msk, other=0.0).to(CD)
        k = tl.sum(acc, axis=1)
        for r0 in range(0, R, BLOCK_R):
            cc = r0 + cols
            msk = rm[:, None] & (cc < R)[None, :]
            y = tl.load(y_ptr + ybase[:, None] + (cc * ys_r)[None, :], mask=msk, other=0.0).to(CD)
            g = tl.load(g_ptr + gbase[:, None] + (cc * gs_r)[None, :], mask=msk, other=0.0).to(CD)
            if LOG:
                dx = g - tl.exp(y) * k[:, None]
            else:
                dx = y * (g - k[:, None])
            tl.store(dx_ptr + dbase[:, None] + (cc * ds_r)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=msk)


# ---- cross-entropy ----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["ignore_index", "smoothing"])
def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, psum_ptr, pcnt_ptr, err_ptr, ROWS, C, INNER, xs_o, xs_c, xs_i,
                   ignore_index, smoothing,
                   REDUCE: tl.constexpr, SMOOTH: tl.constexpr, CD: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    # lse = log sum_c exp(x_c);  loss = lse - (1 - eps) x_t - (eps / C) sum_c x_c  (eps = smoothing)
    # Rows whose target is ignore_index give 0 and do not count; an out-of-range target gives NaN
    # and sets the error flag err_ptr (its x_t is not read: the index is clamped and masked).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rm = rows < ROWS
    xbase = _row_base(rows, INNER, xs_o, xs_i)
    mx, tot, sx = _online_lse(x_ptr, xbase, rm, C, xs_c, CD, BLOCK_ROWS, BLOCK_C, SMOOTH)
    lse = mx + tl.log(tot)
    t = tl.load(t_ptr + rows, mask=rm, other=0).to(tl.int64)
    valid = rm & (t != ignore_index)
    inside = (t >= 0) & (t < C)
    bad = tl.sum((valid & ~inside).to(tl.int32), axis=0)
    tl.store(err_ptr, 1, mask=bad > 0)
    xt = tl.load(x_ptr + xbase + tl.where(inside, t, 0) * xs_c, mask=valid & inside, other=0.0).to(CD)
    if SMOOTH:
        loss = lse - (1.0 - smoothing) * xt - (smoothing / C) * sx
    else:
        loss = lse - xt
    loss = tl.where(inside, loss, float("nan"))
    loss = tl.where(valid, loss, 0.0)
    tl.store(lse_ptr + rows, lse, mask=rm)
    if REDUCE == NONE:
        tl.store(loss_ptr + rows, loss.to(loss_ptr.dtype.element_ty), mask=rm)
    else:
        pid = tl.program_id(0)
        tl.store(psum_ptr + pid, tl.sum(loss, axis=0))
        tl.store(pcnt_ptr + pid, tl.sum(valid.to(CD), axis=0))


# Backward: p_c = exp(x_c - lse);  dx_c = g_row * (p_c - (1 - eps) [c == t] - eps / C) for valid rows,
# 0 for ignored ones; g_row = g[row] (reduction none), g (sum) or g / n_valid (mean).
@triton.jit(do_not_specialize=["ignore_index", "smoothing"])
def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, g_ptr, cnt_ptr, dx_ptr, ROWS, C, INNER, xs_o, xs_c, xs_i,
                   ds_o, ds_c, ds_i, ignore_index, smoothing,
                   REDUCE: tl.constexpr, CD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rm = rows < ROWS
    xbase = _row_base(rows, INNER, xs_o, xs_i)
    dbase = _row_base(rows, INNER, ds_o, ds_i)
    t = tl.load(t_ptr + rows, mask=rm, other=0).to(tl.int64)
    valid = rm & (t != ignore_index)
    lse = tl.load(lse_ptr + rows, mask=rm, other=0.0).to(CD)
    if REDUCE == NONE:
        g = tl.load(g_ptr + rows, mask=rm, other=0.0).to(CD)
    else:
        g0 = tl.load(g_ptr).to(CD)
        if REDUCE == MEAN:
            g0 = g0 / tl.load(cnt_ptr).to(CD)
        g = tl.zeros((BLOCK_ROWS,), CD) + g0
    g = tl.where(valid, g, 0.0)
    cols = tl.arange(0, BLOCK_C).to(tl.int64)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + cols
        msk = rm[:, None] & (cc < C)[None, :]
        x = tl.load(x_ptr + xbase[:, None] + (cc * xs_c)[None, :], mask=msk, other=0.0).to(CD)
        p = tl.exp(x - lse[:, None])
        hot = (cc[None, :] == t[:, None]).to(CD)
        d = p - (1.0 - smoothing) * hot - smoothing / C
        dx = tl.where(valid[:, None], g[:, None] * d, 0.0)
        tl.store(dx_ptr + dbase[:, None] + (cc * ds_c)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=msk)


# ---- launchers --------------------------------------------------------------------------------

def _cd(*dtypes):
    return tl.float64 if torch.float64 in dtypes else tl.float32


_SOFTMAX_TILE = 2048  # elements per program of whole rows (16-bit rows up to 16384, wider rows: streamed)


def _warps(n):
    return 4 if n <= 2048 else (8 if n <= 8192 else 16)


def _softmax_default(ROWS, R, itemsize):
    """softmax_fwd/bwd's heuristic config (BLOCK_ROWS, BLOCK_R, num_warps): whole rows (16-bit ones
    up to 16384, wider ones up to 8192), ~2048 elements per program; longer rows streamed one per
    program in 4096-wide blocks. The interpreter's: whole rows up to 16384, ~32768 per program."""
    if runtime.INTERPRETER:
        br = _pow2(min(R, 1 << 14))
        bm = _pow2(min(ROWS, max(1, (1 << 15) // br)))
    elif (16384 if itemsize <= 2 else 8192) >= R:
        br = _pow2(R)
        bm = max(1, min(_pow2(ROWS), _SOFTMAX_TILE // br))
    else:
        bm, br = 1, 4096
    return dict(BLOCK_ROWS=bm, BLOCK_R=br, num_warps=_warps(bm * br))


def _ce_default(ROWS, C):
    """cross_entropy_fwd/bwd's heuristic config (BLOCK_ROWS, BLOCK_C, num_warps): classes in blocks
    of up to 4096, ~2048 elements per program (the interpreter's: up to 16384, ~32768)."""
    if runtime.INTERPRETER:
        bc = _pow2(min(C, 1 << 14))
        bm = _pow2(min(ROWS, max(1, (1 << 15) // bc)))
    else:
        bc = min(_pow2(C), 4096)
        bm = max(1, min(_pow2(ROWS), _SOFTMAX_TILE // bc))
    return dict(BLOCK_ROWS=bm, BLOCK_C=bc, num_warps=_warps(bm * bc))


# The search space of softmax_fwd/bwd and cross_entropy_fwd/bwd: BLOCK_ROWS rows of BLOCK_R (or
# BLOCK_C) elements per program, blocks cut to the row's length rounded up to a power of two (a
# softmax row that fits one block is read whole, longer rows are streamed through such blocks), at
# most MAX_TILE elements divided by the kernel's TILE_SHARE (softmax's backward holds two tiles, y
# and g; cross-entropy's forward three running tiles), warps that give each thread 2 to 64 of them.
SPACE = dict(BLOCK_ROWS=(1, 2, 4, 8, 16, 32), BLOCK_R=(1024, 2048, 4096, 8192, 16384), num_warps=(1, 2, 4, 8, 16))
QUICK_SPACE = dict(BLOCK_ROWS=(2, 4), BLOCK_R=(32, 64), num_warps=(1,))
MAX_TILE = 16384
TILE_SHARE = dict(softmax_fwd=1, softmax_bwd=2, cross_entropy_fwd=4, cross_entropy_bwd=2)


def _stages(ctx, key, spec):
    """The candidate configs at key (ROWS, R or C) as stages: one, rows per program x block length x warps."""
    rows, r = key
    space = ctx.choices(spec)
    block = spec.fields[1]  # BLOCK_R or BLOCK_C
    row_counts = sorted({min(m, triton.next_power_of_2(rows)) for m in space["BLOCK_ROWS"]})
    lengths = sorted({min(b, triton.next_power_of_2(r)) for b in space["BLOCK_R"]})
    cap = MAX_TILE // TILE_SHARE[spec.name]
    configs = [{"BLOCK_ROWS": m, block: b, "num_warps": w} for m in row_counts for b in lengths
               for w in space["num_warps"] if m * b <= cap and autotune.per_thread_ok(m * b, w)]
    return [lambda best: configs]


def _spec(name, key, block, heuristic, doc):
    return tune.register(tune.Spec(name, ("ROWS", key), ("BLOCK_ROWS", block, "num_warps"), heuristic, _stages,
                                   SPACE, QUICK_SPACE, doc=doc))


# softmax and log_softmax over ROWS rows of R, forward and backward; a row that fits one BLOCK_R block
# is read whole, a longer one streamed through such blocks (SINGLE derived); cross-entropy over ROWS
# rows of C classes, streamed in BLOCK_C blocks
SOFTMAX_FWD, SOFTMAX_BWD = (
    _spec(name, "R", "BLOCK_R", lambda key, dtype: _softmax_default(*key, dtype.itemsize), f"softmax, log_softmax {d}")
    for name, d in (("softmax_fwd", "forward"), ("softmax_bwd", "backward")))
CE_FWD, CE_BWD = (_spec(name, "C", "BLOCK_C", lambda key, dtype: _ce_default(*key), f"cross-entropy {d}")
                  for name, d in (("cross_entropy_fwd", "forward"), ("cross_entropy_bwd", "backward")))


@tune.memoised
def _softmax_plan(ROWS, R, dtype, bwd):
    """(programs, launch meta) of softmax_fwd/bwd over ROWS rows of R, memoised: BLOCK_ROWS rows per
    program, BLOCK_R and the warps from ``flame.tune`` (kernel "softmax_fwd"/"softmax_bwd", key
    (ROWS, R)); BLOCK_R is cut to R rounded up to a power of two, and a row that fits one block is
    read whole (SINGLE), a longer one streamed through blocks of BLOCK_R."""
    cfg = (SOFTMAX_BWD if bwd else SOFTMAX_FWD).config((ROWS, R), dtype)
    br = min(cfg["BLOCK_R"], _pow2(R))
    return cdiv(ROWS, cfg["BLOCK_ROWS"]), dict(SINGLE=br >= R, BLOCK_ROWS=cfg["BLOCK_ROWS"], BLOCK_R=br,
                                               num_warps=cfg["num_warps"])


@tune.memoised
def _ce_plan(ROWS, C, dtype, bwd):
    """(programs, launch meta) of cross_entropy_fwd/bwd over ROWS rows of C classes, memoised:
    BLOCK_ROWS, BLOCK_C (cut to C rounded up to a power of two; the classes are always looped
    over) and the warps from ``flame.tune`` (kernel "cross_entropy_fwd"/"cross_entropy_bwd", key
    (ROWS, C))."""
    cfg = (CE_BWD if bwd else CE_FWD).config((ROWS, C), dtype)
    return cdiv(ROWS, cfg["BLOCK_ROWS"]), dict(BLOCK_ROWS=cfg["BLOCK_ROWS"], BLOCK_C=min(cfg["BLOCK_C"], _pow2(C)),
                                               num_warps=cfg["num_warps"])


@tunable("y")
def softmax_fwd(y, x, outer, R, inner, xs, ys, log):
    rows = outer * inner
    if rows * R == 0:
        return y
    programs, meta = _softmax_plan(rows, R, x.dtype, False)
    launch(_softmax_fwd_kernel, (programs,), x, y, rows, R, inner, *xs, *ys, LOG=log, CD=_cd(x.dtype), **meta)
    return y


@tunable("dx")
def softmax_bwd(dx, y, g, outer, R, inner, ys, gs, ds, log):
    rows = outer * inner
    if rows * R == 0:
        return dx
    programs, meta = _softmax_plan(rows, R, y.dtype, True)
    launch(_softmax_bwd_kernel, (programs,), y, g, dx, rows, R, inner, *ys, *gs, *ds, LOG=log, CD=_cd(y.dtype),
           **meta)
    return dx


@tunable()
def cross_entropy_fwd(x, t, outer, C, inner, xs, reduction, ignore_index, smoothing, out_dtype):
    """Returns (loss, lse, count): loss is (rows,) for 'none' else a 0-d tensor; count (0-d, the
    number of non-ignored rows, fp32) for 'mean', else None."""
    rows = outer * inner
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lse = runtime.empty((rows,), acc)
    red = {"none": NONE, "mean": MEAN, "sum": SUM}[reduction].value
    P, meta = _ce_plan(rows, C, x.dtype, False)
    if red == NONE.value:
        loss = runtime.empty((rows,), out_dtype)
        psum = pcnt = lse
    else:
        loss = runtime.empty((), out_dtype)
        psum = runtime.empty((max(P, 1),), acc)
        pcnt = runtime.empty((max(P, 1),), acc)
    if rows:
        launch(_ce_fwd_kernel, (P,), x, t, loss, lse, psum, pcnt, runtime.error_flag(_BAD_TARGET), rows, C, inner,
               *xs, int(ignore_index), float(smoothing), REDUCE=red, SMOOTH=smoothing != 0, CD=_cd(x.dtype), **meta)
    count = None
    if red != NONE.value:
        count = runtime.empty((), acc) if red == MEAN.value else None
        sum_partials_(loss, psum, P if rows else 0, 1.0, pcnt if count is not None else None, count)
    return loss, lse, count


@tunable("dx")
def cross_entropy_bwd(dx, x, t, lse, g, count, outer, C, inner, xs, ds, reduction, ignore_index, smoothing):
    rows = outer * inner
    if rows * C == 0:
        return dx
    red = {"none": NONE, "mean": MEAN, "sum": SUM}[reduction].value
    programs, meta = _ce_plan(rows, C, x.dtype, True)
    launch(_ce_bwd_kernel, (programs,), x, t, lse, g, count if count is not None else lse, dx,
           rows, C, inner, *xs, *ds, int(ignore_index), float(smoothing), REDUCE=red, CD=_cd(x.dtype), **meta)
    return dx
