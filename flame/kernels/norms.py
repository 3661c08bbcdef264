"""Normalisation kernels: GroupNorm (+ fused SiLU), LayerNorm, RMSNorm and the modulated LayerNorm
(AdaLayerNormZero's), forward and backward.

GroupNorm views its input as (N, C, S) with strides (xs_n, xs_c, xs_s): S collapses every spatial
dim, so the same kernels read NCHW (xs_s == 1) and channels-last (xs_c == 1) memory in place, and
the output is written with its own strides (the same memory format). A group is CG = C / G
channels times S positions; batch 1 has only 32 groups, so statistics are split across programs:

1. ``_gn_partial_kernel``: a program owns one sample, a block of channels and one split of S and
   writes per-channel partials of that split (forward: mean and centred M2 of the split, with
   sums shifted by the split's first value so fp32 sums do not cancel; backward: sum dz and
   sum dz * xhat).
2. ``_gn_combine_kernel`` (forward): one program per (n, g) merges its CG x splits partials with
   Chan's parallel formula into the group's mean and rstd (fp32; fp64 for fp64 inputs).
   ``_gn_bwd_combine_kernel`` (backward): one program per group reduces the partials to dW, dB
   (over N and S, in a fixed order) and to the two per-(n, g) coefficients of dx.
3. ``_gn_apply_kernel``: one elementwise pass, normalise + affine (+ SiLU), or the dx formula.

LayerNorm / RMSNorm view the input as (M, D) rows. A program normalises BLOCK_M rows held in
registers (a looped three-pass variant serves rows longer than one block). The backward writes dx
and per-program dW/dB partials (rows are visited in a fixed order), reduced over programs by the
reduce kernel afterwards: no atomics, results reproducible run to run.

Launch configs come from ``flame.tune`` (kernels "group_norm_fwd", "group_norm_bwd": the tiles,
splits and warps of the statistics and apply passes; "layer_norm_fwd", "layer_norm_bwd": rows per
program, warps and the backward's persistent programs), a tuning table's entry on the GPU or the
heuristics here; memoised per shape and dtype (``tune.memoised``). Block
sizes that must cover a dimension (LayerNorm's BLOCK_D, the combine kernels') are derived.
"""

import itertools

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from .elementwise import _pow2, cdiv, fill_
from .launch import Plan, launch, launch_via
from .reduce import SUM, accumulation_dtype, reduce_


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


# ---- GroupNorm ------------------------------------------------------------------------------

@triton.jit
def _gn_partial_kernel(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, p1_ptr, p2_ptr,
                       C, S, CG, G, n_cblocks, s_per_split, splits,
                       xs_n, xs_c, xs_s, gs_n, gs_c, gs_s,
                       BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                       CD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    # Forward (BWD=0): per channel c of this split, p1 = mean of x, p2 = sum of (x - p1)^2.
    #   Sums run over d = x - K with K = the channel's first value in the split:
    #   mean = K + sum(d) / n, M2 = sum(d^2) - sum(d)^2 / n (no cancellation when K ~ mean).
    # Backward (BWD=1): z = xhat * w + b, y = act(z), dz = dy * act'(z);
    #   p1 = sum_s dz, p2 = sum_s dz * xhat (per channel of this split).
    pid = tl.program_id(0)
    n = (pid // n_cblocks).to(tl.int64)
    cb = pid % n_cblocks
    split = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    c64 = c.to(tl.int64)
    s_lo = split * s_per_split
    s_hi = tl.minimum(s_lo + s_per_split, S)
    xbase = x_ptr + n * xs_n + (c64 * xs_c)[:, None]
    acc1 = tl.zeros((BLOCK_C, BLOCK_S), CD)
    acc2 = tl.zeros((BLOCK_C, BLOCK_S), CD)
    if BWD:
        gbase = dy_ptr + n * gs_n + (c64 * gs_c)[:, None]
        grp = n * G + c // CG
        mean = tl.load(mean_ptr + grp, mask=cmask, other=0.0).to(CD)
        rstd = tl.load(rstd_ptr + grp, mask=cmask, other=0.0).to(CD)
        if HAS_W:
            w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(CD)
        else:
            w = tl.full((BLOCK_C,), 1.0, CD)
        if HAS_B:
            b = tl.load(b_ptr + c, mask=cmask, other=0.0).to(CD)
        else:
            b = tl.zeros((BLOCK_C,), CD)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
            m = cmask[:, None] & (s < s_hi)[None, :]
            x = tl.load(xbase + (s * xs_s)[None, :], mask=m, other=0.0).to(CD)
            dz = tl.load(gbase + (s * gs_s)[None, :], mask=m, other=0.0).to(CD)
            xhat = (x - mean[:, None]) * rstd[:, None]
            if ACT:
                z = xhat * w[:, None] + b[:, None]
                sg = _sigmoid(z)
                dz = dz * (sg * (1.0 + z * (1.0 - sg)))
            dz = tl.where(m, dz, 0.0)
            acc1 += dz
            acc2 += dz * xhat
        r1 = tl.sum(acc1, axis=1)
        r2 = tl.sum(acc2, axis=1)
    else:
        k = tl.load(x_ptr + n * xs_n + c64 * xs_c + s_lo.to(tl.int64) * xs_s, mask=cmask, other=0.0).to(CD)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
            m = cmask[:, None] & (s < s_hi)[None, :]
            x = tl.load(xbase + (s * xs_s)[None, :], mask=m, other=0.0).to(CD)
            d = tl.where(m, x - k[:, None], 0.0)
            acc1 += d
            acc2 += d * d
        cnt = (s_hi - s_lo).to(CD)
        t1 = tl.sum(acc1, axis=1)
        r1 = k + t1 / cnt
        r2 = tl.maximum(tl.sum(acc2, axis=1) - t1 * t1 / cnt, 0.0)
    off = (n * C + c64) * splits + split
    tl.store(p1_ptr + off, r1, mask=cmask)
    tl.store(p2_ptr + off, r2, mask=cmask)


@triton.jit(do_not_specialize=["eps"])
def _gn_combine_kernel(p1_ptr, p2_ptr, mean_ptr, rstd_ptr, CG, S, s_per_split, splits, eps,
                       CD: tl.constexpr, BLOCK: tl.constexpr):
    # Chan's merge of (count_i, mean_i, M2_i) over the group's CG x splits partials:
    #   mean = sum(n_i mean_i) / n,  M2 = sum(M2_i + n_i (mean_i - mean)^2),  var = M2 / n
    pid = tl.program_id(0).to(tl.int64)  # n * G + g: the group's partials are contiguous
    E = CG * splits
    base = pid * E
    total = tl.cast(CG * S, CD)
    acc = tl.zeros((BLOCK,), CD)
    for e0 in range(0, E, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        m = e < E
        sp = e % splits
        cnt = tl.minimum(s_per_split, S - sp * s_per_split).to(CD)
        mu = tl.load(p1_ptr + base + e, mask=m, other=0.0)
        acc += tl.where(m, cnt * mu, 0.0)
    mean = tl.sum(acc, axis=0) / total
    acc2 = tl.zeros((BLOCK,), CD)
    for e0 in range(0, E, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        m = e < E
        sp = e % splits
        cnt = tl.minimum(s_per_split, S - sp * s_per_split).to(CD)
        mu = tl.load(p1_ptr + base + e, mask=m, other=0.0)
        m2 = tl.load(p2_ptr + base + e, mask=m, other=0.0)
        d = mu - mean
        acc2 += tl.where(m, m2 + cnt * d * d, 0.0)
    var = tl.sum(acc2, axis=0) / total
    tl.store(mean_ptr + pid, mean)
    tl.store(rstd_ptr + pid, 1.0 / tl.sqrt(var + eps))


# Backward combine. With p1_c = sum_s dz, p2_c = sum_s dz * xhat for channel c of sample n:
#   dB_c = sum_n p1_c,  dW_c = sum_n p2_c
#   dxhat = dz * w_c;  per (n, g) over its M = CG * S elements:
#   k1 = mean(dxhat) = sum_c w_c p1_c / M,  k2 = mean(dxhat * xhat) = sum_c w_c p2_c / M
#   (then dx = rstd * (w_c dz - k1 - xhat k2), in _gn_apply_kernel).
@triton.jit
def _gn_bwd_combine_kernel(p1_ptr, p2_ptr, w_ptr, dw_ptr, db_ptr, k1_ptr, k2_ptr, N, C, CG, G, S, splits,
                           HAS_W: tl.constexpr, NEED_WB: tl.constexpr, CD: tl.constexpr,
                           BLOCK_CG: tl.constexpr, BLOCK_SP: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    M = tl.cast(CG * S, CD)
    # dW, dB: per channel of the group, summed over samples and splits
    if NEED_WB:
        for c0 in range(0, CG, BLOCK_CG):
            cg = c0 + tl.arange(0, BLOCK_CG)
            cm = cg < CG
            accw = tl.zeros((BLOCK_CG, BLOCK_SP), CD)
            accb = tl.zeros((BLOCK_CG, BLOCK_SP), CD)
            for n in range(0, N):
                base = (n * G + g) * CG * splits
                for sp0 in range(0, splits, BLOCK_SP):
                    sp = sp0 + tl.arange(0, BLOCK_SP)
                    m = cm[:, None] & (sp < splits)[None, :]
                    off = base + (cg * splits)[:, None] + sp[None, :]
                    accb += tl.load(p1_ptr + off, mask=m, other=0.0)
                    accw += tl.load(p2_ptr + off, mask=m, other=0.0)
            c = g * CG + cg
            tl.store(dw_ptr + c, tl.sum(accw, axis=1).to(dw_ptr.dtype.element_ty), mask=cm)
            tl.store(db_ptr + c, tl.sum(accb, axis=1).to(db_ptr.dtype.element_ty), mask=cm)
    # k1, k2 per sample
    for n in range(0, N):
        base = (n * G + g) * CG * splits
        a1 = tl.zeros((BLOCK_CG, BLOCK_SP), CD)
        a2 = tl.zeros((BLOCK_CG, BLOCK_SP), CD)
        for c0 in range(0, CG, BLOCK_CG):
            cg = c0 + tl.arange(0, BLOCK_CG)
            cm = cg < CG
            if HAS_W:
                w = tl.load(w_ptr + g * CG + cg, mask=cm, other=0.0).to(CD)
            else:
                w = tl.full((BLOCK_CG,), 1.0, CD)
            for sp0 in range(0, splits, BLOCK_SP):
                sp = sp0 + tl.arange(0, BLOCK_SP)
                m = cm[:, None] & (sp < splits)[None, :]
                off = base + (cg * splits)[:, None] + sp[None, :]
                a1 += w[:, None] * tl.load(p1_ptr + off, mask=m, other=0.0)
                a2 += w[:, None] * tl.load(p2_ptr + off, mask=m, other=0.0)
        tl.store(k1_ptr + n * G + g, tl.sum(tl.sum(a1, axis=1), axis=0) / M)
        tl.store(k2_ptr + n * G + g, tl.sum(tl.sum(a2, axis=1), axis=0) / M)


# Apply pass. Forward (BWD=0): y = act(xhat * w + b), xhat = (x - mean) * rstd.
# Backward (BWD=1): dz = dy * act'(z) (z recomputed), dx = rstd * (w dz - k1 - xhat * k2)
#   (the GroupNorm input gradient; k1, k2 from _gn_bwd_combine_kernel).
@triton.jit
def _gn_apply_kernel(x_ptr, dy_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, k1_ptr, k2_ptr,
                     C, S, CG, G, n_cblocks,
                     xs_n, xs_c, xs_s, gs_n, gs_c, gs_s, ys_n, ys_c, ys_s,
                     BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                     CD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    n = (pid // n_cblocks).to(tl.int64)
    cb = pid % n_cblocks
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    c64 = c.to(tl.int64)
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    m = cmask[:, None] & (s < S)[None, :]
    grp = n * G + c // CG
    mean = tl.load(mean_ptr + grp, mask=cmask, other=0.0).to(CD)
    rstd = tl.load(rstd_ptr + grp, mask=cmask, other=0.0).to(CD)
    if HAS_W:
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(CD)
    else:
        w = tl.full((BLOCK_C,), 1.0, CD)
    if HAS_B:
        b = tl.load(b_ptr + c, mask=cmask, other=0.0).to(CD)
    else:
        b = tl.zeros((BLOCK_C,), CD)
    x = tl.load(x_ptr + n * xs_n + (c64 * xs_c)[:, None] + (s * xs_s)[None, :], mask=m, other=0.0).to(CD)
    if BWD:
        dz = tl.load(dy_ptr + n * gs_n + (c64 * gs_c)[:, None] + (s * gs_s)[None, :], mask=m, other=0.0).to(CD)
        xhat = (x - mean[:, None]) * rstd[:, None]
        if ACT:
            z = xhat * w[:, None] + b[:, None]
            sg = _sigmoid(z)
            dz = dz * (sg * (1.0 + z * (1.0 - sg)))
        k1 = tl.load(k1_ptr + grp, mask=cmask, other=0.0)
        k2 = tl.load(k2_ptr + grp, mask=cmask, other=0.0)
        out = rstd[:, None] * (dz * w[:, None] - k1[:, None] - xhat * k2[:, None])
    else:
        scale = rstd * w
        shift = b - mean * scale
        out = x * scale[:, None] + shift[:, None]
        if ACT:
            out = out * _sigmoid(out)
    tl.store(y_ptr + n * ys_n + (c64 * ys_c)[:, None] + (s * ys_s)[None, :], out.to(y_ptr.dtype.element_ty), mask=m)


def _gn_default(N, C, S, cl):
    """group_norm_fwd/bwd's heuristic config: tiles of ~4096 elements (the interpreter's: one big
    block) with channels innermost for channels-last input (``cl``), positions for NCHW; the
    statistics split each group's positions until ~4 programs per SM share them."""
    if runtime.INTERPRETER:
        bs = abs_ = _pow2(min(S, 1 << 12))
        bc = _pow2(min(C, max(1, (1 << 14) // bs)))
        abc = _pow2(min(C, max(1, (1 << 15) // bs)))
        splits = 1
    else:
        if cl:
            bc, abc = min(_pow2(C), 64), min(_pow2(C), 128)
            bs, abs_ = max(1, min(_pow2(S), 4096 // bc)), max(1, min(_pow2(S), 4096 // abc))
        else:
            bs = abs_ = min(_pow2(S), 1024)
            bc = abc = max(1, min(_pow2(C), 4096 // bs))
        programs = N * cdiv(C, bc)
        target = 4 * runtime.num_sms()
        splits = max(1, min(cdiv(target, programs), cdiv(S, bs))) if programs < target else 1
    return dict(BLOCK_C=bc, BLOCK_S=bs, SPLITS=splits, num_warps=4 if bc * bs <= 2048 else 8,
                BLOCK_C_APPLY=abc, BLOCK_S_APPLY=abs_, num_warps_apply=4 if abc * abs_ <= 2048 else 8)


def _cd(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# GroupNorm's search space: the statistics pass's tiles of TILE elements, channels innermost for
# channels-last input (BLOCK_C channels, BLOCK_S = TILE / BLOCK_C positions), positions for NCHW
# (BLOCK_S), its warps and SPLITS of each group's positions, chosen so that about PROGRAMS_PER_SM
# programs per SM share the statistics; then the apply pass's tiles and warps (the same choices).
GN_SPACE = dict(BLOCK_C=(16, 32, 64, 128), BLOCK_S=(256, 512, 1024, 2048), TILE=(2048, 4096, 8192), num_warps=(4, 8),
                PROGRAMS_PER_SM=(2, 4, 8))
QUICK_GN_SPACE = dict(BLOCK_C=(2, 4), BLOCK_S=(8, 16), TILE=(32,), num_warps=(4,), PROGRAMS_PER_SM=(4, 16))


def _gn_stages(ctx, key, spec):
    """The candidate group_norm_fwd/bwd configs at key (N, C, S, G, channels_last) as stages: the
    statistics pass's tiles, warps and splits (the apply pass at its default), then the apply
    pass's tiles and warps over the fastest statistics config."""
    n, c, s, _, cl = key
    space = ctx.choices(spec)
    pc, ps = triton.next_power_of_2(c), triton.next_power_of_2(s)
    tiles = set()
    for t, b in itertools.product(space["TILE"], space["BLOCK_C" if cl else "BLOCK_S"]):
        tiles.add((min(b, pc), min(max(1, t // b), ps)) if cl else (min(max(1, t // b), pc), min(b, ps)))
    choices = list(itertools.product(sorted(tiles), space["num_warps"]))

    def statistics(best):
        configs = []
        for ((bc, bs), w), per_sm in itertools.product(choices, space["PROGRAMS_PER_SM"]):
            want = triton.cdiv(per_sm * runtime.num_sms(), n * triton.cdiv(c, bc))
            per_split = triton.cdiv(triton.cdiv(s, max(1, min(want, triton.cdiv(s, bs)))), bs) * bs
            configs.append(dict(best, BLOCK_C=bc, BLOCK_S=bs, SPLITS=triton.cdiv(s, per_split), num_warps=w))
        return autotune.unique(configs)

    def apply(best):
        return [dict(best, BLOCK_C_APPLY=bc, BLOCK_S_APPLY=bs, num_warps_apply=w) for (bc, bs), w in choices]

    return [statistics, apply]


# (N, C, S, G, channels_last): S positions per channel, channels_last 0 or 1; the statistics
# (partial) pass's tile, splits of each group's positions and warps, then the apply pass's
_GN_KEY = ("N", "C", "S", "G", "channels_last")
_GN_FIELDS = ("BLOCK_C", "BLOCK_S", "SPLITS", "num_warps", "BLOCK_C_APPLY", "BLOCK_S_APPLY", "num_warps_apply")
GN_FWD, GN_BWD = (tune.register(tune.Spec(
    name, _GN_KEY, _GN_FIELDS, lambda key, dtype: _gn_default(key[0], key[1], key[2], key[4]), _gn_stages,
    GN_SPACE, QUICK_GN_SPACE, doc=f"GroupNorm (+ SiLU) {what}: statistics, combine and apply passes"))
    for name, what in (("group_norm_fwd", "forward"), ("group_norm_bwd", "backward")))


@tune.memoised
def _gn_plan(N, C, S, G, cl, dtype, bwd):
    """Launch geometry of the three GroupNorm passes, forward or backward (``bwd``); memoised, so
    the host path stays thin. The tiles, splits and warps of the statistics and apply passes come
    from ``flame.tune`` (kernel "group_norm_fwd" or "group_norm_bwd", key (N, C, S, G, cl)); the
    combine kernels' blocks follow from them."""
    cfg = (GN_BWD if bwd else GN_FWD).config((N, C, S, G, int(cl)), dtype)
    CG = C // G
    bc, bs = cfg["BLOCK_C"], cfg["BLOCK_S"]
    s_per_split = cdiv(cdiv(S, cfg["SPLITS"]), bs) * bs
    splits = cdiv(S, s_per_split)
    ncb = cdiv(C, bc)
    part = ((N * ncb, splits), ncb, dict(BLOCK_C=bc, BLOCK_S=bs, num_warps=cfg["num_warps"]))
    comb_block = _pow2(min(CG * splits, 1 << 14 if runtime.INTERPRETER else 1024))
    block_cg = _pow2(min(CG, 1024))
    block_sp = _pow2(min(splits, max(1, (1 << 14 if runtime.INTERPRETER else 2048) // block_cg)))
    abc, abs_ = cfg["BLOCK_C_APPLY"], cfg["BLOCK_S_APPLY"]
    ancb = cdiv(C, abc)
    apply = ((N * ancb, cdiv(S, abs_)), ancb, dict(BLOCK_C=abc, BLOCK_S=abs_, num_warps=cfg["num_warps_apply"]))
    return CG, splits, s_per_split, part, comb_block, (block_cg, block_sp), apply


# The launch.Plan of each norm launch: (kernel, sizes, strides, dtype, switches) -> Plan, its meta the memoised
# launch geometry's with the switches; LayerNorm's row strides are left free (``by_value``). Emptied with
# those geometries (tune.register_cache).
_launches: dict = {}
tune.register_cache(_launches.clear)


def _kept_launch(key, make_meta, by_value=()):
    """The Plan of ``key`` (its kernel first), made with the meta ``make_meta()`` at its first launch."""
    plan = _launches.get(key)
    if plan is None:
        plan = _launches[key] = Plan(key[0], make_meta(), by_value)
    return plan


@tunable("y")
def group_norm_fwd(y, x, w, b, N, C, S, G, eps, act, xs, ys):
    """y = act(GroupNorm(x)) for x, y viewed as (N, C, S) with strides ``xs``, ``ys``.
    Returns (mean, rstd), each (N, G) in fp32 (fp64 for fp64 inputs)."""
    stat_dtype = accumulation_dtype(x.dtype)
    mean = runtime.empty((N, G), stat_dtype)
    rstd = runtime.empty((N, G), stat_dtype)
    if N * C == 0:
        return mean, rstd
    cd = _cd(x.dtype)
    CG, splits, s_per_split, (pgrid, pncb, pmeta), comb_block, _, (agrid, ancb, ameta) = _gn_plan(
        N, C, S, G, xs[1] == 1 and C > 1, x.dtype, False)
    p1 = runtime.empty((N, C, splits), stat_dtype)
    p2 = runtime.empty((N, C, splits), stat_dtype)
    has_w, has_b = w is not None, b is not None
    shape = (N, C, S, G, x.dtype, xs)  # with the kernel and switches: what the launches' ints and meta follow from
    plan = _kept_launch((_gn_partial_kernel, False, *shape),
                        lambda: dict(BWD=False, HAS_W=False, HAS_B=False, ACT=False, CD=cd, **pmeta))
    launch_via(launch, plan, pgrid, (x, x, x, x, x, x, p1, p2, C, S, CG, G, pncb, s_per_split, splits, *xs, 0, 0, 0))
    plan = _kept_launch((_gn_combine_kernel, *shape), lambda: dict(CD=cd, BLOCK=comb_block, num_warps=4))
    launch_via(launch, plan, (N * G,), (p1, p2, mean, rstd, CG, S, s_per_split, splits, float(eps)))
    plan = _kept_launch((_gn_apply_kernel, False, has_w, has_b, act, *shape, ys),
                        lambda: dict(BWD=False, HAS_W=has_w, HAS_B=has_b, ACT=act, CD=cd, **ameta))
    launch_via(launch, plan, agrid, (x, x, y, w if has_w else x, b if has_b else x, mean, rstd, mean, mean,
                                     C, S, CG, G, ancb, *xs, 0, 0, 0, *ys))
    return mean, rstd


@tunable("dx", "dw", "db")
def group_norm_bwd(dx, dw, db, dy, x, w, b, mean, rstd, N, C, S, G, act, xs, gs, dxs):
    """GroupNorm backward. ``dx`` (strides ``dxs``) may be None; ``dw``/``db`` (C,) are written
    when not None (both or neither)."""
    if N * C == 0:
        return
    cd = _cd(x.dtype)
    stat_dtype = accumulation_dtype(x.dtype)
    CG, splits, s_per_split, (pgrid, pncb, pmeta), _, (block_cg, block_sp), (agrid, ancb, ameta) = _gn_plan(
        N, C, S, G, xs[1] == 1 and C > 1, x.dtype, True)
    p1 = runtime.empty((N, C, splits), stat_dtype)
    p2 = runtime.empty((N, C, splits), stat_dtype)
    wp = w if w is not None else x
    bp = b if b is not None else x
    has_w, has_b = w is not None, b is not None
    shape = (N, C, S, G, x.dtype, xs, gs)  # with the kernel and switches: what the launches' ints and meta follow from
    plan = _kept_launch((_gn_partial_kernel, True, has_w, has_b, act, *shape),
                        lambda: dict(BWD=True, HAS_W=has_w, HAS_B=has_b, ACT=act, CD=cd, **pmeta))
    launch_via(launch, plan, pgrid, (x, dy, wp, bp, mean, rstd, p1, p2, C, S, CG, G, pncb, s_per_split, splits,
                                     *xs, *gs))
    k1 = runtime.empty((N, G), stat_dtype)
    k2 = runtime.empty((N, G), stat_dtype)
    need_wb = dw is not None
    plan = _kept_launch((_gn_bwd_combine_kernel, has_w, need_wb, *shape),
                        lambda: dict(HAS_W=has_w, NEED_WB=need_wb, CD=cd, BLOCK_CG=block_cg, BLOCK_SP=block_sp,
                                     num_warps=4))
    launch_via(launch, plan, (G,), (p1, p2, wp, dw if need_wb else p1, db if need_wb else p1, k1, k2,
                                    N, C, CG, G, S, splits))
    if dx is None:
        return
    plan = _kept_launch((_gn_apply_kernel, True, has_w, has_b, act, *shape, dxs),
                        lambda: dict(BWD=True, HAS_W=has_w, HAS_B=has_b, ACT=act, CD=cd, **ameta))
    launch_via(launch, plan, agrid, (x, dy, dx, wp, bp, mean, rstd, k1, k2, C, S, CG, G, ancb, *xs, *gs, *dxs))


# ---- LayerNorm / RMSNorm ----------------------------------------------------------------------

@triton.jit(do_not_specialize=["eps"])
def _ln_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, M, D, xs_m, ys_m, eps,
                   RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, CD: tl.constexpr,
                   SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps) (biased var)
    # RMSNorm:   y = x * rstd * w,              rstd = 1 / sqrt(mean(x^2) + eps)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    cols = tl.arange(0, BLOCK_D)
    xrow = x_ptr + (rows * xs_m)[:, None]
    yrow = y_ptr + (rows * ys_m)[:, None]
    if SINGLE:
        cm = cols < D
        m = rm[:, None] & cm[None, :]
        x = tl.load(xrow + cols[None, :], mask=m, other=0.0).to(CD)
        if RMS:
            mean = tl.zeros((BLOCK_M,), CD)
            d = x
        else:
            mean = tl.sum(x, axis=1) / D
            d = tl.where(m, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / D + eps)
        y = d * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cm, other=0.0).to(CD)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cm, other=0.0).to(CD)[None, :]
        tl.store(yrow + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        mean = tl.zeros((BLOCK_M,), CD)
        if not RMS:
            acc = tl.zeros((BLOCK_M, BLOCK_D), CD)
            for d0 in range(0, D, BLOCK_D):
                cc = d0 + cols
                m = rm[:, None] & (cc < D)[None, :]
                acc += tl.load(xrow + cc[None, :], mask=m, other=0.0).to(CD)
            mean = tl.sum(acc, axis=1) / D
        acc = tl.zeros((BLOCK_M, BLOCK_D), CD)
        for d0 in range(0, D, BLOCK_D):
            cc = d0 + cols
            m = rm[:, None] & (cc < D)[None, :]
            x = tl.load(xrow + cc[None, :], mask=m, other=0.0).to(CD)
            d = tl.where(m, x - mean[:, None], 0.0)
            acc += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / D + eps)
        for d0 in range(0, D, BLOCK_D):
            cc = d0 + cols
            cm = cc < D
            m = rm[:, None] & cm[None, :]
            x = tl.load(xrow + cc[None, :], mask=m, other=0.0).to(CD)
            y = (x - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(w_ptr + cc, mask=cm, other=0.0).to(CD)[None, :]
            if HAS_B:
                y = y + tl.load(b_ptr + cc, mask=cm, other=0.0).to(CD)[None, :]
            tl.store(yrow + cc[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    if not RMS:
        tl.store(mean_ptr + rows, mean, mask=rm)
    tl.store(rstd_ptr + rows, rstd, mask=rm)


# Backward. xhat = (x - mean) * rstd (RMSNorm: x * rstd), dxhat = dy * w, means over the row's D:
#   LayerNorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
#   RMSNorm:   dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
#   dW = sum_rows dy * xhat, dB = sum_rows dy: each program accumulates its rows (visited in a
#   fixed order) into one partial row of pw/pb (P, D); the partials are reduced afterwards.
# SINGLE: rows fit one block; program p handles row blocks p, p + P, ... Otherwise each program
# owns exactly one row (P = M) and loops over it in BLOCK_D chunks.
@triton.jit
def _ln_bwd_kernel(x_ptr, dy_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, pw_ptr, pb_ptr, M, D, n_rblocks, P,
                   xs_m, gs_m, dxs_m,
                   RMS: tl.constexpr, HAS_W: tl.constexpr, NEED_X: tl.constexpr, NEED_W: tl.constexpr,
                   NEED_B: tl.constexpr, CD: tl.constexpr, SINGLE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    if SINGLE:
        cm = cols < D
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(CD)
        else:
            w = tl.full((BLOCK_D,), 1.0, CD)
        accw = tl.zeros((BLOCK_D,), CD)
        accb = tl.zeros((BLOCK_D,), CD)
        for rb in range(pid, n_rblocks, P):
            rows = tl.arange(0, BLOCK_M).to(tl.int64) + rb * BLOCK_M  # rows < 2**31
            rm = rows < M
            m = rm[:, None] & cm[None, :]
            x = tl.load(x_ptr + (rows * xs_m)[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
            dy = tl.load(dy_ptr + (rows * gs_m)[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
            rstd = tl.load(rstd_ptr + rows, mask=rm, other=0.0).to(CD)
            if RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(mean_ptr + rows, mask=rm, other=0.0).to(CD)
                xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
            if NEED_X:
                dxhat = dy * w[None, :]
                k2 = tl.sum(dxhat * xhat, axis=1) / D
                if RMS:
                    dx = rstd[:, None] * (dxhat - xhat * k2[:, None])
                else:
                    k1 = tl.sum(dxhat, axis=1) / D
                    dx = rstd[:, None] * (dxhat - k1[:, None] - xhat * k2[:, None])
                tl.store(dx_ptr + (rows * dxs_m)[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
            if NEED_W:
                accw += tl.sum(dy * xhat, axis=0)
            if NEED_B:
                accb += tl.sum(dy, axis=0)
        poff = pid.to(tl.int64) * D + cols
        if NEED_W:
            tl.store(pw_ptr + poff, accw, mask=cm)
        if NEED_B:
            tl.store(pb_ptr + poff, accb, mask=cm)
    else:
        row = pid.to(tl.int64)
        rstd = tl.load(rstd_ptr + row).to(CD)
        if RMS:
            mean = 0.0
        else:
            mean = tl.load(mean_ptr + row).to(CD)
        a1 = tl.zeros((BLOCK_D,), CD)
        a2 = tl.zeros((BLOCK_D,), CD)
        for d0 in range(0, D, BLOCK_D):
            cc = d0 + cols
            cm = cc < D
            x = tl.load(x_ptr + row * xs_m + cc, mask=cm, other=0.0).to(CD)
            dy = tl.load(dy_ptr + row * gs_m + cc, mask=cm, other=0.0).to(CD)
            xhat = tl.where(cm, (x - mean) * rstd, 0.0)
            if HAS_W:
                dy = dy * tl.load(w_ptr + cc, mask=cm, other=0.0).to(CD)
            a1 += dy
            a2 += dy * xhat
        k1 = tl.sum(a1, axis=0) / D
        k2 = tl.sum(a2, axis=0) / D
        for d0 in range(0, D, BLOCK_D):
            cc = d0 + cols
            cm = cc < D
            x = tl.load(x_ptr + row * xs_m + cc, mask=cm, other=0.0).to(CD)
            dy = tl.load(dy_ptr + row * gs_m + cc, mask=cm, other=0.0).to(CD)
            xhat = (x - mean) * rstd
            if NEED_X:
                if HAS_W:
                    dxhat = dy * tl.load(w_ptr + cc, mask=cm, other=0.0).to(CD)
                else:
                    dxhat = dy
                if RMS:
                    dx = rstd * (dxhat - xhat * k2)
                else:
                    dx = rstd * (dxhat - k1 - xhat * k2)
                tl.store(dx_ptr + row * dxs_m + cc, dx.to(dx_ptr.dtype.element_ty), mask=cm)
            if NEED_W:
                tl.store(pw_ptr + row * D + cc, dy * xhat, mask=cm)
            if NEED_B:
                tl.store(pb_ptr + row * D + cc, dy, mask=cm)


@triton.jit
def _colsum_kernel(pw_ptr, pb_ptr, dw_ptr, db_ptr, P, D,
                   NEED_W: tl.constexpr, NEED_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # Second stage of dW/dB: dw[d] = sum_p pw[p, d], db[d] = sum_p pb[p, d], in a fixed order.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    accw = tl.zeros((BLOCK_P, BLOCK_D), pw_ptr.dtype.element_ty)
    accb = tl.zeros((BLOCK_P, BLOCK_D), pw_ptr.dtype.element_ty)
    for p0 in range(0, P, BLOCK_P):
        p = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
        m = (p < P)[:, None] & cm[None, :]
        off = (p * D)[:, None] + cols[None, :]
        if NEED_W:
            accw += tl.load(pw_ptr + off, mask=m, other=0.0)
        if NEED_B:
            accb += tl.load(pb_ptr + off, mask=m, other=0.0)
    if NEED_W:
        tl.store(dw_ptr + cols, tl.sum(accw, axis=0).to(dw_ptr.dtype.element_ty), mask=cm)
    if NEED_B:
        tl.store(db_ptr + cols, tl.sum(accb, axis=0).to(db_ptr.dtype.element_ty), mask=cm)


def row_block(D):
    """BLOCK_D of the LayerNorm/RMSNorm kernels (derived, not tuned): D rounded up to a power of
    two, so that one block holds a row, up to 8192 (the interpreter's: 16384); longer rows are
    streamed through blocks of that size (the looped kernels)."""
    return min(_pow2(D), 1 << 14 if runtime.INTERPRETER else 8192)


def _ln_default(M, D, bwd):
    """layer_norm_fwd/bwd's heuristic config, from an H100 sweep of D = 320 to 4096 (session 7):
    whole rows, BLOCK_M of them per program in tiles of max(2048, 2 x BLOCK_D) elements up to 8192
    (forward) or of 4096 (D <= 512) / 8192 (backward), with 32 elements per thread in the forward
    (64 up to D = 512) and 64 in the backward; one row per program when rows are streamed. The
    interpreter takes up to 32768 elements per program. The backward's persistent programs: 2 per
    SM (the interpreter's: 1)."""
    bd = row_block(D)
    if bd < D:
        bm, per_thread = 1, 32
    elif runtime.INTERPRETER:
        bm, per_thread = _pow2(min(M, max(1, (1 << 15) // bd))), 32
    else:
        tile = (4096 if bd <= 512 else 8192) if bwd else max(2048, min(2 * bd, 8192))
        bm = max(1, min(_pow2(M), tile // bd))
        per_thread = 64 if bwd or bd <= 512 else 32
    cfg = dict(BLOCK_M=bm, num_warps=min(16, max(1, bm * bd // (32 * per_thread))))
    if bwd:
        cfg["PROGRAMS"] = 1 if runtime.INTERPRETER else 2 * runtime.num_sms()
    return cfg


# LayerNorm's search space: BLOCK_M rows of BLOCK_D (D rounded up, derived) per program, at most
# MAX_LN_TILE elements (the backward holds four such tiles: half, its fastest on the H100 held
# 8192), warps that give each thread 2 to 64 of them; then the backward's persistent programs,
# PROGRAMS_PER_SM per SM.
LN_SPACE = dict(BLOCK_M=(1, 2, 4, 8, 16, 32), num_warps=(1, 2, 4, 8, 16), PROGRAMS_PER_SM=(1, 2, 4, 8))
QUICK_LN_SPACE = dict(BLOCK_M=(2, 4), num_warps=(1,), PROGRAMS_PER_SM=(1, 3))
MAX_LN_TILE = 16384


def _ln_stages(ctx, key, spec):
    """The candidate layer_norm_fwd/bwd configs at key (M, D) as stages: rows per program and warps,
    then (backward) the persistent programs, each at most one per row block. Rows longer than one
    block are streamed, in the backward one row per program: warps only."""
    m, d = key
    space = ctx.choices(spec)
    bd, bwd = row_block(d), spec.name == "layer_norm_bwd"
    streamed = bd < d
    rows = (1,) if bwd and streamed else sorted({min(r, triton.next_power_of_2(m)) for r in space["BLOCK_M"]})
    cap = MAX_LN_TILE // 2 if bwd else MAX_LN_TILE
    tiles = [(r, w) for r in rows for w in space["num_warps"]
             if (r == 1 or r * bd <= cap) and autotune.per_thread_ok(r * bd, w)]

    def blocks(best):
        return [dict(best, BLOCK_M=r, num_warps=w) for r, w in tiles]

    def programs(best):
        row_blocks = triton.cdiv(m, best["BLOCK_M"])
        counts = {min(p * runtime.num_sms(), row_blocks) for p in space["PROGRAMS_PER_SM"]}
        return [dict(best, PROGRAMS=p) for p in sorted(counts - {min(best["PROGRAMS"], row_blocks)})]

    return [blocks, programs] if bwd and not streamed else [blocks]


# LayerNorm and RMSNorm over M rows of D (BLOCK_D derived from D); the backward's PROGRAMS
# persistent programs each reduce a share of dW/dB
LN_FWD = tune.register(tune.Spec(
    "layer_norm_fwd", ("M", "D"), ("BLOCK_M", "num_warps"), lambda key, dtype: _ln_default(*key, False), _ln_stages,
    LN_SPACE, QUICK_LN_SPACE, doc="_ln_fwd_kernel: LayerNorm and RMSNorm forward"))
LN_BWD = tune.register(tune.Spec(
    "layer_norm_bwd", ("M", "D"), ("BLOCK_M", "num_warps", "PROGRAMS"), lambda key, dtype: _ln_default(*key, True),
    _ln_stages, LN_SPACE, QUICK_LN_SPACE, doc="_ln_bwd_kernel + _colsum_kernel: their backward"))


@tune.memoised
def _ln_fwd_plan(M, D, dtype):
    """(programs, launch meta) of the LayerNorm/RMSNorm forward, memoised: BLOCK_M rows per program
    and the warps from ``flame.tune`` (kernel "layer_norm_fwd", key (M, D)), BLOCK_D from D."""
    bd = row_block(D)
    cfg = LN_FWD.config((M, D), dtype)
    return cdiv(M, cfg["BLOCK_M"]), dict(SINGLE=bd >= D, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=bd,
                                         num_warps=cfg["num_warps"])


@tune.memoised
def _ln_bwd_plan(M, D, dtype):
    """(P programs, row blocks, launch meta, the colsum kernel's (programs, meta) or None for the
    split reduction) of the LayerNorm/RMSNorm backward, memoised. BLOCK_M, the warps and the
    persistent programs (PROGRAMS, at most one per row block) come from ``flame.tune`` (kernel
    "layer_norm_bwd", key (M, D)); streamed rows take one program each (BLOCK_M and PROGRAMS
    unused)."""
    bd = row_block(D)
    cfg = LN_BWD.config((M, D), dtype)
    if bd >= D:
        bm = cfg["BLOCK_M"]
        n_rblocks = cdiv(M, bm)
        P = max(1, min(cfg["PROGRAMS"], n_rblocks))
    else:
        bm, n_rblocks, P = 1, M, M
    meta = dict(SINGLE=bd >= D, BLOCK_M=bm, BLOCK_D=bd, num_warps=cfg["num_warps"])
    if P > 4096:  # one partial row per input row (the looped path): the split reduction
        return P, n_rblocks, meta, None
    if runtime.INTERPRETER:
        cbd = _pow2(min(D, 1 << 12))
        bp = _pow2(min(P, max(1, (1 << 14) // cbd)))
    else:  # column strips 16 to 64 wide, narrow enough for about half the SMs to share the sum
        widest = _pow2(2 * D // runtime.num_sms() + 1) // 2  # largest power of two <= 2D / SMs
        cbd = min(_pow2(D), max(16, min(64, widest)))
        bp = min(_pow2(P), 2048 // cbd)
    return P, n_rblocks, meta, (cdiv(D, cbd), dict(BLOCK_P=bp, BLOCK_D=cbd, num_warps=4))


@tunable("y")
def layer_norm_fwd(y, x, w, b, M, D, eps, rms, xs_m, ys_m):
    """Normalise the M rows of D elements of ``x`` (row stride ``xs_m``, unit column stride) into
    ``y``. Returns (mean or None, rstd), each (M,) in fp32 (fp64 for fp64 inputs)."""
    stat_dtype = accumulation_dtype(x.dtype)
    rstd = runtime.empty((M,), stat_dtype)
    mean = None if rms else runtime.empty((M,), stat_dtype)
    if M == 0:
        return mean, rstd
    programs, meta = _ln_fwd_plan(M, D, x.dtype)
    has_w, has_b = w is not None, b is not None
    plan = _kept_launch((_ln_fwd_kernel, M, D, x.dtype, rms, has_w, has_b),
                        lambda: dict(RMS=rms, HAS_W=has_w, HAS_B=has_b, CD=_cd(x.dtype), **meta), by_value=(8, 9))
    launch_via(launch, plan, (programs,), (x, y, w if has_w else x, b if has_b else x, rstd if rms else mean, rstd,
                                           M, D, xs_m, ys_m, float(eps)))
    return mean, rstd


@tunable("dx", "dw", "db")
def layer_norm_bwd(dx, dw, db, dy, x, w, mean, rstd, M, D, rms, xs_m, gs_m, dxs_m):
    """LayerNorm/RMSNorm backward; any of dx, dw, db may be None (not wanted)."""
    if M == 0:
        for t in (dw, db):
            if t is not None:
                fill_(t, 0.0)
        return
    P, n_rblocks, meta, colsum = _ln_bwd_plan(M, D, x.dtype)
    acc = accumulation_dtype(x.dtype)
    pw = runtime.empty((P, D), acc) if dw is not None else None
    pb = runtime.empty((P, D), acc) if db is not None else None
    has_w, need_x, need_w, need_b = w is not None, dx is not None, dw is not None, db is not None
    plan = _kept_launch((_ln_bwd_kernel, M, D, x.dtype, rms, has_w, need_x, need_w, need_b),
                        lambda: dict(RMS=rms, HAS_W=has_w, NEED_X=need_x, NEED_W=need_w, NEED_B=need_b,
                                     CD=_cd(x.dtype), **meta), by_value=(12, 13, 14))
    launch_via(launch, plan, (P,), (x, dy, w if has_w else x, rstd if mean is None else mean, rstd,
                                    dx if need_x else x, pw if need_w else rstd, pb if need_b else rstd,
                                    M, D, n_rblocks, P, xs_m, gs_m, dxs_m if need_x else 0))
    if pw is None and pb is None:
        return
    if colsum is None:
        for out, part in ((dw, pw), (db, pb)):
            if out is not None:
                reduce_(out, part, 1, P, D, (P * D, D, 1), SUM)
        return
    part = pw if pw is not None else pb
    plan = _kept_launch((_colsum_kernel, M, D, x.dtype, need_w, need_b),
                        lambda: dict(NEED_W=need_w, NEED_B=need_b, **colsum[1]))
    launch_via(launch, plan, (colsum[0],), (part, pb if need_b else part, dw if need_w else part,
                                            db if need_b else part, P, D))


# ---- modulated LayerNorm (AdaLayerNormZero's normalisation) -------------------------------------
#
# x (B, L, C) with batch and row strides of its own and a unit column stride; shift and scale
# (B, C) with any strides (column slices of a modulation output, read in place). Rows are whole
# (C up to MAX_MODULATED_C: one block); grid axis 1 is the batch, so each program loads its
# batch's shift and scale once. Configs: LayerNorm's heuristic (``_ln_default``), not tuned.

MAX_MODULATED_C = 8192


@triton.jit(do_not_specialize=["eps"])
def _ln_modulated_fwd_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, L, C,
                             xs_b, xs_l, sh_b, sh_c, sc_b, sc_c, eps,
                             CD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # y = (x - mean) * rstd * (1 + scale[b]) + shift[b], rstd = 1 / sqrt(var + eps) (biased var)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rm, cm = rows < L, cols < C
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + b * xs_b + (rows * xs_l)[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
    mean = tl.sum(x, axis=1) / C
    d = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
    scale = tl.load(scale_ptr + b * sc_b + cols * sc_c, mask=cm, other=0.0).to(CD)
    shift = tl.load(shift_ptr + b * sh_b + cols * sh_c, mask=cm, other=0.0).to(CD)
    y = d * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]
    tl.store(y_ptr + ((b * L + rows) * C)[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(mean_ptr + b * L + rows, mean, mask=rm)
    tl.store(rstd_ptr + b * L + rows, rstd, mask=rm)


# Backward. xhat = (x - mean) * rstd, dxhat = dy * (1 + scale[b]), means over the row's C:
#   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
#   dshift[b] = sum_l dy, dscale[b] = sum_l dy * xhat: program p of batch b visits row blocks
#   p, p + P, ... (a fixed order) and writes its sums as one partial pair of part (B, P, 2, C),
#   reduced over P afterwards.
@triton.jit
def _ln_modulated_bwd_kernel(x_ptr, dy_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, L, C, n_rblocks, P,
                             xs_b, xs_l, gs_b, gs_l, sc_b, sc_c,
                             NEED_X: tl.constexpr, NEED_MOD: tl.constexpr, CD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < C
    s = 1.0 + tl.load(scale_ptr + b * sc_b + cols * sc_c, mask=cm, other=0.0).to(CD)
    acc_shift = tl.zeros((BLOCK_D,), CD)
    acc_scale = tl.zeros((BLOCK_D,), CD)
    for rb in range(p, n_rblocks, P):
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + rb * BLOCK_M
        rm = rows < L
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + b * xs_b + (rows * xs_l)[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
        dy = tl.load(dy_ptr + b * gs_b + (rows * gs_l)[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
        mean = tl.load(mean_ptr + b * L + rows, mask=rm, other=0.0)
        rstd = tl.load(rstd_ptr + b * L + rows, mask=rm, other=0.0)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        if NEED_X:
            dxhat = dy * s[None, :]
            k1 = tl.sum(dxhat, axis=1) / C
            k2 = tl.sum(dxhat * xhat, axis=1) / C
            dx = rstd[:, None] * (dxhat - k1[:, None] - xhat * k2[:, None])
            tl.store(dx_ptr + ((b * L + rows) * C)[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        if NEED_MOD:
            acc_shift += tl.sum(dy, axis=0)
            acc_scale += tl.sum(dy * xhat, axis=0)
    if NEED_MOD:
        part = part_ptr + (b * P + p) * 2 * C + cols
        tl.store(part, acc_shift, mask=cm)
        tl.store(part + C, acc_scale, mask=cm)


def layer_norm_modulated_fwd(y, x, shift, scale, eps):
    """``y`` (dense (B, L, C)) = LayerNorm(x) * (1 + scale[:, None]) + shift[:, None] for ``x``
    (B, L, C) with a unit column stride and ``shift``, ``scale`` (B, C) with any strides. One launch.
    Returns (mean, rstd), each (B * L,) in fp32 (fp64 for fp64 inputs)."""
    B, L, C = x.shape
    stat_dtype = accumulation_dtype(x.dtype)
    mean, rstd = runtime.empty((B * L,), stat_dtype), runtime.empty((B * L,), stat_dtype)
    if B * L * C == 0:
        return mean, rstd
    cfg = _ln_default(L, C, False)
    launch(_ln_modulated_fwd_kernel, (cdiv(L, cfg["BLOCK_M"]), B), x, shift, scale, y, mean, rstd, L, C,
           x.stride(0), x.stride(1), *shift.stride(), *scale.stride(), float(eps),
           CD=_cd(x.dtype), BLOCK_D=row_block(C), **cfg)
    return mean, rstd


def layer_norm_modulated_bwd(dx, dmod, dy, x, scale, mean, rstd):
    """The backward of ``layer_norm_modulated_fwd``: ``dx`` (dense (B, L, C)) and ``dmod`` ((B, 2, C):
    dshift, then dscale, per batch), either None when not wanted, from ``dy`` (B, L, C) (unit
    column stride). One launch, plus one reduction when ``dmod`` is wanted."""
    B, L, C = x.shape
    if B * L * C == 0:
        if dmod is not None:
            fill_(dmod, 0.0)
        return
    cfg = _ln_default(L, C, True)
    n_rblocks = cdiv(L, cfg["BLOCK_M"])
    P = max(1, min(cdiv(cfg["PROGRAMS"], B), n_rblocks))
    part = runtime.empty((B, P, 2, C), accumulation_dtype(x.dtype)) if dmod is not None else None
    launch(_ln_modulated_bwd_kernel, (P, B), x, dy, scale, mean, rstd, dx if dx is not None else x,
           part if part is not None else mean, L, C, n_rblocks, P, x.stride(0), x.stride(1), dy.stride(0),
           dy.stride(1), *scale.stride(), NEED_X=dx is not None, NEED_MOD=dmod is not None, CD=_cd(x.dtype),
           BLOCK_M=cfg["BLOCK_M"], BLOCK_D=row_block(C), num_warps=cfg["num_warps"])
    if dmod is not None:
        reduce_(dmod, part, B, P, 2 * C, (P * 2 * C, 2 * C, 1), SUM)
