#!/usr/bin/env python3
"""Build a latent cache for SDXL LoRA training (see flame/data/cache.py for the format).

From an image folder, with a local SDXL checkpoint -- a diffusers pipeline folder (vae/,
text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/) or one single-file checkpoint (its
tokenizers from ``--tokenizers``, a pipeline folder) -- encoded by flame's VAE and text encoders::

    python scripts/prepare_cache.py CACHE_DIR --images DATA_DIR --model /models/stable-diffusion-xl-base-1.0

``--encoders diffusers`` encodes through diffusers/transformers instead (``pip install -e ".[interop]"``;
pipeline folders only), for cross-checks: both write the same format.

Captions come from ``metadata.jsonl`` in DATA_DIR (lines ``{"file_name": ..., "text": ...}``) or from
a ``.txt`` file with the image's name (``cat.png`` -> ``cat.txt``). Each image goes to the aspect
bucket (multiples of 64 px, about ``--resolution``^2 pixels) nearest its aspect ratio, is scaled to
cover it and cropped (centred, or ``--random-crop``); latents are the VAE's (times its scaling
factor), text embeddings the penultimate hidden states of both CLIP encoders (77 x 2048) and the
pooled CLIP-G projection (1280), time ids the original size, crop and bucket size.

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
    p.add_argument("--model", type=Path, help="local SDXL checkpoint, for --images: a diffusers pipeline folder or "
                                              "one single-file .safetensors")
    p.add_argument("--tokenizers", type=Path, help="pipeline folder with tokenizer/ and tokenizer_2/ (for a "
                                                   "single-file --model)")
    p.add_argument("--encoders", choices=["flame", "diffusers"], default="flame",
                   help="who encodes: flame's kernels, or diffusers/transformers (PyTorch) for cross-checks")
    p.add_argument("--max-tokens", type=int, choices=[75, 150, 225], default=75,
                   help="caption tokens (longer captions are cut, with a warning); 150/225 encode 75-token "
                        "windows (flame encoders only)")
    p.add_argument("--model-config", default="sdxl", help="--synthetic: UNet config giving the dims (tiny, sdxl, "
                                                          "or a diffusers config.json)")
    p.add_argument("--latent-sizes", type=_sizes, help="--synthetic: latent buckets, e.g. 8x8,8x12 "
                                                       "(default: the square sample_size, and 7:9 for sizes from 64)")
    p.add_argument("--resolution", type=int, default=1024, help="bucket area is about resolution^2 pixels")
    p.add_argument("--min-side", type=int, default=512, help="smallest bucket side in pixels")
    p.add_argument("--max-side", type=int, default=2048, help="largest bucket side in pixels")
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
    if args.images is not None and args.model is None:
        p.error("--images needs --model (a local SDXL checkpoint)")
    if args.encoders == "diffusers" and args.max_tokens != 75:
        p.error("--max-tokens 150/225 needs --encoders flame")
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


class FlameEncoders:
    """The VAE and both text encoders of a local SDXL checkpoint, on flame."""

    def __init__(self, path: Path, vae_dtype=None, seed=0, tokenizer_path=None, max_tokens=75, latents="sample",
                 text_encoder_dtype=None):
        """``vae_dtype``, ``text_encoder_dtype``: "bf16", "fp16" or "fp32" (default bf16 on a GPU,
        fp32 on the interpreter)."""
        from flame import bfloat16, float16, float32, is_interpreter, manual_seed
        from flame.models.sdxl_text import SDXLTextEncoders
        from flame.models.vae import AutoencoderKL
        dt = {"fp32": float32, "fp16": float16, "bf16": bfloat16, None: float32 if is_interpreter() else bfloat16}
        self.text = SDXLTextEncoders.from_pretrained(path, dtype=dt[text_encoder_dtype], tokenizer_path=tokenizer_path)
        self.vae = AutoencoderKL.from_pretrained(path, dtype=dt[vae_dtype])
        self.max_tokens = max_tokens
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.text_len = 2 + max_tokens
        self.text_dim = self.text.text_dim
        self.pooled_dim = self.text.pooled_dim
        self.latent_channels = self.vae.config.latent_channels
        manual_seed(seed)  # the latents' sampling noise
        self.sample_latents = latents == "sample"
        self.source = str(path)

    def encode_images(self, pixels):
        """(B, 3, H, W) float32 NumPy array in [-1, 1] -> (B, C, H/8, W/8) scaled latents as NumPy float32."""
        with flame.no_grad():
            x = flame.tensor(pixels).to(self.vae.dtype)
            return self.vae.encode_latents(x, sample=self.sample_latents).to(flame.float32).numpy()

    def encode_prompts(self, captions):
        """Both encoders' penultimate hidden states concatenated (B, L, 2048) and CLIP-G's pooled
        projection (B, 1280) as NumPy float32 (L = 2 + max_tokens)."""
        with flame.no_grad():
            embeds, pooled = self.text.encode(list(captions), max_tokens=self.max_tokens)
            return embeds.to(flame.float32).numpy(), pooled.to(flame.float32).numpy()


class SDXLEncoders:
    """The VAE and both text encoders of a local SDXL checkpoint, in PyTorch through diffusers/transformers."""

    def __init__(self, path: Path, device=None, vae_dtype=None, seed=0, latents="sample"):
        vae_dtype = vae_dtype or "fp32"
        try:
            import torch
            from diffusers import AutoencoderKL
            from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
        except ImportError as e:
            raise SystemExit(f"error: {e.name or e} is not installed; {INTEROP_HINT}") from None
        path = Path(path)
        need = ["vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
        missing = [d for d in need if not (path / d).is_dir()]
        if missing:
            raise SystemExit(f"error: {path} is not an SDXL checkpoint folder in diffusers layout (lacks "
                             f"{', '.join(missing)}/); single-file checkpoints: convert with diffusers' "
                             "StableDiffusionXLPipeline.from_single_file(...).save_pretrained(folder)")
        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        text_dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dt[vae_dtype]).to(self.device).eval()
        self.tokenizers = [CLIPTokenizer.from_pretrained(path / d) for d in ("tokenizer", "tokenizer_2")]
        self.encoders = [CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=text_dtype),
                         CLIPTextModelWithProjection.from_pretrained(path / "text_encoder_2", torch_dtype=text_dtype)]
        self.encoders = [e.to(self.device).eval() for e in self.encoders]
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.text_len = self.tokenizers[0].model_max_length
        self.text_dim = sum(e.config.hidden_size for e in self.encoders)
        self.pooled_dim = self.encoders[1].config.projection_dim
        self.latent_channels = self.vae.config.latent_channels
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.sample_latents = latents == "sample"
        self.source = str(path)

    def encode_images(self, pixels):
        """(B, 3, H, W) float32 NumPy array in [-1, 1] -> (B, C, H/8, W/8) scaled latents as NumPy float32."""
        torch = self.torch
        with torch.no_grad():
            x = torch.from_numpy(pixels).to(self.device, self.vae.dtype)
            dist = self.vae.encode(x).latent_dist
            lat = (dist.sample(self.generator) if self.sample_latents else dist.mode()) * self.scaling_factor
        return lat.float().cpu().numpy()

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
                   show_progress=True, flip=False, caption_variants=1, keep_tokens=0):
    """Encode ``images`` ([(path, caption)]) with ``encoders`` into a new cache (``flip``: each image
    mirrored too; ``caption_variants``: K captions each, see ``shuffled_captions``); returns the folder."""
    import numpy as np
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit(f"error: Pillow is not installed; {INTEROP_HINT}") from None
    buckets = make_buckets(resolution * resolution, 64, min_side, max_side)
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
                         meta={"model": str(getattr(encoders, "source", "")), "scaling_factor": encoders.scaling_factor,
                               "resolution": resolution, "random_crop": random_crop, "seed": seed,
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
        if args.encoders == "flame":
            encoders = FlameEncoders(args.model, args.vae_dtype, args.seed, args.tokenizers, args.max_tokens,
                                     args.latents)
        else:
            encoders = SDXLEncoders(args.model, args.device, args.vae_dtype, args.seed, args.latents)
        out = prepare_images(args.cache_dir, images, encoders, args.resolution, args.min_side, args.max_side,
                             args.random_crop, args.val_fraction, args.val_samples, args.batch_size, args.text_dtype,
                             args.shard_size, args.seed, flip=args.flip, caption_variants=args.caption_variants,
                             keep_tokens=args.keep_tokens)
    from flame.data import LatentCache
    cache = LatentCache(out)
    print(f"wrote {len(cache)} samples ({len(cache.split('train'))} train, {len(cache.split('val'))} val) in "
          f"{len(cache.buckets)} bucket(s) {sorted(cache.buckets)} to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
