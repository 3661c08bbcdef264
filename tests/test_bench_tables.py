"""scripts/bench_tables.py: bench.py runs stored per card, BENCHMARKS.md's tables written from them
(on a run made up here: no GPU, no kernels)."""
import importlib.util
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "scripts" / "bench_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(family, case, flame, torch, **extra):
    """A bench.py --timer both result row: eager times, graph replays beside them."""
    g = dict(flame=flame, torch=torch, ratio=flame / torch, flame_runs=[flame], torch_runs=[torch])
    return dict(family=family, case=case, note="", unit="ms", timer="eager", flame=2 * flame, torch=2 * torch,
                ratio=flame / torch, graph=g, **extra)


def _run(gpu="NVIDIA H200", date="2026-12-01T10:00:00+00:00", commit="abc1234", scale=1.0, families=None):
    results = [
        _row("matmul", "fwd 64x32->16 +bias", 0.010 * scale, 0.008, tuned_speedup=1.10, flame_defaults=0.011),
        _row("matmul", "fwd+bwd 64x32->16 +bias", 0.030 * scale, 0.032, tuned_same_configs=True),
        _row("matmul", "fwd 8x8->8 +bias", 0.005, 0.004, tuned_speedup=0.90),  # no fwd+bwd twin
        _row("conv2d", "fwd 3x3 1x4x8x8->16 vs torch NCHW", 0.020, 0.040),
        _row("conv2d", "fwd 3x3 1x4x8x8->16 vs torch CL", 0.020, 0.010),
        _row("conv2d", "fwd+bwd 3x3 1x4x8x8->16 vs torch NCHW", 0.060, 0.050),
        _row("conv2d", "fwd+bwd 3x3 1x4x8x8->16 vs torch CL", 0.060, 0.030),
        dict(family="conv2d", case="fwd 1x1 1x4x8x8->16 vs torch NCHW", note="", error="flame and torch disagree"),
    ]
    targets = [dict(family="matmul", target="forward at most 1.1x", timer=t, stat="max", value=v, bound=1.1,
                    cases=2, met=v <= 1.1) for t, v in (("eager", 1.5), ("graph", 1.25))]
    families = families or ["matmul", "conv2d"]
    return dict(gpu=gpu, device=gpu, backend="cuda", date=date, torch="2.11.0+cu130", triton="3.6.0", flame="0.1.0",
                python="3.11", command=f"scripts/bench.py --family {','.join(families)} --tuning compare",
                commit=commit, dirty=False, dtype="bfloat16", quick=False, tuning="compare", baseline_table=None,
                timer="both", families=families, results=[r for r in results if r["family"] in families],
                targets=[t for t in targets if t["family"] in families])


DOC = """# Benchmarks

Prose that stays.

## Linear

<!-- bench-table matmul -->
stale
<!-- /bench-table -->

Narrow outputs lose to cuBLAS (prose after the table stays).

## Conv

<!-- bench-table conv2d -->
<!-- /bench-table -->

## Attention

<!-- bench-table attention -->
<!-- /bench-table -->

## Tuning

<!-- bench-table tuning -->
<!-- /bench-table -->
"""


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_add_stores_the_shown_timer_per_card_and_family(bt, tmp_path):
    store = tmp_path / "benchmarks"
    (written,) = bt.add([_write(tmp_path, "a.json", _run(commit=None))], store, commit="feed123")
    assert written == store / "nvidia-h200.json"
    doc = json.loads(written.read_text())
    assert doc["format"] == bt.FORMAT and doc["card"] == "NVIDIA H200"
    assert [r["family"] for r in doc["runs"]] == ["matmul", "conv2d"]  # bench.py's order
    lin = doc["runs"][0]
    assert (lin["dtype"], lin["timer"], lin["commit"]) == ("bf16", "graph", "feed123")
    assert lin["date"] == "2026-12-01T10:00:00+00:00"
    first = lin["cases"][0]
    assert (first["flame"], first["torch"], first["timer"]) == (0.010, 0.008, "graph")  # the replays, not eager
    assert first["eager"]["flame"] == 0.020 and first["tuned_speedup"] == 1.10
    assert lin["cases"][1]["tuned_same_configs"] is True
    assert [t["timer"] for t in lin["targets"]] == ["graph"]
    assert doc["runs"][1]["cases"][-1]["error"]


def test_add_replaces_a_family_and_keeps_the_others(bt, tmp_path):
    store = tmp_path / "benchmarks"
    bt.add([_write(tmp_path, "a.json", _run())], store)
    bt.add([_write(tmp_path, "b.json", _run(date="2026-12-02T00:00:00+00:00", scale=2.0, families=["matmul"]))],
           store)
    bt.add([_write(tmp_path, "c.json", _run(gpu="NVIDIA H100 80GB HBM3"))], store)
    h200 = json.loads((store / "nvidia-h200.json").read_text())
    assert [(r["family"], r["date"][:10]) for r in h200["runs"]] == [("matmul", "2026-12-02"), ("conv2d", "2026-12-01")]
    assert h200["runs"][0]["cases"][0]["flame"] == pytest.approx(0.020)
    assert sorted(p.name for p in store.iterdir()) == ["nvidia-h100-80gb-hbm3.json", "nvidia-h200.json"]


def test_add_refuses_interpreter_and_quick_runs(bt, tmp_path):
    with pytest.raises(SystemExit, match="not a GPU run"):
        bt.add([_write(tmp_path, "i.json", {**_run(), "backend": "interpreter", "gpu": None})], tmp_path)
    with pytest.raises(SystemExit, match="quick"):
        bt.add([_write(tmp_path, "q.json", {**_run(), "quick": True})], tmp_path)


def test_write_fills_the_blocks_and_keeps_the_prose(bt, tmp_path):
    store, doc = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    doc.write_text(DOC)
    bt.add([_write(tmp_path, "a.json", _run()), _write(tmp_path, "c.json", _run(gpu="NVIDIA H100 80GB HBM3"))], store)
    assert bt.main(["check", "--store", str(store), "--doc", str(doc)]) == 1  # stale
    assert bt.main(["write", "--store", str(store), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert bt.main(["check", "--store", str(store), "--doc", str(doc)]) == 0
    assert "Prose that stays." in text and "prose after the table stays" in text and "stale" not in text
    linear = text.split("<!-- bench-table matmul -->\n")[1].split("<!-- /bench-table -->")[0]
    # a line per run (here both cards' runs, alike but for the card): command, date, commit, versions, then the
    # targets of the shown timer
    assert "\nNVIDIA H100 80GB HBM3 (abc1234), NVIDIA H200 (abc1234): `scripts/bench.py --family matmul,conv2d " \
           "--tuning compare`, 2026-12-01, torch 2.11.0+cu130, Triton 3.6.0, bf16, graph replays, tuned tables. " \
           "Targets (graph): forward at most 1.1x: 1.250x max **missed**.\n" in linear
    # fwd / fwd+bwd of one shape side by side, one column group per card (graph replays, µs)
    assert "| case | H100 forward | H100 forward+backward | H200 forward | H200 forward+backward |" in linear
    assert "| 64x32->16 +bias | 10.0 / 8.0 (1.25x) | 30.0 / 32.0 (0.94x) | 10.0 / 8.0 (1.25x) |" in linear
    assert "| 8x8->8 +bias | 5.0 / 4.0 (1.25x) | - | 5.0 / 4.0 (1.25x) | - |" in linear
    conv = text.split("<!-- bench-table conv2d -->\n")[1].split("<!-- /bench-table -->")[0]
    assert "H200 forward vs NCHW | H200 forward vs CL | H200 forward+backward vs NCHW" in conv
    assert "| 3x3 1x4x8x8->16 | 20.0 / 40.0 (0.50x) | 20.0 / 10.0 (2.00x) |" in conv
    assert "| 1x1 1x4x8x8->16 | check failed | - | - | - | check failed |" in conv
    # runs without targets that differ only in card and commit share a line
    assert "\nNVIDIA H100 80GB HBM3 (abc1234), NVIDIA H200 (abc1234): `scripts/bench.py" in conv
    assert "No stored run yet" in text.split("<!-- bench-table attention -->")[1].split("<!-- /bench-table -->")[0]
    tuning = text.split("<!-- bench-table tuning -->\n")[1].split("<!-- /bench-table -->")[0]
    # two timed cases (1.10x and 0.90x), one the same either way
    assert "| NVIDIA H200 (2026-12-01) | 2 (1 launch the heuristic's configs either way) | 0.995x | 0.900x " \
           "(matmul: fwd 8x8->8 +bias) | 1 | matmul 0.995x (2) |" in tuning


def test_the_repository_tables_are_current(bt):
    assert bt.main(["check"]) == 0, "BENCHMARKS.md is stale: run python3 scripts/bench_tables.py write"
    # two model families, softmax's table, full fine-tuning on one and two GPUs: current numbers only
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) < 410


def test_compare_gives_flames_change_and_torchs_drift_per_family(bt, tmp_path):
    before = _run(families=["matmul", "conv2d"])
    before["results"][0]["family"] = "linear"  # bench.py's older family name matches its new one
    before["families"] = ["linear", "matmul", "conv2d"]
    after = _run(scale=1.1, families=["matmul", "conv2d"])
    out = io.StringIO()
    summary = bt.compare(_write(tmp_path, "b.json", before), _write(tmp_path, "a.json", after), out=out)
    text = out.getvalue()
    assert summary["conv2d"] == pytest.approx((1.0, 1.0))
    geo, worst = summary["matmul"]  # two of three cases 1.1x slower
    assert worst == pytest.approx(1.1) and geo == pytest.approx(1.1 ** (2 / 3))
    assert "fwd 64x32->16 +bias" in text and "1.100" in text and "(1.000)" in text
    with pytest.raises(ValueError, match="different cards"):
        bt.compare(_write(tmp_path, "b.json", before), _write(tmp_path, "h.json", _run(gpu="NVIDIA H100")))


def test_a_tree_exported_inside_a_checkout_names_no_commit(tmp_path):
    """A run records the commit of the tree it runs from (common.git_commit): a checkout names its own;
    a tree exported inside another checkout (a snapshot sent to a GPU machine) names none, where git
    would have answered with the outer checkout's commit; ``bench_tables.py add --commit`` supplies it."""
    import shutil
    import subprocess
    import sys
    if shutil.which("git") is None:
        pytest.skip("needs git")
    sys.path.insert(0, str(ROOT / "scripts"))
    common = importlib.import_module("common")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("a\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert common.git_commit(tmp_path) == (head, False)
    (tmp_path / "a.txt").write_text("b\n")
    assert common.git_commit(tmp_path) == (head, True)
    (tmp_path / ".snap").mkdir()
    assert common.git_commit(tmp_path / ".snap") == (None, False)
