"""The rectified-flow samplers flow_dpmpp_2m and flow_heun against diffusers' schedulers, driven
as a diffusers user drives them for Flux.1: the same loop over the same fake model (linear in its
input and the timestep) from the same noise, each sampler on its own trajectory, every step compared."""
import numpy as np
import pytest
import torch

import flame
from flame.diffusion.samplers import FLOW_SAMPLERS, FLUX_SCHEDULER_CONFIG, make_sampler
from helpers import DEVICE, assert_close, rel_err

diffusers = pytest.importorskip("diffusers")
pipeline_flux = pytest.importorskip("diffusers.pipelines.flux.pipeline_flux")
# diffusers' schedulers call np.array on torch tensors, which NumPy 2 warns about
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SHAPE = (1, 4, 4, 4)


def _reference(name, config, steps, image_seq_len):
    """diffusers' scheduler for ``name``, switched from ``config`` with ``from_config`` and its
    timesteps set as FluxPipeline sets them (``mu`` from ``calculate_shift`` under dynamic shifting;
    FluxPipeline drops its own sigmas for a scheduler with flow sigmas) or, where FluxPipeline cannot
    drive it (a static shift for DPM-Solver, any Heun), with ``set_timesteps(steps)``."""
    if name == "flow_heun":
        ref = diffusers.FlowMatchHeunDiscreteScheduler.from_config(config)
        ref.set_timesteps(steps)
        return ref
    ref = diffusers.DPMSolverMultistepScheduler.from_config(
        config, use_flow_sigmas=True, prediction_type="flow_prediction", algorithm_type="dpmsolver++", solver_order=2)
    if not ref.config.use_dynamic_shifting:
        ref.set_timesteps(steps)
        return ref
    c = ref.config
    mu = pipeline_flux.calculate_shift(image_seq_len, c.get("base_image_seq_len", 256),
                                       c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                       c.get("max_shift", 1.15))
    pipeline_flux.retrieve_timesteps(ref, steps, None, sigmas=None, mu=mu)
    return ref


def _model(x, t, pattern):
    """The fake velocity model: linear in the latents and in FluxPipeline's timestep ``t / 1000``."""
    return 0.3 * x + (float(t) / 1000.0) * pattern - 0.2


def _run(name, changes, steps, image_seq_len=None, dtype=torch.float32):
    """Runs diffusers' scheduler and flame's sampler from the same noise, each on its own latents,
    and compares the schedules and, fp32, the latents after every step (1e-5 relative). Returns the
    largest relative error (norm) of a step."""
    config = {**FLUX_SCHEDULER_CONFIG, **changes}
    ref = _reference(name, config, steps, image_seq_len)
    ours = make_sampler(name, steps, config, image_seq_len=image_seq_len)
    want_t = ref.timesteps.numpy()
    assert len(ours) == len(want_t) and ours.timesteps.dtype == want_t.dtype and ours.num_inference_steps == steps
    if want_t.dtype == np.int64:  # DPM-Solver's flow timesteps, truncated to integers
        np.testing.assert_array_equal(ours.timesteps, want_t)
    else:
        np.testing.assert_allclose(ours.timesteps, want_t, rtol=1e-6)
    np.testing.assert_allclose(ours.sigmas, ref.sigmas.numpy(), rtol=1e-6, atol=1e-7)

    g = torch.Generator().manual_seed(0)
    noise, pattern = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    x_ref, x = noise, ours.prepare_latents(flame.from_torch(noise.to(DEVICE, dtype)))
    worst = 0.0
    for i, (t_ref, t) in enumerate(zip(ref.timesteps, ours.timesteps)):
        x_ref = ref.step(_model(x_ref, t_ref, pattern), t_ref, x_ref).prev_sample
        v = _model(ours.scale_model_input(x, i).to_torch().float().cpu(), t, pattern)
        x = ours.step(flame.from_torch(v.to(DEVICE, dtype)), i, x)
        assert x.dtype == dtype and x.shape == SHAPE
        worst = max(worst, rel_err(x.to_torch().float(), x_ref.to(DEVICE)))
        if dtype == torch.float32:
            assert_close(x, x_ref.to(DEVICE), rtol=1e-5, atol=1e-5 * float(x_ref.abs().max()))
    return worst


DEV = {}  # Flux.1-dev's scheduler config: dynamic shift, shift 3.0 (the Heun scheduler's only setting there)
SCHNELL = {"use_dynamic_shifting": False, "shift": 1.0}
CASES = [
    # Flux.1-dev at 1024x1024 (4096 image tokens), 512x512 (1024) and 256x256 (256)
    ("flow_dpmpp_2m", DEV, 28, 4096),
    ("flow_dpmpp_2m", DEV, 6, 1024),
    ("flow_dpmpp_2m", DEV, 4, 256),
    ("flow_dpmpp_2m", DEV, 2, 4096),
    ("flow_dpmpp_2m", DEV, 1, 4096),
    ("flow_dpmpp_2m", {"solver_type": "heun"}, 5, 1024),
    ("flow_dpmpp_2m", {"base_shift": 0.7, "max_shift": 1.3, "max_image_seq_len": 8192}, 5, 6000),
    ("flow_dpmpp_2m", {"euler_at_final": True, "lower_order_final": False}, 4, 4096),  # the name keeps the latter
    # static shifts: schnell's config (DPM-Solver reads flow_shift, default 1, not shift) and a flow_shift of 3
    ("flow_dpmpp_2m", SCHNELL, 4, None),
    ("flow_dpmpp_2m", {"use_dynamic_shifting": False, "flow_shift": 3.0}, 7, None),
    ("flow_heun", DEV, 4, 4096),  # image_seq_len is ignored: diffusers' Heun has no dynamic shift
    ("flow_heun", DEV, 28, None),
    ("flow_heun", DEV, 2, None),
    ("flow_heun", DEV, 1, None),
    ("flow_heun", SCHNELL, 4, None),
    ("flow_heun", {"shift": 1.7, "num_train_timesteps": 500}, 5, None),
]


@pytest.mark.parametrize("name,changes,steps,tokens", CASES,
                         ids=[f"{c[0]}-{c[2]}steps-{i}" for i, c in enumerate(CASES)])
def test_matches_diffusers_every_step(name, changes, steps, tokens):
    _run(name, changes, steps, tokens)


@pytest.mark.parametrize("name", ["flow_dpmpp_2m", "flow_heun"])
def test_bf16_latents_update_in_fp32(name):
    """bf16 latents and model outputs stay within bf16 rounding of diffusers' fp32 loop."""
    worst = _run(name, DEV, 4, 4096, dtype=torch.bfloat16)
    assert worst < 2e-2, f"bf16 loop drifted from the fp32 reference by {worst:.3g}"


def test_flow_samplers_listed():
    assert FLOW_SAMPLERS == ("flow_euler", "flow_dpmpp_2m", "flow_heun")
    heun = make_sampler("flow_heun", 3)  # Flux.1-dev's config by default
    assert len(heun) == 5 and heun.num_inference_steps == 3 and heun.prediction_type == "flow"
    assert heun.config == {"num_train_timesteps": 1000, "shift": 3.0}


def test_what_flux_pipeline_can_drive():
    """The docstring's claims about FluxPipeline (it passes ``sigmas`` and ``mu``): DPM-Solver with
    flow sigmas takes ``mu`` under dynamic shifting only; the Heun scheduler takes no ``sigmas``."""
    sigmas = np.linspace(1.0, 0.25, 4)
    heun = diffusers.FlowMatchHeunDiscreteScheduler.from_config(FLUX_SCHEDULER_CONFIG)
    with pytest.raises(ValueError, match="sigmas"):
        pipeline_flux.retrieve_timesteps(heun, 4, None, sigmas=sigmas, mu=1.0)
    static = diffusers.DPMSolverMultistepScheduler.from_config(
        {**FLUX_SCHEDULER_CONFIG, **SCHNELL}, use_flow_sigmas=True, prediction_type="flow_prediction")
    with pytest.raises(AssertionError):
        pipeline_flux.retrieve_timesteps(static, 4, None, sigmas=None, mu=1.0)


def test_state_and_order():
    x0 = flame.randn(*SHAPE)

    def loop(sampler, start=0):
        x = x0
        for i in range(start, len(sampler)):
            x = sampler.step(flame.mul(x, 0.5), i, x)
        return x.numpy()

    for name in ("flow_dpmpp_2m", "flow_heun"):
        sampler = make_sampler(name, 4, image_seq_len=1024)
        first = loop(sampler)
        np.testing.assert_array_equal(loop(sampler), first)  # step 0 starts a new run: reusable
        np.testing.assert_array_equal(loop(make_sampler(name, 4, image_seq_len=1024)), first)
        sampler.reset()
        np.testing.assert_array_equal(loop(sampler, start=2), loop(make_sampler(name, 4, image_seq_len=1024), start=2))
    dpm = make_sampler("flow_dpmpp_2m", 4, image_seq_len=1024)
    dpm.step(x0, 0, x0)
    with pytest.raises(ValueError, match="in order"):
        dpm.step(x0, 2, x0)
    heun = make_sampler("flow_heun", 4)
    with pytest.raises(ValueError, match="step 1 is the corrector of step 0"):
        heun.step(x0, 1, x0)
    heun.step(x0, 2, x0)
    with pytest.raises(ValueError, match="step 5 is the corrector of step 4"):
        heun.step(x0, 5, x0)
    with pytest.raises(IndexError, match=r"\[0, 7\)"):
        heun.step(x0, 7, x0)


@pytest.mark.parametrize("name,config,tokens,match", [
    ("flow_dpmpp_2m", None, None, "use_dynamic_shifting needs image_seq_len"),
    ("flow_dpmpp_2m", None, 0, "use_dynamic_shifting needs image_seq_len"),
    ("flow_dpmpp_2m", {"final_sigmas_type": "sigma_min"}, 64, "final_sigmas_type='sigma_min' is not supported"),
    ("flow_dpmpp_2m", {"final_sigmas_type": "last"}, 64, "final_sigmas_type must be one of"),
    ("flow_dpmpp_2m", {"use_karras_sigmas": True}, 64, "use_karras_sigmas=True is not supported"),
    ("flow_dpmpp_2m", {"use_lu_lambdas": True}, 64, "use_lu_lambdas=True is not supported"),
    ("flow_dpmpp_2m", {"thresholding": True}, 64, "thresholding=True is not supported"),
    ("flow_dpmpp_2m", {"time_shift_type": "linear"}, 64, "time_shift_type must be one of 'exponential'"),
    ("flow_dpmpp_2m", {"use_dynamic_shifting": False, "flow_shift": 0.0}, None, "flow_shift must be a positive"),
    ("flow_dpmpp_2m", {"use_dynamic_shifting": "yes"}, 64, "use_dynamic_shifting must be true or false"),
    ("flow_dpmpp_2m", {"solver_type": "rk4"}, 64, "solver_type must be one of"),
    ("flow_dpmpp_2m", {"base_shift": "0.5"}, 64, "base_shift must be a finite number"),
    ("flow_dpmpp_2m", {"max_image_seq_len": 256}, 64, "must differ"),
    ("flow_euler", {"max_shift": float("nan")}, 64, "max_shift must be a finite number"),
    ("flow_heun", {"shift": -1.0}, None, "shift must be a positive number"),
    ("flow_heun", {"num_train_timesteps": 0}, None, "num_train_timesteps must be an int >= 1"),
    ("flow_heun", [1.0], None, "config must be a dict"),
])
def test_bad_config_raises(name, config, tokens, match):
    if isinstance(config, dict):  # changes to Flux.1-dev's config
        config = {**FLUX_SCHEDULER_CONFIG, **config}
    with pytest.raises((ValueError, TypeError), match=match):
        make_sampler(name, 4, config, image_seq_len=tokens)


def test_bad_steps_raise():
    with pytest.raises(ValueError, match="num_inference_steps must be an int"):
        make_sampler("flow_heun", 0)
    with pytest.raises(ValueError, match="num_inference_steps must be an int"):
        make_sampler("flow_dpmpp_2m", 1001, image_seq_len=64)
