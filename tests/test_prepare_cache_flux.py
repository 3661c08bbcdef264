"""scripts/prepare_cache.py on Flux.1: flame's encoders (``FluxFlameEncoders``) write the cache that
diffusers/transformers (``FluxDiffusersEncoders``, as FluxPipeline encodes) write, on a tiny random
Flux pipeline folder; the command line picks the family from ``--model``, and the Flux trainer trains
on what it writes; bad input is a clear error."""
import importlib.util
import pathlib

import numpy as np
import pytest

import flame
from flame.data import CacheSettings, LatentCache, build_or_refresh_cache, scan_dataset
from flame.io import save_safetensors
from flame.pipeline.flux import component_sources
from flame.train import Trainer, build_config
from helpers import TF32_TOL

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("PIL")
from tiny_flux import write_tiny_flux_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
LENGTH = 8  # T5 tokens per caption in these tests
# buckets of about 24^2 px in multiples of 16: 16x16, 32x16 and 16x32 (the tiny VAE halves each side)
BUCKETS = dict(resolution=24, min_side=16, max_side=32, bucket_step=16)
BUCKET_OPTIONS = ["--resolution", "24", "--min-side", "16", "--max-side", "32", "--bucket-step", "16"]


def _script():
    spec = importlib.util.spec_from_file_location("prepare_cache", ROOT / "scripts" / "prepare_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pc = _script()


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    return write_tiny_flux_pipeline(tmp_path_factory.mktemp("flux") / "dev")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Four captioned PNGs: two about square, two about 2:1 (two buckets of two)."""
    from PIL import Image
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    sizes = {"sq.png": ((20, 18), "the cat"), "sq2.png": ((17, 17), "a cat"), "wide.png": ((40, 19), ""),
             "wide2.png": ((36, 20), "the cat a cat")}
    for name, ((w, h), caption) in sizes.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(caption)
    return folder


def _rows(path):
    """{image name: {field: float32 array (1, ...)}} of the cache at ``path``, and the cache."""
    cache = LatentCache(path)
    return {pathlib.Path(s["source"]).name: {k: v.float().numpy() for k, v in cache.read([i]).items()}
            for i, s in enumerate(cache.samples)}, cache


def _encode(encoders, images, out):
    return _rows(build_or_refresh_cache(out, scan_dataset(images)[0].items, encoders,
                                        CacheSettings(text_dtype="fp32", **BUCKETS), val_samples=1, batch_size=2))


@pytest.fixture(scope="module")
def flame_cache(dev, images, tmp_path_factory):
    encoders = pc.FluxFlameEncoders(dev, "fp32", latents="mean", text_encoder_dtype="fp32",
                                    max_sequence_length=LENGTH)
    assert (encoders.text_len, encoders.text_dim, encoders.pooled_dim, encoders.latent_channels) == (LENGTH, 32, 12, 4)
    return _encode(encoders, images, tmp_path_factory.mktemp("caches") / "flame")


def test_flame_cache_equals_the_diffusers_encoded_cache(dev, images, flame_cache, tmp_path):
    encoders = pc.FluxDiffusersEncoders(dev, device="cpu", latents="mean", max_sequence_length=LENGTH)
    want, want_cache = _encode(encoders, images, tmp_path / "diffusers")
    got, cache = flame_cache
    assert (cache.latent_channels, cache.text_len, cache.text_dim, cache.pooled_dim) == (4, LENGTH, 32, 12)
    assert cache.meta["family"] == "flux" and cache.meta["bucket_step"] == 16
    assert (cache.meta["scaling_factor"], cache.meta["shift_factor"]) == (0.3611, 0.1159)
    assert sorted(cache.buckets) == [(8, 8), (8, 16)]  # unpacked latents (4, h, w), h and w even for 2x2 patches
    assert got["wide.png"]["latents"].shape == (1, 4, 8, 16) and got["sq.png"]["latents"].shape == (1, 4, 8, 8)
    np.testing.assert_array_equal(got["wide.png"]["time_ids"][0], [19, 40, 0, 1, 16, 32])  # 34x16, centred
    tol = TF32_TOL or dict(rtol=1e-5, atol=1e-5)
    assert sorted(got) == sorted(want)
    for name, sample in got.items():
        for field, value in sample.items():
            np.testing.assert_allclose(value, want[name][field], **tol, err_msg=f"{name} {field}")
    for mine, theirs in zip(cache.empty_prompt(), want_cache.empty_prompt()):  # for caption dropout
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), **tol)
    # the VAE's shift and scale are applied: the scaled latents are not the raw ones
    assert abs(float(np.mean(got["sq.png"]["latents"])) - float(np.mean(want["sq.png"]["latents"]))) < 1e-4

@pytest.mark.extended  # the cache itself: the parity test above

def test_command_line_builds_a_cache_the_flux_trainer_trains_on(dev, images, flame_cache, tmp_path):
    out = tmp_path / "cache"
    assert pc.main([str(out), "--images", str(images), "--model", str(dev), "--max-sequence-length", str(LENGTH),
                    "--latents", "mean", "--val-samples", "0", *BUCKET_OPTIONS]) == 0
    rows, cache = _rows(out)
    assert cache.meta["family"] == "flux" and cache.meta["model"] == str(dev)
    # text on disk is fp16 (the default); on a GPU the encoders run in bf16 (the default there)
    tol = dict(rtol=2e-3, atol=2e-3) if flame.is_interpreter() else dict(rtol=5e-2, atol=5e-2)
    want = flame_cache[0]
    for name, sample in rows.items():
        for field, value in sample.items():
            np.testing.assert_allclose(value, want[name][field], **tol, err_msg=f"{name} {field}")
    cfg = build_config({
        "model": {"path": str(dev), "config": str(dev)},  # config's default, "sdxl", is refused for a Flux path
        "data": {"cache_dir": str(out), "batch_size": 2, "caption_dropout": 0.5},
        "lora": {"rank": 2, "alpha": 4, "targets": "attn"},
        "train": {"steps": 2, "lr": 1e-2, "precision": "fp32", "seed": 3, "lr_scheduler": "constant"},
        "output": {"dir": str(tmp_path / "run"), "save_every": 0, "log_every": 1, "overwrite": True}})
    assert cfg.model.family == "flux"
    flame.manual_seed(3)
    result = Trainer(cfg, progress=False, log=lambda *a: None).train()
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    assert pathlib.Path(result["lora"]).is_file()


def test_a_single_file_transformer_takes_the_rest_from_base(dev, images, flame_cache, tmp_path):
    single = tmp_path / "flux1-tiny.safetensors"  # only its header is read: the family, the variant's config
    save_safetensors({"double_blocks.0.img_attn.qkv.weight": flame.zeros(6, 2)}, single)
    assert pc.default_sequence_length(component_sources(single, dev)) == 512  # dev: base's transformer config
    encoders = pc.FluxFlameEncoders(single, "fp32", latents="mean", text_encoder_dtype="fp32",
                                    max_sequence_length=LENGTH, base=dev, vae=dev / "vae")
    rows, cache = _encode(encoders, images, tmp_path / "single")
    assert cache.meta["model"] == str(single)
    for name, sample in rows.items():
        for field, value in sample.items():
            np.testing.assert_array_equal(value, flame_cache[0][name][field], err_msg=f"{name} {field}")


def _fails(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        pc.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert match in err, err


def test_bad_input_is_a_clear_error(dev, images, tmp_path, capsys):
    single = tmp_path / "flux1-dev.safetensors"
    save_safetensors({"double_blocks.0.img_attn.qkv.weight": flame.zeros(6, 2)}, single)
    sdxl = tmp_path / "sdxl.safetensors"
    save_safetensors({"model.diffusion_model.input_blocks.0.0.weight": flame.zeros(2, 2)}, sdxl)
    base = [str(tmp_path / "out"), "--images", str(images)]
    _fails(capsys, [*base, "--model", str(single)], "holds the transformer only: give a Flux pipeline folder")
    _fails(capsys, [*base, "--model", str(single), "--clip", str(tmp_path / "nope.safetensors"), "--base", str(dev)],
           "nope.safetensors does not exist")
    _fails(capsys, [*base, "--model", str(dev), "--max-tokens", "150"], "--max-tokens is an SDXL option")
    _fails(capsys, [*base, "--model", str(dev), "--max-sequence-length", "600"], "must be in [1, 512]")
    _fails(capsys, [*base, "--model", str(dev), "--bucket-step", "24"], "multiple of 16 for flux")
    _fails(capsys, [*base, "--model", str(dev), "--bucket-step", "48", "--min-side", "40"],
           "multiples of --bucket-step 48")
    _fails(capsys, [*base, "--model", str(single), "--base", str(dev), "--t5", str(dev / "text_encoder_2"),
                    "--encoders", "diffusers"], "single files need --encoders flame")
    _fails(capsys, [*base, "--model", str(sdxl), "--t5", str(dev), "--max-sequence-length", "8"],
           "--t5, --max-sequence-length: Flux options")
    _fails(capsys, [*base, "--model", str(sdxl), "--bucket-step", "16"], "multiple of 64 for sdxl")
    _fails(capsys, [*base, "--model", str(images)], "neither an SDXL nor a Flux.1 checkpoint")
    _fails(capsys, [*base, "--model", str(tmp_path / "missing")], "does not exist")
    with pytest.raises(SystemExit, match=r"not a Flux\.1 checkpoint folder in diffusers layout \(lacks vae, "):
        pc.FluxDiffusersEncoders(images, device="cpu")
    assert not (tmp_path / "out").exists()
