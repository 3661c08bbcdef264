"""``dropout``: inverted dropout with a Philox mask that is never stored.

The forward draws ``u = tl.rand(seed, offset + i)`` per element (flame's generator: reproducible
under ``flame.manual_seed``) and keeps ``x[i] / (1 - p)`` where ``u >= p``. The backward replays the
same (seed, offset) on the incoming gradient, so no mask is saved. The kernel is
``flame.kernels.random.dropout_``.
"""
from __future__ import annotations

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels import random as KR
from ..tensor import Tensor
from ._util import check_float, check_tensor, new
from .creation import draw


def _dense(buf):
    if buf.is_contiguous():
        return buf
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def _apply(x_buf, seed, offset, p):
    out = new(tuple(x_buf.shape), x_buf.dtype)
    KR.dropout_(out._data, x_buf, seed, offset, p)
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
