"""DoRA (Liu et al. 2024, "DoRA: weight-decomposed low-rank adaptation", as PEFT's ``use_dora``
builds it): the two pieces of work a DoRA layer adds to LoRA's GEMMs.

A DoRA layer outputs ``y = c * z + b`` with ``z = x W^T + s (x A^T) B^T`` (LoRA without the bias)
and a per-output-channel scale ``c = m / n``, ``n[o] = ||W[o, :] + s B[o, :] A||_2`` over the
layer's flattened input axis (in, or in * kh * kw for a conv) and ``m`` the trained magnitude.
``n`` is a constant of the step (PEFT detaches it): no gradient flows through it.

- ``adapted_norms_``: ``n`` (and ``c`` given ``m``) in one launch, without materializing
  ``W + s B A``: each program holds a block of B's rows and walks K, forming a
  (rows x BLOCK_K) tile of ``s B A`` with one small ``tl.dot`` (fp32 accuracy), adding the
  tile of W (any dtype, any dense layout) and summing squares.
- ``scale_grad_``: the backward of ``y = c * z + b`` with respect to z and m:
  ``dz = g * c`` and ``dm[o] = (sum_i g[i, o] z[i, o]) / n[o]``, in two launches: one pass over
  (g, z) writes dz and each program's partial column sums, a second sums the partials in program
  order (no atomics: bit-for-bit repeatable) and divides by n.
"""
import torch
import triton
import triton.language as tl

from .. import runtime
from .elementwise import MUL, _pow2, cdiv, copy_, map_
from .launch import launch
from .reduce import accumulation_dtype


@triton.jit
def _adapted_norms_kernel(w_ptr, a_ptr, b_ptr, m_ptr, norm_ptr, ratio_ptr, N, K, R, S, sw0, sw1, sw2, sa0, sb0,
                          scale, RATIO: tl.constexpr, PRECISION: tl.constexpr, BLOCK_O: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # W is read as (N, C, S) with strides (sw0, sw1, sw2), K = C * S: a Linear's (N, K) has S = 1,
    # a conv weight's (N, C, kh, kw) in either memory layout has its kernel window merged into S.
    # A (R, K) and B (N, R) are row-major with row strides sa0, sb0; rows of B past R load as 0.
    offs_o = tl.program_id(0).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc_t = norm_ptr.dtype.element_ty
    b = tl.load(b_ptr + offs_o[:, None] * sb0 + offs_r[None, :], mask=mask_o[:, None] & mask_r[None, :], other=0.0)
    b = b.to(acc_t) * scale
    sq = tl.zeros((BLOCK_O,), acc_t)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_r[:, None] * sa0 + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                    other=0.0).to(acc_t)
        w_off = offs_o[:, None] * sw0 + ((offs_k // S) * sw1 + (offs_k % S) * sw2)[None, :]
        w = tl.load(w_ptr + w_off, mask=mask_o[:, None] & mask_k[None, :], other=0.0).to(acc_t)
        v = w + tl.dot(b, a, input_precision=PRECISION, out_dtype=acc_t)
        sq += tl.sum(v * v, axis=1)
    norm = tl.sqrt(sq)
    tl.store(norm_ptr + offs_o, norm, mask=mask_o)
    if RATIO:
        m = tl.load(m_ptr + offs_o, mask=mask_o, other=0.0).to(acc_t)
        tl.store(ratio_ptr + offs_o, (m / tl.where(mask_o, norm, 1.0)).to(ratio_ptr.dtype.element_ty), mask=mask_o)


def adapted_norms_(norm, weight, lora_a, lora_b, scale, magnitude=None, ratio=None):
    """``norm[o] = ||W[o] + scale * B[o] @ A||_2`` over the flattened input axis, and with
    ``magnitude`` (N,) also ``ratio[o] = magnitude[o] / norm[o]``. ``weight`` (N, K) or
    (N, C, kh, kw) in any dense layout and dtype; ``lora_a`` (r, K) or (r, C, kh, kw) and
    ``lora_b`` (N, r) or (N, r, 1, 1), contiguous; ``norm``/``ratio`` (N,) in the accumulation
    dtype (fp64 when any operand is fp64, else fp32). Returns ``norm``."""
    n = weight.shape[0]
    w = weight if weight.ndim == 2 else weight.reshape(n, weight.shape[1], -1) if _window_merges(weight) else None
    if w is None:  # a 4-D layout whose kernel window is not one stride: read a contiguous copy
        w = runtime.empty(weight.shape, weight.dtype)
        copy_(w, weight)
        w = w.view(n, weight.shape[1], -1)
    if w.ndim == 2:
        k, s, (sw0, sw1), sw2 = w.shape[1], 1, w.stride(), 0
    else:
        k, s, (sw0, sw1, sw2) = w.shape[1] * w.shape[2], w.shape[2], w.stride()
    a = lora_a.reshape(lora_a.shape[0], -1)
    b = lora_b.reshape(n, -1)
    r = a.shape[0]
    if a.shape[1] != k or b.shape[1] != r or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"adapted_norms_: weight {tuple(weight.shape)}, lora_a {tuple(lora_a.shape)} and lora_b "
                         f"{tuple(lora_b.shape)} don't form W + B A (A and B row-major)")
    cfg = _norms_config(n, k, r, norm.dtype)
    launch(_adapted_norms_kernel, (cdiv(n, cfg["BLOCK_O"]),), w, a, b, norm if magnitude is None else magnitude, norm,
           norm if ratio is None else ratio, n, k, r, s, sw0, sw1, sw2, a.stride(0), b.stride(0), float(scale),
           RATIO=ratio is not None, **cfg)
    return norm


def _norms_config(n, k, r, dtype):
    """Blocks, warps, stages and the dot's precision of ``_adapted_norms_kernel``. The products
    B A are tiny (rank r) and the kernel is bound by latency: the fewest rows a tile allows (16, one
    program per 16 output channels) and K walked in long pipelined blocks. fp32 products run as three
    tf32 tensor-core products ("tf32x3", about fp32's accuracy). H200, rank 16, a bf16 W, graph
    replays, over 36 configs (rows 16/32, K blocks 64/128/256, 2-4 stages, tf32x3/ieee): 16 x 256,
    3 stages, tf32x3 was the fastest on all four SDXL attention shapes, 5.2 us (640 x 640) to 11.1 us
    (1280 x 2048), 1e-7 relative error; 32 x 64 tiles took twice as long. fp64 and the interpreter
    multiply exactly."""
    block_r = max(16, _pow2(r))
    if runtime.INTERPRETER:
        return dict(BLOCK_O=max(16, _pow2(min(n, 256))), BLOCK_K=max(16, _pow2(min(k, 1024))), BLOCK_R=block_r,
                    PRECISION="ieee")
    return dict(BLOCK_O=16, BLOCK_K=max(16, min(256, 4096 // block_r)), BLOCK_R=block_r, num_warps=4, num_stages=3,
                PRECISION="ieee" if dtype == torch.float64 else "tf32x3")


def _window_merges(weight):
    """Whether a 4-D weight's (kh, kw) dims are one stride apart (contiguous and channels-last are)."""
    return weight.shape[2] * weight.shape[3] <= 1 or weight.stride(2) == weight.shape[3] * weight.stride(3)


# dz = g * c; part[p, o] = sum over program p's rows i of g[i, o] * z[i, o] (accumulation dtype)
@triton.jit
def _scale_grad_kernel(g_ptr, z_ptr, c_ptr, dz_ptr, part_ptr, M, N, rows_per_program, sgm, sgn, szm, szn, sdm, sdn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc_t = part_ptr.dtype.element_ty
    c = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0).to(acc_t)
    acc = tl.zeros((BLOCK_N,), acc_t)
    lo = pid_m.to(tl.int64) * rows_per_program
    hi = tl.minimum(lo + rows_per_program, M)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask = (offs_m < hi)[:, None] & mask_n[None, :]
        g = tl.load(g_ptr + offs_m[:, None] * sgm + offs_n[None, :] * sgn, mask=mask, other=0.0).to(acc_t)
        z = tl.load(z_ptr + offs_m[:, None] * szm + offs_n[None, :] * szn, mask=mask, other=0.0).to(acc_t)
        tl.store(dz_ptr + offs_m[:, None] * sdm + offs_n[None, :] * sdn, (g * c[None, :]).to(dz_ptr.dtype.element_ty),
                 mask=mask)
        acc += tl.sum(g * z, axis=0)
    tl.store(part_ptr + pid_m * N + offs_n, acc, mask=mask_n)


# dm[o] = (sum_p part[p, o]) / n[o], the partials summed in program order
@triton.jit
def _magnitude_grad_kernel(part_ptr, norm_ptr, dm_ptr, programs, N, BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), part_ptr.dtype.element_ty)
    for p in range(programs):
        acc += tl.load(part_ptr + p * N + offs_n, mask=mask_n, other=0.0)
    dm = acc / tl.load(norm_ptr + offs_n, mask=mask_n, other=1.0).to(acc.dtype)
    tl.store(dm_ptr + offs_n, dm.to(dm_ptr.dtype.element_ty), mask=mask_n)


def scale_grad_(dz, dm, g, z, ratio, norm):
    """The gradients of ``y = ratio * z + b`` (``ratio = m / norm`` per column, ``norm`` a
    constant): ``dz = g * ratio`` into ``dz`` (M, N) and, when ``dm`` (N,) is given,
    ``dm = sum_rows(g * z) / norm``. ``g``, ``z``, ``dz`` are 2-D, any strides; without ``dm``,
    ``z`` is not read (None will do): dz is one elementwise pass."""
    M, N = g.shape
    if dm is None:
        return map_(dz, [g, ratio[None].expand(M, N)], MUL.value)
    if runtime.INTERPRETER:
        block_m, block_n = _pow2(min(M, 256)), _pow2(min(N, 256))
        rows = M
    else:  # about four programs per SM, each a whole number of row blocks
        block_m, block_n = 32, 128
        col_blocks = cdiv(N, block_n)
        rows = block_m * cdiv(M, block_m * max(1, 4 * runtime.num_sms() // col_blocks))
    programs = cdiv(M, rows)
    part = runtime.empty((programs, N), accumulation_dtype(ratio.dtype))
    launch(_scale_grad_kernel, (programs, cdiv(N, block_n)), g, z, ratio, dz, part, M, N, rows, *g.stride(),
           *z.stride(), *dz.stride(), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    if dm is not None:
        launch(_magnitude_grad_kernel, (cdiv(N, block_n),), part, norm, dm, programs, N, BLOCK_N=block_n,
               num_warps=4)
    return dz
