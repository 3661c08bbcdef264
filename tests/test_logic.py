"""Differentiable logic-gate layers (flame.nn.LogicLayer, flame.ops.logic): values and gradients
against a plain PyTorch reference, float64 finite differences, the hard (argmax) functions on every
input pair, packed bits, BPTT through unrolled recurrent logic networks (finite differences,
accumulation, checkpointing), the example scripts, and bad input."""
import gc
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import flame
import flame.kernels.logic as KL
from flame.checkpoint import checkpoint
from flame.nn import Bits, GroupSum, LogicLayer, Sequential, set_hard
from flame.nn.logic import FUNCTIONS, random_wiring, truth_table
from flame.ops.logic import group_sum, logic_gates, logic_gates_packed, logic_plan, pack_bits, unpack_bits
from flame.testing import gradcheck
from helpers import DEVICE, assert_close, assert_within_torch_error

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- the PyTorch reference: the plain 16-function formulation ------------------------------------

def torch_gates(x, logits, a_index, b_index):
    """out[:, g] = sum_i softmax(logits[g])_i op_i(x[:, a[g]], x[:, b[g]]), the 16 relaxations written out."""
    a, b = x[:, a_index], x[:, b_index]
    ab = a * b
    ops = [torch.zeros_like(a), ab, a - ab, a, b - ab, b, a + b - 2 * ab, a + b - ab, 1 - (a + b - ab),
           1 - (a + b - 2 * ab), 1 - b, 1 - b + ab, 1 - a, 1 - a + ab, 1 - ab, torch.ones_like(a)]
    return (torch.stack(ops, -1) * torch.softmax(logits, -1)).sum(-1)


def _wiring(in_dim, gates, seed=0):
    a, b = random_wiring(in_dim, gates, seed, "uniform")
    return flame.tensor(a), flame.tensor(b), torch.from_numpy(a).to(DEVICE), torch.from_numpy(b).to(DEVICE)


def _inputs(batch, in_dim, dtype, layout="rows", seed=0):
    """(flame input requiring grad, fp64 torch copy): values in [0, 1] in the given layout
    (rows: (B, IN) contiguous; features: a (B, IN) view of a (IN, B) buffer, as LogicLayer outputs
    are; sliced: every other column of a wider buffer)."""
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.rand(batch, in_dim, dtype=torch.float64, generator=gen)
    x64[torch.rand(batch, in_dim, generator=gen) < 0.2] = 1.0  # Boolean values mixed in
    x = x64.to(dtype).to(DEVICE)
    if layout == "features":
        x = x.t().contiguous().t()
    elif layout == "sliced":
        x = torch.stack([x, x], -1).reshape(batch, 2 * in_dim)[:, ::2]
    return flame.from_torch(x, requires_grad=True), x.double()


@pytest.fixture(params=[True, False], ids=["fused-sums", "gate-sums"])
def fused(request, monkeypatch):
    """Both ways the logits' batch sums are computed when the input also needs a gradient."""
    monkeypatch.setattr(KL, "FUSED_SUMS", request.param)
    return request.param


CASES = [  # batch, in_dim, gates, input layout
    (1, 1, 1, "rows"), (1, 3, 5, "features"), (7, 5, 9, "sliced"), (33, 40, 100, "features"),
    (130, 17, 1000, "rows"),  # ~120 gates read each column
    (4096, 64, 33, "features"), (2, 600, 65536, "features"), (257, 3001, 1500, "rows"),
]


@pytest.mark.parametrize("batch,in_dim,gates,layout", CASES, ids=str)
def test_matches_torch_reference(batch, in_dim, gates, layout, fused):
    x, x64 = _inputs(batch, in_dim, torch.float32, layout)
    a, b, at, bt = _wiring(in_dim, gates)
    w0 = torch.randn(gates, 16, dtype=torch.float64) * 2
    w = flame.from_torch(w0.float().to(DEVICE), requires_grad=True)
    g0 = torch.randn(batch, gates, dtype=torch.float64)
    y = logic_gates(x, w, a, b)
    grads = y.backward(flame.from_torch(g0.float().to(DEVICE)))
    x64.requires_grad_()
    w64 = w0.clone().to(DEVICE).requires_grad_()
    want = torch_gates(x64, w64, at, bt)
    want.backward(g0.to(DEVICE))
    assert y.shape == (batch, gates) and y.dtype == flame.float32
    assert_close(y.to_torch().double(), want.detach(), rtol=1e-5, atol=1e-6)
    # gradients sum up to hundreds of terms: compare with the fp64 reference at fp32's sum error
    for got, ref in ((grads[x], x64.grad), (grads[w], w64.grad)):
        scale = float(ref.abs().max()) + 1.0
        assert_close(got.to_torch().double(), ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype,batch,in_dim,gates", [
    (torch.float16, 300, 50, 700),
    pytest.param(torch.bfloat16, 1024, 4096, 8192, marks=pytest.mark.gpu),  # the interpreter's bf16 is not torch's
], ids=["fp16", "bf16"])
def test_16_bit_within_torch_error(dtype, batch, in_dim, gates):
    x, x64 = _inputs(batch, in_dim, dtype, "features")
    a, b, at, bt = _wiring(in_dim, gates)
    w0 = torch.randn(gates, 16, dtype=torch.float64)
    w = flame.from_torch(w0.float().to(DEVICE), requires_grad=True)  # fp32 logits, 16-bit activations
    y = logic_gates(x, w, a, b)
    g = torch.randn(batch, gates, dtype=torch.float64).to(DEVICE)
    grads = y.backward(flame.from_torch(g.to(dtype)))
    x64.requires_grad_()
    w64 = w0.clone().to(DEVICE).requires_grad_()
    ref = torch_gates(x64, w64, at, bt)
    ref.backward(g)
    x_low = x64.detach().to(dtype).requires_grad_()
    w_low = w0.detach().float().to(DEVICE).requires_grad_()
    low = torch_gates(x_low, w_low, at, bt)
    low.backward(g.to(dtype))
    assert y.dtype == dtype and grads[w].dtype == flame.float32  # (a 16-bit leaf's gradient is fp32)
    assert_within_torch_error(y, low, ref, 2)
    assert_within_torch_error(grads[x], x_low.grad, x64.grad, 3)
    assert_within_torch_error(grads[w], w_low.grad, w64.grad, 3)


def test_gradcheck_inputs_and_logits():
    # small: every finite difference is a forward on the interpreter (the reference test has the sizes)
    rng = np.random.default_rng(3)
    x = flame.tensor(rng.uniform(0.05, 0.95, (2, 3)), requires_grad=True)
    w = flame.tensor(rng.standard_normal((2, 16)), requires_grad=True)
    a, b = flame.tensor([0, 2]), flame.tensor([1, 2])  # gate 1 reads column 2 twice
    assert gradcheck(lambda x, w: logic_gates(x, w, a, b), [x, w])


def test_gradients_are_bitwise_repeatable(fused):
    x, _ = _inputs(200, 30, torch.float32, "features")
    a, b, _, _ = _wiring(30, 500)
    w = flame.randn(500, 16, requires_grad=True)
    g = flame.randn(200, 500)
    runs = [logic_gates(x, w, a, b).backward(g) for _ in range(2)]
    for t in (x, w):
        assert torch.equal(runs[0][t].to_torch(), runs[1][t].to_torch())


def test_input_without_grad_and_empty_batch():
    x, x64 = _inputs(9, 6, torch.float32)
    x = x.detach()
    a, b, at, bt = _wiring(6, 11)
    w = flame.randn(11, 16, requires_grad=True)
    grads = logic_gates(x, w, a, b).sum().backward()
    w64 = w.to_torch().double().requires_grad_()
    torch_gates(x64, w64, at, bt).sum().backward()
    assert_close(grads[w].to_torch().double(), w64.grad, rtol=1e-5, atol=1e-5)
    empty = flame.zeros(0, 6, requires_grad=True)
    y = logic_gates(empty, w, a, b)
    grads = y.sum().backward()
    assert y.shape == (0, 11) and grads[empty].shape == (0, 6)
    assert float(grads[w].abs().sum().item()) == 0.0


# ---- hard mode ----------------------------------------------------------------------------------

def _every_function_layer(gates=48, in_dim=2, seed=0):
    """A layer whose gate g's argmax function is g % 16 (the other logits random, below it)."""
    layer = LogicLayer(in_dim, gates, seed=seed)
    logits = np.random.default_rng(seed).uniform(-3, 2, (gates, 16))
    logits[np.arange(gates), np.arange(gates) % 16] = 2.5
    layer.load_state_dict({**layer.state_dict(), "weight": flame.tensor(logits.astype(np.float32))})
    return layer


def test_functions_are_numbered_by_truth_table():
    want = {"False": 0b0000, "AND": 0b0001, "XOR": 0b0110, "OR": 0b0111, "NAND": 0b1110, "True": 0b1111}
    for name, table in want.items():
        assert FUNCTIONS.index(name) == table
    # the relaxations at the corners are the truth tables: out(a, b) with a one-hot mixture
    corners = flame.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    logits = np.full((16, 16), -60.0, np.float32)
    np.fill_diagonal(logits, 60.0)
    soft = logic_gates(corners, flame.tensor(logits), flame.zeros(16, dtype=flame.int64),
                       flame.ones(16, dtype=flame.int64)).numpy()
    for code in range(16):
        assert soft[:, code].tolist() == truth_table(code).reshape(-1).tolist(), FUNCTIONS[code]


def test_hard_mode_is_the_argmax_function_on_all_four_input_pairs():
    layer = _every_function_layer()
    codes = layer.codes().numpy()
    assert sorted(set(codes.tolist())) == list(range(16))
    a, b = layer.a_index.numpy(), layer.b_index.numpy()
    x = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], np.float32)  # every gate reads both columns: all 4 pairs
    assert np.all(a != b)
    layer.hard()
    out = layer(flame.tensor(x)).numpy()
    soft_in = layer(flame.tensor(np.where(x > 0, 0.8, 0.3).astype(np.float32))).numpy()  # thresholded at 0.5
    for g in range(layer.out_dim):
        want = [truth_table(codes[g])[int(r[a[g]]), int(r[b[g]])] for r in x]
        assert out[:, g].tolist() == want, (g, FUNCTIONS[codes[g]])
    assert np.array_equal(soft_in, out)


@pytest.mark.parametrize("batch", [1, 31, 32, 100])
def test_packed_bits_equal_the_float_hard_network(batch):
    rng = np.random.default_rng(batch)
    net = Sequential(LogicLayer(12, 64, seed=1), LogicLayer(64, 40, seed=2), GroupSum(5, tau=3.0))
    for layer in list(net.children())[:2]:
        layer.weight._data.copy_(torch.from_numpy(rng.standard_normal((layer.out_dim, 16)).astype(np.float32)))
    x = flame.tensor(rng.random((batch, 12)).astype(np.float32))
    set_hard(net)
    want = net(x).numpy()
    bits = Bits.pack(x)
    assert bits.shape == (batch, 12) and bits.data.shape == (12, (batch + 31) // 32)
    assert np.array_equal(bits.unpack().numpy(), (x.numpy() > 0.5).astype(np.float32))
    assert np.array_equal(net(bits).numpy(), want)
    hidden = net[0](bits)
    assert isinstance(hidden, Bits) and np.array_equal(hidden.unpack().numpy(), net[0](x).numpy())


def test_hard_mode_records_nothing_and_soft_mode_returns():
    layer = LogicLayer(8, 16)
    x = flame.rand(5, 8, requires_grad=True)
    assert layer.hard()(x).grad_fn is None
    assert layer.soft()(x).grad_fn is not None


# ---- GroupSum ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["rows", "features"])
def test_group_sum_matches_torch(layout):
    x, x64 = _inputs(37, 60, torch.float32, layout)
    y = GroupSum(4, tau=2.5)(x)
    g = torch.randn(37, 4, dtype=torch.float64)
    grads = y.backward(flame.from_torch(g.float().to(DEVICE)))
    x64.requires_grad_()
    want = x64.reshape(37, 4, 15).sum(-1) / 2.5
    want.backward(g.to(DEVICE))
    assert_close(y.to_torch().double(), want.detach(), rtol=1e-6, atol=1e-6)
    assert_close(grads[x].to_torch().double(), x64.grad, rtol=1e-6, atol=1e-7)
    assert grads[x].stride() == x.stride()


# ---- the module: wiring, state dict, plans ------------------------------------------------------

def test_random_wiring_is_balanced_and_never_reads_one_input_twice():
    for in_dim, out_dim in ((10, 37), (64, 8), (500, 1000)):
        a, b = random_wiring(in_dim, out_dim, seed=4)
        counts = np.bincount(np.concatenate([a, b]), minlength=in_dim)
        assert counts.max() - counts.min() <= 1 and counts.sum() == 2 * out_dim
        assert not np.any(a == b)
        a2, b2 = random_wiring(in_dim, out_dim, seed=4)
        assert np.array_equal(a, a2) and np.array_equal(b, b2)
    layer = LogicLayer(10, 37, seed=4)
    assert np.array_equal(layer.a_index.numpy(), random_wiring(10, 37, 4)[0])
    assert layer.a_index.dtype == flame.int64 and layer.weight.shape == (37, 16)


def test_state_dict_carries_the_wiring_and_training_after_loading_is_right():
    src, dst = LogicLayer(20, 30, seed=1), LogicLayer(20, 30, seed=2)
    x = flame.rand(6, 20, requires_grad=True)
    dst(x).sum().backward()  # builds dst's plan for its own wiring
    dst.load_state_dict(src.state_dict())
    assert np.array_equal(dst.b_index.numpy(), src.b_index.numpy())
    want = src(x).sum().backward()
    got = dst(x).sum().backward()  # a stale plan would scatter into the old columns
    assert torch.equal(got[x].to_torch(), want[x].to_torch())
    flame.check_errors()


def test_residual_init_passes_the_first_input():
    layer = LogicLayer(6, 9, init="residual")
    assert np.all(layer.codes().numpy() == FUNCTIONS.index("A"))
    x = flame.rand(4, 6)
    assert np.array_equal(layer.hard()(x).numpy(), (x.numpy()[:, layer.a_index.numpy()] > 0.5).astype(np.float32))


# ---- recurrence: BPTT ------------------------------------------------------------------------------

H, I = 4, 2  # state and input width of the test cells


def _cell_params(seed, dtype=flame.float64):
    """A recurrent cell h' = L2(L1([h, x_t])): wiring and logits of two layers."""
    rng = np.random.default_rng(seed)
    w1 = flame.tensor(rng.standard_normal((8, 16)), dtype=dtype, requires_grad=True)
    w2 = flame.tensor(rng.standard_normal((H, 16)), dtype=dtype, requires_grad=True)
    wiring = [tuple(flame.tensor(v) for v in random_wiring(H + I, 8, seed)),
              tuple(flame.tensor(v) for v in random_wiring(8, H, seed + 1))]
    return w1, w2, wiring


def _rollout(w1, w2, wiring, h, xs, segment=0):
    """The cell unrolled over xs (T tensors (B, I)); ``segment`` > 0 checkpoints chunks of that many
    steps; ``w2=None``: the one-layer cell h' = L1([h, x_t]) (``wiring[0]`` of H gates). Returns the
    final state."""
    (a1, b1), (a2, b2) = wiring

    def steps(h, *chunk):
        for x in chunk:
            h = logic_gates(flame.cat([h, x], 1), w1, a1, b1)
            if w2 is not None:
                h = logic_gates(h, w2, a2, b2)
        return h

    if not segment:
        return steps(h, *xs)
    for t in range(0, len(xs), segment):
        h = checkpoint(steps, h, *xs[t:t + segment])
    return h


def _sequence(T, batch, seed, dtype=flame.float64):
    rng = np.random.default_rng(seed)
    xs = [flame.tensor((rng.random((batch, I)) > 0.5).astype(np.float64), dtype=dtype) for _ in range(T)]
    h0 = flame.tensor(rng.uniform(0.1, 0.9, (batch, H)), dtype=dtype, requires_grad=True)
    return xs, h0

@pytest.mark.extended  # the gates' gradients: test_gradcheck_inputs_and_logits

def test_bptt_gradients_equal_finite_differences():
    """The directional derivative of L = sum(h_T * v) along a random direction of (logits, h0), against
    central differences, for T = 1..8 (a one-layer cell: each difference re-runs the rollout)."""
    rng = np.random.default_rng(0)
    for T in range(1, 9):
        wiring = [tuple(flame.tensor(v) for v in random_wiring(H + I, H, T)), (None, None)]
        w = flame.tensor(rng.standard_normal((H, 16)), requires_grad=True)
        xs, h0 = _sequence(T, 3, T)
        v = flame.tensor(rng.standard_normal((3, H)))
        grads = (_rollout(w, None, wiring, h0, xs) * v).sum().backward()
        dirs = [rng.standard_normal(t.shape) for t in (w, h0)]
        analytic = sum(float((grads[t].numpy() * d).sum()) for t, d in zip((w, h0), dirs))
        eps = 1e-6
        with flame.no_grad():
            f = [float((_rollout(flame.tensor(w.numpy() + s * eps * dirs[0]), None, wiring,
                                 flame.tensor(h0.numpy() + s * eps * dirs[1]), xs) * v).sum().item()) for s in (1, -1)]
        numeric = (f[0] - f[1]) / (2 * eps)
        assert abs(analytic - numeric) <= 1e-7 + 1e-6 * abs(numeric), (T, analytic, numeric)


def test_accumulation_over_rollouts_equals_one_big_batch():
    w1, w2, wiring = _cell_params(5)
    xs, h0 = _sequence(6, 10, 5)
    full = _rollout(w1, w2, wiring, h0, xs).sum().backward()
    acc = None
    for rows in (slice(0, 3), slice(3, 10)):  # two rollouts of part of the batch, gradients summed
        h = flame.tensor(h0.numpy()[rows])
        part = _rollout(w1, w2, wiring, h, [x[rows] for x in xs]).sum().backward()
        acc = part if acc is None else acc.accumulate(part)
    for t in (w1, w2):
        assert_close(acc[t].to_torch(), full[t].to_torch(), rtol=1e-12, atol=1e-12)


def test_checkpointed_rollouts_equal_plain_ones():
    w1, w2, wiring = _cell_params(7, flame.float32)
    xs, h0 = _sequence(9, 5, 7, flame.float32)
    plain = _rollout(w1, w2, wiring, h0, xs).sum().backward()
    for segment in (1, 4):
        ckpt = _rollout(w1, w2, wiring, h0, xs, segment).sum().backward()
        for t in (w1, w2, h0):
            if segment == 1:  # the same sums in the same order
                assert torch.equal(ckpt[t].to_torch(), plain[t].to_torch())
            else:  # a segment sums its own steps' weight gradients first: another order
                assert_close(ckpt[t], plain[t], rtol=1e-6, atol=1e-7)


def _live_bytes():
    gc.collect()
    return sum({o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in gc.get_objects() if type(o) is torch.Tensor}.values())


@pytest.mark.extended
@pytest.mark.skipif(not flame.is_interpreter(), reason="counts live host tensors")
def test_checkpointed_rollout_memory_is_flat_in_T():
    w1, w2, wiring = _cell_params(8, flame.float32)
    kept = {}
    for T in (4, 16):
        xs, h0 = _sequence(T, 256, 8, flame.float32)
        for segment in (0, T):
            base = _live_bytes()
            h = _rollout(w1, w2, wiring, h0, xs, segment)
            kept[T, segment] = _live_bytes() - base
            del h
    plain_growth = kept[16, 0] - kept[4, 0]
    assert plain_growth > 12 * 256 * 8 * 4  # at least one hidden activation per step
    assert kept[16, 16] - kept[4, 4] < plain_growth / 8, kept


# ---- errors -------------------------------------------------------------------------------------

def test_bad_input_raises_clear_errors():
    a, b = flame.tensor([0, 1, 2]), flame.tensor([2, 1, 0])
    w, x = flame.randn(3, 16), flame.rand(4, 3)
    with pytest.raises(TypeError, match=r"input must be a flame Tensor, got torch\.Tensor"):
        logic_gates(x.to_torch(), w, a, b)
    with pytest.raises(TypeError, match="expected floating-point input"):
        logic_gates(flame.ones(4, 3, dtype=flame.int64), w, a, b)
    with pytest.raises(ValueError, match=r"input must be 2-D \(batch, in_dim\)"):
        logic_gates(flame.rand(2, 4, 3), w, a, b)
    with pytest.raises(ValueError, match=r"weight must be \(gates, 16\) logits"):
        logic_gates(x, flame.randn(3, 15), a, b)
    with pytest.raises(ValueError, match=r"a_index must have shape \(3,\)"):
        logic_gates(x, w, flame.tensor([0, 1]), b)
    with pytest.raises(TypeError, match="b_index must be int64 or int32"):
        logic_gates(x, w, a, flame.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="plan must be a LogicPlan of 3 gates reading 3 columns"):
        logic_gates(x, w, a, b, plan=logic_plan(a, b, 5))
    with pytest.raises(ValueError, match=r"strict mode: inputs must lie in \[0, 1\], got values in \[-0\.\d+, "):
        logic_gates(x - 0.5, w, a, b, strict=True)
    with pytest.raises(ValueError, match="strict mode"):
        LogicLayer(3, 4, strict=True)(x * 2.0)
    # an index only the device sees: flagged in the kernel, raised at the next host read
    logic_gates(x, w, a, flame.tensor([2, 3, 0]))
    with pytest.raises(IndexError, match=r"wiring index .* outside \[0, in_dim\)"):
        flame.check_errors()
    with pytest.raises(IndexError, match=r"b_index values must lie in \[0, 3\)"):
        logic_plan(a, flame.tensor([2, 3, 0]), 3)


def test_layer_and_bits_errors():
    with pytest.raises(IndexError, match=r"a_index values must lie in \[0, 4\) \(in_dim\), got values in \[0, 4\]"):
        LogicLayer(4, 3, a_index=[0, 4, 1], b_index=[1, 2, 3])
    with pytest.raises(ValueError, match="a_index must hold 3 integer indices"):
        LogicLayer(4, 3, a_index=[0, 1], b_index=[1, 2, 3])
    with pytest.raises(ValueError, match="give both a_index and b_index"):
        LogicLayer(4, 3, a_index=[0, 1, 2])
    with pytest.raises(ValueError, match="in_dim must be a positive int"):
        LogicLayer(0, 3)
    with pytest.raises(ValueError, match="connections must be 'random' or 'uniform'"):
        LogicLayer(4, 3, connections="grid")
    with pytest.raises(ValueError, match=r"input must be \(batch, 4\), got shape \(2, 5\)"):
        LogicLayer(4, 3)(flame.rand(2, 5))
    with pytest.raises(ValueError, match="Bits of 5 features, expected in_dim=4"):
        LogicLayer(4, 3).hard()(Bits.pack(flame.rand(2, 5)))
    with pytest.raises(ValueError, match=r"input must be \(batch, n\) with n a multiple of k=3"):
        GroupSum(3)(flame.rand(2, 10))
    with pytest.raises(ValueError, match="k must be a positive int dividing the 10 inputs"):
        group_sum(flame.rand(2, 10), 3)
    with pytest.raises(ValueError, match="tau must be positive"):
        GroupSum(2, tau=0.0)
    with pytest.raises(TypeError, match="must be a 2-D int32 tensor of packed words"):
        logic_gates_packed(flame.rand(3, 1), flame.zeros(2, dtype=flame.int32), flame.tensor([0, 1]),
                           flame.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"1 words per row hold 32 samples at most, not batch=40"):
        unpack_bits(pack_bits(flame.rand(20, 3)), 40)
    with pytest.raises(ValueError, match="input must be a 2-D floating-point"):
        group_sum(flame.rand(3), 1)
    # a state dict from a wider layer: its indices are out of range here
    narrow, wide = LogicLayer(4, 3, seed=0), LogicLayer(6, 3, a_index=[5, 0, 1], b_index=[1, 2, 3])
    narrow.load_state_dict(wide.state_dict())
    with pytest.raises(IndexError, match=r"a_index values must lie in \[0, 4\)"):
        narrow(flame.rand(2, 4, requires_grad=True))
    with pytest.raises(IndexError, match=r"a_index values must lie in \[0, 4\)"):  # still: no stale plan kept
        narrow(flame.rand(2, 4, requires_grad=True))
    y = narrow(flame.rand(2, 4))  # without a gradient no plan is built: the kernel flags it
    with pytest.raises(IndexError, match="wiring index"):
        y.numpy()  # (every host read checks the flags first)
    # a wiring changed behind the layer's back (not by load_state_dict or rewire): flagged
    layer = LogicLayer(5, 4, seed=0)
    x = flame.rand(3, 5, requires_grad=True)
    layer(x).sum().backward()
    layer.a_index._data.copy_(torch.tensor([4, 3, 2, 1]))  # behind flame's back, as a user might
    layer(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"wiring .* changed after its backward plan was built"):
        flame.check_errors()


# ---- the example scripts ------------------------------------------------------------------------

def _run_script(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def _load_script(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"flame_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mnist_idx_files_are_parsed(tmp_path):
    import gzip
    digits = _load_script("train_digits")
    rng = np.random.default_rng(0)
    for kind, n in (("train", 5), ("t10k", 3)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        (tmp_path / f"{kind}-images-idx3-ubyte.gz").write_bytes(gzip.compress(
            b"\x00\x00\x08\x03" + np.array([n, 28, 28], ">i4").tobytes() + images.tobytes()))
        (tmp_path / f"{kind}-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01" + np.array([n], ">i4").tobytes()
                                                             + labels.tobytes())
        if kind == "train":
            want_x, want_y = images.reshape(n, -1) / 255.0, labels
    xtr, ytr, xte, yte = digits.load_mnist(str(tmp_path))
    assert yte.shape == (3,)
    assert xtr.shape == (5, 784) and xte.shape == (3, 784) and xtr.dtype == np.float32 and ytr.dtype == np.int64
    assert np.allclose(xtr, want_x) and np.array_equal(ytr, want_y)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01")
    with pytest.raises(ValueError, match="not an IDX file"):
        digits.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(b"\x00\x00\x08\x01" + np.array([4], ">i4").tobytes() + b"\x01")
    with pytest.raises(ValueError, match="1 data bytes for shape"):
        digits.read_idx(tmp_path / "short")


@pytest.mark.extended  # the script end to end; its layers and training step: the tests above
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_train_digits_quick(model):
    lines = _run_script("scripts/train_digits.py", "--quick", "--model", model, "--seed", "1")
    assert re.fullmatch(r"test accuracy: 0\.\d{4}", lines[-1]), lines[-3:]


@pytest.mark.extended  # an example script's quick mode
def test_train_logic_quick():
    lines = _run_script("scripts/train_logic.py", "--quick", "--seed", "1")
    assert re.fullmatch(r"test accuracy: 0\.\d{4}", lines[-2]), lines[-3:]
    assert re.fullmatch(r"hard test accuracy: 0\.\d{4}", lines[-1]), lines[-3:]


@pytest.mark.extended  # an example script's quick mode
def test_train_logic_rnn_quick():
    lines = _run_script("scripts/train_logic_rnn.py", "--quick", "--seed", "1")
    assert re.fullmatch(r"test accuracy: [01]\.\d{4}", lines[-2]), lines[-3:]
    assert re.fullmatch(r"hard test accuracy: [01]\.\d{4}", lines[-1]), lines[-3:]


@pytest.mark.extended  # an example script's quick mode
def test_bench_logic_smoke(tmp_path):
    out = tmp_path / "bench.json"
    lines = _run_script("scripts/bench_logic.py", "--quick", "--out", str(out))
    import json
    doc = json.loads(out.read_text())
    assert doc["results"] and all(r["flame_ms"] > 0 for r in doc["results"] if "flame_ms" in r)
    assert any("mean nothing" in line for line in lines) == flame.is_interpreter()
