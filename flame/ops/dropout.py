"""``dropout``: inverted dropout with a Philox mask that is never stored.

The forward draws ``u = tl.rand(seed, offset + i)`` per element (flame's generator: reproducible
under ``flame.manual_seed``) and keeps ``x[i] / (1 - p)`` where ``u >= p``. The backward replays the
same (seed, offset) on the incoming gradient, so no mask is saved.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels.launch import launch
from ..tensor import Tensor
from ._util import check_float, check_tensor, new
from .creation import draw


@triton.jit(do_not_specialize=["seed", "offset", "p", "scale"])
def _dropout_kernel(x_ptr, out_ptr, n, seed, offset, p, scale, BLOCK: tl.constexpr):
    # forward: y = x * [u >= p] * scale;  backward (same seed/offset): dx = g * [u >= p] * scale
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.rand(seed, (offs + offset).to(tl.uint32))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(u >= p, x * scale, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _dense(buf):
    if buf.is_contiguous():
        return buf
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def _apply(x_buf, seed, offset, p):
    n = x_buf.numel()
    out = new(tuple(x_buf.shape), x_buf.dtype)
    if n == 0:
        return out
    block = max(16, 1 << max(0, (min(n, 1 << 16) - 1).bit_length())) if runtime.INTERPRETER else 1024
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    launch(_dropout_kernel, ((n + block - 1) // block,), x_buf, out._data, n, seed, offset, float(p), scale,
           BLOCK=block, num_warps=4)
    return out


def _dropout_backward(node, g):
    a = node.attrs
    return _apply(_dense(g._data), a["seed"], a["offset"], a["p"])


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)`` (identity when
    not ``training`` or ``p == 0``)."""
    check_tensor(x, "input", "dropout")
    check_float(x, "dropout")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    seed, offset = draw(x.numel())
    out = _apply(_dense(x._data), seed, offset, p)
    if needs_grad(x):
        record(out, (x,), _dropout_backward, seed=seed, offset=offset, p=p)
    return out
