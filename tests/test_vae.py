"""SDXL's VAE: parity with diffusers' AutoencoderKL on the tiny config (encode, decode, the scaled
helpers, the tiled paths against diffusers' tiled ones), state-dict names and the full-config
shapes, the LDM name map and single-file loading, and the errors for bad inputs and checkpoints.

``write_tiny_vae(folder)`` is importable by other tests (a seeded tiny diffusers VAE folder).
Through Triton's interpreter a tiny encode is about 60 kernel launches and a decode about 75, so
each test runs as few passes as it can and checks everything each pass gives.
"""
import dataclasses
import math

import pytest
import torch

import flame
from flame.models.vae import (
    AutoencoderKL,
    AutoencoderKLConfig,
    DiagonalGaussian,
    checkpoint_index,
    diffusers_to_ldm_vae,
    ldm_to_diffusers_vae,
)
from helpers import DEVICE

TINY = AutoencoderKLConfig.tiny()
# fp32 GEMMs and convolutions run as tf32 on the GPU; exact fp32 products in the interpreter
RTOL = 1e-5 if flame.is_interpreter() else 2e-2
SDXL_CONFIG_JSON = {  # stabilityai/sdxl-vae's vae/config.json
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.20.0.dev0", "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.13025, "up_block_types": ["UpDecoderBlock2D"] * 4,
}


def write_tiny_vae(folder):
    """Save a seeded diffusers AutoencoderKL of ``AutoencoderKLConfig.tiny()`` into ``folder`` (a
    ``vae/`` folder: config.json and diffusion_pytorch_model.safetensors); returns the model (eval).
    Norm weights and all biases are perturbed so that a swapped weight and bias shows."""
    import diffusers
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**TINY.to_diffusers()).eval()
    with torch.no_grad():
        for p in vae.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    vae.save_pretrained(folder)
    return vae


def _rel(got, ref):
    got = got.to_torch() if isinstance(got, flame.Tensor) else got
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _f(t):
    return flame.from_torch(t.contiguous().to(DEVICE))


def _images(*shape, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(diffusers VAE, flame VAE loaded from the pipeline folder holding it, that folder)."""
    pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("vae_pipeline")
    vae = write_tiny_vae(root / "vae")
    return vae, AutoencoderKL.from_pretrained(root), root


# ---- parity with diffusers ------------------------------------------------------------------------

def test_encode_decode_and_scaled_helpers_match_diffusers(reference):
    vae, model, _ = reference
    assert model.config == TINY and model.dtype == flame.float32
    got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert got == [(k, tuple(v.shape)) for k, v in vae.state_dict().items()]  # names, shapes and order
    assert got == list(AutoencoderKL.parameter_shapes(TINY).items())

    x = _images(2, 3, 8, 8)
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post = vae.encode(x).latent_dist
        decoded = vae.decode(post.mean).sample
    with flame.no_grad():
        dist = model.encode(_f(x))
        for name in ("mean", "logvar", "std"):
            assert _rel(getattr(dist, name), getattr(post, name)) < RTOL, name
        assert dist.mode() is dist.mean
        assert _rel(dist.sample(_f(noise)), post.mean + post.std * noise) < RTOL
        flame.manual_seed(3)
        drawn = dist.sample().to_torch()
        flame.manual_seed(3)
        assert torch.equal(dist.sample().to_torch(), drawn) and not torch.equal(drawn, dist.mean.to_torch())

        images = model.decode(_f(post.mean))
        assert _rel(images, decoded) < RTOL
        assert images.to_torch().is_contiguous(memory_format=torch.channels_last)

        # the diffusion model's latents: (z - shift) * scale and back, with a shift so both terms
        # show (batch 1: batching is checked above)
        shift, scale = 0.25, TINY.scaling_factor
        model.config = dataclasses.replace(TINY, shift_factor=shift)
        try:
            scaled = model.encode_latents(_f(x[:1]), noise=_f(noise[:1]))
            want = ((post.mean + post.std * noise - shift) * scale)[:1]
            assert _rel(scaled, want) < RTOL
            with torch.no_grad():
                ref_images = vae.decode(want / scale + shift).sample
            assert _rel(model.decode_latents(_f(want)), ref_images) < RTOL
        finally:
            model.config = TINY


@pytest.mark.extended  # CI: the untiled paths against diffusers and when the helpers tile (the tests around this one)
def test_tiled_paths_match_diffusers_tiled_paths(reference):
    """8-pixel tiles (4 latent pixels) overlapping by a quarter: a 12x6 image is encoded as 2x1
    tiles (the second 6 pixels high), 6x6 latents decoded as 2x2 tiles (the last row and column 3
    latent pixels: blended with the tile above after that one was blended with its left neighbour);
    diffusers' seams are blended over 1 latent / 2 image pixels, and so must flame's."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    vae, model, _ = reference
    x = _images(1, 3, 12, 6, seed=4)
    z = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(5))
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 8, 4
    try:
        with torch.no_grad():
            post = DiagonalGaussianDistribution(vae._tiled_encode(x))
            ref_images = vae.tiled_decode(z / TINY.scaling_factor).sample
    finally:
        vae.disable_tiling()
    with torch.no_grad():
        untiled = vae._decode(z / TINY.scaling_factor).sample
    assert _rel(untiled, ref_images) > 1e-2  # tiling changes the output: the comparison below means something
    with flame.no_grad():
        dist = model.tiled_encode(_f(x), tile=8)
        assert _rel(dist.mean, post.mean) < RTOL and _rel(dist.logvar, post.logvar) < RTOL
        images = model.decode_latents(_f(z), tile=8)  # larger than one tile: tiled
        assert _rel(images, ref_images) < RTOL
        assert images.to_torch().is_contiguous(memory_format=torch.channels_last)


def test_helpers_tile_only_when_asked_and_larger_than_a_tile(reference, monkeypatch):
    """Which path encode_latents / decode_latents take (the networks replaced by cheap stand-ins)."""
    _, model, _ = reference
    calls = []
    monkeypatch.setattr(model, "_moments", lambda x: calls.append(("enc", x.shape[2])) or
                        flame.zeros(x.shape[0], 8, x.shape[2] // 2, x.shape[3] // 2))
    monkeypatch.setattr(model, "_decode", lambda z: calls.append(("dec", z.shape[2])) or
                        flame.zeros(z.shape[0], 3, 2 * z.shape[2], 2 * z.shape[3]))
    with flame.no_grad():
        model.encode_latents(flame.zeros(1, 3, 32, 32), sample=False)  # default: never tiled
        model.encode_latents(flame.zeros(1, 3, 16, 16), sample=False, tile=True)  # fits sample_size 16
        model.encode_latents(flame.zeros(1, 3, 24, 16), sample=False, tile=True)  # 16-pixel tiles: 2x2
        model.decode_latents(flame.zeros(1, 4, 8, 8), tile=True)  # 16 pixels fit the 16-pixel tile
        model.decode_latents(flame.zeros(1, 4, 6, 4), tile=8)  # 8-pixel tiles at latent stride 3: 2x2
        model.decode_latents(flame.zeros(1, 4, 16, 16), tile=False)
        model.decode_latents(flame.zeros(1, 4, 16, 16))  # default: never tiled
    assert calls == [("enc", 32), ("enc", 16)] + [("enc", 16)] * 2 + [("enc", 12)] * 2 + [("dec", 8)] + \
        [("dec", 4)] * 2 + [("dec", 3)] * 2 + [("dec", 16)] * 2


# ---- names, shapes and checkpoints ----------------------------------------------------------------

def _to_ldm(state_dict, prefix="first_stage_model."):
    """A diffusers-named VAE state dict in LDM names, the attention projections as 1x1 convolutions."""
    out = {}
    for k, v in state_dict.items():
        name = diffusers_to_ldm_vae(k, TINY)
        out[prefix + name] = v[..., None, None].contiguous() if ".attn_1." in name and v.ndim == 2 else v
    return out


def test_ldm_single_file_loads_the_same_weights(reference, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    vae, model, _ = reference
    sd = vae.state_dict()
    ldm = _to_ldm(sd)
    assert ldm["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (16, 16, 1, 1)
    ldm["model.diffusion_model.out.2.weight"] = torch.zeros(2, 2)  # other parts of a full checkpoint
    ldm["first_stage_model.loss.logvar"] = torch.zeros(1)  # the training loss's, skipped
    safetensors_torch.save_file(ldm, tmp_path / "sdxl.safetensors")
    loaded = AutoencoderKL.from_pretrained(tmp_path / "sdxl.safetensors", config=TINY)
    for (k, v), (k2, v2) in zip(loaded.state_dict().items(), model.state_dict().items(), strict=True):
        v = v.to_torch().cpu()
        assert k == k2 and torch.equal(v, v2.to_torch().cpu()) and torch.equal(v, sd[k])

    # a standalone LDM VAE file (no prefix) and diffusers' pre-0.14 attention names index the same tensors
    safetensors_torch.save_file(_to_ldm(sd, prefix=""), tmp_path / "standalone.safetensors")
    index = checkpoint_index([tmp_path / "standalone.safetensors"], TINY)
    prefixed = checkpoint_index([tmp_path / "sdxl.safetensors"], TINY)
    assert {k: (s.key, s.shape) for k, s in index.items()} == \
        {k: (s.key.removeprefix("first_stage_model."), s.shape) for k, s in prefixed.items()}
    legacy = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    old = {}
    for k, v in sd.items():
        for new, name in legacy.items():
            k = k.replace(f".attentions.0.{new}.", f".attentions.0.{name}.")
        old[k] = v.contiguous()
    safetensors_torch.save_file(old, tmp_path / "legacy.safetensors")
    assert set(checkpoint_index([tmp_path / "legacy.safetensors"], TINY)) == set(sd)


def test_sdxl_shapes_and_config_match_diffusers():
    diffusers = pytest.importorskip("diffusers")
    sdxl = AutoencoderKLConfig.sdxl()
    assert AutoencoderKLConfig.from_diffusers(SDXL_CONFIG_JSON) == sdxl
    assert AutoencoderKLConfig.from_diffusers(TINY.to_diffusers()) == TINY
    # the optional parts off, and three levels of two resnets
    bare = dataclasses.replace(TINY, block_out_channels=(8, 16, 16), layers_per_block=2, use_quant_conv=False,
                               use_post_quant_conv=False, mid_block_add_attention=False)
    for cfg in (sdxl, bare):
        with torch.device("meta"):  # no memory
            vae = diffusers.AutoencoderKL(**cfg.to_diffusers())
        assert AutoencoderKLConfig.from_diffusers(dict(vae.config)) == cfg
        shapes = AutoencoderKL.parameter_shapes(cfg)
        assert list(shapes.items()) == [(k, tuple(v.shape)) for k, v in vae.state_dict().items()]
    shapes = AutoencoderKL.parameter_shapes(sdxl)
    assert (len(shapes), sum(math.prod(s) for s in shapes.values())) == (248, 83_653_863)
    assert sdxl.downsample_factor == 8 and TINY.downsample_factor == 2


@pytest.mark.parametrize("cfg", [TINY, AutoencoderKLConfig.sdxl()], ids=["tiny", "sdxl"])
def test_ldm_name_map_round_trips(cfg):
    names = list(AutoencoderKL.parameter_shapes(cfg))
    ldm = [diffusers_to_ldm_vae(k, cfg) for k in names]
    assert len(set(ldm)) == len(ldm)
    assert [ldm_to_diffusers_vae(k, cfg) for k in ldm] == names
    assert [ldm_to_diffusers_vae("first_stage_model." + k, cfg) for k in ldm] == names


def test_ldm_name_map_known_sdxl_names_and_unknown_ones():
    for diffusers_name, ldm_name in [
        ("encoder.conv_in.weight", "encoder.conv_in.weight"),
        ("encoder.down_blocks.1.resnets.0.conv_shortcut.bias", "encoder.down.1.block.0.nin_shortcut.bias"),
        ("encoder.down_blocks.2.downsamplers.0.conv.weight", "encoder.down.2.downsample.conv.weight"),
        ("encoder.mid_block.resnets.1.norm2.weight", "encoder.mid.block_2.norm2.weight"),
        ("encoder.mid_block.attentions.0.group_norm.bias", "encoder.mid.attn_1.norm.bias"),
        ("decoder.mid_block.attentions.0.to_out.0.weight", "decoder.mid.attn_1.proj_out.weight"),
        ("encoder.conv_norm_out.weight", "encoder.norm_out.weight"),
        ("decoder.up_blocks.0.resnets.2.conv1.weight", "decoder.up.3.block.2.conv1.weight"),
        ("decoder.up_blocks.2.upsamplers.0.conv.bias", "decoder.up.1.upsample.conv.bias"),
        ("decoder.up_blocks.3.resnets.0.conv_shortcut.weight", "decoder.up.0.block.0.nin_shortcut.weight"),
        ("quant_conv.weight", "quant_conv.weight"),
        ("post_quant_conv.bias", "post_quant_conv.bias"),
    ]:
        assert diffusers_to_ldm_vae(diffusers_name) == ldm_name
        assert ldm_to_diffusers_vae(ldm_name) == diffusers_name
        assert ldm_to_diffusers_vae("first_stage_model." + ldm_name) == diffusers_name
    for fn, key in [(ldm_to_diffusers_vae, "encoder.down.0.block.0.norm3.weight"),
                    (ldm_to_diffusers_vae, "decoder.up.4.block.0.conv1.weight"),  # SDXL has 4 levels
                    (ldm_to_diffusers_vae, "encoder.mid.attn_1.proj.weight"),
                    (ldm_to_diffusers_vae, "model.diffusion_model.out.2.weight"),
                    (diffusers_to_ldm_vae, "decoder.mid_block.attentions.0.to_out.1.weight"),
                    (diffusers_to_ldm_vae, "encoder.conv_in.running_mean")]:
        with pytest.raises(ValueError, match=r"no (LDM|diffusers) name for|out of range"):
            fn(key)


# ---- errors --------------------------------------------------------------------------------------

def test_bad_inputs_raise_before_computing(reference):
    _, model, _ = reference
    for call, message in [
        (lambda: model.encode(flame.zeros(1, 3, 8, 7)), "height and width must be positive multiples of 2, got 8x7"),
        (lambda: model.encode(flame.zeros(1, 4, 8, 8)), r"images must be \(B, 3, H, W\), got shape \(1, 4, 8, 8\)"),
        (lambda: model.encode_latents(flame.zeros(3, 8, 8)), r"images must be \(B, 3, H, W\)"),
        (lambda: model.decode(flame.zeros(1, 3, 4, 4)), r"latents must be \(B, 4, H, W\)"),
        (lambda: model.decode_latents(flame.zeros(1, 4, 0, 4)), "latents height and width must be positive, got 0x4"),
        (lambda: model.tiled_decode(flame.zeros(1, 4, 4, 4), tile=7), "tile must be a positive multiple of 2"),
        (lambda: model.tiled_encode(flame.zeros(1, 3, 8, 8), tile=8, overlap=1.0), r"overlap must be .* \[0, 1\)"),
        (lambda: model.decode_latents(flame.zeros(1, 4, 4, 4), tile=0), "tile must be a positive multiple"),
        (lambda: DiagonalGaussian(flame.zeros(1, 8, 2, 2)).sample(flame.zeros(1, 4, 2, 3)),
         r"noise must have the latents' shape \(1, 4, 2, 2\)"),
        (lambda: AutoencoderKL(TINY, dtype=flame.float16), "force_upcast=True: it overflows in float16"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match="images must be a flame Tensor, got Tensor"):
        model.encode(torch.zeros(1, 3, 8, 8))
    with pytest.raises(TypeError, match="images must be floating point"):
        model.encode(flame.zeros(1, 3, 8, 8, dtype=flame.int64))


def test_bad_configs_and_checkpoints_raise(reference, tmp_path):
    vae, _, root = reference
    for key, value in [("down_block_types", ["DownEncoderBlock2D", "DownBlock2D"]), ("act_fn", "gelu"),
                       ("latents_mean", [0.0] * 4), ("some_new_option", 1), ("sample_size", [16, 32])]:
        with pytest.raises(ValueError, match=f"unsupported VAE config: {key}|unknown key '{key}'"):
            AutoencoderKLConfig.from_diffusers({**TINY.to_diffusers(), key: value})
    with pytest.raises(ValueError, match=r"norm_num_groups=3 must divide every block width \(8, 16\)"):
        dataclasses.replace(TINY, norm_num_groups=3)
    with pytest.raises(ValueError, match="the config given differs"):
        AutoencoderKL.from_pretrained(root, config=AutoencoderKLConfig.sdxl())

    flame.io.save_safetensors({k: v.contiguous() for k, v in vae.state_dict().items()}, tmp_path / "tiny.safetensors")
    with pytest.raises(RuntimeError, match=r"(?s)VAE from .*tiny.safetensors.*Missing key\(s\) \(\d+\).*"
                                           r"size mismatch for encoder.conv_in.weight"):
        AutoencoderKL.from_pretrained(tmp_path / "tiny.safetensors")  # single file: SDXL's config by default
    unet_like = {"conv_in.weight": torch.zeros(8, 4, 3, 3), "down_blocks.0.resnets.0.conv1.weight": torch.zeros(1)}
    flame.io.save_safetensors(unet_like, tmp_path / "unet.safetensors")
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\) \(124\).*Unexpected key\(s\) \(2\): \"conv_in"):
        AutoencoderKL.from_pretrained(tmp_path / "unet.safetensors", config=TINY)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoencoderKL.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        AutoencoderKL.from_pretrained(tmp_path)
