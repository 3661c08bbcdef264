#!/usr/bin/env python3
"""The SDXL trainer's step on several GPUs: flame's data-parallel LoRA trainer against diffusers + peft
under torch's DistributedDataParallel, or (``--mode full``) flame's sharded full fine-tune against
diffusers under PyTorch's FSDP2, both started by torchrun, on the same machine in the same run; with
the trainer's data, EMA and optimizer features on against the plain step; loading.

    python3 scripts/bench_train.py                   # N = 1, 2, 4 (up to the GPUs there), checkpointing off and on
    python3 scripts/bench_train.py --nproc 1 --nproc 2 --checkpointing off --out out/ddp.json
    python3 scripts/bench_train.py --mode full --shard gradients,parameters --nproc 1 --nproc 2 --checkpointing off \
        --steps 5 --blocks 3 --out out/full.json     # every weight trains: flame sharded, diffusers under FSDP2
    python3 scripts/bench_train.py --mode full --shard gradients --nproc 1 --nproc 2 --checkpointing off \
        --overlap both --framework flame --out out/overlap.json   # reduce-scatters from the backward or after it
    python3 scripts/bench_train.py --mode full --shard gradients,parameters --nproc 2 --checkpointing off \
        --cuda-graph both --framework flame --out out/zero3.json  # ZeRO-2 and ZeRO-3, in a CUDA graph and eagerly
    python3 scripts/bench_train.py --features --steps 10 --blocks 5 --out out/features.json
    python3 scripts/bench_train.py --load --nproc 1 --nproc 2
    python scripts/bench_train.py --config tiny --resolution 64 --nproc 1 --nproc 2 --steps 2 --warmup 1 --blocks 1
                                                          # CPU smoke test (gloo, the interpreter)
    python scripts/bench_train.py --config tiny --resolution 64 --nproc 1 --nproc 2 --steps 2 --warmup 1 --blocks 1 \
        --mode full --shard gradients --framework flame   # the same, full fine-tuning

LoRA (``--mode lora``, the default). flame: the trainer itself (``flame.train.Trainer``) on a synthetic
latent cache; each process trains batch 1 of every global batch from a CUDA graph, and one all-reduce
per step sums the gradients. diffusers + peft: the UNet under DDP (bucketed all-reduces overlapped with
the backward), ``torch.autocast(bf16)``, AdamW, as ``scripts/bench_sdxl.py`` builds it. Both: the SDXL
base UNet with random weights, LoRA rank 16 on the attention projections, 1024x1024 (128x128 latents),
batch 1 per GPU, bf16.

Full fine-tuning (``--mode full``): every weight of the UNet trains, AdamW (lr 1e-5). flame: the
trainer with ``train.mode: full``, bf16 weights, ``train.shard`` each of ``--shard`` (ZeRO-1/2/3,
``flame.sharding``; ``parameters`` needs 2 or more processes, so its N = 1 is skipped and its
scaling taken against ``gradients`` at N = 1, the same one-process step) and
``train.master_weights`` ``--master`` (``bf16_stochastic``: ``--shard none``, whose N > 1
all-reduces the gradients as for LoRA) and ``--overlap``: the ``gradients`` and ``parameters``
stages on 2+ processes reduce-scatter each unit's gradients from the backward as they are complete
(``on``, the library's default), in ``pack`` after it (``off``, ``ShardedOptimizer.overlap`` set
False), or ``both`` (a row each, one N = 1 row). ``--cuda-graph``: flame's step replayed from a CUDA
graph (``on``, ``train.cuda_graph``'s default; ``parameters`` too, its blocks' gathers into the ring
of slots captured with the step), run eagerly (``off``), or ``both`` (a row each). diffusers: the
UNet built as ``bench_sdxl.py --mode full`` builds it (fp32 weights, all trained), under FSDP2 as
accelerate's FSDP plugin runs it: ``fully_shard`` on every down, mid and up block and on the root
(parameters, gradients and optimizer state sharded, each block gathered for its forward and again
for its backward), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
``torch.autocast(bf16)`` around the forward, ``torch.optim.AdamW(fused=True)`` on the fp32 shards;
one process is a one-rank FSDP2. Gradient checkpointing per ``--checkpointing`` on both sides.

Reported per (checkpointing, framework, shard, N): the step time (median over ``--blocks`` blocks of
``--steps`` steps, each timed from a barrier to the end of the slowest rank), images/s, the scaling
efficiency (images/s with N processes over N times images/s with 1, of the same setting), rank 0's
peak memory, and for flame with N > 1 the time of the step's collectives and their share of the step:
where one bucket all-reduces the gradients (LoRA; full with ``--shard none``), that all-reduce alone
(CUDA events around it, 20 times, on a GPU); sharded, every collective of ``--steps`` more steps timed
where it runs (CUDA events around each call through ``flame.distributed``; the clock on the
interpreter), the median step's sum and its calls and time by kind (reduce-scatter, all-gather,
all-reduce), rank 0's view, waits for the other ranks included; with each rank's shard memory
(``ShardedOptimizer.memory()``; printed: rank 0's parameters and total) in the JSON. In a CUDA graph
the backward's reduce-scatters (overlap) and the ``parameters`` stage's gathers of the blocks are
replayed with the step, where no Python runs: the collectives counted are then those outside it (the
step's all-reduces, and the all-gathers of the weights kept whole). Needs diffusers (and peft for
LoRA) for the second framework.

``--features``: flame alone, one process, LoRA, the plain step (one cache, AdamW) against the step
with two datasets (the second repeated twice at half the loss weight), flip augmentation, caption
dropout 0.1, an EMA of the LoRA weights (decay 0.999) and each ``--optimizer`` (default AdamW8bit),
each in fresh processes; reported: step time, its ratio to the plain step, peak memory, CUDA graphs
captured.

``--load``: instead of steps, the time for N processes to hold the frozen UNet (bf16, from a random
fp16 SDXL file written to ``--weights``' folder first, diffusers names): every rank reading the file
(``every``) against rank 0 reading it and broadcasting each parameter (``broadcast``), each timed from
a barrier to the slowest rank's end, with the OS page cache dropped first where the system allows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _blocks(step, args, sync, slowest):
    """Warm-up steps, then the per-step seconds of each timed block (the slowest rank's)."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.blocks):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        times.append(slowest(time.perf_counter() - t0) / args.steps)
    return times


def _feature_settings(args, latent):
    """The data/EMA/optimizer settings of ``--features`` (two flipped synthetic caches written first)."""
    from flame.data import write_synthetic_cache_for
    from flame.models import SDXLUNetConfig
    mcfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    dirs = [os.path.join(args.cache, name) for name in ("set-a", "set-b")]
    for i, d in enumerate(dirs):
        if not os.path.isfile(os.path.join(d, "index.json")):
            write_synthetic_cache_for(d, 32, mcfg, [(latent, latent)], flipped=True, seed=i)
    return {"data": {"cache_dir": None, "datasets": [{"cache_dir": dirs[0]},
                                                     {"cache_dir": dirs[1], "repeats": 2, "loss_weight": 0.5}],
                     "flip": True, "caption_dropout": 0.1},
            "ema": {"decay": 0.999}, "train": {"optimizer": args.optimizer[-1]}}


def run_flame(args):
    import flame
    from flame import distributed
    from flame.train import Trainer, build_config

    latent = args.resolution // 8
    settings = {
        "model": {"config": args.config},
        "data": {"cache_dir": os.path.join(args.cache, "plain"), "batch_size": 1, "synthetic_samples": 64,
                 "synthetic_latent_sizes": [[latent, latent]]},
        "train": {"steps": 10 ** 6, "lr": 1e-4, "precision": "fp32" if flame.is_interpreter() else "bf16",
                  "gradient_checkpointing": args.checkpointing == "on", "cuda_graph": args.cuda_graph == "on"},
        "output": {"dir": tempfile.mkdtemp(prefix="flame-train-"), "save_every": 0, "log_every": 10 ** 6}}
    if args.mode == "full":  # a full run has no lora section
        settings["train"].update(mode="full", shard=args.shards[0], master_weights=args.master, lr=1e-5,
                                 optimizer="adamw", shard_reduce_dtype=_reduce_dtype(args, args.shards[0]))
    else:
        settings["lora"] = {"rank": args.rank, "alpha": args.rank, "targets": "attn"}
    if args.with_features:
        for section, values in _feature_settings(args, latent).items():
            settings.setdefault(section, {}).update(values)
        for key in ("synthetic_samples", "synthetic_latent_sizes"):
            settings["data"].pop(key)
    cfg = build_config(settings)
    trainer = Trainer(cfg, progress=False, log=lambda *a: None)
    world = trainer.world
    if trainer.trained.shards is not None:  # before the first step (off where there is nothing to overlap)
        trainer.trained.shards.overlap = args.overlap == "on"

    def sync():
        flame.synchronize()
        distributed.barrier()

    def slowest(seconds):
        t = flame.tensor([seconds])
        distributed.all_reduce_(t, "max")
        return t.item()

    flame.reset_peak_memory_stats()
    times = _blocks(trainer.train_step, args, sync, slowest)
    allreduce_ms = None
    sharded = trainer.trained.shards
    if trainer.bucket is not None and sharded is None and not flame.is_interpreter():
        import torch
        samples = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            trainer.bucket.all_reduce()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        allreduce_ms = statistics.median(samples)
    collectives = _timed_collectives(trainer, args.steps) if sharded is not None and world.size > 1 else None
    return {"framework": "flame", "world": world.size, "times_s": times, "peak_bytes": flame.max_memory_allocated(),
            "overlap": sharded.overlap if sharded is not None else None,
            "cuda_graph": args.cuda_graph, "graphs": trainer.step_fn.num_graphs,
            "allreduce_ms": allreduce_ms, "allreduce_mb": trainer.bucket.nbytes / 2 ** 20 if trainer.bucket else 0,
            "collectives_ms": collectives and collectives.pop("ms"), "collectives": collectives,
            "shard_bytes": sharded.memory() if sharded is not None else None, "device": flame.device_name()}


def _timed_collectives(trainer, steps):
    """The collectives of ``steps`` more sharded steps, each timed where it runs: every collective of
    flame goes through ``flame.distributed._collective``, wrapped here for these steps, with CUDA events
    on the stream around each call (the clock on the interpreter, where gloo's run synchronously).
    Returns the median step's ``ms`` (their sum), and its ``calls`` and ``ms_by_kind`` (all-gather,
    reduce-scatter, all-reduce)."""
    import torch

    import flame
    from flame import distributed
    cuda = not flame.is_interpreter()

    def clock():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(start, end):
        return start.elapsed_time(end) if cuda else (end - start) * 1e3

    calls, plain = [], distributed._collective

    def timed(what, fn):
        start = clock()
        out = plain(what, fn)
        calls.append((what, start, clock()))
        return out

    per_step = []
    distributed._collective = timed
    try:
        for _ in range(steps):
            calls.clear()
            trainer.train_step()
            flame.synchronize()
            kinds = {}
            for what, start, end in calls:
                count, ms = kinds.get(what, (0, 0.0))
                kinds[what] = (count + 1, ms + elapsed_ms(start, end))
            per_step.append(kinds)
    finally:
        distributed._collective = plain
    totals = [sum(ms for _, ms in kinds.values()) for kinds in per_step]
    middle = statistics.median_low(totals)
    kinds = per_step[totals.index(middle)]
    return {"ms": middle, "calls": {what: count for what, (count, _) in kinds.items()},
            "ms_by_kind": {what: ms for what, (_, ms) in kinds.items()}}


def write_weights(args):
    """A random SDXL UNet in fp16 under diffusers' names, as a single-file checkpoint."""
    import flame
    from flame import io
    from flame.models import SDXLUNet, SDXLUNetConfig
    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    io.save_safetensors(SDXLUNet(cfg, dtype=flame.float16).state_dict(), args.weights)
    return {"bytes": os.path.getsize(args.weights)}


def run_load(args):
    import flame
    from flame import distributed
    from flame.models import SDXLUNet, SDXLUNetConfig
    from flame.nn.init import skip_init

    world = distributed.init()
    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    dtype = flame.float32 if flame.is_interpreter() else flame.bfloat16
    flame.synchronize()
    distributed.barrier()
    t0 = time.perf_counter()
    if args.worker == "load-every" or world.is_main:
        unet = SDXLUNet.from_pretrained(args.weights, dtype=dtype, config=cfg)
    else:
        with skip_init():
            unet = SDXLUNet(cfg, dtype=dtype)
    if args.worker == "load-broadcast":
        distributed.broadcast_(unet.parameters())
    flame.synchronize()
    seconds = flame.tensor([time.perf_counter() - t0])
    distributed.all_reduce_(seconds, "max")
    return {"framework": args.worker, "world": world.size, "times_s": [seconds.item()], "peak_bytes": 0,
            "device": flame.device_name()}


def _drop_page_cache() -> bool:
    """Empty the OS page cache (root on Linux), so the next read comes from the disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_diffusers(args):
    # isort: off
    from flame.models import SDXLUNetConfig  # flame first: it picks the backend (and this rank's GPU)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from bench_sdxl import diffusers_lora_unet, diffusers_train_step
    # isort: on

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    full = args.mode == "full"
    if cuda:
        torch.cuda.set_device(dev)
    if world > 1 or full:  # FSDP2 shards over a process group, of one process too
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    unet, params = diffusers_lora_unet(cfg, args.rank, args.checkpointing == "on", dev, full=full)
    model = unet
    if full:
        model = _fully_sharded(unet)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # the fp32 shards (DTensors)
    else:
        if world > 1:  # static_graph: the same parameters take part in every step (and checkpointing works)
            model = DistributedDataParallel(unet, device_ids=[local] if cuda else None, static_graph=True)
        opt = torch.optim.AdamW(params, lr=1e-4)
    latent = args.resolution // 8
    gen = torch.Generator(dev).manual_seed(int(os.environ.get("RANK", "0")))
    sample = torch.randn(1, cfg.in_channels, latent, latent, device=dev, generator=gen)
    context = torch.randn(1, 77, cfg.cross_attention_dim, device=dev, generator=gen)
    pooled = torch.randn(1, cfg.pooled_dim, device=dev, generator=gen)
    time_ids = torch.randn(1, 6, device=dev, generator=gen).abs() * 1024.0

    def step():
        noise = torch.randn(sample.shape, device=dev, generator=gen)
        timesteps = torch.randint(0, 1000, (1,), device=dev, generator=gen)
        diffusers_train_step(model, opt, (sample, context, pooled, time_ids), noise, timesteps)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    def slowest(seconds):
        if world == 1:
            return seconds
        t = torch.tensor([seconds], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = _blocks(step, args, sync, slowest)
    result = {"framework": FSDP_SETTING if full else "diffusers+peft DDP", "world": world, "times_s": times,
              "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


FSDP_SETTING = "diffusers FSDP2 full-shard, fp32 params, bf16 compute"


def _fully_sharded(unet):
    """diffusers' ``unet`` (fp32 weights) under FSDP2 as accelerate's FSDP plugin puts it: ``fully_shard``
    on every down, mid and up block and on the root, bf16 weights gathered for the forward and the
    backward, gradients reduce-scattered in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        fully_shard(block, mp_policy=policy)
    return fully_shard(unet, mp_policy=policy)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=["sdxl", "tiny"], default="sdxl", help="UNet config (default: SDXL base)")
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent = /8)")
    p.add_argument("--nproc", type=int, action="append", help="processes (GPUs; repeatable; default 1, 2, 4 up to "
                                                              "the GPUs there)")
    p.add_argument("--checkpointing", choices=["on", "off", "both"], default="both")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--mode", choices=["lora", "full"], default="lora",
                   help="lora: the LoRA trainer against diffusers + peft under DDP; full: every UNet weight "
                        "trains, flame's sharded trainer against diffusers under FSDP2 (full-shard, fp32 weights, "
                        "bf16 compute)")
    p.add_argument("--shard", action="append",
                   help="--mode full, flame: train.shard, each of none, optimizer, gradients, parameters "
                        "(repeatable or comma-separated; default gradients, or none with --master bf16_stochastic); "
                        "parameters needs 2+ processes (its N=1 is skipped), none 1 process (or bf16_stochastic)")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="--mode full, flame: train.shard_reduce_dtype (the gradients' reduce-scatter in fp32 or bf16) "
                        "for --shard gradients and parameters")
    p.add_argument("--overlap", choices=["on", "off", "both"], default="on",
                   help="--mode full, flame, --shard gradients or parameters on 2+ processes: reduce-scatter each "
                        "unit's gradients from the backward as they are complete (on), after it (off), or both (a row "
                        "each)")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], default="on",
                   help="flame: the step replayed from a CUDA graph (on: train.cuda_graph's default), run eagerly "
                        "(off), or both (a row each)")
    p.add_argument("--master", "--master-weights", choices=["fp32", "bf16_stochastic"], default="fp32", dest="master",
                   help="--mode full, flame: train.master_weights: fp32 master weights in the shards, or the bf16 "
                        "weights updated with stochastic rounding (--shard none only)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=3, help="timed blocks (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (flame captures on its 2nd)")
    p.add_argument("--framework", choices=["flame", "diffusers", "both"], default="both")
    p.add_argument("--cache", help="latent cache folder for flame (written on first use; default: a temp folder)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--features", action="store_true", help="flame's plain step against the step with datasets, "
                                                              "flip, caption dropout, EMA and --optimizer on")
    p.add_argument("--optimizer", action="append", help="the optimizer of --features (train.optimizer; "
                                                         "repeatable; default adamw8bit)")
    p.add_argument("--with-features", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load", action="store_true", help="measure loading the frozen UNet on every rank against "
                                                          "rank 0 + broadcast, instead of steps")
    p.add_argument("--weights", help="the single-file UNet --load reads (written first; default: a temp folder)")
    p.add_argument("--worker", choices=["flame", "diffusers", "load-every", "load-broadcast", "write-weights"],
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shards = [s for given in args.shard or [] for s in given.split(",") if s]
    unknown = [s for s in args.shards if s not in SHARDS]
    if unknown:
        p.error(f"--shard: unknown {', '.join(unknown)}; each of {', '.join(SHARDS)}")
    if args.mode == "lora" and (args.shards or args.master != "fp32"):
        p.error("--shard and --master apply to --mode full (LoRA adapters are not sharded)")
    if args.mode == "full" and args.features:
        p.error("--features measures the LoRA trainer: no --mode full")
    args.shards = args.shards or ["none" if args.master == "bf16_stochastic" else "gradients"]
    if args.master == "bf16_stochastic" and args.shards != ["none"]:
        p.error("--master bf16_stochastic updates every process's whole bf16 weights: --shard none only")
    return args


SHARDS = ("none", "optimizer", "gradients", "parameters")


def _skipped(args, fw, shard, n):
    """Why the trainer refuses a setting of flame's full fine-tune, or None."""
    if fw != "flame" or args.mode != "full":
        return None
    if shard == "parameters" and n == 1:
        return "train.shard parameters needs 2 or more processes"
    if shard == "none" and n > 1 and args.master == "fp32":
        return "train.shard none would keep the whole fp32 master weights on every process; optimizer is that step"
    return None


def _nprocs(args):
    if args.nproc:
        return args.nproc
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def _frameworks(args):
    import importlib.util
    frameworks = ["flame", "diffusers"] if args.framework == "both" else [args.framework]
    needs = ["diffusers"] + (["peft"] if args.mode == "lora" else [])
    if "diffusers" in frameworks and not all(importlib.util.find_spec(name) for name in needs):
        print(f"{'/'.join(needs)} not importable: measuring flame only", file=sys.stderr)
        frameworks.remove("diffusers")
    return frameworks


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        res = {"flame": run_flame, "diffusers": run_diffusers, "write-weights": write_weights}.get(
            args.worker, run_load)(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.load:
        return _measure_loading(args)
    args.cache = args.cache or tempfile.mkdtemp(prefix="flame-train-cache-")
    if args.features:
        return _measure_features(args)
    rows = []
    for ckpt in (["off", "on"] if args.checkpointing == "both" else [args.checkpointing]):
        for fw in _frameworks(args):
            for shard in (args.shards if fw == "flame" and args.mode == "full" else [None]):
                for n in _nprocs(args):
                    for overlap in _overlaps(args, fw, shard, n):
                        for graph in (([args.cuda_graph] if args.cuda_graph != "both" else ["on", "off"])
                                      if fw == "flame" else [None]):
                            rows += _measure_step(args, fw, shard, ckpt, n, overlap, graph)
            _save(args, rows)
    _report(rows)
    return 1 if any("error" in r for r in rows) else 0


def _reduce_dtype(args, shard):
    """train.shard_reduce_dtype of a flame full run: --reduce-dtype where the shard reduce-scatters."""
    return args.reduce_dtype if shard in ("gradients", "parameters") else "fp32"


def _overlaps(args, fw, shard, n):
    """The --overlap settings of a flame full run (None where nothing is reduce-scattered)."""
    if fw != "flame" or args.mode != "full" or shard not in ("gradients", "parameters") or n == 1:
        return [None]
    return ["on", "off"] if args.overlap == "both" else [args.overlap]


def _measure_step(args, fw, shard, ckpt, n, overlap=None, graph=None):
    """One (framework, shard, checkpointing, N, overlap, CUDA graph) setting under torchrun: [its row], or []
    when skipped."""
    what = fw
    if args.mode == "full":
        reduce = " bf16-reduce" if _reduce_dtype(args, shard) == "bf16" else ""
        what = f"flame full shard {shard}{' bf16-SR' if args.master == 'bf16_stochastic' else ''}{reduce}" \
            f"{'' if overlap is None else ' overlap ' + overlap}" if fw == "flame" else "diffusers FSDP2 full"
    label = f"{what}{' eager' if graph == 'off' else ''} ckpt {ckpt} N={n}"
    why = _skipped(args, fw, shard, n)
    if why:
        print(f"== {label}: skipped ({why})", flush=True)
        return []
    extra = ["--checkpointing", ckpt, "--cache", args.cache, "--mode", args.mode, "--cuda-graph", graph or "on"]
    if args.mode == "full":
        # --master-weights: torchrun would take --master for an abbreviation of its --master-addr / --master-port
        extra += ["--master-weights", args.master, "--reduce-dtype", args.reduce_dtype,
                  "--overlap", overlap or "on", *(["--shard", shard] if shard else [])]
    result = _launch(args, fw, n, label, extra)
    if "error" in result:
        return [result]
    result.update(checkpointing=ckpt, mode=args.mode, shard=shard, images_s=n / result["median_s"])
    comm = f", all-reduce {result['allreduce_ms']:.2f} ms" if result.get("allreduce_ms") else ""
    if result.get("collectives"):
        kinds = result["collectives"]
        comm = f", collectives {result['collectives_ms']:.2f} ms (" + ", ".join(
            f"{kind} {count}x {kinds['ms_by_kind'][kind]:.2f} ms" for kind, count in kinds["calls"].items()) + ")"
    held = result.get("shard_bytes")
    if held:
        comm += f", shard {sum(held.values()) / 2 ** 30:.2f} GiB (parameters {held['parameters'] / 2 ** 30:.2f})"
    if "graphs" in result:
        comm += f", {result['graphs']} CUDA graph{'s' if result['graphs'] != 1 else ''}"
    print(f"   {result['median_s'] * 1e3:.1f} ms/step, {result['images_s']:.2f} images/s, peak "
          f"{result['peak_bytes'] / 2 ** 30:.2f} GiB{comm} ({result['wall_s']:.0f} s)", flush=True)
    return [result]


def _launch(args, worker, n, label, extra=(), torchrun=True):
    """One setting in fresh processes (``n`` under torchrun); rank 0's result, or the error."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)] if torchrun else []
    cmd = [sys.executable, *launcher, __file__, "--worker", worker, "--config", args.config,
           "--resolution", str(args.resolution), "--rank", str(args.rank), "--steps", str(args.steps),
           "--blocks", str(args.blocks), "--warmup", str(args.warmup), *extra]
    print(f"== {label}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode or result is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return {"setting": label, "nproc": n, "error": proc.stderr[-2000:]}
    if "times_s" in result:
        result.update(median_s=statistics.median(result["times_s"]))
    return {**result, "setting": label, "nproc": n, "wall_s": time.perf_counter() - started}


def _save(args, rows):
    if args.out:  # after every setting: a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


def _measure_features(args):
    rows = []
    ckpt = "off" if args.checkpointing == "both" else args.checkpointing
    settings = [("plain", "adamw", [])] + [(f"features ({name})", name, ["--with-features"])
                                           for name in args.optimizer or ["adamw8bit"]]
    for label, name, extra in settings:
        result = _launch(args, "flame", 1, label, ["--checkpointing", ckpt, "--cache", args.cache,
                                                   "--optimizer", name, *extra])
        rows.append(result)
        _save(args, rows)
    if any("error" in r for r in rows):
        return 1
    plain = rows[0]["median_s"]
    print(f"\n{'setting':<28} {'step ms':>8} {'vs plain':>9} {'peak GiB':>9} {'graphs':>7}")
    for r in rows:
        print(f"{r['setting']:<28} {r['median_s'] * 1e3:8.1f} {r['median_s'] / plain:8.3f}x "
              f"{r['peak_bytes'] / 2 ** 30:9.2f} {r['graphs']:7d}")
    return 0


def _measure_loading(args):
    args.weights = args.weights or os.path.join(tempfile.mkdtemp(prefix="flame-ddp-weights-"), "unet.safetensors")
    written = _launch(args, "write-weights", 1, f"write {args.weights}", ["--weights", args.weights], torchrun=False)
    if "error" in written:
        return 1
    print(f"   {written['bytes'] / 2 ** 30:.2f} GiB", flush=True)
    rows = []
    for n in _nprocs(args):
        for how in ("every", "broadcast"):
            cold = _drop_page_cache()
            result = _launch(args, f"load-{how}", n, f"load {how} N={n}", ["--weights", args.weights])
            result["page_cache"] = "dropped" if cold else "warm"
            rows.append(result)
            if "error" not in result:
                print(f"   {result['median_s']:.2f} s (page cache {result['page_cache']}; "
                      f"{result['wall_s']:.0f} s with the start)", flush=True)
        _save(args, rows)
    return 1 if any("error" in r for r in rows) else 0


def _report(rows):
    """The table: per setting its step, images/s, scaling against N = 1 of the same framework and shard
    (flame's shard parameters, which has no N = 1: against shard gradients', marked *), the collectives,
    rank 0's peak memory and flame's images/s over diffusers' at the same checkpointing and N."""
    ok = [r for r in rows if "error" not in r]
    one = {(r["framework"], r.get("shard"), r["checkpointing"], r.get("cuda_graph")): r for r in ok if r["nproc"] == 1}
    base = {(r["checkpointing"], r["nproc"]): r for r in ok if r["framework"] != "flame"}
    comm = "collectives" if any(r.get("mode") == "full" for r in ok) else "all-reduce"
    notes = [f"diffusers full: {FSDP_SETTING}"] if any(r["framework"] == FSDP_SETTING for r in ok) else []
    print(f"\n{'setting':<54} {'step ms':>8} {'images/s':>9} {'scaling':>8} {comm:>16} {'peak GiB':>9} "
          f"{'vs diffusers':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['setting']:<54} failed")
            continue
        single = one.get((r["framework"], r.get("shard"), r["checkpointing"], r.get("cuda_graph")))
        mark = ""
        if single is None and r.get("shard") == "parameters":
            single, mark = one.get((r["framework"], "gradients", r["checkpointing"], r.get("cuda_graph"))), "*"
            note = "scaling*: shard parameters against shard gradients at N = 1, the same one-process step"
            notes += [note] if single and note not in notes else []
        scaling = f"{r['images_s'] / (r['nproc'] * single['images_s']):.3f}{mark}" if single else ""
        ms = r.get("allreduce_ms") or r.get("collectives_ms")
        ar = f"{ms:.2f} ms {ms / (r['median_s'] * 1e3):.1%}" if ms else ""
        ref = base.get((r["checkpointing"], r["nproc"]))
        vs = f"{r['images_s'] / ref['images_s']:.2f}x" if ref and r["framework"] == "flame" else ""
        print(f"{r['setting']:<54} {r['median_s'] * 1e3:8.1f} {r['images_s']:9.2f} {scaling:>8} {ar:>16} "
              f"{r['peak_bytes'] / 2 ** 30:9.2f} {vs:>13}")
    if notes:
        print(f"({'; '.join(notes)})")


if __name__ == "__main__":
    sys.exit(main())
