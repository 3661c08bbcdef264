"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost") as transformers' ``Adafactor``: multi-tensor kernels, five launches per step for a bucket of
tensors (one param group, param dtype and grad dtype), however many tensors it holds.

The host packs, once per set of tensors, an int64 row per tensor (``ROW`` entries: the pointers of
parameter, gradient, second-moment state (the factored row state or the full ``exp_avg_sq``),
column state, first moment and ``RMS`` state, the element count and step slot at the places
``flame.kernels.optim._param_grad_rows`` reads them, then the tensor's logical geometry and its
ranges in the scratch buffers below) and three lists of work items ``[tensor, start, kind, tile
class]``. A factored tensor (``ndim >= 2``) is seen as a stack of ``B`` logical ``R x C`` matrices
(its last two *logical* dims; the leading dims, merged where their strides allow, as at most two
dims ``d0 x d1``): its row state ``exp_avg_sq_row`` holds ``B * R`` values, its column state
``exp_avg_sq_col`` ``B * C`` (both contiguous, transformers' shapes ``shape[:-1]`` and
``shape[:-2] + shape[-1:]``). Parameters and gradients may sit in any dense layout (channels-last
conv weights: logical (O, I, kh, kw), memory order (O, kh, kw, I)): kernels reach an element
through its logical index times the strides, or recover its logical index from its memory
position (``index_d = pos // stride_d % size_d``, right for a dense layout).

The launches of one step (t = step + 1, beta2t = 1 - t^decay_rate):

1. ``_stats_kernel``: the new second-moment state. Factored tensors: ROWS items each reduce whole
   lines (all C elements of ``KB`` (b, r) rows) and COLS items whole columns (all R elements of
   ``KB`` (b, c) columns), so each state value is written by exactly one program; tiles are
   ``KB x LB`` with ``LB`` (the reduced dim's block) picked per tensor from a few tile classes,
   dispatched at run time inside one launch. Other tensors: FLAT items update ``exp_avg_sq``
   element for element. ROWS and FLAT items also write the partial sum of p^2 over their elements
   (one slot per item).
2. ``_finish_kernel``: MEANS items reduce the new row state to its per-matrix mean (scratch
   ``means``); one FINISH item per tensor sums its p^2 partials into ``RMS`` (the parameter before
   this update, as transformers), computes the step's learning rate (relative step, warm-up,
   parameter scale) into the per-tensor scalars and advances the step counter.
3. ``_sumsq_kernel``: the partial sums of u^2 over chunks in memory order, u the unclipped update
   ``g / sqrt(second-moment estimate)``.
4. ``_clip_kernel``: one program per tensor sums its u^2 partials: the clip divisor
   ``max(1, RMS(u) / clip_threshold)``.
5. ``_apply_kernel``: u again (same arithmetic as launch 3), clipped, times the learning rate,
   through the first moment (``beta1``), weight decay ``p -= weight_decay * lr * p``, ``p -= u``,
   stored in the parameter's dtype.

Every reduction is two-phase (each partial sum written to its own slot, then summed in a fixed
order by one program): no atomics, bit-for-bit repeatable results. The launch of step 3 recomputes
u rather than storing it (one fp32 buffer the size of the parameters saved, one gradient read
more).

``found_inf`` (int32 device flag, non-zero: skip) masks off every state, parameter and step-counter
write, without a host sync; ``grad_scale`` multiplies every gradient as it is loaded (a fused
unscale). Math is fp32 throughout (transformers' own: bf16/fp16 parameters are updated as fp32
copies and stored back); ``t^decay_rate`` is ``exp2(decay_rate * log2(t))`` in fp32.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from .. import runtime
from .launch import launch
from .optim import _load_param_grad, _param_grad_rows, _sizes, _store_param, rounding_args, tl_dtype

ROW = 24  # int64 entries per tensor row
ITEM = 4  # int64 entries per work item: tensor row, start (element or line), kind, tile class
_ROW = tl.constexpr(ROW)
_ITEM = tl.constexpr(ITEM)

# tensor row: 0 param, 1 grad, 2 row state (factored) or exp_avg_sq, 3 column state, 4 numel, 5 step
# slot (0, 1, 4, 5 where _param_grad_rows reads them), 6 exp_avg, 7 RMS state, 8 factored,
# 9-16 geometry d0, d1, R, C, s0, s1, sR, sC, 17 first entry in `means`, 18-19 range of its p^2
# partials (launch 1 items), 20-21 range of its u^2 partials (flat items), 22 its index
_V, _COL, _M, _RMS, _FACT, _GEO, _MEANS_AT, _PP, _PU, _T = (tl.constexpr(i) for i in (2, 3, 6, 7, 8, 9, 17, 18, 20, 22))
ROWS, COLS, FLAT, MEANS, FINISH = range(5)  # work item kinds
_ROWS, _COLS, _FLAT, _MEANS = (tl.constexpr(k) for k in (ROWS, COLS, FLAT, MEANS))
# tile classes: the reduced dim's block LB (tiles KB x LB, KB = BLOCK // LB)
LINE_BLOCKS = tuple(4 ** c for c in range(5))
_CLASSES = tl.constexpr(len(LINE_BLOCKS))


@triton.jit
def _item(tensors_ptr, work_ptr):
    it = work_ptr + _ITEM * tl.program_id(0).to(tl.int64)
    return tensors_ptr + _ROW * tl.load(it), tl.load(it + 1), tl.load(it + 2), tl.load(it + 3)


@triton.jit
def _geometry(row):
    # d0, d1, R, C and their strides s0, s1, sR, sC
    g = row + _GEO
    return (tl.load(g), tl.load(g + 1), tl.load(g + 2), tl.load(g + 3), tl.load(g + 4), tl.load(g + 5),
            tl.load(g + 6), tl.load(g + 7))


@triton.jit
def _line_tile(x_ptr, p_ptr, dst_ptr, scale_ptr, part_ptr, k0, K, I, sI, d1, s0, s1, L, sL, Kp, eps1, beta2t,
               omb, STATS: tl.constexpr, HAS_SCALE: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr):
    # Lines k0 .. k0 + KB - 1 (those < K) of a logical (B, I, L) view of x: line k is (b, i) = divmod(k, I),
    # (b0, b1) = divmod(b, d1), its element l at b0 s0 + b1 s1 + i sI + l sL.
    #   STATS:  f = (x scale)^2 + eps1;  dst[k] = beta2t dst[k] + omb mean_l f   (a second-moment state line)
    #           part = sum p^2 over the tile's elements of lines k < Kp (p at the same offsets)
    #   else:   dst[k] = mean_l x
    KB: tl.constexpr = BLOCK // LB
    k = k0 + tl.arange(0, KB)
    kmask = k < K
    b = k // I
    base = (b // d1) * s0 + (b % d1) * s1 + (k % I) * sI
    acc = tl.zeros((KB, LB), tl.float32)
    pacc = tl.zeros((KB, LB), tl.float32)
    for l0 in range(0, L, LB):
        lidx = l0 + tl.arange(0, LB)
        mask = kmask[:, None] & (lidx < L)[None, :]
        off = base[:, None] + lidx[None, :] * sL
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if STATS:
            if HAS_SCALE:
                x = x * tl.load(scale_ptr)
            x = tl.where(mask, x * x + eps1, 0.0)
            p = tl.load(p_ptr + off, mask=(k < Kp)[:, None] & mask, other=0.0).to(tl.float32)
            pacc += p * p
        acc += x
    mean = tl.sum(acc, axis=1) / L.to(tl.float32)
    if STATS:
        old = tl.load(dst_ptr + k, mask=kmask, other=0.0)
        tl.store(dst_ptr + k, old * beta2t + omb * mean, mask=kmask)
        tl.store(part_ptr + tl.program_id(0), tl.sum(tl.sum(pacc, axis=1), axis=0))
    else:
        tl.store(dst_ptr + k, mean, mask=kmask)


@triton.jit
def _lines(cls, x_ptr, p_ptr, dst_ptr, scale_ptr, part_ptr, k0, K, I, sI, d1, s0, s1, L, sL, Kp, eps1, beta2t,
           omb, STATS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # _line_tile with the item's tile class: LB = LINE_BLOCKS[cls] = 4^cls, chosen at run time
    for c in tl.static_range(_CLASSES):
        if cls == c:
            _line_tile(x_ptr, p_ptr, dst_ptr, scale_ptr, part_ptr, k0, K, I, sI, d1, s0, s1, L, sL, Kp, eps1, beta2t,
                       omb, STATS, HAS_SCALE, 1 << (2 * c), BLOCK)


@triton.jit(do_not_specialize=["eps1", "decay"])
def _stats_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, part_ptr, eps1, decay,
                  P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # t = step + 1, beta2t = 1 - t^decay, f = g^2 + eps1 (g times grad_scale):
    #   ROWS item: row[b, r] = beta2t row[b, r] + (1 - beta2t) mean_c f[b, r, c]   for its KB lines (b, r)
    #   COLS item: col[b, c] = beta2t col[b, c] + (1 - beta2t) mean_r f[b, r, c]   for its KB lines (b, c)
    #   FLAT item: v = beta2t v + (1 - beta2t) f                                   for its CHUNK elements
    #   part[w] = sum p^2 over the item's elements (ROWS and FLAT items cover each element once; COLS: 0)
    row, start, kind, cls = _item(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    t = (tl.load(steps_ptr + tl.load(row + 5)) + 1).to(tl.float32)
    omb = tl.exp2(decay * tl.log2(t))  # 1 - beta2t
    beta2t = 1.0 - omb
    if kind == _FLAT:
        v_ptr = tl.load(row + _V).to(tl.pointer_type(tl.float32))
        acc = tl.zeros((BLOCK,), tl.float32)
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < n
            p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0)
            tl.store(v_ptr + idx, v * beta2t + omb * (g * g + eps1), mask=mask)
            acc += p * p
        tl.store(part_ptr + tl.program_id(0), tl.sum(acc, axis=0))
    else:
        d0, d1, R, C, s0, s1, sR, sC = _geometry(row)
        is_col = kind == _COLS
        kept = tl.where(is_col, C, R)
        K = tl.where(n > 0, d0 * d1 * kept, 0)  # no lines when found_inf is set
        dst = tl.load(row + _V + is_col.to(tl.int64)).to(tl.pointer_type(tl.float32))
        _lines(cls, g_ptr, p_ptr, dst, scale_ptr, part_ptr, start, K, kept, tl.where(is_col, sC, sR), d1, s0, s1,
               tl.where(is_col, R, C), tl.where(is_col, sR, sC), tl.where(kind == _ROWS, K, 0), eps1, beta2t, omb,
               True, HAS_SCALE, BLOCK)


@triton.jit
def _rms(row, part_ptr, FIELD: tl.constexpr, BLOCK: tl.constexpr):
    # sqrt(sum of part[a0:a1]) / sqrt(numel), (a0, a1) at row[FIELD]: a tensor's RMS from its partial sums
    a0 = tl.load(row + FIELD)
    a1 = tl.load(row + FIELD + 1)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(a0, a1, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + idx, mask=idx < a1, other=0.0)
    return tl.sqrt(tl.sum(acc, axis=0)) / tl.sqrt(tl.load(row + 4).to(tl.float32))


@triton.jit(do_not_specialize=["lr", "eps2"])
def _finish_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, part_ptr, means_ptr, scal_ptr, lr, eps2,
                   HAS_FOUND: tl.constexpr, RELATIVE: tl.constexpr, WARMUP: tl.constexpr, SCALE_PARAM: tl.constexpr,
                   BLOCK: tl.constexpr):
    # MEANS item: means[b] = mean_r row[b, r] for its KB matrices b (the row state after launch 1)
    # FINISH item (one per tensor), t = step + 1:
    #   RMS = sqrt(sum of its p^2 partials) / sqrt(numel)   (stored in its RMS state)
    #   lr_t = (min(1e-6 t if WARMUP else 1e-2, 1 / sqrt(t)) if RELATIVE else lr)
    #          * (max(eps2, RMS) if SCALE_PARAM else 1)
    #   scal[2 i] = lr_t;  steps[slot] = t
    row, start, kind, cls = _item(tensors_ptr, work_ptr)
    live = tl.load(row + 4) >= 0
    if HAS_FOUND:
        live = tl.load(found_ptr) == 0
    if kind == _MEANS:
        d0, d1, R, _, _, _, _, _ = _geometry(row)
        rs = tl.load(row + _V).to(tl.pointer_type(tl.float32))
        _lines(cls, rs, rs, means_ptr + tl.load(row + _MEANS_AT), found_ptr, part_ptr, start,
               tl.where(live, d0 * d1, 0), 1, 0, 1, R, 0, R, 1, 0, 0.0, 0.0, 0.0, False, False, BLOCK)
    else:
        rms = _rms(row, part_ptr, _PP, BLOCK)
        slot = steps_ptr + tl.load(row + 5)
        t = tl.load(slot) + 1
        tf = t.to(tl.float32)
        if RELATIVE:
            if WARMUP:
                min_step = 1e-6 * tf
            else:
                min_step = 1e-2 + 0.0 * tf
            rate = tl.minimum(min_step, 1.0 / tl.sqrt(tf))
        else:
            rate = lr + 0.0 * tf
        if SCALE_PARAM:
            rate = tl.maximum(eps2, rms) * rate
        tl.store(scal_ptr + 2 * tl.load(row + _T), rate)
        tl.store(slot, t, mask=live)
        tl.store(tl.load(row + _RMS).to(tl.pointer_type(tl.float32)), rms, mask=live)


@triton.jit
def _unclipped(row, g, idx, mask, means_ptr):
    # u = g / sqrt(second-moment estimate) at memory positions idx:
    #   factored: u = (rsqrt(row[b, r] / means[b]) * rsqrt(col[b, c])) * g with (b0, b1, r, c) the logical
    #             index of position idx (pos // stride % size per dim), b = b0 d1 + b1;
    #   else:     u = rsqrt(v) * g
    v_ptr = tl.load(row + _V).to(tl.pointer_type(tl.float32))
    if tl.load(row + _FACT) != 0:
        d0, d1, R, C, s0, s1, sR, sC = _geometry(row)
        b = (idx // s0 % d0) * d1 + idx // s1 % d1
        col_ptr = tl.load(row + _COL).to(tl.pointer_type(tl.float32))
        r_factor = tl.load(v_ptr + b * R + idx // sR % R, mask=mask, other=1.0) / \
            tl.load(means_ptr + tl.load(row + _MEANS_AT) + b, mask=mask, other=1.0)
        c = tl.load(col_ptr + b * C + idx // sC % C, mask=mask, other=1.0)
        u = (tl.rsqrt(r_factor) * tl.rsqrt(c)) * g
    else:
        u = tl.rsqrt(tl.load(v_ptr + idx, mask=mask, other=1.0)) * g
    return u


@triton.jit
def _sumsq_kernel(tensors_ptr, work_ptr, found_ptr, scale_ptr, means_ptr, part_ptr, P_DTYPE: tl.constexpr,
                  G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    # part[w] = sum u^2 over the item's chunk (u: _unclipped)
    row, start, _, _ = _item(tensors_ptr, work_ptr)
    _, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr)
        u = _unclipped(row, g, idx, mask, means_ptr)
        acc += tl.where(mask, u * u, 0.0)
    tl.store(part_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["clip"])
def _clip_kernel(tensors_ptr, part_ptr, scal_ptr, clip, BLOCK: tl.constexpr):
    # one program per tensor: scal[2 i + 1] = max(1, sqrt(sum of its u^2 partials) / sqrt(numel) / clip)
    row = tensors_ptr + _ROW * tl.program_id(0).to(tl.int64)
    ratio = _rms(row, part_ptr, _PU, BLOCK) / clip
    tl.store(scal_ptr + 2 * tl.load(row + _T) + 1, tl.where(ratio < 1.0, 1.0, ratio))  # NaN stays NaN


@triton.jit(do_not_specialize=["beta1", "omb1", "wd", "seed"])
def _apply_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, means_ptr, scal_ptr, beta1, omb1, wd, seed,
                  P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_M: tl.constexpr, HAS_WD: tl.constexpr, SR: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    # u = _unclipped / clip divisor * lr_t;  with beta1: m = beta1 m + (1 - beta1) u, u = m
    # p = p - wd lr_t p (weight decay);  p = p - u  (stored in the parameter's dtype, stochastically
    # rounded with SR: optim._store_param, t the step counter launch 2 advanced)
    row, start, _, _ = _item(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    t = tl.load(steps_ptr + tl.load(row + 5))
    ti = tl.load(row + _T)
    rate = tl.load(scal_ptr + 2 * ti)
    div = tl.load(scal_ptr + 2 * ti + 1)
    m_ptr = tl.load(row + _M).to(tl.pointer_type(tl.float32))
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        u = _unclipped(row, g, idx, mask, means_ptr) / div * rate
        if HAS_M:
            u = tl.load(m_ptr + idx, mask=mask, other=0.0) * beta1 + omb1 * u
            tl.store(m_ptr + idx, u, mask=mask)
        if HAS_WD:
            p = p + (-wd * rate) * p
        _store_param(p_ptr, idx, p - u, mask, row, t, seed, SR)


# ---- host side ------------------------------------------------------------------------------

def geometry(buf):
    """(factored, d0, d1, R, C, s0, s1, sR, sC) of a dense parameter buffer: R x C its last two logical
    dims, d0 x d1 its leading dims merged where their strides allow (size-1 dims dropped, strides of
    size-1 dims set to 1). Raises ValueError for factored layouts whose leading dims don't merge
    into two."""
    shape, strides = tuple(buf.shape), tuple(buf.stride())
    if len(shape) < 2:
        return (0, 1, 1, 1, 1, 1, 1, 1, 1)
    lead = []
    for n, s in zip(shape[:-2], strides[:-2]):
        if n == 1:
            continue
        if lead and lead[-1][1] == s * n:  # the outer dim steps over the whole inner one: merge
            lead[-1] = (lead[-1][0] * n, s)
        else:
            lead.append((n, s))
    if len(lead) > 2:
        raise ValueError(f"Adafactor: a parameter of shape {shape} and strides {strides} has leading dims "
                         "that don't merge into two (factored parameters support up to 4 dims in any dense "
                         "layout, more where the leading dims are laid out together)")
    (d0, s0), (d1, s1) = [(1, 1)] * (2 - len(lead)) + lead
    r, c = shape[-2:]
    return (1, d0, d1, r, c, s0, s1, strides[-2] if r > 1 else 1, strides[-1] if c > 1 else 1)


def _line_class(length, inner):
    """Tile class for lines of ``length`` elements: the smallest block LINE_BLOCKS[i] >= length,
    at most 256 when the reduced dim is the kept one's inner (wide tiles read along it), else 16
    (tall tiles read along the kept dim)."""
    top = len(LINE_BLOCKS) - 1 if inner else 2
    for i in range(top):
        if LINE_BLOCKS[i] >= length:
            return i
    return top


def _items(t, count, step, kind, cls=0):
    starts = np.arange(0, count, step, dtype=np.int64)
    out = np.empty((starts.size, ITEM), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = t, starts, kind, cls
    return out


class Tables:
    """Device tables and scratch buffers for one bucket's Adafactor launches.

    ``rows``: per tensor ``(param buffer, grad buffer (the param's layout), state dict, step slot)``,
    the state as ``flame.optim.Adafactor`` keeps it (``exp_avg_sq_row``/``exp_avg_sq_col`` or
    ``exp_avg_sq``, optional ``exp_avg``, ``RMS``). Keeps references to the device tables so they
    outlive the (asynchronous) launches that read them.
    """

    def __init__(self, rows):
        block, chunk = _sizes()
        self.block, self.chunk = block, chunk
        self.count = len(rows)
        table = np.zeros((max(self.count, 1), ROW), dtype=np.int64)
        stats, finish, flat = [], [], []
        n_stats = n_flat = n_means = 0
        for t, (pdata, gdata, st, slot) in enumerate(rows):
            geo = geometry(pdata)
            numel = pdata.numel()
            second = st["exp_avg_sq_row"] if geo[0] else st["exp_avg_sq"]
            col = st["exp_avg_sq_col"].data_ptr() if geo[0] else 0
            m = st["exp_avg"].data_ptr() if "exp_avg" in st else 0
            table[t, :8] = [pdata.data_ptr(), gdata.data_ptr(), second.data_ptr(), col, numel, slot, m,
                            st["RMS"].data_ptr()]
            table[t, 8:17] = geo
            table[t, 17] = n_means
            first = n_stats
            if geo[0]:
                _, d0, d1, r, c, _, _, sr, sc = geo
                for kept, length, kind, inner in ((d0 * d1 * r, c, ROWS, sc <= sr), (d0 * d1 * c, r, COLS, sr < sc)):
                    cls = _line_class(length, inner)
                    stats.append(_items(t, kept, block // LINE_BLOCKS[cls], kind, cls))
                    n_stats += len(stats[-1])
                cls = _line_class(r, True)
                finish.append(_items(t, d0 * d1, block // LINE_BLOCKS[cls], MEANS, cls))
                n_means += d0 * d1
            else:
                stats.append(_items(t, numel, chunk, FLAT))
                n_stats += len(stats[-1])
            flat.append(_items(t, numel, chunk, FLAT))
            table[t, 18:23] = [first, n_stats, n_flat, n_flat + len(flat[-1]), t]
            n_flat += len(flat[-1])
            finish.append(_items(t, 1, 1, FINISH))
        self.tensors = torch.from_numpy(table).to(runtime.device)  # host transfer
        self.stats, self.finish, self.flat = (
            torch.from_numpy(np.concatenate(x) if x else np.zeros((0, ITEM), np.int64)).to(runtime.device)
            for x in (stats, finish, flat))
        self.part_p = runtime.empty((max(n_stats, 1),), torch.float32)
        self.part_u = runtime.empty((max(n_flat, 1),), torch.float32)
        self.means = runtime.empty((max(n_means, 1),), torch.float32)
        self.scalars = runtime.empty((2 * max(self.count, 1),), torch.float32)


def adafactor_step(tables, steps, p_dtype, g_dtype, *, lr, eps, clip_threshold, decay_rate, beta1, weight_decay,
                   scale_parameter, relative_step, warmup_init, found_inf=None, grad_scale=None, rounding=None):
    """One Adafactor update of every tensor in ``tables`` (five launches; ``lr`` is unused with
    ``relative_step``; ``rounding``: the stochastic-rounding seed of bf16 parameters, or None)."""
    if tables.count == 0:
        return
    found = found_inf if found_inf is not None else steps
    scale = grad_scale if grad_scale is not None else steps
    flags = dict(HAS_FOUND=found_inf is not None)
    dtypes = dict(P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), HAS_SCALE=grad_scale is not None, **flags)
    sizes = dict(CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
    if len(tables.stats):
        launch(_stats_kernel, (len(tables.stats),), tables.tensors, tables.stats, steps, found, scale,
               tables.part_p, float(eps[0]), float(decay_rate), **dtypes, **sizes)
    launch(_finish_kernel, (len(tables.finish),), tables.tensors, tables.finish, steps, found, tables.part_p,
           tables.means, tables.scalars, float(lr or 0.0), float(eps[1]), RELATIVE=bool(relative_step),
           WARMUP=bool(warmup_init), SCALE_PARAM=bool(scale_parameter), BLOCK=tables.block, num_warps=4, **flags)
    if len(tables.flat) == 0:
        return
    launch(_sumsq_kernel, (len(tables.flat),), tables.tensors, tables.flat, found, scale, tables.means,
           tables.part_u, **dtypes, **sizes)
    launch(_clip_kernel, (tables.count,), tables.tensors, tables.part_u, tables.scalars, float(clip_threshold),
           BLOCK=tables.block, num_warps=4)
    has_m = beta1 is not None
    seed, sr = rounding_args(rounding, p_dtype)
    launch(_apply_kernel, (len(tables.flat),), tables.tensors, tables.flat, steps, found, scale, tables.means,
           tables.scalars, float(beta1) if has_m else 0.0, 1.0 - float(beta1) if has_m else 0.0,
           float(weight_decay), seed, HAS_M=has_m, HAS_WD=weight_decay != 0, SR=sr, **dtypes, **sizes)
