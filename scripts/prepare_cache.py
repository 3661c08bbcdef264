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

Captions come from ``metadata.jsonl`` in DATA_DIR (lines ``{"file_name": ..., "text": ...}``) or from
a ``.txt`` file with the image's name (``cat.png`` -> ``cat.txt``). Each image goes to the aspect
bucket (multiples of ``--bucket-step`` px, 64 by default; Flux may take 16, about ``--resolution``^2
pixels) nearest its aspect ratio, is scaled to cover it and cropped (centred, or ``--random-crop``).
Time ids are the original size, crop and bucket size (SDXL's conditioning; Flux's trainer ignores
them); the empty caption's embeddings are stored for caption dropout.

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
import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import flame
from flame.data import CacheWriter, fit_to_bucket, make_buckets, nearest_bucket, write_synthetic_cache_for

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INTEROP_HINT = 'this needs diffusers, transformers and Pillow: pip install -e ".[interop]"'


def _sizes(text):
    try:
        out = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected sizes like 8x8,8x12 (latent h x w), got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("cache_dir", type=Path, help="folder to create (must not hold a cache yet)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder of images with .txt captions or metadata.jsonl")
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
    p.add_argument("--resolution", type=int, default=1024, help="bucket area is about resolution^2 pixels")
    p.add_argument("--min-side", type=int, default=512, help="smallest bucket side in pixels")
    p.add_argument("--max-side", type=int, default=2048, help="largest bucket side in pixels")
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
    if args.images is not None:
        _check_model_options(p, args)
    if args.synthetic is not None and args.synthetic < 1:
        p.error("--synthetic must be at least 1")
    if not 0.0 <= args.val_fraction < 1.0:
        p.error("--val-fraction must be in [0, 1)")
    for name in ("resolution", "batch_size", "shard_size", "caption_variants"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.keep_tokens < 0:
        p.error("--keep-tokens must not be negative")
    if (args.cache_dir / "index.json").exists():
        p.error(f"{args.cache_dir} already holds a cache (index.json); remove it or pick another folder")
    return args


BUCKET_UNIT = {"sdxl": 64, "flux": 16}  # pixels a bucket side must be a multiple of


def _check_model_options(p, args):
    """Set ``args.family`` from ``--model`` and refuse the other family's options (``p.error``)."""
    from flame.models.families import checkpoint_family
    if args.model is None:
        p.error("--images needs --model (a local SDXL or Flux.1 checkpoint)")
    if not args.model.exists():
        p.error(f"--model {args.model} does not exist")
    args.family = checkpoint_family(args.model)
    if args.family is None:
        p.error(f"--model {args.model}: neither an SDXL nor a Flux.1 checkpoint (a pipeline folder has a "
                "model_index.json naming StableDiffusionXLPipeline or FluxPipeline)")
    flux_files = [f"--{k}" for k in ("clip", "t5", "vae") if getattr(args, k) is not None]
    if args.family == "sdxl":
        flux_options = flux_files + (["--max-sequence-length"] if args.max_sequence_length is not None else [])
        if flux_options:
            p.error(f"{', '.join(flux_options)}: Flux options, and {args.model} is an SDXL checkpoint (which holds its "
                    "own encoders and VAE)")
        if args.encoders == "diffusers" and args.max_tokens != 75:
            p.error("--max-tokens 150/225 needs --encoders flame")
    else:
        from flame.pipeline.flux import component_sources
        if args.max_tokens != 75:
            p.error("--max-tokens is an SDXL option (Flux: --max-sequence-length)")
        if args.max_sequence_length is not None and not 1 <= args.max_sequence_length <= 512:
            p.error(f"--max-sequence-length must be in [1, 512], got {args.max_sequence_length}")
        if args.encoders == "diffusers" and flux_files:
            p.error(f"{', '.join(flux_files)}: single files need --encoders flame (--encoders diffusers reads a "
                    "pipeline folder: --model, or --base for a single-file transformer)")
        try:
            component_sources(args.model, args.base, args.clip, args.t5, args.vae)
        except FileNotFoundError as e:
            p.error(str(e))
    unit = BUCKET_UNIT[args.family]
    if args.bucket_step < 1 or args.bucket_step % unit:
        p.error(f"--bucket-step must be a positive multiple of {unit} for {args.family}, got {args.bucket_step}")
    if args.min_side % args.bucket_step or args.max_side % args.bucket_step or args.min_side > args.max_side:
        p.error(f"--min-side and --max-side must be multiples of --bucket-step {args.bucket_step}, the first at most "
                f"the second (got {args.min_side}, {args.max_side})")


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

def scan_folder(folder: Path) -> list:
    """[(image path, caption)] from metadata.jsonl, else from same-name .txt files (missing: "")."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} is not a folder")
    meta = folder / "metadata.jsonl"
    if meta.is_file():
        items = []
        for n, line in enumerate(meta.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                items.append((folder / row["file_name"], str(row.get("text", ""))))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"error: {meta}:{n}: expected {{\"file_name\": ..., \"text\": ...}} ({e})") from None
        missing = [str(p) for p, _ in items if not p.is_file()]
        if missing:
            raise SystemExit(f"error: {meta} names {len(missing)} missing image(s), e.g. {missing[:3]}")
        return items
    items = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in IMAGE_EXTS and path.is_file():
            txt = path.with_suffix(".txt")
            items.append((path, txt.read_text().strip() if txt.is_file() else ""))
    if not items:
        raise SystemExit(f"error: no images ({', '.join(IMAGE_EXTS)}) in {folder}")
    return items


def val_split(names, fraction, count=None) -> set:
    """The held-out names: the ``count`` (default round(fraction * n), at least 1 when fraction > 0
    and n > 1) with the smallest CRC32, so the split does not depend on file order."""
    n = len(names)
    k = count if count is not None else (max(1, round(fraction * n)) if fraction > 0 and n > 1 else 0)
    if not 0 <= k < max(n, 1):
        raise SystemExit(f"error: cannot hold out {k} of {n} samples")
    return set(sorted(names, key=lambda s: (zlib.crc32(s.encode()), s))[:k])


def _flame_dtype(name):
    """flame's dtype of "fp32", "fp16" or "bf16"; None: bf16 on a GPU, fp32 on the interpreter."""
    named = {"fp32": flame.float32, "fp16": flame.float16, "bf16": flame.bfloat16}
    return named[name] if name is not None else (flame.float32 if flame.is_interpreter() else flame.bfloat16)


class _FlameVAEEncoders:
    """What the flame encoders of both families share: the VAE's latents, the conversion of the text
    encoders' outputs to NumPy, and the attributes ``prepare_images`` reads. A subclass loads its
    models, calls ``_use_vae`` and implements ``_encode_text``."""

    family = None

    def _use_vae(self, vae, seed, latents, source):
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)
        self.shift_factor = vae.config.shift_factor  # None for SDXL's VAE
        self.latent_channels = vae.config.latent_channels
        flame.manual_seed(seed)  # the latents' sampling noise
        self.sample_latents = latents == "sample"
        self.source = str(source)

    def encode_images(self, pixels):
        """(B, 3, H, W) float32 NumPy array in [-1, 1] -> (B, C, H/8, W/8) scaled latents
        ((z - shift_factor) * scaling_factor) as NumPy float32."""
        with flame.no_grad():
            x = flame.tensor(pixels).to(self.vae.dtype)
            return self.vae.encode_latents(x, sample=self.sample_latents).to(flame.float32).numpy()

    def encode_prompts(self, captions):
        """(text embeddings (B, text_len, text_dim), pooled vectors (B, pooled_dim)) of ``captions``
        as NumPy float32 (what they are: see the class)."""
        with flame.no_grad():
            embeds, pooled = self._encode_text(list(captions))
            return embeds.to(flame.float32).numpy(), pooled.to(flame.float32).numpy()


class FlameEncoders(_FlameVAEEncoders):
    """The VAE and both text encoders of a local SDXL checkpoint, on flame: text embeddings are both
    CLIP encoders' penultimate hidden states concatenated (B, 2 + max_tokens, 2048), pooled is
    CLIP-G's projection (B, 1280)."""

    family = "sdxl"

    def __init__(self, path: Path, vae_dtype=None, seed=0, tokenizer_path=None, max_tokens=75, latents="sample",
                 text_encoder_dtype=None):
        """``vae_dtype``, ``text_encoder_dtype``: "bf16", "fp16" or "fp32" (default bf16 on a GPU,
        fp32 on the interpreter)."""
        from flame.models.sdxl_text import SDXLTextEncoders
        from flame.models.vae import AutoencoderKL
        self.text = SDXLTextEncoders.from_pretrained(path, dtype=_flame_dtype(text_encoder_dtype),
                                                     tokenizer_path=tokenizer_path)
        self._use_vae(AutoencoderKL.from_pretrained(path, dtype=_flame_dtype(vae_dtype)), seed, latents, path)
        self.max_tokens = max_tokens
        self.text_len = 2 + max_tokens
        self.text_dim = self.text.text_dim
        self.pooled_dim = self.text.pooled_dim

    def _encode_text(self, captions):
        return self.text.encode(captions, max_tokens=self.max_tokens)


class FluxFlameEncoders(_FlameVAEEncoders):
    """The VAE, CLIP-L and T5-XXL of a local Flux.1 checkpoint, on flame: text embeddings are T5's
    last hidden states (B, max_sequence_length, 4096), pooled is CLIP-L's pooled output (B, 768),
    latents the 16-channel (z - shift_factor) * scaling_factor, as diffusers' FluxPipeline uses them.

    ``path``: a Flux pipeline folder, or the transformer's single file with ``base`` (a pipeline
    folder: the tokenizers and every part not given) and/or ``clip``, ``t5``, ``vae`` (the files
    people download), as ``flame-sample`` takes them (``flame.pipeline.flux.component_sources``; the
    transformer itself is not loaded, only its config read for the variant).
    ``max_sequence_length``: T5 tokens per caption (default: 512 for dev, 256 for schnell).

    Memory: the three models stay loaded together (T5-XXL ~9.5 GB, CLIP-L ~0.25 GB, the VAE ~0.2 GB
    in bf16, plus the activations of a batch): less than the Flux transformer that trains on the
    cache needs, so any card that trains Flux holds them, and no model is reloaded per batch."""

    family = "flux"

    def __init__(self, path: Path, vae_dtype=None, seed=0, latents="sample", text_encoder_dtype=None,
                 max_sequence_length=None, base=None, clip=None, t5=None, vae=None):
        """``vae_dtype``, ``text_encoder_dtype``: "bf16", "fp16" or "fp32" (default bf16 on a GPU,
        fp32 on the interpreter)."""
        from flame.pipeline.flux import component_sources, load_text_encoders, load_vae
        sources = component_sources(path, base, clip, t5, vae)
        self.text_len = max_sequence_length or default_sequence_length(sources)
        self.text = load_text_encoders(sources, _flame_dtype(text_encoder_dtype))
        self._use_vae(load_vae(sources["vae"], _flame_dtype(vae_dtype)), seed, latents, path)
        self.text_dim = self.text.text_dim
        self.pooled_dim = self.text.pooled_dim

    def _encode_text(self, captions):
        return self.text.encode(captions, self.text_len)


def default_sequence_length(sources) -> int:
    """T5 tokens per caption for the Flux model of ``component_sources``' answer: 512 for dev, 256
    for schnell (its transformer config's guidance input)."""
    from flame.pipeline.flux import MAX_SEQUENCE_LENGTH, transformer_config, variant
    return MAX_SEQUENCE_LENGTH[variant(transformer_config(sources))]


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


def shuffled_captions(caption, count, keep_tokens, rng):
    """``count - 1`` variants of ``caption`` with its comma-separated tags shuffled, the first
    ``keep_tokens`` tags kept in place (kohya's tag shuffling, done once at cache time)."""
    tags = [t.strip() for t in caption.split(",") if t.strip()]
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    return [", ".join(head + [tail[i] for i in rng.permutation(len(tail))]) for _ in range(count - 1)]


def load_pixels(path, bucket, rng):
    """The image scaled to cover ``bucket`` and cropped: ((3, H, W) floats in [-1, 1], time_ids, the
    time ids of the mirrored crop, whose left edge is measured from the other side)."""
    import numpy as np
    from PIL import Image
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        rw, rh, left, top = fit_to_bucket(w, h, bucket, rng)
        im = im.resize((rw, rh), Image.Resampling.LANCZOS).crop((left, top, left + bucket[0], top + bucket[1]))
        arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return arr.transpose(2, 0, 1), [h, w, top, left, bucket[1], bucket[0]], \
        [h, w, top, rw - left - bucket[0], bucket[1], bucket[0]]


def prepare_images(cache_dir, images, encoders, resolution=1024, min_side=512, max_side=2048, random_crop=False,
                   val_fraction=0.05, val_samples=None, batch_size=4, text_dtype="fp16", shard_size=256, seed=0,
                   show_progress=True, flip=False, caption_variants=1, keep_tokens=0, bucket_step=64):
    """Encode ``images`` ([(path, caption)]) with ``encoders`` (any of this script's four classes:
    the cache's dims and meta are theirs) into a new cache (``flip``: each image mirrored too;
    ``caption_variants``: K captions each, see ``shuffled_captions``; ``bucket_step``: bucket sides
    are its multiples); returns the folder."""
    import numpy as np
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit(f"error: Pillow is not installed; {INTEROP_HINT}") from None
    buckets = make_buckets(resolution * resolution, bucket_step, min_side, max_side)
    groups = {}
    for path, caption in images:  # every image is opened before anything is written
        try:
            with Image.open(path) as im:
                size = im.size
        except OSError as e:
            raise SystemExit(f"error: {path} is not an image Pillow can read ({e})") from None
        groups.setdefault(nearest_bucket(*size, buckets), []).append((path, caption))
    held_out = val_split([str(p) for p, _ in images], val_fraction, val_samples)
    writer = CacheWriter(cache_dir, encoders.latent_channels, encoders.text_len, encoders.text_dim,
                         encoders.pooled_dim, text_dtype=text_dtype, shard_size=shard_size,
                         meta={"model": str(getattr(encoders, "source", "")),
                               "family": getattr(encoders, "family", None), "scaling_factor": encoders.scaling_factor,
                               "shift_factor": getattr(encoders, "shift_factor", None), "resolution": resolution,
                               "bucket_step": bucket_step, "random_crop": random_crop, "seed": seed,
                               "keep_tokens": keep_tokens}, flipped=flip, caption_variants=caption_variants)
    embeds, pooled = encoders.encode_prompts([""])  # the empty caption, for caption dropout
    writer.set_empty_prompt(embeds[0], pooled[0])
    rng = np.random.default_rng(seed) if random_crop else None
    shuffle_rng = np.random.default_rng([seed, 0xCA9])
    bar = _progress(len(images), "encoding") if show_progress else None
    try:
        for bucket, items in sorted(groups.items()):
            for start in range(0, len(items), batch_size):
                chunk = items[start:start + batch_size]
                loaded = [load_pixels(p, bucket, rng) for p, _ in chunk]
                pixels = np.stack([px for px, _, _ in loaded])
                latents = encoders.encode_images(pixels)
                mirrored = encoders.encode_images(np.ascontiguousarray(pixels[..., ::-1])) if flip else None
                embeds, pooled = encoders.encode_prompts([c for _, c in chunk])
                more = caption_variants - 1
                if more:
                    others = [v for _, c in chunk for v in shuffled_captions(c, caption_variants, keep_tokens,
                                                                             shuffle_rng)]
                    v_embeds, v_pooled = encoders.encode_prompts(others)
                    v_embeds = v_embeds.reshape(len(chunk), more, *v_embeds.shape[1:])
                    v_pooled = v_pooled.reshape(len(chunk), more, *v_pooled.shape[1:])
                for j, (path, caption) in enumerate(chunk):
                    extra = {"latents_flipped": mirrored[j], "time_ids_flipped": loaded[j][2]} if flip else {}
                    if more:
                        extra.update(prompt_embeds_variants=v_embeds[j], pooled_variants=v_pooled[j])
                    writer.add(latents[j], embeds[j], pooled[j], loaded[j][1], caption, str(path),
                               "val" if str(path) in held_out else "train", **extra)
                if bar:
                    bar.update(len(chunk))
            writer.flush()  # one bucket at a time: at most a shard of samples in memory
    finally:
        if bar:
            bar.close()
    return writer.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.synthetic is not None:
        out = prepare_synthetic(args.cache_dir, args.synthetic, args.model_config, args.latent_sizes,
                                args.val_samples, args.seed, args.shard_size, flip=args.flip)
    else:
        images = scan_folder(args.images)
        encoders = make_encoders(args)
        out = prepare_images(args.cache_dir, images, encoders, args.resolution, args.min_side, args.max_side,
                             args.random_crop, args.val_fraction, args.val_samples, args.batch_size, args.text_dtype,
                             args.shard_size, args.seed, flip=args.flip, caption_variants=args.caption_variants,
                             keep_tokens=args.keep_tokens, bucket_step=args.bucket_step)
    from flame.data import LatentCache
    cache = LatentCache(out)
    print(f"wrote {len(cache)} samples ({len(cache.split('train'))} train, {len(cache.split('val'))} val) in "
          f"{len(cache.buckets)} bucket(s) {sorted(cache.buckets)} to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
