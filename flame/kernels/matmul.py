"""Batched GEMM: ``C[b] = A[b] @ B[b]`` over buffers with arbitrary strides.

One kernel, ``_matmul_kernel``, computes a (BLOCK_M, BLOCK_N) tile of one batch entry per program:
- A, B and C each come with two batch strides, a row stride and a column stride, so a transposed
  or sliced operand (a weight read as ``W^T``, ``dC @ B^T`` in the backward) and a broadcast batch
  dim (stride 0) are read in place, never copied. More batch dims than two are collapsed on the
  host where the strides allow, else peeled off in Python.
- Tiles are visited in grouped order (GROUP_M row-tiles share the same column tiles in a row of
  the launch order) so consecutive programs reuse A and B panels from L2.
- Accumulation is fp32 (fp64 for fp64 inputs, with ``input_precision="ieee"``); fp32 inputs use
  tf32 tensor cores on the GPU and exact products in the interpreter; fp16/bf16 inputs go to the
  tensor cores as they are. The tile is stored in C's dtype.

- A ``Fusion`` adds work to the tile before it is stored: a scale, a bias, an activation (its
  argument kept for the backward), a residual, and a low-rank product U V (LoRA's up-projection
  inside the base GEMM: one more tl.dot of depth r per tile).

Which kernel runs a GEMM is data (see "routes" below): ``plan(GemmProblem) -> Route``, memoised per
problem. 16-bit 2-D problems on Hopper run ``_matmul_tma_kernel`` (TMA loads, persistent) or, on an
sm_90 GPU with Gluon, the warp-specialised kernel of ``matmul_hopper`` where it is faster; GEMMs with
few output tiles and a long K split K. Launch configs come from ``flame.tune``: a tuning-table entry
or the heuristics below (``_config``, ``_tma_config``).
"""
import dataclasses
import itertools
import math
import os
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from . import matmul_hopper
from .elementwise import GELU, _apply, _pow2, cdiv, collapse, fill_
from .launch import Plan, TensorDescriptor, descriptor, descriptor_like, descriptor_template, launch, launch_via
from .quant import DECODE_FACTOR, as_codes, decode_e4m3, dequantize_rows_, quantize_rows_
from .reduce import SUM, accumulation_dtype, reduce_

# B_FP8: B holds e4m3fn codes with an fp32 scale per column of B (FP8_COLUMNS) or per row (FP8_ROWS)
FP8_COLUMNS = tl.constexpr(1)
FP8_ROWS = tl.constexpr(2)
FP8_DTYPE = torch.float8_e4m3fn  # the dtype of fp8 weight codes

# The kernels' arguments come in groups, one a line: inputs, output, fusion operands, sizes, strides,
# scalars, then the constexpr switches and tiles. A fusion operand whose switch is off is passed as
# None (Triton specialises a None argument as a constant: no dummy buffer, no pointer argument).
# Launches pass the runtime arguments positionally, in signature order, and the constexprs by keyword:
# ``launch.launch`` keys its cache of compiled kernels on the positional arguments and takes the
# trailing constexprs from the keywords (a runtime argument passed by keyword would enter that key by
# identity).


@triton.jit
def _matmul_kernel(a_ptr, b_ptr,  # inputs: A (.., M, K), B (.., K, N) (B_FP8: B's e4m3fn codes as uint8)
                   c_ptr,  # output: C (.., M, N)
                   bias_ptr, pre_out_ptr, res_ptr, u_ptr, v_ptr, b_scale_ptr,  # fusion operands; None when off
                   part_ptr, count_ptr,  # SPLIT_K: partial products (splits, M, N), arrivals per tile; else None
                   M, N, K, B1, R,  # sizes: B1 of the second batch dim (SPLIT_K: the slices), R the rank of U V
                   sa0, sa1, sam, sak, sb0, sb1, sbk, sbn, sc0, sc1, scm, scn,  # strides: two batch dims, row, col
                   sum_, sur, svr, svn, s_bias,  # the fusion operands' strides: U (M, R), V (R, N), bias (N,)
                   alpha, lr_ratio,  # scalars: C = ACT(alpha * (lr_ratio * A B + U V) + bias) + residual
                   ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,  # arithmetic (_kernel_switches)
                   BIAS: tl.constexpr, ACT: tl.constexpr,  # epilogue: bias, activation
                   STORE_PRE: tl.constexpr, RESIDUAL: tl.constexpr,  # the pre-activation stored, a residual added
                   RANK: tl.constexpr, B_FP8: tl.constexpr,  # the low-rank term's padded rank, fp8 B (0: off)
                   SPLIT_K: tl.constexpr, BLOCK_S: tl.constexpr,  # split-K switch, slices per load (_sum_slices)
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # tiles
    # One program = one (BLOCK_M, BLOCK_N) tile of one batch entry; the 1-D grid is
    # (batch entries) x (tiles per entry), batch-major. The batch index splits into (i0, i1)
    # over two (collapsed) batch dims of size (B0, B1).
    # Fused epilogue (constexpr switches, off = IDENTITY / False / 0): C = ACT(alpha * acc + bias[n])
    # + R, where R (RESIDUAL, C's strides; may be C itself) is read before C is written;
    # STORE_PRE also writes alpha * acc + bias (with C's strides) for the activation's backward;
    # RANK > 0 adds a low-rank product U V, U (M, R), V (R, N), R <= RANK, to acc first
    # (_low_rank_tiles).
    # SPLIT_K: the batch entries (B0 = 1, B1 = splits) are slices of one GEMM's K, all writing the
    # same C (batch strides 0): each program stores its slice's product into part (splits, M, N)
    # and counts its arrival at its tile (count_ptr, one int32 per tile, zero before the launch);
    # the tile's last program to arrive sums the slices in slice order (_sum_slices: the same order
    # every run, whichever program is last), applies the epilogue once and sets the count back
    # to zero.
    # B_FP8 (FP8_COLUMNS, FP8_ROWS; 2-D problems and split-K): B holds e4m3fn codes (a uint8 view)
    # with an fp32 scale per column (an output channel of a linear's weight: the accumulator's
    # columns are scaled after the K loop) or per row (the reduction dim: dX = dY W; each B tile's
    # rows are scaled as it is decoded), decoded in registers to A's dtype (_fp8_b_tile).
    # (A prologue fusing dY * act'(pre) into the backward GEMMs' A loads, with the bias gradient
    # as row sums of those tiles, gave wrong 16-bit results on Triton 3.6 when the loaded tile
    # fed both tl.sum and tl.dot: measured on an H200, 2026-11-26; the backward is unfused until
    # that is understood.)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    batch = pid // tiles
    pid_m, pid_n = _tile_coords(pid % tiles, num_pid_m, num_pid_n, GROUP_M)

    i0 = (batch // B1).to(tl.int64)
    i1 = (batch % B1).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + (i0 * sa0 + i1 * sa1) + offs_m[:, None] * sam + offs_k[None, :].to(tl.int64) * sak
    b_ptrs = b_ptr + (i0 * sb0 + i1 * sb1) + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :] * sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    if RANK:  # loaded first, used after the loop: their latency hides behind it
        u, v = _low_rank_tiles(u_ptr, v_ptr, offs_m, offs_n, mask_m, mask_n, R, sum_, sur, svr, svn, UPCAST, RANK)
    if SPLIT_K and B_FP8 == FP8_ROWS:  # this slice's rows of B
        b_scale_ptr += i1 * K
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if B_FP8:
            b = _fp8_b_tile(b, b_scale_ptr, k0 + offs_k, mask_k, a.dtype, B_FP8)
        if UPCAST:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    if B_FP8 == FP8_COLUMNS:
        acc = _fp8_column_scale(acc, b_scale_ptr, offs_n, mask_n)
    if RANK:
        acc = tl.dot(u, v, acc * lr_ratio, input_precision=PRECISION, out_dtype=ACC)

    c_off = (i0 * sc0 + i1 * sc1) + offs_m[:, None] * scm + offs_n[None, :] * scn
    if SPLIT_K:
        part_off = offs_m[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        tl.store(part_ptr + i1 * M * N + part_off, acc, mask=mask)
        # every thread's stores come before the arrival, released at GPU scope (and acquired by
        # the last program, whose loads then bypass L1: the slices were written on other SMs)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid % tiles, 1, sem="acq_rel", scope="gpu") == B1 - 1:
            acc = _sum_slices(part_ptr, part_off, mask, B1, M * N, BLOCK_M, BLOCK_N, BLOCK_S)
            tl.store(count_ptr + pid % tiles, 0)
            _finish_tile(acc, alpha, bias_ptr, s_bias, c_ptr, pre_out_ptr, res_ptr, c_off, offs_n, mask_m, mask_n,
                         BIAS, ACT, STORE_PRE, RESIDUAL)
    else:
        _finish_tile(acc, alpha, bias_ptr, s_bias, c_ptr, pre_out_ptr, res_ptr, c_off, offs_n, mask_m, mask_n,
                     BIAS, ACT, STORE_PRE, RESIDUAL)


@triton.jit
def _sum_slices(part_ptr, part_off, mask, splits, slice_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """One tile of ``sum_s part[s]`` over the ``splits`` slices of split-K's partial products (at
    ``part_off`` within each slice of ``slice_size`` elements): BLOCK_S slices per load, their sum
    (a fixed tree) added to the running total chunk after chunk in slice order, so the order is
    the same every run, and splits / BLOCK_S dependent loads instead of splits (one slice per load
    waited on L2 once per slice: latency-bound with few programs). Loads bypass L1 (``.cg``):
    other SMs wrote the slices during this launch."""
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    ptrs = part_ptr + offs_s[:, None, None] * slice_size + part_off[None, :, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), part_ptr.dtype.element_ty)
    for s0 in range(0, splits, BLOCK_S):
        mask_s = offs_s < splits - s0
        acc += tl.sum(tl.load(ptrs, mask=mask_s[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg"),
                      axis=0)
        ptrs += BLOCK_S * slice_size
    return acc


@triton.jit
def _finish_tile(acc, alpha, bias_ptr, s_bias, c_ptr, pre_out_ptr, res_ptr, c_off, offs_n, mask_m, mask_n,
                 BIAS: tl.constexpr, ACT: tl.constexpr, STORE_PRE: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue of a tile stored through pointers (``c_off``: C's element offsets): C =
    ACT(alpha * acc + bias[n]) + R, with the pre-activation to ``pre_out`` (STORE_PRE) and R read
    from ``res`` before C is written (RESIDUAL)."""
    pre, acc = _epilogue(acc, alpha, bias_ptr, offs_n, mask_n, s_bias, BIAS, ACT)
    mask_c = mask_m[:, None] & mask_n[None, :]
    if STORE_PRE:
        tl.store(pre_out_ptr + c_off, pre.to(pre_out_ptr.dtype.element_ty), mask=mask_c)
    if RESIDUAL:
        acc += tl.load(res_ptr + c_off, mask=mask_c, other=0.0).to(acc.dtype)
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


# Split-K's second pass, for a split computed elsewhere (conv2d's TMA forward and input gradient, the
# Gluon GEMM): part (splits, M, N) holds the fp32 (fp64) products of the K slices, rows dense, slices
# s_part elements apart; C = ACT(alpha * sum_s part[s] + bias[n]) + R, the slices summed by
# _sum_slices (the same order every run, no atomics).
@triton.jit
def _split_k_sum_kernel(part_ptr,  # input: the slices' products (splits, M, N)
                        c_ptr,  # output: C (M, N)
                        bias_ptr, pre_out_ptr, res_ptr,  # fusion operands; None when off
                        M, N, splits, s_part,  # sizes, the slice stride
                        scm, scn, s_bias,  # strides: C's (the pre-activation's and residual's too), bias
                        alpha,  # C = ACT(alpha * sum + bias) + residual
                        BIAS: tl.constexpr, ACT: tl.constexpr,  # epilogue: bias, activation
                        STORE_PRE: tl.constexpr, RESIDUAL: tl.constexpr,  # the pre-activation stored, a residual added
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):  # tiles
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = _sum_slices(part_ptr, offs_m[:, None] * N + offs_n[None, :], mask_m[:, None] & mask_n[None, :], splits,
                      s_part, BLOCK_M, BLOCK_N, BLOCK_S)
    _finish_tile(acc, alpha, bias_ptr, s_bias, c_ptr, pre_out_ptr, res_ptr,
                 offs_m[:, None] * scm + offs_n[None, :] * scn, offs_n, mask_m, mask_n, BIAS, ACT, STORE_PRE, RESIDUAL)


@triton.jit
def _matmul_tma_kernel(a_desc, b_desc,  # inputs: descriptors of A (M, K) and B (K, N) along their unit stride
                       c_desc,  # output: C (M, N), row-major
                       pre_desc, res_desc, bias_ptr, u_ptr, v_ptr, b_scale_ptr,  # fusion operands; None when off
                       M, N, K, R,  # sizes (R: the rank of U V)
                       sum_, sur, svr, svn, s_bias,  # the fusion operands' strides: U (M, R), V (R, N), bias (N,)
                       alpha, lr_ratio,  # scalars, as _matmul_kernel's
                       A_K_CONTIGUOUS: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr,  # the descriptors' orientation
                       BIAS: tl.constexpr, ACT: tl.constexpr,  # epilogue: bias, activation
                       STORE_PRE: tl.constexpr, RESIDUAL: tl.constexpr,  # the pre-activation stored, a residual added
                       RANK: tl.constexpr, B_FP8: tl.constexpr,  # the low-rank term's padded rank, fp8 B (0: off)
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       FLATTEN: tl.constexpr):  # tiles, pipelining across tile boundaries
    # The same 2-D GEMM and epilogue as _matmul_kernel, for Hopper: operands move by TMA (tensor
    # descriptors; out-of-bounds rows/columns load as zeros and are clipped on store, so no masks)
    # and the kernel is persistent: the grid is at most one program per SM and each program walks
    # the tiles pid, pid + programs, ... in grouped order. The descriptors are built on the host
    # (_run_tma; built in the kernel they cost 2-3 us per launch on the H200), each operand
    # described along its contiguous dimension (a descriptor's last stride must be 1): A (M, K) is
    # read as (M, K) tiles when K is contiguous, else as (K, M) tiles transposed in shared memory;
    # likewise B (K, N) as (N, K) or (K, N) tiles. C, the pre-activation and the residual are
    # row-major (M, N). FLATTEN lets the compiler software-pipeline across tile boundaries (the
    # next tile's loads overlap this tile's epilogue). B_FP8 as in _matmul_kernel (B's descriptor
    # then describes the uint8 codes).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if RANK:  # loaded first, used after the K loop: their latency hides behind it
            u, v = _low_rank_tiles(u_ptr, v_ptr, offs_m, offs_n, offs_m < M, offs_n < N, R, sum_, sur, svr, svn,
                                   False, RANK)
        for kk in range(k_tiles):
            off_k = kk * BLOCK_K
            if A_K_CONTIGUOUS:
                a = a_desc.load([off_m, off_k])
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_K_CONTIGUOUS:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if B_FP8:
                offs_k = off_k + tl.arange(0, BLOCK_K)
                b = _fp8_b_tile(b, b_scale_ptr, offs_k, offs_k < K, a.dtype, B_FP8)
            acc = tl.dot(a, b, acc)
        if B_FP8 == FP8_COLUMNS:
            acc = _fp8_column_scale(acc, b_scale_ptr, offs_n, offs_n < N)
        if RANK:
            acc = tl.dot(u, v, acc * lr_ratio)
        pre, acc = _epilogue(acc, alpha, bias_ptr, offs_n, offs_n < N, s_bias, BIAS, ACT)
        if STORE_PRE:
            pre_desc.store([off_m, off_n], pre.to(pre_desc.dtype))
        if RESIDUAL:
            acc += res_desc.load([off_m, off_n]).to(acc.dtype)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _low_rank_tiles(u_ptr, v_ptr, offs_m, offs_n, mask_m, mask_n, R, sum_, sur, svr, svn,
                    UPCAST: tl.constexpr, RANK: tl.constexpr):
    """A tile's share of a low-rank term U V: the (BLOCK_M, RANK) rows of U (M, R) and the (RANK,
    BLOCK_N) columns of V (R, N), by strides, R padded to RANK (>= 16, tl.dot's minimum) with zeros.
    The kernels add ``tl.dot(u, v, ratio * acc)`` after their K loop and scale the sum by beta
    (their alpha), with ratio = alpha / beta from the host: the tile becomes alpha * A B + beta *
    U V, both products accumulated in fp32 with nothing rounded between them (a LoRA layer's
    up-projection added into its base GEMM: one more tl.dot of depth RANK per tile)."""
    offs_r = tl.arange(0, RANK)
    mask_r = offs_r < R
    u = tl.load(u_ptr + offs_m[:, None] * sum_ + offs_r[None, :] * sur, mask=mask_m[:, None] & mask_r[None, :],
                other=0.0)
    v = tl.load(v_ptr + offs_r[:, None] * svr + offs_n[None, :] * svn, mask=mask_r[:, None] & mask_n[None, :],
                other=0.0)
    if UPCAST:
        u = u.to(tl.float32)
        v = v.to(tl.float32)
    return u, v


@triton.jit
def _fp8_b_tile(codes, b_scale_ptr, offs_k, mask_k, dtype, B_FP8: tl.constexpr):
    """A (BLOCK_K, BLOCK_N) tile of B's e4m3fn codes as ``dtype`` values for tl.dot: exact codes
    scaled by 1 / DECODE_FACTOR (``decode_e4m3``; FP8_COLUMNS: the scale comes after the K loop,
    ``_fp8_column_scale``), or (FP8_ROWS) times its row's scale, rounded once to ``dtype``."""
    b = decode_e4m3(codes)
    if B_FP8 == FP8_ROWS:
        scale = tl.load(b_scale_ptr + offs_k, mask=mask_k, other=0.0) * DECODE_FACTOR
        return (b.to(tl.float32) * scale[:, None]).to(dtype)
    return b.to(dtype)


@triton.jit
def _fp8_column_scale(acc, b_scale_ptr, offs_n, mask_n):
    """The accumulator of products with decoded codes (FP8_COLUMNS) times each column's scale."""
    scale = tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0) * DECODE_FACTOR
    return acc * scale.to(acc.dtype)[None, :]


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile number ``tile`` in grouped order: GROUP_M row tiles
    are walked down a column before moving right, so consecutive tiles reuse A and B panels in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _epilogue(acc, alpha, bias_ptr, offs_n, mask_n, s_bias, BIAS: tl.constexpr, ACT: tl.constexpr):
    """(alpha * acc + bias[n], ACT(alpha * acc + bias[n])): the pre-activation and the output of
    a GEMM tile."""
    acc = acc * alpha
    if BIAS:
        acc += tl.load(bias_ptr + offs_n * s_bias, mask=mask_n, other=0.0).to(acc.dtype)[None, :]
    out = acc
    if ACT != 0:
        out = _apply(acc, acc, acc, 0.0, 0.0, ACT)
    return acc, out


# ---- launch configuration ---------------------------------------------------------------------

def _config(M, N, K, dtype, batch=1):
    """Launch config for one problem: BLOCK_M/N/K, GROUP_M, num_warps, num_stages.

    On the GPU a measured entry from the tuning table (``flame.tune``, kernel "matmul", key
    (M, N, K, batch)) wins over the heuristic below. Measured on an H200 with
    Triton 3.6 over SDXL linear shapes: 128x128 tiles with 4 warps and 4 stages (3 for tf32) are
    the best single choice; 128x256 with 8 warps wins once it still gives every SM two tiles;
    tiles shrink to the problem for small shapes and to 64 when 128-wide tiles would leave most
    SMs idle. In the interpreter every program costs ~1.5 ms of Python, so one big block covers
    as much of the problem as numpy handles comfortably.
    """
    return MATMUL.config((M, N, K, batch), dtype)


def _heuristic(key, dtype):
    """matmul's default config at key (M, N, K, batch) (see ``_config``)."""
    M, N, K, batch = key
    if runtime.INTERPRETER:
        return dict(BLOCK_M=_pow2(min(M, 256)), BLOCK_N=_pow2(min(N, 256)), BLOCK_K=_pow2(min(K, 512)),
                    GROUP_M=8, num_warps=4, num_stages=1)
    sms = runtime.num_sms()
    if dtype == torch.float64:
        bm, bn, bk, warps, stages = 64, 64, 32, 4, 3
    elif dtype == torch.float32:  # tf32
        bm, bn, bk, warps, stages = 128, 128, 32, 4, 3
    elif batch * cdiv(M, 128) * cdiv(N, 256) >= 2 * sms and K >= 256:  # fp16 / bf16, large
        bm, bn, bk, warps, stages = 128, 256, 64, 8, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 4, 4
    bm, bn, bk = _shrink_tiles(bm, bn, bk, M, N, K, 16)
    while batch * cdiv(M, bm) * cdiv(N, bn) < sms // 2 and max(bm, bn) > 64:
        if bm >= bn:
            bm //= 2
        else:
            bn //= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


# The tile-loop kernels' config fields (the conv kernels' too); the GEMMs add GROUP_M.
GEMM_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
MATMUL = tune.register(tune.Spec(
    "matmul", ("M", "N", "K", "batch"), GEMM_FIELDS + ("GROUP_M",), _heuristic, autotune.gemm_stages,
    autotune.GEMM_SPACE, autotune.QUICK_GEMM_SPACE,
    doc="_matmul_kernel: every GEMM (matmul, bmm, linear and its backward, 1x1 convolutions)"))


def _shrink_tiles(bm, bn, bk, M, N, K, min_m):
    """Tiles no larger than the problem rounded up to a power of two (at least ``min_m`` rows and
    16 columns / reduction steps, tl.dot's minimum)."""
    return min(bm, max(min_m, _pow2(M))), min(bn, max(16, _pow2(N))), min(bk, max(16, _pow2(K)))


def _kernel_switches(dtype):
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    precision = "ieee" if (dtype == torch.float64 or runtime.INTERPRETER) else "tf32"
    upcast = runtime.INTERPRETER and dtype == torch.bfloat16
    return acc, precision, upcast


# ---- the TMA path (Hopper and later, 16-bit, 2-D problems) -----------------------------------

TMA = not runtime.INTERPRETER and os.environ.get("FLAME_MATMUL_TMA", "1") != "0"
FLATTEN = True  # software-pipeline across tile boundaries (tl.range(flatten=...)): 2-4% faster on the H200
_tma_ready = None  # None: not yet checked; then whether this device and Triton can run the TMA kernel


def tma_available():
    global _tma_ready
    if _tma_ready is None:
        _tma_ready = (torch.cuda.get_device_capability(runtime.device)[0] >= 9 and TensorDescriptor is not None
                      and hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator"))
        if _tma_ready:  # descriptors built in a kernel (attention's) live in a global scratch buffer per launch
            triton.set_allocator(_descriptor_scratch)
    return _tma_ready


_scratch = {}  # CUDA stream handle -> the int8 buffer its launches write their descriptors into


def _descriptor_scratch(size, alignment, stream):
    """Triton's per-launch scratch for device-side tensor descriptors. Launches on one stream run
    one after another and each writes its descriptors before reading them, so one buffer per
    stream serves them all (no allocation per launch). During CUDA-graph capture every launch
    gets its own buffer from the graph's pool, which the graph keeps."""
    if torch.cuda.is_current_stream_capturing():
        return runtime.empty((size,), torch.int8)
    buf = _scratch.get(stream)
    if buf is None or buf.numel() < size or buf.data_ptr() % alignment:
        buf = _scratch[stream] = runtime.empty((max(size, 1 << 16),), torch.int8)
    return buf


def _tma_config(M, N, K, dtype):
    """Launch config of the TMA kernel: a tuning-table entry (kernel "matmul_tma") or the
    heuristic. Measured on an H200 (Triton 3.6, bf16) over the 30 GEMMs of SDXL's linears
    (forward and both gradients): 128x128x64 tiles, 4 warps, 5 stages come within 5% of each
    shape's best config on the geometric mean; 128x256 with 8 warps and 3 stages wins on tall,
    narrow problems (M >= 4096 rows, 512-1024 columns). Problems of fewer 128x128 tiles than half
    the SMs (77-token text projections, LoRA's rank-16 products) take 64-row tiles at most 64
    wide with K blocks of 128, 4 warps, 4 stages, unsplit: H200, against pointer split-K (us,
    graph replays), 77x2048->1280 6.6 vs 11.2, 77x1280->2048 5.0 vs 8.1, LoRA dB 1280x1024->16
    4.2 vs 7.4; past K = 2048 split-K wins (LoRA dA 16x4096->640 8.4 vs 10.0, _plan)."""
    return MATMUL_TMA.config((M, N, K, 1), dtype)


def _tma_heuristic(key, dtype):
    """matmul_tma's default config at key (M, N, K, 1) (see ``_tma_config``)."""
    M, N, K, _ = key
    if _few_tiles(cdiv(M, 128) * cdiv(N, 128), runtime.num_sms()):
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 4
    elif M >= 4096 and 512 <= N <= 1024:
        bm, bn, bk, warps, stages = 128, 256, 64, 8, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 4, 5
    bm, bn, bk = _shrink_tiles(bm, bn, bk, M, N, K, 64)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


MATMUL_TMA = tune.register(tune.Spec(
    "matmul_tma", ("M", "N", "K", "batch"), GEMM_FIELDS + ("GROUP_M",), _tma_heuristic, autotune.gemm_stages,
    autotune.GEMM_SPACE, autotune.QUICK_GEMM_SPACE,
    doc="_matmul_tma_kernel: the TMA GEMM that 16-bit 2-D problems with K >= 128 run on Hopper"))


_FEW_TILES_TMA_MAX_K = 2048


def _stages_with_room_for_low_rank(cfg, rank_block, es):
    """The TMA kernel's pipeline stages, cut (to 1 at least) until its shared memory with a
    low-rank term fits the GPU: per stage an A and a B tile ((BLOCK_M + BLOCK_N) x BLOCK_K), then
    C's store tile and the term's U and V tiles ((BLOCK_M + BLOCK_N) x RANK, once: the loop is not
    flattened). Compiled for sm_90 (Triton 3.9) this sum is within 0.05% of what Triton
    allocates; 128x128x128 tiles of 3 stages (tuned for some SDXL shapes) need 229,376 bytes
    alone, 237,568 with a rank-16 term, against the H200's 232,448."""
    limit = autotune.shared_memory()
    bm, bn, bk, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"]
    fixed = (bm * bn + (bm + bn) * rank_block) * es
    while limit is not None and stages > 1 and stages * (bm + bn) * bk * es + fixed > limit:
        stages -= 1
    return stages


# ---- split-K -----------------------------------------------------------------------------------

def _k_splits(tiles, K, block_k, sms):
    """How many slices to cut K into for a GEMM with few output tiles (LoRA's rank-16 weight
    gradients: M or N = 16 with K = 4096 tokens gave 5 programs for 132 SMs) on ``sms`` SMs: enough
    for about one program per SM, each slice at least 4 K-blocks long, and K divisible by the count
    (equal slices are one batched launch). 1 means no split."""
    if not _few_tiles(tiles, sms) or 16 * block_k > K:
        return 1
    for splits in range(min(cdiv(sms, tiles), K // (4 * block_k), 64), 1, -1):
        if K % splits == 0:
            return splits
    return 1


def _few_tiles(tiles, sms):
    """Whether a GEMM of ``tiles`` output tiles leaves most of ``sms`` SMs idle (fewer than half):
    split-K's precondition, and the TMA heuristic's cue for small tiles."""
    return 2 * tiles <= sms


_ARRIVAL_SLOTS = 1 << 16
_arrivals = None  # this device's split-K arrival counts (int32): zero between launches
_arrival_next = 0  # the first slot the next split-K launch takes


def _arrival_counts(tiles):
    """``tiles`` zero int32 counters for one split-K launch (its programs count their arrivals at
    each output tile there, and the last one sets the count back to zero). Launches take the slots
    of one per-device buffer in turn, so launches on streams running at the same time, or in
    graphs replayed on them, get different counters unless 65,536 slots apart. The buffer is
    zero-filled once, when first needed; needed first inside a CUDA-graph capture, each launch
    there gets its own from the graph's pool, its fill captured with it (run once eagerly before
    capturing, as ``flame.graphs.CapturedStep`` does, to share the device's)."""
    global _arrivals, _arrival_next
    if _arrivals is None:
        if runtime.is_capturing():
            return fill_(runtime.empty((tiles,), torch.int32), 0)
        _arrivals = fill_(runtime.empty((max(tiles, _ARRIVAL_SLOTS),), torch.int32), 0)
    if _arrival_next + tiles > _arrivals.numel():
        _arrival_next = 0
    first, _arrival_next = _arrival_next, _arrival_next + tiles
    return _arrivals[first:first + tiles]


def split_k_sum_(out, sc, part, f):
    """Split-K's second pass (``_split_k_sum_kernel``): ``out`` (M, N), with row and column strides
    ``sc``, = the epilogue ``f`` (a ``Fusion``) of ``sum_s part[s]``, the fp32 (fp64) partial
    products ``part`` (splits, M, N) (each slice's rows dense, the slices any stride apart) summed
    (the same order every run). Launched through a ``launch.Plan`` kept per (sizes, strides, fusion
    switches), the bias stride free. Returns ``out``."""
    splits, M, N = part.shape
    s_part = part.stride(0)
    key = (M, N, splits, s_part, *sc, f.key)
    kept = _sum_launches.get(key)
    if kept is None:
        bs, bm, bn = _sum_blocks(splits, M, N)
        meta = dict(BIAS=f.bias is not None, ACT=f.act, STORE_PRE=f.pre_out is not None,
                    RESIDUAL=f.residual is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_S=bs, num_warps=4)
        if len(_sum_launches) >= _MAX_ROUTES:
            _sum_launches.clear()
        kept = _sum_launches[key] = Plan(_split_k_sum_kernel, meta, by_value=(11,)), (cdiv(M, bm), cdiv(N, bn))
    plan, grid = kept
    launch_via(launch, plan, grid, (part,  # input
                                    out,  # output
                                    f.bias, f.pre_out, f.residual,  # fusion operands
                                    M, N, splits, s_part,  # sizes, the slice stride
                                    *sc, f.bias_stride,  # strides (the bias stride, argument 11, free)
                                    f.alpha))  # scalars
    return out


_sum_launches: dict = {}  # split_k_sum_'s (Plan, grid) per (M, N, splits, C's strides, Fusion.key)
tune.register_cache(_sum_launches.clear)


def _sum_blocks(splits, M, N):
    """(BLOCK_S, BLOCK_M, BLOCK_N) of the split-K sum pass: tiles of at most 64 columns and as many
    rows as keep one load of up to 16 slices within 8192 elements (32 KB of fp32 for 4 warps), so
    that a (16, 640) result is 20 programs, not 5. The interpreter takes bigger blocks (fewer,
    vectorised programs are faster there)."""
    bs = min(_pow2(splits), 16)
    bn = min(_pow2(N), 256 if runtime.INTERPRETER else 64)
    bm = max(1, min(_pow2(M), _load_budget() // (bs * bn)))
    return bs, bm, bn


def _slices_per_load(splits, tile):
    """BLOCK_S of ``_sum_slices``: how many split-K slices of a ``tile``-element tile one load
    takes (at most 16, within _load_budget() elements)."""
    return max(1, min(_pow2(splits), 16, _load_budget() // tile))


def _load_budget():
    return 1 << 16 if runtime.INTERPRETER else 8192


def _or(t, default):
    return default if t is None else t


# ---- routes: which kernel runs a GEMM ----------------------------------------------------------
# The entry points (``matmul_``, ``linear_``, ``matmul_sum_batch_``) reduce their buffers to launches
# over at most two batch dims; ``_launch`` describes each as a ``GemmProblem`` (sizes, strides,
# dtypes, the fusion switches, which buffers are 16-byte aligned, what the device runs), asks
# ``plan`` for its route and runs it (``_RUN``). Routes:
#   "pointer"         ``_matmul_kernel``: any dtype, strides and batch; the whole epilogue fused, a
#                     low-rank term up to _MAX_FUSED_RANK too; fp8 codes of B decoded in the main loop
#   "split_k"         ``_matmul_kernel`` over equal K slices as batch entries, the last slice of each
#                     tile to arrive summing them and applying the epilogue: 2-D problems of few output
#                     tiles and a long K (``_k_splits``) that the TMA kernel does not take
#   "tma"             ``_matmul_tma_kernel``: 16-bit 2-D problems with K >= 128 whose operands TMA can
#                     describe (``_layout``), on Hopper; few-tile ones only up to _FEW_TILES_TMA_MAX_K
#   "gluon"           ``matmul_hopper``'s warp-specialised kernel: the "tma" problems it takes (a low-rank
#                     term of rank <= 64 as the tiles' last k block, at least one 128x128 tile per SM:
#                     ``matmul_hopper._choose``)
#   "low_rank_apart"  a low-rank term the kernels do not fuse (a rank above _MAX_FUSED_RANK, a
#                     batched or a split-K problem): the GEMM without it, then out += beta U V, two
#                     routes in ``Route.then``
#   "fp8_dequant"     fp8 codes of B for more than FP8_INLINE_MAX_ROWS rows on a GPU (``_fp8_route``;
#                     fewer rows decode them in the main loop): B dequantised to A's dtype first, then
#                     the route of that plain GEMM (``Route.then``)
#   "fp8_w8a8"        a linear's forward over fp8 codes under FLAME_FP8_GEMM=w8a8 (``_w8a8``): A quantised
#                     per row, then ``matmul_hopper``'s fp8 product (``config``) or, where that kernel does
#                     not serve, A decoded again and the weight-only route (``Route.then``)
# ``FLAME_DEBUG_ROUTES=1`` prints each distinct problem's route and why, once, to stderr.

ROUTES = ("pointer", "split_k", "tma", "gluon", "low_rank_apart", "fp8_dequant", "fp8_w8a8")
DEBUG_ROUTES = os.environ.get("FLAME_DEBUG_ROUTES", "") == "1"
_TMA_DTYPES = (torch.float16, torch.bfloat16)
_MAX_FUSED_RANK = 64  # the low-rank term's tl.dot takes U (BLOCK_M, RANK) and V (RANK, BLOCK_N) tiles whole
# the buffers a TMA launch reads or writes by descriptor (U and V are loaded by pointer)
_TMA_BUFFERS = ("a", "b", "c", "pre_out", "residual")


class GemmProblem(NamedTuple):
    """One GEMM launch as routing sees it: ``C[b] = A[b] @ B[b]`` (M, K) x (K, N) over batch entries
    b of at most two batch dims, with ``Fusion``'s epilogue. A tuple (``_launch`` builds one per call,
    and the route cache hashes it): sizes; each operand's strides (batch 0, batch 1, row, column),
    B's as (K, N), C's shared by the pre-activation and residual buffers; A's dtype (B's too, unless
    ``b_fp8``: B holds e4m3fn codes, FP8_COLUMNS / FP8_ROWS) and C's; the fusion switches; the
    low-rank term's rank (0: none) and U's and V's strides; FLAME_FP8_GEMM (``fp8_gemm``); which
    buffers (``"a"``, ``"b"``, ``"c"``, ``"pre_out"``, ``"residual"``, ``"u"``, ``"v"``) do not start
    16-byte aligned (looked at only where ``tma``); and the device: ``tma``, it runs flame's TMA
    kernels for this dtype; ``gluon``, matmul_hopper's kernel too (sm_90, FLAME_MATMUL_GLUON not 0);
    ``gpu``, not the interpreter; ``sms``, its SM count. Launch configs come from this process's
    tables and heuristics (``flame.tune``)."""

    M: int
    N: int
    K: int
    batch: tuple  # (B0, B1); (1, 1) for a 2-D problem
    sa: tuple
    sb: tuple
    sc: tuple
    dtype: torch.dtype
    out_dtype: torch.dtype
    bias: bool = False
    act: int = 0
    pre_out: bool = False
    residual: bool = False
    rank: int = 0
    su: tuple = (0, 0)
    sv: tuple = (0, 0)
    b_fp8: int = 0
    fp8_gemm: str = "auto"
    misaligned: tuple = ()
    tma: bool = False
    gluon: bool = False
    gpu: bool = False
    sms: int = 1

    @classmethod
    def dense(cls, M, N, K, dtype, batch=(), a_transposed=False, b_transposed=False, out_dtype=None, *, tma=False,
              gluon=False, gpu=None, sms=1, **fusion):
        """A problem on freshly allocated buffers, from shapes: how tests describe one without allocating
        it. A (M, K), B (K, N) and C (M, N) contiguous behind up to two ``batch`` dims, A read from a
        (K, M) buffer (``a_transposed``: dW = dY^T X), B from an (N, K) one (``b_transposed``: a
        linear's weight); U (M, r) and V (r, N) contiguous; every buffer aligned. ``fusion``: the
        other fields (``bias``, ``act``, ..., ``b_fp8``, ``fp8_gemm``). ``gpu`` defaults to ``tma``:
        ``tma=True, gluon=True, sms=132`` describes an H200."""
        B0, B1 = (1,) * (2 - len(batch)) + tuple(batch)

        def strides(rows, cols, transposed):
            inner = (1, rows) if transposed else (cols, 1)
            return (B1 * rows * cols if B0 > 1 else 0, rows * cols if B1 > 1 else 0, *inner)

        rank = fusion.get("rank", 0)
        fusion = dict(dict(su=(rank, 1), sv=(N, 1)) if rank else {}, **fusion)
        return cls(M, N, K, (B0, B1), strides(M, K, a_transposed), strides(K, N, b_transposed),
                   strides(M, N, False), dtype, out_dtype or dtype, **fusion, tma=tma, gluon=gluon,
                   gpu=tma if gpu is None else gpu, sms=sms)


@dataclasses.dataclass(frozen=True)
class Route:
    """What ``plan`` chose: the path (``kernel``, one of ROUTES), the launch's constexprs and options
    (``config``: tuned fields as ``flame.tune`` answered them, with the derived ones; for the
    composite routes empty, or "low_rank_apart"'s order of its steps: ``term_first``), how many
    slices K runs in (``splits``), and why (``reason``); for the kernel routes the ``grid`` and the
    kernel's size and stride arguments (``args``, from the problem), for "tma" and "gluon" the
    operands' ``layout`` (``_layout``), for "tma" the (shape, strides, block) ``boxes`` of A's, B's
    and C's descriptors (the pre-activation's and residual's are C's); for the composite routes the
    steps they run, ``then``: (problem, route) pairs; for the kernel routes "pointer", "split_k" and
    "tma" the ``launch.Plan`` they launch with (``launch``, their ``sig``)."""

    kernel: str
    config: dict
    splits: int
    reason: str
    grid: tuple = ()
    args: tuple = ()
    layout: tuple | None = None
    boxes: tuple = ()
    then: tuple = ()
    launch: Plan | None = dataclasses.field(default=None, compare=False, repr=False)


_reported: set = set()
_MAX_ROUTES = 4096  # memo entries of either kind before the memo starts afresh


class RouteMemo:
    """A planner's memo: the route of each problem (``problems``, planned by ``planner(p)``) and, for the
    entry points, what each call signature resolved to (``calls``: the GEMM's (problem, route, runner)
    in ``_launch``, a convolution's (problem, route)), emptied together by ``cache_clear``:
    ``flame.tune``'s overrides, tables and resets (``tune.register_cache``), and tests that patch the
    planner's helpers (split counts, configs, shared memory)."""

    __slots__ = ("planner", "problems", "calls", "generation")

    def __init__(self, planner):
        self.planner, self.problems, self.calls = planner, {}, {}
        self.generation = 0  # cache_clear's count: what a KeptCall's stamp (call_stamp) holds of this memo

    def __call__(self, p):
        route = self.problems.get(p)
        if route is None:
            route = self.planner(p)
            if len(self.problems) >= _MAX_ROUTES:
                self.problems.clear()
            self.problems[p] = route
        return route

    def keep_call(self, key, entry):
        """Keep what the call signature ``key`` resolved to (``calls`` starts afresh past its bound)."""
        if len(self.calls) >= _MAX_ROUTES:
            self.calls.clear()
        self.calls[key] = entry

    def cache_clear(self):
        self.problems.clear()
        self.calls.clear()
        self.generation += 1


_route = RouteMemo(lambda p: _plan(p))  # looked up per call: a test may replace _plan's helpers
tune.register_cache(_route.cache_clear)


def plan(p: GemmProblem) -> Route:
    """The route of GEMM problem ``p`` (see above), memoised per problem (a training loop's shapes
    repeat): one dictionary lookup on the host after the first call. Raises ValueError for a
    low-rank term the kernels cannot take, or a bad FLAME_FP8_GEMM."""
    route = _route(p)
    if DEBUG_ROUTES and p not in _reported:
        _reported.add(p)
        fusion = [name for name in ("bias", "pre_out", "residual") if getattr(p, name)]
        fusion += [f"act {p.act}"] * bool(p.act) + [f"rank {p.rank}"] * bool(p.rank)
        fusion += [f"fp8 B {'columns' if p.b_fp8 == FP8_COLUMNS.value else 'rows'}"] * bool(p.b_fp8)
        print(f"flame gemm route: {p.M}x{p.K} @ {p.K}x{p.N} batch {p.batch} {p.dtype} -> {p.out_dtype} "
              f"strides {p.sa[2:]} {p.sb[2:]} {p.sc[2:]} {', '.join(fusion) or 'no fusion'}: {route.kernel}, "
              f"splits {route.splits}, config {route.config}: {route.reason}", file=sys.stderr)
    return route


_PLAN = plan  # ``_launch`` asks ``plan`` itself on every launch while this name is replaced (a test's watcher)


def _plan(p):
    fp8 = _fp8_route(p) if p.b_fp8 else None
    if fp8 == "w8a8":
        return _w8a8(p)
    if fp8 == "dequant":
        q = _dequantised(p)
        then = _plan(q)
        why = (f"fp8 B of {p.M} rows (more than {FP8_INLINE_MAX_ROWS} on a GPU)" if p.fp8_gemm == "auto" else
               "FLAME_FP8_GEMM=dequant")
        return Route("fp8_dequant", {}, then.splits, f"{why}: dequantised to {p.dtype} first, then {then.kernel}",
                     then=((q, then),))
    batch = p.batch[0] * p.batch[1]
    cfg = _config(p.M, p.N, p.K, p.dtype, batch)
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    if p.rank and (batch > 1 or p.rank > _MAX_FUSED_RANK):
        return _apart(p, f"rank {p.rank} above {_MAX_FUSED_RANK}" if batch == 1 else "a batched problem")
    if batch > 1:
        return _pointer(p, cfg, tiles, f"{p.batch[0]} x {p.batch[1]} batch entries")
    splits = _k_splits(tiles, p.K, cfg["BLOCK_K"], p.sms)
    # below K = 128 the pointer kernel was faster (H200: 640x2048x77 at 0.99x cuBLAS, TMA 1.16x); with few
    # tiles, up to K = _FEW_TILES_TMA_MAX_K the TMA kernel's small tiles beat split-K (see _tma_config)
    tma_ok = p.K >= 128 and (splits == 1 or p.K <= _FEW_TILES_TMA_MAX_K)
    layout = _layout(p) if tma_ok else None
    few = f"{tiles} output tiles for {p.sms} SMs"
    if splits > 1 and layout is None:
        if p.rank:
            return _apart(p, f"{few}: K splits")
        return _split_k(p, splits, f"{few}, K = {p.K}" + ("" if p.tma else "; no TMA on this device or dtype"))
    if layout is None:
        if not p.tma:
            why = "no TMA on this device or dtype"
        elif p.K < 128:
            why = f"K = {p.K} < 128: the pointer kernel is faster"
        else:
            why = "operands TMA cannot describe (dtype, alignment or strides)"
        return _pointer(p, cfg, tiles, why)
    hopper = None
    if (p.gluon and not p.b_fp8 and not (p.rank and {"u", "v"} & set(p.misaligned))
            and matmul_hopper.serves(p.dtype, p.rank, p.pre_out, p.residual, p.su, p.sv, layout[1])):
        hopper = matmul_hopper._choose(p.M, p.N, p.K, p.sms)  # the warp-specialised kernel, where it is faster
    if hopper is not None:
        return Route("gluon", hopper, 1, f"{'cooperative' if hopper['COOP'] else 'ping-pong'} "
                                         f"{hopper['BLOCK_M']}x{hopper['BLOCK_N']} tiles per consumer",
                     layout=layout)
    why = "16-bit operands TMA can describe, K >= 128"
    if splits > 1:
        why += f"; {few}, K = {p.K} <= {_FEW_TILES_TMA_MAX_K}: small tiles, no split"
    if p.gluon:
        why += "; the Gluon kernel does not take it"
    return _tma(p, layout, why)


def _fp8_route(p):
    """How the GEMM takes its fp8 B (codes, a scale per column or row): "inline", decoded in the main
    loop (B_FP8), "dequant", written in A's dtype first (``quant.dequantize_rows_``, a transient
    buffer) and the plain GEMM run on that, or "w8a8" (a linear's forward, a scale per column of B):
    A rounded to e4m3 codes with a scale per row too, and the product of codes on the fp8 tensor
    cores (``_w8a8``; FLAME_FP8_GEMM=w8a8, or a ``Fusion`` with ``w8a8``: ``linear_(...,
    w8a8=True)``). Measured on an H200 (Triton 3.6, bf16, 4608 rows, 3072 -> 3072 and 12288, forward
    and dX): inline ran at 0.33-0.46x the bf16 GEMM's speed, every row-tile program decoding every B
    tile again (36 times at 4608 rows). Dequantising first costs about 5 bytes of memory traffic per
    weight element, the inline decode about 1.6 bf16 GEMMs; they break even near 250 rows (5 N K / 4
    TB/s = 1.6 * 2 M N K / 650 TFLOP/s, an estimate): on a GPU, problems of more rows than
    FP8_INLINE_MAX_ROWS dequantise first, and so do fp64 ones (Triton 3.6 cannot compile an fp64
    product of decoded tiles for sm_90: "fp64 don't support largeK MMA"). The interpreter decodes
    inline (what its tests check). "auto" picks between inline and dequant; the input gradient (a
    scale per row of B) under "w8a8" too."""
    route = p.fp8_gemm
    if route not in FP8_GEMMS:
        raise ValueError(f"FLAME_FP8_GEMM must be one of {', '.join(FP8_GEMMS)}, got {route!r}")
    if route == "w8a8" and p.b_fp8 == FP8_COLUMNS.value and p.batch == _ONE:
        return route
    if route in ("auto", "w8a8"):
        inline = not p.gpu or (p.M <= FP8_INLINE_MAX_ROWS and p.dtype != torch.float64)
        return "inline" if inline else "dequant"
    return route


def _w8a8(p):
    """The "fp8_w8a8" route of a linear's forward over an fp8 weight: A's rows quantised to e4m3
    codes and fp32 scales (``quant.quantize_rows_``, times the scale's reciprocal; a transient (M, K)
    buffer), then ``matmul_hopper``'s fp8 product where it serves the problem (sm_90, B and C
    readable by TMA, a problem of at least a wave of tiles), with both scales applied to the
    accumulator; elsewhere
    (other GPUs, the interpreter) the codes of A are decoded back into A's dtype and the weight-only
    route runs on them: the same rounding of A, without the fp8 tensor cores' speed. A low-rank term
    is written first by its own GEMM, then read back by the product as its residual (``_apart``,
    ``term_first``: the Gluon kernel loads it under its main loop); with an activation, or a residual
    of its own, the weight-only route runs."""
    if p.rank:
        if p.act or p.pre_out or p.residual:
            return _plan(p._replace(fp8_gemm="auto"))
        return _apart(p, "W8A8: the fp8 product takes no low-rank term", term_first=True)
    (_, _, sbk, sbn), (_, _, scm, scn) = p.sb, p.sc
    out_es = p.out_dtype.itemsize
    tma_ready = (p.gluon and p.out_dtype in (torch.float16, torch.bfloat16) and sbk == 1 and sbn % 16 == 0
                 and p.K % 16 == 0 and scn == 1 and (scm * out_es) % 16 == 0
                 and not {"b", "c", "pre_out", "residual"} & set(p.misaligned)
                 and matmul_hopper.serves(FP8_DTYPE, 0, p.pre_out, p.residual))
    cfg = matmul_hopper._choose(p.M, p.N, p.K, p.sms, speed=2) if tma_ready else None
    if cfg is not None:
        return Route("fp8_w8a8", cfg, 1, f"W8A8: A quantised per row, fp8 x fp8 wgmma, "
                                         f"{'cooperative' if cfg['COOP'] else 'ping-pong'} "
                                         f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} tiles per consumer",
                     layout=(True, True, p.K, sbn, scm))
    emulated = p._replace(sa=(0, 0, p.K, 1), misaligned=tuple(m for m in p.misaligned if m != "a"), fp8_gemm="auto")
    then = _plan(emulated)
    return Route("fp8_w8a8", {}, then.splits, f"W8A8 without the fp8 kernel here: A quantised per row and decoded "
                                              f"to {p.dtype}, then {then.kernel}", then=((emulated, then),))


def _dequantised(p):
    """The problem of ``p`` with B dequantised into a new contiguous buffer of A's dtype, in the codes'
    own shape: W (N, K) read as B = W^T for a scale per column of B (a linear's weight), B (K, N)
    itself for a scale per row (its input gradient, dX = dY W)."""
    sb = (0, 0, 1, p.K) if p.b_fp8 == FP8_COLUMNS.value else (0, 0, p.N, 1)
    return p._replace(sb=sb, b_fp8=0, misaligned=tuple(m for m in p.misaligned if m != "b"))


def _apart(p, why, term_first=False):
    """The "low_rank_apart" route: ``out = alpha * A B + bias + residual``, then ``out += beta * U V``
    (a second GEMM accumulating into ``out``), a 2-D GEMM each; ``term_first`` (no residual of its
    own): ``out = beta * U V`` first, then ``out = alpha * A B + bias + out`` (``config``'s
    "term_first"). Not with an activation or a pre-activation, which would need the term inside them."""
    if p.act or p.pre_out or any(p.sa[:2]) or any(p.sc[:2]):
        raise ValueError("matmul: a low-rank term is added to 2-D GEMMs, without an activation, only")
    flat = dict(batch=(1, 1), rank=0, su=(0, 0), sv=(0, 0))
    base = p._replace(sa=(0, 0, *p.sa[2:]), sb=(0, 0, *p.sb[2:]), sc=(0, 0, *p.sc[2:]),
                      misaligned=tuple(m for m in p.misaligned if m not in ("u", "v")), **flat)
    term_buffers = {"u": ("a",), "v": ("b",), "c": ("c", "residual")}  # U -> A, V -> B, C -> C and the residual
    term = p._replace(K=p.rank, sa=(0, 0, *p.su), sb=(0, 0, *p.sv), sc=(0, 0, *p.sc[2:]), bias=False,
                      residual=not term_first, b_fp8=0,
                      misaligned=tuple(t for m in p.misaligned for t in term_buffers.get(m, ())), **flat)
    if term_first:
        base = base._replace(residual=True, misaligned=base.misaligned + (("residual",) if "c" in base.misaligned
                                                                           else ()))
    steps = ((term, _plan(term)), (base, _plan(base))) if term_first else ((base, _plan(base)), (term, _plan(term)))
    base_route = steps[1 if term_first else 0][1]
    return Route("low_rank_apart", {"term_first": term_first}, base_route.splits,
                 f"{why}: the term apart, {steps[0][1].kernel} then {steps[1][1].kernel}", then=steps)


def _inline(p):
    """What the kernel routes' reasons add for fp8 codes of B."""
    return "; fp8 B decoded in the main loop" if p.b_fp8 else ""


def _pointer(p, cfg, tiles, why):
    """The "pointer" route: ``_matmul_kernel`` with the config ``cfg`` of ``tiles`` tiles per batch entry."""
    B0, B1 = p.batch
    meta = _pointer_meta(p, cfg, False, 1)
    args = (p.M, p.N, p.K, B1, p.rank, *p.sa, *p.sb, *p.sc, *p.su, *p.sv)
    return Route("pointer", meta, 1, why + _inline(p), grid=(B0 * B1 * tiles,), args=args,
                 launch=_plan_of(_matmul_kernel, meta, _POINTER_LEAD_ARGS, args, p))


def _split_k(p, splits, why):
    """The "split_k" route: ``splits`` equal K slices as the batch entries (1, splits) of
    ``_matmul_kernel``, each program storing its slice's product into an fp32 (fp64) scratch
    (splits, M, N); the last program of each output tile to finish sums the tile's slices (the same
    order every run) and applies the whole epilogue (bias, activation, pre-activation, residual)
    once. Tuned as a batched problem of the slices' K."""
    kc = p.K // splits
    cfg = _config(p.M, p.N, kc, p.dtype, splits)
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    (_, _, sam, sak), (_, _, sbk, sbn), (_, _, scm, scn) = p.sa, p.sb, p.sc
    meta = _pointer_meta(p, cfg, True, _slices_per_load(splits, cfg["BLOCK_M"] * cfg["BLOCK_N"]))
    args = (p.M, p.N, kc, splits, p.rank, 0, kc * sak, sam, sak, 0, kc * sbk, sbk, sbn, 0, 0, scm, scn, *p.su, *p.sv)
    return Route("split_k", meta, splits, f"{why}: {splits} slices of {kc}{_inline(p)}", grid=(splits * tiles,),
                 args=args, launch=Plan(_matmul_kernel, meta, by_value=(_POINTER_LEAD_ARGS + len(args),)))


# The kernels' leading arguments before the size and stride arguments a route carries (``Route.args``),
# which the bias stride follows: the one argument its launch plan leaves free (``_plan_of``)
_POINTER_LEAD_ARGS = 11  # a, b, c, bias, pre_out, residual, u, v, b_scale, part, counts
_TMA_LEAD_ARGS = 9  # descriptors of a, b, c, pre_out, residual; bias, u, v, b_scale


def _plan_of(kernel, meta, buffers, args, p):
    """The ``launch.Plan`` of a kernel route: the route's problem pins every launch argument but the
    buffers (which of them are None included) and the bias stride, which enters its key by value. On a
    TMA device the call signature (``_launch``) holds the dtypes and alignment of A, B, C, U and V, so
    without a bias, codes of B, a pre-activation or a residual buffer every launch has one key: pinned."""
    pinned = p.tma and not (p.bias or p.b_fp8 or p.pre_out or p.residual)
    return Plan(kernel, meta, by_value=(buffers + len(args),), pinned=pinned)


def _pointer_meta(p, cfg, split_k, block_s):
    """``_matmul_kernel``'s constexprs and launch options for problem ``p`` with the config ``cfg``."""
    acc, precision, upcast = _kernel_switches(p.dtype)
    return dict(ACC=acc, PRECISION=precision, UPCAST=upcast, BIAS=p.bias, ACT=p.act, STORE_PRE=p.pre_out,
                RESIDUAL=p.residual, RANK=_rank_block(p.rank), B_FP8=p.b_fp8, SPLIT_K=split_k, BLOCK_S=block_s, **cfg)


def _rank_block(rank):
    """The low-rank term's RANK constexpr: its rank padded to a power of two, at least 16 (tl.dot's
    minimum); 0 without a term."""
    return max(16, _pow2(rank)) if rank else 0


def _tma(p, layout, why):
    """The "tma" route: ``_matmul_tma_kernel`` with the operands' ``layout``."""
    rank_block = _rank_block(p.rank)
    # a low-rank term's U and V loads, issued at each tile's start, would be buffered per pipeline
    # stage in a flattened loop (sm_90, 128x128x64, 5 stages: +40 KB of shared memory, past the
    # H200's, and 157 -> 249 registers): its launches walk their tiles unflattened
    cfg = dict(_tma_config(p.M, p.N, p.K, p.dtype), FLATTEN=FLATTEN and not rank_block)
    if p.act and cfg["num_warps"] == 4:
        # an activation epilogue on 4 warps costs more than its GEMM saves (H200, gelu_tanh,
        # 4096x640->5120: +30 us on 4 warps, +14 us on 8); tables are tuned without one
        cfg["num_warps"] = 8
    if rank_block:
        cfg["num_stages"] = _stages_with_room_for_low_rank(cfg, rank_block, p.dtype.itemsize)
    meta = dict(A_K_CONTIGUOUS=layout[0], B_K_CONTIGUOUS=layout[1], BIAS=p.bias, ACT=p.act, STORE_PRE=p.pre_out,
                RESIDUAL=p.residual, RANK=rank_block, B_FP8=p.b_fp8, **cfg)
    M, N, K = p.M, p.N, p.K
    a_k, b_k, s_a, s_b, s_c = layout
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # each operand described along its unit stride (a descriptor's last stride must be 1)
    boxes = (((M, K), (s_a, 1), (bm, bk)) if a_k else ((K, M), (s_a, 1), (bk, bm)),
             ((N, K), (s_b, 1), (bn, bk)) if b_k else ((K, N), (s_b, 1), (bk, bn)),
             ((M, N), (s_c, 1), (bm, bn)))
    args = (M, N, K, p.rank, *p.su, *p.sv)
    return Route("tma", meta, 1, why + _inline(p), grid=(min(cdiv(M, bm) * cdiv(N, bn), p.sms),), args=args,
                 layout=layout, boxes=boxes, launch=_plan_of(_matmul_tma_kernel, meta, _TMA_LEAD_ARGS, args, p))


def _layout(p):
    """(A K-contiguous, B K-contiguous, A row stride, B row stride, C row stride) when the TMA kernels
    can read every operand of 2-D problem ``p`` (16-bit on a TMA device, C in A's dtype, B also
    e4m3fn codes, 16-byte aligned bases, one unit stride per operand and the other a multiple of 16
    bytes, C row-major), else None."""
    if not p.tma or p.out_dtype != p.dtype or any(m in _TMA_BUFFERS for m in p.misaligned):
        return None
    es = p.dtype.itemsize
    (_, _, sam, sak), (_, _, sbk, sbn), (_, _, scm, scn) = p.sa, p.sb, p.sc
    if scn != 1 or (scm * es) % 16:
        return None
    dims = []
    for rows, cols, size in ((sam, sak, es), (sbn, sbk, 1 if p.b_fp8 else es)):  # (along M or N, along K)
        if cols == 1 and (rows * size) % 16 == 0:
            dims.append((True, rows))
        elif rows == 1 and (cols * size) % 16 == 0:
            dims.append((False, cols))
        else:
            return None
    (a_k, s_a), (b_k, s_b) = dims
    return a_k, b_k, s_a, s_b, scm


# ---- running a route ---------------------------------------------------------------------------

_ONE = (1, 1)
_new_problem = tuple.__new__  # GemmProblem(...) without its Python-level __new__: _problem runs on every launch


def _problem(out, a, b, M, N, K, batch, sa, sb, sc, f):
    """The ``GemmProblem`` of one launch on these buffers (``batch``, ``s*``: two batch dims), with the
    ``Fusion`` ``f``. Fields in GemmProblem's order."""
    dtype = a.dtype
    tma = TMA and dtype in _TMA_DTYPES and tma_available()
    return _new_problem(GemmProblem, (
        M, N, K, batch, sa, sb, sc, dtype, out.dtype,
        f.bias is not None, f.act, f.pre_out is not None, f.residual is not None,
        f.rank, f.u_strides, f.v_strides, f.b_fp8, "w8a8" if f.w8a8 else FP8_ROUTE,
        _misaligned(a, b, out, f) if tma else (),
        tma, tma and matmul_hopper.ROUTE and _gluon_available(), not runtime.INTERPRETER, runtime.num_sms()))


_gluon_ready = None  # matmul_hopper.available(), asked once (it reads the device's capability)


def _gluon_available():
    global _gluon_ready
    if _gluon_ready is None:
        _gluon_ready = matmul_hopper.available()
    return _gluon_ready


def _misaligned(a, b, out, f):
    """The names of the buffers of a launch that do not start 16-byte aligned (``GemmProblem``)."""
    if not (a.data_ptr() | b.data_ptr() | out.data_ptr() | f.pointers) % 16:
        return ()
    u, v = (f.u, f.v) if f.rank else (None, None)
    bufs = (("a", a), ("b", b), ("c", out), ("pre_out", f.pre_out), ("residual", f.residual), ("u", u), ("v", v))
    return tuple(name for name, t in bufs if t is not None and t.data_ptr() % 16)


def _launch(out, a, b, M, N, K, batch_shape, sa, sb, sc, f=None):
    """One GEMM: ``a``, ``b``, ``out`` give the base pointers and dtypes; the problem is (at most two)
    batch dims ``batch_shape`` and per-operand strides ``s* = (batch strides..., row stride, column
    stride)``, all tuples, so no torch view is built on the hot path; ``f`` (a ``Fusion``) the
    epilogue. Runs the route ``plan`` names for it.

    A launch looks its route and runner up in ``_route.calls`` under its call signature: what its
    ``GemmProblem`` is made of, as the call has it (sizes, batch shape and strides as given, the
    dtypes, ``Fusion.key``, the buffers' alignment where the TMA kernels could take the problem,
    the device's switches and FLAME_FP8_GEMM as read now), so a repeated launch builds one tuple
    and no problem (and, on a TMA device, launches a pinned plan: ``_plan_of``). A new signature
    describes its problem (``_problem``) and asks ``plan``, and so does every launch while
    FLAME_DEBUG_ROUTES is on or ``plan`` is replaced (a watcher sees every launch's problem)."""
    f = _NO_FUSION if f is None else f
    dtype, b_dtype = a.dtype, b.dtype
    tma = TMA and dtype in _TMA_DTYPES and tma_available()
    key = (M, N, K, batch_shape, sa, sb, sc, dtype, b_dtype, out.dtype, f.key,
           tma and (a.data_ptr() | b.data_ptr() | out.data_ptr() | f.pointers) % 16 and _misaligned(a, b, out, f),
           tma and matmul_hopper.ROUTE and _gluon_available(), runtime.INTERPRETER, runtime.num_sms(), FP8_ROUTE)
    entry = _route.calls.get(key)
    if entry is None or DEBUG_ROUTES or plan is not _PLAN:
        if b_dtype is not dtype and not f.b_fp8:  # a GemmProblem has one operand dtype (or codes of B)
            raise TypeError(f"matmul: a and b must have one dtype (b may be fp8 codes with their scale), got {dtype} "
                            f"and {b_dtype}")
        pad = 2 - len(batch_shape)
        z = (0,) * pad
        p = _problem(out, a, b, M, N, K, (1,) * pad + batch_shape, z + sa, z + sb, z + sc, f)
        route = plan(p)
        entry = (p, route, _RUN[route.kernel])
        if plan is _PLAN:
            _route.keep_call(key, entry)
    p, route, run = entry
    run(p, route, out, a, b, f)
    return entry


# An entry point keeps what each of its call signatures resolved to, (problem, route, runner, an epilogue
# of its layouts whose buffers each call fills and empties again), in ``_route.calls`` too, under a key
# made of its arguments as it has them and the device's switches as read now (``_launch``'s), so a
# repeated call reads its arguments' layouts once, builds no ``Fusion`` and no ``_launch`` key and runs
# the kept route over its buffers (``_run_kept``). A
# call with a buffer a TMA kernel would read off 16-byte alignment (rare: a view at an odd offset) goes
# through ``_launch`` every time, as do all calls while FLAME_DEBUG_ROUTES is on or ``plan`` is replaced.

def _run_kept(signature, out, a, b, bias, pre_out, residual, u, v, b_scale, handle=None):
    """Run the route kept for an entry point's call (its ``signature``: the sizes, strides, dtypes and
    epilogue switches of its arguments) over these buffers and return True; for a call not kept, return
    the key to keep its launch under (``_keep``), None for one with a misaligned buffer on a TMA device.
    A ``KeptCall`` ``handle`` is given the kept route."""
    tma = TMA and a.dtype in _TMA_DTYPES and tma_available()
    if tma and not all_aligned(out, a, b, pre_out, residual, u, v):
        return None
    key = (signature, _device_switches(tma))
    kept = _route.calls.get(key)
    if kept is None or DEBUG_ROUTES or plan is not _PLAN:
        return key
    _run_entry(kept, out, a, b, bias, pre_out, residual, u, v, b_scale)
    if handle is not None:
        handle.keep(kept)
    return True


def _device_switches(tma):
    """What a kept call's route depends on besides its call signature and the route memo, as read now:
    whether the TMA kernels take it (``tma``), the Gluon one, the interpreter, the SM count and
    FLAME_FP8_GEMM (in ``_run_kept``'s key and ``call_stamp``, which must agree)."""
    return tma, tma and matmul_hopper.ROUTE and _gluon_available(), runtime.INTERPRETER, runtime.num_sms(), FP8_ROUTE


def all_aligned(*bufs):
    """Whether every buffer of ``bufs`` (None: no buffer) starts 16-byte aligned, as the TMA kernels need A, B,
    C, the pre-activation and residual, and the rank-r term's U and V. A ``KeptCall`` caller asks it once per op
    about the buffers it did not allocate itself (``KeptCall.run``'s ``aligned``)."""
    pointers = 0
    for t in bufs:
        if t is not None:
            pointers |= t.data_ptr()
    return not pointers % 16


def _run_entry(kept, out, a, b, bias, pre_out, residual, u, v, b_scale):
    """Run a kept call's route over these buffers, its kept epilogue filled with them for the call."""
    p, route, run, f = kept
    if f is None:
        run(p, route, out, a, b, _NO_FUSION)
        return
    f.bias, f.pre_out, f.residual, f.b_scale = bias, pre_out, residual, b_scale  # the kept epilogue, filled
    if f.rank:
        f.u, f.v = u, v
    try:
        run(p, route, out, a, b, f)
    finally:  # it holds no buffer between calls
        f.bias = f.pre_out = f.residual = f.b_scale = f.u = f.v = None


def _keep(key, entry, f, handle=None):
    """Keep ``_launch``'s ``entry`` (with epilogue ``f``, or None) for call key ``key`` (see ``_run_kept``),
    and give it to the ``KeptCall`` ``handle``."""
    if key is not None and plan is _PLAN and not DEBUG_ROUTES:
        kept = (*entry, None if f is None else f.unbound())
        _route.keep_call(key, kept)
        if handle is not None:
            handle.keep(kept)


def call_stamp():
    """What a kept call's route depends on besides its call signature, as read now: the route memo's
    generation and the device's switches (``_run_kept``'s key); None while every call must go through its
    entry point (tuning on first use, tuning-table entries still to prove, FLAME_DEBUG_ROUTES, a replaced
    ``plan``). Read once per op by a caller of ``KeptCall.run``."""
    if tune._autotune or not tune.direct_entries or DEBUG_ROUTES or plan is not _PLAN:
        return None
    return _route.generation, _device_switches(TMA and tma_available())


class KeptCall:
    """A caller's handle on the route that one of its GEMM entry-point calls resolved to, for a caller
    whose own kept call signature fixes that call's signature (every argument's sizes, strides and dtypes
    and every scalar: ``ops.matmul.lora_linear``'s GEMMs). ``run`` runs the route over a call's buffers
    without the entry point's wrapper, signature and lookup (about a third of a kept call's host time);
    where it returns False (nothing run: the handle is empty, was filled under another ``call_stamp``, or the
    caller does not vouch for every buffer's 16-byte alignment where a TMA kernel reads) the caller calls the
    entry point with ``handle=`` this, which runs the call and fills the handle. The caller checks its buffers'
    alignment once per op (``run``'s ``aligned``), so a call checks none of its own."""

    __slots__ = ("entry", "stamp")

    def __init__(self):
        self.entry = self.stamp = None

    def keep(self, entry):
        self.entry, self.stamp = entry, call_stamp()

    def run(self, stamp, aligned, out, a, b, bias=None, pre_out=None, residual=None, u=None, v=None, b_scale=None):
        """The kept route over buffers ``out``, ``a``, ``b`` (the entry point's operands' buffers, not
        matrix tuples) and the epilogue's, ``stamp`` being ``call_stamp()``: True when it ran. ``aligned``:
        whether the caller knows every buffer of the call to start 16-byte aligned (those it just allocated
        with ``runtime.empty`` are; any other it checked with ``all_aligned``); where not, a route of the TMA
        kernels is not run here (the entry point checks each buffer)."""
        if stamp is None or stamp != self.stamp or (not aligned and self.entry[0].tma):
            return False
        _run_entry(self.entry, out, a, b, bias, pre_out, residual, u, v, b_scale)
        return True


# The runners: route ``r`` of problem ``p`` on these buffers with the epilogue ``f``. They take every
# switch from the route (a composite route's step may run with a Fusion that holds more, such as the
# scale of codes already dequantised) and pass None for what it leaves out.

def _run_pointer(p, r, out, a, b, f, part=None, counts=None):
    b_fp8 = r.config["B_FP8"]
    rank = f.rank
    launch_via(launch, r.launch, r.grid,
               (a, as_codes(b) if b_fp8 else b,  # inputs (B_FP8: B's e4m3fn codes as uint8)
                out,  # output
                f.bias, f.pre_out, f.residual, f.u if rank else None, f.v if rank else None,  # fusion operands
                f.b_scale if b_fp8 else None,
                part, counts,  # split-K's scratch
                *r.args, f.bias_stride,  # sizes and strides
                f.scale, f.rank_ratio))  # scalars


def _run_split_k(p, r, out, a, b, f):
    part = runtime.empty((r.splits, p.M, p.N), accumulation_dtype(p.dtype))
    _run_pointer(p, r, out, a, b, f, part, _arrival_counts(r.grid[0] // r.splits))


def _run_tma(p, r, out, a, b, f):
    # the descriptors are built on the host (built in the kernel they cost 2-3 us per launch on the H200):
    # A's, B's and C's, and the pre-activation's and residual's where they hold C's dtype, are objects kept
    # with the route's launch plan, made once from their templates, that hold this launch's buffers for the
    # call (the launcher reads them as it launches); a new descriptor per launch cost as much host time as
    # the rest of the route
    plan = r.launch
    b_fp8 = r.config["B_FP8"]
    b = as_codes(b) if b_fp8 else b
    kept = plan.memo
    if kept is None:
        templates = tuple(descriptor_template(t, *box) for t, box in zip((a, b, out), r.boxes))
        kept = plan.memo = templates, tuple(descriptor_like(t, None) for t in (*templates, templates[2], templates[2]))
    _, (d_a, d_b, d_c, d_pre, d_res) = kept
    rank = f.rank
    d_a.base, d_b.base, d_c.base = a, b, out
    try:
        launch_via(launch, r.launch, r.grid,
                   (d_a, d_b, d_c,  # inputs and output
                    None if f.pre_out is None else _epilogue_descriptor(f.pre_out, d_pre, out, r.boxes[2]),  # fusion
                    None if f.residual is None else _epilogue_descriptor(f.residual, d_res, out, r.boxes[2]),
                    f.bias, f.u if rank else None, f.v if rank else None, f.b_scale if b_fp8 else None,
                    *r.args, f.bias_stride,  # sizes and strides
                    f.scale, f.rank_ratio))  # scalars
    finally:  # the kept descriptors hold no buffer between launches
        d_a.base = d_b.base = d_c.base = d_pre.base = d_res.base = None


def _epilogue_descriptor(t, kept, out, box):
    """The descriptor of a pre-activation or residual buffer ``t`` (C's box): the plan's ``kept`` one (made
    from C's template) holding ``t`` where ``t`` has C's dtype, else one of its own."""
    if t.dtype is out.dtype:
        kept.base = t
        return kept
    return descriptor(t, *box)


def _run_gluon(p, r, out, a, b, f):
    matmul_hopper.matmul(out, a, b, p.M, p.N, p.K, f, r.layout, r.config)


def _run_low_rank_apart(p, r, out, a, b, f):
    if r.config["term_first"]:
        (term_p, term), (base_p, base) = r.then
        _RUN[term.kernel](term_p, term, out, f.u, f.v, Fusion(alpha=f.beta))
        _RUN[base.kernel](base_p, base, out, a, b, Fusion(f.bias, alpha=f.alpha, residual=out, b_scale=f.b_scale,
                                                         w8a8=f.w8a8))
        return
    (base_p, base), (term_p, term) = r.then
    without_term = Fusion(f.bias, alpha=f.alpha, residual=f.residual, b_scale=f.b_scale, b_scale_rows=f.b_scale_rows,
                          w8a8=f.w8a8)
    _RUN[base.kernel](base_p, base, out, a, b, without_term)
    _RUN[term.kernel](term_p, term, out, f.u, f.v, Fusion(alpha=f.beta, residual=out))


def _run_fp8_dequant(p, r, out, a, b, f):
    ((q, then),) = r.then
    w = dequantize_rows_(runtime.empty(tuple(b.shape), p.dtype), b, f.b_scale)  # the step's B_FP8 is 0
    _RUN[then.kernel](q, then, out, a, w, f)


def _run_fp8_w8a8(p, r, out, a, b, f):
    codes = runtime.empty((p.M, p.K), FP8_DTYPE)
    scales = runtime.empty((p.M,), torch.float32)
    quantize_rows_(codes, scales, a.as_strided((p.M, p.K), p.sa[2:]), exact=False)
    if not r.then:
        matmul_hopper.matmul(out, codes, b, p.M, p.N, p.K, f, r.layout, r.config, a_scale=scales)
        return
    ((q, then),) = r.then
    _RUN[then.kernel](q, then, out, dequantize_rows_(runtime.empty((p.M, p.K), p.dtype), codes, scales), b, f)


_RUN = {"pointer": _run_pointer, "split_k": _run_split_k, "tma": _run_tma, "gluon": _run_gluon,
        "low_rank_apart": _run_low_rank_apart, "fp8_dequant": _run_fp8_dequant, "fp8_w8a8": _run_fp8_w8a8}


def _tma_layout(out, a, b, f, sa, sb, sc):
    """``_layout`` of a 2-D problem on these buffers (``s*``: row and column strides, B's as (K, N))
    with the epilogue ``f``: how tests and scripts/bench_gemm.py drive the Gluon kernel directly."""
    return _layout(_problem(out, a, b, 0, 0, 0, _ONE, (0, 0, *sa), (0, 0, *sb), (0, 0, *sc), f))


# ---- entry points ------------------------------------------------------------------------------

class Fusion:
    """Epilogue work fused into one GEMM launch (see ``_matmul_kernel``):
    ``C = act(alpha * A @ B + beta * U @ V + bias) + residual`` with ``bias`` (N,), ``act`` an
    elementwise op code, ``residual`` a buffer with C's strides (C itself for an in-place
    accumulation); ``pre_out`` receives the argument of ``act``. ``low_rank = (U, V, beta)``: U
    (M, r) and V (r, N) matrices (``matrix``) of A's dtype, any strides (a LoRA up-projection added to
    the base GEMM, or the adapter's share of the input gradient). ``b_scale`` (2-D problems): B is a
    float8_e4m3fn buffer of codes with this fp32 scale per column of B (N,), or per row (K,) with
    ``b_scale_rows``, decoded in the main loop (``B_FP8`` in ``_matmul_kernel``); ``w8a8`` (with a
    scale per column): A is rounded to e4m3 per row for the product (``_w8a8``).

    ``key``: the switches a ``GemmProblem`` takes from it; ``pointers``: the addresses of the
    pre-activation, residual, U and V buffers or'ed together (their 16-byte alignment at once)."""

    __slots__ = ("bias", "bias_stride", "act", "pre_out", "alpha", "residual", "u", "v", "beta", "rank",
                 "scale", "rank_ratio", "u_strides", "v_strides", "b_scale", "b_scale_rows", "b_fp8", "w8a8",
                 "key", "pointers")

    def __init__(self, bias=None, act=0, pre_out=None, alpha=1.0, residual=None, low_rank=None, b_scale=None,
                 b_scale_rows=False, w8a8=False):
        u = v = None
        beta, rank, su, sv = 0.0, 0, (0, 0), (0, 0)
        if low_rank is not None:
            u, v, beta = low_rank
            beta = float(beta)
            if beta != 0.0:
                um = u if type(u) is tuple else matrix(u)
                vm = v if type(v) is tuple else matrix(v)
                u, v, rank, su, sv = um[0], vm[0], um[2], um[3:], vm[3:]
        alpha = float(alpha)
        b_fp8 = 0 if b_scale is None else FP8_ROWS.value if b_scale_rows else FP8_COLUMNS.value
        w8a8 = bool(w8a8)
        self.bias, self.bias_stride, self.act = bias, 0 if bias is None else bias.stride()[0], act
        self.pre_out, self.alpha, self.residual = pre_out, alpha, residual
        self.u, self.v, self.beta, self.rank, self.u_strides, self.v_strides = u, v, beta, rank, su, sv
        # what the kernels multiply the accumulator by, and by what they scale A B before adding U V:
        # alpha * AB + beta * UV = beta * (alpha / beta * AB + UV)
        self.scale, self.rank_ratio = (beta, alpha / beta) if rank else (alpha, 1.0)
        self.b_scale, self.b_scale_rows, self.b_fp8, self.w8a8 = b_scale, bool(b_scale_rows), b_fp8, w8a8
        self.key = (bias is not None, act, pre_out is not None, residual is not None, rank, su, sv, b_fp8, w8a8)
        pointers = (0 if pre_out is None else pre_out.data_ptr()) | (0 if residual is None else residual.data_ptr())
        self.pointers = pointers | (u.data_ptr() | v.data_ptr() if rank else 0)

    def unbound(self):
        """This epilogue without its buffers: what a kept call signature fills with each call's own
        (``_run_kept``). ``pointers`` is left 0: the kept epilogue runs a route already planned."""
        f = _new_fusion(Fusion)
        f.bias = f.pre_out = f.residual = f.b_scale = f.u = f.v = None
        f.bias_stride, f.act, f.alpha, f.beta, f.rank = self.bias_stride, self.act, self.alpha, self.beta, self.rank
        f.scale, f.rank_ratio, f.u_strides, f.v_strides = self.scale, self.rank_ratio, self.u_strides, self.v_strides
        f.b_scale_rows, f.b_fp8, f.w8a8, f.key, f.pointers = self.b_scale_rows, self.b_fp8, self.w8a8, self.key, 0
        return f


_new_fusion = object.__new__


_NO_FUSION = Fusion()


# ---- matrix operands ----------------------------------------------------------------------------
# A 2-D problem's operands are matrices: a torch buffer of two dims, one of more dims whose leading dims
# merge into the rows (a contiguous activation (B, L, C) read as (B * L, C)), or a matrix tuple
# ``(buffer, rows, columns, row stride, column stride)``: the matrix of those elements from the buffer's
# first one (a transposed operand: ``transposed``). The entry points read them in place, so an op builds
# no (rows, n) or transposed torch view for a GEMM (a view costs about as much host time as a launch).

def matrix(t):
    """``t`` as a matrix tuple ``(buffer, rows, columns, row stride, column stride)``: a tuple as it
    is; a torch buffer of two dims; one of more whose leading dims merge into rows, with the strides a
    ``view(-1, n)`` of it has (a size-1 dim is left out), or of one dim (a row); None for one whose
    leading dims do not merge (or a scalar)."""
    if type(t) is tuple:
        return t
    shape, strides = t.shape, t.stride()
    n = len(shape)
    if n == 2:
        return t, shape[0], shape[1], strides[0], strides[1]
    if n < 2:  # a vector: one row (as a view (1, n) of it)
        return (t, 1, shape[0], shape[0] * strides[0], strides[0]) if n else None
    rows = shape[-2]
    outer = strides[-2] * rows  # the stride of a dim that merges with the rows so far
    for i in range(n - 3, -1, -1):
        if shape[i] != 1:
            if strides[i] != outer:
                return None
            rows *= shape[i]
            outer *= shape[i]
    return t, rows, shape[-1], strides[-2], strides[-1]


def dense_matrix(buf, rows, columns):
    """The matrix tuple of a row-major (rows, columns) buffer the caller just allocated: what
    ``matrix`` would read from it, without reading its shape and strides."""
    return buf, rows, columns, columns, 1


def transposed(t):
    """The matrix tuple of the transpose of matrix ``t`` (``matrix``)."""
    buf, rows, cols, rs, cs = t if type(t) is tuple else matrix(t)
    return buf, cols, rows, cs, rs


def _dims(t):
    """The shape of a buffer or the (rows, columns) of a matrix tuple, for messages."""
    return t[1:3] if type(t) is tuple else tuple(t.shape)


def _operand(t, name):
    """``matrix(t)``, or the ValueError of an entry point's operand that is not a matrix."""
    m = matrix(t)
    if m is None:
        raise ValueError(f"matmul: {name} of shape {tuple(t.shape)} and strides {t.stride()} is not a matrix (its "
                         "leading dims do not merge into rows)")
    return m


@tunable("out")
def matmul_(out, a, b, alpha=1.0, residual=None, low_rank=None, b_scale=None, handle=None):
    """``out[..., M, N] = alpha * a[..., M, K] @ b[..., K, N] (+ beta * u @ v) (+ residual)`` over
    torch buffers with any strides.

    ``a``, ``b`` and ``out`` have the same batch shape (broadcast batch dims are stride-0
    expanded views) and ``a`` and ``b`` the same dtype; ``out`` may be any float dtype. A 2-D
    problem (``b`` a matrix: two dims, or a matrix tuple) takes matrices (``matrix``): ``a`` a
    buffer of more dims whose leading dims merge into M rows, or a tuple, and ``out`` laid out as a
    (M, N) matrix likewise. ``residual`` (2-D problems only) has ``out``'s strides and may be
    ``out`` itself. ``low_rank = (u, v, beta)`` (2-D problems only): matrices ``u`` (M, r), ``v``
    (r, N) of ``a``'s dtype, added in the same launch (``Fusion``). ``b_scale`` (K,) fp32 (2-D
    problems only): ``b`` holds float8_e4m3fn codes of ``b_scale[k] * code[k, n]`` (a quantised
    weight W (N_w, K_w) read as ``b = W``: the input gradient dX = dY W of a linear layer;
    ``_fp8_route``). ``handle``: a ``KeptCall`` this call's kept route is given to (2-D problems).
    Returns ``out``.
    """
    bm = b if type(b) is tuple else matrix(b) if len(b.shape) == 2 else None
    am = sc = None
    if bm is not None:
        am = a if type(a) is tuple else matrix(a)
    if am is not None:  # a 2-D problem, unless out is no matrix of its rows
        ab, M, K, sam, sak = am
        bb, _, N, sbk, sbn = bm
        u = v = term = key = None
        if low_rank is not None:
            low_rank, u, v, term = _low_rank_term(low_rank, M, N, ab.dtype)
        if b_scale is not None or bb.dtype is FP8_DTYPE:
            _check_fp8(bb, b_scale, K)
        plain = alpha == 1.0 and residual is None and low_rank is None and b_scale is None
        sc = out.stride()
        if len(sc) != 2 or not plain or handle is not None:  # kept per call signature (else _launch's key)
            key = _run_kept(("matmul", am[1:], ab.dtype, bm[1:], bb.dtype, out.shape, sc, out.dtype, alpha,
                             residual is not None, term, b_scale is not None), out, ab, bb, None, None, residual, u, v,
                            b_scale, handle)
            if key is True:
                return out
            if len(sc) != 2:
                om = matrix(out)
                sc = None if om is None else om[3:]
    if sc is not None:
        if M == 0 or N == 0:
            return out
        if K == 0:
            return fill_(out, 0.0)
        f = None if plain else Fusion(alpha=alpha, residual=residual, low_rank=low_rank, b_scale=b_scale,
                                      b_scale_rows=True)
        _keep(key, _launch(out, ab, bb, M, N, K, (), (sam, sak), (sbk, sbn), sc, f), f, handle)
        return out
    if type(a) is tuple or type(b) is tuple:
        raise ValueError(f"matmul_: matrix tuples need a 2-D problem (b a matrix, a and out matrices of its rows), "
                         f"got a {_dims(a)}, b {_dims(b)} and out {_dims(out)}")
    shape_a = a.shape
    M, K = shape_a[-2], shape_a[-1]
    N = b.shape[-1]
    if b_scale is not None or b.dtype is FP8_DTYPE:
        _check_fp8(b, b_scale, K)
    if out.numel() == 0:
        return out
    if K == 0:
        return fill_(out, 0.0)
    if alpha != 1.0 or residual is not None or low_rank is not None or b_scale is not None:
        raise ValueError(f"matmul_: alpha, residual, low_rank and b_scale need a 2-D problem, got a of shape "
                         f"{tuple(shape_a)}")
    st_a, st_b, st_c = a.stride(), b.stride(), out.stride()
    batch = list(shape_a[:-2])
    # B does not vary over the batch: fold the batch into M (one big GEMM, no batch index)
    if all(s == 0 or d == 1 for s, d in zip(st_b[:-2], batch)):
        shape, (sa, sc) = collapse(batch + [M], [st_a[:-1], st_c[:-1]])
        if len(shape) == 1:
            _launch(out, a, b, shape[0], N, K, (), (sa[0], st_a[-1]), st_b[-2:], (sc[0], st_c[-1]))
            return out
    shape, (a_bs, b_bs, c_bs) = collapse(batch, [st_a[:-2], st_b[:-2], st_c[:-2]])
    if len(shape) <= 2:
        _launch(out, a, b, M, N, K, tuple(shape), (*a_bs, *st_a[-2:]), (*b_bs, *st_b[-2:]), (*c_bs, *st_c[-2:]))
        return out
    # Batch dims that do not collapse: peel the leading ones off in Python.
    lead = len(shape) - 2
    for idx in itertools.product(*(range(s) for s in shape[:lead])):
        views = [t.as_strided(t.shape[-2:], t.stride()[-2:],
                              t.storage_offset() + sum(i * s for i, s in zip(idx, st[:lead])))
                 for t, st in ((a, a_bs), (b, b_bs), (out, c_bs))]
        _launch(views[2], views[0], views[1], M, N, K, tuple(shape[lead:]), (*a_bs[lead:], *st_a[-2:]),
                (*b_bs[lead:], *st_b[-2:]), (*c_bs[lead:], *st_c[-2:]))
    return out


@tunable("out", "pre_out")
def linear_(out, x, w, bias=None, act=0, pre_out=None, low_rank=None, w_scale=None, w8a8=False, residual=None,
            handle=None):
    """``out[R, N] = act(x[R, K] @ w[N, K]^T + beta * u @ v + bias[N]) + residual`` in one launch (any
    strides; the weight is read transposed in place). ``x`` is a matrix (``matrix``: a buffer whose
    leading dims merge into the R rows, or a matrix tuple), ``out`` a buffer laid out as an (R, N)
    matrix; ``pre_out``, if given, laid out as ``out``, receives the argument of ``act``;
    ``residual``, if given, is laid out as ``out`` too;
    ``low_rank = (u, v, beta)``, if given, matrices ``u`` (R, r) and ``v`` (r, N).
    ``w_scale`` (N,) fp32: ``w`` holds float8_e4m3fn codes of ``w_scale[n] * code[n, k]`` (a
    weight quantised per output channel, ``quant.quantize_rows_``), decoded in the main loop or
    dequantised first (``_fp8_route``); with ``w8a8``, ``x`` is rounded to e4m3 per row too and the
    product runs on the fp8 tensor cores where a kernel for them serves (``_w8a8``). ``handle``: a
    ``KeptCall`` this call's kept route is given to."""
    xm = x if type(x) is tuple else _operand(x, "x")
    x, R, K, sxr, sxk = xm
    w_shape = w.shape
    N = w_shape[0]
    u = v = term = None
    if low_rank is not None:
        low_rank, u, v, term = _low_rank_term(low_rank, R, N, x.dtype)
    if w_scale is not None or w.dtype is FP8_DTYPE:
        _check_fp8(w, w_scale, N)
    ws = w.stride()
    key = _run_kept(("linear", xm[1:], x.dtype, out.shape, out.stride(), out.dtype, w_shape, ws, w.dtype,
                     None if bias is None else bias.stride(), act, pre_out is not None, term, w_scale is not None,
                     w8a8, residual is not None), out, x, w, bias, pre_out, residual, u, v, w_scale, handle)
    if key is True:
        return out
    sc = out.stride()
    if len(sc) != 2:
        sc = _operand(out, "out")[3:]
    if R == 0 or N == 0:
        return out
    plain = bias is None and not act and pre_out is None and low_rank is None and w_scale is None and residual is None
    f = None if plain else Fusion(bias, act, pre_out, residual=residual, low_rank=low_rank, b_scale=w_scale,
                                  w8a8=w8a8 and w_scale is not None)
    _keep(key, _launch(out, x, w, R, N, K, (), (sxr, sxk), (ws[1], ws[0]), sc, f), f, handle)
    return out


def linear_geglu(x, w, bias, out_shape):
    """A new contiguous ``out_shape`` buffer (its last dim N, its leading dims x's rows) holding
    ``(x @ w[:N]^T + bias[:N]) * gelu(x @ w[N:]^T + bias[N:])`` (exact GELU), written by one launch
    of the Gluon kernel's gated mode (``matmul_hopper.matmul(..., gated=True)``: GEGLU in the
    projection's epilogue, its (R, 2N) output never written); None, nothing allocated, where that
    kernel does not serve the call (not Hopper, another dtype, a layout TMA cannot read, fewer
    tiles than SMs): the caller composes ``linear_`` and the GEGLU map. ``x`` a matrix (``matrix``)
    read along K, ``w`` (2N, K) contiguous, ``bias`` (2N,) or None; ``matmul_hopper.gated_config``'s
    tiles."""
    xb, R, K, sxr, sxk = x if type(x) is tuple else _operand(x, "x")
    N = w.shape[0] // 2
    es = xb.element_size()
    if not (TMA and matmul_hopper.ROUTE and xb.dtype in _TMA_DTYPES and w.dtype is xb.dtype
            and (bias is None or bias.dtype is xb.dtype) and _gluon_available() and tma_available()
            and sxk == 1 and w.stride() == (K, 1) and w.shape[0] == 2 * N and out_shape[-1] == N
            and (sxr * es) % 16 == 0 and (K * es) % 16 == 0 and (N * es) % 16 == 0
            and (xb.data_ptr() | w.data_ptr()) % 16 == 0 and cdiv(R, 128) * cdiv(N, 128) >= runtime.num_sms()):
        return None
    out = runtime.empty(out_shape, xb.dtype)
    matmul_hopper.matmul(out, xb, w, R, N, K, Fusion(bias, GELU.value), (True, True, sxr, K, N),
                         matmul_hopper.gated_config(), gated=True)
    return out


# How the GEMMs take an fp8 weight (``_fp8_route``): "inline" decodes its codes in the main loop (B_FP8);
# "dequant" first writes it in the activations' dtype (quant.dequantize_rows_, a transient buffer) and
# runs the plain GEMM; "auto" (FLAME_FP8_GEMM unset) picks by rows; "w8a8" also rounds a linear's
# input to fp8 for the forward product (``_w8a8``; also asked per call: ``linear_(..., w8a8=True)``).
FP8_GEMMS = ("auto", "inline", "dequant", "w8a8")
FP8_ROUTE = os.environ.get("FLAME_FP8_GEMM", "auto")
FP8_INLINE_MAX_ROWS = 256


def _check_fp8(w, scale, n):
    """A clear error for a weight the fp8 path cannot take: e4m3fn codes need their fp32 scale,
    one per output channel (``n``), and a scale needs codes."""
    if scale is None and w.dtype != torch.float8_e4m3fn:
        return
    if w.dtype != torch.float8_e4m3fn or scale is None:
        raise TypeError(f"matmul: a float8_e4m3fn weight and its scale come together, got a {w.dtype} weight and "
                        f"{'no scale' if scale is None else 'a scale'}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,) or scale.stride(0) != 1:
        raise ValueError(f"matmul: the scale of an fp8 weight must be a contiguous fp32 ({n},) vector, got "
                         f"{scale.dtype} {tuple(scale.shape)}")


def _low_rank(low_rank, M, N, dtype):
    """``low_rank`` with its u and v as matrix tuples (``matrix``), or a clear error for a low-rank
    term the kernels cannot take: ``(u (M, r), v (r, N), beta)``, u and v matrices in the GEMM's
    operand dtype (their tl.dot runs with the main product's precision)."""
    u, v, beta = low_rank
    um = u if type(u) is tuple else matrix(u)
    vm = v if type(v) is tuple else matrix(v)
    if um is None or vm is None or um[1] != M or vm[2] != N or um[2] != vm[1]:
        su, sv = (tuple(t.shape) if m is None else m[1:3] for t, m in ((u, um), (v, vm)))
        raise ValueError(f"matmul: low_rank u {su} and v {sv} must be ({M}, r) and (r, {N}) matrices")
    if um[0].dtype != dtype or vm[0].dtype != dtype:
        raise TypeError(f"matmul: low_rank u and v must be {dtype} like the operands, got {um[0].dtype} and "
                        f"{vm[0].dtype}")
    return um, vm, beta


def _low_rank_term(low_rank, M, N, dtype):
    """``_low_rank``'s term, its U and V buffers and its part of a call signature (``_run_kept``): the
    layouts of U and V and beta."""
    low_rank = _low_rank(low_rank, M, N, dtype)
    um, vm, beta = low_rank
    return low_rank, um[0], vm[0], (um[1:], vm[1:], beta)


def matmul_sum_batch_(out, a, b):
    """``out[M, N] = sum_i a[i] @ b[i]`` over every batch index ``i`` of ``a[..., M, K]`` and
    ``b[..., K, N]`` (same batch shape): the gradient of an operand that was broadcast over the
    batch. When the batch dims collapse into K for both operands (the usual case: contiguous
    activations), this is one GEMM with a longer reduction; otherwise a batched GEMM into an
    fp32 (fp64) scratch buffer and a sum over the batch."""
    *batch, M, K = a.shape
    N = b.shape[-1]
    if out.numel() == 0:
        return out
    nb = math.prod(batch)
    if nb == 0 or K == 0:
        return fill_(out, 0.0)
    st_a, st_b, st_c = a.stride(), b.stride(), out.stride()
    if nb == 1:
        _launch(out, a, b, M, N, K, (), st_a[-2:], st_b[-2:], st_c)
        return out
    shape, (sa, sb) = collapse(batch + [K], [list(st_a[:-2]) + [st_a[-1]], list(st_b[:-2]) + [st_b[-2]]])
    if len(shape) == 1:
        _launch(out, a, b, M, N, shape[0], (), (st_a[-2], sa[0]), (sb[0], st_b[-1]), st_c)
        return out
    scratch = runtime.empty(tuple(batch) + (M, N), accumulation_dtype(a.dtype))
    matmul_(scratch, a, b)
    return reduce_(out, scratch, 1, nb, M * N, (0, M * N, 1), SUM)

