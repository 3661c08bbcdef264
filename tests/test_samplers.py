"""flame.diffusion.samplers against diffusers' schedulers: the same loop over the same "model" (a
fixed function of the scaled input and the timestep) and the same noise, every step compared."""
import numpy as np
import pytest
import torch

import flame
from flame.diffusion.samplers import SAMPLERS, SDXL_BASE_SCHEDULER_CONFIG, make_sampler
from helpers import DEVICE, assert_close, rel_err

diffusers = pytest.importorskip("diffusers")
# diffusers' schedulers call np.array on torch tensors, which NumPy 2 warns about
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SHAPE = (2, 4, 8, 8)
BASE = SDXL_BASE_SCHEDULER_CONFIG


def _reference(name, config):
    """diffusers' scheduler for ``name``, switched from ``config`` as a user of diffusers would."""
    if name == "euler":
        return diffusers.EulerDiscreteScheduler.from_config(config)
    if name == "euler_a":
        return diffusers.EulerAncestralDiscreteScheduler.from_config(config)
    if name == "dpmpp_2m":
        return diffusers.DPMSolverMultistepScheduler.from_config(
            config, algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=True, lower_order_final=True)
    return diffusers.DDIMScheduler.from_config(config)


def _model(x, t, pattern):
    """A deterministic stand-in for the UNet: depends on its input and on the timestep."""
    return 0.1 * x + torch.sin(0.01 * float(t) + pattern)


def _run(name, config, steps, monkeypatch, dtype=torch.float32, rtol=1e-5):
    """Runs flame's sampler and diffusers' scheduler side by side on the same latents (diffusers'
    fp32 ones, given to flame in ``dtype`` at every step), the same model outputs and the same
    noise; compares the timesteps, the initial noise scale, every scaled model input and every
    step's result (fp32: element by element). Returns the largest relative error (norm) of a step."""
    ours, ref = make_sampler(name, steps, config), _reference(name, config)
    ref.set_timesteps(steps)
    want_t = ref.timesteps.numpy()
    assert len(ours) == len(want_t) and ours.timesteps.dtype == want_t.dtype
    if want_t.dtype == np.int64:
        np.testing.assert_array_equal(ours.timesteps, want_t)
    else:  # fractional timesteps (Karras / continuous): schedule math in float64 against float32
        np.testing.assert_allclose(ours.timesteps, want_t, rtol=1e-5, atol=2e-4)
    assert ours.init_noise_sigma == pytest.approx(float(ref.init_noise_sigma), rel=2e-6)

    g = torch.Generator().manual_seed(0)
    noise, pattern = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    step_noise = [torch.randn(SHAPE, generator=g) for _ in want_t]
    # diffusers' ancestral step draws with randn_tensor: give it the noise flame is given
    module = __import__(type(ref).__module__, fromlist=["randn_tensor"])
    if hasattr(module, "randn_tensor"):
        draws = iter(step_noise)
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: next(draws))

    def flame_copy(t):
        return flame.from_torch(t.to(DEVICE, dtype))

    x_ref = noise * ref.init_noise_sigma
    first = ours.prepare_latents(flame_copy(noise)).to_torch().float()
    assert_close(first, x_ref.to(DEVICE), rtol=2e-6 if dtype == torch.float32 else 2e-2, atol=0)
    worst = 0.0
    for i, t in enumerate(ref.timesteps):
        x = flame_copy(x_ref)
        xin_ref = ref.scale_model_input(x_ref, t)
        xin = ours.scale_model_input(x, i)
        m_ref = _model(xin_ref, t, pattern)
        noise_i = flame_copy(step_noise[i]) if name == "euler_a" else None
        x_prev_scale = float(x_ref.abs().max())
        x_ref = ref.step(m_ref, t, x_ref).prev_sample
        x = ours.step(flame_copy(m_ref), i, x, noise=noise_i)
        assert x.dtype == dtype and x.shape == SHAPE
        worst = max(worst, rel_err(x.to_torch().float(), x_ref.to(DEVICE)))
        if dtype == torch.float32:
            assert_close(xin, xin_ref.to(DEVICE), rtol=rtol, atol=rtol * float(xin_ref.abs().max()))
            # to rtol of the latents' scale, plus a few fp32 ulps of the step's input: diffusers'
            # fp32 ``x + d * dt`` loses those where a step shrinks x a lot (from sigma 4096 at zero
            # terminal SNR); flame folds the step's coefficients in float64 first
            atol = rtol * float(x_ref.abs().max()) + 4 * 2 ** -24 * x_prev_scale
            assert_close(x, x_ref.to(DEVICE), rtol=rtol, atol=atol)
    return worst


CASES = [
    ("euler", {}, 8),
    ("euler_a", {}, 6),
    ("dpmpp_2m", {}, 8),
    ("ddim", {}, 7),
    ("euler", {"prediction_type": "v_prediction", "timestep_spacing": "trailing", "rescale_betas_zero_snr": True}, 5),
    ("euler", {"use_karras_sigmas": True, "timestep_spacing": "linspace", "final_sigmas_type": "sigma_min",
               "prediction_type": "sample"}, 5),
    ("euler", {"prediction_type": "v_prediction", "timestep_type": "continuous", "use_exponential_sigmas": True,
               "sigma_max": 10.0}, 4),
    # diffusers' float32 1 - alpha_bar[0] puts its smallest sigma 8e-5 off here, and log-linear
    # interpolation spreads that over every sigma: 1e-4 (see the test's rtol)
    ("euler", {"interpolation_type": "log_linear", "timestep_spacing": "linspace", "beta_schedule": "linear",
               "beta_start": 0.0001, "beta_end": 0.02}, 4),
    ("euler_a", {"prediction_type": "v_prediction", "timestep_spacing": "trailing", "rescale_betas_zero_snr": True,
                 "use_karras_sigmas": True}, 5),  # the ancestral scheduler has no Karras option: ignored
    ("dpmpp_2m", {"prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "use_karras_sigmas": False}, 6),
    ("dpmpp_2m", {"solver_type": "heun", "prediction_type": "sample", "sigma_max": 10.0}, 5),
    # 15+ steps with a non-zero final sigma: the last step is second order too (diffusers' heun
    # gives NaN there: its last step has zero length, h = 0)
    ("dpmpp_2m", {"final_sigmas_type": "sigma_min", "euler_at_final": False}, 15),
    ("ddim", {"prediction_type": "v_prediction", "timestep_spacing": "trailing", "rescale_betas_zero_snr": True,
              "clip_sample": True, "clip_sample_range": 1.5}, 6),
    ("ddim", {"prediction_type": "sample", "timestep_spacing": "linspace", "set_alpha_to_one": True}, 6),
]


@pytest.mark.parametrize("name,changes,steps", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_diffusers_every_step(name, changes, steps, monkeypatch):
    _run(name, {**BASE, **changes}, steps, monkeypatch, rtol=1e-4 if "interpolation_type" in changes else 1e-5)


@pytest.mark.parametrize("name", SAMPLERS)
def test_bf16_latents_update_in_fp32(name, monkeypatch):
    """bf16 latents and model outputs: bf16 results that stay within bf16 rounding of diffusers'
    fp32 loop (each step's update is fp32, rounded once)."""
    worst = _run(name, BASE, 4, monkeypatch, dtype=torch.bfloat16)
    assert worst < 2e-2, f"bf16 loop drifted from the fp32 reference by {worst:.3g}"


@pytest.mark.parametrize("name", ["euler", "ddim"])
def test_trailing_spacing_gives_the_steps_asked_for(name):
    """diffusers' float arange adds a timestep -1 for 61 trailing steps; flame keeps the rest."""
    ref = _reference(name, {**BASE, "timestep_spacing": "trailing"})
    ref.set_timesteps(61)
    ours = make_sampler(name, 61, {**BASE, "timestep_spacing": "trailing"})
    assert len(ours) == 61 and len(ref.timesteps) == 62 and ref.timesteps[-1] == -1
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps[:-1].numpy())
    if name == "euler":
        np.testing.assert_allclose(ours.sigmas[:-1], ref.sigmas[:-2].numpy(), rtol=2e-5)


def test_state_reuse_and_rng():
    x0 = flame.randn(*SHAPE)

    def loop(sampler, start=0, noise=None):
        x = x0
        for i in range(start, len(sampler)):
            x = sampler.step(flame.mul(sampler.scale_model_input(x, i), 0.5), i, x, noise=noise)
        return x.numpy()

    dpm = make_sampler("dpmpp_2m", 5)
    first = loop(dpm)
    np.testing.assert_array_equal(loop(dpm), first)  # step 0 starts a new run: reusable
    np.testing.assert_array_equal(loop(make_sampler("dpmpp_2m", 5)), first)
    dpm.step(x0, 0, x0)
    with pytest.raises(ValueError, match="in order"):
        dpm.step(x0, 2, x0)
    dpm.reset()  # a run may start mid-schedule (img2img) after reset, with a first-order step
    fresh = make_sampler("dpmpp_2m", 5)
    np.testing.assert_array_equal(loop(dpm, start=2), loop(fresh, start=2))
    # deterministic samplers: scale_model_input is the identity, prepare_latents keeps the noise
    ddim = make_sampler("ddim", 3)
    assert ddim.scale_model_input(x0, 1) is x0 and ddim.prepare_latents(x0) is x0 and ddim.init_noise_sigma == 1.0
    # euler_a draws its noise from flame's generator when none is given: seeded runs repeat
    anc = make_sampler("euler_a", 3)
    flame.manual_seed(7)
    a = loop(anc)
    flame.manual_seed(7)
    np.testing.assert_array_equal(loop(anc), a)
    assert not np.array_equal(loop(anc), a)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match=r"unknown sampler 'heun'.*euler, euler_a, dpmpp_2m, ddim"):
        make_sampler("heun", 10)
    for steps in (0, 1001, 2.5, True):
        with pytest.raises(ValueError, match=r"num_inference_steps must be an int in \[1, num_train_timesteps"):
            make_sampler("euler", steps)
    bad = [
        ("euler", {"timestep_spacing": "even"}, "timestep_spacing must be one of"),
        ("euler", {"prediction_type": "flow_prediction"}, "prediction_type must be one of"),
        ("euler", {"use_beta_sigmas": True}, "use_beta_sigmas=True is not supported"),
        ("euler", {"use_karras_sigmas": True, "use_exponential_sigmas": True}, "exclusive"),
        ("euler", {"use_karras_sigmas": "yes"}, "use_karras_sigmas must be true or false"),
        ("euler", {"beta_schedule": "squaredcos_cap_v2"}, "beta_schedule must be one of"),
        ("euler", {"trained_betas": [0.01] * 10}, "trained_betas must be 1000"),
        ("euler_a", {"steps_offset": -1}, "steps_offset must be an int >= 0"),
        ("ddim", {"num_train_timesteps": "1000"}, "num_train_timesteps must be an int >= 1"),
        ("dpmpp_2m", {"thresholding": True}, "thresholding=True is not supported"),
        ("dpmpp_2m", {"use_lu_lambdas": True}, "use_lu_lambdas=True is not supported"),
        ("dpmpp_2m", {"solver_type": "rk4"}, "solver_type must be one of"),
        ("dpmpp_2m", {"sigma_min": -1.0}, "sigma_min must be a positive number"),
        ("ddim", {"steps_offset": 200}, "past num_train_timesteps"),
        ("ddim", {"timestep_spacing": "trailing", "rescale_betas_zero_snr": True}, "zero terminal SNR"),
    ]
    for name, changes, message in bad:
        with pytest.raises(ValueError, match=message):
            make_sampler(name, 10, {**BASE, **changes})
    with pytest.raises(TypeError, match="config must be a dict"):
        make_sampler("ddim", 10, "scheduler_config.json")
    s, x = make_sampler("euler", 4), flame.zeros(*SHAPE)
    with pytest.raises(IndexError, match=r"step index must be an int in \[0, 4\), got 4"):
        s.step(x, 4, x)
    with pytest.raises(IndexError, match="step index"):
        s.scale_model_input(x, -1)
    with pytest.raises(ValueError, match="model_output has shape"):
        s.step(flame.zeros(1, 4, 8, 8), 0, x)
    with pytest.raises(TypeError, match=r"flame\.from_torch"):
        s.step(torch.zeros(SHAPE), 0, x)
    with pytest.raises(TypeError, match="floating-point"):
        s.step(flame.zeros(*SHAPE, dtype=flame.int64), 0, x)
