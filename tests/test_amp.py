"""Mixed precision: DynamicLossScaler against torch.amp.GradScaler (scale values, skipped steps,
parameters, state), autocast against PyTorch's autocast lists, Policy, fp16 training runs."""
import itertools
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import flame
import flame.nn.functional as F
from flame import amp, nn, optim
from helpers import DEVICE, FLOAT_DTYPES_CPU, GPU_ONLY_DTYPES, assert_close

SHAPES = [(5, 3), (7,), (130,)]


def _torch_scaler(**kw):
    return torch.amp.GradScaler("cuda" if DEVICE.type == "cuda" else "cpu", **kw)


def _run_pair(script, unscale_first, **kw):
    """Run the same scripted gradients through (flame SGD + DynamicLossScaler) and (torch SGD +
    GradScaler). ``script``: per step, None (finite) or (tensor index, value) to inject."""
    gen = torch.Generator().manual_seed(0)
    tparams = [torch.randn(s, generator=gen).to(DEVICE).requires_grad_(True) for s in SHAPES]
    fparams = [flame.from_torch(p.detach().clone(), requires_grad=True) for p in tparams]
    topt = torch.optim.SGD(tparams, lr=0.1)
    fopt = optim.SGD(fparams, lr=0.1)
    ts, fs = _torch_scaler(**kw), amp.DynamicLossScaler(**kw)
    history = []
    for inject in script:
        ts.scale(torch.zeros((), device=DEVICE))  # torch's scaler initialises its state lazily here
        assert fs.get_scale() == ts.get_scale()
        scale = ts.get_scale()
        grads = [torch.randn(s, generator=gen).clamp(-1.5, 1.5).to(DEVICE) * scale for s in SHAPES]
        if inject is not None:
            i, v = inject
            grads[i].view(-1)[1] = v
        for p, g in zip(tparams, grads):
            p.grad = g.clone()
        fg = {fp: flame.from_torch(g.clone()) for fp, g in zip(fparams, grads)}
        if unscale_first:
            ts.unscale_(topt)
            fs.unscale_(fg)
            for fp, tp in zip(fparams, tparams):
                assert_close(fg[fp], tp.grad, rtol=0, atol=0)
        ts.step(topt)
        fs.step(fopt, fg)
        ts.update()
        fs.update()
        assert fs.last_step_skipped() == (inject is not None)
        history.append((fs.get_scale(), ts.get_scale(), fs.get_growth_tracker(), ts._get_growth_tracker()))
        for fp, tp in zip(fparams, tparams):
            assert_close(fp, tp.detach(), rtol=1e-6, atol=1e-6)
    for f_scale, t_scale, f_tr, t_tr in history:
        assert f_scale == t_scale and f_tr == t_tr, history
    return fs, ts, history


@pytest.mark.parametrize("unscale_first", [False, True])
def test_matches_grad_scaler_on_scripted_sequence(unscale_first):
    inf, nan = float("inf"), float("nan")
    script = [None, None, (0, inf), None, None, None, (2, nan), (1, -inf), None, None, None]
    _, _, hist = _run_pair(script, unscale_first, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25,
                           growth_interval=2)
    # PyTorch's own scenario: 4 -> 8 after two clean steps, then an inf backs off to 2
    assert [h[0] for h in hist[:3]] == [4.0, 8.0, 2.0]


def test_defaults_and_growth_to_overflow():
    s = amp.DynamicLossScaler()
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == \
        (65536.0, 2.0, 0.5, 2000)
    # growth that would overflow fp32 leaves the scale as it is (and resets the counter), as torch
    _run_pair([None, None, None], False, init_scale=2.0 ** 127, growth_interval=1)
    # non-power-of-two factors round like torch's fp64 arithmetic
    _run_pair([None, (0, float("inf")), None, None], True, init_scale=3.0, growth_factor=1.1, backoff_factor=0.3,
              growth_interval=1)


def test_skipped_step_equals_run_without_it():
    # init 128, interval 1: 4 steps, the 3rd with an inf -> final scale 128 * 2^3 * 0.5
    fs, _, _ = _run_pair([None, None, (1, float("inf")), None], False, init_scale=128.0, growth_interval=1)
    assert fs.get_scale() == 128 * 2 ** 3 * 0.5
    # 4 AdamW steps, the 3rd with a NaN gradient, equal a run of the 3 clean steps bit for bit
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(6, generator=gen)
    gs = [torch.randn(6, generator=gen) for _ in range(4)]
    finals = []
    for steps in ([0, 1, 2, 3], [0, 1, 3]):
        p = flame.from_torch(p0.clone().to(DEVICE), requires_grad=True)
        opt = optim.AdamW([p], lr=0.05, weight_decay=0.1)
        sc = amp.DynamicLossScaler(init_scale=128.0, growth_interval=1)
        for i in steps:
            g = gs[i] * sc.get_scale()
            if i == 2:
                g[2] = float("nan")
            sc.step(opt, {p: flame.from_torch(g.to(DEVICE))})
            sc.update()
        finals.append((p.numpy(), opt.state_dict()["state"][0]["step"]))
    np.testing.assert_array_equal(finals[0][0], finals[1][0])
    assert finals[0][1] == finals[1][1] == 3


def test_state_dict_round_trip_and_torch_compat():
    fs, ts, _ = _run_pair([None, None, None, (0, float("inf")), None], False, init_scale=16.0, growth_interval=3)
    sd = fs.state_dict()
    assert sd == ts.state_dict()
    other = amp.DynamicLossScaler()
    other.load_state_dict(sd)
    assert other.state_dict() == sd and other.get_growth_tracker() == 1
    tl = _torch_scaler()
    tl.load_state_dict(sd)
    assert tl.state_dict() == sd
    # continue both from the loaded state: same decisions
    p = flame.from_torch(torch.ones(3, device=DEVICE), requires_grad=True)
    opt = optim.SGD([p], lr=1.0)
    for _ in range(3):
        other.step(opt, {p: flame.from_torch(torch.ones(3, device=DEVICE))})
        other.update()
    assert other.get_scale() == 16.0 * 2 * 0.5 * 2 and other.get_growth_tracker() == 1
    with pytest.raises(RuntimeError, match="empty"):
        amp.DynamicLossScaler().load_state_dict({})


def test_scale_backward_and_fp16_grads_refused():
    s = amp.DynamicLossScaler(init_scale=1024.0)
    w = flame.from_torch(torch.randn(4, device=DEVICE), requires_grad=True)
    loss = (w * w).sum()
    grads = s.scale(loss).backward()
    assert_close(grads[w], 2048.0 * w.to_torch().detach(), rtol=1e-6, atol=0)
    s.unscale_(grads)
    assert_close(grads[w], 2.0 * w.to_torch().detach(), rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="already"):
        s.unscale_(grads)
    h = flame.from_torch(torch.randn(4, device=DEVICE).half(), requires_grad=True)
    with pytest.raises(ValueError, match="FP16"):
        s.unscale_({h: flame.from_torch(torch.ones(4, device=DEVICE).half())})
    off = amp.DynamicLossScaler(enabled=False)
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}


def test_no_host_sync_in_the_step_path(monkeypatch):
    """scale/unscale_/step/update never read a device value on the host."""
    s = amp.DynamicLossScaler(init_scale=8.0, growth_interval=1)
    p = flame.from_torch(torch.ones(5, device=DEVICE), requires_grad=True)
    opt = optim.SGD([p], lr=0.5)
    calls = []
    for name in ("item", "cpu", "tolist", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n),
                                                                                          _o(self, *a, **k))[1])
    for _ in range(2):
        g = {p: flame.from_torch(torch.full((5,), 8.0, device=DEVICE))}
        s.step(opt, g)
        s.update()
    assert calls == []
    monkeypatch.undo()
    assert s.get_scale() == 32.0
    np.testing.assert_allclose(p.numpy(), np.ones(5) - 0.5 - 0.25)


def test_lora_fp16_step_with_scaler_trains_adapters_only():
    """fp16 frozen base + fp32 adapters + scaler + AdamW: loss goes down, base untouched."""
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))
    model.to(torch.float16)  # frozen base in the compute dtype, then fp32 adapters
    nn.inject_lora(model, ["0", "2"], rank=2, alpha=2)
    assert all(p.dtype == torch.float32 for p in nn.lora_parameters(model))
    base = model[0].weight.to_torch().clone()
    opt = optim.AdamW(nn.lora_parameters(model), lr=0.05)
    scaler = amp.DynamicLossScaler(init_scale=2.0 ** 10)
    x = flame.randn(6, 8).to(torch.float16)
    target = flame.randn(6, 4)
    losses = []
    for _ in range(4):
        y = model(x).to(torch.float32)
        loss = ((y - target) * (y - target)).mean()
        grads = scaler.scale(loss).backward()
        assert model[0].weight not in grads and all(grads[p].dtype == torch.float32 for p in opt._flat_params())
        scaler.step(opt, grads)
        scaler.update()
        losses.append(float(loss.item()))
    assert losses[-1] < losses[0], losses
    assert torch.equal(model[0].weight.to_torch(), base)


# ---- autocast and Policy ----------------------------------------------------------------------

LOWP = [d for d in FLOAT_DTYPES_CPU if d != torch.float32] + GPU_ONLY_DTYPES
LOWP_PARAMS = [pytest.param(d, marks=pytest.mark.gpu) if d in GPU_ONLY_DTYPES else d for d in LOWP]


def _t(shape, dtype=torch.float32):
    t = torch.randn(shape, dtype=torch.float64).to(dtype).to(DEVICE)
    return flame.from_torch(t.clone()), t


# (name, flame fn, torch fn, input dtypes, dtype PyTorch's CUDA autocast gives): the CUDA lists
# (torch/testing/_internal/autocast_test_lists.py); CPU autocast keeps norms/softmax/sum in 16 bits
CASES = [
    ("linear", lambda x, w, b: F.linear(x, w, b), lambda x, w, b: TF.linear(x, w, b),
     [(3, 8), (5, 8), (5,)], "lowp"),
    ("matmul", lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 8), (8, 4)], "lowp"),
    ("bmm", flame.bmm, torch.bmm, [(2, 3, 8), (2, 8, 5)], "lowp"),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), lambda x, w, b: TF.conv2d(x, w, b, padding=1),
     [(1, 3, 5, 5), (4, 3, 3, 3), (4,)], "lowp"),
    ("sdpa", F.scaled_dot_product_attention, TF.scaled_dot_product_attention,
     [(1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8)], "lowp"),
    ("group_norm", lambda x: F.group_norm(x, 2), lambda x: TF.group_norm(x, 2), [(2, 4, 3, 3)], "fp32"),
    ("layer_norm", lambda x: F.layer_norm(x, (6,)), lambda x: TF.layer_norm(x, (6,)), [(3, 6)], "fp32"),
    ("rms_norm", lambda x: F.rms_norm(x, (6,)), lambda x: TF.rms_norm(x, (6,)), [(3, 6)], "same"),  # torch 2.11
    ("softmax", lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1), [(3, 6)], "fp32"),
    ("log_softmax", lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1), [(3, 6)], "fp32"),
    ("sum", lambda x: x.sum(dim=1), lambda x: x.sum(dim=1), [(3, 6)], "fp32"),
    ("mse_loss", F.mse_loss, TF.mse_loss, [(3, 6), (3, 6)], "fp32"),
    ("l1_loss", F.l1_loss, TF.l1_loss, [(3, 6), (3, 6)], "fp32"),
    ("mean", lambda x: x.mean(), lambda x: x.mean(), [(3, 6)], "same"),
    ("add", lambda a, b: a + b, lambda a, b: a + b, [(3, 6), (3, 6)], "same"),
]


@pytest.mark.parametrize("dtype", LOWP_PARAMS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_autocast_op_dtypes_and_values(case, dtype):
    name, ffn, tfn, shapes, kind = case
    # lower-precision ops get fp32 inputs (they cast down); fp32-list ops get low-precision inputs
    in_dtype = torch.float32 if kind == "lowp" else dtype
    pairs = [_t(s, in_dtype) for s in shapes]
    with amp.autocast(dtype):
        got = ffn(*[f for f, _ in pairs])
    want_dtype = {"lowp": dtype, "fp32": torch.float32, "same": in_dtype}[kind]
    assert got.dtype == want_dtype, (name, got.dtype)
    if DEVICE.type == "cuda":
        with torch.autocast("cuda", dtype=dtype):
            assert tfn(*[t for _, t in pairs]).dtype == want_dtype, name
    # values: the same op on inputs cast by hand, in the dtype autocast picked
    cast = dtype if kind == "lowp" else want_dtype
    ref = tfn(*[t.to(cast) for _, t in pairs])
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.to_torch().float(), ref.float(), **tol)


def test_autocast_gradients_reach_fp32_params_in_fp32():
    lin = nn.Linear(8, 6)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    gn = nn.GroupNorm(1, 3)
    tl, tc, tg = torch.nn.Linear(8, 6), torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.GroupNorm(1, 3)
    with torch.no_grad():
        for fm, tm in ((lin, tl), (conv, tc), (gn, tg)):
            for (_, fp), tp in zip(fm.named_parameters(), tm.parameters()):
                tp.copy_(fp.to_torch())
    tl, tc, tg = tl.to(DEVICE), tc.to(DEVICE), tg.to(DEVICE)
    xf, xt = _t((2, 2, 4, 4))
    target = torch.randn(2, 6, device=DEVICE)

    def run(lib, x, conv, gn, lin):
        h = gn(conv(x))  # conv in fp16, GroupNorm back to fp32
        h = h.reshape(2, -1)[:, :8]
        return lin(h)

    with amp.autocast(torch.float16):
        yf = run(flame, xf, conv, gn, lin)
        assert yf.dtype == torch.float16
    lossf = F.mse_loss(yf, flame.from_torch(target))
    grads = lossf.backward()
    # torch reference with the same casts (CPU autocast keeps GroupNorm in fp16, so cast by hand)
    h = tg(TF.conv2d(xt.half(), tc.weight.half(), tc.bias.half(), padding=1).float())
    yt = TF.linear(h.reshape(2, -1)[:, :8].half(), tl.weight.half(), tl.bias.half())
    TF.mse_loss(yt.float(), target).backward()
    for fm, tm in ((lin, tl), (conv, tc), (gn, tg)):
        for (name, fp), tp in zip(fm.named_parameters(), tm.parameters()):
            g = grads[fp]
            assert g.dtype == torch.float32, name
            torch.testing.assert_close(g.to_torch(), tp.grad, rtol=2e-2, atol=2e-3)


def test_autocast_casts_a_parameter_once_per_region_and_nests():
    from flame.ops import _autocast
    w = flame.randn(4, 4, requires_grad=True)
    x = flame.randn(4, 4)
    with amp.autocast(torch.float16):
        a, = _autocast.lower(w)
        b, = _autocast.lower(w)
        assert a is b and a.dtype == torch.float16  # one cast, reused
        assert _autocast.lower(x)[0] is not _autocast.lower(x)[0]  # inputs are not cached
        with flame.no_grad():
            assert _autocast.lower(w)[0] is not a  # no-grad casts are kept apart
        with amp.autocast(enabled=False):
            assert not amp.is_autocast_enabled() and (x @ x).dtype == torch.float32
        assert amp.get_autocast_dtype() == torch.float16
        seen = []
        th = threading.Thread(target=lambda: seen.append(amp.is_autocast_enabled()))
        th.start()
        th.join()
        assert seen == [False]  # per thread
        y = (x @ w).sum()
    assert not amp.is_autocast_enabled() and (x @ w).dtype == torch.float32
    g = y.backward()
    assert g[w].dtype == torch.float32

    @amp.autocast(torch.float16)
    def f(u):
        return u @ u
    assert f(x).dtype == torch.float16
    with pytest.raises(TypeError, match="dtype"):
        amp.autocast(torch.float64)


def test_parameter_casts_give_lora_adapters_their_copies_in_one_launch():
    """Inside ``ParameterCasts`` each LoRA layer reads its adapters' copies, made on entry by one
    launch, instead of casting them (two launches a layer): same outputs and gradients, bit for bit;
    each entry copies the current values into a fresh buffer (16-byte aligned copies, for TMA; those of one
    shape, here the last three layers' A and two layers' B, views of one stretch of it)."""
    from flame.kernels import launch as L
    from flame.ops.elementwise import parameter_copy
    half = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    sizes = ((24, 40), (40, 13), (13, 24), (24, 24), (24, 24))
    layers = [nn.LoRALinear(nn.Linear(k, n).to(half), rank=3, alpha=5.0) for k, n in sizes]
    params = [p for layer in layers for p in (layer.lora_A, layer.lora_B)]
    for layer in layers:
        flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
    x = flame.randn(5, 24, dtype=half)

    def run():
        y = x
        for layer in layers:
            y = layer(y)
        loss = (y.to(torch.float32) ** 2).sum()
        grads = loss.backward()
        return [loss] + [grads[p] for p in params]

    before = L.launches
    want = run()
    plain = L.launches - before
    casts = amp.ParameterCasts(params + [x], half)
    assert casts.params == params  # the input is already in the compute dtype: not copied
    before = L.launches
    with casts:
        got = run()
        inside = L.launches - before
        copies = [parameter_copy(p, half) for p in params]
        assert all(c.data_ptr() % 16 == 0 and tuple(c.shape) == tuple(p.shape) for c, p in zip(copies, params))
        assert parameter_copy(x, half) is None and parameter_copy(params[0], torch.float32) is None
    assert parameter_copy(params[0], half) is None  # outside the region
    assert inside == plain - 2 * len(layers) + 1
    for g, w in zip(got, want):
        assert_close(g, w, rtol=0, atol=0)
    assert got[1].dtype == torch.float32

    # each entry copies the values of its time: a graph recorded in the first region keeps its copies
    with casts:
        y_old = layers[0](x)
    old_ref = layers[0](x)
    flame.nn.init.normal_(layers[0].lora_B, 0.0, 0.5)
    with casts:
        y_new = layers[0](x)
    assert_close(y_new, layers[0](x), rtol=0, atol=0)
    assert not np.array_equal(y_new.to(torch.float32).numpy(), y_old.to(torch.float32).numpy())
    assert_close(y_old.to(torch.float32).sum().backward()[layers[0].lora_A],
                 old_ref.to(torch.float32).sum().backward()[layers[0].lora_A], rtol=0, atol=0)
    with pytest.raises(TypeError, match="dtype"):
        amp.ParameterCasts(params, torch.float64)
    with pytest.raises(TypeError, match="flame Tensors"):
        amp.ParameterCasts([torch.zeros(3)], half)


def test_parameter_casts_serve_every_cast_of_a_parameter():
    """``to`` (so conv2d's, linear's and autocast's recorded casts) returns the region's copy: a LoRA
    conv runs without its adapters' cast launches, with the same output and gradients; a dense
    parameter in another dim order (channels-last) is copied as it lies; ``copy=True`` still copies."""
    from flame.kernels import launch as L
    from flame.ops.elementwise import parameter_copy
    half = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    conv = nn.LoRAConv2d(nn.Conv2d(4, 6, 3, padding=1).to(half), rank=2, alpha=2.0)
    flame.nn.init.normal_(conv.lora_B, 0.0, 0.5)
    params = [conv.lora_A, conv.lora_B]
    x = flame.randn(2, 4, 5, 5, dtype=half)

    def run():
        y = conv(x)
        grads = (y.to(torch.float32) ** 2).sum().backward()
        return [y] + [grads[p] for p in params]

    casts = amp.ParameterCasts(params, half)
    before = L.launches
    want = run()
    plain = L.launches - before
    before = L.launches
    with casts:
        got = run()
        a16 = flame.ops.elementwise.to(conv.lora_A, half)
        assert a16._data.data_ptr() == parameter_copy(conv.lora_A, half).data_ptr()
        assert a16._data.stride() == conv.lora_A._data.stride()
        assert flame.ops.elementwise.to(conv.lora_A, half, copy=True)._data.data_ptr() != a16._data.data_ptr()
    assert L.launches - before == plain - 2 + 1 + 1  # two casts fewer, the region's one, the copy=True above
    for g, w in zip(got, want):
        assert_close(g, w, rtol=0, atol=0)
    nhwc = flame.from_torch(torch.randn(3, 4, 2, 5, device=DEVICE).to(memory_format=torch.channels_last),
                            requires_grad=True)
    with amp.ParameterCasts([nhwc], half):
        copy = flame.ops.elementwise.to(nhwc, half)
        assert copy._data.stride() == nhwc._data.stride()
        assert_close(copy, nhwc.to_torch().to(half), rtol=0, atol=0)


def test_backward_inside_autocast_is_unaffected():
    lin = nn.Linear(5, 5)
    x = flame.randn(3, 5)
    with amp.autocast(torch.float16):
        g_in = F.mse_loss(lin(x), flame.zeros(3, 5)).backward()
        y = lin(x)
    g_out = F.mse_loss(y, flame.zeros(3, 5)).backward()
    for p in lin.parameters():
        assert_close(g_in[p], g_out[p], rtol=0, atol=0)


def test_policy():
    pol = amp.Policy(compute_dtype=torch.float16)
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == (torch.float32, torch.float16, torch.float32)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.half()
    model[1].requires_grad_(False)
    pol.apply(model, frozen_dtype=torch.float16)
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.float16
    x = flame.randn(3, 4)
    with pol.autocast():
        y = model(pol.cast_to_compute(x))
    out = pol.cast_to_output({"y": [y], "n": 3})
    assert y.dtype == torch.float16 and out["y"][0].dtype == torch.float32 and out["n"] == 3
    grads = out["y"][0].sum().backward()
    assert grads[model[0].weight].dtype == torch.float32 and model[1].weight not in grads
    with pytest.raises(TypeError, match="compute_dtype"):
        amp.Policy(compute_dtype=torch.int32)


# ---- fp16 training: underflow without loss scaling, convergence with it ------------------------

def _mlp_run(scaled, steps=10, autocast_dtype=torch.float16):
    """A small regression MLP (fp32 master weights, fp16 compute) whose loss is weighted by 1e-7:
    without scaling, dL/dy (~1e-9) is below fp16's smallest subnormal and flushes to zero."""
    flame.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 1))
    x = flame.randn(64, 8)
    target = flame.tanh(x.sum(dim=1, keepdim=True) * 0.5)
    opt = optim.AdamW(model.parameters(), lr=3e-2, eps=1e-20, weight_decay=0.0)
    scaler = amp.DynamicLossScaler(init_scale=2.0 ** 16) if scaled else None
    losses, zero_grads = [], []
    for _ in range(steps):
        with amp.autocast(autocast_dtype, enabled=autocast_dtype is not None):
            y = model(x)
        loss = F.mse_loss(y, target) * 1e-7
        grads = (scaler.scale(loss) if scaled else loss).backward()
        zero_grads.append(all(float(grads[p].abs().max()) == 0.0 for p in model.parameters()))
        if scaled:
            scaler.step(opt, grads)
            scaler.update()
        else:
            opt.step(grads)
        losses.append(float(loss) * 1e7)
    return losses, zero_grads


def test_fp16_mlp_converges_with_scaler_and_underflows_without():
    plain, plain_zero = _mlp_run(scaled=False)
    scaled, scaled_zero = _mlp_run(scaled=True)
    ref, _ = _mlp_run(scaled=False, autocast_dtype=None)  # the same run in fp32
    # without scaling every gradient underflows to exactly zero: the model never moves
    assert all(plain_zero) and plain[-1] == plain[0], plain
    # with the scaler it trains like the fp32 run
    assert not any(scaled_zero)
    assert scaled[-1] < 0.2 * scaled[0] and ref[-1] < 0.2 * ref[0], (scaled, ref)
    assert abs(scaled[-1] - ref[-1]) < 0.1 * ref[0], (scaled[-1], ref[-1])


# ---- a full mixed-precision LoRA training step (also runs on the GPU, bf16 there) -------------

class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        h = flame.silu(self.norm(self.conv_in(x)))
        h = self.conv(h).mean(dim=(2, 3))
        return self.proj(h)


@pytest.mark.parametrize("dtype", LOWP_PARAMS)
def test_full_lora_training_step_with_autocast_and_scaler(dtype):
    from flame.kernels import launch as L
    model = _Small()
    nn.inject_lora(model, ["proj"], rank=2, alpha=2, conv=True)
    for p in nn.lora_parameters(model):  # non-zero B so every adapter gets a gradient at step 1
        nn.init.normal_(p, 0.0, 0.1)
    model.norm.requires_grad_(False)
    amp.Policy(compute_dtype=dtype).apply(model, frozen_dtype=dtype)  # frozen base stored in 16 bits
    assert model.conv.weight.dtype == dtype and model.conv.lora_A.dtype == torch.float32
    frozen = {n: p.to_torch().clone() for n, p in model.named_parameters() if not p.requires_grad}
    params = nn.lora_parameters(model)
    opt = optim.AdamW(params, lr=5e-2)
    scaler = amp.DynamicLossScaler(init_scale=2.0 ** 12)
    x = flame.randn(2, 3, 6, 6)
    target = flame.randn(2, 4)

    def loss_of(use_autocast):
        with amp.autocast(dtype, enabled=use_autocast):
            y = model(x)
        assert y.dtype == (dtype if use_autocast else torch.float32)
        return F.mse_loss(y, target)

    # reference gradients: the same step in fp32 (base weights upcast), no scaling
    model.to(torch.float32)
    ref = loss_of(False).backward()
    ref = {p.id: ref[p].to_torch().clone() for p in params}
    amp.Policy(compute_dtype=dtype).apply(model, frozen_dtype=dtype)
    losses = []
    for step in range(4):
        loss = loss_of(True)
        grads = scaler.scale(loss).backward()
        assert set(grads.keys()) == {p.id for p in params}  # no gradient for the frozen base
        if step == 0:
            scaler.unscale_(grads)
            for p in params:
                assert grads[p].dtype == torch.float32
                torch.testing.assert_close(grads[p].to_torch(), ref[p.id], rtol=5e-2, atol=5e-3)
        before = L.launches
        scaler.step(opt, grads)
        if step > 0:  # (the first step also zero-fills the optimizer state)
            assert L.launches - before == 3  # inf check + fused unscale/update + step counters
        scaler.update()
        losses.append(float(loss))
    assert not scaler.last_step_skipped()
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.9 * losses[0], losses
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.to_torch(), frozen[n]), n


def test_unscale_and_step_with_dense_non_contiguous_gradients():
    """A channels-last conv weight's gradient and a transposed one unscale in place, keep their
    layout, and the step matches torch's GradScaler + SGD."""
    pres = torch.preserve_format
    tparams = [torch.randn(8, 5, 3, 3, device=DEVICE).contiguous(memory_format=torch.channels_last).requires_grad_(),
               torch.randn(7, 4, device=DEVICE).t().requires_grad_()]
    fparams = [flame.from_torch(p.detach().clone(memory_format=pres), requires_grad=True) for p in tparams]
    topt, fopt = torch.optim.SGD(tparams, lr=0.1), optim.SGD(fparams, lr=0.1)
    ts, fs = _torch_scaler(), amp.DynamicLossScaler()
    ts.scale(torch.zeros((), device=DEVICE))
    grads = [(torch.randn(p.shape, device=DEVICE) * ts.get_scale()).to(memory_format=pres) for p in tparams]
    grads = [g.contiguous(memory_format=torch.channels_last) if g.dim() == 4 else g.t().contiguous().t() for g in grads]
    for p, g in zip(tparams, grads):
        p.grad = g.clone(memory_format=pres)
    fg = {fp: flame.from_torch(g.clone(memory_format=pres)) for fp, g in zip(fparams, grads)}
    ts.unscale_(topt)
    fs.unscale_(fg)
    for fp, tp in zip(fparams, tparams):
        assert fg[fp].stride() == tp.grad.stride()
        assert_close(fg[fp], tp.grad, rtol=0, atol=0)
    ts.step(topt)
    fs.step(fopt, fg)
    for fp, tp in zip(fparams, tparams):
        assert_close(fp, tp.detach(), rtol=1e-6, atol=1e-6)
