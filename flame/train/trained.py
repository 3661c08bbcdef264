"""What a run trains and how it is saved: the one place where the trainer decides which parameters
train (``trained_parameters``, called once at setup, after the model is built).

``LoRAAdapters`` (``train.mode: lora``): the frozen model with adapters on ``lora.targets`` (and,
with ``lora.text_encoder``, SDXL's text encoders with theirs). ``FullWeights`` (``train.mode:
full`` or a list of expressions): the model's own weights, all or those the expressions match,
updated directly or through a ``flame.sharding.ShardedOptimizer`` (``train.shard``,
``train.master_weights``). The trainer asks either only for: ``params`` (what the loss scaler, the
moving average, the gradient bucket and the broadcast at the start see), ``sharded`` and
``shards`` (whether, and then the ``ShardedOptimizer`` through which, the gradients are packed and
the step is taken), ``make_optimizer(train_cfg)`` (the optimizer the lr schedule drives),
``computing()`` (the context the model's forward and backward run in), ``graph_blocker()`` (why
the step cannot be a CUDA graph, or None), ``train(mode)`` (training mode of what trains),
``check_same(when)`` (the ranks hold the same weights), ``checkpoint_writers()`` /
``load_checkpoint(folder)`` (the weights' files of a checkpoint), ``kind`` and ``what`` (the run's
file: "lora", "the LoRA file"), ``metadata(...)`` and ``save(path, dtype, metadata, checkpoint)``
(the run's file), ``describe()``, ``summary_lines(path)`` and ``usage_line(path)`` (what the
console says).
"""
from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from .. import distributed, sharding
from ..amp import ParameterCasts
from ..io import load_lora, load_safetensors, save_lora, save_safetensors, stored_shapes, to_device
from ..models.offload import streamable_blocks
from ..nn import inject_lora, lora_parameters
from ..nn.lora import component_keys, lora_modules
from ..ops.elementwise import to
from ..optim import SGD, Adafactor, AdamW, AdamW8bit, Lion, Prodigy
from .config import ConfigError
from .console import count
from .outputs import lora_metadata
from .text_encoders import PREFIXES as TEXT_ENCODERS
from .text_encoders import TextEncoderLoRA

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.shard_reduce_dtype


def trained_parameters(cfg, family, model, dtype, cache):
    """What the run of config ``cfg`` trains on ``model`` (its ``family``'s, built in ``dtype``;
    ``cache``: the run's latent cache, whose captions trained text encoders read)."""
    if cfg.train.mode == "lora":
        return LoRAAdapters(cfg, family, model, dtype, cache)
    return FullWeights(cfg, family, model, dtype)


def make_optimizer(t, groups, **extra):
    """``train.optimizer`` over the parameter ``groups``, with the ``train`` section ``t``'s settings;
    ``extra``: further arguments of every optimizer (``stochastic_rounding``)."""
    adam = dict(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
    if t.optimizer == "adamw8bit":
        return AdamW8bit(groups, lr=t.lr, **adam, **extra)
    if t.optimizer == "lion":
        return Lion(groups, lr=t.lr, betas=(t.lion_beta1, t.lion_beta2), weight_decay=t.weight_decay, **extra)
    if t.optimizer == "sgd":
        return SGD(groups, lr=t.lr, momentum=t.sgd_momentum, weight_decay=t.weight_decay, **extra)
    if t.optimizer == "prodigy":
        return Prodigy(groups, lr=t.lr, **adam, d0=t.prodigy_d0, d_coef=t.prodigy_d_coef,
                       growth_rate=t.prodigy_growth_rate or float("inf"), use_bias_correction=t.prodigy_bias_correction,
                       safeguard_warmup=t.prodigy_safeguard_warmup, **extra)
    if t.optimizer == "adafactor":  # an external lr and schedule, as kohya's SDXL recipes set it
        return Adafactor(groups, lr=t.lr, weight_decay=t.weight_decay, scale_parameter=False, relative_step=False,
                         **extra)
    return AdamW(groups, lr=t.lr, **adam, **extra)


class LoRAAdapters:
    """The frozen ``model`` with adapters (``inject_lora`` on the ``lora`` section's targets), and
    with ``lora.text_encoder`` SDXL's text encoders with theirs (``text``, a ``TextEncoderLoRA``;
    None otherwise). ``layers``: the adapted layers' names; ``params``: the adapters' parameters,
    the model's then the text encoders' (fp32, cast to ``dtype`` at once for each step)."""

    kind, what = "lora", "the LoRA file"
    sharded, shards, collective_forward = False, None, False

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
        self._casts = ParameterCasts(self.params, dtype)  # one launch casts them for each step

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

    def make_optimizer(self, t):
        """``train.optimizer`` over ``param_groups`` (``t``: the train section)."""
        return make_optimizer(t, self.param_groups(t.lr))

    def computing(self):
        """The adapters cast to the model's dtype, one launch (``amp.ParameterCasts``)."""
        return self._casts

    def graph_blocker(self) -> str | None:
        if self.cfg.lora.dropout:
            return "lora.dropout > 0 (a replayed step would reuse its dropout masks)"
        return None

    def check_same(self, when: str) -> None:
        """Every rank holds the same adapters (``distributed.check_same``); ``when``: "at step N"."""
        distributed.check_same(self.params, f"LoRA weights {when}")

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

    def metadata(self, step, num_samples, started, finished, datasets, optimizer) -> dict:
        """The LoRA file's metadata (``outputs.lora_metadata``: kohya's ss_* and modelspec keys)."""
        return lora_metadata(self.cfg, step, num_samples, started, finished, datasets, optimizer, self.family)

    def save(self, path, dtype, metadata: dict, checkpoint=None) -> None:
        """The run's LoRA file at ``path``, in ``lora.format`` and ``dtype`` (from the adapters as they
        are: ``checkpoint`` is not read)."""
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


class _Gathered:
    """The ``Checkpointed.streamer`` of a block at the ``parameters`` stage: calling the block runs it
    through ``ShardedOptimizer.run`` (its weights gathered into their ring slot for its forward, while
    the block before it runs, and again for its backward)."""

    def __init__(self, shards):
        self.shards = shards

    def __call__(self, block, args):
        block.streamer = None  # run calls the block itself
        try:
            return self.shards.run(block, *args)
        finally:
            block.streamer = self


@contextlib.contextmanager
def _joined(shards):
    """The body, then ``shards.join()``."""
    try:
        yield
    finally:
        shards.join()


class FullWeights:
    """The model's own weights trained: every one (``train.mode: full``) or those whose names one of
    ``train.mode``'s regular expressions matches (``re.search``), the rest frozen. ``names``,
    ``params``: the trained ones, in module order.

    The update: with bf16 weights and ``train.master_weights: bf16_stochastic``, or with fp32
    weights (``train.precision: fp32``) and ``train.shard: none``, ``train.optimizer`` updates the
    weights themselves (``sharded`` False; several processes all-reduce the gradients as for
    LoRA). Otherwise a ``flame.sharding.ShardedOptimizer`` (``shards``, made by ``make_optimizer``)
    keeps fp32 master weights and the optimizer state, split over the processes at ``train.shard``'s
    stage (``optimizer`` with ``train.shard: none``, which one process runs unsplit), with one unit
    per block of the model (``offload.streamable_blocks``: SDXL's resnets and transformer blocks,
    Flux's double and single blocks, in the order the forward runs them) and the other weights in
    buckets. At the ``parameters`` stage each block gathers its weights into the ring of slots as it
    runs, the next block's gather issued as it starts (``_Gathered``), and the weights outside the
    blocks stay whole; the step is captured into a CUDA graph with its gathers, ending by joining
    any gather no block waited for (``computing``).

    Checkpoints: sharded, each process writes its shard of the master weights and optimizer state
    (``ShardedOptimizer.save``, through ``Checkpoints.write``; another number of processes re-slices
    them on resume); otherwise ``model.safetensors`` holds the trained weights by name (the frozen
    ones come from ``model.path`` again). The run's file (``save``) is the whole model, trained and
    frozen weights, under the family's diffusers names (``Family.diffusers_tensors``)."""

    kind, what = "model", "the model file"
    text = None

    def __init__(self, cfg, family, model, dtype):
        t = cfg.train
        self.cfg, self.family, self.model = cfg, family, model
        patterns = None if t.mode == "full" else [re.compile(p) for p in t.mode]
        model.requires_grad_(False)
        named = [(n, p) for n, p in model.named_parameters() if patterns is None or any(r.search(n) for r in patterns)]
        for _, p in named:
            p.requires_grad_(True)
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.total = sum(1 for _ in model.parameters())
        self.sharded = t.shard != "none" or (t.master_weights == "fp32" and dtype != torch.float32)
        self.stage = t.shard if t.shard != "none" else "optimizer"
        self.collective_forward = t.shard == "parameters"  # every rank gathers each block with the others
        self.shards = None

    def param_groups(self, lr: float) -> list:
        """One group of every trained weight at ``lr``."""
        return [{"params": list(self.params), "lr": lr}]

    def make_optimizer(self, t):
        """``train.optimizer`` over the weights themselves, or the ``ShardedOptimizer``'s (then in
        ``shards``); at the ``parameters`` stage the blocks gather their weights from here on."""
        if not self.sharded:
            rounding = {"stochastic_rounding": True} if t.master_weights == "bf16_stochastic" else {}
            return make_optimizer(t, self.param_groups(t.lr), **rounding)
        blocks = [(b, [p for p in b.parameters() if p.requires_grad]) for _, b in streamable_blocks(self.model)]
        blocks = [(b, unit) for b, unit in blocks if unit]
        self.shards = sharding.ShardedOptimizer(zip(self.names, self.params), self.stage,
                                                lambda leaves: make_optimizer(t, leaves), units=[u for _, u in blocks],
                                                reduce_dtype=REDUCE_DTYPES[t.shard_reduce_dtype],
                                                overlap=t.shard_overlap)
        if self.stage == "parameters":
            for b, _ in blocks:
                b.streamer = _Gathered(self.shards)
        return self.shards.optimizer

    def computing(self):
        """The parameters stage: at the end, the current stream waits for any gather no block waited for
        (``ShardedOptimizer.join``: a CUDA graph's capture must not leave work on the communication
        stream); otherwise nothing to do (the weights are in the model's dtype)."""
        if self.shards is not None and self.stage == "parameters":
            return _joined(self.shards)
        return contextlib.nullcontext()

    def graph_blocker(self) -> str | None:
        return None

    def check_same(self, when: str) -> None:
        """Every rank holds the same weights (at the ``parameters`` stage none holds them whole)."""
        if self.shards is None or self.stage != "parameters":
            distributed.check_same(self.params, f"model weights {when}")

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def checkpoint_writers(self) -> dict:
        """{file name: write(path)}: the trained weights by name (sharded: none, the shards hold them)."""
        if self.sharded:
            return {}
        return {"model.safetensors": lambda p: save_safetensors(dict(zip(self.names, self.params)), p)}

    def load_checkpoint(self, folder) -> None:
        """The trained weights (and, sharded, the optimizer state) of the checkpoint ``folder``."""
        own = "shards.json" if self.sharded else "model.safetensors"
        if not os.path.isfile(os.path.join(folder, own)):
            other = "train.shard none with fp32 weights" if self.sharded else "fp32 master weights (sharded)"
            raise ConfigError(f"resume: {folder} holds no {own}: it was written by a run with {other}; resume it "
                              "with that run's train.shard, train.master_weights and train.precision")
        if self.sharded:
            try:
                self.shards.load(folder)
            except ValueError as e:
                raise ConfigError(f"resume: {e}") from None
            return
        tensors = load_safetensors(os.path.join(folder, own))
        if sorted(tensors) != sorted(self.names):
            raise ConfigError(f"resume: {folder}/{own} holds {len(tensors):,} weights, this run trains "
                              f"{len(self.names):,} others (train.mode)")
        self.model.load_state_dict(tensors, strict=False)

    def metadata(self, step, num_samples, started, finished, datasets, optimizer) -> dict:
        """The model file's metadata: diffusers' format key, the model spec's architecture and title,
        and the training settings."""
        t = self.cfg.train
        training = {"trainer": "flame", "mode": t.mode, "steps": step, "lr": t.lr, "optimizer": optimizer,
                    "precision": t.precision, "master_weights": t.master_weights, "images": num_samples,
                    "started": started, "finished": finished}
        return {"format": "pt", "modelspec.sai_model_spec": "1.0.0",
                "modelspec.architecture": self.family.architecture.removesuffix("/lora"),
                "modelspec.title": self.cfg.output.name, "flame.training": json.dumps(training)}

    def save(self, path, dtype, metadata: dict, checkpoint=None) -> None:
        """The whole model at ``path`` under diffusers' names (``diffusers_class``'s state dict), in
        ``dtype``: the trained weights from ``checkpoint``'s fp32 master weights when the run is
        sharded (None: the model's weights as they are, e.g. with the moving average applied), the
        frozen ones from the model. One tensor at a time goes through the device into host memory."""
        tensors = {}

        def add(name, value):
            for key, piece in self.family.diffusers_tensors(self.model, name, value):
                tensors[key] = to(piece, dtype).to_torch().cpu()  # host transfer

        done = set()
        if self.sharded and checkpoint is not None:
            for name, host in sharding.weights(checkpoint):
                add(name, to_device(host))
                done.add(name)
        for name, p in self.model.named_parameters():
            if name not in done:
                add(name, p)
        save_safetensors(tensors, path, metadata)

    def _how(self) -> str:
        world = distributed.world().size
        if not self.sharded:
            return ("bf16 weights, stochastic rounding" if self.cfg.train.master_weights == "bf16_stochastic"
                    else "fp32 weights")
        if self.cfg.train.shard == "none":
            return "fp32 master weights"
        return f"fp32 master weights, train.shard {self.stage} over {world} process{'es' if world > 1 else ''}"

    def describe(self) -> str:
        """What trains, as the run's first line says it."""
        what = ("every weight" if self.cfg.train.mode == "full" else
                f"{len(self.params):,} of {self.total:,} weight tensors ({', '.join(self.cfg.train.mode)})")
        return f"{what} of the {self.family.diffusers_class} ({sum(p.numel() for p in self.params):,} params; " \
               f"{self._how()})"

    def summary_lines(self, path) -> list:
        return [f"  model file: {path} (the whole {self.family.diffusers_class}, diffusers' names, "
                f"{self.cfg.output.save_dtype})"]

    def usage_line(self, path) -> str:
        """How to load the file at ``path`` in diffusers."""
        cls, sub = self.family.diffusers_class, self.family.diffusers_subfolder
        return (f"  in diffusers: model = {cls}.from_pretrained(BASE, subfolder={sub!r}); "
                f"model.load_state_dict(safetensors.torch.load_file({os.path.abspath(path)!r}))")
