"""DoRA (``dora=True``): PEFT's ``use_dora`` semantics for LoRALinear and LoRAConv2d.

- forward and gradients (x, A, B, magnitude) equal PEFT's DoRA layer with the same weights, with
  and without bias, and with PEFT's dropout path (a fixed mask stands in for both sides' dropout);
- merge equals PEFT's merge, unmerge restores W, fold(strength) equals PEFT at scaling
  strength * alpha / rank (what diffusers' ``set_adapters`` weight does);
- files: PEFT keys load into a diffusers UNet (``load_lora_adapter`` and the pipeline's
  ``load_lora_weights`` path) and reproduce flame's DoRA output; kohya ``.dora_scale`` round-trips
  through flame's loader and is what LyCORIS's output-axis formula expects; bad magnitudes are
  refused before anything changes;
- the trainer with ``lora.dora: true`` trains the magnitudes and writes them.
"""
import copy
import json

import pytest
import torch
from test_lora_interop import RTOL, TINY, _inputs, _load_adapter, _load_weights, _rel, _run_diffusers
from test_train import _config, _trainer, cache_dir  # noqa: F401  (cache_dir: the trainer tests' fixture)

import flame
import flame.io
from flame import nn
from flame.nn.lora import LoRAConv2d, LoRALinear, lora_modules
from helpers import DEVICE, TF32_TOL

TOL = TF32_TOL or dict(rtol=1e-5, atol=1e-5)
peft = pytest.importorskip("peft")


class _Holder(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


class _FixedDropout(torch.nn.Module):
    """A dropout whose mask is given (not ``nn.Identity``: PEFT then takes its dropout path)."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask


def _randomize(layer):
    """Non-zero B and a magnitude away from the norms, so c != 1 and every term matters."""
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
    m = layer.lora_magnitude.to_torch()
    m.mul_(0.5 + torch.rand(m.shape, device=m.device))


def _peft_twin(layer, base):
    """PEFT's DoRA layer (torch) holding ``layer``'s weights (flame), and its magnitude parameter."""
    twin = copy.deepcopy(base)
    with torch.no_grad():
        twin.weight.copy_(layer.weight.to_torch())
        if layer.bias is not None:
            twin.bias.copy_(layer.bias.to_torch())
    cfg = peft.LoraConfig(r=layer.rank, lora_alpha=layer.alpha, target_modules=["layer"], use_dora=True)
    pl = peft.get_peft_model(_Holder(twin), cfg).base_model.model.layer
    mag = pl.lora_magnitude_vector["default"].weight
    with torch.no_grad():
        pl.lora_A["default"].weight.copy_(layer.lora_A.to_torch())
        pl.lora_B["default"].weight.copy_(layer.lora_B.to_torch())
        mag.copy_(layer.lora_magnitude.to_torch().view(mag.shape))
    return pl, mag


def _layer(kind, bias, dropout=0.0):
    flame.manual_seed(3)
    if kind == "linear":
        layer = LoRALinear(nn.Linear(7, 5, bias=bias), rank=3, alpha=6.0, dropout=dropout, dora=True)
        base, shape = torch.nn.Linear(7, 5, bias=bias), (2, 4, 7)
    else:
        layer = LoRAConv2d(nn.Conv2d(3, 4, 3, padding=1, stride=2, bias=bias), rank=2, alpha=3.0, dropout=dropout,
                           dora=True)
        base, shape = torch.nn.Conv2d(3, 4, 3, padding=1, stride=2, bias=bias), (2, 3, 5, 5)
    _randomize(layer)
    return layer, base.to(DEVICE), torch.randn(shape, device=DEVICE)


def _forward_and_grads(layer, x, g):
    xf = flame.from_torch(x.clone(), requires_grad=True)
    y = layer(xf)
    grads = (y * flame.from_torch(g)).sum().backward()
    return y.to_torch(), [grads[t].to_torch() for t in (xf, layer.lora_A, layer.lora_B, layer.lora_magnitude)]


def _peft_forward_and_grads(pl, mag, x, g):
    x = x.clone().requires_grad_(True)
    y = pl(x)
    (y * g).sum().backward()
    return y.detach(), [x.grad, pl.lora_A["default"].weight.grad, pl.lora_B["default"].weight.grad, mag.grad]


def _assert_matches_peft(layer, pl, mag, x):
    with torch.no_grad():
        g = torch.randn(pl(x).shape, device=DEVICE)
    y, grads = _forward_and_grads(layer, x, g)
    y_ref, grads_ref = _peft_forward_and_grads(pl, mag, x, g)
    torch.testing.assert_close(y, y_ref, **TOL)
    for name, got, want in zip(("x", "A", "B", "magnitude"), grads, grads_ref):
        torch.testing.assert_close(got, want.view(got.shape), **TOL, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_forward_and_gradients_match_peft(kind, bias):
    layer, base, x = _layer(kind, bias)
    assert "dora=True" in repr(layer) and len(list(layer.parameters())) == 3 + (2 if bias else 1)
    pl, mag = _peft_twin(layer, base)
    _assert_matches_peft(layer, pl, mag, x)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_dropout_follows_peft(kind, monkeypatch):
    """PEFT feeds the dropped input to the whole DoRA term, its (c - 1) W correction included; the
    same fixed mask on both sides checks flame does that."""
    layer, base, x = _layer(kind, bias=True, dropout=0.5)
    mask = (torch.rand(x.shape, device=DEVICE) > 0.5).float() * 2.0
    monkeypatch.setattr("flame.nn.lora._dropout", lambda t, p, training: t * flame.from_torch(mask))
    pl, mag = _peft_twin(layer, base)
    pl.lora_dropout["default"] = _FixedDropout(mask)
    _assert_matches_peft(layer, pl, mag, x)


@pytest.mark.parametrize("shape,rank,layout,dtype", [
    ((37, 50), 3, "contiguous", torch.float32),
    ((20, 8, 3, 3), 20, "contiguous", torch.float16),
    ((20, 8, 3, 3), 4, "channels_last", torch.float32),
    ((6, 5, 3, 2), 1, "window_transposed", torch.float32),  # kh, kw not one stride apart: read from a copy
    ((9, 4, 1, 1), 2, "channels_last", torch.float32),
], ids=str)
def test_adapted_norms_kernel(shape, rank, layout, dtype):
    """``||W + s B A||`` per output row (and ``m / norm``) in one launch, for Linear and conv weights
    in any layout, odd ranks (1, 3, 20 > the 16-wide dot), a 16-bit W, against float64."""
    from flame.kernels import dora as KD
    w = torch.randn(shape, dtype=torch.float64).to(dtype)
    if layout == "channels_last":
        w = w.to(memory_format=torch.channels_last)
    elif layout == "window_transposed":
        w = w.transpose(2, 3).contiguous().transpose(2, 3)
    a = torch.randn((rank, *shape[1:]))
    b = torch.randn((shape[0], rank, *(1,) * (len(shape) - 2)))
    m = torch.rand(shape[0]) + 0.5
    want = (w.double().flatten(1) + 0.3 * b.double().flatten(1) @ a.double().flatten(1)).norm(dim=1)
    norm, ratio = torch.empty(shape[0], device=DEVICE), torch.empty(shape[0], device=DEVICE)
    out = KD.adapted_norms_(norm, w.to(DEVICE), a.to(DEVICE), b.to(DEVICE), 0.3, m.to(DEVICE), ratio)
    assert out is norm
    torch.testing.assert_close(norm.cpu().double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ratio.cpu().double(), m.double() / want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="don't form W \\+ B A"):
        KD.adapted_norms_(norm, w.to(DEVICE), a[:, :1].contiguous().to(DEVICE), b.to(DEVICE), 0.3)


def test_init_magnitude_is_the_weight_norm_and_leaves_the_output_alone():
    flame.manual_seed(0)
    lin = nn.Linear(9, 6)
    layer = LoRALinear(lin, rank=2, dora=True)
    w = lin.weight.to_torch()
    torch.testing.assert_close(layer.lora_magnitude.to_torch(), w.norm(dim=1), rtol=1e-6, atol=0)
    x = flame.randn(3, 9)
    torch.testing.assert_close(layer(x).to_torch(), lin(x).to_torch(), rtol=1e-6, atol=1e-6)
    conv = nn.Conv2d(3, 4, 3)
    torch.testing.assert_close(LoRAConv2d(conv, rank=2, dora=True).lora_magnitude.to_torch(),
                               conv.weight.to_torch().flatten(1).norm(dim=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_merge_unmerge_and_fold_match_peft(kind):
    layer, base, x = _layer(kind, bias=True)
    layer.eval()
    xf = flame.from_torch(x)
    w0 = layer.weight.to_torch().clone()
    y = layer(xf).to_torch()
    pl, _ = _peft_twin(layer, base)
    pl.merge()
    layer.merge()
    torch.testing.assert_close(layer.weight.to_torch(), pl.base_layer.weight.detach(), **TOL)
    torch.testing.assert_close(layer(xf).to_torch(), y, **TOL)  # merged output = unmerged output
    layer.unmerge()
    torch.testing.assert_close(layer.weight.to_torch(), w0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(xf).to_torch(), y, rtol=1e-6, atol=1e-6)
    # fold at strength s = PEFT (and diffusers' set_adapters weight s) at scaling s * alpha / rank
    pl.unmerge()
    pl.set_scale("default", 0.5)
    with torch.no_grad():
        want = pl(x)
    folded = layer.fold(0.5)
    assert type(folded) is type(layer._base_layer)
    torch.testing.assert_close(folded(xf).to_torch(), want, **TOL)


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)


def _small(dora=True, seed=0):
    flame.manual_seed(seed)
    model = _Small()
    model.requires_grad_(False)
    nn.inject_lora(model, "proj", rank=2, alpha=3.0, conv=True, conv_rank=3, dora=dora)
    for _, m in lora_modules(model):
        flame.nn.init.normal_(m.lora_B, 0.0, 0.5)
        if dora:
            _randomize(m)
    return model


def _outputs(model):
    g = torch.Generator().manual_seed(5)
    xl, xc = torch.randn(2, 6, generator=g), torch.randn(1, 3, 4, 4, generator=g)
    return [model.proj(flame.from_torch(xl.to(DEVICE))).to_torch(),
            model.conv(flame.from_torch(xc.to(DEVICE))).to_torch()]


def _fresh():
    flame.manual_seed(0)  # the same base weights as _small()
    model = _Small()
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_files_round_trip_through_flames_loader(fmt, tmp_path):
    model = _small()
    sd = nn.lora_state_dict(model, format=fmt)
    shapes = {k: tuple(v.shape) for k, v in sd.items() if k.endswith(("magnitude_vector", "dora_scale"))}
    if fmt == "peft":  # as PEFT saves them: (out,) for a Linear, (1, out, 1, 1) for a Conv2d
        assert shapes == {"unet.proj.lora_magnitude_vector": (5,), "unet.conv.lora_magnitude_vector": (1, 4, 1, 1)}
    else:  # LyCORIS's dora_scale on the output axis (ComfyUI: dora_scale.shape[0] == out)
        assert shapes == {"lora_unet_proj.dora_scale": (5, 1), "lora_unet_conv.dora_scale": (4, 1, 1, 1)}
    fresh = _fresh()
    assert sorted(nn.load_lora_state_dict(fresh, sd, alpha=3.0)) == ["conv", "proj"]  # PEFT files: alpha apart
    assert all(m.dora for _, m in lora_modules(fresh))
    for got, want in zip(_outputs(fresh), _outputs(model)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if fmt == "kohya":  # LyCORIS (wd_on_output): W' = dora_scale * (W + s up down) / ||W + s up down|| (rows)
        name = "lora_unet_conv"
        w = fresh.conv.weight.to_torch().clone()
        up, down = sd[f"{name}.lora_up.weight"].to_torch(), sd[f"{name}.lora_down.weight"].to_torch()
        v = w + (sd[f"{name}.alpha"].item() / 3) * (up.flatten(1) @ down.flatten(1)).view(w.shape)
        lycoris = sd[f"{name}.dora_scale"].to_torch() * v / v.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        fresh.conv.merge()
        torch.testing.assert_close(fresh.conv.weight.to_torch(), lycoris, **TOL)
    # through a file (flame.io: the PEFT file's alphas in its metadata)
    flame.io.save_lora(model, tmp_path / "dora.safetensors", format=fmt)
    from_file = _fresh()
    flame.io.load_lora(from_file, tmp_path / "dora.safetensors")
    for got, want in zip(_outputs(from_file), _outputs(model)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a file without magnitudes stays plain LoRA
    plain = {k: v for k, v in sd.items() if k not in shapes}
    other = _fresh()
    nn.load_lora_state_dict(other, plain, alpha=3.0)
    assert not any(m.dora for _, m in lora_modules(other))


def test_bad_magnitudes_are_refused_and_change_nothing():
    model = _small()
    sd = {k: v.to_torch().clone() for k, v in nn.lora_state_dict(model, format="peft").items()}
    fresh = _fresh()

    def refused(bad, error, match, target=fresh):
        before = [(n, type(m)) for n, m in target.named_modules()]
        with pytest.raises(error, match=match):
            nn.load_lora_state_dict(target, bad)
        assert [(n, type(m)) for n, m in target.named_modules()] == before  # nothing injected (all or nothing)

    refused({**sd, "unet.proj.lora_magnitude_vector": torch.ones(6)}, ValueError,
            r"unet\.proj\.lora_magnitude_vector: a DoRA magnitude of shape \(6,\) doesn't fit the layer "
            r"\(weight \(5, 6\): expected \(5,\)\)")
    refused({**sd, "unet.conv.lora_magnitude_vector": torch.ones(1, 4)}, ValueError, r"shape \(1, 4\)")
    refused({**sd, "unet.proj.lora_magnitude_vector": torch.ones(5, dtype=torch.int32)}, TypeError,
            "not a floating-point tensor")
    kohya = {k: v.to_torch().clone() for k, v in nn.lora_state_dict(model, format="kohya").items()}
    refused({**kohya, "lora_unet_proj.dora_scale": torch.ones(1, 6)}, ValueError, "input axis")
    # into existing adapters: a DoRA file into plain LoRA adapters is refused whole
    plain = _small(dora=False)
    a0 = plain.proj.lora_A.to_torch().clone()
    refused(sd, ValueError, r"DoRA magnitude .* is plain LoRA", target=plain)
    torch.testing.assert_close(plain.proj.lora_A.to_torch(), a0, rtol=0, atol=0)
    # a plain file into DoRA adapters: the magnitudes start from the loaded weights (= that plain LoRA's
    # output), unless strict
    plain_sd = nn.lora_state_dict(plain, format="kohya")  # with its alphas
    with pytest.raises(KeyError, match=r"is DoRA, the file has no magnitude for it \(strict\)"):
        nn.load_lora_state_dict(model, plain_sd, strict=True)
    nn.load_lora_state_dict(model, plain_sd)
    for got, want in zip(_outputs(model), _outputs(plain)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.extended  # CI: the file's round trip (test_files_round_trip_through_flames_loader), DoRA against peft
# (test_forward_and_gradients_match_peft) and LoRA files in diffusers (test_lora_interop.py)
def test_peft_file_reproduces_flames_dora_output_in_diffusers(tmp_path):
    """A tiny SDXL UNet with DoRA adapters (alpha != rank) on three of the mid block's attention
    projections (Linear, with and without bias, self- and cross-attention) and a resnet convolution
    (Conv2d): few, as each adds launches to the interpreted forward. diffusers loads the PEFT file
    as DoRA."""
    diffusers = pytest.importorskip("diffusers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from flame.models import SDXLUNet
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**TINY.to_diffusers()).eval()
    weights = tmp_path / "unet.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, weights)
    model = SDXLUNet.from_pretrained(weights, config=TINY)
    model.requires_grad_(False)
    names = nn.inject_lora(model, r"re:mid_block\..*\.(attn1\.to_q|attn1\.to_out\.0|attn2\.to_k)", rank=2, alpha=3,
                           conv=r"re:mid_block\.resnets\.0\.conv1", dora=True)
    assert len(names) == 4
    for _, m in lora_modules(model):
        _randomize(m)
    inp = _inputs()
    with flame.no_grad():
        out = model(*(flame.from_torch(inp[k].to(DEVICE)) for k in inp)).to_torch()
    path = tmp_path / "dora.safetensors"
    flame.io.save_lora(model, path)
    assert json.loads(flame.io.read_metadata(path)[flame.io.METADATA_KEY])["unet.use_dora"] is True
    no_adapter = _run_diffusers(unet, inp)
    for load in (_load_adapter, _load_weights):
        dif = copy.deepcopy(unet)
        load(dif, path)
        doras = [n for n, m in dif.named_modules() if getattr(m, "lora_magnitude_vector", None)]
        assert sorted(doras) == sorted(names), load.__name__
        ref = _run_diffusers(dif, inp)
        assert _rel(out, ref) < RTOL, load.__name__
        assert _rel(no_adapter, ref) > 1e-3, load.__name__  # the adapters change diffusers' output


def test_trainer_trains_and_writes_the_magnitudes(cache_dir, tmp_path):  # noqa: F811
    cfg = _config(cache_dir, tmp_path, "train.steps=2", "lora.dora=true", "lora.plus_ratio=4")
    trainer = _trainer(cfg)
    layers = lora_modules(trainer.model)
    norms = {n: m.lora_magnitude.to_torch().clone() for n, m in layers}
    groups = trainer.optimizer.param_groups
    assert sum(len(g["params"]) for g in groups) == 3 * len(layers)
    mags = {id(m.lora_magnitude) for _, m in layers}
    assert {g["lr"] for g in groups if mags & {id(p) for p in g["params"]}} == {cfg.train.lr}  # A's rate, not B's
    result = trainer.train()
    tensors = flame.io.load_safetensors(result["lora"])
    for name, m in layers:
        got = tensors[f"unet.{name}.lora_magnitude_vector"].to_torch()
        assert not torch.equal(got, norms[name]), name  # the optimizer moved it
        torch.testing.assert_close(got, m.lora_magnitude.to_torch(), rtol=0, atol=0)
    args = json.loads(flame.io.read_metadata(result["lora"])["ss_network_args"])
    assert args == {"dora_wd": "True", "wd_on_output": "True"}
    # the file loads strictly into another DoRA run's adapters, as a resume loads its checkpoint
    fresh = _trainer(_config(cache_dir, tmp_path / "again", "lora.dora=true"))
    flame.io.load_lora(fresh.model, result["lora"], inject=False, strict=True)
    for (_, m), (_, want) in zip(lora_modules(fresh.model), layers):
        torch.testing.assert_close(m.lora_magnitude.to_torch(), want.lora_magnitude.to_torch(), rtol=0, atol=0)
