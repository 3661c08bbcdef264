"""The DDPM noise schedule SDXL was trained with, and the training-time helpers built on it.

``DDPMSchedule()`` is diffusers' ``DDPMScheduler`` training side for SDXL: 1000 steps of
scaled-linear betas, ``betas = linspace(sqrt(0.00085), sqrt(0.012), 1000) ** 2`` (``"linear"``:
``linspace(beta_start, beta_end, T)``), ``alpha_bar_t = prod_{s <= t} (1 - beta_s)``. The table is
a constant: it is computed once on the host in float64 and kept on the device in fp32, one row per
quantity (``alpha_bar``, ``sqrt(alpha_bar)``, ``sqrt(1 - alpha_bar)``, ``snr = alpha_bar / (1 -
alpha_bar)``), so one gather kernel gives every coefficient a batch of timesteps needs.

Training formulas (diffusers' DDPMScheduler and training scripts), all flame ops on the device:

- ``add_noise``: ``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise``;
- ``target``: epsilon-prediction -> ``noise``, v-prediction -> ``sqrt(abar) noise - sqrt(1 - abar) x0``,
  sample-prediction -> ``x0``;
- ``min_snr_weights``: ``min(snr, gamma) / snr`` (epsilon), ``min(snr, gamma) / (snr + 1)`` (v),
  ``min(snr, gamma)`` (sample);
- ``sample_noise``: ``randn(shape) + offset * randn(B, C, 1, 1)`` (noise offset);
- ``sample_timesteps``: integers in ``[low, high)`` from flame's Philox generator: ``low + u (high -
  low)`` for ``u`` uniform in [0, 1) or logit-normal (``sigmoid(mean + std * randn)``, as SD3), then
  optionally shifted towards noise, ``u' = shift u / (1 + (shift - 1) u)``;
- ``rescale_zero_terminal_snr``: the betas rescaled so that the last timestep is pure noise (Lin et
  al. 2023, Algorithm 1: ``sqrt(abar)`` shifted and scaled to end at 0, its start unchanged);
- ``debiased_weights``: ``1 / sqrt(snr)`` (v: ``1 / (snr + 1)``), snr capped at 1000.

The losses themselves are in ``flame.diffusion.losses``.

Timesteps are integer tensors. Lookups check that every timestep lies in ``[0, T)`` (a host
transfer); ``check=False`` skips that for timesteps that are in range by construction, such as
those from ``sample_timesteps``, so a training step does not wait on the host.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from .. import runtime
from ..kernels import copy as KC
from ..ops.creation import rand, randn, tensor
from ..ops.elementwise import add, clamp, div, mul, rsqrt, sigmoid, sub, to
from ..ops.index import index_select
from ..tensor import Tensor

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
BETA_SCHEDULES = ("scaled_linear", "linear")
TIMESTEP_DISTRIBUTIONS = ("uniform", "logit_normal")


class Coefficients(NamedTuple):
    """Per-sample schedule values for a batch of timesteps: four fp32 (B,) tensors."""

    alpha_bar: Tensor
    sqrt_alpha_bar: Tensor
    sqrt_one_minus_alpha_bar: Tensor
    snr: Tensor


def _check_prediction_type(prediction_type):
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
    return prediction_type


def make_betas(num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012,
               beta_schedule: str = "scaled_linear") -> np.ndarray:
    """The (T,) float64 betas of a schedule, computed on the host (a constant of the schedule):
    ``"scaled_linear"``: ``linspace(sqrt(beta_start), sqrt(beta_end), T) ** 2``; ``"linear"``:
    ``linspace(beta_start, beta_end, T)``. Shared by the training schedule and the samplers."""
    if not isinstance(num_train_timesteps, numbers.Integral) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be a positive int, got {num_train_timesteps!r}")
    if beta_schedule not in BETA_SCHEDULES:
        raise ValueError(f"beta_schedule must be one of {BETA_SCHEDULES}, got {beta_schedule!r}")
    if not 0.0 < beta_start <= beta_end < 1.0:
        raise ValueError(f"betas must satisfy 0 < beta_start <= beta_end < 1, got {beta_start}, {beta_end}")
    if beta_schedule == "scaled_linear":
        return np.linspace(math.sqrt(beta_start), math.sqrt(beta_end), int(num_train_timesteps)) ** 2
    return np.linspace(beta_start, beta_end, int(num_train_timesteps))


def rescale_zero_terminal_snr(alphas_cumprod: np.ndarray) -> np.ndarray:
    """``alpha_bar`` (float64) rescaled so that the last timestep has zero SNR (pure noise) and the
    first is unchanged: ``sqrt(alpha_bar)`` shifted by its last value and scaled back to its first
    (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", Algorithm 1)."""
    root = np.sqrt(np.asarray(alphas_cumprod, dtype=np.float64))
    first, last = root[0], root[-1]
    return ((root - last) * (first / (first - last))) ** 2


class DDPMSchedule:
    """The forward (noising) process of a DDPM with a fixed beta schedule (SDXL's by default);
    ``rescale_betas_zero_snr``: rescaled to a zero terminal SNR (train with v-prediction then)."""

    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012,
                 beta_schedule: str = "scaled_linear", rescale_betas_zero_snr: bool = False):
        betas = make_betas(num_train_timesteps, beta_start, beta_end, beta_schedule)
        self.num_train_timesteps = int(num_train_timesteps)
        self.beta_start, self.beta_end, self.beta_schedule = float(beta_start), float(beta_end), beta_schedule
        self.rescale_betas_zero_snr = bool(rescale_betas_zero_snr)
        abar = np.cumprod(1.0 - betas)
        if self.rescale_betas_zero_snr:
            abar = rescale_zero_terminal_snr(abar)
            betas = 1.0 - abar / np.concatenate([[1.0], abar[:-1]])
        rows = np.stack([abar, np.sqrt(abar), np.sqrt(1.0 - abar), abar / (1.0 - abar)]).astype(np.float32)
        self._table = tensor(rows)  # (4, T) fp32 on the device
        self.betas = tensor(betas.astype(np.float32))

    @classmethod
    def from_config(cls, config: dict) -> DDPMSchedule:
        """From a diffusers ``scheduler/scheduler_config.json`` dict (other keys are ignored)."""
        keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "rescale_betas_zero_snr")
        return cls(**{k: config[k] for k in keys if k in config})

    @property
    def alphas_cumprod(self) -> Tensor:
        """``alpha_bar`` for every timestep: an fp32 (T,) device tensor (diffusers' ``alphas_cumprod``)."""
        return Tensor(self._table._data[0])

    # ---- lookups ---------------------------------------------------------------------------
    def _index(self, timesteps) -> Tensor:
        if not isinstance(timesteps, Tensor):
            timesteps = tensor(np.asarray(timesteps, dtype=np.int64).reshape(-1))
        if timesteps.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"timesteps must be an int64 or int32 tensor, got {timesteps.dtype}")
        if timesteps.ndim > 1:
            raise ValueError(f"timesteps must be a 0-d or 1-d tensor, got shape {timesteps.shape}")
        return timesteps.reshape(-1)

    def coefficients(self, timesteps, check: bool = True) -> Coefficients:
        """``alpha_bar``, its square root, ``sqrt(1 - alpha_bar)`` and the SNR at each timestep
        (fp32, shape (B,)), from one gather. ``check=False``: the caller guarantees 0 <= t < T."""
        t = self._index(timesteps)
        if check:
            rows = index_select(self._table, 1, t)
        else:
            rows = Tensor(runtime.empty((4, t.numel()), torch.float32))
            KC.gather_(rows._data, self._table._data, t._data, (self.num_train_timesteps, 0), (0, t.stride(0)), 1)
        return Coefficients(*(Tensor(rows._data[i]) for i in range(4)))

    def snr(self, timesteps, check: bool = True) -> Tensor:
        """``alpha_bar / (1 - alpha_bar)`` at each timestep, fp32 (B,)."""
        return self.coefficients(timesteps, check).snr

    # ---- the forward process ---------------------------------------------------------------
    def add_noise(self, original_samples: Tensor, noise: Tensor, timesteps, check: bool = True) -> Tensor:
        """``sqrt(abar_t) x0 + sqrt(1 - abar_t) noise`` with one timestep per sample (dim 0)."""
        c = self.coefficients(timesteps, check)
        a, b = _per_sample(original_samples, noise, c.sqrt_alpha_bar, c.sqrt_one_minus_alpha_bar, "add_noise")
        return add(mul(a, original_samples), mul(b, noise))

    def get_velocity(self, sample: Tensor, noise: Tensor, timesteps, check: bool = True) -> Tensor:
        """The v-prediction target ``sqrt(abar_t) noise - sqrt(1 - abar_t) x0``."""
        c = self.coefficients(timesteps, check)
        a, b = _per_sample(sample, noise, c.sqrt_alpha_bar, c.sqrt_one_minus_alpha_bar, "get_velocity")
        return sub(mul(a, noise), mul(b, sample))

    def target(self, original_samples: Tensor, noise: Tensor, timesteps, prediction_type: str = "epsilon",
               check: bool = True) -> Tensor:
        """What the model learns to predict: ``noise`` (epsilon), the velocity (v_prediction) or
        ``x0`` (sample)."""
        _check_prediction_type(prediction_type)
        if prediction_type == "epsilon":
            return noise
        if prediction_type == "sample":
            return original_samples
        return self.get_velocity(original_samples, noise, timesteps, check)

    def __repr__(self):
        return (f"DDPMSchedule(num_train_timesteps={self.num_train_timesteps}, beta_start={self.beta_start}, "
                f"beta_end={self.beta_end}, beta_schedule={self.beta_schedule!r}, "
                f"rescale_betas_zero_snr={self.rescale_betas_zero_snr})")


def _per_sample(x, noise, a, b, op):
    """The (B,) coefficients as (B, 1, ..., 1) in x's dtype, after checking x and noise agree."""
    for name, v in (("sample", x), ("noise", noise)):
        if not isinstance(v, Tensor) or not v.dtype.is_floating_point:
            raise TypeError(f"{op}: {name} must be a floating-point flame Tensor, got "
                            f"{getattr(v, 'dtype', type(v).__name__)}")
    if x.shape != noise.shape:
        raise ValueError(f"{op}: sample {x.shape} and noise {noise.shape} must have the same shape")
    if x.ndim == 0 or x.shape[0] != a.numel():
        raise ValueError(f"{op}: {a.numel()} timestep(s) for a batch of shape {x.shape}")
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return to(a.reshape(shape), x.dtype), to(b.reshape(shape), x.dtype)


def min_snr_weights(snr: Tensor, gamma: float, prediction_type: str = "epsilon") -> Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023, as diffusers' and kohya's trainers):
    ``min(snr, gamma) / snr`` for epsilon, ``min(snr, gamma) / (snr + 1)`` for v-prediction and
    ``min(snr, gamma)`` for sample prediction."""
    _check_prediction_type(prediction_type)
    if not isinstance(gamma, numbers.Real) or isinstance(gamma, bool) or not gamma > 0:
        raise ValueError(f"min_snr_weights: gamma must be a positive number, got {gamma!r}")
    clipped = clamp(snr, max=float(gamma))
    if prediction_type == "epsilon":
        return div(clipped, snr)
    if prediction_type == "v_prediction":
        return div(clipped, add(snr, 1.0))
    return clipped


def debiased_weights(snr: Tensor, prediction_type: str = "epsilon") -> Tensor:
    """Debiased-estimation loss weights (Yu et al. 2024, as kohya's ``--debiased_estimation_loss``):
    ``1 / sqrt(snr)`` for epsilon and sample prediction, ``1 / (snr + 1)`` for v-prediction, with
    ``snr`` capped at 1000 (the lowest timesteps would otherwise get weights near 0)."""
    _check_prediction_type(prediction_type)
    capped = clamp(snr, max=1000.0)
    if prediction_type == "v_prediction":
        return div(1.0, add(capped, 1.0))
    return rsqrt(capped)


def _check_fraction_args(distribution, logit_std, shift, op):
    if distribution not in TIMESTEP_DISTRIBUTIONS:
        raise ValueError(f"{op}: distribution must be one of {TIMESTEP_DISTRIBUTIONS}, got {distribution!r}")
    if not shift > 0 or not logit_std >= 0:
        raise ValueError(f"{op}: need shift > 0 and logit_std >= 0, got {shift!r}, {logit_std!r}")


def sample_fraction(batch_size: int, rows=None, distribution: str = "uniform", logit_mean: float = 0.0,
                    logit_std: float = 1.0, shift: float = 1.0) -> Tensor:
    """``batch_size`` fp32 values ``u`` in [0, 1) from flame's Philox generator, on the device:
    uniform, or ``sigmoid(logit_mean + logit_std * randn)`` for ``"logit_normal"`` (SD3); a
    ``shift`` other than 1 maps ``u`` to ``shift u / (1 + (shift - 1) u)`` (above 1: more noise).
    The noise level both objectives draw: DDPM timesteps scale it to integers, flow matching uses
    it as sigma. ``rows=(start, total)``: samples ``start:start + batch_size`` of a batch of
    ``total`` (one data-parallel rank's part; see ``flame.rand``)."""
    if not isinstance(batch_size, numbers.Integral) or batch_size < 0:
        raise ValueError(f"sample_fraction: batch_size must be a non-negative int, got {batch_size!r}")
    _check_fraction_args(distribution, logit_std, shift, "sample_fraction")
    if distribution == "uniform":
        u = rand(int(batch_size), rows=rows)
    else:
        u = sigmoid(add(mul(randn(int(batch_size), rows=rows), float(logit_std)), float(logit_mean)))
    if shift != 1.0:
        u = div(mul(u, float(shift)), add(mul(u, float(shift) - 1.0), 1.0))
    return u


def sample_timesteps(batch_size: int, low: int = 0, high: int = 1000, rows=None, distribution: str = "uniform",
                     logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 1.0) -> Tensor:
    """``batch_size`` int64 timesteps in ``[low, high)`` from flame's Philox generator, computed on
    the device (no host sync): ``low + u (high - low)``, truncated and clamped, with ``u`` from
    ``sample_fraction`` (uniform or logit-normal, optionally shifted)."""
    if not isinstance(batch_size, numbers.Integral) or batch_size < 0:
        raise ValueError(f"sample_timesteps: batch_size must be a non-negative int, got {batch_size!r}")
    if not (isinstance(low, numbers.Integral) and isinstance(high, numbers.Integral) and 0 <= low < high):
        raise ValueError(f"sample_timesteps: need integers 0 <= low < high, got low={low!r}, high={high!r}")
    _check_fraction_args(distribution, logit_std, shift, "sample_timesteps")
    u = sample_fraction(batch_size, rows, distribution, logit_mean, logit_std, shift)
    t = to(add(mul(u, float(high - low)), float(low)), torch.int64)
    return clamp(t, int(low), int(high) - 1)  # u * n may round up to n in fp32


def sample_noise(shape, offset: float = 0.0, dtype=torch.float32, rows=None) -> Tensor:
    """Standard normal noise of ``shape`` (B, C, ...) plus ``offset * randn(B, C, 1, ...)`` when
    ``offset`` is non-zero (the "noise offset" that lets a model learn overall brightness).
    ``rows``: as in ``sample_timesteps``."""
    shape = tuple(shape)
    noise = randn(*shape, dtype=dtype, rows=rows)
    if not offset:
        return noise
    if len(shape) < 3:
        raise ValueError(f"sample_noise: a noise offset needs (B, C, ...) shapes, got {shape}")
    per_channel = randn(*shape[:2], *(1,) * (len(shape) - 2), dtype=dtype, rows=rows)
    return add(noise, mul(per_channel, float(offset)))
