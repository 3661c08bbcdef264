"""Checkpoints whose weights are stored as float8_e4m3fn, as people download them: kohya's / ComfyUI's
``flux1-dev-fp8`` (Linear weights cast to e4m3fn, no scales: scale 1) and ComfyUI's ``fp8_scaled`` files
(a ``<layer>.scale_weight`` next to each ``<layer>.weight``, the weight being codes x scale, and a
``scaled_fp8`` mark). Loaded in fp8, the codes are taken bit for bit with the file's scale on every row;
loaded in another dtype, or into a full-precision (``fp8_skip``) layer, they are dequantised."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import flame
from flame.models import FluxConfig, FluxTransformer2DModel, placement
from flame.models.checkpoints import stored_tensors
from flame.ops.quant import Fp8Weight

CFG = dataclasses.replace(FluxConfig.tiny(), num_layers=1, num_single_layers=1)
FP8 = torch.float8_e4m3fn
SKIP = [r"re:(img_in|txt_in|time_in|vector_in|guidance_in|final_layer)(\..*)?"]
PER_ROW = "double_blocks.0.img_attn.qkv"  # in the scaled file, this layer's scale is one per row


def _linear_weights(cfg):
    return {f"{name}.weight" for name in FluxTransformer2DModel.layer_names(cfg)}


def _fp8_file(path, scaled, layout="bfl", cfg=CFG):
    """A Flux checkpoint of ``cfg`` (a BFL single file or a diffusers folder) whose Linear weights
    (the 2-D ``.weight`` tensors) are float8_e4m3fn; ``scaled``: each with a per-tensor ``scale_weight``
    (one per row for ``PER_ROW``), as ComfyUI's fp8_scaled files. Returns (what to load, {key: the
    weight's values, codes x scale, in fp32})."""
    flame.manual_seed(0)
    base = FluxTransformer2DModel(cfg)
    sd = base.diffusers_state_dict() if layout == "diffusers" else base.state_dict()
    tensors, values = {}, {}
    for key, t in sd.items():
        w = t._data.clone()
        if w.ndim != 2 or not key.endswith(".weight"):
            tensors[key] = w
            continue
        layer = key.removesuffix(".weight")
        if not scaled:
            tensors[key] = w.to(FP8)
            values[key] = tensors[key].float()
            continue
        rows = layer == PER_ROW
        scale = (w.abs().amax(1, keepdim=True) if rows else w.abs().amax()) / 448 * 1.5  # some codes saturate
        tensors[key] = (w / scale).to(FP8)
        tensors[f"{layer}.scale_weight"] = scale.float()
        tensors[f"{layer}.scale_input"] = torch.ones(())  # an activation scale: unused
        values[key] = tensors[key].float() * scale
    if scaled:
        tensors["scaled_fp8"] = torch.empty(0, dtype=FP8)
    if layout == "bfl":
        save_file(tensors, path / "flux1-dev-fp8.safetensors")
        return path / "flux1-dev-fp8.safetensors", values
    (path / "transformer").mkdir()
    save_file(tensors, path / "transformer" / "diffusion_pytorch_model.safetensors")
    (path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel",
                                                                   **cfg.to_diffusers()}))
    return path, values


def _dequantised_file(path, values, like):
    """``like``'s file with each fp8 weight replaced by its values in fp32."""
    tensors = {k: values.get(k, v) for k, v in load_file(like).items()
               if k != "scaled_fp8" and not k.endswith((".scale_weight", ".scale_input"))}
    save_file(tensors, path)
    return path


def _inputs(cfg, h=4, w=4, n_txt=3):
    from flame.models import flux as FX
    flame.manual_seed(2)
    return (flame.randn(1, (h // 2) * (w // 2), cfg.in_channels), flame.randn(1, n_txt, cfg.joint_attention_dim),
            flame.randn(1, cfg.pooled_projection_dim), flame.full((1,), 0.4), FX.latent_image_ids(h, w),
            FX.text_ids(n_txt), flame.full((1,), 3.5))


def _codes(t):
    """``t``'s bytes on the host (a loaded weight's on flame's device against a file's on the host)."""
    return placement.bytes_of(t.view(torch.uint8).contiguous()).cpu()


@pytest.mark.parametrize("scaled", [False, True], ids=["fp8", "fp8_scaled"])
def test_fp8_files_load_their_codes_as_they_are(tmp_path, scaled):
    """weight_dtype fp8: codes bit-equal to the file's, scales the file's (1 without), skipped layers
    dequantised; the output equals a model loaded from the dequantised weights."""
    path, values = _fp8_file(tmp_path, scaled)
    stored = load_file(path)
    with pytest.warns(UserWarning, match=r"load_into: 10 tensor\(s\) of .* are stored as float8_e4m3fn"):  # the skipped
        model = FluxTransformer2DModel.from_pretrained(path, config=CFG, weight_dtype="fp8_e4m3", fp8_skip=SKIP)
    params = dict(model.named_parameters())
    quantised = 0
    for key in _linear_weights(CFG):
        p = params[key]
        if isinstance(p, Fp8Weight):
            quantised += 1
            assert torch.equal(_codes(p._data), _codes(stored[key])), key
            scale = stored.get(key.replace(".weight", ".scale_weight"))
            want = torch.ones(p.shape[0]) if scale is None else scale.reshape(-1).expand(p.shape[0])
            assert torch.equal(p.scale.cpu(), want), key
        else:  # an fp8_skip layer: dequantised
            assert key.startswith(("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "final_layer")), key
            assert torch.equal(p._data.cpu(), values[key].cpu()), key  # values: from the model's device
    assert quantised == 13  # 7 Linears in a double block, 3 in a single one, 3 modulations
    ref = FluxTransformer2DModel.from_pretrained(_dequantised_file(tmp_path / "ref.safetensors", values, path),
                                                 config=CFG)
    out, want = model(*_inputs(CFG)), ref(*_inputs(CFG))
    # On a GPU fp32 products run as tf32: the reference's weights, codes x scale, are rounded to 10 mantissa
    # bits there, while the fp8 layers take the codes exactly and scale the products (unscaled: the same values)
    tol = dict(rtol=1e-2, atol=2e-3) if scaled and not flame.is_interpreter() else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out._data, want._data, **tol)


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_fp8_files_dequantise_into_other_dtypes_and_streamed_blocks(tmp_path, layout):
    """A model in fp32 (resident and with a streamed block) gets codes x scale; diffusers' separate q, k,
    v (each with its own scale) stack into the fused weight, and in fp8 each row keeps its part's scale;
    a streamed block's fp8 codes land in host memory as they are."""
    path, values = _fp8_file(tmp_path, scaled=True, layout=layout)
    with pytest.warns(UserWarning, match=r"stored as float8_e4m3fn: dequantised \(codes x scale\) into float32"):
        model = FluxTransformer2DModel.from_pretrained(path, config=CFG)
    with pytest.warns(UserWarning, match="dequantised"):
        streamed = FluxTransformer2DModel.from_pretrained(path, config=CFG, host_blocks=["single_blocks.0"])
    with pytest.warns(UserWarning, match="dequantised"):  # the fp8_skip layers
        resident_fp8 = FluxTransformer2DModel.from_pretrained(path, config=CFG, weight_dtype="fp8_e4m3", fp8_skip=SKIP)
        streamed_fp8 = FluxTransformer2DModel.from_pretrained(path, config=CFG, weight_dtype="fp8_e4m3", fp8_skip=SKIP,
                                                              host_blocks=["double_blocks.0", "single_blocks.0"])
    dequantised = _dequantised_file(tmp_path / "ref.safetensors", values, _file_of(path))
    ref = FluxTransformer2DModel.from_pretrained(dequantised, config=CFG)
    models = [dict(m.named_parameters()) for m in (model, streamed, ref, resident_fp8, streamed_fp8)]
    assert all(m.keys() == models[0].keys() for m in models)
    for name in models[0]:
        p, s, r, q, h = (m[name] for m in models)
        assert torch.equal(p._data.cpu(), r._data.cpu()) and torch.equal(s._data.cpu(), r._data.cpu()), name
        assert type(q) is type(h) and torch.equal(_codes(q._data), _codes(h._data)), name
        if isinstance(q, Fp8Weight):
            assert torch.equal(q.scale, h.scale), name
            assert torch.equal(q.dequantize()._data.cpu(), r._data.cpu()), name


def _file_of(path):
    return path if path.is_file() else path / "transformer" / "diffusion_pytorch_model.safetensors"


def test_bad_scales_are_refused_naming_the_key(tmp_path):
    w = torch.randn(6, 4)
    save_file({"a.weight": w.to(FP8), "a.scale_weight": torch.ones(3)}, tmp_path / "rows.safetensors")
    with pytest.raises(ValueError, match=r"'a\.scale_weight' has shape \(3,\), but the scale of the fp8 weight "
                                         r"\(6, 4\) must be one number .* or one per output row \(6,\) or \(6, 1\)"):
        stored_tensors([tmp_path / "rows.safetensors"])
    save_file({"a.weight": w.to(FP8), "a.scale_weight": torch.ones(6, 2, 1)}, tmp_path / "blocks.safetensors")
    with pytest.raises(ValueError, match="block-wise scales are not supported"):
        stored_tensors([tmp_path / "blocks.safetensors"])
    path, _ = _fp8_file(tmp_path, scaled=True)
    tensors = load_file(path)
    tensors["img_in.weight"] = tensors["img_in.weight"].float()  # a scale next to a weight that is not fp8
    save_file(tensors, tmp_path / "mixed.safetensors")
    with pytest.raises(ValueError, match=r"'img_in\.weight' is stored as torch\.float32, not float8_e4m3fn, but has "
                                         r"a scale 'img_in\.scale_weight'"):
        FluxTransformer2DModel.from_pretrained(tmp_path / "mixed.safetensors", config=CFG)


def test_the_trainer_trains_on_an_fp8_file(tmp_path):
    """model.path to an fp8_scaled diffusers folder with model.weight_dtype fp8_e4m3 (streamed blocks too):
    the trainer's model holds the file's codes."""
    from test_train_flux import SMALL, _config

    from flame.train import Trainer
    folder, _ = _fp8_file(tmp_path, scaled=True, layout="diffusers", cfg=SMALL)
    lines = []
    with pytest.warns(UserWarning, match="float8_e4m3fn: dequantised"):  # the full-precision layers
        trainer = Trainer(_config(tmp_path / "out", f"model.path={folder / 'transformer'}",
                                  "model.weight_dtype=fp8_e4m3", "train.offload=blocks", "train.steps=1"),
                          progress=False, log=lines.append)
    assert any("2 of 2 blocks streamed" in line for line in lines), lines
    assert isinstance(trainer.model.double_blocks[0].img_attn.qkv.weight, Fp8Weight)
    # a run on weights loaded so: test_train_flux.py's checkpoint test (fp8 and streamed blocks from a folder)


def test_sdxl_unet_fp8_files(tmp_path):
    """The SDXL UNet's loader too: fp8 codes kept, or dequantised into fp16."""
    pytest.importorskip("transformers")
    from tiny_sdxl import UNET

    from flame.models import SDXLUNet
    g = torch.Generator().manual_seed(0)
    tensors, values = {}, {}
    for key, shape in SDXLUNet.parameter_shapes(UNET).items():
        w = 0.1 * torch.randn(shape, generator=g)
        if len(shape) == 2 and key.endswith(".weight"):
            scale = w.abs().amax() / 448
            tensors[key], tensors[key.replace(".weight", ".scale_weight")] = (w / scale).to(FP8), scale
            values[key] = tensors[key].float() * scale
        else:
            tensors[key] = w
    (tmp_path / "unet").mkdir()
    save_file(tensors, tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel",
                                                                **UNET.to_diffusers()}))
    fp8 = SDXLUNet.from_pretrained(tmp_path, weight_dtype="fp8_e4m3")
    with pytest.warns(UserWarning, match=f"{len(values)} tensor"):
        half = SDXLUNet.from_pretrained(tmp_path, flame.float16)
    fp8_params, half_params = dict(fp8.named_parameters()), dict(half.named_parameters())
    for key, want in values.items():
        assert isinstance(fp8_params[key], Fp8Weight), key
        assert torch.equal(_codes(fp8_params[key]._data), _codes(tensors[key])), key
        assert torch.equal(half_params[key]._data.cpu(), want.half()), key
