#!/usr/bin/env python3
"""SDXL inference: flame against diffusers on the same card in the same run.

    PYTHONPATH=. python3 scripts/bench_sample.py --out out/sample.json          # everything below, full SDXL
    PYTHONPATH=. python3 scripts/bench_sample.py --only pipeline --steps 30
    python scripts/bench_sample.py --config tiny --size 64 --steps 2 --repeat 1   # CPU smoke test

Measured, each (part, framework) in its own process so peak memory is its own:

- ``pipeline``: text to image, ``--size`` square, ``--steps`` Euler steps, CFG 5, batch 1: flame's
  ``SDXLPipeline`` with and without its per-step CUDA graph, against diffusers'
  ``StableDiffusionXLPipeline`` (SDPA attention, bf16). Both run the whole call: prompt encoding,
  the denoising loop, the VAE decode.
- ``vae``: decoding 1024x1024 and 2048x2048 latents: flame's VAE and diffusers' AutoencoderKL, both
  tiling what exceeds the VAE's 1024-pixel sample size (``tile=True``, ``enable_tiling()``): time
  and peak memory.
- ``cache``: building a latent cache, 1024x1024 images in batches of 4: the VAE encode and both
  text encoders, flame (``scripts/prepare_cache.py``'s FlameEncoders) against the diffusers path
  (its SDXLEncoders), in images/s.

The models are SDXL base's architectures with random weights (nothing can be downloaded here),
written once as a diffusers pipeline folder in bf16 (``--model`` reuses one), with a small letter
tokenizer (token ids, not their meaning, matter for speed). Reported: median of ``--repeat`` timed
runs after one warm-up run, peak allocated memory, and flame/diffusers ratios.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipeline and letter tokenizer of the tests

import common  # noqa: E402  (scripts/: the shared timers; imports flame, which picks the backend before triton)

import flame  # noqa: E402

PROMPT = "a photograph of an astronaut riding a horse on the moon"


def write_random_pipeline(folder: Path, config: str) -> Path:
    """SDXL base (or the tiny test pipeline) with random weights as a diffusers folder."""
    import diffusers
    import torch
    import transformers
    from test_clip_text import write_tiny_clip_tokenizer
    from tiny_sdxl import MODEL_INDEX, write_tiny_pipeline

    from flame.models import SDXLUNetConfig
    from flame.models.clip_text import CLIPTextConfig
    from flame.models.vae import AutoencoderKLConfig
    if config == "tiny":
        return write_tiny_pipeline(folder)
    folder.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        parts = {"unet": diffusers.UNet2DConditionModel(**SDXLUNetConfig().to_diffusers()),
                 "vae": diffusers.AutoencoderKL(**AutoencoderKLConfig.sdxl().to_diffusers()),
                 "text_encoder": transformers.CLIPTextModel(
                     transformers.CLIPTextConfig(**CLIPTextConfig.sdxl_clip_l().to_transformers())),
                 "text_encoder_2": transformers.CLIPTextModelWithProjection(
                     transformers.CLIPTextConfig(**CLIPTextConfig.sdxl_clip_g().to_transformers()))}
    for name, model in parts.items():
        for p in model.parameters():  # default inits leave some layers at zero: keep activations realistic
            if p.dim() > 1:
                p.data.normal_(0.0, 0.02)
        model.to(torch.bfloat16).save_pretrained(folder / name)
        del model
    for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        write_tiny_clip_tokenizer(folder / name, pad)
    diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                     timestep_spacing="leading", steps_offset=1).save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    return folder


def _timed(fn, args, sync):
    """Median seconds of ``args.repeat`` calls after a warm-up call; with ``--profile`` (on a GPU)
    also the GPU time of one more call by kernel name (top 15)."""
    times = common.wall_times(fn, args.repeat, warmup=1, sync=sync)  # the warm-up compiles, captures graphs
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[1])
        print(json.dumps({"gpu_ms": round(sum(r[1] for r in rows), 2),
                          "top": [(k[:90], round(ms, 2), c) for k, ms, c in rows[:15]]}), file=sys.stderr)
    return statistics.median(times)


# ---- the measured parts, one per process ----------------------------------------------------------

def flame_pipeline(args, cuda_graph):
    from flame.pipeline import SDXLPipeline
    pipe = SDXLPipeline.from_pretrained(args.model)
    flame.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, steps=args.steps, cfg=5.0, width=args.size, height=args.size, seed=0,
                       cuda_graph=cuda_graph)
    return {"s": _timed(run, args, flame.synchronize), "peak_gib": flame.max_memory_allocated() / 2**30}


def diffusers_pipeline(args):
    import torch
    from diffusers import StableDiffusionXLPipeline
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    pipe = StableDiffusionXLPipeline.from_pretrained(args.model, torch_dtype=dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, num_inference_steps=args.steps, guidance_scale=5.0, width=args.size,
                       height=args.size, generator=torch.Generator(dev).manual_seed(0), output_type="np")
    s = _timed(run, args, sync)
    return {"s": s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}


def flame_vae(args, which):
    size = args.vae_sizes[which]
    from flame.models.vae import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(args.model, dtype=flame.float32 if flame.is_interpreter() else flame.bfloat16)
    flame.manual_seed(0)
    latents = flame.randn(1, 4, size // 8, size // 8).to(vae.dtype)
    flame.reset_peak_memory_stats()
    with flame.no_grad():
        s = _timed(lambda: vae.decode_latents(latents, tile=True), args, flame.synchronize)
    return {"s": s, "peak_gib": flame.max_memory_allocated() / 2**30}


def diffusers_vae(args, which):
    size = args.vae_sizes[which]
    import torch
    from diffusers import AutoencoderKL
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vae = AutoencoderKL.from_pretrained(Path(args.model) / "vae",
                                        torch_dtype=torch.bfloat16 if dev == "cuda" else torch.float32).to(dev)
    vae.enable_tiling()
    latents = torch.randn(1, 4, size // 8, size // 8, device=dev, dtype=vae.dtype)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        s = _timed(lambda: vae.decode(latents / vae.config.scaling_factor), args, sync)
    return {"s": s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}


def cache_encoders(args, framework):
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("prepare_cache", ROOT / "scripts" / "prepare_cache.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    enc = pc.FlameEncoders(args.model) if framework == "flame" else pc.SDXLEncoders(args.model, vae_dtype="bf16")
    batch = 4
    pixels = np.random.default_rng(0).uniform(-1, 1, (batch, 3, args.size, args.size)).astype(np.float32)
    captions = [PROMPT] * batch

    def run():
        enc.encode_images(pixels)
        enc.encode_prompts(captions)
    s = _timed(run, args, lambda: None)  # both return host arrays: already synchronized
    return {"images_per_s": batch / s}


PARTS = {
    "pipeline": [("flame (CUDA graph)", lambda a: flame_pipeline(a, True)),
                 ("flame (eager)", lambda a: flame_pipeline(a, False)),
                 ("diffusers", diffusers_pipeline)],
    "vae": [(f"{fw} {k}", functools.partial(fn, which=k))
            for k in (0, 1) for fw, fn in (("flame", flame_vae), ("diffusers", diffusers_vae))],
    "cache": [("flame", lambda a: cache_encoders(a, "flame")), ("diffusers", lambda a: cache_encoders(a, "diffusers"))],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(PARTS), action="append", help="parts to measure (default: all)")
    p.add_argument("--config", choices=("sdxl", "tiny"), default="sdxl")
    p.add_argument("--model", help="an existing pipeline folder (default: write a random one)")
    p.add_argument("--size", type=int, default=1024, help="image side for the pipeline and cache parts")
    p.add_argument("--vae-sizes", type=lambda t: [int(v) for v in t.split(",")], default=[1024, 2048],
                   help="the two image sides of the vae part")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--profile", action="store_true", help="print each part's GPU time by kernel (stderr)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # internal: "part:index" in a child process
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run:
        part, index = args.run.split(":")
        print(json.dumps(PARTS[part][int(index)][1](args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(write_random_pipeline(Path(tmp) / "sdxl", args.config))
        results = {}
        for part in args.only or list(PARTS):
            for i, (name, _) in enumerate(PARTS[part]):
                cmd = [sys.executable, __file__, "--run", f"{part}:{i}", "--model", args.model, "--size",
                       str(args.size), "--steps", str(args.steps), "--repeat", str(args.repeat), "--vae-sizes",
                       ",".join(map(str, args.vae_sizes))] + (["--profile"] if args.profile else [])
                r = subprocess.run(cmd, capture_output=True, text=True)
                if args.profile:
                    print("\n".join(line for line in r.stderr.splitlines() if line.startswith('{"gpu_ms"')))
                if r.returncode:
                    results[f"{part}/{name}"] = {"error": r.stderr.strip().splitlines()[-1:]}
                    print(r.stderr[-3000:], file=sys.stderr)
                else:
                    results[f"{part}/{name}"] = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{part}/{name}: {results[f'{part}/{name}']}", flush=True)
    results["vae sizes"] = args.vae_sizes
    _ratios(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _ratios(results):
    def ratio(a, b, key):
        ra, rb = results.get(a, {}), results.get(b, {})
        if ra.get(key) and rb.get(key):
            print(f"{a} / {b} ({key}): {ra[key] / rb[key]:.3f}")
    for name in ("flame (CUDA graph)", "flame (eager)"):
        ratio(f"pipeline/{name}", "pipeline/diffusers", "s")
    for k in (0, 1):
        ratio(f"vae/flame {k}", f"vae/diffusers {k}", "s")
        ratio(f"vae/flame {k}", f"vae/diffusers {k}", "peak_gib")
    ratio("cache/flame", "cache/diffusers", "images_per_s")


if __name__ == "__main__":
    sys.exit(main())
