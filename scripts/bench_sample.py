#!/usr/bin/env python3
"""SDXL and Flux.1 inference: flame against diffusers on the same card in the same run.

    PYTHONPATH=. python3 scripts/bench_sample.py --out out/sample.json          # everything below, full SDXL
    PYTHONPATH=. python3 scripts/bench_sample.py --only pipeline --steps 30
    PYTHONPATH=. python3 scripts/bench_sample.py --only step --rounds 3                # one UNet step (issue 46)
    PYTHONPATH=. python3 scripts/bench_sample.py --family flux --steps 28 --out out/flux_sample.json
    python scripts/bench_sample.py --config tiny --size 64 --steps 2 --repeat 1   # CPU smoke test

Measured, each (part, framework) in its own process so peak memory is its own:

- ``pipeline``: text to image, ``--size`` square, ``--steps`` Euler steps, CFG 5, batch 1: flame's
  ``SDXLPipeline`` with and without its per-step CUDA graph, against diffusers'
  ``StableDiffusionXLPipeline`` (SDPA attention, bf16), eager and with ``torch.compile(unet)``
  (``--skip torch.compile`` leaves that one out: it compiles for minutes). All run the whole call:
  prompt encoding, the denoising loop, the VAE decode.
- ``step``: one denoising step of the UNet alone, as CFG runs it: batch 2, latents ``--size``/8
  square, 77 tokens of text context, the pooled text and time ids, bf16. flame's ``SDXLUNet``
  replayed as the ``CapturedStep`` the pipeline uses and eagerly, against diffusers'
  ``UNet2DConditionModel`` (SDPA, ``torch.no_grad``) captured in one ``torch.cuda.CUDAGraph`` (warmed
  up on a side stream, static inputs), the same with ``torch.compile(unet)`` (inductor's default
  mode) inside the graph (``first_s``: the warm-up calls that compile, the capture and the first
  timed calls), and eagerly. Reported in ms per step: each timing is ``--step-calls`` calls
  synchronized once. On the CPU the CUDA-graph sides run eagerly (their result says so in ``note``).
- ``vae``: decoding 1024x1024 and 2048x2048 latents: flame's VAE and diffusers' AutoencoderKL, both
  tiling what exceeds the VAE's 1024-pixel sample size (``tile=True``, ``enable_tiling()``): time
  and peak memory.
- ``cache``: building a latent cache, 1024x1024 images in batches of 4: the VAE encode and both
  text encoders, flame (``scripts/prepare_cache.py``'s FlameEncoders) against the diffusers path
  (its SDXLEncoders), in images/s.

The models are SDXL base's architectures with random weights (nothing can be downloaded here),
written once as a diffusers pipeline folder in bf16 (``--model`` reuses one), with a small letter
tokenizer (token ids, not their meaning, matter for speed). Reported: median of ``--repeat`` timed
runs after two warm-up runs, peak allocated memory, and flame/diffusers ratios. ``--rounds R`` runs
each part's processes R times, every other round in reverse order, and reports each round's ratios
and the medians (the host-bound eager sides move with the host's load between processes).

``--family flux``: Flux.1-dev's architectures (transformer, T5-XXL, CLIP-L, the 16-channel VAE) with
random bf16 weights built on the GPU by each process (a 33 GB folder would take longer to write and
read than the runs), the tests' letter tokenizers:

- ``pipeline``: text to image, ``--size`` square, ``--steps`` flow-matching Euler steps, guidance
  3.5 (dev's distilled guidance), batch 1, T5 512 tokens: flame's ``FluxPipeline`` (per-step CUDA
  graph) against diffusers' ``FluxPipeline`` (bf16, SDPA), eager and with ``torch.compile`` on its
  transformer (the warm-up call compiles; its time is reported as ``first_s``).
- ``cache``: the VAE encode of 1024x1024 images in batches of 4 and T5 + CLIP-L of their captions:
  ``scripts/prepare_cache.py``'s Flux encoders, flame against diffusers/transformers, in images/s
  (from a folder of the random VAE and text encoders, written once).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
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
    """Median seconds of ``args.repeat`` calls after two warm-up calls (``_times``)."""
    return statistics.median(_times(fn, args, sync)[1])


def _times(fn, args, sync, per=1):
    """(seconds of the first call, [seconds of each of ``args.repeat`` calls after two warm-up
    calls]): the first compiles kernels (and torch.compile's graphs), the second captures flame's
    CUDA graphs (``CapturedStep``: eager, then captured, then replayed). With ``--profile`` (on a
    GPU) also the GPU time of one more call by kernel name (top 15), divided by ``per`` (a call of
    ``per`` steps: ms and launches a step)."""
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    times = common.wall_times(fn, args.repeat, warmup=1, sync=sync)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        rows = sorted(((e.key, e.device_time_total / 1e3 / per, e.count / per) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[1])
        print(json.dumps({"gpu_ms": round(sum(r[1] for r in rows), 3),
                          "top": [(k[:90], round(ms, 3), round(c, 1)) for k, ms, c in rows[:15]]}), file=sys.stderr)
    return first, times


# ---- the measured parts, one per process ----------------------------------------------------------

def flame_pipeline(args, cuda_graph):
    from flame.pipeline import SDXLPipeline
    pipe = SDXLPipeline.from_pretrained(args.model)
    flame.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, steps=args.steps, cfg=5.0, width=args.size, height=args.size, seed=0,
                       cuda_graph=cuda_graph)
    return {"s": _timed(run, args, flame.synchronize), "peak_gib": flame.max_memory_allocated() / 2**30}


def diffusers_pipeline(args, compiled=False):
    """diffusers' SDXL pipeline, eager or with ``torch.compile(pipe.unet)`` (inductor's default mode;
    ``first_s``: the first call, compilation included)."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    pipe = StableDiffusionXLPipeline.from_pretrained(args.model, torch_dtype=dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        pipe.unet = torch.compile(pipe.unet)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, num_inference_steps=args.steps, guidance_scale=5.0, width=args.size,
                       height=args.size, generator=torch.Generator(dev).manual_seed(0), output_type="np")
    with torch.no_grad():
        first, times = _times(run, args, sync)
    return {"s": statistics.median(times), "first_s": first,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}


def _step_inputs(args):
    """One CFG step's UNet inputs, (sample, timestep, text context, pooled text, time ids), as
    (float32 NumPy array, whether the model's dtype is wanted) pairs: batch 2 (unconditional and
    conditional rows), latents ``--size``/8 square, 77 tokens; widths from the folder's unet/config.json."""
    import numpy as np
    cfg = json.loads((Path(args.model) / "unet" / "config.json").read_text())
    pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    rng, side = np.random.default_rng(0), args.size // 8
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    return [(normal(2, cfg["in_channels"], side, side), True), (np.full(2, 500.0, np.float32), False),
            (normal(2, 77, cfg["cross_attention_dim"]), True), (normal(2, pooled), True),
            (np.array([[args.size, args.size, 0, 0, args.size, args.size]] * 2, np.float32), False)]


def _step_times(step, args, sync, setup_s=0.0):
    """ms per call of ``step`` (median of ``--repeat`` timings of ``--step-calls`` calls each) and
    ``first_s``: ``setup_s`` (warm-up and capture) plus the first timing's calls."""
    first, times = _times(lambda: [step() for _ in range(args.step_calls)], args, sync, per=args.step_calls)
    return {"ms": 1e3 * statistics.median(times) / args.step_calls, "first_s": setup_s + first}


def flame_step(args, cuda_graph):
    from flame.graphs import CapturedStep
    from flame.models import SDXLUNet
    dtype = flame.float32 if flame.is_interpreter() else flame.bfloat16
    unet = SDXLUNet.from_pretrained(args.model, dtype=dtype)
    inputs = [flame.tensor(a, dtype=dtype if cast else None) for a, cast in _step_inputs(args)]
    predict = CapturedStep(unet.__call__, enabled=cuda_graph)  # as SDXLPipeline.predict
    flame.reset_peak_memory_stats()
    with flame.no_grad():
        got = _step_times(lambda: predict(*inputs), args, flame.synchronize)
    note = {"note": "interpreter: no CUDA graph, the step runs eagerly"} if cuda_graph and not predict.enabled else {}
    return {**got, "peak_gib": flame.max_memory_allocated() / 2**30, **note}


def _cuda_graphed(fn, warmup=3):
    """``fn`` captured in one ``torch.cuda.CUDAGraph`` after ``warmup`` calls on a side stream
    (PyTorch's recipe); returns the graph's replay (``fn``'s inputs and outputs are its static buffers)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def diffusers_step(args, cuda_graph, compiled=False):
    """diffusers' UNet2DConditionModel (SDPA), eager or captured in one CUDA graph, optionally
    ``torch.compile``d (inductor's default mode) inside it; on the CPU always eager."""
    import torch
    from diffusers import UNet2DConditionModel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    unet = UNet2DConditionModel.from_pretrained(Path(args.model) / "unet", torch_dtype=dtype).to(dev).eval()
    model = torch.compile(unet) if compiled else unet
    x, t, context, pooled, ids = (torch.from_numpy(a).to(dev, dtype if cast else torch.float32)
                                  for a, cast in _step_inputs(args))
    step = lambda: model(x, t, encoder_hidden_states=context,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": ids}).sample
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    graphed = cuda_graph and dev == "cuda"
    with torch.no_grad():
        start = time.perf_counter()
        run = _cuda_graphed(step) if graphed else step
        sync()
        got = _step_times(run, args, sync, time.perf_counter() - start)
    note = {"note": "no CUDA: no CUDA graph, the step runs eagerly"} if cuda_graph and not graphed else {}
    return {**got, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None, **note}


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
    make = {("sdxl", "flame"): lambda: pc.FlameEncoders(args.model),
            ("sdxl", "diffusers"): lambda: pc.SDXLEncoders(args.model, vae_dtype="bf16"),
            ("flux", "flame"): lambda: pc.FluxFlameEncoders(args.model),
            ("flux", "diffusers"): lambda: pc.FluxDiffusersEncoders(args.model, vae_dtype="bf16")}
    enc = make[args.family, framework]()
    batch = 4
    pixels = np.random.default_rng(0).uniform(-1, 1, (batch, 3, args.size, args.size)).astype(np.float32)
    captions = [PROMPT] * batch

    def run():
        enc.encode_images(pixels)
        enc.encode_prompts(captions)
    s = _timed(run, args, lambda: None)  # both return host arrays: already synchronized
    return {"images_per_s": batch / s}


# ---- Flux.1 ---------------------------------------------------------------------------------------

def _tokenizer_folder() -> Path:
    """The tests' letter CLIP tokenizer and tiny T5 tokenizer in tokenizer/ and tokenizer_2/ of a new folder."""
    from test_clip_text import write_tiny_clip_tokenizer
    from tiny_flux import write_tiny_t5_tokenizer
    folder = Path(tempfile.mkdtemp())
    write_tiny_clip_tokenizer(folder / "tokenizer")
    write_tiny_t5_tokenizer(folder / "tokenizer_2")
    return folder


def write_random_flux_encoders(folder: Path, config: str) -> Path:
    """A Flux.1-dev pipeline folder without the transformer's weights (its config.json only): the
    VAE, CLIP-L and T5-XXL with random bf16 weights, the letter tokenizers (``--config tiny``: the
    tests' whole tiny pipeline)."""
    import diffusers
    import torch
    import transformers
    from tiny_flux import FLUX_MODEL_INDEX, write_tiny_flux_pipeline

    from flame.diffusion.samplers import FLUX_SCHEDULER_CONFIG
    from flame.models import FluxConfig
    from flame.models.clip_text import CLIPTextConfig
    from flame.models.t5 import T5Config
    from flame.models.vae import AutoencoderKLConfig
    if config == "tiny":
        return write_tiny_flux_pipeline(folder)
    tok = _tokenizer_folder()
    folder.mkdir(parents=True)
    for name in ("tokenizer", "tokenizer_2"):
        (tok / name).rename(folder / name)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        parts = {"vae": diffusers.AutoencoderKL(**AutoencoderKLConfig.flux().to_diffusers()),
                 "text_encoder": transformers.CLIPTextModel(transformers.CLIPTextConfig(
                     **CLIPTextConfig.sdxl_clip_l().to_transformers())),
                 "text_encoder_2": transformers.T5EncoderModel(transformers.T5Config(**T5Config().to_transformers()))}
    torch.set_default_dtype(torch.float32)
    for name, model in parts.items():
        model.save_pretrained(folder / name)
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "FluxTransformer2DModel", **FluxConfig().to_diffusers()}))
    diffusers.FlowMatchEulerDiscreteScheduler(**{k: v for k, v in FLUX_SCHEDULER_CONFIG.items()
                                                 if k != "_class_name"}).save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps(FLUX_MODEL_INDEX))
    return folder


def flame_flux_pipeline(args):
    from flame.models import FluxConfig, FluxTransformer2DModel
    from flame.models.clip_text import CLIPTextConfig, CLIPTextModel
    from flame.models.flux_text import FluxTextEncoders, load_t5_tokenizer
    from flame.models.sdxl_text import load_tokenizer
    from flame.models.t5 import T5Config, T5EncoderModel
    from flame.models.vae import AutoencoderKL, AutoencoderKLConfig
    from flame.pipeline.flux import FluxPipeline
    dtype = flame.float32 if flame.is_interpreter() else flame.bfloat16
    tiny = args.config == "tiny"
    tok = _tokenizer_folder()
    text = FluxTextEncoders(CLIPTextModel(CLIPTextConfig.tiny() if tiny else CLIPTextConfig.sdxl_clip_l(), dtype),
                            T5EncoderModel(T5Config.tiny() if tiny else T5Config(), dtype),
                            load_tokenizer(tok / "tokenizer"), load_t5_tokenizer(tok / "tokenizer_2"))
    transformer = FluxTransformer2DModel(_flux_config(tiny, FluxConfig), dtype)
    vae = AutoencoderKL(_flux_vae_config(tiny, AutoencoderKLConfig), dtype)
    pipe = FluxPipeline(transformer, text, vae)
    flame.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, steps=args.steps, guidance=3.5, width=args.size, height=args.size, seed=0)
    first, times = _times(run, args, flame.synchronize)
    return {"s": statistics.median(times), "first_s": first, "peak_gib": flame.max_memory_allocated() / 2**30}


def _flux_config(tiny, FluxConfig):
    """Flux.1-dev's transformer, or for ``--config tiny`` the tiny one taking the tiny CLIP's 12 wide vector."""
    import dataclasses
    return dataclasses.replace(FluxConfig.tiny(), pooled_projection_dim=12) if tiny else FluxConfig()


def _flux_vae_config(tiny, AutoencoderKLConfig):
    """Flux.1's VAE, or for ``--config tiny`` a tiny one with the tiny transformer's 4 latent channels."""
    import dataclasses
    return dataclasses.replace(AutoencoderKLConfig.tiny_flux(), latent_channels=4) if tiny else \
        AutoencoderKLConfig.flux()


def diffusers_flux_pipeline(args, compiled):
    import diffusers
    import torch
    import transformers

    from flame.diffusion.samplers import FLUX_SCHEDULER_CONFIG
    from flame.models import FluxConfig
    from flame.models.clip_text import CLIPTextConfig
    from flame.models.t5 import T5Config
    from flame.models.vae import AutoencoderKLConfig
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tiny = args.config == "tiny"
    tok = _tokenizer_folder()
    torch.set_default_dtype(dtype)  # the random models are built in bf16 on the GPU: no fp32 copy of 12B weights
    with torch.device(dev):
        parts = {
            "transformer": diffusers.FluxTransformer2DModel(**_flux_config(tiny, FluxConfig).to_diffusers()),
            "vae": diffusers.AutoencoderKL(**_flux_vae_config(tiny, AutoencoderKLConfig).to_diffusers()),
            "text_encoder": transformers.CLIPTextModel(transformers.CLIPTextConfig(
                **(CLIPTextConfig.tiny() if tiny else CLIPTextConfig.sdxl_clip_l()).to_transformers())),
            "text_encoder_2": transformers.T5EncoderModel(transformers.T5Config(
                **(T5Config.tiny() if tiny else T5Config()).to_transformers()))}
    torch.set_default_dtype(torch.float32)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        **{k: v for k, v in FLUX_SCHEDULER_CONFIG.items() if k != "_class_name"})
    pipe = diffusers.FluxPipeline(scheduler=scheduler, tokenizer=transformers.CLIPTokenizer.from_pretrained(
        tok / "tokenizer"), tokenizer_2=transformers.T5TokenizerFast.from_pretrained(tok / "tokenizer_2"),
        **{k: m.eval() for k, m in parts.items()})
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        pipe.transformer = torch.compile(pipe.transformer)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = lambda: pipe(PROMPT, num_inference_steps=args.steps, guidance_scale=3.5, width=args.size,
                       height=args.size, generator=torch.Generator(dev).manual_seed(0), output_type="np")
    with torch.no_grad():
        first, times = _times(run, args, sync)
    return {"s": statistics.median(times), "first_s": first,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}


FLUX_PARTS = {
    "pipeline": [("flame (CUDA graph)", flame_flux_pipeline),
                 ("diffusers", lambda a: diffusers_flux_pipeline(a, False)),
                 ("diffusers (torch.compile)", lambda a: diffusers_flux_pipeline(a, True))],
    "cache": [("flame", lambda a: cache_encoders(a, "flame")), ("diffusers", lambda a: cache_encoders(a, "diffusers"))],
}

PARTS = {
    "pipeline": [("flame (CUDA graph)", lambda a: flame_pipeline(a, True)),
                 ("flame (eager)", lambda a: flame_pipeline(a, False)),
                 ("diffusers", diffusers_pipeline),
                 ("diffusers (torch.compile)", lambda a: diffusers_pipeline(a, True))],
    "step": [("flame (CUDA graph)", lambda a: flame_step(a, True)),
             ("flame (eager)", lambda a: flame_step(a, False)),
             ("diffusers (CUDA graph)", lambda a: diffusers_step(a, True)),
             ("diffusers (torch.compile + CUDA graph)", lambda a: diffusers_step(a, True, compiled=True)),
             ("diffusers (eager)", lambda a: diffusers_step(a, False))],
    "vae": [(f"{fw} {k}", functools.partial(fn, which=k))
            for k in (0, 1) for fw, fn in (("flame", flame_vae), ("diffusers", diffusers_vae))],
    "cache": [("flame", lambda a: cache_encoders(a, "flame")), ("diffusers", lambda a: cache_encoders(a, "diffusers"))],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("sdxl", "flux"), default="sdxl", help="the model family measured")
    p.add_argument("--only", choices=sorted(set(PARTS) | set(FLUX_PARTS)), action="append",
                   help="parts to measure (default: all of the family's)")
    p.add_argument("--config", choices=("full", "tiny"), default="full",
                   help="the family's real architectures, or the tests' tiny ones (CPU smoke test)")
    p.add_argument("--model", help="an existing pipeline folder (default: write a random one)")
    p.add_argument("--size", type=int, default=1024, help="image side for the pipeline and cache parts")
    p.add_argument("--vae-sizes", type=lambda t: [int(v) for v in t.split(",")], default=[1024, 2048],
                   help="the two image sides of the vae part")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--step-calls", type=int, default=20,
                   help="UNet calls per timing of the step part (synchronized once, after the last)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each part's sides this many times, alternating their order; report the medians")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--profile", action="store_true", help="print each part's GPU time by kernel (stderr)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one (part, framework) process may take")
    p.add_argument("--skip", action="append", default=[], metavar="TEXT",
                   help="leave out the (part, framework) runs whose name contains TEXT, e.g. compile")
    p.add_argument("--run", help=argparse.SUPPRESS)  # internal: "part:index" in a child process
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = FLUX_PARTS if args.family == "flux" else PARTS
    if args.run:
        part, index = args.run.split(":")
        print(json.dumps(parts[part][int(index)][1](args)))
        return 0
    unknown = [p for p in args.only or [] if p not in parts]
    if unknown:
        raise SystemExit(f"--only {', '.join(unknown)}: not a part of the {args.family} benchmark ({', '.join(parts)})")
    with tempfile.TemporaryDirectory() as tmp:
        todo = args.only or list(parts)
        if args.model is None and (args.family == "sdxl" or "cache" in todo):
            write = write_random_pipeline if args.family == "sdxl" else write_random_flux_encoders
            args.model = str(write(Path(tmp) / args.family, args.config))
        rounds = [{} for _ in range(args.rounds)]
        for part in todo:
            sides = [(i, name) for i, (name, _) in enumerate(parts[part]) if not any(t in name for t in args.skip)]
            for r, got in enumerate(rounds):  # every other round in reverse order: drift of the host hits both sides
                for i, name in sides if r % 2 == 0 else sides[::-1]:
                    got[f"{part}/{name}"] = _run_side(args, part, i)
                    print(f"{part}/{name}{f' (round {r + 1})' if args.rounds > 1 else ''}: {got[f'{part}/{name}']}",
                          flush=True)
    results = _median_rounds(rounds)
    results["vae sizes"] = args.vae_sizes
    for r, got in enumerate(rounds if args.rounds > 1 else ()):
        print(f"round {r + 1}:")
        _ratios(got)
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds:")
    _ratios(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _run_side(args, part, index):
    """One (part, side) in a process of its own: its result dict, or {"error": ...}."""
    cmd = [sys.executable, __file__, "--run", f"{part}:{index}", "--family", args.family, "--config",
           args.config, "--size", str(args.size), "--steps", str(args.steps), "--repeat", str(args.repeat),
           "--step-calls", str(args.step_calls), "--vae-sizes", ",".join(map(str, args.vae_sizes))] + \
        (["--model", args.model] if args.model else []) + (["--profile"] if args.profile else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {args.timeout:g} s"}
    if args.profile:
        print("\n".join(line for line in r.stderr.splitlines() if line.startswith('{"gpu_ms"')))
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return {"error": r.stderr.strip().splitlines()[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _median_rounds(rounds):
    """One result per side from its rounds: each number the median over the rounds that gave one
    (their values under ``rounds``), an error where every round failed."""
    merged = {}
    for key in rounds[0]:
        ok = [got[key] for got in rounds if "error" not in got[key]]
        if not ok:
            merged[key] = rounds[0][key]
            continue
        merged[key] = {k: statistics.median(r[k] for r in ok) if isinstance(v, (int, float)) else v
                       for k, v in ok[0].items()}
        if len(rounds) > 1:
            merged[key]["rounds"] = [r.get("s", r.get("ms", r.get("images_per_s"))) for r in ok]
    return merged


def _ratios(results):
    def ratio(a, b, key):
        ra, rb = results.get(a, {}), results.get(b, {})
        if ra.get(key) and rb.get(key):
            print(f"{a} / {b} ({key}): {ra[key] / rb[key]:.3f}")
    for part, time_key in (("pipeline", "s"), ("step", "ms")):
        names = [name for name, _ in PARTS[part]]
        for name in (n for n in names if n.startswith("flame")):
            for baseline in (n for n in names if n.startswith("diffusers")):
                ratio(f"{part}/{name}", f"{part}/{baseline}", time_key)
                ratio(f"{part}/{name}", f"{part}/{baseline}", "peak_gib")
    for k in (0, 1):
        ratio(f"vae/flame {k}", f"vae/diffusers {k}", "s")
        ratio(f"vae/flame {k}", f"vae/diffusers {k}", "peak_gib")
    ratio("cache/flame", "cache/diffusers", "images_per_s")


if __name__ == "__main__":
    sys.exit(main())
