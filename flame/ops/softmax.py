"""``softmax`` and ``log_softmax`` with PyTorch's names and argument order, forward beside backward,
over any dim of a tensor with any strides (viewed as (outer, R, inner) around the dim); the
kernels are ``kernels/softmax.py``'s, which also serve ``cross_entropy`` (``ops/loss.py``)."""
from __future__ import annotations

import itertools
import math

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels import softmax as K
from ..tensor import Tensor
from . import _autocast
from ._util import check_tensor, normalize_dim
from .elementwise import to


def _dense(buf):
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def _collapse(shape, strides):
    """(size, stride) of dims collapsed into one, or None when their strides do not allow it."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    if not dims:
        return math.prod(shape), 0
    for (_, a), (sb, b) in itertools.pairwise(dims):
        if a != b * sb:
            return None
    return math.prod(shape), dims[-1][1]


def _ori(buf, dim):
    """View ``buf`` as (outer, R, inner) around ``dim``: (buf, outer, R, inner, strides), copying
    to a dense buffer when the dims before or after ``dim`` do not collapse."""
    if buf.dim() == 0:
        return buf, 1, 1, 1, (0, 0, 0)
    shape, strides = buf.shape, buf.stride()
    before = _collapse(shape[:dim], strides[:dim])
    after = _collapse(shape[dim + 1:], strides[dim + 1:])
    if before is None or after is None:
        buf = _dense(buf)
        return _ori(buf, dim)
    return buf, before[0], shape[dim], after[0], (before[1], strides[dim], after[1])


def _dense_ori(shape, dim):
    """(outer, R, inner) strides of a contiguous tensor of ``shape``."""
    if not shape:
        return (0, 0, 0)
    inner = math.prod(shape[dim + 1:])
    return (shape[dim] * inner, inner, 1)


def _softmax_backward(node, g):
    y = node.saved[0]
    a = node.attrs
    dim = a["dim"]
    gbuf, _, _, _, gs = _ori(g._data, dim)
    dx = Tensor(runtime.empty(a["shape"], a["dtype"]))
    K.softmax_bwd(dx._data, y, gbuf, a["outer"], a["R"], a["inner"], a["ys"], gs, _dense_ori(a["shape"], dim),
                  a["log"])
    return dx


def _softmax(x, dim, dtype, log, op):
    check_tensor(x, "input", op)
    x = x if dtype is not None else _autocast.fp32(x)[0]
    if dim is None:
        raise TypeError(f"{op}: dim must be given (implicit dim choice is deprecated in PyTorch)")
    if dtype is not None:
        x = to(x, dtype)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point input, got dtype {x.dtype}")
    dim = normalize_dim(dim, x.ndim, op)
    xbuf, outer, R, inner, xs = _ori(x._data, dim)
    y = Tensor(runtime.empty(x.shape, x.dtype))
    ys = _dense_ori(x.shape, dim)
    K.softmax_fwd(y._data, xbuf, outer, R, inner, xs, ys, log)
    if needs_grad(x):
        record(y, (x,), _softmax_backward, saved=(y._data,), dim=dim, outer=outer, R=R, inner=inner, ys=ys,
               shape=x.shape, dtype=x.dtype, log=log)
    return y


def softmax(x, dim=None, dtype=None):
    """exp(x) / sum(exp(x)) along ``dim`` (max-subtracted: stable for large logits)."""
    return _softmax(x, dim, dtype, False, "softmax")


def log_softmax(x, dim=None, dtype=None):
    """x - logsumexp(x) along ``dim``."""
    return _softmax(x, dim, dtype, True, "log_softmax")
