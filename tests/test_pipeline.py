"""SDXL text-to-image on flame: the pipeline against diffusers' StableDiffusionXLPipeline on a tiny
random checkpoint, ``flame-sample`` end to end, LoRA strengths, and bad input."""
import json
import shutil

import numpy as np
import pytest
import torch

import flame
from flame.diffusion.samplers import make_sampler
from flame.io import save_lora
from flame.models import SDXLUNet
from flame.pipeline import SDXLPipeline, decode, denoise, encode_prompts, time_ids_for
from flame.pipeline.cli import main as sample_main

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
from tiny_sdxl import write_tiny_pipeline  # noqa: E402

from helpers import TF32_TOL  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_pipeline(tmp_path_factory.mktemp("sdxl") / "pipeline")


@pytest.fixture(scope="module")
def pipe(tiny):
    return SDXLPipeline.from_pretrained(tiny, dtype=flame.float32)


@pytest.mark.slow
def test_images_equal_diffusers_for_the_same_initial_latents(tiny, pipe):
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny, torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    latents = torch.randn(1, 4, 8, 8)
    want = ref("a red cat", negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0, width=16,
               height=16, latents=latents.clone(), output_type="np").images[0]
    cond = encode_prompts(pipe.text_encoders, ["a red cat"], "blurry", pipe.force_zeros_for_empty_prompt)
    sampler = make_sampler("euler", 2, pipe.scheduler_config)
    out = denoise(pipe.unet, cond, flame.tensor(latents.numpy()), sampler, 5.0, time_ids_for(16, 16, 1),
                  cuda_graph=False)
    got = decode(pipe.vae, out)[0]
    assert got.shape == (16, 16, 3) and got.dtype == np.uint8
    np.testing.assert_allclose(got.astype(np.float32), np.rint(np.clip(want, 0, 1) * 255), atol=1.0)


def test_zero_negative_embeddings_follow_the_checkpoint(pipe):
    cond = encode_prompts(pipe.text_encoders, ["a cat", "a dog"], None, force_zeros_for_empty_prompt=True)
    assert len(cond) == 2 and not cond.negative_embeds.numpy().any() and not cond.negative_pooled.numpy().any()
    cond = encode_prompts(pipe.text_encoders, ["a cat", "a dog"], None, force_zeros_for_empty_prompt=False)
    assert cond.negative_embeds.numpy().any()  # the embeddings of ""
    with pytest.raises(ValueError, match="2 prompts"):
        encode_prompts(pipe.text_encoders, ["a cat", "a dog"], ["x", "y", "z"])


def test_flame_sample_writes_pngs_with_their_settings_and_a_grid(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code = sample_main(["--model", str(tiny), "--prompt", "a cat", "--steps", "1", "--cfg", "4", "--width", "16",
                        "--height", "16", "--seed", "7", "--batch", "2", "--sampler", "euler_a", "--out", str(out),
                        "--no-progress"])
    assert code == 0, capsys.readouterr().err
    from PIL import Image
    names = sorted(p.name for p in out.iterdir())
    assert names == ["00000-7.png", "00001-8.png", "grid-00000.png"]
    with Image.open(out / "00001-8.png") as im:
        assert im.size == (16, 16)
        settings = json.loads(im.text["flame"])
        assert "a cat" in im.text["parameters"] and "Seed: 8" in im.text["parameters"]
    assert settings["seed"] == 8 and settings["sampler"] == "euler_a" and settings["steps"] == 1
    with Image.open(out / "grid-00000.png") as im:
        assert im.size == (32, 16)


def test_lora_files_fold_in_at_their_strength(tiny, tmp_path, pipe):
    cfg = pipe.unet.config
    donor = SDXLUNet(cfg, dtype=flame.float32)
    flame.nn.inject_lora(donor, "attn", rank=2, alpha=4)
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    layer = donor.get_submodule(name)
    flame.nn.init.normal_(layer.lora_B, 0.0, 0.1)
    path = tmp_path / "style.safetensors"
    save_lora(donor, path)
    fresh = SDXLPipeline.from_pretrained(tiny, dtype=flame.float32)
    w0 = fresh.unet.get_submodule(name).weight.to_torch().clone()
    fresh.load_lora(path, 0.5)
    delta = 0.5 * 2.0 * layer.lora_B.to_torch() @ layer.lora_A.to_torch()
    torch.testing.assert_close(fresh.unet.get_submodule(name).weight.to_torch(), w0 + delta,
                               **(TF32_TOL or dict(rtol=1e-5, atol=1e-6)))  # B A is a flame matmul
    assert fresh.loras == [("style.safetensors", 0.5)] and not flame.nn.lora.lora_modules(fresh.unet)


def test_bad_input_is_a_clear_error(tiny, tmp_path, capsys):
    base = ["--prompt", "a cat", "--steps", "1", "--width", "16", "--height", "16", "--out", str(tmp_path / "o"),
            "--no-progress"]
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(tiny, broken)
    shutil.rmtree(broken / "tokenizer_2")
    assert sample_main(["--model", str(broken), *base]) == 2
    assert "tokenizer_2" in capsys.readouterr().err
    other = tmp_path / "other.safetensors"
    from flame.io import save_safetensors
    save_safetensors({"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": flame.zeros(2, 8),
                      "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": flame.zeros(8, 2)}, other)
    assert sample_main(["--model", str(tiny), "--lora", f"{other}:0.7", *base]) == 2
    assert "other.safetensors" in capsys.readouterr().err
    assert sample_main(["--model", str(tiny), "--lora", str(tmp_path / "missing.safetensors"), *base]) == 2
    assert "missing.safetensors" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sample_main(["--model", str(tiny), "--sampler", "heun", *base])
    assert e.value.code == 2 and "invalid choice: 'heun'" in capsys.readouterr().err
    assert sample_main(["--model", str(tiny), *base, "--width", "18"]) == 2
    assert "multiples of" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


# ---- flame-sample's input errors: one line, exit 2, before any model loads ---------------------------

@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: flame-sample checks its input before the weights."""
    from flame.models import AutoencoderKL, FluxTransformer2DModel, SDXLTextEncoders
    from flame.models.flux_text import FluxTextEncoders

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    for cls in (SDXLUNet, AutoencoderKL, SDXLTextEncoders, FluxTransformer2DModel, FluxTextEncoders):
        monkeypatch.setattr(cls, "from_pretrained", loaded)


def sample_error(capsys, argv) -> str:
    """The one error line flame-sample gives for ``argv``, which must exit with 2."""
    code = sample_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("flame-sample: error: "), (code, err)
    return err[0]


def _folder(tmp_path, tiny, name, model_index=None, keep=()):
    """A folder with ``keep``'s parts of the tiny pipeline and a model_index.json naming ``model_index``."""
    folder = tmp_path / name
    folder.mkdir()
    for part in keep:
        shutil.copytree(tiny / part, folder / part)
    if model_index is not None:
        (folder / "model_index.json").write_text(json.dumps({"_class_name": model_index}))
    return folder


SDXL_INPUT_ERRORS = {  # case: (arguments, what the error line says)
    "missing prompts file": (["--prompts", "{tmp}/missing.txt"], "--prompts {tmp}/missing.txt: no such file"),
    "empty prompts file": (["--prompts", "{tmp}/empty.txt"], "--prompts {tmp}/empty.txt: no prompt in it"),
    "flux sampler": (["--sampler", "flow_euler"], "--sampler flow_euler: SDXL samples with euler, euler_a"),
    "missing lora": (["--lora", "{tmp}/style.safetensors:0.5"], "--lora {tmp}/style.safetensors: no such file"),
    "not a lora": (["--lora", "{model}/unet/diffusion_pytorch_model.safetensors"], "not a LoRA state dict"),
    "damaged lora": (["--lora", "{tmp}/empty.txt"], "--lora {tmp}/empty.txt: damaged or not a safetensors file"),
    "unet folder": (["--model", "{model}/unet"], "the folder of one component (UNet2DConditionModel)"),
    "sd15 folder": (["--model", "{tmp}/sd15"], "its model_index.json names StableDiffusionPipeline"),
    "empty folder": (["--model", "{tmp}/empty"], "no model_index.json or config.json in it"),
    "not safetensors": (["--model", "{tmp}/empty.txt"], "not a .safetensors file"),
    "missing base": (["--base", "{tmp}/nowhere"], "--base {tmp}/nowhere: not a folder"),
    "out is a file": (["--out", "{tmp}/empty.txt"], "--out {tmp}/empty.txt: a file, not a folder"),
}


@pytest.mark.parametrize("case", SDXL_INPUT_ERRORS)
def test_input_errors_are_one_line_before_any_model_loads(tiny, tmp_path, capsys, no_model_loads, case):
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    _folder(tmp_path, tiny, "sd15", "StableDiffusionPipeline", keep=("unet", "vae"))
    _folder(tmp_path, tiny, "empty")
    args, says = SDXL_INPUT_ERRORS[case]
    fill = {"tmp": tmp_path, "model": tiny}
    argv = ["--model", str(tiny), *([] if "--prompts" in args else ["--prompt", "a cat"]), "--steps", "1", "--width",
            "16", "--height", "16", "--out", str(tmp_path / "o"), "--no-progress", *(a.format(**fill) for a in args)]
    assert says.format(**fill) in sample_error(capsys, argv)
    assert not (tmp_path / "o").exists()


def test_the_image_size_is_checked_before_loading_with_the_pipelines_own_factor(tiny, pipe, tmp_path, capsys,
                                                                             no_model_loads):
    early = sample_error(capsys, ["--model", str(tiny), "--prompt", "a cat", "--width", "30", "--height", "16",
                                  "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError) as late:
        pipe("a cat", steps=1, width=30, height=16, cuda_graph=False)
    assert early.endswith(f"--width/--height: {late.value} (the VAE's 2x downsampling times the UNet's 2x)")
    assert "multiples of 4" in early  # SDXL base's: 8 x 4 = 32


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as e:
        sample_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "flame-sample --model PATH" in out and "``" not in out
