"""``clip_grad_norm_``: total gradient norm and in-place rescaling, on the device.

The norm is a multi-tensor reduction (per-chunk fp32 partials, then one finishing program that
also computes the clip coefficient); the rescale reads that coefficient from device memory, so
nothing waits on the host unless the caller asks for the norm's value.
"""
from __future__ import annotations

import math

import torch

from .. import runtime
from ..autograd import GradientMap
from ..kernels import optim as K
from ..tensor import Tensor

_cache: dict = {}  # pointer key -> [(Tables, dtype)]; a few recent gradient sets


def _grad_list(grads):
    if isinstance(grads, Tensor):
        return [grads]
    if isinstance(grads, (GradientMap, dict)):
        return list(grads.values())
    return list(grads)


def _buckets(gs):
    by_dtype = {}
    for g in gs:
        by_dtype.setdefault(g.dtype, []).append(g)
    key = tuple((d, tuple((g.data_ptr(), g.numel()) for g in lst)) for d, lst in by_dtype.items())
    hit = _cache.get(key)
    if hit is not None:
        return hit
    buckets = [(K.Tables([((None, g._data, None, None), g.numel(), 0) for g in lst]), d) for d, lst in by_dtype.items()]
    if len(_cache) >= 4:
        _cache.pop(next(iter(_cache)))
    _cache[key] = buckets
    return buckets


def clip_grad_norm_(grads, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Scale every gradient in ``grads`` (a GradientMap, a dict, a Tensor or an iterable of
    Tensors) in place by ``min(1, max_norm / (total_norm + 1e-6))``, where ``total_norm`` is the
    ``norm_type``-norm of all gradients together (computed in fp32). Returns ``total_norm`` as a
    0-d fp32 flame Tensor; reading it (``.item()``) is the only host sync, and
    ``error_if_nonfinite=True`` asks for one."""
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    max_norm = float(max_norm)
    gs = _grad_list(grads)
    for g in gs:
        if not isinstance(g, Tensor):
            raise TypeError(f"clip_grad_norm_: gradients must be flame Tensors, got {type(g).__name__}")
        if not g.dtype.is_floating_point:
            raise TypeError(f"clip_grad_norm_: gradients must be floating point, got {g.dtype} (shape {g.shape})")
        if runtime.dense_order(g._data) is None:
            raise ValueError(f"clip_grad_norm_: gradients must be dense (contiguous, channels-last or another order "
                             f"without gaps), got shape {g.shape}, strides {g.stride()}")
    norm = runtime.empty((), torch.float32)
    coef = runtime.empty((1,), torch.float32)
    buckets = _buckets([g for g in gs if g.numel()])
    K.grad_norm_(buckets, norm, coef, norm_type, max_norm)
    if error_if_nonfinite:
        value = norm.item()  # host sync, asked for
        if not math.isfinite(value):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
    K.scale_(buckets, coef)
    return Tensor(norm)
