"""Multi-tensor kernels for optimizers, gradient clipping, gradient packing and moving averages.

Every launch here covers many tensors. The host packs, once per set of tensors, an int64 table of
per-tensor rows ``[param ptr, grad ptr, state0 ptr, state1 ptr, numel, step slot, state2 ptr, state3
ptr]`` (the state buffers an optimizer keeps per parameter: moments, quantization scales, ...) and a
table of work items ``[tensor row, first element]``; program ``w`` of a launch reads work item ``w`` and updates
``CHUNK`` elements of one tensor (``BLOCK`` at a time). Pointers are cast back to typed pointers
inside the kernel, so each launch serves one (param dtype, grad dtype) combination.

Optimizer state is fp32 (moments) plus one int64 step counter per parameter on the device
(``steps``). The update kernel reads the step *before* this update, computes ``step + 1``, and a
tiny second kernel (one program per tensor) then writes ``step + 1`` back: two launches per step
for a parameter group, with no race between programs that read the counter and the one writing it.

Both kernels optionally read a device flag ``found_inf`` (int32, non-zero: skip the update, the
step counter included, as PyTorch's GradScaler skips ``optimizer.step()``) and a device fp32
multiplier ``grad_scale`` applied to every gradient before use (a fused unscale).

Scalars that need more than fp32 precision (betas and lr, which enter ``1 - beta ** step``) are
passed as fp32 (hi, lo) pairs and recombined in fp64 inside the kernel; ``beta ** step`` is computed
in fp64 by binary exponentiation, so bias corrections match PyTorch's double-precision ones.

Every update kernel stores the new parameter through ``_store_param``: rounded to the nearest value
of the parameter's dtype, or, with ``SR`` (stochastic rounding, bf16 parameters only), to one of its
two bf16 neighbours at random with probabilities that make the rounding unbiased (see
``_round_bf16_stochastic``). The random bits are Philox of (``seed``; element index, update index
t, step slot): a pure function of the step counters already on the device, so nothing is drawn on
the host per step (CUDA-graph safe) and a resumed run rounds exactly as an uninterrupted one.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from .. import runtime
from .launch import launch

ROW = 8  # int64 entries per tensor row
_ROW = tl.constexpr(ROW)

NORM_2, NORM_1, NORM_INF, NORM_P = (tl.constexpr(i) for i in range(4))


@triton.jit
def _f64(hi, lo):
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def _powi(base, e):
    # base ** e for a float64 base and a non-negative int64 exponent (binary exponentiation)
    result = base * 0.0 + 1.0
    b = base
    k = e
    while k > 0:
        if (k % 2) == 1:
            result = result * b
        b = b * b
        k = k // 2
    return result


@triton.jit
def _work(tensors_ptr, work_ptr):
    w = tl.program_id(0).to(tl.int64)
    t = tl.load(work_ptr + 2 * w)
    start = tl.load(work_ptr + 2 * w + 1)
    return tensors_ptr + _ROW * t, start


@triton.jit
def _param_grad_rows(row, found_ptr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr):
    # a tensor row's parameter and gradient pointers and its element count (0 when found_inf is set:
    # every element masked off, the update skipped)
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    n = tl.load(row + 4)
    if HAS_FOUND:
        n = tl.where(tl.load(found_ptr) == 0, n, 0)
    return p_ptr, g_ptr, n


@triton.jit
def _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE: tl.constexpr):
    # fp32 parameter and gradient elements, the gradient times grad_scale when given (a fused unscale)
    p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    return p, g


@triton.jit
def _round_bf16_stochastic(x, idx, slot, t, seed):
    # Stochastic rounding of fp32 x to bf16 (a bf16 value is the top half of an fp32 bit pattern):
    #   B = bits(x) = 2^16 H + L (0 <= L < 2^16),  r uniform in [0, 2^16):
    #   result = top half of (B + r) = H + [L + r >= 2^16]:  H + 1 with probability L / 2^16, else H.
    # Bit patterns are sign-magnitude and, within a binade and across its upper edge, evenly spaced in
    # value, so x = value(H) + (L / 2^16) (value(H + 1) - value(H)) and E[result] = x: unbiased, the
    # result always one of x's two bf16 neighbours (x itself when L = 0). inf stays inf (L = 0); the
    # largest finite values go to inf with their probability (inf is the next neighbour); NaN is kept
    # NaN explicitly (a payload in L alone would truncate to inf).
    # r: the top 16 bits of Philox(seed; idx lo, idx hi, t, slot), one stream per (parameter, update, element)
    lo = idx.to(tl.uint32)
    zero = lo * 0
    r, _, _, _ = tl.philox(seed, lo, (idx >> 32).to(tl.uint32), zero + t.to(tl.uint32), zero + slot.to(tl.uint32))
    bits = x.to(tl.uint32, bitcast=True) + (r >> 16)
    rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)  # exact: the low 16 bits are zero


@triton.jit
def _store_param(p_ptr, idx, p, mask, row, t, seed, SR: tl.constexpr):
    # the updated fp32 parameter p into the parameter (its row's step slot at row + 5; t: the update's
    # index, 1 for the first): rounded to nearest, or stochastically to bf16 with SR
    if SR:
        tl.store(p_ptr + idx, _round_bf16_stochastic(p, idx, tl.load(row + 5), t, seed), mask=mask)
    else:
        tl.store(p_ptr + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["lr_hi", "lr_lo", "b1_hi", "b1_lo", "b2_hi", "b2_lo", "eps", "wd", "decay", "seed"])
def _adam_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr,
                 lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, eps, wd, decay, seed,
                 P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, DECOUPLED: tl.constexpr,
                 HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, SR: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    # Adam/AdamW (PyTorch's single-tensor algorithm), t = step + 1:
    #   AdamW: p *= 1 - lr * wd            Adam: g += wd * p
    #   m = m + (1 - b1) (g - m);  v = b2 v + (1 - b2) g^2
    #   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    step = tl.load(steps_ptr + tl.load(row + 5)) + 1
    b1 = _f64(b1_hi, b1_lo)
    b2 = _f64(b2_hi, b2_lo)
    step_size = (_f64(lr_hi, lr_lo) / (1.0 - _powi(b1, step))).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - _powi(b2, step)).to(tl.float32)
    omb1 = (1.0 - b1).to(tl.float32)
    omb2 = (1.0 - b2).to(tl.float32)
    b2f = b2.to(tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        if DECOUPLED:
            p = p * decay
        else:
            g = g + wd * p
        m = m + omb1 * (g - m)
        v = v * b2f + omb2 * (g * g)
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
        _store_param(p_ptr, idx, p, mask, row, step, seed, SR)


@triton.jit(do_not_specialize=["lr", "momentum", "dampening", "wd", "seed"])
def _sgd_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, lr, momentum, dampening, wd, seed,
                P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, SR: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    # SGD (PyTorch's algorithm): g += wd * p;
    #   with momentum: buf = g at the first step, else buf = momentum buf + (1 - dampening) g;
    #   g = g + momentum buf (nesterov) or g = buf;   p -= lr g
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    b_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    prev = tl.load(steps_ptr + tl.load(row + 5))  # 0 before the first update
    n_buf = tl.where(prev != 0, n, 0)  # the momentum buffer is uninitialised before the first update
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        g = g + wd * p
        if MOMENTUM:
            buf = tl.load(b_ptr + idx, mask=idx < n_buf, other=0.0)
            buf = tl.where(prev == 0, g, buf * momentum + (1.0 - dampening) * g)
            tl.store(b_ptr + idx, buf, mask=mask)
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        p = p - lr * g
        _store_param(p_ptr, idx, p, mask, row, prev + 1, seed, SR)


@triton.jit(do_not_specialize=["lr", "b1", "b2", "decay", "seed"])
def _lion_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, lr, b1, b2, decay, seed,
                 P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr,
                 SR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay:
    #   p *= 1 - lr * wd;  p -= lr * sign(b1 m + (1 - b1) g);  m = b2 m + (1 - b2) g
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    step = tl.load(steps_ptr + tl.load(row + 5)) + 1
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        c = b1 * m + (1.0 - b1) * g
        direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        p = p * decay - lr * direction
        tl.store(m_ptr + idx, b2 * m + (1.0 - b2) * g, mask=mask)
        _store_param(p_ptr, idx, p, mask, row, step, seed, SR)


@triton.jit
def _nearest_code(x, qmap_ptr):
    # index of the value nearest to x in a sorted 256-entry map (ties to the lower one): a binary
    # search for the last entry <= x, then that entry or the next
    lo = tl.zeros(x.shape, tl.int32)
    for i in tl.static_range(8):
        cand = lo + (128 >> i)
        lo = tl.where(tl.load(qmap_ptr + cand) <= x, cand, lo)
    hi = tl.minimum(lo + 1, 255)
    nearer_hi = tl.load(qmap_ptr + hi) - x < x - tl.load(qmap_ptr + lo)
    return tl.where(nearer_hi, hi, lo)


@triton.jit(do_not_specialize=["lr", "b1", "b2", "eps", "decay", "seed"])
def _adam8bit_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, qmap_ptr, lr, b1, b2, eps, decay, seed,
                     P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr,
                     SR: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    # Adam with blockwise 8-bit moments (bitsandbytes' AdamW8bit), t = step + 1, per 256-element block:
    #   m = b1 * smap[cm] * am + (1 - b1) g;   v = b2 * umap[cv] * av + (1 - b2) g^2
    #   p += -lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + sqrt(1 - b2^t) eps);   p *= 1 - lr * wd
    #   am, av = max |m|, max v over the block;  cm, cv = the nearest codes to m / am, v / av
    # (smap: the signed dynamic map, umap: the unsigned one; cm moved one code toward m's sign when
    # the nearest code has the other sign). A non-finite gradient element zeroes its moments and
    # leaves its parameter. A tensor whose state2 slot is 0 keeps fp32 moments instead (the same
    # update without the codes: bitsandbytes does so below 4096 elements).
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    step = tl.load(steps_ptr + tl.load(row + 5)) + 1
    bc1 = 1.0 - _powi(tl.cast(b1, tl.float64), step)
    bc2_sqrt = tl.sqrt(1.0 - _powi(tl.cast(b2, tl.float64), step))
    step_size = (-lr * bc2_sqrt / bc1).to(tl.float32)
    eps_c = (eps * bc2_sqrt).to(tl.float32)
    am_addr = tl.load(row + 6)
    quantized = am_addr != 0
    m_codes = tl.load(row + 2).to(tl.pointer_type(tl.uint8))  # state0/1 as codes, or as fp32 moments
    v_codes = tl.load(row + 3).to(tl.pointer_type(tl.uint8))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    am_ptr = am_addr.to(tl.pointer_type(tl.float32))
    av_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    blocks = start // 256 + tl.arange(0, ROWS)
    cols = tl.arange(0, 256)
    for off in range(0, CHUNK, ROWS * 256):
        block = blocks + off // 256
        idx = block[:, None] * 256 + cols[None, :]
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        finite = tl.abs(g) < float("inf")  # false for inf and NaN
        bmask = block * 256 < n
        if quantized:
            cm = tl.load(m_codes + idx, mask=mask, other=0).to(tl.int32)
            cv = tl.load(v_codes + idx, mask=mask, other=0).to(tl.int32)
            m = tl.load(qmap_ptr + cm) * tl.load(am_ptr + block, mask=bmask, other=0.0)[:, None]
            v = tl.load(qmap_ptr + 256 + cv) * tl.load(av_ptr + block, mask=bmask, other=0.0)[:, None]
        else:
            m = tl.load(m_ptr + idx, mask=mask, other=0.0)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        keep = finite & mask
        m = tl.where(keep, m * b1 + (1.0 - b1) * g, 0.0)
        v = tl.where(keep, v * b2 + (1.0 - b2) * (g * g), 0.0)
        new_p = (p + step_size * (m / (tl.sqrt(v) + eps_c))) * decay
        _store_param(p_ptr, idx, tl.where(finite, new_p, p), mask, row, step, seed, SR)
        if quantized:
            am = tl.max(tl.abs(m), axis=1)
            av = tl.max(v, axis=1)
            tl.store(am_ptr + block, am, mask=bmask)
            tl.store(av_ptr + block, av, mask=bmask)
            cm = _nearest_code(tl.where(am[:, None] > 0, m / am[:, None], 0.0), qmap_ptr)
            code_neg = tl.load(qmap_ptr + cm) < 0
            cm = tl.where((m < 0) & ~code_neg, cm - 1, tl.where((m > 0) & code_neg, cm + 1, cm))
            cv = _nearest_code(tl.where(av[:, None] > 0, v / av[:, None], 0.0), qmap_ptr + 256)
            tl.store(m_codes + idx, cm.to(tl.uint8), mask=mask)
            tl.store(v_codes + idx, cv.to(tl.uint8), mask=mask)
        else:
            tl.store(m_ptr + idx, m, mask=mask)
            tl.store(v_ptr + idx, v, mask=mask)


# Prodigy's device scalars (fp64): the D estimate, its running maximum, the numerator's running
# sum, the global step k, the step's d * lr * bias correction (read by the update), d_hat,
# whether the update is skipped (no gradient moved the estimate yet), and the initial estimate d0
PRODIGY_D, PRODIGY_D_MAX, PRODIGY_NUM, PRODIGY_K, PRODIGY_DLR, PRODIGY_D_HAT, PRODIGY_SKIP, PRODIGY_D0 = (
    tl.constexpr(i) for i in range(8))


@triton.jit
def _prodigy_dlr(scalars_ptr, lr, b1, b2, BIAS_CORRECTION: tl.constexpr):
    # d * lr, times sqrt(1 - b2^(k+1)) / (1 - b1^(k+1)) with the bias correction
    dlr = tl.load(scalars_ptr + PRODIGY_D) * lr
    if BIAS_CORRECTION:
        k = tl.load(scalars_ptr + PRODIGY_K).to(tl.int64) + 1
        dlr = dlr * tl.sqrt(1.0 - _powi(tl.cast(b2, tl.float64), k)) / (1.0 - _powi(tl.cast(b1, tl.float64), k))
    return dlr


@triton.jit(do_not_specialize=["part_base", "total", "lr", "b1", "b2", "b3", "wd"])
def _prodigy_stats_kernel(tensors_ptr, work_ptr, found_ptr, scale_ptr, scalars_ptr, part_ptr, part_base, total,
                          lr, b1, b2, b3, wd, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
                          DECOUPLED: tl.constexpr, BIAS_CORRECTION: tl.constexpr, SAFEGUARD: tl.constexpr,
                          HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    # Prodigy's first pass (Mishchenko & Defazio 2023; prodigyopt 1.1.2), with d the current estimate:
    #   g += wd p (coupled decay);  m = b1 m + d (1 - b1) g;  v = b2 v + d^2 (1 - b2) g^2
    #   s = b3 s + (d / d0) * (d if safeguard else dlr) * g
    #   partials: (d / d0) dlr <g, p0 - p> and sum |s|, into part[w] and part[total + w]
    # slots: m (state0), v (state1), s (state2), p0 (state3: the parameter at the first step)
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    s_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    p0_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    d64 = tl.load(scalars_ptr + PRODIGY_D)
    d0 = tl.load(scalars_ptr + PRODIGY_D0)
    dlr64 = _prodigy_dlr(scalars_ptr, lr, b1, b2, BIAS_CORRECTION)
    d = d64.to(tl.float32)
    weight = (d64 / d0 * dlr64).to(tl.float32)
    if SAFEGUARD:
        s_weight = (d64 / d0 * d64).to(tl.float32)
    else:
        s_weight = weight
    dot = tl.zeros((BLOCK,), tl.float32)
    s_abs = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p, g = _load_param_grad(p_ptr, g_ptr, scale_ptr, idx, mask, HAS_SCALE)
        if not DECOUPLED:
            g = g + wd * p
        p0 = tl.load(p0_ptr + idx, mask=mask, other=0.0)
        dot += g * (p0 - p)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0) * b1 + d * (1.0 - b1) * g
        v = tl.load(v_ptr + idx, mask=mask, other=0.0) * b2 + d * d * (1.0 - b2) * (g * g)
        s = tl.load(s_ptr + idx, mask=mask, other=0.0) * b3 + s_weight * g
        s_abs += tl.abs(s)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
        tl.store(s_ptr + idx, s, mask=mask)
    w = part_base + tl.program_id(0).to(tl.int64)
    tl.store(part_ptr + w, weight * tl.sum(dot, axis=0))
    tl.store(part_ptr + total + w, tl.sum(s_abs, axis=0))


@triton.jit(do_not_specialize=["total", "lr", "b1", "b2", "b3", "d_coef", "growth"])
def _prodigy_estimate_kernel(found_ptr, scalars_ptr, part_ptr, total, lr, b1, b2, b3, d_coef, growth,
                             BIAS_CORRECTION: tl.constexpr, HAS_FOUND: tl.constexpr, BLOCK: tl.constexpr):
    # one program: numerator = b3 numerator + sum part[:total];  denominator = sum part[total:]
    #   d_hat = d_coef numerator / denominator;  d = max(d, d_hat) while d is still d0;
    #   d_max = max(d_max, d_hat);  d = min(d_max, growth d);  k += 1
    # (a zero denominator: no gradient yet, the update is skipped and nothing changes)
    num = tl.zeros((BLOCK,), tl.float64)
    den = tl.zeros((BLOCK,), tl.float64)
    for off in range(0, total, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        num += tl.load(part_ptr + idx, mask=idx < total, other=0.0).to(tl.float64)
        den += tl.load(part_ptr + total + idx, mask=idx < total, other=0.0).to(tl.float64)
    numerator = tl.load(scalars_ptr + PRODIGY_NUM) * b3 + tl.sum(num, axis=0)
    denominator = tl.sum(den, axis=0)
    run = denominator != 0
    if HAS_FOUND:
        run = run & (tl.load(found_ptr) == 0)
    d = tl.load(scalars_ptr + PRODIGY_D)
    d_max = tl.load(scalars_ptr + PRODIGY_D_MAX)
    d_hat = d_coef * numerator / tl.where(run, denominator, 1.0)
    new_d = tl.where(d == tl.load(scalars_ptr + PRODIGY_D0), tl.maximum(d, d_hat), d)
    new_max = tl.maximum(d_max, d_hat)
    new_d = tl.minimum(new_max, new_d * growth)
    dlr = _prodigy_dlr(scalars_ptr, lr, b1, b2, BIAS_CORRECTION)  # before k moves
    tl.store(scalars_ptr + PRODIGY_D, tl.where(run, new_d, d))
    tl.store(scalars_ptr + PRODIGY_D_MAX, tl.where(run, new_max, d_max))
    tl.store(scalars_ptr + PRODIGY_NUM, tl.where(run, numerator, tl.load(scalars_ptr + PRODIGY_NUM)))
    tl.store(scalars_ptr + PRODIGY_K, tl.load(scalars_ptr + PRODIGY_K) + tl.where(run, 1.0, 0.0))
    tl.store(scalars_ptr + PRODIGY_DLR, dlr)
    tl.store(scalars_ptr + PRODIGY_D_HAT, tl.where(run, d_hat, tl.load(scalars_ptr + PRODIGY_D_HAT)))
    tl.store(scalars_ptr + PRODIGY_SKIP, tl.where(run, 0.0, 1.0))


@triton.jit(do_not_specialize=["b1", "wd", "eps", "seed"])
def _prodigy_update_kernel(tensors_ptr, work_ptr, steps_ptr, found_ptr, scale_ptr, scalars_ptr, b1, wd, eps, seed,
                           P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, DECOUPLED: tl.constexpr,
                           HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, SR: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK: tl.constexpr):
    # Prodigy's second pass, with d the new estimate and dlr the step's (from the old d):
    #   p -= wd dlr p (decoupled);  p -= dlr m / (sqrt(v) + d eps)   (b1 = 0: p -= dlr d g / (...))
    row, start = _work(tensors_ptr, work_ptr)
    p_ptr, g_ptr, n = _param_grad_rows(row, found_ptr, P_DTYPE, G_DTYPE, HAS_FOUND)
    n = tl.where(tl.load(scalars_ptr + PRODIGY_SKIP) == 0, n, 0)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    d = tl.load(scalars_ptr + PRODIGY_D).to(tl.float32)
    dlr = tl.load(scalars_ptr + PRODIGY_DLR).to(tl.float32)
    step = tl.load(steps_ptr + tl.load(row + 5)) + 1
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        denom = tl.sqrt(tl.load(v_ptr + idx, mask=mask, other=0.0)) + d * eps
        if DECOUPLED:
            p = p - wd * dlr * p
        if b1 > 0:
            p = p - dlr * tl.load(m_ptr + idx, mask=mask, other=0.0) / denom
        else:
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALE:
                g = g * tl.load(scale_ptr)
            p = p - dlr * d * g / denom
        _store_param(p_ptr, idx, p, mask, row, step, seed, SR)


@triton.jit
def _advance_kernel(tensors_ptr, steps_ptr, found_ptr, HAS_FOUND: tl.constexpr):
    # one program per tensor row: steps[slot] += 1 (unless found_inf)
    row = tensors_ptr + _ROW * tl.program_id(0).to(tl.int64)
    slot = tl.load(row + 5)
    s = tl.load(steps_ptr + slot)
    if HAS_FOUND:
        s = tl.where(tl.load(found_ptr) == 0, s + 1, s)
    else:
        s = s + 1
    tl.store(steps_ptr + slot, s)


@triton.jit(do_not_specialize=["p", "part_base"])
def _norm_partial_kernel(tensors_ptr, work_ptr, part_ptr, part_base, p,
                         G_DTYPE: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # partial[w] = sum |g|^p over this work item's chunk (max |g| for the inf-norm), in fp32
    row, start = _work(tensors_ptr, work_ptr)
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    n = tl.load(row + 4)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        a = tl.abs(tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32))
        if NORM == NORM_2:
            acc += a * a
        elif NORM == NORM_1:
            acc += a
        elif NORM == NORM_INF:
            acc = tl.where((a > acc) | (a != a), a, acc)
        else:
            acc += tl.where(a > 0, tl.exp(p * tl.log(a)), 0.0)
    if NORM == NORM_INF:
        has_nan = tl.max((acc != acc).to(tl.int32), axis=0) > 0
        res = tl.where(has_nan, float("nan"), tl.max(acc, axis=0))
    else:
        res = tl.sum(acc, axis=0)
    tl.store(part_ptr + part_base + tl.program_id(0).to(tl.int64), res)


@triton.jit(do_not_specialize=["n", "p", "max_norm"])
def _norm_finish_kernel(part_ptr, n, norm_ptr, coef_ptr, p, max_norm, NORM: tl.constexpr, BLOCK: tl.constexpr):
    # one program: norm = (sum partials)^(1/p) (max for inf); coef = min(1, max_norm / (norm + 1e-6))
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, n, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(part_ptr + idx, mask=idx < n, other=0.0)
        if NORM == NORM_INF:
            acc = tl.where((x > acc) | (x != x), x, acc)
        else:
            acc += x
    if NORM == NORM_INF:
        has_nan = tl.max((acc != acc).to(tl.int32), axis=0) > 0
        norm = tl.where(has_nan, float("nan"), tl.max(acc, axis=0))
    else:
        total = tl.sum(acc, axis=0)
        if NORM == NORM_2:
            norm = tl.sqrt(total)
        elif NORM == NORM_1:
            norm = total
        else:
            norm = tl.where(total > 0, tl.exp(tl.log(total) / p), 0.0)
    coef = max_norm / (norm + 1e-6)
    coef = tl.where(coef > 1.0, 1.0, coef)  # NaN stays NaN, as torch.clamp(max=1)
    tl.store(norm_ptr, norm)
    tl.store(coef_ptr, coef)


@triton.jit
def _scale_kernel(tensors_ptr, work_ptr, coef_ptr, G_DTYPE: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    # g *= coef (a device scalar)
    row, start = _work(tensors_ptr, work_ptr)
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    n = tl.load(row + 4)
    c = tl.load(coef_ptr)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(g_ptr + idx, (g * c).to(G_DTYPE), mask=mask)


@triton.jit(do_not_specialize=["a", "b", "flag"])
def _axpby_kernel(tensors_ptr, work_ptr, a, b, flag_ptr, flag, dst_base, scale_ptr, S_DTYPE: tl.constexpr,
                  D_DTYPE: tl.constexpr, READ_DST: tl.constexpr, HAS_FLAG: tl.constexpr, DST_OFFSET: tl.constexpr,
                  HAS_SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # dst = a * src + b * dst (dst: slot 0, src: slot 1; dst is not read when b == 0, READ_DST off:
    # it may hold anything); program 0 also stores the host's ``flag`` into its fp32 slot. With
    # DST_OFFSET slot 0 holds dst's element offset from ``dst_base`` (one buffer per call, fixed tables);
    # with HAS_SCALE a is multiplied by the device scalar at ``scale_ptr`` (fp32) first
    row, start = _work(tensors_ptr, work_ptr)
    if HAS_SCALE:
        a = a * tl.load(scale_ptr)
    if DST_OFFSET:
        d_ptr = dst_base + tl.load(row)
    else:
        d_ptr = tl.load(row).to(tl.pointer_type(D_DTYPE))
    s_ptr = tl.load(row + 1).to(tl.pointer_type(S_DTYPE))
    n = tl.load(row + 4)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(s_ptr + idx, mask=mask, other=0.0).to(tl.float32) * a
        if READ_DST:
            x += tl.load(d_ptr + idx, mask=mask, other=0.0).to(tl.float32) * b
        tl.store(d_ptr + idx, x.to(D_DTYPE), mask=mask)
    if HAS_FLAG:
        tl.store(flag_ptr, flag, mask=tl.program_id(0) == 0)


@triton.jit(do_not_specialize=["first", "count", "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9", "p10",
                                "p11", "p12", "p13", "p14", "p15"])
def _set_sources_kernel(tensors_ptr, first, count, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14,
                        p15):
    # slot 1 (the source pointer) of rows first .. first + count - 1 = p0 .. p(count - 1)
    row = tensors_ptr + first.to(tl.int64) * _ROW + 1
    tl.store(row, p0, mask=count > 0)
    tl.store(row + _ROW, p1, mask=count > 1)
    tl.store(row + 2 * _ROW, p2, mask=count > 2)
    tl.store(row + 3 * _ROW, p3, mask=count > 3)
    tl.store(row + 4 * _ROW, p4, mask=count > 4)
    tl.store(row + 5 * _ROW, p5, mask=count > 5)
    tl.store(row + 6 * _ROW, p6, mask=count > 6)
    tl.store(row + 7 * _ROW, p7, mask=count > 7)
    tl.store(row + 8 * _ROW, p8, mask=count > 8)
    tl.store(row + 9 * _ROW, p9, mask=count > 9)
    tl.store(row + 10 * _ROW, p10, mask=count > 10)
    tl.store(row + 11 * _ROW, p11, mask=count > 11)
    tl.store(row + 12 * _ROW, p12, mask=count > 12)
    tl.store(row + 13 * _ROW, p13, mask=count > 13)
    tl.store(row + 14 * _ROW, p14, mask=count > 14)
    tl.store(row + 15 * _ROW, p15, mask=count > 15)


# ---- host side ------------------------------------------------------------------------------

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}


def tl_dtype(dtype):
    if dtype not in _TL:
        raise TypeError(f"multi-tensor kernels support fp32/fp16/bf16/fp64 buffers, got {dtype}")
    return _TL[dtype]


def _sizes():
    """(BLOCK, CHUNK): one block per program on the interpreter (each program costs ~1.5 ms there),
    GPU-sized blocks with several per program otherwise."""
    if runtime.INTERPRETER:
        return 4096, 4096
    return 1024, 8192


def _split(x):
    """A Python float as an fp32 (hi, lo) pair whose fp64 sum is ``x`` to ~48 bits."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def rounding_args(rounding, p_dtype):
    """(seed, SR) of an update launch: ``rounding``, the stochastic-rounding seed of bf16 parameters,
    or None to round to nearest."""
    if rounding is None:
        return 0, False
    if p_dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding stores bf16 parameters, got {p_dtype} ones")
    return int(rounding), True


class Tables:
    """Device tables for one multi-tensor launch set.

    ``rows``: per tensor ``(param, grad, state0, ..., state3)`` buffers (torch tensors, element
    offsets as ints for kernels that add them to a base pointer, or None for unused slots;
    trailing ones may be left out), the element count and the step slot. Keeps
    references to the tables so they outlive the (asynchronous) launches that read them.
    """

    def __init__(self, rows):
        block, chunk = _sizes()
        self.block, self.chunk = block, chunk
        self.count = len(rows)
        n = len(rows)
        table = np.zeros((n, ROW), dtype=np.int64)
        if n:
            ptrs = np.zeros((n, 6), dtype=np.int64)
            for i, (bufs, _, _) in enumerate(rows):
                ptrs[i, : len(bufs)] = [0 if b is None else b if isinstance(b, int) else b.data_ptr() for b in bufs]
            table[:, [0, 1, 2, 3, 6, 7]] = ptrs
            table[:, 4] = [r[1] for r in rows]
            table[:, 5] = [r[2] for r in rows]
        chunks = (table[:, 4] + chunk - 1) // chunk
        tensor_of = np.repeat(np.arange(n, dtype=np.int64), chunks)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        work_arr = np.stack([tensor_of, (np.arange(tensor_of.size, dtype=np.int64) - first) * chunk], axis=1)
        self.num_work = int(tensor_of.size)
        self._table = table
        self.tensors = torch.from_numpy(table).to(runtime.device)  # host transfer
        self.work = torch.from_numpy(work_arr).to(runtime.device)

    def set_grads(self, ptrs):
        """Point the rows' gradients (slot 1) at the addresses ``ptrs``, one per row in row order, the
        rest as built: one host transfer of the rewritten table and no rebuild, for an optimizer whose
        gradients are new buffers each step (a CUDA graph's replays keep their captured buffers)."""
        self._table[:, 1] = ptrs
        self.tensors = torch.from_numpy(self._table).to(runtime.device)  # host transfer


def adam_step(tables, steps, p_dtype, g_dtype, lr, beta1, beta2, eps, weight_decay, decoupled,
              found_inf=None, grad_scale=None, rounding=None):
    """One Adam/AdamW update of every tensor in ``tables`` (two launches); ``rounding``: the
    stochastic-rounding seed (bf16 parameters) or None, in this and the other update launches."""
    if tables.num_work == 0:
        return
    lr_hi, lr_lo = _split(lr)
    b1_hi, b1_lo = _split(beta1)
    b2_hi, b2_lo = _split(beta2)
    decay = 1.0 - lr * weight_decay
    seed, sr = rounding_args(rounding, p_dtype)
    launch(_adam_kernel, (tables.num_work,), tables.tensors, tables.work, steps,
           found_inf if found_inf is not None else steps, grad_scale if grad_scale is not None else steps,
           lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, float(eps), float(weight_decay), float(decay), seed,
           P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), DECOUPLED=bool(decoupled),
           HAS_FOUND=found_inf is not None, HAS_SCALE=grad_scale is not None, SR=sr,
           CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
    advance(tables, steps, found_inf)


def sgd_step(tables, steps, p_dtype, g_dtype, lr, momentum, dampening, weight_decay, nesterov,
             found_inf=None, grad_scale=None, rounding=None):
    """One SGD update of every tensor in ``tables`` (two launches)."""
    if tables.num_work == 0:
        return
    seed, sr = rounding_args(rounding, p_dtype)
    launch(_sgd_kernel, (tables.num_work,), tables.tensors, tables.work, steps,
           found_inf if found_inf is not None else steps, grad_scale if grad_scale is not None else steps,
           float(lr), float(momentum), float(dampening), float(weight_decay), seed,
           P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), MOMENTUM=momentum != 0, NESTEROV=bool(nesterov),
           HAS_FOUND=found_inf is not None, HAS_SCALE=grad_scale is not None, SR=sr,
           CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
    advance(tables, steps, found_inf)


def lion_step(tables, steps, p_dtype, g_dtype, lr, beta1, beta2, weight_decay, found_inf=None, grad_scale=None,
              rounding=None):
    """One Lion update of every tensor in ``tables`` (two launches: the update, the step counters)."""
    if tables.num_work == 0:
        return
    seed, sr = rounding_args(rounding, p_dtype)
    launch(_lion_kernel, (tables.num_work,), tables.tensors, tables.work, steps,
           found_inf if found_inf is not None else steps, grad_scale if grad_scale is not None else steps,
           float(lr), float(beta1), float(beta2), 1.0 - float(lr) * float(weight_decay), seed,
           P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), HAS_FOUND=found_inf is not None,
           HAS_SCALE=grad_scale is not None, SR=sr, CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
    advance(tables, steps, found_inf)


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' dynamic 8-bit quantization map (Dettmers 2016), 256 sorted fp32 values in
    [-1, 1] (signed) or [0, 1]: for each decade 10^(e-6), e = 0..6, the midpoints of 2^e (signed;
    2^(e+1) unsigned) equal steps of [0.1, 1] times it (and their negatives when signed), then 0 and 1.
    Dense near zero, where most moments lie."""
    values = [0.0, 1.0]
    for e in range(7):
        count = 2 ** e if signed else 2 ** (e + 1)
        edges = np.linspace(0.1, 1.0, count + 1, dtype=np.float32)
        mids = (np.float32(10.0 ** (e - 6)) * ((edges[:-1] + edges[1:]) / np.float32(2))).astype(np.float32)
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    return np.sort(np.asarray(values, dtype=np.float32))


_QMAPS = {}


def quantization_maps():
    """The signed map then the unsigned one, 512 fp32 values on the device (made once)."""
    dev = runtime.device
    if dev not in _QMAPS:
        _QMAPS[dev] = torch.from_numpy(np.concatenate([dynamic_map(True), dynamic_map(False)])).to(dev)
    return _QMAPS[dev]


def adam8bit_step(tables, steps, p_dtype, g_dtype, lr, beta1, beta2, eps, weight_decay, found_inf=None,
                  grad_scale=None, rounding=None):
    """One 8-bit-state AdamW update (bitsandbytes' semantics) of every tensor in ``tables``, whose
    state slots hold (m codes, v codes, m block maxima, v block maxima), or (m, v) in fp32."""
    if tables.num_work == 0:
        return
    rows = tables.chunk // 256 if runtime.INTERPRETER else 4  # the interpreter: one pass per program
    seed, sr = rounding_args(rounding, p_dtype)
    launch(_adam8bit_kernel, (tables.num_work,), tables.tensors, tables.work, steps,
           found_inf if found_inf is not None else steps, grad_scale if grad_scale is not None else steps,
           quantization_maps(), float(lr), float(beta1), float(beta2), float(eps),
           1.0 - float(lr) * float(weight_decay), seed,
           P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), HAS_FOUND=found_inf is not None,
           HAS_SCALE=grad_scale is not None, SR=sr, CHUNK=tables.chunk, ROWS=rows, num_warps=4)
    advance(tables, steps, found_inf)


def prodigy_step(buckets, steps, scalars, lr, beta1, beta2, beta3, decoupled, d_coef, growth_rate,
                 bias_correction, safeguard_warmup, found_inf=None, grad_scale=None):
    """One Prodigy update of every tensor of ``buckets`` ([(Tables, param dtype, grad dtype, weight
    decay, eps, stochastic-rounding seed or None)]): a
    statistics launch per bucket, one launch for the new D estimate (``scalars``, fp64 device
    values indexed by ``PRODIGY_*``), an update launch per bucket, the step counters."""
    buckets = [b for b in buckets if b[0].num_work]
    total = sum(b[0].num_work for b in buckets)
    if not total:
        return
    partial = runtime.empty((2 * total,), torch.float32)
    found = found_inf if found_inf is not None else scalars
    scale = grad_scale if grad_scale is not None else scalars
    flags = dict(HAS_FOUND=found_inf is not None, HAS_SCALE=grad_scale is not None)
    base = 0
    for tables, p_dtype, g_dtype, weight_decay, _, _ in buckets:
        launch(_prodigy_stats_kernel, (tables.num_work,), tables.tensors, tables.work, found, scale, scalars,
               partial, base, total, float(lr), float(beta1), float(beta2), float(beta3), float(weight_decay),
               P_DTYPE=tl_dtype(p_dtype), G_DTYPE=tl_dtype(g_dtype), DECOUPLED=bool(decoupled),
               BIAS_CORRECTION=bool(bias_correction), SAFEGUARD=bool(safeguard_warmup), **flags,
               CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
        base += tables.num_work
    block = _finish_block(total)
    launch(_prodigy_estimate_kernel, (1,), found, scalars, partial, total, float(lr), float(beta1), float(beta2),
           float(beta3), float(d_coef), float(growth_rate), BIAS_CORRECTION=bool(bias_correction),
           HAS_FOUND=found_inf is not None, BLOCK=block, num_warps=4)
    for tables, p_dtype, g_dtype, weight_decay, eps, rounding in buckets:
        seed, sr = rounding_args(rounding, p_dtype)
        launch(_prodigy_update_kernel, (tables.num_work,), tables.tensors, tables.work, steps, found, scale, scalars,
               float(beta1), float(weight_decay), float(eps), seed, P_DTYPE=tl_dtype(p_dtype),
               G_DTYPE=tl_dtype(g_dtype), DECOUPLED=bool(decoupled), **flags, SR=sr, CHUNK=tables.chunk,
               BLOCK=tables.block, num_warps=4)
        advance(tables, steps, found_inf)


def advance(tables, steps, found_inf=None):
    """steps[slot] += 1 for every tensor row (unless found_inf is set)."""
    launch(_advance_kernel, (tables.count,), tables.tensors, steps,
           found_inf if found_inf is not None else steps, HAS_FOUND=found_inf is not None)


def _norm_code(norm_type):
    if norm_type == 2.0:
        return NORM_2.value
    if norm_type == 1.0:
        return NORM_1.value
    if norm_type == float("inf"):
        return NORM_INF.value
    return NORM_P.value


def _finish_block(total):
    """Block of a one-program launch that sums ``total`` partials: GPU-sized, or on the
    interpreter (one block per pass) the partials rounded up to a power of two."""
    return 1024 if not runtime.INTERPRETER else max(16, 1 << max(0, (min(total, 1 << 16) - 1).bit_length()))


def grad_norm_(buckets, norm_out, coef_out, norm_type, max_norm):
    """Total ``norm_type``-norm of every gradient in ``buckets`` ([(Tables, grad dtype)]) into
    ``norm_out`` (fp32, 1 element) and the clip coefficient min(1, max_norm / (norm + 1e-6)) into
    ``coef_out``: one partial-sum launch per bucket, then one finishing launch."""
    code = _norm_code(norm_type)
    total = sum(t.num_work for t, _ in buckets)
    partial = runtime.empty((max(total, 1),), torch.float32)
    base = 0
    for tables, g_dtype in buckets:
        if tables.num_work == 0:
            continue
        launch(_norm_partial_kernel, (tables.num_work,), tables.tensors, tables.work, partial, base,
               float(norm_type) if code == NORM_P.value else 2.0, G_DTYPE=tl_dtype(g_dtype), NORM=code,
               CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)
        base += tables.num_work
    block = _finish_block(total)
    launch(_norm_finish_kernel, (1,), partial, total, norm_out, coef_out,
           float(norm_type) if code == NORM_P.value else 2.0, float(max_norm), NORM=code, BLOCK=block, num_warps=4)


def scale_(buckets, coef):
    """g *= coef[0] for every gradient in ``buckets`` (one launch per bucket)."""
    for tables, g_dtype in buckets:
        if tables.num_work == 0:
            continue
        launch(_scale_kernel, (tables.num_work,), tables.tensors, tables.work, coef, G_DTYPE=tl_dtype(g_dtype),
               CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)


def axpby_(tables, src_dtype, dst_dtype, a, b, flag_out=None, flag=0.0, dst_base=None, scale=None):
    """dst = a * src + b * dst for every (dst, src) row of ``tables``, in one launch (``b == 0``: dst
    is only written); ``flag_out`` (an fp32 element), when given, is set to ``flag``. ``dst_base``
    (a buffer of ``dst_dtype``): the rows' dst entries are element offsets into it. ``scale`` (an
    fp32 element): ``a`` times its value at run time (read by a CUDA graph's replay). Packs gradients
    for the data-parallel all-reduce, keeps exponential moving averages, copies and casts weights."""
    if tables.num_work == 0:
        return
    launch(_axpby_kernel, (tables.num_work,), tables.tensors, tables.work, float(a), float(b),
           flag_out if flag_out is not None else tables.tensors, float(flag),
           dst_base if dst_base is not None else tables.tensors, scale if scale is not None else tables.tensors,
           S_DTYPE=tl_dtype(src_dtype), D_DTYPE=tl_dtype(dst_dtype), READ_DST=b != 0, HAS_FLAG=flag_out is not None,
           DST_OFFSET=dst_base is not None, HAS_SCALE=scale is not None, CHUNK=tables.chunk, BLOCK=tables.block,
           num_warps=4)


SOURCES_PER_LAUNCH = 16


def set_sources_(tables, sources, first=0):
    """The source entries (slot 1) of rows ``first, first + 1, ...`` of ``tables`` = ``sources``'
    buffers, written by kernels that take the pointers as arguments: no host-to-device copy, so a
    CUDA graph captures it and its replays write the pointers of the capture (fixed tables whose
    sources are buffers made anew by each call, e.g. a backward's gradients)."""
    for at in range(0, len(sources), SOURCES_PER_LAUNCH):
        ptrs = [s.data_ptr() for s in sources[at:at + SOURCES_PER_LAUNCH]]
        count = len(ptrs)
        ptrs += [ptrs[0]] * (SOURCES_PER_LAUNCH - count)  # unused: one launch variant (every pointer an int64)
        launch(_set_sources_kernel, (1,), tables.tensors, first + at, count, *ptrs, num_warps=1)
