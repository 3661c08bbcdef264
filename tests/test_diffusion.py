"""flame.diffusion against diffusers' DDPMScheduler / training_utils and the formulas of sdxl.md."""
import math

import numpy as np
import pytest
import torch

import flame
from flame.diffusion import DDPMSchedule, min_snr_weights, sample_noise, sample_timesteps, weighted_mse_loss
from helpers import DEVICE, assert_close, assert_within_torch_error


def _betas64(schedule="scaled_linear", start=0.00085, end=0.012, n=1000):
    if schedule == "scaled_linear":
        return np.linspace(math.sqrt(start), math.sqrt(end), n) ** 2
    return np.linspace(start, end, n)


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear"])
def test_alphas_cumprod_matches_formula_and_diffusers(beta_schedule):
    s = DDPMSchedule(beta_schedule=beta_schedule)
    got = s.alphas_cumprod.to_torch()
    assert got.dtype == torch.float32 and got.shape == (1000,) and got.device.type == DEVICE.type
    want64 = np.cumprod(1.0 - _betas64(beta_schedule))
    np.testing.assert_allclose(got.cpu().numpy(), want64, rtol=2e-7, atol=0)
    assert s.alphas_cumprod.to_torch().data_ptr() == got.data_ptr()  # computed once, kept on the device
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule=beta_schedule)
    torch.testing.assert_close(got.cpu(), ref.alphas_cumprod, rtol=2e-6, atol=0)
    torch.testing.assert_close(s.betas.to_torch().cpu(), ref.betas, rtol=1e-6, atol=0)


def test_from_config_reads_diffusers_keys():
    s = DDPMSchedule.from_config({"num_train_timesteps": 500, "beta_start": 0.0001, "beta_end": 0.02,
                                  "beta_schedule": "linear", "prediction_type": "epsilon", "_class_name": "x"})
    assert (s.num_train_timesteps, s.beta_schedule) == (500, "linear")
    np.testing.assert_allclose(s.alphas_cumprod.numpy(), np.cumprod(1 - _betas64("linear", 0.0001, 0.02, 500)),
                               rtol=2e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_noise_velocity_and_targets_match_diffusers(dtype):
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear")
    s = DDPMSchedule()
    x0 = torch.randn(5, 4, 3, 6, dtype=dtype)
    noise = torch.randn(5, 4, 3, 6, dtype=dtype)
    t = torch.tensor([0, 1, 499, 998, 999])
    fx, fn, ft = (flame.from_torch(v.to(DEVICE)) for v in (x0, noise, t))
    noisy = s.add_noise(fx, fn, ft)
    vel = s.get_velocity(fx, fn, ft, check=False)
    assert noisy.dtype == vel.dtype == dtype
    if dtype == torch.float32:
        assert_close(noisy, ref.add_noise(x0, noise, t).to(DEVICE))
        assert_close(vel, ref.get_velocity(x0, noise, t).to(DEVICE))
    else:  # diffusers rounds alpha_bar to fp16 before its square root: compare errors against fp32
        x32, n32 = x0.float(), noise.float()
        assert_within_torch_error(noisy, ref.add_noise(x0, noise, t), ref.add_noise(x32, n32, t), 2)
        assert_within_torch_error(vel, ref.get_velocity(x0, noise, t), ref.get_velocity(x32, n32, t), 2)
    assert_close(s.target(fx, fn, ft, "v_prediction"), vel)
    assert s.target(fx, fn, ft, "epsilon") is fn and s.target(fx, fn, ft, "sample") is fx


def test_snr_and_min_snr_weights_match_diffusers():
    training_utils = pytest.importorskip("diffusers.training_utils")
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear")
    s = DDPMSchedule()
    t = torch.tensor([0, 3, 100, 500, 900, 999])
    snr_ref = training_utils.compute_snr(ref, t)
    snr = s.snr(flame.from_torch(t.to(DEVICE)))
    # diffusers divides its fp32 alpha_bar by 1 - alpha_bar; flame's table is float64 rounded once
    assert_close(snr, snr_ref.to(DEVICE), rtol=5e-5, atol=0)
    c = s.coefficients(flame.from_torch(t.to(DEVICE)))
    assert_close(flame.mul(c.sqrt_alpha_bar, c.sqrt_alpha_bar), c.alpha_bar, rtol=1e-6, atol=1e-7)
    gamma = 5.0
    clipped = torch.stack([snr_ref, gamma * torch.ones_like(snr_ref)], dim=1).min(dim=1)[0]
    for kind, want in (("epsilon", clipped / snr_ref), ("v_prediction", clipped / (snr_ref + 1)),
                       ("sample", clipped)):
        assert_close(min_snr_weights(snr, gamma, kind), want.to(DEVICE), rtol=5e-5, atol=0)
    w = min_snr_weights(snr, gamma).numpy()
    assert w[-1] == pytest.approx(1.0) and w[0] == pytest.approx(gamma / snr_ref[0].item(), rel=5e-5)


def test_lookup_checks_timesteps():
    s = DDPMSchedule()
    with pytest.raises(IndexError, match="out of range"):
        s.snr(flame.tensor([0, 1000]))
    with pytest.raises(TypeError, match="int64 or int32"):
        s.snr(flame.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="timestep"):
        s.add_noise(flame.zeros(3, 4, 2, 2), flame.zeros(3, 4, 2, 2), [1, 2])
    with pytest.raises(ValueError, match="same shape"):
        s.add_noise(flame.zeros(2, 4, 2, 2), flame.zeros(2, 4, 2, 3), [1, 2])
    with pytest.raises(ValueError, match="prediction_type"):
        s.target(flame.zeros(1, 4, 2, 2), flame.zeros(1, 4, 2, 2), [1], "eps")
    with pytest.raises(ValueError, match="gamma"):
        min_snr_weights(flame.ones(2), 0.0)
    with pytest.raises(ValueError, match="beta_schedule"):
        DDPMSchedule(beta_schedule="cosine")
    # the unchecked gather gives the same rows
    t = flame.tensor([7, 0, 999], dtype=flame.int32)
    for a, b in zip(s.coefficients(t), s.coefficients(t, check=False)):
        assert_close(a, b, rtol=0, atol=0)


def test_sample_timesteps_range_uniformity_and_determinism():
    flame.manual_seed(3)
    t = sample_timesteps(6000, 100, 130)
    assert t.dtype == torch.int64 and t.shape == (6000,)
    v = t.numpy()
    assert v.min() == 100 and v.max() == 129
    counts = np.bincount(v - 100, minlength=30)
    chi2 = float(((counts - 200.0) ** 2 / 200.0).sum())
    assert chi2 < 70, f"timesteps far from uniform (chi2 {chi2:.1f}, 29 dof): {counts}"
    flame.manual_seed(3)
    np.testing.assert_array_equal(sample_timesteps(6000, 100, 130).numpy(), v)
    assert set(sample_timesteps(64, 5, 6).numpy().tolist()) == {5}
    with pytest.raises(ValueError, match="low < high"):
        sample_timesteps(4, 10, 10)


@pytest.mark.parametrize("distribution, shift", [("logit_normal", 1.0), ("uniform", 3.0), ("logit_normal", 0.5)])
def test_timestep_distributions_map_the_same_draw(distribution, shift):
    """logit-normal: u = sigmoid(mean + std * z) of the normal draw z; a shift maps u to
    shift u / (1 + (shift - 1) u); then t = low + u (high - low), truncated."""
    n, low, high, mean, std = 4000, 10, 990, -0.3, 1.2
    flame.manual_seed(5)
    base = (flame.randn(n) if distribution == "logit_normal" else flame.rand(n)).numpy().astype(np.float64)
    flame.manual_seed(5)
    t = sample_timesteps(n, low, high, distribution=distribution, logit_mean=mean, logit_std=std, shift=shift).numpy()
    u = 1.0 / (1.0 + np.exp(-(mean + std * base))) if distribution == "logit_normal" else base
    u = shift * u / (1.0 + (shift - 1.0) * u)
    want = np.clip(np.floor(low + u * (high - low)), low, high - 1)
    assert np.abs(t - want).max() <= 1 and (t == want).mean() > 0.99  # fp32 on the device, fp64 here
    assert t.min() >= low and t.max() < high
    if distribution == "logit_normal" and shift == 1.0:  # the median lands at sigmoid(mean)
        assert abs(np.median(t) - (low + (high - low) / (1 + math.exp(-mean)))) < 15
    if shift > 1:
        assert np.mean(t) > 0.6 * (low + high)  # shifted towards noise
    with pytest.raises(ValueError, match="distribution must be one of"):
        sample_timesteps(4, 0, 10, distribution="cosmap")
    with pytest.raises(ValueError, match="shift > 0"):
        sample_timesteps(4, 0, 10, shift=0.0)


def test_zero_terminal_snr_matches_diffusers():
    s = DDPMSchedule(rescale_betas_zero_snr=True)
    abar = s.alphas_cumprod.numpy()
    assert abar[-1] == 0 and s.snr(flame.tensor([999])).item() == 0
    np.testing.assert_allclose(abar[0], DDPMSchedule().alphas_cumprod.numpy()[0], rtol=1e-6)
    assert DDPMSchedule.from_config({"rescale_betas_zero_snr": True}).rescale_betas_zero_snr
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                  rescale_betas_zero_snr=True)
    torch.testing.assert_close(torch.from_numpy(abar), ref.alphas_cumprod, rtol=2e-5, atol=1e-7)
    # diffusers rescales in fp32, flame in fp64: the small early betas (ratios of near-1 products) differ most
    torch.testing.assert_close(s.betas.to_torch().cpu(), ref.betas, rtol=5e-4, atol=1e-5)


def test_noise_offset_adds_a_per_channel_constant():
    flame.manual_seed(11)
    base = flame.randn(2, 3, 4, 5)
    flame.manual_seed(11)
    assert np.array_equal(sample_noise((2, 3, 4, 5)).numpy(), base.numpy())
    flame.manual_seed(11)
    noisy = sample_noise((2, 3, 4, 5), offset=0.1)
    diff = noisy.numpy() - base.numpy()
    per_channel = diff[:, :, :1, :1]
    np.testing.assert_allclose(diff, np.broadcast_to(per_channel, diff.shape), atol=1e-6)
    assert np.abs(per_channel).max() > 1e-3 and np.abs(per_channel).max() < 1.0  # 0.1 * N(0, 1)
    assert noisy.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weighted_mse_loss_matches_torch(dtype):
    pred = torch.randn(3, 4, 5, 2, dtype=dtype)
    target = torch.randn(3, 4, 5, 2)
    w = torch.rand(3) + 0.5
    fp, ft, fw = (flame.from_torch(v.to(DEVICE), requires_grad=v is pred) for v in (pred, target, w))
    loss = weighted_mse_loss(fp, ft, fw)
    tp = pred.clone().requires_grad_()
    want = (torch.nn.functional.mse_loss(tp.float(), target, reduction="none").mean(dim=(1, 2, 3)) * w).mean()
    assert loss.shape == () and loss.dtype == torch.float32
    assert_close(loss, want.detach().to(DEVICE), rtol=1e-5, atol=1e-6)
    grads = loss.backward()
    want.backward()
    assert_close(grads[fp], tp.grad.float().to(DEVICE), rtol=1e-3 if dtype == torch.float16 else None)
    plain = weighted_mse_loss(fp.detach(), ft)
    assert_close(plain, torch.nn.functional.mse_loss(pred.float(), target).to(DEVICE), rtol=1e-5, atol=1e-6)
