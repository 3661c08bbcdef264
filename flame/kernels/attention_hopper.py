"""Flash attention for Hopper (sm_90) in Gluon: warp-specialised forward and backward kernels
with a TMA producer warp, two or three consumer warpgroups and wgmma, FlashAttention-3's structure (the
backward deterministic: dQ by its own kernel, no atomics; see "backward" below).

Problem and layout as ``attention.py``'s forward (``O = softmax(Q K^T * scale) V`` per (batch,
head), operands as base pointer plus (batch, head, row) strides, the head dim contiguous), on the
subset this kernel serves: bf16/fp16, head dim 64 or 128, no mask, not causal, a positive scale,
Lk a multiple of BLOCK_N (``usable``). It writes O and the base-2 log-sum-exp the portable backward
reads (``lse2 = max + log2(sum)`` of the scores scaled by ``scale * log2(e)``).

One program per CONSUMERS x BLOCK_M query rows of one (batch, head) (``FWD_CONSUMERS``: two
consumer warpgroups at head dim 128, three at 64, FlashAttention-3's shapes), in partitions:
- the loader (1 warp, 24 registers): builds TMA descriptors for this head's Q, K and V (shape
  (L, D): rows past L arrive as zeros), loads the query tiles, then streams K and V blocks
  into two rings of STAGES shared-memory buffers (``*_ready`` barriers count the bytes, ``*_empty``
  barriers take one arrival from each consumer);
- the consumers (4 warps each, the default partition and workers; 240 registers each when two, 160
  when three): BLOCK_M query rows each, online softmax in base 2. Within a warpgroup the softmax of
  key block j runs while the wgmma of P_{j-1} V_{j-1} is in flight (S_j = Q K_j^T and P_{j-1} V_{j-1} are issued
  together, S_j is waited with one group left outstanding); P stays in registers as wgmma's A
  operand. (ptxas moves the ``wgmma.wait_group 0`` of P V above the exponentials, as the next P
  is packed into the registers the wgmma in flight reads; a wait made data-dependent on the row
  sums kept it below them but measured no faster: notes/attention.md.) With PINGPONG the
  consumers take turns to issue their wgmmas (``turn`` barriers, a ring), so that one warpgroup's
  softmax overlaps the others' matrix products.
"""
from __future__ import annotations

import functools

import torch

from .. import runtime
from .launch import launch
from .matmul import tma_available

try:  # Gluon (Triton >= 3.5); the API used here is Triton 3.6's
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # an older Triton: the portable kernels serve every call
    gluon = None

BLOCK_M = 64  # query rows per consumer warpgroup (FWD_CONSUMERS of them per program)
BLOCK_N = 128  # keys per block
HEAD_DIMS = (64, 128)
# registers per consumer thread, by consumer warpgroups; the loader warp's group gets 24 (at entry two
# consumers are 12 warps x 168 registers, three 16 warps x 128)
REGS_PER_CONSUMER = {2: 240, 3: 160}
# The forward's consumer warpgroups per head dim. Measured on an H200 (scripts/attention_lab.py, one
# process, bf16): at 64 three (a program of 192 query rows) against two, SDXL's 1x10x4096 0.101 ms against 0.122
# (cuDNN SDPA 0.111), 4x10x4096 0.375 against 0.417 (0.383), 1x20x1024 0.018 against 0.027 (0.023)
FWD_CONSUMERS = {64: 3, 128: 2}


if gluon is not None:
    @gluon.jit
    def _ring(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        # a ring of STAGES shared-memory buffers' mbarriers: "ready" takes the loader's one arrival (with
        # the bytes its TMA copy brings), "empty" one arrival from each of the CONSUMERS consumer warpgroups
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return ready, empty

    @gluon.jit
    def _loader(q_ptr, k_ptr, v_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                qb, kb, vb, Lq, Lk, sqm, skn, svn, start_m,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CONSUMERS: gl.constexpr):
        layout_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], q_ptr.dtype.element_ty)
        layout_kv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], k_ptr.dtype.element_ty)
        q_desc = tma.make_tensor_descriptor(q_ptr + qb, [Lq, HEAD_DIM], [sqm, 1], [BLOCK_M, HEAD_DIM], layout_q)
        k_desc = tma.make_tensor_descriptor(k_ptr + kb, [Lk, HEAD_DIM], [skn, 1], [BLOCK_N, HEAD_DIM], layout_kv)
        v_desc = tma.make_tensor_descriptor(v_ptr + vb, [Lk, HEAD_DIM], [svn, 1], [BLOCK_N, HEAD_DIM], layout_kv)
        for w in gl.static_range(CONSUMERS):
            mbarrier.expect(q_bar.index(w), BLOCK_M * HEAD_DIM * q_ptr.dtype.element_ty.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(q_desc, [start_m + w * BLOCK_M, 0], q_bar.index(w), q_smem.index(w))
        nbytes: gl.constexpr = BLOCK_N * HEAD_DIM * k_ptr.dtype.element_ty.primitive_bitwidth // 8
        for j in range(Lk // BLOCK_N):
            s = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_empty.index(s), phase ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(k_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _softmax_step(s, m_i, qk_scale):
        # p = exp2(s * scale - m_new) with m_new the running row max of the scaled scores (scale > 0:
        # max(s) * scale = max(s * scale), one FMA per probability); alpha rescales the older sums
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, alpha

    @gluon.jit
    def _step(j, q, o, p_op, m_i, l_i, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, my_turn, other_turn,
              qk_scale, STAGES: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
              o_rows: gl.constexpr):
        # key block j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, the softmax of S_j
        # under the second; returns P_j as the next A operand
        sk = j % STAGES
        sv = (j - 1) % STAGES
        if PINGPONG:
            mbarrier.wait(my_turn, j & 1)
        mbarrier.wait(k_ready.index(sk), (j // STAGES) & 1)
        BM: gl.constexpr = q.shape[0]
        BN: gl.constexpr = k_smem.shape[1]
        s = gl.zeros([BM, BN], gl.float32, s_layout)  # not read (use_acc=False)
        s = warpgroup_mma(q, k_smem.index(sk).permute((1, 0)), s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sv), ((j - 1) // STAGES) & 1)
        o = warpgroup_mma(p_op, v_smem.index(sv), o, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(sk))
        p, m_i, alpha = _softmax_step(s, m_i, qk_scale)
        # p passes through the wait so that the exponentials are issued before it (ptxas still moves
        # the wait above them: the next P is packed into the registers the wgmma in flight reads)
        o, p_op, p = warpgroup_mma_wait(0, deps=(o, p_op, p))
        mbarrier.arrive(v_empty.index(sv))
        l_i = l_i * alpha + gl.sum(p, 1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        return o, gl.convert_layout(p.to(p_op.dtype), p_layout), m_i, l_i

    @gluon.jit
    def _consumer(WG: gl.constexpr, shared,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
        # warpgroup WG (0 .. CONSUMERS - 1): query rows start_m + WG * BLOCK_M + [0, BLOCK_M); with PINGPONG
        # the warpgroups take turns round the ring of ``turn`` barriers; ``shared``: what every consumer takes
        o_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, ob, lse_off, Lq, Lk, \
            som, qk_scale, start_m = shared
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = o_ptr.dtype.element_ty
        q = q_smem.index(WG)
        my_turn = turn.index(WG)
        other_turn = turn.index((WG + 1) % CONSUMERS)
        n_blocks = Lk // BLOCK_N
        if PINGPONG and WG == CONSUMERS - 1:  # warpgroup 0 issues first
            mbarrier.arrive(turn.index(0))
        mbarrier.wait(q_bar.index(WG), 0)

        # step 0: S_0 = Q K_0^T and its probabilities
        if PINGPONG:
            mbarrier.wait(my_turn, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
        p, m_i, _ = _softmax_step(s, m_i, qk_scale)
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # steps 1 .. n-1
        for j in range(1, n_blocks):
            o, p_op, m_i, l_i = _step(j, q, o, p_op, m_i, l_i, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                      my_turn, other_turn, qk_scale, STAGES, PINGPONG, s_layout, p_layout, o_rows)

        # step n: the last P V
        sv = (n_blocks - 1) % STAGES
        if PINGPONG:
            mbarrier.wait(my_turn, n_blocks & 1)
        mbarrier.wait(v_ready.index(sv), ((n_blocks - 1) // STAGES) & 1)
        o = warpgroup_mma(p_op, v_smem.index(sv), o, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
        mbarrier.arrive(v_empty.index(sv))

        # O / l and lse2 = m + log2(l), rows past Lq not stored
        l_o = gl.convert_layout(l_i, o_rows)
        o = o / gl.expand_dims(l_o, 1)
        rows = start_m + WG * BLOCK_M + gl.arange(0, BLOCK_M, o_rows)
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        rows2 = gl.expand_dims(rows, 1)
        cols2 = gl.expand_dims(cols, 0)
        offs = ob + rows2.to(gl.int64) * som + cols2
        gl.store(o_ptr + offs, o.to(dtype), mask=(rows2 < Lq) & (cols2 < HEAD_DIM))
        lse_rows = start_m + WG * BLOCK_M + gl.arange(0, BLOCK_M, s_rows)
        gl.store(lse_ptr + lse_off + lse_rows, m_i + gl.log2(l_i), mask=lse_rows < Lq)

    # O = softmax(Q K^T * scale) V for CONSUMERS x BLOCK_M query rows of one (batch, head); lse2 per row
    @gluon.jit
    def _attn_fwd_hopper_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, H, Lq, Lk, qk_scale,
                                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                CONSUMERS: gl.constexpr):
        start_m = gl.program_id(0) * (CONSUMERS * BLOCK_M)
        pid_bh = gl.program_id(1)
        b = (pid_bh // H).to(gl.int64)
        h = (pid_bh % H).to(gl.int64)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype))
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready, k_empty = _ring(STAGES, CONSUMERS)
        v_ready, v_empty = _ring(STAGES, CONSUMERS)
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(q_bar.index(w), count=1)
            mbarrier.init(turn.index(w), count=1)
        ob = b * sob + h * soh
        lse_off = pid_bh.to(gl.int64) * Lq
        # (the constexprs are written out in each call: a tuple bound to a name first would turn those in
        # it into tensors, Triton 3.6; ``shared`` holds none)
        shared = (o_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, ob, lse_off,
                  Lq, Lk, som, qk_scale, start_m)
        qb, kb, vb = b * sqb + h * sqh, b * skb + h * skh, b * svb + h * svh
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (0, shared, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS)),
                (_consumer, (1, shared, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS)),
                (_loader, (q_ptr, k_ptr, v_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                           qb, kb, vb, Lq, Lk, sqm, skn, svn, start_m, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_consumer, (0, shared, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS)),
                (_consumer, (1, shared, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS)),
                (_consumer, (2, shared, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS)),
                (_loader, (q_ptr, k_ptr, v_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                           qb, kb, vb, Lq, Lk, sqm, skn, svn, start_m, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


@functools.cache
def available():
    """Whether the Gluon kernel can run here: Gluon importable, not the interpreter, an sm_90 GPU
    (``tma_available`` also installs the scratch allocator its in-kernel TMA descriptors need)."""
    return (gluon is not None and not runtime.INTERPRETER and torch.cuda.is_available()
            and torch.cuda.get_device_capability(runtime.device) == (9, 0) and tma_available())


def usable(q, k, v, sq, sk, sv, Lk, D, scale, causal, mask):
    """Whether this kernel serves the call: ``available``, fp16/bf16, head dim 64 or 128, no mask,
    not causal, scale > 0, Lk a positive multiple of BLOCK_N, and Q, K, V TMA-readable (16-byte
    aligned base and batch/head/row strides; O is stored from registers)."""
    if mask is not None or causal or scale <= 0 or D not in HEAD_DIMS or Lk < BLOCK_N or Lk % BLOCK_N:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not available():
        return False
    es = q.element_size()
    return all(t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in s) for t, s in ((q, sq), (k, sk), (v, sv)))


def attention_fwd(q, k, v, o, lse, sq, sk, sv, so, B, H, Lq, Lk, D, qk_scale, stages=2, pingpong=True,
                  consumers=None):
    """O and lse2 of ``attention.attention_fwd`` (``qk_scale`` = scale * log2(e)) on a call that
    ``usable`` accepts; ``consumers``: 2 or 3 warpgroups of BLOCK_M query rows a program (None: FWD_CONSUMERS's)."""
    consumers = consumers or FWD_CONSUMERS[D]
    grid = (-(-Lq // (consumers * BLOCK_M)), B * H)
    launch(_attn_fwd_hopper_kernel, grid, q, k, v, o, lse, H, Lq, Lk, float(qk_scale), *sq, *sk, *sv, *so,
           HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, PINGPONG=pingpong, CONSUMERS=consumers,
           CONSUMER_REGS=REGS_PER_CONSUMER[consumers], num_warps=4)


# ---- backward ------------------------------------------------------------------------------------
#
# One warp-specialised kernel of the forward's shape (a 1-warp TMA loader, two 4-warp consumer
# warpgroups with 240 registers) with two kinds of programs, deterministic like the portable pair
# (no atomics), launched together (``_attn_bwd_hopper_kernel``):
# - dK/dV: one program per 2 x BWD_BLOCK keys of one (batch, head); each consumer owns BWD_BLOCK
#   keys (its K and V tiles loaded once) and walks every query block, whose Q and dO tiles stream
#   through a ring shared by both consumers. Per block it computes S = Q K^T and dP = dO V^T with
#   the queries as rows, so lse2 and delta are two values per thread, writes P and dS to shared
#   memory and takes P^T and dS^T from there as the A operands of dV += P^T dO and dK += dS^T Q.
# - dQ: the forward's structure with dO beside Q: one program per 2 x BWD_BLOCK queries, K and V
#   blocks streaming through rings, dS kept in registers as the A operand of dQ += dS K.

BWD_BLOCK = 64  # keys per dK/dV consumer, query rows per step of either kind, queries per dQ consumer, keys per dQ step

if gluon is not None:
    @gluon.jit
    def _bwd_loader(a_ptr, b_ptr, c_ptr, d_ptr, a_smem, b_smem, c_smem, d_smem, ab_bar, c_ready, c_empty, d_ready,
                    d_empty, ab, bb, cb, db, L_ab, L_cd, sa, sb, sc, sd, start,
                    HEAD_DIM: gl.constexpr, BLOCK_AB: gl.constexpr, BLOCK_CD: gl.constexpr, STAGES: gl.constexpr):
        # both backward kernels' TMA loader: A and B (L_ab rows each) as two BLOCK_AB-row tiles, one per
        # consumer (rows start + w * BLOCK_AB, on ab_bar[w]), loaded once; then C and D (L_cd rows) streamed
        # in BLOCK_CD-row blocks through rings of STAGES buffers. dK/dV: A, B = K, V and C, D = Q, dO; dQ:
        # A, B = Q, dO and C, D = K, V. Rows past L arrive as zeros.
        dtype: gl.constexpr = a_ptr.dtype.element_ty
        layout_ab: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_AB, HEAD_DIM], dtype)
        layout_cd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_CD, HEAD_DIM], dtype)
        a_desc = tma.make_tensor_descriptor(a_ptr + ab, [L_ab, HEAD_DIM], [sa, 1], [BLOCK_AB, HEAD_DIM], layout_ab)
        b_desc = tma.make_tensor_descriptor(b_ptr + bb, [L_ab, HEAD_DIM], [sb, 1], [BLOCK_AB, HEAD_DIM], layout_ab)
        c_desc = tma.make_tensor_descriptor(c_ptr + cb, [L_cd, HEAD_DIM], [sc, 1], [BLOCK_CD, HEAD_DIM], layout_cd)
        d_desc = tma.make_tensor_descriptor(d_ptr + db, [L_cd, HEAD_DIM], [sd, 1], [BLOCK_CD, HEAD_DIM], layout_cd)
        ab_bytes: gl.constexpr = BLOCK_AB * HEAD_DIM * dtype.primitive_bitwidth // 8
        for w in gl.static_range(2):
            mbarrier.expect(ab_bar.index(w), 2 * ab_bytes)
            tma.async_copy_global_to_shared(a_desc, [start + w * BLOCK_AB, 0], ab_bar.index(w), a_smem.index(w))
            tma.async_copy_global_to_shared(b_desc, [start + w * BLOCK_AB, 0], ab_bar.index(w), b_smem.index(w))
        nbytes: gl.constexpr = BLOCK_CD * HEAD_DIM * dtype.primitive_bitwidth // 8
        for j in range(gl.cdiv(L_cd, BLOCK_CD)):
            s = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(c_empty.index(s), phase ^ 1)
            mbarrier.expect(c_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(c_desc, [j * BLOCK_CD, 0], c_ready.index(s), c_smem.index(s))
            mbarrier.wait(d_empty.index(s), phase ^ 1)
            mbarrier.expect(d_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(d_desc, [j * BLOCK_CD, 0], d_ready.index(s), d_smem.index(s))

    @gluon.jit
    def _store_rows(ptr, base, row_stride, start, L, value, layout: gl.constexpr):
        # value (R, D) into rows start .. start + R of a (L, D) matrix at ptr + base, rows past L dropped
        rows = gl.expand_dims(start + gl.arange(0, value.shape[0], gl.SliceLayout(1, layout)), 1)
        cols = gl.expand_dims(gl.arange(0, value.shape[1], gl.SliceLayout(0, layout)), 0)
        gl.store(ptr + base + rows.to(gl.int64) * row_stride + cols, value.to(ptr.dtype.element_ty),
                 mask=(rows < L) & (cols < value.shape[1]))

    # dV_j = sum_i P_ij^T dO_i,  dK_j = scale * sum_i dS_ij^T Q_i,  P = exp2(S * scale * log2(e) - lse2),
    # dS = P * (dO V_j^T - delta)  (S = Q K_j^T; the consumer's keys j, every query block i)
    @gluon.jit
    def _bwd_kv_consumer(WG: gl.constexpr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem,
                         p_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, dkb, dvb, stat_off,
                         Lq, Lk, sdkn, sdvn, qk_scale, sm_scale, start_n,
                         HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype
        k = k_smem.index(WG)
        v = v_smem.index(WG)
        p_buf = p_smem.index(WG)
        ds_buf = ds_smem.index(WG)
        mbarrier.wait(kv_bar.index(WG), 0)
        dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, acc_layout)
        for j in range(gl.cdiv(Lq, BLOCK)):
            s = j % STAGES
            phase = (j // STAGES) & 1
            offs = j * BLOCK + gl.arange(0, BLOCK, rows)
            lse = gl.load(lse_ptr + stat_off + offs, mask=offs < Lq, other=float("inf"))
            delta = gl.load(delta_ptr + stat_off + offs, mask=offs < Lq, other=0.0)
            zero = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)  # not read (use_acc=False)
            mbarrier.wait(q_ready.index(s), phase)
            st = warpgroup_mma(q_smem.index(s), k.permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(s), phase)
            dp = warpgroup_mma(do_smem.index(s), v.permute((1, 0)), zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st,))
            p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 1))
            p_buf.store(p.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_buf.permute((1, 0)), do_smem.index(s), dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp,))
            ds = p * (dp - gl.expand_dims(delta, 1))
            ds_buf.store(ds.to(dtype))
            fence_async_shared()
            dk = warpgroup_mma(ds_buf.permute((1, 0)), q_smem.index(s), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(s))
            mbarrier.arrive(do_empty.index(s))
        start = start_n + WG * BLOCK
        _store_rows(dk_ptr, dkb, sdkn, start, Lk, dk * sm_scale, acc_layout)
        _store_rows(dv_ptr, dvb, sdvn, start, Lk, dv, acc_layout)

    # dQ_i = scale * sum_j dS_ij K_j,  dS_ij = P_ij * (dO_i V_j^T - delta_i)  (the consumer's queries i)
    @gluon.jit
    def _bwd_q_consumer(WG: gl.constexpr, dq_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, q_bar,
                        k_ready, k_empty, v_ready, v_empty, dqb, stat_off, Lq, Lk, sdqm, qk_scale, sm_scale, start_m,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype
        q = q_smem.index(WG)
        do = do_smem.index(WG)
        start = start_m + WG * BLOCK_M
        offs = start + gl.arange(0, BLOCK_M, rows)
        lse = gl.expand_dims(gl.load(lse_ptr + stat_off + offs, mask=offs < Lq, other=float("inf")), 1)
        delta = gl.expand_dims(gl.load(delta_ptr + stat_off + offs, mask=offs < Lq, other=0.0), 1)
        mbarrier.wait(q_bar.index(WG), 0)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        for j in range(Lk // BLOCK_N):
            s = j % STAGES
            phase = (j // STAGES) & 1
            zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # not read (use_acc=False)
            mbarrier.wait(k_ready.index(s), phase)
            st = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(s), phase)
            dp = warpgroup_mma(do, v_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st,))
            p = gl.exp2(st * qk_scale - lse)
            dp = warpgroup_mma_wait(0, deps=(dp,))
            mbarrier.arrive(v_empty.index(s))
            ds = gl.convert_layout((p * (dp - delta)).to(dtype), ds_layout)
            dq = warpgroup_mma(ds, k_smem.index(s), dq, is_async=True)
            dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
            mbarrier.arrive(k_empty.index(s))
        _store_rows(dq_ptr, dqb, sdqm, start, Lq, dq * sm_scale, acc_layout)

    @gluon.jit
    def _bwd_consumer(WG: gl.constexpr, KV, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, a_smem, b_smem, c_smem, d_smem,
                      p_smem, ds_smem, ab_bar, c_ready, c_empty, d_ready, d_empty, dqb, dkb, dvb, stat_off, Lq, Lk,
                      sdqm, sdkn, sdvn, qk_scale, sm_scale, start, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr,
                      STAGES: gl.constexpr):
        # a dK/dV program's consumer (A, B = K, V; C, D = Q, dO) or a dQ program's (A, B = Q, dO; C, D = K, V)
        if KV:
            _bwd_kv_consumer(WG, dk_ptr, dv_ptr, lse_ptr, delta_ptr, a_smem, b_smem, c_smem, d_smem, p_smem, ds_smem,
                             ab_bar, c_ready, c_empty, d_ready, d_empty, dkb, dvb, stat_off, Lq, Lk, sdkn, sdvn,
                             qk_scale, sm_scale, start, HEAD_DIM, BLOCK, STAGES)
        else:
            _bwd_q_consumer(WG, dq_ptr, lse_ptr, delta_ptr, a_smem, b_smem, c_smem, d_smem, ab_bar, c_ready, c_empty,
                            d_ready, d_empty, dqb, stat_off, Lq, Lk, sdqm, qk_scale, sm_scale, start, HEAD_DIM, BLOCK,
                            BLOCK, STAGES)

    @gluon.jit
    def _attn_bwd_hopper_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                                BH, H, Lq, Lk, qk_scale, sm_scale,
                                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
                                sdqb, sdqh, sdqm, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                                HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr):
        # Programs [0, BH * kv_blocks) are dK/dV programs (2 BLOCK keys of one (batch, head) each), the
        # rest dQ programs (2 BLOCK queries each): one launch, the longer dK/dV programs first, so the
        # dQ programs fill the SMs that dK/dV's last wave leaves idle (two launches each end on a
        # partial wave). Both kinds load two tiles once (A, B), stream two more (C, D) through rings
        # and share one shared-memory plan (P and dS buffers: dK/dV only).
        kv_blocks = Lk // (2 * BLOCK)
        pid = gl.program_id(0)
        KV = pid < BH * kv_blocks
        if KV:
            pid_bh = pid // kv_blocks
            start = (pid - pid_bh * kv_blocks) * (2 * BLOCK)
        else:
            q_blocks = gl.cdiv(Lq, 2 * BLOCK)
            pid_bh = (pid - BH * kv_blocks) // q_blocks
            start = (pid - BH * kv_blocks - pid_bh * q_blocks) * (2 * BLOCK)
        b = (pid_bh // H).to(gl.int64)
        h = (pid_bh % H).to(gl.int64)
        qb = b * sqb + h * sqh
        kb = b * skb + h * skh
        vb = b * svb + h * svh
        dob = b * sdob + h * sdoh
        if KV:
            a_ptr, b_ptr, c_ptr, d_ptr = k_ptr, v_ptr, q_ptr, do_ptr
            ab, bb, cb, db = kb, vb, qb, dob
            L_ab, L_cd, sa, sb, sc, sd = Lk, Lq, skn, svn, sqm, sdom
        else:
            a_ptr, b_ptr, c_ptr, d_ptr = q_ptr, do_ptr, k_ptr, v_ptr
            ab, bb, cb, db = qb, dob, kb, vb
            L_ab, L_cd, sa, sb, sc, sd = Lq, Lk, sqm, sdom, skn, svn
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], dtype)
        a_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HEAD_DIM], layout)
        b_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HEAD_DIM], layout)
        c_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], layout)
        d_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, BLOCK], p_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, BLOCK], p_layout)
        ab_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        c_ready, c_empty = _ring(STAGES, 2)
        d_ready, d_empty = _ring(STAGES, 2)
        for w in gl.static_range(2):
            mbarrier.init(ab_bar.index(w), count=1)
        stat_off = pid_bh.to(gl.int64) * Lq
        gl.warp_specialize([
            (_bwd_consumer, (0, KV, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, a_smem, b_smem, c_smem, d_smem, p_smem,
                             ds_smem, ab_bar, c_ready, c_empty, d_ready, d_empty, b * sdqb + h * sdqh,
                             b * sdkb + h * sdkh, b * sdvb + h * sdvh, stat_off, Lq, Lk, sdqm, sdkn, sdvn, qk_scale,
                             sm_scale, start, HEAD_DIM, BLOCK, STAGES)),
            (_bwd_consumer, (1, KV, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, a_smem, b_smem, c_smem, d_smem, p_smem,
                             ds_smem, ab_bar, c_ready, c_empty, d_ready, d_empty, b * sdqb + h * sdqh,
                             b * sdkb + h * sdkh, b * sdvb + h * sdvh, stat_off, Lq, Lk, sdqm, sdkn, sdvn, qk_scale,
                             sm_scale, start, HEAD_DIM, BLOCK, STAGES)),
            (_bwd_loader, (a_ptr, b_ptr, c_ptr, d_ptr, a_smem, b_smem, c_smem, d_smem, ab_bar, c_ready, c_empty,
                           d_ready, d_empty, ab, bb, cb, db, L_ab, L_cd, sa, sb, sc, sd, start, HEAD_DIM, BLOCK, BLOCK,
                           STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


def attention_bwd(q, k, v, do, lse, delta, dq, dk, dv, sq, sk, sv, sdo, sdq, sdk, sdv, B, H, Lq, Lk, D,
                  qk_scale, sm_scale, stages=3):
    """dQ, dK, dV of ``attention.attention_bwd`` (``qk_scale`` = scale * log2(e), ``sm_scale`` =
    scale) on a call that ``usable`` accepts, given lse2 and delta (B*H, Lq) in fp32; Lk a multiple
    of 2 x BWD_BLOCK; dO TMA-readable like Q. dQ, dK, dV are stored from registers in their own
    dtypes."""
    programs = (Lk // (2 * BWD_BLOCK) + -(-Lq // (2 * BWD_BLOCK))) * B * H
    launch(_attn_bwd_hopper_kernel, (programs,), q, k, v, do, lse, delta, dq, dk, dv, B * H, H, Lq, Lk,
           float(qk_scale), float(sm_scale), *sq, *sk, *sv, *sdo, *sdq, *sdk, *sdv,
           HEAD_DIM=D, BLOCK=BWD_BLOCK, STAGES=stages, CONSUMER_REGS=REGS_PER_CONSUMER[2], num_warps=4)
