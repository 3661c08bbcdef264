"""LoRA on fused Linear layers (``parts``): one adapter per part, as PEFT gives the separate layers.

A toy flame model has a fused projection ``attn.qkv`` (5 -> 4 + 4 + 6, ``parts=(4, 4, 6)``), a
plain ``attn.proj`` and a modulation ``mod`` (shift, scale), and names them as diffusers would
(``diffusers_names``; ``diffusers_rows``: the twin's ``norm_out`` holds (scale, shift), as diffusers'
Flux ``norm_out.linear``); its torch twin has three ``nn.Linear`` (``to_q``, ``to_k``, ``to_v``),
``to_out`` and ``norm_out``, wrapped by real PEFT. Checked:

- same adapters (copied through flame's PEFT file keys) give the same output and the same A, B
  (and DoRA magnitude) gradients as PEFT;
- PEFT file: the keys and shapes PEFT itself saves, loaded back bitwise; kohya file: one fused
  adapter (down (3r, in), up block-diagonal (out, 3r), alpha 3 * alpha, as sd-scripts' split_qkv
  writes it, alpha scaled so alpha / rank stays), loaded back bitwise; a shared-down kohya file
  (kohya's default for a fused layer) loads as per-part adapters with the same output; files that
  do not fit raise a clear error and leave the model as it was;
- merge / unmerge / fold of a fused layer; launches of a fused against a plain layer.
"""
import contextlib

import numpy as np
import pytest
import torch

import flame
import flame.io
import flame.kernels.launch as L
from flame import nn
from flame.amp import ParameterCasts
from flame.nn.lora import LoRALinear, lora_modules, lora_parameters
from flame.ops.matmul import lora_linear
from helpers import DEVICE, TF32_TOL, assert_close

TOL = TF32_TOL or dict(rtol=1e-5, atol=1e-5)
PARTS = (4, 4, 6)
SPLIT = ("to_q", "to_k", "to_v")
peft = pytest.importorskip("peft")


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(5, sum(PARTS))
        self.attn.qkv.parts = PARTS
        self.attn.proj = nn.Linear(sum(PARTS), 3)
        self.mod = nn.Linear(5, 6)

    def forward(self, x):
        shift_scale = self.mod(x)
        return self.attn.proj(self.attn.qkv(x)) * (shift_scale[..., 3:] + 1.0) + shift_scale[..., :3]

    def diffusers_names(self, path):
        names = {"attn.qkv": tuple(f"attn.{n}" for n in SPLIT), "attn.proj": ("attn.to_out",), "mod": ("norm_out",)}
        return names[path]

    def diffusers_rows(self, path):
        return ((3, 6), (0, 3)) if path == "mod" else None


class Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        for name, n in zip(SPLIT, PARTS):
            setattr(self.attn, name, torch.nn.Linear(5, n))
        self.attn.to_out = torch.nn.Linear(sum(PARTS), 3)
        self.norm_out = torch.nn.Linear(5, 6)

    def forward(self, x):
        a = self.attn
        scale, shift = self.norm_out(x).chunk(2, -1)
        return a.to_out(torch.cat([a.to_q(x), a.to_k(x), a.to_v(x)], -1)) * (1 + scale) + shift


def _model(rank=2, alpha=3.0, dora=False, seed=0):
    """A Fused model with adapters on both layers, every adapter weight random (B != 0)."""
    flame.manual_seed(seed)
    m = Fused()
    assert nn.inject_lora(m, ["qkv", "proj", "mod"], rank=rank, alpha=alpha, dora=dora) == \
        ["attn.qkv", "attn.proj", "mod"]
    for layer in (m.attn.qkv, m.attn.proj, m.mod):
        flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
        if dora:
            mag = layer.lora_magnitude.to_torch()
            mag.mul_(0.5 + torch.rand(mag.shape, device=mag.device))
    return m


def _peft_twin(m, dora=False):
    """PEFT on the split torch model, holding ``m``'s base weights and (through flame's PEFT keys) adapters."""
    twin = Split().to(DEVICE)
    w, b = m.attn.qkv.weight.to_torch(), m.attn.qkv.bias.to_torch()
    with torch.no_grad():
        start = 0
        for name, n in zip(SPLIT, PARTS):
            getattr(twin.attn, name).weight.copy_(w[start:start + n])
            getattr(twin.attn, name).bias.copy_(b[start:start + n])
            start += n
        twin.attn.to_out.weight.copy_(m.attn.proj.weight.to_torch())
        twin.attn.to_out.bias.copy_(m.attn.proj.bias.to_torch())
        twin.norm_out.weight.copy_(_swap(m.mod.weight.to_torch()))
        twin.norm_out.bias.copy_(_swap(m.mod.bias.to_torch()))
    layer = m.attn.qkv
    cfg = peft.LoraConfig(r=layer.rank, lora_alpha=layer.alpha, target_modules=[*SPLIT, "to_out", "norm_out"],
                          use_dora=dora)
    pm = peft.get_peft_model(twin, cfg)
    ours = nn.lora_state_dict(m, format="peft", prefix="base_model.model")
    theirs = peft.get_peft_model_state_dict(pm)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    result = peft.set_peft_model_state_dict(pm, {k: v.to_torch().clone() for k, v in ours.items()})
    assert not result.unexpected_keys
    return pm


def _swap(t):
    """mod's rows (shift, scale) as norm_out holds them, (scale, shift)."""
    return torch.cat([t[3:], t[:3]])


def _state(m, only="."):
    return {k: v.to_torch().clone() for k, v in m.state_dict().items() if only in k}


def _same_state(m, before, only="."):
    after = _state(m, only)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


def test_parts_give_one_adapter_each():
    m = _model()
    qkv = m.attn.qkv
    assert isinstance(qkv, LoRALinear) and qkv.parts == PARTS and m.attn.proj.parts is None
    assert qkv.lora_A.shape == (6, 5) and qkv.lora_B.shape == (14, 2)
    assert len(lora_parameters(m)) == 6
    with pytest.raises(ValueError, match="must sum to its out_features=14"):
        bad = nn.Linear(5, 14)
        bad.parts = (4, 4)
        LoRALinear(bad, rank=2)
    fresh = Fused()
    fresh.attn.qkv.parts = (14,)  # one part: a plain layer
    nn.inject_lora(fresh, "qkv", rank=2)
    assert fresh.attn.qkv.parts is None and fresh.attn.qkv.lora_A.shape == (2, 5)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_matches_peft_on_separate_layers(dora):
    m = _model(dora=dora)
    pm = _peft_twin(m, dora)
    xt = torch.randn(2, 3, 5, device=DEVICE)
    x = flame.from_torch(xt.clone(), requires_grad=True)
    xt.requires_grad_(True)
    y, yt = m(x), pm(xt)
    assert_close(y, yt.detach(), **TOL)
    g = torch.randn_like(yt)
    grads = (y * flame.from_torch(g)).sum().backward()
    (yt * g).sum().backward()
    named = dict(pm.named_parameters())

    def peft_grad(name, what):
        return named[f"base_model.model.attn.{name}.{what}.default.weight"].grad

    qkv, proj = m.attn.qkv, m.attn.proj
    assert_close(grads[qkv.lora_A], torch.cat([peft_grad(n, "lora_A") for n in SPLIT]), **TOL)
    assert_close(grads[qkv.lora_B], torch.cat([peft_grad(n, "lora_B") for n in SPLIT]), **TOL)
    assert_close(grads[proj.lora_B], peft_grad("to_out", "lora_B"), **TOL)
    assert_close(grads[m.mod.lora_A], named["base_model.model.norm_out.lora_A.default.weight"].grad, **TOL)
    assert_close(_swap(grads[m.mod.lora_B].to_torch()), named["base_model.model.norm_out.lora_B.default.weight"].grad,
                 **TOL)
    if dora:
        assert_close(grads[qkv.lora_magnitude], torch.cat([peft_grad(n, "lora_magnitude_vector") for n in SPLIT]),
                     **TOL)
    assert_close(grads[x], xt.grad, **TOL)
    assert qkv.weight not in grads


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_file_has_one_adapter_per_part_and_loads_back_bitwise(tmp_path, dora):
    import json
    m = _model(alpha=5.0, dora=dora)
    path = tmp_path / "peft.safetensors"
    flame.io.save_lora(m, path, format="peft", prefix="transformer")
    shapes = flame.io.stored_shapes(path)
    want = {f"transformer.attn.{n}.lora_{ab}.weight": (2, 5) if ab == "A" else (size, 2)
            for n, size in zip(SPLIT, PARTS) for ab in "AB"}
    want.update({"transformer.attn.to_out.lora_A.weight": (2, 14), "transformer.attn.to_out.lora_B.weight": (3, 2),
                 "transformer.norm_out.lora_A.weight": (2, 5), "transformer.norm_out.lora_B.weight": (6, 2)})
    if dora:
        want.update({f"transformer.attn.{n}.lora_magnitude_vector": (size,) for n, size in zip(SPLIT, PARTS)})
        want.update({"transformer.attn.to_out.lora_magnitude_vector": (3,),
                     "transformer.norm_out.lora_magnitude_vector": (6,)})
    assert shapes == want
    stored = flame.io.load_safetensors(path)
    assert torch.equal(stored["transformer.norm_out.lora_B.weight"].to_torch(), _swap(m.mod.lora_B.to_torch()))
    cfg = json.loads(flame.io.read_metadata(path)[flame.io.METADATA_KEY])
    assert cfg["transformer.target_modules"] == sorted(["norm_out", *(f"attn.{n}" for n in (*SPLIT, "to_out"))])
    assert (cfg["transformer.r"], cfg["transformer.lora_alpha"], cfg["transformer.use_dora"]) == (2, 5.0, dora)
    fresh = Fused()
    assert sorted(flame.io.load_lora(fresh, path, prefix="transformer")) == ["attn.proj", "attn.qkv", "mod"]
    for (name, a), (_, b) in zip(lora_modules(m), lora_modules(fresh)):
        assert (b.rank, b.alpha, b.dora, b.parts) == (a.rank, a.alpha, a.dora, a.parts), name
    _same_state(fresh, _state(m, "lora_"), "lora_")


def test_kohya_file_is_one_fused_adapter_and_loads_back_bitwise(tmp_path):
    m = _model(alpha=5.0)
    sd = {k: v.to_torch().clone() for k, v in nn.lora_state_dict(m, format="kohya", prefix="transformer").items()}
    key = "lora_unet_attn_qkv"  # kohya names every denoiser "unet", a DiT too
    assert sorted(sd) == sorted(f"lora_unet_{n}.{s}" for n in ("attn_qkv", "attn_proj", "mod")
                                for s in ("lora_down.weight", "lora_up.weight", "alpha"))
    assert torch.equal(sd["lora_unet_mod.lora_up.weight"], m.mod.lora_B.to_torch())  # kohya keeps flame's rows
    qkv = m.attn.qkv
    assert torch.equal(sd[f"{key}.lora_down.weight"], qkv.lora_A.to_torch())
    b = qkv.lora_B.to_torch()
    assert torch.equal(sd[f"{key}.lora_up.weight"], torch.block_diag(b[:4, :], b[4:8], b[8:]))
    assert float(sd[f"{key}.alpha"]) == 15.0 and float(sd["lora_unet_attn_proj.alpha"]) == 5.0  # alpha / rank kept
    path = tmp_path / "kohya.safetensors"
    flame.io.save_lora(m, path, format="kohya", prefix="unet")
    fresh = Fused()
    flame.io.load_lora(fresh, path, prefix="transformer")
    assert (fresh.attn.qkv.rank, fresh.attn.qkv.alpha) == (2, 5.0)
    _same_state(fresh, _state(m, "lora_"), "lora_")
    nn.load_lora_state_dict(fresh, sd, prefix="transformer")  # into the adapters it has
    _same_state(fresh, _state(m, "lora_"), "lora_")


def _fused_reference(m, x, down, up, alpha):
    """The base model with the delta (alpha / rank) up @ down on the fused layer (torch)."""
    def base(layer, x):
        return x @ layer.weight.to_torch().t() + layer.bias.to_torch()

    h = base(m.attn.qkv, x) + alpha / down.shape[0] * (x @ down.t()) @ up.t()
    shift_scale = base(m.mod, x)
    return base(m.attn.proj, h) * (1 + shift_scale[..., 3:]) + shift_scale[..., :3]


def test_shared_down_kohya_file_loads_as_per_part_adapters():
    flame.manual_seed(2)
    m = Fused()
    down, up = torch.randn(2, 5, device=DEVICE), torch.randn(14, 2, device=DEVICE)
    sd = {"lora_unet_attn_qkv.lora_down.weight": down, "lora_unet_attn_qkv.lora_up.weight": up,
          "lora_unet_attn_qkv.alpha": torch.tensor(7.0)}
    x = torch.randn(4, 5, device=DEVICE)
    want = _fused_reference(m, x, down, up, 7.0)
    assert nn.load_lora_state_dict(m, sd) == ["attn.qkv"]
    qkv = m.attn.qkv
    assert (qkv.rank, qkv.alpha) == (2, 7.0)
    assert torch.equal(qkv.lora_A.to_torch(), down.repeat(3, 1)) and torch.equal(qkv.lora_B.to_torch(), up)
    assert_close(m(flame.from_torch(x)), want, **TOL)
    nn.load_lora_state_dict(m, sd, inject=False)  # into adapters of rank 2: the same
    assert_close(m(flame.from_torch(x)), want, **TOL)
    # a block-diagonal file of rank 6 into a fresh layer: three adapters of rank 2
    blocks = torch.zeros(14, 6, device=DEVICE)
    for p, (lo, hi) in enumerate(((0, 4), (4, 8), (8, 14))):
        blocks[lo:hi, 2 * p:2 * p + 2] = up[lo:hi]
    fresh = Fused()
    fresh.load_state_dict({k: v for k, v in m.state_dict().items() if "lora_" not in k}, strict=False)
    down6 = torch.randn(6, 5, device=DEVICE)
    nn.load_lora_state_dict(fresh, {"lora_unet_attn_qkv.lora_down.weight": down6,
                                    "lora_unet_attn_qkv.lora_up.weight": blocks})
    assert (fresh.attn.qkv.rank, fresh.attn.qkv.alpha) == (2, 2.0)  # alpha = file rank 6, / 3
    assert_close(fresh(flame.from_torch(x)), _fused_reference(fresh, x, down6, blocks, 6.0), **TOL)


def test_files_that_do_not_fit_raise_and_leave_the_model_unchanged(tmp_path):
    m = _model()
    before = _state(m)
    kohya = {k: v.to_torch().clone() for k, v in nn.lora_state_dict(m, format="kohya").items()}
    up = kohya["lora_unet_attn_qkv.lora_up.weight"]
    up[0, 5] = 1.0  # off the diagonal blocks
    with pytest.raises(ValueError, match=r"lora_unet_attn_qkv: its up matrix has non-zero entries outside the "
                                         r"diagonal blocks of layer 'attn.qkv'"):
        nn.load_lora_state_dict(m, kohya)
    _same_state(m, before)
    wrong_rank = {"lora_unet_attn_qkv.lora_down.weight": torch.zeros(4, 5),
                  "lora_unet_attn_qkv.lora_up.weight": torch.zeros(14, 4)}
    with pytest.raises(ValueError, match=r"rank 4 in the file; layer 'attn\.qkv' has 3 adapters of rank 2"):
        nn.load_lora_state_dict(m, wrong_rank)
    _same_state(m, before)
    peft_sd = {k: v.to_torch().clone() for k, v in nn.lora_state_dict(m, format="peft").items()}
    partial = {k: v for k, v in peft_sd.items() if ".to_k." not in k}
    with pytest.raises(KeyError, match=r"lacks \['unet.attn.to_k.lora_A.weight', 'unet.attn.to_k.lora_B.weight'\]"):
        nn.load_lora_state_dict(m, partial)
    uneven = {**peft_sd, "unet.attn.to_k.lora_A.weight": torch.zeros(3, 5),
              "unet.attn.to_k.lora_B.weight": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match=r"have ranks \[2, 3\] .* one rank and one alpha"):
        nn.load_lora_state_dict(Fused(), uneven)
    both = {**peft_sd, "unet.attn.qkv.lora_A.weight": torch.zeros(6, 5),
            "unet.attn.qkv.lora_B.weight": torch.zeros(14, 6)}
    with pytest.raises(ValueError, match=r"both name layer 'attn\.qkv'"):
        nn.load_lora_state_dict(m, both)
    path = tmp_path / "partial.safetensors"
    flame.io.save_safetensors(partial, path)
    with pytest.raises(KeyError, match="to_k"):
        flame.io.load_lora(m, path)
    _same_state(m, before)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merge_unmerge_and_fold_of_a_fused_layer(dora):
    m = _model(dora=dora)
    x = flame.randn(4, 5)
    y = m(x).numpy()
    w0 = m.attn.qkv.weight.to_torch().clone()
    tol = TF32_TOL or dict(rtol=1e-5, atol=1e-5)
    nn.merge_lora(m)
    np.testing.assert_allclose(m(x).numpy(), y, **tol)
    nn.unmerge_lora(m)
    assert_close(m.attn.qkv.weight.to_torch().clone(), w0, **tol)
    np.testing.assert_allclose(m(x).numpy(), y, **tol)
    assert nn.fold_lora(m) == ["attn.qkv", "attn.proj", "mod"]
    assert type(m.attn.qkv) is nn.Linear and m.attn.qkv.parts == PARTS
    np.testing.assert_allclose(m(x).numpy(), y, **tol)


def _launches(fn, *args):
    """(launches, result) of ``fn(*args)``."""
    L.launches = 0
    out = fn(*args)
    return L.launches, out


def test_a_fused_layer_adds_one_launch_forward_and_one_backward():
    """The block-diagonal B: one launch forward (and its cast to the activations' dtype, which a
    plain layer's B gets from the ParameterCasts region), one gather backward; a plain layer's
    forward and backward are F.lora_linear's alone."""
    flame.manual_seed(0)
    fused, plain = nn.Linear(32, 24).to(torch.float16), nn.Linear(32, 24).to(torch.float16)
    fused.parts = (8, 16)
    fused, plain = LoRALinear(fused, rank=4), LoRALinear(plain, rank=4)
    x = flame.randn(16, 32, dtype=flame.float16).requires_grad_()
    g = flame.randn(16, 24, dtype=flame.float16)
    fused(x)  # the partition's constant mask and index, made once

    def count(layer, region, fn=None):
        with ParameterCasts([layer.lora_A, layer.lora_B], torch.float16) if region else contextlib.nullcontext():
            forward, y = _launches(fn or layer, x)
            backward, _ = _launches(y.backward, g)
        return forward, backward

    counts = {}
    for name, layer in (("fused", fused), ("plain", plain)):
        for region in (False, True):
            counts[name, region] = count(layer, region)
    direct = count(plain, False, lambda x: lora_linear(x, plain.weight, plain.bias, plain.lora_A, plain.lora_B,
                                                       plain.scale))
    assert counts["plain", False] == direct, (counts, direct)
    for region, extra_forward in ((False, 1), (True, 2)):
        (ff, fb), (pf, pb) = counts["fused", region], counts["plain", region]
        assert (ff - pf, fb - pb) == (extra_forward, 1), counts


def test_a_model_naming_its_layers_wrongly_is_told_so():
    m = _model()
    m.diffusers_names = lambda path: ("a", "b") if path == "attn.qkv" else (path,)
    with pytest.raises(ValueError, match=r"diffusers_names\('attn.qkv'\) gives 2 names .* the layer has 3 part"):
        nn.lora_state_dict(m)
    m = _model()
    m.diffusers_rows = lambda path: ((0, 4), (3, 6)) if path == "mod" else None
    with pytest.raises(ValueError, match=r"diffusers_rows\('mod'\) gives \(\(0, 4\), \(3, 6\)\), which do not split"):
        nn.lora_state_dict(m)


# ---- Flux.1: flame's fused layers against diffusers' FluxTransformer2DModel with PEFT ------------

def _flux_inputs(flux):
    g = torch.Generator().manual_seed(1)
    cfg = flux.FluxConfig.tiny()
    return {"hidden_states": torch.randn(1, 4, cfg.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, 3, cfg.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=g),
            "timestep": torch.tensor([0.7]), "img_ids": flux.latent_image_ids(4, 4).to_torch().cpu(),
            "txt_ids": flux.text_ids(3).to_torch().cpu(), "guidance": torch.tensor([3.5])}


@pytest.fixture(scope="module")
def flux_models(tmp_path_factory):
    """(diffusers' tiny Flux transformer, flame's of the same weights with rank-2 adapters (alpha 3,
    B random) on attention and MLP, the base weights' file)."""
    flux = pytest.importorskip("flame.models.flux")
    diffusers = pytest.importorskip("diffusers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    cfg = flux.FluxConfig.tiny()
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**cfg.to_diffusers()).eval()
    weights = tmp_path_factory.mktemp("flux_lora") / "transformer.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, weights)
    model = flux.FluxTransformer2DModel.from_pretrained(weights, config=cfg, dtype=torch.float32)
    model.requires_grad_(False)
    nn.inject_lora(model, flux.LORA_PRESETS["attn-mlp"], rank=2, alpha=3.0)
    flame.manual_seed(5)
    for _, layer in lora_modules(model):
        flame.nn.init.normal_(layer.lora_B, 0.0, 0.3)
    return ref, model, weights


def _flame_flux(model, inp, grad=None):
    """flame's output (torch) and, with ``grad``, its LoRA gradients {diffusers module: (dA, dB)}."""
    out = model(*(flame.from_torch(inp[k].to(DEVICE)) for k in
                  ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")),
                guidance=flame.from_torch(inp["guidance"].to(DEVICE)))
    if grad is None:
        return out.to_torch().cpu(), None
    grads = (out * flame.from_torch(grad.to(DEVICE))).sum().backward()
    per_module = {}
    for path, layer in lora_modules(model):
        da, db = grads[layer.lora_A].to_torch().cpu(), grads[layer.lora_B].to_torch().cpu()
        names, rows = model.diffusers_names(path), np.cumsum((0, *(layer.parts or (layer.out_features,))))
        for p, name in enumerate(names):
            per_module[name] = (da[p * layer.rank:(p + 1) * layer.rank], db[rows[p]:rows[p + 1]])
    return out.to_torch().cpu(), per_module


def _rel(got, ref):
    return (got.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()


FLUX_RTOL = 1e-4 if flame.is_interpreter() else 2e-2  # fp32 GEMMs run as tf32 on the GPU
FLUX_LORA_MODULES = ({f"transformer_blocks.{i}.{m}" for i in range(2) for m in (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0",
    "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")}
    | {f"single_transformer_blocks.{i}.{m}" for i in range(2) for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")})


def test_flux_peft_file_loads_in_diffusers_with_the_same_output_and_lora_gradients(flux_models, tmp_path):
    import copy
    ref, model, _ = flux_models
    path = tmp_path / "flux_peft.safetensors"
    flame.io.save_lora(model, path, format="peft", prefix="transformer")
    transformer = copy.deepcopy(ref)
    # use_safetensors: diffusers reads the metadata (alpha) only through its safetensors branch
    transformer.load_lora_adapter(str(path), prefix="transformer", use_safetensors=True)
    layers = {n: m for n, m in transformer.named_modules() if getattr(m, "lora_A", None)}
    assert set(layers) == FLUX_LORA_MODULES
    assert {next(iter(m.scaling.values())) for m in layers.values()} == {1.5}
    inp = _flux_inputs(pytest.importorskip("flame.models.flux"))
    theirs = transformer(**inp).sample
    g = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(2))
    ours, grads = _flame_flux(model, inp, g)
    assert _rel(ours, theirs.detach()) < FLUX_RTOL
    assert _rel(theirs.detach(), ref(**inp).sample.detach()) > 0.05  # the adapters matter
    (theirs * g).sum().backward()
    params = dict(transformer.named_parameters())
    assert set(grads) == FLUX_LORA_MODULES
    for name, (da, db) in grads.items():
        ta, tb = (next(p for k, p in params.items() if k.startswith(f"{name}.lora_{ab}.")) for ab in "AB")
        assert _rel(da, ta.grad) < FLUX_RTOL and _rel(db, tb.grad) < FLUX_RTOL, name


def test_flux_kohya_file_loads_in_diffusers_and_in_flame(flux_models, tmp_path):
    """diffusers converts flame's kohya file (its fused QKV adapters block-diagonal, split into
    to_q/to_k/to_v by its sparse check) to the same output. diffusers' conversion has Flux.1-dev's
    sizes for a single block's linear1 written in (3 x 3072 + 12288), so the tiny model's file
    leaves linear1 out; flame loads the same file into a fresh model of the base weights."""
    import copy

    from diffusers import FluxPipeline
    flux = pytest.importorskip("flame.models.flux")
    ref, model, weights = flux_models
    sd = {k: v for k, v in nn.lora_state_dict(model, format="kohya", prefix="transformer").items()
          if "_linear1." not in k}
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (96, 6)
    assert float(sd["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item()) == 9.0
    path = tmp_path / "flux_kohya.safetensors"
    flame.io.save_safetensors(sd, path)
    other = flux.FluxTransformer2DModel.from_pretrained(weights, config=flux.FluxConfig.tiny(), dtype=torch.float32)
    loaded = flame.io.load_lora(other, path, prefix="transformer")
    assert len(loaded) == len(lora_modules(model)) - 2  # all but the two single blocks' linear1
    assert all(other.get_submodule(n).rank == 2 and other.get_submodule(n).alpha == 3.0 for n in loaded)
    transformer = copy.deepcopy(ref)
    # what FluxPipeline.load_lora_weights does for the transformer (no pipeline needed)
    state, alphas, metadata = FluxPipeline.lora_state_dict(str(path), return_alphas=True, return_lora_metadata=True)
    FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=transformer, metadata=metadata)
    layers = {n for n, m in transformer.named_modules() if getattr(m, "lora_A", None)}
    assert layers == {n for n in FLUX_LORA_MODULES if not (n.startswith("single") and "proj_out" not in n)}
    inp = _flux_inputs(flux)
    with torch.no_grad():
        theirs = transformer(**inp).sample
        base = ref(**inp).sample
    ours, _ = _flame_flux(other, inp)
    assert _rel(ours, theirs) < FLUX_RTOL
    assert _rel(theirs, base) > 0.05  # the adapters matter


def test_flux_final_modulation_is_written_in_diffusers_row_order(flux_models, tmp_path):
    """``final_layer.adaLN_modulation.1`` holds (shift, scale), diffusers' ``norm_out.linear`` (scale,
    shift): the model's ``diffusers_rows`` has flame write and read its PEFT adapter in diffusers'
    order (forward only)."""
    import copy
    flux = pytest.importorskip("flame.models.flux")
    ref, _, weights = flux_models
    model = flux.FluxTransformer2DModel.from_pretrained(weights, config=flux.FluxConfig.tiny(), dtype=torch.float32)
    nn.inject_lora(model, ["final_layer.adaLN_modulation.1", "final_layer.linear"], rank=2, alpha=3.0)
    flame.manual_seed(6)
    for _, layer in lora_modules(model):
        flame.nn.init.normal_(layer.lora_B, 0.0, 0.3)
    path = tmp_path / "final.safetensors"
    flame.io.save_lora(model, path, format="peft", prefix="transformer")
    transformer = copy.deepcopy(ref)
    transformer.load_lora_adapter(str(path), prefix="transformer", use_safetensors=True)
    inp = _flux_inputs(flux)
    with torch.no_grad():
        theirs, base = transformer(**inp).sample, ref(**inp).sample
    ours, _ = _flame_flux(model, inp)
    assert _rel(ours, theirs) < FLUX_RTOL and _rel(theirs, base) > 0.05
    fresh = flux.FluxTransformer2DModel.from_pretrained(weights, config=flux.FluxConfig.tiny(), dtype=torch.float32)
    flame.io.load_lora(fresh, path, prefix="transformer")
    for (_, a), (_, b) in zip(lora_modules(model), lora_modules(fresh)):
        assert torch.equal(a.lora_B.to_torch(), b.lora_B.to_torch())


@pytest.mark.gpu
def test_flux_sized_fused_layer_in_bf16():
    """linear1 of Flux.1 (3072 -> 3 x 3072 + 12288) at rank 16 in bf16 inside a ParameterCasts
    region: output and A, B gradients against four separate adapters in fp32 PyTorch."""
    parts = (3072, 3072, 3072, 12288)
    flame.manual_seed(0)
    base = nn.Linear(3072, sum(parts)).to(torch.bfloat16)
    base.parts = parts
    layer = LoRALinear(base, rank=16, alpha=16)
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.02)
    x = flame.randn(2, 512, 3072, dtype=flame.bfloat16)
    with ParameterCasts([layer.lora_A, layer.lora_B], torch.bfloat16):
        y = layer(x)
        g = flame.randn(*y.shape, dtype=flame.bfloat16)
        grads = y.backward(g)
    xt, gt = x.to_torch().float(), g.to_torch().float()
    w, b = layer.weight.to_torch().float(), layer.bias.to_torch().float()
    a = layer.lora_A.to_torch().clone().requires_grad_(True)
    bb = layer.lora_B.to_torch().clone().requires_grad_(True)
    starts = np.cumsum((0, *parts))
    delta = torch.cat([(xt @ a[16 * p:16 * (p + 1)].t()) @ bb[starts[p]:starts[p + 1]].t() for p in range(4)], -1)
    ref = xt @ w.t() + b + delta
    (ref * gt).sum().backward()
    assert_close(y.to(torch.float32), ref.detach(), rtol=2e-2, atol=5e-2)
    assert_close(grads[layer.lora_A], a.grad, rtol=3e-2, atol=3e-2 * a.grad.abs().max().item())
    assert_close(grads[layer.lora_B], bb.grad, rtol=3e-2, atol=3e-2 * bb.grad.abs().max().item())
