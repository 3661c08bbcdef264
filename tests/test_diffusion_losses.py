"""flame.diffusion.losses against hand-written PyTorch versions of kohya's formulas
(sd-scripts ``conditional_loss`` and ``get_huber_threshold_if_needed``, reduced as train_network.py)."""
import math

import pytest
import torch

import flame
from flame.diffusion import DDPMSchedule, weighted_mse_loss
from flame.diffusion.losses import HUBER_SCHEDULES, LOSS_TYPES, diffusion_loss, huber_c_per_timestep
from helpers import DEVICE, assert_close


def _kohya_loss(pred, target, loss_type, weights, c):
    """Elementwise loss, mean per sample, times the weight, batch mean (kohya's train_network.py)."""
    d = pred.float() - target.float()
    if loss_type in ("huber", "smooth_l1"):
        c = c.view(-1, *([1] * (d.ndim - 1)))
        r = torch.sqrt(d ** 2 + c ** 2) - c
        per_elem = 2 * c * r if loss_type == "huber" else 2 * r
    else:
        per_elem = d ** 2 if loss_type == "l2" else d.abs()
    per_sample = per_elem.mean(dim=tuple(range(1, d.ndim)))
    return (per_sample * weights).mean() if weights is not None else per_sample.mean()


def _flame(t, grad=False):
    return flame.from_torch(t.to(DEVICE), requires_grad=grad)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_match_kohya_values_and_gradients(loss_type):
    torch.manual_seed(0)
    pred = torch.randn(3, 2, 3, 4) * 2  # |d| both below and above c, so both regimes of huber count
    target = torch.randn(3, 2, 3, 4)
    w = torch.rand(3) + 0.5
    huber = loss_type in ("huber", "smooth_l1")
    cs = [torch.tensor([0.05, 0.5, 1.5]), 0.3] if huber else [None]
    for c in cs:
        for weights in (w, None):
            fp, ft = _flame(pred, True), _flame(target, True)
            fc = _flame(c) if isinstance(c, torch.Tensor) else c
            loss = diffusion_loss(fp, ft, loss_type, None if weights is None else _flame(weights), huber_c=fc)
            tp, tt = pred.clone().requires_grad_(), target.clone().requires_grad_()
            ref_c = torch.full((3,), c) if isinstance(c, float) else c
            want = _kohya_loss(tp, tt, loss_type, weights, ref_c)
            assert loss.shape == () and loss.dtype == torch.float32
            assert_close(loss, want.detach().to(DEVICE), rtol=1e-5, atol=1e-6)
            grads = loss.backward()
            want.backward()
            assert_close(grads[fp], tp.grad.to(DEVICE), rtol=1e-5, atol=1e-7)
            assert_close(grads[ft], tt.grad.to(DEVICE), rtol=1e-5, atol=1e-7)
    if loss_type == "l2":  # weighted_mse_loss is this loss, and fp16 inputs give an fp32 loss
        fp, ft, fw = _flame(pred), _flame(target), _flame(w)
        assert weighted_mse_loss(fp, ft, fw).to_torch().item() == diffusion_loss(fp, ft, "l2", fw).to_torch().item()
        half = diffusion_loss(_flame(pred.half()), ft, "l2", fw)
        assert half.dtype == torch.float32
        assert_close(half, _kohya_loss(pred.half(), target, "l2", w, None).to(DEVICE), rtol=1e-5, atol=1e-6)
    if huber:  # |d| << c: the huber loss tends to d^2 and smooth_l1 to d^2 / c (kohya's scaling)
        small = diffusion_loss(_flame(pred * 1e-2), _flame(torch.zeros_like(pred)), loss_type, huber_c=0.5)
        quadratic = (pred * 1e-2).pow(2).mean() / (0.5 if loss_type == "smooth_l1" else 1.0)
        assert_close(small, quadratic.to(DEVICE), rtol=1e-2, atol=0)  # next term: -d^2 / 4c^2


def test_huber_c_schedules_match_kohya():
    from diffusers import DDPMScheduler

    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    schedule = DDPMSchedule()
    t = torch.tensor([0, 1, 250, 500, 998, 999])
    ft = _flame(t)
    c, scale = 0.1, 2.0
    abar = torch.index_select(ref.alphas_cumprod, 0, t)
    sigma = ((1.0 - abar) / abar) ** 0.5
    want = {
        "constant": torch.full((6,), c * scale),
        "exponential": torch.exp(-(-math.log(c) / 1000) * t) * scale,
        "snr": (1 - c) / (1 + sigma) ** 2 + c,  # kohya's snr schedule ignores huber_scale
    }
    assert set(want) == set(HUBER_SCHEDULES)
    for name, expected in want.items():
        for check in (True, False):
            got = huber_c_per_timestep(ft, schedule, name, c, scale, check=check)
            assert_close(got, expected.float().to(DEVICE), rtol=1e-5, atol=1e-7)
    # the defaults are kohya's (snr, huber_c 0.1); int32 timesteps work too
    got = huber_c_per_timestep(_flame(t.int()), schedule)
    assert_close(got, ((1 - 0.1) / (1 + sigma) ** 2 + 0.1).to(DEVICE), rtol=1e-5, atol=1e-7)
    # the per-timestep c feeds the loss directly
    pred, target = torch.randn(6, 1, 2, 2), torch.randn(6, 1, 2, 2)
    loss = diffusion_loss(_flame(pred), _flame(target), "huber", huber_c=got)
    assert_close(loss, _kohya_loss(pred, target, "huber", None, got.to_torch().cpu()).to(DEVICE), rtol=1e-5,
                 atol=1e-7)


def test_errors():
    p, t = _flame(torch.zeros(2, 3)), _flame(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"loss_type must be one of \('l2', 'l1', 'huber', 'smooth_l1'\)"):
        diffusion_loss(p, t, "mse")
    for bad in (None, 0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="huber_c"):
            diffusion_loss(p, t, "smooth_l1", huber_c=bad)
    with pytest.raises(ValueError, match=r"huber_c must have shape \(2,\)"):
        diffusion_loss(p, t, "huber", huber_c=_flame(torch.ones(3)))
    with pytest.raises(ValueError, match="huber_c is used only by"):
        diffusion_loss(p, t, "l2", huber_c=0.1)
    with pytest.raises(ValueError, match=r"pred \(2, 3\) and target \(3, 2\)"):
        diffusion_loss(p, _flame(torch.zeros(3, 2)), "l1")
    with pytest.raises(ValueError, match=r"weights must have shape \(2,\)"):
        diffusion_loss(p, t, "l1", weights=_flame(torch.ones(2, 1)))
    with pytest.raises(ValueError, match="pred must be a batched"):
        weighted_mse_loss(_flame(torch.zeros(())), _flame(torch.zeros(())))
    s, ts = DDPMSchedule(), _flame(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"huber_schedule must be one of \('constant', 'exponential', 'snr'\)"):
        huber_c_per_timestep(ts, s, "linear")
    with pytest.raises(ValueError, match="huber_scale must be a positive number"):
        huber_c_per_timestep(ts, s, "exponential", 0.1, 0.0)
    with pytest.raises(ValueError, match="huber_c must be a positive number"):
        huber_c_per_timestep(ts, s, "exponential", -0.1)
    with pytest.raises(ValueError, match="timesteps must be a 1-d int64"):
        huber_c_per_timestep(_flame(torch.tensor([1.0])), s)
    with pytest.raises(ValueError, match="schedule must be a DDPMSchedule"):
        huber_c_per_timestep(ts, None)
    with pytest.raises(IndexError):
        huber_c_per_timestep(_flame(torch.tensor([1000])), s, "snr")
