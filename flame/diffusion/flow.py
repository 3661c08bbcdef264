"""Rectified-flow (flow-matching) training, as Flux.1 and SD3 are trained.

With ``s`` in [0, 1] the noise level ("sigma", the model's ``timestep``):

- ``flow_noisy``: ``x_s = (1 - s) x0 + s e`` (a straight line from data to noise);
- ``flow_target``: the velocity the model predicts, ``e - x0``;
- ``sample_sigmas``: ``s`` uniform or logit-normal (``sample_fraction``, shared with the DDPM
  timesteps), shifted by ``shift s / (1 + (shift - 1) s)``;
- ``resolution_shift``: Flux's resolution-dependent shift. diffusers' FluxPipeline and BFL's
  sampler take ``mu`` linear in the number of image tokens, from 0.5 at 256 tokens to 1.15 at 4096,
  and map ``s`` to ``e^mu / (e^mu + 1/s - 1)``, which is the shift above with ``shift = e^mu``;
- ``flow_loss_weights``: SD3's weighting schemes (diffusers' ``compute_loss_weighting_for_sd3``):
  ``"none"`` (ones), ``"sigma_sqrt"`` (``1 / s^2``, SD3's "sigma_sqrt") and ``"cosmap"``
  (``2 / (pi (1 - 2 s + 2 s^2))``).

Everything runs on the device from flame's generator; no host sync.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..ops.elementwise import add, clamp, div, mul, sub, to
from ..tensor import Tensor
from .schedule import _per_sample, sample_fraction

WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap")


def resolution_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                     max_shift: float = 1.15) -> float:
    """The shift ``e^mu`` of Flux's resolution-dependent schedule for ``image_seq_len`` tokens
    (``mu`` linear through (base_seq_len, base_shift) and (max_seq_len, max_shift), as diffusers'
    ``calculate_shift``): 1024² (4096 tokens) gives e^1.15 = 3.16, 512² (1024) e^0.6125 = 1.85."""
    if not isinstance(image_seq_len, numbers.Integral) or image_seq_len < 1:
        raise ValueError(f"resolution_shift: image_seq_len must be a positive int, got {image_seq_len!r}")
    if max_seq_len == base_seq_len:
        raise ValueError("resolution_shift: max_seq_len and base_seq_len must differ")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return math.exp(base_shift + slope * (image_seq_len - base_seq_len))


def sample_sigmas(batch_size: int, rows=None, distribution: str = "uniform", logit_mean: float = 0.0,
                  logit_std: float = 1.0, shift: float = 1.0) -> Tensor:
    """``batch_size`` fp32 noise levels in [0, 1) (see ``sample_fraction``; ``shift`` may come
    from ``resolution_shift``)."""
    return sample_fraction(batch_size, rows, distribution, logit_mean, logit_std, shift)


def flow_noisy(x0: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """``(1 - s) x0 + s e`` per sample, in ``x0``'s dtype."""
    one_minus, s = _per_sample(x0, noise, sub(1.0, sigmas), sigmas, "flow_noisy")
    return add(mul(x0, one_minus), mul(noise, s))


def flow_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The velocity ``e - x0``."""
    if x0.shape != noise.shape:
        raise ValueError(f"flow_target: sample {x0.shape} and noise {noise.shape} must have the same shape")
    return sub(noise, x0)


def flow_loss_weights(sigmas: Tensor, scheme: str = "none") -> Tensor | None:
    """Per-sample fp32 loss weights of SD3's ``scheme`` (None for ``"none"``: no weighting).
    ``"sigma_sqrt"`` divides by ``s^2`` with ``s`` kept at 1e-3 or above, so a draw of 0 stays
    finite."""
    if scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"flow_loss_weights: scheme must be one of {WEIGHTING_SCHEMES}, got {scheme!r}")
    if scheme == "none":
        return None
    s = to(sigmas, torch.float32)
    if scheme == "sigma_sqrt":
        s = clamp(s, min=1e-3)
        return div(1.0, mul(s, s))
    bottom = add(sub(1.0, mul(s, 2.0)), mul(mul(s, s), 2.0))
    return div(2.0 / math.pi, bottom)
