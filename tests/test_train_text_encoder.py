"""Text-encoder LoRA for SDXL (``lora.text_encoder``): both CLIP encoders of the tiny pipeline folder
(tests/tiny_sdxl.py) trained with the denoiser, their captions encoded inside the (graph-checked)
step; one LoRA file with the UNet's and both encoders' adapters under diffusers' and kohya's names,
read by diffusers' ``StableDiffusionXLPipeline.load_lora_weights``, by flame-sample's pipeline and by
the trainer's ``lora.init_from``; exact resume; the options refused where they cannot work.

Most runs train the stand-in denoiser (tests/standin.py) so that the encoders' kernels dominate; one
trains a step of the tiny pipeline's own UNet, whose file diffusers and flame-sample load whole."""
import json
import pathlib
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import flame
from flame.data import write_synthetic_cache
from flame.io import load_lora, load_safetensors, read_metadata, save_lora, save_safetensors
from flame.models import SDXLTextEncoders
from flame.nn.lora import lora_modules
from flame.train import ConfigError, Trainer, build_config, list_checkpoints
from tests.standin import StandInUNet

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from tiny_sdxl import write_tiny_pipeline

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

DIMS = SimpleNamespace(in_channels=4, cross_attention_dim=32, pooled_dim=16, sample_size=4)  # the tiny encoders'
PROMPT = "synthetic c0=+0.50 a cat"
# embeddings against diffusers' (fp32 on the CPU) and between flame's paths; on a GPU fp32 products run as
# tf32 (~3e-3 here); a trained adapter must move them by 10x that (its step moves them by 0.15-0.8)
CLOSE = dict(rtol=1e-5, atol=1e-5) if flame.is_interpreter() else dict(rtol=5e-3, atol=5e-3)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return write_tiny_pipeline(tmp_path_factory.mktemp("sdxl") / "pipeline")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "synthetic"
    write_synthetic_cache(path, 10, 4, 77, 32, 16, latent_sizes=[(4, 4)], val_samples=2, seed=1)
    return path


def _config(pipeline, cache, out, *overrides):
    raw = {"model": {"config": "tiny", "path": str(pipeline)}, "data": {"cache_dir": str(cache), "batch_size": 2},
           "lora": {"rank": 2, "targets": "attn", "text_encoder": True, "text_encoder_lr": 1e-2,
                    "text_encoder_rank": 3, "text_encoder_alpha": 6},
           "train": {"steps": 3, "lr": 3e-3, "precision": "fp32", "seed": 3},
           "output": {"dir": str(out), "save_every": 0, "log_every": 1}}
    return build_config(raw, overrides)


def _trainer(cfg, model=None):
    flame.manual_seed(cfg.train.seed)
    return Trainer(cfg, model=StandInUNet(DIMS) if model is None else model, progress=False, log=lambda *a: None)


def _encoders(pipeline, path=None):
    """flame's encoders of the tiny pipeline, with the text-encoder adapters of LoRA file ``path``."""
    text = SDXLTextEncoders.from_pretrained(pipeline, dtype=flame.float32)
    if path is not None:
        load_lora({"text_encoder": text.text_encoder, "text_encoder_2": text.text_encoder_2}, path)
    return text


def _embeddings(text, prompt=PROMPT):
    with flame.no_grad():
        return tuple(t.numpy() for t in text.encode([prompt]))


def _b(model):
    return {n: m.lora_B.numpy() for n, m in lora_modules(model)}


STRAIGHT = ("data.caption_dropout=0.5", "output.validate_every=2", "train.steps=2")


@pytest.fixture(scope="module")
def straight(pipeline, cache, tmp_path_factory):
    """An uninterrupted 2-step run with caption dropout and validation: (result, trainer)."""
    out = tmp_path_factory.mktemp("straight")
    trainer = _trainer(_config(pipeline, cache, out, *STRAIGHT))
    return trainer.train(), trainer


def test_both_encoders_train_with_the_unet_into_one_file(pipeline, straight):
    result, trainer = straight
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    assert sorted(result["val_losses"]) == [0, 2] and all(np.isfinite(list(result["val_losses"].values())))
    for model in (trainer.model, *trainer.text.models.values()):  # every adapter's B left zero
        assert all(np.abs(b).max() > 0 for b in _b(model).values())
    te_groups = trainer.optimizer.param_groups[-4:]  # (CLIP-L, bigG) x (A, B) at lora.text_encoder_lr
    assert [g["lr"] for g in te_groups] == [1e-2] * 4
    keys = load_safetensors(result["lora"]).keys()
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}
    assert "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_A.weight" in keys
    assert "text_encoder_2.text_model.encoder.layers.1.self_attn.q_proj.lora_B.weight" in keys
    assert not any(k.startswith("text_encoder.text_model.encoder.layers.1.") for k in keys)  # CLIP-L's last layer
    meta = read_metadata(result["lora"])
    peft = json.loads(meta["lora_adapter_metadata"])
    assert (peft["unet.r"], peft["text_encoder.r"], peft["text_encoder_2.lora_alpha"]) == (2, 3, 6)
    assert "encoder.layers.0.self_attn.q_proj" in peft["text_encoder.target_modules"]  # either transformers layout
    assert meta["ss_text_encoder_lr"] == "0.01"
    ckpt = list_checkpoints(pathlib.Path(result["checkpoint"]).parent)[-1][1]
    assert any(k.startswith("text_encoder_2.") for k in load_safetensors(pathlib.Path(ckpt) / "lora.safetensors"))
    # the file's encoders give the trained encoders' embeddings
    trained = _embeddings(trainer.text.encoders)
    for got, want in zip(_embeddings(_encoders(pipeline, result["lora"])), trained):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, base in zip(trained, _embeddings(_encoders(pipeline))):
        assert np.abs(got - base).max() > 1e-4


def test_kohya_names_and_transformers_5_names_hold_the_same_adapters(pipeline, straight, tmp_path):
    result, trainer = straight
    path = tmp_path / "kohya.safetensors"
    save_lora(trainer.trained.models, path, format="kohya")
    keys = load_safetensors(path).keys()
    assert {k.split("_")[1] for k in keys} == {"unet", "te1", "te2"}
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in keys
    assert "lora_te2_text_model_encoder_layers_1_mlp_fc2.alpha" in keys
    # diffusers saves a text encoder's adapters without text_model. under transformers 5: those load too
    flat = tmp_path / "flat.safetensors"
    tensors = {k.replace(".text_model.", ".", 1): v for k, v in load_safetensors(result["lora"]).items()}
    meta = read_metadata(result["lora"])
    save_safetensors(tensors, flat, metadata=meta)
    assert "text_encoder.encoder.layers.0.mlp.fc1.lora_A.weight" in tensors
    for file in (path, flat):
        for got, want in zip(_embeddings(_encoders(pipeline, file)), _embeddings(trainer.text.encoders)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=file.name)

@pytest.mark.extended  # exact resume: tests/test_train.py (this one passed on the H200)

def test_resume_continues_exactly(pipeline, cache, straight, tmp_path):
    result, trainer = straight
    first = _trainer(_config(pipeline, cache, tmp_path, *STRAIGHT[:2], "train.steps=1")).train()
    assert first["losses"] == result["losses"][:1]
    resumed = _trainer(_config(pipeline, cache, tmp_path, *STRAIGHT, "resume=latest"))
    rest = resumed.train()
    assert rest["losses"] == result["losses"][1:]
    for model, again in zip(trainer.text.models.values(), resumed.text.models.values()):
        for (name, want), got in zip(_b(model).items(), _b(again).values()):
            np.testing.assert_array_equal(got, want, err_msg=name)
    with pytest.raises(ConfigError, match=r"lora\.text_encoder True -> False"):
        _trainer(_config(pipeline, cache, tmp_path, "resume=latest", "lora.text_encoder=false",
                         "lora.text_encoder_lr=null", "lora.text_encoder_rank=null", "lora.text_encoder_alpha=null"))


@pytest.fixture(scope="module")
def real(pipeline, cache, tmp_path_factory):
    """A step of the tiny pipeline's own UNet with the encoders: (LoRA file, trainer)."""
    out = tmp_path_factory.mktemp("real")
    latents = tmp_path_factory.mktemp("cache8") / "synthetic"
    write_synthetic_cache(latents, 2, 4, 77, 32, 16, latent_sizes=[(8, 8)], val_samples=0, seed=2)
    cfg = _config(pipeline, latents, out, "model.config=sdxl", "lora.targets=[attn2.to_k]", "train.steps=1",
                  "data.batch_size=1")
    flame.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, progress=False, log=lambda *a: None)
    return trainer.train()["lora"], trainer


def _diffusers_embeddings(pipeline, path=None):
    import diffusers
    import torch
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(pipeline, torch_dtype=torch.float32)
    if path is not None:
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, use_safetensors=True)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt([PROMPT], device="cpu", num_images_per_prompt=1,
                                                  do_classifier_free_guidance=False)
    return embeds.numpy(), pooled.numpy()


def test_diffusers_loads_the_file_peft_and_kohya(pipeline, real, tmp_path):
    path, trainer = real
    trained = _embeddings(trainer.text.encoders)
    kohya = tmp_path / "kohya.safetensors"
    save_lora(trainer.trained.models, kohya, format="kohya")
    for file in (pathlib.Path(path), kohya):
        for got, want in zip(_diffusers_embeddings(pipeline, file), trained):
            np.testing.assert_allclose(got, want, **CLOSE, err_msg=file.name)
    for got, base in zip(trained, _diffusers_embeddings(pipeline)):
        assert np.abs(got - base).max() > 10 * CLOSE["atol"]


def test_flame_sample_folds_the_encoders_adapters_in(pipeline, real):
    from flame.pipeline import SDXLPipeline
    from flame.pipeline.sdxl import encode_prompts
    path, trainer = real
    pipe = SDXLPipeline.from_pretrained(pipeline, dtype=flame.float32)
    before = encode_prompts(pipe.text_encoders, [PROMPT], force_zeros_for_empty_prompt=True)
    to_k = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"
    w0 = pipe.unet.get_submodule(to_k).weight.numpy()
    names = pipe.load_lora(path)
    assert to_k in names and "text_encoder.text_model.encoder.layers.0.mlp.fc2" in names
    assert "text_encoder_2.text_model.encoder.layers.1.self_attn.out_proj" in names
    after = encode_prompts(pipe.text_encoders, [PROMPT], force_zeros_for_empty_prompt=True)
    for got, want, base in zip(after[:2], _embeddings(trainer.text.encoders), before[:2]):
        np.testing.assert_allclose(got.numpy(), want, **CLOSE)
        assert np.abs(got.numpy() - base.numpy()).max() > 10 * CLOSE["atol"]
    assert np.abs(pipe.unet.get_submodule(to_k).weight.numpy() - w0).max() > 0
    assert not lora_modules(pipe.text_encoders)  # folded

@pytest.mark.extended  # the file's names: the tests above; init_from: test_train.py

def test_init_from_reads_the_encoders_back_and_samples_use_them(pipeline, real, tmp_path, monkeypatch):
    path, trainer = real
    cfg = _config(pipeline, trainer.cfg.data.cache_dir, tmp_path / "a", "model.config=sdxl",
                  "lora.targets=[attn2.to_k]", f"lora.init_from={path}", "sample.prompts=[a cat]", "sample.steps=1",
                  "sample.width=16", "sample.height=16")
    again = Trainer(cfg, progress=False, log=lambda *a: None)
    for got, want in zip(_embeddings(again.text.encoders), _embeddings(trainer.text.encoders)):
        np.testing.assert_array_equal(got, want)
    encoded, encode = [], again.text.encoders.encode  # sample prompts: encoded by the encoders being trained
    monkeypatch.setattr(again.text.encoders, "encode", lambda *a, **k: encoded.append(a[0]) or encode(*a, **k))
    assert again.samples.conditioning is None
    assert [pathlib.Path(p).name for p in again.samples.render(again.model, 0, tmp_path / "s")] == ["00.png"]
    assert encoded == [["a cat"]]
    lines = []
    unet_only = _config(pipeline, trainer.cfg.data.cache_dir, tmp_path / "b", "model.config=sdxl",
                        "lora.targets=[attn2.to_k]", f"lora.init_from={path}", "lora.text_encoder=false",
                        "lora.text_encoder_lr=null", "lora.text_encoder_rank=null", "lora.text_encoder_alpha=null")
    plain = Trainer(unet_only, progress=False, log=lines.append)
    assert plain.text is None and any("also holds text-encoder adapters" in line for line in lines)
    for (name, want), got in zip(_b(trainer.model).items(), _b(plain.model).values()):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_the_option_is_refused_where_it_cannot_work(pipeline, cache, tmp_path):
    def refused(raw_over, *overrides):
        raw = {"model": {"config": "tiny", "path": str(pipeline)}, "data": {"cache_dir": str(cache)},
               "lora": {"text_encoder": True}, "train": {"steps": 1}, "output": {"dir": str(tmp_path / "o")}}
        for section, values in raw_over.items():
            raw[section] = {**raw.get(section, {}), **values}
        with pytest.raises(ConfigError) as e:
            build_config(raw, overrides)
        return str(e.value)

    assert "Flux.1 keeps its text encoders" in refused({"model": {"family": "flux", "path": None}})
    assert "set model.path to an SDXL pipeline" in refused({"model": {"path": None}})
    assert "data.caption_variants" in refused({"data": {"caption_variants": True}})
    assert "lora.text_encoder_lr: set for the text encoders' adapters" in refused(
        {"lora": {"text_encoder": False, "text_encoder_lr": 1e-5}})
    assert "did you mean lora.text_encoder?" in refused({}, "train.train_text_encoder=true")
    with pytest.raises(ConfigError, match=r"text_encoder_targets: \['nothing'\] matches none .* text_model\.encoder"):
        _trainer(_config(pipeline, cache, tmp_path / "a", "lora.text_encoder_targets=[nothing]"))
    narrow = tmp_path / "narrow"  # a cache (and UNet) of 24 text features: not these encoders' 12 + 20
    write_synthetic_cache(narrow, 4, 4, 77, 24, 16, latent_sizes=[(4, 4)], val_samples=0, seed=1)
    with pytest.raises(ConfigError, match=r"give text_dim 32 \(the cache's 24\)"):
        _trainer(_config(pipeline, narrow, tmp_path / "n"), StandInUNet(SimpleNamespace(**{**vars(DIMS),
                                                                                         "cross_attention_dim": 24})))
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(pipeline, broken)
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(ConfigError, match=r"lora\.text_encoder: .*tokenizer_2/"):
        _trainer(_config(broken, cache, tmp_path / "b"))
