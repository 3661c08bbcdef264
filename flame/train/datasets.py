"""Image folders for training: the encoders that turn images and captions into a latent cache on
flame (SDXL's and Flux.1's, shared with ``scripts/prepare_cache.py``), and ``prepare_datasets``,
which builds or refreshes the caches of the config's ``data.images`` / ``data.datasets[].images``
before a run (``flame.data.images``: kohya's folder names, captions, unreadable images, the content
hash that lets an unchanged image keep its cached row).

The cache folders: ``data.images`` goes to ``data.cache_dir`` when that is set, else to
``output.dir/cache``; a ``data.datasets`` entry with ``images`` to its ``cache_dir``, else to
``output.dir/cache/<the folder's name>``. A dataset with kohya subfolders (``10_sks dog``) caches
each in a subfolder of that name, with its own repeats. The text encoders and the VAE come from
``sample.model`` or ``model.path`` (a pipeline folder, an SDXL single file with ``sample.tokenizers``,
a Flux transformer file with ``sample.model``); they load only when some image is new or changed,
and leave before the model being trained loads.
"""
from __future__ import annotations

import os
import pathlib
import re
import sys

from ..autograd import no_grad
from ..data import BUCKET_UNIT, CacheSettings, DatasetError, plan_cache, scan_dataset, write_cache
from ..models.sdxl_text import SDXLTextEncoders
from ..models.vae import AutoencoderKL
from ..ops.creation import manual_seed, tensor
from ..pipeline.flux import (
    MAX_SEQUENCE_LENGTH,
    component_sources,
    load_text_encoders,
    load_vae,
    transformer_config,
    variant,
)
from ..runtime import is_interpreter
from ..tensor import bfloat16, float16, float32
from .errors import ConfigError

_DTYPES = {"fp32": float32, "fp16": float16, "bf16": bfloat16}
SDXL_PARTS = ("text_encoder", "text_encoder_2", "vae")
TOKENIZERS = ("tokenizer", "tokenizer_2")


def _flame_dtype(name):
    """flame's dtype of "fp32", "fp16" or "bf16"; None: bf16 on a GPU, fp32 on the interpreter."""
    return _DTYPES[name] if name is not None else (float32 if is_interpreter() else bfloat16)


def default_sequence_length(sources) -> int:
    """T5 tokens per caption for the Flux model of ``component_sources``' answer: 512 for dev, 256
    for schnell (its transformer config's guidance input)."""
    return MAX_SEQUENCE_LENGTH[variant(transformer_config(sources))]


class _FlameVAEEncoders:
    """What the flame encoders of both families share: the VAE's latents, the conversion of the text
    encoders' outputs to NumPy, and the attributes ``flame.data.images`` reads. A subclass loads its
    models, calls ``_use_vae`` and implements ``_encode_text``."""

    family = None

    def _use_vae(self, vae, seed, latents, source):
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)
        self.shift_factor = vae.config.shift_factor  # None for SDXL's VAE
        self.latent_channels = vae.config.latent_channels
        manual_seed(seed)  # the latents' sampling noise
        self.sample_latents = latents == "sample"
        self.source = str(source)

    def encode_images(self, pixels):
        """(B, 3, H, W) float32 NumPy array in [-1, 1] -> (B, C, H/8, W/8) scaled latents
        ((z - shift_factor) * scaling_factor) as NumPy float32."""
        with no_grad():
            x = tensor(pixels).to(self.vae.dtype)
            return self.vae.encode_latents(x, sample=self.sample_latents).to(float32).numpy()

    def encode_prompts(self, captions):
        """(text embeddings (B, text_len, text_dim), pooled vectors (B, pooled_dim)) of ``captions``
        as NumPy float32 (what they are: see the class)."""
        with no_grad():
            embeds, pooled = self._encode_text(list(captions))
            return embeds.to(float32).numpy(), pooled.to(float32).numpy()


class FlameEncoders(_FlameVAEEncoders):
    """The VAE and both text encoders of a local SDXL checkpoint, on flame: text embeddings are both
    CLIP encoders' penultimate hidden states concatenated (B, 2 + max_tokens, 2048), pooled is
    CLIP-G's projection (B, 1280)."""

    family = "sdxl"

    def __init__(self, path, vae_dtype=None, seed=0, tokenizer_path=None, max_tokens=75, latents="sample",
                 text_encoder_dtype=None):
        """``vae_dtype``, ``text_encoder_dtype``: "bf16", "fp16" or "fp32" (default bf16 on a GPU,
        fp32 on the interpreter)."""
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

    def __init__(self, path, vae_dtype=None, seed=0, latents="sample", text_encoder_dtype=None,
                 max_sequence_length=None, base=None, clip=None, t5=None, vae=None):
        """``vae_dtype``, ``text_encoder_dtype``: "bf16", "fp16" or "fp32" (default bf16 on a GPU,
        fp32 on the interpreter)."""
        sources = component_sources(path, base, clip, t5, vae)
        self.text_len = max_sequence_length or default_sequence_length(sources)
        self.text = load_text_encoders(sources, _flame_dtype(text_encoder_dtype))
        self._use_vae(load_vae(sources["vae"], _flame_dtype(vae_dtype)), seed, latents, path)
        self.text_dim = self.text.text_dim
        self.pooled_dim = self.text.pooled_dim

    def _encode_text(self, captions):
        return self.text.encode(captions, self.text_len)


def _lacks(folder, needed, what):
    """Why ``folder`` cannot give the subfolders ``needed`` of ``what`` pipeline folder; None if it can."""
    folder = pathlib.Path(folder)
    missing = [d for d in needed if not (folder / d).is_dir()]
    if not missing:
        return None
    if (folder / "config.json").is_file() and (folder.parent / "model_index.json").is_file():
        return f"{folder} is the {folder.name}/ folder of a pipeline: give the pipeline folder {folder.parent}"
    return f"{folder} is not {what} pipeline folder (it has no {', '.join(d + '/' for d in missing)})"


def encoder_source_problem(family, path, base=None, clip=None, t5=None, vae=None) -> str | None:
    """Why the text encoders, tokenizers and VAE of ``family`` cannot come from ``path`` (with
    ``base``: a pipeline folder for what a single file lacks; Flux's ``clip``, ``t5``, ``vae``
    files), found from the folders alone, before anything loads; None when they can."""
    if path is None:
        return "no checkpoint holds the text encoders and VAE"
    p = pathlib.Path(path)
    if not p.exists():
        return f"{p} does not exist"
    if base is not None and not pathlib.Path(base).is_dir():
        return f"{base} is not a folder (expected a pipeline folder with {' and '.join(TOKENIZERS)})"
    if family == "sdxl":
        if p.is_dir():
            return _lacks(p, SDXL_PARTS + (() if base is not None else TOKENIZERS), "an SDXL")
        if base is None:
            return (f"{p} is a single file, which holds no tokenizers: give a pipeline folder with tokenizer/ and "
                    "tokenizer_2/ for them")
        return _lacks(base, TOKENIZERS, "an SDXL")
    try:
        sources = component_sources(p, base, clip, t5, vae)
    except FileNotFoundError as e:
        return str(e)
    from_base = [k for k in SDXL_PARTS if sources[k] == sources["base"]]
    return _lacks(sources["base"], TOKENIZERS + tuple(from_base), "a Flux.1")


def encoder_record(family, path, base=None, clip=None, t5=None, vae=None, max_tokens=75, max_sequence_length=None,
                   latents="sample", encoders="flame") -> dict:
    """What encodes a cache, as ``CacheSettings.model`` records it: a cache refreshed by other
    encoders, from another checkpoint or with other text lengths is encoded anew."""
    def where(x):
        return os.path.abspath(x) if x is not None else None

    record = {"family": family, "path": where(path), "base": where(base), "latents": latents, "encoders": encoders}
    if family == "sdxl":
        record["max_tokens"] = max_tokens
    else:
        record.update(clip=where(clip), t5=where(t5), vae=where(vae), max_sequence_length=max_sequence_length)
    return record


def _slug(name):
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "images"


def image_datasets(cfg) -> list:
    """The config's datasets (``data.images`` as one, else ``data.datasets``), each a dict with
    ``option`` (its config name), ``images``, ``cache_dir`` (None: the default place) and the
    ``data.datasets`` keys; [] when none has images."""
    d = cfg.data
    if d.images is not None:
        entries = [{"option": "data.images", "images": d.images, "cache_dir": d.cache_dir}]
    else:
        entries = [dict(e, option=f"data.datasets[{i}]") for i, e in enumerate(d.datasets or [])]
    return entries if any(e.get("images") for e in entries) else []


def encoder_source(cfg, family) -> tuple:
    """(checkpoint, pipeline folder for what a single file lacks) of the config's text encoders and
    VAE: SDXL's from ``sample.model`` or ``model.path`` (tokenizers: ``sample.tokenizers``), Flux's
    from ``model.path`` with ``sample.model`` as the pipeline folder (or ``sample.model`` alone)."""
    m, smp = cfg.model, cfg.sample
    if family == "sdxl":
        return smp.model or m.path, smp.tokenizers
    return m.path or smp.model, smp.model


def cache_settings(cfg, family, resolution=None) -> CacheSettings:
    """The ``CacheSettings`` of the config's data section (``resolution``: a dataset's own)."""
    d = cfg.data
    return CacheSettings(model=encoder_record(family, *encoder_source(cfg, family)),
                         resolution=resolution or d.resolution, min_side=d.bucket_min_side,
                         max_side=d.bucket_max_side, bucket_step=d.bucket_step or BUCKET_UNIT[family],
                         random_crop=d.random_crop, flip=d.flip)


def _encoders(cfg, family, dtype):
    """The family's flame encoders for the config (text encoders in ``dtype``; fp16 runs encode in
    fp32: SDXL's VAE and T5 overflow in fp16)."""
    name = {float32: "fp32", bfloat16: "bf16", float16: "fp32", None: None}[dtype]
    path, base = encoder_source(cfg, family)
    if family == "sdxl":
        return FlameEncoders(path, vae_dtype=name, tokenizer_path=base, text_encoder_dtype=name)
    return FluxFlameEncoders(path, vae_dtype=name, text_encoder_dtype=name, base=base)


def prepare_datasets(cfg, family: str, dtype=None, log=print, progress=None):
    """Build or refresh the latent caches of the config's image folders (see the module doc) and
    return the datasets the trainer opens: ``[{"cache_dir", "repeats", "loss_weight", "is_reg"}]``
    (``data.datasets`` entries without images pass through as they are); None when the config names
    no images (its ``data.cache_dir`` / ``data.datasets`` are caches already).

    ``family``: "sdxl" or "flux"; ``dtype``: the encoders' (flame's default when None). Every folder
    is scanned and every new image opened before the encoders load, which they do only when some
    image is new or changed; a problem is a ConfigError naming the option. ``progress``: a bar while
    encoding (default: when stderr is a terminal)."""
    datasets = image_datasets(cfg)
    if not datasets:
        return None
    d = cfg.data
    progress = sys.stderr.isatty() if progress is None else progress
    source, base = encoder_source(cfg, family)
    problem = encoder_source_problem(family, source, base)
    if problem:
        raise ConfigError(f"{datasets[0]['option']}: encoding images needs the text encoders, tokenizers and VAE of "
                          f"model.path or sample.model: {problem}")
    names = [_slug(os.path.basename(os.path.normpath(e["images"]))) if e.get("images") else None for e in datasets]
    plans, out = [], []
    for i, (e, name) in enumerate(zip(datasets, names)):
        if not e.get("images"):
            out.append({k: e[k] for k in ("cache_dir", "repeats", "loss_weight", "is_reg")})
            continue
        option = e["option"] if e["option"] == "data.images" else f"{e['option']}.images"
        home = e["cache_dir"] or os.path.join(cfg.output.dir, "cache", *(
            [] if e["option"] == "data.images" else [name if names.count(name) == 1 else f"{name}-{i}"]))
        held = d.val_fraction if cfg.output.validate_every and not e.get("is_reg") else 0.0
        try:
            sets = scan_dataset(e["images"], e.get("caption_extension") or d.caption_extension, e.get("repeats"),
                                d.require_captions, log)
            settings = cache_settings(cfg, family, e.get("resolution"))
            for s in sets:
                path = os.path.join(home, s.name) if s.name else home
                plans.append((option, plan_cache(path, s.items, settings, held, bad_images=d.bad_images, log=log)))
                out.append({"cache_dir": path, "repeats": s.repeats, "loss_weight": e.get("loss_weight", 1.0),
                            "is_reg": e.get("is_reg", False)})
                log(f"{option}: {s.folder}: {len(s.items)} image(s) x {s.repeats} repeat(s), "
                    f"{plans[-1][1].reused} cached already")
        except DatasetError as err:
            raise ConfigError(f"{option}: {err}") from None
    encoders = None
    if any(p.needs_encoders for _, p in plans):
        try:
            encoders = _encoders(cfg, family, dtype)
        except (OSError, ValueError, RuntimeError) as err:
            raise ConfigError(f"{plans[0][0]}: cannot load the text encoders and VAE from {source}: {err}") from None
    try:
        for option, plan in plans:
            try:
                write_cache(plan, encoders if plan.needs_encoders else None, progress=progress, log=log)
            except DatasetError as err:
                raise ConfigError(f"{option}: {err}") from None
    finally:
        del encoders  # the encoders leave memory before the model being trained loads
    return out
