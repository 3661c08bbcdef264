"""Image folders into latent caches: datasets as users keep them, and a cache built or refreshed from
them (``scripts/prepare_cache.py`` and the trainer's ``data.images`` share this code).

Scanning (``scan_dataset``). A dataset is a folder, searched recursively for images (``IMAGE_EXTS``;
hidden files and folders left out). Captions come from ``metadata.jsonl`` in the folder (lines
``{"file_name": ..., "text": ...}``: the images it names, and only those) or from a file beside each
image with the caption extension (``cat.png`` -> ``cat.txt``; kohya's ``cat.caption`` with
``caption_extension=".caption"``). kohya's folder names give repeats: each subfolder named
``N_name`` (``10_sks dog``) is an image set trained N times per epoch and cached on its own; the
images outside such subfolders form one more set, of the folder's own count (N when the folder
itself is named ``N_name``, else 1). A ``repeats`` given with the dataset replaces every count the
names give. An image without a caption trains on the empty caption: one warning per dataset counts
them and names the first few (``require_captions`` makes it an error). A folder without images is
an error.

Caching (``plan_cache`` then ``write_cache``; ``build_or_refresh_cache`` does both for one cache).
Each image goes to the aspect bucket nearest its shape (``buckets.py``), is scaled to cover it and
cropped, and is encoded by an encoders object (below). The cache records the SHA-256 of each image
file and, in its meta, the ``CacheSettings`` it was encoded with (the model included). A refresh
reuses the rows of the images whose bytes, caption and settings are unchanged (a random crop and
the shuffled captions are drawn from the file's digest, so a reused row is the row a fresh build
writes), encodes the new and changed images and leaves out those no longer there; a cache that is
already up to date is not written, and needs no model. Images that Pillow cannot open are found
before anything is encoded: skipped with one warning naming them, or refused (``bad_images``). The
new cache replaces the old one atomically (``CacheWriter(replace=True)``); an error while encoding
leaves the old one as it was.

Encoders: any object with ``latent_channels``, ``text_len``, ``text_dim``, ``pooled_dim``,
``scaling_factor``, ``shift_factor``, ``family``, ``source``, ``encode_images(pixels)`` ((B, 3, H, W)
float32 NumPy in [-1, 1] -> (B, C, H/f, W/f) scaled latents) and ``encode_prompts(captions)`` (->
text embeddings (B, L, D) and pooled vectors (B, P)), NumPy arrays out. flame's are in
``flame.train.datasets``; ``scripts/prepare_cache.py`` adds diffusers' for cross-checks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import re
import sys
import zlib
from typing import NamedTuple

import numpy as np

from .buckets import fit_to_bucket, make_buckets, nearest_bucket
from .cache import INDEX, CacheError, CacheWriter, LatentCache

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_EXTS = (".txt", ".caption")  # the ones a warning about missing captions looks for
BAD_IMAGES = ("skip", "error")
KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")
NAMED = 5  # file names a warning lists


class DatasetError(ValueError):
    """A dataset that cannot be cached as asked; the message (one line) names the folder or files."""


class ImageItem(NamedTuple):
    path: pathlib.Path
    caption: str


@dataclasses.dataclass
class ImageSet:
    """Images cached together and trained with one repeat count: a dataset folder's own images
    (``name`` ""), or one of its kohya ``N_name`` subfolders (``name`` is the subfolder's)."""

    folder: pathlib.Path
    name: str
    repeats: int
    items: list


def _stderr(text):
    print(text, file=sys.stderr, flush=True)


def _listed(paths, folder) -> str:
    names = [str(pathlib.Path(p).relative_to(folder)) if pathlib.Path(p).is_relative_to(folder) else str(p)
             for p in paths]
    return ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


def folder_repeats(name: str) -> int | None:
    """N of a kohya folder name ``N_name`` (N >= 1), else None."""
    m = KOHYA_FOLDER.match(name)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


def caption_extension(text: str) -> str:
    """``text`` as a caption file extension with its dot (".txt", "caption" -> ".caption")."""
    ext = text if not isinstance(text, str) or text.startswith(".") else f".{text}"
    if not isinstance(ext, str) or len(ext) < 2 or "/" in ext or os.sep in ext or ext.lower() in IMAGE_EXTS:
        raise DatasetError(f"caption extension {text!r}: expected a file extension such as .txt or .caption")
    return ext


def _read_caption(path) -> str:
    try:
        return pathlib.Path(path).read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _from_metadata(folder, meta):
    """([ImageItem], [paths without a caption]) of ``metadata.jsonl`` rows."""
    items, missing = [], []
    for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            path, text = folder / row["file_name"], row.get("text")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DatasetError(f"{meta}:{n}: expected {{\"file_name\": ..., \"text\": ...}} ({e})") from None
        items.append(ImageItem(path, "" if text is None else str(text).strip()))
        if text is None:
            missing.append(path)
    absent = [str(p) for p, _ in items if not p.is_file()]
    if absent:
        raise DatasetError(f"{meta} names {len(absent)} missing image(s): {_listed(absent, folder)}")
    return items, missing


def _captioned(folder, ext, exclude=()):
    """([ImageItem], [paths without a caption]) of the images under ``folder``, recursively (leaving
    out its subfolders named in ``exclude``): metadata.jsonl's, else each with its caption file."""
    meta = folder / "metadata.jsonl"
    if meta.is_file():
        return _from_metadata(folder, meta)
    items, missing = [], []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if path.suffix.lower() not in IMAGE_EXTS or any(p.startswith(".") for p in parts) or parts[0] in exclude \
                or not path.is_file():
            continue
        text = path.with_suffix(ext)
        items.append(ImageItem(path, _read_caption(text) if text.is_file() else ""))
        if not text.is_file():
            missing.append(path)
    return items, missing


def scan_dataset(folder, caption_ext: str = ".txt", repeats: int | None = None, require_captions: bool = False,
                 log=_stderr) -> list:
    """The ``ImageSet``s of the dataset ``folder`` (see the module doc); ``repeats``: replaces the
    counts of kohya's folder names. DatasetError for a missing folder, one without images, or
    (``require_captions``) images without a caption, which are otherwise one warning to ``log``."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"{folder} {'is not a folder' if folder.exists() else 'does not exist'}")
    ext = caption_extension(caption_ext)
    kohya = [] if (folder / "metadata.jsonl").is_file() else sorted(
        d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".") and folder_repeats(d.name))
    sets = []
    items, missing = _captioned(folder, ext, exclude={d.name for d in kohya})
    if items:
        sets.append(ImageSet(folder, "", folder_repeats(folder.name) or 1, items))
    for sub in kohya:
        items, more = _captioned(sub, ext)
        if items:
            sets.append(ImageSet(sub, sub.name, folder_repeats(sub.name), items))
            missing += more
    if not sets:
        raise DatasetError(f"no images ({', '.join(IMAGE_EXTS)}) in {folder}")
    if repeats is not None:
        for s in sets:
            s.repeats = repeats
    if missing:
        total = sum(len(s.items) for s in sets)
        others = [e for e in CAPTION_EXTS if e != ext and any(p.with_suffix(e).is_file() for p in missing)]
        where = "a metadata.jsonl text" if (folder / "metadata.jsonl").is_file() else f"a {ext} file"
        text = (f"{len(missing)} of {total} images in {folder} have no caption ({where}): "
                f"{_listed(missing, folder)}" + (f"; they have {others[0]} files: set the caption extension to "
                                                 f"{others[0]}" if others else ""))
        if require_captions:
            raise DatasetError(f"{text} (captions are required)")
        log(f"warning: {text}; they train on the empty caption")
    return sets


def val_split(names, fraction, count=None) -> set:
    """The held-out names: the ``count`` (default round(fraction * n), at least 1 when fraction > 0
    and n > 1) with the smallest CRC32, so the split does not depend on file order."""
    n = len(names)
    k = count if count is not None else (max(1, round(fraction * n)) if fraction > 0 and n > 1 else 0)
    if not 0 <= k < max(n, 1):
        raise DatasetError(f"cannot hold out {k} of {n} samples for validation")
    return set(sorted(names, key=lambda s: (zlib.crc32(s.encode()), s))[:k])


def shuffled_captions(caption, count, keep_tokens, rng):
    """``count - 1`` variants of ``caption`` with its comma-separated tags shuffled, the first
    ``keep_tokens`` tags kept in place (kohya's tag shuffling, done once at cache time)."""
    tags = [t.strip() for t in caption.split(",") if t.strip()]
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    return [", ".join(head + [tail[i] for i in rng.permutation(len(tail))]) for _ in range(count - 1)]


def load_pixels(path, bucket, rng):
    """The image scaled to cover ``bucket`` and cropped: ((3, H, W) floats in [-1, 1], time_ids, the
    time ids of the mirrored crop, whose left edge is measured from the other side)."""
    from PIL import Image
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        rw, rh, left, top = fit_to_bucket(w, h, bucket, rng)
        im = im.resize((rw, rh), Image.Resampling.LANCZOS).crop((left, top, left + bucket[0], top + bucket[1]))
        arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return arr.transpose(2, 0, 1), [h, w, top, left, bucket[1], bucket[0]], \
        [h, w, top, rw - left - bucket[0], bucket[1], bucket[0]]


def file_sha256(path) -> str:
    """The hex SHA-256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _image_size(path):
    """(width, height) of the image at ``path``, or the reason Pillow cannot read it (a str)."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            size = im.size
            im.verify()  # the file's structure (PNG: every chunk's CRC) without decoding it
        return size
    except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, ValueError, ...
        return str(e) or type(e).__name__


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """How images are encoded into a cache. ``model``: what encodes them (the checkpoint and the
    encoders' options, JSON-able). All of it is part of every cached image's key: a refresh with
    other settings encodes every image anew."""

    model: object = None
    resolution: int = 1024  # buckets hold about resolution^2 pixels
    min_side: int | None = None  # bucket sides in pixels; None: resolution / 2 (rounded down to the step)
    max_side: int | None = None  # None: 2 * resolution (rounded down to the step)
    bucket_step: int = 64  # bucket sides are multiples of this many pixels
    random_crop: bool = False
    flip: bool = False  # also encode each image mirrored
    caption_variants: int = 1  # K captions per image: its own and K - 1 with shuffled tags
    keep_tokens: int = 0  # tags kept in place when shuffling
    seed: int = 0  # random crops and tag shuffles (with each file's digest)
    text_dtype: str = "fp16"  # of the text embeddings on disk

    def __post_init__(self):
        step = self.bucket_step
        if self.min_side is None:
            object.__setattr__(self, "min_side", max(step, self.resolution // 2 // step * step))
        if self.max_side is None:
            object.__setattr__(self, "max_side", max(step, 2 * self.resolution // step * step))

    def buckets(self) -> list:
        """The (width, height) aspect buckets; DatasetError when the sides allow none."""
        try:
            return make_buckets(self.resolution * self.resolution, self.bucket_step, self.min_side, self.max_side)
        except ValueError as e:
            raise DatasetError(f"aspect buckets of resolution {self.resolution}: {str(e).split(': ', 1)[-1]}") from None

    def record(self) -> dict:
        """The settings as the cache's meta records them (JSON values)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


class _Row(NamedTuple):
    item: ImageItem
    sha256: str
    bucket: tuple  # (width, height) in pixels
    old: int | None  # the sample of the old cache holding it, or None: to encode
    split: str


@dataclasses.dataclass
class CachePlan:
    """What ``write_cache`` does in one cache folder (``plan_cache``'s answer): ``rows`` in the order
    they are written, each copied from ``old`` or encoded; ``skipped``: unreadable images left out."""

    path: str
    settings: CacheSettings
    rows: list
    old: LatentCache | None
    skipped: list
    bad_images: str

    @property
    def reused(self) -> int:
        return sum(r.old is not None for r in self.rows)

    @property
    def up_to_date(self) -> bool:
        """Whether the folder's cache holds exactly these rows already (nothing to write)."""
        old = self.old
        return old is not None and old.has_empty_prompt and [
            (s.get("sha256"), s["caption"], s["source"], s["split"]) for s in old.samples] == [
            (r.sha256, r.item.caption, str(r.item.path), r.split) for r in self.rows]

    @property
    def needs_encoders(self) -> bool:
        """Whether writing it encodes anything (an image, or the empty caption)."""
        return not self.up_to_date and (self.reused < len(self.rows) or not self.old.has_empty_prompt)


def _old_cache(path, settings, log):
    """The cache in ``path`` when its rows can be reused with ``settings``, else None (said to ``log``)."""
    if not os.path.isfile(os.path.join(path, INDEX)):
        return None
    try:
        old = LatentCache(path)
    except CacheError as e:
        log(f"warning: the cache at {path} cannot be read ({e}); encoding every image anew")
        return None
    was, now = old.meta.get("encoding"), settings.record()
    if was != now:
        changed = ", ".join(f"{k} {was.get(k)!r} -> {v!r}" for k, v in now.items() if was.get(k) != v) \
            if isinstance(was, dict) else "it records none: an older cache"
        log(f"the cache at {path} was encoded with other settings ({changed}); encoding every image anew")
        return None
    return old


def plan_cache(path, images, settings: CacheSettings, val_fraction: float = 0.0, val_samples=None,
               bad_images: str = "error", log=_stderr) -> CachePlan:
    """What building or refreshing the cache in ``path`` from ``images`` ([ImageItem] or (path,
    caption) pairs) takes, found without any model and without writing: each file's digest, the
    rows of the cache already there that can be kept, the bucket of each new image (opened by
    Pillow: ``bad_images`` "skip" leaves the unreadable ones out with one warning, "error" raises a
    DatasetError naming them), and the held-out split (``val_split``)."""
    if bad_images not in BAD_IMAGES:
        raise ValueError(f"bad_images must be one of {BAD_IMAGES}, got {bad_images!r}")
    path = os.fspath(path)
    buckets = settings.buckets()
    old = _old_cache(path, settings, log)
    reusable, scale = {}, None
    if old is not None:
        for i, s in enumerate(old.samples):
            if "sha256" in s:
                reusable.setdefault((s["sha256"], s["caption"]), i)
        latent_h = old.buckets[old.bucket_of(0)][0]
        scale = int(old.read([0])["time_ids"][0, 4]) // latent_h  # pixels per latent
    rows, bad = [], []
    for file, caption in images:
        item = ImageItem(pathlib.Path(file), str(caption))
        try:
            digest = file_sha256(item.path)
        except OSError as e:
            bad.append((item.path, e.strerror or str(e)))
            continue
        i = reusable.get((digest, item.caption))
        if i is not None:
            h, w = old.buckets[old.bucket_of(i)]
            rows.append(_Row(item, digest, (w * scale, h * scale), i, "train"))
            continue
        size = _image_size(item.path)
        if isinstance(size, str):
            bad.append((item.path, size))
            continue
        rows.append(_Row(item, digest, nearest_bucket(*size, buckets), None, "train"))
    if bad:
        folder = os.path.commonpath([str(p) for p, _ in bad]) if len(bad) > 1 else os.path.dirname(bad[0][0])
        text = f"{len(bad)} image(s) that Pillow cannot read: " + _listed([p for p, _ in bad], folder) + \
            (f" ({bad[0][1]})" if len(bad) == 1 else "")
        if bad_images == "error":
            raise DatasetError(f"{text}; fix or remove them (or skip them: data.bad_images / --bad-images skip)")
        log(f"warning: skipping {text}")
    if not rows:
        raise DatasetError(f"no image left to cache in {path}: every one was unreadable")
    held = val_split([str(r.item.path) for r in rows], val_fraction, val_samples)
    rows = sorted((r._replace(split="val" if str(r.item.path) in held else "train") for r in rows),
                  key=lambda r: r.bucket)  # stable: each bucket in the scan's order
    return CachePlan(path, settings, rows, old, [p for p, _ in bad], bad_images)


def _row_rng(settings, digest, salt):
    return np.random.default_rng([settings.seed, salt, int(digest[:15], 16)])


def _encode(plan, encoders, rows, bucket, log):
    """Per row of ``rows`` (new ones, of one bucket), the fields ``CacheWriter.add`` takes, encoded
    (None for an image that fails to decode, skipped)."""
    s, loaded = plan.settings, []
    for r in rows:
        try:
            loaded.append(load_pixels(r.item.path, bucket, _row_rng(s, r.sha256, 0xC20) if s.random_crop else None))
        except Exception as e:  # a file that passed Pillow's check and fails to decode
            if plan.bad_images == "error":
                raise DatasetError(f"{r.item.path}: Pillow cannot read this image ({e})") from None
            log(f"warning: skipping {r.item.path}: Pillow cannot read this image ({e})")
            loaded.append(None)
    good = [j for j, x in enumerate(loaded) if x is not None]
    out = [None] * len(rows)
    if not good:
        return out
    pixels = np.stack([loaded[j][0] for j in good])
    latents = encoders.encode_images(pixels)
    mirrored = encoders.encode_images(np.ascontiguousarray(pixels[..., ::-1])) if s.flip else None
    embeds, pooled = encoders.encode_prompts([rows[j].item.caption for j in good])
    more = s.caption_variants - 1
    if more:
        others = [v for j in good for v in shuffled_captions(rows[j].item.caption, s.caption_variants, s.keep_tokens,
                                                             _row_rng(s, rows[j].sha256, 0xCA9))]
        v_embeds, v_pooled = encoders.encode_prompts(others)
    for k, j in enumerate(good):
        out[j] = {"latents": latents[k], "prompt_embeds": embeds[k], "pooled": pooled[k], "time_ids": loaded[j][1]}
        if s.flip:
            out[j].update(latents_flipped=mirrored[k], time_ids_flipped=loaded[j][2])
        if more:
            out[j].update(prompt_embeds_variants=v_embeds[k * more:(k + 1) * more],
                          pooled_variants=v_pooled[k * more:(k + 1) * more])
    return out


def _chunks(rows, batch_size):
    """``rows`` in order, cut after every ``batch_size``-th row to encode (kept rows ride along)."""
    chunk, new = [], 0
    for r in rows:
        chunk.append(r)
        new += r.old is None
        if new == batch_size:
            yield chunk
            chunk, new = [], 0
    if chunk:
        yield chunk


def write_cache(plan: CachePlan, encoders=None, batch_size: int = 4, shard_size: int = 256, progress=False,
                log=_stderr) -> str:
    """Carry out ``plan``: copy the rows kept, encode the others with ``encoders`` (needed when
    ``plan.needs_encoders``), and replace the folder's cache atomically (nothing is written when it
    is up to date). ``progress``: a tqdm bar over the images encoded. Returns the folder."""
    if plan.up_to_date:
        return plan.path
    if encoders is None and plan.needs_encoders:
        raise ValueError(f"write_cache: {plan.path} has images to encode, and no encoders were given")
    if encoders is not None and plan.old is not None:
        dims = (encoders.latent_channels, encoders.text_len, encoders.text_dim, encoders.pooled_dim)
        held = (plan.old.latent_channels, plan.old.text_len, plan.old.text_dim, plan.old.pooled_dim)
        if dims != held:  # another checkpoint at the same path
            log(f"the cache at {plan.path} holds rows of sizes {held}, the encoders make {dims} (latent channels, "
                "text length and width, pooled width); encoding every image anew")
            plan = dataclasses.replace(plan, rows=[r._replace(old=None) for r in plan.rows], old=None)
    s, old = plan.settings, plan.old
    if encoders is not None:
        dims = (encoders.latent_channels, encoders.text_len, encoders.text_dim, encoders.pooled_dim)
        meta = {"model": str(getattr(encoders, "source", "")), "family": getattr(encoders, "family", None),
                "scaling_factor": encoders.scaling_factor, "shift_factor": getattr(encoders, "shift_factor", None)}
    else:
        dims = (old.latent_channels, old.text_len, old.text_dim, old.pooled_dim)
        meta = {k: old.meta.get(k) for k in ("model", "family", "scaling_factor", "shift_factor")}
    meta.update(resolution=s.resolution, bucket_step=s.bucket_step, random_crop=s.random_crop, seed=s.seed,
                keep_tokens=s.keep_tokens, encoding=s.record())
    writer = CacheWriter(plan.path, *dims, text_dtype=s.text_dtype, shard_size=shard_size, meta=meta, flipped=s.flip,
                         caption_variants=s.caption_variants, replace=True)
    bar = None
    try:
        if encoders is not None:
            embeds, pooled = encoders.encode_prompts([""])  # the empty caption, for caption dropout
        else:
            embeds, pooled = old.host_empty_prompt()
        writer.set_empty_prompt(embeds[0], pooled[0])
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(plan.rows) - plan.reused, desc=f"encoding {os.path.basename(plan.path)}",
                       unit="img", dynamic_ncols=True)
        for bucket, rows in itertools.groupby(plan.rows, key=lambda r: r.bucket):
            for chunk in _chunks(rows, batch_size):
                new = [r for r in chunk if r.old is None]
                encoded = dict(zip(map(id, new), _encode(plan, encoders, new, bucket, log)))
                for r in chunk:
                    fields = old.stored(r.old) if r.old is not None else encoded[id(r)]
                    if fields is not None:  # None: unreadable after all, skipped
                        writer.add(**fields, caption=r.item.caption, source=str(r.item.path), split=r.split,
                                   sha256=r.sha256)
                if bar is not None:
                    bar.update(len(new))
            writer.flush()  # one bucket at a time: at most a shard of samples in memory
        if not writer.buckets:
            raise DatasetError(f"no image left to cache in {plan.path}: every one was unreadable")
        return writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()


def build_or_refresh_cache(cache_dir, images, encoders, settings: CacheSettings | None = None,
                           val_fraction: float = 0.0, val_samples=None, bad_images: str = "error", batch_size: int = 4,
                           shard_size: int = 256, progress=False, log=_stderr) -> str:
    """Build the cache in ``cache_dir`` from ``images`` ([ImageItem] or (path, caption) pairs), or
    refresh the one there (``plan_cache``, ``write_cache``). ``encoders``: an encoders object, or a
    function without arguments that loads one, called only when an image must be encoded.
    Returns the folder."""
    plan = plan_cache(cache_dir, images, settings or CacheSettings(), val_fraction, val_samples, bad_images, log)
    if plan.needs_encoders and not hasattr(encoders, "encode_images"):
        encoders = encoders()
    return write_cache(plan, encoders if plan.needs_encoders else None, batch_size, shard_size, progress, log)
