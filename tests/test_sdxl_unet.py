"""SDXL UNet: parity with diffusers' UNet2DConditionModel (outputs, gradients, LoRA with peft) on the
tiny config, state-dict names and shapes, the full-config sizes, the LDM key map and checkpoint errors."""
import copy
import dataclasses
import json
import math

import pytest
import torch

import flame
import flame.nn.functional as F
from flame.models import SDXLUNet, SDXLUNetConfig, diffusers_to_ldm, ldm_to_diffusers, sdxl_keys
from flame.nn.lora import _expand_targets, _matches
from helpers import DEVICE

TINY = SDXLUNetConfig.tiny()
# fp32 GEMMs run as tf32 on the GPU (deep net: errors compound); exact fp32 in the interpreter
RTOL = 1e-4 if flame.is_interpreter() else 1e-1  # GPU: tf32 products (10-bit mantissa); the strict check is fp32 on CPU
INPUT_NAMES = ("sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids")
# parameters whose gradients are compared: every kind of layer, early and late in the network
CHECKED = ("conv_in.weight", "time_embedding.linear_1.weight", "add_embedding.linear_2.bias",
           "down_blocks.0.downsamplers.0.conv.weight",
           "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight",
           "down_blocks.2.resnets.0.norm1.weight", "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
           "mid_block.attentions.0.transformer_blocks.0.norm2.bias", "up_blocks.0.resnets.2.conv_shortcut.weight",
           "up_blocks.0.attentions.1.proj_out.weight", "up_blocks.1.upsamplers.0.conv.weight",
           "up_blocks.2.resnets.1.time_emb_proj.weight", "conv_norm_out.weight", "conv_out.bias")


def _rel(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _assert_grads_close(got, ref32, ref64):
    """{name: gradient}: flame's error against the fp64 reference is at most 3x PyTorch's own fp32
    error (docs/design.md's rule), with a floor of RTOL; gradients that nearly cancel (attention q/k
    over 4 tokens: ~1e-8 where others are ~1e-3) carry large relative errors in any fp32 code."""
    for n, g in got.items():
        e_flame, e_torch = _rel(g, ref64[n]), _rel(ref32[n], ref64[n])
        assert e_flame <= max(RTOL, 3 * e_torch), f"{n}: gradient error {e_flame:.3g} (PyTorch fp32: {e_torch:.3g})"


def _fp64_grads(module, inp, target, select):
    """Gradients of the MSE loss of an fp64 copy of ``module`` for the parameters ``select(name)`` picks."""
    m64 = copy.deepcopy(module).double()
    m64.zero_grad(set_to_none=True)
    inp64 = {k: v.double() if v.is_floating_point() else v for k, v in inp.items()}
    torch.nn.functional.mse_loss(_run_diffusers(m64, inp64), target.double()).backward()
    return {select(n): p.grad for n, p in m64.named_parameters() if select(n)}


def _inputs(cfg=TINY, batch=2, size=8, tokens=8):
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(batch, cfg.in_channels, size, size, generator=g),
            "timestep": torch.tensor([10, 901])[:batch],
            "encoder_hidden_states": torch.randn(batch, tokens, cfg.cross_attention_dim, generator=g),
            "text_embeds": torch.randn(batch, cfg.pooled_dim, generator=g),
            "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024], [768, 1152, 16, 32, 1024, 1024]])[:batch]}


def _run_diffusers(unet, inp):
    added = {"text_embeds": inp["text_embeds"], "time_ids": inp["time_ids"]}
    return unet(inp["sample"], inp["timestep"], inp["encoder_hidden_states"], added_cond_kwargs=added).sample


def _run_flame(model, inp):
    return model(*(flame.from_torch(inp[k].to(DEVICE)) for k in INPUT_NAMES))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A seeded diffusers UNet of the tiny config (norm weights and all biases perturbed so that a
    swapped weight/bias shows), saved as a sharded diffusers folder and as an SGM-named single file."""
    diffusers = pytest.importorskip("diffusers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**TINY.to_diffusers()).eval()
    with torch.no_grad():
        for p in unet.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("sdxl_unet")
    unet.save_pretrained(root / "unet", max_shard_size="3MB")
    sd = {k: v.contiguous() for k, v in unet.state_dict().items()}
    ldm = sdxl_keys.to_ldm(sd, TINY)
    ldm["first_stage_model.decoder.conv_in.weight"] = torch.zeros(2, 2)  # other parts of an SGM file
    ldm["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"] = torch.zeros(3)
    safetensors_torch.save_file(ldm, root / "sgm.safetensors")
    return unet, root


# ---- parity with diffusers ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.extended  # the forward's parity: test_lora_interop, test_pipeline; gradients: the ops' gradchecks
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_forward_and_gradients_match_diffusers(reference, checkpointing):
    if checkpointing:
        pytest.importorskip("flame.checkpoint")
    unet, root = reference
    assert len(list((root / "unet").glob("*.safetensors"))) > 1  # the sharded index path
    model = SDXLUNet.from_pretrained(root / "unet")
    assert model.config == TINY
    # state_dict in the skeleton's order (the architecture's), names and shapes as diffusers'
    got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert got == list(SDXLUNet.parameter_shapes(TINY).items())
    assert dict(got) == {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    model.enable_gradient_checkpointing(checkpointing)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    for name in CHECKED:
        params[name].requires_grad_(True)
    inp = _inputs()
    target = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))

    unet.zero_grad()
    ref = _run_diffusers(unet, inp)
    ref_loss = torch.nn.functional.mse_loss(ref, target)
    ref_loss.backward()

    out = _run_flame(model, inp)
    t = out.to_torch()
    assert t.shape == ref.shape and t.dtype == torch.float32
    assert t.is_contiguous(memory_format=torch.channels_last)
    assert _rel(t, ref) < RTOL
    loss = F.mse_loss(out, flame.from_torch(target.to(DEVICE)))
    assert abs(loss.item() - ref_loss.item()) <= RTOL * ref_loss.item()
    grads = loss.backward()
    ref32 = {n: p.grad for n, p in unet.named_parameters() if n in CHECKED}
    ref64 = _fp64_grads(unet, inp, target, lambda n: n if n in CHECKED else None)
    _assert_grads_close({n: grads[params[n]].to_torch() for n in CHECKED}, ref32, ref64)


def test_sgm_named_file_loads_the_same_weights(reference):
    """Every weight equal to diffusers' (the same weights give the same output: the parity test above)."""
    unet, root = reference
    model = SDXLUNet.from_pretrained(root / "sgm.safetensors", config=TINY)
    ref_sd = unet.state_dict()
    sd = model.state_dict()
    assert set(sd) == set(ref_sd)
    for k, v in sd.items():
        assert torch.equal(v.to_torch().cpu(), ref_sd[k]), k


@pytest.mark.extended  # LoRA against peft: tests/test_lora_parts.py per layer, test_lora_interop.py whole
def test_lora_loss_and_gradients_match_peft(reference):
    peft = pytest.importorskip("peft")
    unet, root = reference
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    ref = copy.deepcopy(unet)
    ref.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian"))
    ref_lora = {n.replace(".default.weight", ""): p for n, p in ref.named_parameters() if ".lora_" in n}

    model = SDXLUNet.from_pretrained(root / "unet")
    model.requires_grad_(False)
    names = flame.nn.inject_lora(model, "attn", rank=4, alpha=4)
    assert len(names) == 88  # 11 transformer blocks x 2 attentions x 4 projections
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(lora) == set(ref_lora)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in ref_lora.items():  # identical non-zero A and B on both sides
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
            lora[n].to_torch().copy_(p)

    inp = _inputs(batch=1)  # batching is covered by the parity test
    target = torch.randn(1, 4, 8, 8, generator=g)
    ref_loss = torch.nn.functional.mse_loss(_run_diffusers(ref, inp), target)
    ref_loss.backward()
    loss = F.mse_loss(_run_flame(model, inp), flame.from_torch(target.to(DEVICE)))
    assert abs(loss.item() - ref_loss.item()) <= RTOL * ref_loss.item()
    grads = loss.backward()
    assert len(grads) == len(lora) == 176
    ref64 = _fp64_grads(ref, inp, target, lambda n: n.replace(".default.weight", "") if ".lora_" in n else None)
    _assert_grads_close({n: grads[p].to_torch() for n, p in lora.items()},
                        {n: p.grad for n, p in ref_lora.items()}, ref64)


def test_from_pretrained_casts_to_dtype(reference):
    unet, root = reference
    model = SDXLUNet.from_pretrained(root / "unet", dtype=flame.bfloat16)
    ref = unet.state_dict()
    assert model.dtype == flame.bfloat16
    for k, v in model.state_dict().items():
        assert v.dtype == flame.bfloat16
        # one bf16 ulp: the interpreter's fp32 -> bf16 cast truncates, the GPU's rounds to nearest
        torch.testing.assert_close(v.to_torch().cpu().float(), ref[k], rtol=2 ** -7, atol=0, msg=k)


# ---- names, shapes and sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, SDXLUNetConfig()], ids=["tiny", "sdxl"])
def test_parameter_names_and_shapes_match_diffusers(cfg):
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):  # no memory: the full config is 2.57 B parameters
        unet = diffusers.UNet2DConditionModel(**cfg.to_diffusers())
    want = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    assert dict(SDXLUNet.parameter_shapes(cfg)) == want
    assert SDXLUNetConfig.from_diffusers(dict(unet.config)) == cfg


def test_full_sdxl_sizes_and_lora_targets():
    shapes = SDXLUNet.parameter_shapes()
    assert len(shapes) == 1680
    assert sum(math.prod(s) for s in shapes.values()) == 2_567_463_684
    linear = SDXLUNet.layer_names(kind="Linear")
    convs = SDXLUNet.layer_names(kind="Conv2d")
    assert (len(linear), len(convs)) == (743, 51)
    assert sorted(shapes[f"{n}.weight"][-1] for n in convs).count(3) == 40  # 40 3x3, 11 1x1
    assert sum(_matches(n, _expand_targets("attn")) for n in linear) == 560
    assert sum(_matches(n, _expand_targets("attn-mlp")) for n in linear) == 722
    assert len(SDXLUNet.layer_names(kind="LayerNorm")) == 3 * 70  # 70 transformer blocks


# ---- checkpointing scopes ---------------------------------------------------------------------------

def _saved_bytes(out):
    """Bytes of the distinct tensors the graph behind ``out`` keeps for its backward (checkpoint
    segments: their arguments)."""
    seen, nodes, stack = {}, set(), [out._node]
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes or not hasattr(node, "edges"):
            continue
        nodes.add(id(node))
        saved = node.saved
        items = list(saved.args if hasattr(saved, "args") else saved if isinstance(saved, (tuple, list)) else (saved,))
        while items:
            t = items.pop()
            if isinstance(t, (tuple, list)):  # a GEMM operand kept as a matrix: (buffer, rows, columns, strides)
                items.extend(t)
                continue
            data = t if isinstance(t, torch.Tensor) else getattr(t, "_data", None)  # ops keep either
            if isinstance(data, torch.Tensor):  # a view of the same bytes counts once
                seen[data.data_ptr()] = max(seen.get(data.data_ptr(), 0), data.numel() * data.element_size())
        stack.extend(e for e in node.edges if e is not None)
    return sum(seen.values())


def test_feed_forward_scope_keeps_the_input_not_the_projection_and_changes_no_gradient():
    """scope feed_forward: each GEGLU (projection + gate) keeps its (B, L, dim) input instead of the
    (B, L, 8 dim) projection and recomputes it; outputs and gradients are the same numbers."""
    from flame.models.blocks import LeafLayers
    from flame.models.sdxl_unet import FeedForward
    flame.manual_seed(3)
    ff = FeedForward(LeafLayers(flame.float32), 8)
    x = flame.randn(2, 5, 8, requires_grad=True)
    g = flame.randn(2, 5, 8)
    runs = []
    for on in (False, True):
        ff.net[0].gradient_checkpointing = on
        y = ff(x)
        kept = _saved_bytes(y)
        grads = y.backward(g)
        runs.append((y.to_torch(), kept, [grads[t].to_torch() for t in (x, ff.net[0].proj.weight, ff.net[2].bias)]))
    (y0, kept0, g0), (y1, kept1, g1) = runs
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    projection, weight = 2 * 5 * 64 * 4, 64 * 8 * 4  # bytes, fp32; x is kept either way (proj's dW, or the segment)
    assert kept0 - kept1 == projection + weight, (kept0, kept1)  # the weight: proj's dX


def test_enable_gradient_checkpointing_switches_one_scope():
    from flame.models.blocks import Checkpointed
    from flame.models.sdxl_unet import GEGLU
    model = SDXLUNet.skeleton(TINY)  # the module tree alone, nothing allocated
    flags = lambda: {type(m).__name__: m.gradient_checkpointing for m in model.modules()
                     if isinstance(m, Checkpointed)}
    assert set(flags().values()) == {False}
    model.enable_gradient_checkpointing(True, scope="feed_forward")
    assert flags() == {"ResnetBlock2D": False, "BasicTransformerBlock": False, "GEGLU": True}
    model.enable_gradient_checkpointing(True)  # blocks: a GEGLU inside a recomputed block is not checkpointed again
    assert flags() == {"ResnetBlock2D": True, "BasicTransformerBlock": True, "GEGLU": False}
    model.enable_gradient_checkpointing(False)
    assert set(flags().values()) == {False} and any(isinstance(m, GEGLU) for m in model.modules())
    with pytest.raises(ValueError, match="scope must be one of blocks, feed_forward"):
        model.enable_gradient_checkpointing(True, scope="attention")


# ---- LDM / SGM names -------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, SDXLUNetConfig()], ids=["tiny", "sdxl"])
def test_ldm_key_map_round_trips(cfg):
    names = list(SDXLUNet.parameter_shapes(cfg))
    ldm = [diffusers_to_ldm(k, cfg) for k in names]
    assert len(set(ldm)) == len(ldm)
    assert [ldm_to_diffusers(k, cfg) for k in ldm] == names
    assert [ldm_to_diffusers(sdxl_keys.LDM_PREFIX + k, cfg) for k in ldm] == names


@pytest.mark.parametrize("diffusers_name, ldm_name", [
    ("conv_in.weight", "input_blocks.0.0.weight"),
    ("time_embedding.linear_2.bias", "time_embed.2.bias"),
    ("add_embedding.linear_1.weight", "label_emb.0.0.weight"),
    ("down_blocks.0.resnets.1.conv2.weight", "input_blocks.2.0.out_layers.3.weight"),
    ("down_blocks.0.downsamplers.0.conv.weight", "input_blocks.3.0.op.weight"),
    ("down_blocks.1.resnets.0.conv_shortcut.bias", "input_blocks.4.0.skip_connection.bias"),
    ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
     "input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"),
    ("down_blocks.2.attentions.1.transformer_blocks.9.ff.net.0.proj.weight",
     "input_blocks.8.1.transformer_blocks.9.ff.net.0.proj.weight"),
    ("mid_block.resnets.1.time_emb_proj.weight", "middle_block.2.emb_layers.1.weight"),
    ("mid_block.attentions.0.proj_in.weight", "middle_block.1.proj_in.weight"),
    ("up_blocks.0.resnets.0.norm1.weight", "output_blocks.0.0.in_layers.0.weight"),
    ("up_blocks.0.upsamplers.0.conv.weight", "output_blocks.2.2.conv.weight"),
    ("up_blocks.1.attentions.2.norm.bias", "output_blocks.5.1.norm.bias"),
    ("up_blocks.2.resnets.2.norm2.weight", "output_blocks.8.0.out_layers.0.weight"),
    ("conv_norm_out.bias", "out.0.bias"),
    ("conv_out.weight", "out.2.weight"),
])
def test_ldm_key_map_known_sdxl_names(diffusers_name, ldm_name):
    assert diffusers_to_ldm(diffusers_name) == ldm_name
    assert ldm_to_diffusers(ldm_name) == diffusers_name
    assert ldm_to_diffusers("model.diffusion_model." + ldm_name) == diffusers_name


def test_ldm_key_map_upsampler_slot_without_attentions():
    cfg = dataclasses.replace(SDXLUNetConfig(), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))
    assert diffusers_to_ldm("up_blocks.0.upsamplers.0.conv.weight", cfg) == "output_blocks.2.1.conv.weight"
    assert ldm_to_diffusers("output_blocks.2.1.conv.weight", cfg) == "up_blocks.0.upsamplers.0.conv.weight"


@pytest.mark.parametrize("fn, key", [
    (diffusers_to_ldm, "down_blocks.0.resnets.0.norm3.weight"),
    (diffusers_to_ldm, "lora_unet_down_blocks_1.weight"),
    (ldm_to_diffusers, "input_blocks.3.1.norm.weight"),  # the downsampler slot has no transformer
    (ldm_to_diffusers, "middle_block.3.in_layers.0.weight"),
    (ldm_to_diffusers, "output_blocks.1.0.in_layers.1.weight"),
])
def test_ldm_key_map_rejects_unknown_names(fn, key):
    with pytest.raises(ValueError, match=r"no .* name for"):
        fn(key)


# ---- checkpoint errors -------------------------------------------------------------------------------

def _save(tensors, path):
    flame.io.save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.mark.parametrize("change, message", [
    ("drop", r"Missing key\(s\) \(1\): \"mid_block.resnets.0.conv1.bias\""),
    ("extra", r"Unexpected key\(s\) \(1\): \"mid_block.resnets.0.conv9.weight\""),
    ("shape", r"size mismatch for mid_block.resnets.0.conv1.bias: the checkpoint has shape \(3,\)"),
])
def test_mismatched_checkpoint_is_rejected_by_name(reference, tmp_path, change, message):
    unet, _ = reference
    sd = dict(unet.state_dict())
    key = "mid_block.resnets.0.conv1.bias"
    if change == "drop":
        del sd[key]
    elif change == "extra":
        sd["mid_block.resnets.0.conv9.weight"] = torch.zeros(3)
    else:
        sd[key] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=message):
        SDXLUNet.from_pretrained(_save(sd, tmp_path / "bad.safetensors"), config=TINY)


def test_sdxl_file_for_the_wrong_config_lists_the_problems(tmp_path):
    path = _save({"conv_in.weight": torch.zeros(32, 4, 3, 3)}, tmp_path / "partial.safetensors")
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\) \(1679\).*size mismatch for conv_in.weight"):
        SDXLUNet.from_pretrained(path)


def test_corrupt_and_missing_files_raise(tmp_path):
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SDXLUNet.from_pretrained(bad, config=TINY)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SDXLUNet.from_pretrained(tmp_path / "nowhere")
    folder = tmp_path / "unet"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY.to_diffusers()))
    with pytest.raises(FileNotFoundError, match="no diffusion_pytorch_model"):
        SDXLUNet.from_pretrained(tmp_path)  # a pipeline folder: looks into unet/


# ---- config ------------------------------------------------------------------------------------------

def test_config_round_trips_and_rejects_other_architectures():
    d = SDXLUNetConfig().to_diffusers()
    assert SDXLUNetConfig.from_diffusers({**d, "_class_name": "UNet2DConditionModel", "upcast_attention": None}) \
        == SDXLUNetConfig()
    assert SDXLUNetConfig().pooled_dim == 1280 and TINY.pooled_dim == 16
    for key, value in (("addition_embed_type", "text"), ("use_linear_projection", False),
                       ("class_embed_type", "timestep"), ("some_new_option", 1), ("layers_per_block", [2, 3, 2])):
        with pytest.raises(ValueError, match=key):
            SDXLUNetConfig.from_diffusers({**d, key: value})
    with pytest.raises(ValueError, match="norm_num_groups=7"):
        dataclasses.replace(TINY, norm_num_groups=7)
    with pytest.raises(ValueError, match="not divisible by 5 attention heads"):
        dataclasses.replace(TINY, attention_head_dim=(1, 5, 4))


def test_forward_rejects_bad_inputs_before_computing():
    skeleton = SDXLUNet.skeleton(TINY)  # runs the checks of forward; has no weights
    good = {k: flame.from_torch(v.to(DEVICE)) for k, v in _inputs(batch=2).items()}
    for name, shape, message in (("sample", (2, 3, 8, 8), r"sample must be \(B, 4, h, w\)"),
                                 ("sample", (2, 4, 8, 6), "multiples of 4"),
                                 ("encoder_hidden_states", (2, 8, 31), r"\(2, 'L', 32\)"),
                                 ("text_embeds", (1, 16), r"text_embeds must have shape \(2, 16\)"),
                                 ("time_ids", (2, 5), r"time_ids must have shape \(2, 6\)")):
        args = dict(good, **{name: flame.zeros(*shape)})
        with pytest.raises(ValueError, match=message):
            skeleton(*(args[k] for k in INPUT_NAMES))
