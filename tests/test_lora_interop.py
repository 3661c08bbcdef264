"""LoRA files flame writes load into diffusers and reproduce flame's output (tiny SDXL UNet, fp32).

flame's UNet gets adapters with non-zero B in two groups: the mid block's attention projections
at rank 2 and the other 80 at rank 4, alpha 8, so rank and alpha (!= rank) per layer must reach the
file. A diffusers UNet of the same weights loads the saved file and must give flame's output:

- PEFT/diffusers file (mid alpha 1: the metadata's rank and alpha patterns): through
  ``UNet2DConditionModel.load_lora_adapter`` and through what ``StableDiffusionXLPipeline.load_lora_weights``
  does for the UNet (``lora_state_dict``, then ``load_lora_into_unet``);
- kohya file (mid alpha 8): through the latter, i.e. diffusers' kohya-to-diffusers conversion.
  One alpha for all layers, as sd-scripts and flame's trainer write them: diffusers 0.42 drops a
  per-layer alpha of a kohya attention LoRA (the conversion names its alpha_pattern entries
  "...attn1.processor.to_q_lora.down.weight", which match no module), so that is not checked.
"""
import copy
import importlib

import pytest
import torch

import flame
import flame.io
from flame.models import SDXLUNet, SDXLUNetConfig
from flame.nn.lora import lora_modules
from helpers import DEVICE

TINY = SDXLUNetConfig.tiny()
RTOL = 1e-4 if flame.is_interpreter() else 2e-2  # fp32 GEMMs run as tf32 on the GPU
MID = r"re:mid_block\..*\.(to_q|to_k|to_v|to_out\.0)"
ALL_ATTN = 88  # 11 transformer blocks x 2 attentions x 4 projections
MID_ATTN = 8


def _rel(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(1, TINY.in_channels, 8, 8, generator=g),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 8, TINY.cross_attention_dim, generator=g),
            "text_embeds": torch.randn(1, TINY.pooled_dim, generator=g),
            "time_ids": torch.tensor([[768.0, 1152, 16, 32, 1024, 1024]])}


def _run_diffusers(unet, inp):
    added = {"text_embeds": inp["text_embeds"], "time_ids": inp["time_ids"]}
    with torch.no_grad():
        return unet(inp["sample"], inp["timestep"], inp["encoder_hidden_states"], added_cond_kwargs=added).sample


@pytest.fixture(scope="module")
def unets(tmp_path_factory):
    """(diffusers UNet, flame UNet of the same weights with adapters)."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    if not hasattr(importlib.import_module("diffusers.loaders.lora_base"), "LORA_ADAPTER_METADATA_KEY"):
        pytest.skip("this diffusers ignores lora_adapter_metadata (the alpha of PEFT files): 0.34 or later needed")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**TINY.to_diffusers()).eval()
    root = tmp_path_factory.mktemp("lora_interop")
    safetensors_torch.save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, root / "unet.safetensors")

    model = SDXLUNet.from_pretrained(root / "unet.safetensors", config=TINY)
    model.requires_grad_(False)
    assert len(flame.nn.inject_lora(model, MID, rank=2)) == MID_ATTN  # alpha set per test
    assert len(flame.nn.inject_lora(model, "attn", rank=4, alpha=8)) == ALL_ATTN - MID_ATTN
    for _, m in lora_modules(model):
        flame.nn.init.normal_(m.lora_B, 0.0, 0.3)  # B = 0 would make every adapter a no-op
    return unet, model


def _load_adapter(unet, path):
    # use_safetensors: without it (or weight_name) diffusers 0.42 reads a file path through its
    # pickle branch, which drops the safetensors metadata and with it alpha (then alpha = rank)
    unet.load_lora_adapter(str(path), prefix="unet", use_safetensors=True)


def _load_weights(unet, path):
    """What ``StableDiffusionXLPipeline.load_lora_weights`` does for the UNet (no pipeline needed)."""
    from diffusers import StableDiffusionXLPipeline
    sd, alphas, metadata = StableDiffusionXLPipeline.lora_state_dict(str(path), unet_config=unet.config,
                                                                   return_lora_metadata=True)
    StableDiffusionXLPipeline.load_lora_into_unet(sd, alphas, unet, metadata=metadata)


@pytest.mark.parametrize("fmt, mid_alpha, loaders", [("peft", 1.0, (_load_adapter, _load_weights)),
                                                     pytest.param("kohya", 8.0, (_load_weights,),
                                                                  marks=pytest.mark.extended)],  # test_lora.py: kohya
                         ids=["peft", "kohya"])
def test_saved_lora_reproduces_flame_output_in_diffusers(unets, tmp_path, fmt, mid_alpha, loaders):
    base, model = unets
    for name, m in lora_modules(model):
        if name.startswith("mid_block."):
            m.alpha = mid_alpha
    inp = _inputs()
    with flame.no_grad():
        out = model(*(flame.from_torch(inp[k].to(DEVICE)) for k in inp)).to_torch()
    path = tmp_path / f"lora_{fmt}.safetensors"
    flame.io.save_lora(model, path, format=fmt)
    if fmt == "kohya":  # the names kohya's sd-scripts write for SDXL: the original (SGM) layout
        assert "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.alpha" in flame.io.load_safetensors(path)
    no_adapter = _run_diffusers(base, inp)

    for load in loaders:
        unet = copy.deepcopy(base)
        load(unet, path)
        layers = {n: m for n, m in unet.named_modules() if getattr(m, "lora_A", None)}
        assert len(layers) == ALL_ATTN, load.__name__
        scales = {n: next(iter(m.scaling.values())) for n, m in layers.items()}
        assert {s for n, s in scales.items() if n.startswith("mid_block.")} == {mid_alpha / 2}, load.__name__
        assert {s for n, s in scales.items() if not n.startswith("mid_block.")} == {8 / 4}, load.__name__
        ref = _run_diffusers(unet, inp)
        assert _rel(out, ref) < RTOL, load.__name__
        assert _rel(no_adapter, ref) > 0.1, load.__name__  # the adapters change diffusers' output
