"""fp8 weights for frozen layers: ``Fp8Weight``, ``quantize_fp8``, ``dequantize_fp8``, ``requantize_fp8_``.

An ``Fp8Weight`` is a frozen (out, in) weight stored as float8_e4m3fn codes with one fp32 scale per
output channel (``W ~ scale[:, None] * codes``): half the memory of bf16. ``linear`` and
``lora_linear`` take it as their weight and read the codes inside their GEMMs (decoded in
registers; the scale on the output columns in the forward, on the reduction rows in the input
gradient, ``kernels.matmul.Fusion``). It never has a gradient: requiring one is refused. Formats
(``FORMATS``): "fp8_e4m3" only. Quantisation rounds to nearest, ties to even, saturating at +-448
(``kernels/quant.py``).
"""
from __future__ import annotations

import torch

from .. import runtime
from ..autograd import no_grad
from ..kernels import elementwise as KE
from ..kernels import quant as KQ
from ..tensor import FLOAT_DTYPES, Tensor
from ._util import check_tensor

FP8 = torch.float8_e4m3fn
FORMATS = {"fp8_e4m3": FP8}  # weight format name -> storage dtype
SCALES = ("absmax", "one")


class Fp8Weight(Tensor):
    """A frozen weight (out, in) as e4m3fn codes (the tensor's own buffer, dtype float8_e4m3fn) and
    ``scale``, an fp32 (out,) buffer: ``W[n, k] ~ scale[n] * codes[n, k]``. Made by
    ``quantize_fp8``; ``dequantize()`` gives W back (rounded). ``requires_grad`` is always False.
    ``w8a8`` (False by default): ``linear`` and ``lora_linear`` round their input to e4m3 per row for
    the forward product over this weight (W8A8: the fp8 tensor cores; the input gradient and a LoRA
    branch still read the unrounded input)."""

    __slots__ = ("scale", "w8a8")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, w8a8: bool = False):
        super().__init__(codes, requires_grad=False)
        self.scale = scale
        self.w8a8 = w8a8

    @property
    def requires_grad(self) -> bool:
        return False

    @requires_grad.setter
    def requires_grad(self, value: bool):
        if value:
            raise RuntimeError(f"an fp8 weight ({tuple(self.shape)}, float8_e4m3fn codes with per-channel scales) "
                               "is frozen and cannot require gradients: no weight gradient is computed for a "
                               "quantised weight (train LoRA adapters on it, or leave the layer unquantised)")

    def dequantize(self, dtype=torch.float32) -> Tensor:
        """``scale[:, None] * codes`` as a new tensor of ``dtype`` (no gradient)."""
        return dequantize_fp8(self, dtype)

    def __repr__(self):
        return f"Fp8Weight(shape={self.shape}, dtype=float8_e4m3fn, scale=fp32 per output channel)"


def _check_scale_mode(scale, op):
    if scale not in SCALES:
        raise ValueError(f"{op}: scale must be one of {list(SCALES)}, got {scale!r}")


def quantize_fp8(weight, scale: str = "absmax") -> Fp8Weight:
    """``weight`` (out, in) as an ``Fp8Weight``.

    ``scale="absmax"``: each output channel's scale is its largest magnitude / 448 (1 for a zero
    row), so the row uses e4m3's whole range. ``scale="one"``: scale 1, for weights whose values are
    e4m3 numbers already (a ``*_fp8_e4m3fn.safetensors`` checkpoint decoded by ``flame.io``: stored
    exactly; other values round to e4m3 and saturate at +-448). A ``weight`` of dtype
    float8_e4m3fn (codes as such files hold them) is taken as it is, scale 1. The result is a
    constant: a weight that requires grad is refused (freeze it first)."""
    op = "quantize_fp8"
    check_tensor(weight, "weight", op)
    _check_scale_mode(scale, op)
    if weight.ndim != 2:
        raise ValueError(f"{op}: weight must be 2-D (out_features, in_features), got shape {weight.shape}")
    if weight.dtype != FP8 and weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: weight must be float32, float16, bfloat16, float64 or float8_e4m3fn, "
                        f"got {weight.dtype}")
    if isinstance(weight, Fp8Weight):
        raise TypeError(f"{op}: weight is an Fp8Weight already")
    if weight.requires_grad:
        raise ValueError(f"{op}: weight {weight.shape} requires grad; an fp8 weight is frozen (no gradient "
                         "reaches it): call requires_grad_(False) on it first")
    n, k = weight.shape
    codes = runtime.empty((n, k), FP8)
    scales = runtime.empty((n,), torch.float32)
    if weight.dtype == FP8:  # codes as stored: copied as bytes, scale 1
        KE.copy_(KQ.as_codes(codes), KQ.as_codes(weight._data))
        KE.fill_(scales, 1.0)
    else:
        KQ.quantize_rows_(codes, scales, weight._data, absmax=scale == "absmax")
    return Fp8Weight(codes, scales)


def dequantize_fp8(weight: Fp8Weight, dtype=torch.float32) -> Tensor:
    """``weight.scale[:, None] * codes`` (out, in) in ``dtype`` (a float dtype), a new tensor."""
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"dequantize_fp8: weight must be an Fp8Weight, got {type(weight).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize_fp8: dtype must be a float dtype {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
    out = runtime.empty(tuple(weight.shape), dtype)
    return Tensor(KQ.dequantize_rows_(out, weight._data, weight.scale))


@no_grad()
def requantize_fp8_(weight: Fp8Weight, values: Tensor) -> Fp8Weight:
    """Store ``values`` (a float tensor of ``weight``'s shape) into ``weight`` in place: new codes
    and new absmax scales (a LoRA merged into or taken out of an fp8 base). Returns ``weight``."""
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"requantize_fp8_: weight must be an Fp8Weight, got {type(weight).__name__}")
    check_tensor(values, "values", "requantize_fp8_")
    if values.shape != weight.shape or values.dtype not in FLOAT_DTYPES:
        raise ValueError(f"requantize_fp8_: values must be a float tensor of shape {weight.shape}, got "
                         f"{values.dtype} {values.shape}")
    KQ.quantize_rows_(weight._data, weight.scale, values._data)
    return weight


def weight_scale(weight):
    """The per-output-channel scale buffer of an ``Fp8Weight`` (what the GEMMs take with its
    codes), None for any other weight."""
    return weight.scale if isinstance(weight, Fp8Weight) else None


def check_not_raw_fp8(weight, op: str) -> None:
    """A clear error for float8 codes passed as a weight without their scale."""
    if weight.dtype == FP8 and not isinstance(weight, Fp8Weight):
        raise TypeError(f"{op}: weight is a float8_e4m3fn tensor without scales: make it an Fp8Weight with "
                        "flame.ops.quant.quantize_fp8 (codes as stored in a *_fp8_e4m3fn file: scale 1)")
