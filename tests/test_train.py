"""The SDXL LoRA trainer: config validation, loss going down, LoRA files, exact resume, Ctrl-C and
NaN stops. Most tests train a small stand-in denoiser (the UNet's forward signature and LoRA target
names, a handful of kernels per step) so they stay fast on the interpreter; one trains the real
tiny SDXL UNet through the CLI with configs/sdxl_lora_tiny.yaml."""
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

import flame
import flame.nn.functional as F
from flame import nn
from flame.data import LatentCache, write_synthetic_cache
from flame.io import load_lora, load_safetensors, save_safetensors
from flame.train import ConfigError, Trainer, TrainingStopped, build_config, list_checkpoints, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIMS = SimpleNamespace(in_channels=4, cross_attention_dim=16, pooled_dim=8, sample_size=4)


class _Attention(nn.Module):
    def __init__(self, dim, context_dim):
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, context):
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        return self.to_out[0](F.scaled_dot_product_attention(q, k, v))


class StandInUNet(nn.Module):
    """``SDXLUNet``'s forward signature on a few layers: latent pixels as tokens, a timestep and
    pooled embedding added, one cross-attention block (to_q/to_k/to_v/to_out.0) over the text."""

    def __init__(self, dims=DIMS, width=16, dtype=None):
        super().__init__()
        self.config = dims
        self.proj_in = nn.Linear(dims.in_channels, width, dtype=dtype)
        self.cond = nn.Linear(dims.pooled_dim + 1, width, dtype=dtype)
        self.attn2 = _Attention(width, dims.cross_attention_dim)
        self.proj_out = nn.Linear(width, dims.in_channels, dtype=dtype)
        self.attn2.to(dtype or flame.float32)

    @property
    def dtype(self):
        return self.proj_in.weight.dtype

    def enable_gradient_checkpointing(self, enabled=True):
        self.checkpointing = enabled
        return self

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        B, C, H, W = sample.shape
        dt = self.dtype
        x = sample.to(dt).permute(0, 2, 3, 1).reshape(B, H * W, C)
        t = (timestep.to(flame.float32) * 0.001).reshape(B, 1)
        cond = self.cond(flame.cat([text_embeds.to(flame.float32), t], -1).to(dt)).reshape(B, 1, -1)
        h = self.proj_in(x) + cond
        h = h + self.attn2(h, encoder_hidden_states.to(dt))
        return self.proj_out(h).reshape(B, H, W, C).permute(0, 3, 1, 2)


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
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(path, ["train.lr"])
    with pytest.raises(ConfigError, match=r"output\.dir: required"):
        build_config({"data": {"cache_dir": "c"}, "train": {"steps": 1}})


def test_cli_reports_config_errors_and_prints_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"cache_dir": "cache"}, "output": {"dir": "out"}, "train": {"steps": 2}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "scripts/train_sdxl_lora.py", str(path), "train.lr=abc", "lora.nope=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "train.lr: expected a number" in r.stderr and "lora.nope: unknown option" in r.stderr
    r = subprocess.run([sys.executable, "scripts/train_sdxl_lora.py", str(path), "lora.rank=8", "--print-config"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lora"]["rank"] == 8


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


@pytest.mark.parametrize("mixed", [False, True])
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


def test_tiny_sdxl_config_trains_through_the_cli(tmp_path):
    """configs/sdxl_lora_tiny.yaml end to end on the real tiny SDXL UNet (3 steps instead of 6 to
    save time): synthetic cache, training, validation loss down, a checkpoint, a LoRA file that
    loads into SDXLUNet."""
    from flame.models import SDXLUNet, SDXLUNetConfig
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "scripts/train_sdxl_lora.py", "configs/sdxl_lora_tiny.yaml", "--no-progress",
                        f"output.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3",
                        "output.validate_every=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "writing a synthetic cache of 20 samples" in r.stdout and "step 3/3" in r.stdout
    rows = _metrics(tmp_path)
    val = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    assert sorted(val) == [0, 3] and val[3] < 0.97 * val[0], val
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3]
    model = SDXLUNet(SDXLUNetConfig.tiny())
    loaded = load_lora(model, tmp_path / "lora.safetensors")
    attn_mlp = [n for n in SDXLUNet.layer_names(SDXLUNetConfig.tiny()) if "time_emb_proj" not in n
                and ".linear_" not in n]  # every Linear but the time / text-time embeddings'
    assert sorted(loaded) == sorted(attn_mlp)
