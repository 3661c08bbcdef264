"""Regression losses (ops/loss.py, kernels/loss.py) against torch.nn.functional's: values and
gradients in every dtype, weights broadcast per sample, per channel and materialised, strides,
empty inputs, float64 finite differences, bad input."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import flame
import flame.nn.functional as F
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, check_op


def _f(t, requires_grad=False):
    return flame.from_torch(t.detach().to(DEVICE, copy=True), requires_grad=requires_grad)


def _check(f_fn, t_fn, inputs, grad_mask, g, atol=1e-5, rtol=1e-4):
    """flame vs torch, values and the gradients ``grad_mask`` asks for (``check_op``): ``atol`` and
    ``rtol`` in fp32/fp64, the design's low-precision rule in fp16/bf16."""
    return check_op(f_fn, t_fn, inputs, g, grad_mask=grad_mask, tol=dict(atol=atol, rtol=rtol), lowp=(2, 3)).out


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64, device=DEVICE) * scale).to(dtype)


LOSSES = {
    "mse": (F.mse_loss, TF.mse_loss, {}),
    "l1": (F.l1_loss, TF.l1_loss, {}),
    "smooth_l1": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.7}),
    "smooth_l1_beta0": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.0}),
    "huber": (F.huber_loss, TF.huber_loss, {"delta": 0.6}),
}


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("red", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_losses(name, red, dtype):
    f_l, t_l, kw = LOSSES[name]
    x, y = _randn(3, 4, 5, dtype=dtype), _randn(3, 4, 5, dtype=dtype)
    x[0, 1] = y[0, 1]  # d == 0: the gradient of |d| is 0 there, as torch's sign
    g = _randn(*((3, 4, 5) if red == "none" else ()), dtype=dtype)
    _check(lambda x, y: f_l(x, y, reduction=red, **kw), lambda x, y: t_l(x, y, reduction=red, **kw),
           [x, y], [True, True], g)


@pytest.mark.parametrize("name", ["mse", "l1", "huber"])
@pytest.mark.parametrize("red", ["none", "mean", "sum"])
@pytest.mark.parametrize("wshape", [(3, 1, 1), (4, 1), (3, 4, 5), (3, 1, 5)], ids=str)
def test_weighted_losses(name, red, wshape):
    # weights broadcast from (B, 1, 1) (min-SNR per sample), per channel, full and a pattern that
    # is materialised; torch needs the full shape, so its reference gets the expanded weight
    f_l, t_l, kw = LOSSES[name]
    x, y = _randn(3, 4, 5), _randn(3, 4, 5)
    w = torch.rand(wshape, device=DEVICE) + 0.5
    g = _randn(*((3, 4, 5) if red == "none" else ()))
    _check(lambda x, y, w: f_l(x, y, reduction=red, weight=w, **kw),
           lambda x, y, w: t_l(x, y, reduction=red, weight=w.expand(3, 4, 5), **kw), [x, y, w], [True, True, True], g)


def test_losses_noncontig_mixed_dtype_and_empty():
    x = _randn(4, 6).t()
    y = _randn(6, 4, dtype=torch.float16)
    out = F.mse_loss(_f(x), _f(y))
    assert out.dtype == torch.float32
    assert_close(out, TF.mse_loss(x, y.float()))
    e = _f(torch.randn(0, 3, device=DEVICE), True)
    assert np.isnan(F.l1_loss(e, e.detach()).item())
    assert F.huber_loss(e, e.detach(), reduction="sum").item() == 0.0
    assert F.mse_loss(e, e.detach(), reduction="none").shape == (0, 3)
    grads = F.mse_loss(e, e.detach(), reduction="sum").backward()
    assert grads[e].shape == (0, 3)


def test_losses_gradcheck():
    rng = np.random.default_rng(4)
    x = flame.tensor(rng.standard_normal((2, 3)), requires_grad=True)
    y = flame.tensor(rng.standard_normal((2, 3)), requires_grad=True)
    w = flame.tensor(rng.random((2, 1)) + 0.5, requires_grad=True)
    assert gradcheck(lambda x, y: F.mse_loss(x, y), [x, y])
    assert gradcheck(lambda x, y: F.smooth_l1_loss(x, y, beta=0.5, reduction="none"), [x, y])
    assert gradcheck(lambda x, y, w: F.l1_loss(x, y, weight=w), [x, y, w])
    assert gradcheck(lambda x, y, w: F.huber_loss(x, y, delta=0.8, weight=w, reduction="sum"), [x, y, w])


def test_losses_bad_inputs():
    x = _f(_randn(3, 4))
    with pytest.raises(ValueError, match="same shape"):
        F.mse_loss(x, _f(_randn(4, 3)))
    with pytest.raises(ValueError, match="reduction"):
        F.l1_loss(x, x, reduction="batchmean")
    with pytest.raises(TypeError, match="floating"):
        F.mse_loss(x, flame.from_torch(torch.ones(3, 4, dtype=torch.int64, device=DEVICE)))
    with pytest.raises(ValueError, match="weight"):
        F.mse_loss(x, x, weight=_f(_randn(2, 4)))
    with pytest.raises(ValueError, match="beta"):
        F.smooth_l1_loss(x, x, beta=-1.0)
    with pytest.raises(ValueError, match="delta"):
        F.huber_loss(x, x, delta=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mse", "huber"])
def test_losses_bf16_latents(name):
    f_l, t_l, kw = LOSSES[name]
    x, y = _randn(4, 4, 128, 128, dtype=torch.bfloat16), _randn(4, 4, 128, 128, dtype=torch.bfloat16)
    _check(lambda x, y: f_l(x, y, **kw), lambda x, y: t_l(x, y, **kw), [x, y], [True, True],
           _randn(dtype=torch.bfloat16))
