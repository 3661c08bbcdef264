"""Modules against torch.nn: same weights through state_dict -> same outputs and gradients."""
from collections import OrderedDict

import numpy as np
import pytest
import torch

import flame
from flame import nn
from helpers import DEVICE, TF32_TOL, assert_close, pair


def _load(fm, tm):
    fm.load_state_dict(tm.state_dict())
    return fm


def _check_module(fm, tm, shape, rtol=None, atol=None):
    """Forward and backward of ``fm`` and ``tm`` (same weights) on the same input: outputs, input
    gradients and every parameter's gradient (by name) agree."""
    if rtol is None and TF32_TOL:
        rtol, atol = TF32_TOL["rtol"], TF32_TOL["atol"]
    tm.zero_grad()
    x, xt = pair(shape, requires_grad=True)
    y, yt = fm(x), tm(xt)
    assert_close(y, yt, rtol=rtol, atol=atol)
    w, wt = pair(tuple(yt.shape))
    grads = (y * w).sum().backward()
    (yt * wt).sum().backward()
    assert_close(grads[x], xt.grad, rtol=rtol, atol=atol)
    tparams = dict(tm.named_parameters())
    names = [n for n, _ in fm.named_parameters()]
    assert names == list(tparams)
    for name, p in fm.named_parameters():
        assert_close(grads[p], tparams[name].grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(bias):
    tm = torch.nn.Linear(13, 7, bias=bias).to(DEVICE)
    fm = _load(nn.Linear(13, 7, bias=bias), tm)
    assert fm.bias is None if not bias else fm.bias.shape == (7,)
    _check_module(fm, tm, (2, 3, 13))
    _check_module(fm, tm, (13,))


def test_packed_linears_run_as_one_gemm_at_inference():
    """``pack_linears`` puts the layers' weights (and biases) in one buffer, values and state dict
    unchanged; ``linears`` then runs them as one GEMM under no_grad (each output a view of its
    columns), and each layer's own forward where a gradient is needed or the packing is gone."""
    import flame.kernels.launch as L
    layers = [nn.Linear(16, n) for n in (8, 8, 4)]
    x = flame.randn(3, 5, 16)
    with flame.no_grad():
        want = [m(x).to_torch().clone() for m in layers]
    before = [{k: v.to_torch().clone() for k, v in m.state_dict().items()} for m in layers]
    assert nn.pack_linears(layers)
    assert all(torch.equal(b[k], v.to_torch()) for m, b in zip(layers, before) for k, v in m.state_dict().items())
    with flame.no_grad():
        L.launches = 0
        got = nn.linears(x, layers)
        assert L.launches == 1
    for g, w in zip(got, want):
        assert_close(g, w, **TF32_TOL)
    xg = x.detach().requires_grad_()
    outs = nn.linears(xg, layers)  # training: each layer's own GEMM, gradients to each parameter
    grads = sum(o.sum() for o in outs).backward()
    assert all(m.weight in grads and m.bias in grads for m in layers)
    layers[1].weight = nn.Parameter(flame.zeros(8, 16))  # replaced: no longer one buffer
    with flame.no_grad():
        L.launches = 0
        got = nn.linears(x, layers)
        assert L.launches == 3
    assert_close(got[1], layers[1].bias.to_torch().expand(3, 5, 8), **TF32_TOL)
    packed = [nn.Linear(16, 8), nn.Linear(16, 8)]
    assert nn.pack_linears(packed)
    with flame.no_grad():
        nn.linears(x, packed)
        for m in packed:
            m.to(flame.float64)  # the Parameter objects stay; their buffers are new, no longer one
        got = nn.linears(x.to(flame.float64), packed)
    assert got[0].dtype == torch.float64 and "_packed" in vars(packed[0])
    assert_close(got[1], packed[1](x.to(flame.float64)), **TF32_TOL)
    assert not nn.pack_linears([nn.Linear(16, 4), nn.Linear(8, 4)])  # input widths differ
    assert not nn.pack_linears([nn.Linear(16, 4), nn.LoRALinear(nn.Linear(16, 4), rank=2)])


@pytest.mark.parametrize("kw", [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1, bias=False),
                                dict(kernel_size=1), dict(kernel_size=(3, 1), padding="same", groups=2)])
def test_conv2d_matches_torch(kw):
    tm = torch.nn.Conv2d(4, 6, **kw).to(DEVICE)
    fm = _load(nn.Conv2d(4, 6, **kw), tm)
    assert [n for n, _ in fm.named_parameters()] == [n for n, _ in tm.named_parameters()]
    _check_module(fm, tm, (2, 4, 7, 5))


def test_conv2d_weight_is_channels_last_through_load_and_cast():
    tm = torch.nn.Conv2d(4, 6, 3, padding=1).to(DEVICE)
    fm = _load(nn.Conv2d(4, 6, 3, padding=1), tm)
    assert fm.weight._data.stride() == (36, 1, 12, 4)  # (out, kh, kw, in) in memory
    assert_close(fm.weight, tm.weight, rtol=0, atol=0)
    fm.to(flame.float16)
    assert fm.weight.dtype == flame.float16 and fm.weight._data.stride() == (36, 1, 12, 4)
    assert_close(fm.weight, tm.weight.half(), rtol=0, atol=0)


def test_conv2d_init_and_errors():
    fm = nn.Conv2d(8, 16, 3)
    bound = 1 / np.sqrt(8 * 9)
    assert np.abs(fm.weight.numpy()).max() <= bound and np.abs(fm.bias.numpy()).max() <= bound
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.Conv2d(6, 4, 3, groups=4)
    with pytest.raises(ValueError, match="padding_mode"):
        nn.Conv2d(4, 4, 3, padding_mode="reflect")


def test_linear_default_init_follows_torch():
    fm = nn.Linear(40, 300)
    bound = 1 / np.sqrt(40)
    w, b = fm.weight.numpy(), fm.bias.numpy()
    assert fm.weight.requires_grad and fm.weight.is_leaf and isinstance(fm.weight, nn.Parameter)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    # uniform(-bound, bound): std bound / sqrt(3)
    assert abs(w.std() - bound / np.sqrt(3)) < 0.05 * bound
    assert abs(w.mean()) < 0.05 * bound
    flame.manual_seed(3)
    a = nn.Linear(4, 5).weight.numpy()
    flame.manual_seed(3)
    assert np.array_equal(a, nn.Linear(4, 5).weight.numpy())


def test_norm_layers_match_torch():
    tm = torch.nn.GroupNorm(4, 8, eps=1e-4).to(DEVICE)
    with torch.no_grad():
        tm.weight.normal_()
        tm.bias.normal_()
    fm = _load(nn.GroupNorm(4, 8, eps=1e-4), tm)
    _check_module(fm, tm, (2, 8, 3, 5))
    tm = torch.nn.LayerNorm((6,)).to(DEVICE)
    with torch.no_grad():
        tm.weight.normal_()
        tm.bias.normal_()
    _check_module(_load(nn.LayerNorm(6), tm), tm, (3, 4, 6))
    tm = torch.nn.LayerNorm(6, elementwise_affine=False).to(DEVICE)
    _check_module(nn.LayerNorm(6, elementwise_affine=False), tm, (5, 6))
    tm = torch.nn.RMSNorm(10, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        tm.weight.normal_()
    _check_module(_load(nn.RMSNorm(10, eps=1e-6), tm), tm, (3, 10))


def test_norm_default_init():
    gn, ln, rms = nn.GroupNorm(2, 6), nn.LayerNorm(5), nn.RMSNorm(5)
    for p in (gn.weight, ln.weight, rms.weight):
        assert np.array_equal(p.numpy(), np.ones(p.shape, np.float32))
    for p in (gn.bias, ln.bias):
        assert np.array_equal(p.numpy(), np.zeros(p.shape, np.float32))
    assert [n for n, _ in nn.GroupNorm(2, 6, affine=False).named_parameters()] == []
    assert [n for n, _ in nn.LayerNorm(5, bias=False).named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match="divisible"):
        nn.GroupNorm(4, 6)


@pytest.mark.parametrize("fm,tm", [(nn.SiLU(), torch.nn.SiLU()), (nn.GELU(), torch.nn.GELU()),
                                   (nn.GELU("tanh"), torch.nn.GELU("tanh")), (nn.Identity(), torch.nn.Identity())],
                         ids=["silu", "gelu", "gelu_tanh", "identity"])
def test_activations_match_torch(fm, tm):
    _check_module(fm, tm, (4, 9))


class _Block(nn.Module):
    def __init__(self, lib, d):
        super().__init__()
        self.norm = lib.LayerNorm(d)
        self.layers = lib.ModuleList([lib.Linear(d, 2 * d), lib.Linear(2 * d, d)])
        self.act = lib.GELU()

    def forward(self, x):
        h = self.act(self.layers[0](self.norm(x)))
        return x + self.layers[1](h)


class _TorchBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)])
        self.act = torch.nn.GELU()

    def forward(self, x):
        h = self.act(self.layers[0](self.norm(x)))
        return x + self.layers[1](h)


def _models(d=5):
    tm = torch.nn.Sequential(OrderedDict(
        proj_in=torch.nn.Linear(3, d), block=_TorchBlock(d),
        out=torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(d, 2))))
    fm = nn.Sequential(OrderedDict(
        proj_in=nn.Linear(3, d), block=_Block(nn, d), out=nn.Sequential(nn.SiLU(), nn.Linear(d, 2))))
    return fm, tm.to(DEVICE)


def test_nested_model_names_outputs_and_gradients():
    fm, tm = _models()
    assert list(fm.state_dict()) == list(tm.state_dict())
    assert [n for n, _ in fm.named_modules()] == [n for n, _ in tm.named_modules()]
    assert len(list(fm.parameters())) == len(list(tm.parameters())) == 10
    assert [n for n, _ in fm.named_children()] == ["proj_in", "block", "out"]
    _load(fm, tm)
    _check_module(fm, tm, (4, 3))


def test_state_dict_round_trip_between_flame_models():
    a, _ = _models()
    b, _ = _models()
    x = flame.randn(2, 3)
    assert not np.array_equal(a(x).numpy(), b(x).numpy())
    b.load_state_dict(a.state_dict())
    assert np.array_equal(a(x).numpy(), b(x).numpy())
    # values were copied: b's parameters are its own
    assert a.proj_in.weight.data_ptr() != b.proj_in.weight.data_ptr()
    # and torch tensors load too (as from a diffusers checkpoint)
    c, _ = _models()
    c.load_state_dict({k: v.to_torch().clone() for k, v in a.state_dict().items()})
    assert np.array_equal(a(x).numpy(), c(x).numpy())


def test_load_state_dict_errors_name_keys_and_shapes():
    fm, tm = _models()
    sd = dict(tm.state_dict())
    del sd["block.norm.bias"]
    sd["extra.weight"] = torch.zeros(2)
    sd["out.1.weight"] = torch.zeros(3, 5)
    with pytest.raises(RuntimeError) as e:
        fm.load_state_dict(sd)
    msg = str(e.value)
    assert 'Missing key(s) in state_dict: "block.norm.bias"' in msg
    assert 'Unexpected key(s) in state_dict: "extra.weight"' in msg
    assert "size mismatch for out.1.weight: copying a param with shape (3, 5) from checkpoint, " \
           "the shape in current model is (2, 5)" in msg
    del sd["out.1.weight"]
    sd["out.1.weight"] = tm.state_dict()["out.1.weight"]
    before = fm.block.norm.bias.numpy()
    missing, unexpected = fm.load_state_dict(sd, strict=False)
    assert missing == ["block.norm.bias"] and unexpected == ["extra.weight"]
    assert np.array_equal(fm.block.norm.bias.numpy(), before)
    assert_close(fm.out[1].weight, tm.out[1].weight.detach())
    sd["out.1.weight"] = torch.zeros(7)
    with pytest.raises(RuntimeError, match=r"size mismatch for out\.1\.weight"):
        fm.load_state_dict(sd, strict=False)


def test_load_state_dict_casts_to_parameter_dtype():
    fm = nn.Linear(3, 2, dtype=flame.float16)
    tm = torch.nn.Linear(3, 2).to(DEVICE)
    fm.load_state_dict(tm.state_dict())
    assert fm.weight.dtype == flame.float16
    assert_close(fm.weight, tm.weight.detach().half())


def test_to_dtype_keeps_parameter_objects():
    fm, _ = _models()
    ids = [p.id for p in fm.parameters()]
    vals = [p.numpy() for p in fm.parameters()]
    fm.to(flame.bfloat16)
    assert all(p.dtype == flame.bfloat16 for p in fm.parameters())
    assert [p.id for p in fm.parameters()] == ids
    fm.to(dtype=flame.float32)
    for p, v in zip(fm.parameters(), vals):
        np.testing.assert_allclose(p.numpy(), v, rtol=1e-2, atol=1e-2)
    with pytest.raises(TypeError):
        fm.to(flame.int32)


def test_train_eval_and_requires_grad():
    fm, _ = _models()
    assert all(m.training for m in fm.modules())
    fm.eval()
    assert not any(m.training for m in fm.modules())
    fm.train()
    assert all(m.training for m in fm.modules())
    fm.proj_in.requires_grad_(False)
    grads = fm(flame.randn(2, 3)).sum().backward()
    assert fm.proj_in.weight not in grads and fm.proj_in.bias not in grads
    assert fm.out[1].weight in grads and len(grads) == 8


def test_parameter_and_registration_rules():
    t = flame.randn(3, 4)
    p = nn.Parameter(t)
    assert isinstance(p, flame.Tensor) and p.requires_grad and p.is_leaf
    assert p.data_ptr() == t.data_ptr() and p.id != t.id
    assert not nn.Parameter(t, requires_grad=False).requires_grad
    with pytest.raises(TypeError):
        nn.Parameter([1.0, 2.0])
    m = nn.Module()
    m.w = p
    m.plain = flame.zeros(2)  # a plain tensor attribute is not a parameter
    m.child = nn.Linear(2, 2)
    m.register_buffer("running", flame.ones(2))
    m.register_buffer("scratch", flame.ones(1), persistent=False)
    assert [n for n, _ in m.named_parameters()] == ["w", "child.weight", "child.bias"]
    assert list(m.state_dict()) == ["w", "running", "child.weight", "child.bias"]
    assert m.w is p and m.running.shape == (2,)
    with pytest.raises(TypeError, match="parameter 'w'"):
        m.w = flame.zeros(3, 4)
    m.w = None
    assert [n for n, _ in m.named_parameters()] == ["child.weight", "child.bias"]
    with pytest.raises(AttributeError, match="nope"):
        _ = m.nope
    shared = nn.Linear(2, 2)
    tied = nn.Sequential(shared, shared)
    assert len(list(tied.parameters())) == 2  # shared parameters are listed once


def test_members_are_instance_attributes_however_the_stores_are_written():
    """A module's stores keep their entries in its instance dict (attribute reads without
    Module.__getattr__): direct store writes, deletes, pops and clears show at once, a deep copy's
    stores mirror into the copy, and a shallow copy shares the original's stores as torch's does."""
    import copy
    m = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    lin = m[0]
    assert "weight" in vars(lin) and lin.weight is lin._parameters["weight"]
    new = nn.Linear(3, 4)
    m._modules["0"] = new  # as inject_lora swaps a layer
    assert getattr(m, "0") is new and m[0] is new
    w = nn.Parameter(flame.zeros(4, 3))
    new._parameters["weight"] = w
    assert new.weight is w
    del m._modules["1"]
    assert not hasattr(m, "1") and len(m) == 1
    assert new._parameters.pop("bias") is not None and not hasattr(new, "bias")
    new._buffers.update(running=flame.ones(2), count=flame.zeros(1))
    assert new._buffers.popitem()[0] == "count" and not hasattr(new, "count") and new.running.shape == (2,)
    new._buffers.clear()
    assert not hasattr(new, "running")
    new.plain = 1
    assert new._modules.pop("plain", None) is None and new.plain == 1  # a plain attribute is no member
    twin = copy.deepcopy(m)
    twin._modules["0"] = nn.Identity()
    assert isinstance(twin[0], nn.Identity) and isinstance(getattr(twin, "0"), nn.Identity)
    assert getattr(m, "0") is new  # the original's stores and attributes untouched
    shallow = copy.copy(new)
    shallow.weight = nn.Parameter(flame.ones(4, 3))
    assert shallow.weight is new.weight is new._parameters["weight"]  # one store, as torch's copy


def test_containers_and_repr():
    seq = nn.Sequential(nn.Linear(2, 3), nn.SiLU())
    seq.append(nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear) and len(seq[:2]) == 2
    ml = nn.ModuleList([nn.Identity()])
    ml.extend([nn.SiLU(), nn.GELU()])
    assert len(ml) == 3 and isinstance(ml[-1], nn.GELU)
    with pytest.raises(IndexError):
        ml[3]
    text = repr(seq)
    assert "(0): Linear(in_features=2, out_features=3, bias=True)" in text and "(1): SiLU()" in text
    with pytest.raises(NotImplementedError):
        nn.Module()(1)


def test_calling_a_module_runs_the_forward_it_has_at_the_call():
    """module(...) is module.forward(...), looked up at each call: positional and keyword arguments
    pass through, and a forward set later on the instance or on the class is the one that runs."""
    class Affine(nn.Module):
        def forward(self, x, scale=1.0, *, shift=0.0):
            return x * scale + shift

    m, other = Affine(), Affine()
    assert m(2.0) == 2.0 and m(2.0, 3.0, shift=1.0) == 7.0 and m.__call__(2.0, scale=2.0) == 4.0
    m.forward = lambda x: -x  # on the instance: this module only
    assert m(2.0) == -2.0 and other(2.0) == 2.0
    Affine.forward = lambda self, x: x + 10.0  # on the class: every instance without its own
    assert other(2.0) == 12.0 and m(2.0) == -2.0
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        other(1.0, bad=1)


# ---- dropout ------------------------------------------------------------------------------------

def test_dropout_mask_scale_and_gradient():
    x = flame.randn(40, 50, requires_grad=True)
    drop = nn.Dropout(0.3)
    flame.manual_seed(7)
    y = drop(x)
    yn, xn = y.numpy(), x.numpy()
    kept = yn != 0
    assert 0.25 < 1 - kept.mean() < 0.35
    np.testing.assert_allclose(yn[kept], xn[kept] / 0.7, rtol=1e-6)
    g = flame.randn(40, 50)
    grads = (y * g).sum().backward()
    np.testing.assert_allclose(grads[x].numpy(), np.where(kept, g.numpy() / 0.7, 0.0), rtol=1e-6)
    # same seed, same mask; another draw, another mask
    flame.manual_seed(7)
    assert np.array_equal(drop(x).numpy(), yn)
    assert not np.array_equal(drop(x).numpy(), yn)


def test_dropout_modes_and_edges():
    x = flame.randn(5, 6)
    drop = nn.Dropout(0.5).eval()
    assert drop(x) is x
    assert nn.Dropout(0.0)(x) is x
    assert not nn.Dropout(1.0)(x).numpy().any()
    xt = flame.randn(6, 5).t()  # non-contiguous input
    y = nn.Dropout(0.5)(xt)
    kept = y.numpy() != 0
    np.testing.assert_allclose(y.numpy()[kept], 2 * xt.numpy()[kept], rtol=1e-6)
    assert nn.Dropout(0.5)(flame.zeros(0, 3)).shape == (0, 3)
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)


# ---- init ---------------------------------------------------------------------------------------

def test_init_functions():
    from flame.nn import init
    w = flame.empty(64, 32, 3, 3)
    fan_in, fan_out = init._calculate_fan_in_and_fan_out(w)
    assert (fan_in, fan_out) == torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(64, 32, 3, 3))
    for nl, param in [("relu", None), ("leaky_relu", 0.2), ("tanh", None), ("linear", None), ("selu", None)]:
        assert init.calculate_gain(nl, param) == torch.nn.init.calculate_gain(nl, param)
    init.kaiming_uniform_(w, a=0.0, nonlinearity="relu")
    bound = np.sqrt(2.0) * np.sqrt(3.0 / fan_in)
    a = w.numpy()
    assert np.abs(a).max() <= bound and abs(a.std() - bound / np.sqrt(3)) < 0.03 * bound
    init.normal_(w, 1.0, 0.5)
    assert abs(w.numpy().mean() - 1.0) < 0.02 and abs(w.numpy().std() - 0.5) < 0.02
    init.kaiming_normal_(w, mode="fan_out", nonlinearity="relu")
    assert abs(w.numpy().std() - np.sqrt(2.0 / fan_out)) < 0.03 * np.sqrt(2.0 / fan_out)
    init.xavier_uniform_(w)
    assert np.abs(w.numpy()).max() <= np.sqrt(6.0 / (fan_in + fan_out))
    init.zeros_(w)
    assert not w.numpy().any()
    init.constant_(w, 2.5)
    assert (w.numpy() == 2.5).all()
    v = flame.zeros(8, 6).t()  # a non-contiguous view is filled through a copy
    init.uniform_(v, -1.0, 1.0)
    assert np.abs(v.numpy()).max() <= 1.0 and v.numpy().std() > 0.2
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.kaiming_uniform_(flame.empty(5))
