"""Batches from a latent cache: within one aspect bucket, shuffled from (seed, epoch), resumable.

``BucketBatchLoader`` plans an epoch as a list of batches: each bucket's samples permuted by a
NumPy generator seeded with ``(seed, epoch)``, cut into batches of ``batch_size`` (the last one
of a bucket smaller, or dropped with ``drop_last``), and the batches of all buckets permuted by the
same generator. The plan depends on nothing but the cache, the seed and the epoch, so the loader's
state is two integers: ``{"epoch": e, "position": p}`` (``p`` batches of epoch ``e`` consumed).
``load_state_dict`` of a saved state continues with exactly the batch an uninterrupted run would
have read next. Iterating never stops: after the last batch of an epoch comes the first of the next.

Data parallelism: with ``parts=W`` the plan is made of global batches of ``W * batch_size`` samples
(one aspect bucket each), exactly the plan a single process with that batch size makes. Every
rank walks the same plan (``next_indices``) and takes its own rows of each global batch
(``part_bounds``), so the ranks' batches share one shape and the run is the single-process run at
the global batch size, split.
"""
from __future__ import annotations

import numpy as np

from .cache import Batch, LatentCache


def part_bounds(total: int, parts: int, part: int) -> tuple:
    """Rows ``[start, stop)`` of part ``part`` when ``total`` rows are split into ``parts`` parts
    as evenly as possible (sizes differ by at most one; a part may be empty)."""
    return part * total // parts, (part + 1) * total // parts


class BucketBatchLoader:
    """Infinite iterator of ``Batch``es of ``split`` ("train" or "val") of ``cache``; ``parts``:
    the data-parallel world size (batches of ``parts * batch_size``, see the module doc)."""

    def __init__(self, cache: LatentCache, batch_size: int, split: str = "train", shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, parts: int = 1):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts must be a positive int, got {parts!r}")
        self.cache, self.batch_size, self.split, self.parts = cache, batch_size, split, parts
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        by_bucket = {}
        for i in cache.split(split):  # a sample with repeats is in the plan that many times
            by_bucket.setdefault(cache.bucket_of(i), []).extend([i] * (cache.repeats_of(i) if split == "train" else 1))
        self._buckets = [np.array(by_bucket[b], dtype=np.int64) for b in sorted(by_bucket)]
        self.epoch, self.position = 0, 0
        self._plan_cache = (None, None)
        self._epoch_draws = {}  # (epoch, salt) -> a uniform number per sample (flips, caption variants)
        if not self.plan(0):
            sizes = [len(b) for b in self._buckets]
            raise ValueError(f"no batch of {batch_size * parts} in the {split!r} split of {cache.path} "
                             f"(bucket sizes {sizes}{', drop_last' if drop_last else ''})")

    def plan(self, epoch: int) -> list:
        """The batches of ``epoch``: a list of tuples of sample indices (cached for the last epoch asked)."""
        if self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        batches, size = [], self.batch_size * self.parts
        for ids in self._buckets:
            if rng is not None:
                ids = rng.permutation(ids)
            for start in range(0, len(ids), size):
                chunk = ids[start:start + size]
                if len(chunk) == size or not self.drop_last:
                    batches.append(tuple(int(i) for i in chunk))
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._plan_cache = (epoch, batches)
        return batches

    def __len__(self):
        """Batches per epoch."""
        return len(self.plan(self.epoch))

    @property
    def num_samples(self) -> int:
        return int(sum(len(b) for b in self._buckets))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return self.cache.batch(self.next_indices())

    def next_indices(self) -> tuple:
        """The sample indices of the next (global) batch, advancing the position."""
        plan = self.plan(self.epoch)
        if self.position >= len(plan):
            self.epoch, self.position = self.epoch + 1, 0
            plan = self.plan(self.epoch)
        ids = plan[self.position]
        self.position += 1
        return ids

    def _draws(self, salt):
        """Per sample of the cache, a uniform number in [0, 1) for the current epoch, from (seed,
        epoch, salt): a resumed run and every data-parallel rank draw alike."""
        key = (self.epoch, salt)
        if key not in self._epoch_draws:
            kept = {k: v for k, v in self._epoch_draws.items() if k[0] == self.epoch}
            kept[key] = np.random.default_rng([self.seed, self.epoch, salt]).random(len(self.cache))
            self._epoch_draws = kept
        return self._epoch_draws[key]

    def flips_of(self, ids) -> list:
        """Whether each sample of ``ids`` (a batch of the current epoch) trains on its mirrored image:
        a fair coin per sample and epoch."""
        draws = self._draws(0xF11B)
        return [bool(draws[i] < 0.5) for i in ids]

    def variants_of(self, ids, count: int) -> list:
        """Which of ``count`` caption variants each sample of ``ids`` trains with this epoch (each
        equally likely, per sample and epoch)."""
        draws = self._draws(0xCA9)
        return [min(int(draws[i] * count), count - 1) for i in ids]

    def epoch_batches(self, epoch: int = 0):
        """The batches of one epoch in order, without touching the iterator's state (validation)."""
        for ids in self.plan(epoch):
            yield self.cache.batch(ids)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "parts": self.parts}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``. A state saved with another ``parts`` (world size) continues at the
        same fraction of its epoch in this loader's plan, which has other batches."""
        for key in ("seed", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"loader state was saved with {key}={state[key]}, this loader has "
                                 f"{key}={getattr(self, key)}: the batches would differ")
        epoch, position = int(state["epoch"]), int(state["position"])
        parts = int(state.get("parts", 1))
        if parts != self.parts:
            saved = BucketBatchLoader(self.cache, self.batch_size, self.split, self.shuffle, self.seed, self.drop_last,
                                      parts)
            planned = len(saved.plan(epoch))
            if epoch < 0 or not 0 <= position <= planned:
                raise ValueError(f"loader state out of range: epoch {epoch}, position {position}")
            position = position * len(self.plan(epoch)) // planned
        if epoch < 0 or not 0 <= position <= len(self.plan(epoch)):
            raise ValueError(f"loader state out of range: epoch {epoch}, position {position}")
        self.epoch, self.position = epoch, position
