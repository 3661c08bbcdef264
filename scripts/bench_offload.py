#!/usr/bin/env python3
"""Streamed blocks (``flame.models.offload``): a Flux-shaped LoRA step with its blocks' frozen weights
on the device (resident) against streamed from pinned host memory, same model, same call.

    PYTHONPATH=. python3 scripts/bench_offload.py                       # 8 double + 8 single blocks, 1024x1024
    PYTHONPATH=. python3 scripts/bench_offload.py --double 19 --single 38 --modes resident,half
    PYTHONPATH=. python3 scripts/bench_offload.py --config tiny --tokens 4 --text 3 --steps 1 --checkpointing off  # CPU

The model is Flux.1's transformer (hidden 3072, 24 heads) with ``--double``/``--single`` blocks of
random bf16 weights, frozen, LoRA rank ``--rank`` on the attention and MLP linears (the ``attn-mlp``
preset), ``--tokens`` image and ``--text`` text tokens (1024x1024: 4096 + 512). A step is forward,
MSE loss and backward, replayed from a CUDA graph. Modes: ``resident``; ``all`` (every block
streamed); ``half`` (every other block); each with gradient checkpointing off and/or on
(``--checkpointing``). Reported per mode: step time (median of ``--steps`` replays), the eager
step's peak memory, the bytes copied host-to-device per step, and the time those copies take alone
(at the copy bandwidth measured first), so ``streamed - max(resident, copies)`` is what overlapping
did not hide.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=("flux", "tiny"), default="flux", help="Flux.1's block size, or the tiny one")
    p.add_argument("--double", type=int, default=8, help="double blocks (default 8)")
    p.add_argument("--single", type=int, default=8, help="single blocks (default 8)")
    p.add_argument("--tokens", type=int, default=4096, help="image tokens, a square number (default 4096: 1024x1024)")
    p.add_argument("--text", type=int, default=512, help="text tokens (default 512)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--modes", default="resident,all,half", help="comma-separated: resident, all, half")
    p.add_argument("--checkpointing", default="off,on", help="comma-separated: off, on")
    p.add_argument("--steps", type=int, default=5, help="timed replays per mode (default 5)")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    args.checkpointing = args.checkpointing.split(",")
    side = round(args.tokens ** 0.5)
    if side * side != args.tokens:
        raise SystemExit(f"--tokens must be a square number, got {args.tokens}")
    for m in args.modes:
        if m not in ("resident", "all", "half"):
            raise SystemExit(f"--modes: unknown mode {m!r} (resident, all, half)")
    for c in args.checkpointing:
        if c not in ("off", "on"):
            raise SystemExit(f"--checkpointing: unknown setting {c!r} (off, on)")
    return args


def build(args):
    import dataclasses

    import flame
    from flame import nn
    from flame.models.flux import FluxConfig, FluxTransformer2DModel, latent_image_ids, text_ids
    from flame.train.families.flux import FluxFamily

    base = FluxConfig.tiny() if args.config == "tiny" else FluxConfig()
    cfg = dataclasses.replace(base, num_layers=args.double, num_single_layers=args.single)
    dtype = flame.float32 if flame.is_interpreter() else flame.bfloat16
    flame.manual_seed(0)
    model = FluxTransformer2DModel(cfg, dtype=dtype)
    model.requires_grad_(False)
    nn.inject_lora(model, FluxFamily().lora_targets("attn-mlp"), rank=args.rank, alpha=args.rank)
    params = nn.lora_parameters(model)
    side = round(args.tokens ** 0.5)
    inputs = (flame.randn(1, args.tokens, cfg.in_channels, dtype=dtype),
              flame.randn(1, args.text, cfg.joint_attention_dim, dtype=dtype),
              flame.randn(1, cfg.pooled_projection_dim, dtype=dtype), flame.full((1,), 0.5),
              latent_image_ids(2 * side, 2 * side), text_ids(args.text), flame.full((1,), 1.0))
    target = flame.randn(1, args.tokens, cfg.output_size, dtype=flame.float32)

    def fwd_bwd(*xs):
        out = model(*xs)
        loss = flame.nn.functional.mse_loss(out.to(flame.float32), target)
        return loss, loss.backward()

    return model, params, inputs, fwd_bwd


def copy_bandwidth(streamer):
    """Host-to-device bytes per second of the largest streamed block's copy (pinned memory)."""
    import torch

    import flame
    rec = max(streamer._streamed, key=lambda r: r.nbytes)
    dst = streamer._slots[rec.slot][:rec.nbytes]
    reps = 10 if not flame.is_interpreter() else 1
    dst.copy_(rec.host, non_blocking=True)
    flame.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(rec.host, non_blocking=not flame.is_interpreter())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return reps * rec.nbytes / (time.perf_counter() - start)


def run_mode(args, model, inputs, fwd_bwd, mode, checkpointing, capture=True):
    import torch

    import flame
    from flame.graphs import CapturedStep
    from flame.models import offload

    model.enable_gradient_checkpointing(checkpointing == "on")
    streamer = None
    if mode != "resident":
        n = len(offload.streamable_blocks(model))
        plan = offload.plan_offload(model, count="all" if mode == "all" else n // 2)
        streamer = offload.BlockStreamer(model, plan)
    step = CapturedStep(fwd_bwd, enabled=capture)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    flame.synchronize()
    flame.reset_peak_memory_stats()
    copied = streamer.copied_bytes if streamer else 0
    start = time.perf_counter()
    step(*inputs)  # eager: its peak is the step's memory
    flame.synchronize()
    eager_s = time.perf_counter() - start
    peak = flame.max_memory_allocated()
    per_step = (streamer.copied_bytes - copied) if streamer else 0
    for _ in range(2):  # captured, then replayed
        step(*inputs)
    flame.synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(*inputs)
        flame.synchronize()
        times.append(time.perf_counter() - start)
    result = {"mode": mode, "checkpointing": checkpointing, "capture": capture,
              "step_ms": 1e3 * statistics.median(times), "eager_step_ms": 1e3 * eager_s, "peak_gib": peak / 2**30,
              "copied_gib_per_step": per_step / 2**30,
              "streamed_blocks": len(streamer.plan.streamed) if streamer else 0,
              "device_weights_gib": (streamer.plan.device_bytes if streamer else
                                     offload.plan_offload(model, count=0).device_bytes) / 2**30}
    if streamer is not None:
        flame.synchronize()
        bw = copy_bandwidth(streamer)
        result.update(copy_gb_s=bw / 1e9, copies_alone_ms=1e3 * per_step / bw,
                      slot_mib=streamer.plan.slot_bytes / 2**20)
        streamer.restore()
    del step
    gc.collect()
    return result


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import flame
    from flame.models import offload
    model, _, inputs, fwd_bwd = build(args)
    print(json.dumps({"device": flame.device_name(), "double": args.double, "single": args.single,
                      "tokens": args.tokens, "text": args.text, "rank": args.rank}), flush=True)
    results = []
    for checkpointing in args.checkpointing:
        for mode in args.modes:
            try:
                r = run_mode(args, model, inputs, fwd_bwd, mode, checkpointing)
            except Exception as e:  # report it, then measure the eager step
                print(json.dumps({"mode": mode, "checkpointing": checkpointing, "capture_error": repr(e)}), flush=True)
                for _, b in offload.streamable_blocks(model):
                    if b.streamer is not None:
                        b.streamer.streamer.restore()
                        break
                r = run_mode(args, model, inputs, fwd_bwd, mode, checkpointing, capture=False)
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"{'mode':<9} {'ckpt':<5} {'step ms':>9} {'peak GiB':>9} {'weights GiB':>12} {'H2D GiB/step':>13} "
          f"{'copies alone ms':>16}")
    for r in results:
        alone = r.get("copies_alone_ms", 0.0)
        print(f"{r['mode']:<9} {r['checkpointing']:<5} {r['step_ms']:>9.1f} {r['peak_gib']:>9.2f} "
              f"{r['device_weights_gib']:>12.2f} {r['copied_gib_per_step']:>13.2f} {alone:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
