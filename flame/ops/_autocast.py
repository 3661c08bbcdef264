"""The autocast state the ops read (``flame.amp.autocast`` sets it; ops sit below amp).

Per thread, as PyTorch's: off, or a compute dtype. Two one-line hooks put ops on PyTorch's CUDA
autocast lists:

- ``lower(*tensors)`` for the lower-precision list (matmul/bmm, linear, conv, attention):
  floating inputs other than fp64 are cast to the compute dtype;
- ``fp32(*tensors)`` for the fp32 list (group/layer/RMS norm, softmax, log-softmax, losses, sum):
  fp16/bf16 inputs are cast up to fp32, so the op also returns fp32.

Both return their arguments unchanged (non-tensors and None included) when autocast is off.
Casts are recorded ops, so an fp32 parameter cast down gets an fp32 gradient. A parameter (a
leaf that requires grad) is cast once per autocast region and grad mode: later ops reuse the
cast, as PyTorch's autocast weight cache does (until a backward releases that cast's node).
"""
from __future__ import annotations

import threading

import torch

from ..autograd import is_grad_enabled
from ..tensor import Tensor
from .elementwise import to


class _State(threading.local):
    dtype = None  # this thread's compute dtype, None outside autocast (a class default: no AttributeError per read)
    cache = None  # the region's weight casts


_state = _State()
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def get_autocast():
    """The compute dtype of the current autocast region, or None."""
    return _state.dtype


class autocast_state:
    """Set this thread's autocast dtype (None turns it off) for a ``with`` block, with a fresh
    weight-cast cache (``cache=False``: none)."""

    def __init__(self, dtype, cache: bool = True):
        if dtype is not None and dtype not in _DTYPES:
            raise TypeError(f"autocast: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
        self.dtype = dtype
        self.cache = cache

    def __enter__(self):
        self._prev = (get_autocast(), _state.cache)
        _state.dtype = self.dtype
        _state.cache = {} if self.cache else None
        return self

    def __exit__(self, *exc):
        _state.dtype, _state.cache = self._prev
        return False


def _cast(t, dtype):
    cache = _state.cache
    if cache is None or not (t.requires_grad and t._node is None):
        return to(t, dtype)
    key = (t.id, dtype, is_grad_enabled())
    hit = cache.get(key)
    if hit is None or (hit._node is not None and hit._node.released):  # a backward consumed it
        hit = cache[key] = to(t, dtype)
    return hit


def lower(*tensors):
    """Cast floating inputs (not fp64) to the autocast dtype; a no-op when autocast is off."""
    dtype = _state.dtype
    if dtype is None:
        return tensors
    return tuple(_cast(t, dtype) if isinstance(t, Tensor) and t.dtype in _DTYPES and t.dtype != dtype else t
                 for t in tensors)


def fp32(*tensors):
    """Cast fp16/bf16 inputs to fp32 inside an autocast region; a no-op when autocast is off."""
    if _state.dtype is None:
        return tensors
    return tuple(to(t, torch.float32) if isinstance(t, Tensor) and t.dtype in _DTYPES[:2] else t for t in tensors)
