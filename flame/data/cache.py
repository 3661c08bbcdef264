"""The latent cache: what a trainer needs of each image, computed once.

A cache is a folder::

    index.json                      format, dims, dtypes, buckets, shards, and one entry per sample
    b128x128-00000.safetensors      one shard: rows of one aspect bucket
    b112x144-00000.safetensors      ...
    empty_prompt.safetensors        the text encoders' outputs for the empty caption (optional)

Each shard is a safetensors file holding, for its N samples (all of one aspect bucket, latent
size h x w), four stacked tensors:

- ``latents`` (N, C, h, w): VAE latents, already multiplied by the VAE's scaling factor;
- ``prompt_embeds`` (N, L, D): the text encoders' penultimate hidden states, concatenated
  (SDXL: 77 x 2048 = CLIP-L 768 + CLIP-G 1280);
- ``pooled`` (N, P): the pooled, projected CLIP-G embedding (SDXL: 1280);
- ``time_ids`` (N, 6): ``[orig_h, orig_w, crop_top, crop_left, target_h, target_w]`` in pixels;
- with flips (``"flipped": true`` in the index, for flip augmentation): ``latents_flipped`` and
  ``time_ids_flipped``, the same of the horizontally mirrored image (its crop's left edge measured
  from the other side);
- with K caption variants (``"caption_variants": K`` in the index, e.g. its tags shuffled):
  ``prompt_embeds_variants`` (N, K - 1, L, D) and ``pooled_variants`` (N, K - 1, P), variants 1..K-1
  (variant 0 is ``prompt_embeds`` / ``pooled``).

``empty_prompt.safetensors`` holds ``prompt_embeds`` (1, L, D) and ``pooled`` (1, P) of the empty
caption, which caption dropout trains on; ``index.json`` names it under ``"empty_prompt"`` (caches
written before it existed have none and still open).

``index.json`` lists every sample as ``{"shard", "row", "split", "caption", "source"}``; ``split``
is "train" or "val" (held out for the validation loss). A sample encoded from an image file may also
carry ``"sha256"``, the hex digest of the file's bytes, and the index's ``meta`` then says how it
was encoded (``flame.data.images``): a refresh of the cache reuses the rows whose file, caption and
encoding are unchanged (caches without them still open; a refresh encodes their images anew). Shards
are checked by the ``safetensors`` package and read through NumPy memory maps of their tensors, so a
batch costs the bytes of its rows only (``safe_open``'s slices copy each row: 8x slower on a batch
of four SDXL rows). ``CacheWriter`` groups samples by bucket and writes full shards as they fill;
``LatentCache`` reads them. A writer made with ``replace=True`` replaces the cache already in its
folder: its shards get names that the old cache does not use, ``index.json`` is replaced last
(atomically) and the files only the old index named are deleted after it, so the folder holds the
old cache or the new one at every moment; ``abort()`` deletes what the writer wrote and leaves the old
cache as it was.

``LatentCache`` checks the whole cache when it is opened, before any training starts: the index's
keys and entries, and every shard's safetensors header (fields, dtypes, shapes; ``safe_open``
checks the data offsets and the file size) against the index -- headers only, no data is read. A problem raises a
``CacheError`` naming the file; a missing ``index.json`` or shard raises ``CacheNotFoundError``,
which is also a ``FileNotFoundError``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from .. import runtime
from ..io import atomic_write, data_offsets, open_safetensors, save_safetensors
from ..ops.elementwise import to
from ..tensor import Tensor

FORMAT = "flame-latent-cache"
VERSION = 1
INDEX = "index.json"
FIELDS = ("latents", "prompt_embeds", "pooled", "time_ids")
TEXT_FIELDS = ("prompt_embeds", "pooled")
FLIPPED = {"latents": "latents_flipped", "time_ids": "time_ids_flipped"}  # field -> its mirrored image's
VARIANTS = {"prompt_embeds": "prompt_embeds_variants", "pooled": "pooled_variants"}  # field -> its other captions
EMPTY_PROMPT = "empty_prompt.safetensors"
_CACHE_FILE = re.compile(r"^(r\d+-)?(b\d+x\d+-\d+|empty_prompt)\.safetensors$")  # the files a writer makes
SPLITS = ("train", "val")

# safetensors dtype codes of the cache (both NumPy dtypes, so shards are read through memory maps)
_NUMPY = {"F32": np.float32, "F16": np.float16}
_NAMES = {"fp32": "F32", "float32": "F32", torch.float32: "F32", "fp16": "F16", "float16": "F16",
          torch.float16: "F16"}
_DIMS = ("latent_channels", "text_len", "text_dim", "pooled_dim")
_REBUILD = "rebuild the cache with scripts/prepare_cache.py"


class CacheError(ValueError):
    """A latent cache that cannot be used: a damaged or inconsistent ``index.json`` or shard. The
    message (one line) names the file and what is wrong."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """A latent cache without its ``index.json``, or a shard that its index lists but is missing."""


def _dtype_code(dtype, what):
    if dtype not in _NAMES:
        raise ValueError(f"{what} must be float32 or float16 ('fp32', 'fp16'), got {dtype!r}")
    return _NAMES[dtype]


class CacheWriter:
    """Builds a cache folder sample by sample (``add``), then ``close()`` writes the index.

    ``text_dtype``: dtype of ``prompt_embeds`` and ``pooled`` on disk (fp16 by default);
    ``latent_dtype``: of the latents (fp32 by default). ``meta``: free JSON-able facts recorded in
    the index (the checkpoint, the VAE scaling factor, how the data was made). ``flipped``: every
    sample also brings the latents and time ids of its mirrored image (flip augmentation).
    ``caption_variants``: K, every sample brings the text embeddings of K - 1 more captions.
    ``replace``: the folder may hold a cache, which ``close()`` replaces (see the module doc);
    otherwise a folder holding one is refused.
    """

    def __init__(self, path, latent_channels: int, text_len: int, text_dim: int, pooled_dim: int,
                 text_dtype="fp16", latent_dtype="fp32", shard_size: int = 256, meta: dict | None = None,
                 flipped: bool = False, caption_variants: int = 1, replace: bool = False):
        if shard_size < 1:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.path = os.fspath(path)
        if os.path.exists(os.path.join(self.path, INDEX)) and not replace:
            raise FileExistsError(f"{self.path} already holds a cache ({INDEX}); remove it or pick another folder")
        self._made = []  # folders made for the cache, deepest first (abort removes them when empty)
        folder = os.path.abspath(self.path)
        while not os.path.exists(folder) and folder != os.path.dirname(folder):
            self._made.append(folder)
            folder = os.path.dirname(folder)
        os.makedirs(self.path, exist_ok=True)
        taken = {name.split("-", 1)[0] for name in os.listdir(self.path) if _CACHE_FILE.match(name)}
        # file names of this cache: the plain ones in a new folder, else prefixed by a generation no file has
        self.prefix = "" if not taken else next(f"r{k}-" for k in range(1, len(taken) + 2) if f"r{k}" not in taken)
        self._written = []  # files written, for abort()
        self.dims = {"latent_channels": int(latent_channels), "text_len": int(text_len), "text_dim": int(text_dim),
                     "pooled_dim": int(pooled_dim)}
        self.codes = {"latents": _dtype_code(latent_dtype, "latent_dtype"),
                      "prompt_embeds": _dtype_code(text_dtype, "text_dtype"),
                      "pooled": _dtype_code(text_dtype, "text_dtype"), "time_ids": "F32"}
        self.flipped = bool(flipped)
        if self.flipped:
            self.codes.update({FLIPPED[f]: self.codes[f] for f in FLIPPED})
        if not isinstance(caption_variants, int) or caption_variants < 1:
            raise ValueError(f"caption_variants must be a positive int, got {caption_variants!r}")
        self.caption_variants = caption_variants
        if caption_variants > 1:
            self.codes.update({VARIANTS[f]: self.codes[f] for f in VARIANTS})
        self.shard_size = int(shard_size)
        self.meta = dict(meta or {})
        self._empty = None  # {field: (1, ...) array} of the empty caption
        self._buckets = {}  # (h, w) -> bucket index
        self._pending = {}  # bucket index -> list of (fields, entry)
        self._counts = {}  # bucket index -> shards written
        self.buckets, self.shards, self.samples = [], [], []

    def _shape_check(self, name, value, shape):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"CacheWriter.add: {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")

    def add(self, latents, prompt_embeds, pooled, time_ids, caption: str = "", source: str = "",
            split: str = "train", latents_flipped=None, time_ids_flipped=None, prompt_embeds_variants=None,
            pooled_variants=None, sha256: str | None = None) -> None:
        """Queue one sample (NumPy arrays or anything ``np.asarray`` takes); with ``flipped`` also its
        mirrored image's latents and time ids; with K caption variants the other captions' embeddings,
        (K - 1, L, D) and (K - 1, P). ``sha256``: the hex digest of the image file's bytes."""
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
        if self.flipped != (latents_flipped is not None and time_ids_flipped is not None):
            raise ValueError("CacheWriter.add: latents_flipped and time_ids_flipped are given exactly when the writer "
                             f"was made with flipped=True (it was made with flipped={self.flipped})")
        if self.flipped:
            fields["latents_flipped"] = np.asarray(latents_flipped, dtype=np.float32)
            fields["time_ids_flipped"] = np.asarray(time_ids_flipped, dtype=np.float32)
            self._shape_check("latents_flipped", fields["latents_flipped"], latents.shape)
            self._shape_check("time_ids_flipped", fields["time_ids_flipped"], (6,))
        more = self.caption_variants - 1
        if bool(more) != (prompt_embeds_variants is not None and pooled_variants is not None):
            raise ValueError(f"CacheWriter.add: prompt_embeds_variants and pooled_variants are given exactly when the "
                             f"writer keeps several caption variants (it keeps {self.caption_variants})")
        if more:
            fields["prompt_embeds_variants"] = np.asarray(prompt_embeds_variants, dtype=np.float32)
            fields["pooled_variants"] = np.asarray(pooled_variants, dtype=np.float32)
            self._shape_check("prompt_embeds_variants", fields["prompt_embeds_variants"],
                              (more, d["text_len"], d["text_dim"]))
            self._shape_check("pooled_variants", fields["pooled_variants"], (more, d["pooled_dim"]))
        key = tuple(latents.shape[1:])
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = len(self.buckets)
            self.buckets.append({"latent_size": list(key), "count": 0})
            self._pending[b], self._counts[b] = [], 0
        self.buckets[b]["count"] += 1
        entry = {"split": split, "caption": str(caption), "source": str(source)}
        if sha256 is not None:
            entry["sha256"] = str(sha256)
        self._pending[b].append((fields, entry))
        if len(self._pending[b]) >= self.shard_size:
            self._flush(b)

    def set_empty_prompt(self, prompt_embeds, pooled) -> None:
        """The text encoders' outputs for the empty caption, (L, D) and (P,): written once beside the
        shards, for caption dropout."""
        d = self.dims
        fields = {"prompt_embeds": np.asarray(prompt_embeds, dtype=np.float32),
                  "pooled": np.asarray(pooled, dtype=np.float32)}
        self._shape_check("empty prompt_embeds", fields["prompt_embeds"], (d["text_len"], d["text_dim"]))
        self._shape_check("empty pooled", fields["pooled"], (d["pooled_dim"],))
        self._empty = {f: v[None] for f, v in fields.items()}

    def _flush(self, b):
        rows = self._pending[b]
        if not rows:
            return
        h, w = self.buckets[b]["latent_size"]
        name = f"{self.prefix}b{h}x{w}-{self._counts[b]:05d}.safetensors"
        tensors = {f: torch.from_numpy(np.stack([r[0][f] for r in rows]).astype(_NUMPY[self.codes[f]]))
                   for f in self.codes}
        self._save(tensors, name)
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

    def _save(self, tensors, name):
        self._written.append(os.path.join(self.path, name))
        save_safetensors(tensors, self._written[-1], metadata={"format": FORMAT})

    def close(self) -> str:
        """Write the remaining shards and ``index.json`` (atomically, last); then delete the files of
        a replaced cache that the new index does not name. Returns the folder."""
        self.flush()
        if not self.samples:
            raise ValueError("CacheWriter.close: no samples were added")
        doc = {"format": FORMAT, "version": VERSION, **self.dims,
               "dtypes": dict(self.codes), "meta": self.meta, "flipped": self.flipped,
               "caption_variants": self.caption_variants,
               "buckets": self.buckets, "shards": self.shards, "samples": self.samples}
        if self._empty is not None:
            tensors = {f: torch.from_numpy(v.astype(_NUMPY[self.codes[f]])) for f, v in self._empty.items()}
            doc["empty_prompt"] = self.prefix + EMPTY_PROMPT
            self._save(tensors, doc["empty_prompt"])
        atomic_write(os.path.join(self.path, INDEX), lambda f: f.write(json.dumps(doc, indent=1).encode()))
        kept = {os.path.basename(p) for p in self._written}
        for name in os.listdir(self.path):
            if _CACHE_FILE.match(name) and name not in kept:
                os.unlink(os.path.join(self.path, name))
        self._written, self._made = [], []
        return self.path

    def abort(self) -> None:
        """Delete the files this writer wrote (and the folders it made, when they are empty): a
        folder it was to replace keeps its old cache."""
        for path in self._written:
            if os.path.exists(path):
                os.unlink(path)
        for folder in self._made:
            try:
                os.rmdir(folder)
            except OSError:  # not empty: keep it and its parents
                break
        self._written, self._made = [], []


def _count(value) -> bool:
    """Whether ``value`` is a non-negative JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _read_index(index) -> dict:
    """The parsed ``index.json`` at ``index``, checked: format and version, required keys, and every
    bucket, shard and sample entry consistent with the others (a ``CacheError`` otherwise)."""
    try:
        with open(index, "rb") as f:
            doc = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{index}: not valid JSON ({e}); the cache index is damaged, {_REBUILD}") from None
    if not isinstance(doc, dict):
        raise CacheError(f"{index}: not a {FORMAT} v{VERSION} index (a JSON {type(doc).__name__}, not an object)")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CacheError(f"{index}: not a {FORMAT} v{VERSION} index (format {doc.get('format')!r}, "
                         f"version {doc.get('version')!r})")

    def bad(what):
        return CacheError(f"{index}: {what}; the cache index is damaged, {_REBUILD}")

    missing = [k for k in (*_DIMS, "dtypes", "buckets", "shards", "samples") if k not in doc]
    if missing:
        raise bad(f"missing key(s) {missing}")
    for key in _DIMS:
        if not _count(doc[key]) or doc[key] == 0:
            raise bad(f"{key} must be a positive integer, got {_short(doc[key])}")
    dtypes = doc["dtypes"]
    variants = doc.get("caption_variants", 1)
    if not (_count(variants) and variants >= 1):
        raise bad(f"caption_variants must be a positive integer, got {_short(variants)}")
    fields = FIELDS + (tuple(FLIPPED.values()) if doc.get("flipped") else ()) + \
        (tuple(VARIANTS.values()) if variants > 1 else ())
    if not isinstance(dtypes, dict) or any(dtypes.get(f) not in _NUMPY for f in fields):
        raise bad(f"dtypes must give each of {list(fields)} as 'F32' or 'F16', got {_short(dtypes)}")
    buckets, shards, samples = doc["buckets"], doc["shards"], doc["samples"]
    for key, value in (("buckets", buckets), ("shards", shards), ("samples", samples)):
        if not isinstance(value, list):
            raise bad(f"{key} must be a list, got {_short(value)}")
    for b, entry in enumerate(buckets):
        size = entry.get("latent_size") if isinstance(entry, dict) else None
        if not (isinstance(size, list) and len(size) == 2 and all(_count(v) and v > 0 for v in size)
                and _count(entry.get("count"))):
            raise bad(f"buckets[{b}] must be {{'latent_size': [h, w], 'count': n}}, got {_short(entry)}")
    held, files = [0] * len(buckets), {}
    for s, entry in enumerate(shards):
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and entry["file"]
                and _count(entry.get("bucket")) and _count(entry.get("count")) and entry["count"] > 0):
            raise bad(f"shards[{s}] must be {{'file': name, 'bucket': b, 'count': n}}, got {_short(entry)}")
        if entry["bucket"] >= len(buckets):
            raise bad(f"shards[{s}] ({entry['file']}) points at bucket {entry['bucket']}, but the index has "
                      f"{len(buckets)} bucket(s)")
        if entry["file"] in files:
            raise bad(f"shards[{files[entry['file']]}] and shards[{s}] are both {entry['file']}")
        files[entry["file"]] = s
        held[entry["bucket"]] += entry["count"]
    for b, entry in enumerate(buckets):
        if entry["count"] != held[b]:
            raise bad(f"buckets[{b}] counts {entry['count']} samples, but its shards hold {held[b]} rows")
    first = np.cumsum([0] + [e["count"] for e in shards])  # global row number of each shard's row 0
    seen = np.zeros(int(first[-1]), dtype=bool)
    for i, entry in enumerate(samples):
        if not (isinstance(entry, dict) and _count(entry.get("shard")) and _count(entry.get("row"))
                and entry.get("split") in SPLITS):
            raise bad(f"samples[{i}] must have a 'shard', a 'row' and a 'split' in {SPLITS}, got {_short(entry)}")
        s, row = entry["shard"], entry["row"]
        if s >= len(shards):
            raise bad(f"samples[{i}] points at shard {s}, but the index has {len(shards)} shard(s)")
        if row >= shards[s]["count"]:
            raise bad(f"samples[{i}] points at row {row} of shards[{s}] ({shards[s]['file']}), which has "
                      f"{shards[s]['count']} row(s)")
        if seen[first[s] + row]:
            raise bad(f"samples[{i}] points at row {row} of shards[{s}] ({shards[s]['file']}), as an earlier "
                      "sample does")
        seen[first[s] + row] = True
    if "empty_prompt" in doc and not (isinstance(doc["empty_prompt"], str) and doc["empty_prompt"]):
        raise bad(f"empty_prompt must be a file name, got {_short(doc['empty_prompt'])}")
    return doc


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
    memory-mapped shards on demand. Opening checks the index and every shard's header and size
    (see the module doc): a ``CacheError`` naming the file if anything is wrong."""

    def __init__(self, path):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX)
        if not os.path.isfile(index):
            raise CacheNotFoundError(f"no latent cache at {self.path} (missing {INDEX}); build one with "
                                     "scripts/prepare_cache.py (or --synthetic N for a demo cache)")
        doc = _read_index(index)
        self.latent_channels, self.text_len, self.text_dim, self.pooled_dim = (doc[k] for k in _DIMS)
        self.meta = doc.get("meta", {})
        self.buckets = [tuple(b["latent_size"]) for b in doc["buckets"]]
        self.flipped = bool(doc.get("flipped"))  # mirrored images' latents too (flip augmentation)
        self.caption_variants = int(doc.get("caption_variants", 1))  # text embeddings of K captions per image
        self.shards = doc["shards"]
        self.samples = doc["samples"]
        self._layouts = [self._check_shard(s, doc["dtypes"]) for s in range(len(self.shards))]
        self._empty_file = doc.get("empty_prompt")
        if self._empty_file:
            shapes = {"prompt_embeds": (1, self.text_len, self.text_dim), "pooled": (1, self.pooled_dim)}
            self._check_file(os.path.join(self.path, self._empty_file), shapes, doc["dtypes"], "the empty-prompt file",
                             kind="file")
        self._maps = {}  # shard -> {field: np.memmap}

    def _check_shard(self, shard, dtypes):
        """{field: (offset, NumPy dtype, shape)} of shard ``shard``, from its header, which must match
        the index (fields, dtypes, shapes) and the file's size (no data is read)."""
        entry = self.shards[shard]
        n, (h, w) = entry["count"], self.buckets[entry["bucket"]]
        shapes = {"latents": (n, self.latent_channels, h, w), "prompt_embeds": (n, self.text_len, self.text_dim),
                  "pooled": (n, self.pooled_dim), "time_ids": (n, 6)}
        if self.flipped:
            shapes.update({FLIPPED[f]: shapes[f] for f in FLIPPED})
        if self.caption_variants > 1:
            shapes.update({VARIANTS[f]: (n, self.caption_variants - 1, *shapes[f][1:]) for f in VARIANTS})
        return self._check_file(os.path.join(self.path, entry["file"]), shapes, dtypes,
                                f"shards[{shard}] of {os.path.join(self.path, INDEX)}",
                                f" ({n} rows of bucket {h}x{w})")

    def _check_file(self, path, shapes, dtypes, what, rows="", kind="shard"):
        """{field: (offset, NumPy dtype, shape)} of the safetensors file ``path`` (``what`` in the
        index) holding ``shapes``: its header (``safe_open`` checks the offsets and the file's size)
        must hold them in the index's ``dtypes``; no data is read."""
        try:
            with open_safetensors(path, framework="numpy") as f:
                stored = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except FileNotFoundError:
            raise CacheNotFoundError(f"{path}: missing ({what}); {_REBUILD}") from None
        except OSError as e:
            raise CacheError(f"{path}: cannot read this file ({e.strerror}); {_REBUILD}") from None
        except ValueError as e:  # open_safetensors's messages name the file
            raise CacheError(f"{e}; the {kind} is damaged or not part of this cache, {_REBUILD}") from None

        def bad(what):
            return CacheError(f"{path}: {what}; the {kind} is damaged or not part of this cache, {_REBUILD}")

        for field in shapes:
            if field not in stored:
                raise bad(f"no tensor {field!r} (it holds {sorted(stored)[:8]})")
            dtype, shape = stored[field]
            if dtype != dtypes[field]:
                raise bad(f"{field} is {dtype!r}, the index says {dtypes[field]!r}")
            if list(shape) != list(shapes[field]):
                raise bad(f"{field} has shape {list(shape)}, the index says {list(shapes[field])}{rows}")
        offsets = data_offsets(path)
        return {field: (offsets[field], _NUMPY[dtypes[field]], shapes[field]) for field in shapes}

    def __len__(self):
        return len(self.samples)

    def split(self, name: str) -> list:
        """Indices of the samples of split ``name`` ("train" or "val")."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [i for i, s in enumerate(self.samples) if s["split"] == name]

    def bucket_of(self, index: int) -> int:
        return self.shards[self.samples[index]["shard"]]["bucket"]

    @property
    def has_empty_prompt(self) -> bool:
        """Whether the cache holds the empty caption's embedding (``empty_prompt``)."""
        return bool(self._empty_file)

    def host_empty_prompt(self) -> tuple:
        """``(prompt_embeds (1, L, D), pooled (1, P))`` of the empty caption as stored, NumPy arrays;
        a ``CacheError`` for a cache written without it."""
        if not self._empty_file:
            raise CacheError(f"{self.path} holds no embedding of the empty caption (caches written before "
                             f"{EMPTY_PROMPT} existed); {_REBUILD} to use caption dropout")
        with open_safetensors(os.path.join(self.path, self._empty_file), framework="numpy") as f:
            return tuple(f.get_tensor(field) for field in TEXT_FIELDS)

    def empty_prompt(self) -> tuple:
        """``host_empty_prompt()`` on flame's device."""
        return tuple(Tensor(torch.from_numpy(v).to(runtime.device)) for v in self.host_empty_prompt())  # host transfer

    def stored(self, index: int) -> dict:
        """{field: NumPy array} of every field stored for sample ``index`` (its mirrored image and
        caption variants too, when the cache holds them), as ``CacheWriter.add`` takes them."""
        entry = self.samples[index]
        return {field: np.array(rows[entry["row"]]) for field, rows in self._map(entry["shard"]).items()}

    def _map(self, shard):
        maps = self._maps.get(shard)
        if maps is None:
            path = os.path.join(self.path, self.shards[shard]["file"])
            maps = self._maps[shard] = {
                field: np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
                for field, (offset, dtype, shape) in self._layouts[shard].items()}
        return maps

    def read(self, indices, flips=None, variants=None) -> dict:
        """{field: host torch tensor} stacking the rows of ``indices`` (all of one bucket);
        ``flips``: per index, whether its mirrored image's latents and time ids are taken;
        ``variants``: per index, which caption variant's embeddings (0: the first)."""
        indices = [int(i) for i in indices]
        if not indices:
            raise ValueError("LatentCache.read: no indices")
        flips = [bool(f) for f in flips] if flips is not None else [False] * len(indices)
        if any(flips) and not self.flipped:
            raise CacheError(f"{self.path} holds no mirrored images' latents; rebuild it with scripts/prepare_cache.py "
                             "--flip to use flip augmentation")
        variants = [int(v) for v in variants] if variants is not None else [0] * len(indices)
        if any(not 0 <= v < self.caption_variants for v in variants):
            raise CacheError(f"{self.path} holds {self.caption_variants} caption variant(s) per image, asked for "
                             f"{sorted(set(variants))}; rebuild it with scripts/prepare_cache.py --caption-variants K")
        buckets = {self.bucket_of(i) for i in indices}
        if len(buckets) != 1:
            raise ValueError(f"LatentCache.read: a batch must come from one aspect bucket, got {sorted(buckets)}")
        rows = [(self._map(self.samples[i]["shard"]), self.samples[i]["row"]) for i in indices]

        def row_of(field, maps, row, flip, variant):
            if flip and field in FLIPPED:
                return maps[FLIPPED[field]][row]
            if variant and field in VARIANTS:
                return maps[VARIANTS[field]][row, variant - 1]
            return maps[field][row]

        return {field: torch.from_numpy(np.stack([row_of(field, maps, row, f, v)
                                                  for (maps, row), f, v in zip(rows, flips, variants)]))
                for field in FIELDS}

    def repeats_of(self, index: int) -> int:
        """How many times sample ``index`` is in an epoch (a ``CacheSet`` sets it per cache)."""
        return 1

    def weight_of(self, index: int) -> float:
        """The factor of sample ``index``'s loss (a ``CacheSet`` sets it per cache)."""
        return 1.0

    def batch(self, indices, flips=None, variants=None) -> Batch:
        """The rows of ``indices`` on flame's device (``flips``, ``variants``: see ``read``); latents
        and time ids as fp32."""
        return self.upload(self.read(indices, flips, variants), tuple(indices))

    @staticmethod
    def upload(host: dict, indices: tuple) -> Batch:
        """A ``Batch`` on flame's device of host rows ``{field: torch tensor}`` (``read``'s)."""
        dev = {}
        for field, t in host.items():
            if runtime.device.type != "cpu":
                t = t.pin_memory().to(runtime.device, non_blocking=True)  # host transfer, no stream sync
            x = Tensor(t)
            dev[field] = to(x, torch.float32) if field in ("latents", "time_ids") else x
        return Batch(dev["latents"], dev["prompt_embeds"], dev["pooled"], dev["time_ids"], indices)
