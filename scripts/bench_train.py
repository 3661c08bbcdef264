#!/usr/bin/env python3
"""The SDXL LoRA trainer's step: on several GPUs, flame's data-parallel trainer against diffusers +
peft under torch's DistributedDataParallel, both started by torchrun, on the same machine in the
same run; with the trainer's data, EMA and optimizer features on against the plain step; loading.

    python3 scripts/bench_train.py                   # N = 1, 2, 4 (up to the GPUs there), checkpointing off and on
    python3 scripts/bench_train.py --nproc 1 --nproc 2 --checkpointing off --out out/ddp.json
    python3 scripts/bench_train.py --features --steps 10 --blocks 5 --out out/features.json
    python3 scripts/bench_train.py --load --nproc 1 --nproc 2
    python scripts/bench_train.py --config tiny --resolution 64 --nproc 1 --nproc 2 --steps 2 --warmup 1 --blocks 1
                                                          # CPU smoke test (gloo, the interpreter)

flame: the trainer itself (``flame.train.Trainer``) on a synthetic latent cache; each process trains
batch 1 of every global batch from a CUDA graph, and one all-reduce per step sums the gradients.
diffusers + peft: the UNet under DDP (bucketed all-reduces overlapped with the backward),
``torch.autocast(bf16)``, AdamW, as ``scripts/bench_sdxl.py`` builds it. Both: the SDXL base UNet with
random weights, LoRA rank 16 on the attention projections, 1024x1024 (128x128 latents), batch 1
per GPU, bf16.

Reported per (checkpointing, framework, N): the step time (median over ``--blocks`` blocks of
``--steps`` steps, each timed from a barrier to the end of the slowest rank), images/s, the scaling
efficiency (images/s with N processes over N times images/s with 1), rank 0's peak memory, and for
flame the time of the step's all-reduce alone (CUDA events around the bucket's collective) and its
share of the step. Needs diffusers and peft for the second framework (see ``bench_sdxl.py``).

``--features``: flame alone, one process, the plain step (one cache, AdamW) against the step with
two datasets (the second repeated twice at half the loss weight), flip augmentation, caption dropout
0.1, an EMA of the LoRA weights (decay 0.999) and each ``--optimizer`` (default AdamW8bit), each in fresh
processes; reported: step time, its ratio to the plain step, peak memory, CUDA graphs captured.

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
        "lora": {"rank": args.rank, "alpha": args.rank, "targets": "attn"},
        "train": {"steps": 10 ** 6, "lr": 1e-4, "precision": "fp32" if flame.is_interpreter() else "bf16",
                  "gradient_checkpointing": args.checkpointing == "on"},
        "output": {"dir": tempfile.mkdtemp(prefix="flame-train-"), "save_every": 0, "log_every": 10 ** 6}}
    if args.with_features:
        for section, values in _feature_settings(args, latent).items():
            settings.setdefault(section, {}).update(values)
        for key in ("synthetic_samples", "synthetic_latent_sizes"):
            settings["data"].pop(key)
    cfg = build_config(settings)
    trainer = Trainer(cfg, progress=False, log=lambda *a: None)
    world = trainer.world

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
    if trainer.bucket is not None and not flame.is_interpreter():
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
    return {"framework": "flame", "world": world.size, "times_s": times, "peak_bytes": flame.max_memory_allocated(),
            "graphs": trainer.step_fn.num_graphs,
            "allreduce_ms": allreduce_ms, "allreduce_mb": trainer.bucket.nbytes / 2 ** 20 if trainer.bucket else 0,
            "device": flame.device_name()}


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
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    unet, params = diffusers_lora_unet(cfg, args.rank, args.checkpointing == "on", dev)
    model = unet
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
    result = {"framework": "diffusers+peft DDP", "world": world, "times_s": times,
              "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if world > 1:
        dist.destroy_process_group()
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=["sdxl", "tiny"], default="sdxl", help="UNet config (default: SDXL base)")
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent = /8)")
    p.add_argument("--nproc", type=int, action="append", help="processes (GPUs; repeatable; default 1, 2, 4 up to "
                                                              "the GPUs there)")
    p.add_argument("--checkpointing", choices=["on", "off", "both"], default="both")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
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
    return p.parse_args(argv)


def _nprocs(args):
    if args.nproc:
        return args.nproc
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def _frameworks(args):
    import importlib.util
    frameworks = ["flame", "diffusers"] if args.framework == "both" else [args.framework]
    if "diffusers" in frameworks and not (importlib.util.find_spec("diffusers") and importlib.util.find_spec("peft")):
        print("diffusers/peft not importable: measuring flame only", file=sys.stderr)
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
            for n in _nprocs(args):
                result = _launch(args, fw, n, f"{fw} ckpt {ckpt} N={n}",
                                 ["--checkpointing", ckpt, "--cache", args.cache])
                rows.append(result)
                if "error" in result:
                    continue
                result.update(checkpointing=ckpt, images_s=n / result["median_s"])
                ar = f", all-reduce {result['allreduce_ms']:.2f} ms" if result.get("allreduce_ms") else ""
                print(f"   {result['median_s'] * 1e3:.1f} ms/step, {result['images_s']:.2f} images/s, peak "
                      f"{result['peak_bytes'] / 2 ** 30:.2f} GiB{ar} ({result['wall_s']:.0f} s)", flush=True)
            _save(args, rows)
    _report(rows)
    return 1 if any("error" in r for r in rows) else 0


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
    ok = [r for r in rows if "error" not in r]
    one = {(r["framework"], r["checkpointing"]): r for r in ok if r["nproc"] == 1}
    base = {(r["checkpointing"], r["nproc"]): r for r in ok if r["framework"] != "flame"}
    print(f"\n{'setting':<36} {'step ms':>8} {'images/s':>9} {'scaling':>8} {'all-reduce':>16} {'peak GiB':>9} "
          f"{'vs diffusers':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['setting']:<36} failed")
            continue
        single = one.get((r["framework"], r["checkpointing"]))
        scaling = f"{r['images_s'] / (r['nproc'] * single['images_s']):.3f}" if single else ""
        ar = (f"{r['allreduce_ms']:.2f} ms {r['allreduce_ms'] / (r['median_s'] * 1e3):.1%}"
              if r.get("allreduce_ms") else "")
        ref = base.get((r["checkpointing"], r["nproc"]))
        vs = f"{r['images_s'] / ref['images_s']:.2f}x" if ref and r["framework"] == "flame" else ""
        print(f"{r['setting']:<36} {r['median_s'] * 1e3:8.1f} {r['images_s']:9.2f} {scaling:>8} {ar:>16} "
              f"{r['peak_bytes'] / 2 ** 30:9.2f} {vs:>13}")


if __name__ == "__main__":
    sys.exit(main())
