"""Mixed precision: DynamicLossScaler against torch.amp.GradScaler (scale values, skipped steps,
parameters, state), autocast against PyTorch's autocast lists, Policy, fp16 training runs."""
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
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(6, generator=gen)
    gs = [torch.randn(6, generator=gen) for _ in range(3)]
    runs = []
    for skip in (True, False):
        p = flame.from_torch(p0.clone().to(DEVICE), requires_grad=True)
        opt = optim.AdamW([p], lr=0.05)
        sc = amp.DynamicLossScaler(init_scale=128.0, growth_interval=1)
        for i in range(3):
            if i == 1 and not skip:
                continue
            g = gs[i] * sc.get_scale()
            if i == 1:
                g[2] = float("nan")
            sc.step(opt, {p: flame.from_torch(g.to(DEVICE))})
            sc.update()
        runs.append(p.numpy())
    np.testing.assert_array_equal(runs[0], runs[1])


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
    ("rms_norm", lambda x: F.rms_norm(x, (6,)), lambda x: TF.rms_norm(x, (6,)), [(3, 6)], "fp32"),
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
