"""Helpers shared by the op modules: argument checks, output allocation and dense copies."""
from __future__ import annotations

import numbers

import numpy as np
import torch

from .. import runtime
from ..kernels import elementwise as KE
from ..tensor import Tensor

REDUCTIONS = ("none", "mean", "sum")  # the losses' ``reduction`` values


def new(shape, dtype) -> Tensor:
    """A fresh contiguous tensor (uninitialised)."""
    return Tensor(runtime.empty(tuple(shape), dtype))


def check_tensor(x, name: str, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise argument_error(x, name, op)
    return x


def argument_error(x, name: str, op: str, expected: str = "a flame Tensor") -> TypeError:
    """The TypeError for argument ``name`` of ``op`` that is not ``expected``; a torch.Tensor or a
    numpy.ndarray (the usual mistake) is named as such, with the call that converts it."""
    if isinstance(x, torch.Tensor):
        got = ("torch.Tensor: flame ops take flame Tensors; wrap it with flame.from_torch(t) (no copy; t "
               "must be on flame's device) or copy it with flame.tensor(t)")
    elif isinstance(x, np.ndarray):
        got = "numpy.ndarray: flame ops take flame Tensors; copy it to the device with flame.tensor(a)"
    else:
        got = type(x).__name__
    return TypeError(f"{op}: {name} must be {expected}, got {got}")


def dense(buf):
    """A contiguous copy of the buffer ``buf`` (one copy-kernel pass)."""
    out = runtime.empty(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def check_float_input(x, name: str, op: str) -> Tensor:
    """``x`` when it is a floating-point flame Tensor, else the TypeError naming ``op`` and ``name``."""
    check_tensor(x, name, op)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point {name}, got dtype {x.dtype}")
    return x


def check_reduction(reduction, op: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


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
