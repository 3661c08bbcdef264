"""The SDXL LoRA trainer: config validation, loss going down, LoRA files, exact resume, Ctrl-C and
NaN stops; and under bad input, signals and partial files: every bad setting refused before any work
starts (exit 2, one error line, no traceback, no empty output folder left), SIGTERM and repeated
Ctrl-C keeping the exact-resume promise, damaged metrics and full disks losing nothing, and what the
console says. Most tests train a small stand-in denoiser (the UNet's forward signature and LoRA
target names, a handful of kernels per step) so they stay fast on the interpreter; one trains the
real tiny SDXL UNet through the CLI with configs/sdxl_lora_tiny.yaml."""
import errno
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

import flame
from flame.data import LatentCache, write_synthetic_cache
from flame.io import load_lora, load_safetensors, read_metadata, save_safetensors
from flame.models import SDXLUNetConfig
from flame.train import ConfigError, Trainer, TrainingStopped, build_config, cli, list_checkpoints, load_config
from flame.train.trainer import TrainingError
from tests.standin import DIMS, StandInUNet

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "synthetic"
    write_synthetic_cache(path, 40, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 4), (4, 6)], val_samples=8, concepts=4, seed=1)
    return path


def _config(cache, out, *overrides):
    raw = {"model": {"config": "tiny"}, "data": {"cache_dir": str(cache), "batch_size": 4},
           "lora": {"rank": 4, "targets": "attn"},
           "train": {"steps": 6, "lr": 3e-3, "precision": "fp32", "max_grad_norm": 1.0, "seed": 3},
           "diffusion": {"min_snr_gamma": 5.0},
           "output": {"dir": str(out), "save_every": 0, "log_every": 2, "keep_last": 5}}
    return build_config(raw, overrides)


def _trainer(cfg, **kw):
    flame.manual_seed(cfg.train.seed)
    return Trainer(cfg, model=StandInUNet(), progress=False, log=lambda *a: None, **kw)


@pytest.fixture(scope="module")
def straight(cache_dir, tmp_path_factory):
    """Losses of an uninterrupted 6-step run of the base config."""
    return _trainer(_config(cache_dir, tmp_path_factory.mktemp("straight"))).train()["losses"]


def _interrupt_at(trainer, step, monkeypatch):
    """Send SIGINT (as Ctrl-C does) right after optimizer step ``step``."""
    real_step = trainer.train_step

    def step_then_interrupt():
        real_step()
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(trainer, "train_step", step_then_interrupt)


def _metrics(out):
    return [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]


# ---- config ---------------------------------------------------------------------------------------

def test_config_defaults_overrides_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"cache_dir": "cache"}, "output": {"dir": "out"},
                                    "train": {"steps": 10, "lr": "1e-4"}}))
    cfg = load_config(path, ["lora.targets=[to_q, to_v]", "train.precision=fp16", "diffusion.min_snr_gamma=5"])
    assert cfg.train.lr == 1e-4 and cfg.lora.targets == ["to_q", "to_v"] and cfg.train.precision == "fp16"
    assert cfg.diffusion.min_snr_gamma == 5.0 and cfg.lora.rank == 16 and cfg.resume is None
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.learning_rate=1", "lora.rnak=4", "train.precision=fp8", "data.batch_size=0",
                           "diffusion.timestep_max=5000", "lr=3"])
    msg = str(e.value)
    for part in ("train.learning_rate: unknown option (did you mean train.lr?)",
                 "lora.rnak: unknown option (did you mean lora.rank?)",
                 "train.precision: expected one of bf16, fp16, fp32, got 'fp8'",
                 "data.batch_size: must be >= 1, got 0", "diffusion.timestep_max: must be < 1001",
                 "lr: unknown option (did you mean train.lr?)"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match="set exactly one"):
        load_config(path, ["train.epochs=2"])
    with pytest.raises(ConfigError, match=r"timestep_min .* must be below"):
        load_config(path, ["diffusion.timestep_min=500", "diffusion.timestep_max=400"])
    with pytest.raises(ConfigError, match=r"train.compile_ahead: expected auto, off or a recorded kernel list"):
        load_config(path, ["train.compile_ahead=no-such-list.jsonl"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(path, ["train.lr"])
    # YAML 1.1 reads off/on/yes/no as booleans; the config keeps them words (compile_ahead: off), and
    # options of kind bool read the words as booleans
    words = load_config(path, ["train.compile_ahead=off", "train.gradient_checkpointing=yes", "data.flip=Off",
                               "train.cuda_graph=no"])
    assert words.train.compile_ahead == "off" and words.train.gradient_checkpointing is True
    assert words.data.flip is False and words.train.cuda_graph is False
    with pytest.raises(ConfigError, match=r"data\.flip: expected true or false, got 'maybe'"):
        load_config(path, ["data.flip=maybe"])
    with pytest.raises(ConfigError, match=r"output\.dir: required"):
        build_config({"data": {"cache_dir": "c"}, "train": {"steps": 1}})


def test_cli_reports_config_errors_and_prints_config(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"cache_dir": "cache"}, "output": {"dir": "out"}, "train": {"steps": 2}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "scripts/train_lora.py", str(path), "train.lr=abc", "lora.nope=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "train.lr: expected a number" in r.stderr and "lora.nope: unknown option" in r.stderr
    assert cli.main([str(path), "lora.rank=8", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["lora"]["rank"] == 8


def test_trainer_rejects_a_cache_that_does_not_fit(cache_dir, tmp_path):
    cfg = _config(cache_dir, tmp_path)
    with pytest.raises(ConfigError, match=r"text_dim 16 \(the model needs 24\)"):
        Trainer(cfg, model=StandInUNet(SimpleNamespace(**{**vars(DIMS), "cross_attention_dim": 24})),
                progress=False, log=lambda *a: None)


# ---- training -------------------------------------------------------------------------------------

def test_epochs_set_the_number_of_steps(cache_dir, tmp_path):
    # 32 training samples in two buckets of 16: 2 batches of 8 each per epoch, 2 per optimizer step
    cfg = _config(cache_dir, tmp_path, "train.steps=null", "train.epochs=1", "data.batch_size=8", "train.grad_accum=2")
    trainer = _trainer(cfg)
    assert len(trainer.loader) == 4 and trainer.total_steps == 2
    result = trainer.train()
    assert result["step"] == 2 and len(result["losses"]) == 2
    assert trainer.loader.state_dict()["epoch"] == 0 and trainer.loader.state_dict()["position"] == 4


@pytest.mark.slow
def test_loss_goes_down_and_lora_file_loads(cache_dir, tmp_path):
    cfg = _config(cache_dir, tmp_path, "train.steps=12", "output.validate_every=12", "output.log_every=4",
                  "lora.format=kohya", "lora.targets=attn-mlp", "train.lr=3e-2", "train.lr_scheduler=cosine",
                  "train.warmup_steps=2")
    result = _trainer(cfg).train()
    assert len(result["losses"]) == 12 and all(math.isfinite(v) for v in result["losses"])
    val = result["val_losses"]
    assert sorted(val) == [0, 12]
    assert val[12] < 0.7 * val[0], f"validation loss did not go down: {val}"
    # the LoRA file loads into a fresh model and reproduces the trained model's validation loss
    lora = pathlib.Path(result["lora"])
    assert lora.name == "lora.safetensors" and lora.is_file()
    keys = load_safetensors(lora).keys()
    assert any(k.startswith("lora_unet_attn2_to_q.lora_down") for k in keys), sorted(keys)[:4]
    fresh = _trainer(_config(cache_dir, tmp_path / "again", "output.validate_every=1", "lora.targets=[to_q]"))
    loaded = load_lora(fresh.model, lora)  # same base weights; injects the adapters the model lacks
    assert sorted(loaded) == ["attn2.to_k", "attn2.to_out.0", "attn2.to_q", "attn2.to_v", "proj_in", "proj_out"]
    assert fresh.validate() == pytest.approx(val[12], rel=1e-5)
    rows = _metrics(tmp_path)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 13)) and all("lr" in r and "grad_norm" in r for r in rows if "loss" in r)
    assert [r["lr"] for r in rows if "loss" in r][:3] == pytest.approx([0.0, 1.5e-2, 3e-2])
    assert [r["val_loss"] for r in rows if "val_loss" in r] == pytest.approx([val[0], val[12]])
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["lora"]["format"] == "kohya"


def test_lora_file_in_bf16_with_training_metadata_and_tensorboard_scalars(cache_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = _config(cache_dir, tmp_path, "train.steps=4", "output.validate_every=4", "output.save_dtype=bf16",
                  "output.report_to=[jsonl, tensorboard]", "lora.rank=3", "lora.alpha=6")
    result = _trainer(cfg).train()
    lora = pathlib.Path(result["lora"])
    tensors = load_safetensors(lora)
    assert {str(t.dtype) for t in tensors.values()} == {"torch.bfloat16"}
    meta = read_metadata(lora)
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_steps"]) == ("3", "6.0", "4")
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora" and meta["ss_seed"] == "3"
    assert json.loads(meta["lora_adapter_metadata"])["unet.r"] == 3  # diffusers still reads rank and alpha
    fresh = _trainer(_config(cache_dir, tmp_path / "again", "lora.targets=[to_q]", "lora.rank=3"))
    load_lora(fresh.model, lora)  # bf16 weights into the fp32 adapters
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val_loss")] == [0, 4]
    assert events.Scalars("val_loss")[-1].value == pytest.approx(result["val_losses"][4], rel=1e-6)


@pytest.mark.parametrize("loss", ["huber-snr", pytest.param("smooth_l1-exponential", marks=pytest.mark.extended),
                                  pytest.param("l1-constant", marks=pytest.mark.extended), "l2-debiased"])
# every loss type and huber schedule against kohya's formulas: test_diffusion_losses.py
def test_loss_types_train_and_validate_with_kohyas_formulas(cache_dir, tmp_path, loss):
    from flame.diffusion import diffusion_loss, huber_c_per_timestep
    loss_type, schedule = loss.split("-")
    debiased = schedule == "debiased"
    cfg = _config(cache_dir, tmp_path, "train.steps=2", f"diffusion.loss_type={loss_type}",
                  f"diffusion.huber_schedule={'snr' if debiased else schedule}", "diffusion.huber_c=0.2",
                  "diffusion.min_snr_gamma=null", f"diffusion.debiased_estimation={str(debiased).lower()}")
    trainer = _trainer(cfg)
    b = trainer.loader.cache.batch([0, 1, 2, 3])
    noise, t = flame.randn(*b.latents.shape), flame.tensor([5, 300, 700, 990])
    got = trainer.compute_loss(b.latents, noise, t, b.prompt_embeds, b.pooled, b.time_ids).item()
    sched = trainer.objective.schedule
    pred = trainer.model(sched.add_noise(b.latents, noise, t), t, b.prompt_embeds, b.pooled, b.time_ids)
    c = huber_c_per_timestep(t, sched, schedule, 0.2) if loss_type in ("huber", "smooth_l1") else None
    snr = sched.snr(t).numpy()
    w = flame.tensor(1 / np.sqrt(np.minimum(snr, 1000))) if debiased else None  # kohya's debiased estimation
    assert got == pytest.approx(diffusion_loss(pred, noise, loss_type, w, c).item(), rel=1e-5)
    assert all(math.isfinite(v) for v in trainer.train()["losses"])
    with pytest.raises(ConfigError, match=r"diffusion\.huber_c: huber needs a positive threshold"):
        _config(cache_dir, tmp_path, "diffusion.loss_type=huber", "diffusion.huber_c=0")


def test_timestep_sampling_zero_terminal_snr_and_input_perturbation(cache_dir, tmp_path):
    over = ["train.steps=2", "diffusion.timestep_sampling=logit_normal", "diffusion.timestep_shift=2.0",
            "diffusion.zero_terminal_snr=true", "diffusion.prediction_type=v_prediction",
            "diffusion.input_perturbation=0.1"]
    trainer = _trainer(_config(cache_dir, tmp_path, *over))
    schedule = trainer.objective.schedule
    assert schedule.rescale_betas_zero_snr and schedule.alphas_cumprod.numpy()[-1] == 0
    seen, real = [], trainer.step_fn
    trainer.step_fn = lambda *args: seen.append(args) or real(*args)
    losses = trainer.train()["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    latents, noise, timesteps, embeds, pooled, input_noise, weights, time_ids = seen[0]
    assert weights is None  # one dataset: no per-sample loss weights
    extra = ((input_noise - noise) * 10.0).numpy()  # gamma = 0.1 times a standard normal draw
    assert abs(extra.std() - 1.0) < 0.2 and abs(extra.mean()) < 0.2
    # the UNet sees the perturbed noise, the target stays the plain noise
    same = trainer.compute_loss(latents, noise, timesteps, embeds, pooled, time_ids, input_noise=noise).item()
    assert same == trainer.compute_loss(latents, noise, timesteps, embeds, pooled, time_ids).item()
    assert same != trainer.compute_loss(latents, noise, timesteps, embeds, pooled, time_ids,
                                        input_noise=input_noise).item()
    with pytest.raises(ConfigError, match=r"zero_terminal_snr: .* set diffusion\.prediction_type=v_prediction"):
        _config(cache_dir, tmp_path, "diffusion.zero_terminal_snr=true")
    plain = _trainer(_config(cache_dir, tmp_path / "plain", "train.steps=1"))
    plain_step = plain.step_fn
    plain.step_fn = lambda *args: seen.append(args) or plain_step(*args)
    plain.train_step()
    assert seen[-1][5] is None  # no perturbation: the step gets no second noise


def test_lora_init_from_starts_from_a_file(cache_dir, tmp_path):
    first = _trainer(_config(cache_dir, tmp_path / "a", "train.steps=2", "output.validate_every=2")).train()
    cfg = _config(cache_dir, tmp_path / "b", "train.steps=2", "output.validate_every=2",
                  f"lora.init_from={first['lora']}")
    second = _trainer(cfg)
    assert second.validate() == pytest.approx(first["val_losses"][2], rel=1e-5)  # the file's weights, not an init
    with pytest.raises(ConfigError, match=r"lora\.init_from: .*rank 4 in the file, the model's adapter has rank 2"):
        _trainer(_config(cache_dir, tmp_path / "c", "train.steps=2", f"lora.init_from={first['lora']}", "lora.rank=2"))
    with pytest.raises(ConfigError, match=r"lora\.init_from: .*nothing\.safetensors is not a file"):
        _config(cache_dir, tmp_path / "d", f"lora.init_from={tmp_path / 'nothing.safetensors'}")


def test_resume_reproduces_the_loss_curve_exactly(cache_dir, tmp_path, straight):
    """3 steps, then 3 more from the checkpoint (train.steps raised to 6) = 6 straight steps."""
    first = _trainer(_config(cache_dir, tmp_path / "b", "train.steps=3")).train()
    assert first["losses"] == straight[:3]
    ckpts = list_checkpoints(tmp_path / "b" / "checkpoints")
    assert [s for s, _ in ckpts] == [3]
    assert sorted(os.listdir(ckpts[0][1])) == ["COMPLETE", "lora.safetensors", "optimizer.safetensors",
                                               "trainer_state.json"]
    second = _trainer(_config(cache_dir, tmp_path / "b", "resume=latest")).train()
    assert second["step"] == 6
    assert second["losses"] == straight[3:], (second["losses"], straight)
    assert [r["loss"] for r in _metrics(tmp_path / "b") if "loss" in r] == straight
    assert [s for s, _ in list_checkpoints(tmp_path / "b" / "checkpoints")] == [3, 6]
    with pytest.raises(ConfigError, match=r"checkpoints of an earlier run \(steps \[3, 6\]\).*--resume"):
        _trainer(_config(cache_dir, tmp_path / "b")).train()
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        _trainer(_config(cache_dir, tmp_path / "b", f"resume={tmp_path / 'nowhere'}")).train()


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(cache_dir, tmp_path, straight, monkeypatch, mixed):
    over = []
    if mixed:  # fp16 base + loss scaler, accumulation, noise offset, v-prediction, a schedule that decays
        over = ["train.precision=fp16", "train.grad_accum=2", "diffusion.noise_offset=0.05",
                "diffusion.prediction_type=v_prediction", "train.lr_scheduler=linear", "train.warmup_steps=1"]
        straight = _trainer(_config(cache_dir, tmp_path / "a", *over)).train()["losses"]
    trainer = _trainer(_config(cache_dir, tmp_path / "b", *over))
    _interrupt_at(trainer, 2, monkeypatch)
    with pytest.raises(TrainingStopped, match="interrupted at step 2") as e:
        trainer.train()
    assert e.value.reason == "interrupted" and e.value.step == 2
    assert [s for s, _ in list_checkpoints(tmp_path / "b" / "checkpoints")] == [2]
    assert not (tmp_path / "b" / "lora.safetensors").exists()
    rest = _trainer(_config(cache_dir, tmp_path / "b", *over, "resume=latest")).train()
    assert rest["losses"] == straight[2:]
    assert [r["loss"] for r in _metrics(tmp_path / "b") if "loss" in r] == straight


def test_keyboard_interrupt_inside_a_step_keeps_the_last_complete_step(cache_dir, tmp_path, straight, monkeypatch):
    trainer = _trainer(_config(cache_dir, tmp_path, "train.steps=4"))
    real = trainer._update

    def update_or_interrupt(loss, grads):
        if trainer.step == 1:
            raise KeyboardInterrupt  # after the batch and noise of step 2 were drawn
        return real(loss, grads)

    monkeypatch.setattr(trainer, "_update", update_or_interrupt)
    with pytest.raises(TrainingStopped):
        trainer.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [1]
    rest = _trainer(_config(cache_dir, tmp_path, "train.steps=4", "resume=latest")).train()
    assert rest["losses"] == straight[1:4]


def test_non_finite_loss_stops_with_a_clean_checkpoint(tmp_path):
    cache = tmp_path / "cache"
    write_synthetic_cache(cache, 12, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 4)], val_samples=0, concepts=4, seed=2)
    shard = LatentCache(cache).shards[0]["file"]
    data = load_safetensors(cache / shard)
    bad = data["latents"].numpy()
    bad[5] = np.nan  # one poisoned sample
    data["latents"] = flame.tensor(bad)
    save_safetensors(data, cache / shard)
    cfg = _config(cache, tmp_path / "out", "train.precision=bf16", "train.steps=6", "output.log_every=6",
                  "output.save_every=0", "data.batch_size=2")
    trainer = _trainer(cfg)
    bad_step = 1 + next(i for i, b in enumerate(trainer.loader.plan(0)) if 5 in b)
    with pytest.raises(TrainingStopped, match=f"loss at step {bad_step} is nan") as e:
        trainer.train()
    assert e.value.reason == "non_finite" and e.value.step == 6
    lora = load_safetensors(pathlib.Path(e.value.checkpoint) / "lora.safetensors")
    assert all(np.isfinite(v.numpy()).all() for v in lora.values())
    assert any(np.abs(v.numpy()).max() > 0 for k, v in lora.items() if "lora_B" in k)  # good steps were applied
    assert not (tmp_path / "out" / "lora.safetensors").exists()
    rows = [r for r in _metrics(tmp_path / "out") if "loss" in r]
    assert math.isnan(rows[bad_step - 1]["loss"]) and len(rows) == 6


@pytest.mark.slow
def test_tiny_sdxl_config_trains_through_the_cli(tmp_path):
    """configs/sdxl_lora_tiny.yaml end to end through the CLI on a real SDXL UNet (1 step of batch 1
    instead of 6 of batch 2, tests/tiny_sdxl.py's 2-level UNet instead of SDXLUNetConfig.tiny(), and no
    validation, to save time; test_loss_goes_down_and_lora_file_loads checks the validation loss):
    synthetic cache, training, a checkpoint, a LoRA file that loads into SDXLUNet."""
    from tiny_sdxl import UNET

    from flame.models import SDXLUNet
    config = tmp_path / "unet.json"
    config.write_text(json.dumps(UNET.to_diffusers()))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "scripts/train_lora.py", "configs/sdxl_lora_tiny.yaml", "--no-progress",
                        f"output.dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1",
                        "data.batch_size=1", "output.validate_every=0", f"model.config={config}",
                        "data.synthetic_latent_sizes=[[4, 4]]"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "writing a synthetic cache of 20 samples" in r.stdout and "step 1/1" in r.stdout
    rows = _metrics(tmp_path / "out")
    assert [row["step"] for row in rows if "loss" in row] == [1]
    assert not any("val_loss" in row for row in rows)
    assert [s for s, _ in list_checkpoints(tmp_path / "out" / "checkpoints")] == [1]
    model = SDXLUNet(UNET)
    loaded = load_lora(model, tmp_path / "out" / "lora.safetensors")
    attn_mlp = [n for n in SDXLUNet.layer_names(UNET) if "time_emb_proj" not in n
                and ".linear_" not in n]  # every Linear but the time / text-time embeddings'
    assert sorted(loaded) == sorted(attn_mlp)


# ---- bad input, signals, partial files, the console -------------------------------------------------

def _lora_weights(ckpt):
    return {k: v.numpy() for k, v in load_safetensors(pathlib.Path(ckpt) / "lora.safetensors").items()}


# ---- refused before any work starts --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A cache that fits the tiny SDXL UNet the CLI builds (8 training samples, batch 4 fills it)."""
    from flame.data import write_synthetic_cache_for
    path = tmp_path_factory.mktemp("tiny") / "cache"
    write_synthetic_cache_for(path, 10, SDXLUNetConfig.tiny(), [(8, 8)], val_samples=2, seed=0)
    return path


def _fake_checkpoint(out, **config_changes):
    """A complete checkpoint of step 1 whose trainer state records ``config_changes`` (enough for the
    checks made before loading)."""
    ckpt = pathlib.Path(out) / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    config = {"lora": {"rank": 4, "targets": "attn"}, "data": {"batch_size": 4}, "train": {"seed": 0}}
    for key, value in config_changes.items():
        section, name = key.split(".")
        config[section][name] = value
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": config, "loader": {"epoch": 0, "position": 1}}))
    (ckpt / "COMPLETE").write_text("1\n")


def _damage_index(cache):
    (cache / "index.json").write_text('{"format": "flame-latent-')


CLI_ERRORS = {  # name: (overrides, setup(cache, out) -> cache to use, words the error line holds)
    "model_config": (["model.config=foo"], None, ["model.config", "'foo'"]),
    "bad_regex": (["lora.targets=['to_q[']"], None, ["lora.targets", "not a valid regular expression"]),
    "no_target_matches": (["lora.targets=[no_such_layer]"], None, ["lora.targets", "matches none"]),
    "batch_too_large": (["data.batch_size=64", "data.drop_last=true"], None, ["data.batch_size", "no batch of 64"]),
    "name_with_folder": (["output.name=sub/lora"], None, ["output.name", "folder"]),
    "output_under_a_file": ([], "file_parent", ["output.dir", "cannot write"]),
    "corrupt_index": ([], "damage_index", ["index.json"]),
    "resume_other_rank": (["--resume", "lora.rank=4"], "checkpoint_rank_8", ["lora.rank 8 -> 4", "cannot change"]),
}


@pytest.mark.parametrize("case", sorted(CLI_ERRORS))
def test_cli_refuses_bad_settings_before_any_work(tiny_cache, tmp_path, capsys, case):
    overrides, setup, words = CLI_ERRORS[case]
    cache, out = tiny_cache, tmp_path / "run" / "out"
    if setup == "file_parent":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "a_file").write_text("")
        out = tmp_path / "run" / "a_file" / "out"
    elif setup == "damage_index":
        cache = tmp_path / "cache"
        cache.mkdir()
        _damage_index(cache)
    elif setup == "checkpoint_rank_8":
        _fake_checkpoint(out, **{"lora.rank": 8})
    # in this process (test_cli_reports_config_errors_and_prints_config runs the script in its own)
    code = cli.main([str(ROOT / "configs" / "sdxl_lora_tiny.yaml"), "--no-progress", f"output.dir={out}",
                     f"data.cache_dir={cache}", "data.batch_size=4", "lora.targets=attn", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("flame-train-lora: error:"), err
    assert len(lines) <= 2, err  # the error line (an "invalid config:" header and its one item)
    for word in words:
        assert word in err, err
    if setup != "checkpoint_rank_8":
        assert not (tmp_path / "run" / "out").exists(), "an output folder was left behind by a run that did not start"


def test_no_empty_output_folder_is_left_behind(cache_dir, tmp_path):
    out = tmp_path / "new" / "deeper"
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        _trainer(_config(cache_dir, out, "lora.targets=[nothing_here]"))
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match=r"data.batch_size: no batch of 64 .*drop_last"):
        _trainer(_config(cache_dir, out, "data.batch_size=64", "data.drop_last=true"))
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there before is kept
    with pytest.raises(ConfigError):
        _trainer(_config(cache_dir, tmp_path / "kept", "lora.targets=[nothing_here]"))
    assert (tmp_path / "kept").is_dir()


def test_bf16_on_a_gpu_before_ampere_is_refused_with_the_fix(cache_dir, tmp_path, monkeypatch):
    from flame import runtime
    # only what the trainer asks: patching torch.cuda's capability would make Triton compile for that GPU
    monkeypatch.setattr(runtime, "device_capability", lambda: (7, 5))
    monkeypatch.setattr(runtime, "device_name", lambda: "Tesla T4")
    with pytest.raises(ConfigError, match=r"train.precision: bf16 needs .* 8.0 .* Tesla T4 is 7.5: use "
                                          r"train.precision=fp16"):
        _trainer(_config(cache_dir, tmp_path / "out", "train.precision=bf16"))
    assert not (tmp_path / "out").exists()


def test_resume_refuses_shape_changes_and_warns_on_harmless_ones(cache_dir, tmp_path):
    _trainer(_config(cache_dir, tmp_path, "train.steps=1")).train()
    for change, shown in (("lora.rank=8", "lora.rank 4 -> 8"), ("lora.targets=[to_q]", "lora.targets 'attn' -> "),
                          ("data.batch_size=2", "data.batch_size 4 -> 2"), ("train.seed=5", "train.seed 3 -> 5")):
        with pytest.raises(ConfigError, match="cannot change within a run") as e:
            _trainer(_config(cache_dir, tmp_path, "train.steps=2", "resume=latest", change))
        assert shown in str(e.value)
    lines = []
    flame.manual_seed(3)
    trainer = Trainer(_config(cache_dir, tmp_path, "train.steps=2", "resume=latest", "train.lr=1e-3",
                              "output.log_every=1"), model=StandInUNet(), progress=False, log=lines.append)
    assert trainer.train()["step"] == 2
    warning = next(line for line in lines if line.startswith("warning: resuming with different settings"))
    assert "train.lr 0.003 -> 0.001" in warning and "output.log_every 2 -> 1" in warning


def test_config_messages_point_to_the_right_option(tmp_path):
    base = {"data": {"cache_dir": "c"}, "output": {"dir": "o"}, "train": {"steps": 1}}
    with pytest.raises(ConfigError) as e:
        build_config(base, ["trian.steps=3", "lora.targets=[]", "lora.rnak=2"])
    msg = str(e.value)
    assert "trian.steps: unknown option (did you mean train.steps?)" in msg
    assert "lora.rnak: unknown option (did you mean lora.rank?)" in msg
    assert "lora.targets: expected attn, attn-mlp or a non-empty list of module-name patterns, got []" in msg
    assert build_config(base, ["output.name=my_lora.safetensors"]).output.name == "my_lora"
    with pytest.raises(ConfigError, match=r"model.path: .*nowhere does not exist"):
        build_config(base, [f"model.path={tmp_path / 'nowhere'}"])


def test_usage_does_not_list_overrides_as_required(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "required: CONFIG" in err and "section.key=value" not in err.splitlines()[-1]
    args = cli.parse_args(["train.lr=1", "c.yaml", "--no-progress", "lora.rank=2"])
    assert args.config == "c.yaml" and args.overrides == ["train.lr=1", "lora.rank=2"] and args.no_progress
    with pytest.raises(SystemExit):
        cli.parse_args(["c.yaml", "--bogus"])


def test_help_is_plain_text_in_lines_a_terminal_shows(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "flame-train-lora CONFIG" in out and "  train.lr: 0.0001 -- " in out
    assert "``" not in out and max(len(line) for line in out.split("options (section.key")[1].splitlines()) <= 100

def test_cli_exit_codes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"cache_dir": "c"}, "output": {"dir": str(tmp_path / "o")},
                                    "train": {"steps": 1}}))
    outcomes = {143: TrainingStopped("stopped", "interrupted", 1, "ck", signal.SIGTERM),
                130: TrainingStopped("stopped", "interrupted", 1, "ck", signal.SIGINT),
                1: TrainingError("writing the checkpoint failed: No space left on device")}

    class FakeTrainer:
        def __init__(self, cfg, progress=None):
            pass

        def train(self):
            raise outcome

    monkeypatch.setattr("flame.train.trainer.Trainer", FakeTrainer)
    for code, stop in outcomes.items():
        outcome = stop
        assert cli.main([str(path)]) == code
    assert "flame-train-lora: error: writing the checkpoint failed" in capsys.readouterr().err


# ---- signals ---------------------------------------------------------------------------------------

def _signal_during(monkeypatch, obj, name, when, signals):
    """Replace ``obj.name`` by a call that sends ``signals`` to this process first when ``when()``."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if when():
            for sig in signals:
                os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


def test_sigterm_saves_a_checkpoint_and_resume_continues(cache_dir, tmp_path, straight, monkeypatch):
    trainer = _trainer(_config(cache_dir, tmp_path))
    _signal_during(monkeypatch, trainer, "_update", lambda: trainer.step == 2, [signal.SIGTERM])
    with pytest.raises(TrainingStopped, match=r"interrupted at step 3 \(SIGTERM\)") as e:
        trainer.train()
    assert e.value.signum == signal.SIGTERM and e.value.step == 3
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3]
    rest = _trainer(_config(cache_dir, tmp_path, "resume=latest")).train()
    assert rest["losses"] == straight[3:]


def test_two_signals_during_the_update_save_one_step_boundary(cache_dir, tmp_path, straight, monkeypatch):
    """Two Ctrl-C inside the optimizer update (the weights half-written): the update finishes, and the
    checkpoint is that of the step it ends; the resumed run follows the uninterrupted one."""
    trainer = _trainer(_config(cache_dir, tmp_path))
    _signal_during(monkeypatch, trainer.optimizer, "step", lambda: trainer.step == 1, [signal.SIGINT] * 2)
    with pytest.raises(TrainingStopped) as e:
        trainer.train()
    assert e.value.step == 2
    ckpt = e.value.checkpoint
    reference = _trainer(_config(cache_dir, tmp_path / "ref", "train.steps=2", "output.save_every=2"))
    reference.train()
    ref = _lora_weights(list_checkpoints(tmp_path / "ref" / "checkpoints")[0][1])
    mine = _lora_weights(ckpt)
    assert all((ref[k] == mine[k]).all() for k in ref), "the checkpoint mixes two steps"
    rest = _trainer(_config(cache_dir, tmp_path, "resume=latest")).train()
    assert rest["losses"] == straight[2:]


def test_two_signals_during_the_forward_abandon_the_step(cache_dir, tmp_path, straight, monkeypatch):
    trainer = _trainer(_config(cache_dir, tmp_path))
    _signal_during(monkeypatch, trainer, "step_fn", lambda: trainer.step == 2, [signal.SIGINT] * 2)
    with pytest.raises(TrainingStopped) as e:
        trainer.train()
    assert e.value.step == 2 and [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]
    rest = _trainer(_config(cache_dir, tmp_path, "resume=latest")).train()
    assert rest["losses"] == straight[2:]


def test_a_third_signal_during_the_save_quits_without_a_partial_checkpoint(cache_dir, tmp_path, monkeypatch):
    trainer = _trainer(_config(cache_dir, tmp_path))
    _signal_during(monkeypatch, trainer, "step_fn", lambda: trainer.step == 2, [signal.SIGINT] * 2)
    import flame.train.trainer as T
    _signal_during(monkeypatch, T, "save_safetensors", lambda: trainer.run.stop is not None, [signal.SIGINT])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert os.listdir(tmp_path / "checkpoints") == []  # the save in flight was removed whole


# ---- partial files ---------------------------------------------------------------------------------

def test_a_damaged_metrics_line_is_repaired_on_resume(cache_dir, tmp_path, straight):
    _trainer(_config(cache_dir, tmp_path, "train.steps=3")).train()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 4, "lo')  # a crash mid-write
    rest = _trainer(_config(cache_dir, tmp_path, "resume=latest")).train()
    assert rest["losses"] == straight[3:]
    assert [r["loss"] for r in _metrics(tmp_path) if "loss" in r] == straight
    before = metrics.read_text()
    again = _trainer(_config(cache_dir, tmp_path, "resume=latest")).train()  # the run is finished
    assert again["step"] == 6 and again["losses"] == []
    assert metrics.read_text() == before, "resuming a finished run appended lines"


def test_validation_losses_are_not_repeated_when_a_finished_run_is_resumed(cache_dir, tmp_path):
    cfg = ("train.steps=2", "output.validate_every=2")
    _trainer(_config(cache_dir, tmp_path, *cfg)).train()
    before = (tmp_path / "metrics.jsonl").read_text()
    _trainer(_config(cache_dir, tmp_path, *cfg, "resume=latest")).train()
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_a_full_disk_while_checkpointing_keeps_everything_and_names_the_folder(cache_dir, tmp_path, monkeypatch):
    import flame.train.trainer as T
    trainer = _trainer(_config(cache_dir, tmp_path, "output.save_every=2"))
    real = T.save_safetensors

    def full_disk(tensors, path, **kw):
        if trainer.step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, **kw)

    monkeypatch.setattr(T, "save_safetensors", full_disk)
    with pytest.raises(TrainingError) as e:
        trainer.train()
    msg = str(e.value)
    assert "No space left on device" in msg and f"free space on the disk holding {tmp_path / 'checkpoints'}" in msg
    assert "step-00000002" in msg and "--resume" in msg
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002"]


# ---- what the console says -------------------------------------------------------------------------

def test_the_console_shows_smoothed_loss_validation_and_a_summary(cache_dir, tmp_path):
    lines = []
    flame.manual_seed(3)
    cfg = _config(cache_dir, tmp_path, "train.steps=1", "output.validate_every=1", "output.log_every=1")
    result = Trainer(cfg, model=StandInUNet(), progress=False, log=lines.append).train()
    text = "\n".join(lines)
    assert "for 1 steps" not in text and ": 1 step (" in text
    assert "step 0: validation loss" in text and "step 1: validation loss" in text
    step_line = next(line for line in lines if line.startswith("step 1/1"))
    assert "loss " in step_line and (" mem " in step_line) != flame.is_interpreter()  # GPU memory on a GPU only
    rows = [r for r in _metrics(tmp_path) if "loss" in r]
    assert rows[0]["loss_smooth"] == pytest.approx(rows[0]["loss"])  # bias-corrected: the first is the loss
    summary = lines[-1]
    assert summary.startswith("done: 1 step in ")
    for part in ("validation loss:", "training loss (smoothed):", str(tmp_path / "lora.safetensors"),
                 "step-00000001", "metrics.jsonl", "load_lora_weights(", "use_safetensors=True"):
        assert part in summary, summary
    assert result["val_losses"][1] == pytest.approx(float(summary.split("validation loss: ")[1].split()[0]),
                                                    abs=1e-4)
    lines.clear()
    flame.manual_seed(3)
    Trainer(_config(cache_dir, tmp_path, "train.steps=3", "resume=latest", "output.validate_every=1"),
            model=StandInUNet(), progress=False, log=lines.append).train()
    assert any(": steps 2-3 of 3 (" in line for line in lines), lines


def test_each_steps_loss_is_shown_beside_the_bias_corrected_average(cache_dir, tmp_path):
    from flame.train.trainer import SMOOTHING
    lines = []
    flame.manual_seed(3)
    Trainer(_config(cache_dir, tmp_path, "train.steps=3", "output.log_every=1"), model=StandInUNet(), progress=False,
            log=lines.append).train()
    rows = [r for r in _metrics(tmp_path) if "loss" in r]
    assert rows[0]["loss_smooth"] == pytest.approx(rows[0]["loss"])  # the first loss itself, not 2% of it
    average = 0.0
    for n, row in enumerate(rows, 1):  # Adam's bias correction: the average over n losses divided by 1 - beta^n
        average = SMOOTHING * average + (1 - SMOOTHING) * row["loss"]
        assert row["loss_smooth"] == pytest.approx(average / (1 - SMOOTHING ** n))
        step_line = next(line for line in lines if line.startswith(f"step {n}/3 "))
        assert f"  loss {row['loss']:.4f}  smoothed {row['loss_smooth']:.4f}  " in step_line, step_line
    assert f"training loss (smoothed): {rows[-1]['loss_smooth']:.4f} (step 3: {rows[-1]['loss']:.4f})" in lines[-1]


def test_the_bar_shows_the_validation_loss_just_computed(cache_dir, tmp_path, capsys):
    flame.manual_seed(3)
    cfg = _config(cache_dir, tmp_path, "train.steps=2", "output.validate_every=2", "output.log_every=1")
    val = Trainer(cfg, model=StandInUNet(), progress=True, log=lambda *a: None).train()["val_losses"]
    bar = capsys.readouterr().err
    assert f"{val[0]:.4f}" != f"{val[2]:.4f}"
    assert re.findall(r"val=([0-9.]+)", bar)[-1] == f"{val[2]:.4f}", bar  # validated after step 2's flush
    last = _metrics(tmp_path)[-3]  # step 2's loss, then its speed record and its validation loss
    assert f"loss={last['loss']:.4f}, smoothed={last['loss_smooth']:.4f}" in bar

def test_load_config_file_errors_name_the_option(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"cache_dir": "c"}, "output": {"dir": "o"}, "train": {"steps": 1},
                                    "model": {"config": "foo"}}))
    with pytest.raises(ConfigError, match=r"model\.config: a sdxl model's config is tiny, sdxl or a diffusers config"):
        load_config(path)


def test_samples_while_training_go_to_step_folders_and_metrics(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("PIL")
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tiny_sdxl import write_tiny_pipeline
    pipe = write_tiny_pipeline(tmp_path / "pipeline")  # text encoders 12 + 20 wide, pooled 16
    dims = SimpleNamespace(in_channels=4, cross_attention_dim=32, pooled_dim=16, sample_size=4, block_out_channels=(8,))
    cache = tmp_path / "cache"
    write_synthetic_cache(cache, 8, 4, 6, 32, 16, latent_sizes=[(4, 4)], val_samples=0, seed=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# samples\n\na dog\n")
    cfg = _config(cache, tmp_path / "run", "train.steps=3", f"sample.prompts={prompts}", f"sample.model={pipe}",
                  "sample.steps=1", "sample.every_n_steps=3", "sample.at_start=true", "sample.width=16",
                  "sample.height=16", "sample.seed=5", "output.report_to=[tensorboard]")
    flame.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, model=StandInUNet(dims), progress=False, log=lambda *a: None)
    rng = flame.get_rng_state()
    trainer.samples.render(trainer.model, 0, tmp_path / "probe")
    assert flame.get_rng_state() == rng and trainer.model.training  # sampling leaves the run as it was
    trainer.train()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sampled = [(r["step"], r["samples"]) for r in records if "samples" in r]
    assert [s for s, _ in sampled] == [0, 3]  # at the start, every 3 steps; the end is step 3: not twice
    for step, paths in sampled:
        assert paths == [str(run / "samples" / f"step-{step}" / "00.png")]
    with Image.open(sampled[-1][1][0]) as im:
        assert im.size == (16, 16) and json.loads(im.text["flame"])["prompt"] == "a dog"
    first = np.asarray(Image.open(sampled[0][1][0]))
    np.testing.assert_array_equal(first, np.asarray(Image.open(tmp_path / "probe" / "step-0" / "00.png")))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("samples/00")] == [0, 3]


def test_sample_section_is_checked_before_any_work(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"sample\.prompts: sampling needs the text encoders"):
        _config(cache_dir, tmp_path / "o", "sample.prompts=[a cat]")
    with pytest.raises(ConfigError, match=r"sample\.max_tokens: expected one of 75, 150, 225"):
        _config(cache_dir, tmp_path / "o", "sample.max_tokens=100")
    with pytest.raises(ConfigError) as e:
        _config(cache_dir, tmp_path / "o", f"sample.prompts={tmp_path / 'nothing.txt'}", f"sample.model={tmp_path}",
                "sample.width=30")
    assert "nothing.txt is not a file" in str(e.value) and "sample.width: must be a multiple of 8" in str(e.value)


def test_block_learning_rates_and_lora_plus_make_the_optimizer_groups(tiny_cache, cache_dir, tmp_path):
    from flame.models import SDXLUNet
    from flame.train.families.sdxl import block_of
    cfg = _config(tiny_cache, tmp_path / "sdxl", "lora.lr_down=0.5", "lora.lr_mid=0", "lora.lr_up=2",
                  "lora.plus_ratio=16")
    with flame.nn.init.skip_init():  # only the adapters' groups matter here
        model = SDXLUNet(SDXLUNetConfig.tiny())
    trainer = Trainer(cfg, model=model, progress=False, log=lambda *a: None)
    lr = cfg.train.lr
    want = {"down": 0.5 * lr, "mid": 0.0, "up": 2 * lr, "other": lr}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    seen = set()
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            side = 16.0 if name.endswith("lora_B") else 1.0
            assert group["lr"] == pytest.approx(want[block_of(name)] * side), name
            seen.add(block_of(name))
    assert seen == {"down", "mid", "up"}  # attn targets: no adapter outside the three parts
    assert block_of("time_embedding.linear_1") == "other" and block_of("mid_block.attentions.0.proj_in") == "mid"
    # LoRA+ on the stand-in: B starts at 0 and Adam's first step moves it by about its own lr
    moved = {}
    for ratio in (1.0, 4.0):
        t = _trainer(_config(cache_dir, tmp_path / f"plus{ratio}", "train.steps=1", f"lora.plus_ratio={ratio}",
                             "train.max_grad_norm=0"))
        t.train_step()
        moved[ratio] = max(float(np.abs(m.lora_B.numpy()).max()) for _, m in flame.nn.lora.lora_modules(t.model))
    assert moved[1.0] == pytest.approx(3e-3, rel=0.02) and moved[4.0] == pytest.approx(4 * 3e-3, rel=0.02)


def test_ema_file_checkpoints_and_exact_resume(cache_dir, tmp_path, monkeypatch):
    over = ["ema.decay=0.5", "ema.every=2", "output.save_every=2", "train.steps=4"]
    trainer = _trainer(_config(cache_dir, tmp_path / "a", *over))
    start = {k: v.numpy().astype(np.float64) for k, v in trainer.model.state_dict().items() if "lora" in k}
    at = {}
    real_step = trainer.train_step

    def recording_step():
        real_step()
        at[trainer.step] = {k: v.numpy() for k, v in trainer.model.state_dict().items() if "lora" in k}

    monkeypatch.setattr(trainer, "train_step", recording_step)
    straight = trainer.train()
    want = start
    for n, step in enumerate((2, 4)):  # updates after steps 2 and 4 with diffusers' warm-up decay
        d = min(0.5, (1 + n) / (10 + n))
        want = {k: d * w + (1 - d) * at[step][k] for k, w in want.items()}
    ema_file = load_safetensors(tmp_path / "a" / "lora_ema.safetensors")
    plain = load_safetensors(tmp_path / "a" / "lora.safetensors")
    assert ema_file.keys() == plain.keys()
    for key, value in ema_file.items():  # PEFT names: unet.<path>.lora_A.weight
        path = key.removeprefix("unet.").removesuffix(".weight")
        np.testing.assert_allclose(value.numpy(), want[path], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(plain[key].numpy(), at[4][path])  # the trained weights, not the average
    # interrupted after step 2 and resumed: the same average at the end
    b = _trainer(_config(cache_dir, tmp_path / "b", *over))
    _interrupt_at(b, 2, monkeypatch)
    with pytest.raises(TrainingStopped):
        b.train()
    assert (tmp_path / "b" / "checkpoints" / "step-00000002" / "ema.safetensors").is_file()
    rest = _trainer(_config(cache_dir, tmp_path / "b", *over, "resume=latest")).train()
    assert rest["losses"] == straight["losses"][2:]
    again = load_safetensors(tmp_path / "b" / "lora_ema.safetensors")
    for key in ema_file:
        np.testing.assert_array_equal(again[key].numpy(), ema_file[key].numpy())
    with pytest.raises(ConfigError, match=r"sample\.use_ema: no moving average is kept"):
        _config(cache_dir, tmp_path, "sample.use_ema=true")


def test_caption_dropout_swaps_in_the_empty_caption_on_the_device(cache_dir, tmp_path):
    trainer = _trainer(_config(cache_dir, tmp_path, "data.caption_dropout=0.5"))
    empty_embeds, empty_pooled = (t.numpy() for t in LatentCache(cache_dir).empty_prompt())
    seen, real = [], trainer.step_fn
    trainer.step_fn = lambda *args: seen.append((args[3].numpy(), args[4].numpy())) or real(*args)
    trainer.train()
    rows = [(e, p) for embeds, pooled in seen for e, p in zip(embeds, pooled)]
    dropped = [bool((e == empty_embeds[0]).all()) for e, _ in rows]
    assert len(rows) == 24 and 4 <= sum(dropped) <= 20  # 6 steps of 4: Binomial(24, 0.5)
    for (_, p), d in zip(rows, dropped):  # the pooled embedding goes with the hidden states
        assert bool((p == empty_pooled[0]).all()) == d
    old = tmp_path / "old_cache"
    shutil.copytree(cache_dir, old)
    index = json.loads((old / "index.json").read_text())
    del index["empty_prompt"]
    (old / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"data\.caption_dropout: the cache at .* holds no embedding of the empty"):
        _trainer(_config(old, tmp_path / "o", "data.caption_dropout=0.1"))


def test_locon_adds_conv_adapters_with_their_own_rank(tiny_cache, tmp_path):
    from flame.models import SDXLUNet
    with flame.nn.init.skip_init():
        model = SDXLUNet(SDXLUNetConfig.tiny())
    cfg = _config(tiny_cache, tmp_path, "lora.conv_targets=locon", "lora.conv_rank=2", "lora.conv_alpha=1")
    trainer = Trainer(cfg, model=model, progress=False, log=lambda *a: None)
    layers = dict(flame.nn.lora.lora_modules(trainer.model))
    convs = {n for n, m in layers.items() if isinstance(m, flame.nn.lora.LoRAConv2d)}
    assert {"down_blocks.0.resnets.0.conv1", "down_blocks.1.resnets.0.conv_shortcut",
            "down_blocks.0.downsamplers.0.conv", "up_blocks.0.upsamplers.0.conv", "mid_block.resnets.1.conv2"} <= convs
    assert not convs & {"conv_in", "conv_out"} and "down_blocks.0.resnets.0.time_emb_proj" not in layers
    assert {(layers[n].rank, layers[n].alpha) for n in convs} == {(2, 1.0)}
    assert layers["mid_block.attentions.0.transformer_blocks.0.attn1.to_q"].rank == 4
    kohya = flame.nn.lora_state_dict(trainer.model, format="kohya")
    assert kohya["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape == (2, 32, 3, 3)
    with pytest.raises(ConfigError, match=r"lora\.conv_targets: 'to_q' matches none of the model's .* Conv2d"):
        Trainer(_config(tiny_cache, tmp_path / "bad", "lora.conv_targets=to_q"), progress=False)


def test_several_datasets_with_repeats_a_regularization_set_and_their_loss_weights(cache_dir, tmp_path):
    reg = tmp_path / "reg"
    write_synthetic_cache(reg, 6, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 4)], val_samples=0, concepts=4, seed=9)
    datasets = [{"cache_dir": str(cache_dir), "repeats": 2}, {"cache_dir": str(reg), "is_reg": True, "loss_weight": 2}]
    cfg = _config(None, tmp_path / "run", f"data.datasets={json.dumps(datasets)}", "data.prior_loss_weight=0.25",
                  "data.cache_dir=null")
    trainer = _trainer(cfg)
    n_main, n_reg = len(LatentCache(cache_dir).split("train")), 6
    assert sum(len(b) for b in trainer.loader.plan(0)) == 2 * n_main + n_reg
    seen, real = [], trainer.step_fn
    trainer.step_fn = lambda *args: seen.append((args[6].numpy(), len(args[0]))) or real(*args)
    result = trainer.train()
    meta = read_metadata(result["lora"])
    assert meta["ss_num_reg_images"] == str(n_reg) and meta["ss_prior_loss_weight"] == "0.25"
    assert json.loads(meta["ss_dataset_dirs"])[str(cache_dir)] == {"n_repeats": 2, "img_count": n_main}
    weights = np.concatenate([w for w, _ in seen])
    assert set(weights.tolist()) <= {1.0, 0.5} and len(weights) == sum(n for _, n in seen)
    with pytest.raises(ConfigError, match=r"data\.cache_dir / data\.datasets: set exactly one"):
        _config(cache_dir, tmp_path, f"data.datasets={json.dumps(datasets)}")
    with pytest.raises(ConfigError, match=r"data\.datasets\[1\]: unknown key\(s\) weight; an entry has cache_dir"):
        _config(None, tmp_path, "data.cache_dir=null", 'data.datasets=[{cache_dir: a}, {cache_dir: b, weight: 2}]')
    with pytest.raises(ConfigError, match=r"data\.datasets\[0\]\.repeats: must be >= 1"):
        _config(None, tmp_path, "data.cache_dir=null", "data.datasets=[{cache_dir: a, repeats: 0}]")


def test_flip_trains_on_the_mirrored_latents_chosen_per_sample_and_epoch(tmp_path):
    cache = tmp_path / "flipped"
    write_synthetic_cache(cache, 16, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 6)], val_samples=0, concepts=4, seed=2, flipped=True)
    trainer = _trainer(_config(cache, tmp_path / "run", "data.flip=true", "train.steps=2"))
    seen, asked, real = [], [], trainer.step_fn
    real_flips = trainer.loader.flips_of
    trainer.loader.flips_of = lambda ids: asked.append((tuple(ids), real_flips(ids))) or asked[-1][1]
    trainer.step_fn = lambda *args: seen.append(args[0].numpy()) or real(*args)
    trainer.train()
    c = LatentCache(cache)
    flips = [f for _, fs in asked for f in fs]
    assert 0 < sum(flips) < len(flips)  # 8 coins: both sides
    for (ids, fs), latents in zip(asked, seen):
        np.testing.assert_array_equal(latents, c.read(ids, fs)["latents"].numpy())
        for j, f in enumerate(fs):  # a mirrored sample's latents are its own, mirrored along the width
            mine = c.read([ids[j]])["latents"].numpy()[0]
            np.testing.assert_array_equal(latents[j], mine[..., ::-1] if f else mine)
    plain = write_synthetic_cache(tmp_path / "plain", 4, DIMS.in_channels, 6, DIMS.cross_attention_dim,
                                  DIMS.pooled_dim, latent_sizes=[(4, 4)], val_samples=0, concepts=4)
    with pytest.raises(ConfigError, match=r"data\.flip: the cache at .* holds no mirrored images' latents"):
        _trainer(_config(plain, tmp_path / "o", "data.flip=true"))


def test_caption_variants_train_on_the_variant_picked_per_sample_and_epoch(tmp_path):
    from flame.data import CacheWriter
    rng = np.random.default_rng(0)
    w = CacheWriter(tmp_path / "variants", DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                    caption_variants=3, text_dtype="fp32")
    for _ in range(8):
        w.add(rng.standard_normal((DIMS.in_channels, 4, 4)), rng.standard_normal((6, DIMS.cross_attention_dim)),
              rng.standard_normal(DIMS.pooled_dim), [32, 32, 0, 0, 32, 32],
              prompt_embeds_variants=rng.standard_normal((2, 6, DIMS.cross_attention_dim)),
              pooled_variants=rng.standard_normal((2, DIMS.pooled_dim)))
    cache = LatentCache(w.close())
    trainer = _trainer(_config(cache.path, tmp_path / "run", "data.caption_variants=true", "train.steps=2"))
    seen, real = [], trainer.step_fn
    trainer.step_fn = lambda *args: seen.append((args[3].numpy(), args[4].numpy())) or real(*args)
    picked = []
    real_variants = trainer.loader.variants_of
    trainer.loader.variants_of = lambda ids, n: picked.append((tuple(ids), real_variants(ids, n))) or picked[-1][1]
    trainer.train()
    assert {v for _, vs in picked for v in vs} - {0} and all(n == 4 for n in map(len, (ids for ids, _ in picked)))
    for (ids, vs), (embeds, pooled) in zip(picked, seen):
        host = cache.read(ids, variants=vs)
        np.testing.assert_array_equal(embeds, host["prompt_embeds"].numpy())
        np.testing.assert_array_equal(pooled, host["pooled"].numpy())
    with pytest.raises(ConfigError, match=r"data\.caption_variants: the cache at .* holds one caption per image"):
        _trainer(_config(tmp_path / "variants_none", tmp_path / "o", "data.caption_variants=true",
                         "data.synthetic_samples=4"))


OPTIMIZERS = {  # train.optimizer: (its class, settings, the state it checkpoints)
    "lion": ("Lion", ["train.lr=3e-4"], {"exp_avg"}),
    "adamw8bit": ("AdamW8bit", [], {"state1", "state2", "absmax1", "absmax2"}),
    "prodigy": ("Prodigy", ["train.lr=1.0", "train.prodigy_d0=1e-4"], {"exp_avg", "exp_avg_sq", "s", "p0"}),
    "adafactor": ("Adafactor", ["train.lr=1e-3"], {"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n != "adafactor" else n
                                  for n in OPTIMIZERS])  # their state round trips: test_optim.py
def test_each_optimizer_trains_checkpoints_its_state_and_resumes_exactly(cache_dir, tmp_path, monkeypatch, name):
    import flame.train.trained as trainer_module  # make_optimizer lives with what trains
    cls, settings, state = OPTIMIZERS[name]
    real = trainer_module.AdamW8bit  # the tiny model's adapters are below bitsandbytes' 4096-element threshold
    monkeypatch.setattr(trainer_module, "AdamW8bit", lambda *a, **kw: real(*a, min_8bit_size=0, **kw))
    over = [f"train.optimizer={name}", *settings, "train.steps=3", "output.save_every=2"]
    trainer = _trainer(_config(cache_dir, tmp_path / "a", *over))
    assert type(trainer.optimizer).__name__ == cls
    straight = trainer.train()
    assert all(math.isfinite(v) for v in straight["losses"])
    saved = load_safetensors(tmp_path / "a" / "checkpoints" / "step-00000002" / "optimizer.safetensors")
    assert {k.split(".", 1)[1] for k in saved} == state
    assert read_metadata(straight["lora"])["ss_optimizer"] == cls
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000002", tmp_path / "b" / "checkpoints" / "step-00000002")
    resumed = _trainer(_config(cache_dir, tmp_path / "b", *over, "resume=latest")).train()
    assert resumed["losses"] == straight["losses"][2:]
    assert load_safetensors(resumed["lora"]).keys() == load_safetensors(straight["lora"]).keys()
    for key, value in load_safetensors(resumed["lora"]).items():
        np.testing.assert_array_equal(value.numpy(), load_safetensors(straight["lora"])[key].numpy())


def test_optimizer_settings_are_checked(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.optimizer: expected one of adamw, adamw8bit, lion, prodigy"):
        _config(cache_dir, tmp_path, "train.optimizer=rmsprop")
    with pytest.raises(ConfigError, match=r"prodigy estimates one step size .* lora\.plus_ratio must be 1"):
        _config(cache_dir, tmp_path, "train.optimizer=prodigy", "lora.plus_ratio=4")
