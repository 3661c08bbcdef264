"""CapturedStep: the replayed step gives the eager step's results, per input signature; a captured
function that breaks the graph rules raises, on the interpreter as on a GPU."""
import threading

import numpy as np
import pytest
import torch

import flame
import flame.nn.functional as F
from flame import nn, runtime
from flame.diffusion.samplers import make_sampler
from flame.graphs import CapturedStep, GraphRuleError
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


def test_released_graphs_are_captured_anew():
    # flame.distributed.shutdown frees every step's graphs before leaving a NCCL group (graphs.release_all)
    model = _model()
    eager, captured = _step_fn(model), CapturedStep(_step_fn(model))
    x, t = _inputs(1)
    for _ in range(3):
        captured(x, t)
    flame.graphs.release_all()
    assert captured.num_graphs == 0
    for _ in range(3):
        loss = captured(x, t)[0]
    assert_close(loss, eager(x, t)[0].to_torch(), rtol=1e-5, atol=1e-6)
    assert captured.num_graphs == (0 if flame.is_interpreter() else 1)


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


# Each breaks one graph rule: (function, the words of the error that name the rule and the action).
_BROKEN_RULES = {
    "numpy": (lambda x: x * float(x.sum().numpy()), r"a device-to-host read \(Tensor\.numpy\)"),
    "item": (lambda x: x * x.sum().item(), r"a device-to-host read \(Tensor\.item\)"),
    "tolist": (lambda x: x * len(x.tolist()), r"a device-to-host read \(Tensor\.tolist\)"),
    "print": (lambda x: print(x) or x, r"a device-to-host read \(Tensor\.__repr__, printing values\)"),
    "host copy": (lambda x: x + flame.tensor(np.ones(4, np.float32)),
                  r"a host-to-device copy \(flame\.tensor of host data\)"),
    "torch host copy": (lambda x: x + flame.tensor(torch.ones(4)), r"a host-to-device copy"),
    "randn": (lambda x: x + flame.randn(*x.shape), r"a random draw from flame's generator"),
    "dropout": (lambda x: F.dropout(x, 0.5), r"a random draw from flame's generator"),
    "synchronize": (lambda x: runtime.synchronize() or x * 2.0, r"a host synchronization \(runtime\.synchronize\)"),
}


@pytest.mark.parametrize("rule", list(_BROKEN_RULES))
def test_a_captured_function_that_breaks_a_graph_rule_raises(rule):
    """On the interpreter as on a GPU: the first call of a signature runs eagerly, the second (the
    capture on a GPU) raises, naming the step, the rule and the action; the same function runs
    outside CapturedStep, and with enabled=False."""
    fn, words = _BROKEN_RULES[rule]
    x = flame.randn(4)
    step = CapturedStep(fn)
    step(x)
    with pytest.raises(GraphRuleError, match=r"^CapturedStep\(<lambda>\): " + words + r".* inside a captured function"):
        step(x)
    with pytest.raises(GraphRuleError):  # every later call too: a GPU would replay what was never captured
        step(x)
    assert isinstance(fn(x), flame.Tensor)
    free = CapturedStep(fn, enabled=False)
    for _ in range(3):
        free(x)


def test_a_graph_rule_error_names_the_step():
    class Trainer:
        def loss(self, x):
            return (x * x.sum().item()).sum()

    step = CapturedStep(Trainer().loss)
    x = flame.randn(3)
    step(x)
    with pytest.raises(GraphRuleError, match=r"^CapturedStep\(Trainer\.loss\): a device-to-host read"):
        step(x)


def test_a_legal_captured_function_runs_under_the_rules():
    """Noise drawn outside and passed in, a device-side copy (flame.tensor of a flame tensor), dropout
    that draws nothing, a host-made buffer cached on the signature's first call: all legal."""
    cache = {}

    def step_fn(x, noise, p):
        if x.shape not in cache:  # made on the eager first call, reused by the capture
            cache[x.shape] = flame.tensor(np.arange(x.shape[0], dtype=np.float32))
        y = F.dropout(flame.tensor(x) + noise, p, training=False) + F.dropout(x, 0.0)
        return y * cache[x.shape]

    step = CapturedStep(step_fn)
    for rows in (4, 4, 4, 6, 6):
        x, noise = flame.randn(rows), flame.randn(rows)
        want = (x.to_torch() * 2 + noise.to_torch()) * torch.arange(rows, dtype=torch.float32, device=DEVICE)
        assert_close(step(x, noise, 0.5), want, rtol=1e-6, atol=1e-6)
    assert step.num_graphs == (0 if flame.is_interpreter() else 2)


def _sdxl_denoise():
    from tiny_sdxl import UNET

    from flame.models import SDXLUNet
    from flame.pipeline.sdxl import Conditioning, denoise, time_ids_for
    unet, noise = SDXLUNet(UNET), flame.randn(1, 4, 8, 8)
    embeds, pooled = flame.randn(1, 3, 32), flame.randn(1, 16)
    cond = Conditioning(embeds, pooled, flame.zeros_like(embeds), flame.zeros_like(pooled))
    return denoise(unet, cond, noise, make_sampler("euler", 2), 1.0, time_ids_for(16, 16, 1), cuda_graph=True)


def _flux_denoise():
    from flame.models import FluxConfig, FluxTransformer2DModel
    from flame.pipeline.flux import FluxConditioning, denoise
    transformer, noise = FluxTransformer2DModel(FluxConfig.tiny()), flame.randn(1, 4, 4, 4)
    cond = FluxConditioning(flame.randn(1, 3, 32), flame.randn(1, 16))
    return denoise(transformer, cond, noise, make_sampler("flow_euler", 2, image_seq_len=4), cuda_graph=True)


@pytest.mark.parametrize("denoise", [pytest.param(_sdxl_denoise, marks=pytest.mark.extended), _flux_denoise],
                         ids=["sdxl", "flux"])  # the same capture rules; SDXL's UNet steps: extended
def test_the_pipelines_captured_model_calls_keep_the_graph_rules(denoise, monkeypatch):
    """The denoising loops' CapturedStep of the model call runs its second step under the rules (the
    capture on a GPU), and nothing there breaks them."""
    entered = []
    rules = runtime.graph_rules
    monkeypatch.setattr(runtime, "graph_rules", lambda name: entered.append(name) or rules(name))
    flame.manual_seed(0)
    latents = denoise()  # two steps: the model's second call is the capture
    assert len(entered) == 1 and entered[0].endswith(".forward")  # model.__call__ is its bound forward
    assert np.isfinite(latents.numpy()).all()


@pytest.mark.skipif(not flame.is_interpreter(), reason="a GPU's capture forbids other threads' syncs itself")
def test_the_graph_rules_hold_only_inside_the_captured_call_and_its_thread():
    seen = []

    def step_fn(x):
        worker = threading.Thread(target=lambda: seen.append(flame.tensor([1.0, 2.0]).numpy()))
        worker.start()
        worker.join()
        return x + 1.0

    x = flame.randn(4)
    step = CapturedStep(step_fn)
    step(x)
    step(x)
    assert len(seen) == 2 and seen[1].tolist() == [1.0, 2.0]  # the other thread copied and read freely
    assert x.numpy().shape == (4,) and flame.randn(2).shape == (2,)  # and after the call, this one does


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_device_usable():
    x = flame.randn(4)
    step = CapturedStep(lambda x: x + flame.randn(*x.shape))
    step(x)
    with pytest.raises(GraphRuleError, match="a random draw"):
        step(x)

    def syncing(x):  # a host read flame does not see: the device refuses it during the capture
        return x * x.to_torch().sum().item()

    step = CapturedStep(syncing)
    step(x)
    with pytest.raises(RuntimeError, match="capturing the step failed"):
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


@pytest.mark.gpu
def test_the_hopper_attention_backward_replays_as_it_runs_eager():
    """The Gluon attention forward and backward (dK/dV, then dQ) replayed from a CUDA graph give the
    eager gradients bit for bit (the kernels are deterministic)."""
    from flame.kernels import attention_hopper
    if not attention_hopper.available():
        pytest.skip("needs an sm_90 GPU with triton.experimental.gluon")
    flame.manual_seed(0)
    q, k, v = (flame.randn(1, 384, 2, 128, dtype=flame.bfloat16).permute(0, 2, 1, 3).requires_grad_()
               for _ in range(3))

    def step(g):  # q, k and v are the step's leaves, as a model's parameters are
        return (F.scaled_dot_product_attention(q, k, v) * g).sum().backward()

    g = flame.randn(1, 2, 384, 128, dtype=flame.bfloat16)
    want = step(g)
    captured = CapturedStep(step)
    for _ in range(3):
        got = captured(g)
        for t in (q, k, v):
            assert torch.equal(got[t].to_torch(), want[t].to_torch())
    assert captured.num_graphs == 1
