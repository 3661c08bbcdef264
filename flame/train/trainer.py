"""The SDXL LoRA trainer: cached latents in, a LoRA file out.

One optimizer step::

    for each of grad_accum micro-batches:           (host: next batch of one aspect bucket)
        noise, t = sample_noise(...), sample_timesteps(...)        (flame's Philox RNG)
        loss, grads = loss_and_grads(latents, noise, t, embeds, pooled, time_ids)
    [unscale_ + found-inf check (fp16)] clip_grad_norm_, AdamW step (skipped on the device when
    the loss or the gradient norm is not finite), loss-scaler update, lr-scheduler step

``loss_and_grads`` is a pure device function of fixed-shape tensors (noising, UNet forward,
min-SNR-weighted MSE, backward): no host sync and no random numbers inside, so it can be replayed
from a CUDA graph (``train.cuda_graph``). The host reads losses only every ``output.log_every``
steps (and before any checkpoint): a non-finite loss then stops the run with a checkpoint whose
weights never saw that step's update.

Checkpoints (``flame.train.checkpoints``) hold the LoRA weights, the AdamW state, the lr
scheduler, the loss scaler, flame's RNG state, the data loader's position and the step; resuming
from one reproduces the losses of an uninterrupted run exactly. Ctrl-C (SIGINT) finishes the
current step, saves a checkpoint and stops; a second Ctrl-C stops at once.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time

import numpy as np
import torch
import yaml

from .. import runtime
from ..amp import DynamicLossScaler
from ..autograd import GradientMap, no_grad
from ..data import BucketBatchLoader, LatentCache, write_synthetic_cache_for
from ..diffusion import DDPMSchedule, min_snr_weights, sample_noise, sample_timesteps, weighted_mse_loss
from ..graphs import CapturedStep
from ..io import atomic_write, load_lora, load_safetensors, save_lora, save_safetensors
from ..nn import inject_lora, lora_parameters
from ..ops.creation import get_rng_state, manual_seed, set_rng_state, tensor
from ..ops.elementwise import abs as fabs
from ..ops.elementwise import add, lt, mul, sub, to
from ..ops.shape import stack
from ..optim import AdamW, clip_grad_norm_
from ..optim.lr_scheduler import get_scheduler
from .checkpoints import latest_checkpoint, list_checkpoints, save_checkpoint
from .config import ConfigError, to_dict
from .model import build_unet, unet_config

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VAL_SEED = 0x5EEDBA5E


class TrainingStopped(RuntimeError):
    """The run stopped before its last step (``reason``: "interrupted" or "non_finite"); a
    checkpoint of the last good state was saved at ``checkpoint``."""

    def __init__(self, message, reason, step, checkpoint):
        super().__init__(message)
        self.reason, self.step, self.checkpoint = reason, step, checkpoint


class Trainer:
    """Builds a run from a validated config (``flame.train.config``) and trains it (``train()``).

    ``model``: a ready UNet to use instead of ``model.path`` / ``model.config`` (it must follow
    ``SDXLUNet``'s forward signature and expose ``config``, ``dtype`` and
    ``enable_gradient_checkpointing``). ``progress``: show a tqdm bar (default: when stderr is a
    terminal; otherwise a log line every ``log_every`` steps). ``log``: where text lines go.
    """

    def __init__(self, config, model=None, progress=None, log=print):
        self.cfg, self.log = config, log
        self.progress = progress
        c = config
        self.dtype = PRECISIONS[c.train.precision]
        self.out_dir = c.output.dir
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        os.makedirs(self.out_dir, exist_ok=True)
        manual_seed(c.train.seed)
        if model is None:
            model = build_unet(c.model.path, c.model.config, self.dtype)
        self.model = model
        self.cache = self._open_cache(model.config)
        model.requires_grad_(False)
        self.lora_layers = inject_lora(model, c.lora.targets, c.lora.rank, c.lora.alpha, c.lora.init, c.lora.dropout)
        model.train()
        if c.train.gradient_checkpointing:
            model.enable_gradient_checkpointing(True)
        self.params = lora_parameters(model)
        self.optimizer = AdamW(self.params, lr=c.train.lr, betas=(c.train.adam_beta1, c.train.adam_beta2),
                               eps=c.train.adam_eps, weight_decay=c.train.weight_decay)
        self.loader = BucketBatchLoader(self.cache, c.data.batch_size, "train", shuffle=True, seed=c.train.seed,
                                        drop_last=c.data.drop_last)
        self.total_steps = c.train.steps or c.train.epochs * math.ceil(len(self.loader) / c.train.grad_accum)
        self.scheduler = get_scheduler(c.train.lr_scheduler, self.optimizer, c.train.warmup_steps, self.total_steps)
        self.scaler = DynamicLossScaler() if self.dtype == torch.float16 else None
        self.schedule = self._noise_schedule()
        if c.diffusion.timestep_max > self.schedule.num_train_timesteps:
            raise ConfigError(f"diffusion.timestep_max ({c.diffusion.timestep_max}) exceeds the noise schedule's "
                              f"{self.schedule.num_train_timesteps} timesteps")
        graph = c.train.cuda_graph and not c.lora.dropout  # a replay would repeat the dropout masks
        if c.train.cuda_graph and c.lora.dropout:
            log("train.cuda_graph: off because lora.dropout > 0 (a replayed step would reuse its dropout masks)")
        self.step_fn = CapturedStep(self.loss_and_grads, enabled=graph)
        self.step = 0
        self.val_loader = None
        if c.output.validate_every and self.cache.split("val"):
            self.val_loader = BucketBatchLoader(self.cache, c.output.val_batch_size or c.data.batch_size, "val",
                                                shuffle=False)
        self.losses = {}  # step -> loss, as read on the host
        self.val_losses = {}  # step -> validation loss
        self._pending = []  # (step, loss, grad norm or None, lr, epoch) on the device, not yet read
        self._stop = None
        self._clock = None

    # ---- setup -------------------------------------------------------------------------------
    def _open_cache(self, mcfg):
        c = self.cfg.data
        if c.synthetic_samples and not os.path.isfile(os.path.join(c.cache_dir, "index.json")):
            self.log(f"writing a synthetic cache of {c.synthetic_samples} samples to {c.cache_dir}")
            write_synthetic_cache_for(c.cache_dir, c.synthetic_samples, mcfg, c.synthetic_latent_sizes,
                                      seed=self.cfg.train.seed)
        cache = LatentCache(c.cache_dir)
        want = {"latent_channels": mcfg.in_channels, "text_dim": mcfg.cross_attention_dim,
                "pooled_dim": mcfg.pooled_dim}
        bad = [f"{k} {getattr(cache, k)} (the model needs {v})" for k, v in want.items() if getattr(cache, k) != v]
        if bad:
            raise ConfigError(f"the cache at {c.cache_dir} does not fit the model: " + ", ".join(bad))
        if not cache.split("train"):
            raise ConfigError(f"the cache at {c.cache_dir} has no training samples")
        return cache

    def _noise_schedule(self):
        """The checkpoint's own scheduler config when it has one (pipeline folder), else SDXL's."""
        path = self.cfg.model.path
        if path and os.path.isdir(path):
            for candidate in (os.path.join(path, "scheduler", "scheduler_config.json"),
                              os.path.join(path, "..", "scheduler", "scheduler_config.json")):
                if os.path.isfile(candidate):
                    with open(candidate) as f:
                        sched = json.load(f)
                    kind = sched.get("prediction_type", "epsilon")
                    if kind != self.cfg.diffusion.prediction_type:
                        self.log(f"warning: {candidate} says prediction_type={kind}, the config trains "
                                 f"{self.cfg.diffusion.prediction_type}")
                    return DDPMSchedule.from_config(sched)
        return DDPMSchedule()

    # ---- the step ----------------------------------------------------------------------------
    def compute_loss(self, latents, noise, timesteps, prompt_embeds, pooled, time_ids):
        """The min-SNR-weighted MSE between the UNet's prediction and its target (0-d fp32)."""
        d = self.cfg.diffusion
        noisy = self.schedule.add_noise(latents, noise, timesteps, check=False)
        target = self.schedule.target(latents, noise, timesteps, d.prediction_type, check=False)
        pred = self.model(noisy, timesteps, prompt_embeds, pooled, time_ids)
        weights = None
        if d.min_snr_gamma:
            weights = min_snr_weights(self.schedule.snr(timesteps, check=False), d.min_snr_gamma, d.prediction_type)
        return weighted_mse_loss(pred, target, weights)

    def loss_and_grads(self, latents, noise, timesteps, prompt_embeds, pooled, time_ids):
        """Forward and backward of one micro-batch: ``(loss, GradientMap of the LoRA gradients)``.
        The loss is divided by grad_accum (and scaled by the loss scaler) for the backward only.
        Fixed shapes, no host sync, no random numbers: a CUDA graph can replay it."""
        loss = self.compute_loss(latents, noise, timesteps, prompt_embeds, pooled, time_ids)
        scaled = mul(loss, 1.0 / self.cfg.train.grad_accum) if self.cfg.train.grad_accum > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        return loss, scaled.backward()

    def _draw(self, batch):
        d = self.cfg.diffusion
        noise = sample_noise(batch.latents.shape, d.noise_offset)
        timesteps = sample_timesteps(len(batch), d.timestep_min, d.timestep_max)
        return noise, timesteps

    def _micro_batches(self):
        """Forward+backward of grad_accum micro-batches: (mean loss, summed gradients)."""
        losses, total = [], None
        for _ in range(self.cfg.train.grad_accum):
            batch = next(self.loader)
            noise, timesteps = self._draw(batch)
            loss, grads = self.step_fn(batch.latents, noise, timesteps, batch.prompt_embeds, batch.pooled,
                                       batch.time_ids)
            losses.append(loss if self.cfg.train.grad_accum == 1 else loss.clone())
            if self.cfg.train.grad_accum == 1:
                total = grads
            else:
                total = (total or GradientMap()).accumulate(grads)
        mean = losses[0] if len(losses) == 1 else mul(stack(losses).sum(), 1.0 / len(losses))
        return mean, total

    def _update(self, loss, grads):
        """Clip, optimizer step, scaler update. Returns the gradient norm (device) or None."""
        max_norm = self.cfg.train.max_grad_norm
        norm = None
        with no_grad():
            if self.scaler is not None:
                if max_norm:
                    self.scaler.unscale_(grads)
                    norm = clip_grad_norm_(grads, max_norm)
                self.scaler.step(self.optimizer, grads)
                self.scaler.update()
                return norm
            if max_norm:
                norm = clip_grad_norm_(grads, max_norm)
            # skip the update on the device when the loss (or the norm) is inf/NaN: x + y is finite iff both are
            probe = loss if norm is None else add(loss, norm)
            found = sub(1, to(lt(fabs(probe), math.inf), torch.int32))
            self.optimizer.step(grads, found_inf=found)
        return norm

    def train_step(self):
        """One optimizer step (grad_accum micro-batches); the loss stays on the device."""
        loss, grads = self._micro_batches()
        lr = self.scheduler.get_last_lr()[0]
        norm = self._update(loss, grads)
        self.scheduler.step()
        self.step += 1
        self._pending.append((self.step, loss.clone(), norm, lr, self.loader.epoch))

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> float:
        """Mean loss over the held-out split with fixed noise (a fixed seed) and evenly spaced
        timesteps: the same number for the same weights, whatever the step."""
        d = self.cfg.diffusion
        saved = get_rng_state()
        set_rng_state({"seed": VAL_SEED, "offset": 0})
        n = self.val_loader.num_samples
        span = d.timestep_max - d.timestep_min
        all_t = d.timestep_min + (np.arange(n) + 0.5) * span // n
        total, seen = None, 0
        self.model.eval()
        try:
            with no_grad():
                for batch in self.val_loader.epoch_batches(0):
                    b = len(batch)
                    noise = sample_noise(batch.latents.shape, d.noise_offset)
                    timesteps = tensor(all_t[seen:seen + b].astype(np.int64))
                    loss = mul(self.compute_loss(batch.latents, noise, timesteps, batch.prompt_embeds, batch.pooled,
                                                 batch.time_ids), float(b))
                    total = loss if total is None else add(total, loss)
                    seen += b
        finally:
            self.model.train()
            set_rng_state(saved)
        value = float(total.item()) / seen  # host sync (validation only)
        self.val_losses[self.step] = value
        self._metrics({"step": self.step, "val_loss": value})
        return value

    # ---- logging -----------------------------------------------------------------------------
    def _metrics(self, record):
        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _flush(self, bar):
        """Read the pending losses (one host sync), log them, and stop on a non-finite one."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = stack([p[1] for p in pending]).numpy()
        norms = [p[2] for p in pending]
        norm_values = stack(norms).numpy() if all(n is not None for n in norms) else [None] * len(pending)
        now = time.perf_counter()
        its = len(pending) / max(now - self._clock, 1e-9)
        self._clock = now
        mem = runtime.max_memory_allocated() / 2 ** 30
        bad = None
        for (step, _, _, lr, epoch), value, norm in zip(pending, values, norm_values):
            value = float(value)
            self.losses[step] = value
            rec = {"step": step, "loss": value, "lr": lr, "epoch": epoch}
            if norm is not None:
                rec["grad_norm"] = float(norm)
            self._metrics(rec)
            if bad is None and not math.isfinite(value):
                bad = (step, value)
        last = pending[-1]
        text = {"loss": f"{float(values[-1]):.4f}", "lr": f"{last[3]:.3g}", "it/s": f"{its:.2f}",
                "mem": f"{mem:.1f}G"}
        self._metrics({"step": last[0], "it_s": its, "max_memory_gb": mem})
        if bar is not None:
            bar.set_postfix(text, refresh=True)
        else:
            self.log(f"step {last[0]}/{self.total_steps}  " + "  ".join(f"{k} {v}" for k, v in text.items()))
        if bad is not None:
            self._stop = ("non_finite", bad)

    # ---- checkpoints -------------------------------------------------------------------------
    def state(self, opt: dict) -> dict:
        """The host-side part of a checkpoint (JSON-able); ``opt``: the optimizer's state dict."""
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": get_rng_state(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "optimizer": {"param_groups": opt["param_groups"],
                              "steps": {str(i): e["step"] for i, e in opt["state"].items()}},
                "config": to_dict(self.cfg)}

    def save(self) -> str:
        """Write a checkpoint of the current step (reads pending losses first)."""
        opt = self.optimizer.state_dict()
        tensors = {f"{i}.{k}": v for i, entry in opt["state"].items() for k, v in entry.items() if k != "step"}
        state = self.state(opt)
        writers = {
            "lora.safetensors": lambda p: save_lora(self.model, p, format="peft"),
            "optimizer.safetensors": lambda p: save_safetensors(tensors, p),
            "trainer_state.json": lambda p: atomic_write(p, lambda f: f.write(json.dumps(state, indent=1).encode())),
        }
        return save_checkpoint(self.ckpt_dir, self.step, writers, self.cfg.output.keep_last)

    def load(self, path) -> None:
        """Restore a checkpoint written by ``save`` (the model must already carry its adapters)."""
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        mine, theirs = to_dict(self.cfg), state.get("config", {})
        changed = [f"{s}.{k}" for s in ("model", "lora", "data") for k in mine[s]
                   if theirs.get(s, {}).get(k) != mine[s][k]]
        if changed:
            self.log(f"warning: resuming with different settings than the checkpoint: {', '.join(changed)}")
        load_lora(self.model, os.path.join(path, "lora.safetensors"), inject=False)
        tensors = load_safetensors(os.path.join(path, "optimizer.safetensors"))
        opt = state["optimizer"]
        entries = {int(i): {"step": s} for i, s in opt["steps"].items()}
        for key, value in tensors.items():
            i, name = key.split(".", 1)
            entries[int(i)][name] = value
        self.optimizer.load_state_dict({"state": entries, "param_groups": opt["param_groups"]})
        # the schedule is a closed form of the step: keep the step, take lr / warm-up / length from this config
        current = self.scheduler.state_dict()
        keep = ("base_lrs", "num_warmup_steps", "num_training_steps")
        self.scheduler.load_state_dict({**state["scheduler"], **{k: current[k] for k in keep}})
        self.scheduler.last_epoch -= 1
        self.scheduler.step()  # re-applies this step's lr to the optimizer
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self._trim_metrics()

    def _trim_metrics(self):
        """Drop metric records past the resumed step (they belong to the run that was cut short)."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            lines = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= self.step]
        with open(path, "w") as f:
            f.writelines(lines)

    def resume(self, spec) -> str | None:
        """Resume from ``spec``: "latest" (None when there is no complete checkpoint yet) or a folder."""
        if spec == "latest":
            path = latest_checkpoint(self.ckpt_dir)
            if path is None:
                self.log(f"no complete checkpoint in {self.ckpt_dir}: starting from step 0")
                return None
        else:
            path = spec
            if not os.path.isfile(os.path.join(path, "COMPLETE")):
                done = [p for _, p in list_checkpoints(self.ckpt_dir)]
                raise ConfigError(f"resume: {path} is not a complete checkpoint (no COMPLETE marker); complete "
                                  f"ones: {done or 'none'}")
        self.load(path)
        self.log(f"resumed from {path} at step {self.step}")
        return path

    # ---- the loop ----------------------------------------------------------------------------
    def _on_sigint(self, signum, frame):
        if self._stop is not None:
            raise KeyboardInterrupt
        self._stop = ("interrupted", None)
        self.log("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again to quit at once)")

    def _bar(self):
        from tqdm import tqdm
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if self.progress is None else not self.progress)
        return None if bar.disable else bar

    def lora_path(self) -> str:
        return os.path.join(self.out_dir, f"{self.cfg.output.name}.safetensors")

    def _start_fresh(self):
        """A run from step 0 must not mix with an earlier run's checkpoints and metrics."""
        old = list_checkpoints(self.ckpt_dir)
        if old and not self.cfg.output.overwrite:
            raise ConfigError(f"{self.out_dir} holds checkpoints of an earlier run (steps {[s for s, _ in old]}): "
                              "continue it with --resume (resume=latest), or pick another output.dir, or set "
                              "output.overwrite=true to replace it")
        if os.path.isdir(self.ckpt_dir):
            shutil.rmtree(self.ckpt_dir)
        metrics = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            os.unlink(metrics)

    def train(self) -> dict:
        """Run (or resume) to ``total_steps``; writes the LoRA file. Raises ``TrainingStopped``
        after saving a checkpoint when interrupted or when a loss is not finite."""
        c = self.cfg
        if not (c.resume and self.resume(c.resume)):
            self._start_fresh()
        with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(c), f, sort_keys=False)
        self.log(f"training {len(self.lora_layers)} LoRA layers ({sum(p.numel() for p in self.params):,} params) "
                 f"on {len(self.loader.cache.split('train'))} samples for {self.total_steps} steps "
                 f"({c.train.precision}, {runtime.device_name()})")
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGINT, self._on_sigint)
        bar = self._bar()
        self._clock = time.perf_counter()
        try:
            if self.val_loader is not None and self.step == 0:
                self.validate()
            while self.step < self.total_steps and self._stop is None:
                snapshot = (self.loader.state_dict(), get_rng_state())
                try:
                    self.train_step()
                except KeyboardInterrupt:  # raised inside the step: its update was not applied
                    self.loader.load_state_dict(snapshot[0])
                    set_rng_state(snapshot[1])
                    self._stop = ("interrupted", None)
                    break
                if bar is not None:
                    bar.update(1)
                s = self.step
                due_save = c.output.save_every and s % c.output.save_every == 0
                if s % c.output.log_every == 0 or s == self.total_steps or due_save:
                    self._flush(bar)
                if self._stop is None and self.val_loader is not None and s % c.output.validate_every == 0:
                    self.validate()
                if self._stop is None and due_save and s < self.total_steps:
                    self.save()
            self._flush(bar)
            if self._stop is None and self.val_loader is not None and self.step not in self.val_losses:
                self.validate()  # a last validation loss at the end of the run
            checkpoint = self.save()
        finally:
            if bar is not None:
                bar.close()
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
        if self._stop is not None:
            reason, info = self._stop
            if reason == "non_finite":
                msg = (f"stopped: the loss at step {info[0]} is {info[1]} (non-finite). Updates with a non-finite "
                       f"loss or gradient were skipped, so the checkpoint {checkpoint} (step {self.step}) holds finite "
                       "weights; lower train.lr, use train.precision=fp32 or fp16, or check the cache for bad latents")
            else:
                msg = (f"interrupted at step {self.step}: checkpoint saved to {checkpoint}; continue with --resume "
                       "(resume=latest)")
            self.log(msg)
            raise TrainingStopped(msg, reason, self.step, checkpoint)
        save_lora(self.model, self.lora_path(), format=c.lora.format)
        self.log(f"wrote {self.lora_path()} ({c.lora.format} format) after {self.step} steps")
        return {"step": self.step, "losses": [self.losses[s] for s in sorted(self.losses)],
                "val_losses": dict(self.val_losses), "lora": self.lora_path(), "checkpoint": checkpoint}


def train(config, model=None, **kwargs) -> dict:
    """Build a ``Trainer`` for ``config`` and run it (see ``Trainer.train``)."""
    return Trainer(config, model=model, **kwargs).train()


__all__ = ["PRECISIONS", "Trainer", "TrainingStopped", "train", "unet_config"]
