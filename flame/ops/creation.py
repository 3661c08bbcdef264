"""Tensor factories: from data, filled, sequences and random numbers."""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .. import runtime
from ..autograd import is_grad_enabled
from ..kernels import elementwise as KE
from ..kernels import random as KR
from ..tensor import SUPPORTED_DTYPES, Tensor, check_dtype

_generator = {"seed": 0x5EED, "offset": 0}
_substream = 0  # this process's stream of the generator (its rank in data-parallel training)
_GOLDEN = 0x9E3779B97F4A7C15  # spreads substreams over Philox keys


def manual_seed(seed: int) -> None:
    """Seed flame's Philox generator (random factories and dropout)."""
    if not isinstance(seed, numbers.Integral):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__}")
    _generator["seed"] = int(seed) & 0x7FFFFFFFFFFFFFFF
    _generator["offset"] = 0


def get_rng_state() -> dict:
    return dict(_generator)


def set_rng_state(state: dict) -> None:
    _generator.update(seed=int(state["seed"]), offset=int(state["offset"]))


def set_rng_substream(index: int) -> None:
    """Draw from substream ``index`` of the generator in this process (data-parallel rank ``index``):
    the Philox key mixes the seed with ``index`` (substream 0 is the plain seed), while the offset
    advances as in every other process. Processes that make the same draws keep one generator
    state, yet their dropout masks and other draws differ; draws of ``rows`` of a shared batch
    (``rand``, ``randn``) use the plain seed in every process."""
    global _substream
    if not isinstance(index, numbers.Integral) or index < 0:
        raise ValueError(f"set_rng_substream: index must be a non-negative int, got {index!r}")
    _substream = int(index)


def draw(n: int, shared: bool = False) -> tuple:
    """``(key, offset)`` for ``n`` numbers of flame's generator, advancing it: element ``i`` of the
    draw is Philox(key, offset + i). ``shared``: the key every process uses (the plain seed), not
    this process's substream."""
    runtime.graph_rule("random draw", "ops.creation.draw, under rand, randn, dropout, nn.init, ...")
    key = _generator["seed"]
    if _substream and not shared:
        key = (key + _substream * _GOLDEN) & 0x7FFFFFFFFFFFFFFF
    # Philox yields 4 numbers per counter; keep offsets 4-aligned so tensors never share counters.
    off = _generator["offset"]
    _generator["offset"] = off + ((n + 3) // 4) * 4
    return key, off


def _shape(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"shape entries must be non-negative ints, got {tuple(size)}")
    return tuple(int(s) for s in size)


def _size(size) -> tuple:
    """A shape given as an int or a sequence."""
    return _shape((size,) if isinstance(size, int) else (tuple(size),))


def _finish(data, requires_grad):
    return Tensor(data, requires_grad=requires_grad)


def empty(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    runtime.resolve_device(device)
    dtype = check_dtype(dtype or runtime.get_default_dtype())
    return _finish(runtime.empty(_shape(size), dtype), requires_grad)


def full(size, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    if dtype is None:
        if isinstance(fill_value, bool):
            dtype = torch.bool
        elif isinstance(fill_value, numbers.Integral):
            dtype = torch.int64
        else:
            dtype = runtime.get_default_dtype()
    out = empty(*_size(size), dtype=dtype, device=device)
    KE.fill_(out._data, fill_value)
    out.requires_grad = requires_grad
    return out


def zeros(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return full(_shape(size), 0, dtype=dtype or runtime.get_default_dtype(), device=device, requires_grad=requires_grad)


def ones(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return full(_shape(size), 1, dtype=dtype or runtime.get_default_dtype(), device=device, requires_grad=requires_grad)


def _random(size, dist, a, b, dtype, device, requires_grad, rows=None):
    dtype = check_dtype(dtype or runtime.get_default_dtype())
    if not dtype.is_floating_point:
        raise TypeError(f"random factories need a floating dtype, got {dtype}")
    out = empty(*size, dtype=dtype, device=device)
    if rows is None:
        key, offset = draw(out.numel())
    else:  # rows start:start + size[0] of a (total, *size[1:]) draw every process makes alike
        start, total = _rows(rows, size)
        row = math.prod(size[1:])
        key, offset = draw(total * row, shared=True)
        offset += start * row
    KR.random_(out._data, dist, key, offset, a, b)
    out.requires_grad = requires_grad
    return out


def _rows(rows, size):
    try:
        start, total = (int(v) for v in rows)
    except (TypeError, ValueError):
        raise TypeError(f"rows must be (start, total), got {rows!r}") from None
    if not size or not 0 <= start <= start + size[0] <= total:
        raise ValueError(f"rows=({start}, {total}) does not hold the {size[0] if size else 0} rows of a draw of "
                         f"shape {size}: need 0 <= start and start + rows <= total")
    return start, total


def rand(*size, dtype=None, device=None, requires_grad=False, rows=None) -> Tensor:
    """Uniform numbers in [0, 1) from flame's Philox generator. ``rows=(start, total)``: the rows
    ``start:start + size[0]`` of a draw of shape ``(total, *size[1:])`` that every process makes
    alike (a data-parallel rank's part of one global batch): the same numbers however the rows are
    split, and the generator advances by the whole draw."""
    return _random(_shape(size), KR.UNIFORM, 0.0, 1.0, dtype, device, requires_grad, rows)


def randn(*size, dtype=None, device=None, requires_grad=False, rows=None) -> Tensor:
    """Standard normal numbers from flame's Philox generator (``rows``: see ``rand``)."""
    return _random(_shape(size), KR.NORMAL, 0.0, 1.0, dtype, device, requires_grad, rows)


def uniform(size, low=0.0, high=1.0, dtype=None, requires_grad=False) -> Tensor:
    return _random(_size(size), KR.UNIFORM, low, high, dtype, None, requires_grad)


def normal(size, mean=0.0, std=1.0, dtype=None, requires_grad=False) -> Tensor:
    return _random(_size(size), KR.NORMAL, mean, std, dtype, None, requires_grad)


def _like(fn):
    def like(x: Tensor, *args, dtype=None, requires_grad=False, **kwargs):
        return fn(x.shape, *args, dtype=dtype or x.dtype, requires_grad=requires_grad, **kwargs)

    like.__name__ = fn.__name__ + "_like"
    like.__doc__ = f"``{fn.__name__}`` with the shape (and by default the dtype) of ``x``."
    return like


empty_like = _like(empty)
zeros_like = _like(zeros)
ones_like = _like(ones)
full_like = _like(full)
rand_like = _like(rand)
randn_like = _like(randn)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Values from ``start`` (inclusive) to ``end`` (exclusive) in steps of ``step``."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    n = max(0, math.ceil((end - start) / step))
    if dtype is None:
        is_int = all(isinstance(v, numbers.Integral) for v in (start, end, step))
        dtype = torch.int64 if is_int else runtime.get_default_dtype()
    out = empty(n, dtype=dtype, device=device)
    KR.arange_(out._data, start, step)
    out.requires_grad = requires_grad
    return out


def tensor(data, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Copy ``data`` (nested lists, numbers, NumPy arrays, torch or flame tensors) to the device.

    Python floats become the default dtype, ints int64 and bools bool; NumPy arrays and tensors
    keep their dtype unless ``dtype`` is given.
    """
    runtime.resolve_device(device)
    if isinstance(data, Tensor):
        src = data._data
    elif isinstance(data, torch.Tensor):
        src = data
    else:
        try:
            arr = np.asarray(data)
        except ValueError as e:
            raise TypeError(f"tensor: cannot build a tensor from ragged data ({e})") from None
        if arr.dtype == object:
            raise TypeError(f"tensor: cannot build a tensor from {type(data).__name__} holding mixed or ragged data")
        if not isinstance(data, np.ndarray) and arr.dtype == np.float64:
            arr = arr.astype(np.float32 if runtime.get_default_dtype() != torch.float64 else np.float64)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"tensor: unsupported data of NumPy dtype {arr.dtype}")
        if arr.dtype.kind == "u" or arr.dtype == np.int16 or arr.dtype == np.int8:
            arr = arr.astype(np.int64)
        src = torch.from_numpy(arr.copy())  # C order; keeps 0-d arrays 0-d
    if src.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"tensor: unsupported dtype {src.dtype}")
    if src.device.type == "cpu" and not isinstance(data, Tensor):  # on the interpreter flame's tensors are too
        runtime.graph_rule("host copy", "flame.tensor of host data")
    data_dev = src.detach().to(runtime.device, copy=True).contiguous()  # host transfer
    out = Tensor(data_dev)
    if dtype is not None and dtype != out.dtype:
        check_dtype(dtype)
        converted = empty(*out.shape, dtype=dtype)
        KE.copy_(converted._data, out._data)
        out = converted
    out.requires_grad = requires_grad
    return out


def from_torch(t: torch.Tensor, requires_grad: bool | None = None) -> Tensor:
    """Wrap a torch tensor without copying. It must live on flame's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(t).__name__}")
    if t.device != runtime.device:
        raise RuntimeError(f"from_torch: tensor is on {t.device} but flame runs on {runtime.device}")
    check_dtype(t.dtype)
    return Tensor(t.detach(), requires_grad=t.requires_grad if requires_grad is None else requires_grad)


def fill_(x: Tensor, value) -> Tensor:
    """In place: set every element of ``x`` to ``value`` (outside the graph)."""
    if x.requires_grad and x.is_leaf and is_grad_enabled():
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation")
    KE.fill_(x._data, value)
    return x


def zero_(x: Tensor) -> Tensor:
    return fill_(x, 0)
