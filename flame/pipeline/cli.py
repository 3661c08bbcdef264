"""``flame-sample --model PATH --prompt TEXT [options]``: SDXL images with flame, optionally with LoRAs.

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

from ..diffusion.samplers import SAMPLERS
from ..tensor import bfloat16, float32

PROG = "flame-sample"


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
                   help="SDXL diffusers pipeline folder, or one single-file .safetensors checkpoint")
    p.add_argument("--tokenizers", type=pathlib.Path,
                   help="pipeline folder whose tokenizer/ and tokenizer_2/ to use (a single file carries none)")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="LoRA file (PEFT or kohya) added at STRENGTH (default 1); repeatable")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeatable")
    prompts.add_argument("--prompts", type=pathlib.Path, metavar="FILE",
                         help="text file with one prompt per line (empty lines and # comments skipped)")
    p.add_argument("--negative-prompt", default=None, help="negative prompt for every image")
    p.add_argument("--steps", type=_positive(int), default=30, help="sampling steps")
    p.add_argument("--cfg", type=float, default=5.0, help="classifier-free guidance scale (1 = none)")
    p.add_argument("--width", type=_positive(int), default=1024, help="image width in pixels")
    p.add_argument("--height", type=_positive(int), default=1024, help="image height in pixels")
    p.add_argument("--seed", type=int, default=0, help="image k of a prompt uses seed + k")
    p.add_argument("--sampler", choices=SAMPLERS, default="euler", help="sampling method")
    p.add_argument("--batch", type=_positive(int), default=1, help="images per prompt, made in one batch")
    p.add_argument("--max-tokens", type=int, choices=(75, 150, 225), default=75,
                   help="caption length in tokens (longer captions are cut, with a warning)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="UNet and text encoder precision (default bf16 on a GPU, fp32 on the CPU interpreter)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run each step's UNet call eagerly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("samples"), help="output folder")
    return p.parse_args(argv)


def _next_index(out: pathlib.Path) -> int:
    taken = [int(m.group(1)) for f in out.iterdir() if (m := re.match(r"(?:grid-)?(\d{5})", f.name))]
    return max(taken, default=-1) + 1


def run(args) -> list:
    """Generate the images ``args`` describe; returns the written paths."""
    from tqdm import tqdm

    from .images import save_grid, save_png
    from .sdxl import SDXLPipeline, encode_prompts, generate, parse_lora, read_prompt_file

    prompts = read_prompt_file(args.prompts) if args.prompts else list(args.prompt)
    loras = [parse_lora(spec) for spec in args.lora]
    missing = [str(path) for path, _ in loras if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"LoRA file(s) not found: {', '.join(missing)}")
    dtype = {"bf16": bfloat16, "fp32": float32, None: None}[args.dtype]
    pipe = SDXLPipeline.from_pretrained(args.model, dtype=dtype, tokenizer_path=args.tokenizers)
    for path, strength in loras:
        pipe.load_lora(path, strength)
    args.out.mkdir(parents=True, exist_ok=True)
    index = _next_index(args.out)
    written, images = [], []
    bar = tqdm(total=len(prompts) * args.steps, desc="sampling", unit="step", disable=args.no_progress,
               dynamic_ncols=True)
    try:
        for prompt in prompts:
            cond = encode_prompts(pipe.text_encoders, [prompt] * args.batch, args.negative_prompt,
                                  pipe.force_zeros_for_empty_prompt, args.max_tokens)
            made = generate(pipe.unet, pipe.vae, cond, pipe.scheduler_config, steps=args.steps, cfg=args.cfg,
                            width=args.width, height=args.height, seed=args.seed, sampler=args.sampler,
                            cuda_graph=not args.no_cuda_graph, progress=lambda: bar.update(1),
                            predict=None if args.no_cuda_graph else pipe.predict)
            for k, image in enumerate(made):
                settings = {"prompt": prompt, "negative_prompt": args.negative_prompt or "", "steps": args.steps,
                            "sampler": args.sampler, "cfg": args.cfg, "seed": args.seed + k,
                            "size": f"{args.width}x{args.height}", "model": pathlib.Path(args.model).name,
                            "loras": ", ".join(f"{name}:{s:g}" for name, s in pipe.loras)}
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
