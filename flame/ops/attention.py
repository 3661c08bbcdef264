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


def _empty_like_order(buf, dtype=None):
    """An uninitialised dense buffer shaped like ``buf`` whose leading dims are laid out in
    ``buf``'s stride order (outermost = largest stride) and whose last (head) dim is innermost
    (allocated with those strides: no permuted view of a contiguous allocation to build)."""
    shape = tuple(buf.shape)
    strides = _layout(shape, buf.stride())
    dtype = dtype or buf.dtype
    return runtime.empty(shape, dtype) if strides is None else runtime.empty_strided(shape, strides, dtype)


@functools.lru_cache(maxsize=256)
def _layout(shape, stride):
    """The strides of ``_empty_like_order``'s buffer for a buffer of ``shape`` and ``stride``, None
    when contiguous."""
    n = len(shape)
    order = sorted(range(n - 1), key=lambda i: (-stride[i], i)) + [n - 1]
    if order == list(range(n)):
        return None
    strides, step = [0] * n, 1
    for i in reversed(order):  # innermost first: each dim's stride is the product of the sizes inside it
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def _bh_strides(buf):
    """(batch, head, row) strides of a (B, H, L, D) or (N, L, D) buffer (N = heads of batch 1)."""
    s = buf.stride()
    return (s[0], s[1], s[2]) if buf.dim() == 4 else (0, s[0], s[1])


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


_checked: dict = {}  # q/k/v shapes, strides and dtypes that passed _check -> (B, H, Lq, Lk, D)


def _dims(query, key, value, attn_mask, dropout_p, scale, enable_gqa):
    """(B, H, Lq, Lk, D) of a valid call, else the error ``_check`` raises. The checks that
    depend on the tensors are memoised on their shapes, strides and dtypes (masked calls and
    subclasses are checked every time): the host path of a repeated attention stays thin."""
    sig = None
    if (attn_mask is None and type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
            and type(dropout_p) in (float, int) and dropout_p == 0 and not enable_gqa
            and (scale is None or type(scale) in (float, int))):
        qb, kb, vb = query._data, key._data, value._data
        sig = (qb.shape, qb.stride(), qb.dtype, kb.shape, kb.stride(), kb.dtype, vb.shape, vb.stride(), vb.dtype)
        dims = _checked.get(sig)
        if dims is not None:
            return dims
    _check(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    shape = query.shape
    dims = (shape[0], shape[1]) if len(shape) == 4 else (1, shape[0])
    dims += (shape[-2], key.shape[-2], shape[-1])
    if sig is not None:
        if len(_checked) > 1024:
            _checked.clear()
        _checked[sig] = dims
    return dims


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


def _sdpa_backward(node, g):
    qb, kb, vb, ob, lse, mask = node.saved
    a = node.attrs
    B, H, Lq, Lk, D = a["B"], a["H"], a["Lq"], a["Lk"], a["D"]
    if g.dtype != qb.dtype:
        g = to(g, qb.dtype)
    gb = g._data
    if D > 1 and gb.stride(-1) != 1:
        gb = contiguous(g)._data
    dq, dk, dv = _empty_like_order(qb), _empty_like_order(kb), _empty_like_order(vb)
    if D > 0 and B * H > 0 and (Lq > 0 or Lk > 0):
        KA.attention_bwd(qb, kb, vb, ob, gb, lse, dq, dk, dv, _bh_strides(qb), _bh_strides(kb), _bh_strides(vb),
                         _bh_strides(ob), _bh_strides(gb), _bh_strides(dq), _bh_strides(dk), _bh_strides(dv),
                         B, H, Lq, Lk, D, a["scale"], a["causal"], mask)
    return Tensor(dq), Tensor(dk), Tensor(dv)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``softmax(query @ key^T * scale + attn_mask) @ value`` with ``torch.nn.functional``'s
    signature and semantics (see the module docstring for what is and is not supported)."""
    query, key, value, attn_mask = _autocast.lower(query, key, value, attn_mask)
    B, H, Lq, Lk, D = _dims(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    qb, kb, vb = query._data, key._data, value._data
    scale = (1.0 / math.sqrt(D) if D > 0 else 1.0) if scale is None else float(scale)
    grad = needs_grad(query, key, value)
    if grad and D > MAX_GRAD_HEAD_DIM:  # refused before any work, not when the backward runs
        raise ValueError(f"{_OP}: head dims above {MAX_GRAD_HEAD_DIM} have a forward only (no backward), got "
                         f"head dim {D} with inputs that require grad; run it under flame.no_grad() or detach "
                         f"query, key and value")
    mask = _mask_arg(attn_mask, query, B, H, Lq, Lk)
    out = _empty_like_order(qb)
    lse = runtime.empty((B * H, max(Lq, 1)), KA.stats_dtype(qb.dtype))
    if out.numel() > 0:
        KA.attention_fwd(qb, kb, vb, out, lse, _bh_strides(qb), _bh_strides(kb), _bh_strides(vb), _bh_strides(out),
                         B, H, Lq, Lk, D, scale, is_causal, mask)
    y = Tensor(out)
    if grad:
        record(y, (query, key, value), _sdpa_backward, saved=(qb, kb, vb, out, lse, mask),
               B=B, H=H, Lq=Lq, Lk=Lk, D=D, scale=scale, causal=bool(is_causal))
    return y
