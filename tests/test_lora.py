"""LoRA: forward/backward against a PyTorch reference, frozen base, key names, merge/unmerge."""
import math
import re

import numpy as np
import pytest
import torch

import flame
from flame import nn
from flame.nn.lora import LoRALinear
from helpers import DEVICE, TF32_TOL, assert_close

TOL = TF32_TOL or dict(rtol=1e-5, atol=1e-5)


class Attn(nn.Module):
    def __init__(self, c, ctx):
        super().__init__()
        self.to_q = nn.Linear(c, c, bias=False)
        self.to_k = nn.Linear(ctx, c, bias=False)
        self.to_v = nn.Linear(ctx, c, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(c, c), nn.Dropout(0.0)])


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn1 = Attn(c, c)
        self.attn2 = Attn(c, 6)
        self.ff = nn.Module()
        self.ff.net = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))


class Tiny(nn.Module):
    """Module names like SDXL's: down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q."""

    def __init__(self, c=8):
        super().__init__()
        self.conv_in = nn.Linear(4, c)
        blocks = nn.ModuleList([nn.Module(), nn.Module()])
        tr = nn.Module()
        tr.proj_in = nn.Linear(c, c)
        tr.transformer_blocks = nn.ModuleList([Block(c)])
        tr.proj_out = nn.Linear(c, c)
        blocks[1].attentions = nn.ModuleList([tr])
        self.down_blocks = blocks


def _ref(x, w, b, a, bb, scale):
    y = x @ w.t() + (0 if b is None else b)
    return y + scale * ((x @ a.t()) @ bb.t())


def test_inject_targets_and_names():
    m = Tiny()
    names = nn.inject_lora(m, "attn", rank=2, alpha=4)
    base = "down_blocks.1.attentions.0.transformer_blocks.0"
    want = [f"{base}.attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")]
    assert names == want
    assert isinstance(m.get_submodule(f"{base}.attn1.to_out.0"), LoRALinear)
    assert type(m.get_submodule(f"{base}.ff.net.0")) is nn.Linear
    # base keys keep their names; the base is frozen, adapters are trainable
    sd = m.state_dict()
    assert f"{base}.attn1.to_out.0.weight" in sd and f"{base}.attn1.to_out.0.bias" in sd
    layer = m.get_submodule(f"{base}.attn1.to_q")
    assert not layer.weight.requires_grad and layer.lora_A.requires_grad and layer.lora_B.requires_grad
    assert len(nn.lora_parameters(m)) == 16
    # regexes and suffixes
    m2 = Tiny()
    got = nn.inject_lora(m2, [r".*\.attn2\.to_[kv]", "ff.net.2", re.compile(r".*proj_in")], rank=3)
    assert got == ["down_blocks.1.attentions.0.proj_in", f"{base}.attn2.to_k", f"{base}.attn2.to_v",
                   f"{base}.ff.net.2"]
    with pytest.raises(ValueError, match="no Linear"):
        nn.inject_lora(Tiny(), "nothing_here", rank=2)


def test_state_dict_keys_and_shapes():
    m = Tiny(c=8)
    nn.inject_lora(m, "attn", rank=4, alpha=2)
    p = "down_blocks.1.attentions.0.transformer_blocks.0"
    peft = nn.lora_state_dict(m, format="peft")
    assert len(peft) == 16
    assert peft[f"unet.{p}.attn1.to_q.lora_A.weight"].shape == (4, 8)
    assert peft[f"unet.{p}.attn1.to_q.lora_B.weight"].shape == (8, 4)
    assert peft[f"unet.{p}.attn2.to_k.lora_A.weight"].shape == (4, 6)
    assert peft[f"unet.{p}.attn2.to_out.0.lora_B.weight"].shape == (8, 4)
    kohya = nn.lora_state_dict(m, format="kohya")
    assert len(kohya) == 24
    k = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    assert kohya[f"{k}.lora_down.weight"].shape == (4, 8)
    assert kohya[f"{k}.lora_up.weight"].shape == (8, 4)
    assert kohya[f"{k}.alpha"].shape == () and float(kohya[f"{k}.alpha"].item()) == 2.0
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_out_0.lora_up.weight" in kohya


def test_init_zero_b_and_distributions():
    flame.manual_seed(1)
    lin = nn.Linear(400, 30)
    layer = LoRALinear(lin, rank=64, alpha=64)
    a = layer.lora_A.numpy()
    bound = 1 / math.sqrt(400)
    assert np.abs(a).max() <= bound and abs(a.std() - bound / math.sqrt(3)) < 0.05 * bound
    assert np.all(layer.lora_B.numpy() == 0)
    layer.reset_lora("gaussian")
    a = layer.lora_A.numpy()
    assert abs(a.std() - 1 / 64) < 0.05 / 64 and np.all(layer.lora_B.numpy() == 0)
    # B = 0: the output equals the base layer's bit for bit
    x = flame.randn(5, 400)
    np.testing.assert_array_equal(layer(x).numpy(), lin(x).numpy())


@pytest.mark.parametrize("bias", [True, False])
def test_forward_backward_matches_torch(bias):
    lin = nn.Linear(11, 7, bias=bias)
    layer = LoRALinear(lin, rank=3, alpha=5.0)
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
    w, a, bb = (t.to_torch().clone() for t in (layer.weight, layer.lora_A, layer.lora_B))
    b = layer.bias.to_torch().clone() if bias else None
    xt = torch.randn(2, 4, 11, device=DEVICE)
    x = flame.from_torch(xt.clone(), requires_grad=True)
    at, bt = a.clone().requires_grad_(True), bb.clone().requires_grad_(True)
    xt.requires_grad_(True)
    y = layer(x)
    yt = _ref(xt, w, b, at, bt, 5.0 / 3)
    assert_close(y, yt.detach(), **TOL)
    gt = torch.randn(2, 4, 7, device=DEVICE)
    grads = (y * flame.from_torch(gt)).sum().backward()
    (yt * gt).sum().backward()
    assert_close(grads[layer.lora_A], at.grad, **TOL)
    assert_close(grads[layer.lora_B], bt.grad, **TOL)
    assert_close(grads[x], xt.grad, **TOL)
    assert layer.weight not in grads
    if bias:
        assert layer.bias not in grads


def test_half_base_with_fp32_adapters():
    lin = nn.Linear(16, 12).to(torch.float16)
    layer = LoRALinear(lin, rank=4, alpha=8)
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.3)
    assert layer.weight.dtype == torch.float16 and layer.lora_A.dtype == torch.float32
    xt = torch.randn(5, 16, device=DEVICE).half()
    x = flame.from_torch(xt.clone())
    y = layer(x)
    assert y.dtype == torch.float16
    at = layer.lora_A.to_torch().clone().requires_grad_(True)
    bt = layer.lora_B.to_torch().clone().requires_grad_(True)
    ref = _ref(xt.float(), layer.weight.to_torch().float(), layer.bias.to_torch().float(), at, bt, 2.0)
    assert_close(y.to(torch.float32), ref.detach(), rtol=2e-2, atol=2e-2)
    grads = y.to(torch.float32).sum().backward()
    ref.sum().backward()
    assert grads[layer.lora_A].dtype == torch.float32
    assert_close(grads[layer.lora_A], at.grad, rtol=3e-2, atol=3e-2)
    assert_close(grads[layer.lora_B], bt.grad, rtol=3e-2, atol=3e-2)
    assert layer.weight not in grads


def test_dropout_only_in_training():
    layer = LoRALinear(nn.Linear(6, 6), rank=2, alpha=2, dropout=0.5)
    flame.nn.init.normal_(layer.lora_B, 0.0, 1.0)
    x = flame.randn(4, 6)
    layer.eval()
    a, b = layer(x).numpy(), layer(x).numpy()
    np.testing.assert_array_equal(a, b)
    layer.train()
    assert not np.allclose(layer(x).numpy(), a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_unmerge(dtype):
    m = Tiny()
    nn.inject_lora(m, "attn", rank=2, alpha=3)
    layer = m.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    layer.to(dtype)
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
    w0 = layer.weight.to_torch().clone()
    x = flame.randn(3, 8).to(dtype)
    y_lora = layer(x).to(torch.float32).numpy()
    nn.merge_lora(m)
    assert layer.merged
    want = (w0.float() + 1.5 * layer.lora_B.to_torch() @ layer.lora_A.to_torch()).to(dtype)
    # merging multiplies B @ A with flame's matmul: tf32 on the GPU for fp32
    tol = (TF32_TOL or dict(rtol=1e-5, atol=1e-6)) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    assert_close(layer.weight.to_torch().clone(), want, **tol)
    np.testing.assert_allclose(layer(x).to(torch.float32).numpy(), y_lora, **tol if dtype == torch.float32
                               else dict(rtol=1e-2, atol=1e-2))
    nn.unmerge_lora(m)
    assert not layer.merged
    assert_close(layer.weight.to_torch().clone(), w0, **tol)


def test_fold_lora_adds_each_file_at_its_strength_and_restores_plain_layers():
    m = Tiny()
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    w0 = m.get_submodule(name).weight.to_torch().clone()
    deltas = []
    for strength in (0.5, -2.0):  # two "files" in turn, the first merged before folding
        nn.inject_lora(m, "attn", rank=2, alpha=3)
        layer = m.get_submodule(name)
        flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
        deltas.append(strength * 1.5 * layer.lora_B.to_torch() @ layer.lora_A.to_torch())
        if strength == 0.5:
            nn.merge_lora(m)
        assert name in nn.fold_lora(m, strength)
        assert type(m.get_submodule(name)) is nn.Linear and not nn.lora.lora_modules(m)
    assert_close(m.get_submodule(name).weight.to_torch().clone(), w0 + deltas[0] + deltas[1],
                 **(TF32_TOL or dict(rtol=1e-5, atol=1e-6)))


# ---- Conv2d ("LoCon") -------------------------------------------------------------------------

def _build_convnet(root, lib):
    """SDXL-like names: conv_in, down_blocks.0.resnets.0.{conv1, conv_shortcut}, a Linear proj."""
    root.conv_in = lib.Conv2d(3, 4, 3, padding=1)
    res = lib.Module()
    res.conv1 = lib.Conv2d(4, 6, 3, stride=2, padding=1)
    res.conv_shortcut = lib.Conv2d(4, 6, 1, stride=2, bias=False)
    blk = lib.Module()
    blk.resnets = lib.ModuleList([res])
    root.down_blocks = lib.ModuleList([blk])
    root.proj = lib.Linear(6, 5)


def _convnet_forward(root, x):
    h = root.conv_in(x)
    r = root.down_blocks[0].resnets[0]
    h = r.conv1(h) + r.conv_shortcut(h)
    return root.proj(h.permute(0, 2, 3, 1))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        _build_convnet(self, nn)

    forward = _convnet_forward


class TorchConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _build_convnet(self, torch.nn)

    forward = _convnet_forward


def _torch_twin(m):
    tm = TorchConvNet().to(DEVICE)
    tm.load_state_dict({k: v.to_torch().clone() for k, v in m.state_dict().items()})
    return tm


def test_conv_lora_matches_torch_reference_and_freezes_base():
    from flame.nn.lora import LoRAConv2d
    base = nn.Conv2d(4, 6, 3, stride=2, padding=1)
    layer = LoRAConv2d(base, rank=3, alpha=6.0)
    assert layer.lora_A.shape == (3, 4, 3, 3) and layer.lora_B.shape == (6, 3, 1, 1)
    x = flame.randn(2, 4, 7, 9)
    np.testing.assert_array_equal(layer(x).numpy(), base(x).numpy())  # B = 0: exactly the base conv
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.5)
    w, b, a, bb = (t.to_torch().clone() for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B))
    xt = x.to_torch().clone().requires_grad_(True)
    xf = flame.from_torch(xt.detach().clone(), requires_grad=True)
    at, bt = a.requires_grad_(True), bb.requires_grad_(True)
    tf = torch.nn.functional
    yt = tf.conv2d(xt, w, b, stride=2, padding=1) + 2.0 * tf.conv2d(tf.conv2d(xt, at, stride=2, padding=1), bt)
    y = layer(xf)
    assert_close(y, yt.detach(), **TOL)
    gt = torch.randn_like(yt)
    grads = (y * flame.from_torch(gt)).sum().backward()
    (yt * gt).sum().backward()
    for f, t in ((layer.lora_A, at), (layer.lora_B, bt), (xf, xt)):
        assert_close(grads[f], t.grad, **TOL)
    assert layer.weight not in grads and layer.bias not in grads


def test_conv_injection_names_keys_and_merge():
    m = ConvNet()
    names = nn.inject_lora(m, "proj", rank=2, alpha=4, conv=True, conv_rank=3, conv_alpha=1.5)
    res = "down_blocks.0.resnets.0"
    assert names == ["conv_in", f"{res}.conv1", f"{res}.conv_shortcut", "proj"]
    assert nn.inject_lora(ConvNet(), "conv1", rank=2) == [f"{res}.conv1"]  # a conv named by the targets
    assert nn.inject_lora(ConvNet(), "proj", rank=2, conv=r"re:.*resnets.*") == \
        [f"{res}.conv1", f"{res}.conv_shortcut", "proj"]
    c1 = m.get_submodule(f"{res}.conv1")
    assert (c1.rank, c1.alpha, m.proj.rank, m.proj.alpha) == (3, 1.5, 2, 4.0)
    peft = nn.lora_state_dict(m, format="peft")
    assert peft[f"unet.{res}.conv1.lora_A.weight"].shape == (3, 4, 3, 3)
    assert peft[f"unet.{res}.conv1.lora_B.weight"].shape == (6, 3, 1, 1)
    assert peft[f"unet.{res}.conv_shortcut.lora_A.weight"].shape == (3, 4, 1, 1)
    kohya = nn.lora_state_dict(m, format="kohya")
    k = f"lora_unet_{res.replace('.', '_')}_conv1"
    assert kohya[f"{k}.lora_down.weight"].shape == (3, 4, 3, 3) and kohya[f"{k}.lora_up.weight"].shape == (6, 3, 1, 1)
    assert float(kohya[f"{k}.alpha"].item()) == 1.5
    for p in nn.lora_parameters(m):
        flame.nn.init.normal_(p, 0.0, 0.3)
    x = flame.randn(2, 3, 6, 6)
    y = m(x).numpy()
    w0 = c1.weight.to_torch().clone()
    nn.merge_lora(m)
    want = w0 + 0.5 * torch.einsum("or,rikl->oikl", c1.lora_B.to_torch()[:, :, 0, 0], c1.lora_A.to_torch())
    tol = TF32_TOL or dict(rtol=1e-5, atol=1e-6)  # tf32 products on the GPU
    assert_close(c1.weight.to_torch().clone(), want, **tol)
    np.testing.assert_allclose(m(x).numpy(), y, **(TF32_TOL or dict(rtol=1e-4, atol=1e-5)))
    nn.unmerge_lora(m)
    assert_close(c1.weight.to_torch().clone(), w0, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        nn.inject_lora(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), "0", rank=2)


def test_conv_lora_matches_peft():
    peft = pytest.importorskip("peft")
    m = ConvNet()
    nn.inject_lora(m, ["conv1", "conv_shortcut", "proj"], rank=2, alpha=3)
    for p in nn.lora_parameters(m):
        flame.nn.init.normal_(p, 0.0, 0.4)
    tm = _torch_twin(ConvNet())  # base weights copied below, with the adapters, by key
    cfg = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["conv1", "conv_shortcut", "proj"])
    tm = peft.inject_adapter_in_model(cfg, tm)
    ours = nn.lora_state_dict(m, format="peft", prefix="")
    theirs = peft.get_peft_model_state_dict(tm)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    base = {k: v.to_torch().clone() for k, v in m.state_dict().items() if "lora_" not in k}
    tsd = {k.replace(".base_layer", ""): k for k in tm.state_dict()}
    tm.load_state_dict({tsd[k]: v for k, v in base.items()}, strict=False)
    peft.set_peft_model_state_dict(tm, {k: v.to_torch().clone() for k, v in ours.items()})
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    yt = tm(x)
    y = m(flame.from_torch(x.clone()))
    assert_close(y, yt.detach(), **TOL)
    g = torch.randn_like(yt)
    grads = (y * flame.from_torch(g)).sum().backward()
    (yt * g).sum().backward()
    named = dict(tm.named_parameters())
    for name, p in m.named_parameters():
        if "lora_" in name:
            tname = name + ".default.weight"
            assert_close(grads[p], named[tname].grad, **TOL)


KOHYA_SDXL = {  # diffusers module path -> the key kohya's sd-scripts write for it in an SDXL LoRA
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q":
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
    "mid_block.attentions.0.transformer_blocks.9.attn2.to_out.0":
        "lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0",
    "up_blocks.0.attentions.2.transformer_blocks.9.ff.net.2":
        "lora_unet_output_blocks_2_1_transformer_blocks_9_ff_net_2",
    "down_blocks.2.attentions.1.proj_out": "lora_unet_input_blocks_8_1_proj_out",
    "down_blocks.0.resnets.0.conv1": "lora_unet_input_blocks_1_0_in_layers_2",
    "up_blocks.1.resnets.2.conv_shortcut": "lora_unet_output_blocks_5_0_skip_connection",
    "down_blocks.0.downsamplers.0.conv": "lora_unet_input_blocks_3_0_op",
    "up_blocks.1.upsamplers.0.conv": "lora_unet_output_blocks_5_2_conv",
    "time_embedding.linear_1": "lora_unet_time_embed_0",
    "add_embedding.linear_2": "lora_unet_label_emb_0_2",
}


def test_kohya_files_of_sdxl_use_the_original_layout_and_both_flavours_load(tmp_path):
    from flame.io import load_lora, save_lora
    from flame.models import SDXLUNet, SDXLUNetConfig
    from flame.nn.lora import _kohya_name
    skeleton = SDXLUNet.skeleton(SDXLUNetConfig())
    assert {p: _kohya_name(skeleton.original_name(p), "unet") for p in KOHYA_SDXL} == KOHYA_SDXL
    flame.manual_seed(4)
    with flame.nn.init.skip_init():  # the base weights do not matter here
        model = SDXLUNet(SDXLUNetConfig.tiny())
    nn.inject_lora(model, "attn", rank=2, alpha=3)
    for p in nn.lora_parameters(model):
        flame.nn.init.normal_(p, 0.0, 0.5)
    written = {k: v.numpy() for k, v in nn.lora_state_dict(model, format="kohya").items()}
    assert "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in written
    assert not any(k.startswith("lora_unet_down_blocks") for k in written)
    save_lora(model, tmp_path / "sgm.safetensors", format="kohya")
    paths = dict(nn.lora.lora_modules(model))
    flat = {}  # the same adapters under kohya keys over the diffusers paths (what flame wrote before)
    for path in paths:
        old, new = _kohya_name(path, "unet"), _kohya_name(model.original_name(path), "unet")
        flat.update({k.replace(new, old): flame.tensor(v) for k, v in written.items() if k.startswith(new + ".")})
    flame.io.save_safetensors(flat, tmp_path / "flat.safetensors")
    for name in ("sgm.safetensors", "flat.safetensors"):
        with flame.nn.init.skip_init():
            fresh = SDXLUNet(SDXLUNetConfig.tiny())
        assert sorted(load_lora(fresh, tmp_path / name)) == sorted(paths)
        for path, m in nn.lora.lora_modules(fresh):
            np.testing.assert_array_equal(m.lora_B.numpy(), paths[path].lora_B.numpy())
            assert m.alpha == 3
