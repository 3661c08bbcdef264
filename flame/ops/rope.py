"""``qk_norm_rope``: Flux's attention prologue (RMSNorm of q and k per head, the rotary embedding,
q, k, v split into heads) as one op over the fused QKV projections, read in place.

The op has three outputs (four with ``tail``), and flame records one node per output. Their
backward is one kernel, so the output nodes hand their gradients to a fourth node, ``hub`` (an empty tensor the op
makes): each stores its gradient in a dict the nodes share and passes an empty gradient on to
``hub``, whose node runs after all of them (its consumers) and reads the dict. Empty tensors cost
no launch, not even where the engine sums them.
"""
from __future__ import annotations

import math
import numbers

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels import rope as K
from ..tensor import Tensor
from ._util import check_tensor, dense

_OP = "qk_norm_rope"


def _dense(t):
    """A (D,) weight's buffer with unit stride (a copy when it is a strided view)."""
    buf = t._data
    return buf if buf.is_contiguous() else dense(buf)


def _kind(v):
    """What an argument is, for errors: its type, and its length if it is a list or tuple."""
    return type(v).__name__ + (f" of {len(v)}" if isinstance(v, (list, tuple)) else "")


def _check_streams(qkvs):
    if not isinstance(qkvs, (list, tuple)) or not 1 <= len(qkvs) <= 2:
        raise TypeError(f"{_OP}: qkvs must be a list of 1 or 2 flame Tensors (B, L_i, W_i), got {_kind(qkvs)}")
    for i, x in enumerate(qkvs):
        check_tensor(x, f"qkvs[{i}]", _OP)
        if x.ndim != 3:
            raise ValueError(f"{_OP}: qkvs[{i}] must be 3-D (B, L, W), got shape {x.shape}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{_OP}: qkvs[{i}] must be floating point, got dtype {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"{_OP}: the last dim of qkvs[{i}] must be contiguous (stride 1), got strides "
                             f"{x.stride()}")
    x0 = qkvs[0]
    for i, x in enumerate(qkvs[1:], 1):
        if x.dtype != x0.dtype:
            raise TypeError(f"{_OP}: every stream must have one dtype, got {x0.dtype} (qkvs[0]) and {x.dtype} "
                            f"(qkvs[{i}])")
        if x.shape[0] != x0.shape[0]:
            raise ValueError(f"{_OP}: every stream must have one batch size, got shapes {x0.shape} and {x.shape}")
        if x.device != x0.device:
            raise RuntimeError(f"{_OP}: qkvs[{i}] is on {x.device} but qkvs[0] is on {x0.device}")


def _check_weights(norm_weights, qkvs):
    """The head dim D, from the weights, after checking every weight."""
    n = len(qkvs)
    if not isinstance(norm_weights, (list, tuple)) or len(norm_weights) != n or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in norm_weights):
        raise TypeError(f"{_OP}: norm_weights must be a list of {n} (q_weight, k_weight) pairs, one per stream, "
                        f"got {_kind(norm_weights)}")
    first = None
    for i, pair in enumerate(norm_weights):
        for name, w in zip(("q_weight", "k_weight"), pair):
            arg = f"norm_weights[{i}] {name}"
            check_tensor(w, arg, _OP)
            if w.ndim != 1:
                raise ValueError(f"{_OP}: {arg} must be 1-D (D,), got shape {w.shape}")
            if w.dtype not in (torch.float32, qkvs[0].dtype):
                raise TypeError(f"{_OP}: {arg} must be float32 or the input's dtype ({qkvs[0].dtype}), got {w.dtype}")
            if w.device != qkvs[0].device:
                raise RuntimeError(f"{_OP}: {arg} is on {w.device} but the input is on {qkvs[0].device}")
            if first is None:
                first = (w, arg)
            elif w.shape != first[0].shape or w.dtype != first[0].dtype:
                raise ValueError(f"{_OP}: every norm weight must have one shape and dtype, got {first[1]} "
                                 f"{tuple(first[0].shape)} {first[0].dtype} and {arg} {tuple(w.shape)} {w.dtype}")
    D = first[0].shape[0]
    if D == 0 or D % 2:
        raise ValueError(f"{_OP}: the head dim D (the norm weights' length) must be even and positive for the "
                         f"rotary pairs, got {D}")
    return D


TAILS = (None, "gelu_tanh")


def _check(qkvs, norm_weights, cos, sin, num_heads, eps, tail):
    """(H, D, L_total, eps) of a valid call; otherwise the error, before any launch."""
    _check_streams(qkvs)
    if tail not in TAILS:
        raise ValueError(f"{_OP}: tail must be None or 'gelu_tanh', got {tail!r}")
    if not isinstance(num_heads, numbers.Integral) or isinstance(num_heads, bool) or num_heads <= 0:
        raise ValueError(f"{_OP}: num_heads must be a positive int, got {num_heads!r}")
    H = int(num_heads)
    D = _check_weights(norm_weights, qkvs)
    for i, x in enumerate(qkvs):
        if x.shape[2] < 3 * H * D:
            raise ValueError(f"{_OP}: qkvs[{i}] has {x.shape[2]} columns, fewer than 3 * num_heads * D = "
                             f"3 * {H} * {D} = {3 * H * D} ([q | k | v]); shape {x.shape}")
    if tail is not None and (len(qkvs) != 1 or qkvs[0].shape[2] == 3 * H * D):
        raise ValueError(f"{_OP}: tail needs one stream with columns past 3 * num_heads * D = {3 * H * D} (the "
                         f"single block's MLP input), got {len(qkvs)} stream(s) of shapes {[x.shape for x in qkvs]}")
    L_total = sum(x.shape[1] for x in qkvs)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, name, _OP)
        if t.dtype != torch.float32:
            raise TypeError(f"{_OP}: {name} must be a float32 table, got {t.dtype}")
        if tuple(t.shape) != (L_total, D // 2):
            raise ValueError(f"{_OP}: {name} must have shape (L_total, D / 2) = ({L_total}, {D // 2}) (the streams' "
                             f"tokens, one angle per pair of the head dim), got {tuple(t.shape)}")
        if t.device != qkvs[0].device:
            raise RuntimeError(f"{_OP}: {name} is on {t.device} but the input is on {qkvs[0].device}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not 0 <= eps < math.inf:
        raise ValueError(f"{_OP}: eps must be a finite non-negative number, got {eps!r}")
    return H, D, L_total, float(eps)


def _part_backward(node, g):
    # q, k, v or the tail: its gradient is kept for the hub's backward; the hub gets an empty one
    node.attrs["grads"][node.attrs["part"]] = g
    return Tensor(runtime.empty((0,), node.attrs["dtype"]))


# The hub's backward: the gradients of q, k, v (any may be missing: zeros) to each stream's input
# gradient and the norm weights' gradients. Per head and token (math above
# kernels/rope.py:_norm_rope_bwd): dy = R^T dq (the inverse rotation), dxhat = dy * w,
# dx = rstd * (dxhat - xhat * mean(dxhat * xhat)), dw = sum over B, L, H of dy * xhat (fp32
# partials per program, reduced per stream); dv is moved back into the v columns. A stream wider
# than 3 H D gets a full-width gradient (the engine needs the input's shape): past 3 H D the
# tail's, dx = dt * gelu_tanh'(x), or zeros without a tail.
def _qk_norm_rope_backward(node, _):
    xs, weights, cos, sin = node.saved
    a = node.attrs
    H, D = a["H"], a["D"]
    grads = a["grads"]
    dq, dk, dv, dt = (_unit_last_stride(grads.get(i)) for i in range(4))
    grads.clear()
    need = node.needs_input_grad
    n = len(xs)
    dxs = [runtime.empty(tuple(x.shape), x.dtype) for x in xs]
    need_w = [need[n + 2 * i] or need[n + 2 * i + 1] for i in range(n)]
    dws = [runtime.empty((2 * D,), weights[i][0].dtype) if need_w[i] else None for i in range(n)]
    K.qk_norm_rope_bwd(dxs, dws, dq, dk, dv, xs, weights, cos, sin, H, D, a["eps"], dt)
    out = [Tensor(dx) if need[i] else None for i, dx in enumerate(dxs)]
    for i, dw in enumerate(dws):
        out += [Tensor(dw[:D]) if need[n + 2 * i] else None, Tensor(dw[D:]) if need[n + 2 * i + 1] else None]
    return tuple(out)


def _unit_last_stride(g):
    """An output gradient's buffer with a unit-stride last dim (a copy otherwise), or None."""
    if g is None:
        return None
    buf = g._data
    if buf.stride(-1) == 1:
        return buf
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    return KE.copy_(out, buf)


def qk_norm_rope(qkvs, norm_weights, cos, sin, num_heads, eps=1e-6, tail=None):
    """Flux's attention prologue over the fused QKV projection(s) ``qkvs`` (a list of 1 or 2
    streams (B, L_i, W_i), last dim contiguous, whose first 3 H D columns are [q | k | v], H =
    ``num_heads`` heads of D; later columns are ignored): per stream and head, RMSNorm of q and k
    over D with that stream's ``norm_weights[i] = (q_weight, k_weight)`` (D,) (statistics in
    fp32), then the rotary embedding of the pairs (x[2i], x[2i+1]) by the fp32 tables ``cos``,
    ``sin`` (L_total, D/2) of the streams concatenated along L in list order; v is only moved.

    Returns ``(q, k, v)``, each (B, H, L_total, D) in the input's dtype: permuted views of dense
    (B, L_total, H, D) buffers. ``tail="gelu_tanh"`` (one stream; Flux's single block, whose
    linear1 output holds the MLP input past 3 H D) also returns ``gelu_tanh(qkvs[0][..., 3HD:])``
    (B, L, W - 3 H D), so that the input gets one gradient, written once, instead of two
    zero-padded halves and their sum. One launch forward; backward one launch plus one reduction
    per stream whose norm weights need gradients. The tables take no gradient."""
    H, D, L_total, eps = _check(qkvs, norm_weights, cos, sin, num_heads, eps, tail)
    xs = [x._data for x in qkvs]
    weights = [(_dense(wq), _dense(wk)) for wq, wk in norm_weights]
    B, dtype = xs[0].shape[0], xs[0].dtype
    outs = [runtime.empty((B, L_total, H, D), dtype) for _ in range(3)]
    t = runtime.empty((B, L_total, xs[0].shape[2] - 3 * H * D), dtype) if tail else None
    K.qk_norm_rope_fwd(*outs, xs, weights, cos._data, sin._data, H, D, eps, t)
    results = [Tensor(o.permute(0, 2, 1, 3)) for o in outs] + ([Tensor(t)] if tail else [])
    inputs = (*qkvs, *(w for pair in norm_weights for w in pair))
    if needs_grad(*inputs):
        grads = {}  # the outputs' gradients, by part (0 q, 1 k, 2 v, 3 tail), until the hub's backward takes them
        hub = Tensor(runtime.empty((0,), dtype))
        record(hub, inputs, _qk_norm_rope_backward, saved=(xs, weights, cos._data, sin._data), grads=grads,
               H=H, D=D, eps=eps)
        for part, out in enumerate(results):
            record(out, (hub,), _part_backward, grads=grads, part=part, dtype=dtype)
    return tuple(results)
