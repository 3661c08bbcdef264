"""Rectified-flow training helpers against diffusers' Flux/SD3 formulas."""
import math

import numpy as np
import pytest
import torch

import flame
from flame.diffusion import (
    flow_loss_weights,
    flow_noisy,
    flow_target,
    resolution_shift,
    sample_fraction,
    sample_sigmas,
    sample_timesteps,
)


def _np(t):
    return t.numpy().astype(np.float64)


def _flame(t):
    """A (CPU) torch reference input as a flame tensor on flame's device."""
    return flame.from_torch(t.to(flame.device))


@pytest.mark.parametrize("tokens", [256, 1024, 4096, 4608, 77])
def test_resolution_shift_is_diffusers_calculate_shift(tokens):
    pipeline_flux = pytest.importorskip("diffusers.pipelines.flux.pipeline_flux")
    mu = pipeline_flux.calculate_shift(tokens, 256, 4096, 0.5, 1.15)
    assert resolution_shift(tokens) == pytest.approx(math.exp(mu), rel=1e-12)


def test_shifted_sigmas_are_the_schedulers_time_shift():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    flame.manual_seed(3)
    plain = _np(sample_sigmas(64))
    mu = 1.15
    flame.manual_seed(3)
    shifted = _np(sample_sigmas(64, shift=resolution_shift(4096)))
    ref = sched.time_shift(mu, 1.0, torch.tensor(plain, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(shifted, ref, rtol=1e-5, atol=1e-6)


def test_sigma_distributions_and_range():
    flame.manual_seed(0)
    u = _np(sample_sigmas(20000))
    assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.02
    ln = _np(sample_sigmas(20000, distribution="logit_normal", logit_mean=0.0, logit_std=1.0))
    z = np.log(ln / (1 - ln))  # the normal it came from
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1.0) < 0.05
    shifted = _np(sample_sigmas(20000, shift=3.0))
    assert shifted.mean() > 0.6  # more noise


def test_timesteps_and_sigmas_share_the_draw():
    flame.manual_seed(5)
    u = _np(sample_fraction(8, distribution="logit_normal", shift=2.0))
    flame.manual_seed(5)
    t = sample_timesteps(8, 0, 1000, distribution="logit_normal", shift=2.0).numpy()
    np.testing.assert_array_equal(t, np.clip(np.floor(u.astype(np.float32) * 1000), 0, 999))


def test_noisy_and_target_match_flow_match_scheduler():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler()
    x0 = torch.randn(3, 4, 6, 10)
    noise = torch.randn(3, 4, 6, 10)
    sig = torch.tensor([0.05, 0.5, 0.97])
    # scale_noise takes timesteps and looks their sigmas up in its table: use table entries
    timesteps = sched.timesteps[[980, 500, 30]]
    sig = sched.sigmas[[980, 500, 30]]
    ref = sched.scale_noise(x0, timesteps, noise)
    got = flow_noisy(_flame(x0), _flame(noise), _flame(sig.float())).to_torch().cpu()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    target = flow_target(_flame(x0), _flame(noise)).to_torch().cpu()
    torch.testing.assert_close(target, noise - x0)


@pytest.mark.parametrize("scheme", ["none", "sigma_sqrt", "cosmap"])
def test_weighting_schemes_match_diffusers(scheme):
    training_utils = pytest.importorskip("diffusers.training_utils")
    sig = torch.tensor([0.01, 0.2, 0.5, 0.9, 0.999])
    ref = training_utils.compute_loss_weighting_for_sd3(scheme, sig)
    got = flow_loss_weights(_flame(sig), scheme)
    if scheme == "none":
        assert got is None
        return
    torch.testing.assert_close(got.to_torch().cpu(), ref.float(), rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scheme"):
        flow_loss_weights(flame.ones(2), "snr")
    with pytest.raises(ValueError, match="image_seq_len"):
        resolution_shift(0)
    with pytest.raises(ValueError, match="distribution"):
        sample_sigmas(2, distribution="beta")
    with pytest.raises(ValueError, match="same shape"):
        flow_target(flame.ones(2, 3), flame.ones(2, 4))
    with pytest.raises(ValueError, match="timestep"):
        flow_noisy(flame.ones(2, 3), flame.ones(2, 3), flame.ones(3))


# ---- sampling: FlowMatchEulerDiscreteScheduler as FluxPipeline drives it ------------------------------

FLOW_CONFIGS = {
    "dev": (None, 28, 4096),  # Flux.1-dev's scheduler config (dynamic shift) at 1024x1024
    "dev-512": (None, 20, 1024),
    "schnell": ({"use_dynamic_shifting": False, "shift": 1.0}, 4, None),
    "static-shift": ({"use_dynamic_shifting": False, "shift": 3.0}, 7, None),
    "linear-time-shift": ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, 5, 2000),
}


@pytest.mark.parametrize("case", list(FLOW_CONFIGS))
def test_flow_euler_matches_diffusers_step_for_step(case):
    diffusers = pytest.importorskip("diffusers")
    pipeline_flux = pytest.importorskip("diffusers.pipelines.flux.pipeline_flux")
    from flame.diffusion import FLUX_SCHEDULER_CONFIG, make_sampler
    config, n, tokens = FLOW_CONFIGS[case]
    full = dict(FLUX_SCHEDULER_CONFIG, **(config or {}))
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(full)
    kwargs = {}
    if full["use_dynamic_shifting"]:
        kwargs["mu"] = pipeline_flux.calculate_shift(tokens, full["base_image_seq_len"], full["max_image_seq_len"],
                                                     full["base_shift"], full["max_shift"])
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), **kwargs)
    sampler = make_sampler("flow_euler", n, config, image_seq_len=tokens)
    np.testing.assert_allclose(sampler.timesteps, ref.timesteps.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sampler.sigmas, ref.sigmas.numpy(), rtol=1e-5, atol=1e-7)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 8, generator=gen)
    mine = sampler.prepare_latents(_flame(x))
    for i, t in enumerate(ref.timesteps[:3]):
        v = torch.randn(2, 6, 8, generator=gen)
        x = ref.step(v, t, x).prev_sample
        mine = sampler.step(_flame(v), i, mine)
        torch.testing.assert_close(mine.to_torch().cpu(), x, rtol=1e-5, atol=1e-6)


def test_flow_euler_errors():
    from flame.diffusion import make_sampler
    with pytest.raises(ValueError, match="use_dynamic_shifting needs image_seq_len"):
        make_sampler("flow_euler", 4)
    with pytest.raises(ValueError, match="image_seq_len is a flow sampler's setting"):
        make_sampler("euler", 4, image_seq_len=1024)
    with pytest.raises(ValueError, match="use_karras_sigmas=True is not supported"):
        make_sampler("flow_euler", 4, {"use_karras_sigmas": True}, image_seq_len=16)
    with pytest.raises(ValueError, match="shift_terminal is not supported"):
        make_sampler("flow_euler", 4, {"shift_terminal": 0.02, "use_dynamic_shifting": False})
    with pytest.raises(ValueError, match="unknown sampler 'flux'"):
        make_sampler("flux", 4)
