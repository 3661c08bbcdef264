"""Helpers shared by the op modules: argument checks and output allocation."""
from __future__ import annotations

import numbers

from .. import runtime
from ..tensor import Tensor


def new(shape, dtype) -> Tensor:
    """A fresh contiguous tensor (uninitialised)."""
    return Tensor(runtime.empty(tuple(shape), dtype))


def check_tensor(x, name: str, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: {name} must be a flame Tensor, got {type(x).__name__}")
    return x


def check_float(x: Tensor, op: str) -> Tensor:
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def is_scalar(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, complex)


def normalize_dim(dim: int, ndim: int, op: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    lo, hi = -max(ndim, 1), max(ndim, 1) - 1
    if not lo <= dim <= hi:
        raise IndexError(f"{op}: dimension out of range (expected to be in range of [{lo}, {hi}], but got {dim})")
    return dim % max(ndim, 1)


def normalize_dims(dim, ndim: int, op: str) -> tuple:
    """``None`` means every dim; an int or a sequence of ints otherwise. Sorted, no repeats."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = sorted(normalize_dim(d, ndim, op) for d in dims)
    if len(set(out)) != len(out):
        raise RuntimeError(f"{op}: dim {dim} appears multiple times in the list of dims")
    return tuple(out) if ndim > 0 else ()
