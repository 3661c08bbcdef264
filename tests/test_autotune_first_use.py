"""Tuning on first use (FLAME_AUTOTUNE=1, flame/autotune.py + flame.tune's cache table), on the
interpreter: a fake kernel whose timings and wrong configs the test decides, and a real GEMM."""
import json
import warnings

import pytest
import torch

import flame
import flame.nn.functional as F
from flame import autotune, tune
from flame.kernels import elementwise as KE

FAKE, FAKE_ROUTER = "fake_first_use", "fake_router"
DEFAULT = {"BLOCK": 16, "num_warps": 4}
CANDIDATES = [{"BLOCK": 32, "num_warps": 4}, {"BLOCK": 64, "num_warps": 4}, {"BLOCK": 16, "num_warps": 8}]
TIMES = {(16, 4): 3.0, (32, 4): 1.0, (64, 4): 0.5, (16, 8): 2.0}  # BLOCK 64 is fastest, and wrong
ASKED = []  # the config each fake launch ran with
SEARCH, TIME_MS = autotune.search_stages, autotune._time_ms  # the real ones (the fixture replaces them)


@autotune.tunable("out")
def fake_entry(out, x):
    tune.config(FAKE_ROUTER, (x.shape[0],), x.dtype, DEFAULT)  # asked first, then not run (like "matmul")
    cfg = tune.config(FAKE, (x.shape[0],), x.dtype, DEFAULT)
    ASKED.append(cfg)
    KE.copy_(out, x)
    if cfg["BLOCK"] == 64:
        KE.fill_(out, 7.0)


def _active_time(run, reps):
    run()
    active = tune._overrides.get(FAKE)
    cfg = active.config if active is not None else DEFAULT
    return TIMES[cfg["BLOCK"], cfg["num_warps"]]


@pytest.fixture
def first_use(monkeypatch, tmp_path):
    monkeypatch.setitem(tune.KERNELS, FAKE, (("N",), ("BLOCK", "num_warps")))
    monkeypatch.setitem(tune.KERNELS, FAKE_ROUTER, (("N",), ("BLOCK", "num_warps")))
    monkeypatch.setenv("FLAME_AUTOTUNE", "1")
    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_INTERPRETER_OK", True)
    monkeypatch.setattr(autotune, "_time_ms", _active_time)
    monkeypatch.setattr(autotune, "search_stages", lambda space, kernel, key: [lambda best: list(CANDIDATES)])
    ASKED.clear()
    tune.reset()
    yield tmp_path
    monkeypatch.undo()  # FLAME_AUTOTUNE off again before tune re-reads it: later tests must not tune
    tune.reset()


def _call(n=5):
    x = torch.arange(n, dtype=torch.float32, device=flame.device)
    out = torch.empty_like(x)
    fake_entry(out, x)
    return x, out


def _cached(tmp_path):
    doc = json.loads(tune.cache_path().read_text())
    assert tune.cache_path().parent == tmp_path / "autotune"
    return doc["entries"][FAKE]["float32"]


def test_an_unknown_key_is_tuned_once_and_cached(first_use, capsys):
    x, out = _call()
    assert torch.equal(out, x)  # the caller's result comes from the heuristic's run
    err = capsys.readouterr().err
    assert f"flame autotune: {FAKE} [5] float32: 4 configs (1 wrong, 0 did not compile or fit)" in err
    [entry] = _cached(first_use)
    assert list(json.loads(tune.cache_path().read_text())["entries"]) == [FAKE]  # only the kernel that ran
    assert entry["key"] == [5] and entry["config"] == {"BLOCK": 32, "num_warps": 4}  # fastest right one
    assert entry["ms"] == 1.0 and entry["default_ms"] == 3.0
    ASKED.clear()
    x, out = _call()
    assert torch.equal(out, x) and ASKED == [{"BLOCK": 32, "num_warps": 4}]
    assert capsys.readouterr().err == ""  # known now: no second tuning
    tune.reset()  # a later process reads the cache table
    ASKED.clear()
    _call()
    assert ASKED == [{"BLOCK": 32, "num_warps": 4}] and capsys.readouterr().err == ""
    _call(n=6)  # another shape is another key
    assert "[6] float32" in capsys.readouterr().err and len(_cached(first_use)) == 2


def test_nothing_is_tuned_or_read_without_the_switch(first_use, monkeypatch):
    _call()
    assert tune.cache_path().is_file()
    monkeypatch.delenv("FLAME_AUTOTUNE")
    tune.reset()
    ASKED.clear()
    _call(n=7)
    _call()
    assert ASKED == [DEFAULT, DEFAULT]  # the cache table is not read, nothing new is tuned
    assert "[7]" not in tune.cache_path().read_text()


def test_no_tuning_during_graph_capture(first_use, monkeypatch, capsys):
    monkeypatch.setattr(autotune, "_capturing", lambda: True)
    x, out = _call()
    assert torch.equal(out, x) and not tune.cache_path().exists()
    monkeypatch.setattr(autotune, "_capturing", lambda: False)
    _call()  # the key is still unknown: the next eager call tunes it
    assert _cached(first_use)[0]["config"] == {"BLOCK": 32, "num_warps": 4}


def test_a_corrupt_cache_table_is_replaced_with_a_warning(first_use):
    path = tune.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, out = _call()
    assert torch.equal(out, x)
    assert any(issubclass(w.category, tune.TuningTableWarning) and "unreadable" in str(w.message) for w in caught)
    assert _cached(first_use)[0]["key"] == [5]


def test_remember_rejects_configs_that_are_not_the_kernels(first_use):
    with pytest.raises(ValueError, match="config fields"):
        tune.remember(FAKE, (5,), "float32", {"BLOCK": 16}, 1.0, 2.0)


def test_a_real_gemm_is_tuned_on_first_use(first_use, monkeypatch, capsys):
    quick = autotune.Space(torch.float32, quick=True)
    monkeypatch.setattr(autotune, "search_stages", lambda space, kernel, key: SEARCH(quick, kernel, key))
    monkeypatch.setattr(autotune, "_time_ms", TIME_MS)  # real (host) timings of the interpreter
    x = torch.randn(24, 16, device=flame.device)
    w = torch.randn(40, 16, device=flame.device)
    tol = 1e-4 if flame.is_interpreter() else 3e-2  # fp32 GEMMs run tf32 products on the GPU
    y = F.linear(flame.from_torch(x), flame.from_torch(w))
    torch.testing.assert_close(y.to_torch(), x @ w.t(), rtol=tol, atol=tol)
    assert "flame autotune: matmul [24, 40, 16, 1] float32" in capsys.readouterr().err
    doc = json.loads(tune.cache_path().read_text())
    assert [e["key"] for e in doc["entries"]["matmul"]["float32"]] == [[24, 40, 16, 1]]
    y = F.linear(flame.from_torch(x), flame.from_torch(w))  # now with the tuned config
    torch.testing.assert_close(y.to_torch(), x @ w.t(), rtol=tol, atol=tol)
    assert capsys.readouterr().err == ""


def test_candidates_never_write_the_callers_outputs_passed_by_keyword(first_use):
    x = torch.arange(5, dtype=torch.float32, device=flame.device)
    out = torch.empty_like(x)
    fake_entry(out=out, x=x)  # the wrong candidate writes 7s: into its own fresh buffer only
    assert torch.equal(out, x)
    assert _cached(first_use)[0]["config"] == {"BLOCK": 32, "num_warps": 4}


def test_gpu_candidates_are_timed_as_graph_replays(monkeypatch):
    """On the GPU a candidate's time is that of its CUDA-graph replays (device time, as
    scripts/autotune.py and bench.py measure it); a call that cannot be captured falls back to
    CUDA events around each call."""
    import triton.testing

    monkeypatch.setattr(flame.runtime, "INTERPRETER", False)
    asked = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, rep, return_mode: asked.append((rep, return_mode)) or 0.004)
    assert TIME_MS(lambda: None, 7) == 0.004 and asked == [(7, "median")]

    def not_capturable(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 0.5

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", not_capturable)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    runs = []
    assert TIME_MS(lambda: runs.append(1), 3) == 0.5 and len(runs) == 4  # a warm-up call, then 3 timed
