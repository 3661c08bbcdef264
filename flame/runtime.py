"""Backend selection, allocation and device bookkeeping.

The backend is chosen once, when flame is imported: CUDA when ``torch.cuda.is_available()``,
otherwise Triton's interpreter on CPU tensors. ``FLAME_DEVICE=cpu|cuda`` overrides the choice.
``TRITON_INTERPRET=1`` must be set before ``triton`` is imported for the interpreter to take
effect, so this module must be imported before any kernel module (``flame/__init__.py`` does so).

Allocation goes through ``torch.empty*`` only: zero-filling is a Triton kernel like everything
else that touches values.
"""
from __future__ import annotations

import os
import sys

import torch


def _choose_device() -> str:
    requested = os.environ.get("FLAME_DEVICE", "").strip().lower()
    if requested not in ("", "cpu", "cuda"):
        raise RuntimeError(f"FLAME_DEVICE must be 'cpu' or 'cuda', got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("FLAME_DEVICE=cuda but torch.cuda.is_available() is False")
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE_TYPE: str = _choose_device()
INTERPRETER: bool = DEVICE_TYPE == "cpu"

if INTERPRETER:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "flame must be imported before triton when running on the CPU: the interpreter is "
            "selected by TRITON_INTERPRET=1, which triton reads at import time"
        )
    os.environ["TRITON_INTERPRET"] = "1"

device = torch.device(DEVICE_TYPE)
_default_dtype = torch.float32


def is_interpreter() -> bool:
    """True when kernels run through Triton's interpreter on CPU tensors."""
    return INTERPRETER


def default_device() -> torch.device:
    return device


def get_default_dtype() -> torch.dtype:
    return _default_dtype


def set_default_dtype(dtype: torch.dtype) -> None:
    global _default_dtype
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"default dtype must be a floating dtype, got {dtype}")
    _default_dtype = dtype


def resolve_device(dev) -> torch.device:
    """Map a user's device argument to flame's one device, or raise a clear error."""
    if dev is None:
        return device
    d = torch.device(dev)
    if d.type != device.type:
        raise RuntimeError(
            f"flame runs on {device.type!r} in this process (FLAME_DEVICE/CUDA availability); "
            f"got device={str(dev)!r}"
        )
    return device


def to_args(args, dtype=None, device=None):
    """The dtype named by ``.to(...)``-style arguments (positional dtypes and devices, or the
    keywords); a device must be flame's own (see ``resolve_device``)."""
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        else:
            device = a
    resolve_device(device)
    return dtype


def empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(buf, dtype) -> torch.Tensor:
    """Uninitialised, shaped like ``buf``: its strides when it is dense and non-overlapping
    (torch's preserve_format), else contiguous."""
    return torch.empty_like(buf, dtype=dtype, device=device)


def empty_strided(shape, strides, dtype) -> torch.Tensor:
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def empty_dense_like(buf, dtype) -> torch.Tensor:
    """Uninitialised, shaped like ``buf``: in its memory order when that is dense (``dense_order``),
    else contiguous."""
    return empty_like(buf, dtype) if dense_order(buf) is not None else empty(tuple(buf.shape), dtype)


def dense_order(buf):
    """The dims of ``buf`` from outermost to innermost in memory when its strides are a permutation
    of a contiguous layout (no gaps, no overlap: NCHW, channels-last, ...), else None."""
    if buf.is_contiguous():  # the common case, without sorting (optimizer and backward hot paths)
        return tuple(range(buf.dim()))
    order = tuple(sorted(range(buf.dim()), key=lambda d: -buf.stride(d)))
    expected = 1
    for d in reversed(order):
        if buf.shape[d] != 1 and buf.stride(d) != expected:
            return None
        expected *= buf.shape[d]
    return order


def same_dense_layout(a, b) -> bool:
    """Whether buffers ``a`` and ``b`` have one shape, are both dense (``dense_order``) and lay their
    elements out in the same order: element i of one's memory is element i of the other's, so a
    kernel may treat both as flat arrays of ``numel`` elements."""
    if a.shape != b.shape or dense_order(a) is None:
        return False
    return a.stride() == b.stride() or (dense_order(b) is not None and
                                        all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride())))


def synchronize() -> None:
    if not INTERPRETER:
        torch.cuda.synchronize()


def memory_allocated() -> int:
    """Bytes currently held by tensors (CUDA only; 0 on the interpreter backend)."""
    return torch.cuda.memory_allocated() if not INTERPRETER else 0


def max_memory_allocated() -> int:
    return torch.cuda.max_memory_allocated() if not INTERPRETER else 0


def reset_peak_memory_stats() -> None:
    if not INTERPRETER:
        torch.cuda.reset_peak_memory_stats()


_num_sms = None


def num_sms() -> int:
    """Streaming multiprocessors on the device (1 on the interpreter backend); read once."""
    global _num_sms
    if _num_sms is None:
        _num_sms = 1 if INTERPRETER else torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms


def device_name() -> str:
    return torch.cuda.get_device_name() if not INTERPRETER else "cpu-interpreter"
