"""flame.optim.Adafactor against transformers' Adafactor (the reference semantics)."""
import pytest
import torch
from test_optim import _assert_params, _bf16_neighbours, _flag, _grad_map, _torch_step, assert_stochastically_rounded

import flame
from flame import optim
from flame.kernels import adafactor as KA
from flame.kernels import launch as L
from helpers import DEVICE


def Reference(params, **kw):
    """transformers' Adafactor, imported on first use (its module imports transformers' trainer
    utilities: seconds of every test worker's collection)."""
    from transformers.optimization import Adafactor
    return Adafactor(params, **kw)

_CL = torch.channels_last
# 1-D, 2-D (LoRA's A and B), 3-D, a channels-last conv weight (LoCon's (r, in, kh, kw) A), a
# transposed matrix, LoCon's channels-last (out, r, 1, 1) B
SPECS = [((7,), None), ((3, 5), None), ((2, 3, 4), None), ((4, 3, 3, 2), _CL), ((5, 3), "t"), ((4, 2, 1, 1), _CL)]


def _laid_out(t, layout):
    if layout == "t":
        return t.t().contiguous().t()
    return t.contiguous(memory_format=layout) if layout is not None else t


def _params(specs=SPECS, dtype=torch.float32):
    ts = [_laid_out(torch.randn(s, dtype=torch.float64).to(dtype).to(DEVICE), lay) for s, lay in specs]
    torch_ps = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in ts]
    flame_ps = [flame.from_torch(t.clone(memory_format=torch.preserve_format), requires_grad=True) for t in ts]
    return flame_ps, torch_ps


def _grads(ps, dtype=torch.float32):
    """Gradients laid out like their parameters, as backward() returns them."""
    return [torch.empty_like(p, dtype=dtype).copy_(torch.randn(p.shape, dtype=torch.float64)) for p in ps]


def _assert_state(fo, fp, to, tp, **tol):
    steps = fo._steps.cpu()
    for f, p in zip(fp, tp):
        want, got = to.state[p], fo.state[f.id]
        assert set(got) | {"step"} == set(want), (set(got), set(want))
        assert steps[fo._slots[f.id]] == want["step"]
        for name, value in got.items():
            assert value.shape == want[name].shape, name
            torch.testing.assert_close(value, want[name].to(value.device), **tol)


CONFIGS = [
    dict(),  # relative step scaled by the parameter's RMS
    dict(warmup_init=True, beta1=0.9, weight_decay=0.02),
    dict(lr=1e-2, relative_step=False, scale_parameter=False, weight_decay=0.1, decay_rate=-0.6),
    dict(lr=3e-2, relative_step=False, beta1=0.8, clip_threshold=0.5, eps=(1e-20, 1e-2)),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=range(len(CONFIGS)))
def test_matches_transformers_five_steps(kw):
    fp, tp = _params()
    fo, to = optim.Adafactor(fp, **kw), Reference(tp, **kw)
    for _ in range(5):
        gs = _grads(tp)
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)
    _assert_state(fo, fp, to, tp, rtol=1e-5, atol=1e-7)
    for p in fp:  # the full-size state keeps the parameter's layout
        for name in ("exp_avg", "exp_avg_sq"):
            if name in fo.state[p.id]:
                assert fo.state[p.id][name].stride() == p.stride()


def test_found_inf_skips_and_grad_scale_unscales():
    fp, tp = _params(SPECS[:4])
    kw = dict(beta1=0.9, weight_decay=0.1)
    fo, to = optim.Adafactor(fp, **kw), Reference(tp, **kw)
    scale = 512.0
    for i in range(4):
        gs = _grads(tp)
        if i == 2:  # flagged: no state, parameter or step counter changes (the relative step stays put)
            fo.step(_grad_map(fp, [g * float("inf") for g in gs]), found_inf=_flag(1),
                    grad_scale=flame.tensor([1.0 / scale]))
            continue
        fo.step(_grad_map(fp, [g * scale for g in gs]), found_inf=_flag(0), grad_scale=flame.tensor([1.0 / scale]))
        _torch_step(to, tp, gs)
    _assert_params(fp, tp)
    _assert_state(fo, fp, to, tp, rtol=1e-5, atol=1e-7)
    assert fo.state_dict()["state"][0]["step"] == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_parameters_fp32_math(dtype):
    """fp16/bf16 parameters with gradients in their dtype or fp32 (holding the same values): each
    step is transformers' fp32 update of the stored value, rounded once to the parameter dtype
    (within an ulp: the interpreter rounds to bf16 towards zero). transformers is re-synchronised
    to flame's rounded values after every step, so that roundings do not compound."""
    fp, tp = _params(SPECS[:4], dtype)
    kw = dict(beta1=0.9, weight_decay=0.1)
    fo, to = optim.Adafactor(fp, **kw), Reference(tp, **kw)
    eps = torch.finfo(dtype).eps
    for _ in range(3):
        gs = _grads(tp, dtype)
        fo.step(_grad_map(fp, [g.float() if i % 2 else g for i, g in enumerate(gs)]))
        _torch_step(to, tp, gs)
        for f, t in zip(fp, tp):
            assert f.dtype == dtype
            got, want = f.to_torch().float(), t.detach().float()
            assert ((got - want).abs() <= want.abs() * eps + 1e-6).all()
            with torch.no_grad():
                t.copy_(f.to_torch())
    _assert_state(fo, fp, to, tp, rtol=1e-4, atol=1e-6)


def test_state_dict_round_trip_continues_identically():
    fp, tp = _params(SPECS[:4])
    kw = dict(beta1=0.9, weight_decay=0.1)
    fo, to = optim.Adafactor(fp, **kw), Reference(tp, **kw)
    all_grads = [_grads(tp) for _ in range(4)]
    for gs in all_grads[:2]:
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    sd = fo.state_dict()

    def fresh():
        return [flame.from_torch(p.to_torch().clone(memory_format=torch.preserve_format), requires_grad=True)
                for p in fp]
    fp2, fp3 = fresh(), fresh()
    fo2, fo3 = optim.Adafactor(fp2, **kw), optim.Adafactor(fp3, **kw)
    fo2.load_state_dict(sd)
    fo3.load_state_dict(to.state_dict())  # transformers' own state dict: same names and shapes
    for gs in all_grads[2:]:
        for ps, opt in ((fp, fo), (fp2, fo2), (fp3, fo3)):
            opt.step(_grad_map(ps, gs))
        _torch_step(to, tp, gs)
    for a, b in zip(fp, fp2):
        assert torch.equal(a.to_torch(), b.to_torch())
    _assert_params(fp3, tp)
    _assert_params(fp2, tp)
    bad = dict(sd, state={0: {k: v for k, v in sd["state"][0].items() if k != "RMS"}})
    with pytest.raises(KeyError, match="RMS"):
        optim.Adafactor(fresh(), **kw).load_state_dict(bad)


def test_bad_arguments_raise_as_transformers():
    fp, tp = _params(SPECS[:2])
    for kw in (dict(lr=1e-3), dict(warmup_init=True, relative_step=False, lr=1e-3)):
        with pytest.raises(ValueError) as want:
            Reference(tp, **kw)
        with pytest.raises(ValueError) as got:
            optim.Adafactor(fp, **kw)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="external `lr`"):
        optim.Adafactor(fp, relative_step=False)
    # five dims whose three leading dims don't merge: no (d0, d1) view for the factored kernels
    odd = torch.randn(2, 3, 4, 5, 6, device=DEVICE).permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    with pytest.raises(ValueError, match="leading dims"):
        optim.Adafactor([flame.from_torch(odd, requires_grad=True)])


def test_launches_per_step_and_several_blocks_per_work_item(monkeypatch):
    """Five launches per step however many tensors; the GPU's sizes (several blocks per work item,
    lines longer than a tile, many small matrices per item) give transformers' result too."""
    monkeypatch.setattr(KA, "_sizes", lambda: (256, 1024))
    specs = [((2500,), None), ((3, 700), None), ((700, 3), "t"), ((9, 40, 3, 3), _CL)]
    fp, tp = _params(specs)
    fo, to = optim.Adafactor(fp, beta1=0.9), Reference(tp, beta1=0.9)
    for _ in range(2):  # the first step also zero-fills the state
        gs = _grads(tp)
        before = L.launches
        fo.step(_grad_map(fp, gs))
        _torch_step(to, tp, gs)
    assert L.launches - before == 5
    _assert_params(fp, tp)
    _assert_state(fo, fp, to, tp, rtol=1e-5, atol=1e-7)


def test_stochastic_rounding_of_bf16_parameters_in_every_layout():
    """bf16 parameters with stochastic_rounding: after each step every element is one of the two
    bf16 neighbours of the fp32 update (the same Adafactor on fp32 copies of the values, re-synchronised
    after each step), without bias, in factored, flat, channels-last and transposed layouts; a
    found_inf step leaves them and the rounding stream as they were."""
    specs = SPECS + [((64, 70), None)]
    fp, _ = _params(specs, torch.bfloat16)
    f32 = [flame.from_torch(p.to_torch().float(), requires_grad=True) for p in fp]
    kw = dict(beta1=0.9, weight_decay=0.1)
    ob, of = optim.Adafactor(fp, stochastic_rounding=True, **kw), optim.Adafactor(f32, **kw)
    for i in range(3):
        gs = _grads([p.to_torch() for p in fp])  # fp32, in the parameters' layouts
        if i == 1:
            before = [p.to_torch().clone() for p in fp]
            ob.step(_grad_map(fp, gs), found_inf=_flag(1))
            assert all(torch.equal(p.to_torch(), b) for p, b in zip(fp, before))
        ob.step(_grad_map(fp, gs))
        of.step(_grad_map(f32, gs))
        for b, f in zip(fp, f32):
            assert b.dtype == torch.bfloat16 and b.stride() == f.stride()
        got = torch.cat([p.to_torch().reshape(-1) for p in fp])
        exact = torch.cat([p.to_torch().reshape(-1) for p in f32])
        assert 0.2 < assert_stochastically_rounded(got, exact) < 0.8
        down, up = _bf16_neighbours(exact.cpu())
        assert not torch.equal(got.cpu().float(), torch.where((exact.cpu() - down).abs() * 2 > (up - down).abs(),
                                                              up, down))  # not rounded to nearest
        for b, f in zip(fp, f32):
            f.to_torch().copy_(b.to_torch())
