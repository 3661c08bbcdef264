"""A persistent, warp-specialised GEMM for Hopper (sm_90) in Gluon: ``matmul.py``'s 2-D TMA problem
(16-bit operands, fp32 accumulation, the ``Fusion`` epilogue; a low-rank term U V as each tile's last k
block) with a TMA
producer warp, two consumer warpgroups issuing wgmma, and TMA stores. Also the W8A8 product of
``matmul``'s "fp8_w8a8" route: e4m3 codes for both operands (fp8 tensor cores, twice the 16-bit
rate), A with an fp32 scale per row and B per column, applied to the accumulator
(``SCALED``) before the epilogue.

The grid is at most one program per SM; each walks the output tiles pid, pid + programs, ... in
``matmul._tile_coords``' grouped order, in three partitions:
- the loader (1 warp, 24 registers): streams (A, B) blocks of BLOCK_K along K into a ring of STAGES
  shared-memory stages (``ready`` barriers count the bytes, ``empty`` barriers take one arrival per
  consumer that reads the stage), tile after tile, running ahead of the consumers across tiles;
- two consumers (4 warps each, the default partition and a worker, CONSUMER_REGS registers): each
  accumulates a (BLOCK_M, BLOCK_N) fp32 block with wgmma (one in flight: a stage is released once
  the wgmma after it has been issued and the one reading it waited), then applies the epilogue in
  registers (``matmul._epilogue``: alpha, bias, activation) and stores through its own shared
  buffer by TMA (the store left in flight until that buffer is needed again). A residual arrives
  by TMA into that buffer while the tile's main loop runs.
Two schedules (``COOP``):
- cooperative: a program tile is (2 BLOCK_M, BLOCK_N), each consumer takes half of its rows; a
  stage holds two A blocks and one B block, read by both (128x256 as CUTLASS's cooperative kernels);
- ping-pong: a program tile is (BLOCK_M, BLOCK_N) and the consumers take alternate tiles of the
  program's walk. The loader fills the ring in walk order, so a consumer's main loop starts as the
  other's ends, and each epilogue runs under the other consumer's wgmmas; the finer tile also
  evens out the last wave (4608 x 3072 is 432 tiles of 128x256, 3.3 waves on 132 SMs, but 864 of
  128x128 or 64x256, 6.5).
With SPLIT_K > 1 the walk covers each tile once per split of K, and a tile stores its split's fp32
product into that split's slice of a scratch (the epilogue is the split-K sum's, ``matmul``). With BOX_H > 0
A is a convolution's source read as its implicit GEMM (``Conv``, ``_loader``).
Operands are described along their contiguous dimension as in ``matmul._run_tma``: A (M, K) as
(BLOCK_M, BLOCK_K) blocks when K is contiguous, else (BLOCK_K, BLOCK_M) blocks read transposed by
wgmma; B (K, N) as (BLOCK_N, BLOCK_K) or (BLOCK_K, BLOCK_N) blocks. So the forward (x W^T) and both
backward products (dY W, dY^T X) run here. Rows and columns past the problem load as zeros and
are clipped on store. Descriptors are built on the host (``_descriptor``).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .. import autotune, runtime
from . import matmul as gemm
from .launch import Plan, descriptor_template, launch, launch_via

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # an older Triton: the other GEMM kernels serve every call
    gluon = None

# FLAME_MATMUL_GLUON=0 keeps every GEMM on matmul.py's kernels and every convolution on conv2d.py's
ROUTE = not runtime.INTERPRETER and os.environ.get("FLAME_MATMUL_GLUON", "1") != "0"
K_BYTES = 128  # bytes of K per operand row of a stage: BLOCK_K = 64 16-bit or 128 fp8 elements (128-byte swizzle)
CONSUMER_REGS = 240  # per thread; the loader warp's group gets 24 (12 warps x 168 registers at entry)


if gluon is not None:
    @gluon.jit
    def _tap_shift(tap, KW, B_h, C_h, B_w, C_w):
        """(rows, columns) from an output pixel to its source pixel at ``tap`` (``Conv``)."""
        kh = tap // KW
        return B_h + kh * C_h, B_w + (tap - kh * KW) * C_w

    @gluon.jit
    def _load_pixels(desc, smem, bar, first, shift_h, shift_w, c0, OH, OW, BOX_H: gl.constexpr, ROWS: gl.constexpr,
                     WIDTH: gl.constexpr):
        # output pixels first .. first + ROWS - 1 (flat (n, h, w) order: BOX_H rows of one image): the box
        # of their source pixels (h + shift_h, w + shift_w), channels c0.., by one 4-D TMA load (zero-filled
        # outside the image and past the channels) into the 2-D (ROWS, WIDTH) block ``smem`` (the same
        # bytes: the box's rows in order, swizzled alike)
        image = first // (OH * OW)
        pixel = first - image * (OH * OW)
        box = smem._reinterpret(desc.dtype, [1, BOX_H, ROWS // BOX_H, WIDTH], desc.layout)
        tma.async_copy_global_to_shared(desc, [image, pixel // OW + shift_h, pixel % OW + shift_w, c0], bar, box)

    @gluon.jit
    def _loader(a_desc, b_desc, bt_desc, u_desc, v_desc, vt_desc, a_smem, b_smem, bt_smem, ready, empty, M, N, K, OH,
                OW, C, KW, B_h, C_h, B_w, C_w, TAP_STRIDE, A_K: gl.constexpr, B_K: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TAIL_N: gl.constexpr, BLOCK_K: gl.constexpr,
                COOP: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr,
                BOX_H: gl.constexpr, WGRAD: gl.constexpr, SPLIT_K: gl.constexpr, LOW_RANK: gl.constexpr):
        # BOX_H > 0: a convolution's implicit GEMM (``Conv``), OH .. TAP_STRIDE its geometry, its
        # source's pixels read by ``_load_pixels``. Forward and input gradient: A is the source; k block
        # kk is channels (kk % c_blocks) * BLOCK_K.. of tap kk // c_blocks, and a tile's BLOCK_M rows are
        # output pixels whose A block is the box of their source pixels at that tap. B is the weight as
        # a (Co, taps * Ci) matrix: tap t's block starts t * TAP_STRIDE further along its columns (the
        # K offset when B_K, else the N offset). WGRAD (the weight gradient, dW (Co, taps * Ci) = dY^T
        # X_tap): A is dY^T (read as (pixels, Co) blocks), k block kk is output pixels kk * BLOCK_K..,
        # and B's block of columns (tap, channel c) (within one tap: C a multiple of the tile's) is
        # the box of their source pixels at that tap. LOW_RANK: after a tile's k blocks, one more of U's
        # rows and V's columns in B's layout (the rank padded to BLOCK_K with zeros by TMA).
        SUB: gl.constexpr = 2 if COOP else 1  # A blocks per stage
        c_blocks = gl.cdiv(C, BLOCK_K)
        MAIN_N: gl.constexpr = BLOCK_N - TAIL_N
        STEP_N: gl.constexpr = MAIN_N if GATED else BLOCK_N  # output columns per tile
        TAIL_OFF = N if GATED else MAIN_N  # B's rows (columns) of the tail block past the main one's
        num_pid_m = gl.cdiv(M, SUB * BLOCK_M)
        num_pid_n = gl.cdiv(N, STEP_N)
        k_steps = gl.cdiv(gl.cdiv(K, BLOCK_K), SPLIT_K)  # k blocks per split of K
        nbytes: gl.constexpr = (SUB * BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
        count = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, gl.num_programs(0)):
            split = tile // (num_pid_m * num_pid_n)
            pid_m, pid_n = gemm._tile_coords(tile - split * num_pid_m * num_pid_n, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * (SUB * BLOCK_M)
            off_n = pid_n * STEP_N
            if WGRAD:  # the tap and first channel of the tile's two blocks of columns
                tap_n = off_n // C
                n_h, n_w = _tap_shift(tap_n, KW, B_h, C_h, B_w, C_w)
                tap_t = (off_n + MAIN_N) // C
                t_h, t_w = _tap_shift(tap_t, KW, B_h, C_h, B_w, C_w)
            for kk in range(split * k_steps, (split + 1) * k_steps):
                s = count % STAGES
                mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                mbarrier.expect(ready.index(s), nbytes)
                if BOX_H > 0 and not WGRAD:
                    tap = kk // c_blocks
                    off_k = (kk - tap * c_blocks) * BLOCK_K
                    off_tap = tap * TAP_STRIDE
                    shift_h, shift_w = _tap_shift(tap, KW, B_h, C_h, B_w, C_w)
                else:
                    off_k = kk * BLOCK_K
                    off_tap = 0
                for w in gl.static_range(SUB):
                    if BOX_H > 0 and not WGRAD:
                        _load_pixels(a_desc, a_smem.index(s * SUB + w), ready.index(s), off_m + w * BLOCK_M,
                                     shift_h, shift_w, off_k, OH, OW, BOX_H, BLOCK_M, BLOCK_K)
                    elif A_K:
                        tma.async_copy_global_to_shared(a_desc, [off_m + w * BLOCK_M, off_k], ready.index(s),
                                                        a_smem.index(s * SUB + w))
                    else:
                        tma.async_copy_global_to_shared(a_desc, [off_k, off_m + w * BLOCK_M], ready.index(s),
                                                        a_smem.index(s * SUB + w))
                if WGRAD:
                    _load_pixels(b_desc, b_smem.index(s), ready.index(s), off_k, n_h, n_w, off_n - tap_n * C, OH, OW,
                                 BOX_H, BLOCK_K, MAIN_N)
                    if TAIL_N > 0:
                        _load_pixels(bt_desc, bt_smem.index(s), ready.index(s), off_k, t_h, t_w,
                                     off_n + MAIN_N - tap_t * C, OH, OW, BOX_H, BLOCK_K, TAIL_N)
                elif B_K:
                    tma.async_copy_global_to_shared(b_desc, [off_n, off_tap + off_k], ready.index(s), b_smem.index(s))
                    if TAIL_N > 0:
                        tma.async_copy_global_to_shared(bt_desc, [off_n + TAIL_OFF, off_tap + off_k], ready.index(s),
                                                        bt_smem.index(s))
                else:
                    tma.async_copy_global_to_shared(b_desc, [off_k, off_tap + off_n], ready.index(s), b_smem.index(s))
                    if TAIL_N > 0:
                        tma.async_copy_global_to_shared(bt_desc, [off_k, off_tap + off_n + TAIL_OFF], ready.index(s),
                                                        bt_smem.index(s))
                count += 1
            if LOW_RANK:
                s = count % STAGES
                mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                for w in gl.static_range(SUB):
                    tma.async_copy_global_to_shared(u_desc, [off_m + w * BLOCK_M, 0], ready.index(s),
                                                    a_smem.index(s * SUB + w))
                if B_K:
                    tma.async_copy_global_to_shared(v_desc, [off_n, 0], ready.index(s), b_smem.index(s))
                    if TAIL_N > 0:
                        tma.async_copy_global_to_shared(vt_desc, [off_n + MAIN_N, 0], ready.index(s), bt_smem.index(s))
                else:
                    tma.async_copy_global_to_shared(v_desc, [0, off_n], ready.index(s), b_smem.index(s))
                    if TAIL_N > 0:
                        tma.async_copy_global_to_shared(vt_desc, [0, off_n + MAIN_N], ready.index(s), bt_smem.index(s))
                count += 1

    @gluon.jit
    def _part_epilogue(acc, layout: gl.constexpr, off_m, off_n, M, N, bias_ptr, a_scale_ptr, b_scale_ptr, s_bias,
                       alpha, BIAS: gl.constexpr, ACT: gl.constexpr, SCALED: gl.constexpr, ROWS: gl.constexpr,
                       WIDTH: gl.constexpr):
        # (pre-activation, output) of the (ROWS, WIDTH) accumulator block at (off_m, off_n)
        offs_n = off_n + gl.arange(0, WIDTH, gl.SliceLayout(0, layout))
        if SCALED:  # W8A8: the products of codes times A's row scale and B's column scale
            offs_m = off_m + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
            a_scale = gl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
            b_scale = gl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc * a_scale[:, None] * b_scale[None, :]
        return gemm._epilogue(acc, alpha, bias_ptr, offs_n, offs_n < N, s_bias, BIAS, ACT)

    @gluon.jit
    def _consumer(WG: gl.constexpr, a_smem, b_smem, bt_smem, c_smem, ct_smem, ready, empty, res_bar, turn, c_desc,
                  ct_desc, pre_desc, pret_desc, res_desc, rest_desc, bias_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                  s_bias, alpha, rank_ratio, A_K: gl.constexpr, B_K: gl.constexpr, BIAS: gl.constexpr,
                  ACT: gl.constexpr, STORE_PRE: gl.constexpr, RESIDUAL: gl.constexpr, SCALED: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TAIL_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  COOP: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr,
                  SPLIT_K: gl.constexpr, LOW_RANK: gl.constexpr):
        # consumer WG (0 or 1): cooperative, rows WG * BLOCK_M + [0, BLOCK_M) of every program tile;
        # ping-pong, every other program tile, starting with tile WG of the walk. Ping-pong hands the
        # main loop over (``turn``) once every block of the consumer's tile has landed: a consumer
        # that waited on its next tile's stages earlier could be STAGES or more loads ahead of the
        # loader, where a ready barrier's parity reads as a completion from the previous round.
        # So the consumers' main loops take turns and each epilogue runs under the other's wgmmas.
        # A tile of BLOCK_N = MAIN_N + TAIL_N columns (a power of two and, for widths such as 160, a
        # smaller one: Gluon's blocks are powers of two) is two accumulators, each with its own B
        # blocks, wgmma and store buffer; TAIL_N = 0 leaves the second out. GATED (GEGLU): the tail
        # accumulates the gate columns N + [off_n, off_n + MAIN_N) of B beside the main block's
        # hidden ones, and the tile stores hidden * ACT(gate), MAIN_N output columns. LOW_RANK: once
        # A B is accumulated, the accumulator is scaled by rank_ratio and the tile's last k block adds
        # U V, so that the epilogue's alpha (the Fusion's scale) makes it alpha A B + beta U V.
        SUB: gl.constexpr = 2 if COOP else 1
        MAIN_N: gl.constexpr = BLOCK_N - TAIL_N
        STEP_N: gl.constexpr = MAIN_N if GATED else BLOCK_N
        PARTS: gl.constexpr = 2 if TAIL_N > 0 else 1  # wgmma groups a k block issues
        # wgmma's k per instruction: 32 bytes of each operand row (16 for 16-bit operands, 32 for fp8)
        instr_k: gl.constexpr = 256 // a_smem.dtype.primitive_bitwidth
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, MAIN_N, instr_k])
        tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, TAIL_N if TAIL_N > 0 else 8, instr_k])
        dtype: gl.constexpr = c_desc.dtype
        buf = c_smem.index(WG)
        buf_t = ct_smem.index(WG)
        bar = res_bar.index(WG)
        num_pid_m = gl.cdiv(M, SUB * BLOCK_M)
        num_pid_n = gl.cdiv(N, STEP_N)
        k_steps = gl.cdiv(gl.cdiv(K, BLOCK_K), SPLIT_K)  # k blocks per split of K
        programs = gl.num_programs(0)
        first = gl.program_id(0) + (0 if COOP else WG) * programs
        step = programs if COOP else 2 * programs
        res_phase = 0
        turns = 0
        if not COOP and WG == 1:  # consumer 0 goes first
            mbarrier.arrive(turn.index(0))
        for tile in range(first, num_pid_m * num_pid_n * SPLIT_K, step):
            if not COOP:
                mbarrier.wait(turn.index(WG), turns & 1)
                turns += 1
            split = tile // (num_pid_m * num_pid_n)
            pid_m, pid_n = gemm._tile_coords(tile - split * num_pid_m * num_pid_n, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * (SUB * BLOCK_M) + (WG * BLOCK_M if COOP else 0)
            off_n = pid_n * STEP_N
            if RESIDUAL:  # into the store buffers once their last stores have been read
                tma.store_wait(0)
                mbarrier.expect(bar, BLOCK_M * BLOCK_N * dtype.primitive_bitwidth // 8)
                tma.async_copy_global_to_shared(res_desc, [off_m, off_n], bar, buf)
                if TAIL_N > 0:
                    tma.async_copy_global_to_shared(rest_desc, [off_m, off_n + MAIN_N], bar, buf_t)
            # ring position: the walk's k blocks so far
            count = (tile - gl.program_id(0)) // programs * (k_steps + LOW_RANK)
            s = count % STAGES
            # a fresh accumulator per tile (not read: use_acc is off for the first k block); one carried
            # over from the last tile would be live through the epilogue beside its result
            acc = gl.zeros([BLOCK_M, MAIN_N], gl.float32, acc_layout)
            if TAIL_N > 0:
                acc_t = gl.zeros([BLOCK_M, TAIL_N], gl.float32, tail_layout)
            for kk in range(k_steps):
                s = count % STAGES
                mbarrier.wait(ready.index(s), (count // STAGES) & 1)
                a = a_smem.index(s * SUB + (WG if COOP else 0))
                if not A_K:
                    a = a.permute((1, 0))
                b = b_smem.index(s)
                if B_K:
                    b = b.permute((1, 0))
                acc = warpgroup_mma(a, b, acc, use_acc=kk > 0, is_async=True)
                if TAIL_N > 0:
                    b_t = bt_smem.index(s)
                    if B_K:
                        b_t = b_t.permute((1, 0))
                    acc_t = warpgroup_mma(a, b_t, acc_t, use_acc=kk > 0, is_async=True)
                    acc, acc_t = warpgroup_mma_wait(PARTS, deps=(acc, acc_t))
                else:
                    acc = warpgroup_mma_wait(PARTS, deps=(acc,))
                if kk > 0:  # the previous stage's wgmmas are done
                    mbarrier.arrive(empty.index((count - 1) % STAGES))
                count += 1
            if LOW_RANK:
                s = count % STAGES
                mbarrier.wait(ready.index(s), (count // STAGES) & 1)
                if TAIL_N > 0:
                    acc, acc_t = warpgroup_mma_wait(0, deps=(acc, acc_t))
                    acc_t = acc_t * rank_ratio
                else:
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                acc = acc * rank_ratio
                mbarrier.arrive(empty.index((count - 1) % STAGES))
                u = a_smem.index(s * SUB + (WG if COOP else 0))
                v = b_smem.index(s)
                if B_K:
                    v = v.permute((1, 0))
                acc = warpgroup_mma(u, v, acc, is_async=True)
                if TAIL_N > 0:
                    v_t = bt_smem.index(s)
                    if B_K:
                        v_t = v_t.permute((1, 0))
                    acc_t = warpgroup_mma(u, v_t, acc_t, is_async=True)
                count += 1
            if not COOP:
                mbarrier.arrive(turn.index(1 - WG))
            if TAIL_N > 0:
                acc, acc_t = warpgroup_mma_wait(0, deps=(acc, acc_t))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(s))

            if SPLIT_K > 1:  # this split's fp32 product into its slice of the scratch C, M rounded up to tiles
                slice_row = split * (num_pid_m * SUB * BLOCK_M) + off_m
                tma.store_wait(0)
                buf.store(acc)
                if TAIL_N > 0:
                    buf_t.store(acc_t)
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [slice_row, off_n], buf)
                if TAIL_N > 0:
                    tma.async_copy_shared_to_global(ct_desc, [slice_row, off_n + MAIN_N], buf_t)
            elif GATED:  # hidden * ACT(gate), each with its bias (the gate's N columns further on)
                _, out = _part_epilogue(acc, acc_layout, off_m, off_n, M, N, bias_ptr, a_scale_ptr, b_scale_ptr,
                                        s_bias, alpha, BIAS, 0, SCALED, BLOCK_M, MAIN_N)
                _, gate = _part_epilogue(acc_t, tail_layout, off_m, off_n, M, N, bias_ptr + N * s_bias, a_scale_ptr,
                                         b_scale_ptr, s_bias, alpha, BIAS, ACT, SCALED, BLOCK_M, TAIL_N)
                tma.store_wait(0)
                buf.store((out * gate).to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [off_m, off_n], buf)
            else:
                # with STORE_PRE the activation is applied after the pre-activation is stored (both tiles
                # held at once spill)
                pre, out = _part_epilogue(acc, acc_layout, off_m, off_n, M, N, bias_ptr, a_scale_ptr, b_scale_ptr,
                                          s_bias, alpha, BIAS, 0 if STORE_PRE else ACT, SCALED, BLOCK_M, MAIN_N)
                if TAIL_N > 0:
                    pre_t, out_t = _part_epilogue(acc_t, tail_layout, off_m, off_n + MAIN_N, M, N, bias_ptr,
                                                  a_scale_ptr, b_scale_ptr, s_bias, alpha, BIAS,
                                                  0 if STORE_PRE else ACT, SCALED, BLOCK_M, TAIL_N)
                if RESIDUAL:
                    mbarrier.wait(bar, res_phase)
                    res_phase ^= 1
                    out += buf.load(acc_layout).to(gl.float32)
                    if TAIL_N > 0:
                        out_t += buf_t.load(tail_layout).to(gl.float32)
                else:
                    tma.store_wait(0)
                if STORE_PRE:
                    buf.store(pre.to(dtype))
                    if TAIL_N > 0:
                        buf_t.store(pre_t.to(dtype))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(pre_desc, [off_m, off_n], buf)
                    out = gemm._apply(pre, pre, pre, 0.0, 0.0, ACT)
                    if TAIL_N > 0:
                        tma.async_copy_shared_to_global(pret_desc, [off_m, off_n + MAIN_N], buf_t)
                        out_t = gemm._apply(pre_t, pre_t, pre_t, 0.0, 0.0, ACT)
                    tma.store_wait(0)
                buf.store(out.to(dtype))
                if TAIL_N > 0:
                    buf_t.store(out_t.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [off_m, off_n], buf)
                if TAIL_N > 0:
                    tma.async_copy_shared_to_global(ct_desc, [off_m, off_n + MAIN_N], buf_t)
        tma.store_wait(0)

    # C = ACT(alpha * A B + bias) (+ R): see the module's docstring. The sizes only count tiles and
    # blocks (the descriptors carry the shapes), so they are not specialised on: one compiled kernel
    # per config serves every shape.
    @gluon.jit(do_not_specialize=["M", "N", "K", "s_bias", "OH", "OW", "C", "KW", "B_h", "C_h", "B_w", "C_w",
                                  "TAP_STRIDE"])
    def _gemm_hopper_kernel(a_desc, b_desc, bt_desc, c_desc, ct_desc, pre_desc, pret_desc, res_desc, rest_desc,
                            u_desc, v_desc, vt_desc, bias_ptr, a_scale_ptr, b_scale_ptr, M, N, K, s_bias, alpha,
                            rank_ratio, OH, OW, C, KW, B_h, C_h, B_w, C_w, TAP_STRIDE, A_K: gl.constexpr,
                            B_K: gl.constexpr, BIAS: gl.constexpr, ACT: gl.constexpr, STORE_PRE: gl.constexpr,
                            RESIDUAL: gl.constexpr, SCALED: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, TAIL_N: gl.constexpr, BLOCK_K: gl.constexpr, COOP: gl.constexpr,
                            STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            GATED: gl.constexpr, BOX_H: gl.constexpr, WGRAD: gl.constexpr,
                            SPLIT_K: gl.constexpr, LOW_RANK: gl.constexpr):
        SUB: gl.constexpr = 2 if COOP else 1
        MAIN_N: gl.constexpr = BLOCK_N - TAIL_N
        dtype: gl.constexpr = a_desc.dtype
        # a convolution's pixel boxes (4-D descriptors) land in 2-D blocks, as wgmma reads them
        if BOX_H > 0 and not WGRAD:
            a_smem = gl.allocate_shared_memory(dtype, [STAGES * SUB, BLOCK_M, BLOCK_K],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
        else:
            a_smem = gl.allocate_shared_memory(dtype, [STAGES * SUB] + a_desc.block_type.shape, a_desc.layout)
        if WGRAD:
            b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, MAIN_N],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_K, MAIN_N], dtype))
        else:
            b_smem = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        if TAIL_N > 0 and WGRAD:
            bt_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, TAIL_N],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_K, TAIL_N], dtype))
        elif TAIL_N > 0:  # the tile's last TAIL_N columns (the host's tail descriptors)
            bt_smem = gl.allocate_shared_memory(dtype, [STAGES] + bt_desc.block_type.shape, bt_desc.layout)
        else:  # a stand-in, never read
            bt_smem = b_smem
        if TAIL_N > 0 and not GATED:  # a gated tile stores its main block only
            ct_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + ct_desc.block_type.shape, ct_desc.layout)
        else:
            ct_smem = c_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        res_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=SUB)  # one arrival per consumer reading the stage
        for w in gl.static_range(2):
            mbarrier.init(res_bar.index(w), count=1)
            mbarrier.init(turn.index(w), count=1)
        # (the argument tuples are written out in the call: a tuple bound to a name first would turn
        # the constexprs in it into tensors, Triton 3.6)
        gl.warp_specialize([
            (_consumer, (0, a_smem, b_smem, bt_smem, c_smem, ct_smem, ready, empty, res_bar, turn, c_desc, ct_desc,
                         pre_desc, pret_desc, res_desc, rest_desc, bias_ptr, a_scale_ptr, b_scale_ptr, M, N, K, s_bias,
                         alpha, rank_ratio, A_K, B_K, BIAS, ACT, STORE_PRE, RESIDUAL, SCALED, BLOCK_M, BLOCK_N, TAIL_N,
                         BLOCK_K, COOP, STAGES, GROUP_M, GATED, SPLIT_K, LOW_RANK)),
            (_consumer, (1, a_smem, b_smem, bt_smem, c_smem, ct_smem, ready, empty, res_bar, turn, c_desc, ct_desc,
                         pre_desc, pret_desc, res_desc, rest_desc, bias_ptr, a_scale_ptr, b_scale_ptr, M, N, K, s_bias,
                         alpha, rank_ratio, A_K, B_K, BIAS, ACT, STORE_PRE, RESIDUAL, SCALED, BLOCK_M, BLOCK_N, TAIL_N,
                         BLOCK_K, COOP, STAGES, GROUP_M, GATED, SPLIT_K, LOW_RANK)),
            (_loader, (a_desc, b_desc, bt_desc, u_desc, v_desc, vt_desc, a_smem, b_smem, bt_smem, ready, empty, M, N,
                       K, OH, OW, C, KW, B_h, C_h, B_w, C_w, TAP_STRIDE, A_K, B_K, BLOCK_M, BLOCK_N, TAIL_N, BLOCK_K,
                       COOP, STAGES, GROUP_M, GATED, BOX_H, WGRAD, SPLIT_K, LOW_RANK)),
        ], [4, 1], [CONSUMER_REGS, 24])


@functools.cache
def available():
    """Whether the Gluon kernel can run here: Gluon importable, not the interpreter, an sm_90 GPU."""
    return (gluon is not None and not runtime.INTERPRETER and torch.cuda.is_available()
            and torch.cuda.get_device_capability(runtime.device) == (9, 0))


def serves(dtype, rank, pre_out, residual, su=(0, 0), sv=(0, 0), b_k=True):
    """Whether this kernel's epilogue and operands fit a 2-D problem that ``matmul._layout`` accepted,
    from its description (``matmul.GemmProblem``): fp16/bf16 operands of one dtype (or e4m3 codes of
    both, the W8A8 product: ``matmul(..., a_scale=)``), not both a pre-activation and a residual (one
    store buffer per consumer; ``linear_`` never asks for both), and a low-rank term U V (strides
    ``su``, ``sv``) only of 16-bit operands and a rank of at most a k block, U's rows and V's in B's
    layout (``b_k``: along K) contiguous and 16-byte aligned (``takes_low_rank``)."""
    return (dtype in _GL_DTYPES and not (pre_out and residual)
            and (not rank or (dtype.itemsize == 2 and takes_low_rank(rank, su, sv, b_k, dtype.itemsize))))


def takes_low_rank(rank, su, sv, b_k, itemsize):
    """Whether U (M, rank) and V (rank, N) of these strides can be the tile's last k block: U read
    as A is (rows along K), V as B is (``b_k``: contiguous along the rank, else along N), both
    TMA-describable, the rank at most BLOCK_K."""
    v_rows, v_step = (sv[1], sv[0]) if b_k else (sv[0], sv[1])
    return (rank <= K_BYTES // itemsize and su[1] == 1 and v_step == 1
            and (su[0] * itemsize) % 16 == 0 and (v_rows * itemsize) % 16 == 0)


def usable(a, b, f, b_k=True):
    """Whether this kernel can serve a 2-D problem on these buffers with the epilogue ``f`` (a
    ``Fusion``; B read along K when ``b_k``): ``available`` and ``serves``."""
    return (b.dtype == a.dtype and serves(a.dtype, f.rank, f.pre_out is not None, f.residual is not None,
                                          f.u_strides, f.v_strides, b_k)
            and available())


def plan(M, N, K, a, b, f):
    """The launch config (``config``) for a 2-D problem on these buffers that ``matmul._layout``
    accepted, or None where this kernel does not serve it (not ``usable``, FLAME_MATMUL_GLUON=0, or
    measured slower than the TMA kernel: ``_choose``). ``matmul.plan`` asks ``serves`` and
    ``_choose`` itself, from the problem's description, and memoises the answer in its route."""
    if not ROUTE or not usable(a, b, f):
        return None
    return _choose(M, N, K)


# The tile shapes _choose picks from: (COOP, BLOCK_M, BLOCK_N) -> main-loop rate relative to the
# cooperative 2 x 64x256 one, and the cooperative epilogue's cost in steps of K (it runs after the
# main loop; ping-pong's runs under the other consumer's). Fitted on an H200, bf16, Triton 3.6
# (scripts/bench_gemm.py, notes/gemm.md): the model picked the fastest of the three on each of the 23
# Flux, SDXL and 8192-cube shapes of that (short-burst) run; timed in 20 ms bursts at the card's
# power limit, the route beat matmul.py's TMA kernel on 34 of 35 shape x problem rows (3% slower on
# 4096x3072->3072).
TILES = {(True, 64, 256): 1.0, (False, 128, 128): 0.95, (False, 64, 128): 0.83, (True, 64, 160): 0.93}
COOP_EPILOGUE_K = 90
# Problems of fewer 128x128 tiles than SMs stay on the TMA kernel (its small tiles and split-K win there: H200,
# 1024x1280->1280 and 1024x5120->1280, 80 tiles, TMA 1.27x / 1.26x cuBLAS's time, Gluon 1.38x / 1.34x)
MIN_TILES_PER_SM = 1


def _choose(M, N, K, sms=None, speed=1, split=False, max_split=4, n_divides=None):
    """The tile shape of least predicted time on ``sms`` SMs (default: this GPU's): whole waves of one
    program tile per SM (the last one partly idle) times a tile's cost (its area over its main-loop
    rate, times K over the operands' ``speed`` (2 for fp8: twice the 16-bit MMA rate), plus the
    cooperative epilogue); None for problems of fewer than MIN_TILES_PER_SM 128x128 tiles per SM.
    ``split`` (a convolution's long K): such a problem may instead split K in 2 to ``max_split``
    (``SPLIT_K``; at least 4 k blocks a split) where that, with the split-K sum's cost
    (``_split_sum_cost``), is predicted faster; unsplit, it stays None. ``n_divides``: only tiles
    whose columns divide it (None when none does)."""
    sms = sms or runtime.num_sms()
    small = gemm.cdiv(M, 128) * gemm.cdiv(N, 128) < MIN_TILES_PER_SM * sms
    if small and not split:
        return None
    k_blocks = gemm.cdiv(K, K_BYTES // 2 * speed)

    def rows(tile):
        return 2 * tile[1] if tile[0] else tile[1]

    def cost(option):
        tile, splits = option
        waves = gemm.cdiv(gemm.cdiv(M, rows(tile)) * gemm.cdiv(N, tile[2]) * splits, sms)
        k = gemm.cdiv(k_blocks, splits) * K_BYTES // 2
        main = waves * rows(tile) * tile[2] * (k + (COOP_EPILOGUE_K if tile[0] else 0)) / TILES[tile]
        return main + (_split_sum_cost(M, N, splits) if splits > 1 else 0)

    tiles = [tile for tile in TILES if n_divides is None or n_divides % tile[2] == 0]
    options = [(tile, 1) for tile in tiles]
    if split and speed == 1:
        options += [(tile, s) for tile in tiles for s in range(2, max_split + 1) if k_blocks >= 4 * s]
    if not options:
        return None
    (coop, bm, bn), splits = min(options, key=cost)
    if small and splits == 1:
        return None
    return config(coop=coop, block_m=bm, block_n=bn, split_k=splits)


# The split-K sum in _choose's units (a program tile's rows x columns x K): the fp32 partial products
# written and read back and the output written, about 0.9 units a byte (H200: ~3 TB/s against the
# kernel's ~700 TFLOP/s over 132 SMs), and ~4 us for its launch and tail
SPLIT_SUM_BYTE = 0.9
SPLIT_SUM_LAUNCH = 1e7


def _split_sum_cost(M, N, splits):
    return SPLIT_SUM_BYTE * (8 * splits + 2) * M * N + SPLIT_SUM_LAUNCH


def config(coop=True, block_m=None, block_n=None, stages=None, group_m=8, split_k=1):
    """Launch config (BLOCK_M, BLOCK_N, COOP, STAGES, GROUP_M, SPLIT_K): BLOCK_M rows and BLOCK_N columns
    per consumer (cooperative default 64 x 256, ping-pong 128 x 128); STAGES at most ``stages``, as
    many as the GPU's shared memory holds beside the two store buffers (``stages_that_fit``: fp32
    ones for SPLIT_K > 1, the splits of K whose products ``matmul`` sums)."""
    if block_m is None:
        block_m = 64 if coop else 128
    if block_n is None:
        block_n = 256 if coop else 128
    fit = stages_that_fit(block_m, block_n, coop, 4 if split_k > 1 else 2)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, COOP=coop, STAGES=fit if stages is None else min(stages, fit),
                GROUP_M=group_m, SPLIT_K=split_k)


@functools.cache
def gated_config():
    """The launch config of the gated (GEGLU) mode, ``matmul(..., gated=True)``: ping-pong
    64 x (128 + 128) tiles, each consumer's epilogue under the other's main loop (made once: the
    stage count asks the GPU's shared memory)."""
    return config(coop=False, block_m=64, block_n=256)


def stages_that_fit(block_m, block_n, coop, es, limit=None):
    """The most ring stages (at most 8) that fit the shared memory (``limit`` bytes, default the
    GPU's) beside the two (BLOCK_M, BLOCK_N) store buffers of ``es``-byte outputs and the barriers (a
    stage holds K_BYTES of K per operand row, whatever the operands' dtype)."""
    limit = limit or autotune.shared_memory()
    stage = ((2 if coop else 1) * block_m + block_n) * K_BYTES
    room = limit - 2 * block_m * block_n * es - 1024
    return max(1, min(8, room // stage))


def split_width(block_n):
    """(main, tail): a tile's BLOCK_N columns as a power of two and the rest, itself a power of two
    of at least 16 or 0 (160 = 128 + 32, 192 = 128 + 64, 128 = 128 + 0)."""
    main = 1 << (block_n.bit_length() - 1)
    tail = block_n - main
    if tail and (tail < 16 or tail & (tail - 1)):
        raise ValueError(f"matmul_hopper: BLOCK_N={block_n} is not a power of two plus a smaller one of at least 16")
    return main, tail


def _template(base, shape, strides, block_shape):
    """The fields of a Gluon TMA descriptor of buffers like ``base`` (``launch.descriptor_template``:
    Triton's checks, made once per dtype, shape, strides and block) with the default swizzled
    shared layout of its block, which Gluon's host descriptors carry."""
    fields = dict(descriptor_template(base, shape, strides, block_shape))  # its base None
    fields["layout"] = _shared_layout(base.dtype, tuple(block_shape))
    return fields


@functools.cache
def _shared_layout(dtype, block_shape):
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _GL_BUFFER_DTYPES[dtype])


# the operands' dtypes; the buffers' add split-K's fp32 scratch
_GL_DTYPES = {} if gluon is None else {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
                                       torch.float8_e4m3fn: gl.float8e4nv}
_GL_BUFFER_DTYPES = {} if gluon is None else {**_GL_DTYPES, torch.float32: gl.float32}


class _Launch:
    """What ``matmul`` keeps per (problem, config, dtypes, epilogue switches): the kernel's launch
    ``plan`` and ``grid``, its leading descriptor arguments (A, B, B's tail, C, C's tail, the
    pre-activation's pair, the residual's pair; None for those the kernel does not read: Triton's
    launcher encodes every descriptor passed, ~1 us of host time each), made once from their
    templates, and ``fills``: (descriptor, source) pairs, the source an index into (A, B, C,
    pre-activation, residual), whose bases each launch sets for the call (a new descriptor per
    launch cost as much host time as the rest of the launch)."""

    __slots__ = ("plan", "grid", "descriptors", "fills", "k", "geometry")

    def __init__(self, out, a, b, M, N, K, f, layout, cfg, scaled, gated, conv):
        a_k, b_k, s_a, s_b, s_c = layout
        bm, bn, coop = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["COOP"]
        main, tail = (bn // 2, bn // 2) if gated else split_width(bn)
        block_k = K_BYTES // a.element_size()
        widths = (main, tail)  # a tile's two blocks of columns (the tail's 0 without one)
        self.k, self.geometry, b_k_size, b_n_size = K, (0,) * 9, K, N  # the kernel's K and conv geometry; B's extents
        if conv is not None:
            self.geometry = (conv.OH, conv.OW, conv.C, conv.KW, conv.B_h, conv.C_h, conv.B_w, conv.C_w,
                             conv.C if b_k else N)
        if conv is not None and not conv.weight_grad:  # A's pixel boxes; B's taps along K (forward) or N (dX)
            taps = conv.KH * conv.KW
            specs = [(0, conv.boxes(a, bm, block_k))]
            self.k = taps * gemm.cdiv(conv.C, block_k) * block_k  # every tap's channel blocks
            if not b_k:  # (k=co, n=ci) blocks: K is the Co channels
                b_k_size, b_n_size = conv.C, taps * N
        else:
            specs = [(0, (a, [M, K], [s_a, 1], [bm, block_k]) if a_k else (a, [K, M], [s_a, 1], [block_k, bm]))]
        if gated:  # B's hidden and gate halves: one (2N, K) descriptor (passed for B's tail too), read at two rows
            specs.append((1, (b, [2 * N, K], [s_b, 1], [main, block_k])))
        elif conv is not None and conv.weight_grad:  # B's pixel boxes: block_k pixels x a block of columns
            for w in widths:
                specs.append((1, None if not w else conv.boxes(b, block_k, w)))
        else:
            for w in widths:
                specs.append((1, None if not w else (b, [b_n_size, b_k_size], [s_b, 1], [w, block_k]) if b_k else
                              (b, [b_k_size, b_n_size], [s_b, 1], [block_k, w])))
        splits = cfg["SPLIT_K"]  # split K: C is the fp32 scratch of the products, a slice of split_rows a split
        for source, t in ((2, out), (3, f.pre_out), (4, f.residual)):  # each buffer the tile writes
            specs += [(source, None if t is None or not w or (gated and part) else
                       (t, [splits * split_rows(M, cfg), N], [N, 1], [bm, w]) if splits > 1 and source == 2 else
                       (t, [M, N], [s_c, 1], [bm, w]))
                      for part, w in enumerate(widths)]  # a gated tile writes its first part only
        if f.rank:  # U as A's blocks of the tile's last k block, V as B's (the rank zero-filled up to BLOCK_K)
            (su, _), (sv0, sv1) = f.u_strides, f.v_strides
            specs.append((5, (f.u, [M, f.rank], [su, 1], [bm, block_k])))
            for w in widths:
                specs.append((6, None if not w else (f.v, [N, f.rank], [sv1, 1], [w, block_k]) if b_k else
                              (f.v, [f.rank, N], [sv0, 1], [block_k, w])))
        else:
            specs += [(5, None), (6, None), (6, None)]
        self.descriptors, self.fills = [], []
        for source, spec in specs:
            made = None
            if spec is not None:
                made = object.__new__(TensorDescriptor)  # Gluon's class: Triton specialises on it and its layout
                made.__dict__ = _template(*spec)
                self.fills.append((made, source))
            self.descriptors.append(made)
        if gated:
            self.descriptors.insert(2, self.descriptors[1])
        self.descriptors = tuple(self.descriptors)
        self.fills = tuple(self.fills)
        meta = dict(A_K=a_k, B_K=b_k, BIAS=f.bias is not None, ACT=f.act, STORE_PRE=f.pre_out is not None,
                    RESIDUAL=f.residual is not None, SCALED=scaled, BLOCK_K=block_k, TAIL_N=tail,
                    CONSUMER_REGS=CONSUMER_REGS, GATED=gated, BOX_H=0 if conv is None else conv.box_h,
                    WGRAD=conv is not None and conv.weight_grad, LOW_RANK=f.rank > 0, num_warps=4, **cfg)
        # the plan keys its compiled kernels on its tensor arguments' dtypes (the bias and the
        # scales, C standing in for those switched off) and its descriptors' (blocks and layouts
        # follow from the constexprs); the sizes are not specialised on
        self.plan = Plan(_gemm_hopper_kernel, meta)
        self.grid = (min(gemm.cdiv(M, 2 * bm if coop else bm) * gemm.cdiv(N, main if gated else bn) * splits,
                         runtime.num_sms()),)


_launches: dict = {}  # (sizes, layout, dtypes, epilogue switches, config) -> _Launch
_MAX_LAUNCHES = 4096


def matmul(out, a, b, M, N, K, f, layout, cfg, a_scale=None, gated=False, conv=None):
    """``out`` (M, N) = the epilogue ``f`` of A B on a problem that ``usable`` accepts, with
    ``layout`` from ``matmul._tma_layout`` and the launch config ``cfg`` (``config``). W8A8: ``a``
    and ``b`` hold float8_e4m3fn codes, both read along K, with ``a_scale`` (M,) fp32 per row of A
    and ``f.b_scale`` (N,) per column of B: ``A B = diag(a_scale) codes_A codes_B diag(b_scale)``.
    ``gated`` (GEGLU, ``matmul.linear_geglu``): B (2N, K) read along K, ``out = (A B_h^T + bias_h)
    * act(A B_g^T + bias_g)`` over its hidden rows [0, N) and gate rows [N, 2N) (the bias (2N,)
    likewise, ``f.act`` the gate's activation), each tile's hidden and gate blocks side by side
    (``cfg``'s BLOCK_N split in halves); no pre-activation, residual or scales. ``conv`` (a
    ``Conv``): A is that convolution's channels-last source ``a``, read as its implicit GEMM (M
    output pixels, K = taps x C), and ``b`` its weight as a (Co, taps * Ci) matrix (see ``Conv``).
    ``cfg``'s SPLIT_K > 1 (``_choose(split=True)``): each split of K writes its fp32 product to its
    slice of a scratch (``split_rows`` rows), which ``matmul.split_k_sum_`` sums into ``out`` with
    the epilogue ``f`` (not with a low-rank term: ``f``'s U V is each tile's last k block)."""
    splits = cfg["SPLIT_K"]
    if splits > 1:  # the kernel writes each split's fp32 product, the sum applies the epilogue
        if f.rank:
            raise ValueError("matmul_hopper: a low-rank term is each tile's last k block, not a split-K sum's term")
        rows = split_rows(M, cfg)
        result, fusion, out = out, f, runtime.empty((splits * rows, N), torch.float32)
        f = gemm.Fusion()
    pre, res = f.pre_out, f.residual
    key = (M, N, K, layout, a.dtype, out.dtype, f.bias is not None, f.act, None if pre is None else pre.dtype,
           None if res is None else res.dtype, a_scale is not None, gated, conv, f.rank, f.u_strides, f.v_strides,
           *cfg.values())
    kept = _launches.get(key)
    if kept is None:
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        kept = _launches[key] = _Launch(out, a, b, M, N, K, f, layout, cfg, a_scale is not None, gated, conv)
    sources = (a, b, out, pre, res, f.u, f.v)
    aligned = 0
    for made, source in kept.fills:
        made.base = sources[source]
        aligned |= made.base.data_ptr()
    try:
        if aligned % 16:
            raise ValueError("matmul_hopper: a TMA operand's base is not 16-byte aligned")
        launch_via(launch, kept.plan, kept.grid,
                   (*kept.descriptors, gemm._or(f.bias, out), gemm._or(a_scale, out), gemm._or(f.b_scale, out),
                    M, N, kept.k, f.bias_stride, f.scale, f.rank_ratio, *kept.geometry))
    finally:  # the kept descriptors hold no buffer between launches
        for made, _ in kept.fills:
            made.base = None
    if splits > 1:
        return gemm.split_k_sum_(result, (layout[4], 1), out.view(splits, rows, N)[:, :M], fusion)
    return out


def split_rows(M, cfg):
    """The rows of one split's slice of the split-K scratch: M rounded up to the program tile's rows
    (a tile's TMA store into its slice never reaches the next one)."""
    tile = 2 * cfg["BLOCK_M"] if cfg["COOP"] else cfg["BLOCK_M"]
    return gemm.cdiv(M, tile) * tile


class Conv(NamedTuple):
    """A stride-1 convolution as this kernel's implicit GEMM (``matmul(..., conv=)``, one group): the
    source's NB x XH x XW pixels of C channels (contiguous) at pixel ``strides`` (n, h, w); output
    pixel (h, w) of OH x OW reads tap (kh, kw) (of KH x KW) at source pixel (h + B_h + kh * C_h, w +
    B_w + kw * C_w) (forward and weight gradient: B = -padding, C = dilation; input gradient: B =
    padding, C = -dilation); ``box_h`` rows of pixels per block of pixels (``box_rows``: BLOCK_M
    output pixels of A, or with ``weight_grad`` BLOCK_K of B). ``weight_grad``: the product is dW
    (Co, taps * C) = dY^T X_tap, A dY as an (output pixels, Co) matrix read transposed, B the source
    (C a multiple of the tile's columns, so that a block of them is one tap's)."""

    NB: int
    XH: int
    XW: int
    C: int
    strides: tuple
    OH: int
    OW: int
    KH: int
    KW: int
    B_h: int
    C_h: int
    B_w: int
    C_w: int
    box_h: int
    weight_grad: bool = False

    def boxes(self, source, rows, width):
        """(buffer, shape, strides, block shape) of the source's descriptor in blocks of ``rows`` pixels
        (``box_h`` rows of them) x ``width`` channels."""
        return (source, [self.NB, self.XH, self.XW, self.C], [*self.strides, 1],
                [1, self.box_h, rows // self.box_h, width])


def box_rows(block_m, OH, OW):
    """The rows of pixels of an A block of ``block_m`` output pixels (``Conv.box_h``): 1 when the
    blocks tile each image row (OW a multiple of ``block_m``), ``block_m / OW`` when they are whole
    rows that tile each image; None otherwise (a block would straddle rows or images: no TMA box)."""
    if OW % block_m == 0:
        return 1
    if block_m % OW == 0 and (OH * OW) % block_m == 0:
        return block_m // OW
    return None
