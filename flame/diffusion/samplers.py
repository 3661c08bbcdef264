"""Inference samplers for SDXL and Flux.1, step for step the same as diffusers' schedulers.

``make_sampler(name, num_inference_steps, config, image_seq_len=None)`` builds one of

=================  ==============================================================================
``euler``          ``EulerDiscreteScheduler`` (Karras et al. 2022's Euler step in sigma space)
``euler_a``        ``EulerAncestralDiscreteScheduler`` (Euler to ``sigma_down``, plus ``sigma_up`` noise)
``dpmpp_2m``       ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
                   use_karras_sigmas=True, lower_order_final=True)``: "DPM++ 2M Karras"
``ddim``           ``DDIMScheduler`` with ``eta = 0`` (deterministic)
``flow_euler``     ``FlowMatchEulerDiscreteScheduler`` as ``FluxPipeline`` drives it
``flow_dpmpp_2m``  ``DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                   algorithm_type="dpmsolver++", solver_order=2)`` as ``FluxPipeline`` drives it
``flow_heun``      ``FlowMatchHeunDiscreteScheduler`` (Heun's method, a static shift only)
=================  ==============================================================================

from ``config``, a diffusers ``scheduler_config.json`` dict (default: SDXL base's,
``SDXL_BASE_SCHEDULER_CONFIG``, and Flux.1-dev's, ``FLUX_SCHEDULER_CONFIG``, for the ``flow_*``
samplers), the way ``Scheduler.from_config(pipe.scheduler.config)`` switches samplers in diffusers:
each sampler reads the keys its diffusers class takes (others are ignored; a key missing or null
gets that class's default) and the name fixes the settings that define it (for ``dpmpp_2m`` and
``flow_dpmpp_2m`` those above, as keyword arguments to ``from_config`` would). Read keys:

- all but ``flow_*``: ``num_train_timesteps``, ``beta_start``, ``beta_end``, ``beta_schedule`` (``scaled_linear``,
  ``linear``), ``trained_betas``, ``prediction_type`` (``epsilon``, ``v_prediction``, ``sample``),
  ``rescale_betas_zero_snr`` (Lin et al. 2023, Algorithm 1);
- euler, euler_a, ddim: ``timestep_spacing`` (``leading``, ``trailing``, ``linspace``), ``steps_offset``;
- euler: ``interpolation_type`` (``linear``, ``log_linear``), ``use_karras_sigmas``,
  ``use_exponential_sigmas``, ``sigma_min``, ``sigma_max``, ``timestep_type`` (``discrete``,
  ``continuous``), ``final_sigmas_type`` (``zero``, ``sigma_min``);
- dpmpp_2m: ``solver_type`` (``midpoint``, ``heun``), ``euler_at_final``, ``final_sigmas_type``,
  ``sigma_min``, ``sigma_max`` (its Karras sigmas span the whole training range, so the spacing
  keys do not apply, as in diffusers);
- ddim: ``clip_sample``, ``clip_sample_range``, ``set_alpha_to_one``.

Rectified flow (Flux.1, the ``flow_*`` samplers): no betas; the latents at noise level ``s`` in
[0, 1] are ``(1 - s) x0 + s eps``, the model predicts the velocity ``v = eps - x0`` and its
timestep is ``sampler.timesteps[i]``, ``1000 s`` (FluxPipeline hands the transformer ``t / 1000``);
``sampler.sigmas`` are the levels. A shift maps ``s`` to ``shift s / (1 + (shift - 1) s)``: the
config's static one or, with ``use_dynamic_shifting``, ``e^mu`` with ``mu`` linear in
``image_seq_len``, the image's tokens (``base_shift`` at ``base_image_seq_len`` tokens,
``max_shift`` at ``max_image_seq_len``: FluxPipeline's ``calculate_shift``; the config's values,
which diffusers' ``from_config`` keeps for FluxPipeline to read).

- ``flow_euler``: levels ``linspace(1, 1/n, n)`` shifted by ``shift`` or dynamically
  (``time_shift_type`` exponential, or linear: ``mu`` itself is the shift), then a final 0; each step
  is ``x + (s_next - s) v``. Read keys: those and ``num_train_timesteps``; ``shift_terminal``,
  ``invert_sigmas``, Karras/exponential/beta sigmas and stochastic sampling are refused.
- ``flow_dpmpp_2m``: what ``DPMSolverMultistepScheduler.from_config(flux_pipe.scheduler.config,
  use_flow_sigmas=True, prediction_type="flow_prediction")`` gives in FluxPipeline. FluxPipeline
  passes such a scheduler no sigmas, only ``mu``, and ``set_timesteps(n, mu=mu)`` sets
  ``flow_shift = e^mu`` (it asserts ``use_dynamic_shifting``: FluxPipeline cannot drive a config
  without it, as Flux.1-schnell's; flame then takes the static ``flow_shift`` as
  ``set_timesteps(n)`` does. DPM-Solver reads ``flow_shift``, default 1, not the Flux config's
  ``shift``). Levels: ``1 - linspace(1, 1/T, n + 1)`` (``T = num_train_timesteps``) shifted,
  descending, without the 0 (so the first is ``shift(1 - 1/T)``, not 1), then a final 0; timesteps
  ``floor(1000 s)`` (diffusers truncates them to integers). The steps are ``dpmpp_2m``'s
  DPM-Solver++(2M) on ``alpha = 1 - s``, ``sigma = s``, ``x0 = x - s v``: the first and the last
  (which lands on ``x0``) first order. Read keys: ``num_train_timesteps``, ``flow_shift``, the
  dynamic shift's (``time_shift_type`` exponential only), ``solver_type``, ``euler_at_final``;
  refused: ``final_sigmas_type="sigma_min"`` (diffusers then ends at the smallest sigma of the
  config's DDPM betas), ``thresholding``, and Karras/exponential/beta sigmas and Lu lambdas (which
  take precedence over flow sigmas in diffusers). Betas, spacing and ``variance_type`` do not apply.
- ``flow_heun``: ``FlowMatchHeunDiscreteScheduler.from_config(config)`` with ``set_timesteps(n)``.
  It reads only ``num_train_timesteps`` and ``shift``: no dynamic shift, so Flux.1-dev's config
  gives the static shift 3 at every resolution and ``image_seq_len`` is unused; FluxPipeline cannot
  drive it (its ``set_timesteps`` takes no sigmas). Levels: ``linspace(1, shift(1/T), n)`` shifted
  (again: diffusers' end is its smallest shifted training level), then 0. Heun's method: each level
  but the last takes two steps, an Euler predictor and the trapezoidal corrector (the model at the
  predicted latents); the last, to 0, is Euler alone. So ``len(sampler)`` is ``2n - 1``, timesteps
  ``t_0, t_1, t_1, ..., t_{n-1}, t_{n-1}`` as diffusers', and the loop below stays the same.

A value flame does not implement (``thresholding``, ``use_beta_sigmas``, ``squaredcos_cap_v2``,
learned variance, ...) is a ValueError naming the key; so is any bad value.

The loop (``x`` the latents, ``i`` the step index, the model's timestep ``sampler.timesteps[i]``)::

    x = sampler.prepare_latents(noise)                 # noise * init_noise_sigma
    for i, t in enumerate(sampler.timesteps):
        out = model(sampler.scale_model_input(x, i), t, ...)
        x = sampler.step(out, i, x)

Host and device: every schedule quantity (betas, ``alpha_bar``, sigmas, timesteps, each step's
coefficients) is host-side float64 NumPy, from ``schedule.make_betas`` as the training schedule;
diffusers computes the same quantities in float32, which differ by up to ~1e-5 relative (the
smallest sigmas). Each update is a linear combination of at most three tensors with host scalars,
run as flame elementwise kernels in fp32 (bf16/fp16 operands are read and upcast inside the
kernels) and stored in the latents' dtype: bf16 latents are updated in fp32 by every sampler
(diffusers upcasts in the Euler, Heun and DPM samplers only) and rounded once per step.

State: euler, euler_a, ddim and flow_euler are stateless. dpmpp_2m and flow_dpmpp_2m keep the
previous step's denoised prediction (fp32) for their second-order update. That state belongs to one
run: step 0 starts a new run, as does the first step after ``reset()`` or after a finished run (a
run that starts later in the schedule, as img2img does, begins with a first-order step, like
diffusers'); any other step must follow the previous one (``i`` after ``i - 1``), else ValueError.
flow_heun keeps a predictor's latents and model output (references) for its corrector: an odd step
must follow the even one before it, else ValueError; any even step may start a run. One sampler
object so serves image after image.

Where flame differs from diffusers on purpose: steps are addressed by index, not by timestep value;
``euler_a`` draws its noise with flame's generator (``randn_like``, fp32) unless ``noise`` is given
and draws none on a step whose ``sigma_up`` is 0 (the last); ``euler_a`` also accepts
``prediction_type="sample"``; ``flow_dpmpp_2m`` leaves the config's ``flow_shift`` alone (diffusers'
``set_timesteps(mu=...)`` overwrites it); trailing spacing always gives ``num_inference_steps`` timesteps
(diffusers adds a timestep -1 for some step counts); ``num_inference_steps`` above
``num_train_timesteps`` is refused by every sampler (diffusers' DDIM refuses it, the others repeat
timesteps); ``ddim`` refuses epsilon prediction at a timestep whose ``alpha_bar`` is 0 (zero
terminal SNR: diffusers divides by zero). Steps record no autograd graph.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
import torch

from ..kernels import elementwise as K
from ..ops._util import argument_error
from ..ops.creation import randn_like, zeros_like
from ..ops.elementwise import map_op, mul, to
from ..tensor import Tensor
from .schedule import PREDICTION_TYPES, make_betas, rescale_zero_terminal_snr

SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "ddim")  # DDPM-trained models (SDXL)
FLOW_SAMPLERS = ("flow_euler", "flow_dpmpp_2m", "flow_heun")  # rectified-flow models (Flux.1)

# SDXL base 1.0's scheduler/scheduler_config.json (EulerDiscreteScheduler): the default config.
SDXL_BASE_SCHEDULER_CONFIG = {
    "_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
    "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}
# Flux.1-dev's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler): a flow sampler's default.
FLUX_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
    "use_dynamic_shifting": True,
}

# The keys every sampler reads, with the defaults of diffusers' scheduler constructors.
_COMMON_KEYS = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
                "trained_betas": None, "prediction_type": "epsilon", "rescale_betas_zero_snr": False}
_SPACING_KEYS = {"timestep_spacing": "linspace", "steps_offset": 0}
# EulerDiscreteScheduler's sigma options; EulerAncestralDiscreteScheduler has none of them.
_EULER_SIGMA_KEYS = {"interpolation_type": "linear", "use_karras_sigmas": False, "use_exponential_sigmas": False,
                     "use_beta_sigmas": False, "sigma_min": None, "sigma_max": None, "timestep_type": "discrete",
                     "final_sigmas_type": "zero"}
SPACINGS = ("leading", "trailing", "linspace")
# Karras et al. (2022) eq. 5 with rho = 7: sigma_i = (max^(1/rho) + i/(n-1) (min^(1/rho) - max^(1/rho)))^rho.
_KARRAS_RHO = 7.0


def make_sampler(name: str, num_inference_steps: int, config: Mapping | None = None,
                 image_seq_len: int | None = None) -> Sampler:
    """A sampler ``name`` (one of ``SAMPLERS`` or ``FLOW_SAMPLERS``) of ``num_inference_steps`` steps,
    configured from a diffusers scheduler config dict (None: SDXL base's, or Flux.1's for a flow
    sampler). ``image_seq_len``: the image tokens of a flow sampler's dynamic shift."""
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS + FLOW_SAMPLERS)}")
    if name in FLOW_SAMPLERS:
        return cls(num_inference_steps, config, image_seq_len)
    if image_seq_len is not None:
        raise ValueError(f"{name}: image_seq_len is a flow sampler's setting")
    return cls(num_inference_steps, config)


class Sampler:
    """Common interface: ``timesteps`` (NumPy array of the model's timesteps, one per step: float32
    for the Euler and Heun samplers, whose timesteps may be fractional, int64 for the others, as
    diffusers), ``len(sampler)`` (the steps, ``2 num_inference_steps - 1`` for flow_heun),
    ``init_noise_sigma``, ``prepare_latents``, ``scale_model_input``, ``step`` and ``reset``.

    ``config`` holds the resolved settings (the keys this sampler reads, the name's fixed ones);
    ``alphas_cumprod`` the float64 training schedule (DDPM samplers); the sigma-based samplers
    (euler, euler_a, dpmpp_2m and the flow samplers) also have ``sigmas``, float64, one more than the
    steps (the last is the target of the last step)."""

    name = ""
    DEFAULTS: dict = {}  # the config keys the diffusers class reads, with its defaults
    FIXED: dict = {}  # settings the sampler's name defines, whatever the config says
    zero_snr_floor = True  # diffusers' sigma-based schedulers set alpha_bar[-1] = 2**-24 under zero SNR
    init_noise_sigma = 1.0
    default_config = SDXL_BASE_SCHEDULER_CONFIG  # the config when None is given
    ddpm = True  # a DDPM schedule: prediction_type and alphas_cumprod (not a rectified flow)

    def __init__(self, num_inference_steps: int, config: Mapping | None = None):
        self.config = _resolve(self.default_config if config is None else config, self.DEFAULTS, self.FIXED,
                               self.name)
        self.num_train_timesteps = _integer(self.config, "num_train_timesteps", 1, self.name)
        if (not isinstance(num_inference_steps, numbers.Integral) or isinstance(num_inference_steps, bool)
                or not 1 <= num_inference_steps <= self.num_train_timesteps):
            raise ValueError(f"{self.name}: num_inference_steps must be an int in [1, num_train_timesteps = "
                             f"{self.num_train_timesteps}], got {num_inference_steps!r}")
        self.num_inference_steps = int(num_inference_steps)
        if self.ddpm:
            self.prediction_type = _one_of(self.config, "prediction_type", PREDICTION_TYPES, self.name)
            self.alphas_cumprod = _alphas_cumprod(self.config, self.name, self.zero_snr_floor)

    def __len__(self) -> int:
        return len(self.timesteps)

    def __repr__(self):
        return (f"{type(self).__name__}(name={self.name!r}, steps={len(self)}, "
                f"prediction_type={self.prediction_type!r})")

    def prepare_latents(self, noise: Tensor) -> Tensor:
        """The first latents: ``noise * init_noise_sigma`` (``noise`` itself when that is 1)."""
        if not isinstance(noise, Tensor):
            raise argument_error(noise, "noise", f"{self.name}.prepare_latents")
        return noise if self.init_noise_sigma == 1.0 else mul(noise, float(self.init_noise_sigma))

    def scale_model_input(self, x: Tensor, i: int) -> Tensor:
        """The model's input at step ``i``: ``x`` itself for the samplers that work on the diffusion
        process's own scale (DDIM, DPM-Solver)."""
        self._index(i, "scale_model_input")
        if not isinstance(x, Tensor):
            raise argument_error(x, "x", f"{self.name}.scale_model_input")
        return x

    def step(self, model_output: Tensor, i: int, x: Tensor, noise: Tensor | None = None) -> Tensor:
        """The latents after step ``i`` from the model's ``model_output`` at ``x``, in ``x``'s dtype.
        ``noise`` (same shape) feeds the ancestral sampler (drawn with ``flame.randn_like`` when
        None); the deterministic samplers ignore it."""
        self._index(i, "step")
        op = f"{self.name}.step"
        for arg, v in (("model_output", model_output), ("x", x), ("noise", noise)):
            if v is None and arg == "noise":
                continue
            if not isinstance(v, Tensor):
                raise argument_error(v, arg, op)
            if not v.dtype.is_floating_point:
                raise TypeError(f"{op}: {arg} must be a floating-point tensor, got {v.dtype}")
            if v.shape != x.shape:
                raise ValueError(f"{op}: {arg} has shape {v.shape}, x has {x.shape}")
        return self._step(model_output, int(i), x, noise)

    def reset(self) -> None:
        """Forget the state of the current run (multistep samplers); a no-op for the others."""

    def _index(self, i, op):
        if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < len(self):
            raise IndexError(f"{self.name}.{op}: step index must be an int in [0, {len(self)}), got {i!r}")

    def _step(self, model_output, i, x, noise):
        raise NotImplementedError


class EulerSampler(Sampler):
    """diffusers' ``EulerDiscreteScheduler``: with ``sigma = sqrt((1 - abar) / abar)`` at the step's
    timestep and the latents on the sigma scale (``x = x0 + sigma eps``), the denoised estimate
    ``x0`` and one Euler step of the probability-flow ODE ``dx/dsigma = (x - x0) / sigma``:
    ``x' = x + (x - x0) / sigma * (sigma_next - sigma)``. The UNet sees ``x / sqrt(sigma^2 + 1)``."""

    name = "euler"
    DEFAULTS = {**_COMMON_KEYS, **_SPACING_KEYS, **_EULER_SIGMA_KEYS}

    def __init__(self, num_inference_steps: int, config: Mapping | None = None):
        super().__init__(num_inference_steps, config)
        s, name = self.config, self.name
        spacing = _one_of(s, "timestep_spacing", SPACINGS, name)
        interpolation = _one_of(s, "interpolation_type", ("linear", "log_linear"), name)
        karras, exponential = _flag(s, "use_karras_sigmas", name), _flag(s, "use_exponential_sigmas", name)
        _unsupported(s, "use_beta_sigmas", name, "beta sigmas are not implemented")
        if karras and exponential:
            raise ValueError(f"{name}: config use_karras_sigmas and use_exponential_sigmas are exclusive")
        continuous = _one_of(s, "timestep_type", ("discrete", "continuous"), name) == "continuous"
        train = _training_sigmas(self.alphas_cumprod)
        t = _spaced_timesteps(spacing, self.num_train_timesteps, self.num_inference_steps,
                              _integer(s, "steps_offset", 0, name)).astype(np.float32)
        if interpolation == "linear":
            sigmas = np.interp(t, np.arange(len(train)), train)
        else:  # diffusers: num_inference_steps + 1 log-spaced sigmas, largest to smallest; t keeps its spacing
            sigmas = np.exp(np.linspace(math.log(train[-1]), math.log(train[0]), self.num_inference_steps + 1))
        if karras or exponential:
            lo, hi = _sigma_range(s, sigmas, name)
            n = self.num_inference_steps
            sigmas = _karras(lo, hi, n) if karras else np.exp(np.linspace(math.log(hi), math.log(lo), n))
            t = _sigma_to_t(sigmas, train).astype(np.float32)
        self.sigmas = np.append(sigmas, _final_sigma(s, train, name))
        if continuous and self.prediction_type == "v_prediction":  # the UNet takes 0.25 log(sigma)
            t = (0.25 * np.log(self.sigmas[:-1])).astype(np.float32)
        self.timesteps = t
        top = float(self.sigmas.max())
        # "leading" spacing starts below the largest training timestep: diffusers scales the
        # initial noise by sqrt(sigma_max^2 + 1) there (the variance of x0 + sigma eps for unit x0)
        self.init_noise_sigma = top if spacing in ("linspace", "trailing") else math.sqrt(top * top + 1.0)

    def scale_model_input(self, x: Tensor, i: int) -> Tensor:
        """``x / sqrt(sigma_i^2 + 1)``: the latents back on the diffusion process's scale."""
        super().scale_model_input(x, i)
        return mul(x, 1.0 / math.sqrt(self.sigmas[i] ** 2 + 1.0))

    def _denoised(self, sigma):
        """(p, q) with ``x0 = p x + q m`` for model output ``m`` at sigma-scaled ``x``: epsilon
        ``x - sigma m``; v ``x / (sigma^2 + 1) - sigma m / sqrt(sigma^2 + 1)``; sample ``m``."""
        if self.prediction_type == "epsilon":
            return 1.0, -sigma
        if self.prediction_type == "v_prediction":
            return 1.0 / (sigma * sigma + 1.0), -sigma / math.sqrt(sigma * sigma + 1.0)
        return 0.0, 1.0

    def _euler(self, model_output, x, sigma, sigma_to, extra=()):
        """``x + (x - x0) / sigma * (sigma_to - sigma)`` plus the ``extra`` (coefficient, tensor)
        terms; with ``x0 = p x + q m`` and ``r = (sigma_to - sigma) / sigma`` that is
        ``(1 + r (1 - p)) x - r q m``."""
        p, q = self._denoised(sigma)
        r = (sigma_to - sigma) / sigma
        return _combine([(1.0 + r * (1.0 - p), x), (-r * q, model_output), *extra], x.dtype)

    def _step(self, model_output, i, x, noise):
        return self._euler(model_output, x, self.sigmas[i], self.sigmas[i + 1])


class EulerAncestralSampler(EulerSampler):
    """diffusers' ``EulerAncestralDiscreteScheduler``: from ``sigma`` to ``sigma_next`` as an Euler
    step to ``sigma_down`` plus fresh noise of std ``sigma_up``, where
    ``sigma_up = sqrt(sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2)`` and
    ``sigma_down = sqrt(sigma_next^2 - sigma_up^2)`` (so the marginal variance is ``sigma_next^2``)."""

    name = "euler_a"
    DEFAULTS = {**_COMMON_KEYS, **_SPACING_KEYS}
    FIXED = _EULER_SIGMA_KEYS  # the ancestral scheduler has none of these options

    def _step(self, model_output, i, x, noise):
        sigma, sigma_next = self.sigmas[i], self.sigmas[i + 1]
        up = math.sqrt(sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2)
        down = math.sqrt(sigma_next ** 2 - up ** 2)
        extra = []
        if up > 0.0:  # the last step (sigma_next = 0) adds no noise and draws none
            extra = [(up, noise if noise is not None else randn_like(x, dtype=torch.float32))]
        return self._euler(model_output, x, sigma, down, extra)


class _DPMSolver2M(Sampler):
    """DPM-Solver++(2M) (Lu et al. 2022, data-prediction form, multistep order 2) as diffusers'
    ``DPMSolverMultistepScheduler`` runs it, on the process ``x = alpha x0 + sigma eps`` of a
    subclass: its ``sigmas`` (the noise levels, one more than the steps), ``_alpha_sigma`` of a level
    and ``_denoised``, the model output's ``x0``.

    With ``lambda = log(alpha / sigma)`` and ``h = lambda_next - lambda`` (so ``e^-h`` is the ratio
    of the two levels' ``sigma / alpha``), the first-order step is ``x' = sigma_next / sigma x +
    alpha_next (1 - e^-h) x0``; the second-order one adds ``D1 = (x0 - x0_prev) / r0``,
    ``r0 = (lambda - lambda_prev) / h``, with weight ``alpha_next (1 - e^-h) / 2`` (midpoint) or
    ``alpha_next ((e^-h - 1) / h + 1)`` (heun). The first step of a run is first order, and so is the
    last when ``final_sigmas_type`` is ``zero`` (its sigma is 0: ``x' = x0``), ``euler_at_final`` is
    set or the run has fewer than 15 steps."""

    FIXED = {"algorithm_type": "dpmsolver++", "solver_order": 2, "lower_order_final": True}
    # diffusers' sigma options, each exclusive of the others: the sampler's name fixes one
    _SIGMA_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas",
                   "use_flow_sigmas")
    SOLVER_DEFAULTS = {"solver_type": "midpoint", "euler_at_final": False, "final_sigmas_type": "zero",
                       "thresholding": False, **dict.fromkeys(_SIGMA_KEYS, False)}
    # diffusers maps the UniPC solver types to midpoint
    _SOLVER_TYPES = {"midpoint": "midpoint", "heun": "heun", "logrho": "midpoint", "bh1": "midpoint",
                     "bh2": "midpoint"}
    _prev = None  # (step index, fp32 denoised x0) of the run's previous step

    def _solver_options(self):
        """Reads the solver's settings from ``config``; the other sigma options are refused."""
        s, name = self.config, self.name
        self.solver_type = self._SOLVER_TYPES[_one_of(s, "solver_type", tuple(self._SOLVER_TYPES), name)]
        _unsupported(s, "thresholding", name, "dynamic thresholding is for pixel-space models")
        fixed = next(key for key in self._SIGMA_KEYS if self.FIXED.get(key))
        for key in self._SIGMA_KEYS:
            if key != fixed:
                _unsupported(s, key, name, f"{name} sets {fixed}")
        self.euler_at_final = _flag(s, "euler_at_final", name)

    def _alpha_sigma(self, s):
        raise NotImplementedError

    def _denoised(self, alpha, sigma):
        """(p, q) with ``x0 = p x + q m`` for model output ``m`` at the level ``(alpha, sigma)``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the previous step's denoised prediction: the next step starts a run."""
        self._prev = None

    def _first_order(self, i):
        n, s = len(self), self.config
        lower_order_final = i == n - 1 and (self.euler_at_final or (s["lower_order_final"] and n < 15)
                                            or s["final_sigmas_type"] == "zero")
        return self._prev is None or lower_order_final

    def _step(self, model_output, i, x, noise):
        if i == 0:
            self._prev = None
        elif self._prev is not None and self._prev[0] != i - 1:
            raise ValueError(f"{self.name}.step: step {i} after step {self._prev[0]}; steps of a run go in "
                             "order (call reset() to start a run elsewhere)")
        alpha, sigma = self._alpha_sigma(self.sigmas[i])
        alpha_next, sigma_next = self._alpha_sigma(self.sigmas[i + 1])
        p, q = self._denoised(alpha, sigma)
        x0 = _combine([(p, x), (q, model_output)], torch.float32)
        rho, rho_next = sigma / alpha, sigma_next / alpha_next  # e^-lambda
        a, b = sigma_next / sigma, alpha_next * (1.0 - rho_next / rho)  # e^-h = rho_next / rho
        if self._first_order(i):
            terms = [(a, x), (b, x0)]
        else:  # x' = a x + b x0 + c (x0 - x0_prev) / r0 = a x + (b + k) x0 - k x0_prev, k = c h / h0
            prev_alpha, prev_sigma = self._alpha_sigma(self.sigmas[i - 1])
            h, h0 = math.log(rho / rho_next), math.log(prev_sigma / prev_alpha / rho)
            if self.solver_type == "midpoint":  # c = b / 2
                k = 0.5 * b * h / h0
            else:  # c = alpha_next ((e^-h - 1) / h + 1): k has no 1 / h (a zero-length step is the identity)
                k = alpha_next * (rho_next / rho - 1.0 + h) / h0
            terms = [(a, x), (b + k, x0), (-k, self._prev[1])]
        out = _combine(terms, x.dtype)
        self._prev = (i, x0) if i < len(self) - 1 else None
        return out


class DPMSolverMultistepSampler(_DPMSolver2M):
    """diffusers' ``DPMSolverMultistepScheduler`` as "DPM++ 2M Karras": DPM-Solver++(2M) on the DDPM
    process with Karras sigmas ``s`` (noise-to-signal ratios): ``alpha = 1 / sqrt(s^2 + 1)``,
    ``sigma = s alpha``, so ``lambda = -log(s)``."""

    name = "dpmpp_2m"
    DEFAULTS = {**_COMMON_KEYS, **_DPMSolver2M.SOLVER_DEFAULTS, "sigma_min": None, "sigma_max": None,
                "variance_type": None, "use_dynamic_shifting": False}
    FIXED = {**_DPMSolver2M.FIXED, "use_karras_sigmas": True}

    def __init__(self, num_inference_steps: int, config: Mapping | None = None):
        super().__init__(num_inference_steps, config)
        s, name = self.config, self.name
        self._solver_options()
        _unsupported(s, "variance_type", name, "learned-variance model outputs are not supported")
        _unsupported(s, "use_dynamic_shifting", name, "dpmpp_2m uses Karras sigmas")
        train = _training_sigmas(self.alphas_cumprod)
        lo, hi = _sigma_range(s, train[::-1], name)
        sigmas = _karras(lo, hi, self.num_inference_steps)
        self.timesteps = np.round(_sigma_to_t(sigmas, train)).astype(np.int64)
        self.sigmas = np.append(sigmas, _final_sigma(s, train, name))

    def _alpha_sigma(self, s):
        return _alpha_sigma(s)

    def _denoised(self, alpha, sigma):
        return _ddpm_coefficients(self.prediction_type, alpha, sigma)[0]


class DDIMSampler(Sampler):
    """diffusers' ``DDIMScheduler`` with ``eta = 0`` (Song et al. 2021): with ``abar`` at the step's
    timestep ``t`` and ``abar_prev`` at ``t - num_train_timesteps // num_inference_steps`` (diffusers'
    rule for every spacing; before 0: 1 with ``set_alpha_to_one``, else ``abar[0]``), the model's
    ``x0`` and ``eps`` give ``x' = sqrt(abar_prev) x0 + sqrt(1 - abar_prev) eps``; ``clip_sample``
    clamps ``x0`` to ``[-clip_sample_range, clip_sample_range]`` first."""

    name = "ddim"
    DEFAULTS = {**_COMMON_KEYS, "timestep_spacing": "leading", "steps_offset": 0, "clip_sample": True,
                "clip_sample_range": 1.0, "set_alpha_to_one": True, "thresholding": False}
    zero_snr_floor = False  # DDIMScheduler keeps alpha_bar[-1] = 0 under zero terminal SNR

    def __init__(self, num_inference_steps: int, config: Mapping | None = None):
        super().__init__(num_inference_steps, config)
        s, name = self.config, self.name
        _unsupported(s, "thresholding", name, "dynamic thresholding is for pixel-space models")
        self.clip_sample = _flag(s, "clip_sample", name)
        self.clip_sample_range = _positive(s, "clip_sample_range", name)
        abar = self.alphas_cumprod
        self.final_alpha_cumprod = 1.0 if _flag(s, "set_alpha_to_one", name) else float(abar[0])
        spacing = _one_of(s, "timestep_spacing", SPACINGS, name)
        T = self.num_train_timesteps
        t = _spaced_timesteps(spacing, T, self.num_inference_steps, _integer(s, "steps_offset", 0, name), rounded=True)
        self.timesteps = t.astype(np.int64)
        if self.timesteps.max() >= T:
            raise ValueError(f"{name}: steps_offset {s['steps_offset']} puts timestep {self.timesteps.max()} past "
                             f"num_train_timesteps = {T}")
        if self.prediction_type == "epsilon" and (abar[self.timesteps] == 0.0).any():
            raise ValueError(f"{name}: epsilon prediction is undefined at zero terminal SNR (alpha_bar = 0 at "
                             f"t = {T - 1}); use v_prediction with rescale_betas_zero_snr")

    def _step(self, model_output, i, x, noise):
        t = int(self.timesteps[i])
        t_prev = t - self.num_train_timesteps // self.num_inference_steps
        abar = float(self.alphas_cumprod[t])
        abar_prev = float(self.alphas_cumprod[t_prev]) if t_prev >= 0 else self.final_alpha_cumprod
        (p, q), (ex, em) = _ddpm_coefficients(self.prediction_type, math.sqrt(abar), math.sqrt(1.0 - abar))
        a, b = math.sqrt(abar_prev), math.sqrt(1.0 - abar_prev)
        if not self.clip_sample:  # x' = a (p x + q m) + b (ex x + em m)
            return _combine([(a * p + b * ex, x), (a * q + b * em, model_output)], x.dtype)
        x0 = _combine([(p, x), (q, model_output)], torch.float32)
        r = self.clip_sample_range
        x0 = map_op(K.CLAMP, (x0,), torch.float32, -r, r)
        return _combine([(a, x0), (b * ex, x), (b * em, model_output)], x.dtype)



# the dynamic (resolution-dependent) shift's settings, with the defaults FluxPipeline reads them with
_DYNAMIC_SHIFT_KEYS = {"use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                       "max_image_seq_len": 4096, "time_shift_type": "exponential"}


class _FlowSampler(Sampler):
    """A rectified-flow sampler (Flux.1): the latents at noise level ``s`` in [0, 1] are
    ``x = (1 - s) x0 + s eps`` and the model predicts the velocity ``v = eps - x0`` (so
    ``x0 = x - s v``); no betas. Its constructor takes ``image_seq_len``, the image's tokens, for the
    dynamic shift; ``sigmas`` are the levels ``s`` (the model's at step ``i`` and, the last, 0)."""

    ddpm = False
    prediction_type = "flow"
    default_config = FLUX_SCHEDULER_CONFIG

    def _shift_factor(self, image_seq_len, static_key, time_shift_types):
        """The shift of ``s -> shift s / (1 + (shift - 1) s)``: the config's ``static_key``, or with
        ``use_dynamic_shifting`` ``e^mu`` (``time_shift_type`` exponential) or ``mu`` (linear), ``mu``
        linear in ``image_seq_len`` through (base_image_seq_len, base_shift) and (max_image_seq_len,
        max_shift), computed as FluxPipeline's ``calculate_shift``."""
        s, name = self.config, self.name
        if not _flag(s, "use_dynamic_shifting", name):
            return _positive(s, static_key, name)
        if not isinstance(image_seq_len, numbers.Integral) or isinstance(image_seq_len, bool) or image_seq_len < 1:
            raise ValueError(f"{name}: use_dynamic_shifting needs image_seq_len, the image's tokens (a positive "
                             f"int), got {image_seq_len!r}")
        lo, hi = _integer(s, "base_image_seq_len", 1, name), _integer(s, "max_image_seq_len", 1, name)
        if hi == lo:
            raise ValueError(f"{name}: base_image_seq_len and max_image_seq_len must differ, both {lo}")
        base = _real(s, "base_shift", name)
        slope = (_real(s, "max_shift", name) - base) / (hi - lo)
        mu = slope * image_seq_len + (base - slope * lo)
        return math.exp(mu) if _one_of(s, "time_shift_type", time_shift_types, name) == "exponential" else mu

    def _euler(self, v, i, x):
        """``x + (s_next - s) v``: Euler from level ``sigmas[i]`` to ``sigmas[i + 1]``."""
        return _combine([(1.0, x), (self.sigmas[i + 1] - self.sigmas[i], v)], x.dtype)


class FlowEulerSampler(_FlowSampler):
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` as FluxPipeline drives it (module docstring):
    Euler steps of ``dx/ds = v`` from ``s = 1`` (noise) to 0, ``x' = x + (s_next - s) v``."""

    name = "flow_euler"
    DEFAULTS = {"num_train_timesteps": 1000, "shift": 1.0, **_DYNAMIC_SHIFT_KEYS, "shift_terminal": None,
                "invert_sigmas": False, "use_karras_sigmas": False, "use_exponential_sigmas": False,
                "use_beta_sigmas": False, "stochastic_sampling": False}

    def __init__(self, num_inference_steps: int, config: Mapping | None = None, image_seq_len: int | None = None):
        super().__init__(num_inference_steps, config)
        s, name, n = self.config, self.name, self.num_inference_steps
        for key in ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                    "stochastic_sampling"):
            _unsupported(s, key, name, "not implemented for flow matching")
        if s["shift_terminal"] is not None:
            raise ValueError(f"{name}: config shift_terminal is not supported, got {s['shift_terminal']!r}")
        # FluxPipeline's sigmas linspace(1, 1/n, n)
        shift = self._shift_factor(image_seq_len, "shift", ("exponential", "linear"))
        sigmas = _shifted(np.linspace(1.0, 1.0 / n, n), shift)
        self.sigmas = np.append(sigmas, 0.0)
        self.timesteps = (sigmas * self.num_train_timesteps).astype(np.float32)

    def _step(self, model_output, i, x, noise):
        return self._euler(model_output, i, x)


class FlowDPMSolverSampler(_FlowSampler, _DPMSolver2M):
    """diffusers' ``DPMSolverMultistepScheduler`` with flow sigmas (module docstring): DPM-Solver++(2M)
    on the flow ``alpha = 1 - s``, ``sigma = s`` (``lambda = log((1 - s) / s)``), ``x0 = x - s v``."""

    name = "flow_dpmpp_2m"
    DEFAULTS = {"num_train_timesteps": 1000, "flow_shift": 1.0, **_DYNAMIC_SHIFT_KEYS, **_DPMSolver2M.SOLVER_DEFAULTS}
    FIXED = {**_DPMSolver2M.FIXED, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}

    def __init__(self, num_inference_steps: int, config: Mapping | None = None, image_seq_len: int | None = None):
        super().__init__(num_inference_steps, config)
        s, name, n, T = self.config, self.name, self.num_inference_steps, self.num_train_timesteps
        self._solver_options()
        if _one_of(s, "final_sigmas_type", ("zero", "sigma_min"), name) != "zero":
            raise ValueError(f"{name}: config final_sigmas_type='sigma_min' is not supported (the smallest sigma of "
                             "the config's DDPM betas, not a flow level)")
        shift = self._shift_factor(image_seq_len, "flow_shift", ("exponential",))
        # n + 1 levels evenly from 0 to 1 - 1/T, shifted; descending without the 0, then a final 0
        sigmas = _shifted(1.0 - np.linspace(1.0, 1.0 / T, n + 1), shift)[:0:-1]
        self.sigmas = np.append(sigmas, 0.0)
        self.timesteps = (sigmas * T).astype(np.int64)  # diffusers truncates them to integers

    def _alpha_sigma(self, s):
        return 1.0 - s, s

    def _denoised(self, alpha, sigma):
        return 1.0, -sigma


class FlowHeunSampler(_FlowSampler):
    """diffusers' ``FlowMatchHeunDiscreteScheduler`` (module docstring): Heun's method on
    ``dx/ds = v`` over the levels ``s_0 = 1 > s_1 > ... > s_{n-1}`` and then 0, two model calls per
    level but the last: step ``2j`` is the Euler predictor ``x~ = x + (s_{j+1} - s_j) v`` and step
    ``2j + 1`` (the model at ``x~``, level ``s_{j+1}``) the corrector
    ``x' = x + (s_{j+1} - s_j) (v + v~) / 2``; the last step, to 0, is Euler alone. So ``timesteps``
    has ``2n - 1`` entries (``t_0, t_1, t_1, ..., t_{n-1}, t_{n-1}``) and ``sigmas`` ``2n``: the
    model's level at each step, then 0. The corrector needs its predictor's ``x`` and model output:
    the sampler keeps references to them (do not modify them in place) until the corrector."""

    name = "flow_heun"
    DEFAULTS = {"num_train_timesteps": 1000, "shift": 1.0}
    _stage = None  # (step index, x, model output) of the predictor whose corrector comes next

    def __init__(self, num_inference_steps: int, config: Mapping | None = None, image_seq_len: int | None = None):
        super().__init__(num_inference_steps, config)  # image_seq_len: no dynamic shift in diffusers' Heun
        shift, T = _positive(self.config, "shift", self.name), self.num_train_timesteps
        # diffusers spaces the levels evenly from 1 to its smallest shifted training level, then shifts them again
        levels = np.append(_shifted(np.linspace(1.0, _shifted(1.0 / T, shift), self.num_inference_steps), shift), 0.0)
        self.sigmas = np.concatenate([levels[:1], np.repeat(levels[1:-1], 2), levels[-1:]])
        self.timesteps = (self.sigmas[:-1] * T).astype(np.float32)

    def reset(self) -> None:
        """Forget a pending predictor: the next step starts a run."""
        self._stage = None

    def _step(self, model_output, i, x, noise):
        if i % 2 == 0:  # a predictor (or the last step): Euler to the next level
            self._stage = (i, x, model_output) if i < len(self) - 1 else None
            return self._euler(model_output, i, x)
        if self._stage is None or self._stage[0] != i - 1:
            raise ValueError(f"{self.name}.step: step {i} is the corrector of step {i - 1}, which must come just "
                             "before it")
        _, x_start, v_start = self._stage
        self._stage = None
        half = 0.5 * (self.sigmas[i] - self.sigmas[i - 1])
        return _combine([(1.0, x_start), (half, v_start), (half, model_output)], x.dtype)


_BY_NAME = {cls.name: cls for cls in (EulerSampler, EulerAncestralSampler, DPMSolverMultistepSampler, DDIMSampler,
                                      FlowEulerSampler, FlowDPMSolverSampler, FlowHeunSampler)}


# ---- the update: a linear combination on the device ----------------------------------------------

def _combine(terms, dtype) -> Tensor:
    """``sum(c * t)`` over (host scalar, flame Tensor) ``terms`` of one shape, computed in fp32 and
    stored as ``dtype``: one multiply kernel per coefficient other than 0 and 1 and one add kernel
    per further term (zero terms are skipped)."""
    live = [(float(c), t) for c, t in terms if c != 0.0]
    if not live:
        return zeros_like(terms[0][1], dtype=dtype)
    out = None
    for k, (c, t) in enumerate(live):
        last = k == len(live) - 1
        # the last kernel writes ``dtype``; earlier partial results stay fp32
        if c != 1.0:
            t = map_op(K.MUL, (t,), dtype if last and out is None else torch.float32, c)
        out = t if out is None else map_op(K.ADD, (out, t), dtype if last else torch.float32)
    return to(out, dtype)


# ---- host-side schedule math (float64 NumPy) --------------------------------------------------

def _alpha_sigma(s):
    """``alpha = 1 / sqrt(s^2 + 1)`` and ``sigma = s alpha`` of the process ``x = alpha x0 + sigma
    eps`` whose noise-to-signal ratio is ``s``."""
    alpha = 1.0 / math.sqrt(s * s + 1.0)
    return alpha, s * alpha


def _ddpm_coefficients(prediction_type, alpha, sigma):
    """((px, pm), (ex, em)): ``x0 = px x + pm m`` and ``eps = ex x + em m`` for ``x = alpha x0 +
    sigma eps`` and model output ``m``: epsilon ``m = eps``; sample ``m = x0``; v-prediction
    ``m = alpha eps - sigma x0``, so ``x0 = alpha x - sigma m`` and ``eps = sigma x + alpha m``."""
    if prediction_type == "epsilon":
        return (1.0 / alpha, -sigma / alpha), (0.0, 1.0)
    if prediction_type == "sample":
        return (0.0, 1.0), (1.0 / sigma, -alpha / sigma)
    return (alpha, -sigma), (sigma, alpha)


def _alphas_cumprod(s, name, zero_snr_floor):
    """``alpha_bar`` (float64, (T,)) from the config's betas; with ``rescale_betas_zero_snr`` shifted
    and scaled in ``sqrt(alpha_bar)`` so that the last is 0 and the first unchanged (Lin et al. 2023,
    Algorithm 1), then, for the sigma-based samplers, the last set to 2**-24 (a finite sigma) as
    diffusers does."""
    T = s["num_train_timesteps"]
    if s["trained_betas"] is not None:
        betas = np.asarray(s["trained_betas"], dtype=np.float64)
        if betas.shape != (T,) or not ((betas >= 0.0) & (betas < 1.0)).all():
            raise ValueError(f"{name}: config trained_betas must be {T} (num_train_timesteps) numbers in [0, 1)")
    else:
        try:
            betas = make_betas(T, float(s["beta_start"]), float(s["beta_end"]), s["beta_schedule"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: config: {e}") from None
    abar = np.cumprod(1.0 - betas)
    if _flag(s, "rescale_betas_zero_snr", name):
        abar = rescale_zero_terminal_snr(abar)
        if zero_snr_floor:
            abar[-1] = 2.0 ** -24
    return abar


def _training_sigmas(abar):
    """``sqrt((1 - abar) / abar)`` for every training timestep (ascending)."""
    return np.sqrt((1.0 - abar) / abar)


def _spaced_timesteps(spacing, T, n, offset, rounded=False):
    """diffusers' ``timestep_spacing`` (Lin et al. 2023, Table 2), descending: ``linspace`` n points
    from T-1 to 0 (rounded for the integer samplers); ``leading`` ``k * (T // n) + steps_offset``;
    ``trailing`` ``round(T - k T / n) - 1``, for k = 0 .. n-1. (diffusers' trailing rule, a float
    ``arange(T, 0, -T / n)``, gives one more timestep, -1, for some n (61, 103, ...): not here.)"""
    if spacing == "linspace":
        t = np.linspace(0, T - 1, n)
        return (t.round() if rounded else t)[::-1].copy()
    if spacing == "leading":
        return (np.arange(n) * (T // n))[::-1] + offset
    return np.round(T - np.arange(n) * (T / n)) - 1


def _karras(sigma_min, sigma_max, n):
    ramp = np.linspace(0.0, 1.0, n)
    lo, hi = sigma_min ** (1.0 / _KARRAS_RHO), sigma_max ** (1.0 / _KARRAS_RHO)
    return (hi + ramp * (lo - hi)) ** _KARRAS_RHO


def _shifted(sigmas, shift):
    """The flow-matching time shift ``shift s / (1 + (shift - 1) s)`` (SD3, Esser et al. 2024): a
    ``shift`` above 1 spends more of the steps at high noise."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def _sigma_to_t(sigmas, train_sigmas):
    """The (fractional) training timestep of each sigma: piecewise-linear in log sigma between the
    training sigmas, clamped to [0, T-1]."""
    return np.interp(np.log(np.maximum(sigmas, 1e-10)), np.log(train_sigmas), np.arange(len(train_sigmas)))


def _sigma_range(s, descending, name):
    """(sigma_min, sigma_max) of a Karras or exponential schedule: the config's when set, else the
    ends of ``descending``."""
    lo = descending[-1] if s["sigma_min"] is None else _positive(s, "sigma_min", name)
    hi = descending[0] if s["sigma_max"] is None else _positive(s, "sigma_max", name)
    return float(lo), float(hi)


def _final_sigma(s, train_sigmas, name):
    """The sigma after the last step: 0, or the smallest training sigma (``final_sigmas_type``)."""
    return 0.0 if _one_of(s, "final_sigmas_type", ("zero", "sigma_min"), name) == "zero" else train_sigmas[0]


# ---- config ---------------------------------------------------------------------------------------

def _resolve(config, defaults, fixed, name):
    """The settings: ``defaults`` updated with the config's non-null values for those keys, then
    ``fixed``. Other keys of the config are ignored, as diffusers' ``from_config`` does."""
    if not isinstance(config, Mapping):
        raise TypeError(f"{name}: config must be a dict (a diffusers scheduler_config.json), got "
                        f"{type(config).__name__}")
    settings = dict(defaults)
    settings.update({k: v for k, v in config.items() if k in defaults and v is not None})
    settings.update(fixed)
    return settings


def _one_of(s, key, choices, name):
    if s[key] not in choices:
        raise ValueError(f"{name}: config {key} must be one of {', '.join(map(repr, choices))}, got {s[key]!r}")
    return s[key]


def _flag(s, key, name):
    if not isinstance(s[key], (bool, np.bool_)):
        raise ValueError(f"{name}: config {key} must be true or false, got {s[key]!r}")
    return bool(s[key])


def _positive(s, key, name):
    v = s[key]
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"{name}: config {key} must be a positive number, got {v!r}")
    return float(v)


def _real(s, key, name):
    v = s[key]
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name}: config {key} must be a finite number, got {v!r}")
    return float(v)


def _integer(s, key, low, name):
    v = s[key]
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name}: config {key} must be an int >= {low}, got {v!r}")
    return int(v)


def _unsupported(s, key, name, why):
    """A setting flame does not implement: anything but diffusers' default (false / null) is refused."""
    if s[key]:
        raise ValueError(f"{name}: config {key}={s[key]!r} is not supported ({why})")
