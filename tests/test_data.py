"""The latent cache, its bucketed loader, aspect buckets, the synthetic cache and scripts/prepare_cache.py."""
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import flame
from flame.data import (
    BucketBatchLoader,
    CacheError,
    CacheNotFoundError,
    CacheSet,
    CacheSettings,
    CacheWriter,
    DatasetError,
    LatentCache,
    build_or_refresh_cache,
    fit_to_bucket,
    make_buckets,
    nearest_bucket,
    scan_dataset,
    write_synthetic_cache,
)
from flame.data.images import shuffled_captions
from flame.io import load_safetensors, save_safetensors
from helpers import TF32_TOL

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _prepare_cache_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("prepare_cache", ROOT / "scripts" / "prepare_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sample(rng, h, w, c=4, L=5, D=6, P=3):
    return (rng.standard_normal((c, h, w)), rng.standard_normal((L, D)), rng.standard_normal(P),
            [8 * h, 8 * w, 0, 0, 8 * h, 8 * w])


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    """21 samples in 3 buckets of 9, 7 and 5 (one val sample in the first and one in the last), shards
    of 4 rows; returns (path, samples)."""
    path = tmp_path_factory.mktemp("cache") / "c"
    rng = np.random.default_rng(0)
    w = CacheWriter(path, 4, 5, 6, 3, shard_size=4, meta={"note": "test"})
    samples = []
    for i, (h, wd) in enumerate([(2, 2)] * 9 + [(2, 3)] * 7 + [(3, 2)] * 5):
        s = _sample(rng, h, wd)
        split = "val" if i in (3, 17) else "train"
        w.add(*s, caption=f"c{i}", source=f"img{i}.png", split=split)
        samples.append((s, split))
    assert w.close() == os.fspath(path)
    return path, samples


# ---- cache ----------------------------------------------------------------------------------------

def test_cache_round_trip_shards_and_index(small_cache):
    path, samples = small_cache
    cache = LatentCache(path)
    assert (len(cache), cache.latent_channels, cache.text_len, cache.text_dim, cache.pooled_dim) == (21, 4, 5, 6, 3)
    assert cache.buckets == [(2, 2), (2, 3), (3, 2)] and cache.meta == {"note": "test"}
    index = json.loads((path / "index.json").read_text())
    assert [s["count"] for s in index["shards"]] == [4, 4, 4, 4, 1, 3, 1]  # full shards as they fill, then rests
    assert sorted(p.name for p in path.glob("*.safetensors")) == sorted(s["file"] for s in index["shards"])
    assert cache.split("val") == [i for i, s in enumerate(cache.samples) if s["caption"] in ("c3", "c17")]
    by_source = {s["source"]: i for i, s in enumerate(cache.samples)}
    for n in (0, 3, 10, 20):
        (lat, emb, pooled, tids), split = samples[n]
        i = by_source[f"img{n}.png"]
        assert cache.samples[i]["split"] == split and cache.samples[i]["caption"] == f"c{n}"
        host = cache.read([i])
        assert host["latents"].dtype == torch.float32 and host["prompt_embeds"].dtype == torch.float16
        np.testing.assert_array_equal(host["latents"][0].numpy(), lat.astype(np.float32))
        np.testing.assert_array_equal(host["prompt_embeds"][0].numpy(), emb.astype(np.float16))
        np.testing.assert_array_equal(host["pooled"][0].numpy(), pooled.astype(np.float16))
        np.testing.assert_array_equal(host["time_ids"][0].numpy(), np.array(tids, np.float32))
    batch = cache.batch([by_source["img10.png"], by_source["img11.png"]])
    assert isinstance(batch.latents, flame.Tensor) and batch.latents.shape == (2, 4, 2, 3)
    assert batch.latents.dtype == flame.float32 and batch.time_ids.dtype == flame.float32
    assert batch.prompt_embeds.shape == (2, 5, 6) and batch.pooled.shape == (2, 3) and len(batch) == 2
    with pytest.raises(ValueError, match="one aspect bucket"):
        cache.read([by_source["img0.png"], by_source["img10.png"]])


def test_the_empty_caption_is_stored_once_and_old_caches_still_open(tmp_path, small_cache):
    path, _ = small_cache  # written without an empty caption, as caches were before it existed
    old = LatentCache(path)
    assert not old.has_empty_prompt
    with pytest.raises(CacheError, match=r"holds no embedding of the empty caption.*prepare_cache\.py"):
        old.empty_prompt()
    rng = np.random.default_rng(1)
    w = CacheWriter(tmp_path / "new", 4, 5, 6, 3, text_dtype="fp16")
    w.add(*_sample(rng, 2, 2))
    embeds, pooled = rng.standard_normal((5, 6)), rng.standard_normal(3)
    with pytest.raises(ValueError, match=r"empty prompt_embeds has shape \(6, 5\), expected \(5, 6\)"):
        w.set_empty_prompt(embeds.T, pooled)
    w.set_empty_prompt(embeds, pooled)
    cache = LatentCache(w.close())
    got_embeds, got_pooled = cache.empty_prompt()
    assert cache.has_empty_prompt and got_embeds.shape == (1, 5, 6) and got_pooled.dtype == torch.float16
    np.testing.assert_allclose(got_embeds.to(flame.float32).numpy()[0], embeds, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got_pooled.to(flame.float32).numpy()[0], pooled, rtol=1e-3, atol=1e-3)
    damaged = {"prompt_embeds": torch.zeros(1, 5, 6, dtype=torch.float16)}  # no pooled
    save_safetensors(damaged, tmp_path / "new" / "empty_prompt.safetensors")
    with pytest.raises(CacheError, match=r"empty_prompt.safetensors: no tensor 'pooled'.*the file is damaged"):
        LatentCache(tmp_path / "new")
    assert LatentCache(write_synthetic_cache(tmp_path / "syn", 3, 4, 5, 6, 3, latent_sizes=[(2, 2)])).has_empty_prompt


def test_a_cache_set_reads_like_one_cache_with_repeats_and_weights(tmp_path, small_cache):
    path, _ = small_cache
    rng = np.random.default_rng(3)
    w = CacheWriter(tmp_path / "b", 4, 5, 6, 3, shard_size=2)
    extra = [_sample(rng, 2, 3) for _ in range(3)]  # a bucket the first cache has too
    for s in extra:
        w.add(*s)
    a, b = LatentCache(path), LatentCache(w.close())
    cs = CacheSet([(a, 2, 1.0), (b, 1, 0.25)])
    assert len(cs) == 24 and cs.buckets == [(2, 2), (2, 3), (3, 2)]
    assert cs.split("val") == a.split("val") and cs.split("train")[-3:] == [21, 22, 23]
    assert (cs.repeats_of(0), cs.weight_of(0), cs.repeats_of(22), cs.weight_of(22)) == (2, 1.0, 1, 0.25)
    assert cs.bucket_of(22) == cs.bucket_of(10) == 1
    batch = cs.batch([22, 10, 21])  # rows of both caches, in the order asked
    np.testing.assert_allclose(batch.latents.numpy()[0], extra[1][0], rtol=1e-6)
    np.testing.assert_allclose(batch.latents.numpy()[1], a.read([10])["latents"].numpy()[0], rtol=1e-6)
    np.testing.assert_allclose(batch.latents.numpy()[2], extra[0][0], rtol=1e-6)
    loader = BucketBatchLoader(cs, 4, seed=1)
    planned = [i for ids in loader.plan(0) for i in ids]
    train_a = list(a.split("train"))
    assert sorted(planned) == sorted(train_a * 2 + [21, 22, 23])  # cache a's samples twice per epoch
    assert BucketBatchLoader(cs, 4, "val", shuffle=False).num_samples == 2  # no repeats in validation
    w2 = CacheWriter(tmp_path / "c", 4, 5, 7, 3)
    w2.add(rng.standard_normal((4, 2, 2)), rng.standard_normal((5, 7)), rng.standard_normal(3), [16] * 6)
    with pytest.raises(CacheError, match=r"does not fit .*: text_dim 7 against 6"):
        CacheSet([(a, 1, 1.0), (LatentCache(w2.close()), 1, 1.0)])


def test_mirrored_images_are_cached_and_chosen_per_sample_and_epoch(tmp_path, small_cache):
    rng = np.random.default_rng(5)
    w = CacheWriter(tmp_path / "f", 4, 5, 6, 3, flipped=True, shard_size=3)
    rows = []
    for _ in range(8):
        lat, emb, pooled, tid = _sample(rng, 2, 3)
        rows.append((lat, lat[..., ::-1] + 1.0, [16, 24, 0, 4, 16, 24]))
        w.add(lat, emb, pooled, tid, latents_flipped=rows[-1][1], time_ids_flipped=rows[-1][2])
    with pytest.raises(ValueError, match="exactly when the writer was made with flipped=True"):
        w.add(*_sample(rng, 2, 3))
    cache = LatentCache(w.close())
    assert cache.flipped and not LatentCache(small_cache[0]).flipped
    host = cache.read([0, 1, 2], flips=[False, True, False])
    np.testing.assert_allclose(host["latents"].numpy()[1], rows[1][1], rtol=1e-6)
    np.testing.assert_allclose(host["latents"].numpy()[0], rows[0][0], rtol=1e-6)
    np.testing.assert_array_equal(host["time_ids"].numpy()[1], rows[1][2])
    with pytest.raises(CacheError, match=r"holds no mirrored images' latents.*--flip"):
        LatentCache(small_cache[0]).read([0], flips=[True])
    loader = BucketBatchLoader(cache, 4, seed=2)
    first = loader.flips_of(range(8))
    assert first == BucketBatchLoader(cache, 4, seed=2).flips_of(range(8))  # from (seed, epoch) alone
    loader.epoch = 1
    assert loader.flips_of(range(8)) != first or BucketBatchLoader(cache, 4, seed=3).flips_of(range(8)) != first
    index = json.loads((tmp_path / "f" / "index.json").read_text())
    shard = tmp_path / "f" / index["shards"][0]["file"]
    tensors = {k: v.to_torch() for k, v in load_safetensors(shard).items() if k != "latents_flipped"}
    save_safetensors(tensors, shard)
    with pytest.raises(CacheError, match="no tensor 'latents_flipped'"):
        LatentCache(tmp_path / "f")


def test_prepare_cache_encodes_mirrored_images_with_their_crop(tmp_path):
    from PIL import Image

    class Encoders:  # a stand-in: latents are the pixels pooled 8x8, captions encode to zeros
        latent_channels, text_len, text_dim, pooled_dim, scaling_factor = 3, 4, 5, 2, 1.0

        def encode_images(self, pixels):
            b, c, h, w = pixels.shape
            return pixels.reshape(b, c, h // 8, 8, w // 8, 8).mean(axis=(3, 5))

        def encode_prompts(self, captions):
            return np.zeros((len(captions), 4, 5)), np.zeros((len(captions), 2))

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(folder / "a.png")
    out = build_or_refresh_cache(tmp_path / "c", [(folder / "a.png", "x")], Encoders(),
                                 CacheSettings(resolution=64, min_side=64, max_side=64, flip=True, random_crop=True,
                                               seed=3), val_samples=0)
    cache = LatentCache(out)
    plain, mirrored = cache.read([0]), cache.read([0], flips=[True])
    np.testing.assert_allclose(mirrored["latents"].numpy()[0], plain["latents"].numpy()[0][..., ::-1], atol=1e-6)
    # the captions: as written, and with their tags shuffled behind the first (keep_tokens=1)
    out = build_or_refresh_cache(tmp_path / "v", [(folder / "a.png", "sks, red, blue, green")], Encoders(),
                                 CacheSettings(resolution=64, min_side=64, max_side=64, caption_variants=4,
                                               keep_tokens=1), val_samples=0)
    assert LatentCache(out).caption_variants == 4
    variants = shuffled_captions("sks, red, blue, green", 40, 1, np.random.default_rng(0))
    assert all(v.startswith("sks, ") and sorted(v.split(", ")[1:]) == ["blue", "green", "red"] for v in variants)
    assert len(set(variants)) > 1
    # 80x64 covers the 64x64 bucket at its size; the crop's left edge of the mirror is 80 - left - 64
    ids, flipped_ids = plain["time_ids"].numpy()[0], mirrored["time_ids"].numpy()[0]
    assert list(ids[:3]) == [64, 80, 0] and list(ids[4:]) == [64, 64] and 0 <= ids[3] <= 16
    np.testing.assert_array_equal(flipped_ids, [64, 80, 0, 16 - ids[3], 64, 64])


def test_caption_variants_are_cached_and_one_is_chosen_per_sample_and_epoch(tmp_path):
    rng = np.random.default_rng(6)
    w = CacheWriter(tmp_path / "v", 4, 5, 6, 3, caption_variants=3)
    texts = []
    for _ in range(6):
        lat, emb, pooled, tid = _sample(rng, 2, 2)
        more_e, more_p = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 3))
        texts.append(([emb, *more_e], [pooled, *more_p]))
        w.add(lat, emb, pooled, tid, prompt_embeds_variants=more_e, pooled_variants=more_p)
    with pytest.raises(ValueError, match="exactly when the writer keeps several caption variants"):
        w.add(*_sample(rng, 2, 2))
    cache = LatentCache(w.close())
    host = cache.read([0, 1, 2], variants=[2, 0, 1])
    for j, (i, v) in enumerate([(0, 2), (1, 0), (2, 1)]):
        np.testing.assert_allclose(host["prompt_embeds"].float().numpy()[j], texts[i][0][v], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(host["pooled"].float().numpy()[j], texts[i][1][v], rtol=1e-3, atol=1e-3)
    with pytest.raises(CacheError, match=r"holds 3 caption variant\(s\) per image, asked for \[0, 3\]"):
        cache.read([0, 1], variants=[0, 3])
    loader = BucketBatchLoader(cache, 2, seed=1)
    picks = loader.variants_of(range(6), 3)
    assert picks == BucketBatchLoader(cache, 2, seed=1).variants_of(range(6), 3) and set(picks) <= {0, 1, 2}
    counts = np.bincount([v for e in range(300) for v in _epoch_picks(cache, e)], minlength=3)
    assert counts.min() > 0.25 * counts.sum()  # each variant about a third of the time


def _epoch_picks(cache, epoch):
    loader = BucketBatchLoader(cache, 2, seed=1)
    loader.epoch = epoch
    return loader.variants_of([0], 3)


def test_cache_writer_and_reader_errors(tmp_path, small_cache):
    w = CacheWriter(tmp_path / "x", 4, 5, 6, 3)
    rng = np.random.default_rng(1)
    lat, emb, pooled, tids = _sample(rng, 2, 2)
    with pytest.raises(ValueError, match=r"prompt_embeds has shape \(5, 7\), expected \(5, 6\)"):
        w.add(lat, np.zeros((5, 7)), pooled, tids)
    with pytest.raises(ValueError, match=r"latents must be \(4, h, w\)"):
        w.add(lat[:3], emb, pooled, tids)
    with pytest.raises(ValueError, match="split must be one of"):
        w.add(lat, emb, pooled, tids, split="test")
    with pytest.raises(ValueError, match="no samples"):
        w.close()
    with pytest.raises(ValueError, match="float32 or float16"):
        CacheWriter(tmp_path / "y", 4, 5, 6, 3, text_dtype="int8")
    with pytest.raises(FileExistsError, match="already holds a cache"):
        CacheWriter(small_cache[0], 4, 5, 6, 3)
    with pytest.raises(CacheNotFoundError, match=r"prepare_cache\.py") as e:
        LatentCache(tmp_path / "nothing")
    assert isinstance(e.value, FileNotFoundError)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "index.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a flame-latent-cache"):
        LatentCache(tmp_path / "z")


def _copy(small_cache, tmp_path):
    """A copy of the small cache to damage: (folder, its index as a dict)."""
    path = tmp_path / "c"
    shutil.copytree(small_cache[0], path)
    return path, json.loads((path / "index.json").read_text())


def _cache_error(path, match, kind=CacheError):
    """Opening the cache at ``path`` raises ``kind`` matching ``match``, in one line."""
    with pytest.raises(kind, match=match) as e:
        LatentCache(path)
    assert "\n" not in str(e.value)
    return e.value


def test_cache_open_rejects_a_damaged_index_json(small_cache, tmp_path):
    path, _ = _copy(small_cache, tmp_path)
    (path / "index.json").write_text('{"format":')
    _cache_error(path, r"c/index\.json: not valid JSON \(Expecting value: line 1 column 11 \(char 10\)\); the cache "
                       r"index is damaged, rebuild the cache with scripts/prepare_cache\.py$")
    (path / "index.json").write_bytes(b'{"format": "\xff"}')
    _cache_error(path, r"c/index\.json: not valid JSON \(.*utf-8.*\); the cache index is damaged")
    (path / "index.json").write_text("[]")
    _cache_error(path, r"c/index\.json: not a flame-latent-cache v1 index \(a JSON list, not an object\)")


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("samples"), r"missing key\(s\) \['samples'\]"),
    (lambda d: d.update(text_dim="6"), r"text_dim must be a positive integer, got '6'"),
    (lambda d: d["dtypes"].pop("pooled"), r"dtypes must give each of \['latents', .*'time_ids'\] as 'F32' or 'F16'"),
    (lambda d: d["samples"][5].update(shard=7), r"samples\[5\] points at shard 7, but the index has 7 shard\(s\)"),
    (lambda d: d["samples"][5].update(row=4),
     r"samples\[5\] points at row 4 of shards\[1\] \(b2x2-00001\.safetensors\), which has 4 row\(s\)"),
    (lambda d: d["samples"][5].update(row=0),
     r"samples\[5\] points at row 0 of shards\[1\] \(b2x2-00001\.safetensors\), as an earlier sample does"),
    (lambda d: d["samples"][5].pop("split"), r"samples\[5\] must have a 'shard', a 'row' and a 'split' in"),
    (lambda d: d["shards"][2].update(bucket=3),
     r"shards\[2\] \(b2x3-00000\.safetensors\) points at bucket 3, but the index has 3 bucket\(s\)"),
    (lambda d: d["shards"][2].update(file="b2x2-00000.safetensors"),
     r"shards\[0\] and shards\[2\] are both b2x2-00000\.safetensors"),
    (lambda d: d["buckets"][0].update(count=10), r"buckets\[0\] counts 10 samples, but its shards hold 9 rows"),
    (lambda d: d["buckets"][1].pop("latent_size"), r"buckets\[1\] must be \{'latent_size': \[h, w\], 'count': n\}"),
], ids=["missing-key", "dim", "dtypes", "sample-shard", "sample-row", "duplicate-row", "sample-entry",
        "shard-bucket", "duplicate-shard", "bucket-count", "bucket-entry"])
def test_cache_open_rejects_an_inconsistent_index(small_cache, tmp_path, edit, match):
    path, doc = _copy(small_cache, tmp_path)
    edit(doc)
    (path / "index.json").write_text(json.dumps(doc))
    _cache_error(path, r"c/index\.json: " + match + r".*; the cache index is damaged, rebuild the cache with "
                 r"scripts/prepare_cache\.py$")


def test_cache_open_checks_each_shards_rows_against_the_index(small_cache, tmp_path):
    path, doc = _copy(small_cache, tmp_path)
    doc["samples"].pop(3)  # row 3 of shards[0]: the index now lists 3 rows of its 4
    doc["shards"][0]["count"], doc["buckets"][0]["count"] = 3, 8
    (path / "index.json").write_text(json.dumps(doc))
    _cache_error(path, r"b2x2-00000\.safetensors: latents has shape \[4, 4, 2, 2\], the index says \[3, 4, 2, 2\] "
                       r"\(3 rows of bucket 2x2\); the shard is damaged or not part of this cache")


def _resaved(edit):
    """A damage that rewrites the shard with ``edit`` applied to its tensors ({name: NumPy array})."""
    def damage(path):
        tensors = {k: v.numpy() for k, v in load_safetensors(path).items()}
        edit(tensors)
        save_safetensors({k: torch.from_numpy(v) for k, v in tensors.items()}, path)
    return damage


def _shard_offsets(path):
    """Rewrite the shard's header so that latents' data_offsets span 4 bytes too few."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["latents"]["data_offsets"][1] -= 4
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_bytes(p.read_bytes()[:-3]), r"truncated or damaged \(safetensors: .*not fully covered\)"),
    (lambda p: p.write_bytes(b"garbage!" * 64),
     r"damaged or not a safetensors file \(safetensors: .*header too large\)"),
    (lambda p: p.write_bytes(b"abc"), r"damaged or not a safetensors file \(safetensors: .*header too small\)"),
    (lambda p: p.write_bytes(p.read_bytes()[:40]), r"damaged or not a safetensors file \(safetensors: .*header length"),
    (lambda p: save_safetensors({"weight": torch.zeros(3)}, p), r"no tensor 'latents' \(it holds \['weight'\]\)"),
    (_resaved(lambda t: t.update(latents=t["latents"].astype(np.float16))), r"latents is 'F16', the index says 'F32'"),
    (_resaved(lambda t: t.update(pooled=np.zeros((4, 4), np.float16))),
     r"pooled has shape \[4, 4\], the index says \[4, 3\] \(4 rows of bucket 2x3\)"),
    (lambda p: shutil.copyfile(p.with_name("b2x2-00000.safetensors"), p),
     r"latents has shape \[4, 4, 2, 2\], the index says \[4, 4, 2, 3\] \(4 rows of bucket 2x3\)"),
    (_shard_offsets, r"damaged or not a safetensors file \(safetensors: .*invalid shape, data type, or offset"),
], ids=["truncated", "garbage", "tiny", "cut-header", "foreign", "dtype", "shape", "other-bucket", "offsets"])
def test_cache_open_rejects_a_damaged_shard(small_cache, tmp_path, damage, match):
    """Every shard is checked at open time (header and size only), not when training first reads its
    bucket: shards[2] holds samples 8..11 of bucket 1 (2x3)."""
    path, doc = _copy(small_cache, tmp_path)
    shard = path / doc["shards"][2]["file"]
    assert shard.name == "b2x3-00000.safetensors"
    damage(shard)
    _cache_error(path, r"c/b2x3-00000\.safetensors: " + match + r".*; the shard is damaged or not part of this "
                 r"cache, rebuild the cache with scripts/prepare_cache\.py$")


def test_cache_open_reports_a_missing_shard(small_cache, tmp_path):
    path, doc = _copy(small_cache, tmp_path)
    (path / doc["shards"][3]["file"]).unlink()
    err = _cache_error(path, r"c/b3x2-00000\.safetensors: missing \(shards\[3\] of .*c/index\.json\); rebuild the "
                             r"cache with scripts/prepare_cache\.py$", CacheNotFoundError)
    assert isinstance(err, FileNotFoundError)


# ---- loader ---------------------------------------------------------------------------------------

def test_loader_batches_within_buckets_and_covers_each_epoch(small_cache):
    cache = LatentCache(small_cache[0])
    train = set(cache.split("train"))
    loader = BucketBatchLoader(cache, 3, seed=7)
    assert len(loader) == 3 + 3 + 2 and loader.num_samples == 19  # buckets of 8, 7 and 4 train samples
    for epoch in range(3):
        plan = loader.plan(epoch)
        seen = [i for b in plan for i in b]
        assert sorted(seen) == sorted(train)  # every training sample once, no val sample
        assert all(len({cache.bucket_of(i) for i in b}) == 1 for b in plan)
    assert loader.plan(0) != loader.plan(1)
    assert BucketBatchLoader(cache, 3, seed=7).plan(1) == loader.plan(1)
    assert BucketBatchLoader(cache, 3, seed=8).plan(0) != loader.plan(0)
    assert sorted(len(b) for b in loader.plan(0)) == [1, 1, 2, 3, 3, 3, 3, 3]
    dropped = BucketBatchLoader(cache, 3, seed=7, drop_last=True)
    assert all(len(b) == 3 for b in dropped.plan(0)) and len(dropped) == 5
    fixed = BucketBatchLoader(cache, 4, split="val", shuffle=False)
    assert fixed.plan(0) == fixed.plan(5) and [len(b) for b in fixed.plan(0)] == [1, 1]
    with pytest.raises(ValueError, match="no batch of 9"):
        BucketBatchLoader(cache, 9, drop_last=True)


def test_loader_resumes_mid_epoch_and_across_epochs(small_cache):
    cache = LatentCache(small_cache[0])
    ref = BucketBatchLoader(cache, 3, seed=3)
    straight = [next(ref).indices for _ in range(12)]  # crosses into epoch 1 after 8 batches
    assert ref.state_dict()["epoch"] == 1 and ref.state_dict()["position"] == 4
    for cut in (0, 4, 7, 9):
        a = BucketBatchLoader(cache, 3, seed=3)
        head = [next(a).indices for _ in range(cut)]
        b = BucketBatchLoader(cache, 3, seed=3)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        assert head + [next(b).indices for _ in range(12 - cut)] == straight
    b = next(BucketBatchLoader(cache, 3, seed=3))
    assert b.indices == straight[0] and b.latents.shape[0] == len(b)
    with pytest.raises(ValueError, match="seed=3, this loader has seed=4"):
        BucketBatchLoader(cache, 3, seed=4).load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match="out of range"):
        BucketBatchLoader(cache, 3, seed=3).load_state_dict({"epoch": 0, "position": 99})


# ---- buckets --------------------------------------------------------------------------------------

def test_aspect_buckets():
    buckets = make_buckets()
    assert (1024, 1024) in buckets and (896, 1152) in buckets and (1152, 896) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0 and min(w, h) >= 512 and max(w, h) <= 2048
        assert w * h <= 1024 * 1024
    ratios = [w / h for w, h in buckets]
    assert ratios == sorted(ratios)
    assert nearest_bucket(1000, 1000, buckets) == (1024, 1024)
    assert nearest_bucket(1920, 1080, buckets) == (1344, 768)
    assert nearest_bucket(600, 900, buckets) == (832, 1216)
    rw, rh, left, top = fit_to_bucket(1920, 1080, (1344, 768))
    assert (rw, rh) == (1365, 768) and (left, top) == (10, 0)  # covers the bucket, centred crop
    rng = np.random.default_rng(0)
    crops = {fit_to_bucket(1920, 1080, (1344, 768), rng)[2] for _ in range(50)}
    assert min(crops) >= 0 and max(crops) <= 21 and len(crops) > 5
    assert fit_to_bucket(500, 500, (1024, 1024)) == (1024, 1024, 0, 0)  # upscaled to cover
    with pytest.raises(ValueError, match="multiples of step"):
        make_buckets(min_side=500)


# ---- synthetic ------------------------------------------------------------------------------------

def test_synthetic_cache_is_deterministic_and_learnable(tmp_path):
    a = write_synthetic_cache(tmp_path / "a", 48, 4, 10, 12, 5, latent_sizes=[(6, 6), (6, 8)], concepts=4, seed=5)
    b = write_synthetic_cache(tmp_path / "b", 48, 4, 10, 12, 5, latent_sizes=[(6, 6), (6, 8)], concepts=4, seed=5)
    ca, cb = LatentCache(a), LatentCache(b)
    assert len(ca.split("val")) == 6 and ca.buckets == [(6, 6), (6, 8)]
    ids = [i for i in range(48) if ca.bucket_of(i) == 0]
    ra, rb = ca.read(ids), cb.read(ids)
    assert all(np.array_equal(ra[k].numpy(), rb[k].numpy()) for k in ra)
    # word token k is z_k times a fixed vector: its top singular direction recovers z_k (up to scale),
    # and the latents are a linear function of the 4 strengths (plus a little noise)
    emb = ra["prompt_embeds"].float().numpy()
    z = np.stack([emb[:, 1 + k] @ np.linalg.svd(emb[:, 1 + k], full_matrices=False)[2][0] for k in range(4)], 1)
    y = ra["latents"].reshape(len(ids), -1).numpy()
    features = np.c_[z, np.ones(len(ids))]
    coef, *_ = np.linalg.lstsq(features, y, rcond=None)
    resid = y - features @ coef
    assert resid.var() < 0.05 * y.var(), (resid.var(), y.var())
    assert 0.5 < y.std() < 2.0
    t = ra["time_ids"].numpy()
    assert (t == np.array([48, 48, 0, 0, 48, 48], np.float32)).all()


@pytest.mark.extended  # synthetic caches: every trainer test writes one
# ---- scripts/prepare_cache.py -----------------------------------------------------------------------

def test_prepare_cache_synthetic_cli(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "cache"
    r = subprocess.run([sys.executable, "scripts/prepare_cache.py", str(out), "--synthetic", "16", "--model-config",
                        "tiny", "--latent-sizes", "8x8,8x12", "--val-samples", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote 16 samples (14 train, 2 val) in 2 bucket(s)" in r.stdout
    cache = LatentCache(out)
    assert (cache.latent_channels, cache.text_len, cache.text_dim, cache.pooled_dim) == (4, 77, 32, 16)
    r = subprocess.run([sys.executable, "scripts/prepare_cache.py", str(out), "--synthetic", "4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "already holds a cache" in r.stderr
    r = subprocess.run([sys.executable, "scripts/prepare_cache.py", str(tmp_path / "n"), "--images", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--images needs --model" in r.stderr


@pytest.mark.slow
@pytest.mark.extended
def test_prepare_cache_from_images_with_a_tiny_sdxl(tmp_path):
    """flame's encoders (the default) write the cache the diffusers path writes, on a tiny pipeline.
    Extended: its parts, the encoders (test_vae.py, test_clip_text.py) and the image cache
    (test_image_datasets.py), are checked in the default run."""
    pytest.importorskip("diffusers")
    pytest.importorskip("PIL")
    from PIL import Image
    from tiny_sdxl import write_tiny_pipeline
    model = write_tiny_pipeline(tmp_path / "sdxl")
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    sizes = {"wide.png": (96, 48), "tall.jpg": (40, 80), "square.png": (64, 64), "sq2.png": (70, 66)}
    for name, (w, h) in sizes.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(images / name)
        (images / name).with_suffix(".txt").write_text(f"a {name.split('.')[0]}")
    pc = _prepare_cache_module()
    items = scan_dataset(images)[0].items
    assert sorted((p.name, c) for p, c in items)[0] == ("sq2.png", "a sq2")
    caches = {}
    for who, enc in (("flame", pc.FlameEncoders(model, "fp32", latents="mean", text_encoder_dtype="fp32")),
                     ("diffusers", pc.SDXLEncoders(model, device="cpu", latents="mean"))):
        assert (enc.text_dim, enc.pooled_dim, enc.text_len, enc.latent_channels) == (32, 16, 77, 4)
        out = build_or_refresh_cache(tmp_path / who, items, enc, CacheSettings(
            resolution=91, min_side=64, max_side=128, text_dtype="fp32"), val_samples=1, batch_size=2)
        cache = LatentCache(out)
        assert len(cache) == 4 and len(cache.split("val")) == 1
        by_name = {pathlib.Path(s["source"]).name: i for i, s in enumerate(cache.samples)}
        caches[who] = {n: {k: v.float().numpy() for k, v in cache.read([i]).items()} for n, i in by_name.items()}
    host = caches["flame"]
    # buckets of at most 91^2 px: 64x64, 128x64, 64x128; wide 2:1 -> 128x64, tall 1:2 -> 64x128 (the tiny VAE
    # halves each side)
    assert host["wide.png"]["latents"].shape == (1, 4, 32, 64)
    assert host["tall.jpg"]["latents"].shape == (1, 4, 64, 32)
    assert host["square.png"]["latents"].shape == (1, 4, 32, 32)
    # time ids: original (h, w), crop (top, left), target (h, w)
    np.testing.assert_array_equal(host["wide.png"]["time_ids"][0], [48, 96, 0, 0, 64, 128])
    np.testing.assert_array_equal(host["sq2.png"]["time_ids"][0], [66, 70, 0, 2, 64, 64])  # 68x64, crop
    for name, sample in host.items():
        for key in ("latents", "prompt_embeds", "pooled", "time_ids"):
            np.testing.assert_allclose(sample[key], caches["diffusers"][name][key],
                                       **(TF32_TOL or dict(rtol=1e-4, atol=1e-5)), err_msg=f"{name} {key}")
    # metadata.jsonl takes precedence over .txt files
    (images / "metadata.jsonl").write_text(json.dumps({"file_name": "wide.png", "text": "from jsonl"}) + "\n")
    assert [(p.name, c) for p, c in scan_dataset(images)[0].items] == [("wide.png", "from jsonl")]
    with pytest.raises(SystemExit, match="not an SDXL checkpoint folder"):
        pc.SDXLEncoders(images, device="cpu")
    (images / "metadata.jsonl").unlink()
    (images / "broken.png").write_text("not an image")
    with pytest.raises(DatasetError, match=r"1 image\(s\) that Pillow cannot read: broken\.png"):
        build_or_refresh_cache(tmp_path / "nothing", scan_dataset(images)[0].items, enc)
    assert not (tmp_path / "nothing").exists()
