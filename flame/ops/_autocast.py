"""The autocast state the ops read (``flame.amp.autocast`` sets it; ops sit below amp).

Per thread, as PyTorch's: ``None`` (off) or the compute dtype. ``lower(*tensors)`` is the
one-line hook of the ops on PyTorch's lower-precision list (matmul, linear, conv, attention):
floating inputs other than fp64 are cast to the compute dtype. ``fp32(*tensors)`` is the hook of
the ops on its fp32 list (norms, softmax, losses, sum): lower-precision inputs are cast up.
"""
from __future__ import annotations

import threading

import torch

_state = threading.local()


def get_autocast():
    """The compute dtype of the current autocast region, or None."""
    return getattr(_state, "dtype", None)


class autocast_state:
    """Set this thread's autocast dtype (None turns it off) for a ``with`` block."""

    def __init__(self, dtype):
        if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"autocast: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
        self.dtype = dtype

    def __enter__(self):
        self._prev = get_autocast()
        _state.dtype = self.dtype
        return self

    def __exit__(self, *exc):
        _state.dtype = self._prev
        return False
