"""In-place initialisers with ``torch.nn.init``'s names, formulas and defaults.

Random values come from flame's Philox generator (``flame.manual_seed``), so they are
reproducible under a seed but not bit-equal to PyTorch's. Every function writes through a Triton
kernel outside the graph and returns its argument; a tensor without storage (``device="meta"``) is
left as it is.
"""
from __future__ import annotations

import contextlib
import math

from .. import runtime
from ..kernels import elementwise as KE
from ..kernels import random as KR
from ..ops.creation import draw
from ..tensor import Tensor

_skipping = 0


@contextlib.contextmanager
def skip_init():
    """Inside, the initialisers leave tensors as allocated (uninitialised) and draw no random
    numbers: for building a model whose every parameter is then loaded from a checkpoint."""
    global _skipping
    _skipping += 1
    try:
        yield
    finally:
        _skipping -= 1


def _check(t, fn):
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: expected a flame Tensor, got {type(t).__name__}")
    return t


def _random_into(t, dist, a, b):
    if not t.dtype.is_floating_point:
        raise TypeError(f"random init needs a floating-point tensor, got {t.dtype}")
    if t.numel() == 0 or _skipping or t._data.is_meta:
        return t
    buf = t._data
    dst = buf if buf.is_contiguous() else runtime.empty(tuple(buf.shape), buf.dtype)
    KR.random_(dst, dist, *draw(t.numel()), a, b)
    if dst is not buf:
        KE.copy_(buf, dst)
    return t


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    return _random_into(_check(tensor, "uniform_"), KR.UNIFORM, float(a), float(b))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    return _random_into(_check(tensor, "normal_"), KR.NORMAL, float(mean), float(std))


def constant_(tensor: Tensor, val: float) -> Tensor:
    if not _skipping and not _check(tensor, "constant_")._data.is_meta:
        KE.fill_(tensor._data, val)
    return tensor


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


def calculate_gain(nonlinearity: str, param=None) -> float:
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
    if nonlinearity in linear or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif not isinstance(param, bool) and isinstance(param, (int, float)):
            slope = param
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor):
    if tensor.ndim < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions")
    receptive = math.prod(tensor.shape[2:]) if tensor.ndim > 2 else 1
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _fan(tensor, mode):
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    _check(tensor, "kaiming_uniform_")
    if 0 in tensor.shape:
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    _check(tensor, "kaiming_normal_")
    if 0 in tensor.shape:
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    return normal_(tensor, 0.0, std)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(_check(tensor, "xavier_uniform_"))
    a = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return uniform_(tensor, -a, a)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(_check(tensor, "xavier_normal_"))
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)))
