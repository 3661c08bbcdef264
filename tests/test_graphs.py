"""CapturedStep: the replayed step gives the eager step's results, per input signature."""
import numpy as np
import pytest
import torch

import flame
from flame import nn
from flame.graphs import CapturedStep
from helpers import DEVICE, assert_close


def _model():
    flame.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))


def _step_fn(model):
    def step(x, target):
        loss = ((model(x) - target) ** 2).mean()
        return loss, loss.backward()
    return step


def _inputs(seed, rows=5):
    rng = np.random.default_rng(seed)
    return flame.tensor(rng.standard_normal((rows, 8)).astype(np.float32)), \
        flame.tensor(rng.standard_normal((rows, 4)).astype(np.float32))


def test_captured_step_matches_eager_across_calls_and_shapes():
    model = _model()
    eager, captured = _step_fn(model), CapturedStep(_step_fn(model))
    params = list(model.parameters())
    for seed, rows in [(1, 5), (2, 5), (3, 5), (4, 7), (5, 7), (6, 7), (7, 5)]:
        x, t = _inputs(seed, rows)
        loss_e, grads_e = eager(x, t)
        loss_c, grads_c = captured(x, t)
        assert_close(loss_c, loss_e.to_torch(), rtol=1e-5, atol=1e-6)
        for p in params:
            assert_close(grads_c[p], grads_e[p].to_torch(), rtol=1e-5, atol=1e-6)
    assert captured.num_graphs == (0 if flame.is_interpreter() else 2)


def test_captured_step_sees_in_place_parameter_updates():
    model = _model()
    captured = CapturedStep(_step_fn(model))
    x, t = _inputs(1)
    for _ in range(3):
        captured(x, t)
    w = model[0].weight
    before = captured(x, t)[0].item()
    with flame.no_grad():
        flame.kernels.elementwise.fill_(w._data, 0.0)
    after = captured(x, t)[0].item()
    eager = _step_fn(model)(x, t)[0].item()
    assert after != before
    assert after == pytest.approx(eager, rel=1e-5)


@pytest.mark.gpu
def test_capture_refuses_random_numbers_and_host_syncs():
    def noisy(x):
        return x + flame.randn(*x.shape)

    step = CapturedStep(noisy)
    x = flame.randn(4)
    step(x)
    with pytest.raises(RuntimeError, match="random numbers"):
        step(x)

    def syncing(x):
        return x * x.sum().item()

    step = CapturedStep(syncing)
    step(x)
    with pytest.raises(RuntimeError, match="synchronize with the host"):
        step(x)
    # the failed capture leaves PyTorch's own CUDA random numbers usable
    assert torch.randn(3, device=DEVICE).shape == (3,)
    # and later captures work (a failed capture can leave its memory pool marked as recording)
    step = CapturedStep(lambda x: x * 2.0)
    outs = [step(x).to_torch().clone() for _ in range(3)]
    assert all(torch.equal(o, x.to_torch() * 2) for o in outs)
    assert step.num_graphs == (0 if flame.is_interpreter() else 1)


def test_dropped_graphs_are_not_freed_during_a_later_capture():
    """Graphs of a dropped step held in a reference cycle (a trainer holding its own step) are
    freed by the cyclic collector; if that ran mid-capture it would invalidate the capture. With
    the collector made to run at every allocation, a later capture still works."""
    import gc

    class Owner:
        pass

    x = flame.randn(4)
    for _ in range(3):
        owner = Owner()
        owner.me = owner  # a cycle: only the cyclic collector frees it
        owner.step = CapturedStep(lambda t: t + 1.0)
        owner.step(x)
        owner.step(x)  # captured (GPU)
        del owner
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        step = CapturedStep(lambda t: t * 3.0)
        outs = [step(x).to_torch().clone() for _ in range(3)]
    finally:
        gc.set_threshold(*threshold)
    assert all(torch.equal(o, x.to_torch() * 3) for o in outs)
