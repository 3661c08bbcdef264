"""Several latent caches trained as one: each with its repeats and loss weight (kohya's dataset
folders with ``repeats``, a regularization set with ``prior_loss_weight``).

``CacheSet([(cache, repeats, loss_weight), ...])`` reads like one ``LatentCache`` -- sample indices
run over the caches in order, buckets are shared by latent size -- so the bucketed loader and the
trainer take it as they take a single cache. ``repeats_of(i)``: how many times sample ``i`` is in
an epoch (the loader plans each bucket with those copies); ``weight_of(i)``: the factor of its loss.
The caches must have the same dims (latent channels, text length and width, pooled width); a
batch may mix rows of several caches of one bucket.
"""
from __future__ import annotations

import numpy as np
import torch

from .cache import _DIMS, FIELDS, Batch, CacheError, LatentCache


class CacheSet:
    """``parts``: ``(LatentCache, repeats, loss_weight)`` triples."""

    def __init__(self, parts):
        parts = [(c, int(r), float(w)) for c, r, w in parts]
        if not parts:
            raise ValueError("CacheSet: no caches")
        first = parts[0][0]
        for cache, repeats, weight in parts:
            if not isinstance(cache, LatentCache):
                raise TypeError(f"CacheSet: expected LatentCache parts, got {type(cache).__name__}")
            if repeats < 1 or weight < 0:
                raise ValueError(f"CacheSet: {cache.path}: repeats must be >= 1 and loss_weight >= 0, got {repeats}, "
                                 f"{weight}")
            other = {k: (getattr(cache, k), getattr(first, k)) for k in _DIMS if getattr(cache, k) != getattr(first, k)}
            if other:
                raise CacheError(f"{cache.path} does not fit {first.path}: " + ", ".join(
                    f"{k} {a} against {b}" for k, (a, b) in other.items()))
        self.parts = parts
        self.path = ", ".join(c.path for c, _, _ in parts)
        self.latent_channels, self.text_len, self.text_dim, self.pooled_dim = (getattr(first, k) for k in _DIMS)
        self.buckets = sorted({b for c, _, _ in parts for b in c.buckets})
        self._start = np.cumsum([0] + [len(c) for c, _, _ in parts])

    def __len__(self):
        return int(self._start[-1])

    def _locate(self, index):
        k = int(np.searchsorted(self._start, index, side="right")) - 1
        return k, int(index - self._start[k])

    def split(self, name: str) -> list:
        return [int(self._start[k]) + i for k, (c, _, _) in enumerate(self.parts) for i in c.split(name)]

    def bucket_of(self, index: int) -> int:
        k, i = self._locate(index)
        cache = self.parts[k][0]
        return self.buckets.index(cache.buckets[cache.bucket_of(i)])

    def repeats_of(self, index: int) -> int:
        return self.parts[self._locate(index)[0]][1]

    def weight_of(self, index: int) -> float:
        return self.parts[self._locate(index)[0]][2]

    @property
    def has_empty_prompt(self) -> bool:
        return all(c.has_empty_prompt for c, _, _ in self.parts)

    def empty_prompt(self) -> tuple:
        for cache, _, _ in self.parts:
            cache.empty_prompt()  # each one has it (or raises naming its folder)
        return self.parts[0][0].empty_prompt()

    @property
    def flipped(self) -> bool:
        return all(c.flipped for c, _, _ in self.parts)

    @property
    def caption_variants(self) -> int:
        """The caption variants every cache of the set holds."""
        return min(c.caption_variants for c, _, _ in self.parts)

    def batch(self, indices, flips=None, variants=None) -> Batch:
        """The rows of ``indices`` (one bucket, any caches) on flame's device, in order (``flips``,
        ``variants``: as ``LatentCache.read`` takes them)."""
        indices = [int(i) for i in indices]
        flips = list(flips) if flips is not None else [False] * len(indices)
        variants = list(variants) if variants is not None else [0] * len(indices)
        where = [self._locate(i) for i in indices]
        rows = {}  # cache -> its host rows of this batch, in batch order
        for k in sorted({k for k, _ in where}):
            mine = [j for j, (kk, _) in enumerate(where) if kk == k]
            read = self.parts[k][0].read([where[j][1] for j in mine], [flips[j] for j in mine],
                                         [variants[j] for j in mine])
            rows[k] = {f: t.numpy() for f, t in read.items()}
        taken = dict.fromkeys(rows, 0)
        host = {f: [] for f in FIELDS}
        for k, _ in where:
            for f in FIELDS:
                host[f].append(rows[k][f][taken[k]])
            taken[k] += 1
        return LatentCache.upload({f: torch.from_numpy(np.stack(v)) for f, v in host.items()}, tuple(indices))
