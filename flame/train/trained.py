"""What a run trains and how it is saved: the one place where the trainer decides which parameters
train (``trained_parameters``, called once at setup, after the model is built).

Today that is ``LoRAAdapters``: the frozen model with adapters on ``lora.targets`` (and, with
``lora.text_encoder``, SDXL's text encoders with theirs). The trainer asks the object only for:
``params`` (what the optimizer, the loss scaler, the moving average, the gradient bucket and the
weight checks see), ``param_groups(lr)`` (the optimizer's groups), ``train(mode)`` (training mode
of what trains), ``checkpoint_writers()`` / ``load_checkpoint(folder)`` (the weights' files of a
checkpoint), ``save(path, dtype, metadata)`` (the run's output file), ``describe()`` and
``summary_lines(path)`` (what the console says). Another kind of training (every weight of the model)
is another class with these members, chosen in ``trained_parameters``.
"""
from __future__ import annotations

import os

from ..io import load_lora, save_lora, stored_shapes
from ..nn import inject_lora, lora_parameters
from ..nn.lora import component_keys, lora_modules
from .config import ConfigError
from .console import count
from .text_encoders import PREFIXES as TEXT_ENCODERS
from .text_encoders import TextEncoderLoRA


def trained_parameters(cfg, family, model, dtype, cache):
    """What the run of config ``cfg`` trains on ``model`` (its ``family``'s, built in ``dtype``;
    ``cache``: the run's latent cache, whose captions trained text encoders read)."""
    return LoRAAdapters(cfg, family, model, dtype, cache)


class LoRAAdapters:
    """The frozen ``model`` with adapters (``inject_lora`` on the ``lora`` section's targets), and
    with ``lora.text_encoder`` SDXL's text encoders with theirs (``text``, a ``TextEncoderLoRA``;
    None otherwise). ``layers``: the adapted layers' names; ``params``: the adapters' parameters,
    the model's then the text encoders'."""

    def __init__(self, cfg, family, model, dtype, cache):
        c = cfg.lora
        self.cfg, self.family, self.model = cfg, family, model
        model.requires_grad_(False)
        self.layers = inject_lora(model, family.lora_targets(c.targets), c.rank, c.alpha, c.init, c.dropout,
                                  conv=c.conv_targets or False, conv_rank=c.conv_rank, conv_alpha=c.conv_alpha,
                                  dora=c.dora)
        self.text = None
        if c.text_encoder:
            self.text = TextEncoderLoRA.load(cfg, dtype, cache)
            self.layers += self.text.layers
        self.params = lora_parameters(model) + (self.text.parameters() if self.text is not None else [])

    @property
    def models(self) -> dict:
        """{PEFT prefix: model} of the run's adapters: the LoRA file's parts (the denoiser's, and SDXL's
        text encoders' when trained)."""
        return {self.family.lora_prefix: self.model, **(self.text.models if self.text is not None else {})}

    def init_from(self, path, log) -> None:
        """``lora.init_from`` into the adapters just made: a layer outside the targets or another
        rank is refused whole; a part of the run the file has no adapters for starts fresh."""
        try:
            loaded = load_lora(self.models, path, inject=False)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"lora.init_from: {path}: {e.args[0] if e.args else e}") from None
        fresh = [p for p in self.models if not loaded.get(p)]
        if fresh:
            log(f"lora.init_from: {path} holds no adapters for {' and '.join(fresh)}: theirs start fresh")
        if self.text is None and any(component_keys(stored_shapes(path), p, bare=False) for p in TEXT_ENCODERS):
            log(f"lora.init_from: {path} also holds text-encoder adapters, which this run does not train "
                "(lora.text_encoder=false): left out")

    def param_groups(self, lr: float) -> list:
        """The adapters in one optimizer group per (model part, A or B), in module order: the part's
        learning-rate multiplier (SDXL: ``lora.lr_down`` / ``lr_mid`` / ``lr_up``) times ``lr``, and
        for B also ``lora.plus_ratio`` (LoRA+). DoRA's magnitudes go with their layer's A (the
        part's rate, not LoRA+'s). The text encoders' adapters (``lora.text_encoder``) follow, one
        group per (encoder, side) at ``lora.text_encoder_lr``. The groups are the same whatever the
        multipliers, so a run may resume with other ones."""
        lc = self.cfg.lora
        scale = self.family.lr_scales(lc)
        groups = {}
        for name, layer in lora_modules(self.model):
            block = self.family.block_of(name)
            groups.setdefault((block, "A"), []).append(layer.lora_A)
            groups.setdefault((block, "B"), []).append(layer.lora_B)
            if layer.dora:
                groups[block, "A"].append(layer.lora_magnitude)
        out = [{"params": params, "lr": lr * scale[block] * (lc.plus_ratio if side == "B" else 1.0)}
               for (block, side), params in groups.items()]
        if self.text is not None:
            out += self.text.param_groups(lr if lc.text_encoder_lr is None else lc.text_encoder_lr, lc.plus_ratio)
        return out

    def train(self, mode: bool) -> None:
        """The model (and the text encoders being trained) in training mode or not (dropout)."""
        self.model.train(mode)
        if self.text is not None:
            self.text.train(mode)

    def checkpoint_writers(self) -> dict:
        """{file name: write(path)} of the adapters' part of a checkpoint."""
        return {"lora.safetensors": lambda p: save_lora(self.models, p, format="peft")}

    def load_checkpoint(self, folder) -> None:
        """The adapters of the checkpoint ``folder`` (every one of them, exactly)."""
        load_lora(self.models, os.path.join(folder, "lora.safetensors"), inject=False, strict=True)

    def save(self, path, dtype, metadata: dict) -> None:
        """The run's LoRA file at ``path``, in ``lora.format`` and ``dtype``."""
        save_lora(self.models, path, format=self.cfg.lora.format, dtype=dtype, metadata=metadata)

    def describe(self) -> str:
        """What trains, as the run's first line says it."""
        return f"{count(len(self.layers), 'LoRA layer')} ({sum(p.numel() for p in self.params):,} params)"

    def summary_lines(self, path) -> list:
        """The summary's lines about the LoRA file at ``path``."""
        lc = self.cfg.lora
        lines = [f"  LoRA file: {path} ({lc.format} format, {count(len(self.layers), 'layer')}, "
                 f"rank {lc.rank}, alpha {lc.alpha if lc.alpha is not None else lc.rank:g})"]
        if self.text is not None:
            lines.append(f"    text encoders: {count(len(self.text.layers), 'layer')} of them, rank {self.text.rank}, "
                         f"alpha {self.text.alpha:g} (diffusers' text_encoder. / text_encoder_2., kohya's lora_te1_ / "
                         "lora_te2_)")
        return lines

    def usage_line(self, path) -> str:
        """How to load the file at ``path`` in diffusers."""
        folder, name = os.path.split(os.path.abspath(path))
        return ("  in diffusers: pipe.load_lora_weights("
                f"{folder!r}, weight_name={name!r}, use_safetensors=True)"
                + ("  # use_safetensors keeps the alpha stored in the file's metadata"
                   if self.cfg.lora.format == "peft" else ""))
