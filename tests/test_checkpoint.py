"""Activation checkpointing: the two ways a checkpoint can be wrong (gradients cut at segment
borders, intermediates kept anyway) plus dropout replay, tuple outputs, closures and nesting."""
import gc

import pytest
import torch

import flame
from flame import nn
from flame.checkpoint import checkpoint, checkpoint_sequential
from helpers import DEVICE, TF32_TOL, assert_close


def _mlp(depth=6, width=8):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.SiLU()]
    return nn.Sequential(*layers)


def _grads_of(loss, tensors):
    grads = loss.backward()
    return [grads[t] for t in tensors]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_gradients_equal_plain_run_through_chained_segments():
    model = _mlp()
    x = flame.randn(3, 8, requires_grad=True)
    leaves = [x, *model.parameters()]

    plain = _grads_of((model(x * 1.5) ** 2).sum(), leaves)
    ckpt = _grads_of((checkpoint_sequential(model, 3, x * 1.5) ** 2).sum(), leaves)
    # first layer's weight and the input sit before two segment borders: a checkpoint that cut
    # the graph there would give them no gradient at all (KeyError) or zeros
    _assert_same(ckpt, plain)
    assert float(plain[0].abs().sum()) > 0


def test_params_inside_fn_and_input_get_gradients_like_torch():
    lin1, lin2 = nn.Linear(5, 7), nn.Linear(7, 4)
    t1, t2 = torch.nn.Linear(5, 7).to(DEVICE), torch.nn.Linear(7, 4).to(DEVICE)
    with torch.no_grad():
        for tm, fm in ((t1, lin1), (t2, lin2)):
            tm.weight.copy_(fm.weight.to_torch())
            tm.bias.copy_(fm.bias.to_torch())
    xt = torch.randn(2, 5, device=DEVICE, requires_grad=True)
    x = flame.from_torch(xt.detach().clone(), requires_grad=True)

    y = checkpoint(lambda h: lin2(flame.tanh(lin1(h))), x)
    grads = (y * y).sum().backward()
    yt = torch.utils.checkpoint.checkpoint(lambda h: t2(torch.tanh(t1(h))), xt, use_reentrant=False)
    (yt * yt).sum().backward()
    tol = TF32_TOL or {"rtol": 1e-5, "atol": 1e-6}  # both sides' fp32 matmuls are tf32 on the GPU
    assert_close(y, yt.detach(), **tol)
    for f, t in ((x, xt), (lin1.weight, t1.weight), (lin1.bias, t1.bias), (lin2.weight, t2.weight)):
        assert_close(grads[f], t.grad, **tol)


def test_dropout_replays_the_same_mask():
    drop, lin = nn.Dropout(0.5), nn.Linear(16, 16)
    x = flame.randn(4, 16, requires_grad=True)

    def fn(h):
        return lin(drop(h))

    flame.manual_seed(7)
    plain = _grads_of((fn(x) * x).sum(), [x, lin.weight])
    after_plain = flame.get_rng_state()
    flame.manual_seed(7)
    y = checkpoint(fn, x)
    after_forward = flame.get_rng_state()
    ckpt = _grads_of((y * x).sum(), [x, lin.weight])
    _assert_same(ckpt, plain)
    # the re-run draws from the saved state and puts the generator back where it was
    assert after_forward == after_plain == flame.get_rng_state()


def test_tuple_outputs_closure_tensor_and_shared_parameter():
    lin = nn.Linear(6, 6)
    x = flame.randn(2, 6, requires_grad=True)
    w = flame.randn(6, requires_grad=True)

    def run(use_ckpt):
        scale = flame.sigmoid(w)  # interior tensor of the outer graph, read by fn as a closure

        def fn(h):
            a = lin(h) * scale
            return a, flame.tanh(a), h  # the last output is the input itself

        a, b, h = checkpoint(fn, x) if use_ckpt else fn(x)
        out = lin(b) + a * 0.5 + h  # lin's parameters are used inside and outside the segment
        return _grads_of((out * out).sum(), [x, w, lin.weight, lin.bias])

    _assert_same(run(True), run(False))


def test_unused_output_and_recompute_once():
    calls = []
    lin = nn.Linear(4, 4)

    def fn(h):
        calls.append(1)
        y = lin(h)
        return y, y * 2.0

    x = flame.randn(3, 4, requires_grad=True)
    a, _ = checkpoint(fn, x)
    grads = a.sum().backward()
    assert len(calls) == 2  # forward plus one recomputation, even with two outputs
    ref = lin(x).sum().backward()
    _assert_same([grads[x], grads[lin.weight]], [ref[x], ref[lin.weight]])


def test_nested_checkpoints_and_kwargs():
    inner, outer = nn.Linear(5, 5), nn.Linear(5, 5)
    x = flame.randn(2, 5, requires_grad=True)

    def fn(h, *, gain):
        return outer(checkpoint(lambda z: flame.silu(inner(z)), h)) * gain

    leaves = [x, inner.weight, outer.weight]
    plain = _grads_of(fn(x, gain=3.0).sum(), leaves)
    ckpt = _grads_of(checkpoint(fn, x, gain=3.0).sum(), leaves)
    _assert_same(ckpt, plain)


def test_parameter_hooks_run_once_and_retain_graph():
    lin = nn.Linear(3, 3)
    seen = []
    lin.weight.register_hook(lambda g: seen.append(g.shape))
    x = flame.randn(2, 3, requires_grad=True)
    y = checkpoint(lin, x).sum()
    g1 = y.backward(retain_graph=True)
    g2 = y.backward()
    assert seen == [(3, 3), (3, 3)]
    _assert_same([g2[lin.weight], g2[x]], [g1[lin.weight], g1[x]])


def test_no_grad_and_bad_arguments():
    lin = nn.Linear(3, 3)
    x = flame.randn(2, 3)
    with flame.no_grad():
        y = checkpoint(lin, x)
    assert not y.requires_grad
    assert checkpoint(lambda h: h * 2.0, x).requires_grad is False  # nothing inside requires grad
    with pytest.raises(TypeError, match="callable"):
        checkpoint(3, x)
    with pytest.raises(TypeError, match="Tensor or a tuple"):
        checkpoint(lambda h: {"y": h}, x)
    with pytest.raises(ValueError, match="segments"):
        checkpoint_sequential(nn.Sequential(lin), 0, x)


# ---- memory: the intermediates of a checkpointed segment must really be freed -----------------

def _live_bytes():
    """Bytes of every distinct storage that a live torch tensor (flame's buffers included) holds."""
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor:
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _measure(model, x, segments):
    """(bytes alive after the forward, peak bytes sampled during backward), over a baseline
    taken before the forward. On the GPU both come from the allocator's counters."""
    samples = []
    handles = []
    if flame.is_interpreter():  # sample when each segment's first weight gradient is done (gc walks are slow)
        for lin in list(model.children())[::4]:
            handles.append(lin.weight.register_post_accumulate_grad_hook(lambda t, g: samples.append(_live_bytes())))
    flame.synchronize()
    base = _live_bytes() if flame.is_interpreter() else flame.memory_allocated()
    flame.reset_peak_memory_stats()
    y = checkpoint_sequential(model, segments, x) if segments else model(x)
    loss = (y * y).sum()
    after_forward = (_live_bytes() if flame.is_interpreter() else flame.memory_allocated()) - base
    grads = loss.backward()
    flame.synchronize()
    peak = (max(samples) if flame.is_interpreter() else flame.max_memory_allocated()) - base
    del loss, y, grads
    for h in handles:
        h.remove()
    return after_forward, peak


def test_checkpoint_frees_intermediates():
    width, batch = 32, 64
    act = batch * width * 4  # bytes of one fp32 activation
    model = _mlp(depth=8, width=width)
    x = flame.randn(batch, width, requires_grad=True)
    plain_fwd, plain_peak = _measure(model, x, 0)
    ckpt_fwd, ckpt_peak = _measure(model, x, 4)
    # plain keeps ~2 activations per Linear+SiLU pair (16 in all); checkpointing keeps the 3 segment
    # inputs plus the last segment's 4 (it runs plainly): a version that kept everything fails here
    assert plain_fwd >= 14 * act, (plain_fwd, act)
    assert ckpt_fwd <= plain_fwd - 6 * act, (ckpt_fwd, plain_fwd, act)
    assert ckpt_peak < plain_peak, (ckpt_peak, plain_peak)


def test_gradient_reaching_a_leaf_beside_a_branch_without_gradient():
    # x reaches the segment directly and through e; the output that uses e is dropped, so the
    # branch through e carries no gradient: x must still get the gradient of its direct use
    x = flame.randn(3, requires_grad=True)
    w = flame.randn(3, requires_grad=True)
    e = x * 2.0
    a, _ = checkpoint(lambda h: (h * w, e * 3.0), x)
    grads = a.sum().backward()
    assert_close(grads[x], w.detach(), rtol=0, atol=0)
    assert_close(grads[w], x.detach(), rtol=0, atol=0)


def test_recomputation_runs_under_the_forward_autocast_state():
    from flame import amp
    lin1, lin2 = nn.Linear(6, 6), nn.Linear(6, 3)
    x = flame.randn(4, 6, requires_grad=True)

    def fn(h):
        return flame.tanh(lin2(flame.silu(lin1(h))))

    leaves = [x, lin1.weight, lin2.bias]
    with amp.autocast(flame.float16):
        y_plain = fn(x)
        y_ckpt = checkpoint(fn, x)
    assert y_ckpt.dtype == y_plain.dtype == flame.float16
    # backward outside the region: the re-run must still cast to fp16, or the gradients differ
    plain = _grads_of(y_plain.float().sum(), leaves)
    ckpt = _grads_of(y_ckpt.float().sum(), leaves)
    for g, w in zip(ckpt, plain):
        assert_close(g, w, rtol=0, atol=0)
