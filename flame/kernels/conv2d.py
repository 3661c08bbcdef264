"""2-D convolution as implicit GEMM over channels-last data (no im2col buffer).

Two kernels:

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
- ``_conv_wgrad_kernel``: the weight gradient, a GEMM over the N*Ho*Wo rows per tap:
    dW[co, ci, kh, kw] = sum_{n, oh, ow} dY[n, oh, ow, co] * x[n, oh*s - p + kh*d, ow*s - p + kw*d, ci]
  one program per (co tile, ci tile, tap, split of the rows), fp32 (fp64) accumulation; with
  more than one split the partial sums go to an fp32 scratch (split, Co, Ci, KH, KW) reduced by
  the reduction kernel (deterministic, no atomics).

All tensors are read through (n, h, w, c) strides, so NCHW-contiguous and channels-last inputs
(and any other strided view) work alike; channels-last is the fast layout.

A 1x1 convolution with stride 1, no padding and one group is a plain GEMM over the (N*H*W, C)
matrices of its activations: when those are strided views of the buffers (``_gemm_views``), all
three functions call the GEMM kernel (``flame.kernels.matmul``) instead, with no im2col indexing.
"""
import torch
import triton
import triton.language as tl

from .. import runtime, tune
from .elementwise import _pow2, cdiv, collapse
from .launch import launch
from .matmul import _kernel_switches, linear_, matmul_
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


# dW[co, ci, kh, kw] = sum_{n, oh, ow} dY[n, oh, ow, co] * x[n, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw, ci]
# (x is zero outside [0, H) x [0, W): padding contributes nothing). Rows r = (n, oh, ow) are
# the GEMM's reduction axis; program (tile, tap, split) reduces rows [split * RPS, (split+1) * RPS).
@triton.jit
def _conv_wgrad_kernel(dy_ptr, x_ptr, out_ptr,
                       M, OH, OW, CO, CI, KW, H, W, sh, ph, dh, sw, pw, dw, rows_per_split, tiles,
                       sy_n, sy_h, sy_w, sy_c, sx_n, sx_h, sx_w, sx_c,
                       so_s, so_co, so_ci, so_h, so_w,
                       ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # CO and CI are per group; program 0's axis is (group, co tile, ci tile), group-major
    pid = tl.program_id(0) % tiles
    grp = (tl.program_id(0) // tiles).to(tl.int64)
    tap = tl.program_id(1)
    split = tl.program_id(2)
    dy_ptr += grp * CO * sy_c
    x_ptr += grp * CI * sx_c
    out_ptr += grp * CO * so_co
    num_pid_n = tl.cdiv(CI, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    kh = tap // KW
    kw = tap % KW

    offs_co = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_ci = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
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
        ih = oh * sh - ph + kh * dh
        iw = ow * sw - pw + kw * dw
        ok = mask_r & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        ih = tl.where(ok, ih, 0)
        iw = tl.where(ok, iw, 0)
        y_rows = dy_ptr + n_idx * sy_n + oh * sy_h + ow * sy_w
        x_rows = x_ptr + n_idx * sx_n + ih * sx_h + iw * sx_w
        a = tl.load(y_rows[None, :] + offs_co[:, None] * sy_c,
                    mask=mask_co[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(x_rows[:, None] + offs_ci[None, :] * sx_c,
                    mask=ok[:, None] & mask_ci[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)

    o_ptrs = (out_ptr + split.to(tl.int64) * so_s + kh.to(tl.int64) * so_h + kw.to(tl.int64) * so_w
              + offs_co[:, None] * so_co + offs_ci[None, :] * so_ci)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_co[:, None] & mask_ci[None, :])


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


def _gemm_config(M, N, K, dtype, taps=1, kernel="conv2d"):
    """Tile config for the implicit GEMM (M rows, N columns, K channels per tap, ``taps`` =
    KH * KW). On the GPU a tuning-table entry (``flame.tune``, ``kernel`` "conv2d" or
    "conv2d_dgrad", key (M, N, K, taps)) wins; else a heuristic, not yet measured on a GPU: the
    matmul kernel's H200 choices (128x128, BLOCK_K 64 for 16-bit, 32 for tf32), shrunk to the
    problem."""
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
    default = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return tune.config(kernel, (M, N, K, taps), dtype, default)


def _nhwc(t):
    """(n, h, w, c) strides of a 4-D (N, C, H, W) buffer."""
    s = t.stride()
    return s[0], s[2], s[3], s[1]


def conv_gemm_(out, src, w, bias, OH, OW, geom_h, geom_w, transposed, groups=1):
    """One implicit-GEMM launch (see ``_conv_gemm_kernel``).

    ``out`` (NB, N, OH, OW) and ``src`` (NB, C, XH, XW) are 4-D buffers with any strides;
    ``w`` is (Co, Ci, KH, KW): read as (k=ci, n=co) for the forward and (k=co, n=ci) when
    ``transposed``. ``geom_*`` = (A, B, C, D) of the source-position formula. With ``groups``
    the channels of ``src`` and ``out`` (and the rows of ``w``) split into that many independent
    problems, one per program-grid row."""
    NB, N = out.shape[0], out.shape[1] // groups
    C, XH, XW = src.shape[1] // groups, src.shape[2], src.shape[3]
    KH, KW = w.shape[2], w.shape[3]
    # with a divisor D > 1 (the input gradient of a strided conv) the rows split into D_h * D_w
    # phases, each of which only meets the taps whose offset it divides: no work on masked taps
    P_h, P_w = geom_h[3], geom_w[3]
    M = NB * cdiv(OH, P_h) * cdiv(OW, P_w)
    if out.numel() == 0:
        return out
    ws = w.stride()
    sw_k, sw_n = (ws[0], ws[1]) if transposed else (ws[1], ws[0])
    cfg = _gemm_config(M, N, C, src.dtype, KH * KW, "conv2d_dgrad" if transposed else "conv2d")
    acc, precision, upcast = _kernel_switches(src.dtype)
    div = geom_h[3] != 1 or geom_w[3] != 1
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), groups, P_h * P_w)
    src_s, out_s = _nhwc(src), _nhwc(out)
    launch(_conv_gemm_kernel, grid, src, w, out, out if bias is None else bias,
           M, OH, OW, C, N, KH, KW, XH, XW, *geom_h, *geom_w,
           *src_s, sw_k, sw_n, ws[2], ws[3], *out_s, 0 if bias is None else bias.stride(0),
           C * src_s[3], (C if transposed else N) * ws[0], N * out_s[3], P_h, P_w,
           ACC=acc, PRECISION=precision, UPCAST=upcast, BIAS=bias is not None, DIV=div, GROUP_M=8, **cfg)
    return out


def _rows(t):
    """A 4-D (N, C, H, W) buffer as an (N*H*W, C) strided view, or None when the (N, H, W) dims
    do not collapse to one row stride (NCHW with N > 1). A single row keeps the batch stride."""
    n, c, h, w = t.shape
    s = t.stride()
    shape, (rs,) = collapse([n, h, w], [[s[0], s[2], s[3]]])
    if len(shape) != 1:
        return None
    return t.as_strided((n * h * w, c), (rs[0] if shape[0] > 1 else s[0], s[1]), t.storage_offset())


def _gemm_views(w, stride, padding, groups, *acts):
    """(``w`` as a (Co, Ci) matrix, then each activation buffer of ``acts`` as an (N*H*W, C)
    matrix) when the convolution is a plain GEMM: 1x1 kernel, stride 1, no padding (dilation
    does not matter), one group, and every activation viewable as a matrix without a copy.
    None otherwise (the implicit-GEMM kernels take it)."""
    if tuple(w.shape[2:]) != (1, 1) or tuple(stride) != (1, 1) or tuple(padding) != (0, 0) or groups != 1:
        return None
    mats = [_rows(t) for t in acts]
    if any(m is None for m in mats):
        return None
    ws = w.stride()
    return (w.as_strided(tuple(w.shape[:2]), ws[:2], w.storage_offset()), *mats)


def conv2d_forward_(out, x, w, bias, stride, padding, dilation, groups=1):
    """``out`` (NB, Co, Ho, Wo) = conv2d(x, w, bias); ``padding`` is the (top, left) padding."""
    views = _gemm_views(w, stride, padding, groups, out, x)
    if views is not None:  # out (NHW, Co) = x (NHW, Ci) @ w (Co, Ci)^T + bias
        w2, out2, x2 = views
        linear_(out2, x2, w2, bias)
        return out
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    return conv_gemm_(out, x, w, bias, out.shape[2], out.shape[3], (sh, -ph, dh, 1), (sw, -pw, dw, 1), False,
                      groups)


def conv2d_input_grad_(dx, dy, w, stride, padding, dilation, groups=1):
    """``dx`` (NB, Ci, H, W) = the gradient of conv2d's input from ``dy`` (NB, Co, Ho, Wo)."""
    views = _gemm_views(w, stride, padding, groups, dx, dy)
    if views is not None:  # dx (NHW, Ci) = dy (NHW, Co) @ w (Co, Ci)
        w2, dx2, dy2 = views
        matmul_(dx2, dy2, w2)
        return dx
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    return conv_gemm_(dx, dy, w, None, dx.shape[2], dx.shape[3], (1, ph, -dh, sh), (1, pw, -dw, sw), True,
                      groups)


def conv2d_weight_grad_(dw_out, dy, x, stride, padding, dilation, groups=1):
    """``dw_out`` (Co, Ci/groups, KH, KW) = the gradient of conv2d's weight (any strides, any
    float dtype)."""
    views = _gemm_views(dw_out, stride, padding, groups, dy, x)
    if views is not None:  # dw (Co, Ci) = dy (NHW, Co)^T @ x (NHW, Ci)
        dw2, dy2, x2 = views
        matmul_(dw2, dy2.t(), x2)
        return dw_out
    CO, CI, KH, KW = dw_out.shape
    CO //= groups
    NB, _, OH, OW = dy.shape
    H, W = x.shape[2], x.shape[3]
    M = NB * OH * OW
    if dw_out.numel() == 0:
        return dw_out
    acc, precision, upcast = _kernel_switches(x.dtype)
    if runtime.INTERPRETER:
        bm, bn, bk, warps, stages = _pow2(min(CO, 128)), _pow2(min(CI, 128)), _pow2(min(M, 512)), 4, 1
    else:
        bm, bn, bk, warps, stages = _gpu_tiles(x.dtype, CO, CI, M)
    tiles = cdiv(CO, bm) * cdiv(CI, bn)
    programs = tiles * groups * KH * KW
    splits = 1
    if not runtime.INTERPRETER:  # split the N*Ho*Wo reduction until the GPU has ~2 programs per SM
        target = 2 * runtime.num_sms()
        if programs < target:
            splits = max(1, min(cdiv(target, programs), cdiv(M, 4 * bk), 256))
    rows_per_split = cdiv(cdiv(M, splits), bk) * bk
    splits = cdiv(M, rows_per_split) if M else 1
    if M == 0:
        from .elementwise import fill_
        return fill_(dw_out, 0.0)
    if splits == 1:
        target_buf, so = dw_out, (0,) + tuple(dw_out.stride())
    else:
        target_buf = runtime.empty((splits, CO * groups, CI, KH, KW), acc_dtype(x.dtype))
        so = target_buf.stride()
    (sh, sw), (ph, pw), (dh, dwl) = stride, padding, dilation
    launch(_conv_wgrad_kernel, (tiles * groups, KH * KW, splits), dy, x, target_buf,
           M, OH, OW, CO, CI, KW, H, W, sh, ph, dh, sw, pw, dwl, rows_per_split, tiles,
           *_nhwc(dy), *_nhwc(x), *so,
           ACC=acc, PRECISION=precision, UPCAST=upcast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           num_warps=warps, num_stages=stages)
    if splits > 1:
        n = dw_out.numel()
        if dw_out.is_contiguous():
            reduce_(dw_out, target_buf, 1, splits, n, (0, n, 1), SUM)
        else:
            tmp = runtime.empty(tuple(dw_out.shape), dw_out.dtype)
            reduce_(tmp, target_buf, 1, splits, n, (0, n, 1), SUM)
            from .elementwise import copy_
            copy_(dw_out, tmp)
    return dw_out


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32
