"""flame.tune: launch-config tables (exact, bucket and heuristic lookups, bad tables) and the
matmul / conv / attention / norm / softmax / elementwise / reduction launchers' use of them."""
import contextlib
import json
import pathlib
import warnings

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

from flame import runtime, tune
from flame.kernels import attention, conv2d, matmul
from flame.kernels import elementwise as KE
from flame.kernels import norms as KN
from flame.kernels import reduce as KR
from flame.kernels import softmax as KS

ROOT = pathlib.Path(__file__).resolve().parents[1]

GPU = "NVIDIA H200"
MM = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=2, num_stages=5)
CONV = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=2)
DEFAULT = dict(BLOCK_M=1, BLOCK_N=1, BLOCK_K=1, GROUP_M=1, num_warps=1, num_stages=1)
FWD = dict(BLOCK_M=128, BLOCK_N=32, M_GROUP=2, num_warps=8, num_stages=2)
BWD = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2, BLOCK_M_DQ=128, BLOCK_N_DQ=32, num_warps_dq=4,
           num_stages_dq=3, CHUNKS=3)
GN = dict(BLOCK_C=32, BLOCK_S=128, SPLITS=20, num_warps=4, BLOCK_C_APPLY=64, BLOCK_S_APPLY=64, num_warps_apply=8)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A fresh table folder; returns write(entries, name=GPU, **top-level fields) -> path."""
    monkeypatch.setenv("FLAME_TUNE_DIR", str(tmp_path))
    tune.reset()

    def write(rows, name=GPU, **top):
        doc = dict(format=1, gpu=name, triton=triton.__version__, date="2026-12-01", entries=rows)
        doc.update(top)
        path = tmp_path / f"{tune.slug(name)}.json"
        path.write_text(json.dumps(doc))
        return path

    yield write
    tune.reset()


def entry(key, config, ms=1.0):
    return dict(key=list(key), config=config, ms=ms, default_ms=2 * ms)


def ask(key, dtype=torch.bfloat16, kernel="matmul", default=DEFAULT):
    return tune.config(kernel, key, dtype, default, device_name=GPU)


def quiet_ask(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tune.TuningTableWarning)
        return ask(*args, **kw)


def test_slug_and_buckets():
    assert tune.slug("NVIDIA H200") == "nvidia-h200"
    assert tune.slug(" NVIDIA H100 80GB HBM3 ") == "nvidia-h100-80gb-hbm3"
    assert tune.bucket((4096, 5120, 6144, 77, 1, 0)) == (4096, 4096, 8192, 64, 1, 0)


def test_exact_lookup(tables):
    other = dict(MM, BLOCK_M=128)
    tables({"matmul": {"bfloat16": [entry((4096, 640, 640, 1), MM), entry((4096, 640, 640, 2), other)]}})
    assert quiet_ask((4096, 640, 640, 1)) == MM
    assert quiet_ask((4096, 640, 640, 2)) == other
    assert quiet_ask((4096, 640, 640, 2), dtype="bfloat16") == other  # dtype by name too


def test_entries_within_noise_of_the_heuristic_answer_the_heuristic(tables):
    near = dict(entry((4096, 640, 640, 1), MM), ms=1.0, default_ms=1.02)  # 2% faster: noise
    tables({"matmul": {"bfloat16": [near, entry((4096, 640, 5120, 1), MM)]}})
    assert quiet_ask((4096, 640, 640, 1)) == DEFAULT
    assert quiet_ask((4000, 600, 700, 1)) == DEFAULT  # its bucket neighbours too
    assert quiet_ask((4096, 640, 5120, 1)) == MM  # 2x faster: used


def test_bucket_fallback_takes_the_nearest_entry_in_the_bucket(tables):
    far = dict(MM, num_warps=8)
    tables({"matmul": {"float16": [entry((4096, 1280, 1280, 1), far), entry((5000, 640, 700, 1), MM)]}})
    # (4600, 600, 660, 1) is in bucket (4096, 512, 512, 1) with (5000, 640, 700, 1) but not with the first
    assert quiet_ask((4600, 600, 660, 1), torch.float16) == MM
    # both entries share the bucket of (4096, 1100, 1100, 1): the closer one in log distance wins
    tables({"matmul": {"float16": [entry((4096, 1024, 1024, 1), MM), entry((4096, 1400, 1400, 1), far)]}})
    tune.reset()
    assert quiet_ask((4096, 1300, 1300, 1), torch.float16) == far
    assert quiet_ask((4096, 1000, 1000, 1), torch.float16) == MM
    # another bucket in any dimension (batch included): the heuristic
    assert quiet_ask((4096, 1024, 1024, 2), torch.float16) is DEFAULT
    assert quiet_ask((8192, 1024, 1024, 1), torch.float16) is DEFAULT


def test_heuristic_fallback_without_table_kernel_or_dtype(tables):
    assert quiet_ask((64, 64, 64, 1)) is DEFAULT  # no file at all
    tables({"matmul": {"float16": [entry((64, 64, 64, 1), MM)]}})
    tune.reset()
    assert quiet_ask((64, 64, 64, 1), torch.float16) == MM
    assert quiet_ask((64, 64, 64, 1), torch.float32) is DEFAULT  # dtype absent
    conv_default = {k: v for k, v in DEFAULT.items() if k != "GROUP_M"}
    assert quiet_ask((64, 64, 64, 9), torch.float16, "conv2d", conv_default) is conv_default  # kernel absent
    # another GPU's name reads another file (absent here)
    assert tune.config("matmul", (64, 64, 64, 1), torch.float16, DEFAULT, device_name="NVIDIA H100") is DEFAULT


def test_answers_are_cached_until_reset(tables):
    path = tables({"matmul": {"bfloat16": [entry((128, 128, 128, 1), MM)]}})
    assert quiet_ask((128, 128, 128, 1)) == MM
    path.unlink()
    assert quiet_ask((128, 128, 128, 1)) == MM  # neither the file nor the lookup is read again
    tune.reset()
    assert quiet_ask((128, 128, 128, 1)) is DEFAULT


def _one_warning(match, key=(64, 64, 64, 1)):
    """Ask twice for two keys; exactly one TuningTableWarning matching ``match``. Returns the answer."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [ask(key), ask(key), ask((7, 7, 7, 1))]
    msgs = [str(w.message) for w in seen if issubclass(w.category, tune.TuningTableWarning)]
    assert len(msgs) == 1, msgs
    assert match in msgs[0] and ".json" in msgs[0], msgs[0]
    return got[0]


@pytest.mark.parametrize("top, match", [
    (dict(triton=None), "'triton'"),  # no version: the entries' provenance is unknown
    (dict(format=2), "format"),
    (dict(gpu="NVIDIA A100"), "written for GPU"),  # a file named for this GPU holding another's table
    (dict(entries=[]), "'entries'"),
])
def test_foreign_or_malformed_table_is_ignored_with_one_warning(tables, top, match):
    tables({"matmul": {"bfloat16": [entry((64, 64, 64, 1), MM)]}}, **top)
    assert _one_warning(match) is DEFAULT


@pytest.mark.parametrize("version", ["2.1.0", "99.0.0", "{major}.{minor}.99"])
def test_a_table_from_another_triton_release_or_patch_is_used(tables, version):
    major, minor = triton.__version__.split(".")[:2]
    tables({"matmul": {"bfloat16": [entry((64, 64, 64, 1), MM)]}}, triton=version.format(major=major, minor=minor))
    assert quiet_ask((64, 64, 64, 1)) == MM
    assert quiet_ask((60, 70, 64, 1)) == MM  # its bucket neighbours too


def test_entries_of_this_triton_release_come_first_in_their_bucket(tables):
    ours, theirs = dict(MM, num_warps=8), dict(MM, num_warps=4)
    old = dict(entry((4096, 1024, 1024, 1), theirs), triton="2.1.0")  # per entry: kept by a merge
    tables({"matmul": {"float16": [old, entry((4096, 1400, 1400, 1), ours), dict(entry((64, 64, 64, 1), theirs),
                                                                                  triton="2.1.0")]}})
    # the exact key's entry is from another release, this release's neighbour in the bucket wins
    assert quiet_ask((4096, 1024, 1024, 1), torch.float16) == ours
    assert quiet_ask((64, 64, 64, 1), torch.float16) == theirs  # only another release's: used
    # a table stamped with another release holding an entry stamped with this one
    tables({"matmul": {"float16": [dict(entry((4096, 1024, 1024, 1), ours), triton=triton.__version__),
                                   entry((4096, 1000, 1000, 1), theirs)]}}, triton="2.1.0")
    tune.reset()
    assert quiet_ask((4096, 1000, 1000, 1), torch.float16) == ours


@pytest.mark.parametrize("text", ['{"format": 1, "gpu": ', "[1, 2]", "\xff\xfe"])
def test_corrupt_table_is_ignored_with_one_warning(tables, tmp_path, text):
    (tmp_path / "nvidia-h200.json").write_bytes(text.encode("latin-1"))
    assert _one_warning("ignored") is DEFAULT


def test_bad_entries_are_dropped_with_one_warning_and_the_rest_kept(tables):
    good = entry((64, 64, 64, 1), MM)
    tables({
        "matmul": {"bfloat16": [
            good,
            entry((7, 7, 7, 1), dict(MM, BLOCK_X=16)),  # unknown field
            dict(key=[8, 8, 8, 1], config=MM, ms=1.0),  # no default_ms
            entry((9, 9, 9), MM),  # key too short
            entry((10, 10, 10, 1), dict(MM, BLOCK_M=48)),  # not a power of two
            entry((11, 11, 11, 1), dict(MM, num_warps=0)),
            entry((64, 64, 64, 1), dict(MM, BLOCK_M=16)),  # duplicate key
            dict(entry((12, 12, 12, 1), MM), triton=3.6),  # not a version string
        ], "float8": []},
        "conv2d": {"bfloat16": [entry((64, 64, 64, 9), MM)]},  # GROUP_M is not a conv field
        "softmax": {"bfloat16": []},  # no such tunable kernel
    })
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ask((64, 64, 64, 1)) == MM
        for key in ((7, 7, 7, 1), (8, 8, 8, 1), (10, 10, 10, 1), (11, 11, 11, 1), (12, 12, 12, 1)):
            assert ask(key) is DEFAULT
        conv_default = {k: v for k, v in DEFAULT.items() if k != "GROUP_M"}
        assert ask((64, 64, 64, 9), kernel="conv2d", default=conv_default) is conv_default
    msgs = [str(w.message) for w in seen if issubclass(w.category, tune.TuningTableWarning)]
    assert len(msgs) == 1, msgs
    for part in ("10 bad entries or sections ignored", "BLOCK_X", "default_ms", "[9, 9, 9]", "BLOCK_M=48",
                 "num_warps=0", "twice", "triton 3.6", "float8", "softmax", "GROUP_M"):
        assert part in msgs[0], (part, msgs[0])


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "autotune").glob("*.json")), ids=lambda p: p.stem)
def test_committed_tables_have_no_bad_entries(path):
    # each committed table as its GPU reads it, under any Triton release: every entry kept, with its provenance
    raw = json.loads(path.read_text())
    table, problems = tune._parse(raw, raw["gpu"])
    assert table is not None and problems == [], problems[:5]
    rows = {(k, d, tuple(e["key"])): e for k, per_dtype in raw["entries"].items() for d, es in per_dtype.items()
            for e in es}
    assert {k: e.triton for k, e in table.exact.items()} == {k: e.get("triton", raw["triton"]) for k, e in rows.items()}


def test_misuse_by_a_launcher_raises():
    with pytest.raises(ValueError, match="unknown kernel"):
        tune.config("nope", (1,), torch.float16, {}, device_name=GPU)
    with pytest.raises(ValueError, match="GROUP_M"):
        tune.config("conv2d", (1, 1, 1, 1), torch.float16, DEFAULT, device_name=GPU)
    with pytest.raises(ValueError, match="shape key"):
        tune.config("matmul", (1, 1, 1), torch.float16, DEFAULT, device_name=GPU)


# ---- the launchers ------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """matmul/conv config choice as on a 132-SM H200 (the kernels still never run here)."""
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    monkeypatch.setattr(runtime, "_num_sms", 132)
    monkeypatch.setattr(runtime, "device_name", lambda: GPU)


# The heuristics' answers before the tuning layer existed (132 SMs): with no table, unchanged.
_MM_HEURISTIC = [
    ((4096, 640, 640, torch.bfloat16, 1), (128, 128, 64, 8, 4, 4)),
    ((16384, 1280, 5120, torch.bfloat16, 1), (128, 256, 64, 8, 8, 3)),
    ((77, 640, 2048, torch.float16, 2), (64, 64, 64, 8, 4, 4)),
    ((1000, 7, 129, torch.float32, 1), (64, 16, 32, 8, 4, 3)),
    ((64, 64, 64, torch.float64, 3), (64, 64, 32, 8, 4, 3)),
    ((4096, 16, 640, torch.bfloat16, 1), (64, 16, 64, 8, 4, 4)),
]
_CONV_HEURISTIC = [
    ((16384, 320, 320, torch.bfloat16), (128, 128, 64, 4, 3)),
    ((1024, 1280, 1280, torch.float16), (64, 128, 64, 4, 3)),
    ((4096, 640, 960, torch.float32), (128, 128, 32, 4, 3)),
    ((49, 4, 3, torch.float64), (64, 16, 16, 4, 3)),
]


def test_without_a_table_gpu_configs_are_the_heuristics(tables, fake_gpu):
    for args, want in _MM_HEURISTIC:
        assert matmul._config(*args) == dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps",
                                                  "num_stages"), want)), args
    for args, want in _CONV_HEURISTIC:
        expected = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), want))
        assert conv2d._gemm_config(*args) == expected, args
        assert conv2d._gemm_config(*args, 9, "conv2d_dgrad") == expected, args


def test_gpu_configs_come_from_the_table(tables, fake_gpu):
    dgrad = dict(CONV, BLOCK_M=128)
    tables({"matmul": {"bfloat16": [entry((4096, 640, 640, 1), MM)]},
            "conv2d": {"float16": [entry((1024, 1280, 1280, 9), CONV)]},
            "conv2d_dgrad": {"float16": [entry((1024, 1280, 1280, 9), dgrad)]}})
    assert matmul._config(4096, 640, 640, torch.bfloat16, 1) == MM
    assert matmul._config(4000, 700, 600, torch.bfloat16, 1) == MM  # same bucket
    assert matmul._config(4096, 640, 640, torch.bfloat16, 4)["num_warps"] == 8  # batch 4: the heuristic
    assert conv2d._gemm_config(1024, 1280, 1280, torch.float16, 9) == CONV
    assert conv2d._gemm_config(1024, 1280, 1280, torch.float16, 9, "conv2d_dgrad") == dgrad
    assert conv2d._gemm_config(1024, 1280, 1280, torch.float16, 1)["BLOCK_M"] == 64  # 1x1: heuristic


# The attention heuristics' answers before they went through flame.tune (132 SMs, or the interpreter):
# (Lq, Lk, D, B*H, dtype) -> forward (BLOCK_D, BLOCK_M, BLOCK_N, M_GROUP, SINGLE_KV, num_warps,
# num_stages), dK/dV and dQ (BLOCK_D, BLOCK_M, BLOCK_N, num_warps, num_stages; dQ None: fused),
# query blocks per chunk. Every branch: batch 1 and many programs, short K/V (chunks, M_GROUP),
# fp32/fp64, D > 128, Lq = 0.
_ATTN_HEURISTIC = {False: [
    ((4096, 4096, 64, 10, torch.bfloat16), (64, 64, 64, 1, False, 4, 4), (64, 32, 64, 4, 3), (64, 64, 64, 4, 3), 128),
    ((16384, 4096, 64, 40, torch.bfloat16), (64, 128, 64, 1, False, 8, 3), (64, 32, 64, 4, 3), (64, 64, 64, 4, 3), 512),
    ((1024, 1024, 64, 20, torch.float16), (64, 64, 64, 1, False, 4, 3), (64, 32, 64, 4, 3), (64, 64, 64, 4, 3), 32),
    ((4032, 77, 64, 40, torch.bfloat16), (64, 64, 128, 8, True, 4, 1), (64, 128, 128, 8, 1), None, 3),
    ((1008, 77, 64, 80, torch.bfloat16), (64, 64, 128, 4, True, 4, 1), (64, 128, 128, 8, 1), None, 2),
    ((4096, 77, 40, 2, torch.float16), (64, 64, 128, 1, True, 4, 1), (64, 128, 128, 8, 1), None, 1),
    ((2048, 2048, 128, 128, torch.bfloat16), (128, 128, 128, 1, False, 8, 3), (128, 32, 64, 4, 3), (128, 128, 64, 8, 3),
     64),  # head dim 128 from 2048 keys: 128x128 tiles, 8 warps (issue 46)
    ((300, 1000, 256, 3, torch.bfloat16), (256, 64, 32, 1, False, 4, 2), (256, 32, 32, 4, 1), (256, 32, 32, 4, 1), 10),
    ((64, 129, 64, 1, torch.bfloat16), (64, 64, 64, 1, False, 4, 3), (64, 32, 64, 4, 3), (64, 64, 64, 4, 3), 2),
    ((100, 60, 32, 4, torch.float32), (32, 64, 64, 1, True, 4, 1), (32, 32, 64, 4, 1), None, 1),
    ((100, 70, 32, 4, torch.float32), (32, 64, 32, 1, False, 4, 2), (32, 32, 32, 4, 1), (32, 32, 32, 4, 1), 4),
    ((50, 20, 8, 2, torch.float64), (16, 32, 32, 1, True, 4, 1), (16, 16, 32, 4, 1), None, 1),
    ((50, 40, 8, 2, torch.float64), (16, 32, 32, 1, False, 4, 1), (16, 16, 32, 4, 1), (16, 32, 16, 4, 1), 4),
    ((3000, 200, 160, 6, torch.float16), (256, 64, 32, 1, False, 4, 2), (256, 32, 32, 4, 1), (256, 32, 32, 4, 1), 94),
    ((5, 100, 160, 6, torch.float16), (256, 64, 32, 1, False, 4, 2), (256, 32, 32, 4, 1), (256, 32, 32, 4, 1), 1),
], True: [
    ((24, 136, 16, 2, torch.bfloat16), (16, 32, 128, 1, False, 4, 1), (16, 32, 128, 4, 1), (16, 32, 128, 4, 1), 1),
    ((300, 9, 40, 3, torch.float32), (64, 128, 16, 1, True, 4, 1), (64, 128, 16, 4, 1), None, 3),
    ((0, 5, 8, 1, torch.float64), (16, 16, 16, 1, True, 4, 1), (16, 16, 16, 4, 1), None, 0),
    ((200, 128, 200, 1, torch.float16), (256, 128, 128, 1, True, 4, 1), (256, 128, 128, 4, 1), None, 2),
]}
_FWD_KEYS = ("BLOCK_D", "BLOCK_M", "BLOCK_N", "M_GROUP", "SINGLE_KV", "num_warps", "num_stages")
_PROGRAM_KEYS = ("BLOCK_D", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def _attn_configs(args):
    """The attention launch configs for (Lq, Lk, D, B*H, dtype) as the tuples of _ATTN_HEURISTIC."""
    fwd = attention._fwd_config(*args)
    kv, dq, per_chunk = attention._bwd_config(*args)
    return (tuple(fwd[k] for k in _FWD_KEYS), tuple(kv[k] for k in _PROGRAM_KEYS),
            None if dq is None else tuple(dq[k] for k in _PROGRAM_KEYS), per_chunk)


@pytest.mark.parametrize("interpreter", [False, True])
def test_without_a_table_attention_configs_are_the_heuristics(tables, fake_gpu, monkeypatch, interpreter):
    if interpreter:
        monkeypatch.setattr(runtime, "INTERPRETER", True)
        monkeypatch.setattr(runtime, "_num_sms", 1)
    with tune.record() as asked:
        for args, *want in _ATTN_HEURISTIC[interpreter]:
            assert _attn_configs(args) == tuple(want), args
    # every launch asked flame.tune (so a table or an override reaches it) and got the heuristic
    assert [(q[0], q[1]) for q in asked] == [(k, args[:4]) for args, *_ in _ATTN_HEURISTIC[interpreter]
                                             for k in ("attention_fwd", "attention_bwd")]


def test_attention_configs_come_from_the_table(tables, fake_gpu):
    short_fwd = dict(FWD, BLOCK_N=128)
    tables({"attention_fwd": {"bfloat16": [entry((4096, 4096, 64, 10), FWD), entry((4096, 77, 64, 10), short_fwd)]},
            "attention_bwd": {"bfloat16": [entry((4096, 4096, 64, 10), BWD), entry((1024, 77, 64, 20), BWD)]}})
    bf16 = torch.bfloat16
    derived = dict(BLOCK_D=64, SINGLE_KV=False, KV_TMA=attention.KV_TMA)  # TMA K/V loads: D a power of 2, 4096 keys
    assert attention._fwd_config(4096, 4096, 64, 10, bf16) == dict(FWD, **derived)
    assert attention._fwd_config(4032, 4032, 64, 10, bf16) == dict(FWD, **derived)  # same bucket
    assert attention._fwd_config(4096, 4096, 56, 10, bf16) == dict(FWD, **dict(derived, KV_TMA=False))
    assert attention._fwd_config(4096, 4096, 64, 40, bf16)["BLOCK_N"] == 64  # batch 4: the heuristic
    assert attention._fwd_config(4096, 4096, 64, 10, torch.float16)["BLOCK_M"] == 64  # fp16: the heuristic
    assert attention._fwd_config(4096, 77, 64, 10, bf16) == dict(short_fwd, BLOCK_D=64, SINGLE_KV=True, KV_TMA=False)
    assert attention._fwd_config(4096, 90, 64, 10, bf16) == dict(short_fwd, BLOCK_D=64, SINGLE_KV=True, KV_TMA=False)
    # an entry whose key block cannot hold every key (BLOCK_N 32 < 77 keys): the loop over key blocks
    tables({"attention_fwd": {"bfloat16": [entry((4096, 77, 64, 10), FWD)]}})
    tune.reset()
    assert attention._fwd_config(4096, 77, 64, 10, bf16) == dict(FWD, **dict(derived, KV_TMA=False))  # 77 keys

    tables({"attention_bwd": {"bfloat16": [entry((4096, 4096, 64, 10), BWD), entry((1024, 77, 64, 20), BWD)]}})
    tune.reset()
    kv, dq, per_chunk = attention._bwd_config(4096, 4096, 64, 10, bf16)
    assert kv == dict(BLOCK_D=64, BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
    assert dq == dict(BLOCK_D=64, BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3)
    assert per_chunk == 22  # 64 query blocks in 3 chunks
    kv, dq, per_chunk = attention._bwd_config(1024, 77, 64, 20, bf16)  # short K/V in one block: dQ fused
    assert kv["BLOCK_N"] == 128 and dq is None and per_chunk == 6
    assert attention._bwd_config(1024, 77, 64, 20, torch.float16)[0]["BLOCK_M"] == 128  # fp16: the heuristic
    tables({"attention_bwd": {"bfloat16": [entry((1024, 77, 64, 20), dict(BWD, BLOCK_N=64))]}})
    tune.reset()
    kv, dq, _ = attention._bwd_config(1024, 77, 64, 20, bf16)  # 64-key blocks: dK/dV and dQ programs
    assert kv["BLOCK_N"] == 64 and dq["BLOCK_N"] == 32


@pytest.mark.skipif(not runtime.INTERPRETER, reason="asserts the interpreter's routing and default configs")
def test_interpreter_configs_ignore_tables(tables, monkeypatch):
    name = runtime.device_name()
    tables({"matmul": {"float32": [entry((8, 8, 8, 1), MM)]},
            "conv2d": {"float32": [entry((8, 8, 8, 1), CONV)]}}, name=name)
    assert tune.config("matmul", (8, 8, 8, 1), torch.float32, DEFAULT, device_name=name) == MM  # readable
    assert matmul._config(8, 8, 8, torch.float32) == dict(BLOCK_M=8, BLOCK_N=8, BLOCK_K=8, GROUP_M=8,
                                                         num_warps=4, num_stages=1)
    assert conv2d._gemm_config(8, 8, 8, torch.float32)["num_stages"] == 1


@pytest.mark.skipif(not runtime.INTERPRETER, reason="asserts the interpreter's routing and default configs")
def test_conv_launcher_names_its_kernel_and_taps(monkeypatch):
    calls = []
    real = conv2d._gemm_config

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(conv2d, "_gemm_config", spy)
    x, w = torch.randn(1, 9, 4, 4), torch.randn(9, 9, 3, 2)  # 9 channels: no fold (_conv_fold_kernel)
    out, dx = runtime.empty((1, 9, 2, 3), torch.float32), runtime.empty((1, 9, 4, 4), torch.float32)
    conv2d.conv2d_forward_(out, x, w, None, (1, 1), (0, 0), (1, 1))
    conv2d.conv2d_input_grad_(dx, out, w, (1, 1), (0, 0), (1, 1))
    assert [(c[4], c[5]) for c in calls] == [(6, "conv2d"), (6, "conv2d_dgrad")]


# The norm and conv weight-gradient heuristics' answers before they went through flame.tune (132
# SMs, or the interpreter), as their kernels' config fields. GroupNorm: (N, C, S, G, channels-last)
# -> (BLOCK_C, BLOCK_S, SPLITS, num_warps, BLOCK_C_APPLY, BLOCK_S_APPLY, num_warps_apply); LayerNorm:
# (M, D) -> (BLOCK_M, num_warps, PROGRAMS); the weight gradient: (Co, Ci, N*Ho*Wo, dtype, TMA) ->
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
_GN_HEURISTIC = {False: [
    ((1, 320, 16384, 32, True), (64, 64, 106, 8, 128, 32, 8)),
    ((1, 320, 16384, 32, False), (4, 1024, 7, 8, 4, 1024, 8)),
    ((4, 1280, 1024, 32, False), (4, 1024, 1, 8, 4, 1024, 8)),
    ((2, 1920, 4032, 32, True), (64, 64, 9, 8, 128, 32, 8)),
    ((3, 10, 15, 5, False), (16, 16, 1, 4, 16, 16, 4)),
], True: [
    ((1, 320, 16384, 32, True), (4, 4096, 1, 8, 8, 4096, 8)),
    ((4, 1280, 1024, 32, False), (16, 1024, 1, 8, 32, 1024, 8)),
    ((1, 6, 35, 3, True), (8, 64, 1, 4, 8, 64, 4)),
]}
# (M, D): the forward's (BLOCK_M, warps), the backward's (BLOCK_M, warps, PROGRAMS)
_LN_HEURISTIC = {False: [((4096, 640), (2, 2), (8, 4, 264)), ((1024, 1280), (2, 4), (4, 4, 264)),
                         ((77, 20000), (1, 8), (1, 8, 264)), ((10, 24), (16, 1), (16, 1, 264))],
                 True: [((4096, 640), (32, 16), (32, 16, 1)), ((77, 20000), (1, 16), (1, 16, 1)),
                        ((10, 24), (16, 1), (16, 1, 1))]}
_WGRAD_HEURISTIC = {False: [
    ((320, 320, 16384, torch.bfloat16, True), (128, 128, 64, 4, 3)),
    ((4, 320, 16384, torch.bfloat16, False), (16, 128, 64, 4, 3)),
    ((1280, 2560, 1024, torch.float32, False), (128, 128, 32, 4, 3)),
], True: [
    ((12, 8, 30, torch.float32, False), (16, 8, 32, 4, 1)),
    ((320, 640, 100000, torch.float16, False), (128, 128, 512, 4, 1)),
]}


@pytest.mark.parametrize("interpreter", [False, True])
def test_without_a_table_norm_and_wgrad_configs_are_the_heuristics(tables, fake_gpu, monkeypatch, interpreter):
    if interpreter:
        monkeypatch.setattr(runtime, "INTERPRETER", True)
        monkeypatch.setattr(runtime, "_num_sms", 1)
    bf16 = torch.bfloat16
    with tune.record() as asked:  # empties the memoised plans first (they may be another backend's)
        for (n, c, s, g, cl), _ in _GN_HEURISTIC[interpreter]:
            for bwd in (False, True):
                KN._gn_plan(n, c, s, g, cl, bf16, bwd)
        for (m, d), _, _ in _LN_HEURISTIC[interpreter]:
            KN._ln_fwd_plan(m, d, bf16)
            KN._ln_bwd_plan(m, d, bf16)
        for (co, ci, rows, dtype, tma), _ in _WGRAD_HEURISTIC[interpreter]:
            conv2d._wgrad_config(co, ci, rows, 9, dtype, tma)
    want = []
    for (n, c, s, g, cl), cfg in _GN_HEURISTIC[interpreter]:
        want += [(k, (n, c, s, g, int(cl)), "bfloat16", dict(zip(tune.KERNELS[k][1], cfg)))
                 for k in ("group_norm_fwd", "group_norm_bwd")]
    for key, (bm, warps), (bbm, bwarps, programs) in _LN_HEURISTIC[interpreter]:
        want += [("layer_norm_fwd", key, "bfloat16", dict(BLOCK_M=bm, num_warps=warps)),
                 ("layer_norm_bwd", key, "bfloat16", dict(BLOCK_M=bbm, num_warps=bwarps, PROGRAMS=programs))]
    for (co, ci, rows, dtype, tma), cfg in _WGRAD_HEURISTIC[interpreter]:
        want.append(("conv2d_wgrad_tma" if tma else "conv2d_wgrad", (co, ci, rows, 9), str(dtype)[6:],
                     dict(zip(tune.KERNELS["conv2d_wgrad"][1], cfg))))
    assert asked == want


def test_norm_and_wgrad_configs_come_from_the_table(tables, fake_gpu):
    ln_bwd = dict(BLOCK_M=2, num_warps=4, PROGRAMS=100)
    wgrad, wgrad_tma = dict(CONV, BLOCK_K=64), dict(CONV, BLOCK_M=64, BLOCK_K=128)
    tables({"group_norm_fwd": {"bfloat16": [entry((1, 320, 16384, 32, 1), GN)]},
            "group_norm_bwd": {"bfloat16": [entry((1, 320, 16384, 32, 1), dict(GN, SPLITS=1))]},
            "layer_norm_fwd": {"bfloat16": [entry((4096, 640), dict(BLOCK_M=8, num_warps=16))]},
            "layer_norm_bwd": {"bfloat16": [entry((4096, 640), ln_bwd)]},
            "conv2d_wgrad": {"bfloat16": [entry((320, 320, 16384, 9), wgrad)]},
            "conv2d_wgrad_tma": {"bfloat16": [entry((320, 320, 16384, 9), wgrad_tma)]}})
    bf16 = torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error", tune.TuningTableWarning)  # every entry is valid
        _, splits, per_split, part, _, _, apply = KN._gn_plan(1, 320, 16384, 32, True, bf16, False)
    # 20 splits of 16384 positions in whole 128-position blocks: 896 each, 19 programs per channel block
    assert (splits, per_split) == (19, 896)
    assert part == ((10, 19), 10, dict(BLOCK_C=32, BLOCK_S=128, num_warps=4))
    assert apply == ((5, 256), 5, dict(BLOCK_C=64, BLOCK_S=64, num_warps=8))
    assert KN._gn_plan(1, 320, 16384, 32, True, bf16, True)[3][0] == (10, 1)  # the backward's entry
    assert KN._gn_plan(1, 320, 16128, 32, True, bf16, False)[3][2]["BLOCK_C"] == 32  # same bucket
    assert KN._gn_plan(1, 320, 16384, 32, False, bf16, False)[3][2]["BLOCK_C"] == 4  # NCHW: the heuristic
    assert KN._ln_fwd_plan(4096, 640, bf16) == (512, dict(SINGLE=True, BLOCK_M=8, BLOCK_D=1024, num_warps=16))
    assert KN._ln_bwd_plan(4096, 640, bf16)[:3] == (100, 2048, dict(SINGLE=True, BLOCK_M=2, BLOCK_D=1024,
                                                                    num_warps=4))
    assert KN._ln_bwd_plan(4096, 640, torch.float16)[0] == 264  # fp16: the heuristic
    assert conv2d._wgrad_config(320, 320, 16384, 9, bf16, False) == wgrad
    assert conv2d._wgrad_config(320, 320, 16384, 9, bf16, True) == wgrad_tma
    assert conv2d._wgrad_config(320, 320, 16384, 1, bf16, True)["BLOCK_K"] == 64  # 1 tap: the heuristic


def test_memoised_norm_plans_follow_override_and_reset(tables):
    plan = KN._ln_fwd_plan(64, 32, torch.float32)
    assert KN._ln_fwd_plan(64, 32, torch.float32) is plan  # memoised
    with tune.override("layer_norm_fwd", dict(BLOCK_M=2, num_warps=1)):
        assert KN._ln_fwd_plan(64, 32, torch.float32) == (32, dict(SINGLE=True, BLOCK_M=2, BLOCK_D=32, num_warps=1))
    assert KN._ln_fwd_plan(64, 32, torch.float32) == plan
    gn = KN._gn_plan(2, 8, 48, 4, True, torch.float32, True)
    with tune.override("group_norm_bwd", dict(GN, BLOCK_C=2, BLOCK_S=8, SPLITS=3)):
        assert KN._gn_plan(2, 8, 48, 4, True, torch.float32, True)[:2] == (2, 3)  # CG 2, 3 splits
    assert KN._gn_plan(2, 8, 48, 4, True, torch.float32, True) == gn


# The softmax and cross-entropy heuristics' answers before they went through flame.tune (the GPU's,
# then the interpreter's): softmax (ROWS, R, dtype) -> (BLOCK_ROWS, BLOCK_R, num_warps), SINGLE;
# cross-entropy (ROWS, C) -> (BLOCK_ROWS, BLOCK_C, num_warps).
_SM_HEURISTIC = {False: [((8192, 32000, torch.bfloat16), (1, 4096, 8), False),
                         ((8192, 12000, torch.bfloat16), (1, 16384, 16), True),
                         ((8192, 12000, torch.float32), (1, 4096, 8), False),
                         ((4096, 1000, torch.float32), (2, 1024, 4), True), ((3, 5, torch.float16), (4, 8, 4), True)],
                 True: [((8192, 32000, torch.bfloat16), (2, 16384, 16), False),
                        ((8192, 12000, torch.float32), (2, 16384, 16), True),
                        ((4096, 1000, torch.float32), (32, 1024, 16), True)]}
_CE_HEURISTIC = {False: [((8192, 32000), (1, 4096, 8)), ((4096, 1000), (2, 1024, 4)), ((7, 100), (8, 128, 4))],
                 True: [((8192, 32000), (2, 16384, 16)), ((4096, 1000), (32, 1024, 16)), ((7, 100), (8, 128, 4))]}


@pytest.mark.parametrize("interpreter", [False, True])
def test_without_a_table_softmax_configs_are_the_heuristics(tables, fake_gpu, monkeypatch, interpreter):
    monkeypatch.setattr(runtime, "INTERPRETER", interpreter)
    with tune.record() as asked:  # empties the memoised plans first (they may be another backend's)
        for bwd in (False, True):
            for (rows, r, dtype), (bm, br, warps), single in _SM_HEURISTIC[interpreter]:
                assert KS._softmax_plan(rows, r, dtype, bwd) == (
                    -(-rows // bm), dict(SINGLE=single, BLOCK_ROWS=bm, BLOCK_R=br, num_warps=warps))
            for (rows, c), (bm, bc, warps) in _CE_HEURISTIC[interpreter]:
                assert KS._ce_plan(rows, c, torch.bfloat16, bwd) == (-(-rows // bm), dict(BLOCK_ROWS=bm, BLOCK_C=bc,
                                                                                           num_warps=warps))
    assert [q[0] for q in asked] == ["softmax_fwd"] * len(_SM_HEURISTIC[interpreter]) + \
        ["cross_entropy_fwd"] * 3 + ["softmax_bwd"] * len(_SM_HEURISTIC[interpreter]) + ["cross_entropy_bwd"] * 3
    assert asked[0][1:3] == ((8192, 32000), "bfloat16")


def test_softmax_configs_come_from_the_table(tables, fake_gpu):
    tables({"softmax_fwd": {"bfloat16": [entry((8192, 32000), dict(BLOCK_ROWS=2, BLOCK_R=2048, num_warps=4)),
                                         entry((8192, 12000), dict(BLOCK_ROWS=1, BLOCK_R=65536, num_warps=16))]},
            "softmax_bwd": {"bfloat16": [entry((8192, 32000), dict(BLOCK_ROWS=1, BLOCK_R=32768, num_warps=16))]},
            "cross_entropy_fwd": {"float32": [entry((8192, 32000), dict(BLOCK_ROWS=4, BLOCK_C=1024, num_warps=2))]},
            "cross_entropy_bwd": {"float32": [entry((100, 40), dict(BLOCK_ROWS=4, BLOCK_C=1024, num_warps=2))]}})
    bf16, f32 = torch.bfloat16, torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", tune.TuningTableWarning)  # every entry is valid
        assert KS._softmax_plan(8192, 32000, bf16, False) == (4096, dict(SINGLE=False, BLOCK_ROWS=2, BLOCK_R=2048,
                                                                         num_warps=4))
    # BLOCK_R is cut to R rounded up to a power of two: whole rows, here and at a neighbour in the bucket
    assert KS._softmax_plan(8192, 12000, bf16, False)[1] == dict(SINGLE=True, BLOCK_ROWS=1, BLOCK_R=16384, num_warps=16)
    assert KS._softmax_plan(8192, 14000, bf16, False)[1]["BLOCK_R"] == 16384
    assert KS._softmax_plan(8192, 32000, bf16, True)[1] == dict(SINGLE=True, BLOCK_ROWS=1, BLOCK_R=32768,
                                                                num_warps=16)
    assert KS._softmax_plan(8192, 32000, torch.float16, False)[1]["BLOCK_R"] == 4096  # fp16: the heuristic
    assert KS._ce_plan(8192, 32000, f32, False) == (2048, dict(BLOCK_ROWS=4, BLOCK_C=1024, num_warps=2))
    assert KS._ce_plan(100, 40, f32, True) == (25, dict(BLOCK_ROWS=4, BLOCK_C=64, num_warps=2))
    assert KS._ce_plan(8192, 32000, f32, True)[1]["BLOCK_C"] == 4096  # no backward entry: the heuristic


def test_memoised_softmax_plans_follow_override_and_reset(tables):
    plan = KS._softmax_plan(64, 40, torch.float32, False)
    assert KS._softmax_plan(64, 40, torch.float32, False) is plan and plan[1]["SINGLE"]  # memoised
    with tune.override("softmax_fwd", dict(BLOCK_ROWS=2, BLOCK_R=16, num_warps=1)):
        assert KS._softmax_plan(64, 40, torch.float32, False) == (32, dict(SINGLE=False, BLOCK_ROWS=2, BLOCK_R=16,
                                                                           num_warps=1))
        assert KS._softmax_plan(64, 40, torch.float32, True) == plan  # the backward is another kernel
    assert KS._softmax_plan(64, 40, torch.float32, False) == plan
    ce = KS._ce_plan(64, 40, torch.float32, True)
    with tune.override("cross_entropy_bwd", dict(BLOCK_ROWS=4, BLOCK_C=8, num_warps=2)):
        assert KS._ce_plan(64, 40, torch.float32, True) == (16, dict(BLOCK_ROWS=4, BLOCK_C=8, num_warps=2))
    assert KS._ce_plan(64, 40, torch.float32, True) == ce
    tune.reset()
    assert KS._ce_plan(64, 40, torch.float32, True) is not ce  # reset empties the memo too


def _map_plan(shape, dtype, inputs, op=KE.ADD):
    """(kernel name, grid, launch config) of _plan_map for an output of ``shape`` (no memory: meta
    tensors) and the inputs ``inputs(out)``."""
    out = torch.empty(shape, dtype=dtype, device="meta")
    kernel, grid, _, meta = KE._plan_map(out, inputs(out), op.value, None)
    return kernel.fn.__name__, grid, {k: meta[k] for k in ("BLOCK", "BLOCK_R", "BLOCK_C", "num_warps") if k in meta}


def _same(out):
    return [torch.empty_like(out), torch.empty_like(out)]


def _by_channel(out):  # x * a per-channel scale, broadcast
    return [torch.empty_like(out), torch.empty(1, out.shape[1], 1, 1, dtype=out.dtype, device="meta").expand(out.shape)]


def _transposed(out):
    return [torch.empty(out.shape[::-1], dtype=out.dtype, device="meta").t()]


# The map and reduction heuristics' answers before they went through flame.tune (the GPU's with
# 132 SMs, then the interpreter's): map (shape, dtype, inputs) -> (kernel, grid, config);
# reduction (outer, R, inner) -> (grid, R per split, config).
_MAP_HEURISTIC = {
    False: [(((1, 320, 128, 128), torch.bfloat16, _same), ("_map_contiguous_kernel", (1280,), dict(BLOCK=4096,
                                                                                                    num_warps=8))),
            (((1, 320, 128, 128), torch.float32, _same), ("_map_contiguous_kernel", (2560,), dict(BLOCK=2048,
                                                                                                   num_warps=8))),
            (((1, 320, 128, 128), torch.bfloat16, _by_channel),
             ("_map_strided_kernel", (80, 16), dict(BLOCK_R=4, BLOCK_C=1024, num_warps=8))),
            (((4096, 640), torch.bfloat16, _transposed),
             ("_map_strided_kernel", (64, 10), dict(BLOCK_R=64, BLOCK_C=64, num_warps=8))),
            (((1, 3, 5, 7), torch.float32, _by_channel),
             ("_map_strided_kernel", (1, 1), dict(BLOCK_R=4, BLOCK_C=64, num_warps=4)))],
    True: [(((1, 320, 128, 128), torch.bfloat16, _same), ("_map_contiguous_kernel", (80,), dict(BLOCK=65536,
                                                                                                 num_warps=8))),
           (((1, 3, 5, 7), torch.bfloat16, _same), ("_map_contiguous_kernel", (1,), dict(BLOCK=128, num_warps=4))),
           (((1, 320, 128, 128), torch.bfloat16, _by_channel),
            ("_map_strided_kernel", (80, 4), dict(BLOCK_R=4, BLOCK_C=4096, num_warps=8))),
           (((4096, 640), torch.bfloat16, _transposed),
            ("_map_strided_kernel", (256, 1), dict(BLOCK_R=16, BLOCK_C=1024, num_warps=8)))]}
_REDUCE_HEURISTIC = {
    False: [((1, 4096, 640), ((1, 10, 32), 128, dict(BLOCK_R=32, BLOCK_I=64, num_warps=8))),
            ((1, 16384, 320), ((1, 5, 103), 160, dict(BLOCK_R=32, BLOCK_I=64, num_warps=8))),
            ((8192, 32000, 1), ((8192, 1, 1), 32768, dict(BLOCK_R=1024, BLOCK_I=1, num_warps=4)))],
    True: [((1, 4096, 640), ((1, 1, 1), 4096, dict(BLOCK_R=16, BLOCK_I=1024, num_warps=8))),
           ((8192, 32000, 1), ((8192, 1, 1), 32768, dict(BLOCK_R=16384, BLOCK_I=1, num_warps=8)))]}


@pytest.mark.parametrize("interpreter", [False, True])
def test_without_a_table_map_and_reduce_configs_are_the_heuristics(tables, fake_gpu, monkeypatch, interpreter):
    monkeypatch.setattr(runtime, "INTERPRETER", interpreter)
    with tune.record() as asked:
        for (shape, dtype, inputs), want in _MAP_HEURISTIC[interpreter]:
            assert _map_plan(shape, dtype, inputs) == want
        for key, want in _REDUCE_HEURISTIC[interpreter]:
            assert KR._reduce_plan(*key, torch.bfloat16) == want
    kernels = [q[0] for q in asked]
    assert kernels == [want[0][1:-7] for _, want in _MAP_HEURISTIC[interpreter]] + \
        ["reduce"] * len(_REDUCE_HEURISTIC[interpreter])
    assert asked[0][1:3] == ((5242880,), "bfloat16") and asked[2][1] == (320, 16384, 0)
    assert asked[3][1] == (4096, 640, 1)  # an operand is not unit-stride innermost


def test_map_and_reduce_configs_come_from_the_table(tables, fake_gpu):
    tables({"map_contiguous": {"bfloat16": [entry((5242880,), dict(BLOCK_SIZE=1024, num_warps=2))]},
            "map_strided": {"bfloat16": [entry((320, 16384, 0), dict(BLOCK_R=16, BLOCK_C=256, num_warps=4)),
                                         entry((3, 35, 0), dict(BLOCK_R=64, BLOCK_C=128, num_warps=2))]},
            "reduce": {"bfloat16": [entry((1, 4096, 640), dict(BLOCK_R=128, BLOCK_I=32, num_warps=4)),
                                    entry((8192, 32000, 1), dict(BLOCK_R=4096, BLOCK_I=8, num_warps=16))]}})
    bf16 = torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error", tune.TuningTableWarning)  # every entry is valid
        assert _map_plan((1, 320, 128, 128), bf16, _same) == ("_map_contiguous_kernel", (5120,),
                                                              dict(BLOCK=1024, num_warps=2))
    assert _map_plan((1, 320, 128, 128), bf16, _by_channel) == ("_map_strided_kernel", (20, 64),
                                                                dict(BLOCK_R=16, BLOCK_C=256, num_warps=4))
    # blocks cut to the dims rounded up to powers of two (3 -> 4 rows, 35 -> 64 columns)
    assert _map_plan((1, 3, 5, 7), bf16, _by_channel)[2] == dict(BLOCK_R=4, BLOCK_C=64, num_warps=2)
    assert _map_plan((1, 320, 128, 128), torch.float16, _same)[2]["BLOCK"] == 4096  # fp16: the heuristic
    # the splits follow from the tuned BLOCK_R: 20 programs, R split 8 ways (4 blocks of 128 each at least)
    assert KR._reduce_plan(1, 4096, 640, bf16) == ((1, 20, 8), 512, dict(BLOCK_R=128, BLOCK_I=32, num_warps=4))
    assert KR._reduce_plan(8192, 32000, 1, bf16) == ((8192, 1, 1), 32768, dict(BLOCK_R=4096, BLOCK_I=1,
                                                                               num_warps=16))


@pytest.mark.skipif(not runtime.INTERPRETER, reason="the interpreter's heuristic plans, on CPU tensors")
def test_memoised_map_and_reduce_plans_follow_override_and_reset(tables):
    a, b, out = torch.randn(3, 40), torch.randn(3, 40), torch.empty(3, 40)
    KE.map_(out, [a, b], KE.ADD)
    plan = next(p for k, p in KE._plans.items() if k[3:5] == (out.shape, out.stride()) and k[0] == KE.ADD.value)
    assert plan[3]["BLOCK"] == 128
    with tune.override("map_contiguous", dict(BLOCK_SIZE=32, num_warps=1)) as o:
        KE.map_(out, [a, b], KE.ADD)
        torch.testing.assert_close(out, a + b)  # four programs of 32
        (tuned,) = [p for k, p in KE._plans.items() if k[3:5] == (out.shape, out.stride())]
        assert tuned[1:4] == ((4,), (120,), dict(plan[3], BLOCK=32, num_warps=1)) and o.served == 1
        assert tuned[4] != plan[4]  # a new plan id: launch(sig=) never meets the old plan's compiled kernel
    KE.map_(out, [a, b], KE.ADD)
    assert [p[3]["BLOCK"] for k, p in KE._plans.items() if k[3:5] == (out.shape, out.stride())] == [128]
    col = torch.empty(40)
    KR.reduce_(col, a, 1, 3, 40, a.stride() and (0, 40, 1), KR.SUM)
    assert KR._plans[1, 3, 40, torch.float32][2] == dict(BLOCK_R=4, BLOCK_I=64, num_warps=4)
    with tune.override("reduce", dict(BLOCK_R=2, BLOCK_I=16, num_warps=1)):
        KR.reduce_(col, a, 1, 3, 40, (0, 40, 1), KR.SUM)
        torch.testing.assert_close(col, a.sum(0))
        assert KR._plans[1, 3, 40, torch.float32] == ((1, 3, 1), 4, dict(BLOCK_R=2, BLOCK_I=16, num_warps=1))
    assert KR._plans == {}  # emptied on exit
    tune.reset()
    assert KE._plans == {}  # reset empties the map plans too


@pytest.mark.skipif(not runtime.INTERPRETER, reason="the interpreter's heuristic plans, on CPU tensors")
def test_new_map_and_reduce_plans_are_tuned_on_first_use(monkeypatch, tmp_path, capsys):
    from flame import autotune

    monkeypatch.setenv("FLAME_AUTOTUNE", "1")
    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_INTERPRETER_OK", True)
    tune.reset()
    try:
        a, b, out = torch.randn(5, 30), torch.randn(5, 30), torch.empty(5, 30)
        KE.map_(out, [a, b], KE.ADD)
        torch.testing.assert_close(out, a + b)
        x, col = torch.randn(3, 7), torch.empty(7)
        KR.reduce_(col, x, 1, 3, 7, (0, 7, 1), KR.SUM)
        torch.testing.assert_close(col, x.sum(0))
        err = capsys.readouterr().err
        assert "flame autotune: map_contiguous [150] float32" in err
        assert "flame autotune: reduce [1, 3, 7] float32" in err
        doc = json.loads(tune.cache_path().read_text())
        assert {k: [e["key"] for e in v["float32"]] for k, v in doc["entries"].items()} == {
            "map_contiguous": [[150]], "reduce": [[1, 3, 7]]}
        KE.map_(out, [a, b], KE.ADD)
        KR.reduce_(col, x, 1, 3, 7, (0, 7, 1), KR.SUM)
        assert capsys.readouterr().err == ""  # known now: not tuned again
    finally:
        monkeypatch.undo()
        tune.reset()


def test_wgrad_launches_with_the_override(monkeypatch):
    dev = runtime.device
    tol = {} if runtime.INTERPRETER else dict(rtol=1e-2, atol=1e-2)  # tf32 on the GPU
    x, g = torch.randn(1, 3, 6, 5, device=dev), torch.randn(1, 4, 6, 5, device=dev)
    dw = runtime.empty((4, 3, 3, 3), torch.float32)
    want = torch.nn.grad.conv2d_weight(x, (4, 3, 3, 3), g, padding=1)
    seen = _launched_blocks(monkeypatch, conv2d)
    for forced in (False, True, False):
        other = 32 if seen and seen[0] == 16 else 16  # a BLOCK_M the heuristic did not pick
        cfg = dict(CONV, BLOCK_M=other, BLOCK_N=16, BLOCK_K=16) if forced else None
        with tune.override("conv2d_wgrad", cfg) if cfg else contextlib.nullcontext():
            dw.fill_(float("nan"))
            conv2d.conv2d_weight_grad_(dw, g, x, (1, 1), (1, 1), (1, 1))
            torch.testing.assert_close(dw, want, **tol)
    assert seen[1] != seen[0] == seen[2], seen


# ---- override and launcher caches ---------------------------------------------------------------

@pytest.fixture
def caches(monkeypatch):
    """Registrations made by the test are dropped afterwards (the launchers' own stay)."""
    monkeypatch.setattr(tune, "_cache_clears", list(tune._cache_clears))


@pytest.mark.parametrize("interpreter", [True, False])
def test_override_answers_every_key_and_dtype_on_every_backend(tables, monkeypatch, interpreter):
    monkeypatch.setattr(runtime, "INTERPRETER", interpreter)
    monkeypatch.setattr(runtime, "device_name", lambda: GPU)
    tables({"matmul": {"bfloat16": [entry((64, 64, 64, 1), MM)]}})
    want_table = DEFAULT if interpreter else MM  # the current device's table: only on a GPU
    assert tune.config("matmul", (64, 64, 64, 1), torch.bfloat16, DEFAULT) == want_table
    tried = dict(MM, BLOCK_M=16, num_stages=2)
    with tune.override("matmul", tried) as active:
        for key, dtype in [((64, 64, 64, 1), torch.bfloat16), ((7, 9, 11, 3), torch.float32),
                           ((1, 1, 1, 1), "float16")]:
            assert tune.config("matmul", key, dtype, DEFAULT) == tried
        assert ask((64, 64, 64, 1)) == tried  # a named GPU's table entry too
        conv_default = {k: v for k, v in DEFAULT.items() if k != "GROUP_M"}
        assert tune.config("conv2d", (8, 8, 8, 9), torch.float16, conv_default) is conv_default  # other kernels
        assert active.served == 4
    assert tune.config("matmul", (64, 64, 64, 1), torch.bfloat16, DEFAULT) == want_table  # cached answers dropped
    assert ask((64, 64, 64, 1)) == MM


def test_override_nests_and_restores(tables):
    outer, inner = dict(MM, BLOCK_M=16), dict(MM, BLOCK_M=32)
    with tune.override("matmul", outer):
        with tune.override("conv2d", CONV), tune.override("matmul", inner):
            assert ask((8, 8, 8, 1)) == inner
            assert tune.config("conv2d", (8, 8, 8, 1), "float32", CONV | {"BLOCK_M": 1}) == CONV
        assert ask((8, 8, 8, 1)) == outer
        assert tune.config("conv2d", (8, 8, 8, 1), "float32", CONV | {"BLOCK_M": 1})["BLOCK_M"] == 1
    assert ask((8, 8, 8, 1)) is DEFAULT


@pytest.mark.parametrize("kernel, cfg, match", [
    ("nope", MM, "unknown kernel"),
    ("matmul", dict(MM, BLOCK_X=16), "BLOCK_X"),
    ("matmul", {k: v for k, v in MM.items() if k != "GROUP_M"}, "GROUP_M"),
    ("conv2d", MM, "GROUP_M"),
    ("matmul", dict(MM, BLOCK_K=48), "BLOCK_K=48"),
    ("matmul", dict(MM, num_warps=0), "num_warps=0"),
    ("matmul", dict(MM, num_stages=2.0), "num_stages=2.0"),
    ("conv2d", [16, 16, 16, 4, 2], "not conv2d's"),
    ("attention_bwd", dict(BWD, BLOCK_N_DQ=48), "BLOCK_N_DQ=48"),  # the dQ program's blocks are checked too
    ("attention_bwd", {k: v for k, v in BWD.items() if k != "CHUNKS"}, "CHUNKS"),
    ("attention_fwd", dict(FWD, SINGLE_KV=1), "SINGLE_KV"),  # derived, not tuned
    ("group_norm_fwd", dict(GN, BLOCK_C=48), "BLOCK_C=48"),
    ("group_norm_bwd", dict(GN, SPLITS=0), "SPLITS=0"),
    ("layer_norm_bwd", dict(BLOCK_M=2, num_warps=4), "PROGRAMS"),
    ("layer_norm_fwd", dict(BLOCK_M=2, num_warps=4, BLOCK_D=1024), "BLOCK_D"),  # derived, not tuned
    ("conv2d_wgrad", MM, "GROUP_M"),
    ("softmax_fwd", dict(BLOCK_ROWS=2, BLOCK_R=48, num_warps=4), "BLOCK_R=48"),
    ("softmax_bwd", dict(BLOCK_ROWS=2, BLOCK_R=64, num_warps=4, SINGLE=1), "SINGLE"),  # derived, not tuned
    ("cross_entropy_fwd", dict(BLOCK_ROWS=2, BLOCK_R=64, num_warps=4), "BLOCK_C"),
    ("cross_entropy_bwd", dict(BLOCK_ROWS=0, BLOCK_C=64, num_warps=4), "BLOCK_ROWS=0"),
    ("map_contiguous", dict(BLOCK_SIZE=96, num_warps=4), "BLOCK_SIZE=96"),
    ("map_contiguous", dict(BLOCK=64, num_warps=4), "BLOCK_SIZE"),
    ("map_strided", dict(BLOCK_R=2, BLOCK_I=64, num_warps=4), "BLOCK_C"),
    ("reduce", dict(BLOCK_R=64, BLOCK_I=1, num_warps=0), "num_warps=0"),
])
def test_override_rejects_a_config_that_is_not_the_kernels(kernel, cfg, match):
    with pytest.raises(ValueError, match=match):
        tune.override(kernel, cfg)
    assert ask((8, 8, 8, 1)) is DEFAULT  # nothing stays behind


def test_registered_caches_are_emptied_by_override_and_reset(caches):
    launcher_cache = {}  # as a launcher keeps configs per shape
    assert tune.register_cache(launcher_cache.clear) == launcher_cache.clear
    tune.register_cache(launcher_cache.clear)  # once is enough
    assert tune._cache_clears.count(launcher_cache.clear) == 1
    launcher_cache["shape"] = "heuristic"
    with tune.override("matmul", MM):
        assert launcher_cache == {}
        launcher_cache["shape"] = "overridden"
    assert launcher_cache == {}
    launcher_cache["shape"] = "heuristic"
    tune.reset()
    assert launcher_cache == {}
    with pytest.raises(TypeError, match="callable"):
        tune.register_cache({})


def test_hot_path_is_one_lookup_after_the_first_call(tables, monkeypatch):
    calls = []
    real = tune._lookup
    monkeypatch.setattr(tune, "_lookup", lambda *a: calls.append(a) or real(*a))
    for _ in range(3):
        ask((64, 64, 64, 1))
    with tune.override("matmul", MM) as active:
        for _ in range(3):
            assert ask((64, 64, 64, 1)) == MM
    assert len(calls) == 2 and active.served == 1


def _launched_blocks(monkeypatch, module):
    """BLOCK_M of each launch ``module`` makes (the launch itself still happens)."""
    seen = []
    real = module.launch

    def spy(kernel, grid, *args, **meta):
        seen.append(meta["BLOCK_M"])
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", spy)
    return seen


def test_kernels_launch_with_the_override(monkeypatch):
    dev = runtime.device
    tol = {} if runtime.INTERPRETER else dict(rtol=1e-2, atol=1e-2)  # tf32 on the GPU
    a, b = torch.randn(40, 24, device=dev), torch.randn(24, 36, device=dev)
    out = runtime.empty((40, 36), torch.float32)
    seen = _launched_blocks(monkeypatch, matmul)
    matmul.matmul_(out, a, b)  # fills the launcher's cache with the heuristic
    with tune.override("matmul", dict(MM, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)):
        matmul.matmul_(out, a, b)
        torch.testing.assert_close(out, a @ b, **tol)
    matmul.matmul_(out, a, b)
    assert seen[1] == 16 and seen[0] == seen[2] != 16, seen
    # 9 input channels take the implicit GEMM (conv2d), 2 the folded one (conv2d_fold)
    for ci, kernel, cfg in ((9, "conv2d", dict(CONV, BLOCK_M=32, BLOCK_N=16, BLOCK_K=16)),
                            (2, "conv2d_fold", dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1))):
        x, w = torch.randn(1, ci, 5, 4, device=dev), torch.randn(3, ci, 3, 3, device=dev)
        y = runtime.empty((1, 3, 3, 2), torch.float32)
        seen = _launched_blocks(monkeypatch, conv2d)
        for override in (None, cfg, None):
            with tune.override(kernel, override) if override else contextlib.nullcontext():
                conv2d.conv2d_forward_(y, x, w, None, (1, 1), (0, 0), (1, 1))
                torch.testing.assert_close(y, torch.nn.functional.conv2d(x, w), **tol)
        assert seen[1] == 32 and seen[0] == seen[2] != 32, (kernel, seen)


class _FailsToBuild:
    """A jitted kernel whose launches with the meta values ``bad`` raise Triton's out-of-resources
    error, as a config tuned under another Triton release that no longer fits would; others run."""

    def __init__(self, kernel, bad):
        self.kernel, self.bad, self.tries = kernel, bad, 0

    def __getattr__(self, name):  # arg_names, do_not_specialize: launch()'s direct path reads them
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def run(*args, **meta):
            if all(meta.get(k) == v for k, v in self.bad.items()):
                self.tries += 1
                raise OutOfResources(262144, 232448, "shared memory")
            return self.kernel[grid](*args, **meta)
        return run


def _table_warnings(seen):
    return [str(w.message) for w in seen if issubclass(w.category, tune.TuningTableWarning)]


def test_an_entry_from_another_release_that_fails_to_launch_falls_back_to_the_heuristic_once(tables, monkeypatch):
    bad = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)
    good = dict(bad, BLOCK_M=32, GROUP_M=4)
    path = tables({"matmul": {"float32": [entry((40, 36, 24, 1), bad), entry((160, 36, 24, 1), good)]}},
                  triton="2.1.0")
    kernel = _FailsToBuild(matmul._matmul_kernel, dict(BLOCK_M=16, GROUP_M=2))
    monkeypatch.setattr(matmul, "_matmul_kernel", kernel)
    blocks = _launched_blocks(monkeypatch, matmul)
    tol = {} if runtime.INTERPRETER else dict(rtol=1e-2, atol=1e-2)  # tf32 on the GPU
    with tune.table_from(path, device_name=GPU), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for M in (160, 40, 40, 44):  # 44 shares the failing entry's bucket
            a, b = torch.randn(M, 24, device=runtime.device), torch.randn(24, 36, device=runtime.device)
            out = runtime.empty((M, 36), torch.float32)
            matmul.matmul_(out, a, b)
            torch.testing.assert_close(out, a @ b, **tol)
    # the working entry is used; the failing one is tried once, then the heuristic runs, now and later
    assert blocks[:2] == [32, 16] and 16 not in blocks[2:] and len(blocks) == 5, blocks
    assert kernel.tries == 1
    msgs = _table_warnings(seen)
    assert len(msgs) == 1, msgs
    for part in ("OutOfResources", "matmul/float32 key [40, 36, 24, 1] (Triton 2.1.0", str(path)):
        assert part in msgs[0], (part, msgs[0])
    assert "[160, 36, 24, 1]" not in msgs[0]  # proven by its launch: not dropped


def test_a_launch_outside_entry_points_that_fails_raises_once_then_takes_the_heuristic(tables, monkeypatch):
    path = tables({"map_contiguous": {"float32": [entry((150,), dict(BLOCK_SIZE=64, num_warps=2))]}},
                  triton="2.1.0")
    kernel = _FailsToBuild(KE._map_contiguous_kernel, dict(BLOCK=64, num_warps=2))
    monkeypatch.setattr(KE, "_map_contiguous_kernel", kernel)
    a, b = torch.randn(5, 30, device=runtime.device), torch.randn(5, 30, device=runtime.device)
    out = runtime.empty((5, 30), torch.float32)
    with tune.table_from(path, device_name=GPU):
        with pytest.warns(tune.TuningTableWarning, match="dropped"), \
                pytest.raises(tune.EntryDropped, match=r"map_contiguous/float32 key \[150\] \(Triton 2\.1\.0") as err:
            KE.map_(out, [a, b], KE.ADD)  # an op's map: no entry point to run again
        assert isinstance(err.value.__cause__, OutOfResources)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tune.TuningTableWarning)
            KE.map_(out, [a, b], KE.ADD)
        torch.testing.assert_close(out, a + b)
    assert kernel.tries == 1


def test_an_error_with_no_entry_from_another_release_in_use_is_raised_as_it_is(tables, monkeypatch):
    path = tables({"map_contiguous": {"float32": [entry((150,), dict(BLOCK_SIZE=64, num_warps=2))]}})
    monkeypatch.setattr(KE, "_map_contiguous_kernel", _FailsToBuild(KE._map_contiguous_kernel, {}))
    a, out = torch.randn(150, device=runtime.device), runtime.empty((150,), torch.float32)
    with tune.table_from(path, device_name=GPU), warnings.catch_warnings():
        warnings.simplefilter("error", tune.TuningTableWarning)
        for _ in range(2):  # this release's entry: not dropped, the error stays
            with pytest.raises(OutOfResources):
                KE.map_(out, [a], KE.NEG)


def test_tuning_on_first_use_tunes_keys_whose_entry_is_from_another_release(tables, fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("FLAME_AUTOTUNE", "1")
    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path / "cache"))
    tables({"matmul": {"bfloat16": [dict(entry((64, 64, 64, 1), MM), triton="2.1.0"), entry((32, 32, 32, 1), MM)]}})
    tune.reset()
    try:
        with tune.asked_configs() as asked:
            assert tune.config("matmul", (64, 64, 64, 1), torch.bfloat16, DEFAULT) is DEFAULT
            assert tune.config("matmul", (32, 32, 32, 1), torch.bfloat16, DEFAULT) == MM
        assert [q[4] for q in asked] == [True, False]  # unknown: tuned; known
    finally:
        monkeypatch.undo()  # FLAME_AUTOTUNE off again before tune re-reads it
        tune.reset()


def test_attention_kernels_launch_with_the_override(monkeypatch):
    # 130 keys: the loop over key blocks with its own dQ program on both backends
    B, H, Lq, Lk, D = 1, 2, 20, 130, 8
    q, k, v, do = (torch.randn(B, n, H, D, device=runtime.device).permute(0, 2, 1, 3) for n in (Lq, Lk, Lk, Lq))
    o, dq, dk, dv = (runtime.empty((B, n, H, D), torch.float32).permute(0, 2, 1, 3) for n in (Lq, Lq, Lk, Lk))
    lse = runtime.empty((B * H, Lq), torch.float32)
    st = [(t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v, o, do, dq, dk, dv)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*ref)
    want_grads = torch.autograd.grad(want, ref, do)
    tol = {} if runtime.INTERPRETER else dict(rtol=1e-2, atol=1e-2)
    launched = []
    real = attention.launch

    def spy(kernel, grid, *args, **meta):
        launched.append((kernel.fn.__name__, meta.get("BLOCK_M"), meta.get("BLOCK_N"), grid))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(attention, "launch", spy)

    def run():
        attention.attention_fwd(q, k, v, o, lse, *st[:4], B, H, Lq, Lk, D, D ** -0.5, False)
        attention.attention_bwd(q, k, v, o, do, lse, dq, dk, dv, *st, B, H, Lq, Lk, D, D ** -0.5, False)
        torch.testing.assert_close(o, want, **tol)
        for got, w in zip((dq, dk, dv), want_grads):
            torch.testing.assert_close(got, w, **tol)

    run()  # fills the memoised configs with the heuristic
    fwd = dict(BLOCK_M=16, BLOCK_N=32, M_GROUP=2, num_warps=4, num_stages=1)
    bwd = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1, BLOCK_M_DQ=32, BLOCK_N_DQ=16, num_warps_dq=4,
               num_stages_dq=1, CHUNKS=2)
    default = list(launched)
    launched.clear()
    with tune.override("attention_fwd", fwd), tune.override("attention_bwd", bwd):
        run()
    blocks = {name: (bm, bn, grid) for name, bm, bn, grid in launched}
    assert blocks["_attn_fwd_kernel"] == (16, 32, (1, B * H))  # two 16-row query blocks in one program
    assert blocks["_attn_bwd_dkdv_kernel"] == (16, 64, (3, B * H, 2))  # 3 key blocks x 2 query chunks
    assert blocks["_attn_bwd_dq_kernel"] == (32, 16, (1, B * H))
    assert "_sum_chunks_kernel" in blocks
    launched.clear()
    run()
    assert launched == default  # the heuristic again


def test_record_lists_each_query_with_its_answer(tables, caches):
    tables({"matmul": {"bfloat16": [entry((64, 64, 64, 1), MM)]}})
    launcher_cache = {"shape": "from before"}
    tune.register_cache(launcher_cache.clear)
    conv_default = {k: v for k, v in DEFAULT.items() if k != "GROUP_M"}
    ask((64, 64, 64, 1))  # cached before the block: asked again inside it
    with tune.record() as asked:
        assert launcher_cache == {}
        ask((64, 64, 64, 1))
        ask((64, 64, 64, 1))  # answered from the cache: listed once
        with tune.override("conv2d", CONV), tune.record() as inner:
            tune.config("conv2d", (8, 8, 8, 9), torch.float16, conv_default, device_name=GPU)
        ask((7, 7, 7, 1), dtype="float32")
    assert asked == [("matmul", (64, 64, 64, 1), "bfloat16", MM), ("conv2d", (8, 8, 8, 9), "float16", CONV),
                     ("matmul", (7, 7, 7, 1), "float32", DEFAULT)]
    assert inner == [("conv2d", (8, 8, 8, 9), "float16", CONV)]
    ask((5, 5, 5, 1))
    assert len(asked) == 3 and tune._records == []  # nothing is recorded after the block


# Small keys per kernel (each kernel's spec lists its key names): every spec's heuristic and quick
# search space give configs of exactly its fields, so a new kernel is covered by registering its spec.
SPEC_KEYS = {("M", "N", "K", "batch"): (40, 24, 72, 1), ("M", "N", "C", "taps"): (40, 24, 8, 9),
             ("M", "N", "K", "taps"): (24, 8, 40, 9), ("Lq", "Lk", "D", "BH"): (24, 136, 16, 2),
             ("M", "D"): (10, 24), ("N", "C", "S", "G", "channels_last"): (1, 6, 35, 3, 1), ("ROWS", "R"): (10, 40),
             ("ROWS", "C"): (7, 100), ("numel",): (105,), ("ROWS", "COLS", "transposed"): (15, 7, 0),
             ("outer", "R", "inner"): (1, 40, 24)}


@pytest.mark.parametrize("name", sorted(tune.SPECS))
def test_every_spec_gives_configs_of_its_fields(name):
    from flame import autotune
    spec = tune.SPECS[name]
    assert tune.KERNELS[name] == (spec.key, spec.fields) and spec.doc
    key = SPEC_KEYS[spec.key]
    default = spec.heuristic(key, torch.float32)
    assert set(default) == set(spec.fields), default
    assert spec.config(key, torch.float32) == default  # no table on the interpreter
    best = default
    for i, stage in enumerate(autotune.search_stages(autotune.Space(torch.float32, quick=True), name, key)):
        configs = stage(best)
        # a later stage may have nothing left to vary at a small key (on a GPU every count of
        # layer_norm_bwd's persistent programs is capped at the default's, the row blocks)
        assert configs or i > 0, name
        assert all(set(c) == set(spec.fields) for c in configs), (name, configs[:3])
        assert spec.keep is None or all(spec.keep(c, key) for c in configs)
        best = configs[0] if configs else best


def test_entry_points_skip_call_entry_while_no_entry_of_another_release_can_be_served(tables, monkeypatch):
    """tune.direct_entries: kernel entry points call their function directly (no call_entry) while no
    table entry tuned with another Triton release can be answered; heuristics_only()/table_from()
    blocks and any such entry loaded turn that off (for good once an entry was loaded), so a failing
    entry's launch is still run again with the heuristic (the tests above)."""
    monkeypatch.setattr(tune, "_foreign_seen", False)
    monkeypatch.setattr(tune, "direct_entries", False)
    calls = []
    real = tune.call_entry
    monkeypatch.setattr(tune, "call_entry", lambda *a: calls.append(a[0].__name__) or real(*a))
    a, b = torch.randn(8, 8, device=runtime.device), torch.randn(8, 8, device=runtime.device)
    out = runtime.empty((8, 8), torch.float32)
    tune.reset()
    if runtime.INTERPRETER:  # no table to read: direct from the start
        assert tune.direct_entries
    else:  # a GPU: once its own table is loaded
        matmul.matmul_(out, a, b)
        assert tune.direct_entries
    calls.clear()
    matmul.matmul_(out, a, b)
    assert calls == []
    with tune.heuristics_only():
        assert not tune.direct_entries
        matmul.matmul_(out, a, b)
    assert tune.direct_entries and calls == ["matmul_"]
    path = tables({"matmul": {"float32": [entry((8, 8, 8, 1), MM)]}}, triton="2.1.0")
    with tune.table_from(path, device_name=GPU):
        matmul.matmul_(out, a, b)
    assert not tune.direct_entries and tune._foreign_seen
    tune.reset()
    matmul.matmul_(out, a, b)
    assert not tune.direct_entries and calls == ["matmul_"] * 3
