"""The trainer (SDXL and Flux.1): cached latents in, a LoRA file (or a fine-tuned model) out.

What differs between model families (the model, its layer names and LoRA presets, the cache fields,
the objective: DDPM noise prediction or rectified flow, the conditioning inputs) sits behind
``flame.train.families``; ``Trainer`` is the one setup, step, validation and checkpoint for all. Its
parts live beside it: ``preflight`` (the checks made before any weight loads), ``trained`` (which
parameters train and how they are saved: LoRA adapters, or the model's own weights, ZeRO-sharded
over the processes or not), ``run_state`` (the run's host-side state),
``loop`` (when steps, reads of the losses, validations, samples and checkpoints happen), ``resume``
(checkpoints and resuming), ``console`` (the progress bar, log lines, summary and metrics.jsonl) and
``stops`` (stop signals and the errors a run ends with).

One optimizer step::

    for each of grad_accum micro-batches:           (host: next batch of one aspect bucket)
        noise, levels = sample_noise(...), objective.draw(...)     (flame's Philox RNG)
        loss, grads = loss_and_grads(latents, noise, levels, embeds, pooled, ..., *conditioning)
    [unscale_ + found-inf check (fp16)] clip_grad_norm_, AdamW step (skipped on the device when
    the loss or the gradient norm is not finite), loss-scaler update, lr-scheduler step

A sharded full fine-tune (``trained.shards``, a ``flame.sharding.ShardedOptimizer``) packs each
micro-batch's gradients into it instead (reduce-scattered from the ``gradients`` stage on), and its
``step`` clips by the global norm over the shards and skips the update on every rank alike.

``loss_and_grads`` is a pure device function of fixed-shape tensors (noising, model forward,
weighted loss, backward): no host sync and no random numbers inside, so it can be replayed
from a CUDA graph (``train.cuda_graph``). The host reads losses only every ``output.log_every``
steps (and before any checkpoint): a non-finite loss then stops the run with a checkpoint whose
weights never saw that step's update.

Checkpoints (``flame.train.checkpoints``) hold the trained weights, the optimizer state (sharded:
each rank's shard of both, written by every rank), the lr scheduler, the loss scaler, flame's RNG
state, the data loader's position and the step; resuming from one reproduces the losses of an
uninterrupted run exactly.

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

import json
import math
import os
import signal

import numpy as np
import torch

from .. import distributed
from ..amp import DynamicLossScaler
from ..autograd import GradientMap, no_grad
from ..data import part_bounds
from ..diffusion import sample_noise
from ..graphs import CapturedStep
from ..io import atomic_write, save_safetensors
from ..models.offload import BlockStreamer, plan_offload, plan_offload_from_config
from ..nn import quantize_linears_
from ..ops.creation import get_rng_state, manual_seed, rand, randn, set_rng_state, set_rng_substream, tensor, zeros
from ..ops.elementwise import abs as fabs
from ..ops.elementwise import add, ge, lt, mul, sub, to, where
from ..ops.quant import Fp8Weight
from ..ops.shape import stack
from ..optim import EMA, clip_grad_norm_
from ..optim.lr_scheduler import get_scheduler
from . import families, loop, preflight, resume
from .config import ConfigError, to_dict
from .console import Console, MetricsFile, quiet
from .outputs import Trackers
from .preflight import PRECISIONS
from .resume import RESUME_FIXED, Checkpoints
from .run_state import SMOOTHING, RunState
from .stops import StopSignals, TrainingError, TrainingStopped
from .text_encoders import check_source
from .trained import make_optimizer, trained_parameters

VAL_SEED = 0x5EEDBA5E


class Trainer:
    """Builds a run from a validated config (``flame.train.config``) and trains it (``train()``).

    ``model``: a ready model to use instead of ``model.path`` / ``model.config`` (it must follow
    its family's forward signature, ``SDXLUNet``'s or ``FluxTransformer2DModel``'s, and expose
    ``config``, ``dtype`` and ``enable_gradient_checkpointing``). ``progress``: show a tqdm bar
    (default: when stderr is a terminal; otherwise a log line every ``log_every`` steps). ``log``:
    where text lines go.

    The run's host-side state is ``run`` (a ``RunState``); what trains is ``trained`` (a
    ``trained.LoRAAdapters`` or ``trained.FullWeights``; ``text``: the adapted text encoders, or None).
    """

    def __init__(self, config, model=None, progress=None, log=print):
        self.world = distributed.init(config.distributed.timeout)
        main = self.world.is_main
        self.cfg, self.log = config, log if main else quiet
        self.progress = progress if main else False
        self.dtype = PRECISIONS[config.train.precision]
        self.out_dir = config.output.dir
        self.output = preflight.OutputDir(self.out_dir)
        self.checkpoints = Checkpoints(os.path.join(self.out_dir, "checkpoints"), config.output.keep_last, self.log)
        self.run = RunState()
        self.signals = StopSignals(self.run, self.world.size)
        try:
            self._setup(model)
        except BaseException:
            self.output.remove_created()
            raise

    @property
    def step(self) -> int:
        """Optimizer steps done (``run.step``)."""
        return self.run.step

    # ---- setup -------------------------------------------------------------------------------
    def _setup(self, model):
        c = self.cfg
        self.family = families.get(c.model.family, c)
        self.text = None  # lora.text_encoder: the text encoders with their adapters (TextEncoderLoRA)
        mcfg, fp8, plan = self._check(model)
        # ---- the run
        self.compiling = preflight.compile_ahead(c.train.compile_ahead, self.family, mcfg, self.world, self.log)
        # before the model: the text encoders come and go first (rank 0 alone makes samples); those being
        # trained stay, and samples are made with them
        self.samples = self._prepare_samples(mcfg) if self.world.is_main and not c.lora.text_encoder else None
        manual_seed(c.train.seed)
        self.model = model if model is not None else self._build_model(fp8, plan)
        self._attach_trained(mcfg)
        self._place_weights(fp8, plan)
        self._make_update()
        self._make_step()

    def _check(self, model):
        """Everything that can fail without model weights (a bad setting fails here, in seconds).
        Returns the model config, the fp8 settings of the frozen weights ({} without) and the offload
        plan made from the config (None without)."""
        c = self.cfg
        mcfg = model.config if model is not None else preflight.model_config(self.family, c.model)
        preflight.check_precision(self.dtype)
        preflight.agreed(self.world, self.output.prepare)
        data = preflight.open_cache(c, self.family, mcfg, self.dtype, self.log, self.progress, self.world)
        self.cache, self.datasets, self._weighted = data.cache, data.datasets, data.weighted
        self.loader = preflight.make_loader(c, self.cache, "train", c.data.batch_size, True, self.world)
        self.val_loader = None
        if c.output.validate_every and self.cache.split("val"):
            self.val_loader = preflight.make_loader(c, self.cache, "val", c.output.val_batch_size or c.data.batch_size,
                                                    False, self.world)
        self.total_steps = preflight.total_steps(c, self.loader)
        self.objective = self.family.objective(c, self.log)
        preflight.check_trained(c, self.family, model, mcfg, self.world)
        self.memory = None
        if c.train.memory_budget_gb is not None:
            self.memory = preflight.plan_memory_budget(c, self.family, self.cache, mcfg, self.dtype, self.log)
        weight_dtype = preflight.memory_settings(c, self.memory)[0]
        fp8 = {} if weight_dtype is None else {"weight_dtype": weight_dtype,
                                               "fp8_skip": self.family.full_precision_layers}
        # streamed blocks of a checkpoint load straight into pinned host memory, fp8 weights quantise as
        # they load: the GPU never holds the whole model in bf16
        plan = None
        if model is None and c.model.path:
            plan = preflight.plan_offload(c, self.memory, lambda **kw: plan_offload_from_config(
                mcfg, self.dtype, **fp8, **kw))
        if c.lora.text_encoder:
            check_source(c)
        self.resume_from = preflight.agreed(self.world, lambda: self.checkpoints.find(c))  # (path, state) or None
        if self.resume_from is None:
            preflight.agreed(self.world, lambda: self.checkpoints.check_fresh_start(c, self.out_dir))
        else:
            resume.resume_loader(self.loader, *self.resume_from, self.world.size, c.data.batch_size, self.log)
        return mcfg, fp8, plan

    def _build_model(self, fp8, plan):
        """The model of ``model.path`` / ``model.config``, placed as the memory settings say while it loads."""
        c = self.cfg
        try:
            placement = dict(fp8, host_blocks=plan.streamed) if plan is not None else fp8  # for loading only
            return self.family.build(c.model.path, c.model.config, self.dtype, **placement)
        except torch.cuda.OutOfMemoryError:
            raise
        except (OSError, ValueError, RuntimeError) as e:  # a damaged or mismatched checkpoint
            raise ConfigError(f"model.path: cannot load {c.model.path}: {e}") from None

    def _attach_trained(self, mcfg):
        """What trains (``trained``), started from ``lora.init_from`` or rank 0's initial values."""
        c = self.cfg
        self.trained = trained_parameters(c, self.family, self.model, self.dtype, self.cache)
        self.text = self.trained.text
        if self.text is not None and self.world.is_main:
            self.samples = self._prepare_samples(mcfg)
        if c.lora.init_from is not None:
            self.trained.init_from(c.lora.init_from, self.log)
        self.trained.train(True)
        params = self.trained.params
        distributed.broadcast_(params)  # every rank starts from rank 0's adapters (weights)
        set_rng_substream(self.world.rank)  # from here on each rank draws its own dropout masks
        # several processes sum the gradients, the loss and the stop flag in one bucket; sharded, the shards
        # take the gradients and the bucket the rest
        self.bucket = distributed.GradientBucket([] if self.trained.sharded else params) \
            if self.world.size > 1 else None

    def _place_weights(self, fp8, plan):
        """The memory settings on the built model: checkpointed blocks, fp8 frozen weights, streamed blocks."""
        c, model = self.cfg, self.model
        weight_dtype, checkpointed, streaming = preflight.memory_settings(c, self.memory)
        if checkpointed != 0:
            try:
                model.enable_gradient_checkpointing(True, scope=c.train.checkpoint_scope, blocks=checkpointed)
            except ValueError as e:
                raise ConfigError(f"train.checkpoint_blocks: {e}") from None
        if fp8:
            quantize_linears_(model, weight_dtype, skip=self.family.full_precision_layers)  # if not loaded so
            stored = sum(isinstance(w, Fp8Weight) for w in model.parameters())
            self.log(f"model.weight_dtype: {stored} frozen Linear weights stored as {weight_dtype}")
            preflight.use_w8a8(c, model, self.log)
        if streaming:  # last: the streamer moves the frozen weights as they are now
            plan = plan or preflight.plan_offload(c, self.memory, lambda **kw: plan_offload(model, **kw))
            self.log(plan.summary())
        self.streamer = BlockStreamer(model, plan) if plan is not None else None

    def _make_update(self):
        """The optimizer, its lr schedule, the moving average and (fp16) the loss scaler."""
        t = self.cfg.train
        self.optimizer = self.trained.make_optimizer(t)
        if t.optimizer == "prodigy" and t.lr < 0.1:
            self.log(f"train.lr is {t.lr}: Prodigy's lr multiplies the step size it estimates; 1.0 is usual")
        self.scheduler = get_scheduler(t.lr_scheduler, self.optimizer, t.warmup_steps, self.total_steps,
                                       num_cycles=t.lr_num_cycles, power=t.lr_power)
        decay = self.cfg.ema.decay
        self.ema = EMA(self.trained.params, decay) if decay is not None else None
        self.scaler = DynamicLossScaler() if self.dtype == torch.float16 else None

    def _make_step(self):
        """The captured step, and where the run's lines and metrics go."""
        c = self.cfg
        # caption dropout's empty caption: the cache's embedding, or (text encoders trained) its tokens
        self._empty_prompt = self.cache.empty_prompt() if c.data.caption_dropout and self.text is None else None
        blocker = self.trained.graph_blocker()
        graph = c.train.cuda_graph and blocker is None
        if c.train.cuda_graph and blocker is not None:
            self.log(f"train.cuda_graph: off because {blocker}")
        self.step_fn = CapturedStep(self.loss_and_grads, enabled=graph)
        trackers = [t for t in c.output.report_to if t != "jsonl"] if self.world.is_main else []
        self.metrics = MetricsFile(os.path.join(self.out_dir, "metrics.jsonl"),
                                   Trackers(trackers, self.out_dir, c.output.name, to_dict(c)), self.world.is_main,
                                   self.checkpoints.write_error)
        self.console = Console(self.log, self.progress, self.total_steps)

    def _prepare_samples(self, mcfg):
        """The ``sample`` section's prompts encoded and its VAE loaded (None without prompts); with
        the text encoders trained, the prompts are encoded by them at each sampling."""
        s = self.cfg.sample
        if s.prompts is None:
            return None
        return self.family.training_samples(s, s.model or self.cfg.model.path, self.dtype, mcfg,
                                            None if self.text is None else self.text.encoders)

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
        """Forward and backward of one micro-batch: ``(loss, GradientMap of the trained gradients)``.
        The loss is divided by grad_accum (and scaled by the loss scaler) for the backward only.
        Fixed shapes, no host sync, no random numbers: a CUDA graph can replay it. With the text
        encoders trained, ``prompt_embeds`` and ``pooled`` are the captions' token ids and EOS
        positions (``TextEncoderLoRA.inputs``), encoded here."""
        with self.trained.computing():
            if self.text is not None:
                prompt_embeds, pooled = self.text.encode(prompt_embeds, pooled)
            loss = self.compute_loss(latents, noise, levels, prompt_embeds, pooled, *conditioning,
                                     input_noise=input_noise, sample_weights=sample_weights)
            scaled = mul(loss, 1.0 / self.cfg.train.grad_accum) if self.cfg.train.grad_accum > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            return loss, scaled.backward()

    def _part(self, ids):
        """This rank's rows ``(start, stop)`` of the global batch ``ids``, their latents' shape and how
        many of them count. A rank without rows (fewer samples than ranks) whose forward takes part in
        collectives (``trained.collective_forward``: ZeRO-3's gathers) computes row 0, which counts 0."""
        start, stop = part_bounds(len(ids), self.world.size, self.world.rank)
        counted = stop - start
        if start == stop and self.trained.collective_forward:
            start, stop = 0, 1
        size = self.cache.buckets[self.cache.bucket_of(ids[0])]
        return start, stop, (stop - start, self.cache.latent_channels, *size), counted

    def _draws(self, shape, rows):
        """A micro-batch's random draws, ``rows`` of one global draw: noise, noise levels, input
        perturbation's noise and caption dropout's keep coin (None when off), decided on the device."""
        d = self.cfg.diffusion
        noise = sample_noise(shape, d.noise_offset, rows=rows)
        levels = self.objective.draw(shape, rows)
        input_noise = None
        if d.input_perturbation:  # the input sees noise + gamma * randn, the target the noise alone
            input_noise = add(noise, mul(randn(*shape, rows=rows), d.input_perturbation))
        keep = None
        if self.cfg.data.caption_dropout:
            keep = ge(rand(shape[0], rows=rows), self.cfg.data.caption_dropout)
        return noise, levels, input_noise, keep

    def _step_inputs(self, ids, shape, noise, levels, input_noise, keep) -> tuple:
        """``step_fn``'s arguments for this rank's samples ``ids`` (their flips, caption variants, text
        inputs, loss weights and the family's conditioning made here, outside the captured step)."""
        c = self.cfg.data
        flips = self.loader.flips_of(ids) if c.flip else None
        variants = self.loader.variants_of(ids, self.cache.caption_variants) if c.caption_variants else None
        batch = self.cache.batch(ids, flips, variants)
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
        return (batch.latents, noise, levels, embeds, pooled, input_noise, weights, *conditioning)

    def _micro_batches(self):
        """Forward+backward of grad_accum micro-batches: (mean loss, summed gradients). With several
        processes, each packs its share of every micro-batch (weighted by its rows) into the bucket,
        and one all-reduce makes the global mean loss and gradients. Sharded, the gradients go into
        the shards instead (``pack``: this rank's shard of the weighted sum) and the summed gradients
        returned are this rank's shard."""
        accum, shards = self.cfg.train.grad_accum, self.trained.shards
        losses, total = [], None
        for m in range(accum):
            ids = self.loader.next_indices()  # the global micro-batch, the same on every rank
            start, stop, shape, counted = self._part(ids)
            draws = self._draws(shape, (start, len(ids)))
            if start == stop:  # fewer samples than ranks in a bucket's last batch
                if shards is not None:
                    shards.pack(None, accumulate=m > 0)
                self.bucket.pack(None, None, 0.0, m > 0, self.signals.requested is not None)
                continue
            weight = counted / len(ids)
            if shards is not None:  # before the backward, which may reduce-scatter the gradients (overlap)
                shards.weigh(weight)
            loss, grads = self.step_fn(*self._step_inputs(ids[start:stop], shape, *draws))
            if shards is not None:
                shards.pack(grads, weight=weight, accumulate=m > 0)
                grads = GradientMap()
            if self.bucket is not None:
                self.bucket.pack(grads, loss, weight, m > 0, self.signals.requested is not None)
                continue
            losses.append(loss if accum == 1 else loss.clone())
            total = grads if accum == 1 or shards is not None else (total or GradientMap()).accumulate(grads)
        if self.bucket is not None:
            self.bucket.all_reduce()
            loss, total = self.bucket.loss if accum == 1 else mul(self.bucket.loss, 1.0 / accum), self.bucket.grads
        else:
            loss = losses[0] if len(losses) == 1 else mul(stack(losses).sum(), 1.0 / len(losses))
        return loss, (total if shards is None else shards.grads)

    def _update(self, loss, grads):
        """Clip, optimizer step, scaler update. Returns the gradient norm (device) or None."""
        max_norm = self.cfg.train.max_grad_norm
        norm = None
        if self.trained.shards is not None:
            return self._sharded_update(loss, max_norm or None)
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

    def _sharded_update(self, loss, max_norm):
        """``ShardedOptimizer.step``: clipping by the global norm over every rank's shard, the update
        skipped on every rank when any has inf/NaN gradients, a non-finite loss or (fp16) the scaler's
        flag. Returns the norm (device) or None."""
        shards = self.trained.shards
        with no_grad():
            if self.scaler is not None:
                self.scaler.unscale_(shards.grads)
                norm = shards.step(max_norm=max_norm, found_inf=self.scaler.found_inf)
                self.scaler.update()
                return norm
            found = sub(1, to(lt(fabs(loss), math.inf), torch.int32))
            return shards.step(max_norm=max_norm, found_inf=found)

    def _lr(self) -> float:
        """The scheduled learning rate of ``train.lr`` at this step (before the multipliers)."""
        return self.scheduler.lr_at(self.cfg.train.lr, self.scheduler.last_epoch, 0)

    def train_step(self):
        """One optimizer step (grad_accum micro-batches); the loss stays on the device."""
        run = self.run
        run.step_done = False
        loss, grads = self._micro_batches()
        lr = self._lr()
        with self.signals.deferred():  # the state changes of a step are applied whole or not at all
            norm = self._update(loss, grads)
            self.scheduler.step()
            run.step += 1
            if self.ema is not None and run.step % self.cfg.ema.every == 0:
                self.ema.update()
            run.pending.append((run.step, loss.clone(), norm, lr, self.loader.epoch))
            run.step_done = True
        if self.bucket is not None and run.stop is None and self.bucket.stop_requested():
            run.stop = ("interrupted", self.signals.requested or signal.SIGTERM)  # every rank stops after this step

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> float:
        """Mean loss over the held-out split with fixed noise (a fixed seed) and evenly spaced
        timesteps: the same number for the same weights, whatever the step."""
        d = self.cfg.diffusion
        saved = get_rng_state()
        set_rng_state({"seed": VAL_SEED, "offset": 0})
        all_levels = self.objective.validation_levels(self.val_loader.num_samples)
        total, seen = zeros((1,)), 0
        self.trained.train(False)
        try:
            with no_grad(), self.trained.computing():
                for ids in self.val_loader.plan(0):  # global batches: each rank takes its rows
                    start, stop, shape, counted = self._part(ids)
                    noise = sample_noise(shape, d.noise_offset, rows=(start, len(ids)))
                    if stop > start:
                        batch = self.cache.batch(ids[start:stop])
                        levels = tensor(all_levels[seen + start:seen + stop])
                        conditioning = self.family.conditioning(batch, shape, batch.prompt_embeds.shape[1])
                        embeds, pooled = batch.prompt_embeds, batch.pooled
                        if self.text is not None:
                            embeds, pooled = self.text.encode(*self.text.inputs(batch.indices))
                        loss = self.compute_loss(batch.latents, noise, levels, embeds, pooled, *conditioning)
                        total = add(total, mul(loss, float(counted)))
                    seen += len(ids)
        finally:
            self.trained.train(True)
            set_rng_state(saved)
        distributed.all_reduce_(total)
        value = float(total.item()) / seen  # host sync (validation only)
        self.run.val_losses[self.step] = value
        self.metrics.write([{"step": self.step, "val_loss": value}])
        self.console.say(f"step {self.step}: validation loss {value:.4f}")
        self.console.show_validation(self.run.val_losses)
        return value

    # ---- checkpoints -------------------------------------------------------------------------
    def state(self, opt: dict | None) -> dict:
        """The host-side part of a checkpoint (JSON-able); ``opt``: the optimizer's state dict (None:
        sharded, the shards hold it)."""
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": get_rng_state(),
                "world_size": self.world.size,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "ema": {"updates": self.ema.updates} if self.ema is not None else None,
                "optimizer": resume.optimizer_state(opt) if opt is not None else None,
                "config": to_dict(self.cfg)}

    def save(self) -> str:
        """Write a checkpoint of the current step (rank 0 alone, the others returning its path; sharded,
        every rank its shard and rank 0 the rest): the trained weights' files, the optimizer's
        tensors, ``state`` and the moving average."""
        shards = self.trained.shards
        if shards is None and not self.world.is_main:
            return self.checkpoints.path(self.step)
        opt = self.optimizer.state_dict() if shards is None else None
        state = self.state(opt)
        writers = {
            **self.trained.checkpoint_writers(),
            "trainer_state.json": lambda p: atomic_write(p, lambda f: f.write(json.dumps(state, indent=1).encode())),
        }
        if opt is not None:
            tensors = resume.optimizer_tensors(opt)
            writers["optimizer.safetensors"] = lambda p: save_safetensors(tensors, p)
        if self.ema is not None:
            shadow = {str(i): t for i, t in enumerate(self.ema.shadow)}
            writers["ema.safetensors"] = lambda p: save_safetensors(shadow, p)
        return self.checkpoints.write(self.step, writers, shards)

    def load(self, path, state) -> None:
        """Restore a checkpoint written by ``save`` (the trained parameters must already exist);
        ``state``: its trainer_state.json, read and checked by ``Checkpoints.find``, after which
        setup has set the loader's position too. The metric records after its step are dropped."""
        self.trained.load_checkpoint(path)  # sharded: the optimizer state too
        if self.trained.shards is None:
            resume.restore_optimizer(self.optimizer, path, state)
        resume.restore_schedule(self.scheduler, state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            resume.restore_ema(self.ema, path, state, self.log)
        set_rng_state(state["rng"])
        self.run.step = int(state["step"])
        self.trained.check_same(f"loaded from {path}")
        if self.world.is_main:
            self.run.restore(self.metrics.trim(self.step, self.log))

    # ---- the run -----------------------------------------------------------------------------
    def output_path(self, ema: bool = False) -> str:
        """The file the run writes, its LoRA or model (``ema``: the one of the moving average,
        NAME_ema.safetensors)."""
        return os.path.join(self.out_dir, f"{self.cfg.output.name}{'_ema' if ema else ''}.safetensors")

    def train(self) -> dict:
        """Run (or resume) to ``total_steps``; writes the LoRA (or model) file. Raises
        ``TrainingStopped`` after saving a checkpoint when interrupted or when a loss is not finite,
        and ``TrainingError`` when a file cannot be written. Returns the final step, the losses read
        from this run's steps, the validation losses, the run's file (under "lora" or "model") and
        the last checkpoint."""
        return loop.run(self)


def train(config, model=None, **kwargs) -> dict:
    """Build a ``Trainer`` for ``config`` and run it (see ``Trainer.train``)."""
    return Trainer(config, model=model, **kwargs).train()


__all__ = ["PRECISIONS", "RESUME_FIXED", "SMOOTHING", "Trainer", "TrainingError", "TrainingStopped", "make_optimizer",
           "train"]
