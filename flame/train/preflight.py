"""What a run checks and opens before any weight loads, so that a bad setting fails in seconds with a
``ConfigError``: the precision against the GPU (``check_precision``), the output folder
(``OutputDir``), the model config (``model_config``), the latent caches (``open_cache``) and their
loaders (``make_loader``), what trains (``check_trained``: LoRA targets, or the weights of a full
fine-tune and its sharding against the number of processes), the memory settings
(``plan_memory_budget``, ``memory_settings``, ``plan_offload``) and the kernels to compile while the
model loads (``compile_ahead``). ``agreed`` makes each decision that reads or changes files once, on
rank 0, and hands every rank its outcome.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass

import torch

from .. import distributed, runtime
from ..data import BucketBatchLoader, CacheError, CacheSet, LatentCache
from ..kernels import launch, matmul_hopper, precompile
from ..nn.layers import Conv2d
from ..nn.lora import adaptable_layers, matching_layers
from ..nn.quant import use_w8a8_
from .config import ConfigError
from .datasets import prepare_datasets
from .memory import plan_memory

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def agreed(world, fn):
    """``fn()`` on rank 0, and its result (or the error it raised) on every rank: decisions that
    read or change files are made once."""
    if world.size == 1:
        return fn()
    result = error = None
    if world.is_main:
        try:
            result = fn()
        except Exception as e:  # every rank raises it
            error = e
    result, error = distributed.broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def check_precision(dtype) -> None:
    """bf16 needs a GPU of compute capability 8.0 (Ampere) or later."""
    capability = runtime.device_capability()
    if dtype != torch.bfloat16 or capability is None:
        return
    major, minor = capability
    if major < 8:
        raise ConfigError(f"train.precision: bf16 needs a GPU of compute capability 8.0 (Ampere) or later; "
                          f"this {runtime.device_name()} is {major}.{minor}: use train.precision=fp16")


class OutputDir:
    """output.dir (``path``): made when missing and checked writable (``prepare``); the folders made
    for it (``created``, deepest first) go again when the run refuses to start (``remove_created``)."""

    def __init__(self, path):
        self.path, self.created = path, []

    def prepare(self) -> None:
        missing, d = [], os.path.abspath(self.path)
        while not os.path.exists(d) and d != os.path.dirname(d):
            missing.append(d)
            d = os.path.dirname(d)
        self.created = missing
        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
        except OSError as e:
            raise ConfigError(f"output.dir: cannot write to {self.path}: {e.strerror or e}") from None

    def remove_created(self) -> None:
        for d in self.created:
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): keep it and its parents
                break
        self.created = []


def model_config(family, model_cfg):
    """The model config of the ``model`` section: its folder's config.json, or ``model.config``."""
    option = "path" if model_cfg.path and os.path.isdir(model_cfg.path) else "config"  # a folder holds its config
    try:
        return family.model_config(getattr(model_cfg, option))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.{option}: {e}") from None


@dataclass
class Data:
    """The run's latent cache (one ``LatentCache`` or a ``CacheSet``), ``datasets``: (folder,
    repeats, training images, is_reg) of each cache (the LoRA file's metadata), ``weighted``:
    whether per-sample loss weights go into the step."""

    cache: object
    datasets: list
    weighted: bool


def open_cache(cfg, family, mcfg, dtype, log, progress, world) -> Data:
    """The caches of the ``data`` section (``data.images`` built or refreshed first; a synthetic cache
    written when asked for), each checked against the model ``mcfg`` and the data options."""
    c = cfg.data

    def write_synthetic():
        if c.synthetic_samples and not os.path.isfile(os.path.join(c.cache_dir, "index.json")):
            log(f"writing a synthetic cache of {c.synthetic_samples} samples to {c.cache_dir}")
            family.write_synthetic_cache(c.cache_dir, c.synthetic_samples, mcfg, c.synthetic_latent_sizes,
                                         seed=cfg.train.seed, flipped=c.flip)

    agreed(world, write_synthetic)
    built = agreed(world, lambda: prepare_datasets(cfg, family.name, dtype, log, progress))
    entries = built or c.datasets or [{"cache_dir": c.cache_dir, "repeats": 1, "loss_weight": 1.0, "is_reg": False}]
    caches, datasets = [], []
    want = family.cache_dims(mcfg)
    for e in entries:
        cache = LatentCache(e["cache_dir"])
        _check_cache(cfg, e["cache_dir"], cache, want)
        weight = e["loss_weight"] * (c.prior_loss_weight if e["is_reg"] else 1.0)
        caches.append((cache, e["repeats"], weight))
        datasets.append((e["cache_dir"], e["repeats"], len(cache.split("train")), e["is_reg"]))
    if len(caches) == 1 and caches[0][1:] == (1, 1.0):  # one cache as it is (an image folder may repeat)
        cache = caches[0][0]
    else:
        try:
            cache = CacheSet(caches)
        except CacheError as err:
            raise ConfigError(f"data.datasets: {err}") from None
    if not cache.split("train"):
        raise ConfigError(f"the cache at {cache.path} has no training samples")
    return Data(cache, datasets, any(w != 1.0 for _, _, w in caches))


def _check_cache(cfg, folder, cache, want: dict) -> None:
    """The cache at ``folder`` has the fields the model needs (``want``) and what the data options read."""
    c = cfg.data
    bad = [f"{k} {getattr(cache, k)} (the model needs {v})" for k, v in want.items() if getattr(cache, k) != v]
    if bad:
        raise ConfigError(f"the cache at {folder} does not fit the model: " + ", ".join(bad))
    if c.flip and not cache.flipped:
        raise ConfigError(f"data.flip: the cache at {folder} holds no mirrored images' latents: "
                          "rebuild it with scripts/prepare_cache.py --flip, or set data.flip=false")
    if c.caption_variants and cache.caption_variants < 2:
        raise ConfigError(f"data.caption_variants: the cache at {folder} holds one caption per image: "
                          "rebuild it with scripts/prepare_cache.py --caption-variants K, or set "
                          "data.caption_variants=false")
    if c.caption_dropout and not cache.has_empty_prompt and not cfg.lora.text_encoder:
        raise ConfigError(f"data.caption_dropout: the cache at {folder} holds no embedding of the "
                          "empty caption (it was written before prepare_cache.py stored one): rebuild it, or "
                          "set data.caption_dropout=0")


def make_loader(cfg, cache, split, batch_size, shuffle, world) -> BucketBatchLoader:
    """The loader of ``split`` in global batches of ``world.size`` x ``batch_size``."""
    try:
        return BucketBatchLoader(cache, batch_size, split, shuffle=shuffle, seed=cfg.train.seed,
                                 drop_last=cfg.data.drop_last and split == "train", parts=world.size)
    except ValueError as e:
        option = "data.batch_size" if split == "train" else "output.val_batch_size"
        each = f" ({world.size} processes take {batch_size} each)" if world.size > 1 else ""
        raise ConfigError(f"{option}: {e}{each}; lower it (or set data.drop_last=false)") from None


def total_steps(cfg, loader) -> int:
    """``train.steps``, or the optimizer steps of ``train.epochs`` epochs of ``loader``."""
    return cfg.train.steps or cfg.train.epochs * math.ceil(len(loader) / cfg.train.grad_accum)


def check_trained(cfg, family, model, mcfg, world) -> None:
    """What ``train.mode`` trains selects something, and a full fine-tune's sharding fits the
    number of processes (``world``)."""
    t = cfg.train
    if t.mode == "lora":
        check_targets(cfg, family, model, mcfg)
        return
    names = [n for n, _ in model.named_parameters()] if model is not None else family.parameter_names(mcfg)
    if t.mode != "full" and not any(re.search(p, n) for p in t.mode for n in names):
        raise ConfigError(f"train.mode: {t.mode!r} matches none of the model's {len(names):,} parameter names "
                          f"(they look like {names[len(names) // 2]})")
    if t.shard == "parameters" and world.size == 1:
        raise ConfigError("train.shard: parameters frees each block's weights between uses so that every process "
                          "holds 1/N of them; one process has no others to hold the rest: use train.shard optimizer "
                          "(or none), or start N processes with torchrun")
    if t.shard == "none" and world.size > 1 and t.master_weights == "fp32" and t.precision != "fp32":
        raise ConfigError(f"train.shard: none with {world.size} processes would keep the whole fp32 master weights "
                          f"and optimizer state on each: set train.shard optimizer (the same step, each process "
                          f"keeping 1/{world.size} of them), or train.master_weights bf16_stochastic")


def check_targets(cfg, family, model, mcfg) -> None:
    """lora.targets must select at least one layer (checked on the module names, no weights)."""
    if model is not None:
        names = adaptable_layers(model)
        convs = [n for n in names if isinstance(model.get_submodule(n), Conv2d)]
    else:
        convs = family.layer_names(mcfg, "Conv2d")
        names = family.layer_names(mcfg, "Linear") + convs
    if not matching_layers(names, family.lora_targets(cfg.lora.targets)):
        example = next((n for n in names if n.endswith(("to_q", "qkv"))), names[0] if names else "none")
        raise ConfigError(f"lora.targets: {cfg.lora.targets!r} matches none of the model's "
                          f"{len(names):,} Linear and Conv2d layers (names look like {example})")
    conv = cfg.lora.conv_targets
    if conv is not None and not matching_layers(convs, conv):
        example = next((n for n in convs if n.endswith("conv1")), convs[0] if convs else "none")
        raise ConfigError(f"lora.conv_targets: {conv!r} matches none of the model's {len(convs):,} Conv2d "
                          f"layers (names look like {example})")


def plan_memory_budget(cfg, family, cache, mcfg, dtype, log):
    """``train.memory_budget_gb``: the weight dtype, checkpointed and streamed blocks that fit
    (``memory.plan_memory``) for the cache's largest bucket at ``data.batch_size``; logged. Also says
    when the allocator's expandable segments, which the estimate assumes, are off."""
    h, w = max(cache.buckets, key=lambda hw: hw[0] * hw[1])
    try:
        plan = plan_memory(int(cfg.train.memory_budget_gb * 2**30), profile=family.activation_profile,
                           config=mcfg, dtype=dtype, tokens=cfg.data.batch_size * family.tokens((h, w), cache.text_len),
                           targets=family.lora_targets(cfg.lora.targets), rank=cfg.lora.rank,
                           weight_dtype=cfg.model.weight_dtype, allow_fp8=not cfg.lora.dora,
                           fp8_skip=family.full_precision_layers)
    except TypeError as e:  # a model the planner does not know
        raise ConfigError(f"train.memory_budget_gb: {e}") from None
    log(plan.summary())
    if not runtime.use_expandable_segments() and not runtime.is_interpreter():
        log("train.memory_budget_gb: PYTORCH_CUDA_ALLOC_CONF turns the allocator's expandable segments off; "
            "the budget's estimate assumes them")
    return plan


def memory_settings(cfg, plan) -> tuple:
    """(weight dtype, checkpointed blocks: None all, N, 0 none; whether blocks stream) as the
    memory ``plan`` chose them, or (no plan) as the config sets them."""
    if plan is not None:
        return plan.weight_dtype, plan.checkpoint_blocks, plan.offload_blocks > 0
    return (cfg.model.weight_dtype, cfg.train.checkpoint_blocks if cfg.train.gradient_checkpointing else 0,
            cfg.train.offload == "blocks")


def use_w8a8(cfg, model, log):
    """``model.fp8_gemm: w8a8``: the forward products over the model's fp8 weights round their input
    to e4m3 (``nn.use_w8a8_``), said in the log with what this GPU makes of it."""
    if cfg.model.fp8_gemm != "w8a8":
        return
    count = use_w8a8_(model)
    fast = matmul_hopper.available() and matmul_hopper.ROUTE
    log(f"model.fp8_gemm: w8a8: the inputs of {count} fp8 Linear weights rounded to e4m3 per token in the "
        "forward, " + ("products on the fp8 tensor cores" if fast else
                       "emulated on this device (no fp8 tensor-core kernel here: slower than weight-only fp8)"))


def plan_offload(cfg, memory, planner):
    """``train.offload: blocks``: ``planner(count=..., budget_bytes=...)`` (``plan_offload`` of a
    model or of its config) for the blocks the memory plan ``memory``, else ``offload_blocks`` or
    ``offload_budget_gb``, ask for (all by default); None without offload. A plan that cannot be made is
    a ConfigError."""
    t = cfg.train
    if memory is not None:
        if not memory.offload_blocks:
            return None
        count, budget = memory.offload_blocks, None
    elif t.offload == "none":
        return None
    else:
        budget = None if t.offload_budget_gb is None else int(t.offload_budget_gb * 2**30)
        count = (t.offload_blocks or "all") if budget is None else None
    try:
        return planner(count=count, budget_bytes=budget)
    except ValueError as e:
        raise ConfigError(f"train.offload: {e}") from None


def compile_ahead(setting, family, mcfg, world, log):
    """Start compiling the kernels ``train.compile_ahead`` (``setting``) lists (kernels/precompile.py),
    one process per host; with ``auto`` the kernels this run compiles are recorded for the next.
    ``auto`` compiles a shipped list (a full SDXL or Flux.1 run's kernels) only for the architecture
    it was recorded on: a smaller model (the tiny configs, tests) would compile hundreds of
    variants it never runs. Returns the ``precompile.Background`` or None."""
    if setting == "off" or runtime.is_interpreter() or world.local_rank != 0:
        return None
    if setting == "auto":
        shipped = family.kernel_list(mcfg)
        paths = precompile.auto_paths(shipped=shipped is not None, model=shipped or "")
        _record_new_kernels(paths, log)
    else:
        paths = [setting]
    return precompile.Background(paths) if paths else None


def _record_new_kernels(paths, log):
    """Record the kernel variants this run compiles that ``paths`` do not list into this machine's list
    (``precompile.recorded_path``), for its next runs; unless FLAME_RECORD_KERNELS names another file:
    that one gets every variant the run launches (a list to ship, or to compile ahead elsewhere)."""
    record = str(precompile.recorded_path())
    if os.environ.get(launch.RECORD_ENV, record) != record:
        return
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
    except OSError as e:  # an unwritable cache folder: nothing recorded, nothing else changes
        log(f"train.compile_ahead: not recording this run's kernels ({e})")
        return
    os.environ[launch.RECORD_ENV] = record
    launch.note_known(line for p in paths for line in precompile.read_lines(p))  # only new ones
