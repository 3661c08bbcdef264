"""What a training step optimises: the noise levels it draws, the noised input and the target, and
the weighted loss. One class per kind of model; a model family (``flame.train.families``) picks one.

- ``DDPMObjective`` (SDXL): integer timesteps of a DDPM schedule, epsilon or v-prediction targets,
  min-SNR and debiased-estimation weights, Huber thresholds per timestep.
- ``FlowObjective`` (Flux): rectified flow, noise levels ``s`` in [0, 1), ``x_s = (1 - s) x0 + s e``,
  the velocity target ``e - x0``, SD3's weighting schemes; the shift may follow the image's token
  count (Flux's resolution-dependent shift).

``draw`` runs outside the captured step (it draws random numbers); ``loss`` runs inside it (device
work only: no host sync, no random draws).
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..diffusion import (
    DDPMSchedule,
    debiased_weights,
    diffusion_loss,
    flow_loss_weights,
    flow_noisy,
    flow_target,
    huber_c_per_timestep,
    min_snr_weights,
    resolution_shift,
    sample_sigmas,
    sample_timesteps,
)
from ..ops.elementwise import mul
from .errors import ConfigError


def _times(weights, more):
    return more if weights is None else weights if more is None else mul(weights, more)


class DDPMObjective:
    """Noise prediction on a DDPM schedule (``diffusion`` config section; the schedule from the
    checkpoint's ``scheduler/`` folder when it has one)."""

    def __init__(self, diffusion_cfg, model_path=None, log=print):
        self.cfg = d = diffusion_cfg
        self.schedule = self._schedule(d, model_path, log)
        if d.timestep_max > self.schedule.num_train_timesteps:
            raise ConfigError(f"diffusion.timestep_max ({d.timestep_max}) exceeds the noise schedule's "
                              f"{self.schedule.num_train_timesteps} timesteps")

    @staticmethod
    def _schedule(d, path, log):
        """The checkpoint's own scheduler config when it has one (pipeline folder), else SDXL's;
        rescaled to a zero terminal SNR when diffusion.zero_terminal_snr or that config asks."""
        sched, source = {}, None
        if path and os.path.isdir(path):
            for candidate in (os.path.join(path, "scheduler", "scheduler_config.json"),
                              os.path.join(path, "..", "scheduler", "scheduler_config.json")):
                if os.path.isfile(candidate):
                    with open(candidate) as f:
                        sched, source = json.load(f), candidate
                    kind = sched.get("prediction_type", "epsilon")
                    if kind != d.prediction_type:
                        log(f"warning: {candidate} says prediction_type={kind}, the config trains {d.prediction_type}")
                    break
        zero_snr = bool(sched.get("rescale_betas_zero_snr")) or d.zero_terminal_snr
        if zero_snr and d.prediction_type != "v_prediction":
            raise ConfigError(f"diffusion.prediction_type: {source} has a zero terminal SNR "
                              "(rescale_betas_zero_snr), where only v_prediction has a target to learn: set "
                              "diffusion.prediction_type=v_prediction")
        return DDPMSchedule.from_config({**sched, "rescale_betas_zero_snr": zero_snr})

    def draw(self, shape, rows):
        """Timesteps (int64) for a micro-batch of latents of ``shape`` (this rank's ``rows``)."""
        d = self.cfg
        return sample_timesteps(shape[0], d.timestep_min, d.timestep_max, rows=rows, distribution=d.timestep_sampling,
                                logit_mean=d.logit_mean, logit_std=d.logit_std, shift=d.timestep_shift)

    def validation_levels(self, n: int) -> np.ndarray:
        """``n`` evenly spaced timesteps over [timestep_min, timestep_max): the same for every validation."""
        d = self.cfg
        span = d.timestep_max - d.timestep_min
        return (d.timestep_min + (np.arange(n) + 0.5) * span // n).astype(np.int64)

    def loss(self, predict, latents, noise, timesteps, input_noise=None, sample_weights=None):
        """``diffusion.loss_type`` between ``predict(noisy)`` and the target, weighted per sample by
        min-SNR / debiased estimation when set and by ``sample_weights``. The input is noised with
        ``input_noise`` when given (input perturbation), the target with ``noise``."""
        d, sched = self.cfg, self.schedule
        noisy = sched.add_noise(latents, noise if input_noise is None else input_noise, timesteps, check=False)
        target = sched.target(latents, noise, timesteps, d.prediction_type, check=False)
        pred = predict(noisy)
        weights = sample_weights
        if d.min_snr_gamma or d.debiased_estimation:
            snr = sched.snr(timesteps, check=False)
            if d.min_snr_gamma:
                weights = _times(weights, min_snr_weights(snr, d.min_snr_gamma, d.prediction_type))
            if d.debiased_estimation:
                weights = _times(weights, debiased_weights(snr, d.prediction_type))
        huber_c = None
        if d.loss_type in ("huber", "smooth_l1"):
            huber_c = huber_c_per_timestep(timesteps, sched, d.huber_schedule, d.huber_c, d.huber_scale, check=False)
        return diffusion_loss(pred, target, d.loss_type, weights, huber_c)


class FlowObjective:
    """Rectified flow (``diffusion`` config section: ``timestep_sampling``, ``logit_mean``/``std``,
    ``timestep_shift`` or ``resolution_shift``, ``weighting_scheme``, ``loss_type``). Latents are
    (B, C, h, w); the image token count for the resolution shift is (h / 2) (w / 2) (2x2 patches)."""

    def __init__(self, diffusion_cfg):
        self.cfg = diffusion_cfg

    def shift(self, shape) -> float:
        d = self.cfg
        return resolution_shift((shape[-2] // 2) * (shape[-1] // 2)) if d.resolution_shift else d.timestep_shift

    def draw(self, shape, rows):
        """Noise levels (fp32, [0, 1)) for a micro-batch of latents of ``shape``."""
        d = self.cfg
        return sample_sigmas(shape[0], rows=rows, distribution=d.timestep_sampling, logit_mean=d.logit_mean,
                             logit_std=d.logit_std, shift=self.shift(shape))

    def validation_levels(self, n: int) -> np.ndarray:
        """``n`` evenly spaced noise levels in (0, 1)."""
        return ((np.arange(n) + 0.5) / n).astype(np.float32)

    def loss(self, predict, latents, noise, sigmas, input_noise=None, sample_weights=None):
        d = self.cfg
        noisy = flow_noisy(latents, noise if input_noise is None else input_noise, sigmas)
        pred = predict(noisy)
        weights = _times(sample_weights, flow_loss_weights(sigmas, d.weighting_scheme))
        huber_c = d.huber_c * d.huber_scale if d.loss_type in ("huber", "smooth_l1") else None
        return diffusion_loss(pred, flow_target(latents, noise), d.loss_type, weights, huber_c)
