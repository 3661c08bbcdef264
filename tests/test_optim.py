"""Fused optimizers, LR schedulers and clip_grad_norm_ against torch.optim / torch.nn.utils."""
import math
import warnings

import numpy as np
import pytest
import torch

import flame
from flame import optim
from flame.graphs import CapturedStep
from flame.kernels import optim as KO
from helpers import DEVICE

# odd sizes; 4500 elements span two work items of the interpreter's 4096-element chunks, 21000
# span three of the GPU's 8192-element chunks
SHAPES = [(3, 5), (17,), (4, 3, 2), (1,), (4500,), (3, 7000)]


def _params(shapes=SHAPES, dtype=torch.float32):
    torch_ps = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype).to(DEVICE)) for s in shapes]
    flame_ps = [flame.from_torch(p.detach().clone(), requires_grad=True) for p in torch_ps]
    return flame_ps, torch_ps


def _grads(torch_ps, skip=()):
    return [None if i in skip else torch.randn(p.shape, dtype=torch.float32, device=DEVICE)
            for i, p in enumerate(torch_ps)]


def _grad_map(flame_ps, gs):
    gm = flame.GradientMap()
    for p, g in zip(flame_ps, gs):
        if g is not None:
            gm[p] = flame.from_torch(g.clone())
    return gm


def _torch_step(opt, torch_ps, gs):
    for p, g in zip(torch_ps, gs):
        p.grad = None if g is None else g.clone().to(p.dtype)
    opt.step()


def _assert_params(flame_ps, torch_ps, rtol=1e-6, atol=1e-6):
    # 1e-6 relative to the O(1) parameter scale (single elements near 0 see rounding-order noise)
    for f, t in zip(flame_ps, torch_ps):
        torch.testing.assert_close(f.to_torch(), t.detach(), rtol=rtol, atol=atol)


CONFIGS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=0.05)),
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02)),
]


def _run_both(name, kw, steps):
    """``steps`` updates of flame's and torch's optimizer ``name`` from the same params and grads."""
    fp, tp = _params()
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(tp, **kw)
    for _ in range(steps):
        gs = _grads(tp)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    return fp, tp, fo


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_matches_torch_five_steps(name, kw):
    fp, tp, fo = _run_both(name, kw, 5)
    _assert_params(fp, tp)
    st = fo.state_dict()["state"]
    assert all(st[i]["step"] == 5 for i in range(len(SHAPES)))


def test_param_groups_with_own_hyperparameters():
    fp, tp = _params()
    groups = lambda ps: [dict(params=ps[:2], lr=2e-2, weight_decay=0.3, betas=(0.85, 0.95)),
                         dict(params=ps[2:])]
    fo = optim.AdamW(groups(fp), lr=1e-2, weight_decay=0.01)
    to = torch.optim.AdamW(groups(tp), lr=1e-2, weight_decay=0.01)
    assert fo.param_groups[1]["lr"] == 1e-2 and fo.param_groups[0]["betas"] == (0.85, 0.95)
    for _ in range(4):
        gs = _grads(tp)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)


def test_sgd_param_groups_mixed_momentum():
    fp, tp = _params()
    groups = lambda ps: [dict(params=ps[:3], momentum=0.0), dict(params=ps[3:], nesterov=True)]
    fo = optim.SGD(groups(fp), lr=0.1, momentum=0.9)
    to = torch.optim.SGD(groups(tp), lr=0.1, momentum=0.9)
    for _ in range(3):
        gs = _grads(tp)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_params_without_gradient_are_skipped(name):
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2)
    fp, tp = _params()
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(tp, **kw)
    for skip in [(), (1, 3), (), (0,), ()]:  # the set of params changes: tables are rebuilt
        gs = _grads(tp, skip)
        before = [p.to_torch().clone() for p in fp]
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
        for i in skip:
            assert torch.equal(fp[i].to_torch(), before[i])
    _assert_params(fp, tp)
    steps = [fo.state_dict()["state"][i]["step"] for i in range(len(SHAPES))]
    assert steps == [4, 4, 5, 4, 5, 5]


def _flag(value):
    return flame.tensor([value], dtype=flame.int32)


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.1, momentum=0.9))])
def test_found_inf_skips_the_update_on_the_device(name, kw):
    fp, tp = _params()
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(tp, **kw)
    for i in range(4):
        gs = _grads(tp)
        skip = i == 2
        if skip:  # the flag is set: nothing changes, not even the step counters
            before = [p.to_torch().clone() for p in fp]
            state_before = fo.state_dict()["state"]
            fo.step(_grad_map(fp, gs), found_inf=_flag(1))
            for p, b in zip(fp, before):
                assert torch.equal(p.to_torch(), b)
            state_after = fo.state_dict()["state"]
            for k, entry in state_before.items():
                for name_, v in entry.items():
                    if isinstance(v, int):
                        assert state_after[k][name_] == v
                    else:
                        assert torch.equal(state_after[k][name_].to_torch(), v.to_torch())
        else:
            fo.step(_grad_map(fp, gs), found_inf=_flag(0))
            _torch_step(to, tp, gs)
    _assert_params(fp, tp)
    assert fo.state_dict()["state"][0]["step"] == 3


def test_grad_scale_unscales_inside_the_kernel():
    fp, tp = _params()
    fo, to = optim.AdamW(fp, lr=1e-2), torch.optim.AdamW(tp, lr=1e-2)
    scale = 1024.0
    for _ in range(3):
        gs = _grads(tp)
        fo.step(_grad_map(fp, [g * scale for g in gs]), grad_scale=flame.tensor([1.0 / scale]))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True))])
def test_state_dict_resume_continues_identically(name, kw):
    fp, tp = _params()
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(tp, **kw)
    all_grads = [_grads(tp) for _ in range(5)]
    for gs in all_grads[:3]:
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    sd = fo.state_dict()
    # a fresh optimizer over copies of the parameters, resumed from the state dict
    fp2 = [flame.from_torch(p.to_torch().clone(), requires_grad=True) for p in fp]
    fo2 = getattr(optim, name)(fp2, **kw)
    fo2.load_state_dict(sd)
    for gs in all_grads[3:]:
        fo.step(_grad_map(fp, gs))
        fo2.step(_grad_map(fp2, gs))
        _torch_step(to, tp, gs)
    for a, b in zip(fp, fp2):
        assert torch.equal(a.to_torch(), b.to_torch())
    _assert_params(fp2, tp)


def test_load_state_dict_errors():
    fp, _ = _params()
    fo = optim.AdamW(fp)
    fo.step(_grad_map(fp, _grads(fp)))
    sd = fo.state_dict()
    with pytest.raises(ValueError, match="parameter group"):
        optim.AdamW(fp[:2]).load_state_dict(sd)
    bad = dict(sd, state={0: dict(sd["state"][0], exp_avg=flame.zeros(2, 2))})
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        optim.AdamW(fp).load_state_dict(bad)


@pytest.mark.parametrize("shapes", [SHAPES, [(i % 5 + 1, 3) for i in range(40)]], ids=["6-params", "40-params"])
def test_optimizer_step_launch_count_does_not_grow_with_params(shapes):
    """Every kernel launch goes through flame.kernels.launch.launch, which counts them: an
    optimizer step is 2 launches (update + step counters) however many parameters there are, 3
    with the loss scaler's inf check in front (the unscale is fused into the update)."""
    from flame import amp
    from flame.kernels import launch as L
    fp, _ = _params(shapes)
    counts = {}
    for name, opt in (("AdamW", optim.AdamW(fp, weight_decay=0.1)), ("SGD", optim.SGD(fp, lr=0.1, momentum=0.9))):
        scaler = amp.DynamicLossScaler(init_scale=4.0)
        for step in range(2):  # the first step also allocates the state (zero fills)
            plain, scaled = _grad_map(fp, _grads(fp)), _grad_map(fp, _grads(fp))
            before = L.launches
            opt.step(plain)
            mid = L.launches
            scaler.step(opt, scaled)
            counts[name, step] = (mid - before, L.launches - mid)
    assert counts[("AdamW", 1)] == counts[("SGD", 1)] == (2, 3), counts
    before = L.launches
    optim.clip_grad_norm_(_grad_map(fp, _grads(fp)), 1.0)
    assert L.launches - before == 3


def test_bad_arguments():
    fp, _ = _params()
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.AdamW([])
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        optim.AdamW([flame.zeros(3, dtype=flame.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="more than one parameter group"):
        optim.SGD([dict(params=fp[:2]), dict(params=fp[1:])])
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD(fp, nesterov=True)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        optim.AdamW(fp, amsgrad=True)
    opt = optim.AdamW(fp)
    with pytest.raises(TypeError, match="GradientMap"):
        opt.step([1, 2])
    with pytest.raises(TypeError, match="found_inf"):
        opt.step(flame.GradientMap(), found_inf=flame.zeros(1))
    gm = flame.GradientMap()
    gm[fp[0]] = flame.zeros(2)
    with pytest.raises(ValueError, match="gradient of shape"):
        opt.step(gm)


def test_training_a_module_end_to_end():
    # grads from a real backward through Linear layers; flame AdamW vs torch AdamW on the same model
    from flame import nn
    tm = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.SiLU(), torch.nn.Linear(9, 2)).to(DEVICE)
    fm = nn.Sequential(nn.Linear(6, 9), nn.SiLU(), nn.Linear(9, 2))
    fm.load_state_dict(tm.state_dict())
    fo = optim.AdamW(fm.parameters(), lr=1e-2)
    to = torch.optim.AdamW(tm.parameters(), lr=1e-2)
    x = torch.randn(5, 6, device=DEVICE)
    for _ in range(3):
        loss = (fm(flame.from_torch(x)) ** 2).mean()
        fo.step(loss.backward())
        to.zero_grad()
        (tm(x) ** 2).mean().backward()
        to.step()
    tol = dict(rtol=1e-5, atol=1e-6) if flame.is_interpreter() else dict(rtol=1e-3, atol=1e-3)  # tf32 GEMMs
    for (k, v), (k2, v2) in zip(fm.state_dict().items(), tm.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v.to_torch(), v2, **tol)


# dense parameters that are not contiguous: a channels-last conv weight, a transposed matrix
_CL = torch.channels_last


def _dense_params():
    ts = [torch.randn(8, 5, 3, 3, dtype=torch.float64).float().to(DEVICE).contiguous(memory_format=_CL),
          torch.randn(7, 4, dtype=torch.float64).float().to(DEVICE).t(),
          torch.randn(2, 3, 1, 1, dtype=torch.float64).float().to(DEVICE).contiguous(memory_format=_CL)]
    torch_ps = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in ts]
    flame_ps = [flame.from_torch(t.clone(memory_format=torch.preserve_format), requires_grad=True) for t in ts]
    return flame_ps, torch_ps


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True))])
def test_dense_non_contiguous_params_match_torch(name, kw):
    """Channels-last and transposed parameters: the state is laid out like the parameter, and a
    gradient in the parameter's layout, in another dense layout or not dense at all updates the
    same elements as torch's optimizer. A resumed optimizer continues identically."""
    fp, tp = _dense_params()
    assert not any(p.is_contiguous() for p in fp[:2])
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(tp, **kw)
    layouts = [lambda g: g.clone(memory_format=torch.preserve_format), lambda g: g.contiguous(),
               lambda g: torch.cat([g, g], dim=-1)[..., : g.shape[-1]]]  # the last: not dense
    for step in range(4):
        gs = [torch.randn(p.shape, device=DEVICE).to(memory_format=torch.preserve_format) for p in tp]
        gm = flame.GradientMap()
        for i, (p, g) in enumerate(zip(fp, gs)):
            gm[p] = flame.from_torch(layouts[(i + step) % 3](g))
        if step == 2:  # resume from the state dict into fresh copies of the parameters
            fp = [flame.from_torch(p.to_torch().clone(memory_format=torch.preserve_format), requires_grad=True)
                  for p in fp]
            sd, fo = fo.state_dict(), getattr(optim, name)(fp, **kw)
            fo.load_state_dict(sd)
            gm = flame.GradientMap()
            for i, (p, g) in enumerate(zip(fp, gs)):
                gm[p] = flame.from_torch(layouts[(i + step) % 3](g))
        fo.step(gm)
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)
    for p in fp:
        assert all(buf.stride() == p.stride() for buf in fo.state[p.id].values())


def test_non_dense_params_raise():
    t = flame.from_torch(torch.randn(4, 6, device=DEVICE)[:, ::2], requires_grad=True)
    with pytest.raises(ValueError, match="must be dense"):
        optim.AdamW([t])


def test_clip_grad_norm_channels_last_gradients():
    gs = [torch.randn(8, 5, 3, 3, device=DEVICE).contiguous(memory_format=_CL), torch.randn(7, 4, device=DEVICE).t()]
    fg = [flame.from_torch(g.clone(memory_format=torch.preserve_format)) for g in gs]
    tp = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
    for p, g in zip(tp, gs):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(tp, 0.5)
    torch.testing.assert_close(optim.clip_grad_norm_(fg, 0.5).to_torch(), want, rtol=1e-5, atol=0)
    for f, p in zip(fg, tp):
        assert f.stride() == p.grad.stride()
        torch.testing.assert_close(f.to_torch(), p.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="must be dense"):
        optim.clip_grad_norm_([flame.from_torch(torch.randn(4, 6, device=DEVICE)[:, ::2])], 1.0)


def test_training_a_conv_module_end_to_end():
    """flame's Conv2d keeps its weight channels-last: its gradient comes back channels-last (no
    copy) and AdamW trains it as torch's AdamW trains torch's Conv2d."""
    from flame import nn
    tm = torch.nn.Conv2d(3, 4, 3, padding=1).to(DEVICE)
    fm = nn.Conv2d(3, 4, 3, padding=1)
    fm.load_state_dict(tm.state_dict())
    assert fm.weight.stride() == fm.weight.to_torch().contiguous(memory_format=_CL).stride()
    fo = optim.AdamW(fm.parameters(), lr=1e-2)
    to = torch.optim.AdamW(tm.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 6, 5, device=DEVICE)
    for _ in range(3):
        grads = (fm(flame.from_torch(x)) ** 2).mean().backward()
        assert grads[fm.weight].stride() == fm.weight.stride()
        fo.step(grads)
        to.zero_grad()
        (tm(x) ** 2).mean().backward()
        to.step()
    tol = dict(rtol=1e-5, atol=1e-6) if flame.is_interpreter() else dict(rtol=1e-3, atol=1e-3)  # tf32
    for (k, v), (k2, v2) in zip(fm.state_dict().items(), tm.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v.to_torch(), v2, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.05, momentum=0.9))])
def test_low_precision_params_fp32_math(name, kw, dtype):
    # fp16/bf16 parameters, fp32 gradients and state: each step is the fp32 update of the stored
    # value, rounded once to the parameter dtype. Reference: torch in fp32 from the same rounded
    # start, re-synchronised to flame's rounded values after every step (errors do not compound).
    fp, _ = _params(dtype=dtype)
    ref = [torch.nn.Parameter(p.to_torch().float()) for p in fp]
    fo, to = getattr(optim, name)(fp, **kw), getattr(torch.optim, name)(ref, **kw)
    eps = torch.finfo(dtype).eps
    for _ in range(3):
        gs = _grads(ref)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, ref, gs)
        for f, r in zip(fp, ref):
            assert f.dtype == dtype
            got, want = f.to_torch().float(), r.detach()
            # at most one rounding of the fp32 result (half an ulp, plus fp32 noise)
            assert ((got - want).abs() <= want.abs() * eps * 0.5 + 1e-6).all()
            with torch.no_grad():
                r.copy_(got)


# ---- clip_grad_norm_ ----------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    _, tp = _params()
    gs = _grads(tp)
    fp = [flame.from_torch(g.clone()) for g in gs]
    for p, g in zip(tp, gs):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(tp, max_norm, norm_type=norm_type)
    got = optim.clip_grad_norm_(fp, max_norm, norm_type=norm_type)
    assert got.shape == () and got.dtype == torch.float32
    torch.testing.assert_close(got.to_torch(), want, rtol=1e-5, atol=0)
    for f, p in zip(fp, tp):
        torch.testing.assert_close(f.to_torch(), p.grad, rtol=1e-5, atol=1e-7)
    if max_norm > 1e3:  # no clipping: the gradients are unchanged
        for f, g in zip(fp, gs):
            torch.testing.assert_close(f.to_torch(), g, rtol=1e-6, atol=0)


def test_clip_grad_norm_gradient_map_and_edge_cases():
    fp, tp = _params()
    gs = _grads(tp)
    gm = _grad_map(fp, gs)
    total = optim.clip_grad_norm_(gm, 1.0)
    expect = math.sqrt(sum(float((g.double() ** 2).sum()) for g in gs))
    assert total.item() == pytest.approx(expect, rel=1e-5)
    clipped = math.sqrt(sum(float((gm[p].to_torch().double() ** 2).sum()) for p in fp))
    assert clipped == pytest.approx(1.0, rel=1e-5)
    assert optim.clip_grad_norm_(flame.GradientMap(), 1.0).item() == 0.0
    bad = [flame.tensor([1.0, float("nan")])]
    with pytest.raises(RuntimeError, match="non-finite"):
        optim.clip_grad_norm_(bad, 1.0, error_if_nonfinite=True)
    assert math.isnan(optim.clip_grad_norm_(bad, 1.0).item())


# ---- LR schedulers ------------------------------------------------------------------------------

def _pair_opts(name="SGD", **kw):
    f = [flame.zeros(2, requires_grad=True), flame.zeros(3, requires_grad=True)]
    t = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = lambda ps: [dict(params=[ps[0]]), dict(params=[ps[1]], lr=0.5)]
    return getattr(optim, name)(groups(f), lr=0.1, **kw), getattr(torch.optim, name)(groups(t), lr=0.1, **kw)


def _compare(make_flame, make_torch, steps=25, name="SGD", opt_kw=None, keys=("lr",)):
    fo, to = _pair_opts(name, **(opt_kw or {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fs, ts = make_flame(fo), make_torch(to)
        for _ in range(steps):
            assert fs.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-9, abs=1e-15)
            for fg, tg in zip(fo.param_groups, to.param_groups):
                for k in keys:
                    assert fg[k] == pytest.approx(tg[k], rel=1e-9, abs=1e-15), k
            to.step()
            fs.step()
            ts.step()


S = optim.lr_scheduler
T = torch.optim.lr_scheduler


@pytest.mark.parametrize("case", ["step", "multistep", "exponential", "cosine", "linear", "constant", "lambda"])
def test_torch_schedulers(case):
    make = {
        "step": lambda m, o: m.StepLR(o, step_size=4, gamma=0.5),
        "multistep": lambda m, o: m.MultiStepLR(o, milestones=[3, 7, 12], gamma=0.3),
        "exponential": lambda m, o: m.ExponentialLR(o, gamma=0.9),
        "cosine": lambda m, o: m.CosineAnnealingLR(o, T_max=20, eta_min=1e-3),
        "linear": lambda m, o: m.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=10),
        "constant": lambda m, o: m.ConstantLR(o, factor=0.25, total_iters=6),
        "lambda": lambda m, o: m.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1 / (1 + s)]),
    }[case]
    _compare(lambda o: make(S, o), lambda o: make(T, o), steps=20)


@pytest.mark.parametrize("name,opt_kw,keys", [("SGD", dict(momentum=0.9), ("lr", "momentum")),
                                              ("AdamW", {}, ("lr", "betas"))])
@pytest.mark.parametrize("kw", [dict(anneal_strategy="cos"), dict(anneal_strategy="linear", three_phase=True)])
def test_one_cycle(name, opt_kw, keys, kw):
    make = lambda m, o: m.OneCycleLR(o, max_lr=[1.0, 0.3], total_steps=30, pct_start=0.25, **kw)
    _compare(lambda o: make(S, o), lambda o: make(T, o), steps=30, name=name, opt_kw=opt_kw, keys=keys)


def _diffusers_lambdas(kind, warmup, total, cycles=0.5):
    def f(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        progress = float(step - warmup) / float(max(1, total - warmup))
        if kind == "linear":
            return max(0.0, float(total - step) / float(max(1, total - warmup)))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))
    return f


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_schedules_match_diffusers_formulas(kind):
    make = {"constant": lambda o: S.get_constant_schedule_with_warmup(o, 5),
            "linear": lambda o: S.get_linear_schedule_with_warmup(o, 5, 20),
            "cosine": lambda o: S.get_cosine_schedule_with_warmup(o, 5, 20)}[kind]
    _compare(make, lambda o: T.LambdaLR(o, _diffusers_lambdas(kind, 5, 20)), steps=22)
    fo, _ = _pair_opts()
    sched = S.get_scheduler(kind if kind != "constant" else "constant_with_warmup", fo, 5, 20)
    assert type(sched) is type(make(_pair_opts()[0]))


@pytest.mark.parametrize("kind", ["cosine_with_restarts", "polynomial"])
def test_restart_and_polynomial_schedules_match_diffusers(kind):
    optimization = pytest.importorskip("diffusers.optimization")
    make = {"cosine_with_restarts": lambda o: S.get_scheduler(kind, o, 3, 20, num_cycles=3),
            "polynomial": lambda o: S.get_scheduler(kind, o, 3, 20, power=2.0)}[kind]
    ref = {"cosine_with_restarts": lambda o: optimization.get_cosine_with_hard_restarts_schedule_with_warmup(
               o, 3, 20, num_cycles=3),
           "polynomial": lambda o: optimization.get_polynomial_decay_schedule_with_warmup(o, 3, 20, power=2.0)}[kind]
    _compare(make, ref, steps=24)  # past num_training_steps too


def test_scheduler_state_dict_resume():
    fo, _ = _pair_opts("AdamW")
    sched = S.OneCycleLR(fo, max_lr=0.2, total_steps=40)
    for _ in range(13):
        sched.step()
    sd_sched = sched.state_dict()
    import copy
    sd_opt = {"param_groups": copy.deepcopy(fo.state_dict()["param_groups"]), "state": {}}
    fo2, _ = _pair_opts("AdamW")
    fo2.load_state_dict(sd_opt)
    sched2 = S.OneCycleLR(fo2, max_lr=0.2, total_steps=40, last_epoch=12)
    sched2.load_state_dict(sd_sched)
    assert sched2.get_last_lr() == sched.get_last_lr()
    for _ in range(10):
        sched.step()
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
        assert [g["betas"] for g in fo2.param_groups] == [g["betas"] for g in fo.param_groups]


def test_scheduler_drives_the_optimizer_lr():
    fp, tp = _params([(5,), (3, 2)])
    fo, to = optim.SGD(fp, lr=0.1, momentum=0.5), torch.optim.SGD(tp, lr=0.1, momentum=0.5)
    fs, ts = S.CosineAnnealingLR(fo, T_max=4), T.CosineAnnealingLR(to, T_max=4)
    for _ in range(4):
        gs = _grads(tp)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
        fs.step()
        ts.step()
    _assert_params(fp, tp)


def test_tables_are_reused_over_new_gradients_and_follow_swapped_buffers(monkeypatch):
    from flame import nn
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = optim.SGD(model.parameters(), lr=0.5)
    builds = [0]
    real = KO.Tables

    def counting(rows):
        builds[0] += 1
        return real(rows)

    monkeypatch.setattr(KO, "Tables", counting)
    ps = list(model.parameters())
    gm = _grad_map(ps, _grads(ps))
    opt.step(gm)
    opt.step(gm)  # same gradient buffers: the tables are reused
    assert builds[0] == 1
    before = [p.to_torch().clone() for p in ps]
    new = _grad_map(ps, _grads(ps))
    opt.step(new)  # a new backward's buffers: their pointers rewritten in the tables, no rebuild
    assert builds[0] == 1
    for p, b, (_, g) in zip(ps, before, sorted(new.items())):
        torch.testing.assert_close(p.to_torch(), b - 0.5 * g.to_torch())
    # Module.to swaps every parameter's buffer (same Parameter objects): the optimizer follows
    model.to(flame.float16)
    before = [p.to_torch().float().clone() for p in ps]
    opt.step(gm)
    assert builds[0] == 2
    for p, b, (_, g) in zip(ps, before, sorted(gm.items())):
        assert p.dtype == flame.float16
        torch.testing.assert_close(p.to_torch().float(), (b - 0.5 * g.to_torch()).half().float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)), ("SGD", dict(lr=0.1, momentum=0.9))])
def test_several_blocks_per_work_item(monkeypatch, name, kw):
    # the GPU layout: each program loops over several blocks of its chunk (chunks end mid-tensor)
    monkeypatch.setattr(KO, "_sizes", lambda: (256, 1024))
    fp, tp, _ = _run_both(name, kw, 3)
    _assert_params(fp, tp)
    gs = _grads(tp)
    fg = [flame.from_torch(g.clone()) for g in gs]
    for p, g in zip(tp, gs):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(tp, 0.5)
    optim.clip._cache.clear()
    got = optim.clip_grad_norm_(fg, 0.5)
    torch.testing.assert_close(got.to_torch(), want, rtol=1e-5, atol=0)
    for f, p in zip(fg, tp):
        torch.testing.assert_close(f.to_torch(), p.grad, rtol=1e-5, atol=1e-7)


def test_ema_follows_diffusers_decay_warmup_and_applies_for_a_while():
    params = [flame.nn.Parameter(flame.randn(5, 3)), flame.nn.Parameter(flame.randn(7).to(flame.bfloat16))]
    start = [p.to(flame.float32).numpy().astype(np.float64) for p in params]
    ema = flame.optim.EMA(params, decay=0.9)
    want = [s.copy() for s in start]
    for n in range(4):
        for p in params:  # the trained weights move
            p._data.copy_(p._data * 0.5 + 1.0)
        d = min(0.9, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(d)
        ema.update()
        if n == 0:
            tables = ema._update_tables[1]
        assert ema._update_tables[1] is tables  # built once: no host transfer per update
        want = [d * w + (1 - d) * p.to(flame.float32).numpy() for w, p in zip(want, params)]
    for got, w in zip(ema.shadow, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-6)
    trained = [p.to(flame.float32).numpy() for p in params]
    with ema.applied():
        np.testing.assert_allclose(params[0].numpy(), want[0], rtol=1e-6)
        np.testing.assert_allclose(params[1].to(flame.float32).numpy(), want[1], rtol=1e-2)  # cast to bf16
    for p, t in zip(params, trained):
        np.testing.assert_array_equal(p.to(flame.float32).numpy(), t)
    other = flame.optim.EMA(params, decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 4 and all((a.numpy() == b.numpy()).all() for a, b in zip(other.shadow, ema.shadow))
    with pytest.raises(ValueError, match="decay must be in"):
        flame.optim.EMA(params, decay=1.0)
    with pytest.raises(ValueError, match="other shapes"):
        other.load_state_dict({"updates": 1, "shadow": [flame.zeros(2)]})


class _ReferenceLion(torch.optim.Optimizer):
    """lion-pytorch's update (Chen et al. 2023), the reference flame's fused Lion is checked against."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((m * b1 + p.grad * (1 - b1)).sign(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_lion_matches_the_reference_and_honours_found_inf_and_grad_scale():
    fp, tp = _params()
    kw = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.5)
    fo, to = optim.Lion(fp, **kw), _ReferenceLion(tp, **kw)
    for i in range(6):
        gs = _grads(tp)
        if i == 3:  # a skipped step changes nothing
            before = [p.to_torch().clone() for p in fp]
            fo.step(_grad_map(fp, gs), found_inf=_flag(1))
            assert all(torch.equal(p.to_torch(), b) for p, b in zip(fp, before))
            continue
        fo.step(_grad_map(fp, [g * 64.0 for g in gs]), grad_scale=flame.tensor([1.0 / 64.0]))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)  # FMA on the GPU: a few ulps on |p| ~ 2
    assert fo.state_dict()["state"][0]["step"] == 5
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        optim.Lion(fp, betas=(0.9, 1.0))


def _bnb_dynamic_map(signed):
    """bitsandbytes' ``create_dynamic_map(signed)`` (defaults: 7 exponent bits, 8 bits), in torch."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, (2 ** e if signed else 2 ** (e + 1)) + 1, dtype=torch.float32)
        mids = (10 ** (e - 6)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


def test_dynamic_maps_are_bitsandbytes_maps():
    for signed in (True, False):
        mine = torch.from_numpy(KO.dynamic_map(signed))
        assert mine.shape == (256,) and bool((mine[1:] > mine[:-1]).all())
        assert mine[-1] == 1.0 and (mine[0] < -0.99 if signed else mine[0] == 0.0) and 0.0 in mine
        torch.testing.assert_close(mine, _bnb_dynamic_map(signed), rtol=2e-7, atol=0)


class _ReferenceAdamW8bit:
    """bitsandbytes' blockwise 8-bit AdamW update (its CUDA kernel's order of operations), in torch,
    on flat fp32 tensors."""

    def __init__(self, params, lr, betas, eps, weight_decay, min_8bit_size=4096):
        self.params, self.lr, self.betas, self.eps, self.wd = params, lr, betas, eps, weight_decay
        self.maps = (_bnb_dynamic_map(True).to(DEVICE), _bnb_dynamic_map(False).to(DEVICE))
        self.state = []
        for p in params:
            n = p.numel()
            if n < min_8bit_size:
                self.state.append({"m": torch.zeros(n, device=DEVICE), "v": torch.zeros(n, device=DEVICE)})
            else:
                nb = -(-n // 256)
                self.state.append({"cm": torch.zeros(n, dtype=torch.long, device=DEVICE),
                                   "cv": torch.zeros(n, dtype=torch.long, device=DEVICE),
                                   "am": torch.zeros(nb, device=DEVICE), "av": torch.zeros(nb, device=DEVICE)})
        self.t = 0

    @staticmethod
    def _nearest(qmap, x):
        lo = (torch.searchsorted(qmap, x, right=True) - 1).clamp(0, 255)
        hi = (lo + 1).clamp(max=255)
        return torch.where(qmap[hi] - x < x - qmap[lo], hi, lo)

    def _blocks(self, x, n):
        return torch.nn.functional.pad(x, (0, -n % 256)).view(-1, 256)

    @torch.no_grad()
    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, math.sqrt(1 - b2 ** self.t)
        smap, umap = self.maps
        for p, g, st in zip(self.params, grads, self.state):
            n = p.numel()
            flat, g = p.data.view(-1), g.reshape(-1).float()
            if "m" in st:
                m, v = st["m"], st["v"]
            else:
                m = (smap[st["cm"]].view(-1) * self._blocks(torch.ones(n, device=DEVICE), n)
                     .mul(st["am"][:, None]).view(-1)[:n])
                v = umap[st["cv"]] * st["av"].repeat_interleave(256)[:n]
            ok = torch.isfinite(g)
            m = torch.where(ok, m * b1 + (1 - b1) * g, 0.0)
            v = torch.where(ok, v * b2 + (1 - b2) * g * g, 0.0)
            new = (flat + (-self.lr * bc2 / bc1) * (m / (v.sqrt() + bc2 * self.eps))) * (1 - self.lr * self.wd)
            flat.copy_(torch.where(ok, new, flat))
            if "m" in st:
                st["m"], st["v"] = m, v
                continue
            am = self._blocks(m.abs(), n).amax(1)
            av = self._blocks(v, n).amax(1)
            st["am"], st["av"] = am, av
            xm = torch.where(am.repeat_interleave(256)[:n] > 0, m / am.repeat_interleave(256)[:n], 0.0)
            cm = self._nearest(smap, xm)
            neg = smap[cm] < 0
            st["cm"] = torch.where((m < 0) & ~neg, cm - 1, torch.where((m > 0) & neg, cm + 1, cm))
            st["cv"] = self._nearest(umap, torch.where(av.repeat_interleave(256)[:n] > 0,
                                                       v / av.repeat_interleave(256)[:n], 0.0))


def test_adamw8bit_matches_bitsandbytes_blockwise_update():
    # (3, 5) keeps fp32 moments (< 4096 elements); 4500 and 21000 elements are quantized, over two
    # and three work items, each with a partial last 256-block
    fp, tp = _params([(3, 5), (4500,), (3, 7000)])
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    fo, ref = optim.AdamW8bit(fp, **kw), _ReferenceAdamW8bit(tp, **kw)
    for i in range(5):
        gs = _grads(tp)
        if i == 2:
            gs[2][1, 5] = float("nan")  # resets that element's moments, leaves its parameter
            before = [p.to_torch().clone() for p in fp]
            fo.step(_grad_map(fp, gs), found_inf=_flag(1))
            assert all(torch.equal(p.to_torch(), b) for p, b in zip(fp, before))
        fo.step(_grad_map(fp, [g * 8.0 for g in gs]), grad_scale=flame.tensor([1.0 / 8.0]))
        ref.step(gs)
    _assert_params(fp, tp, rtol=1e-5, atol=1e-6)
    state = fo.state_dict()["state"]
    assert state[0]["state1"].dtype == torch.float32 and "absmax1" not in state[0]
    for i in (1, 2):
        st, want = state[i], ref.state[i]
        assert st["state1"].dtype == torch.uint8 and st["step"] == 5
        torch.testing.assert_close(st["absmax1"].to_torch(), want["am"], rtol=1e-5, atol=0)
        torch.testing.assert_close(st["absmax2"].to_torch(), want["av"], rtol=1e-5, atol=0)
        for got, ref_codes in ((st["state1"], want["cm"]), (st["state2"], want["cv"])):
            differ = (got.to_torch().reshape(-1).long() - ref_codes).abs()
            assert differ.max() <= 1 and (differ > 0).float().mean() < 1e-3  # rounding at code midpoints


def test_adamw8bit_tracks_adamw_and_resumes_from_its_state():
    fp, tp = _params([(64, 96)])
    f8 = [flame.from_torch(p.detach().clone(), requires_grad=True) for p in tp]
    o32, o8 = optim.AdamW(fp, lr=1e-2, weight_decay=0.0), optim.AdamW8bit(f8, lr=1e-2, weight_decay=0.0)
    start = tp[0].detach().clone()
    grads = [_grads(tp) for _ in range(8)]
    for gs in grads[:4]:
        o32.step(_grad_map(fp, gs))
        o8.step(_grad_map(f8, gs))
    saved = o8.state_dict()
    resumed_ps = [flame.from_torch(f8[0].to_torch().clone(), requires_grad=True)]
    resumed = optim.AdamW8bit(resumed_ps, lr=1e-2, weight_decay=0.0)
    resumed.load_state_dict(saved)
    for gs in grads[4:]:
        o32.step(_grad_map(fp, gs))
        o8.step(_grad_map(f8, gs))
        resumed.step(_grad_map(resumed_ps, gs))
    assert torch.equal(resumed_ps[0].to_torch(), f8[0].to_torch())
    moved = (fp[0].to_torch() - start).abs().mean()
    assert (f8[0].to_torch() - fp[0].to_torch()).abs().mean() < 0.02 * moved  # 8-bit moments, same path
    bad = {**saved, "state": {0: {**saved["state"][0], "state1": flame.zeros(64, 96)}}}
    with pytest.raises(TypeError, match=r"state1.*expected torch\.uint8"):
        resumed.load_state_dict(bad)


PRODIGY_CONFIGS = [
    dict(weight_decay=0.01),
    dict(d0=1e-3, betas=(0.9, 0.99), use_bias_correction=True, growth_rate=1.5, weight_decay=0.1, decouple=False),
    dict(d0=1e-2, betas=(0.0, 0.999), safeguard_warmup=True, d_coef=0.5, lr=0.5),
]


@pytest.mark.parametrize("kw", PRODIGY_CONFIGS, ids=range(len(PRODIGY_CONFIGS)))
def test_prodigy_matches_prodigyopt(kw):
    prodigyopt = pytest.importorskip("prodigyopt")
    fp, tp = _params([(3, 5), (4500,), (17,)])
    with torch.no_grad():
        tp[2].zero_()  # a zero tensor (LoRA's B): prodigyopt keeps p0 as a scalar 0 then
        fp[2].to_torch().zero_()
    fo, to = optim.Prodigy(fp, **kw), prodigyopt.Prodigy(tp, **kw)
    for i in range(8):
        gs = _grads(tp)
        if i == 3:
            before = [p.to_torch().clone() for p in fp]
            fo.step(_grad_map(fp, gs), found_inf=_flag(1))
            assert all(torch.equal(p.to_torch(), b) for p, b in zip(fp, before))
        fo.step(_grad_map(fp, [g * 4.0 for g in gs]), grad_scale=flame.tensor([0.25]))
        _torch_step(to, tp, gs)
    group = fo.state_dict()["param_groups"][0]
    for name in ("d", "d_max", "d_numerator", "k"):
        assert group[name] == pytest.approx(to.param_groups[0][name], rel=1e-5), name
    # lr 0.5 (config 2) magnifies the rounding of d's sums over 4,500 products, taken in another order
    # than prodigyopt's on a GPU, to a few 1e-6 after 8 steps
    _assert_params(fp, tp, rtol=1e-5, atol=1e-5)


def test_prodigy_resumes_and_refuses_groups_with_different_lrs():
    fp, tp = _params([(3, 5), (17,)])
    grads = [_grads(tp)] * 6  # one direction throughout: the parameters move along it and D grows
    whole = optim.Prodigy(fp, d0=1e-3, weight_decay=0.01)
    for gs in grads[:3]:
        whole.step(_grad_map(fp, gs))
    copies = [flame.from_torch(p.to_torch().clone(), requires_grad=True) for p in fp]
    resumed = optim.Prodigy(copies, d0=1e-3, weight_decay=0.01)
    resumed.load_state_dict(whole.state_dict())
    for gs in grads[3:]:
        whole.step(_grad_map(fp, gs))
        resumed.step(_grad_map(copies, gs))
    assert all(torch.equal(a.to_torch(), b.to_torch()) for a, b in zip(fp, copies))
    assert resumed.state_dict()["param_groups"][0]["d"] == whole.state_dict()["param_groups"][0]["d"] > 1e-3
    split = optim.Prodigy([{"params": [copies[0]]}, {"params": [copies[1]], "lr": 0.5}])
    with pytest.raises(ValueError, match="different learning rates"):
        split.step(_grad_map(copies, grads[0]))


# ---- stochastic rounding (bf16 parameters trained without fp32 master weights) --------------------

def _bf16_neighbours(exact):
    """The bf16 values either side of fp32 ``exact`` (as fp32): towards zero and away from it (both
    ``exact`` when it is a bf16 value)."""
    bits = exact.contiguous().view(torch.int32)
    down = bits & ~0xFFFF
    up = torch.where(bits == down, down, down + 0x10000)
    return down.view(torch.float32), up.view(torch.float32)


def assert_stochastically_rounded(got, exact):
    """Every element of bf16 ``got`` is one of the two bf16 neighbours of its fp32 ``exact`` value;
    elements whose exact value lies strictly between them are rounded without bias: the mean of
    (got - exact) / ulp is 0 within 6 standard deviations (each term has variance f (1 - f) <= 1/4,
    f the exact value's fraction of the way). Returns the fraction rounded away from zero."""
    got, exact = got.float().reshape(-1).cpu(), exact.float().reshape(-1).cpu()
    down, up = _bf16_neighbours(exact)
    assert ((got == down) | (got == up)).all()
    between = up != down
    ulps = ((got - exact) / (up - down))[between].double()
    assert ulps.abs().mean() > 0 and ulps.mean().abs() <= 6 * 0.5 / ulps.numel() ** 0.5, ulps.mean()
    return (got == up)[between].float().mean().item()


def _twins(shapes, seed=12345):  # not the tests' torch seed: values independent of gradients
    """bf16 parameters and fp32 copies of their values (the exact fp32 update's reference)."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen).to(torch.bfloat16).to(DEVICE) for s in shapes]
    return ([flame.from_torch(v.clone(), requires_grad=True) for v in values],
            [flame.from_torch(v.float(), requires_grad=True) for v in values])


SR_CONFIGS = [
    ("AdamW", dict(lr=1e-3, weight_decay=0.1)),
    ("AdamW8bit", dict(lr=1e-3)),  # (4500,): 8-bit moments; the small ones: fp32 moments
    ("SGD", dict(lr=1e-3, momentum=0.9)),
    ("Lion", dict(lr=1e-4, weight_decay=0.1)),
    ("Prodigy", dict(d0=1e-4)),
]
SR_SHAPES = [(3, 5), (17,), (4500,)]


@pytest.mark.parametrize("name,kw", SR_CONFIGS, ids=[n for n, _ in SR_CONFIGS])
def test_stochastic_rounding_lands_on_a_neighbour_of_the_fp32_update_without_bias(name, kw):
    # the same optimizer on fp32 copies of the bf16 values computes the exact update (the kernels'
    # fp32 math is the same): after a step every bf16 element is one of its two neighbours, without
    # bias, and some nearer the neighbour towards zero round away from zero and the other way round
    # (rounding to nearest never would)
    bf, f32 = _twins(SR_SHAPES)
    ob = getattr(optim, name)(bf, stochastic_rounding=True, **kw)
    of = getattr(optim, name)(f32, **kw)
    gs = [torch.randn(p.shape, device=DEVICE) for p in bf]
    for _ in range(2):  # the second step from the rounded values: the fp32 twins re-synchronised
        ob.step(_grad_map(bf, gs))
        of.step(_grad_map(f32, gs))
        got = torch.cat([p.to_torch().reshape(-1) for p in bf])
        exact = torch.cat([p.to_torch().reshape(-1) for p in f32])
        assert_stochastically_rounded(got, exact)
        down, up = _bf16_neighbours(exact.cpu())
        away = (exact.cpu() - down).abs() / (up - down).abs()
        rounded_away = got.cpu().float() == up
        assert rounded_away[(away > 0) & (away < 0.5)].any() and not rounded_away[away > 0.5].all()
        for b, f in zip(bf, f32):
            f.to_torch().copy_(b.to_torch().float())
    assert all(p.dtype == torch.bfloat16 for p in bf)


ADAFACTOR_CONSTANT_LR = dict(lr=1e-3, relative_step=False, scale_parameter=False)  # constant g: u = lr g / |g|


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-3, weight_decay=0.0)), ("SGD", dict(lr=1e-3)),
                                     ("Adafactor", ADAFACTOR_CONSTANT_LR)])
def test_stochastic_rounding_moves_weights_that_round_to_nearest_leaves_stuck(name, kw):
    # p = 1 under a constant update of 1e-3 upwards, below half a bf16 ulp (2^-8 above 1): rounded to
    # nearest (or towards zero, the interpreter's cast) the weights never move; rounded stochastically
    # each step is unbiased, so the mean after K steps is 1 + K * 1e-3, within 6 standard deviations
    # of the mean of N elements (each step adds variance <= ulp^2 / 4 to an element)
    n, steps, ulp = 4096, 12, 2.0 ** -7
    runs = {}
    for sr in (False, True):
        p = flame.from_torch(torch.ones(n, dtype=torch.bfloat16, device=DEVICE), requires_grad=True)
        opt = getattr(optim, name)([p], stochastic_rounding=sr, **kw)
        grads = _grad_map([p], [torch.full((n,), -1.0, device=DEVICE)])
        for _ in range(steps):
            opt.step(grads)
        runs[sr] = p.to_torch().float()
    assert torch.equal(runs[False], torch.ones(n, device=DEVICE))
    bound = 6 * ulp * (steps / 4 / n) ** 0.5
    assert abs(runs[True].mean().item() - (1.0 + steps * 1e-3)) < bound
    assert set(runs[True].unique().tolist()) <= {1.0 + k * ulp for k in range(steps + 1)}


def test_stochastic_rounding_bits_follow_seed_and_step():
    # SGD's update does not depend on the step counter, and zero-gradient steps leave bf16 values
    # exactly where they are: the same step from the same values rounds alike for the same seed and
    # step, differently for another step or seed
    def one_step(seed, idle_steps):
        ps, _ = _twins([(300,)], seed=1)
        opt = optim.SGD(ps, lr=1e-3, stochastic_rounding=True, rounding_seed=seed)
        for _ in range(idle_steps):
            opt.step(_grad_map(ps, [torch.zeros(300, device=DEVICE)]))
        start = ps[0].to_torch().clone()
        opt.step(_grad_map(ps, [torch.linspace(-3, 3, 300, device=DEVICE)]))
        return start, ps[0].to_torch()

    start, a = one_step(7, 0)
    again, b = one_step(7, 0)
    assert torch.equal(start, again) and torch.equal(a, b)
    _, later = one_step(7, 3)
    _, other_seed = one_step(8, 0)
    assert not torch.equal(a, later) and not torch.equal(a, other_seed)


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-3)), ("AdamW8bit", dict(lr=1e-3)),
                                     ("Adafactor", dict(beta1=0.9))])
def test_stochastic_rounding_resume_equals_the_uninterrupted_run(name, kw):
    # the seed is a group entry and the rounding bits a function of the step counters: a fresh
    # optimizer built under another flame seed continues bit for bit once the state dict is loaded
    bf, _ = _twins([(4500,), (3, 5)])
    whole = getattr(optim, name)(bf, stochastic_rounding=True, **kw)
    grads = [[torch.randn(p.shape, device=DEVICE) for p in bf] for _ in range(4)]
    for gs in grads[:2]:
        whole.step(_grad_map(bf, gs))
    saved = whole.state_dict()
    assert saved["param_groups"][0]["stochastic_rounding"] is True
    flame.manual_seed(1234)
    copies = [flame.from_torch(p.to_torch().clone(), requires_grad=True) for p in bf]
    resumed = getattr(optim, name)(copies, stochastic_rounding=True, **kw)
    assert resumed.param_groups[0]["rounding_seed"] != saved["param_groups"][0]["rounding_seed"]
    resumed.load_state_dict(saved)
    for gs in grads[2:]:
        whole.step(_grad_map(bf, gs))
        resumed.step(_grad_map(copies, gs))
    assert all(torch.equal(a.to_torch(), b.to_torch()) for a, b in zip(bf, copies))


OFF_CONFIGS = SR_CONFIGS[:4] + [("Adafactor", dict(beta1=0.9, weight_decay=0.1))]


@pytest.mark.parametrize("name,kw", OFF_CONFIGS, ids=[n for n, _ in OFF_CONFIGS])
def test_stochastic_rounding_off_or_on_fp32_params_changes_nothing(name, kw):
    # fp32 parameters: stochastic_rounding on is bit-identical to off; bf16 parameters with it off:
    # the fp32 update cast once by flame's own cast (to nearest on a GPU, as every flame cast)
    bf, f32 = _twins(SR_SHAPES)
    f32_on = [flame.from_torch(p.to_torch().clone(), requires_grad=True) for p in f32]
    opts = [getattr(optim, name)(ps, stochastic_rounding=sr, **kw) for ps, sr in ((bf, False), (f32, False),
                                                                                    (f32_on, True))]
    gs = [torch.randn(p.shape, device=DEVICE) for p in bf]
    for ps, opt in zip((bf, f32, f32_on), opts):
        opt.step(_grad_map(ps, gs))
    for b, f, on in zip(bf, f32, f32_on):
        assert torch.equal(on.to_torch(), f.to_torch())
        assert torch.equal(b.to_torch(), f.to(torch.bfloat16).to_torch())


def test_stochastic_rounding_refuses_fp16_and_bad_settings():
    bf, f32 = _twins([(3, 5)])
    half = [flame.from_torch(torch.randn(4, device=DEVICE).half(), requires_grad=True)]
    for name in ("AdamW", "AdamW8bit", "SGD", "Lion", "Prodigy", "Adafactor"):
        with pytest.raises(ValueError, match=r"stochastic_rounding rounds fp32 updates to bf16.*float16"):
            getattr(optim, name)(half, stochastic_rounding=True)
    optim.AdamW(half)  # off: fp16 parameters as before
    opt = optim.AdamW(bf + f32, stochastic_rounding=True)  # fp32 ones in an SR group: rounded as before
    with pytest.raises(ValueError, match="float16"):
        opt.add_param_group(dict(params=half))
    opt.add_param_group(dict(params=half, stochastic_rounding=False))
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        optim.AdamW(bf, stochastic_rounding="yes")
    for seed in (-1, 2 ** 63, 1.5):
        with pytest.raises(ValueError, match="rounding_seed"):
            optim.AdamW(bf, stochastic_rounding=True, rounding_seed=seed)
    saved = optim.AdamW(half).state_dict()
    saved["param_groups"][0]["stochastic_rounding"] = True
    with pytest.raises(ValueError, match="float16"):
        optim.AdamW(half).load_state_dict(saved)


def _captured_steps(opt, params, grads, calls):
    """``calls`` optimizer steps as a CapturedStep (eager, captured, replayed on a GPU; under the graph
    rules from the second call on the interpreter), each with the next of ``grads`` (one tensor per
    step, for ``params[0]``) copied into one gradient buffer as a captured backward leaves it."""
    buf = torch.zeros_like(grads[0])
    gm = _grad_map(params, [buf])
    gm[params[0]] = flame.from_torch(buf)
    step = CapturedStep(lambda: opt.step(gm))
    for g in grads[:calls]:
        buf.copy_(g)
        step()


def test_stochastic_rounding_step_keeps_the_cuda_graph_rules():
    # a captured step may draw nothing on the host, and the captured updates equal eager ones
    bf, _ = _twins([(300,)])
    eager = [flame.from_torch(p.to_torch().clone(), requires_grad=True) for p in bf]
    grads = [torch.randn(300, device=DEVICE) for _ in range(3)]
    _captured_steps(optim.AdamW(bf, lr=1e-3, stochastic_rounding=True), bf, grads, 3)
    eager_opt = optim.AdamW(eager, lr=1e-3, stochastic_rounding=True)
    for g in grads:
        eager_opt.step(_grad_map(eager, [g]))
    assert torch.equal(bf[0].to_torch(), eager[0].to_torch())


@pytest.mark.gpu
def test_stochastic_rounding_on_the_gpu_bf16_sdxl_sized_tensor():
    # a 2.6M-element bf16 weight (an SDXL attention projection's size x 2): neighbours and no bias
    # after AdamW steps, constant tiny updates progress while rounding to nearest stalls, and
    # captured (CUDA-graph) steps equal eager ones bit for bit
    shape = (1280, 2048)
    bf, f32 = _twins([shape])
    ob, of = (optim.AdamW(ps, lr=1e-4, stochastic_rounding=sr) for ps, sr in ((bf, True), (f32, False)))
    for _ in range(3):
        gs = [torch.randn(shape, device=DEVICE)]
        ob.step(_grad_map(bf, gs))
        of.step(_grad_map(f32, gs))
        assert_stochastically_rounded(bf[0].to_torch(), f32[0].to_torch())
        f32[0].to_torch().copy_(bf[0].to_torch().float())
    ones = [flame.from_torch(torch.ones(shape, dtype=torch.bfloat16, device=DEVICE), requires_grad=True)
            for _ in range(3)]
    opts = [optim.AdamW([p], lr=1e-3, weight_decay=0.0, stochastic_rounding=sr)
            for p, sr in zip(ones, (False, True, True))]
    g = torch.full(shape, -1.0, device=DEVICE)
    for _ in range(10):
        opts[0].step(_grad_map(ones[:1], [g]))
        opts[1].step(_grad_map(ones[1:2], [g]))
    _captured_steps(opts[2], ones[2:], [g] * 10, 10)
    assert torch.equal(ones[0].to_torch(), torch.ones_like(ones[0].to_torch()))
    assert abs(ones[1].to_torch().float().mean().item() - 1.01) < 1e-4
    assert torch.equal(ones[1].to_torch(), ones[2].to_torch())
