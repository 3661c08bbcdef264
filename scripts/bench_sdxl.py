#!/usr/bin/env python3
"""SDXL LoRA training step: flame against diffusers + peft, same card, same run.

    PYTHONPATH=. python3 scripts/bench_sdxl.py                       # full SDXL, 1024x1024, batch 1 and 4
    PYTHONPATH=. python3 scripts/bench_sdxl.py --batch 1 --checkpointing off --out out/sdxl.json
    PYTHONPATH=. python3 scripts/bench_sdxl.py --paths both    # + flame as an Ampere/Ada card runs (no TMA, no table)
    PYTHONPATH=. python3 scripts/bench_sdxl.py --batch 1 --checkpointing off --dora both   # + DoRA on both sides
    PYTHONPATH=. python3 scripts/bench_sdxl.py --framework all --cold-cache   # + PyTorch graphed and compiled
    PYTHONPATH=. python3 scripts/bench_sdxl.py --batch 1 --checkpointing off --capture off --rounds 3  # eager
    PYTHONPATH=. python3 scripts/bench_sdxl.py --mode full --batch 1 --checkpointing off --framework all  # every weight
    python scripts/bench_sdxl.py --config tiny --resolution 64 --steps 2 --warmup 1   # CPU smoke test

Both sides build the SDXL base UNet with random weights (nothing can be downloaded here), frozen in
bf16, with LoRA rank 16 on the ``attn`` targets (560 Linear layers, 23.2M fp32 parameters), AdamW
on the LoRA parameters, an MSE loss against a noise target, 77x2048 context and pooled 1280 + 6
time ids. diffusers runs under ``torch.autocast(bf16)`` with peft's LoRA, as diffusers' training
scripts run it. flame runs its own step, eagerly and (with ``--capture``, the
default on a GPU) with the forward+backward replayed from a CUDA graph (``flame.graphs``).

``--mode full`` trains every UNet weight instead (no adapters): diffusers as its full fine-tuning
script runs it (fp32 weights under ``torch.autocast(bf16)``, AdamW over all of them); flame with bf16
weights and either fp32 master weights and AdamW state in a one-rank ``flame.sharding.ShardedOptimizer``
(``--master fp32``, the trainer's ``train.master_weights: fp32``) or AdamW updating the bf16 weights
with stochastic rounding (``--master bf16_stochastic``).

PyTorch comes in three settings (``--framework``): ``diffusers`` (eager), ``diffusers-graph`` (the
whole step -- forward, backward, AdamW with ``capturable=True`` -- captured once in a
``torch.cuda.CUDAGraph`` and replayed) and ``diffusers-compile`` (the same with ``torch.compile(unet)``,
inductor's default mode, inside the graph; its compile time is reported). Ratios are taken against
the fastest PyTorch setting in the run. MFU: the step's model FLOPs, counted by torch's FLOP counter
over one eager diffusers step (matrix products, convolutions, attention, forward and backward; no
recomputation), over the step time, as a fraction of the card's dense bf16 peak (989 TFLOP/s on the
H100 and H200 SXM). flame reports the time from its process start to the end of its first step
(``--cold-cache``: with an empty Triton cache, every kernel compiled).

Each (framework, batch, checkpointing) setting runs in its own process so that peak memory is the
setting's own. Reported: median step time over ``--steps`` timed steps after ``--warmup`` steps,
peak allocated memory, and flame/diffusers ratios. Host-bound (eager) steps drift between processes
on a busy machine: ``--rounds N`` runs every setting N times, alternating, and pools each one's
steps. diffusers and peft are optional: without them only flame is measured. On a GPU machine
without network access, bring them as wheels (Python 3.12):

    pip download -d wheels --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 --platform any diffusers==0.42.1 transformers huggingface_hub regex
    pip download -d wheels --no-deps peft==0.21.2 accelerate psutil     # their torch is already installed
    python3 -m pip install --no-index --find-links wheels diffusers==0.42.1 peft==0.21.2   # on the GPU machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # a worker's first-step time counts from here (the interpreter's own start is ~50 ms)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
FRAMEWORKS = ["flame", "diffusers", "diffusers-graph", "diffusers-compile"]


CHECKPOINT_SCOPES = {"on": "blocks", "ff": "feed_forward"}  # --checkpointing -> flame's checkpoint scope


def inputs_shape(args, cfg):
    """Shapes of a step's inputs: latents, text states (77 tokens), pooled text, time ids."""
    latent = args.resolution // 8
    return (args.batch, cfg.in_channels, latent, latent), (args.batch, 77, cfg.cross_attention_dim), \
        (args.batch, cfg.pooled_dim), (args.batch, 6)


def _time_steps(step, args, sync):
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def _profile(step, args):
    """GPU kernel time of one step by kernel name (top 30), when --profile is given on a GPU."""
    import torch
    if not args.profile or not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(-1)
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    return {"total_ms": sum(r[1] for r in rows), "kernels": sum(r[2] for r in rows),
            "top": [{"name": k[:120], "ms": round(ms, 3), "count": c} for k, ms, c in rows[:30]]}


def reserved_bytes() -> int:
    """The most memory PyTorch's caching allocator held since the last peak reset (what a card must
    have: the live tensors' peak, plus cached free blocks and the CUDA graphs' pools); 0 without a GPU."""
    import torch
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


def memory_settings(model, args, family, targets, tokens, scopes=None):
    """``--checkpointing``, ``--checkpoint-blocks``, ``--weight-dtype``, ``--fp8-gemm``, ``--offload`` and
    ``--memory-cap`` on flame's frozen, LoRA-injected ``model``, as the trainer applies
    ``train.gradient_checkpointing``, ``train.checkpoint_blocks``, ``model.weight_dtype``,
    ``model.fp8_gemm`` and ``train.offload`` (``family``: its
    full-precision layers; ``scopes``: ``--checkpointing``'s values to the model's scopes); or those
    the trainer's ``train.memory_budget_gb`` planner picks for ``--memory-budget`` (``targets``: the
    adapters' LoRA targets, ``tokens``: a batch's), which then is the memory cap too. Returns the
    planner's summary line, or None."""
    from flame import nn
    from flame.models.offload import offload_blocks
    summary = None
    if args.memory_budget is not None:
        from flame.train.memory import plan_memory
        plan = plan_memory(int(args.memory_budget * 2**30), profile=family.activation_profile, config=model.config,
                           dtype=model.dtype, tokens=tokens, targets=targets, rank=args.rank, weight_dtype=None,
                           allow_fp8=args.dora != "on", fp8_skip=family.full_precision_layers)
        summary = plan.summary()
        args.weight_dtype, args.memory_cap = plan.weight_dtype, args.memory_budget
        args.checkpointing = "on" if plan.checkpoint_blocks else "off"
        args.checkpoint_blocks, args.offload = plan.checkpoint_blocks, plan.offload_blocks or None
    if args.checkpointing != "off":
        blocks = None if args.checkpoint_blocks is None else int(args.checkpoint_blocks)
        model.enable_gradient_checkpointing(True, scope=(scopes or CHECKPOINT_SCOPES)[args.checkpointing],
                                            blocks=blocks)
    if args.weight_dtype:
        nn.quantize_linears_(model, args.weight_dtype, skip=family.full_precision_layers)
        if args.fp8_gemm == "w8a8":
            nn.use_w8a8_(model)
    if args.offload:
        streamer = offload_blocks(model, count=args.offload if args.offload == "all" else int(args.offload))
        print(streamer.plan.summary(), file=sys.stderr)
    import torch
    if args.memory_cap is not None and torch.cuda.is_available():  # from here: the trainer loads fp8 and streamed
        torch.cuda.empty_cache()  # blocks' weights as they are now, without the bf16 copies made here first
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap * 2**30 / total))
    return summary


def run_flame(args):
    import flame
    from flame import amp, nn
    from flame.graphs import CapturedStep
    from flame.kernels import precompile
    from flame.models import SDXLUNet, SDXLUNetConfig
    from flame.train.families.sdxl import SDXLFamily
    flame.testing.simulate_shared_memory_limit()  # the portable setting's smaller card
    ahead = precompile.compile_ahead(args.precompile, progress=False) if args.precompile else None

    if args.memory_budget is not None:  # as the trainer does for train.memory_budget_gb
        flame.runtime.use_expandable_segments()
    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    flame.manual_seed(0)
    model = SDXLUNet(cfg, dtype=flame.bfloat16 if not flame.is_interpreter() else flame.float32)
    model.requires_grad_(args.mode == "full")
    if args.mode == "lora":
        nn.inject_lora(model, "attn", rank=args.rank, alpha=args.rank, dora=args.dora == "on")
    latent = args.resolution // 8
    memory_plan = memory_settings(model, args, SDXLFamily(), "attn", args.batch * latent * latent)
    params, update = trained_parameters(model, args)
    shapes = inputs_shape(args, cfg)
    sample, context, pooled, time_ids = (flame.randn(*s) for s in shapes)
    time_ids = time_ids.abs() * 1024.0

    # as the trainer: one launch casts the fp32 adapters (full mode: the weights are the model's dtype)
    casts = amp.ParameterCasts(params, model.dtype) if args.mode == "lora" else contextlib.nullcontext()

    def fwd_bwd(noisy, target, timesteps, context, pooled, time_ids):
        with casts:
            pred = model(noisy, timesteps, context, pooled, time_ids)
            loss = flame.nn.functional.mse_loss(pred.to(flame.float32), target)
            return loss, loss.backward()

    step_fn = CapturedStep(fwd_bwd, enabled=args.capture == "on")

    def step(i):
        noise = flame.randn(*shapes[0])
        timesteps = (flame.rand(args.batch) * 999.0).to(flame.int64)
        loss, grads = step_fn(sample + noise * 0.5, noise, timesteps, context, pooled, time_ids)
        update(grads)
        return loss

    step(0)  # the first step: every kernel compiled (or read from Triton's cache)
    flame.synchronize()
    first_step_s = time.perf_counter() - STARTED
    flame.reset_peak_memory_stats()
    times = _time_steps(step, args, flame.synchronize)
    return {"framework": "flame", "capture": args.capture, "times_s": times, "profile": _profile(step, args),
            "first_step_s": first_step_s, "compiled_ahead": ahead,
            "peak_bytes": flame.max_memory_allocated(), "reserved_bytes": reserved_bytes(),
            "trained_params": sum(p.numel() for p in params),
            "device": flame.device_name(), "graphs": step_fn.num_graphs,
            "memory_plan": memory_plan}


def trained_parameters(model, args, lr=1e-5):
    """flame's trained parameters of ``model`` and the update that takes a step's gradients:
    the LoRA adapters with AdamW (``--mode lora``), or every weight (``--mode full``) with fp32
    master weights in a one-rank ShardedOptimizer or with AdamW's stochastic rounding (``--master``)."""
    from flame import nn, optim
    from flame.sharding import ShardedOptimizer
    if args.mode == "lora":
        params = nn.lora_parameters(model)
        opt = optim.AdamW(params, lr=lr)
        return params, opt.step
    params = [p for p in model.parameters() if p.requires_grad]
    if args.master == "bf16_stochastic":
        opt = optim.AdamW(params, lr=lr, stochastic_rounding=True)
        return params, opt.step
    shards = ShardedOptimizer(model.named_parameters(), "optimizer", lambda leaves: optim.AdamW(leaves, lr=lr))

    def update(grads):
        shards.pack(grads)
        shards.step()
    return params, update


def diffusers_lora_unet(cfg, rank, checkpointing, dev, dora=False, full=False):
    """diffusers' UNet of ``cfg`` (random weights, frozen in bf16) with peft's LoRA of ``rank`` on the
    attention projections in fp32 (``dora``: peft's DoRA), in training mode: ``(unet, LoRA parameters)``;
    ``full``: no adapters, every weight trained in fp32 (under autocast), as diffusers' full
    fine-tuning scripts: ``(unet, its parameters)``."""
    # isort: off
    import torch
    from diffusers import UNet2DConditionModel
    # isort: on
    torch.manual_seed(0)
    with torch.device(dev):
        unet = UNet2DConditionModel(**cfg.to_diffusers())
    if not full:
        return with_peft_lora(unet, rank, LORA_TARGETS, checkpointing, dora)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return unet, list(unet.parameters())


def with_peft_lora(model, rank, targets, checkpointing, dora=False):
    """``model`` (a diffusers model) frozen in bf16 with peft's LoRA of ``rank`` on ``targets`` in fp32
    (``dora``: peft's DoRA), gradient checkpointing on or off, in training mode: ``(model, LoRA
    parameters)``."""
    import torch
    from peft import LoraConfig
    model.to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets,
                                 use_dora=dora))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model, params


def diffusers_train_step(model, opt, inputs, noise, timesteps, zero_grad=True):
    """One LoRA training step of diffusers' UNet (``model``, plain or under DDP) under autocast(bf16):
    MSE against the noise, backward, the optimizer step. ``inputs``: (sample, context, pooled, time ids).
    ``zero_grad=False`` leaves the gradient buffers in place (a step captured in a CUDA graph)."""
    import torch
    sample, context, pooled, time_ids = inputs
    with torch.autocast(sample.device.type, dtype=torch.bfloat16):
        pred = model(sample + noise * 0.5, timesteps, context,
                     added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise)
    loss.backward()
    opt.step()
    if zero_grad:
        opt.zero_grad(set_to_none=True)
    return loss


DENSE_BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 tensor-core FLOP/s (SXM cards)


def _peak_flops(device_name):
    return next((v for k, v in DENSE_BF16_PEAK.items() if k in device_name), None)


def _count_flops(step):
    """Model FLOPs of one step (torch's FLOP counter over the matrix products, convolutions and
    attention of the forward and backward; a checkpointed forward's recomputation is not model work
    and is counted only if ``step`` does it)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step(-1)
    return counter.get_total_flops()


def run_diffusers(args):
    """diffusers + peft: eager (``diffusers``), the whole step (forward, backward, AdamW with
    ``capturable=True``) captured once in a ``torch.cuda.CUDAGraph`` and replayed
    (``diffusers-graph``), or the same with ``torch.compile(unet)`` (inductor, default mode) inside
    the graph (``diffusers-compile``; ``compile_s``: the first call, compilation included)."""
    # isort: off
    from flame.models import SDXLUNetConfig  # flame first: it picks the backend before triton is imported
    import torch
    # isort: on

    cfg = SDXLUNetConfig.tiny() if args.config == "tiny" else SDXLUNetConfig()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    graph = args.worker != "diffusers"
    if graph and dev != "cuda":
        raise SystemExit(f"{args.worker} needs a CUDA GPU")
    unet, params = diffusers_lora_unet(cfg, args.rank, args.checkpointing == "on", dev, dora=args.dora == "on",
                                       full=args.mode == "full")
    opt = torch.optim.AdamW(params, lr=1e-4 if args.mode == "lora" else 1e-5, capturable=graph)
    shapes = inputs_shape(args, cfg)
    sample, context, pooled, time_ids = (torch.randn(*s, device=dev) for s in shapes)
    time_ids = time_ids.abs() * 1024.0
    model = torch.compile(unet) if args.worker == "diffusers-compile" else unet

    def body(zero_grad=True):
        noise = torch.randn_like(sample)
        timesteps = torch.randint(0, 1000, (args.batch,), device=dev)
        return diffusers_train_step(model, opt, (sample, context, pooled, time_ids), noise, timesteps, zero_grad)

    timed = time_torch_step(args, body, opt, dev)
    return {"framework": args.worker.replace("diffusers", "diffusers+peft" if args.mode == "lora" else "diffusers"),
            **timed, "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else 0,
            "trained_params": sum(p.numel() for p in params),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}


def time_torch_step(args, body, opt, dev):
    """Time a PyTorch training step ``body(zero_grad=True)`` as ``args.worker`` asks: eagerly
    (``diffusers``; its model FLOPs counted too), or captured once in a ``torch.cuda.CUDAGraph`` after
    three warm-up calls on a side stream (the first compiles under ``diffusers-compile``: its time is
    ``compile_s``) and replayed. Peak memory counts from the warm-up on. Returns ``times_s``,
    ``profile``, ``flops``, ``compile_s``."""
    import torch
    graph = args.worker != "diffusers"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    flops = _count_flops(lambda i: body()) if not graph and args.checkpointing == "off" else None
    compile_s = None
    if dev == "cuda":  # from here: a graph's private pool is allocated during its capture, not at replay
        torch.cuda.reset_peak_memory_stats()
    if graph:  # warm up on a side stream (the first call compiles), then capture one step
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                t0 = time.perf_counter()
                body()
                sync()
                if i == 0 and args.worker == "diffusers-compile":
                    compile_s = time.perf_counter() - t0
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=True)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            body(zero_grad=False)

    def step(i):
        return captured.replay() if graph else body()

    times = _time_steps(step, args, sync)
    return {"times_s": times, "profile": _profile(step, args), "flops": flops, "compile_s": compile_s}


def parse_args(argv, configs=("sdxl", "tiny"), doc=__doc__):
    """The options of a training-step bench (this one, and ``bench_flux.py`` with its ``configs``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=list(configs), default=configs[0], help=f"model config (default {configs[0]})")
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent = /8)")
    p.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1 and 4)")
    p.add_argument("--checkpointing", choices=["on", "off", "ff", "both"], default="both",
                   help="on: each resnet and transformer block recomputed in the backward; ff: flame's GEGLU "
                        "projections only (checkpoint_scope feed_forward; flame alone: diffusers has no such scope); "
                        "both: off and on")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mode", choices=["lora", "full"], default="lora",
                   help="lora: adapters on the attention projections; full: every weight trains")
    p.add_argument("--master", choices=["fp32", "bf16_stochastic"], default="fp32",
                   help="flame, --mode full: fp32 master weights (a one-rank ShardedOptimizer) or bf16 weights "
                        "updated with stochastic rounding")
    p.add_argument("--dora", choices=["off", "on", "both"], default="off",
                   help="DoRA adapters (flame's lora.dora, peft's use_dora) instead of plain LoRA, or both")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (flame captures on its 2nd)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every setting this many times, alternating (each setting once, then again...): its "
                        "steps pooled, each run's median listed, so drift on the machine reaches every setting alike")
    p.add_argument("--framework", action="append", choices=FRAMEWORKS + ["both", "all"],
                   help="flame, diffusers (eager), diffusers-graph (the whole step in one CUDA graph), "
                        "diffusers-compile (torch.compile inside the graph; minutes to compile); both = flame + "
                        "diffusers; all = every one (repeatable; default: both)")
    p.add_argument("--capture", choices=["on", "off", "both"], default=None,
                   help="flame's CUDA-graph step (default: on with a GPU, off on the interpreter)")
    p.add_argument("--paths", choices=["default", "portable", "both"], default="default",
                   help="flame's kernel paths: default (TMA on Hopper, the card's tuning table) or portable (what "
                        "an Ampere or Ada card runs: no TMA, no tuning table, the built-in heuristics, 99 KB "
                        "of shared memory per block)")
    p.add_argument("--profile", action="store_true", help="add the GPU kernel time by kernel name of one step")
    p.add_argument("--cold-cache", action="store_true",
                   help="flame workers start with an empty Triton cache (the first step compiles every kernel)")
    p.add_argument("--precompile", metavar="FILE",
                   help="flame workers first compile the kernel variants FILE records, in parallel processes "
                        "(flame.kernels.precompile; record a FILE with FLAME_RECORD_KERNELS=FILE)")
    p.add_argument("--weight-dtype", choices=["fp8_e4m3"],
                   help="flame: the frozen model's Linear weights in fp8 (the trainer's model.weight_dtype)")
    p.add_argument("--fp8-gemm", choices=["w8a8"],
                   help="flame, with fp8 weights: their forward products round the inputs to e4m3 (W8A8 on the fp8 "
                        "tensor cores; the trainer's model.fp8_gemm)")
    p.add_argument("--offload", metavar="N|all",
                   help="flame: stream N (or all) blocks' frozen weights from pinned host memory (the trainer's "
                        "train.offload: blocks)")
    p.add_argument("--checkpoint-blocks", metavar="N",
                   help="flame, with --checkpointing on: recompute only N blocks, spread over the model (the "
                        "trainer's train.checkpoint_blocks)")
    p.add_argument("--memory-cap", metavar="GIB", type=float,
                   help="flame: the GPU memory the step may use, as a smaller card's (torch's per-process memory "
                        "fraction; a step that needs more fails with out of memory)")
    p.add_argument("--memory-budget", metavar="GIB", type=float,
                   help="flame: the settings the trainer's train.memory_budget_gb picks for this budget (fp8 weights, "
                        "checkpointed and streamed blocks; replaces --checkpointing and the options above), with "
                        "the budget as --memory-cap")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.memory_args = [a for k, v in (("--weight-dtype", args.weight_dtype), ("--fp8-gemm", args.fp8_gemm),
                                       ("--offload", args.offload),
                                       ("--checkpoint-blocks", args.checkpoint_blocks),
                                       ("--memory-cap", args.memory_cap), ("--memory-budget", args.memory_budget))
                        if v is not None for a in (k, str(v))]
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.mode == "full" and (args.dora != "off" or args.memory_args):
        p.error("--mode full trains every weight: no --dora, fp8 weights, offload or memory budget")
    return args


def _settings(args):
    import importlib.util

    import torch
    asked = {"both": ["flame", "diffusers"], "all": FRAMEWORKS}
    frameworks = [fw for name in args.framework or ["both"] for fw in asked.get(name, [name])]
    frameworks = [fw for i, fw in enumerate(frameworks) if fw not in frameworks[:i]]
    if not (importlib.util.find_spec("diffusers") and importlib.util.find_spec("peft")) and frameworks != ["flame"]:
        print("diffusers/peft not importable: measuring flame only", file=sys.stderr)
        frameworks = ["flame"]
    capture = args.capture or ("on" if torch.cuda.is_available() else "off")
    captures = ["off", "on"] if capture == "both" else [capture]
    ckpts = ["off", "on"] if args.checkpointing == "both" else [args.checkpointing]
    paths = ["default", "portable"] if args.paths == "both" else [args.paths]
    doras = ["off", "on"] if args.dora == "both" else [args.dora]
    for batch in args.batch or [1, 4]:
        for ckpt in ckpts:
            for dora in doras:
                for fw in (frameworks if ckpt != "ff" else ["flame"]):
                    for cap in (captures if fw == "flame" else [None]):
                        for path in (paths if fw == "flame" else ["default"]):
                            yield fw, batch, ckpt, cap, path, dora


ADA_SHARED_MEMORY = 101376  # bytes per block on Ampere consumer and Ada cards (sm_86, sm_89)


def _portable_env(tmp):
    """The environment of a flame worker that runs as on a card without Hopper's paths (TMA, the
    Gluon GEMM and attention kernels), with the shared memory of an Ada card."""
    return dict(os.environ, FLAME_MATMUL_TMA="0", FLAME_ATTN_TMA="0", FLAME_MATMUL_GLUON="0", FLAME_ATTN_GLUON="0",
                FLAME_TUNE_DIR=tmp, FLAME_TEST_MAX_SHARED_MEMORY=str(ADA_SHARED_MEMORY))


def main(argv=None, workers=None, script=__file__, parse=parse_args):
    """The bench driver: each setting in a worker process (``script --worker ...``), results pooled
    and reported. ``workers``: (flame worker, PyTorch worker) of the model benched (SDXL's here)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        args.batch = args.batch[0]
        flame_worker, torch_worker = workers or (run_flame, run_diffusers)
        res = (flame_worker if args.worker == "flame" else torch_worker)(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    no_table = tempfile.mkdtemp(prefix="flame-no-table-")
    settings = list(_settings(args))
    runs = {}  # setting label -> its runs' results (one per round), in the order first run
    for rnd in range(args.rounds):
        for setting in settings:
            label, result = _run_setting(args, setting, no_table, script)
            runs.setdefault(label, []).append(result)
            if "error" not in result:
                _print_run(result, f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else "")
    rows = [_pool_rounds(label, results) for label, results in runs.items()]
    _report(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


def _run_setting(args, setting, no_table, script=__file__):
    """One setting's worker process: (label, its result, or {"error": ...} when it failed)."""
    fw, batch, ckpt, cap, path, dora = setting
    cmd = [sys.executable, script, "--worker", fw, "--batch", str(batch), "--checkpointing", ckpt,
           "--config", args.config, "--resolution", str(args.resolution), "--rank", str(args.rank),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--dora", dora, "--mode", args.mode,
           "--master", args.master]
    cmd += ["--precompile", args.precompile] if args.precompile and fw == "flame" else []
    cmd += (["--profile"] if args.profile else []) + (["--capture", cap] if cap else [])
    memory = args.memory_args if fw == "flame" else []
    cmd += memory
    full = f" full{' bf16-SR' if args.master == 'bf16_stochastic' and fw == 'flame' else ''}" \
        if args.mode == "full" else ""
    label = f"{fw}{full}{' portable' if path == 'portable' else ''}{' graph' if cap == 'on' else ''}" \
            f"{' dora' if dora == 'on' else ''}{''.join(' ' + a.lstrip('-') for a in memory)} batch {batch} ckpt {ckpt}"
    print(f"== {label}", flush=True)
    env = _portable_env(no_table) if path == "portable" else dict(os.environ)
    if args.cold_cache and fw == "flame":
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="flame-cold-triton-")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode or result is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return label, {"error": (proc.stderr or proc.stdout)[-2000:]}
    result.update(setting=label, batch=batch, checkpointing=ckpt, dora=dora,
                  median_s=statistics.median(result["times_s"]))
    return label, result


def _print_run(result, round_note):
    start = f", first step {result['first_step_s']:.1f} s after start" if result.get("first_step_s") else ""
    start += f", {result['compile_s']:.0f} s to compile" if result.get("compile_s") else ""
    ahead = result.get("compiled_ahead")
    start += (f" ({ahead['variants']} kernel variants compiled ahead in {ahead['seconds']:.1f} s, "
              f"{ahead['failed']} failed)") if ahead else ""
    start += f"\n   {result['memory_plan']}" if result.get("memory_plan") else ""
    held = f" (allocator {result['reserved_bytes'] / 2**30:.2f} GiB)" if result.get("reserved_bytes") else ""
    print(f"   median {result['median_s'] * 1e3:.1f} ms, peak {result['peak_bytes'] / 2**30:.2f} GiB{held}{start}"
          f"{round_note}", flush=True)
    if result.get("profile"):
        prof = result["profile"]
        print(f"   GPU kernel time {prof['total_ms']:.1f} ms in {prof['kernels']} kernels; top:")
        for k in prof["top"][:15]:
            print(f"     {k['ms']:8.2f} ms {k['count']:5d}x  {k['name'][:90]}")


def _pool_rounds(label, results):
    """One row per setting from its runs in every round: the first run's result (its start-up times,
    profile) with the timed steps of all runs pooled (``median_s`` their median), each run's median
    in ``round_medians_s`` and the highest peak memory; an error row if any run failed."""
    failed = [r for r in results if "error" in r]
    if failed:
        return {"setting": label, "error": failed[0]["error"]}
    row = dict(results[0], times_s=[t for r in results for t in r["times_s"]],
               round_medians_s=[r["median_s"] for r in results], peak_bytes=max(r["peak_bytes"] for r in results))
    row["median_s"] = statistics.median(row["times_s"])
    return row


def _report(rows):
    """Per setting: step time, peak memory, both as ratios to the strongest (fastest) PyTorch setting
    of the same batch, checkpointing and adapter, and MFU: the model FLOPs of the step (counted by
    the eager diffusers worker, without checkpointing's recomputation) over the time, as a fraction
    of the card's dense bf16 peak."""
    ok = [r for r in rows if "error" not in r]
    strongest, flops = {}, {}
    for r in ok:
        key = (r["batch"], r["checkpointing"], r["dora"])
        if r["framework"] != "flame" and (key not in strongest or r["median_s"] < strongest[key]["median_s"]):
            strongest[key] = r
        if r.get("flops"):
            flops[r["batch"], r["dora"]] = r["flops"]
    print(f"\n{'setting':<44} {'step ms':>9} {'peak GiB':>9} {'vs torch':>9} {'memory':>7} {'MFU':>6} "
          f"{'compile s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['setting']:<44} failed")
            continue
        ckpt = "off" if r["checkpointing"] == "ff" else r["checkpointing"]  # ff: against PyTorch's plain step
        ref = strongest.get((r["batch"], ckpt, r["dora"]))
        tr = f"{r['median_s'] / ref['median_s']:.2f}x" if ref and r is not ref else ""
        mr = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x" if ref and r is not ref and ref["peak_bytes"] else ""
        peak, work = _peak_flops(r.get("device", "")), flops.get((r["batch"], r["dora"]))
        r["mfu"] = work / r["median_s"] / peak if peak and work else None
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else ""
        comp = f"{r['compile_s']:.0f}" if r.get("compile_s") else ""
        print(f"{r['setting']:<44} {r['median_s'] * 1e3:9.1f} {r['peak_bytes'] / 2**30:9.2f} {tr:>9} {mr:>7} {mfu:>6} "
              f"{comp:>10}")
    if strongest:
        print("(vs torch, memory: ratios to the fastest PyTorch setting of the same batch, checkpointing and adapter; "
              "flame's ckpt ff against PyTorch's ckpt off)")
    for r in ok:
        if len(r.get("round_medians_s", ())) > 1:
            print(f"{r['setting']}: the medians of its rounds "
                  + " / ".join(f"{m * 1e3:.1f}" for m in r["round_medians_s"]) + " ms")


if __name__ == "__main__":
    sys.exit(main())
