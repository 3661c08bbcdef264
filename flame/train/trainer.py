"""The LoRA trainer (SDXL and Flux.1): cached latents in, a LoRA file out.

What differs between model families (the model, its layer names and LoRA presets, the cache fields,
the objective: DDPM noise prediction or rectified flow, the conditioning inputs) sits behind
``flame.train.families``; this module is the one loop, checkpoint/resume path and console for all.

One optimizer step::

    for each of grad_accum micro-batches:           (host: next batch of one aspect bucket)
        noise, levels = sample_noise(...), objective.draw(...)     (flame's Philox RNG)
        loss, grads = loss_and_grads(latents, noise, levels, embeds, pooled, ..., *conditioning)
    [unscale_ + found-inf check (fp16)] clip_grad_norm_, AdamW step (skipped on the device when
    the loss or the gradient norm is not finite), loss-scaler update, lr-scheduler step

``loss_and_grads`` is a pure device function of fixed-shape tensors (noising, model forward,
weighted loss, backward): no host sync and no random numbers inside, so it can be replayed
from a CUDA graph (``train.cuda_graph``). The host reads losses only every ``output.log_every``
steps (and before any checkpoint): a non-finite loss then stops the run with a checkpoint whose
weights never saw that step's update.

Checkpoints (``flame.train.checkpoints``) hold the LoRA weights, the AdamW state, the lr
scheduler, the loss scaler, flame's RNG state, the data loader's position and the step; resuming
from one reproduces the losses of an uninterrupted run exactly.

Everything a run needs is checked before the model is loaded (``Trainer.__init__``): the model
config, the output folder (writable; removed again if the run refuses to start and it was made for
it), the whole latent cache, the batch size, the LoRA targets and, when resuming, that the
checkpoint's settings give the same tensor shapes and data order.

Signals: Ctrl-C (SIGINT) or SIGTERM (what schedulers send) finishes the current step, saves a
checkpoint and stops. A second one abandons the step in flight (or, during the few launches that
update the weights, lets them finish first), so the checkpoint saved then is the state of one step
boundary; a third quits without saving.

Several GPUs (``torchrun --nproc-per-node N``, see ``flame.distributed``): each process trains on
its rows of every global batch (``data.batch_size`` each, the loader's ``parts``), noise and
timesteps are the rows of one global draw (the run equals one process at the global batch size),
and one all-reduce per optimizer step sums the gradients, the loss and the stop requests. Rank 0
alone writes files and prints. A stop signal that reaches any rank stops every rank at the same
step, a step or two later (a second signal does not abandon a step: the ranks must finish it
together; a third quits without saving); the weights are compared across ranks at every log line.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import torch
import yaml

from .. import distributed, runtime
from ..amp import DynamicLossScaler, ParameterCasts
from ..autograd import GradientMap, no_grad
from ..data import BucketBatchLoader, CacheError, CacheSet, LatentCache, part_bounds
from ..diffusion import sample_noise
from ..graphs import CapturedStep
from ..io import atomic_write, load_lora, load_safetensors, save_lora, save_safetensors, stored_shapes
from ..kernels import launch, precompile
from ..models.offload import BlockStreamer, plan_offload, plan_offload_from_config
from ..nn import inject_lora, lora_parameters, quantize_linears_
from ..nn.layers import Conv2d
from ..nn.lora import adaptable_layers, component_keys, lora_modules, matching_layers
from ..ops.creation import get_rng_state, manual_seed, rand, randn, set_rng_state, set_rng_substream, tensor, zeros
from ..ops.elementwise import abs as fabs
from ..ops.elementwise import add, ge, lt, mul, sub, to, where
from ..ops.quant import Fp8Weight
from ..ops.shape import stack
from ..optim import EMA, Adafactor, AdamW, AdamW8bit, Lion, Prodigy, clip_grad_norm_
from ..optim.lr_scheduler import get_scheduler
from . import families
from .checkpoints import checkpoint_path, latest_checkpoint, list_checkpoints, save_checkpoint
from .config import ConfigError, to_dict
from .datasets import prepare_datasets
from .memory import plan_memory
from .outputs import Trackers, lora_metadata
from .text_encoders import PREFIXES as TEXT_ENCODERS
from .text_encoders import TextEncoderLoRA, check_source

# settings a resumed run must share with its checkpoint: the adapters' shapes and the data order
# the loader's saved position counts in (any other change is allowed, with a warning)
RESUME_FIXED = ("model.family", "lora.rank", "lora.targets", "lora.conv_targets", "lora.conv_rank", "lora.dora",
                "lora.text_encoder", "lora.text_encoder_targets", "lora.text_encoder_rank",
                "data.batch_size", "data.drop_last", "data.datasets", "train.seed", "train.optimizer")
SMOOTHING = 0.98  # the loss shown: an exponential moving average over ~50 steps, bias-corrected

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VAL_SEED = 0x5EEDBA5E


class TrainingStopped(RuntimeError):
    """The run stopped before its last step (``reason``: "interrupted" by the signal ``signum``, or
    "non_finite"); a checkpoint of the last good state was saved at ``checkpoint``."""

    def __init__(self, message, reason, step, checkpoint, signum=None):
        super().__init__(message)
        self.reason, self.step, self.checkpoint, self.signum = reason, step, checkpoint, signum


class TrainingError(RuntimeError):
    """The run could not go on (a file could not be written, e.g. a full disk); the message says what
    was kept and what to do."""


def _count(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _duration(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def make_optimizer(t, groups):
    """``train.optimizer`` over the adapters' parameter ``groups``, with the ``train`` section's settings."""
    adam = dict(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
    if t.optimizer == "adamw8bit":
        return AdamW8bit(groups, lr=t.lr, **adam)
    if t.optimizer == "lion":
        return Lion(groups, lr=t.lr, betas=(t.lion_beta1, t.lion_beta2), weight_decay=t.weight_decay)
    if t.optimizer == "prodigy":
        return Prodigy(groups, lr=t.lr, **adam, d0=t.prodigy_d0, d_coef=t.prodigy_d_coef,
                       growth_rate=t.prodigy_growth_rate or float("inf"), use_bias_correction=t.prodigy_bias_correction,
                       safeguard_warmup=t.prodigy_safeguard_warmup)
    if t.optimizer == "adafactor":  # an external lr and schedule, as kohya's SDXL recipes set it
        return Adafactor(groups, lr=t.lr, weight_decay=t.weight_decay, scale_parameter=False, relative_step=False)
    return AdamW(groups, lr=t.lr, **adam)


class Trainer:
    """Builds a run from a validated config (``flame.train.config``) and trains it (``train()``).

    ``model``: a ready model to use instead of ``model.path`` / ``model.config`` (it must follow
    its family's forward signature, ``SDXLUNet``'s or ``FluxTransformer2DModel``'s, and expose
    ``config``, ``dtype`` and ``enable_gradient_checkpointing``). ``progress``: show a tqdm bar
    (default: when stderr is a terminal; otherwise a log line every ``log_every`` steps). ``log``:
    where text lines go.
    """

    def __init__(self, config, model=None, progress=None, log=print):
        self.world = distributed.init(config.distributed.timeout)
        main = self.world.is_main
        self.cfg, self.log = config, log if main else _quiet
        self.progress = progress if main else False
        self.dtype = PRECISIONS[config.train.precision]
        self.out_dir = config.output.dir
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        self._created = []  # folders made for output.dir, deepest first (removed if setup fails)
        try:
            self._setup(model)
        except BaseException:
            self._remove_created()
            raise

    def _setup(self, model):
        c = self.cfg
        self.family = families.get(c.model.family, c)
        self.text = None  # lora.text_encoder: the text encoders with their adapters (TextEncoderLoRA)
        # ---- checks that need no model weights: a bad setting fails here, in seconds
        mcfg = model.config if model is not None else self._model_config()
        self._check_precision()
        self._agreed(self._prepare_output_dir)
        self.cache = self._open_cache(mcfg)
        self.loader = self._loader("train", c.data.batch_size, shuffle=True)
        self.val_loader = None
        if c.output.validate_every and self.cache.split("val"):
            self.val_loader = self._loader("val", c.output.val_batch_size or c.data.batch_size, shuffle=False)
        self.total_steps = c.train.steps or c.train.epochs * math.ceil(len(self.loader) / c.train.grad_accum)
        self.objective = self.family.objective(c, self.log)
        self._check_targets(model, mcfg)
        self.memory = self._plan_memory(mcfg) if c.train.memory_budget_gb is not None else None
        if self.memory is not None and not runtime.use_expandable_segments() and not runtime.is_interpreter():
            self.log("train.memory_budget_gb: PYTORCH_CUDA_ALLOC_CONF turns the allocator's expandable segments off; "
                     "the budget's estimate assumes them")
        weight_dtype, checkpointed, streaming = self._memory_settings()
        fp8 = {} if weight_dtype is None else {"weight_dtype": weight_dtype,
                                               "fp8_skip": self.family.full_precision_layers}
        # streamed blocks of a checkpoint load straight into pinned host memory, fp8 weights quantise as
        # they load: the GPU never holds the whole model in bf16
        plan = self._plan_offload(lambda **kw: plan_offload_from_config(mcfg, self.dtype, **fp8, **kw)) \
            if model is None and c.model.path else None
        if c.lora.text_encoder:
            check_source(c)
        self._resume_from = self._agreed(self._find_checkpoint)  # (path, trainer state) or None
        if self._resume_from is None:
            self._agreed(self._check_fresh_start)
        else:
            self._resume_loader(*self._resume_from)
        # ---- the run
        self._ahead = self._compile_ahead(mcfg)  # kernels compile in other processes while the model loads
        # before the UNet: the text encoders come and go first (rank 0 alone makes samples); those being
        # trained stay, and samples are made with them
        self.samples = self._prepare_samples(mcfg) if self.world.is_main and not c.lora.text_encoder else None
        manual_seed(c.train.seed)
        if model is None:
            try:
                placement = dict(fp8, host_blocks=plan.streamed) if plan is not None else fp8  # for loading only
                model = self.family.build(c.model.path, c.model.config, self.dtype, **placement)
            except torch.cuda.OutOfMemoryError:
                raise
            except (OSError, ValueError, RuntimeError) as e:  # a damaged or mismatched checkpoint
                raise ConfigError(f"model.path: cannot load {c.model.path}: {e}") from None
        self.model = model
        model.requires_grad_(False)
        targets = self.family.lora_targets(c.lora.targets)
        self.lora_layers = inject_lora(model, targets, c.lora.rank, c.lora.alpha, c.lora.init, c.lora.dropout,
                                       conv=c.lora.conv_targets or False, conv_rank=c.lora.conv_rank,
                                       conv_alpha=c.lora.conv_alpha, dora=c.lora.dora)
        if c.lora.text_encoder:
            self.text = TextEncoderLoRA.load(c, self.dtype, self.cache)
            self.lora_layers += self.text.layers
            if self.world.is_main:
                self.samples = self._prepare_samples(mcfg)
        if c.lora.init_from is not None:
            self._init_from(c.lora.init_from)
        self._train_mode(True)
        self.params = lora_parameters(model) + (self.text.parameters() if self.text is not None else [])
        self.adapter_casts = ParameterCasts(self.params, self.dtype)  # one launch casts them for each step
        distributed.broadcast_(self.params)  # every rank starts from rank 0's adapters
        set_rng_substream(self.world.rank)  # from here on each rank draws its own dropout masks
        self.bucket = distributed.GradientBucket(self.params) if self.world.size > 1 else None
        if checkpointed != 0:
            try:
                model.enable_gradient_checkpointing(True, scope=c.train.checkpoint_scope, blocks=checkpointed)
            except ValueError as e:
                raise ConfigError(f"train.checkpoint_blocks: {e}") from None
        if fp8:
            quantize_linears_(model, weight_dtype, skip=self.family.full_precision_layers)  # if not loaded so
            stored = sum(isinstance(w, Fp8Weight) for w in model.parameters())
            self.log(f"model.weight_dtype: {stored} frozen Linear weights stored as {weight_dtype}")
        if streaming:  # last: the streamer moves the frozen weights as they are now
            plan = plan or self._plan_offload(lambda **kw: plan_offload(model, **kw))
            self.log(plan.summary())
        self.streamer = BlockStreamer(model, plan) if plan is not None else None
        t = c.train
        self.optimizer = make_optimizer(t, self._param_groups())
        if t.optimizer == "prodigy" and t.lr < 0.1:
            self.log(f"train.lr is {t.lr}: Prodigy's lr multiplies the step size it estimates; 1.0 is usual")
        self.scheduler = get_scheduler(c.train.lr_scheduler, self.optimizer, c.train.warmup_steps, self.total_steps,
                                       num_cycles=c.train.lr_num_cycles, power=c.train.lr_power)
        self.ema = EMA(self.params, c.ema.decay) if c.ema.decay is not None else None
        # caption dropout's empty caption: the cache's embedding, or (text encoders trained) its tokens
        self._empty_prompt = self.cache.empty_prompt() if c.data.caption_dropout and self.text is None else None
        self.scaler = DynamicLossScaler() if self.dtype == torch.float16 else None
        graph = c.train.cuda_graph and not c.lora.dropout  # a replay would repeat the dropout masks
        if c.train.cuda_graph and c.lora.dropout:
            self.log("train.cuda_graph: off because lora.dropout > 0 (a replayed step would reuse its dropout masks)")
        self.step_fn = CapturedStep(self.loss_and_grads, enabled=graph)
        trackers = [t for t in c.output.report_to if t != "jsonl"] if self.world.is_main else []
        self.trackers = Trackers(trackers, self.out_dir, c.output.name, to_dict(c))
        self.step = 0
        self.losses = {}  # step -> loss, as read on the host
        self.val_losses = {}  # step -> validation loss
        self._pending = []  # (step, loss, grad norm or None, lr, epoch) on the device, not yet read
        self._ema = (0.0, 0)  # (biased moving average of the loss, losses in it)
        self._stop = None
        self._sampled = None  # the step whose samples were made last
        self._clock = None
        self._bar_ = None
        self._step_done = True  # False while a step's state changes are not all applied
        self._deferring, self._deferred = 0, False
        self._requested, self._signals = None, 0  # several processes: this rank's stop request, signals seen

    # ---- setup -------------------------------------------------------------------------------
    def _plan_offload(self, planner):
        """``train.offload: blocks``: ``planner(count=..., budget_bytes=...)`` (``plan_offload`` of a
        model or of its config) for the blocks ``offload_blocks`` or ``offload_budget_gb`` ask for (all
        by default); None without offload. A plan that cannot be made is a ConfigError."""
        t = self.cfg.train
        if self.memory is not None:
            if not self.memory.offload_blocks:
                return None
            count, budget = self.memory.offload_blocks, None
        elif t.offload == "none":
            return None
        else:
            budget = None if t.offload_budget_gb is None else int(t.offload_budget_gb * 2**30)
            count = (t.offload_blocks or "all") if budget is None else None
        try:
            return planner(count=count, budget_bytes=budget)
        except ValueError as e:
            raise ConfigError(f"train.offload: {e}") from None

    def _memory_settings(self):
        """(weight dtype, checkpointed blocks: None all, N, 0 none; whether blocks stream) as the
        memory plan chose them, or as the config sets them."""
        c, m = self.cfg, self.memory
        if m is not None:
            return m.weight_dtype, m.checkpoint_blocks, m.offload_blocks > 0
        return (c.model.weight_dtype, c.train.checkpoint_blocks if c.train.gradient_checkpointing else 0,
                c.train.offload == "blocks")

    def _plan_memory(self, mcfg):
        """``train.memory_budget_gb``: the weight dtype, checkpointed and streamed blocks that fit
        (``memory.plan_memory``) for the cache's largest bucket at ``data.batch_size``; logged."""
        c = self.cfg
        h, w = max(self.cache.buckets, key=lambda hw: hw[0] * hw[1])
        try:
            plan = plan_memory(int(c.train.memory_budget_gb * 2**30), profile=self.family.activation_profile,
                               config=mcfg, dtype=self.dtype, tokens=c.data.batch_size * self.family.tokens(
                                   (h, w), self.cache.text_len), targets=self.family.lora_targets(c.lora.targets),
                               rank=c.lora.rank, weight_dtype=c.model.weight_dtype, allow_fp8=not c.lora.dora,
                               fp8_skip=self.family.full_precision_layers)
        except TypeError as e:  # a model the planner does not know
            raise ConfigError(f"train.memory_budget_gb: {e}") from None
        self.log(plan.summary())
        return plan

    def _agreed(self, fn):
        """``fn()`` on rank 0, and its result (or the error it raised) on every rank: decisions that
        read or change files are made once."""
        if self.world.size == 1:
            return fn()
        result = error = None
        if self.world.is_main:
            try:
                result = fn()
            except Exception as e:  # every rank raises it
                error = e
        result, error = distributed.broadcast_object((result, error))
        if error is not None:
            raise error
        return result

    def _model_config(self):
        c = self.cfg.model
        option = "path" if c.path and os.path.isdir(c.path) else "config"  # a folder holds its config.json
        try:
            return self.family.model_config(getattr(c, option))
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.{option}: {e}") from None

    def _compile_ahead(self, mcfg):
        """Start compiling the kernels ``train.compile_ahead`` lists (kernels/precompile.py), one
        process per host; with ``auto`` the kernels this run compiles are recorded for the next.
        ``auto`` compiles a shipped list (a full SDXL or Flux.1 run's kernels) only for the architecture
        it was recorded on: a smaller model (the tiny configs, tests) would compile hundreds of
        variants it never runs."""
        setting = self.cfg.train.compile_ahead
        if setting == "off" or runtime.is_interpreter() or self.world.local_rank != 0:
            return None
        if setting == "auto":
            shipped = self.family.kernel_list(mcfg)
            paths = precompile.auto_paths(shipped=shipped is not None, model=shipped or "")
            record = precompile.recorded_path()
            try:
                record.parent.mkdir(parents=True, exist_ok=True)
                os.environ.setdefault(launch.RECORD_ENV, str(record))
                launch.note_known(line for p in paths for line in precompile.read_lines(p))  # only new ones
            except OSError as e:  # an unwritable cache folder: nothing recorded, nothing else changes
                self.log(f"train.compile_ahead: not recording this run's kernels ({e})")
        else:
            paths = [setting]
        return precompile.Background(paths) if paths else None

    def _prepare_samples(self, mcfg):
        """The ``sample`` section's prompts encoded and its VAE loaded (None without prompts); with
        the text encoders trained, the prompts are encoded by them at each sampling."""
        s = self.cfg.sample
        if s.prompts is None:
            return None
        return self.family.training_samples(s, s.model or self.cfg.model.path, self.dtype, mcfg,
                                            None if self.text is None else self.text.encoders)

    def _lora_models(self) -> dict:
        """{PEFT prefix: model} of the run's adapters: the LoRA file's parts (the denoiser's, and SDXL's
        text encoders' when trained)."""
        return {self.family.lora_prefix: self.model, **(self.text.models if self.text is not None else {})}

    def _init_from(self, path):
        """``lora.init_from`` into the adapters just made: a layer outside the targets or another
        rank is refused whole; a part of the run the file has no adapters for starts fresh."""
        try:
            loaded = load_lora(self._lora_models(), path, inject=False)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"lora.init_from: {path}: {e.args[0] if e.args else e}") from None
        fresh = [p for p in self._lora_models() if not loaded.get(p)]
        if fresh:
            self.log(f"lora.init_from: {path} holds no adapters for {' and '.join(fresh)}: theirs start fresh")
        if self.text is None and any(component_keys(stored_shapes(path), p, bare=False) for p in TEXT_ENCODERS):
            self.log(f"lora.init_from: {path} also holds text-encoder adapters, which this run does not train "
                     "(lora.text_encoder=false): left out")

    def _train_mode(self, mode: bool):
        """The model (and the text encoders being trained) in training mode or not (dropout)."""
        self.model.train(mode)
        if self.text is not None:
            self.text.train(mode)

    def _sample(self):
        """Images of the sample prompts from the current weights, their paths into metrics.jsonl."""
        folder = os.path.join(self.out_dir, "samples")
        try:
            with self.ema.applied() if self.cfg.sample.use_ema else contextlib.nullcontext():
                if self.text is not None:
                    self.text.train(False)
                paths = self.samples.render(self.model, self.step, folder)
        except OSError as e:
            raise self._write_error(e, "sample images", folder) from e
        finally:
            if self.text is not None:
                self.text.train(True)
        self._metrics([{"step": self.step, "samples": paths}])
        self.trackers.log_images(self.step, paths)
        self._say(f"step {self.step}: {_count(len(paths), 'sample')} in {os.path.dirname(paths[0])}")
        self._sampled = self.step

    def _param_groups(self):
        """The adapters in one optimizer group per (model part, A or B), in module order: the part's
        learning-rate multiplier (SDXL: ``lora.lr_down`` / ``lr_mid`` / ``lr_up``) times ``train.lr``, and
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
        out = [{"params": params, "lr": self.cfg.train.lr * scale[block] * (lc.plus_ratio if side == "B" else 1.0)}
               for (block, side), params in groups.items()]
        if self.text is not None:
            out += self.text.param_groups(self.cfg.train.lr if lc.text_encoder_lr is None else lc.text_encoder_lr,
                                          lc.plus_ratio)
        return out

    def _lr(self) -> float:
        """The scheduled learning rate of ``train.lr`` at this step (before the multipliers)."""
        return self.scheduler.lr_at(self.cfg.train.lr, self.scheduler.last_epoch, 0)

    def _check_precision(self):
        """bf16 needs a GPU of compute capability 8.0 (Ampere) or later."""
        capability = runtime.device_capability()
        if self.dtype != torch.bfloat16 or capability is None:
            return
        major, minor = capability
        if major < 8:
            raise ConfigError(f"train.precision: bf16 needs a GPU of compute capability 8.0 (Ampere) or later; "
                              f"this {runtime.device_name()} is {major}.{minor}: use train.precision=fp16")

    def _prepare_output_dir(self):
        """Create output.dir (recording the folders made) and check that files can be written there."""
        missing, d = [], os.path.abspath(self.out_dir)
        while not os.path.exists(d) and d != os.path.dirname(d):
            missing.append(d)
            d = os.path.dirname(d)
        self._created = missing
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.out_dir, prefix=".write-test-"):
                pass
        except OSError as e:
            raise ConfigError(f"output.dir: cannot write to {self.out_dir}: {e.strerror or e}") from None

    def _remove_created(self):
        for d in self._created:
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): keep it and its parents
                break
        self._created = []

    def _open_cache(self, mcfg):
        c = self.cfg.data

        def write_synthetic():
            if c.synthetic_samples and not os.path.isfile(os.path.join(c.cache_dir, "index.json")):
                self.log(f"writing a synthetic cache of {c.synthetic_samples} samples to {c.cache_dir}")
                self.family.write_synthetic_cache(c.cache_dir, c.synthetic_samples, mcfg, c.synthetic_latent_sizes,
                                                  seed=self.cfg.train.seed, flipped=c.flip)

        self._agreed(write_synthetic)
        built = self._agreed(lambda: prepare_datasets(self.cfg, self.family.name, self.dtype, self.log,
                                                      self.progress))  # data.images: built or refreshed here
        entries = built or c.datasets or [{"cache_dir": c.cache_dir, "repeats": 1, "loss_weight": 1.0,
                                           "is_reg": False}]
        caches, self._datasets = [], []  # (folder, repeats, training images, is_reg): for the LoRA's metadata
        want = self.family.cache_dims(mcfg)
        for e in entries:
            cache = LatentCache(e["cache_dir"])
            bad = [f"{k} {getattr(cache, k)} (the model needs {v})" for k, v in want.items() if getattr(cache, k) != v]
            if bad:
                raise ConfigError(f"the cache at {e['cache_dir']} does not fit the model: " + ", ".join(bad))
            if c.flip and not cache.flipped:
                raise ConfigError(f"data.flip: the cache at {e['cache_dir']} holds no mirrored images' latents: "
                                  "rebuild it with scripts/prepare_cache.py --flip, or set data.flip=false")
            if c.caption_variants and cache.caption_variants < 2:
                raise ConfigError(f"data.caption_variants: the cache at {e['cache_dir']} holds one caption per image: "
                                  "rebuild it with scripts/prepare_cache.py --caption-variants K, or set "
                                  "data.caption_variants=false")
            if c.caption_dropout and not cache.has_empty_prompt and not self.cfg.lora.text_encoder:
                raise ConfigError(f"data.caption_dropout: the cache at {e['cache_dir']} holds no embedding of the "
                                  "empty caption (it was written before prepare_cache.py stored one): rebuild it, or "
                                  "set data.caption_dropout=0")
            weight = e["loss_weight"] * (c.prior_loss_weight if e["is_reg"] else 1.0)
            caches.append((cache, e["repeats"], weight))
            self._datasets.append((e["cache_dir"], e["repeats"], len(cache.split("train")), e["is_reg"]))
        if len(caches) == 1 and caches[0][1:] == (1, 1.0):  # one cache as it is (an image folder may repeat)
            cache = caches[0][0]
        else:
            try:
                cache = CacheSet(caches)
            except CacheError as err:
                raise ConfigError(f"data.datasets: {err}") from None
        self._weighted = any(w != 1.0 for _, _, w in caches)  # per-sample loss weights go into the step
        if not cache.split("train"):
            raise ConfigError(f"the cache at {cache.path} has no training samples")
        return cache

    def _loader(self, split, batch_size, shuffle):
        c = self.cfg
        try:
            return BucketBatchLoader(self.cache, batch_size, split, shuffle=shuffle, seed=c.train.seed,
                                     drop_last=c.data.drop_last and split == "train", parts=self.world.size)
        except ValueError as e:
            option = "data.batch_size" if split == "train" else "output.val_batch_size"
            each = f" ({self.world.size} processes take {batch_size} each)" if self.world.size > 1 else ""
            raise ConfigError(f"{option}: {e}{each}; lower it (or set data.drop_last=false)") from None

    def _check_targets(self, model, mcfg):
        """lora.targets must select at least one layer (checked on the module names, no weights)."""
        if model is not None:
            names = adaptable_layers(model)
            convs = [n for n in names if isinstance(model.get_submodule(n), Conv2d)]
        else:
            convs = self.family.layer_names(mcfg, "Conv2d")
            names = self.family.layer_names(mcfg, "Linear") + convs
        if not matching_layers(names, self.family.lora_targets(self.cfg.lora.targets)):
            example = next((n for n in names if n.endswith(("to_q", "qkv"))), names[0] if names else "none")
            raise ConfigError(f"lora.targets: {self.cfg.lora.targets!r} matches none of the model's "
                              f"{len(names):,} Linear and Conv2d layers (names look like {example})")
        conv = self.cfg.lora.conv_targets
        if conv is not None and not matching_layers(convs, conv):
            example = next((n for n in convs if n.endswith("conv1")), convs[0] if convs else "none")
            raise ConfigError(f"lora.conv_targets: {conv!r} matches none of the model's {len(convs):,} Conv2d "
                              f"layers (names look like {example})")

    def _find_checkpoint(self):
        """The checkpoint to resume from, as ``(path, trainer state)``, or None (a fresh start)."""
        spec = self.cfg.resume
        if not spec:
            return None
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
        state_file = os.path.join(path, "trainer_state.json")
        try:
            with open(state_file) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"resume: cannot read {state_file} ({e}); resume from an earlier checkpoint "
                              f"({[p for _, p in list_checkpoints(self.ckpt_dir)]})") from None
        self._check_resumable(path, state.get("config", {}))
        return path, state

    def _resume_loader(self, path, state):
        """The loader continues where the checkpoint's run stopped (at the same fraction of the epoch
        when that run had another number of processes, with a warning)."""
        saved, now = int(state.get("world_size", 1)), self.world.size
        if saved != now:
            b = self.cfg.data.batch_size
            was = f"{saved} process{'es' if saved > 1 else ''}"
            self.log(f"warning: {path} was trained by {was}, this run has {now}: the global batch changes from "
                     f"{saved * b} to {now * b} samples, the data order goes on at the same point of the epoch in the "
                     "new batches, and each process's random stream is derived anew from its rank; the steps from here "
                     f"are not the ones {was} would take")
        try:
            self.loader.load_state_dict(state["loader"])  # the position resuming continues from
        except ValueError as e:
            raise ConfigError(f"resume: {path} does not fit the cache at {self.cache.path}: {e}") from None

    def _check_resumable(self, path, saved):
        """Settings that change tensor shapes or the data order are errors; other changes are warned about."""
        mine = to_dict(self.cfg)
        changed = {}
        for section, opts in mine.items():
            if section == "resume" or not isinstance(opts, dict):
                continue
            for key, value in opts.items():
                old = saved.get(section, {}).get(key, value)
                if old != value:
                    changed[f"{section}.{key}"] = (old, value)
        fixed = [f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in RESUME_FIXED if k in changed]
        if fixed:
            raise ConfigError(f"resume: {path} was trained with other settings that cannot change within a run: "
                              f"{', '.join(fixed)}. Set them back, or start a new run in another output.dir")
        if changed:
            self.log("warning: resuming with different settings than the checkpoint: "
                     + ", ".join(f"{k} {o!r} -> {n!r}" for k, (o, n) in changed.items()))

    def _check_fresh_start(self):
        old = list_checkpoints(self.ckpt_dir)
        if old and not self.cfg.output.overwrite:
            raise ConfigError(f"{self.out_dir} holds checkpoints of an earlier run (steps {[s for s, _ in old]}): "
                              "continue it with --resume (resume=latest), or pick another output.dir, or set "
                              "output.overwrite=true to replace it")

    # ---- the step ----------------------------------------------------------------------------
    def compute_loss(self, latents, noise, levels, prompt_embeds, pooled, *conditioning, input_noise=None,
                     sample_weights=None):
        """The objective's loss (0-d fp32) of the model's prediction for ``latents`` noised to
        ``levels`` (timesteps or flow noise levels), with ``conditioning`` the family's further
        inputs (SDXL's time ids; Flux's position ids and guidance); ``input_noise``: input
        perturbation; ``sample_weights``: the datasets' loss weights."""
        def predict(noisy):
            return self.family.predict(self.model, noisy, levels, prompt_embeds, pooled, *conditioning)
        return self.objective.loss(predict, latents, noise, levels, input_noise, sample_weights)

    def loss_and_grads(self, latents, noise, levels, prompt_embeds, pooled, input_noise=None, sample_weights=None,
                       *conditioning):
        """Forward and backward of one micro-batch: ``(loss, GradientMap of the LoRA gradients)``.
        The loss is divided by grad_accum (and scaled by the loss scaler) for the backward only.
        Fixed shapes, no host sync, no random numbers: a CUDA graph can replay it. With the text
        encoders trained, ``prompt_embeds`` and ``pooled`` are the captions' token ids and EOS
        positions (``TextEncoderLoRA.inputs``), encoded here."""
        with self.adapter_casts:
            if self.text is not None:
                prompt_embeds, pooled = self.text.encode(prompt_embeds, pooled)
            loss = self.compute_loss(latents, noise, levels, prompt_embeds, pooled, *conditioning,
                                     input_noise=input_noise, sample_weights=sample_weights)
            scaled = mul(loss, 1.0 / self.cfg.train.grad_accum) if self.cfg.train.grad_accum > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            return loss, scaled.backward()

    def _part(self, ids):
        """This rank's rows ``(start, stop)`` of the global batch ``ids`` and their latents' shape."""
        start, stop = part_bounds(len(ids), self.world.size, self.world.rank)
        size = self.cache.buckets[self.cache.bucket_of(ids[0])]
        return start, stop, (stop - start, self.cache.latent_channels, *size)

    def _micro_batches(self):
        """Forward+backward of grad_accum micro-batches: (mean loss, summed gradients). With several
        processes, each packs its share of every micro-batch (weighted by its rows) into the bucket,
        and one all-reduce makes the global mean loss and gradients."""
        d, accum = self.cfg.diffusion, self.cfg.train.grad_accum
        losses, total = [], None
        for m in range(accum):
            ids = self.loader.next_indices()  # the global micro-batch, the same on every rank
            start, stop, shape = self._part(ids)
            rows = (start, len(ids))  # this rank's rows of one global draw
            noise = sample_noise(shape, d.noise_offset, rows=rows)
            levels = self.objective.draw(shape, rows)
            input_noise = None
            if d.input_perturbation:  # the input sees noise + gamma * randn, the target the noise alone
                input_noise = add(noise, mul(randn(*shape, rows=rows), d.input_perturbation))
            keep = None
            if self.cfg.data.caption_dropout:  # decided on the device
                keep = ge(rand(shape[0], rows=rows), self.cfg.data.caption_dropout)
            if start == stop:  # fewer samples than ranks in a bucket's last batch
                self.bucket.pack(None, None, 0.0, m > 0, self._requested is not None)
                continue
            mine = ids[start:stop]
            flips = self.loader.flips_of(mine) if self.cfg.data.flip else None
            variants = self.loader.variants_of(mine, self.cache.caption_variants) if self.cfg.data.caption_variants \
                else None
            batch = self.cache.batch(mine, flips, variants)
            if self.text is not None:  # the captions' tokens (the empty caption's where dropped), encoded in the step
                embeds, pooled = self.text.inputs(batch.indices, keep)
            else:
                embeds, pooled = batch.prompt_embeds, batch.pooled
                if keep is not None:
                    empty_embeds, empty_pooled = self._empty_prompt
                    embeds = where(keep.reshape(-1, 1, 1), embeds, empty_embeds)
                    pooled = where(keep.reshape(-1, 1), pooled, empty_pooled)
            weights = None
            if self._weighted:  # the datasets' loss weights of these rows
                weights = tensor(np.array([self.cache.weight_of(i) for i in batch.indices], dtype=np.float32))
            conditioning = self.family.conditioning(batch, shape, batch.prompt_embeds.shape[1])
            loss, grads = self.step_fn(batch.latents, noise, levels, embeds, pooled, input_noise, weights,
                                       *conditioning)
            if self.bucket is not None:
                self.bucket.pack(grads, loss, (stop - start) / len(ids), m > 0, self._requested is not None)
                continue
            losses.append(loss if accum == 1 else loss.clone())
            total = grads if accum == 1 else (total or GradientMap()).accumulate(grads)
        if self.bucket is not None:
            self.bucket.all_reduce()
            return (self.bucket.loss if accum == 1 else mul(self.bucket.loss, 1.0 / accum)), self.bucket.grads
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
        self._step_done = False
        loss, grads = self._micro_batches()
        lr = self._lr()
        with self._signals_deferred():  # the state changes of a step are applied whole or not at all
            norm = self._update(loss, grads)
            self.scheduler.step()
            self.step += 1
            if self.ema is not None and self.step % self.cfg.ema.every == 0:
                self.ema.update()
            self._pending.append((self.step, loss.clone(), norm, lr, self.loader.epoch))
            self._step_done = True
        if self.bucket is not None and self._stop is None and self.bucket.stop_requested():
            self._stop = ("interrupted", self._requested or signal.SIGTERM)  # every rank stops after this step

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> float:
        """Mean loss over the held-out split with fixed noise (a fixed seed) and evenly spaced
        timesteps: the same number for the same weights, whatever the step."""
        d = self.cfg.diffusion
        saved = get_rng_state()
        set_rng_state({"seed": VAL_SEED, "offset": 0})
        all_levels = self.objective.validation_levels(self.val_loader.num_samples)
        total, seen = zeros((1,)), 0
        self._train_mode(False)
        try:
            with no_grad():
                for ids in self.val_loader.plan(0):  # global batches: each rank takes its rows
                    start, stop, shape = self._part(ids)
                    noise = sample_noise(shape, d.noise_offset, rows=(start, len(ids)))
                    if stop > start:
                        batch = self.cache.batch(ids[start:stop])
                        levels = tensor(all_levels[seen + start:seen + stop])
                        conditioning = self.family.conditioning(batch, shape, batch.prompt_embeds.shape[1])
                        embeds, pooled = batch.prompt_embeds, batch.pooled
                        if self.text is not None:
                            embeds, pooled = self.text.encode(*self.text.inputs(batch.indices))
                        loss = self.compute_loss(batch.latents, noise, levels, embeds, pooled, *conditioning)
                        total = add(total, mul(loss, float(stop - start)))
                    seen += len(ids)
        finally:
            self._train_mode(True)
            set_rng_state(saved)
        distributed.all_reduce_(total)
        value = float(total.item()) / seen  # host sync (validation only)
        self.val_losses[self.step] = value
        self._metrics([{"step": self.step, "val_loss": value}])
        self._say(f"step {self.step}: validation loss {value:.4f}")
        if self._bar_ is not None:
            self._bar_.set_postfix(self._fields(), refresh=True)
        return value

    # ---- logging -----------------------------------------------------------------------------
    def _metrics_path(self):
        return os.path.join(self.out_dir, "metrics.jsonl")

    def _metrics(self, records):
        """Append ``records`` to metrics.jsonl in one write (rank 0 alone)."""
        if not self.world.is_main:
            return
        try:
            with open(self._metrics_path(), "a") as f:
                f.write(_json_lines(records))
        except OSError as e:
            raise self._write_error(e, "metrics", self._metrics_path()) from e
        self.trackers.log(records)

    def _say(self, text):
        """A line for the user, above the progress bar when there is one."""
        if self._bar_ is not None:
            self._bar_.write(text)
        else:
            self.log(text)

    def _smoothed(self, value=None):
        """The smoothed loss shown beside the step's: the exponential moving average with Adam's bias
        correction (divided by 1 - SMOOTHING^n after n losses, so that it is the weighted mean of the
        losses so far, not pulled towards its zero start), with ``value`` taken in first (unless it is
        None or not finite); NaN before any loss."""
        avg, n = self._ema
        if value is not None and math.isfinite(value):
            avg, n = SMOOTHING * avg + (1 - SMOOTHING) * value, n + 1
            self._ema = (avg, n)
        return avg / (1 - SMOOTHING ** n) if n else math.nan

    def _flush(self):
        """Read the pending losses (one host sync), log them, and stop on a non-finite one."""
        if not self._pending:
            return
        pending = self._pending
        values = stack([p[1] for p in pending]).numpy()
        norms = [p[2] for p in pending]
        norm_values = stack(norms).numpy() if all(n is not None for n in norms) else [None] * len(pending)
        now = time.perf_counter()
        its = len(pending) / max(now - self._clock, 1e-9)
        self._clock = now
        records, bad, ema = [], None, self._ema
        for (step, _, _, lr, epoch), value, norm in zip(pending, values, norm_values):
            value = float(value)
            rec = {"step": step, "loss": value, "loss_smooth": self._smoothed(value), "lr": lr, "epoch": epoch}
            if norm is not None:
                rec["grad_norm"] = float(norm)
            records.append(rec)
            if bad is None and not math.isfinite(value):
                bad = (step, value)
        distributed.check_same(self.params, f"LoRA weights at step {pending[-1][0]}")
        speed = {"step": pending[-1][0], "it_s": its}
        if not runtime.is_interpreter():
            speed["max_memory_gb"] = runtime.max_memory_allocated() / 2 ** 30
        try:
            with self._signals_deferred():  # the records are written once: never twice, never half
                self._metrics(records + [speed])
                self._pending = []
                self.losses.update((rec["step"], rec["loss"]) for rec in records)
        finally:
            if self._pending:  # not written: the next flush makes these records again
                self._ema = ema
        self._show(records[-1], its, speed.get("max_memory_gb"))
        if bad is not None:
            self._stop = ("non_finite", bad)

    def _show(self, rec, its, mem):
        """The bar's fields (a log line without a bar) of the step flushed last: its loss, the smoothed
        loss, lr, speed, memory, and the latest validation loss."""
        self._step_fields = {"loss": f"{rec['loss']:.4f}", "smoothed": f"{rec['loss_smooth']:.4f}",
                             "lr": f"{rec['lr']:.3g}", "it/s": f"{its:.2f}"}
        if mem is not None:
            self._step_fields["mem"] = f"{mem:.1f}G" if mem >= 1 else f"{mem * 1024:.0f}M"
        fields = self._fields()
        if self._bar_ is not None:
            self._bar_.set_postfix(fields, refresh=True)
        else:
            self.log(f"step {rec['step']}/{self.total_steps}  " + "  ".join(f"{k} {v}" for k, v in fields.items()))

    def _fields(self) -> dict:
        """The fields shown: the last flushed step's and the latest validation loss (a validation
        runs after its step's flush, so it updates the bar itself)."""
        fields = dict(self._step_fields)
        if self.val_losses:
            fields["val"] = f"{self.val_losses[max(self.val_losses)]:.4f}"
        return fields

    # ---- checkpoints -------------------------------------------------------------------------
    def state(self, opt: dict) -> dict:
        """The host-side part of a checkpoint (JSON-able); ``opt``: the optimizer's state dict."""
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": get_rng_state(),
                "world_size": self.world.size,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "ema": {"updates": self.ema.updates} if self.ema is not None else None,
                "optimizer": {"param_groups": opt["param_groups"],
                              "steps": {str(i): e["step"] for i, e in opt["state"].items()}},
                "config": to_dict(self.cfg)}

    def save(self) -> str:
        """Write a checkpoint of the current step (rank 0 alone; the others return its path)."""
        if not self.world.is_main:
            return checkpoint_path(self.ckpt_dir, self.step)
        opt = self.optimizer.state_dict()
        tensors = {f"{i}.{k}": v for i, entry in opt["state"].items() for k, v in entry.items() if k != "step"}
        state = self.state(opt)
        writers = {
            "lora.safetensors": lambda p: save_lora(self._lora_models(), p, format="peft"),
            "optimizer.safetensors": lambda p: save_safetensors(tensors, p),
            "trainer_state.json": lambda p: atomic_write(p, lambda f: f.write(json.dumps(state, indent=1).encode())),
        }
        if self.ema is not None:
            shadow = {str(i): t for i, t in enumerate(self.ema.shadow)}
            writers["ema.safetensors"] = lambda p: save_safetensors(shadow, p)
        try:
            with distributed.hold_exit():  # a peer lost meanwhile does not cut this checkpoint short
                return save_checkpoint(self.ckpt_dir, self.step, writers, self.cfg.output.keep_last)
        except OSError as e:
            raise self._write_error(e, f"the checkpoint of step {self.step}", self.ckpt_dir) from e

    def _write_error(self, e, what, where):
        """A ``TrainingError`` for an OSError while writing ``what`` to ``where``: what failed, what is
        kept, what to do."""
        kept = latest_checkpoint(self.ckpt_dir)
        kept = (f"the newest complete checkpoint is {kept}" if kept else "no checkpoint was written yet")
        cause = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            todo = (f"free space on the disk holding {where} (or lower output.keep_last), then continue with "
                    "--resume")
        else:
            todo = "fix that, then continue with --resume"
        return TrainingError(f"writing {what} to {where} failed: {cause}. Nothing half-written was kept; {kept}. "
                             f"To go on: {todo}")

    def load(self, path, state) -> None:
        """Restore a checkpoint written by ``save`` (the model must already carry its adapters);
        ``state``: its trainer_state.json, read and checked by ``_find_checkpoint``, which has set
        the loader's position too."""
        load_lora(self._lora_models(), os.path.join(path, "lora.safetensors"), inject=False, strict=True)
        tensors = load_safetensors(os.path.join(path, "optimizer.safetensors"))
        opt = state["optimizer"]
        if len(opt["param_groups"]) != len(self.optimizer.param_groups):
            raise ConfigError(f"resume: {path} holds {len(opt['param_groups'])} optimizer groups, this run makes "
                              f"{len(self.optimizer.param_groups)} (one per UNet part and adapter side since lora.lr_* "
                              "and lora.plus_ratio); resume it with the flame release that wrote it")
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
        if self.ema is not None:
            ema_file = os.path.join(path, "ema.safetensors")
            if state.get("ema") and os.path.isfile(ema_file):
                shadow = load_safetensors(ema_file)
                self.ema.load_state_dict({"updates": state["ema"]["updates"],
                                          "shadow": [shadow[str(i)] for i in range(len(shadow))]})
            else:
                self.log(f"ema.decay: {path} holds no moving average; it starts from the weights of step "
                         f"{state['step']}")
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        distributed.check_same(self.params, f"LoRA weights loaded from {path}")
        if self.world.is_main:
            self._restore_metrics()

    def _restore_metrics(self):
        """Keep the metric records up to the resumed step (later ones belong to the run that was cut
        short; a line cut off by a crash mid-write is dropped) and take the smoothed loss and the
        validation losses from them."""
        path = self._metrics_path()
        if not os.path.isfile(path):
            return
        kept, damaged = [], 0
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                    damaged += 1
                elif rec["step"] <= self.step:
                    kept.append(rec)
        if damaged:
            self.log(f"{path}: dropped {_count(damaged, 'damaged line')} (a crash while writing)")
        atomic_write(path, lambda f: f.write(_json_lines(kept).encode()))
        for rec in kept:
            if isinstance(rec.get("loss"), (int, float)):
                self._smoothed(rec["loss"])
            if isinstance(rec.get("val_loss"), (int, float)):
                self.val_losses[rec["step"]] = rec["val_loss"]

    # ---- the loop ----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        """SIGINT / SIGTERM: the first asks for a checkpoint at the end of this step; the next one
        abandons the step (``KeyboardInterrupt``), after the weight update when it is under way.
        With several processes the first is this rank's stop request (the ranks stop together, see
        ``train_step``), the second changes nothing and the third quits without saving."""
        if self.world.size > 1:
            self._signals += 1
            if self._signals == 1:
                self._requested = signum
                _notice(f"\n{signal.Signals(signum).name}: the {self.world.size} processes finish the step they agree "
                        "on and save a checkpoint (a third signal quits without saving)\n")
            elif self._signals >= 3:
                raise KeyboardInterrupt
            return
        if self._stop is None:
            self._stop = ("interrupted", signum)
            _notice(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint (again: stop "
                    "sooner, saving the last finished step)\n")
        elif self._deferring:
            self._deferred = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def _signals_deferred(self):
        """Inside, a stop signal that would interrupt waits until the block is done (a few launches)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    def _make_bar(self):
        from tqdm import tqdm
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if self.progress is None else not self.progress)
        return None if bar.disable else bar

    def lora_path(self, ema: bool = False) -> str:
        """The LoRA file the run writes (``ema``: the one of the moving average, NAME_ema.safetensors)."""
        return os.path.join(self.out_dir, f"{self.cfg.output.name}{'_ema' if ema else ''}.safetensors")

    def _start_fresh(self):
        """A run from step 0 does not mix with an earlier run's checkpoints and metrics (allowed by
        output.overwrite, checked in setup)."""
        if os.path.isdir(self.ckpt_dir):
            shutil.rmtree(self.ckpt_dir)
        if os.path.exists(self._metrics_path()):
            os.unlink(self._metrics_path())

    def train(self) -> dict:
        """Run (or resume) to ``total_steps``; writes the LoRA file. Raises ``TrainingStopped``
        after saving a checkpoint when interrupted or when a loss is not finite, and
        ``TrainingError`` when a file cannot be written."""
        c = self.cfg
        if self._ahead is not None:
            background, self._ahead = self._ahead, None
            ahead = background.wait()
            if ahead is None:
                self.log(f"train.compile_ahead failed ({background.error}); kernels compile on first use")
            elif ahead["variants"]:
                self.log(f"compiled {ahead['variants'] - ahead['failed']} kernels ahead in {ahead['seconds']:.1f} s")
        if self._resume_from is not None:
            self.load(*self._resume_from)
            self.log(f"resumed from {self._resume_from[0]} at step {self.step}")
        elif self.world.is_main:
            self._start_fresh()
        first = self.step
        if self.world.is_main:
            with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(to_dict(c), f, sort_keys=False)
        todo = (_count(self.total_steps, "step") if first == 0 else
                f"steps {first + 1}-{self.total_steps} of {self.total_steps}" if first < self.total_steps else
                f"no steps (the run finished at step {first} of {self.total_steps})")
        self.log(f"training {_count(len(self.lora_layers), 'LoRA layer')} ({sum(p.numel() for p in self.params):,} "
                 f"params) on {_count(len(self.loader.cache.split('train')), 'sample')}: {todo} "
                 f"({c.train.precision}, {runtime.device_name()}"
                 + (f", {self.world.size} processes, global batch {self.world.size * c.data.batch_size}"
                    if self.world.size > 1 else "") + ")")
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._step_fields = {}  # the bar's fields of the step flushed last
        self._bar_ = self._make_bar()
        started = self._clock = time.perf_counter()
        started_at = time.time()
        # the model's, adapters' and optimizer's objects live for the whole run: kept out of the cyclic
        # collector's passes (gc.freeze), its full collections stop walking them every few eager steps
        gc.collect()
        gc.freeze()
        try:
            checkpoint = self._loop()
            distributed.barrier()  # no rank leaves (and torchrun stops none) before rank 0's checkpoint is written
        except distributed.PeerLostError as e:
            kept = latest_checkpoint(self.ckpt_dir)
            raise TrainingError(f"{e}. Nothing half-written was kept; "
                                + (f"the newest complete checkpoint is {kept}" if kept else "no checkpoint was written")
                                + ": continue with --resume once every process can run") from e
        finally:
            gc.unfreeze()  # a dropped trainer's objects become collectable again
            if self._bar_ is not None:
                self._bar_.close()
                self._bar_ = None
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self.trackers.close()
            precompile.mark_compiled(launch.take_recorded())  # the next run's compile_ahead skips them
        if self._stop is not None:
            reason, info = self._stop
            if reason == "non_finite":
                msg = (f"stopped: the loss at step {info[0]} is {info[1]} (non-finite). Updates with a non-finite "
                       f"loss or gradient were skipped, so the checkpoint {checkpoint} (step {self.step}) holds finite "
                       "weights; lower train.lr, use train.precision=fp32 or fp16, or check the cache for bad latents")
                signum = None
            else:
                signum = info
                msg = (f"interrupted at step {self.step} ({signal.Signals(signum).name}): checkpoint saved to "
                       f"{checkpoint}; continue with --resume (resume=latest)")
            self.log(msg)
            raise TrainingStopped(msg, reason, self.step, checkpoint, signum)
        if self.world.is_main:
            meta = lora_metadata(c, self.step, len(self.loader.cache.split("train")), started_at, time.time(),
                                 self._datasets, type(self.optimizer).__name__, self.family)
            for path, averaged in ((self.lora_path(), False), (self.lora_path(ema=True), True)):
                if averaged and self.ema is None:
                    continue
                try:
                    with self.ema.applied() if averaged else contextlib.nullcontext():
                        save_lora(self._lora_models(), path, format=c.lora.format,
                                  dtype=PRECISIONS[c.output.save_dtype], metadata=meta)
                except OSError as e:
                    raise self._write_error(e, "the LoRA file", path) from e
            self._summary(self.step - first, time.perf_counter() - started, checkpoint)
        return {"step": self.step, "losses": [self.losses[s] for s in sorted(self.losses)],
                "val_losses": dict(self.val_losses), "lora": self.lora_path(), "checkpoint": checkpoint}

    def _loop(self) -> str:
        """The steps, validations and checkpoints up to ``total_steps`` or a stop; returns the
        checkpoint saved last."""
        c = self.cfg
        if self.val_loader is not None and self.step == 0:
            self.validate()
        if self.samples is not None and self.step == 0 and c.sample.at_start:
            self._sample()
        while self.step < self.total_steps and self._stop is None:
            snapshot = (self.loader.state_dict(), get_rng_state())
            try:
                self.train_step()
                if self._bar_ is not None:
                    self._bar_.update(1)
                s = self.step
                due_save = c.output.save_every and s % c.output.save_every == 0
                if s % c.output.log_every == 0 or s == self.total_steps or due_save:
                    self._flush()
                if self._stop is None and self.val_loader is not None and s % c.output.validate_every == 0:
                    self.validate()
                every = c.sample.every_n_steps
                if self._stop is None and self.samples is not None and every and s % every == 0:
                    self._sample()
                if self._stop is None and due_save and s < self.total_steps:
                    self.save()
            except KeyboardInterrupt:  # a second signal (or Ctrl-C without our handler)
                if self.world.size > 1:  # a rank cannot abandon a step alone: quit without saving
                    raise
                if not self._step_done:  # abandoned before its update: back to the step boundary
                    self.loader.load_state_dict(snapshot[0])
                    set_rng_state(snapshot[1])
                    self._step_done = True
                if self._stop is None:
                    self._stop = ("interrupted", signal.SIGINT)
                break
        self._flush()
        if self._stop is None and self.val_loader is not None and self.step not in self.val_losses:
            self.validate()  # a last validation loss at the end of the run
        if self._stop is None and self.samples is not None and self._sampled != self.step:
            self._sample()  # samples of the final weights
        return self.save()

    def _summary(self, steps, seconds, checkpoint):
        c = self.cfg
        rate = f", {steps / seconds:.2f} steps/s" if steps and seconds > 0 else ""
        lines = [f"done: {_count(steps, 'step')} in {_duration(seconds)}{rate}, step {self.step} of {self.total_steps}"]
        if self._ema[1]:
            lines.append(f"  training loss (smoothed): {self._smoothed():.4f}"
                         + (f" (step {max(self.losses)}: {self.losses[max(self.losses)]:.4f})" if self.losses else ""))
        if self.val_losses:
            first, last = min(self.val_losses), max(self.val_losses)
            lines.append(f"  validation loss: {self.val_losses[last]:.4f} at step {last}"
                         + (f" ({self.val_losses[first]:.4f} at step {first})" if first != last else ""))
        layers = self.lora_layers
        lines += [f"  LoRA file: {self.lora_path()} ({c.lora.format} format, {_count(len(layers), 'layer')}, "
                  f"rank {c.lora.rank}, alpha {c.lora.alpha if c.lora.alpha is not None else c.lora.rank:g})"]
        if self.text is not None:
            lines.append(f"    text encoders: {_count(len(self.text.layers), 'layer')} of them, rank {self.text.rank}, "
                         f"alpha {self.text.alpha:g} (diffusers' text_encoder. / text_encoder_2., kohya's lora_te1_ / "
                         "lora_te2_)")
        if self.ema is not None:
            lines.append(f"  moving average (decay {c.ema.decay:g}): {self.lora_path(ema=True)}")
        lines += [f"  checkpoint: {checkpoint} (--resume continues from it)", f"  metrics: {self._metrics_path()}"]
        folder, name = os.path.split(os.path.abspath(self.lora_path()))
        lines.append("  in diffusers: pipe.load_lora_weights("
                     f"{folder!r}, weight_name={name!r}, use_safetensors=True)"
                     + ("  # use_safetensors keeps the alpha stored in the file's metadata"
                        if c.lora.format == "peft" else ""))
        self.log("\n".join(lines))


def _json_lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _quiet(*args, **kwargs):
    """The log of ranks other than 0: they print nothing (rank 0 says the same)."""


def _notice(text):
    """Write ``text`` to stderr from a signal handler (no Python-level buffers: no reentrancy)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def train(config, model=None, **kwargs) -> dict:
    """Build a ``Trainer`` for ``config`` and run it (see ``Trainer.train``)."""
    return Trainer(config, model=model, **kwargs).train()


__all__ = ["PRECISIONS", "Trainer", "TrainingError", "TrainingStopped", "train"]
