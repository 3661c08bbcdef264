"""Flux.1's VAE: ``AutoencoderKLConfig.flux()`` against the hub's and diffusers' Flux VAE config,
and a tiny Flux-shaped VAE (``tiny_flux()``: 16 latent channels, no quant convs, shifted latents)
loaded from a diffusers folder, from Black Forest Labs' single-file names (``ae.safetensors``) and
from a diffusers-named single file, compared with diffusers' AutoencoderKL on the diffusion
model's latents, untiled and tiled; single-file config inference and config mismatches.

Through Triton's interpreter a tiny encode is about 60 kernel launches and a decode about 75, so
the weights of every loading path are compared once and the networks run on two of them.
"""
import json

import pytest
import torch
from test_vae import RTOL, TINY, _f, _images, _rel, _to_ldm, write_tiny_vae

import flame
from flame.models.vae import AutoencoderKL, AutoencoderKLConfig, single_file_config

FLUX = AutoencoderKLConfig.flux()
TINY_FLUX = AutoencoderKLConfig.tiny_flux()
FLUX_CONFIG_JSON = {  # black-forest-labs/FLUX.1-dev's vae/config.json
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0.dev0", "_name_or_path": "../checkpoints/flux-dev",
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 16, "latents_mean": None, "latents_std": None,
    "layers_per_block": 2, "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False, "use_quant_conv": False,
}


def test_flux_config_matches_diffusers_flux_vae(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    assert AutoencoderKLConfig.from_diffusers(FLUX_CONFIG_JSON) == FLUX
    assert (FLUX.latent_channels, FLUX.scaling_factor, FLUX.shift_factor, FLUX.downsample_factor) == (16, 0.3611,
                                                                                                      0.1159, 8)
    assert not FLUX.use_quant_conv and not FLUX.use_post_quant_conv and FLUX.mid_block_add_attention
    with torch.device("meta"):  # no memory
        vae = diffusers.AutoencoderKL(**FLUX.to_diffusers())
    vae.save_config(tmp_path)  # the config.json save_pretrained writes: every key diffusers 0.42 has
    assert AutoencoderKLConfig.from_diffusers(json.loads((tmp_path / "config.json").read_text())) == FLUX
    shapes = [(k, tuple(v.shape)) for k, v in vae.state_dict().items()]
    assert list(AutoencoderKL.parameter_shapes(FLUX).items()) == shapes
    assert AutoencoderKLConfig.from_diffusers(TINY_FLUX.to_diffusers()) == TINY_FLUX
    with pytest.raises(ValueError, match="force_upcast=True"):
        AutoencoderKL(TINY_FLUX, dtype=flame.float16)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(diffusers VAE of ``tiny_flux()``, flame VAE loaded from the pipeline folder holding it, that
    folder, {file kind: single file of the same weights}): the kinds are "bfl" (ae.safetensors'
    names: LDM without a prefix, attention projections as 1x1 convolutions) and "diffusers"."""
    diffusers = pytest.importorskip("diffusers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root = tmp_path_factory.mktemp("flux_vae_pipeline")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**TINY_FLUX.to_diffusers()).eval()
    with torch.no_grad():  # norm weights and biases perturbed so that a swapped weight and bias shows
        for p in vae.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    vae.save_pretrained(root / "vae")
    sd = vae.state_dict()
    assert TINY_FLUX.block_out_channels == TINY.block_out_channels  # _to_ldm numbers TINY's levels
    files = {"bfl": root / "ae.safetensors", "diffusers": root / "vae.safetensors"}
    safetensors_torch.save_file(_to_ldm(sd, prefix=""), files["bfl"])
    safetensors_torch.save_file({k: v.contiguous() for k, v in sd.items()}, files["diffusers"])
    return vae, AutoencoderKL.from_pretrained(root), root, files


def test_single_files_load_the_folder_weights_and_infer_flux(reference):
    vae, model, _, files = reference
    assert model.config == TINY_FLUX and model.quant_conv is None and model.post_quant_conv is None
    sd = vae.state_dict()
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == [(k, tuple(v.shape)) for k, v in sd.items()]
    bfl = flame.io.stored_shapes(files["bfl"])
    for name, shape in [("encoder.mid.attn_1.q.weight", (16, 16, 1, 1)),
                        ("decoder.mid.attn_1.proj_out.weight", (16, 16, 1, 1)),
                        ("encoder.conv_out.weight", (32, 16, 3, 3)), ("encoder.norm_out.bias", (16,)),
                        ("encoder.down.0.downsample.conv.weight", (8, 8, 3, 3)),
                        ("decoder.up.1.upsample.conv.weight", (16, 16, 3, 3)),  # BFL's up.0 is the narrowest level
                        ("decoder.up.0.block.0.nin_shortcut.weight", (8, 16, 1, 1)),
                        ("decoder.conv_in.weight", (16, 16, 3, 3))]:
        assert tuple(bfl[name]) == shape, name
    assert not any("quant_conv" in k for k in bfl)
    for kind, file in files.items():
        assert single_file_config([file]) == FLUX, kind  # 16 latent channels, no quant_conv: Flux.1's
        loaded = AutoencoderKL.from_pretrained(file, config=TINY_FLUX)
        for (k, v), (k2, v2) in zip(loaded.state_dict().items(), model.state_dict().items(), strict=True):
            v = v.to_torch().cpu()
            assert k == k2 and torch.equal(v, v2.to_torch().cpu()) and torch.equal(v, sd[k]), (kind, k)
    # without a config a single file gets Flux.1's (full size here: every shape differs, no quant_conv is missing)
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder.conv_in.weight: the checkpoint has shape "
                                           r"\(8, 3, 3, 3\), the model \(128, 3, 3, 3\)") as error:
        AutoencoderKL.from_pretrained(files["bfl"])
    assert "quant_conv" not in str(error.value)


def test_sdxl_single_files_still_default_to_sdxl(tmp_path):
    pytest.importorskip("diffusers")
    sd = write_tiny_vae(tmp_path / "vae").state_dict()
    flame.io.save_safetensors({k: v.contiguous() for k, v in sd.items()}, tmp_path / "sdxl_vae.safetensors")
    assert single_file_config([tmp_path / "sdxl_vae.safetensors"]) == AutoencoderKLConfig.sdxl()
    flame.io.save_safetensors(_to_ldm(sd), tmp_path / "sdxl.safetensors")  # a full checkpoint's first_stage_model.
    assert single_file_config([tmp_path / "sdxl.safetensors"]) == AutoencoderKLConfig.sdxl()
    assert AutoencoderKL.from_pretrained(tmp_path / "sdxl.safetensors", config=TINY).config == TINY


def test_scaled_latents_match_diffusers(reference):
    """encode_latents(sample=False) = (mode - shift) * scaling and decode_latents(z) = decode(z / scaling + shift),
    on the folder-loaded model."""
    vae, model, _, _ = reference
    x = _images(2, 3, 8, 6)
    scale, shift = TINY_FLUX.scaling_factor, TINY_FLUX.shift_factor
    with torch.no_grad():
        want = (vae.encode(x).latent_dist.mode() - shift) * scale
        images = vae.decode(want / scale + shift).sample
    assert want.shape == (2, 16, 4, 3)
    with flame.no_grad():
        assert _rel(model.encode_latents(_f(x), sample=False), want) < RTOL
        got = model.decode_latents(_f(want))
        assert _rel(got, images) < RTOL
        assert got.to_torch().is_contiguous(memory_format=torch.channels_last)

@pytest.mark.extended  # tiling: tests/test_vae.py

def test_tiled_scaled_latents_match_diffusers_tiling(reference):
    """8-pixel tiles overlapping by a quarter (as in test_vae's tiled test) on the model loaded from
    BFL's single file: a 12x6 image encoded as 2x1 tiles, 6x6 latents decoded as 2x2 tiles."""
    vae, _, _, files = reference
    model = AutoencoderKL.from_pretrained(files["bfl"], config=TINY_FLUX)
    x = _images(1, 3, 12, 6, seed=4)
    z = torch.randn(1, 16, 6, 6, generator=torch.Generator().manual_seed(5))
    scale, shift = TINY_FLUX.scaling_factor, TINY_FLUX.shift_factor
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 8, 4
    try:
        with torch.no_grad():
            want = (vae.encode(x).latent_dist.mode() - shift) * scale
            images = vae.decode(z / scale + shift).sample
    finally:
        vae.disable_tiling()
    with torch.no_grad():
        assert _rel(vae.decode(z / scale + shift).sample, images) > 1e-2  # tiling shows in the output
    with flame.no_grad():
        assert _rel(model.encode_latents(_f(x), sample=False, tile=8), want) < RTOL
        assert _rel(model.decode_latents(_f(z), tile=8), images) < RTOL


def test_config_and_file_mismatches_raise(reference, tmp_path):
    _, _, root, files = reference
    for cfg in (FLUX, TINY):
        with pytest.raises(ValueError, match="the config given differs"):
            AutoencoderKL.from_pretrained(root, config=cfg)
    # SDXL-shaped config for a Flux file: its quant convs are missing, its conv_out too narrow
    with pytest.raises(RuntimeError, match=r"(?s)VAE from .*ae.safetensors.*Missing key\(s\) \(4\): "
                                           r"\"quant_conv.weight\".*size mismatch for encoder.conv_out.weight: the "
                                           r"checkpoint has shape \(32, 16, 3, 3\), the model \(8, 16, 3, 3\)"):
        AutoencoderKL.from_pretrained(files["bfl"], config=TINY)
    # Flux-shaped config for an SDXL file: its quant convs are unexpected
    sdxl = {k: torch.zeros(shape) for k, shape in AutoencoderKL.parameter_shapes(TINY).items()}
    flame.io.save_safetensors(sdxl, tmp_path / "sdxl_vae.safetensors")
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) \(4\): [^\n]*\"quant_conv.weight\""):
        AutoencoderKL.from_pretrained(tmp_path / "sdxl_vae.safetensors", config=TINY_FLUX)
