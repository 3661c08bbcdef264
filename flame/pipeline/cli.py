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
file, a LoRA for another model, ...), with one ``flame-sample: error:`` line; 130 on Ctrl-C (images
already written are kept). Every input that can be checked without the weights (the prompts, the
LoRA files' headers, the model folder and family, the family's options, the image size against the
checkpoint's config.json files) is checked before any model loads.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from ..diffusion.samplers import FLOW_SAMPLERS, SAMPLERS, make_sampler
from ..io import stored_shapes
from ..models import AutoencoderKLConfig, SDXLUNetConfig
from ..models.families import MODEL_CLASSES, PIPELINE_CLASSES, checkpoint_family, class_name
from ..nn.lora import detect_format
from ..tensor import bfloat16, float32

PROG = "flame-sample"
DEFAULTS = {"sdxl": {"steps": 30, "cfg": 5.0, "sampler": "euler"},
            "flux": {"cfg": 1.0, "sampler": "flow_euler"}}  # Flux's steps: 28 for dev, 4 for schnell
T5_MAX_TOKENS = 512  # FluxTextEncoders' limit of --max-sequence-length


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""),
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
                   help=f"Flux: T5 tokens per prompt, 1 to {T5_MAX_TOKENS} (default: dev 512, schnell 256)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="model and text encoder precision (default bf16 on a GPU, fp32 on the CPU interpreter)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run each step's model call eagerly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("samples"), help="output folder")
    return p.parse_args(argv)


def _next_index(out: pathlib.Path) -> int:
    taken = [int(m.group(1)) for f in out.iterdir() if (m := re.match(r"(?:grid-)?(\d{5})", f.name))]
    return max(taken, default=-1) + 1


def _what_is_there(path: pathlib.Path) -> str:
    """"no such file", "a folder, not a file" or "" for a file."""
    return "" if path.is_file() else "a folder, not a file" if path.is_dir() else "no such file"


def read_prompts(args) -> list:
    """The prompts of ``--prompt`` or of the ``--prompts`` file; ValueError naming the option."""
    if args.prompts is None:
        return list(args.prompt)
    from .stages import read_prompt_file
    path = args.prompts
    if _what_is_there(path):
        raise ValueError(f"--prompts {path}: {_what_is_there(path)}")
    try:
        return read_prompt_file(path)
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {path}: not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"--prompts {path}: cannot be read ({e.strerror})") from None
    except ValueError:
        raise ValueError(f"--prompts {path}: no prompt in it (empty lines and lines starting with # are "
                         "skipped)") from None


def read_loras(args) -> list:
    """(path, strength) of each ``--lora``, each file's header checked to be a LoRA's (its layers
    are checked against the model once it is loaded)."""
    from .stages import parse_lora
    loras = [parse_lora(spec) for spec in args.lora]
    for path, _ in loras:
        if _what_is_there(path):
            raise ValueError(f"--lora {path}: {_what_is_there(path)}")
        try:
            keys = stored_shapes(path)
        except ValueError as e:  # names the file
            raise ValueError(f"--lora {e}") from None
        except OSError as e:
            raise ValueError(f"--lora {path}: cannot be read ({e.strerror})") from None
        try:
            detect_format(keys)
        except ValueError as e:
            raise ValueError(f"--lora {path}: {e}") from None
    return loras


def model_family(path: pathlib.Path) -> str:
    """"sdxl" or "flux" for ``--model``; ValueError saying what the path holds instead."""
    if not path.exists():
        raise ValueError(f"--model {path}: no such file or folder")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"--model {path}: not a .safetensors file (other formats are not supported: convert "
                             "them to safetensors)")
        try:
            stored_shapes(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {e}") from None
    pipeline = class_name(path / "model_index.json") if path.is_dir() else None
    family = checkpoint_family(path) if pipeline is None or pipeline in PIPELINE_CLASSES else None
    if family is not None:
        return family
    found = [f"its {name} names {cls}" for name in ("model_index.json", "config.json")
             if (cls := class_name(path / name)) is not None]
    raise ValueError(f"--model {path}: neither an SDXL nor a Flux checkpoint: "
                     + ("; ".join(found) if found else "no model_index.json or config.json in it")
                     + f" (a pipeline folder's model_index.json names {' or '.join(PIPELINE_CLASSES)})")


def _component_folder(path: pathlib.Path):
    """The model class a component folder's own config.json names (a pipeline's ``unet/`` or
    ``transformer/``), else None."""
    name = class_name(path / "config.json") if path.is_dir() else None
    return name if name in MODEL_CLASSES else None


def _component_config(source, subfolder: str, config_class, default):
    """``config_class`` of a component's config.json, read without its weights: ``source`` is a
    pipeline folder holding ``subfolder/`` or that folder itself; ``default`` (the family's) for a
    single file."""
    p = pathlib.Path(source)
    for candidate in (p / "config.json", p / subfolder / "config.json"):  # the loaders' order
        if candidate.is_file():
            try:
                return config_class.from_diffusers(json.loads(candidate.read_text()))
            except json.JSONDecodeError as e:
                raise ValueError(f"{candidate} is not valid JSON ({e})") from None
    return default


def _check_image_size(args, factor: int, why: str) -> None:
    """``check_image_size`` of ``--width`` and ``--height``, the message saying where ``factor`` comes from."""
    from .stages import check_image_size
    try:
        check_image_size(args.width, args.height, factor)
    except ValueError as e:
        raise ValueError(f"--width/--height: {e} ({why})") from None


class _Sdxl:
    """flame-sample's SDXL side: the request checked at once, then the whole pipeline loaded."""

    family = "sdxl"

    def __init__(self, args):
        if args.clip or args.t5 or args.vae:
            raise ValueError("--clip, --t5 and --vae are Flux options; an SDXL checkpoint holds its own")
        if args.max_sequence_length is not None:
            raise ValueError("--max-sequence-length is a Flux option (SDXL: --max-tokens)")
        if args.sampler not in SAMPLERS:
            raise ValueError(f"--sampler {args.sampler}: SDXL samples with {', '.join(SAMPLERS)} (the flow_ samplers "
                             "are Flux's)")
        if _component_folder(args.model):
            raise ValueError(f"--model {args.model}: the folder of one component ({_component_folder(args.model)}); "
                             "give the pipeline folder that holds it (unet/, vae/, text_encoder/, tokenizer/, ...) "
                             "or a single-file checkpoint")
        if args.base is not None and not args.base.is_dir():
            raise ValueError(f"--base {args.base}: not a folder (a pipeline folder with tokenizer/ and tokenizer_2/)")
        vae = _component_config(args.model, "vae", AutoencoderKLConfig, AutoencoderKLConfig.sdxl())
        unet = _component_config(args.model, "unet", SDXLUNetConfig, SDXLUNetConfig())
        levels = 2 ** (len(unet.block_out_channels) - 1)  # the UNet's downsamplings
        _check_image_size(args, vae.downsample_factor * levels,
                          f"the VAE's {vae.downsample_factor}x downsampling times the UNet's {levels}x")
        self.args = args
        self.steps = args.steps or DEFAULTS["sdxl"]["steps"]
        self.pipe = None

    def load(self, dtype):
        from .sdxl import SDXLPipeline
        self.pipe = SDXLPipeline.from_pretrained(self.args.model, dtype=dtype, tokenizer_path=self.args.base)

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
    """flame-sample's Flux side: the request checked at once; text encoders first (then freed),
    then the transformer and VAE."""

    family = "flux"

    def __init__(self, args):
        from .flux import component_sources
        if args.sampler not in FLOW_SAMPLERS:
            raise ValueError(f"--sampler {args.sampler}: Flux samples with {', '.join(FLOW_SAMPLERS)}")
        if args.max_tokens != 75:
            raise ValueError("--max-tokens is an SDXL option (Flux: --max-sequence-length)")
        length = args.max_sequence_length
        if length is not None and not 1 <= length <= T5_MAX_TOKENS:
            raise ValueError(f"--max-sequence-length must be 1 to {T5_MAX_TOKENS} (T5 tokens per prompt), got {length}")
        if _component_folder(args.model) and args.base is None:
            raise ValueError(f"--model {args.model}: the folder of one component ({_component_folder(args.model)}); "
                             "give the Flux pipeline folder that holds it, or the one for the other parts with --base")
        self.args = args
        self.sources = component_sources(args.model, args.base, args.clip, args.t5, args.vae)
        vae = _component_config(self.sources["vae"], "vae", AutoencoderKLConfig, AutoencoderKLConfig.flux())
        _check_image_size(args, 2 * vae.downsample_factor,
                          f"the VAE's {vae.downsample_factor}x downsampling times the transformer's 2x2 patches")
        self.pipe = None

    def load(self, dtype):
        from .flux import default_dtype
        self.dtype = default_dtype(dtype)

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


def check_request(args):
    """Everything about a request that can be checked before a model loads (ValueError or
    FileNotFoundError naming the option); returns (the family's side, not loaded yet, prompts, LoRAs)."""
    prompts = read_prompts(args)
    loras = read_loras(args)
    family = model_family(args.model)
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: a file, not a folder")
    for key, value in DEFAULTS[family].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return (_Flux if family == "flux" else _Sdxl)(args), prompts, loras


def run(args) -> list:
    """Generate the images ``args`` describe; returns the written paths."""
    from tqdm import tqdm

    from .images import save_grid, save_png

    side, prompts, loras = check_request(args)
    side.load({"bf16": bfloat16, "fp32": float32, None: None}[args.dtype])
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
