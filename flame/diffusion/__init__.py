"""Diffusion training utilities: the DDPM noise schedule, targets, loss weights and noise sampling."""
from .schedule import (
    BETA_SCHEDULES,
    PREDICTION_TYPES,
    Coefficients,
    DDPMSchedule,
    min_snr_weights,
    sample_noise,
    sample_timesteps,
    weighted_mse_loss,
)
