"""What a run reports besides its LoRA weights: the training metadata written into the LoRA file,
and the trackers its metrics go to (``output.report_to``).

Metadata: kohya's ``ss_*`` keys (what sd-scripts writes and what LoRA browsers and A1111/ComfyUI
extensions read: network dim/alpha, base model, resolution, steps, learning rate, ...) and the
Stability AI model spec's ``modelspec.*`` keys (architecture ``stable-diffusion-xl-v1-base/lora``).

Trackers: ``jsonl`` is ``output.dir/metrics.jsonl`` (always written: resuming reads it);
``tensorboard`` writes event files to ``output.dir/tensorboard/`` (the ``tensorboard`` package, through
``torch.utils.tensorboard``); ``wandb`` logs to Weights & Biases (the ``wandb`` package; set
``WANDB_MODE=offline`` to log without network and ``wandb sync`` later). Every scalar of a metrics
record goes to each tracker at its step; sample images go as images.
"""
from __future__ import annotations

import datetime
import importlib
import json

TRACKERS = ("jsonl", "tensorboard", "wandb")
_INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}


def lora_metadata(cfg, step: int, num_samples: int, started: float, finished: float, datasets=(),
                  optimizer: str = "AdamW", family=None) -> dict:
    """{str: str} training metadata for the LoRA file of a run with config ``cfg``; ``datasets``:
    ``(folder, repeats, training images, is_reg)`` of each cache it trained on; ``optimizer``: its
    class name (kohya's ``ss_optimizer``); ``family``: the run's model family (its base-model version and
    modelspec architecture; SDXL's when None)."""
    c = cfg
    alpha = c.lora.alpha if c.lora.alpha is not None else c.lora.rank
    network_args = {}
    if c.lora.conv_targets is not None:
        network_args = {"conv_dim": c.lora.conv_rank or c.lora.rank,
                        "conv_alpha": c.lora.conv_alpha if c.lora.conv_alpha is not None else
                        (c.lora.conv_rank or c.lora.rank)}
    if c.lora.dora:  # LyCORIS's network args for DoRA (strings, as kohya's --network_args pass them): magnitudes
        network_args.update({"dora_wd": "True", "wd_on_output": "True"})  # per output channel, PEFT's axis
    dirs = {folder: {"n_repeats": repeats, "img_count": count} for folder, repeats, count, _ in datasets}
    size = f"{c.sample.width or 1024}x{c.sample.height or 1024}" if c.model.config == "sdxl" else ""
    values = {
        "ss_network_module": "networks.lora", "ss_network_dim": c.lora.rank, "ss_network_alpha": alpha,
        "ss_base_model_version": family.base_model_version if family else "sdxl_base_v1-0",
        "ss_sd_model_name": c.model.path or c.model.config,
        "ss_output_name": c.output.name, "ss_steps": step, "ss_max_train_steps": c.train.steps or "",
        "ss_num_train_images": num_samples, "ss_learning_rate": c.train.lr, "ss_unet_lr": c.train.lr,
        "ss_text_encoder_lr": (c.train.lr if c.lora.text_encoder_lr is None else c.lora.text_encoder_lr)
        if c.lora.text_encoder else 0.0,  # 0: frozen, as kohya's --network_train_unet_only records it
        "ss_lr_scheduler": c.train.lr_scheduler, "ss_lr_warmup_steps": c.train.warmup_steps,
        "ss_optimizer": optimizer, "ss_mixed_precision": c.train.precision,
        "ss_seed": c.train.seed, "ss_network_args": json.dumps(network_args) if network_args else "",
        "ss_num_reg_images": sum(n for _, _, n, reg in datasets if reg),
        "ss_dataset_dirs": json.dumps(dirs) if dirs else "", "ss_prior_loss_weight": c.data.prior_loss_weight,
        "ss_flip_aug": c.data.flip, "ss_caption_dropout_rate": c.data.caption_dropout,
        "ss_ip_noise_gamma": c.diffusion.input_perturbation or "",
        "ss_zero_terminal_snr": c.diffusion.zero_terminal_snr,
        "ss_gradient_accumulation_steps": c.train.grad_accum, "ss_batch_size_per_device": c.data.batch_size,
        "ss_noise_offset": c.diffusion.noise_offset, "ss_min_snr_gamma": c.diffusion.min_snr_gamma or "",
        "ss_v_parameterization": c.diffusion.prediction_type == "v_prediction",
        "ss_gradient_checkpointing": c.train.gradient_checkpointing, "ss_max_grad_norm": c.train.max_grad_norm or 0,
        "ss_training_started_at": started, "ss_training_finished_at": finished,
        "ss_training_comment": json.dumps({"trainer": "flame", "lora_targets": c.lora.targets}),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": family.architecture if family else "stable-diffusion-xl-v1-base/lora",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": c.output.name, "modelspec.resolution": size,
        "modelspec.prediction_type": "v" if c.diffusion.prediction_type == "v_prediction" else "epsilon",
        "modelspec.date": datetime.datetime.fromtimestamp(finished, datetime.timezone.utc).isoformat("T", "seconds"),
    }
    return {k: str(v) for k, v in values.items() if v != ""}


def _need(name, load):
    """``load()`` (an import), or a ValueError saying how to install ``name``."""
    try:
        return load()
    except ImportError:
        raise ValueError(f"output.report_to: {name} is not installed ({_INSTALL[name]}), or drop it from "
                         "output.report_to") from None


class Trackers:
    """The trackers of ``report_to`` besides jsonl (written by the trainer itself), opened at once so
    a missing package fails before training starts."""

    def __init__(self, report_to, out_dir: str, run_name: str, config: dict):
        unknown = [t for t in report_to if t not in TRACKERS]
        if unknown:
            raise ValueError(f"output.report_to: unknown tracker(s) {unknown}; choose from {', '.join(TRACKERS)}")
        self._tb = self._wandb = None
        if "tensorboard" in report_to:
            board = _need("tensorboard", lambda: importlib.import_module("torch.utils.tensorboard"))
            self._tb = board.SummaryWriter(log_dir=f"{out_dir}/tensorboard")
        if "wandb" in report_to:
            wandb = _need("wandb", lambda: importlib.import_module("wandb"))
            self._wandb = wandb.init(project="flame", name=run_name, dir=out_dir, config=config, resume="allow")

    def log(self, records) -> None:
        """Every number of each metrics record, at the record's step."""
        for rec in records:
            step = rec.get("step", 0)
            scalars = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))
                       and not isinstance(v, bool)}
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)
            if self._wandb is not None and scalars:
                self._wandb.log(scalars, step=step)

    def log_images(self, step: int, paths) -> None:
        """The sample images of ``step`` (PNG paths)."""
        if self._tb is None and self._wandb is None:
            return
        import numpy as np
        from PIL import Image
        for k, path in enumerate(paths):
            with Image.open(path) as im:
                pixels = np.asarray(im.convert("RGB"))
            if self._tb is not None:
                self._tb.add_image(f"samples/{k:02d}", pixels, step, dataformats="HWC")
            if self._wandb is not None:
                import wandb
                self._wandb.log({f"samples/{k:02d}": wandb.Image(pixels)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
