"""Flash attention: FlashAttention-2 forward and blockwise backward over strided q/k/v.

Problem: ``O = softmax(Q K^T * scale + M) V`` per (batch, head), with Q (Lq, D), K and V (Lk, D)
(D up to 512 in the forward, up to 256 in the backward),
an optional mask M (additive float, or boolean where True keeps a score) and an optional causal
mask with PyTorch's top-left alignment (query i sees keys j <= i, whatever Lq and Lk are).

Layout: every operand comes as a base pointer plus (batch, head, row) strides; the head dim is
contiguous (stride 1). A (B, L, H, D) projection permuted to (B, H, L, D) is read in place. Masks
come with four strides (0 where broadcast). The log-sum-exp and ``delta`` buffers are dense
(B*H, Lq) in fp32 (fp64 for fp64 inputs).

Kernels (all programs of one (batch, head) pair index it as ``pid_bh = b * H + h``):
- ``_attn_fwd_kernel``: one program per BLOCK_M query rows (or M_GROUP query blocks that share
  one K/V block when Lk fits in BLOCK_N: the cross-attention path, K/V loaded once per program).
  Online softmax in base 2 with the scale folded in: ``s2 = (q.k * scale + m) * log2(e)``; the
  row statistics (max, sum) are rescaled as each key block arrives (with a positive scale the max
  is taken over the raw q.k and each probability costs one FMA). From KV_TMA_MIN_KEYS keys on, on
  Hopper, the K/V blocks of the loop arrive through TMA tensor descriptors. Stores O and
  ``lse2 = max + log2(sum)`` (base-2 log-sum-exp of the scaled scores; +inf for a row whose
  every key is masked out: its output is 0 and so are its gradients, as in PyTorch's
  ``_safe_softmax`` path). Above head dim 256 the value/output columns may be split over
  programs (grid axis 2, BLOCK_DV columns each; see ``ACC_REGS``): each slice recomputes the
  scores over the whole head dim, and the first one stores lse2.
  On sm_90 with Gluon, the unmasked, non-causal head-dim-128 calls run the warp-specialised
  kernels of ``attention_hopper.py`` instead (route "gluon", forward and backward), which write
  the same O and lse2. Which kernels run a call is data: see "routes" below (``plan``).
- ``_attn_bwd_preprocess_kernel``: ``delta_i = sum_d dO[i, d] * O[i, d]``.
- ``_attn_bwd_dkdv_kernel``: one program per BLOCK_N keys (and per chunk of query blocks),
  looping over query blocks; recomputes P from lse2. With FUSED_DQ (every key in one block)
  it also writes dQ of each query block it visits, so short K/V needs no second kernel.
- ``_attn_bwd_dq_kernel``: one program per BLOCK_M queries, looping over key blocks.
- ``_sum_chunks_kernel``: sums the fp32 partial dK/dV of query chunks (deterministic, no atomics).

Loops are split into an unmasked stage (key blocks fully inside [0, Lk) and fully at or below
the causal diagonal) and a masked stage (the diagonal and the ragged last block), so the common
blocks pay no ``where``. Loads and stores are masked on both sequence ends and on the head dim
(BLOCK_D is D rounded up to a power of 2).

Interpreter notes (as in matmul.py): bf16 dot inputs are upcast (the interpreter's bf16 dot is
wrong); fp32 dots use ``input_precision="ieee"``; fp64 inputs accumulate in fp64.
"""
import dataclasses
import functools
import os
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from . import attention_hopper
from .launch import Plan, launch, launch_via
from .matmul import RouteMemo, tma_available

# The forward's K/V loop reads through TMA descriptors where the GPU and the layout allow it
# (route "kv_tma") and there are at least KV_TMA_MIN_KEYS keys; FLAME_ATTN_TMA=0 turns that off
# (TMA_SWITCH). Measured on an H200 (Triton 3.6, bf16, the tuned configs): 2-7% faster at 4096
# keys (head dims 64 and 128, batch 1 and 4), 5% slower at 1024.
TMA_SWITCH = os.environ.get("FLAME_ATTN_TMA", "1") != "0"
KV_TMA = not runtime.INTERPRETER and TMA_SWITCH
KV_TMA_MIN_KEYS = 2048
# On an sm_90 GPU with Gluon, the calls that ``attention_hopper.usable`` accepts and whose head dim
# is in HOPPER_HEAD_DIMS[direction] run the warp-specialised Gluon kernels of attention_hopper.py
# (route "gluon", ``_gluon_refusal``; the backward's dO TMA-readable too); FLAME_ATTN_GLUON=0 turns
# both off, FLAME_ATTN_GLUON_BWD=0 the backward's (the portable kernels below then serve those calls).
# Measured on an H200 (Triton 3.6, bf16, scripts/attention_lab.py, one process): forward, Flux's
# 1x24x4608x128 0.453 ms against 0.522 here (cuDNN SDPA 0.448); SDXL's head dim 64 with three consumer
# warpgroups, 1x10x4096 0.101 against 0.111 here (cuDNN 0.111), 4x10x4096 0.375 against 0.411 (0.383),
# 1x20x1024 0.018 against 0.019 (0.023). Backward: Flux 1.52 ms against 1.73 here (cuDNN 1.31); at head
# dim 64 the Gluon backward is slower (SDXL, 4096 tokens: 0.394 against 0.329), so 64 stays here.
HOPPER_FWD = not runtime.INTERPRETER and os.environ.get("FLAME_ATTN_GLUON", "1") != "0"
HOPPER_BWD = HOPPER_FWD and os.environ.get("FLAME_ATTN_GLUON_BWD", "1") != "0"
FORWARD, BACKWARD = "forward", "backward"  # an AttentionProblem's direction
HOPPER_HEAD_DIMS = {FORWARD: (64, 128), BACKWARD: (128,)}

# log2(e) = 1.4426950408889634 (written inline in jit code)
LOG2E = 1.4426950408889634


# ---- shared pieces of the forward and backward kernels -------------------------------------------

@triton.jit
def _offsets(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Row indices start .. start + BLOCK (int64 when offsets may pass 2^31)."""
    offs = start + tl.arange(0, BLOCK)
    if WIDE:
        offs = offs.to(tl.int64)
    return offs


@triton.jit
def _load_rows(base, offs, offs_d, L, row_stride, HEAD_DIM, UPCAST: tl.constexpr):
    """Rows ``offs`` of a head's (L, HEAD_DIM) operand at ``base`` (row stride ``row_stride``, the
    head dim contiguous), columns ``offs_d``; zeros past L and HEAD_DIM; fp32 with UPCAST (the
    interpreter's bf16 dot is wrong). Q, K, V and dO tiles alike."""
    t = tl.load(base + offs[:, None] * row_stride + offs_d[None, :],
                mask=(offs < L)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _mask_scores(s, mask_base, offs_m, offs_n, Lq, Lk, smm, smn, add_scale, MASK_KIND: tl.constexpr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, KEY_BOUND: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The score tile ``s`` (queries x keys, or keys x queries with TRANSPOSED) with the user mask
    applied (MASK_KIND 1: additive, times ``add_scale``; 2: boolean, False -> -inf) and, in a
    MASKED stage of the loops, keys past Lk (KEY_BOUND) and, with CAUSAL, keys after the query
    (top-left diagonal) set to -inf."""
    if TRANSPOSED:
        m2 = offs_m[None, :]
        n2 = offs_n[:, None]
    else:
        m2 = offs_m[:, None]
        n2 = offs_n[None, :]
    if MASK_KIND == 1:
        am = tl.load(mask_base + m2 * smm + n2 * smn, mask=(m2 < Lq) & (n2 < Lk), other=0.0)
        s = s + am.to(s.dtype) * add_scale
    elif MASK_KIND == 2:
        am = tl.load(mask_base + m2 * smm + n2 * smn, mask=(m2 < Lq) & (n2 < Lk), other=0)
        s = tl.where(am != 0, s, float("-inf"))
    if MASKED:
        if CAUSAL:
            keep = n2 <= m2
            if KEY_BOUND:
                keep = keep & (n2 < Lk)
            s = tl.where(keep, s, float("-inf"))
        elif KEY_BOUND:
            s = tl.where(n2 < Lk, s, float("-inf"))
    return s


@triton.jit
def _key_stages(start_m, Lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(n_full, hi) for the query block at ``start_m``: key blocks [0, n_full) lie inside [0, Lk) and
    (CAUSAL) at or below the diagonal for every row, so they need no masks; [n_full, hi) do."""
    if CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
        n_full = tl.minimum((Lk // BLOCK_N) * BLOCK_N, ((start_m + 1) // BLOCK_N) * BLOCK_N)
    else:
        hi = Lk
        n_full = (Lk // BLOCK_N) * BLOCK_N
    return n_full, hi


# ---- forward ----------------------------------------------------------------------------------

@triton.jit
def _fwd_update(acc, m_i, l_i, q, k, v, offs_m, offs_n, mask_base, Lq, Lk, qk_scale, smm, smn,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                ACC: tl.constexpr, PRECISION: tl.constexpr, POS_SCALE: tl.constexpr):
    # One key block: the online-softmax rescale of (acc, m_i, l_i), in base 2. With a positive
    # scale the row max is taken over the raw scores QK^T and each probability costs one FMA,
    # exp2(qk * scale - m); otherwise the scores are scaled first (scale 1 afterwards).
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC)
    scale = qk_scale
    if not POS_SCALE:
        qk = qk * qk_scale
        scale = 1.0
    qk = _mask_scores(qk, mask_base, offs_m, offs_n, Lq, Lk, smm, smn, 1.4426950408889634 / scale,
                      MASK_KIND=MASK_KIND, MASKED=MASKED, CAUSAL=CAUSAL, KEY_BOUND=True, TRANSPOSED=False)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    m_use = m_new
    if MASKED or MASK_KIND != 0:  # a row may have seen only -inf so far: subtract 0 (m_i stays -inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION, out_dtype=ACC)
    return acc, m_new, l_i


@triton.jit
def _fwd_loop(acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, dv0, lo, hi, Lq, Lk, qk_scale,
              skn, svn, smm, smn,
              HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr, WIDE: tl.constexpr, KV_TMA: tl.constexpr, POS_SCALE: tl.constexpr):
    # k_src/v_src: this head's K and V base pointers, or (KV_TMA) their tensor descriptors. K is
    # read over the whole head dim (offs_d), V over this program's value columns dv0 + [0, BLOCK_DV).
    offs_dv = dv0 + tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = _offsets(start_n, BLOCK_N, WIDE)
        if KV_TMA:  # rows past Lk arrive as zeros
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, dv0])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
        else:
            k = _load_rows(k_src, offs_n, offs_d, Lk, skn, HEAD_DIM, UPCAST)
            v = _load_rows(v_src, offs_n, offs_dv, Lk, svn, HEAD_DIM, UPCAST)
        acc, m_i, l_i = _fwd_update(acc, m_i, l_i, q, k, v, offs_m, offs_n, mask_base, Lq, Lk, qk_scale,
                                    smm, smn, MASKED, CAUSAL, MASK_KIND, ACC, PRECISION, POS_SCALE)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, mask_ptr,
                     H, Lq, Lk, qk_scale,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, smb, smh, smm, smn,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, M_GROUP: tl.constexpr, SINGLE_KV: tl.constexpr,
                     CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ACC: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr, KV_TMA: tl.constexpr,
                     POS_SCALE: tl.constexpr):
    pid_g = tl.program_id(0)
    if CAUSAL:  # the longest rows (most key blocks) first
        pid_g = tl.num_programs(0) - 1 - pid_g
    pid_bh = tl.program_id(1)
    pid_dv = tl.program_id(2)  # which BLOCK_DV columns of V and O (one slice unless BLOCK_DV < BLOCK_D)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q_base = q_ptr + b * sqb + h * sqh
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    o_base = o_ptr + b * sob + h * soh
    mask_base = mask_ptr + b * smb + h * smh
    lse_base = lse_ptr + pid_bh.to(tl.int64) * Lq
    offs_d = tl.arange(0, BLOCK_D)
    dv0 = pid_dv * BLOCK_DV
    offs_dv = dv0 + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM
    if SINGLE_KV:  # every key in one block: load K/V once for all M_GROUP query blocks
        offs_n = _offsets(0, BLOCK_N, WIDE)
        k = _load_rows(k_base, offs_n, offs_d, Lk, skn, HEAD_DIM, UPCAST)
        v = _load_rows(v_base, offs_n, offs_dv, Lk, svn, HEAD_DIM, UPCAST)
    k_src = k_base
    v_src = v_base
    if KV_TMA:  # K/V blocks by TMA (Hopper): one descriptor each per program
        k_src = tl.make_tensor_descriptor(k_base, shape=[Lk, HEAD_DIM], strides=[skn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[Lk, HEAD_DIM], strides=[svn, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    for g in range(M_GROUP):
        start_m = (pid_g * M_GROUP + g) * BLOCK_M
        offs_m = _offsets(start_m, BLOCK_M, WIDE)
        row_ok = offs_m < Lq
        q = _load_rows(q_base, offs_m, offs_d, Lq, sqm, HEAD_DIM, UPCAST)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=ACC)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
        l_i = tl.zeros((BLOCK_M,), dtype=ACC)
        if SINGLE_KV:
            acc, m_i, l_i = _fwd_update(acc, m_i, l_i, q, k, v, offs_m, offs_n, mask_base, Lq, Lk, qk_scale,
                                        smm, smn, True, CAUSAL, MASK_KIND, ACC, PRECISION, POS_SCALE)
        else:
            n_full, hi = _key_stages(start_m, Lk, BLOCK_M, BLOCK_N, CAUSAL)
            acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, dv0, 0, n_full,
                                      Lq, Lk, qk_scale, skn, svn, smm, smn, HEAD_DIM, BLOCK_DV, BLOCK_N, False,
                                      CAUSAL, MASK_KIND, ACC, PRECISION, UPCAST, WIDE, KV_TMA, POS_SCALE)
            acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, dv0, n_full, hi,
                                      Lq, Lk, qk_scale, skn, svn, smm, smn, HEAD_DIM, BLOCK_DV, BLOCK_N, True,
                                      CAUSAL, MASK_KIND, ACC, PRECISION, UPCAST, WIDE, KV_TMA, POS_SCALE)
        empty = l_i == 0.0  # every key masked out (or Lk == 0): output 0, lse +inf
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
        tl.store(o_base + offs_m[:, None] * som + offs_dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
        if pid_dv == 0:  # every slice computed the same statistics: the first one stores them
            tl.store(lse_base + offs_m, lse, mask=row_ok)


# ---- backward ---------------------------------------------------------------------------------
# Notation per (batch, head): S = Q K^T * scale + M, P = softmax_rows(S), O = P V, dO = dL/dO.
#   dV = P^T dO
#   dP = dO V^T
#   dS = P * (dP - delta),   delta_i = sum_j P_ij dP_ij = sum_d dO_id O_id   (softmax backward)
#   dQ = dS K * scale,       dK = dS^T Q * scale
# P is recomputed blockwise from the saved base-2 log-sum-exp: P_ij = exp2(S_ij * log2(e) - lse2_i).
# The mask gets no gradient. Rows with lse2 = +inf (fully masked, or padding rows past Lq, which
# load lse2 = +inf) have P = 0 and so contribute nothing.

# delta_i = sum_d dO[i, d] * O[i, d]  (= rowsum(P * dP), the softmax-backward correction term)
@triton.jit
def _attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, H, Lq, sob, soh, som, sdb, sdh, sdm,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                                ACC: tl.constexpr, WIDE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = _offsets(pid_m * BLOCK_M, BLOCK_M, WIDE)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < Lq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(o_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(do_ptr + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), 1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _bwd_kv_loop(dk, dv, k, v, q_base, do_base, o_base, lse_base, delta_base, mask_base, dq_base, offs_n, offs_d,
                 lo, hi, Lq, Lk, qk_scale, sm_scale, sqm, sdom, som, sdqm, smm, smn,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 KEY_BOUND: tl.constexpr, MASK_KIND: tl.constexpr, FUSED_DQ: tl.constexpr,
                 ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr):
    # Transposed scores for one key block against query blocks lo..hi:
    #   S^T = K Q^T (BLOCK_N, BLOCK_M), P^T = exp2(S^T - lse2), dV += P^T dO,
    #   dP^T = V dO^T, dS^T = P^T * (dP^T - delta), dK += dS^T Q  (scaled by `scale` at the end),
    #   and with FUSED_DQ (the block holds every key, so this program is the only one to see these
    #   query rows): delta = rowsum(dO * O) computed here and dQ = dS K * scale for this query block.
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = _offsets(start_m, BLOCK_M, WIDE)
        row_ok = offs_m < Lq
        q = _load_rows(q_base, offs_m, offs_d, Lq, sqm, HEAD_DIM, UPCAST)
        do = _load_rows(do_base, offs_m, offs_d, Lq, sdom, HEAD_DIM, UPCAST)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
        if FUSED_DQ:
            o = _load_rows(o_base, offs_m, offs_d, Lq, som, HEAD_DIM, False)
            delta = tl.sum(o.to(ACC) * do.to(ACC), 1)
        else:
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION, out_dtype=ACC) * qk_scale
        st = _mask_scores(st, mask_base, offs_m, offs_n, Lq, Lk, smm, smn, 1.4426950408889634, MASK_KIND=MASK_KIND,
                          MASKED=MASKED, CAUSAL=CAUSAL, KEY_BOUND=KEY_BOUND, TRANSPOSED=True)
        pt = tl.math.exp2(st - lse[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION, out_dtype=ACC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION, out_dtype=ACC)
        dst = pt * (dpt - delta[None, :])
        dst_lp = dst.to(q.dtype)
        dk = tl.dot(dst_lp, q, dk, input_precision=PRECISION, out_dtype=ACC)
        if FUSED_DQ:
            dq = tl.dot(tl.trans(dst_lp), k, input_precision=PRECISION, out_dtype=ACC) * sm_scale
            tl.store(dq_base + offs_m[:, None] * sdqm + offs_d[None, :], dq.to(dq_base.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    return dk, dv


# dK_j = scale * sum_i dS_ij Q_i,  dV_j = sum_i P_ij dO_i,  dS = P * (dO V^T - delta)
# (one program: BLOCK_N keys x one chunk of query blocks; FUSED_DQ also writes dQ_i = scale * dS_i K)
@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, mask_ptr,
                          H, Lq, Lk, qk_scale, sm_scale, blocks_per_chunk,
                          sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sob, soh, som,
                          sdkc, sdkb, sdkh, sdkn, sdvc, sdvb, sdvh, sdvn, sdqb, sdqh, sdqm,
                          smb, smh, smm, smn,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                          FUSED_DQ: tl.constexpr, KEY_BOUND: tl.constexpr, ACC: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_c = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = _offsets(start_n, BLOCK_N, WIDE)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = (offs_n < Lk)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = _load_rows(k_ptr + b * skb + h * skh, offs_n, offs_d, Lk, skn, HEAD_DIM, UPCAST)
    v = _load_rows(v_ptr + b * svb + h * svh, offs_n, offs_d, Lk, svn, HEAD_DIM, UPCAST)
    q_base = q_ptr + b * sqb + h * sqh
    do_base = do_ptr + b * sdob + h * sdoh
    o_base = o_ptr + b * sob + h * soh
    dq_base = dq_ptr + b * sdqb + h * sdqh
    mask_base = mask_ptr + b * smb + h * smh
    lse_base = lse_ptr + pid_bh.to(tl.int64) * Lq
    delta_base = delta_ptr + pid_bh.to(tl.int64) * Lq
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    m_lo = pid_c * blocks_per_chunk * BLOCK_M
    m_hi = tl.minimum(m_lo + blocks_per_chunk * BLOCK_M, Lq)
    if CAUSAL:
        # query blocks before the one holding row start_n see none of these keys; blocks from
        # diag_end on see all of them (every row >= start_n + BLOCK_N - 1)
        lo = tl.maximum(m_lo, (start_n // BLOCK_M) * BLOCK_M)
        diag_end = ((start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, o_base, lse_base, delta_base, mask_base, dq_base, offs_n,
                              offs_d, lo, tl.minimum(diag_end, m_hi), Lq, Lk, qk_scale, sm_scale, sqm, sdom, som,
                              sdqm, smm, smn, HEAD_DIM, BLOCK_M, True, CAUSAL, KEY_BOUND, MASK_KIND, FUSED_DQ, ACC,
                              PRECISION, UPCAST, WIDE)
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, o_base, lse_base, delta_base, mask_base, dq_base, offs_n,
                              offs_d, tl.maximum(lo, diag_end), m_hi, Lq, Lk, qk_scale, sm_scale, sqm, sdom, som,
                              sdqm, smm, smn, HEAD_DIM, BLOCK_M, KEY_BOUND, False, KEY_BOUND, MASK_KIND, FUSED_DQ, ACC,
                              PRECISION, UPCAST, WIDE)
    else:
        dk, dv = _bwd_kv_loop(dk, dv, k, v, q_base, do_base, o_base, lse_base, delta_base, mask_base, dq_base, offs_n,
                              offs_d, m_lo, m_hi, Lq, Lk, qk_scale, sm_scale, sqm, sdom, som, sdqm, smm, smn,
                              HEAD_DIM, BLOCK_M, KEY_BOUND, False, KEY_BOUND, MASK_KIND, FUSED_DQ, ACC, PRECISION,
                              UPCAST, WIDE)
    dk = dk * sm_scale
    c = pid_c.to(tl.int64)
    tl.store(dk_ptr + c * sdkc + b * sdkb + h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(dv_ptr + c * sdvc + b * sdvb + h * sdvh + offs_n[:, None] * sdvn + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, mask_base, offs_m, offs_d, lo, hi, Lq, Lk, qk_scale,
                skn, svn, smm, smn,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                MASK_KIND: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                WIDE: tl.constexpr):
    # S = Q K^T (BLOCK_M, BLOCK_N), P = exp2(S - lse2), dP = dO V^T, dS = P * (dP - delta), dQ += dS K
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = _offsets(start_n, BLOCK_N, WIDE)
        k = _load_rows(k_base, offs_n, offs_d, Lk, skn, HEAD_DIM, UPCAST)
        v = _load_rows(v_base, offs_n, offs_d, Lk, svn, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * qk_scale
        s = _mask_scores(s, mask_base, offs_m, offs_n, Lq, Lk, smm, smn, 1.4426950408889634, MASK_KIND=MASK_KIND,
                         MASKED=MASKED, CAUSAL=CAUSAL, KEY_BOUND=True, TRANSPOSED=False)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION, out_dtype=ACC)
    return dq


# dQ_i = scale * sum_j dS_ij K_j,  dS_ij = P_ij * (dO_i . V_j - delta_i)
# (one program: BLOCK_M queries, looping over key blocks up to the causal diagonal)
@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, mask_ptr,
                        H, Lq, Lk, qk_scale, sm_scale,
                        sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
                        smb, smh, smm, smn,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                        ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows (most key blocks) first
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = _offsets(start_m, BLOCK_M, WIDE)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = _load_rows(q_ptr + b * sqb + h * sqh, offs_m, offs_d, Lq, sqm, HEAD_DIM, UPCAST)
    do = _load_rows(do_ptr + b * sdob + h * sdoh, offs_m, offs_d, Lq, sdom, HEAD_DIM, UPCAST)
    lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=0.0)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    mask_base = mask_ptr + b * smb + h * smh
    n_full, hi = _key_stages(start_m, Lk, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
    dq = _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, mask_base, offs_m, offs_d, 0, n_full, Lq, Lk,
                     qk_scale, skn, svn, smm, smn, HEAD_DIM, BLOCK_N, False, CAUSAL, MASK_KIND, ACC, PRECISION,
                     UPCAST, WIDE)
    dq = _bwd_q_loop(dq, q, do, lse, delta, k_base, v_base, mask_base, offs_m, offs_d, n_full, hi, Lq, Lk,
                     qk_scale, skn, svn, smm, smn, HEAD_DIM, BLOCK_N, True, CAUSAL, MASK_KIND, ACC, PRECISION,
                     UPCAST, WIDE)
    dq = dq * sm_scale
    tl.store(dq_ptr + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=ok)


# out[b, h, n, :] = sum_c part[c, b*H + h, n, :]  (partial dK/dV of query chunks; fixed order)
# dK = sum_c partial_dK[c], dV = sum_c partial_dV[c] over the query chunks, in chunk order
# (program_id(2) picks dK (0) or dV (1); the partials are (2, chunks, B*H, L, D) dense)
@triton.jit
def _sum_chunks_kernel(part_ptr, dk_ptr, dv_ptr, H, L, C, spc, spbh, spn, skb, skh, skn, svb, svh, svn,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                       ACC: tl.constexpr):
    pid_l = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_l = (pid_l * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_l < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = part_ptr + (which * C).to(tl.int64) * spc + pid_bh.to(tl.int64) * spbh + offs_l[:, None] * spn
    src += offs_d[None, :]
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=ACC)
    for c in range(0, C):
        acc += tl.load(src + c * spc, mask=ok, other=0.0).to(ACC)
    if which == 0:
        dst = dk_ptr + b * skb + h * skh + offs_l[:, None] * skn
    else:
        dst = dv_ptr + b * svb + h * svh + offs_l[:, None] * svn
    tl.store(dst + offs_d[None, :], acc.to(dk_ptr.dtype.element_ty), mask=ok)


# ---- launch configuration ---------------------------------------------------------------------

def _pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a, b):
    return -(-a // b)


# Lk at or below this uses the short-K/V paths (K/V in one block: forward loads them once per
# program; backward fuses dQ into the dK/dV kernel and splits the query range over programs).
SHORT_KV_MAX = 128
# Tests set this to a dict of block sizes to exercise the multi-block paths in the interpreter
# (BLOCK_M, BLOCK_N; optionally M_GROUP, CHUNK, KV_TMA and the forward's BLOCK_DV).
FORCE_BLOCKS = None


def _switches(dtype, gpu):
    """(ACC, PRECISION, UPCAST) of the portable kernels for ``dtype`` on a GPU (``gpu``) or the interpreter."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    # fp32 attention is for tests: exact products (no tf32) everywhere; fp16/bf16 ignore it on the GPU
    precision = "ieee" if (not gpu or dtype in (torch.float32, torch.float64)) else "tf32"
    upcast = not gpu and dtype == torch.bfloat16
    return acc, precision, upcast


def stats_dtype(dtype):
    """Dtype of the saved log-sum-exp and delta buffers."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _short_max(esize, bd):
    """Largest Lk served by the short-K/V paths: K and V of that many rows must fit in shared
    memory next to the query tiles, so 4- and 8-byte dtypes (tests only) and head dims above 128
    get shorter ones (above 256: 32 keys of 2 bytes, 16 of more, K and V at most 64 KiB each)."""
    if runtime.INTERPRETER or (esize <= 2 and bd <= 128):
        return SHORT_KV_MAX
    if bd > 256:
        return SHORT_KV_MAX // 4 if esize <= 2 else SHORT_KV_MAX // 8
    return SHORT_KV_MAX // 4 if esize >= 8 else SHORT_KV_MAX // 2


def short_kv(Lk, D, esize):
    """Whether ``Lk`` keys of head dim ``D`` in ``esize``-byte elements take the short-K/V paths."""
    return Lk <= _short_max(esize, max(16, _pow2(D)))


def _configured(impl):
    """``impl`` memoised per shape, except while a test forces block sizes (FORCE_BLOCKS); the
    memo is registered with ``flame.tune`` so that ``tune.override`` and ``tune.reset`` reach it.
    Callers only read the returned configs."""
    cached = tune.memoised(impl)

    @functools.wraps(impl)
    def config(*args):
        return impl(*args) if FORCE_BLOCKS is not None else cached(*args)

    return config


@_configured
def _fwd_config(Lq, Lk, D, BH, dtype):
    """Forward launch config: BLOCK_D, BLOCK_M, BLOCK_N, M_GROUP, SINGLE_KV, KV_TMA, num_warps,
    num_stages, and BLOCK_DV where the value columns are split.

    BLOCK_M, BLOCK_N, M_GROUP, num_warps and num_stages come from ``flame.tune`` (kernel
    "attention_fwd", key (Lq, Lk, D, B*H)): a tuning-table entry on the GPU, else
    ``_fwd_heuristic``. BLOCK_D is D rounded up to a power of two; SINGLE_KV (K/V loaded once per
    program) holds when Lk is short (``short_kv``) and fits in one BLOCK_N block, so that every
    entry gives a correct launch. BLOCK_DV, the value/output columns of one program
    (``_dv_block``, from the tile and the warps), is there only when it is less than BLOCK_D
    (head dims above 256); without it a program takes all of them."""
    esize = dtype.itemsize
    bd = max(16, _pow2(D))
    short = short_kv(Lk, D, esize)
    if FORCE_BLOCKS is not None:
        bm, bn = FORCE_BLOCKS["BLOCK_M"], FORCE_BLOCKS["BLOCK_N"]
        short = short and Lk <= bn
        cfg = dict(BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn if not short else max(16, _pow2(Lk)),
                   M_GROUP=FORCE_BLOCKS.get("M_GROUP", 1) if short else 1, SINGLE_KV=short,
                   KV_TMA=FORCE_BLOCKS.get("KV_TMA", False) and not short and bd == D, num_warps=4, num_stages=1)
        dv = FORCE_BLOCKS.get("BLOCK_DV", bd)
    else:
        cfg = ATTN_FWD.config((Lq, Lk, D, BH), dtype)
        single = short and Lk <= cfg["BLOCK_N"]
        cfg = dict(cfg, BLOCK_D=bd, SINGLE_KV=single,
                   KV_TMA=KV_TMA and not single and bd == D and Lk >= KV_TMA_MIN_KEYS)
        dv = _dv_block(bd, cfg["BLOCK_M"], cfg["num_warps"], esize)
    return cfg if dv >= bd else dict(cfg, BLOCK_DV=dv)


# Head dims above 256 (the SDXL VAE's single-head attention has 512): the (BLOCK_M, BLOCK_D)
# accumulator of O no longer fits in registers next to the Q tile and the scores (64 x 512 fp32
# is 128 registers a thread with 8 warps, and Triton keeps the loop-invariant Q tile in
# registers as well). A program then accumulates only BLOCK_DV of the value columns (grid axis
# 2 walks the slices): each slice recomputes the scores Q K^T over the whole head dim and the
# same row statistics (max, sum, lse), and multiplies by its columns of V. The accumulator gets
# at most ACC_REGS registers per thread; more warps (a tuning entry's num_warps) keep more
# columns per program. With two slices the forward does 1.5x the FLOPs, bought back by the
# taller tile: K/V are read once per 128 query rows and each warpgroup runs 64-row wgmmas.
# Measured on an H100 (Triton 3.6, bf16, one head of D = 512, Lq = Lk = 16384; SDPA 4.52 ms):
# 128 x 32 tiles, 8 warps, 2 stages, two slices of 256, TMA K/V: 2.15 ms (256 TFLOP/s of
# useful work; 2.31 ms without TMA); the same with 128 x 64 tiles and one stage 1.97 ms, but it
# needs all of Hopper's shared memory; unsplit 64 x 64 (8 warps, one stage) 2.40 ms, 64 x 32
# (two stages) 2.86 ms; 64 x 32 in two slices 5.25 ms, 128 x 32 in four slices 4.00 ms. At
# 4096 tokens: the 128 x 32 split 0.241 ms (SDPA 0.335), 32 x 32 unsplit (4 warps) 0.245,
# 64 x 64 unsplit 0.276. With TMA plus a mask or causal, the 2-stage config can pass the 227 KB
# of shared memory (Triton 3.9 compiled it to 232 KB): ``launch`` then runs it with one stage.
# Chunking the Q K^T product over D instead would free the Q tile's registers, but would read
# Q again for every key block.
ACC_REGS = 128


def _dv_block(bd, bm, warps, esize):
    """Value/output columns per program: all of BLOCK_D up to head dim 256, above it the widest
    power-of-two slice whose accumulator (BLOCK_M x BLOCK_DV, 2 registers per fp64 element) holds
    at most ACC_REGS registers per thread of ``warps`` warps and at most half of the SM's 64K
    registers (16 warps get 128 registers a thread in all). The interpreter takes every column."""
    if bd <= 256 or runtime.INTERPRETER:
        return bd
    budget = min(ACC_REGS * 32 * warps, 32768)
    dv = bd
    while dv > 16 and bm * dv * max(1, esize // 4) > budget:
        dv //= 2
    return dv


def _fwd_heuristic(Lq, Lk, bd, BH, esize, short):
    """attention_fwd's default config (BLOCK_M, BLOCK_N, M_GROUP, num_warps, num_stages)."""
    if runtime.INTERPRETER:  # ~1.5 ms per program: few, big programs
        return dict(BLOCK_M=max(16, _pow2(min(Lq, 128))), BLOCK_N=max(16, _pow2(min(Lk, 128))), M_GROUP=1,
                    num_warps=4, num_stages=1)
    # GPU heuristics from a sweep on an H200 (Triton 3.6, bf16, the bench shapes): 64x64 tiles with
    # 4 warps beat 128-row tiles at batch 1 (1.03x SDPA's time at 4096 tokens against 1.59x);
    # with many programs (batch 4) 128 rows and 8 warps win. Head dim 128 with K/V by TMA (Flux:
    # 24 heads of 4608 tokens) takes 128x128 tiles, 8 warps, 3 stages (230 KB of shared memory):
    # 0.531 ms against 0.582 for 64x64 (cuDNN 0.463; notes/attention.md). fp32/fp64 (tests) get
    # smaller tiles so that they fit in shared memory.
    warps = 4
    if bd > 256:  # 128-row tiles over two value slices (see ACC_REGS); fp32/fp64 (tests): 4 warps, no slices
        bm, bn, warps, stages = (128, 32, 8, 2) if esize <= 2 else (32, 16, 4, 1) if esize == 4 else (16, 16, 4, 1)
    elif esize >= 8:
        bm, bn, stages = 32, 32, 1
    elif esize == 4 or bd > 128:
        bm, bn, stages = 64, 32, 2
    elif bd <= 64 and BH * _cdiv(Lq, 64) >= 8 * runtime.num_sms():
        bm, bn, warps, stages = 128, 64, 8, 3
    elif bd == 128 and Lk >= KV_TMA_MIN_KEYS:  # K/V by TMA: two warpgroups of 64 rows, 128-key blocks
        bm, bn, warps, stages = 128, 128, 8, 3
    else:
        bm, bn, stages = 64, 64, 4 if (bd <= 64 and Lk >= 2048) else 3
    if short:  # K/V in one block; 64 query rows, one stage (nothing to pipeline)
        bn = max(16, _pow2(Lk))
        bm = min(bm, 64)
        nm = _cdiv(Lq, bm)
        group = max(1, min(8, (nm * BH) // (2 * runtime.num_sms())))
        return dict(BLOCK_M=bm, BLOCK_N=bn, M_GROUP=group, num_warps=warps if bd > 256 else 4, num_stages=1)
    return dict(BLOCK_M=bm, BLOCK_N=bn, M_GROUP=1, num_warps=warps, num_stages=stages)


@_configured
def _bwd_config(Lq, Lk, D, BH, dtype):
    """(dK/dV config, dQ config or None for the fused short-K/V path, query blocks per chunk).

    The tunable fields come from ``flame.tune`` (kernel "attention_bwd", key (Lq, Lk, D, B*H)): a
    tuning-table entry on the GPU, else ``_bwd_heuristic``. BLOCK_M, BLOCK_N, num_warps and
    num_stages configure the dK/dV program; BLOCK_M_DQ, BLOCK_N_DQ, num_warps_dq and num_stages_dq
    the dQ program; CHUNKS splits the query blocks of each key block over that many programs (more
    than one: fp32 partial dK/dV, summed afterwards). When Lk is short (``short_kv``) and fits in
    one BLOCK_N block, the dK/dV program also writes dQ and the dQ fields go unused."""
    esize = dtype.itemsize
    bd = max(16, _pow2(D))
    short = short_kv(Lk, D, esize)
    if FORCE_BLOCKS is not None:
        bm, bn = FORCE_BLOCKS["BLOCK_M"], FORCE_BLOCKS["BLOCK_N"]
        if short and Lk <= bn:
            bpc = FORCE_BLOCKS.get("CHUNK", _cdiv(Lq, bm))
            return dict(BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=max(16, _pow2(Lk)), num_warps=4, num_stages=1), None, bpc
        kv = dict(BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
        return kv, dict(kv), _cdiv(Lq, bm)
    cfg = ATTN_BWD.config((Lq, Lk, D, BH), dtype)
    kv = dict(BLOCK_D=bd, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
              num_stages=cfg["num_stages"])
    bpc = _cdiv(_cdiv(Lq, kv["BLOCK_M"]), cfg["CHUNKS"])
    if short and Lk <= kv["BLOCK_N"]:
        return kv, None, bpc
    dq = dict(BLOCK_D=bd, BLOCK_M=cfg["BLOCK_M_DQ"], BLOCK_N=cfg["BLOCK_N_DQ"], num_warps=cfg["num_warps_dq"],
              num_stages=cfg["num_stages_dq"])
    return kv, dq, bpc


def _bwd_heuristic(Lq, Lk, bd, BH, esize, short):
    """attention_bwd's default config (the fields of ``_bwd_config``)."""
    if runtime.INTERPRETER:
        kv = (max(16, _pow2(min(Lq, 128))), max(16, _pow2(min(Lk, 128))), 4, 1)
        return _bwd_fields(kv, kv, 1)
    # GPU heuristics from a sweep on an H200 (Triton 3.6, bf16, the bench shapes): the short-K/V
    # path wants 128 query rows (D <= 64) and 8 warps per program and up to ~4 programs per SM over the query
    # chunks (Lk = 77: 2x faster than 64 rows / 2 per SM); the long path 32x64 dK/dV tiles and
    # 64x64 (D <= 64) or 128x64 (D = 128) dQ tiles.
    big = esize >= 4 or bd > 128  # fp32/fp64 (tests) and D > 128: small tiles, one stage
    if short:  # dQ is fused: its fields repeat dK/dV's, unused
        if big:
            kv = (16 if esize >= 8 else 32, max(16, _pow2(Lk)), 4, 1)
        else:
            kv = (128 if bd <= 64 else 64, max(16, _pow2(Lk)), 8, 1)
        nm = _cdiv(Lq, kv[0])
        return _bwd_fields(kv, kv, max(1, min(nm, (4 * runtime.num_sms()) // max(BH, 1))))
    if big:
        return _bwd_fields((16 if esize >= 8 else 32, 32, 4, 1), (32, 16 if esize >= 8 else 32, 4, 1), 1)
    if bd <= 64:
        return _bwd_fields((32, 64, 4, 3), (64, 64, 4, 3), 1)
    return _bwd_fields((32, 64, 4, 3), (128, 64, 8, 3), 1)


def _derived(key, dtype):
    """(Lq, Lk, BLOCK_D, BH, element size, short K/V) of an attention key (Lq, Lk, D, BH)."""
    Lq, Lk, D, BH = key
    return Lq, Lk, max(16, _pow2(D)), BH, dtype.itemsize, short_kv(Lk, D, dtype.itemsize)


# ---- tuning: the specs and their search spaces ----------------------------------------------------
# Field -> values (from a sweep of every config on an H200): the forward on long K/V ("fwd") and on
# short K/V ("fwd_short": every key in one block of the padded Lk, M_GROUP query blocks per
# program); the backward's dK/dV program ("kv"; tuned with the dQ fields at the default), then its
# dQ program ("dq", with the fastest dK/dV config), or on short K/V the fused program ("kv_short")
# with CHUNKS from PROGRAMS_PER_SM: about that many programs per SM over the query chunks.
# --quick: a few tiny blocks.
SPACE = dict(
    fwd=dict(BLOCK_M=(64, 128), BLOCK_N=(32, 64, 128), M_GROUP=(1,), num_warps=(4, 8), num_stages=(1, 2, 3, 4)),
    fwd_short=dict(BLOCK_M=(64, 128), M_GROUP=(1, 2, 4), num_warps=(4, 8), num_stages=(1, 2)),
    kv=dict(BLOCK_M=(32, 64, 128), BLOCK_N=(64, 128), num_warps=(4, 8), num_stages=(1, 2, 3)),
    dq=dict(BLOCK_M_DQ=(64, 128), BLOCK_N_DQ=(32, 64), num_warps_dq=(4, 8), num_stages_dq=(2, 3)),
    kv_short=dict(BLOCK_M=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2), PROGRAMS_PER_SM=(1, 2, 4, 8)),
)
QUICK_SPACE = dict(
    fwd=dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), M_GROUP=(1,), num_warps=(4,), num_stages=(1,)),
    fwd_short=dict(BLOCK_M=(16,), M_GROUP=(1, 2), num_warps=(4,), num_stages=(1,)),
    kv=dict(BLOCK_M=(16, 32), BLOCK_N=(16,), num_warps=(4,), num_stages=(1,)),
    dq=dict(BLOCK_M_DQ=(16, 32), BLOCK_N_DQ=(16,), num_warps_dq=(4,), num_stages_dq=(1,)),
    kv_short=dict(BLOCK_M=(16,), num_warps=(4,), num_stages=(1,), PROGRAMS_PER_SM=(1, 4)),
)
MAX_BWD_AREA = 128 * 64  # dK/dV tiles of 128 x 128 spill registers (the sweep skipped them)


def _fwd_stages(ctx, key, spec):
    """The candidate attention_fwd configs at key (Lq, Lk, D, B*H) that fit in shared memory (the
    query tile, the K and V blocks of every pipeline stage and the probabilities P), one stage."""
    lq, lk, d, _ = key
    space, es, bd = ctx.choices(spec), ctx.dtype.itemsize, max(16, _pow2(d))
    if short_kv(lk, d, es):  # K/V loaded once, query tiles pipelined
        bn = max(16, _pow2(lk))
        configs = autotune.product(autotune.fitted(space["fwd_short"], BLOCK_M=lq), dict(BLOCK_N=bn))
        configs = [c for c in configs if ctx.fits(2 * bn, c["num_stages"] * c["BLOCK_M"], c["BLOCK_M"] * bn, bd)]
    else:
        configs = autotune.product(autotune.fitted(space["fwd"], BLOCK_M=lq, BLOCK_N=lk))
        configs = [c for c in configs if ctx.fits(c["BLOCK_M"], c["num_stages"] * 2 * c["BLOCK_N"],
                                                  c["BLOCK_M"] * c["BLOCK_N"], bd)]
    return [lambda best: configs]


def _bwd_stages(ctx, key, spec):
    """The candidate attention_bwd configs at key (Lq, Lk, D, B*H) as stages: on long K/V the dK/dV
    program's (K and V resident, Q and dO tiles pipelined), then the dQ program's (Q and dO
    resident, K and V pipelined) over the fastest so far; on short K/V the fused program's block,
    warps, stages and query chunks."""
    lq, lk, d, bh = key
    space, es, bd = ctx.choices(spec), ctx.dtype.itemsize, max(16, _pow2(d))

    def kv_fits(c, bn):
        return ctx.fits(2 * bn, c["num_stages"] * 2 * c["BLOCK_M"], 2 * c["BLOCK_M"] * bn, bd)

    if short_kv(lk, d, es):
        bn = max(16, _pow2(lk))
        choices = autotune.fitted(space["kv_short"], BLOCK_M=lq)
        per_sm = choices.pop("PROGRAMS_PER_SM")

        def fused(best):
            configs = []
            for bm in choices["BLOCK_M"]:
                nm = -(-lq // bm)
                chunks = sorted({max(1, min(nm, p * runtime.num_sms() // bh)) for p in per_sm})
                configs += autotune.product(dict(choices, BLOCK_M=(bm,), CHUNKS=chunks), dict(best, BLOCK_N=bn))
            return [c for c in configs if kv_fits(c, bn)]

        return [fused]

    def dkdv(best):
        return [c for c in autotune.product(autotune.fitted(space["kv"], BLOCK_M=lq, BLOCK_N=lk), dict(best, CHUNKS=1))
                if c["BLOCK_M"] * c["BLOCK_N"] <= MAX_BWD_AREA and kv_fits(c, c["BLOCK_N"])]

    def dq(best):
        return [c for c in autotune.product(autotune.fitted(space["dq"], BLOCK_M_DQ=lq, BLOCK_N_DQ=lk), best)
                if ctx.fits(2 * c["BLOCK_M_DQ"], c["num_stages_dq"] * 2 * c["BLOCK_N_DQ"],
                            c["BLOCK_M_DQ"] * c["BLOCK_N_DQ"], bd)]

    return [dkdv, dq]


_KEY = ("Lq", "Lk", "D", "BH")  # BH: batch x heads
# the forward: BLOCK_D and SINGLE_KV derived (``_fwd_config``)
ATTN_FWD = tune.register(tune.Spec(
    "attention_fwd", _KEY, ("BLOCK_M", "BLOCK_N", "M_GROUP", "num_warps", "num_stages"),
    lambda key, dtype: _fwd_heuristic(*_derived(key, dtype)), _fwd_stages, SPACE, QUICK_SPACE,
    doc="_attn_fwd_kernel: the flash-attention forward"))
# the dK/dV program, the dQ program (*_DQ, *_dq; unused when dQ is fused into dK/dV for short K/V)
# and how many chunks split the query blocks (``_bwd_config``)
ATTN_BWD = tune.register(tune.Spec(
    "attention_bwd", _KEY, ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "BLOCK_M_DQ", "BLOCK_N_DQ",
                            "num_warps_dq", "num_stages_dq", "CHUNKS"),
    lambda key, dtype: _bwd_heuristic(*_derived(key, dtype)), _bwd_stages, SPACE, QUICK_SPACE,
    doc="_attn_bwd_dkdv_kernel and _attn_bwd_dq_kernel: the flash-attention backward"))


def _bwd_fields(kv, dq, chunks):
    """An attention_bwd config from (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV and of
    the dQ program and the number of query chunks."""
    (bm, bn, warps, stages), (dq_bm, dq_bn, dq_warps, dq_stages) = kv, dq
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, BLOCK_M_DQ=dq_bm, BLOCK_N_DQ=dq_bn,
                num_warps_dq=dq_warps, num_stages_dq=dq_stages, CHUNKS=chunks)


# ---- routes: which kernels run an attention call --------------------------------------------------
# ``attention_fwd`` and ``attention_bwd`` describe each call as an ``AttentionProblem`` (direction,
# sizes, dtype, the scale's sign, causal, the mask kind, whether offsets need int64, which operands
# TMA cannot read, and what the device runs), ask ``plan`` for its route and run it (``_RUN``).
# Forward:
#   "gluon"     ``attention_hopper``'s warp-specialised kernel (sm_90 with Gluon, HOPPER_FWD): 16-bit,
#               head dim in HOPPER_HEAD_DIMS[FORWARD], no mask, not causal, scale > 0, Lk a positive multiple
#               of its 128-key block, Q, K and V readable by TMA (``_gluon_refusal``)
#   "short_kv"  ``_attn_fwd_kernel`` with every key in one block (``short_kv``, SINGLE_KV): K and V
#               loaded once per program for M_GROUP query blocks (cross-attention)
#   "kv_tma"    ``_attn_fwd_kernel``'s key loop with K/V blocks read through TMA descriptors: a GPU
#               with TMA (FLAME_ATTN_TMA not 0), at least KV_TMA_MIN_KEYS keys, a power-of-two head
#               dim, 16-bit K and V that TMA can read, 32-bit offsets (``_kv_tma_refusal``)
#   "pointer"   ``_attn_fwd_kernel``'s key loop with pointer loads: every other call
#   "none"      no (batch, head) pair or no query: nothing to write
# Backward:
#   "gluon"     the delta preprocess, then ``attention_hopper``'s dK/dV and dQ kernels (HOPPER_BWD):
#               the forward's "gluon" calls with head dim in HOPPER_HEAD_DIMS[BACKWARD], queries and dO
#               readable by TMA too
#   "fused_dq"  short K/V in one key block: ``_attn_bwd_dkdv_kernel`` computes delta and writes dQ too
#   "dkdv_dq"   the delta preprocess, ``_attn_bwd_dkdv_kernel``, then ``_attn_bwd_dq_kernel`` (with no
#               keys, only the dQ program: dQ = 0)
#   "none"      no (batch, head) pair
# ``Route.splits``: the forward's value-column slices (BLOCK_DV, head dims above 256: grid axis 2);
# the portable backward's query chunks (CHUNKS: more than one writes fp32 partial dK/dV that
# ``_sum_chunks_kernel`` sums in a fixed order). Configs are ``_fwd_config``'s and ``_bwd_config``'s
# (this process's ``flame.tune`` tables and heuristics). Routes are memoised per problem, except
# while a test forces blocks (FORCE_BLOCKS). ``FLAME_DEBUG_ROUTES=1`` prints each distinct
# problem's route and why, once, to stderr.

ROUTES = {FORWARD: ("gluon", "short_kv", "kv_tma", "pointer", "none"),
          BACKWARD: ("gluon", "fused_dq", "dkdv_dq", "none")}
DEBUG_ROUTES = os.environ.get("FLAME_DEBUG_ROUTES", "") == "1"
_TMA_DTYPES = (torch.float16, torch.bfloat16)
_I32 = 2 ** 31 - 1


def _wide(*extents):
    return any(e > _I32 for e in extents)


class AttentionProblem(NamedTuple):
    """One call of ``attention_fwd`` or ``attention_bwd`` as routing sees it. A tuple (the route memo
    hashes it): the ``direction`` (FORWARD, BACKWARD); sizes; the operands' dtype; whether the scale
    is positive (the forward then takes row maxima over the raw scores); causal; the mask kind (0:
    none, 1: additive, 2: boolean); ``wide``: an operand's extent passes 2^31 elements (int64
    offsets); ``misaligned``: the operands among "q", "k", "v" and (backward) "do" whose base or
    batch/head/row stride is not a multiple of 16 bytes (looked at only for 16-bit dtypes where
    ``tma`` or ``gluon``); and the device: ``tma``, TMA descriptors work here (a GPU that has them,
    or the interpreter, which emulates them) and FLAME_ATTN_TMA is not 0; ``gluon``, the Gluon
    kernels of attention_hopper.py run here (sm_90, Gluon) and FLAME_ATTN_GLUON (a backward's:
    FLAME_ATTN_GLUON_BWD too) is not 0; ``gpu``, not the interpreter. Launch configs come from this
    process's tables and heuristics (``flame.tune``)."""

    direction: str
    B: int
    H: int
    Lq: int
    Lk: int
    D: int
    dtype: torch.dtype
    positive_scale: bool = True
    causal: bool = False
    mask: int = 0
    wide: bool = False
    misaligned: tuple = ()
    tma: bool = False
    gluon: bool = False
    gpu: bool = False

    @classmethod
    def dense(cls, direction, B, H, Lq, Lk, D, dtype, *, layout="bhld", scale=1.0, causal=False, mask=0, tma=False,
              gluon=False, gpu=None):
        """A call on freshly allocated buffers, from shapes: how tests describe one without allocating
        it. Every operand (B, H, L, D) contiguous (``layout="bhld"``) or a (B, L, H, D) buffer permuted
        (``"blhd"``: a projection's heads read in place), every base aligned; a mask (``mask`` its
        kind) contiguous (B, H, Lq, Lk). ``gpu`` defaults to ``tma``: ``tma=True, gluon=True``
        describes an H200."""
        def strides(L):
            return (H * L * D, L * D, D) if layout == "bhld" else (L * H * D, D, H * D)

        named = dict(q=strides(Lq), k=strides(Lk), v=strides(Lk))
        if direction == BACKWARD:
            named["do"] = strides(Lq)
        misaligned = ()
        if dtype in _TMA_DTYPES and (tma or gluon):
            misaligned = tuple(name for name, s in named.items() if any(x * dtype.itemsize % 16 for x in s))
        wide = _wide(Lq * strides(Lq)[2], Lk * strides(Lk)[2], (Lq * Lk + Lk) if mask else 0)
        return cls(direction, B, H, Lq, Lk, D, dtype, scale > 0, causal, mask, wide, misaligned, tma, gluon,
                   tma if gpu is None else gpu)


@dataclasses.dataclass(frozen=True)
class Route:
    """What ``plan`` chose: the path (``kernel``, one of ROUTES[direction]); ``config``, the main
    portable kernel's constexprs and launch options (the forward's ``_attn_fwd_kernel``, the
    backward's dK/dV program: tuned fields as ``flame.tune`` answered them, the derived ones and
    the switches; empty for "gluon" and "none"); ``splits`` (see above); why (``reason``); the main
    kernel's ``grid``; for "dkdv_dq" the dQ program's ``dq_config``; for the portable backward
    ``per_chunk``, the query blocks of one chunk; ``plans``, the launch plans of its kernels
    (``_launch``), made at their first launch."""

    kernel: str
    config: dict
    splits: int
    reason: str
    grid: tuple = ()
    dq_config: dict | None = None
    per_chunk: int = 0
    plans: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


_reported: set = set()
# The route of each problem, and what each maskless call signature of the entry points resolved to
# (``_planned``: its problem and route), emptied together by ``flame.tune``'s overrides and resets
_route = RouteMemo(lambda p: _plan(p))  # looked up per call: a test may replace _plan's helpers
tune.register_cache(_route.cache_clear)


def plan(p: AttentionProblem) -> Route:
    """The route of attention problem ``p`` (see above), memoised per problem (a training loop's
    shapes repeat): one dictionary lookup on the host after the first call."""
    route = _route(p) if FORCE_BLOCKS is None else _plan(p)
    if DEBUG_ROUTES and p not in _reported:
        _reported.add(p)
        what = [f"{p.B}x{p.H} heads, {p.Lq} queries x {p.Lk} keys of {p.D}", str(p.dtype)]
        what += ["causal"] * p.causal + [("", "additive mask", "boolean mask")[p.mask]] * bool(p.mask)
        what += ["scale <= 0"] * (not p.positive_scale) + ["int64 offsets"] * p.wide
        what += [f"{', '.join(p.misaligned)} not 16-byte aligned"] * bool(p.misaligned)
        print(f"flame attention route: {p.direction} {', '.join(what)}: {route.kernel}, splits {route.splits}, "
              f"config {route.config}: {route.reason}", file=sys.stderr)
    return route


_PLAN = plan  # the entry points plan every call while this name is replaced (a test's watcher)


def _plan(p):
    if p.B * p.H == 0 or (p.direction == FORWARD and p.Lq == 0):
        return Route("none", {}, 0, "no (batch, head) pair" if p.B * p.H == 0 else "no query")
    refusal = _gluon_refusal(p)
    if refusal is None:
        kernels = "kernel" if p.direction == FORWARD else "dK/dV and dQ kernels"
        return Route("gluon", {}, 1, f"head dim {p.D}, {p.Lk} keys, no mask, not causal: attention_hopper's "
                                     f"warp-specialised {kernels}")
    refusal = f"; not Gluon: {refusal}" if p.gluon else ""
    return _plan_forward(p, refusal) if p.direction == FORWARD else _plan_backward(p, refusal)


def _gluon_refusal(p):
    """Why attention_hopper.py's kernels do not take problem ``p`` (None: they do): its ``usable``
    (the device, 16-bit, head dim, no mask, not causal, scale > 0, Lk a positive multiple of its
    key block, Q, K, V readable by TMA), HOPPER_HEAD_DIMS of its direction, and for a backward
    queries and dO readable by TMA too."""
    if not p.gluon:
        return "not an sm_90 GPU with Gluon, or FLAME_ATTN_GLUON(_BWD)=0"
    if FORCE_BLOCKS is not None:
        return "blocks forced (FORCE_BLOCKS)"
    if p.mask or p.causal:
        return "a mask" if p.mask else "causal"
    if not p.positive_scale:
        return "scale <= 0"
    head_dims = HOPPER_HEAD_DIMS[p.direction]
    if p.D not in head_dims or p.D not in attention_hopper.HEAD_DIMS:
        return f"head dim {p.D} (the Gluon {p.direction} takes {head_dims}: HOPPER_HEAD_DIMS)"
    if p.dtype not in _TMA_DTYPES:
        return f"{p.dtype}"
    if p.Lk < attention_hopper.BLOCK_N or p.Lk % attention_hopper.BLOCK_N:
        return f"Lk = {p.Lk} not a positive multiple of {attention_hopper.BLOCK_N}"
    if p.direction == BACKWARD and p.Lq == 0:
        return "no query"
    if p.misaligned:
        return f"{', '.join(p.misaligned)} not 16-byte aligned (TMA)"
    return None


def _plan_forward(p, refusal):
    cfg = _fwd_config(p.Lq, p.Lk, p.D, p.B * p.H, p.dtype)
    grid = (_cdiv(_cdiv(p.Lq, cfg["BLOCK_M"]), cfg["M_GROUP"]), p.B * p.H)
    slices = 1
    if "BLOCK_DV" in cfg:  # value columns split: grid axis 2 walks the slices
        slices = _cdiv(p.D, cfg["BLOCK_DV"])
        grid += (slices,)
        refusal = f"; value columns in {slices} slices of {cfg['BLOCK_DV']}{refusal}"
    else:
        cfg = dict(cfg, BLOCK_DV=cfg["BLOCK_D"])
    if cfg["SINGLE_KV"]:
        kernel, why = "short_kv", (f"{p.Lk} keys in one block of {cfg['BLOCK_N']}: K/V loaded once per program, "
                                   f"{cfg['M_GROUP']} query block(s) each")
    else:
        tma_refusal = _kv_tma_refusal(p, cfg)
        kernel = "pointer" if tma_refusal else "kv_tma"
        why = tma_refusal or (f"{p.Lk} keys, 16-bit K/V TMA can read, a power-of-two head dim: K/V blocks by TMA"
                              if FORCE_BLOCKS is None else "blocks forced with KV_TMA, K/V TMA can read")
    acc, precision, upcast = _switches(p.dtype, p.gpu)
    config = dict(cfg, KV_TMA=kernel == "kv_tma", HEAD_DIM=p.D, CAUSAL=p.causal, MASK_KIND=p.mask, ACC=acc,
                  PRECISION=precision, UPCAST=upcast, WIDE=p.wide, POS_SCALE=p.positive_scale)
    return Route(kernel, config, slices, why + refusal, grid)


def _kv_tma_refusal(p, cfg):
    """Why the forward's key loop (config ``cfg``) reads K/V by pointer (None: through TMA). With
    FORCE_BLOCKS the forced KV_TMA decides instead of the GPU and the key count (tests)."""
    if FORCE_BLOCKS is not None:
        if not cfg["KV_TMA"]:
            return "blocks forced without KV_TMA"
    elif not p.gpu:
        return "the interpreter: pointer loads"
    if not p.tma:
        return "no TMA here (FLAME_ATTN_TMA=0 or a GPU without it)"
    if FORCE_BLOCKS is None:
        if cfg["BLOCK_D"] != p.D:
            return f"head dim {p.D} not a power of two"
        if p.Lk < KV_TMA_MIN_KEYS:
            return f"{p.Lk} keys < KV_TMA_MIN_KEYS = {KV_TMA_MIN_KEYS} (TMA is slower there)"
    if p.dtype not in _TMA_DTYPES:
        return f"{p.dtype}: TMA takes 16-bit K/V"
    if "k" in p.misaligned or "v" in p.misaligned:
        return "K or V not 16-byte aligned (TMA)"
    if p.wide:
        return "int64 offsets"
    return None


def _plan_backward(p, refusal):
    kv, dq, per_chunk = _bwd_config(p.Lq, p.Lk, p.D, p.B * p.H, p.dtype)
    per_chunk = max(1, per_chunk)
    acc, precision, upcast = _switches(p.dtype, p.gpu)
    common = dict(HEAD_DIM=p.D, CAUSAL=p.causal, MASK_KIND=p.mask, ACC=acc, PRECISION=precision, UPCAST=upcast,
                  WIDE=p.wide)
    chunks = max(1, _cdiv(_cdiv(p.Lq, kv["BLOCK_M"]), per_chunk))
    grid = (_cdiv(p.Lk, kv["BLOCK_N"]), p.B * p.H, chunks)
    if chunks > 1:
        refusal = f"; {chunks} query chunks of {per_chunk} blocks, fp32 partial dK/dV summed{refusal}"
    if dq is None and p.Lk > 0:  # one key block: the dK/dV program computes delta and dQ itself
        config = dict(common, FUSED_DQ=True, KEY_BOUND=p.Lk % kv["BLOCK_N"] != 0, **kv)
        why = f"{p.Lk} keys in one block of {kv['BLOCK_N']}: the dK/dV program computes delta and writes dQ"
        return Route("fused_dq", config, chunks, why + refusal, grid, None, per_chunk)
    config = dict(common, FUSED_DQ=False, KEY_BOUND=False, **kv)
    why = (f"{p.Lk} keys in blocks of {kv['BLOCK_N']}: delta, the dK/dV program, then the dQ program" if p.Lk else
           "no keys: the dQ program writes dQ = 0")
    return Route("dkdv_dq", config, chunks, why + refusal, grid, dict(common, **(kv if dq is None else dq)), per_chunk)


# ---- running a route ------------------------------------------------------------------------------
# Operands are described by (buffer, (batch stride, head stride, row stride)); the head dim is
# contiguous. ``mask`` is None or (buffer, (4 strides), kind) with kind 1 = additive, 2 = boolean
# (a uint8 view).

def _problem(direction, operands, B, H, Lq, Lk, D, scale, causal, mask, wide, gluon):
    """The ``AttentionProblem`` of a call on these buffers: ``operands``, ((name, buffer, strides), ...),
    those TMA may read; ``gluon``, this direction's switch (HOPPER_FWD or HOPPER_BWD)."""
    dtype = operands[0][1].dtype
    tma = TMA_SWITCH and (runtime.INTERPRETER or tma_available())
    gluon = gluon and attention_hopper.available()
    misaligned = ()
    if dtype in _TMA_DTYPES and (tma or gluon):
        es = dtype.itemsize
        misaligned = tuple(name for name, t, s in operands if t.data_ptr() % 16 or any(x * es % 16 for x in s))
    return AttentionProblem(direction, B, H, Lq, Lk, D, dtype, scale > 0, bool(causal), 0 if mask is None else mask[2],
                            wide, misaligned, tma, gluon, not runtime.INTERPRETER)


def _mask_buffer(mask, q):
    """(buffer, 4 strides) of the mask (``q`` with zero strides where there is none: never read)."""
    return (q, (0, 0, 0, 0)) if mask is None else mask[:2]


def _planned(key, direction, operands, B, H, Lq, Lk, D, scale, causal, mask, strides, gluon):
    """``(p, plan(p))`` of an entry point's call, its problem ``p`` from ``_problem`` (``strides``, every
    operand's (batch, head, row) strides, for ``wide``), memoised per call signature ``key`` (None: not
    memoised): a repeated call builds no problem. Every call plans while blocks are forced,
    FLAME_DEBUG_ROUTES is on or ``plan`` is replaced."""
    entry = None if key is None else _route.calls.get(key)
    if entry is None or DEBUG_ROUTES or FORCE_BLOCKS is not None or plan is not _PLAN:
        ms = _mask_buffer(mask, operands[0][1])[1]
        Ls = (Lq, Lk, Lk, Lq) + (Lq, Lq, Lk, Lk)[:len(strides) - 4]  # q, k, v, o (do, dq, dk, dv)
        wide = _wide(Lq * ms[2] + Lk * ms[3], *[L * s[2] for L, s in zip(Ls, strides)])
        p = _problem(direction, operands, B, H, Lq, Lk, D, scale, causal, mask, wide, gluon)
        entry = p, plan(p)
        if key is not None and FORCE_BLOCKS is None and plan is _PLAN:
            _route.keep_call(key, entry)
    return entry


@tunable("o", "lse")
def attention_fwd(q, k, v, o, lse, sq, sk, sv, so, B, H, Lq, Lk, D, scale, causal, mask=None):
    """O = softmax(Q K^T * scale + mask) V into ``o``; base-2 log-sum-exp into ``lse`` (B*H, Lq).
    A maskless call whose q, k and v are 16-byte aligned has a call signature (strides, sizes, dtype,
    the scale's sign, causal, the switches TMA_SWITCH and HOPPER_FWD as read now): see ``_planned``."""
    key = None
    if mask is None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0:
        key = (sq, sk, sv, so, B, H, Lq, Lk, D, q.dtype, scale > 0, causal, TMA_SWITCH, HOPPER_FWD)
    p, route = _planned(key, FORWARD, (("q", q, sq), ("k", k, sk), ("v", v, sv)), B, H, Lq, Lk, D, scale, causal,
                        mask, (sq, sk, sv, so), HOPPER_FWD)
    _RUN[FORWARD][route.kernel](p, route, (q, k, v, o, lse), (sq, sk, sv, so), scale, mask)


@tunable("dq", "dk", "dv")
def attention_bwd(q, k, v, o, do, lse, dq, dk, dv, sq, sk, sv, so, sdo, sdq, sdk, sdv,
                  B, H, Lq, Lk, D, scale, causal, mask=None):
    """dQ, dK, dV of ``attention_fwd`` given dO, O and the saved log-sum-exp (call signatures as the
    forward's, with dO aligned too and HOPPER_BWD)."""
    strides = (sq, sk, sv, so, sdo, sdq, sdk, sdv)
    key = None
    if mask is None and (q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr()) % 16 == 0:
        key = (strides, B, H, Lq, Lk, D, q.dtype, scale > 0, causal, TMA_SWITCH, HOPPER_BWD)
    p, route = _planned(key, BACKWARD, (("q", q, sq), ("k", k, sk), ("v", v, sv), ("do", do, sdo)), B, H, Lq, Lk,
                        D, scale, causal, mask, strides, HOPPER_BWD)
    _RUN[BACKWARD][route.kernel](p, route, (q, k, v, o, do, lse, dq, dk, dv), strides, scale, mask)


# The runners: route ``r`` of problem ``p`` on the call's buffers and strides (the forward's q, k, v,
# o, lse and sq, sk, sv, so; the backward's q, k, v, o, do, lse, dq, dk, dv and sq, sk, sv, so,
# sdo, sdq, sdk, sdv), its scale and mask.

def _launch(r, kernel, grid, args, meta):
    """``launch(kernel, grid, *args, **meta)`` through the ``Plan`` that route ``r`` keeps for
    ``kernel`` (a route is one problem's: its kernels' ``meta`` never changes): no keywords (~15
    constexprs as keywords cost about as much host time as the rest of a launch) and no argument
    types looked at. Each argument that is not a tensor or a float enters the key by value, as
    ``launch`` keys it."""
    plan = r.plans.get(kernel)
    if plan is None:
        by_value = [i for i, a in enumerate(args) if not isinstance(a, (torch.Tensor, float))]
        plan = r.plans[kernel] = Plan(kernel, meta, by_value)
    launch_via(launch, plan, grid, args)


def _run_none(p, r, bufs, strides, scale, mask):
    return None


def _run_forward_gluon(p, r, bufs, strides, scale, mask):
    attention_hopper.attention_fwd(*bufs, *strides, p.B, p.H, p.Lq, p.Lk, p.D, scale * LOG2E)


def _run_forward(p, r, bufs, strides, scale, mask):
    q, k, v, o, lse = bufs
    mbuf, ms = _mask_buffer(mask, q)
    _launch(r, _attn_fwd_kernel, r.grid, (q, k, v, o, lse, mbuf, p.H, p.Lq, p.Lk, float(scale * LOG2E),
                                          *strides[0], *strides[1], *strides[2], *strides[3], *ms), r.config)


def _run_backward_gluon(p, r, bufs, strides, scale, mask):
    q, k, v, o, do, lse, dq, dk, dv = bufs
    sq, sk, sv, so, sdo, sdq, sdk, sdv = strides
    delta = runtime.empty((p.B * p.H, p.Lq), stats_dtype(p.dtype))
    launch(_attn_bwd_preprocess_kernel, (_cdiv(p.Lq, 64), p.B * p.H), o, do, delta, p.H, p.Lq, *so, *sdo,
           HEAD_DIM=p.D, BLOCK_D=p.D, BLOCK_M=64, ACC=tl.float32, WIDE=_wide(p.Lq * so[2], p.Lq * sdo[2]))
    attention_hopper.attention_bwd(q, k, v, do, lse, delta, dq, dk, dv, sq, sk, sv, sdo, sdq, sdk, sdv,
                                   p.B, p.H, p.Lq, p.Lk, p.D, scale * LOG2E, scale)


def _run_dkdv(p, r, bufs, strides, scale, mask, delta):
    """The dK/dV program of route ``r`` (with FUSED_DQ it writes dQ too), over ``r.splits`` query
    chunks: more than one writes fp32 partials, (2, chunks, B*H, Lk, D) dense, summed in a fixed order."""
    q, k, v, o, do, lse, dq, dk, dv = bufs
    sq, sk, sv, so, sdo, sdq, sdk, sdv = strides
    mbuf, ms = _mask_buffer(mask, q)
    BH, chunks = p.B * p.H, r.splits
    if chunks > 1:
        part = runtime.empty((2, chunks, BH, p.Lk, p.D), stats_dtype(p.dtype))
        tk, tv = part[0], part[1]
        stk = stv = (BH * p.Lk * p.D, p.H * p.Lk * p.D, p.Lk * p.D, p.D)
    else:
        tk, tv, stk, stv = dk, dv, (0,) + tuple(sdk), (0,) + tuple(sdv)
    _launch(r, _attn_bwd_dkdv_kernel, r.grid,
            (q, k, v, do, o, lse, delta, tk, tv, dq, mbuf, p.H, p.Lq, p.Lk, float(scale * LOG2E), float(scale),
             r.per_chunk, *sq, *sk, *sv, *sdo, *so, *stk, *stv, *sdq, *ms), r.config)
    if chunks > 1:
        bl = 32 if p.gpu else 128
        _launch(r, _sum_chunks_kernel, (_cdiv(p.Lk, bl), BH, 2),
                (part, dk, dv, p.H, p.Lk, chunks, BH * p.Lk * p.D, p.Lk * p.D, p.D, *sdk, *sdv),
                dict(HEAD_DIM=p.D, BLOCK_D=r.config["BLOCK_D"], BLOCK_L=bl, ACC=r.config["ACC"]))


def _run_fused_dq(p, r, bufs, strides, scale, mask):
    _run_dkdv(p, r, bufs, strides, scale, mask, bufs[5])  # delta is computed in the kernel; lse stands in


def _run_dkdv_dq(p, r, bufs, strides, scale, mask):
    q, k, v, o, do, lse, dq = bufs[:7]
    sq, sk, sv, so, sdo, sdq = strides[:6]
    delta = lse  # never read without queries
    if p.Lq > 0:
        delta = runtime.empty((p.B * p.H, p.Lq), stats_dtype(p.dtype))
        bm = 64 if p.gpu else r.config["BLOCK_M"]
        _launch(r, _attn_bwd_preprocess_kernel, (_cdiv(p.Lq, bm), p.B * p.H), (o, do, delta, p.H, p.Lq, *so, *sdo),
                dict(HEAD_DIM=p.D, BLOCK_D=r.config["BLOCK_D"], BLOCK_M=bm, ACC=r.config["ACC"], WIDE=p.wide))
    if p.Lk > 0:
        _run_dkdv(p, r, bufs, strides, scale, mask, delta)
    if p.Lq > 0:
        mbuf, ms = _mask_buffer(mask, q)
        _launch(r, _attn_bwd_dq_kernel, (_cdiv(p.Lq, r.dq_config["BLOCK_M"]), p.B * p.H),
                (q, k, v, do, lse, delta, dq, mbuf, p.H, p.Lq, p.Lk, float(scale * LOG2E), float(scale), *sq, *sk, *sv,
                 *sdo, *sdq, *ms), r.dq_config)


_RUN = {FORWARD: dict(gluon=_run_forward_gluon, short_kv=_run_forward, kv_tma=_run_forward, pointer=_run_forward,
                      none=_run_none),
        BACKWARD: dict(gluon=_run_backward_gluon, fused_dq=_run_fused_dq, dkdv_dq=_run_dkdv_dq, none=_run_none)}
