"""The latent cache: what a trainer needs of each image, computed once.

A cache is a folder::

    index.json                      format, dims, dtypes, buckets, shards, and one entry per sample
    b128x128-00000.safetensors      one shard: rows of one aspect bucket
    b112x144-00000.safetensors      ...

Each shard is a safetensors file holding, for its N samples (all of one aspect bucket, latent
size h x w), four stacked tensors:

- ``latents`` (N, C, h, w): VAE latents, already multiplied by the VAE's scaling factor;
- ``prompt_embeds`` (N, L, D): the text encoders' penultimate hidden states, concatenated
  (SDXL: 77 x 2048 = CLIP-L 768 + CLIP-G 1280);
- ``pooled`` (N, P): the pooled, projected CLIP-G embedding (SDXL: 1280);
- ``time_ids`` (N, 6): ``[orig_h, orig_w, crop_top, crop_left, target_h, target_w]`` in pixels.

``index.json`` lists every sample as ``{"shard", "row", "split", "caption", "source"}``; ``split``
is "train" or "val" (held out for the validation loss). Shards are read through memory maps, so a
batch costs the bytes of its rows only. ``CacheWriter`` groups samples by bucket and writes full
shards as they fill; ``LatentCache`` reads them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .. import runtime
from ..io import _read_header, atomic_write, save_safetensors
from ..ops.elementwise import to
from ..tensor import Tensor

FORMAT = "flame-latent-cache"
VERSION = 1
INDEX = "index.json"
FIELDS = ("latents", "prompt_embeds", "pooled", "time_ids")
SPLITS = ("train", "val")

# safetensors dtype codes of the cache (both NumPy dtypes, so shards are read through memory maps)
_NUMPY = {"F32": np.float32, "F16": np.float16}
_NAMES = {"fp32": "F32", "float32": "F32", torch.float32: "F32", "fp16": "F16", "float16": "F16",
          torch.float16: "F16"}


def _dtype_code(dtype, what):
    if dtype not in _NAMES:
        raise ValueError(f"{what} must be float32 or float16 ('fp32', 'fp16'), got {dtype!r}")
    return _NAMES[dtype]


class CacheWriter:
    """Builds a cache folder sample by sample (``add``), then ``close()`` writes the index.

    ``text_dtype``: dtype of ``prompt_embeds`` and ``pooled`` on disk (fp16 by default);
    ``latent_dtype``: of the latents (fp32 by default). ``meta``: free JSON-able facts recorded in
    the index (the checkpoint, the VAE scaling factor, how the data was made).
    """

    def __init__(self, path, latent_channels: int, text_len: int, text_dim: int, pooled_dim: int,
                 text_dtype="fp16", latent_dtype="fp32", shard_size: int = 256, meta: dict | None = None):
        if shard_size < 1:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        if os.path.exists(os.path.join(self.path, INDEX)):
            raise FileExistsError(f"{self.path} already holds a cache ({INDEX}); remove it or pick another folder")
        self.dims = {"latent_channels": int(latent_channels), "text_len": int(text_len), "text_dim": int(text_dim),
                     "pooled_dim": int(pooled_dim)}
        self.codes = {"latents": _dtype_code(latent_dtype, "latent_dtype"),
                      "prompt_embeds": _dtype_code(text_dtype, "text_dtype"),
                      "pooled": _dtype_code(text_dtype, "text_dtype"), "time_ids": "F32"}
        self.shard_size = int(shard_size)
        self.meta = dict(meta or {})
        self._buckets = {}  # (h, w) -> bucket index
        self._pending = {}  # bucket index -> list of (fields, entry)
        self._counts = {}  # bucket index -> shards written
        self.buckets, self.shards, self.samples = [], [], []

    def _shape_check(self, name, value, shape):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"CacheWriter.add: {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")

    def add(self, latents, prompt_embeds, pooled, time_ids, caption: str = "", source: str = "",
            split: str = "train") -> None:
        """Queue one sample (NumPy arrays or anything ``np.asarray`` takes)."""
        if split not in SPLITS:
            raise ValueError(f"CacheWriter.add: split must be one of {SPLITS}, got {split!r}")
        d = self.dims
        latents = np.asarray(latents, dtype=np.float32)
        if latents.ndim != 3 or latents.shape[0] != d["latent_channels"]:
            raise ValueError(f"CacheWriter.add: latents must be ({d['latent_channels']}, h, w), got {latents.shape}")
        fields = {"latents": latents, "prompt_embeds": np.asarray(prompt_embeds, dtype=np.float32),
                  "pooled": np.asarray(pooled, dtype=np.float32), "time_ids": np.asarray(time_ids, dtype=np.float32)}
        self._shape_check("prompt_embeds", fields["prompt_embeds"], (d["text_len"], d["text_dim"]))
        self._shape_check("pooled", fields["pooled"], (d["pooled_dim"],))
        self._shape_check("time_ids", fields["time_ids"], (6,))
        key = tuple(latents.shape[1:])
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = len(self.buckets)
            self.buckets.append({"latent_size": list(key), "count": 0})
            self._pending[b], self._counts[b] = [], 0
        self.buckets[b]["count"] += 1
        self._pending[b].append((fields, {"split": split, "caption": str(caption), "source": str(source)}))
        if len(self._pending[b]) >= self.shard_size:
            self._flush(b)

    def _flush(self, b):
        rows = self._pending[b]
        if not rows:
            return
        h, w = self.buckets[b]["latent_size"]
        name = f"b{h}x{w}-{self._counts[b]:05d}.safetensors"
        tensors = {f: torch.from_numpy(np.stack([r[0][f] for r in rows]).astype(_NUMPY[self.codes[f]]))
                   for f in FIELDS}
        save_safetensors(tensors, os.path.join(self.path, name), metadata={"format": FORMAT})
        shard = len(self.shards)
        self.shards.append({"file": name, "bucket": b, "count": len(rows)})
        for row, (_, entry) in enumerate(rows):
            self.samples.append({"shard": shard, "row": row, **entry})
        self._counts[b] += 1
        self._pending[b] = []

    def flush(self) -> None:
        """Write every bucket's queued samples as (possibly short) shards, freeing their memory."""
        for b in list(self._pending):
            self._flush(b)

    def close(self) -> str:
        """Write the remaining shards and ``index.json`` (atomically, last). Returns the folder."""
        self.flush()
        if not self.samples:
            raise ValueError("CacheWriter.close: no samples were added")
        doc = {"format": FORMAT, "version": VERSION, **self.dims,
               "dtypes": {f: self.codes[f] for f in FIELDS}, "meta": self.meta,
               "buckets": self.buckets, "shards": self.shards, "samples": self.samples}
        atomic_write(os.path.join(self.path, INDEX), lambda f: f.write(json.dumps(doc, indent=1).encode()))
        return self.path


@dataclass
class Batch:
    """One batch of cached samples on flame's device (all of one aspect bucket)."""

    latents: Tensor  # (B, C, h, w) fp32
    prompt_embeds: Tensor  # (B, L, D) as stored
    pooled: Tensor  # (B, P) as stored
    time_ids: Tensor  # (B, 6) fp32
    indices: tuple  # sample indices in the cache

    def __len__(self):
        return len(self.indices)


class LatentCache:
    """A cache folder opened for reading: sample metadata from ``index.json`` and rows read from
    memory-mapped shards on demand."""

    def __init__(self, path):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX)
        if not os.path.isfile(index):
            raise FileNotFoundError(f"no latent cache at {self.path} (missing {INDEX}); build one with "
                                    "scripts/prepare_cache.py (or --synthetic N for a demo cache)")
        with open(index) as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"{index}: not a {FORMAT} v{VERSION} index (format {doc.get('format')!r}, "
                             f"version {doc.get('version')!r})")
        self.latent_channels, self.text_len = int(doc["latent_channels"]), int(doc["text_len"])
        self.text_dim, self.pooled_dim = int(doc["text_dim"]), int(doc["pooled_dim"])
        self.meta = doc.get("meta", {})
        self.buckets = [tuple(b["latent_size"]) for b in doc["buckets"]]
        self.shards = doc["shards"]
        self.samples = doc["samples"]
        self._maps = {}  # shard -> {field: np.memmap}

    def __len__(self):
        return len(self.samples)

    def split(self, name: str) -> list:
        """Indices of the samples of split ``name`` ("train" or "val")."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [i for i, s in enumerate(self.samples) if s["split"] == name]

    def bucket_of(self, index: int) -> int:
        return self.shards[self.samples[index]["shard"]]["bucket"]

    def _map(self, shard):
        maps = self._maps.get(shard)
        if maps is not None:
            return maps
        path = os.path.join(self.path, self.shards[shard]["file"])
        with open(path, "rb") as f:
            header, base = _read_header(f, path)
        maps = {}
        for field in FIELDS:
            info = header.get(field)
            if info is None or info["dtype"] not in _NUMPY:
                raise ValueError(f"{path}: shard lacks a float32/float16 tensor {field!r}")
            begin, _ = info["data_offsets"]
            maps[field] = np.memmap(path, dtype=_NUMPY[info["dtype"]], mode="r", offset=base + begin,
                                    shape=tuple(info["shape"]))
        self._maps[shard] = maps
        return maps

    def read(self, indices) -> dict:
        """{field: host torch tensor} stacking the rows of ``indices`` (all of one bucket)."""
        indices = [int(i) for i in indices]
        if not indices:
            raise ValueError("LatentCache.read: no indices")
        buckets = {self.bucket_of(i) for i in indices}
        if len(buckets) != 1:
            raise ValueError(f"LatentCache.read: a batch must come from one aspect bucket, got {sorted(buckets)}")
        rows = [(self._map(self.samples[i]["shard"]), self.samples[i]["row"]) for i in indices]
        return {field: torch.from_numpy(np.stack([maps[field][row] for maps, row in rows])) for field in FIELDS}

    def batch(self, indices) -> Batch:
        """The rows of ``indices`` on flame's device; latents and time ids as fp32."""
        host = self.read(indices)
        dev = {}
        for field, t in host.items():
            if runtime.device.type != "cpu":
                t = t.pin_memory().to(runtime.device, non_blocking=True)  # host transfer, no stream sync
            x = Tensor(t)
            dev[field] = to(x, torch.float32) if field in ("latents", "time_ids") else x
        return Batch(dev["latents"], dev["prompt_embeds"], dev["pooled"], dev["time_ids"], tuple(indices))
