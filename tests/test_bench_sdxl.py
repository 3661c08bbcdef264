"""scripts/bench_sdxl.py's driver: settings run in alternating rounds, each setting's steps pooled
(the workers are stubbed: no model is built)."""
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_sdxl", ROOT / "scripts" / "bench_sdxl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_settings", lambda args: iter([("flame", 1, "off", "off", "default", "off"),
                                                                ("diffusers", 1, "off", None, "default", "off")]))
    return module


def _stub_workers(monkeypatch, bench, times, fail=()):
    """Worker processes answering with the next of ``times[framework]`` (step times), in call order."""
    calls = []

    def run(cmd, **kw):
        fw = cmd[cmd.index("--worker") + 1]
        calls.append(fw)
        if (fw, calls.count(fw)) in fail:
            return subprocess.CompletedProcess(cmd, 1, "", "out of memory")
        steps = times[fw][calls.count(fw) - 1]
        res = {"framework": fw, "times_s": steps, "peak_bytes": 2**30 * calls.count(fw), "device": "cpu"}
        return subprocess.CompletedProcess(cmd, 0, "noise\nRESULT " + json.dumps(res) + "\n", "")
    monkeypatch.setattr(bench.subprocess, "run", run)
    return calls


def test_rounds_alternate_and_pool_each_settings_steps(bench, monkeypatch, tmp_path, capsys):
    calls = _stub_workers(monkeypatch, bench, {"flame": [[1.0, 3.0], [2.0, 4.0], [9.0, 9.0]],
                                               "diffusers": [[2.0, 2.0], [2.0, 6.0], [4.0, 4.0]]})
    out = tmp_path / "r.json"
    assert bench.main(["--rounds", "3", "--out", str(out)]) == 0
    assert calls == ["flame", "diffusers"] * 3
    flame, torch_row = json.loads(out.read_text())
    assert flame["times_s"] == [1.0, 3.0, 2.0, 4.0, 9.0, 9.0] and flame["median_s"] == 3.5
    assert flame["round_medians_s"] == [2.0, 3.0, 9.0] and flame["peak_bytes"] == 3 * 2**30
    assert torch_row["median_s"] == 3.0 and torch_row["round_medians_s"] == [2.0, 4.0, 4.0]
    text = capsys.readouterr().out
    assert "(round 2 of 3)" in text and "the medians of its rounds 2000.0 / 3000.0 / 9000.0 ms" in text
    assert "1.17x" in text  # flame's pooled median against diffusers': 3.5 / 3.0


def test_a_failed_round_fails_its_setting(bench, monkeypatch, tmp_path):
    _stub_workers(monkeypatch, bench, {"flame": [[1.0], [1.0]], "diffusers": [[2.0], [2.0]]}, fail={("diffusers", 2)})
    out = tmp_path / "r.json"
    assert bench.main(["--rounds", "2", "--out", str(out)]) == 1
    flame, torch_row = json.loads(out.read_text())
    assert flame["median_s"] == 1.0 and torch_row == {"setting": "diffusers batch 1 ckpt off", "error": "out of memory"}


def test_rounds_must_be_positive(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_the_portable_setting_turns_off_every_hopper_path_flame_reads(bench):
    """Every environment switch of a TMA or Gluon path that flame reads is off in the portable
    setting's environment (a switch added later and missed here would let Hopper's kernels run in
    a row that stands for an Ampere or Ada card), and the shared memory is an Ada card's."""
    import re
    switches = {m for path in (ROOT / "flame").rglob("*.py")
                for m in re.findall(r'os\.environ\.get\("(FLAME_\w*(?:TMA|GLUON)\w*)"', path.read_text())}
    assert {"FLAME_MATMUL_TMA", "FLAME_MATMUL_GLUON", "FLAME_ATTN_TMA", "FLAME_ATTN_GLUON"} <= switches
    env = bench._portable_env("/tmp/none")
    implied = {"FLAME_ATTN_GLUON_BWD"}  # attention's Gluon backward runs only where its forward does
    assert all(env.get(s) == "0" for s in switches - implied), {s: env.get(s) for s in switches}
    assert env["FLAME_TEST_MAX_SHARED_MEMORY"] == "101376" and env["FLAME_TUNE_DIR"] == "/tmp/none"
