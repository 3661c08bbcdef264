"""Reductions over one (collapsed) axis of an (outer, R, inner) view with any strides.

One kernel serves sum, max, min and the squared-deviation sum used by ``var``; the op is a
constexpr switch. Each program owns one ``outer`` index, a block of ``inner`` columns and one
split of ``R``; when there are too few programs to fill the GPU the R axis is split and the
partial results, laid out as (outer, splits, inner) in the accumulation dtype, are reduced again
by the same kernel. No atomics: results are bitwise reproducible run to run.

Launch configs come from ``flame.tune`` (kernel "reduce": key (outer, R, inner), fields BLOCK_R,
BLOCK_I, num_warps; looked up in the input's dtype), a tuning table's entry on the GPU or the
heuristics here, with the blocks cut to R and inner rounded up to powers of two; the R splits
follow from BLOCK_R. Plans are memoised per shape and dtype (``_plans``, registered with
``tune.register_cache``). A split reduction's second pass is a reduction of its own key.

``sum_partials_`` is the second stage of the losses' reductions to a scalar (cross-entropy's and
the regression losses'): one program sums per-program partials in a fixed order, optionally divided
by the sum of per-program counts.
"""
import math

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from .elementwise import _pow2, cdiv, compute_dtype, fill_
from .launch import launch

SUM, MAX, MIN, SQDEV = (tl.constexpr(i) for i in range(4))


@triton.jit(do_not_specialize=["scale"])
def _reduce_kernel(x_ptr, out_ptr, mean_ptr, R, INNER, r_per_split, splits, scale,
                   xs_outer, xs_r, xs_inner,
                   OP: tl.constexpr, CD: tl.constexpr, IDENT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    # BLOCK_I == 1 (reducing rows: inner == 1) keeps a 1-D accumulator along R; otherwise a
    # (BLOCK_R, BLOCK_I) tile is reduced over its first axis.
    o = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    r_lo = split * r_per_split
    r_hi = tl.minimum(r_lo + r_per_split, R)
    if BLOCK_I == 1:
        cols = tl.program_id(1).to(tl.int64)
        col_mask = cols < INNER
        base = x_ptr + o * xs_outer + cols * xs_inner
        acc = tl.full((BLOCK_R,), IDENT, CD)
    else:
        cols = tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
        col_mask = cols < INNER
        base = x_ptr + o * xs_outer + (cols * xs_inner)[None, :]
        acc = tl.full((BLOCK_R, BLOCK_I), IDENT, CD)
    if OP == SQDEV:
        mean = tl.load(mean_ptr + o * INNER + cols, mask=col_mask, other=0.0).to(CD)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        if BLOCK_I == 1:
            mask = rows < r_hi
            x = tl.load(base + rows * xs_r, mask=mask, other=0).to(CD)
        else:
            mask = (rows < r_hi)[:, None] & col_mask[None, :]
            x = tl.load(base + (rows * xs_r)[:, None], mask=mask, other=0).to(CD)
        if OP == SUM:
            acc += x
        elif OP == SQDEV:
            if BLOCK_I == 1:
                d = tl.where(mask, x - mean, 0.0)
            else:
                d = tl.where(mask, x - mean[None, :], 0.0)
            acc += d * d
        elif OP == MAX:
            x = tl.where(mask, x, IDENT)
            acc = tl.where((x > acc) | (x != x), x, acc)
        else:
            x = tl.where(mask, x, IDENT)
            acc = tl.where((x < acc) | (x != x), x, acc)
    if OP == MAX or OP == MIN:  # noqa: SIM109 - jit code: plain comparisons of constexprs
        if OP == MAX:
            res = tl.max(acc, axis=0)
        else:
            res = tl.min(acc, axis=0)
        if tl.int64 != CD:  # a NaN anywhere in the column wins, as in torch.amax
            has_nan = tl.max((acc != acc).to(tl.int32), axis=0) > 0
            res = tl.where(has_nan, float("nan"), res)
    else:
        res = tl.sum(acc, axis=0) * scale
    tl.store(out_ptr + (o * splits + split) * INNER + cols, res.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit(do_not_specialize=["scale"])
def _partials_kernel(psum_ptr, pcnt_ptr, out_ptr, cnt_out_ptr, P, scale,
                     HAS_COUNT: tl.constexpr, CD: tl.constexpr, BLOCK: tl.constexpr):
    # out = scale * sum(psum) [/ sum(pcnt), also stored], summed in a fixed order by one program
    acc = tl.zeros((BLOCK,), CD)
    cnt = tl.zeros((BLOCK,), CD)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < P
        acc += tl.load(psum_ptr + p, mask=m, other=0.0).to(CD)
        if HAS_COUNT:
            cnt += tl.load(pcnt_ptr + p, mask=m, other=0.0).to(CD)
    res = tl.sum(acc, axis=0) * scale
    if HAS_COUNT:
        c = tl.sum(cnt, axis=0)
        res = res / c
        tl.store(cnt_out_ptr, c)
    tl.store(out_ptr, res.to(out_ptr.dtype.element_ty))


def accumulation_dtype(dtype):
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if dtype.is_floating_point else torch.int64


def _identity(op, cd):
    if op in (SUM, SQDEV):
        return 0.0 if cd != tl.int64 else 0
    if cd == tl.int64:
        return -(2 ** 63) if op == MAX else 2 ** 63 - 1
    return -math.inf if op == MAX else math.inf


def _target_programs():
    return 4 * runtime.num_sms()


def _reduce_default(R, inner):
    """reduce's heuristic config: rows (inner == 1) in blocks of 1024, else tiles of up to 64
    columns and ~2048 elements; the interpreter's: up to 16384 elements."""
    if inner == 1:  # an H200 sweep of block sizes: 1024 x 4 warps is best or near it for bf16 and fp32
        block_i = 1
        block_r = _pow2(min(R, 1 << 14 if runtime.INTERPRETER else 1024))
    else:
        block_i = _pow2(min(inner, 1 << 10 if runtime.INTERPRETER else 64))
        block_r = _pow2(min(R, max(1, (1 << 14 if runtime.INTERPRETER else 2048) // block_i)))
    return dict(BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4 if block_r * block_i <= 1024 else 8)


# The search space: BLOCK_R x BLOCK_I tiles (BLOCK_I 1 when reducing rows, inner == 1) of
# REDUCE_AREA elements (or the whole of a shorter R), cut to the dims rounded up to powers of two;
# warps that give each thread 2 to 64 elements.
SPACE = dict(BLOCK_R=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), BLOCK_I=(32, 64, 128),
             REDUCE_AREA=(1024, 2048, 4096, 8192), num_warps=(1, 2, 4, 8, 16))
QUICK_SPACE = dict(BLOCK_R=(16, 32, 64, 128), BLOCK_I=(4, 8), REDUCE_AREA=(64, 128), num_warps=(1,))


def _stages(ctx, key, spec):
    """The candidate configs at key (outer, R, inner) as stages: one, BLOCK_R x BLOCK_I tiles (rows:
    BLOCK_I 1) x warps."""
    _, r, inner = key
    space = ctx.choices(spec)
    widths = [1] if inner == 1 else sorted({min(i, triton.next_power_of_2(inner)) for i in space["BLOCK_I"]})
    lengths = sorted({min(b, triton.next_power_of_2(r)) for b in space["BLOCK_R"]})
    tiles = [(b, i) for i in widths for b in lengths
             if b * i in space["REDUCE_AREA"] or (b * i < min(space["REDUCE_AREA"]) and b == lengths[-1])]
    return [lambda best: [dict(BLOCK_R=b, BLOCK_I=i, num_warps=w) for b, i in tiles for w in space["num_warps"]
                          if autotune.per_thread_ok(b * i, w)]]


# sum/max/min/squared deviations over R of an (outer, R, inner) view (dtype: the input's) in
# BLOCK_R x BLOCK_I tiles (cut likewise); the R splits are derived
REDUCE = tune.register(tune.Spec(
    "reduce", ("outer", "R", "inner"), ("BLOCK_R", "BLOCK_I", "num_warps"),
    lambda key, dtype: _reduce_default(*key[1:]), _stages, SPACE, QUICK_SPACE, helper=True,
    doc="_reduce_kernel: sums, max, min, squared deviations over one axis"))


def _reduce_plan(outer, R, inner, dtype):
    """(grid, R per split, launch config) of a reduction of (outer, R, inner) in ``dtype``
    (``reduce_`` memoises it in ``_plans``): BLOCK_R, BLOCK_I and the warps from ``flame.tune``;
    when there are too few programs to fill the GPU, R is split in whole blocks (grid axis 2)."""
    cfg = REDUCE.config((outer, R, inner), dtype)
    block_r, block_i = min(cfg["BLOCK_R"], _pow2(R)), min(cfg["BLOCK_I"], _pow2(inner))
    programs = outer * cdiv(inner, block_i)
    splits = 1
    if not runtime.INTERPRETER and programs < _target_programs() and 4 * block_r < R:
        splits = min(cdiv(_target_programs(), programs), cdiv(R, 4 * block_r), 1024)
    r_per_split = cdiv(cdiv(R, splits), block_r) * block_r
    splits = cdiv(R, r_per_split)
    return ((outer, cdiv(inner, block_i), splits), r_per_split,
            dict(BLOCK_R=block_r, BLOCK_I=block_i, num_warps=cfg["num_warps"]))


_plans: dict = {}  # (outer, R, inner, dtype) -> _reduce_plan; emptied by flame.tune (override, record, reset)
tune.register_cache(_plans.clear)


def reduce_(out, x, outer, R, inner, strides, op, scale=1.0, mean=None):
    """Reduce ``x`` viewed as (outer, R, inner) with ``strides`` over R into contiguous ``out``
    of ``outer * inner`` elements. ``scale`` multiplies sums; ``mean`` (outer*inner, contiguous)
    is subtracted before squaring for SQDEV. With ``FLAME_AUTOTUNE=1`` a call that needs a new
    plan goes through ``_reduce_first_use`` (tuning on first use); calls with a plan never pay for it."""
    if outer * inner == 0:
        return out
    op = tl.constexpr(op).value
    cd = compute_dtype(x.dtype, out.dtype)
    ident = _identity(op, cd)
    if R == 0:  # empty sum: 0 (times scale, so an empty mean is NaN)
        return fill_(out, 0.0 * scale)
    plan = _plans.get((outer, R, inner, x.dtype))
    if plan is None:
        if tune.autotuning():
            return _reduce_first_use(out, x, outer, R, inner, strides, op, scale, mean)
        plan = _plans[outer, R, inner, x.dtype] = _reduce_plan(outer, R, inner, x.dtype)
    grid, r_per_split, meta = plan
    splits = grid[2]
    mean_arg = mean if mean is not None else x
    s_outer, s_r, s_inner = strides
    if splits == 1:
        launch(_reduce_kernel, grid, x, out, mean_arg, R, inner, R, 1, float(scale), s_outer, s_r, s_inner,
               OP=op, CD=cd, IDENT=ident, **meta)
        return out
    partial = runtime.empty((outer, splits, inner), accumulation_dtype(x.dtype))
    launch(_reduce_kernel, grid, x, partial, mean_arg, R, inner, r_per_split, splits, 1.0, s_outer, s_r, s_inner,
           OP=op, CD=cd, IDENT=ident, **meta)
    second = SUM.value if op == SQDEV else op
    return reduce_(out, partial, outer, splits, inner, (splits * inner, inner, 1), second, scale)


@tunable("out", helper=True)
def _reduce_first_use(out, x, outer, R, inner, strides, op, scale, mean):
    """reduce_ with a new plan when tuning on first use: the ``flame.autotune`` entry point of the
    reduction (it writes all of ``out``); a helper, like ``elementwise._map_first_use``."""
    _plans[outer, R, inner, x.dtype] = _reduce_plan(outer, R, inner, x.dtype)
    return reduce_(out, x, outer, R, inner, strides, op, scale, mean)


def column_sum_(out, x):
    """``out[n] = sum_r x[r, n]`` for a 2-D buffer ``x`` with any strides (a bias gradient): the
    reduction kernel directly, without the op layer's planning."""
    R, N = x.shape
    return reduce_(out, x, 1, R, N, (0, x.stride(0), x.stride(1)), SUM)


def sum_partials_(out, psum, P, scale=1.0, pcnt=None, count_out=None):
    """The second stage of a two-stage reduction to a scalar: ``out = scale * sum(psum[:P])``, or
    with ``pcnt`` ``out = scale * sum(psum[:P]) / sum(pcnt[:P])`` and that count into ``count_out``
    (a mean over counted elements); one program, a fixed order: bitwise repeatable."""
    block = _pow2(min(max(P, 1), 1 << 14 if runtime.INTERPRETER else 1024))
    launch(_partials_kernel, (1,), psum, pcnt, out, count_out, P, float(scale), HAS_COUNT=pcnt is not None,
           CD=tl.float64 if psum.dtype == torch.float64 else tl.float32, BLOCK=block, num_warps=4)
