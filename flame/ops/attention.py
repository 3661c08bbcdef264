"""``scaled_dot_product_attention`` with PyTorch's semantics, on the flash-attention kernels.

``softmax(Q K^T * scale + mask) V`` over (B, H, L, D) (or (N, L, D)) tensors with any batch, head
and sequence strides and a contiguous head dim, so a (B, L, H, D) projection permuted to
(B, H, L, D) is read in place. Nothing of size Lq x Lk is ever stored: the forward saves O and a
per-row log-sum-exp (fp32), and the backward recomputes the probabilities blockwise.

PyTorch conventions kept:
- ``is_causal`` uses the top-left alignment: query i sees keys j <= i, also when Lq != Lk (an
  explicit ``attn_mask`` may be combined with it; both apply).
- ``attn_mask`` is boolean (True = take part in attention) or additive float (same dtype as the
  query, or float32), broadcastable to (B, H, Lq, Lk). It receives no gradient.
- A query row whose every key is masked out gets output 0 and zero gradients (PyTorch's CPU and
  math paths give the same since 2.5; older releases and some CUDA backends return NaN there).
- ``scale`` defaults to 1/sqrt(D).
Head dims: any D up to 512 in the forward (the SDXL VAE's single-head mid-block attention has
512), up to 256 with a gradient: above 256 there is no backward, and a call whose inputs require
grad (outside ``flame.no_grad()``) raises at the forward rather than when the backward runs.

Not supported (clear errors): ``dropout_p != 0``, ``enable_gqa=True``, a value head dim different
from the query's, batch dims that differ between q, k and v (no broadcasting), a non-contiguous
head dim, head dims above 512, and gradients for head dims above 256.

Outputs and gradients are allocated in the memory order of the corresponding input (dims ordered
by stride), so a (B, L, H, D)-laid-out query gives a (B, L, H, D)-laid-out output and the usual
``out.transpose(1, 2).reshape(B, L, H * D)`` is a view.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import attention as KA
from ..tensor import Tensor
from . import _autocast
from ._util import argument_error, check_tensor
from .elementwise import to
from .shape import contiguous

_OP = "scaled_dot_product_attention"
MAX_HEAD_DIM = 512  # the forward's limit
MAX_GRAD_HEAD_DIM = 256  # the backward's: above it the forward alone (inference)


def _empty(shape, strides, dtype):
    """An uninitialised buffer of ``shape`` with ``strides`` (``_layout``'s: None when contiguous)."""
    return runtime.empty(shape, dtype) if strides is None else runtime.empty_strided(shape, strides, dtype)


@functools.lru_cache(maxsize=256)
def _layout(shape, stride):
    """The strides of a dense buffer laid out like one of ``shape`` and ``stride``, None when contiguous:
    its leading dims in that buffer's stride order (outermost = largest stride), its last (head) dim
    innermost. Outputs and gradients are allocated with them, not as permuted views."""
    n = len(shape)
    order = sorted(range(n - 1), key=lambda i: (-stride[i], i)) + [n - 1]
    if order == list(range(n)):
        return None
    strides, step = [0] * n, 1
    for i in reversed(order):  # innermost first: each dim's stride is the product of the sizes inside it
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def _bh_strides(strides):
    """(batch, head, row) strides of a (B, H, L, D) or (N, L, D) buffer (N = heads of batch 1) with these strides."""
    return (strides[0], strides[1], strides[2]) if len(strides) == 4 else (0, strides[0], strides[1])


class _Operands(NamedTuple):
    """What the shapes and strides of a call's query, key and value fix: ``dims`` (B, H, Lq, Lk, D);
    ``shapes`` of q, k, v; ``layouts``, the allocation strides (None: contiguous) of buffers laid out
    like each (``_layout``: the output and dQ like q, dK like k, dV like v); ``bh``, the
    (batch, head, row) strides of q, k, v and of those buffers (the output's serve dQ)."""

    dims: tuple
    shapes: tuple
    layouts: tuple
    bh: tuple

    @classmethod
    def of(cls, qb, kb, vb):
        shapes = tuple(tuple(b.shape) for b in (qb, kb, vb))
        layouts = tuple(_layout(shape, b.stride()) for shape, b in zip(shapes, (qb, kb, vb)))
        allocated = tuple(_bh_strides(_dense(shape) if lay is None else lay) for shape, lay in zip(shapes, layouts))
        shape = shapes[0]
        dims = ((shape[0], shape[1]) if len(shape) == 4 else (1, shape[0])) + (shape[-2], shapes[1][-2], shape[-1])
        return cls(dims, shapes, layouts, tuple(_bh_strides(b.stride()) for b in (qb, kb, vb)) + allocated)


def _dense(shape):
    """The contiguous strides of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _check(query, key, value, attn_mask, dropout_p, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name, _OP)
    if not query.dtype.is_floating_point:
        raise TypeError(f"{_OP}: expected floating-point query, key and value, got {query.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"{_OP}: expected query, key and value to have the same dtype, got query.dtype "
                        f"{query.dtype}, key.dtype {key.dtype} and value.dtype {value.dtype}")
    if not isinstance(dropout_p, numbers.Real) or dropout_p != 0.0:
        raise ValueError(f"{_OP}: dropout_p must be 0 (attention dropout is not implemented), got {dropout_p!r}")
    if enable_gqa:
        raise ValueError(f"{_OP}: enable_gqa=True is not supported (repeat key/value heads instead)")
    if scale is not None and not isinstance(scale, numbers.Real):
        raise TypeError(f"{_OP}: scale must be a float or None, got {type(scale).__name__}")
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    if not (query.ndim == key.ndim == value.ndim) or query.ndim not in (3, 4):
        raise ValueError(f"{_OP}: expected 4-D (B, H, L, D) or 3-D (N, L, D) query, key and value of the same "
                         f"rank, got {shapes}")
    if not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):
        raise ValueError(f"{_OP}: batch/head dims of query, key and value must match (no broadcasting), got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"{_OP}: key and value must have the same sequence length, got {shapes}")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise ValueError(f"{_OP}: query, key and value must have the same head dim, got {shapes}")
    D = query.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head dims above {MAX_HEAD_DIM} are not supported, got {shapes}")
    if D > 1:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.stride(-1) != 1:
                raise ValueError(f"{_OP}: the head dim (last dim) of {name} must be contiguous (stride 1), got shape "
                                 f"{t.shape} with strides {t.stride()}; call .contiguous() first")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise argument_error(attn_mask, "attn_mask", _OP, "a flame Tensor or None")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (query.dtype, torch.float32):
            raise TypeError(f"{_OP}: attn_mask must be bool, float32 or the query's dtype ({query.dtype}), "
                            f"got {attn_mask.dtype}")


_checked: dict = {}  # q/k/v shapes, strides and dtypes that passed _check -> their _Operands


def _operands(query, key, value, attn_mask, dropout_p, scale, enable_gqa):
    """The ``_Operands`` of a valid call, else the error ``_check`` raises. The checks that depend on
    the tensors, and what their shapes and strides fix, are memoised on their shapes, strides and
    dtypes (masked calls and subclasses are checked every time): the host path of a repeated
    attention stays thin."""
    sig = None
    if (attn_mask is None and type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
            and type(dropout_p) in (float, int) and dropout_p == 0 and not enable_gqa
            and (scale is None or type(scale) in (float, int))):
        qb, kb, vb = query._data, key._data, value._data
        sig = (qb.shape, qb.stride(), qb.dtype, kb.shape, kb.stride(), kb.dtype, vb.shape, vb.stride(), vb.dtype)
        ops = _checked.get(sig)
        if ops is not None:
            return ops
    _check(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    ops = _Operands.of(query._data, key._data, value._data)
    if sig is not None:
        if len(_checked) > 1024:
            _checked.clear()
        _checked[sig] = ops
    return ops


def _mask_arg(attn_mask, query, B, H, Lq, Lk):
    """(buffer, strides over (B, H, Lq, Lk), kind) for the kernels; kind 1 additive, 2 boolean."""
    if attn_mask is None:
        return None
    buf = attn_mask._data
    target = (B, H, Lq, Lk) if query.ndim == 4 else (H, Lq, Lk)
    if buf.dim() > len(target):
        raise ValueError(f"{_OP}: attn_mask of shape {attn_mask.shape} is not broadcastable to {target}")
    try:
        buf = buf.expand(target)
    except RuntimeError:
        raise ValueError(f"{_OP}: attn_mask of shape {attn_mask.shape} is not broadcastable to {target}") from None
    if buf.dim() == 3:
        buf = buf.unsqueeze(0)
    kind = 1
    if buf.dtype == torch.bool:
        buf = buf.view(torch.uint8)  # same bytes, a type the kernels load portably
        kind = 2
    return buf, tuple(buf.stride()), kind


# dS = P * (dO V^T - delta) with delta_i = sum_d dO_id O_id (= rowsum(P * dP)); dQ = scale dS K,
# dK = scale dS^T Q, dV = P^T dO, P recomputed blockwise from the saved log-sum-exp
def _sdpa_backward(node, g):
    qb, kb, vb, ob, lse, mask = node.saved
    a = node.attrs
    ops = a["operands"]
    B, H, Lq, Lk, D = ops.dims
    if g.dtype != qb.dtype:
        g = to(g, qb.dtype)
    gb = g._data
    if D > 1 and gb.stride(-1) != 1:
        gb = contiguous(g)._data
    (sq_shape, sk_shape, sv_shape), (lq, lk, lv), dtype = ops.shapes, ops.layouts, qb.dtype
    dq, dk, dv = _empty(sq_shape, lq, dtype), _empty(sk_shape, lk, dtype), _empty(sv_shape, lv, dtype)
    if D > 0 and B * H > 0 and (Lq > 0 or Lk > 0):
        sq, sk, sv, so, sdk, sdv = ops.bh
        KA.attention_bwd(qb, kb, vb, ob, gb, lse, dq, dk, dv, sq, sk, sv, so, _bh_strides(gb.stride()), so, sdk, sdv,
                         B, H, Lq, Lk, D, a["scale"], a["causal"], mask)
    return Tensor(dq), Tensor(dk), Tensor(dv)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``softmax(query @ key^T * scale + attn_mask) @ value`` with ``torch.nn.functional``'s
    signature and semantics (see the module docstring for what is and is not supported)."""
    query, key, value, attn_mask = _autocast.lower(query, key, value, attn_mask)
    ops = _operands(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    B, H, Lq, Lk, D = ops.dims
    qb, kb, vb = query._data, key._data, value._data
    scale = (1.0 / math.sqrt(D) if D > 0 else 1.0) if scale is None else float(scale)
    grad = needs_grad(query, key, value)
    if grad and D > MAX_GRAD_HEAD_DIM:  # refused before any work, not when the backward runs
        raise ValueError(f"{_OP}: head dims above {MAX_GRAD_HEAD_DIM} have a forward only (no backward), got "
                         f"head dim {D} with inputs that require grad; run it under flame.no_grad() or detach "
                         f"query, key and value")
    mask = None if attn_mask is None else _mask_arg(attn_mask, query, B, H, Lq, Lk)
    dtype = qb.dtype
    out = _empty(ops.shapes[0], ops.layouts[0], dtype)
    lse = runtime.empty((B * H, max(Lq, 1)), KA.stats_dtype(dtype))
    if B * H * Lq * D > 0:
        sq, sk, sv, so = ops.bh[:4]
        KA.attention_fwd(qb, kb, vb, out, lse, sq, sk, sv, so, B, H, Lq, Lk, D, scale, is_causal, mask)
    y = Tensor(out)
    if grad:
        record(y, (query, key, value), _sdpa_backward, saved=(qb, kb, vb, out, lse, mask), operands=ops, scale=scale,
               causal=bool(is_causal))
    return y
