"""Flux.1 text-to-image on flame: the text encoders and the pipeline against diffusers' FluxPipeline on
a tiny random checkpoint (dev-like and schnell-like, true CFG), ``flame-sample`` on a Flux folder and
on single files, LoRA strengths, and bad input."""
import json

import numpy as np
import pytest
import torch

import flame
from flame.diffusion.samplers import make_sampler
from flame.models.flux_text import FluxTextEncoders
from flame.pipeline.cli import main as sample_main
from flame.pipeline.flux import FluxPipeline, decode, denoise, encode_prompts

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from test_pipeline import no_model_loads, sample_error  # noqa: E402, F401 (a fixture)
from tiny_flux import write_tiny_flux_pipeline  # noqa: E402

RTOL = 1e-5 if flame.is_interpreter() else 2e-2  # GPU: fp32 GEMMs run as tf32
LENGTH = 12  # T5 tokens per prompt in these tests


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    return write_tiny_flux_pipeline(tmp_path_factory.mktemp("flux") / "dev")


@pytest.fixture(scope="module")
def pipe(dev):
    return FluxPipeline.from_pretrained(dev, dtype=flame.float32)


def reference(folder):
    ref = diffusers.FluxPipeline.from_pretrained(folder, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


def flame_noise(shape, seed=0):
    """flame's initial noise of image 0 for ``seed``, as torch (what diffusers is given as latents)."""
    from flame.pipeline.stages import initial_noise
    return torch.from_numpy(initial_noise(1, shape, seed).numpy())


def test_text_encoders_match_diffusers_encode_prompt(dev, pipe):
    ref = reference(dev)
    prompts = ["the cat", "a very long caption that the tokenizers cut " * 4]
    with torch.no_grad(), pytest.warns(UserWarning, match="was cut"):
        want_embeds, want_pooled, _ = ref.encode_prompt(prompts, None, max_sequence_length=LENGTH)
        embeds, pooled = pipe.text_encoders.encode(prompts, LENGTH)
    assert embeds.shape == (2, LENGTH, 32) and pooled.shape == (2, 12)
    np.testing.assert_allclose(embeds.numpy(), want_embeds.numpy(), rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(pooled.numpy(), want_pooled.numpy(), rtol=RTOL, atol=RTOL)
    assert pipe.text_encoders.text_dim == 32 and pipe.text_encoders.pooled_dim == 12


@pytest.mark.slow
@pytest.mark.parametrize("true_cfg", [pytest.param(1.0, marks=pytest.mark.extended), 3.0])  # 3.0: CFG's superset
def test_images_equal_diffusers_for_the_same_initial_latents(dev, pipe, true_cfg):
    ref = reference(dev)
    noise = flame_noise((4, 16, 16))
    packed = diffusers.FluxPipeline._pack_latents(noise, 1, 4, 16, 16)
    negative = "blurry" if true_cfg > 1 else None
    want = ref("a red cat", negative_prompt=negative, true_cfg_scale=true_cfg, num_inference_steps=3,
               guidance_scale=3.5, width=32, height=32, latents=packed.clone(), max_sequence_length=LENGTH,
               output_type="np").images[0]
    got = pipe("a red cat", negative_prompt=negative, true_cfg=true_cfg, steps=3, width=32, height=32,
               max_sequence_length=LENGTH, cuda_graph=False)[0]
    assert got.shape == (32, 32, 3) and got.dtype == np.uint8
    np.testing.assert_allclose(got.astype(np.float32), np.clip(want, 0, 1) * 255, atol=2.0)


@pytest.mark.slow
@pytest.mark.extended  # CI: the dev pipeline against diffusers (above), the schnell transformer (test_flux.py)
def test_schnell_folder_without_guidance_matches_diffusers(tmp_path):
    folder = write_tiny_flux_pipeline(tmp_path / "schnell", guidance=False)
    ref = reference(folder)
    pipe = FluxPipeline.from_pretrained(folder, dtype=flame.float32)
    assert pipe.variant == "schnell" and pipe.max_sequence_length == 256
    noise = flame_noise((4, 8, 16), seed=5)
    want = ref("the cat", num_inference_steps=2, width=32, height=16, max_sequence_length=LENGTH, output_type="np",
               latents=diffusers.FluxPipeline._pack_latents(noise, 1, 4, 8, 16)).images[0]
    cond = encode_prompts(pipe.text_encoders, "the cat", max_sequence_length=LENGTH)
    sampler = make_sampler("flow_euler", 2, pipe.scheduler_config, image_seq_len=4 * 8)
    latents = denoise(pipe.transformer, cond, flame.tensor(noise.numpy()), sampler, cuda_graph=False)
    got = decode(pipe.vae, latents)[0]
    assert got.shape == (16, 32, 3)
    np.testing.assert_allclose(got.astype(np.float32), np.clip(want, 0, 1) * 255, atol=2.0)


@pytest.mark.extended  # the pipeline's parts: the parity tests above; the CLI's errors: test_pipeline.py
def test_flame_sample_makes_flux_images_from_a_folder_and_from_single_files(dev, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["--prompt", "a cat", "--steps", "1", "--width", "16", "--height", "16", "--seed", "3",
              "--max-sequence-length", "8", "--no-progress", "--dtype", "fp32"]
    assert sample_main(["--model", str(dev), *common, "--batch", "2", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    from PIL import Image
    assert sorted(p.name for p in out.iterdir()) == ["00000-3.png", "00001-4.png", "grid-00000.png"]
    with Image.open(out / "00001-4.png") as im:
        settings = json.loads(im.text["flame"])
        folder_image = np.asarray(im)
    assert settings["sampler"] == "flow_euler" and settings["guidance"] == 3.5 and settings["cfg"] == 1.0
    assert settings["steps"] == 1
    assert sample_main(["--model", str(dev), *common, "--sampler", "flow_heun", "--out", str(tmp_path / "heun")]) == 0
    with Image.open(tmp_path / "heun" / "00000-3.png") as im:
        assert "Sampler: flow_heun" in im.text["parameters"] and "Guidance: 3.5" in im.text["parameters"]
    # the transformer as one BFL file, the rest from --base: the same image
    from safetensors.torch import save_file
    from tiny_flux import bfl_state_dict, tiny_pipeline_config
    sd = diffusers.FluxTransformer2DModel.from_pretrained(dev / "transformer").state_dict()
    single = tmp_path / "flux1-tiny.safetensors"
    save_file(bfl_state_dict(sd, tiny_pipeline_config()), single)
    with pytest.raises(FileNotFoundError, match="--base"):
        FluxPipeline.from_pretrained(single)
    # the file's config is --base's transformer/config.json (its rotary axes cannot be read from weights)
    code = sample_main(["--model", str(single), "--base", str(dev), *common, "--seed", "4", "--out",
                        str(tmp_path / "single")])
    assert code == 0, capsys.readouterr().err
    with Image.open(tmp_path / "single" / "00000-4.png") as im:
        np.testing.assert_array_equal(np.asarray(im), folder_image)


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_lora_files_fold_in_at_their_strength(dev, tmp_path, pipe, fmt):
    from flame.io import save_lora
    from flame.models import FluxTransformer2DModel
    donor = FluxTransformer2DModel(pipe.transformer.config, dtype=flame.float32)
    names = ["double_blocks.0.img_attn.proj", "single_blocks.1.linear1"]  # a plain and a fused layer (4 parts)
    flame.nn.inject_lora(donor, names, rank=2, alpha=4)
    for name in names:
        flame.nn.init.normal_(donor.get_submodule(name).lora_B, 0.0, 0.1)
    path = tmp_path / "style.safetensors"
    save_lora(donor, path, format=fmt, prefix="transformer")  # the trainer's Flux files
    fresh = FluxPipeline.from_pretrained(dev, dtype=flame.float32)
    before = {n: fresh.transformer.get_submodule(n).weight.to_torch().clone() for n in names}
    fresh.load_lora(path, 0.5)
    for name in names:  # the folded weight is W + strength * (the adapter's delta), whatever the file's layout
        delta = _adapter_delta(donor.get_submodule(name))
        torch.testing.assert_close(fresh.transformer.get_submodule(name).weight.to_torch(), before[name] + 0.5 * delta,
                                   rtol=RTOL, atol=1e-6 if flame.is_interpreter() else 1e-3)
    assert fresh.loras == [("style.safetensors", 0.5)]


def _adapter_delta(layer):
    """scale * B A of a LoRA layer, its parts' adapters side by side (the block-diagonal up matrix)."""
    a, b = layer.lora_A.to_torch(), layer.lora_B.to_torch()
    parts = layer.parts or (b.shape[0],)
    rank = a.shape[0] // len(parts)
    rows, out = 0, []
    for k, size in enumerate(parts):
        out.append(b[rows:rows + size] @ a[k * rank:(k + 1) * rank])
        rows += size
    return layer.scale * torch.cat(out)


def test_bad_input_is_a_clear_error(dev, tmp_path, capsys, pipe):
    base = ["--model", str(dev), "--prompt", "a cat", "--steps", "1", "--out", str(tmp_path / "o"), "--no-progress",
            "--dtype", "fp32"]
    assert sample_main([*base, "--width", "18", "--height", "16"]) == 2
    assert "multiples of 4" in capsys.readouterr().err  # the tiny VAE's 2x times the 2x2 patches
    assert sample_main([*base, "--sampler", "euler"]) == 2
    assert "flow_euler" in capsys.readouterr().err
    assert sample_main([*base, "--max-tokens", "150"]) == 2
    assert "--max-sequence-length" in capsys.readouterr().err
    assert sample_main([*base, "--max-sequence-length", "600"]) == 2
    assert "--max-sequence-length must be 1 to 512" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 prompts"):
        encode_prompts(pipe.text_encoders, ["a", "b"], ["x", "y", "z"], LENGTH)
    with pytest.raises(ValueError, match="flow-matching"):
        denoise(pipe.transformer, encode_prompts(pipe.text_encoders, "a", max_sequence_length=LENGTH),
                flame.zeros(1, 4, 8, 8), make_sampler("euler", 2), cuda_graph=False)
    with pytest.raises(FileNotFoundError, match="tokenizer_2"):
        FluxTextEncoders.from_pretrained(dev, tokenizer_path=tmp_path)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


FLUX_INPUT_ERRORS = {  # case: (arguments, what the error line says)
    "width": (["--width", "18"], "--width/--height: width and height must be positive multiples of 4, got 18x16 (the "
                                 "VAE's 2x downsampling times the transformer's 2x2 patches)"),
    "long sequence": (["--max-sequence-length", "600"], "--max-sequence-length must be 1 to 512 (T5 tokens per "
                                                       "prompt), got 600"),
    "no sequence": (["--max-sequence-length", "0"], "--max-sequence-length must be 1 to 512"),
    "transformer folder": (["--model", "{model}/transformer"], "the folder of one component (FluxTransformer2DModel)"),
}


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("case", FLUX_INPUT_ERRORS)
def test_input_errors_are_one_line_before_any_model_loads(dev, tmp_path, capsys, case):
    args, says = FLUX_INPUT_ERRORS[case]
    argv = ["--model", str(dev), "--prompt", "a cat", "--steps", "1", "--width", "16", "--height", "16", "--out",
            str(tmp_path / "o"), "--no-progress", *(a.format(model=dev) for a in args)]
    assert says in sample_error(capsys, argv)
    assert not (tmp_path / "o").exists()
