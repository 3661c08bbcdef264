#!/usr/bin/env python3
"""Build a latent cache for SDXL or Flux.1 LoRA training (see flame/data/cache.py for the format).

From an image folder, with a local checkpoint, encoded by flame's VAE and text encoders; the family
comes from ``--model`` (a pipeline folder's ``model_index.json``, a single file's tensor names).
SDXL: a diffusers pipeline folder (vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/)
or one single-file checkpoint (its tokenizers from ``--base``, a pipeline folder)::

    python scripts/prepare_cache.py CACHE_DIR --images DATA_DIR --model /models/stable-diffusion-xl-base-1.0

Flux.1 (dev or schnell): a diffusers pipeline folder, or the transformer's single file with ``--base``
(a Flux pipeline folder: the tokenizers and every part not given) and/or the files people download,
``--clip``, ``--t5``, ``--vae``, as ``flame-sample`` takes them (only the transformer's config is
read, for the variant)::

    python scripts/prepare_cache.py CACHE_DIR --images DATA_DIR --model /models/FLUX.1-dev
    python scripts/prepare_cache.py CACHE_DIR --images DATA_DIR --model flux1-dev.safetensors \
        --base /models/FLUX.1-dev --clip clip_l.safetensors --t5 t5xxl_fp16.safetensors --vae ae.safetensors

``--encoders diffusers`` encodes through diffusers/transformers instead (``pip install -e ".[interop]"``;
pipeline folders only), for cross-checks: both write the same format.

DATA_DIR is read as the trainer's ``data.images`` reads it, by the same code (``flame.data.images``):
images searched recursively; captions from ``metadata.jsonl`` (lines ``{"file_name": ..., "text":
...}``) or from a file with the image's name and ``--caption-extension`` (``cat.png`` -> ``cat.txt``,
or kohya's ``cat.caption``); images without one are a warning (``--require-captions``: an error);
images Pillow cannot read are an error (``--bad-images skip``: a warning). kohya's subfolders
``N_name`` are cached each in CACHE_DIR/N_name, and the command prints the ``data.datasets`` entries
that train them N times per epoch. Each image goes to the aspect bucket (multiples of
``--bucket-step`` px, 64 by default; Flux may take 16, about ``--resolution``^2 pixels) nearest its
aspect ratio, is scaled to cover it and cropped (centred, or ``--random-crop``). Time ids are the
original size, crop and bucket size (SDXL's conditioning; Flux's trainer ignores them); the empty
caption's embeddings are stored for caption dropout.

A CACHE_DIR that holds a cache already is refreshed: the rows of images whose bytes, caption and
settings are unchanged are kept, new and changed images are encoded, removed ones leave (an
unchanged folder loads no model). Errors (a missing or wrong ``--model``, bucket sizes, an unreadable
image, a folder without images) are one ``error:`` line and exit status 2, found before any model
loads; nothing is written then.

- SDXL: latents are the VAE's (4 channels, times its scaling factor), text embeddings the
  penultimate hidden states of both CLIP encoders (77 x 2048), pooled the CLIP-G projection (1280).
- Flux: latents are the Flux VAE's 16 channels, (z - shift_factor) * scaling_factor, stored unpacked
  (16, h, w) (the trainer packs 2x2 patches), text embeddings T5-XXL's last hidden states
  (``--max-sequence-length`` x 4096: 512 tokens for dev, 256 for schnell by default), pooled CLIP-L's
  pooled output (768). The index's meta records the family and both VAE factors. T5-XXL, CLIP-L and
  the VAE stay on the GPU together (about 10 GB in bf16: less than the transformer that trains on
  the cache). On disk, ``--text-dtype fp16`` (the default) takes 4 MB per caption at 512 tokens.

Without any model, a structured synthetic cache for demos and tests, with the dimensions of a
UNet config (``tiny``, ``sdxl`` or a diffusers config.json)::

    python scripts/prepare_cache.py CACHE_DIR --synthetic 64 --model-config tiny --latent-sizes 8x8,8x12
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flame.data import (
    BAD_IMAGES,
    BUCKET_UNIT,
    CacheSettings,
    DatasetError,
    LatentCache,
    plan_cache,
    scan_dataset,
    write_cache,
    write_synthetic_cache_for,
)
from flame.train.datasets import (
    FlameEncoders,
    FluxFlameEncoders,
    default_sequence_length,
    encoder_record,
    encoder_source_problem,
)

INTEROP_HINT = 'this needs diffusers, transformers and Pillow: pip install -e ".[interop]"'


def _sizes(text):
    try:
        out = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected sizes like 8x8,8x12 (latent h x w), got {text!r}")
    return out


def fail(message):
    """One ``error:`` line on stderr and exit status 2, as the trainer ends on a setting it refuses."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("cache_dir", type=Path, help="folder of the cache: created, or (--images) refreshed")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder of images with caption files or metadata.jsonl")
    src.add_argument("--synthetic", type=int, metavar="N", help="write N synthetic samples instead (no model)")
    p.add_argument("--model", type=Path, help="local SDXL or Flux.1 checkpoint, for --images: a diffusers pipeline "
                                              "folder or one single-file .safetensors (Flux: the transformer's)")
    p.add_argument("--base", "--tokenizers", dest="base", type=Path,
                   help="pipeline folder giving what a single-file --model lacks: the tokenizers (tokenizer/ and "
                        "tokenizer_2/), and for Flux the text encoders and VAE not given by --clip, --t5, --vae")
    p.add_argument("--clip", type=Path, help="Flux: CLIP-L file (clip_l.safetensors) or folder")
    p.add_argument("--t5", type=Path, help="Flux: T5-XXL encoder file (t5xxl_fp16.safetensors) or folder")
    p.add_argument("--vae", type=Path, help="Flux: VAE file (ae.safetensors) or folder")
    p.add_argument("--encoders", choices=["flame", "diffusers"], default="flame",
                   help="who encodes: flame's kernels, or diffusers/transformers (PyTorch) for cross-checks")
    p.add_argument("--max-tokens", type=int, choices=[75, 150, 225], default=75,
                   help="caption tokens (longer captions are cut, with a warning); 150/225 encode 75-token "
                        "windows (flame encoders only); SDXL only")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="Flux: T5 tokens per caption, at most 512 (default: dev 512, schnell 256)")
    p.add_argument("--model-config", default="sdxl", help="--synthetic: UNet config giving the dims (tiny, sdxl, "
                                                          "or a diffusers config.json)")
    p.add_argument("--latent-sizes", type=_sizes, help="--synthetic: latent buckets, e.g. 8x8,8x12 "
                                                       "(default: the square sample_size, and 7:9 for sizes from 64)")
    p.add_argument("--caption-extension", default=".txt", help="caption files beside the images (kohya: .caption)")
    p.add_argument("--require-captions", action="store_true", help="an image without a caption is an error")
    p.add_argument("--bad-images", choices=BAD_IMAGES, default="error",
                   help="images Pillow cannot read: an error, or skipped with a warning")
    p.add_argument("--resolution", type=int, default=1024, help="bucket area is about resolution^2 pixels")
    p.add_argument("--min-side", type=int, default=None, help="smallest bucket side in pixels (default resolution/2)")
    p.add_argument("--max-side", type=int, default=None, help="largest bucket side in pixels (default 2*resolution)")
    p.add_argument("--bucket-step", type=int, default=64,
                   help="bucket sides are multiples of this many pixels: of 64 for SDXL, of 16 for Flux (its VAE's 8 "
                        "times the transformer's 2x2 patches)")
    p.add_argument("--random-crop", action="store_true", help="crop at a random offset instead of the centre")
    p.add_argument("--caption-variants", type=int, default=1, metavar="K",
                   help="encode K captions per image: the caption, and K-1 with its comma-separated tags shuffled "
                        "(for the trainer's data.caption_variants)")
    p.add_argument("--keep-tokens", type=int, default=0, metavar="N",
                   help="--caption-variants: the first N tags stay in place (kohya's keep_tokens)")
    p.add_argument("--flip", action="store_true", help="also encode each image mirrored, for the trainer's data.flip "
                                                       "(twice the VAE work and latent storage)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share for the validation loss")
    p.add_argument("--val-samples", type=int, help="held-out samples (overrides --val-fraction)")
    p.add_argument("--batch-size", type=int, default=4, help="images per VAE / text-encoder batch")
    p.add_argument("--device", default=None, help="--encoders diffusers: torch device (default: cuda if available)")
    p.add_argument("--vae-dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="VAE precision (default: bf16 on a GPU with --encoders flame, else fp32; SDXL's VAE "
                        "overflows in fp16 unless it is the fp16-fixed one)")
    p.add_argument("--text-dtype", choices=["fp16", "fp32"], default="fp16", help="embeddings on disk")
    p.add_argument("--shard-size", type=int, default=256, help="samples per shard file")
    p.add_argument("--latents", choices=["sample", "mean"], default="sample",
                   help="store a sample of the VAE's latent distribution (as diffusers' and kohya's scripts) "
                        "or its mean")
    p.add_argument("--seed", type=int, default=0, help="latent sampling, random crops, synthetic data")
    args = p.parse_args(argv)
    if args.synthetic is not None and args.synthetic < 1:
        fail("--synthetic must be at least 1")
    if not 0.0 <= args.val_fraction < 1.0:
        fail("--val-fraction must be in [0, 1)")
    for name in ("resolution", "batch_size", "shard_size", "caption_variants"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be positive")
    if args.keep_tokens < 0:
        fail("--keep-tokens must not be negative")
    if args.images is not None:
        _check_model_options(args)
    elif (args.cache_dir / "index.json").exists():
        fail(f"{args.cache_dir} already holds a cache (index.json); remove it or pick another folder")
    return args


def _check_model_options(args):
    """Set ``args.family`` and ``args.settings`` (``CacheSettings``) from ``--model`` and the bucket
    options; refuse the other family's options and a checkpoint that lacks a part (``fail``)."""
    from flame.models.families import checkpoint_family
    if args.model is None:
        fail("--images needs --model (a local SDXL or Flux.1 checkpoint)")
    if not args.model.exists():
        fail(f"--model {args.model} does not exist")
    args.family = checkpoint_family(args.model)
    if args.family is None:
        fail(f"--model {args.model}: neither an SDXL nor a Flux.1 checkpoint (a pipeline folder has a "
             "model_index.json naming StableDiffusionXLPipeline or FluxPipeline)")
    flux_files = [f"--{k}" for k in ("clip", "t5", "vae") if getattr(args, k) is not None]
    if args.family == "sdxl":
        flux_options = flux_files + (["--max-sequence-length"] if args.max_sequence_length is not None else [])
        if flux_options:
            fail(f"{', '.join(flux_options)}: Flux options, and {args.model} is an SDXL checkpoint (which holds its "
                 "own encoders and VAE)")
        if args.encoders == "diffusers" and args.max_tokens != 75:
            fail("--max-tokens 150/225 needs --encoders flame")
        if args.encoders == "diffusers" and args.model.is_file():
            fail(f"--encoders diffusers reads a pipeline folder, and {args.model} is a single file; "
                 f"{SDXLEncoders.single_file_hint}")
    else:
        if args.max_tokens != 75:
            fail("--max-tokens is an SDXL option (Flux: --max-sequence-length)")
        if args.max_sequence_length is not None and not 1 <= args.max_sequence_length <= 512:
            fail(f"--max-sequence-length must be in [1, 512], got {args.max_sequence_length}")
        if args.encoders == "diffusers" and flux_files:
            fail(f"{', '.join(flux_files)}: single files need --encoders flame (--encoders diffusers reads a "
                 "pipeline folder: --model, or --base for a single-file transformer)")
    unit = BUCKET_UNIT[args.family]
    if args.bucket_step < 1 or args.bucket_step % unit:
        fail(f"--bucket-step must be a positive multiple of {unit} for {args.family}, got {args.bucket_step}")
    sides = [v for v in (args.min_side, args.max_side) if v is not None]
    if any(v % args.bucket_step for v in sides) or (len(sides) == 2 and sides[0] > sides[1]):
        fail(f"--min-side and --max-side must be multiples of --bucket-step {args.bucket_step}, the first at most "
             f"the second (got {args.min_side}, {args.max_side})")
    record = encoder_record(args.family, args.model, args.base, args.clip, args.t5, args.vae, args.max_tokens,
                            args.max_sequence_length, args.latents, args.encoders)
    args.settings = CacheSettings(model=record, resolution=args.resolution, min_side=args.min_side,
                                  max_side=args.max_side, bucket_step=args.bucket_step, random_crop=args.random_crop,
                                  flip=args.flip, caption_variants=args.caption_variants, keep_tokens=args.keep_tokens,
                                  seed=args.seed, text_dtype=args.text_dtype)
    try:
        args.settings.buckets()
    except DatasetError as e:
        fail(f"--resolution, --min-side, --max-side: {e}")
    problem = encoder_source_problem(args.family, args.model, args.base, args.clip, args.t5, args.vae)
    if problem:  # last: the options' errors need no checkpoint
        fail(f"--model: {problem}")


def make_encoders(args):
    """The encoders ``args`` asks for: flame's or diffusers' (``--encoders``), of ``args.family``."""
    if args.family == "sdxl":
        if args.encoders == "flame":
            return FlameEncoders(args.model, args.vae_dtype, args.seed, args.base, args.max_tokens, args.latents)
        return SDXLEncoders(args.model, args.device, args.vae_dtype, args.seed, args.latents)
    if args.encoders == "flame":
        return FluxFlameEncoders(args.model, args.vae_dtype, args.seed, args.latents,
                                 max_sequence_length=args.max_sequence_length, base=args.base, clip=args.clip,
                                 t5=args.t5, vae=args.vae)
    from flame.pipeline.flux import component_sources
    sources = component_sources(args.model, args.base)
    return FluxDiffusersEncoders(sources["base"], args.device, args.vae_dtype, args.seed, args.latents,
                                 args.max_sequence_length or default_sequence_length(sources))


def _progress(total, desc):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True)


# ---- synthetic ------------------------------------------------------------------------------------

def prepare_synthetic(cache_dir, num_samples, model_config="sdxl", latent_sizes=None, val_samples=None, seed=0,
                      shard_size=256, show_progress=True, flip=False):
    """A synthetic cache with the dims of ``model_config``; returns the folder."""
    from flame.train.families.sdxl import unet_config
    bar = _progress(num_samples, "synthetic") if show_progress else None
    try:
        return write_synthetic_cache_for(cache_dir, num_samples, unet_config(model_config), latent_sizes,
                                         val_samples=val_samples, seed=seed, shard_size=shard_size,
                                         progress=bar.update if bar else None, flipped=flip)
    finally:
        if bar:
            bar.close()


# ---- images ---------------------------------------------------------------------------------------

def _interop():
    """(torch, diffusers, transformers), or SystemExit saying how to install them."""
    try:
        import diffusers
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"error: {e.name or e} is not installed; {INTEROP_HINT}") from None
    return torch, diffusers, transformers


class _TorchVAEEncoders:
    """What the diffusers/transformers encoders of both families share: the pipeline folder's check,
    the device, and the VAE's latents ((latent_dist.sample() - shift_factor) * scaling_factor, or the
    mode). A subclass loads its text encoders and implements ``encode_prompts``."""

    family = checkpoint = single_file_hint = None
    components = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")  # alike in both families

    def __init__(self, path: Path, device=None, vae_dtype=None, seed=0, latents="sample"):
        torch, diffusers, _ = _interop()
        path = Path(path)
        missing = [d for d in self.components if not (path / d).is_dir()]
        if missing:
            raise SystemExit(f"error: {path} is not {self.checkpoint} checkpoint folder in diffusers layout (lacks "
                             f"{', '.join(missing)}/); {self.single_file_hint}")
        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        self.vae = diffusers.AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dt[vae_dtype or "fp32"])
        self.vae = self.vae.to(self.device).eval()
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.shift_factor = getattr(self.vae.config, "shift_factor", None)
        self.latent_channels = self.vae.config.latent_channels
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.sample_latents = latents == "sample"
        self.source = str(path)

    def text_dtype(self, on_gpu):
        """The text encoders' torch dtype: ``on_gpu`` on a GPU, float32 on the CPU."""
        return on_gpu if self.device.type == "cuda" else self.torch.float32

    def encode_images(self, pixels):
        """(B, 3, H, W) float32 NumPy array in [-1, 1] -> (B, C, H/8, W/8) scaled latents as NumPy float32."""
        torch = self.torch
        with torch.no_grad():
            x = torch.from_numpy(pixels).to(self.device, self.vae.dtype)
            dist = self.vae.encode(x).latent_dist
            z = dist.sample(self.generator) if self.sample_latents else dist.mode()
            if self.shift_factor is not None:
                z = z - self.shift_factor
            lat = z * self.scaling_factor
        return lat.float().cpu().numpy()


class SDXLEncoders(_TorchVAEEncoders):
    """The VAE and both text encoders of a local SDXL checkpoint, in PyTorch through diffusers/transformers."""

    family, checkpoint = "sdxl", "an SDXL"
    single_file_hint = ("single-file checkpoints: convert with diffusers' "
                        "StableDiffusionXLPipeline.from_single_file(...).save_pretrained(folder)")

    def __init__(self, path: Path, device=None, vae_dtype=None, seed=0, latents="sample"):
        super().__init__(path, device, vae_dtype, seed, latents)
        _, _, transformers = _interop()
        path, text_dtype = Path(path), self.text_dtype(self.torch.float16)
        self.tokenizers = [transformers.CLIPTokenizer.from_pretrained(path / d) for d in ("tokenizer", "tokenizer_2")]
        self.encoders = [transformers.CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=text_dtype),
                         transformers.CLIPTextModelWithProjection.from_pretrained(path / "text_encoder_2",
                                                                                  torch_dtype=text_dtype)]
        self.encoders = [e.to(self.device).eval() for e in self.encoders]
        self.text_len = self.tokenizers[0].model_max_length
        self.text_dim = sum(e.config.hidden_size for e in self.encoders)
        self.pooled_dim = self.encoders[1].config.projection_dim

    def encode_prompts(self, captions):
        """Both encoders' penultimate hidden states concatenated (B, 77, 2048) and CLIP-G's pooled
        projection (B, 1280), as diffusers' StableDiffusionXLPipeline.encode_prompt computes them."""
        torch = self.torch
        hidden = []
        with torch.no_grad():
            for tok, enc in zip(self.tokenizers, self.encoders):
                ids = tok(list(captions), padding="max_length", max_length=tok.model_max_length, truncation=True,
                          return_tensors="pt").input_ids.to(self.device)
                out = enc(ids, output_hidden_states=True)
                hidden.append(out.hidden_states[-2])
            pooled = out.text_embeds
        return torch.cat(hidden, dim=-1).float().cpu().numpy(), pooled.float().cpu().numpy()


class FluxDiffusersEncoders(_TorchVAEEncoders):
    """The VAE, CLIP-L and T5 of a local Flux.1 pipeline folder, in PyTorch through diffusers/transformers
    (the text encoders in bf16 on a GPU: T5 overflows in fp16). ``max_sequence_length``: T5 tokens
    per caption (default: 512 for dev, 256 for schnell, from the folder's transformer config)."""

    family, checkpoint = "flux", "a Flux.1"
    single_file_hint = "for a single-file transformer give its pipeline folder (--base), or use --encoders flame"

    def __init__(self, path: Path, device=None, vae_dtype=None, seed=0, latents="sample", max_sequence_length=None):
        super().__init__(path, device, vae_dtype, seed, latents)
        _, _, transformers = _interop()
        from flame.pipeline.flux import component_sources
        path, text_dtype = Path(path), self.text_dtype(self.torch.bfloat16)
        self.text_len = max_sequence_length or default_sequence_length(component_sources(path))
        self.tokenizers = (transformers.CLIPTokenizer.from_pretrained(path / "tokenizer"),
                           transformers.T5TokenizerFast.from_pretrained(path / "tokenizer_2"))
        self.clip = transformers.CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=text_dtype)
        self.t5 = transformers.T5EncoderModel.from_pretrained(path / "text_encoder_2", torch_dtype=text_dtype)
        self.clip, self.t5 = self.clip.to(self.device).eval(), self.t5.to(self.device).eval()
        self.text_dim = self.t5.config.d_model
        self.pooled_dim = self.clip.config.hidden_size

    def encode_prompts(self, captions):
        """T5's last hidden states (B, max_sequence_length, 4096) and CLIP-L's pooled output (B, 768),
        as diffusers' FluxPipeline.encode_prompt computes them (no attention mask)."""
        captions, (clip_tok, t5_tok) = list(captions), self.tokenizers
        with self.torch.no_grad():
            ids = clip_tok(captions, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                           return_tensors="pt").input_ids
            pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
            ids = t5_tok(captions, padding="max_length", max_length=self.text_len, truncation=True,
                         return_tensors="pt").input_ids
            states = self.t5(ids.to(self.device), output_hidden_states=False)[0]
        return states.float().cpu().numpy(), pooled.float().cpu().numpy()


def cache_images(args) -> list:
    """Build or refresh the caches of ``args.images`` (one per kohya subfolder, see the module doc):
    everything is scanned and every new image opened before the encoders load, which they do only
    when an image is new or changed. Returns [(cache folder, repeats)]."""
    try:
        sets = scan_dataset(args.images, args.caption_extension, require_captions=args.require_captions)
        plans = [plan_cache(args.cache_dir / s.name if s.name else args.cache_dir, s.items, args.settings,
                            args.val_fraction, args.val_samples, args.bad_images) for s in sets]
    except DatasetError as e:
        fail(e)
    for s, plan in zip(sets, plans):
        print(f"{s.folder}: {len(plan.rows)} image(s), {plan.reused} cached already", flush=True)
    encoders = make_encoders(args) if any(p.needs_encoders for p in plans) else None
    try:
        for plan in plans:
            write_cache(plan, encoders if plan.needs_encoders else None, args.batch_size, args.shard_size,
                        progress=True)
    except DatasetError as e:
        fail(e)
    return [(plan.path, s.repeats) for s, plan in zip(sets, plans)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.synthetic is not None:
        caches = [(prepare_synthetic(args.cache_dir, args.synthetic, args.model_config, args.latent_sizes,
                                     args.val_samples, args.seed, args.shard_size, flip=args.flip), 1)]
    else:
        caches = cache_images(args)
    for out, _ in caches:
        cache = LatentCache(out)
        print(f"wrote {len(cache)} samples ({len(cache.split('train'))} train, {len(cache.split('val'))} val) in "
              f"{len(cache.buckets)} bucket(s) {sorted(cache.buckets)} to {out}", flush=True)
    if len(caches) > 1 or caches[0][1] != 1:  # kohya's repeats: the trainer takes them per dataset
        print("train on them with these datasets (flame-train-lora's config):\ndata:\n  datasets:", flush=True)
        for out, repeats in caches:
            print(f"    - {{cache_dir: {os.path.abspath(out)!r}, repeats: {repeats}}}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
