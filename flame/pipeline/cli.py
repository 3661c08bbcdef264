"""``flame-sample --model PATH --prompt TEXT [options]``: SDXL or Flux.1 images with flame, optionally
with LoRAs.

The model family comes from the checkpoint: a pipeline folder's ``model_index.json``, or a single
file's tensor names. A single Flux file holds the transformer only: ``--base`` names a Flux pipeline
folder for the tokenizers and every other part, or ``--clip``, ``--t5`` and ``--vae`` name the files
people download (``clip_l.safetensors``, ``t5xxl_fp16.safetensors``, ``ae.safetensors``; the
tokenizers still come from ``--base``). Flux's prompts are all encoded first and the text encoders
freed before the transformer loads, so T5-XXL and the transformer never share GPU memory.

Writes one PNG per image into ``--out`` (named ``NNNNN-SEED.png``, never overwriting), each with its
prompt and settings in the PNG text metadata, plus ``grid-NNNNN.png`` when a call makes more than
one image. Exit status: 0 when the images were written; 2 for a usage or input error (a missing
file, a LoRA for another model, ...); 130 on Ctrl-C (images already written are kept).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

from ..diffusion.samplers import FLOW_SAMPLERS, SAMPLERS, make_sampler
from ..models.families import checkpoint_family
from ..tensor import bfloat16, float32

PROG = "flame-sample"
DEFAULTS = {"sdxl": {"steps": 30, "cfg": 5.0, "sampler": "euler"},
            "flux": {"cfg": 1.0, "sampler": "flow_euler"}}  # Flux's steps: 28 for dev, 4 for schnell


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, type=pathlib.Path,
                   help="SDXL or Flux diffusers pipeline folder, or one single-file .safetensors checkpoint")
    p.add_argument("--base", "--tokenizers", dest="base", type=pathlib.Path,
                   help="pipeline folder giving what a single file lacks: the tokenizers (SDXL: tokenizer/ and "
                        "tokenizer_2/), and for Flux the text encoders, VAE and scheduler not given by file")
    p.add_argument("--clip", type=pathlib.Path, help="Flux: CLIP-L file (clip_l.safetensors) or folder")
    p.add_argument("--t5", type=pathlib.Path, help="Flux: T5-XXL encoder file (t5xxl_fp16.safetensors) or folder")
    p.add_argument("--vae", type=pathlib.Path, help="Flux: VAE file (ae.safetensors) or folder")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="LoRA file (PEFT or kohya) added at STRENGTH (default 1); repeatable")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeatable")
    prompts.add_argument("--prompts", type=pathlib.Path, metavar="FILE",
                         help="text file with one prompt per line (empty lines and # comments skipped)")
    p.add_argument("--negative-prompt", default=None,
                   help="negative prompt for every image (Flux: used by true CFG, --cfg above 1)")
    p.add_argument("--steps", type=_positive(int), default=None,
                   help="sampling steps (default: SDXL 30, Flux.1-dev 28, Flux.1-schnell 4)")
    p.add_argument("--cfg", type=float, default=None,
                   help="classifier-free guidance scale, 1 = none (default: SDXL 5; Flux 1, above 1 it is "
                        "diffusers' true_cfg_scale, two model rows a step)")
    p.add_argument("--guidance", type=float, default=3.5, help="Flux.1-dev's distilled guidance (a model input)")
    p.add_argument("--width", type=_positive(int), default=1024, help="image width in pixels")
    p.add_argument("--height", type=_positive(int), default=1024, help="image height in pixels")
    p.add_argument("--seed", type=int, default=0, help="image k of a prompt uses seed + k")
    p.add_argument("--sampler", choices=SAMPLERS + FLOW_SAMPLERS, default=None,
                   help="sampling method (default: SDXL euler, Flux flow_euler; Flux takes "
                        f"{', '.join(FLOW_SAMPLERS)})")
    p.add_argument("--batch", type=_positive(int), default=1, help="images per prompt, made in one batch")
    p.add_argument("--max-tokens", type=int, choices=(75, 150, 225), default=75,
                   help="SDXL: caption length in tokens (longer captions are cut, with a warning)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="Flux: T5 tokens per prompt, at most 512 (default: dev 512, schnell 256)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="model and text encoder precision (default bf16 on a GPU, fp32 on the CPU interpreter)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run each step's model call eagerly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("samples"), help="output folder")
    return p.parse_args(argv)


def _next_index(out: pathlib.Path) -> int:
    taken = [int(m.group(1)) for f in out.iterdir() if (m := re.match(r"(?:grid-)?(\d{5})", f.name))]
    return max(taken, default=-1) + 1


class _Sdxl:
    """flame-sample's SDXL side: the whole pipeline loaded at once."""

    family = "sdxl"

    def __init__(self, args, dtype):
        from .sdxl import SDXLPipeline
        if args.clip or args.t5 or args.vae:
            raise ValueError("--clip, --t5 and --vae are Flux options; an SDXL checkpoint holds its own")
        if args.max_sequence_length is not None:
            raise ValueError("--max-sequence-length is a Flux option (SDXL: --max-tokens)")
        self.args = args
        self.pipe = SDXLPipeline.from_pretrained(args.model, dtype=dtype, tokenizer_path=args.base)
        self.steps = args.steps or DEFAULTS["sdxl"]["steps"]

    def encode(self, prompts):
        from .sdxl import encode_prompts
        a = self.args
        return [encode_prompts(self.pipe.text_encoders, [p] * a.batch, a.negative_prompt,
                               self.pipe.force_zeros_for_empty_prompt, a.max_tokens) for p in prompts]

    def load_denoiser(self):
        return self.pipe

    def generate(self, cond, progress):
        from .sdxl import generate
        a, pipe = self.args, self.pipe
        return generate(pipe.unet, pipe.vae, cond, pipe.scheduler_config, steps=self.steps, cfg=a.cfg, width=a.width,
                        height=a.height, seed=a.seed, sampler=a.sampler, cuda_graph=not a.no_cuda_graph,
                        progress=progress, predict=None if a.no_cuda_graph else pipe.predict)

    def settings(self):
        return {}


class _Flux:
    """flame-sample's Flux side: text encoders first (then freed), then the transformer and VAE."""

    family = "flux"

    def __init__(self, args, dtype):
        from .flux import component_sources, default_dtype
        if args.sampler not in FLOW_SAMPLERS:
            raise ValueError(f"--sampler {args.sampler}: Flux samples with {', '.join(FLOW_SAMPLERS)}")
        if args.max_tokens != 75:
            raise ValueError("--max-tokens is an SDXL option (Flux: --max-sequence-length)")
        self.args = args
        self.sources = component_sources(args.model, args.base, args.clip, args.t5, args.vae)
        self.dtype = default_dtype(dtype)
        self.pipe = None

    def encode(self, prompts):
        from .flux import MAX_SEQUENCE_LENGTH, encode_prompts, load_text_encoders, transformer_config, variant
        a = self.args
        length = a.max_sequence_length or MAX_SEQUENCE_LENGTH[variant(transformer_config(self.sources))]
        text = load_text_encoders(self.sources, self.dtype)
        try:
            return [encode_prompts(text, [p] * a.batch, a.negative_prompt, length) for p in prompts]
        finally:
            del text  # T5-XXL leaves GPU memory before the transformer arrives

    def load_denoiser(self):
        from .flux import FluxPipeline, load_transformer, load_vae, scheduler_settings, variant
        transformer = load_transformer(self.sources, self.dtype)
        vae = load_vae(self.sources["vae"], self.dtype)
        self.pipe = FluxPipeline(transformer, None, vae, scheduler_settings(self.sources["base"], variant(transformer)),
                                 str(self.args.model))
        return self.pipe

    def generate(self, cond, progress):
        from .flux import DEFAULT_STEPS, generate
        a, pipe = self.args, self.pipe
        return generate(pipe.transformer, pipe.vae, cond, pipe.scheduler_config,
                        steps=a.steps or DEFAULT_STEPS[pipe.variant], guidance=a.guidance, true_cfg=a.cfg,
                        width=a.width, height=a.height, seed=a.seed, sampler=a.sampler,
                        cuda_graph=not a.no_cuda_graph, progress=progress,
                        predict=None if a.no_cuda_graph else pipe.predict)

    def settings(self):
        from .flux import DEFAULT_STEPS
        return {"guidance": self.args.guidance if self.pipe.variant == "dev" else None,
                "steps": self.args.steps or DEFAULT_STEPS[self.pipe.variant]}


def run(args) -> list:
    """Generate the images ``args`` describe; returns the written paths."""
    from tqdm import tqdm

    from .images import save_grid, save_png
    from .stages import parse_lora, read_prompt_file

    prompts = read_prompt_file(args.prompts) if args.prompts else list(args.prompt)
    loras = [parse_lora(spec) for spec in args.lora]
    missing = [str(path) for path, _ in loras if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"LoRA file(s) not found: {', '.join(missing)}")
    if not args.model.exists():
        raise FileNotFoundError(f"--model {args.model} does not exist")
    family = checkpoint_family(args.model)
    if family is None:
        raise ValueError(f"--model {args.model}: neither an SDXL nor a Flux checkpoint (a pipeline folder has a "
                         "model_index.json naming StableDiffusionXLPipeline or FluxPipeline)")
    for key, value in DEFAULTS[family].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    dtype = {"bf16": bfloat16, "fp32": float32, None: None}[args.dtype]
    side = (_Flux if family == "flux" else _Sdxl)(args, dtype)
    conditioning = side.encode(prompts)
    pipe = side.load_denoiser()
    for path, strength in loras:
        pipe.load_lora(path, strength)
    args.out.mkdir(parents=True, exist_ok=True)
    index = _next_index(args.out)
    written, images = [], []
    extra = side.settings()
    steps = extra.get("steps", args.steps)
    flow = args.sampler in FLOW_SAMPLERS  # model calls per image: a Heun sampler makes 2 per step but the last
    calls = len(make_sampler(args.sampler, steps, pipe.scheduler_config, image_seq_len=1 if flow else None).timesteps)
    bar = tqdm(total=len(prompts) * calls, desc="sampling", unit="call", disable=args.no_progress, dynamic_ncols=True)
    try:
        for prompt, cond in zip(prompts, conditioning):
            made = side.generate(cond, lambda: bar.update(1))
            for k, image in enumerate(made):
                settings = {"prompt": prompt, "negative_prompt": args.negative_prompt or "", "steps": steps,
                            "sampler": args.sampler, "cfg": args.cfg, "seed": args.seed + k,
                            "size": f"{args.width}x{args.height}", "model": pathlib.Path(args.model).name,
                            "loras": ", ".join(f"{name}:{s:g}" for name, s in pipe.loras), **extra}
                written.append(save_png(image, args.out / f"{index:05d}-{args.seed + k}.png", settings))
                images.append(image)
                index += 1
    finally:
        bar.close()
    if len(images) > 1:
        written.append(save_grid(images, args.out / f"grid-{index - len(images):05d}.png", columns=args.batch
                                 if len(prompts) > 1 and args.batch > 1 else None))
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        written = run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} file(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
