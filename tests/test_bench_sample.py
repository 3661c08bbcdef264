"""scripts/bench_sample.py's driver: with ``--rounds`` each part's sides run in alternating order and
each number is the median of its rounds (the side processes are stubbed: no model is built); the step
part run for real on the tiny pipeline."""
import importlib.util
import json
from pathlib import Path

import pytest

import flame

ROOT = Path(__file__).resolve().parents[1]


def _load(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its shared helpers (common), as when run as a script
    spec = importlib.util.spec_from_file_location("bench_sample", ROOT / "scripts" / "bench_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_alternate_the_sides_and_report_medians(monkeypatch, tmp_path, capsys):
    bench = _load(monkeypatch)
    calls, times = [], {0: [3.0, 1.0, 2.0], 2: [2.0, 2.0, 5.0]}  # side index -> its rounds' seconds

    def run_side(args, part, index):
        calls.append(index)
        if index == 1:
            return {"error": "no GPU"}
        return {"s": times[index][calls.count(index) - 1], "peak_gib": 1.0}

    monkeypatch.setattr(bench, "_run_side", run_side)
    out = tmp_path / "r.json"
    assert bench.main(["--only", "pipeline", "--rounds", "3", "--model", str(tmp_path), "--out", str(out),
                       "--skip", "torch.compile"]) == 0
    assert calls == [0, 1, 2, 2, 1, 0, 0, 1, 2]  # every other round reversed; --skip leaves a side out
    results = json.loads(out.read_text())
    assert results["pipeline/flame (CUDA graph)"] == {"s": 2.0, "peak_gib": 1.0, "rounds": [3.0, 1.0, 2.0]}
    assert results["pipeline/diffusers"]["s"] == 2.0
    assert results["pipeline/flame (eager)"] == {"error": "no GPU"}
    assert "pipeline/diffusers (torch.compile)" not in results
    printed = capsys.readouterr().out
    assert "round 3:" in printed and "medians of 3 rounds:" in printed
    assert "pipeline/flame (CUDA graph) / pipeline/diffusers (s): 1.000" in printed


@pytest.mark.slow
def test_step_part_runs_the_tiny_unet(monkeypatch, tmp_path, capsys):
    """``--only step`` end to end on the tests' tiny pipeline: every side but the compiled one
    (``--skip``; it compiles for a while), in ms per step; on the CPU the CUDA-graph sides run eagerly
    and say so."""
    bench = _load(monkeypatch)
    out = tmp_path / "step.json"
    assert bench.main(["--only", "step", "--config", "tiny", "--size", "64", "--repeat", "1", "--step-calls", "1",
                       "--skip", "torch.compile", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    sides = ["flame (CUDA graph)", "flame (eager)", "diffusers (CUDA graph)", "diffusers (eager)"]
    assert sorted(results) == sorted([f"step/{s}" for s in sides] + ["vae sizes"])
    for side in sides:
        got = results[f"step/{side}"]
        assert {"ms", "first_s", "peak_gib"} <= set(got) and got["ms"] > 0, (side, got)
        assert ("note" in got) == ("CUDA graph" in side and flame.is_interpreter()), (side, got)
    assert "step/flame (CUDA graph) / step/diffusers (eager) (ms):" in capsys.readouterr().out
