"""fp8 (e4m3fn) weights: quantisation with one scale per output channel, dequantisation, and the
bit-level encode/decode helpers the GEMMs use to read fp8 weights in their main loop.

A weight W (N, K) is stored as e4m3fn codes Q (N, K) (1 sign bit, 4 exponent bits of bias 7, 3
mantissa bits; no infinities, S.1111.111 is NaN, largest finite 448) and an fp32 scale s (N,), so
that ``W[n, k] ~ s[n] * Q[n, k]``. ``quantize_rows_`` computes ``s = absmax(W[n, :]) / 448`` (1
for an all-zero row; or s = 1 for values that are e4m3 numbers already, such as a
``*_fp8_e4m3fn.safetensors`` checkpoint's) and rounds ``W / s`` to the nearest code, ties to even,
saturating at +-448: what ``torch.Tensor.to(torch.float8_e4m3fn)`` gives for in-range values.

Both directions are integer and float32 arithmetic on the codes, not Triton's float8 casts:
- Triton's interpreter (Triton 3.9) rounds fp32 to e4m3 without carrying a rounded-up mantissa into
  the exponent (124.25 becomes 64, not 128), so ``encode_e4m3`` rounds by hand (exactly, on every
  backend);
- Triton refuses the e4m3fn type below sm_89 (Ampere: the RTX 3090 class, where fp8 storage matters
  most), so ``decode_e4m3`` builds fp16 bit patterns from the bytes: the code's exponent and
  mantissa fields moved into fp16's give ``value * 2^-8`` exactly (e4m3 subnormals land on fp16
  subnormals), and the GEMMs fold the ``2^8`` (``DECODE_FACTOR``) into the scale they multiply by.
  The fp8 buffers travel to the kernels as uint8 views. A NaN code decodes as +-480.
"""
import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from .elementwise import _pow2, cdiv, fill_
from .launch import launch

E4M3_MAX = tl.constexpr(448.0)  # the largest finite e4m3fn value
DECODE_FACTOR = tl.constexpr(256.0)  # decode_e4m3(code) = value(code) / DECODE_FACTOR


@triton.jit
def encode_e4m3(x):
    """The e4m3fn codes (uint8) of the fp32 values ``x``: round to nearest, ties to even,
    saturating at +-448. With e = max(floor(log2 |x|), -6) (-6: the smallest normal exponent, below
    which the spacing stays 2^-9), t = |x| * 2^(3 - e) lies in [0, 16) and rounds to an integer r;
    the code's magnitude is (e + 6) * 8 + r, in which r = 16 (a mantissa rounded up) carries into
    the exponent and r < 8 (e = -6) is a subnormal. Every step is exact in fp32."""
    bits = x.to(tl.int32, bitcast=True)
    mag = tl.minimum(tl.abs(x), E4M3_MAX)
    e = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    t = mag * ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e), built from its exponent bits
    whole = t.to(tl.int32)
    frac = t - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    code = (e + 6) * 8 + whole + up.to(tl.int32)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """fp16 values ``value(code) / DECODE_FACTOR`` of uint8 e4m3fn codes, exact: the sign to bit
    15, the exponent and mantissa fields (bits 6-0) to fp16's bits 13-7 (exponent bias 15 = 7 + 8)."""
    c = code.to(tl.uint16)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _codes(w, scale, inverse, EXACT: tl.constexpr, HW_CAST: tl.constexpr):
    """The e4m3fn codes (uint8) of ``w / scale`` per row: EXACT, by IEEE division (as torch's
    reference computes it), else ``w * inverse`` (the scale's reciprocal: within an ulp of the
    quotient, so a code differs only where the quotient lies within an ulp of a rounding boundary;
    2.5x faster on the H200, where the division bounds the kernel); rounded by the hardware's
    conversion (HW_CAST: sm_89 and later; round to nearest even, saturating, as ``encode_e4m3``) or
    by ``encode_e4m3``."""
    if EXACT:
        x = tl.div_rn(w, tl.broadcast_to(scale[:, None], w.shape))
    else:
        x = w * inverse[:, None]
    if HW_CAST:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return encode_e4m3(x)


@triton.jit
def _quantize_rows_kernel(w_ptr, q_ptr, scale_ptr, N, K, swn, swk, ABSMAX: tl.constexpr, ONE_PASS: tl.constexpr,
                          EXACT: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    # One program = BLOCK_N rows of W: (ABSMAX) each row's largest magnitude and its scale s = absmax /
    # 448 (1 for a zero row; and 1 / s = 448 / absmax), else s = 1; then the codes of W / s
    # (``_codes``: EXACT by division, else times 1 / s). ONE_PASS (a row fits one BLOCK_K): the rows
    # are read once and kept in registers; else a pass over K for the scales and a second one for the
    # codes. Q is contiguous (N, K).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    cols = tl.arange(0, BLOCK_K).to(tl.int64)
    w_rows = w_ptr + rows[:, None] * swn
    if ONE_PASS:
        mask = mask_n[:, None] & (cols < K)[None, :]
        w = tl.load(w_rows + cols[None, :] * swk, mask=mask, other=0.0).to(tl.float32)
        scale, inverse = _row_scale(tl.max(tl.abs(w), axis=1), BLOCK_N, ABSMAX)
        tl.store(scale_ptr + rows, scale, mask=mask_n)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], _codes(w, scale, inverse, EXACT, HW_CAST), mask=mask)
    else:
        amax = tl.zeros((BLOCK_N,), tl.float32)
        if ABSMAX:
            for k0 in range(0, K, BLOCK_K):
                mask = mask_n[:, None] & (cols < K - k0)[None, :]
                w = tl.load(w_rows + (k0 + cols)[None, :] * swk, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        scale, inverse = _row_scale(amax, BLOCK_N, ABSMAX)
        tl.store(scale_ptr + rows, scale, mask=mask_n)
        for k0 in range(0, K, BLOCK_K):
            mask = mask_n[:, None] & (cols < K - k0)[None, :]
            w = tl.load(w_rows + (k0 + cols)[None, :] * swk, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * K + (k0 + cols)[None, :], _codes(w, scale, inverse, EXACT, HW_CAST),
                     mask=mask)


@triton.jit
def _row_scale(amax, BLOCK_N: tl.constexpr, ABSMAX: tl.constexpr):
    """(scale, its reciprocal) of each row: absmax / 448 and 448 / absmax (IEEE divisions; 1 and 1 for
    a zero row), or 1 and 1 without ABSMAX."""
    one = tl.full((BLOCK_N,), 1.0, tl.float32)
    if ABSMAX:
        limit = tl.full((BLOCK_N,), E4M3_MAX, tl.float32)
        nonzero = amax > 0.0
        return tl.where(nonzero, tl.div_rn(amax, limit), one), tl.div_rn(limit, tl.where(nonzero, amax, limit))
    return one, one


@triton.jit
def _dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, N, K, son, sok, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    # out[n, k] = s[n] * value(Q[n, k]), rounded once to out's dtype (through fp32: the product is
    # torch's q.float() * s exactly). Q contiguous (N, K); out by strides.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = rows < N
    mask = mask_n[:, None] & (cols < K)[None, :]
    scale = tl.load(scale_ptr + rows, mask=mask_n, other=0.0) * DECODE_FACTOR
    q = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0)
    w = decode_e4m3(q).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows[:, None] * son + cols[None, :] * sok, w.to(out_ptr.dtype.element_ty), mask=mask)


ONE_PASS_MAX_K = 16384  # rows up to this long are quantised from registers (read once)


def _row_blocks(N, K):
    """(BLOCK_N, BLOCK_K, num_warps) of the (de)quantisation kernels: on the GPU, rows up to
    ONE_PASS_MAX_K whole (a few of them per program when short), longer ones in chunks of 1024; on
    the interpreter (about a millisecond and a half of Python per program) big blocks."""
    if runtime.INTERPRETER:
        bk = min(_pow2(K), 1024)
        return max(1, min(_pow2(N), 16384 // bk)), bk, 4
    bk = _pow2(K)
    if bk <= ONE_PASS_MAX_K:  # 32 elements a thread: enough loads in flight, registers for 3-4 programs an SM
        bn = max(1, min(_pow2(N), 4096 // bk))
        return bn, bk, max(4, bn * bk // 1024)
    return 4, 1024, 4


@functools.cache
def _hardware_e4m3():
    """Whether the GPU converts fp32 to e4m3 itself (sm_89 and later; not the interpreter)."""
    capability = runtime.device_capability()
    return capability is not None and capability >= (8, 9)


def as_codes(q):
    """A float8_e4m3fn buffer's bytes (a uint8 view): the kernels read and write the codes as
    integers (see the module docstring)."""
    return q.view(torch.uint8)


def quantize_rows_(q, scale, w, absmax=True, exact=True):
    """Codes ``q`` (N, K, contiguous float8_e4m3fn) and scales ``scale`` (N,) fp32 of the weight
    ``w`` (N, K, any float dtype, any strides): ``scale = absmax of each row / 448`` (1 for a zero
    row), or 1 everywhere when not ``absmax``; ``q = e4m3(w / scale)``, by IEEE division when
    ``exact`` (torch's ``(w / scale).to(float8_e4m3fn)`` bit for bit), else as ``w * (448 / absmax)``
    (activations quantised for W8A8 on every forward: 2.5x faster). Returns ``q``."""
    N, K = w.shape
    if q.numel() == 0:  # no values: scale 1
        fill_(scale, 1.0)
        return q
    bn, bk, warps = _row_blocks(N, K)
    launch(_quantize_rows_kernel, (cdiv(N, bn),), w, as_codes(q), scale, N, K, *w.stride(), ABSMAX=absmax,
           ONE_PASS=bk >= K, EXACT=exact, HW_CAST=_hardware_e4m3(), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return q


def dequantize_rows_(out, q, scale):
    """``out[n, k] = scale[n] * value(q[n, k])`` for codes ``q`` (N, K, contiguous
    float8_e4m3fn) into ``out`` (N, K, any float dtype, any strides). Returns ``out``."""
    N, K = q.shape
    if out.numel() == 0:
        return out
    bn, bk, warps = _row_blocks(N, K)
    launch(_dequantize_rows_kernel, (cdiv(N, bn), cdiv(K, bk)), as_codes(q), scale, out, N, K, *out.stride(),
           BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
