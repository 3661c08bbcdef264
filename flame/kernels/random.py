"""Generators: Philox random numbers (uniform, normal), dropout masks and arithmetic sequences.

Random numbers come from Triton's Philox-4x32 (``tl.rand``/``tl.randn``) keyed by a 64-bit seed
and the element's counter offset, so a (seed, offset) pair fully determines a tensor: results are
reproducible under ``flame.manual_seed`` and independent of launch configuration.
"""
import triton
import triton.language as tl

from .. import runtime
from .elementwise import cdiv
from .launch import launch

UNIFORM, NORMAL = tl.constexpr(0), tl.constexpr(1)


@triton.jit(do_not_specialize=["seed", "offset", "a", "b"])
def _random_kernel(out_ptr, n, seed, offset, a, b, DIST: tl.constexpr, BLOCK: tl.constexpr):
    # uniform: a + (b - a) * U[0, 1);  normal: a + b * N(0, 1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    counters = (offs + offset).to(tl.uint32)
    if DIST == UNIFORM:
        r = a + (b - a) * tl.rand(seed, counters)
    else:
        r = a + b * tl.randn(seed, counters)
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset", "p", "scale"])
def _dropout_kernel(x_ptr, out_ptr, n, seed, offset, p, scale, BLOCK: tl.constexpr):
    # y = x * [u >= p] * scale with u = U[0, 1) of (seed, offset + i); the backward replays the same
    # (seed, offset) on the gradient: dx = g * [u >= p] * scale, so no mask is stored
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.rand(seed, (offs + offset).to(tl.uint32))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(u >= p, x * scale, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["start", "step"])
def _arange_kernel(out_ptr, n, start, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, (start + offs * step).to(out_ptr.dtype.element_ty), mask=mask)


def _block(n):
    if runtime.INTERPRETER:
        return max(16, 1 << max(0, (min(n, 1 << 16) - 1).bit_length()))
    return 1024


def random_(out, dist, seed, offset, a, b):
    """Fill contiguous ``out`` with uniform [a, b) or normal (mean a, std b) numbers."""
    n = out.numel()
    if n == 0:
        return out
    block = _block(n)
    launch(_random_kernel, (cdiv(n, block),), out, n, seed, offset, float(a), float(b),
           DIST=tl.constexpr(dist).value, BLOCK=block)
    return out


def arange_(out, start, step):
    """out[i] = start + i * step for contiguous ``out`` (computed in fp32/fp64 or int64)."""
    n = out.numel()
    if n == 0:
        return out
    block = _block(n)
    cast = float if out.dtype.is_floating_point else int
    launch(_arange_kernel, (cdiv(n, block),), out, n, cast(start), cast(step), BLOCK=block)
    return out


def dropout_(out, x, seed, offset, p):
    """out = x with each element zeroed where its uniform draw is below ``p``, the rest scaled by
    1 / (1 - p); ``out`` and ``x`` contiguous, of one shape."""
    n = x.numel()
    if n == 0:
        return out
    block = _block(n)
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    launch(_dropout_kernel, (cdiv(n, block),), x, out, n, seed, offset, float(p), scale, BLOCK=block, num_warps=4)
    return out
