"""2-D convolution as implicit GEMM over channels-last data (no im2col buffer).

Three kernels:

- ``_conv_gemm_kernel`` computes ``out[n, oh, ow, j] = sum_{kh, kw, c} src[n, ih, iw, c] *
  w[c, j, kh, kw]`` (+ bias[j]) for one (BLOCK_M rows of (n, oh, ow)) x (BLOCK_N columns j) tile.
  The reduction index is ordered (kh, kw, c), c innermost, so with channels-last ``src`` each
  A-tile load is contiguous along c. The source position of a row for tap (kh, kw) is
  ``ih = (oh * A + B + kh * C) / D``, valid when it is an integer in [0, XH) (same for w):
    forward:         src = x,  ih = oh * stride - pad + kh * dil            (A=s, B=-p, C=d, D=1)
    input gradient:  src = dY, oh_src = (ih + pad - kh * dil) / stride      (A=1, B=p, C=-d, D=s)
  so the input gradient (a transposed convolution) is the same kernel with the roles of the
  spatial sizes swapped, the weight read as w[co, ci] -> (k=co, n=ci), and rows whose
  ``ih + pad - kh * dil`` is not a multiple of the stride masked out (stride 2: input rows that
  receive no gradient from some taps, odd sizes included). For stride > 1 the rows are split
  into stride_h * stride_w phases (grid axis 2), so within a program every row shares which taps
  reach it. Groups are grid axis 1 (channel offsets). The reduction over (tap, channel block)
  is one flat loop, so the compiler pipelines the whole of K, not C per tap.
- ``_conv_fold_kernel``: the same product for few reduction channels (conv_in's 4 input channels,
  conv_out's input gradient over its 4 output channels), one group and no divisor: all taps x
  channels of a row are one K block, gathered once as a (rows, taps, channels) tile, and the
  program sweeps every output column with it. One K block padded per tap would be 3/4 zeros for
  4 channels (H200, conv_in forward: 39.3 -> 14.9 us).
- ``_conv_wgrad_kernel``: the weight gradient, a GEMM over the N*Ho*Wo rows per tap:
    dW[co, ci, kh, kw] = sum_{n, oh, ow} dY[n, oh, ow, co] * x[n, oh*s - p + kh*d, ow*s - p + kw*d, ci]
  one program per (co tile, ci tile, tap, split of the rows), fp32 (fp64) accumulation; with
  more than one split the partial sums go to an fp32 scratch (split, Co, Ci, KH, KW), laid out in
  dW's own memory order (channels-last for flame's weights: contiguous ci stores), reduced by the
  reduction kernel (deterministic, no atomics). Few input channels (conv_in) fold the taps into
  the ci columns (one program for all taps); few output channels at stride 1 (conv_out) swap the
  operands first (``conv2d_weight_grad_``).

All tensors are read through (n, h, w, c) strides, so NCHW-contiguous and channels-last inputs
(and any other strided view) work alike; channels-last is the fast layout.

On Hopper, stride-1 forwards, input and weight gradients run on the warp-specialised GEMM of
``matmul_hopper`` (its loader reads each tap's box of source pixels by TMA: ``matmul_hopper.Conv``),
K split where the tiles fill less than a wave. Other 16-bit channels-last problems take TMA versions
of the first and last (``_conv_tma_kernel``, ``_conv_wgrad_tma_kernel``): operands move as
descriptor boxes, padding is TMA's zero fill, and a stride of 2 reads (forward, weight gradient) or
writes (input gradient) through a "phase view" that makes every other pixel one box (see
``_phase_split``). A forward or input-gradient grid under one wave of the GPU's SMs splits its
reduction (split-K, ``_wave_splits``): fp32 partial sums to a scratch, summed with the bias by the
GEMM's split-K pass (``matmul.split_k_sum_``). The pointer kernels take the rest: groups, odd sizes
under a stride, fp32/fp64, other layouts.

A 1x1 convolution with stride 1, no padding and one group is a plain GEMM over the (N*H*W, C)
matrices of its activations: when those are strided views of the buffers (``_gemm_views``), all
three functions call the GEMM kernel (``flame.kernels.matmul``) instead, with no im2col indexing.
"""
import dataclasses
import math
import os
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from . import matmul as KM
from .elementwise import _pow2, cdiv, collapse, copy_, fill_
from .launch import Plan, descriptor, descriptor_like, descriptor_template, launch, launch_via
from .matmul import GEMM_FIELDS, _epilogue, _kernel_switches, _tile_coords, linear_, matmul_
from .reduce import SUM, reduce_


@triton.jit
def _conv_gemm_kernel(src_ptr, w_ptr, out_ptr, bias_ptr,
                      M, OH, OW, C, N, KH, KW, XH, XW,
                      A_h, B_h, C_h, D_h, A_w, B_w, C_w, D_w,
                      s_n, s_h, s_w, s_c, sw_k, sw_n, sw_h, sw_w, so_n, so_h, so_w, so_c, s_bias,
                      sg_src, sg_w, sg_out, P_h, P_w,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      BIAS: tl.constexpr, DIV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)  # convolution group: channel offsets of src, w, out
    src_ptr += grp * sg_src
    w_ptr += grp * sg_w
    out_ptr += grp * sg_out
    bias_ptr += grp * N * s_bias
    # Output phase (input gradient with stride > 1): this program's rows are the positions
    # (oh, ow) = (i * P_h + R_h, j * P_w + R_w); M is the row count of phase (0, 0), the largest.
    phase = tl.program_id(2)
    R_h = phase // P_w
    R_w = phase % P_w
    OHp = (OH - R_h + P_h - 1) // P_h
    OWp = (OW - R_w + P_w - 1) // P_w
    NB = M // (((OH + P_h - 1) // P_h) * ((OW + P_w - 1) // P_w))
    Mp = NB * OHp * OWp
    num_pid_m = tl.cdiv(Mp, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    # programs past a smaller phase's tiles compute fully masked tiles (group_m kept >= 1)
    group_m = tl.maximum(tl.minimum(num_pid_m - first_m, GROUP_M), 1)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < Mp
    mask_n = offs_n < N
    ohw = OHp * OWp
    n_idx = offs_m // ohw
    rem = offs_m % ohw
    oh = (rem // OWp) * P_h + R_h
    ow = (rem % OWp) * P_w + R_w
    row_base = src_ptr + n_idx * s_n

    # One flat loop over (tap, channel block) so the whole K = KH * KW * C reduction is one
    # software-pipelined loop. With a divisor (strided input gradient) a tap that cannot reach
    # this phase's rows is fully masked by ``ok`` (its loads are skipped, the MMA adds zeros).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    c_blocks = tl.cdiv(C, BLOCK_K)
    for t in range(0, KH * KW * c_blocks):
        tap = t // c_blocks
        c0 = (t - tap * c_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap % KW
        num_h = oh * A_h + B_h + kh * C_h
        num_w = ow * A_w + B_w + kw * C_w
        if DIV:
            ok = (num_h >= 0) & (num_w >= 0) & (num_h % D_h == 0) & (num_w % D_w == 0)
            ih = num_h // D_h
            iw = num_w // D_w
        else:
            ok = (num_h >= 0) & (num_w >= 0)
            ih = num_h
            iw = num_w
        ok = ok & (ih < XH) & (iw < XW) & mask_m
        ih = tl.where(ok, ih, 0)
        iw = tl.where(ok, iw, 0)
        a_rows = row_base + ih * s_h + iw * s_w
        w_tap = w_ptr + kh.to(tl.int64) * sw_h + kw.to(tl.int64) * sw_w
        ck = c0 + offs_k
        mask_k = ck < C
        a = tl.load(a_rows[:, None] + ck[None, :].to(tl.int64) * s_c,
                    mask=ok[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_tap + ck[:, None].to(tl.int64) * sw_k + offs_n[None, :] * sw_n,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)

    if BIAS:
        acc += tl.load(bias_ptr + offs_n * s_bias, mask=mask_n, other=0.0).to(ACC)[None, :]
    o_off = n_idx * so_n + oh * so_h + ow * so_w
    c_ptrs = out_ptr + o_off[:, None] + offs_n[None, :] * so_c
    tl.store(c_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _conv_fold_kernel(src_ptr, w_ptr, out_ptr, bias_ptr, M, OH, OW, C, N, TAPS, KW, XH, XW,
                      A_h, B_h, C_h, A_w, B_w, C_w,
                      s_n, s_h, s_w, s_c, sw_k, sw_n, sw_h, sw_w, so_n, so_h, so_w, so_c, s_bias,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BIAS: tl.constexpr,
                      TAPS_P2: tl.constexpr, C_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # _conv_gemm_kernel's product (no divisor, one group) for few reduction channels (conv_in's
    # 4): a row's whole reduction, every tap x channel, is one K block of TAPS_P2 * C_P2 columns
    # (column tap * C_P2 + c), gathered once as a (BLOCK_M, TAPS_P2, C_P2) tile (channels
    # contiguous) instead of one mostly-masked K block per tap. The program then sweeps all N
    # columns BLOCK_N at a time with that tile: one dot and one store per column block.
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ohw = OH * OW
    n_idx = offs_m // ohw
    oh = (offs_m % ohw) // OW
    ow = offs_m % OW
    taps = tl.arange(0, TAPS_P2)
    kh = taps // KW
    kw = taps % KW
    ih = oh[:, None] * A_h + B_h + kh[None, :] * C_h
    iw = ow[:, None] * A_w + B_w + kw[None, :] * C_w
    ok = (ih >= 0) & (iw >= 0) & (ih < XH) & (iw < XW) & mask_m[:, None] & (taps < TAPS)[None, :]
    rows = n_idx[:, None] * s_n + tl.where(ok, ih, 0) * s_h + tl.where(ok, iw, 0) * s_w
    cs = tl.arange(0, C_P2)
    mask_c = cs < C
    a = tl.load(src_ptr + rows[:, :, None] + cs[None, None, :].to(tl.int64) * s_c,
                mask=ok[:, :, None] & mask_c[None, None, :], other=0.0)
    a = tl.reshape(a, (BLOCK_M, TAPS_P2 * C_P2))
    w_cols = (kh.to(tl.int64) * sw_h + kw.to(tl.int64) * sw_w)[:, None] + cs[None, :].to(tl.int64) * sw_k
    w_mask = (taps < TAPS)[:, None] & mask_c[None, :]
    if UPCAST:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
        a = a.to(tl.float32)
    o_rows = out_ptr + n_idx * so_n + oh * so_h + ow * so_w
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        b = tl.load(w_ptr + w_cols[:, :, None] + offs_n[None, None, :] * sw_n,
                    mask=w_mask[:, :, None] & mask_n[None, None, :], other=0.0)
        b = tl.reshape(b, (TAPS_P2 * C_P2, BLOCK_N))
        if UPCAST:
            b = b.to(tl.float32)
        acc = tl.dot(a, b, input_precision=PRECISION, out_dtype=ACC)
        if BIAS:
            acc += tl.load(bias_ptr + offs_n * s_bias, mask=mask_n, other=0.0).to(ACC)[None, :]
        tl.store(o_rows[:, None] + offs_n[None, :] * so_c, acc.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


# dW[co, ci, kh, kw] = sum_{n, oh, ow} dY[n, oh, ow, co] * x[n, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw, ci]
# (x is zero outside [0, H) x [0, W): padding contributes nothing). Rows r = (n, oh, ow) are
# the GEMM's reduction axis; program (tile, tap, split) reduces rows [split * RPS, (split+1) * RPS).
# With FOLD_TAPS the taps join the ci axis instead: columns j = tap * CI + ci of a (CO, TAPS * CI)
# product, all taps in one program (grid axis 1 is 1). For few input channels (conv_in's 4) a ci
# tile per tap would be mostly padding and every tap's program would read the same dY rows again.
@triton.jit
def _conv_wgrad_kernel(dy_ptr, x_ptr, out_ptr,
                       M, OH, OW, CO, CI, KW, TAPS, H, W, sh, ph, dh, sw, pw, dw, rows_per_split, tiles,
                       sy_n, sy_h, sy_w, sy_c, sx_n, sx_h, sx_w, sx_c,
                       so_s, so_co, so_ci, so_h, so_w,
                       ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, FOLD_TAPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # CO and CI are per group; program 0's axis is (group, co tile, ci tile), group-major
    pid = tl.program_id(0) % tiles
    grp = (tl.program_id(0) // tiles).to(tl.int64)
    split = tl.program_id(2)
    dy_ptr += grp * CO * sy_c
    x_ptr += grp * CI * sx_c
    out_ptr += grp * CO * so_co
    num_pid_n = tl.cdiv(CI * TAPS, BLOCK_N) if FOLD_TAPS else tl.cdiv(CI, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n

    offs_co = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if FOLD_TAPS:  # column j: tap j // CI, channel j % CI (past the last tap: channel CI, masked)
        tap = offs_n // CI
        offs_ci = tl.where(tap < TAPS, offs_n % CI, CI).to(tl.int64)
    else:
        tap = tl.program_id(1)
        offs_ci = offs_n.to(tl.int64)
    kh = tap // KW
    kw = tap % KW
    mask_co = offs_co < CO
    mask_ci = offs_ci < CI
    ohw = OH * OW
    r_start = split.to(tl.int64) * rows_per_split
    r_end = tl.minimum(r_start + rows_per_split, M)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for r0 in range(0, rows_per_split, BLOCK_K):
        r = r_start + r0 + tl.arange(0, BLOCK_K)
        mask_r = r < r_end
        n_idx = r // ohw
        rem = r % ohw
        oh = rem // OW
        ow = rem % OW
        y_rows = dy_ptr + n_idx * sy_n + oh * sy_h + ow * sy_w
        a = tl.load(y_rows[None, :] + offs_co[:, None] * sy_c,
                    mask=mask_co[:, None] & mask_r[None, :], other=0.0)
        if FOLD_TAPS:  # the source pixel depends on the column's tap: a (rows, columns) gather
            ih = oh[:, None] * sh - ph + kh[None, :] * dh
            iw = ow[:, None] * sw - pw + kw[None, :] * dw
            ok = mask_r[:, None] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & mask_ci[None, :]
            b_ptrs = x_ptr + n_idx[:, None] * sx_n + ih * sx_h + iw * sx_w + offs_ci[None, :] * sx_c
        else:
            ih = oh * sh - ph + kh * dh
            iw = ow * sw - pw + kw * dw
            ok = (mask_r & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))[:, None] & mask_ci[None, :]
            b_ptrs = (x_ptr + n_idx * sx_n + ih * sx_h + iw * sx_w)[:, None] + offs_ci[None, :] * sx_c
        b = tl.load(b_ptrs, mask=ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)

    _store_wgrad_tile(out_ptr, acc, split, kh, kw, offs_co, offs_ci, CO, CI, so_s, so_co, so_ci, so_h, so_w)


@triton.jit
def _store_wgrad_tile(out_ptr, acc, split, kh, kw, offs_co, offs_ci, CO, CI, so_s, so_co, so_ci, so_h, so_w):
    """Store a (co, ci) tile of the weight gradient (split ``split`` of the scratch) at tap (kh, kw):
    one tap, or with folded taps one per column."""
    o_ptrs = (out_ptr + split.to(tl.int64) * so_s + offs_co[:, None] * so_co
              + (kh.to(tl.int64) * so_h + kw.to(tl.int64) * so_w + offs_ci * so_ci)[None, :])
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_co < CO)[:, None] & (offs_ci < CI)[None, :])


# Strided source reads by TMA (PHASED, stride S > 1): output pixel o reads source pixel S * o + off
# for tap offset off. Write off = S * q + r (0 <= r < S): then the source pixels of a run of output
# pixels o0.. are the run q + o0.. of phase r, the pixels S * i + r. A 5-D view of the
# (NB, XH, XW, C) source, (n, i_h, r_h, i_w, r_w * C + c) with strides (s_n, S_h * s_h, s_h,
# S_w * s_w, 1), makes each phase a box: it needs XH and XW divisible by S, pixels C apart (the
# w-phase folds into the channel axis) and channel blocks that divide C (a block past C would read
# the next phase's channels instead of TMA's zeros). Positions outside the image (padding) are
# outside [0, XH / S_h) x [0, XW / S_w) and read as zeros, as in the unit-stride view.
@triton.jit
def _phase_split(off, S, LIFT):
    """(q, r) with off = S * q + r, 0 <= r < S; LIFT * S >= -off keeps // and % on non-negative ints."""
    lifted = off + LIFT * S
    return lifted // S - LIFT, lifted % S


def _pixel_box(NB, XH, XW, C, s_n, s_h, s_w, S_h, S_w, TH, TW, BLOCK_C, phased):
    """(shape, strides, block shape) of an (n, h, w, c) buffer's host-built TMA descriptor of TH x TW
    pixel x BLOCK_C channel boxes: 4-D, or the 5-D phase view above (``phased``)."""
    if phased:
        return ([NB, XH // S_h, S_h, XW // S_w, S_w * C], [s_n, S_h * s_h, s_h, S_w * s_w, 1],
                [1, TH, 1, TW, BLOCK_C])
    return [NB, XH, XW, C], [s_n, s_h, s_w, 1], [1, TH, TW, BLOCK_C]


@triton.jit
def _load_source(desc, n, h0, w0, off_h, off_w, c0, C, S_h, S_w, LIFT_h, LIFT_w, PHASED: tl.constexpr):
    """The box of source pixels (S_h * h + off_h, S_w * w + off_w) for the output pixels (h, w) of
    the tile at (h0, w0), channels from c0 (S = 1 unless PHASED)."""
    if PHASED:
        q_h, r_h = _phase_split(off_h, S_h, LIFT_h)
        q_w, r_w = _phase_split(off_w, S_w, LIFT_w)
        return desc.load([n, h0 + q_h, r_h, w0 + q_w, r_w * C + c0])
    else:
        return desc.load([n, h0 + off_h, w0 + off_w, c0])


# The weight gradient by TMA (Hopper): the reduction runs over spatial tiles of TH x TW output
# positions of one image. For tap (kh, kw) the dY tile dy[n, h0:h0+TH, w0:w0+TW, co0:co0+BLOCK_M]
# and the x tile of the source pixels S * (h, w) + (B_h + kh * C_h, B_w + kw * C_w) are descriptor
# loads (_load_source); TMA zero-fills positions past the output (dY) and outside the image (x), so
#   dW[co, ci, kh, kw] += sum_{positions p of the tile} dY[p, co] * x[S * p + shift(kh, kw), ci]
# needs no masks. Program (co tile x ci tile, tap, split) reduces its split's spatial tiles.
# With FLAT_DY, dY's pixels are the rows of one (NB * OH * OW, CO) matrix of row stride sy_w and a
# tile (whole rows, TW = OW, or a segment of one row) is BLOCK_K consecutive rows of it: a 2-D box,
# used as the transposed dot operand as it comes. The 4-D box needs a rank-reducing reshape there,
# which gave wrong gradients on the H200 (Triton 3.6) for tiles spanning rows, so without FLAT_DY
# tiles are one row (TH = 1).
@triton.jit
def _conv_wgrad_tma_kernel(dyd, xd, out_ptr, NB, OH, OW, CO, CI, KW, B_h, C_h, B_w, C_w,
                           S_h, S_w, LIFT_h, LIFT_w, tiles_per_split, so_s, so_co, so_ci, so_h, so_w,
                           PHASED: tl.constexpr, FLAT_DY: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    BLOCK_K: tl.constexpr = TH * TW
    num_pid_n = tl.cdiv(CI, BLOCK_N)
    off_co = tl.program_id(0) // num_pid_n * BLOCK_M
    off_ci = tl.program_id(0) % num_pid_n * BLOCK_N
    tap = tl.program_id(1)
    split = tl.program_id(2)
    kh = tap // KW
    kw = tap - kh * KW
    tiles_h = tl.cdiv(OH, TH)
    tiles_w = tl.cdiv(OW, TW)
    t0 = split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, NB * tiles_h * tiles_w)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t0, t1):
        n = t // (tiles_h * tiles_w)
        h0 = (t // tiles_w) % tiles_h * TH
        w0 = t % tiles_w * TW
        if FLAT_DY:
            a = dyd.load([(n * OH + h0) * OW + w0, off_co])
        else:
            a = dyd.load([n, h0, w0, off_co]).reshape(BLOCK_K, BLOCK_M)
        b = _load_source(xd, n, h0, w0, B_h + kh * C_h, B_w + kw * C_w, off_ci, CI, S_h, S_w, LIFT_h, LIFT_w,
                         PHASED).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a.T, b, acc)
    offs_co = off_co + tl.arange(0, BLOCK_M)
    offs_ci = off_ci + tl.arange(0, BLOCK_N)
    _store_wgrad_tile(out_ptr, acc, split, kh, kw, offs_co, offs_ci, CO, CI, so_s, so_co, so_ci, so_h, so_w)


# The implicit GEMM of _conv_gemm_kernel on Hopper: operands move by TMA, through descriptors the
# launcher builds on the host (built in the kernel, their setup cost each program 2-3 us of latency:
# H200, 5-15% of these convolutions' time). An M tile is a TH x TW block of output positions of
# one image, so for tap (kh, kw) its A tile is the block of source positions S * (h, w) +
# (B_h + kh * C_h, B_w + kw * C_w): one descriptor load (_load_source; a 4-D box of
# src[n, h0+.., w0+.., c0:c0+BLOCK_K] for S = 1, a box of the phase view for S > 1).
# TMA fills positions outside the image (the padding, negative coordinates included) and channels
# past C with zeros, so there are no masks at all. With a divisor D > 1 (the input gradient of a
# stride-D convolution, C = -1: dx[ih] gets dY[(ih + B - kh) / D] where that divides) program
# axis 1 is the output phase R: the output pixels D * i + R, stored through the phase view of
# ``out``. Their taps are kh = kh0 + D * u with kh0 = (R + B) mod D, reading dY at
# i + (R + B - kh) / D: only the taps that reach the phase are loaded.
# The weight (channels-last, taps and channels dense) is a 2-D (Co, taps * Ci) descriptor: the
# forward reads (n=co, k=ci) tiles and transposes them in shared memory, the input gradient reads
# (k=co, n=ci) tiles directly. A tile that runs past this tap's Ci channels into the next tap's
# is harmless: forward, those k meet the zero-filled channels of the A tile; input gradient, those
# n are output columns past N, clipped on store (with a divisor BLOCK_N divides N: no tile runs
# past it into the next phase's channels). The output tile is stored through a 4-D descriptor, or
# with a divisor the phase view (clipped).
# Split-K (grid axis 2, for grids under one wave): split s runs the loop steps [s * steps_per_split,
# (s + 1) * steps_per_split) of its phase's reduction (possibly none: phases meet different numbers
# of taps) and stores its fp32 partial sum, with no bias, as images s * NB.. of a scratch with
# ``out``'s (OH, OW) pixels, channels last: (splits * NB, OH, OW, N), read by the same 4-D or phase
# view. split_k_sum_ (kernels/matmul.py) then sums the splits, adds the bias and casts.
# One split is the plain kernel: images 0.. of ``out`` itself, the whole loop.
@triton.jit
def _conv_tma_kernel(src, wd, out, bias_ptr, NB, C, OH, OW, N, KH, KW, B_h, C_h, B_w, C_w, S_h, S_w,
                     LIFT_h, LIFT_w, D_h, D_w, s_bias, steps_per_split, TRANSPOSED: tl.constexpr, BIAS: tl.constexpr,
                     PHASED: tl.constexpr, DIVIDED: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    BLOCK_M: tl.constexpr = TH * TW
    split = tl.program_id(2)
    R_h = tl.program_id(1) // D_w  # output phase (0 unless DIVIDED)
    R_w = tl.program_id(1) % D_w
    kh0 = (R_h + B_h) % D_h  # the first tap that reaches the phase (B >= 0 where D > 1)
    kw0 = (R_w + B_w) % D_w
    taps_w = tl.cdiv(KW - kw0, D_w)
    tiles_h = tl.cdiv(OH // D_h, TH)
    tiles_w = tl.cdiv(OW // D_w, TW)
    pid_m, pid_n = _tile_coords(tl.program_id(0), NB * tiles_h * tiles_w, tl.cdiv(N, BLOCK_N), GROUP_M)
    n = pid_m // (tiles_h * tiles_w)
    h0 = (pid_m // tiles_w) % tiles_h * TH
    w0 = pid_m % tiles_w * TW
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_blocks = tl.cdiv(C, BLOCK_K)
    t0 = split * steps_per_split
    t1 = tl.minimum(t0 + steps_per_split, tl.cdiv(KH - kh0, D_h) * taps_w * c_blocks)
    for t in range(t0, t1):
        u = t // c_blocks
        c0 = (t - u * c_blocks) * BLOCK_K
        kh = kh0 + u // taps_w * D_h
        kw = kw0 + u % taps_w * D_w
        tap = kh * KW + kw
        # R + B + k * C is a multiple of D for the phase's taps: the division is exact
        a = _load_source(src, n, h0, w0, (R_h + B_h + kh * C_h) // D_h, (R_w + B_w + kw * C_w) // D_w, c0, C,
                         S_h, S_w, LIFT_h, LIFT_w, PHASED).reshape(BLOCK_M, BLOCK_K)
        if TRANSPOSED:
            b = wd.load([c0, tap * N + off_n])
        else:
            b = wd.load([off_n, tap * C + c0]).T
        acc = tl.dot(a, b, acc)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _, acc = _epilogue(acc, 1.0, bias_ptr, offs_n, offs_n < N, s_bias, BIAS, 0)
    acc = acc.to(out.dtype)
    n_out = split * NB + n
    if DIVIDED:
        out.store([n_out, h0, R_h, w0, R_w * N + off_n], acc.reshape(1, TH, 1, TW, BLOCK_N))
    else:
        out.store([n_out, h0, w0, off_n], acc.reshape(1, TH, TW, BLOCK_N))


# ---- launch configuration ---------------------------------------------------------------------

def _gpu_tiles(dtype, M, N, K):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an (M x K) @ (K x N) tile loop: the matmul
    kernel's H200 choices per dtype, shrunk to the problem (at least 16 for tl.dot)."""
    if dtype == torch.float64:
        bm, bn, bk, warps, stages = 64, 64, 32, 4, 3
    elif dtype == torch.float32:
        bm, bn, bk, warps, stages = 128, 128, 32, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 4, 3
    return (min(bm, max(16, _pow2(M))), min(bn, max(16, _pow2(N))), min(bk, max(16, _pow2(K))), warps, stages)


def _gemm_heuristic(key, dtype):
    """conv2d's and conv2d_dgrad's default config at key (M, N, K, taps): the matmul kernel's H200
    choices (128x128, BLOCK_K 64 for 16-bit, 32 for tf32), shrunk to the problem and halved while
    the tiles leave SMs idle; not yet measured on a GPU. The interpreter: big blocks."""
    M, N, K, _ = key
    if runtime.INTERPRETER:
        return dict(BLOCK_M=_pow2(min(M, 256)), BLOCK_N=_pow2(min(N, 128)), BLOCK_K=_pow2(min(K, 128)),
                    num_warps=4, num_stages=1)
    bm, bn, bk, warps, stages = _gpu_tiles(dtype, M, N, K)
    sms = runtime.num_sms()
    while cdiv(M, bm) * cdiv(N, bn) < sms and max(bm, bn) > 64:
        if bm >= bn:
            bm //= 2
        else:
            bn //= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _fold_heuristic(key, dtype):
    """conv2d_fold's default config at key (M, N, C, taps): programs of 64 rows that sweep N 64
    columns at a time, 4 warps, 2 stages (the interpreter: big blocks, few programs)."""
    M, N, _, _ = key
    if runtime.INTERPRETER:
        return dict(BLOCK_M=max(16, _pow2(min(M, 256))), BLOCK_N=max(16, _pow2(min(N, 128))), num_warps=4,
                    num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=max(16, min(64, _pow2(N))), num_warps=4, num_stages=2)


def _wgrad_heuristic(key, dtype, tma=False):
    """conv2d_wgrad's (and, ``tma``, conv2d_wgrad_tma's) default config at key (CO, CI, M, taps):
    the matmul kernel's H200 tiles shrunk to the problem (the interpreter's pointer kernel: big
    blocks, few programs)."""
    CO, CI, M, _ = key
    if runtime.INTERPRETER and not tma:
        return dict(BLOCK_M=_pow2(min(CO, 128)), BLOCK_N=_pow2(min(CI, 128)), BLOCK_K=_pow2(min(M, 512)),
                    num_warps=4, num_stages=1)
    bm, bn, bk, warps, stages = _gpu_tiles(dtype, CO, CI, M)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _tma_heuristic(key, dtype):
    """conv2d_tma's and conv2d_dgrad_tma's default config at key (M, N, C, taps)."""
    _, N, C, _ = key
    bn = min(128, max(16, _pow2(N)))
    bk = min(64, max(16, _pow2(C)))
    return dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4)


def _wgrad_tma_keep(cfg, key):
    # On the H200 (Triton 3.6) wgrad TMA configs with BLOCK_M = 256 or BLOCK_K = 128 gave wrong
    # weight gradients at 32x32 pixels (relative error 0.17, in a sweep of every config). The
    # kernel's indexing holds for any TH x TW = BLOCK_K tile (_spatial_tile), so the cause, likely
    # in the compiler's handling of those 4-D descriptor tiles, is not understood yet: they stay
    # out rather than reach untested shapes through the table's bucket fallback.
    return cfg["BLOCK_M"] < 256 and cfg["BLOCK_K"] < 128


def _conv_spec(name, key, fields, heuristic, doc, keep=None):
    return tune.register(tune.Spec(name, key, fields, heuristic, autotune.gemm_stages, autotune.GEMM_SPACE,
                                   autotune.QUICK_GEMM_SPACE, keep, doc=doc))


# The tunable kernels of this file. Keys: M = batch x output pixels (the input gradient: input
# pixels, per stride phase on the TMA path), N = output channels (the input gradient: input
# channels) per group, C = reduction channels per tap and group, taps = KH x KW (per phase);
# the weight gradient: M = output and N = input channels per group, K = batch x output pixels.
_PIXELS = ("M", "N", "C", "taps")
SPECS = {s.name: s for s in (
    _conv_spec("conv2d", _PIXELS, GEMM_FIELDS, _gemm_heuristic, "_conv_gemm_kernel: the implicit GEMM, forward"),
    _conv_spec("conv2d_dgrad", _PIXELS, GEMM_FIELDS, _gemm_heuristic,
               "_conv_gemm_kernel as the input gradient (output phases under a stride)"),
    _conv_spec("conv2d_tma", _PIXELS, GEMM_FIELDS, _tma_heuristic,
               "_conv_tma_kernel, forward: 16-bit channels-last on Hopper (BLOCK_M = a TH x TW pixel tile)"),
    _conv_spec("conv2d_dgrad_tma", _PIXELS, GEMM_FIELDS, _tma_heuristic,
               "_conv_tma_kernel as the input gradient, keyed per output phase"),
    _conv_spec("conv2d_fold", _PIXELS, ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), _fold_heuristic,
               "_conv_fold_kernel: few reduction channels, every tap in one K block (forward, input gradient)"),
    _conv_spec("conv2d_wgrad", ("M", "N", "K", "taps"), GEMM_FIELDS, _wgrad_heuristic,
               "_conv_wgrad_kernel: the weight gradient, a GEMM per tap (split-K follows from the tiles)"),
    _conv_spec("conv2d_wgrad_tma", ("M", "N", "K", "taps"), GEMM_FIELDS,
               lambda key, dtype: _wgrad_heuristic(key, dtype, tma=True),
               "_conv_wgrad_tma_kernel: the TMA weight gradient (BLOCK_K = a TH x TW tile of output pixels)",
               keep=_wgrad_tma_keep),
)}


def _gemm_config(M, N, K, dtype, taps=1, kernel="conv2d"):
    """Tile config for the implicit GEMM (M rows, N columns, K channels per tap, ``taps`` =
    KH * KW): a tuning-table entry (``flame.tune``, ``kernel`` "conv2d" or "conv2d_dgrad", key
    (M, N, K, taps)) on the GPU, else ``_gemm_heuristic``."""
    return SPECS[kernel].config((M, N, K, taps), dtype)


def _fold_config(M, N, C, taps, dtype):
    """Tile config of ``_conv_fold_kernel`` (M rows, N columns, C channels per tap, ``taps`` =
    KH * KW): a tuning-table entry (kernel "conv2d_fold", key (M, N, C, taps)) on the GPU, else
    ``_fold_heuristic``."""
    return SPECS["conv2d_fold"].config((M, N, C, taps), dtype)


def _wgrad_config(CO, CI, M, taps, dtype, tma):
    """Tile config of the weight gradient: a (CO x M) @ (M x CI) tile loop per tap, CO and CI per
    group, M = batch x output pixels. A tuning-table entry (``flame.tune``, kernel "conv2d_wgrad"
    or, for the TMA kernel, "conv2d_wgrad_tma"; key (CO, CI, M, taps)) wins on the GPU; else
    ``_wgrad_heuristic``. The TMA kernel reduces over spatial tiles of BLOCK_K output pixels; the
    launcher derives the split of the reduction from the tiles."""
    return SPECS["conv2d_wgrad_tma" if tma else "conv2d_wgrad"].config((CO, CI, M, taps), dtype)


def _nhwc(t):
    """(n, h, w, c) strides of a 4-D (N, C, H, W) buffer (or ``Operand``)."""
    s = t.stride()
    return s[0], s[2], s[3], s[1]


# ---- routes: which kernel runs a convolution ----------------------------------------------------
# ``plan(problem)`` decides, from a ``ConvProblem`` (the direction, each operand's shape, strides
# and dtype, stride/padding/dilation/groups, and whether the buffers and the device allow TMA),
# which of the paths below runs and with which config; the three entry points build the problem
# from their buffers, ask ``plan`` and run the route it names. Forward and input gradient:
#   "gemm"           1x1, stride 1, no padding, one group, activations viewable as (N*H*W, C)
#                    matrices: the GEMM launcher (``linear_``/``matmul_``), which picks its own config
#   "gluon"          ``matmul_hopper``'s warp-specialised GEMM reading the implicit GEMM's pixel boxes
#                    (``_plan_gluon``): what "tma" takes at stride 1 on sm_90, K split below a wave
#   "tma"            ``_conv_tma_kernel``: 16-bit channels-last buffers TMA can describe, stride 1 or
#                    phase views; split-K below one wave of SMs (``_wave_splits``)
#   "fold"           ``_conv_fold_kernel``: few reduction channels, every tap x channel in one K block
#   "implicit_gemm"  ``_conv_gemm_kernel``: everything else (groups, odd sizes, fp32/fp64, any
#                    layout); an input gradient under a stride runs its output phases on grid axis 2
# Weight gradient:
#   "gemm"           as above (dW = dY^T X)
#   "gluon_wgrad"    ``matmul_hopper``'s warp-specialised GEMM, B the source's pixel boxes per tap
#                    (``_plan_gluon_wgrad``): stride 1 on sm_90, K (the pixels) split below a wave
#   "wgrad_tma"      ``_conv_wgrad_tma_kernel`` over spatial tiles
#   "wgrad_swap"     few output channels at stride 1: the pointer kernel with the operands swapped
#                    (then its few "input" channels fold with the taps)
#   "wgrad_fold"     few input channels: the pointer kernel with every (tap, ci) in one column tile
#   "wgrad"          ``_conv_wgrad_kernel``, one program per tap
# and "none" (an empty output) or "zero_fill" (a weight gradient over no output pixels). The
# weight-gradient routes split their reduction when their grid is small (``_wgrad_splits``): fp32
# partials then summed by the reduction kernel. ``FLAME_DEBUG_ROUTES=1`` prints each distinct
# problem's route and why, once, to stderr.

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "forward", "input_grad", "weight_grad"
DEBUG_ROUTES = os.environ.get("FLAME_DEBUG_ROUTES", "") == "1"
_TMA_DTYPES = (torch.float16, torch.bfloat16)


class Operand(NamedTuple):
    """A buffer as routing sees it: shape, strides and dtype (``stride()`` as a tensor's)."""

    shape: tuple
    strides: tuple
    dtype: torch.dtype

    @classmethod
    def of(cls, t):
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype)

    def stride(self):
        return self.strides


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One convolution launch: ``direction`` (FORWARD, INPUT_GRAD or WEIGHT_GRAD), the input ``x``
    (N, Ci, H, W) (the input gradient's output dX), the weight ``w`` (Co, Ci/groups, KH, KW) (the
    weight gradient's output dW), the output ``y`` (N, Co, OH, OW) (the gradients' dY); stride,
    (top, left) padding, dilation, groups; the forward's bias dtype (None: no bias); ``aligned``:
    the buffers a TMA kernel would read have 16-byte aligned bases; ``tma``: the device runs
    flame's TMA kernels for this dtype; ``gluon``: and the warp-specialised GEMM of
    ``matmul_hopper`` (sm_90, its route on)."""

    direction: str
    x: Operand
    w: Operand
    y: Operand
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1
    bias: torch.dtype | None = None
    aligned: bool = True
    tma: bool = False
    gluon: bool = False

    @classmethod
    def of(cls, direction, x, w, y, stride, padding, dilation, groups=1, bias=None):
        """The problem of a launch on these torch buffers."""
        bufs = (y, x) if direction == WEIGHT_GRAD else (y, x, w)
        dtype = (x if direction == INPUT_GRAD else y).dtype  # the first operand the TMA checks take
        tma = bool(KM.TMA and dtype in _TMA_DTYPES and KM.tma_available())
        return cls(direction, Operand.of(x), Operand.of(w), Operand.of(y), tuple(stride), tuple(padding),
                   tuple(dilation), groups, None if bias is None else bias.dtype,
                   all(t.data_ptr() % 16 == 0 for t in bufs), tma, tma and _gluon_on())

    @classmethod
    def dense(cls, direction, x_shape, w_shape, dtype, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
              channels_last=True, bias=False, tma=False, gluon=False):
        """A problem on freshly allocated buffers (channels-last activations and weight, or
        contiguous NCHW ones): how tests describe one without allocating it."""
        (nb, _, h, wd), (co, _, kh, kw) = x_shape, w_shape
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1

        def operand(shape):
            _, c, hh, ww = shape
            strides = (hh * ww * c, 1, ww * c, c) if channels_last else (c * hh * ww, hh * ww, ww, 1)
            return Operand(tuple(shape), strides, dtype)

        return cls(direction, operand(x_shape), operand(w_shape), operand((nb, co, oh, ow)), tuple(stride),
                   tuple(padding), tuple(dilation), groups, dtype if bias else None, True,
                   tma and dtype in _TMA_DTYPES, gluon and tma and dtype in _TMA_DTYPES)


@dataclasses.dataclass(frozen=True)
class Route:
    """What ``plan`` chose: the path (``kernel``, one of the names above), its launch config (the
    kernel's constexprs: tuned fields as ``flame.tune`` answered them, with the derived ones; empty
    for "gemm", "none", "zero_fill"), how many splits its reduction runs in, and why. ``kept``: what
    the route's runner keeps from its first launch (the "tma" route: ``_TmaLaunch``; "gluon": its
    ``matmul_hopper.Conv``, sizes, layout and launch config)."""

    kernel: str
    config: dict
    splits: int
    reason: str
    kept: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


_reported: set = set()


_route = KM.RouteMemo(lambda p: _plan_wgrad(p) if p.direction == WEIGHT_GRAD else _plan_conv(p))
tune.register_cache(_route.cache_clear)


def plan(p: ConvProblem) -> Route:
    """The route of convolution problem ``p`` (see above), memoised per problem (a training loop's
    shapes repeat): one dictionary lookup on the host after the first call."""
    route = _route(p)
    if DEBUG_ROUTES and p not in _reported:
        _reported.add(p)
        print(f"flame conv route: {p.direction} x{list(p.x.shape)} w{list(p.w.shape)} y{list(p.y.shape)} "
              f"{p.x.dtype} stride {p.stride} padding {p.padding} dilation {p.dilation} groups {p.groups}: "
              f"{route.kernel}, splits {route.splits}, config {route.config}: {route.reason}", file=sys.stderr)
    return route


_PLAN = plan  # the entry points plan every call while this name is replaced (a test's watcher)


def _planned(direction, x, w, y, stride, padding, dilation, groups, bias=None):
    """``(p, plan(p))`` for ``p = ConvProblem.of(...)`` of an entry point's buffers, memoised per call
    signature (what the problem is made of, as the call has it: shapes, strides and dtypes, the
    geometry's tuples, the bias dtype, the alignment of the buffers TMA reads and the TMA switch as
    read now), so a repeated convolution builds no problem; every call plans while
    FLAME_DEBUG_ROUTES is on or ``plan`` is replaced."""
    pointers = y.data_ptr() | x.data_ptr() | (0 if direction == WEIGHT_GRAD else w.data_ptr())
    tma = KM.TMA and (x if direction == INPUT_GRAD else y).dtype in _TMA_DTYPES and KM.tma_available()
    key = (direction, x.shape, x.stride(), x.dtype, w.shape, w.stride(), w.dtype, y.shape, y.stride(), y.dtype,
           stride, padding, dilation, groups, None if bias is None else bias.dtype, pointers % 16 == 0, tma,
           tma and _gluon_on())
    entry = _route.calls.get(key)
    if entry is None or DEBUG_ROUTES or plan is not _PLAN:
        p = ConvProblem.of(direction, x, w, y, stride, padding, dilation, groups, bias)
        entry = p, plan(p)
        if plan is _PLAN:
            _route.keep_call(key, entry)
    return entry


def _gemm_route(p, *acts):
    """The "gemm" route when the convolution is a plain GEMM over ``acts`` (1x1 kernel, stride 1,
    no padding, one group, each activation viewable as an (N*H*W, C) matrix), else None."""
    if tuple(p.w.shape[2:]) != (1, 1) or p.stride != (1, 1) or p.padding != (0, 0) or p.groups != 1:
        return None
    if any(_row_stride(a) is None for a in acts):
        return None
    return Route("gemm", {}, 1, "1x1 kernel, stride 1, no padding, one group, activations viewable as (N*H*W, C) "
                                "matrices: a plain GEMM")


def _geometry(p):
    """(out, src, geom_h, geom_w) of a forward or input gradient: ``geom_*`` = (A, B, C, D) of the
    source-position formula of ``_conv_gemm_kernel``."""
    (sh, sw), (ph, pw), (dh, dw) = p.stride, p.padding, p.dilation
    if p.direction == INPUT_GRAD:
        return p.x, p.y, (1, ph, -dh, sh), (1, pw, -dw, sw)
    return p.y, p.x, (sh, -ph, dh, 1), (sw, -pw, dw, 1)


def _plan_conv(p):
    out, src, geom_h, geom_w = _geometry(p)
    transposed = p.direction == INPUT_GRAD
    gemm = _gemm_route(p, out, src)
    if gemm is not None:
        return gemm
    if math.prod(out.shape) == 0:
        return Route("none", {}, 0, "empty output")
    groups = p.groups
    NB, N, OH, OW = out.shape[0], out.shape[1] // groups, out.shape[2], out.shape[3]
    C = src.shape[1] // groups
    KH, KW = p.w.shape[2], p.w.shape[3]
    # with a divisor D > 1 (the input gradient of a strided conv) the rows split into D_h * D_w
    # phases, each of which only meets the taps whose offset it divides: no work on masked taps
    P_h, P_w = geom_h[3], geom_w[3]
    M = NB * cdiv(OH, P_h) * cdiv(OW, P_w)
    if groups == 1 and _tma_ok(p, out, src, geom_h, geom_w):
        return _plan_gluon(p, out, src) or _plan_tma(p, out, src, geom_h, geom_w, transposed)
    fold = folds(C, KH * KW) if groups == 1 and P_h * P_w == 1 else None
    if fold:
        cfg = _fold_config(M, N, C, KH * KW, src.dtype)
        return Route("fold", dict(fold, **cfg), 1, f"{C} reduction channels x {KH * KW} taps fit one K block of "
                                                  f"{fold['TAPS_P2'] * fold['C_P2']} columns")
    cfg = _gemm_config(M, N, C, src.dtype, KH * KW, "conv2d_dgrad" if transposed else "conv2d")
    if groups > 1:
        why = f"{groups} groups"
    else:
        why = (f"{P_h * P_w} output phases" if P_h * P_w > 1 else f"{C} channels x {KH * KW} taps: too wide to fold")
        why += "; no TMA: " + ("layout or sizes TMA cannot take" if p.tma else "not on this device or dtype")
    return Route("implicit_gemm", dict(cfg), 1, why)


def _gluon_on():
    """Whether convolutions may take ``matmul_hopper``'s kernel: its route on and an sm_90 GPU."""
    return KM.matmul_hopper.ROUTE and KM._gluon_available()


def _plan_gluon(p, out, src):
    """The "gluon" route, or None: ``matmul_hopper``'s warp-specialised GEMM over the implicit GEMM
    (``matmul_hopper.Conv``) of a problem the TMA kernel could run (``_tma_ok``) at stride 1 with
    ``out`` viewable as (pixels, channels) rows, in the tile shape that kernel picks for its (M, N,
    K) (``matmul_hopper._choose``: a wave of tiles or more, or K split to make one) when a block of
    that many output pixels is a TMA box (``matmul_hopper.box_rows``). Its config carries that box's
    rows."""
    if not p.gluon or p.stride != (1, 1) or _row_stride(out) is None:
        return None
    NB, N, OH, OW = out.shape
    KH, KW = p.w.shape[2], p.w.shape[3]
    cfg = KM.matmul_hopper._choose(NB * OH * OW, N, KH * KW * src.shape[1], split=True)
    box_h = None if cfg is None else KM.matmul_hopper.box_rows(cfg["BLOCK_M"], OH, OW)
    return None if box_h is None else _gluon_route("gluon", cfg, box_h, "K")


def _plan_gluon_wgrad(p):
    """The "gluon_wgrad" route, or None: ``matmul_hopper``'s kernel on dW (Co, taps * Ci) = dY^T
    X_tap (``matmul_hopper.Conv.weight_grad``) for what the TMA weight gradient takes at stride 1,
    dY viewable as (pixels, Co) rows, dW channels-last with its taps and channels dense in the
    operands' dtype, at least 128 output channels (a tile's rows), blocks of 64 output pixels that
    are TMA boxes, and a tile shape whose columns divide Ci (a block of them within one tap), K
    split up to 8 ways. (B's boxes are wider than the 128-byte swizzle: the compiler loads them in
    64-channel column blocks, each the whole box of pixels, as it loads a 2-D block of that width:
    Triton 3.6's PTX for sm_90.)"""
    if not (p.gluon and p.stride == (1, 1) and _wgrad_tma(p) and _row_stride(p.y) is not None):
        return None
    (CO, CI, KH, KW), (NB, _, OH, OW) = p.w.shape, p.y.shape
    if CO < 128 or p.w.strides != (KH * KW * CI, 1, KW * CI, CI) or p.w.dtype != p.x.dtype:
        return None  # (a dW of another dtype: the kernel's store buffers are sized for 16-bit outputs)
    box_h = KM.matmul_hopper.box_rows(KM.matmul_hopper.K_BYTES // 2, OH, OW)
    cfg = None if box_h is None else KM.matmul_hopper._choose(CO, KH * KW * CI, NB * OH * OW, split=True,
                                                               max_split=8, n_divides=CI)
    return None if cfg is None else _gluon_route("gluon_wgrad", cfg, box_h, "K (the pixels)")


def _gluon_route(kernel, cfg, box_h, k):
    """A route on ``matmul_hopper``'s kernel: its launch config ``cfg`` with the pixel boxes' rows."""
    splits = cfg["SPLIT_K"]
    why = "stride 1, 16-bit channels-last buffers TMA can describe: the warp-specialised GEMM"
    return Route(kernel, dict(cfg, BOX_H=box_h), splits, why + (f", {k} in {splits} splits" if splits > 1 else ""))


def _tma_work(NB, OH, OW, N, C, KH, KW, D_h, D_w, cfg):
    """(output tiles of one phase, reduction steps of the longest phase) of ``_conv_tma_kernel``."""
    tiles = NB * cdiv(OH // D_h, cfg["TH"]) * cdiv(OW // D_w, cfg["TW"]) * cdiv(N, cfg["BLOCK_N"])
    return tiles, cdiv(KH, D_h) * cdiv(KW, D_w) * cdiv(C, cfg["BLOCK_K"])


def _plan_tma(p, out, src, geom_h, geom_w, transposed):
    NB, N, OH, OW = out.shape
    C = src.shape[1]
    KH, KW = p.w.shape[2], p.w.shape[3]
    phased, divided = (geom_h[0], geom_w[0]) != (1, 1), (geom_h[3], geom_w[3]) != (1, 1)
    D_h, D_w = geom_h[3], geom_w[3]  # output phases: D_h * D_w launches' worth along grid axis 1
    # tuned per phase: a stride-2 input gradient is 4 problems of a quarter of the pixels and at most
    # ceil(K / 2)^2 taps each, not the stride-1 problem of its shape (M, N, C, taps)
    cfg = dict(_conv_tma_config(NB * OH * OW // (D_h * D_w), N, C, src.dtype, cdiv(KH, D_h) * cdiv(KW, D_w),
                                "conv2d_dgrad" if transposed else "conv2d"))
    cfg["BLOCK_K"] = _dividing_block(cfg["BLOCK_K"], C, phased)
    cfg["BLOCK_N"] = _dividing_block(cfg["BLOCK_N"], N, divided)
    cfg["TH"], cfg["TW"] = _spatial_tile(cfg.pop("BLOCK_M"), OH // D_h, OW // D_w)
    tiles, steps = _tma_work(NB, OH, OW, N, C, KH, KW, D_h, D_w, cfg)
    splits = _wave_splits(tiles * D_h * D_w, steps, runtime.num_sms())  # 1 in the interpreter (1 SM)
    # the sum pass writes ``out`` as (NB*OH*OW, N) rows; none of the splits empty in the longest phase
    splits = cdiv(steps, cdiv(steps, splits)) if splits > 1 and _row_stride(out) is not None else 1
    why = f"16-bit channels-last buffers TMA can describe, {'phase views' if phased or divided else 'stride 1'}"
    if splits > 1:
        why += f"; {tiles * D_h * D_w} programs under one wave of {runtime.num_sms()} SMs: split-K"
    return Route("tma", cfg, splits, why)


def _wgrad_geometry(p):
    """The weight gradient's (dy, x, CO, CI, OH, OW, H, W, ph, pw, swap): with ``swap`` (few
    output channels at stride 1, see ``_run_wgrad``) the operands' roles are exchanged."""
    (CO, CI, KH, KW), (sh, sw), (ph, pw), (dh, dwl) = p.w.shape, p.stride, p.padding, p.dilation
    dy, x = p.y, p.x
    CO //= p.groups
    OH, OW, H, W = dy.shape[2], dy.shape[3], x.shape[2], x.shape[3]
    taps = KH * KW
    swap = not _wgrad_tma(p) and p.groups == 1 and (sh, sw) == (1, 1) and CO * taps <= _FOLD_COLUMNS < CI * taps
    if swap:
        dy, x, CO, CI, OH, OW, H, W = x, dy, CI, CO, H, W, OH, OW
        ph, pw = (KH - 1) * dh - ph, (KW - 1) * dwl - pw
    return dy, x, CO, CI, OH, OW, H, W, ph, pw, swap


def _wgrad_tma(p):
    return p.groups == 1 and _phase_view_ok(p.x, *p.stride) and _tma_operands_ok(p, p.y, p.x)


def _wgrad_units(p, cfg, NB, OH, OW):
    """(reduction units, rows per unit) of the weight gradient: spatial tiles (TMA) or BLOCK_K rows."""
    if "TH" in cfg:
        return NB * cdiv(OH, cfg["TH"]) * cdiv(OW, cfg["TW"]), 1
    return cdiv(NB * OH * OW, cfg["BLOCK_K"]), cfg["BLOCK_K"]


def _plan_wgrad(p):
    gemm = _gemm_route(p, p.y, p.x)
    if gemm is not None:
        return gemm
    NB, KH, KW, groups = p.y.shape[0], p.w.shape[2], p.w.shape[3], p.groups
    if math.prod(p.w.shape) == 0:
        return Route("none", {}, 0, "empty weight")
    if NB * p.y.shape[2] * p.y.shape[3] == 0:
        return Route("zero_fill", {}, 0, "no output pixels: dW = 0")
    gluon = _plan_gluon_wgrad(p)
    if gluon is not None:
        return gluon
    tma = _wgrad_tma(p)
    dy, x, CO, CI, OH, OW, _, _, _, _, swap = _wgrad_geometry(p)
    taps = KH * KW
    fold = not tma and taps > 1 and CI * taps <= _FOLD_COLUMNS
    cfg = dict(_wgrad_config(CO, CI, NB * OH * OW, taps, x.dtype, tma))
    if tma:
        cfg["TH"], cfg["TW"], cfg["FLAT_DY"] = _wgrad_spatial_tile(cfg.pop("BLOCK_K"), OH, OW,
                                                                   _row_stride(dy) is not None)
        cfg["BLOCK_N"] = _dividing_block(cfg["BLOCK_N"], CI, p.stride != (1, 1))
    else:
        cfg["FOLD_TAPS"] = fold
    if fold:  # one column tile holds every (tap, channel) column
        cfg["BLOCK_N"] = max(16, _pow2(CI * taps))
    units, _ = _wgrad_units(p, cfg, NB, OH, OW)
    tiles = cdiv(CO, cfg["BLOCK_M"]) * (1 if fold else cdiv(CI, cfg["BLOCK_N"]))
    splits = cdiv(units, cdiv(units, _wgrad_splits(tiles * groups * (1 if fold else taps), units)))
    if tma:
        kernel, why = "wgrad_tma", "16-bit channels-last buffers TMA can describe"
    elif swap:
        kernel, why = "wgrad_swap", f"{CI} output channels at stride 1: operands swapped"
        why += "; taps folded" if fold else ""
    elif fold:
        kernel, why = "wgrad_fold", f"{CI} input channels x {taps} taps fit one column tile"
    else:
        kernel, why = "wgrad", "one program per tap" + (f", groups {groups}" if groups > 1 else "")
    return Route(kernel, cfg, splits, why + (f"; {splits} splits of the rows: few programs" if splits > 1 else ""))


def _tma_ok(p, out, src, geom_h, geom_w):
    """Whether ``_conv_tma_kernel`` can run this problem: source stride A and divisor D that the
    phase views take (``_phase_view_ok``; a divisor with unit dilation only, C = -1), one 16-bit
    dtype, buffers as ``_tma_operands_ok`` wants them and the weight's taps and channels dense."""
    if not (_phase_view_ok(src, geom_h[0], geom_w[0]) and _phase_view_ok(out, geom_h[3], geom_w[3])):
        return False
    if (geom_h[3] > 1 and geom_h[2] != -1) or (geom_w[3] > 1 and geom_w[2] != -1):
        return False
    ci, kw = p.w.shape[1], p.w.shape[3]
    ws = p.w.strides
    if ws[3] != ci or ws[2] != kw * ci or (p.bias is not None and p.bias != src.dtype):
        return False
    return _tma_operands_ok(p, out, src, p.w)


def _tma_operands_ok(p, *ops):
    """Whether TMA descriptors can describe these 4-D operands: the device runs TMA kernels, one
    16-bit dtype, channels (dim 1) contiguous, 16-byte aligned bases and other strides (channels a
    multiple of 8)."""
    dtype = ops[0].dtype
    if not p.tma or dtype not in _TMA_DTYPES or not p.aligned:
        return False
    es = dtype.itemsize
    for t in ops:
        if t.dtype != dtype or t.strides[1] != 1:
            return False
        if any((st * es) % 16 for st in t.strides if st != 1):
            return False
    return True


def _phase_view_ok(src, S_h, S_w):
    """Whether the TMA kernels can read ``src`` (NB, C, XH, XW) at strides (S_h, S_w): always at
    stride 1; else through the phase view (see ``_phase_split``): XH and XW divisible by the
    strides, pixels C apart when S_w > 1, and C a multiple of 16 (channel blocks that divide it)."""
    if S_h == S_w == 1:
        return True
    C, XH, XW = src.shape[1], src.shape[2], src.shape[3]
    return XH % S_h == 0 and XW % S_w == 0 and C % 16 == 0 and (S_w == 1 or _nhwc(src)[2] == C)


def _phase_args(geom_h, geom_w, KH, KW):
    """The TMA kernels' phase-view arguments (S_h, S_w, LIFT_h, LIFT_w) for source positions
    S * o + B + k * C_geom (k < KH or KW)."""
    def lift(S, B, Cg, K):  # LIFT * S >= -(smallest tap offset)
        return cdiv(max(0, -min(B, B + (K - 1) * Cg)), S)

    return (geom_h[0], geom_w[0], lift(geom_h[0], geom_h[1], geom_h[2], KH),
            lift(geom_w[0], geom_w[1], geom_w[2], KW))


def _dividing_block(block, C, phased):
    """A channel block of a phase view divides its C (a box past C would reach the next phase's
    channels); ``block`` itself otherwise."""
    while phased and C % block:
        block //= 2
    return block



def _spatial_tile(block_m, OH, OW):
    """(TH, TW) with TH * TW = ``block_m``, TW a power of two: the one that wastes the fewest
    positions at the image's edges (the larger TW on a tie)."""
    best = None
    tw = min(block_m, _pow2(OW))
    while tw >= 1:
        th = block_m // tw
        waste = cdiv(OH, th) * th * cdiv(OW, tw) * tw
        if best is None or waste < best[0]:
            best = (waste, th, tw)
        tw //= 2
    return best[1], best[2]


_FOLD_COLUMNS = 64  # (tap, channel) columns the pointer kernels fold into one K block or column tile, at most


def _fold_shape(C, taps):
    """``_conv_fold_kernel``'s K block as TAPS_P2 taps x C_P2 channels (powers of two, K >= 16 for tl.dot)."""
    taps_p2 = _pow2(taps)
    return dict(TAPS_P2=taps_p2, C_P2=max(_pow2(C), 16 // taps_p2))


def folds(C, taps):
    """``_conv_fold_kernel``'s K block (``_fold_shape``) for a forward or unit-stride input gradient
    with C reduction channels per tap and ``taps`` taps (one group) when that block is at most
    _FOLD_COLUMNS wide, else None (the implicit GEMM takes it)."""
    shape = _fold_shape(C, taps)
    return shape if shape["TAPS_P2"] * shape["C_P2"] <= _FOLD_COLUMNS else None


def _wgrad_splits(programs, units):
    """How many splits of its ``units`` reduction steps the weight gradient's grid of ``programs``
    programs runs: enough for about 2 programs per SM, each split at least 4 steps (1 in the
    interpreter)."""
    if runtime.INTERPRETER or programs >= 2 * runtime.num_sms():
        return 1
    return max(1, min(cdiv(2 * runtime.num_sms(), programs), cdiv(units, 4), 256))


def _wgrad_spatial_tile(block_k, OH, OW, dy_rows):
    """(TH, TW, FLAT_DY) of the TMA weight gradient's spatial tiles (see ``_conv_wgrad_tma_kernel``).
    With dY viewable as a (pixels, CO) matrix (``dy_rows``): TH whole rows when a power-of-two
    row fits ``block_k`` times TH and TH divides OH, else segments of ``block_k`` pixels when they
    tile each row exactly; both are FLAT_DY tiles that never cross into the next row or image.
    Otherwise one row cut to ``block_k`` (at least 16 pixels, the last tile of a row partly empty)."""
    tw = min(block_k, max(16, _pow2(OW)))
    if dy_rows and _pow2(OW) == OW and block_k > OW and OH % (block_k // OW) == 0:
        return block_k // OW, OW, True
    return 1, tw, dy_rows and OW % tw == 0


def _conv_tma_config(M, N, C, dtype, taps, kernel):
    """Launch config of the TMA conv kernel (tuning-table kernel "conv2d_tma"/"conv2d_dgrad_tma")."""
    return SPECS[kernel + "_tma"].config((M, N, C, taps), dtype)


_SPLIT_COST = 4  # loop steps: see _wave_splits


def _wave_splits(programs, steps, sms):
    """How many splits of its reduction loop (``steps`` steps) a grid of ``programs`` programs
    should run on ``sms`` SMs. 1 from one wave up; below one wave, the s in 1..8 (each split at
    least 4 steps) with the shortest estimated time ceil(programs * s / sms) * (steps / s + cost),
    the cost of a split being 0 unsplit, else ``_SPLIT_COST`` steps: its fp32 tile written to the
    scratch and read back by the sum, 2 * 4 * 128 * 128 bytes, the operand bytes of 4 steps of a
    128x128x64 tile ((128 + 128) * 64 * 2). Ties go to the smaller s. SDXL's 32x32 convolutions at
    1280 channels (80 tiles of 128x128, 180 steps) on 132 SMs: 3 splits, 240 programs in 2 waves
    (waves alone, with no cost, would pick 8: 640 programs in 5 waves, 8/3 the scratch traffic)."""
    if programs >= sms:
        return 1

    def time(s):
        return cdiv(programs * s, sms) * (steps / s + (_SPLIT_COST if s > 1 else 0))

    return min(range(1, max(1, min(8, steps // 4)) + 1), key=time)  # min keeps the first (smallest) on a tie


# ---- running a route ----------------------------------------------------------------------------

def _row_stride(t):
    """The row stride of a 4-D (N, C, H, W) buffer (or ``Operand``) seen as an (N*H*W, C) matrix,
    or None when the (N, H, W) dims do not collapse to one stride (NCHW with N > 1). A single row
    keeps the batch stride."""
    n, _, h, w = t.shape
    s = t.stride()
    shape, (rs,) = collapse([n, h, w], [[s[0], s[2], s[3]]])
    if len(shape) != 1:
        return None
    return rs[0] if shape[0] > 1 else s[0]


def as_rows(t):
    """A 4-D (N, C, H, W) buffer as an (N*H*W, C) strided view, or None (see ``_row_stride``)."""
    rs = _row_stride(t)
    if rs is None:
        return None
    n, c, h, w = t.shape
    return t.as_strided((n * h * w, c), (rs, t.stride(1)), t.storage_offset())


def _gemm_views(w, *acts):
    """``w`` as a (Co, Ci) matrix, then each activation buffer of ``acts`` as an (N*H*W, C) matrix
    (the "gemm" route: ``_gemm_route`` checked that they are views)."""
    ws = w.stride()
    return (w.as_strided(tuple(w.shape[:2]), ws[:2], w.storage_offset()), *map(as_rows, acts))


def _run_conv(route, p, out, src, w, bias):
    """Run the forward or input-gradient route ``route`` of problem ``p`` (see ``_conv_gemm_kernel``):
    ``out`` (NB, N, OH, OW) and ``src`` (NB, C, XH, XW) are 4-D buffers with any strides; ``w`` is
    (Co, Ci, KH, KW): read as (k=ci, n=co) for the forward and (k=co, n=ci) for the input gradient.
    With groups the channels of ``src`` and ``out`` (and the rows of ``w``) split into that many
    independent problems, one per program-grid row."""
    if route.kernel == "none":
        return out
    _, _, geom_h, geom_w = _geometry(p)
    transposed = p.direction == INPUT_GRAD
    if route.kernel == "tma":
        return _conv_tma_(out, src, w, bias, geom_h, geom_w, transposed, route)
    if route.kernel == "gluon":
        return _conv_gluon_(out, src, w, bias, geom_h, geom_w, transposed, route)
    groups = p.groups
    NB, N, OH, OW = out.shape[0], out.shape[1] // groups, out.shape[2], out.shape[3]
    C, XH, XW = src.shape[1] // groups, src.shape[2], src.shape[3]
    KH, KW = w.shape[2], w.shape[3]
    P_h, P_w = geom_h[3], geom_w[3]
    M = NB * cdiv(OH, P_h) * cdiv(OW, P_w)
    ws = w.stride()
    sw_k, sw_n = (ws[0], ws[1]) if transposed else (ws[1], ws[0])
    acc, precision, upcast = _kernel_switches(src.dtype)
    bias_buf, s_bias = (out, 0) if bias is None else (bias, bias.stride(0))
    src_s, out_s = _nhwc(src), _nhwc(out)
    cfg = route.config
    if route.kernel == "fold":
        launch(_conv_fold_kernel, (cdiv(M, cfg["BLOCK_M"]),), src, w, out, bias_buf,
               M, OH, OW, C, N, KH * KW, KW, XH, XW, *geom_h[:3], *geom_w[:3],
               *src_s, sw_k, sw_n, ws[2], ws[3], *out_s, s_bias,
               ACC=acc, PRECISION=precision, UPCAST=upcast, BIAS=bias is not None, **cfg)
        return out
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), groups, P_h * P_w)
    launch(_conv_gemm_kernel, grid, src, w, out, bias_buf,
           M, OH, OW, C, N, KH, KW, XH, XW, *geom_h, *geom_w,
           *src_s, sw_k, sw_n, ws[2], ws[3], *out_s, s_bias,
           C * src_s[3], (C if transposed else N) * ws[0], N * out_s[3], P_h, P_w,
           ACC=acc, PRECISION=precision, UPCAST=upcast, BIAS=bias is not None, DIV=P_h * P_w != 1, GROUP_M=8,
           **cfg)
    return out


class _TmaLaunch(NamedTuple):
    """What a "tma" route keeps from its first launch (all of it fixed by its problem): the kernel's
    ``launch.Plan`` (the bias stride free), grid, the size arguments before the bias stride and the
    reduction steps per split after it, the descriptor templates of the source, weight and target
    (``launch.descriptor_template``), and with split-K the fp32 target's shape and the output's
    (rows, channels) strides that the sum pass writes."""

    plan: Plan
    grid: tuple
    args: tuple
    steps: int
    templates: tuple
    target_shape: tuple
    rows_strides: tuple


def _conv_tma_(out, src, w, bias, geom_h, geom_w, transposed, route):
    kept = route.kept.get("tma")
    if kept is None:
        kept = route.kept["tma"] = _tma_launch(out, src, w, bias, geom_h, geom_w, transposed, route)
    t_src, t_w, t_target = kept.templates
    split = route.splits > 1
    target = runtime.empty(kept.target_shape, torch.float32) if split else out
    # the problem's buffers are 16-byte aligned (the route's condition) and the scratch is fresh: no check
    launch_via(launch, kept.plan, kept.grid,
               (descriptor_like(t_src, src), descriptor_like(t_w, w), descriptor_like(t_target, target),
                out if bias is None else bias, *kept.args, 0 if bias is None else bias.stride(0), kept.steps))
    if split:
        KM.split_k_sum_(out, kept.rows_strides, target, KM.Fusion(bias))
    return out


def _conv_gluon_(out, src, w, bias, geom_h, geom_w, transposed, route):
    def describe(box_h):
        NB, N, OH, OW = out.shape
        C, XH, XW = src.shape[1], src.shape[2], src.shape[3]
        KH, KW = w.shape[2], w.shape[3]
        conv = KM.matmul_hopper.Conv(NB, XH, XW, C, _nhwc(src)[:3], OH, OW, KH, KW, geom_h[1], geom_h[2], geom_w[1],
                                     geom_w[2], box_h)
        # A read along K (its pixel boxes), the weight as a (Co, taps * Ci) matrix: (n=co, k=ci) blocks
        # read along K for the forward, (k=co, n=ci) blocks for the input gradient
        return conv, (NB * OH * OW, N, KH * KW * C), (True, not transposed, 0, w.stride(0), _row_stride(out))

    return _run_gluon(route, describe, out, src, w, KM.Fusion(bias))


def _wgrad_gluon_(route, p, dw_out, dy, x):
    def describe(box_h):
        (NB, CO, OH, OW), (CI, XH, XW), (KH, KW) = dy.shape, x.shape[1:], dw_out.shape[2:]
        (ph, pw), (dh, dwl) = p.padding, p.dilation
        conv = KM.matmul_hopper.Conv(NB, XH, XW, CI, _nhwc(x)[:3], OH, OW, KH, KW, -ph, dh, -pw, dwl, box_h,
                                     weight_grad=True)
        # A: dY as (pixels, Co) blocks, read transposed; B: x's pixel boxes; C: dW as a (Co, taps * Ci) matrix
        return conv, (CO, KH * KW * CI, NB * OH * OW), (False, False, _row_stride(dy), 0, dw_out.stride(0))

    return _run_gluon(route, describe, dw_out, dy, x, KM.Fusion())


def _run_gluon(route, describe, out, a, b, fusion):
    """``matmul_hopper.matmul`` over a Gluon route's implicit GEMM: ``describe(box_h)`` gives its
    (``Conv``, (M, N, K), layout) at the route's first launch, kept with the route and the launch config."""
    kept = route.kept.get("gluon")
    if kept is None:
        cfg = dict(route.config)
        kept = route.kept["gluon"] = (*describe(cfg.pop("BOX_H")), cfg)
    conv, (M, N, K), layout, cfg = kept
    return KM.matmul_hopper.matmul(out, a, b, M, N, K, fusion, layout, cfg, conv=conv)


def _tma_launch(out, src, w, bias, geom_h, geom_w, transposed, route):
    """The ``_TmaLaunch`` of a "tma" route, from its first launch's buffers."""
    NB, N, OH, OW = out.shape
    C, XH, XW = src.shape[1], src.shape[2], src.shape[3]
    KH, KW = w.shape[2], w.shape[3]
    phased, divided = (geom_h[0], geom_w[0]) != (1, 1), (geom_h[3], geom_w[3]) != (1, 1)
    D_h, D_w = geom_h[3], geom_w[3]
    cfg, splits = route.config, route.splits
    th, tw, bn, bk = cfg["TH"], cfg["TW"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles, steps = _tma_work(NB, OH, OW, N, C, KH, KW, D_h, D_w, cfg)
    if splits > 1:  # fp32 partial sums of out's pixels, channels last, split-major
        target_shape, target_s = (splits, NB * OH * OW, N), (OH * OW * N, OW * N, N)
        target = runtime.empty((0,), torch.float32)  # the dtype the target's template is made for
        rows_strides = (_row_stride(out), out.stride(1))  # the sum pass writes ``out`` as (NB*OH*OW, N) rows
    else:
        target_shape, target_s, target, rows_strides = (), _nhwc(out)[:3], out, ()
    src_box = _pixel_box(NB, XH, XW, C, *_nhwc(src)[:3], geom_h[0], geom_w[0], th, tw, bk, phased)
    target_box = _pixel_box(splits * NB, OH, OW, N, *target_s, D_h, D_w, th, tw, bn, divided)
    # the weight (channels-last, taps and channels dense) as a (Co, taps * Ci) matrix: (k=co, n=ci) tiles for
    # the input gradient, (n=co, k=ci) tiles for the forward
    w_box = (([C, KH * KW * N], [w.stride(0), 1], [bk, bn]) if transposed
             else ([N, KH * KW * C], [w.stride(0), 1], [bn, bk]))
    templates = tuple(descriptor_template(t, *box) for t, box in ((src, src_box), (w, w_box), (target, target_box)))
    args = (NB, C, OH, OW, N, KH, KW, geom_h[1], geom_h[2], geom_w[1], geom_w[2], *_phase_args(geom_h, geom_w, KH, KW),
            D_h, D_w)
    meta = dict(TRANSPOSED=transposed, BIAS=bias is not None and splits == 1, PHASED=phased, DIVIDED=divided,
                GROUP_M=8, **cfg)
    plan = Plan(_conv_tma_kernel, meta, by_value=(4 + len(args),))  # 4 buffers, the sizes, then the bias stride
    return _TmaLaunch(plan, (tiles, D_h * D_w, splits), args, cdiv(steps, splits), templates, target_shape,
                      rows_strides)


def _run_wgrad(route, p, dw_out, dy, x):
    """Run the weight-gradient route ``route`` of problem ``p``. With "wgrad_swap" (few output
    channels at stride 1, conv_out's 4) the operands' roles are swapped: dW[co, ci, kh, kw] =
    sum_q x[q, ci] * dY[q - ph' + (KH-1-kh) * dh, co] with ph' = (KH-1) * dh - ph, q over x's pixels,
    the weight gradient of a convolution of dY by "dY" = x, stored transposed and tap-flipped, whose
    few "input" channels then fold with the taps."""
    if route.kernel == "none":
        return dw_out
    if route.kernel == "zero_fill":
        return fill_(dw_out, 0.0)
    if route.kernel == "gluon_wgrad":
        return _wgrad_gluon_(route, p, dw_out, dy, x)
    KH, KW = dw_out.shape[2], dw_out.shape[3]
    NB, groups, taps = dy.shape[0], p.groups, KH * KW
    (sh, sw), (dh, dwl) = p.stride, p.dilation
    _, _, CO, CI, OH, OW, H, W, ph, pw, swap = _wgrad_geometry(p)
    if swap:
        dy, x = x, dy
    cfg, splits = route.config, route.splits
    fold = cfg.get("FOLD_TAPS", False)
    units, per_unit = _wgrad_units(p, cfg, NB, OH, OW)
    per_split = cdiv(units, splits)
    tiles = cdiv(CO, cfg["BLOCK_M"]) * (1 if fold else cdiv(CI, cfg["BLOCK_N"]))
    order = runtime.dense_order(dw_out)  # channels-last weights: ci innermost, so tile stores are contiguous
    if splits == 1:
        target_buf, so = dw_out, (0,) + tuple(dw_out.stride())
    else:  # fp32 partial gradients laid out as dw_out (or contiguous), summed below as flat slabs
        perm = order or (0, 1, 2, 3)
        slab = runtime.empty((splits, *(dw_out.shape[d] for d in perm)), acc_dtype(x.dtype))
        target_buf = slab.permute(0, *(1 + perm.index(d) for d in range(4)))
        so = target_buf.stride()
    out_base = target_buf
    if swap:  # store (co', ci') = (ci, co) at tap (KH-1-kh, KW-1-kw): from the last tap, strides negated
        out_base = target_buf[..., KH - 1:, KW - 1:]
        so = (so[0], so[2], so[1], -so[3], -so[4])
    grid = (tiles * groups, 1 if fold else taps, splits)
    if route.kernel == "wgrad_tma":
        th, tw, bm, bn = cfg["TH"], cfg["TW"], cfg["BLOCK_M"], cfg["BLOCK_N"]
        phased = (sh, sw) != (1, 1)
        dy_desc = (descriptor(dy, [NB * OH * OW, CO], [_row_stride(dy), 1], [th * tw, bm]) if cfg["FLAT_DY"]
                   else descriptor(dy, [NB, OH, OW, CO], [*_nhwc(dy)[:3], 1], [1, th, tw, bm]))
        x_desc = descriptor(x, *_pixel_box(NB, H, W, CI, *_nhwc(x)[:3], sh, sw, th, tw, bn, phased))
        launch(_conv_wgrad_tma_kernel, grid, dy_desc, x_desc, target_buf, NB, OH, OW, CO, CI, KW, -ph, dh, -pw, dwl,
               *_phase_args((sh, -ph, dh), (sw, -pw, dwl), KH, KW), per_split, *so, PHASED=phased, **cfg)
    else:
        acc, precision, upcast = _kernel_switches(x.dtype)
        launch(_conv_wgrad_kernel, grid, dy, x, out_base,
               NB * OH * OW, OH, OW, CO, CI, KW, taps, H, W, sh, ph, dh, sw, pw, dwl, per_split * per_unit, tiles,
               *_nhwc(dy), *_nhwc(x), *so, ACC=acc, PRECISION=precision, UPCAST=upcast, **cfg)
    if splits > 1:
        n = dw_out.numel()
        if order is not None:
            reduce_(dw_out, target_buf, 1, splits, n, (0, n, 1), SUM)
        else:
            tmp = runtime.empty(tuple(dw_out.shape), dw_out.dtype)
            reduce_(tmp, target_buf, 1, splits, n, (0, n, 1), SUM)
            copy_(dw_out, tmp)
    return dw_out


@tunable("out")
def conv2d_forward_(out, x, w, bias, stride, padding, dilation, groups=1):
    """``out`` (NB, Co, Ho, Wo) = conv2d(x, w, bias); ``padding`` is the (top, left) padding."""
    p, route = _planned(FORWARD, x, w, out, stride, padding, dilation, groups, bias)
    if route.kernel == "gemm":  # out (NHW, Co) = x (NHW, Ci) @ w (Co, Ci)^T + bias
        w2, out2, x2 = _gemm_views(w, out, x)
        linear_(out2, x2, w2, bias)
        return out
    return _run_conv(route, p, out, x, w, bias)


@tunable("dx")
def conv2d_input_grad_(dx, dy, w, stride, padding, dilation, groups=1):
    """``dx`` (NB, Ci, H, W) = the gradient of conv2d's input from ``dy`` (NB, Co, Ho, Wo)."""
    p, route = _planned(INPUT_GRAD, dx, w, dy, stride, padding, dilation, groups)
    if route.kernel == "gemm":  # dx (NHW, Ci) = dy (NHW, Co) @ w (Co, Ci)
        w2, dx2, dy2 = _gemm_views(w, dx, dy)
        matmul_(dx2, dy2, w2)
        return dx
    return _run_conv(route, p, dx, dy, w, None)


@tunable("dw_out")
def conv2d_weight_grad_(dw_out, dy, x, stride, padding, dilation, groups=1):
    """``dw_out`` (Co, Ci/groups, KH, KW) = the gradient of conv2d's weight (any strides, any
    float dtype)."""
    p, route = _planned(WEIGHT_GRAD, x, dw_out, dy, stride, padding, dilation, groups)
    if route.kernel == "gemm":  # dw (Co, Ci) = dy (NHW, Co)^T @ x (NHW, Ci)
        dw2, dy2, x2 = _gemm_views(dw_out, dy, x)
        matmul_(dw2, dy2.t(), x2)
        return dw_out
    return _run_wgrad(route, p, dw_out, dy, x)


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32
