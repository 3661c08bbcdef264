"""A synthetic latent cache with learnable structure, for demos and tests (no model, no images).

Every sample is described by a few hidden "concept" strengths ``z`` (K numbers ~ N(0, 1)). Its
latents are a smooth picture built from them: each concept is a fixed low-frequency cosine
pattern with its own per-channel phase and gain, weighted by ``z_k``, plus a little noise, at the
sample's bucket size (the patterns are defined on the unit square, so every aspect bucket shows
the same picture). Its text embedding reads like a tokenised caption: a start token, one "word"
token per concept (a fixed random vector scaled by ``z_k``), then padding tokens; its pooled
embedding is a fixed projection of ``z``. The time ids are the bucket's pixel size with no crop.

So the latents are a deterministic function of the text: a denoiser that attends to the
embeddings can learn to predict the clean picture (and so the noise), and the validation loss of
a LoRA trained on this data goes down.
"""
from __future__ import annotations

import math

import numpy as np

from .cache import CacheWriter


class _World:
    """The fixed random patterns and vectors of one synthetic cache (from its seed)."""

    def __init__(self, rng, concepts, channels, text_dim, pooled_dim):
        self.k = concepts
        self.freq = rng.integers(0, 3, size=(concepts, 2)) + rng.uniform(0.25, 0.75, size=(concepts, 2))
        self.phase = rng.uniform(0, 2 * math.pi, size=(concepts, channels))
        sign = rng.choice([-1.0, 1.0], size=(concepts, channels))
        self.gain = rng.uniform(0.5, 1.5, size=(concepts, channels)) * sign
        self.words = rng.standard_normal((concepts, text_dim))
        self.start = rng.standard_normal(text_dim)
        self.pad = rng.standard_normal(text_dim) * 0.5
        self.proj = rng.standard_normal((concepts, pooled_dim)) / math.sqrt(concepts)

    def latents(self, z, h, w, rng):
        y = (np.arange(h) + 0.5)[:, None] / h
        x = (np.arange(w) + 0.5)[None, :] / w
        out = np.zeros((self.gain.shape[1], h, w))
        for k in range(self.k):
            arg = 2 * math.pi * (self.freq[k, 0] * y + self.freq[k, 1] * x)  # (h, w)
            out += z[k] * self.gain[k][:, None, None] * np.cos(arg[None] + self.phase[k][:, None, None])
        return out / math.sqrt(self.k / 2) + 0.05 * rng.standard_normal(out.shape)

    def text(self, z, text_len, rng):
        emb = np.repeat(self.pad[None], text_len, axis=0)
        emb[0] = self.start
        n = min(self.k, text_len - 1)
        emb[1:1 + n] = z[:n, None] * self.words[:n]
        return emb + 0.02 * rng.standard_normal(emb.shape), np.tanh(z @ self.proj)


def write_synthetic_cache(path, num_samples: int, latent_channels: int = 4, text_len: int = 77,
                          text_dim: int = 2048, pooled_dim: int = 1280, latent_sizes=((128, 128), (112, 144)),
                          val_samples: int | None = None, concepts: int = 8, seed: int = 0,
                          shard_size: int = 256, progress=None, flipped: bool = False) -> str:
    """Write ``num_samples`` synthetic samples to a new cache at ``path`` (see the module doc).

    Samples go round-robin to the buckets of ``latent_sizes`` ((h, w) latent sizes); the last
    ``val_samples`` (default: one in eight, at least one when there are 8 or more samples) are held
    out as the "val" split. ``progress``: a callable ``progress(n)`` told of each written sample.
    ``flipped``: also the mirrored images' latents (the latents mirrored along the width).
    """
    if num_samples < 1:
        raise ValueError(f"write_synthetic_cache: num_samples must be positive, got {num_samples}")
    latent_sizes = [tuple(int(v) for v in s) for s in latent_sizes]
    if not latent_sizes or any(len(s) != 2 or min(s) < 1 for s in latent_sizes):
        raise ValueError(f"write_synthetic_cache: latent_sizes must be (h, w) pairs, got {latent_sizes}")
    if val_samples is None:
        val_samples = num_samples // 8
    if not 0 <= val_samples < num_samples:
        raise ValueError(f"write_synthetic_cache: val_samples must be in [0, {num_samples}), got {val_samples}")
    rng = np.random.default_rng(seed)
    world = _World(rng, concepts, latent_channels, text_dim, pooled_dim)
    writer = CacheWriter(path, latent_channels, text_len, text_dim, pooled_dim, shard_size=shard_size,
                         meta={"synthetic": {"seed": seed, "concepts": concepts, "samples": num_samples},
                               "scaling_factor": None}, flipped=flipped)
    for i in range(num_samples):
        h, w = latent_sizes[i % len(latent_sizes)]
        z = rng.standard_normal(concepts)
        prompt, pooled = world.text(z, text_len, rng)
        caption = "synthetic " + " ".join(f"c{k}={z[k]:+.2f}" for k in range(concepts))
        latents, time_ids = world.latents(z, h, w, rng), [8 * h, 8 * w, 0, 0, 8 * h, 8 * w]
        mirrored = (latents[..., ::-1], time_ids) if flipped else (None, None)
        writer.add(latents, prompt, pooled, time_ids, caption, source=f"synthetic-{i:06d}",
                   split="val" if i >= num_samples - val_samples else "train", latents_flipped=mirrored[0],
                   time_ids_flipped=mirrored[1])
        if progress is not None:
            progress(1)
    writer.set_empty_prompt(*world.text(np.zeros(concepts), text_len, rng))  # no concept: the empty caption
    return writer.close()


def write_synthetic_cache_for(path, num_samples: int, model_config, latent_sizes=None, **kwargs) -> str:
    """A synthetic cache with the dims of a UNet config (``in_channels``, ``cross_attention_dim``,
    ``pooled_dim``; 77 text tokens). ``latent_sizes`` default to the config's square
    ``sample_size`` and a 7:9 bucket of about the same area (SDXL: 128x128 and 112x144)."""
    s = model_config.sample_size
    if latent_sizes is None:
        latent_sizes = [(s, s)] + ([(s * 7 // 64 * 8, s * 9 // 64 * 8)] if s >= 64 else [])
    return write_synthetic_cache(path, num_samples, model_config.in_channels, 77, model_config.cross_attention_dim,
                                 model_config.pooled_dim, latent_sizes, **kwargs)
