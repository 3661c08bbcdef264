"""Diffusion utilities: the DDPM noise schedule and rectified flow (flow matching), their targets, loss
weights and noise sampling for training; the samplers for inference (Euler, Euler ancestral, DPM++ 2M
Karras, DDIM; for Flux.1 flow Euler, DPM++ 2M and Heun)."""
from .flow import (
    WEIGHTING_SCHEMES,
    flow_loss_weights,
    flow_noisy,
    flow_target,
    resolution_shift,
    sample_sigmas,
)
from .losses import HUBER_SCHEDULES, LOSS_TYPES, diffusion_loss, huber_c_per_timestep, weighted_mse_loss
from .samplers import (
    FLOW_SAMPLERS,
    FLUX_SCHEDULER_CONFIG,
    SAMPLERS,
    SDXL_BASE_SCHEDULER_CONFIG,
    DDIMSampler,
    DPMSolverMultistepSampler,
    EulerAncestralSampler,
    EulerSampler,
    FlowDPMSolverSampler,
    FlowEulerSampler,
    FlowHeunSampler,
    Sampler,
    make_sampler,
)
from .schedule import (
    BETA_SCHEDULES,
    PREDICTION_TYPES,
    TIMESTEP_DISTRIBUTIONS,
    Coefficients,
    DDPMSchedule,
    debiased_weights,
    make_betas,
    min_snr_weights,
    rescale_zero_terminal_snr,
    sample_fraction,
    sample_noise,
    sample_timesteps,
)
