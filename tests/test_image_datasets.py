"""Image folders into latent caches (flame.data.images, flame.train.datasets): kohya's folder names,
caption files, missing captions, unreadable images, the incremental refresh by content hash, the
trainer's data.images options and their errors, and scripts/prepare_cache.py's one-line errors."""
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

from flame.data import (
    CacheSettings,
    DatasetError,
    LatentCache,
    build_or_refresh_cache,
    plan_cache,
    scan_dataset,
    write_cache,
)
from flame.train import ConfigError, build_config
from flame.train import datasets as train_datasets

pytest.importorskip("PIL")
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = CacheSettings(model="stand-in", resolution=64, min_side=64, max_side=128)  # buckets 64x64 only


def _png(path, w=64, h=64, seed=0, caption=None, ext=".txt"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    if caption is not None:
        path.with_suffix(ext).write_text(caption)
    return path


class StandIn:
    """Encoders without a model: latents are the pixels pooled 8x8, a caption's embedding is its
    length; counts the images and captions encoded."""

    latent_channels, text_len, text_dim, pooled_dim, scaling_factor, shift_factor = 3, 4, 5, 2, 1.0, None
    family, source = "sdxl", "stand-in"

    def __init__(self):
        self.images, self.captions = 0, []

    def encode_images(self, pixels):
        self.images += len(pixels)
        b, c, h, w = pixels.shape
        return pixels.reshape(b, c, h // 8, 8, w // 8, 8).mean(axis=(3, 5))

    def encode_prompts(self, captions):
        self.captions += list(captions)
        lengths = np.array([len(c) for c in captions], dtype=np.float32)
        return (np.broadcast_to(lengths[:, None, None], (len(captions), self.text_len, self.text_dim)),
                np.zeros((len(captions), self.pooled_dim)))


def _never():
    raise AssertionError("the encoders were loaded, and nothing needed encoding")


def _rows(path):
    """{file name: (caption, latents)} of the cache at ``path``."""
    cache = LatentCache(path)
    return {pathlib.Path(s["source"]).name: (s["caption"], cache.read([i])["latents"].numpy()[0])
            for i, s in enumerate(cache.samples)}


# ---- scanning ---------------------------------------------------------------------------------------

def test_kohya_folder_names_give_repeats_each_set_apart(tmp_path):
    root = tmp_path / "train"
    _png(root / "10_sks dog" / "a.png", caption="sks dog")
    _png(root / "10_sks dog" / "more" / "b.png", caption="sks dog on grass")
    _png(root / "2_style" / "c.png", caption="style")
    _png(root / "loose.png", caption="loose")
    _png(root / "notes" / "d.png", caption="not a kohya folder: the root's set")
    _png(root / ".hidden" / "e.png", caption="left out")
    sets = scan_dataset(root)
    assert [(s.name, s.repeats, [p.name for p, _ in s.items]) for s in sets] == [
        ("", 1, ["loose.png", "d.png"]), ("10_sks dog", 10, ["a.png", "b.png"]), ("2_style", 2, ["c.png"])]
    assert sets[1].items[1].caption == "sks dog on grass"
    assert [s.repeats for s in scan_dataset(root, repeats=3)] == [3, 3, 3]  # a given count replaces the names'
    alone = scan_dataset(root / "10_sks dog")  # the folder's own name counts too
    assert [(s.name, s.repeats, len(s.items)) for s in alone] == [("", 10, 2)]


def test_captions_come_from_the_configured_extension_or_metadata(tmp_path):
    _png(tmp_path / "a.png", caption="from txt")
    (tmp_path / "a.caption").write_text("from caption\n")
    assert scan_dataset(tmp_path)[0].items[0].caption == "from txt"
    for ext in (".caption", "caption"):
        assert scan_dataset(tmp_path, ext)[0].items[0].caption == "from caption"
    with pytest.raises(DatasetError, match=r"expected a file extension such as \.txt"):
        scan_dataset(tmp_path, ".png")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "from jsonl"}) + "\n")
    assert [tuple(i) for i in scan_dataset(tmp_path, ".caption")[0].items] == [(tmp_path / "a.png", "from jsonl")]


def test_images_without_a_caption_are_one_warning_or_an_error(tmp_path):
    _png(tmp_path / "captioned.png", caption="a cat")
    for k in range(6):
        _png(tmp_path / f"n{k}.png", caption="kohya style" if k < 2 else None, ext=".caption")
    said = []
    items = scan_dataset(tmp_path, log=said.append)[0].items
    assert [c for _, c in items] == ["a cat"] + [""] * 6  # they train on the empty caption
    assert len(said) == 1, said
    assert said[0].startswith(f"warning: 6 of 7 images in {tmp_path} have no caption (a .txt file): n0.png, n1.png, "
                              "n2.png, n3.png, n4.png and 1 more; they have .caption files: set the caption "
                              "extension to .caption"), said
    with pytest.raises(DatasetError, match=r"6 of 7 images .* have no caption .*\(captions are required\)"):
        scan_dataset(tmp_path, require_captions=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"no images \(\.png, .*\) in .*empty"):
        scan_dataset(tmp_path / "empty")
    with pytest.raises(DatasetError, match="nowhere does not exist"):
        scan_dataset(tmp_path / "nowhere")


def test_unreadable_images_are_skipped_with_one_warning_or_refused(tmp_path):
    good = _png(tmp_path / "good.png", caption="fine")
    (tmp_path / "broken.png").write_text("not an image")
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:100])
    items = scan_dataset(tmp_path)[0].items
    with pytest.raises(DatasetError, match=r"2 image\(s\) that Pillow cannot read: broken\.png, cut\.png; fix or "
                                           r"remove them \(or skip them: data\.bad_images / --bad-images skip\)"):
        plan_cache(tmp_path / "cache", items, SMALL)
    said = []
    plan = plan_cache(tmp_path / "cache", items, SMALL, bad_images="skip", log=said.append)
    assert said == ["warning: skipping 2 image(s) that Pillow cannot read: broken.png, cut.png"]
    assert [r.item.path.name for r in plan.rows] == ["good.png"] and not (tmp_path / "cache").exists()
    assert _rows(write_cache(plan, StandIn())).keys() == {"good.png"}


# ---- the cache, built and refreshed ---------------------------------------------------------------------

def test_a_refresh_encodes_only_new_and_changed_images_and_drops_removed_ones(tmp_path):
    images, cache = tmp_path / "images", tmp_path / "cache"
    for k in range(5):
        _png(images / f"{k}.png", 64 + 8 * k, 64, seed=k, caption=f"image {k}")
    first = StandIn()
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, first, SMALL, batch_size=2)
    assert first.images == 5 and sorted(first.captions) == ["", *[f"image {k}" for k in range(5)]]
    before = _rows(cache)
    index = cache / "index.json"
    stamp = index.stat().st_mtime_ns
    # nothing changed: nothing is written, and no encoders load
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, _never, SMALL)
    assert index.stat().st_mtime_ns == stamp
    # one caption changed, one image replaced, one removed, one added (and one moved: same bytes, kept)
    (images / "1.txt").write_text("image 1, new words")
    _png(images / "2.png", 72, 64, seed=20, caption="image 2")
    (images / "3.png").unlink()
    _png(images / "5.png", seed=5, caption="image 5")
    (images / "4.png").rename(images / "4b.png")
    (images / "4.txt").rename(images / "4b.txt")
    again = StandIn()
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, lambda: again, SMALL, batch_size=2)
    assert again.images == 3 and sorted(again.captions) == ["", "image 1, new words", "image 2", "image 5"]
    after = _rows(cache)
    assert sorted(after) == ["0.png", "1.png", "2.png", "4b.png", "5.png"]
    for kept, was in (("0.png", "0.png"), ("4b.png", "4.png"), ("1.png", "1.png")):  # 1: same pixels, new text
        np.testing.assert_array_equal(after[kept][1], before[was][1])
    assert not np.array_equal(after["2.png"][1], before["2.png"][1])
    assert LatentCache(cache).samples[1]["sha256"] and len(LatentCache(cache).samples[0]["sha256"]) == 64
    files = sorted(os.listdir(cache))  # the old generation's shards are gone
    assert files == ["index.json", "r1-b8x8-00000.safetensors", "r1-empty_prompt.safetensors"], files
    # other settings (the model, the buckets, flips): every image is encoded anew
    third = StandIn()
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, third,
                           CacheSettings(model="another", resolution=64, min_side=64, max_side=128))
    assert third.images == 5
    assert sorted(os.listdir(cache)) == ["index.json", "r2-b8x8-00000.safetensors", "r2-empty_prompt.safetensors"]

    class Wider(StandIn):  # another checkpoint at the same path: its rows have other sizes
        text_dim = 6

    wider = Wider()
    _png(images / "6.png", seed=6, caption="image 6")
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, wider,
                           CacheSettings(model="another", resolution=64, min_side=64, max_side=128))
    assert wider.images == 6 and LatentCache(cache).text_dim == 6


def test_an_error_while_encoding_leaves_the_old_cache_as_it_was(tmp_path):
    images, cache = tmp_path / "images", tmp_path / "cache"
    for k in range(3):
        _png(images / f"{k}.png", seed=k, caption=f"image {k}")
    build_or_refresh_cache(cache, scan_dataset(images)[0].items, StandIn(), SMALL)
    files, rows = sorted(os.listdir(cache)), _rows(cache)
    _png(images / "3.png", seed=3, caption="new")
    (images / "0.txt").write_text("changed")

    class Failing(StandIn):
        def encode_images(self, pixels):
            if self.images:
                raise RuntimeError("out of memory")
            return super().encode_images(pixels)

    with pytest.raises(RuntimeError, match="out of memory"):
        build_or_refresh_cache(cache, scan_dataset(images)[0].items, Failing(), SMALL, batch_size=1)
    assert sorted(os.listdir(cache)) == files and _rows(cache).keys() == rows.keys()
    with pytest.raises(RuntimeError, match="out of memory"):  # a new folder: removed again
        build_or_refresh_cache(tmp_path / "new" / "cache", scan_dataset(images)[0].items, Failing(), SMALL,
                               batch_size=1)
    assert not (tmp_path / "new").exists()


# ---- the trainer's config and prepare_datasets -------------------------------------------------------------

def _pipeline(path, unet_only=False):
    """A folder in the layout of an SDXL pipeline (no weights: nothing here loads them)."""
    for sub in ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    (path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    return path


def _cfg(tmp_path, data, *overrides, model=None):
    model = model or _pipeline(tmp_path / "sdxl")
    raw = {"model": {"path": str(model), "config": "tiny"}, "data": data, "train": {"steps": 1, "precision": "fp32"},
           "output": {"dir": str(tmp_path / "run")}}
    return build_config(raw, overrides)


def test_config_takes_image_folders_and_refuses_bad_settings(tmp_path):
    images = tmp_path / "images"
    _png(images / "a.png", caption="a")
    cfg = _cfg(tmp_path, {"images": str(images), "caption_extension": "caption"})
    d = cfg.data
    assert (d.images, d.cache_dir, d.resolution, d.caption_extension, d.bad_images) == (str(images), None, 1024,
                                                                                        ".caption", "skip")
    cfg = _cfg(tmp_path, {"datasets": [{"images": str(images), "is_reg": True}, {"cache_dir": "c", "repeats": 2},
                                       {"cache_dir": "d"}]})
    assert cfg.data.datasets[1:] == [{"cache_dir": "c", "repeats": 2, "loss_weight": 1.0, "is_reg": False},
                                     {"cache_dir": "d", "repeats": 1, "loss_weight": 1.0, "is_reg": False}]
    assert cfg.data.datasets[0]["images"] == str(images) and cfg.data.datasets[0]["repeats"] is None
    cases = [
        ({"images": str(tmp_path / "nope")}, [], f"data.images: {tmp_path / 'nope'} does not exist"),
        ({"images": str(images / "a.png")}, [], "data.images: " + str(images / "a.png") + " is not a folder"),
        ({"images": str(images)}, ["data.resolution=1000"],
         "data.resolution: must be a multiple of the bucket step, 64 pixels, got 1000"),
        ({"images": str(images)}, ["data.bucket_step=32"],
         "data.bucket_step: sdxl bucket sides are multiples of 64 pixels, got 32"),
        ({"images": str(images)}, ["data.bucket_min_side=2048", "data.bucket_max_side=1024"],
         "data.bucket_min_side / data.bucket_max_side: aspect buckets of resolution 1024: need min_side <= max_side"),
        ({"images": str(images), "datasets": [{"images": str(images)}]}, [],
         "data.images / data.datasets: set exactly one of them"),
        ({}, [], "data.images / data.cache_dir / data.datasets: set one"),
        ({"datasets": [{"repeats": 2}]}, [], "data.datasets[0]: set images (a folder of images) or cache_dir"),
        ({"datasets": [{"cache_dir": "c", "resolution": 512}]}, [],
         "data.datasets[0]: resolution apply to an entry with images"),
        ({"datasets": [{"images": str(images), "resolution": 100}]}, [],
         "data.datasets[0].resolution: must be a multiple of the bucket step, 64 pixels, got 100"),
        ({"images": str(images)}, [f"output.dir={images / 'run'}"], "output.dir: " + str(images / "run")
         + " is inside data.images"),
        ({"images": str(images)}, ["data.caption_variants=true"], "data.caption_variants: caches of image folders"),
        ({"images": str(images)}, ["data.caption_extension=.jpg"], "data.caption_extension: caption extension"),
        ({"images": str(images)}, ["data.bad_images=ignore"], "data.bad_images: expected one of skip, error"),
        ({"images": str(images)}, ["data.synthetic_samples=4"], "data.synthetic_samples: writes data.cache_dir"),
    ]
    for data, overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            _cfg(tmp_path, data, *overrides)
        assert message in str(e.value), (data, overrides, str(e.value))
    with pytest.raises(ConfigError, match=r"data\.images: encoding images needs the text encoders and VAE"):
        build_config({"model": {"config": "tiny"}, "data": {"images": str(images)}, "train": {"steps": 1},
                      "output": {"dir": str(tmp_path / "run")}})


def test_prepare_datasets_caches_each_folder_and_reuses_them(tmp_path, monkeypatch):
    root = tmp_path / "train"
    _png(root / "10_sks dog" / "a.png", caption="sks dog")
    _png(root / "10_sks dog" / "b.png", 96, 64, seed=1, caption="sks dog, wide")
    _png(root / "1_style" / "c.png", seed=2, caption="style")
    reg = tmp_path / "reg"
    _png(reg / "r.png", seed=3, caption="a dog")
    loads = []
    monkeypatch.setattr(train_datasets, "_encoders", lambda cfg, family, dtype: loads.append(dtype) or StandIn())
    cfg = _cfg(tmp_path, {"images": str(root), "resolution": 64})
    said = []
    entries = train_datasets.prepare_datasets(cfg, "sdxl", log=said.append, progress=False)
    out = tmp_path / "run" / "cache"
    assert entries == [{"cache_dir": str(out / "10_sks dog"), "repeats": 10, "loss_weight": 1.0, "is_reg": False},
                       {"cache_dir": str(out / "1_style"), "repeats": 1, "loss_weight": 1.0, "is_reg": False}]
    assert loads == [None] and len(LatentCache(out / "10_sks dog")) == 2
    assert LatentCache(out / "1_style").meta["encoding"]["model"]["path"] == str(tmp_path / "sdxl")
    assert any("2 image(s) x 10 repeat(s), 0 cached already" in s for s in said), said
    assert train_datasets.prepare_datasets(cfg, "sdxl", log=said.append) == entries and loads == [None]  # no load
    # several datasets: cached under output.dir/cache/NAME or their cache_dir; caches pass through
    cache_only = {"cache_dir": str(out / "1_style"), "repeats": 3}
    cfg = _cfg(tmp_path, {"resolution": 64, "datasets": [
        {"images": str(root / "1_style"), "repeats": 4}, {"images": str(reg), "is_reg": True,
                                                          "cache_dir": str(tmp_path / "reg-cache")}, cache_only]})
    entries = train_datasets.prepare_datasets(cfg, "sdxl", log=said.append)
    assert entries == [{"cache_dir": str(out / "1_style"), "repeats": 4, "loss_weight": 1.0, "is_reg": False},
                       {"cache_dir": str(tmp_path / "reg-cache"), "repeats": 1, "loss_weight": 1.0, "is_reg": True},
                       {"cache_dir": str(out / "1_style"), "repeats": 3, "loss_weight": 1.0, "is_reg": False}]
    assert len(loads) == 2  # for the regularization images alone
    # a config without images: nothing to do
    assert train_datasets.prepare_datasets(_cfg(tmp_path, {"cache_dir": str(out / "1_style")}), "sdxl") is None


def test_prepare_datasets_refuses_before_any_model_loads(tmp_path, monkeypatch):
    images = tmp_path / "images"
    _png(images / "a.png", caption="a")
    (images / "b.png").write_text("not an image")
    monkeypatch.setattr(train_datasets, "_encoders", lambda *a: _never())
    pipeline = _pipeline(tmp_path / "sdxl")
    cases = [
        ({"images": str(images)}, ["data.bad_images=error"], pipeline,
         r"data\.images: 1 image\(s\) that Pillow cannot read: b\.png \(cannot identify image file"),
        ({"images": str(images)}, ["data.require_captions=true"], pipeline,
         r"data\.images: 1 of 2 images in .* have no caption \(a \.txt file\): b\.png \(captions are required\)"),
        ({"images": str(images)}, [], pipeline / "unet",
         r"data\.images: encoding images needs the text encoders, tokenizers and VAE of model\.path or sample\.model: "
         rf".*unet is the unet/ folder of a pipeline: give the pipeline folder {pipeline}$"),
        ({"datasets": [{"images": str(images)}]}, [f"sample.model={tmp_path / 'images'}"], pipeline,
         r"data\.datasets\[0\]: encoding images needs .*images is not an SDXL pipeline folder \(it has no "
         r"text_encoder/, text_encoder_2/, vae/, tokenizer/, tokenizer_2/\)$"),
    ]
    for data, overrides, model, match in cases:
        cfg = _cfg(tmp_path, dict(data, resolution=64), *overrides, model=model)
        with pytest.raises(ConfigError, match=match):
            train_datasets.prepare_datasets(cfg, "sdxl", log=lambda *a: None)
    assert not (tmp_path / "run" / "cache").exists()


def test_the_trainer_loads_the_familys_flame_encoders_from_its_checkpoint(tmp_path):
    pytest.importorskip("diffusers")
    from tiny_sdxl import write_tiny_pipeline

    import flame
    model = write_tiny_pipeline(tmp_path / "sdxl")
    images = tmp_path / "images"
    _png(images / "a.png", caption="a")
    cfg = _cfg(tmp_path, {"images": str(images)}, f"sample.tokenizers={model}", model=model / "unet")
    assert train_datasets.encoder_source(cfg, "sdxl") == (str(model / "unet"), str(model))
    cfg = _cfg(tmp_path, {"images": str(images)}, f"sample.model={model}", model=model / "unet")
    encoders = train_datasets._encoders(cfg, "sdxl", flame.float16)  # fp16 runs encode in fp32
    assert isinstance(encoders, train_datasets.FlameEncoders) and encoders.source == str(model)
    assert (encoders.text_len, encoders.text_dim, encoders.pooled_dim, encoders.latent_channels) == (77, 32, 16, 4)
    assert encoders.vae.dtype == flame.float32 and encoders.text.dtype == flame.float32


# ---- scripts/prepare_cache.py -----------------------------------------------------------------------

def _script():
    spec = importlib.util.spec_from_file_location("prepare_cache", ROOT / "scripts" / "prepare_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_cache_errors_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    pc = _script()
    monkeypatch.setattr(pc, "make_encoders", lambda args: _never())
    pipeline = _pipeline(tmp_path / "sdxl")
    images, empty, bad = tmp_path / "images", tmp_path / "empty", tmp_path / "bad"
    _png(images / "a.png", caption="a")
    empty.mkdir()
    _png(bad / "a.png", caption="a")
    (bad / "b.jpg").write_text("not an image")
    (bad / "b.txt").write_text("b")
    out = tmp_path / "out"
    cases = [
        (["--images", str(images), "--model", str(tmp_path / "missing")], "--model " + str(tmp_path / "missing")
         + " does not exist"),
        (["--images", str(images), "--model", str(pipeline / "unet")], f"is the unet/ folder of a pipeline: give the "
                                                                       f"pipeline folder {pipeline}"),
        (["--images", str(images), "--model", str(pipeline), "--min-side", "32"], "multiples of --bucket-step 64"),
        (["--images", str(images), "--model", str(pipeline), "--resolution", "20", "--min-side", "64", "--max-side",
          "64"], "no bucket of area <= 400 with sides in [64, 64]"),
        (["--images", str(bad), "--model", str(pipeline)], "1 image(s) that Pillow cannot read: b.jpg"),
        (["--images", str(empty), "--model", str(pipeline)], f"no images (.png, .jpg, .jpeg, .webp, .bmp) in {empty}"),
        (["--images", str(images), "--model", str(pipeline), "--require-captions", "--caption-extension", "caption"],
         "1 of 1 images"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            pc.main([str(out), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (argv, err)
        assert not out.exists()


def test_prepare_cache_writes_kohya_sets_apart_and_refreshes(tmp_path, capsys, monkeypatch):
    pc = _script()
    made = []
    monkeypatch.setattr(pc, "make_encoders", lambda args: made.append(args.family) or StandIn())
    pipeline = _pipeline(tmp_path / "sdxl")
    root = tmp_path / "train"
    _png(root / "5_sks" / "a.png", caption="sks")
    _png(root / "5_sks" / "b.png", seed=1, caption="sks, red")
    _png(root / "c.png", seed=2, caption="plain")
    argv = [str(tmp_path / "out"), "--images", str(root), "--model", str(pipeline), "--resolution", "64",
            "--val-samples", "0"]
    assert pc.main(argv) == 0
    text = capsys.readouterr().out
    assert f"{{cache_dir: {str(tmp_path / 'out' / '5_sks')!r}, repeats: 5}}" in text, text
    assert len(LatentCache(tmp_path / "out")) == 1 and len(LatentCache(tmp_path / "out" / "5_sks")) == 2
    assert pc.main(argv) == 0 and made == ["sdxl"]  # the second run finds every image cached
    assert "2 image(s), 2 cached already" in capsys.readouterr().out


@pytest.mark.extended  # its parts: prepare_datasets' tests above and the trainer's (test_train.py)
def test_one_command_trains_from_a_kohya_image_folder(tmp_path):
    """The issue's path as the README shows it: scripts/tiny_example.py's pipeline and kohya folder of
    captioned images, configs/sdxl_lora_tiny_images.yaml, one trainer run, no cache step."""
    pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("tiny_example", ROOT / "scripts" / "tiny_example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    import flame
    from flame.train import Trainer, load_config
    assert example.main([str(tmp_path / "example")]) == 0
    cfg = load_config(ROOT / "configs" / "sdxl_lora_tiny_images.yaml",
                      [f"model.path={tmp_path / 'example' / 'model'}", f"data.images={tmp_path / 'example' / 'images'}",
                       f"output.dir={tmp_path / 'run'}", "train.steps=2", "data.batch_size=1", "output.save_every=0",
                       "lora.targets=attn"])
    flame.manual_seed(0)
    result = Trainer(cfg, progress=False, log=lambda *a: None).train()
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    cache = LatentCache(tmp_path / "run" / "cache" / "2_cat")
    assert len(cache) == len(example.CAPTIONS) and {s["caption"] for s in cache.samples} == set(example.CAPTIONS)
    assert (tmp_path / "run" / "lora.safetensors").is_file()
