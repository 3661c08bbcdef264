"""Repository-level checks: the README's commands, the scripts, and the rule that flame/ calls no
PyTorch compute."""
import ast
import contextlib
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import flame

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, timeout=600, env=None, **kw):
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def _readme_commands():
    """Command lines of the README's first fenced block, without their trailing comments."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
    assert block, "README.md has no fenced code block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


# ---- README -------------------------------------------------------------------------------------

def test_readme_starts_with_main_job_and_tests():
    text = (ROOT / "README.md").read_text()
    # The two commands come before any prose section.
    assert text.index("```") < text.index("\n## "), "the commands must be at the very top of README.md"
    cmds = _readme_commands()
    assert len(cmds) >= 2, cmds
    main_job, tests = cmds[0].split(), cmds[1].split()
    assert main_job[0] in ("python", "python3"), cmds[0]
    assert (ROOT / main_job[1]).is_file(), f"README's first command runs {main_job[1]}, which does not exist"
    assert tests[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]), cmds[1]


def test_ci_runs_the_readme_test_command():
    test_cmd = _readme_commands()[1]
    args = test_cmd.split()[1:]  # "-m pytest ..." as .ci/run writes it after "$PY"
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"$PY" ' + " ".join(args) in ci, f".ci/run does not run the README's test command {test_cmd!r}"


# ---- scripts ------------------------------------------------------------------------------------

def test_train_mlp_loss_goes_down():
    r = _run(["scripts/train_mlp.py", "--steps", "3"])
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(m) for m in re.findall(r"^step\s+\d+\s+loss\s+(\S+)$", r.stdout, re.M)]
    assert len(losses) == 3, r.stdout
    assert all(b < a for a, b in itertools.pairwise(losses)), f"loss did not decrease every step: {losses}"
    first, final = map(float, re.search(r"loss (\S+) -> (\S+) ", r.stdout).groups())
    assert final < first, r.stdout


def test_train_mlp_rejects_bad_flags():
    r = _run(["scripts/train_mlp.py", "--steps", "0"], timeout=120)
    assert r.returncode == 2 and "--steps" in r.stderr, r.stderr


def test_bench_quick_elementwise_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = _run(["scripts/bench.py", "--quick", "--family", "elementwise", "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    for key in ("gpu", "device", "date", "torch", "triton", "command", "dtype", "results"):
        assert key in doc, f"bench JSON lacks {key!r}"
    assert "--family elementwise" in doc["command"]
    names = [row["case"].split()[0] for row in doc["results"]]
    assert names == ["add", "mul", "gelu", "sum(-1)", "t().contiguous()"], names
    for row in doc["results"]:
        assert "error" not in row, row
        assert row["family"] == "elementwise" and row["unit"] == "ms"
        assert row["flame"] > 0 and row["torch"] > 0 and row["bytes"] > 0
        assert row["ratio"] == pytest.approx(row["flame"] / row["torch"])
        assert row["flame_gbps"] == pytest.approx(row["bytes"] / row["flame"] / 1e6)
    assert "flame/torch" in r.stdout and "add " in r.stdout  # the table


def test_bench_tuning_compare_times_the_heuristic_defaults_too(tmp_path):
    out = tmp_path / "bench.json"
    no_tables = tmp_path / "tables"
    no_tables.mkdir()
    r = _run(["scripts/bench.py", "--quick", "--family", "overhead,elementwise", "--tuning", "compare",
              "--repeat", "2", "--out", str(out)], env={"FLAME_TUNE_DIR": str(no_tables)})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["tuning"] == "compare"
    device_rows = [row for row in doc["results"] if row["unit"] == "ms"]
    # no table (an empty FLAME_TUNE_DIR, on the GPU too): every case launches the heuristic's configs either way
    assert device_rows and all(row.get("tuned_same_configs") for row in device_rows)
    assert all("flame_defaults" not in row for row in device_rows)
    assert "0 cases more than 5% slower" in r.stdout and f"({len(device_rows)} launch the heuristic" in r.stdout


def test_bench_compare_times_both_sides_when_the_table_changes_a_config(monkeypatch):
    bench = _load_bench(monkeypatch)
    calls = []
    monkeypatch.setattr(bench, "_table_changes", lambda case, ctx: True)
    in_defaults = []
    real_defaults = bench.tune.heuristics_only

    def spying_defaults():
        in_defaults.append(True)
        return real_defaults()

    monkeypatch.setattr(bench.tune, "heuristics_only", spying_defaults)
    monkeypatch.setattr(bench, "time_device", lambda fn, ctx: calls.append(len(in_defaults)) or 2.0 + len(in_defaults))
    case = bench.Case("c", lambda: None, lambda: None, check=False)
    ctx = bench.Ctx(dtype=torch.float32, quick=True, warmup=1, rep=1, repeat=3, tuning="compare", timer="eager")
    row = bench.run_case("f", case, ctx)
    assert len(row["flame_defaults_runs"]) == len(row["flame_tuned_runs"]) == 3
    assert row["tuned_speedup"] == pytest.approx(row["flame_defaults"] / row["flame_tuned"])
    if bench.flame.is_interpreter():
        # flame and torch three times, then tuned and heuristic flame alternately (the latter inside
        # heuristics_only)
        assert row["tuned_timer"] == "eager" and len(in_defaults) == 3
        assert calls == [0] * 6 + [0, 1, 1, 2, 2, 3]
    else:  # graphs of both sides, the heuristic's captured inside heuristics_only, replayed alternately
        assert row["tuned_timer"] == "graph" and len(in_defaults) == 1
        assert calls == [0] * 6 + [1] * 6


def test_bench_compare_against_a_baseline_table(tmp_path, monkeypatch):
    # --baseline-table: the other side runs inside tune.table_from(that file), never the heuristics
    bench = _load_bench(monkeypatch)
    monkeypatch.setattr(bench, "_table_changes", lambda case, ctx: True)
    opened = []
    monkeypatch.setattr(bench.tune, "table_from", lambda path: opened.append(path) or contextlib.nullcontext())
    monkeypatch.setattr(bench.tune, "heuristics_only", lambda: pytest.fail("timed the heuristics"))
    monkeypatch.setattr(bench, "time_device", lambda fn, ctx: 2.0)
    case = bench.Case("c", lambda: None, lambda: None, check=False)
    ctx = bench.Ctx(dtype=torch.float32, quick=True, warmup=1, rep=1, repeat=2, tuning="compare", timer="eager",
                    baseline=str(tmp_path / "old.json"))
    row = bench.run_case("f", case, ctx)
    assert row["tuned_speedup"] == 1.0 and opened and set(opened) == {str(tmp_path / "old.json")}
    (tmp_path / "old.json").write_text("{}")
    for argv, match in ((["--baseline-table", str(tmp_path / "old.json")], "needs --tuning compare"),
                        (["--tuning", "compare", "--baseline-table", str(tmp_path / "nope.json")], "no file")):
        r = _run(["scripts/bench.py", "--quick", "--family", "elementwise", *argv], timeout=120)
        assert r.returncode == 2 and match in r.stderr, r.stderr


def test_bench_case_filter_and_kernel_profile(tmp_path, monkeypatch, capsys):
    # --case keeps the cases whose names contain one of the texts
    out = tmp_path / "bench.json"
    r = _run(["scripts/bench.py", "--quick", "--family", "elementwise", "--case", "add", "--case", "gelu",
              "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert [row["case"].split()[0] for row in json.loads(out.read_text())["results"]] == ["add", "gelu"]
    bench = _load_bench(monkeypatch)  # a filtered full-size run checks no target on its subset of cases
    one_case = bench.Case("a", lambda: 1, lambda: 1, check=False)
    monkeypatch.setattr(bench, "FAMILIES", {"f": (lambda ctx: [one_case], "")})
    monkeypatch.setattr(bench, "run_case", lambda fam, case, ctx: dict(family=fam, case=case.name, unit="ms",
                                                                       flame=1.0, torch=1.0, ratio=1.0))
    monkeypatch.setattr(bench, "check_targets", lambda rows, fams: pytest.fail("targets checked on a subset"))
    assert bench.main(["--family", "f", "--case", "a", "--out", str(tmp_path / "sub.json")]) == 0
    assert json.loads((tmp_path / "sub.json").read_text())["targets"] == []
    # --kernels: a profile's CUDA events per kernel name, per call, most time first (CPU events ignored)
    bench = _load_bench(monkeypatch)
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    class Event:
        def __init__(self, name, device_type, device_time):
            self.name, self.device_type, self.device_time = name, device_type, device_time

    events = [Event("gemm", cuda, 30.0), Event("sum", cuda, 2.0), Event("gemm", cuda, 34.0),
              Event("sum", cuda, 4.0), Event("launch", cpu, 99.0)]
    assert bench.per_call_kernels(events, calls=2) == [["gemm", 1.0, 32.0], ["sum", 1.0, 3.0]]
    # a device case of a run with --kernels carries both sides' kernels (timing and profiling faked)
    monkeypatch.setattr(bench, "time_device", lambda fn, ctx: 1.0)
    monkeypatch.setattr(bench, "kernel_times", lambda fn: [["k", 1.0, fn()]])
    ctx = bench.Ctx(dtype=torch.float32, quick=True, warmup=1, rep=1, timer="eager", kernels=True,
                    interpreter=False)
    row = bench.run_case("f", bench.Case("c", lambda: 5.0, lambda: 7.0, check=False), ctx)
    assert row["kernels"] == dict(flame=[["k", 1.0, 5.0]], torch=[["k", 1.0, 7.0]])
    bench.print_kernels([row])
    assert "flame: 5.0 us per call in 1 launches" in capsys.readouterr().out


def _load_bench(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("flame_bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_heuristics_only_hides_every_table_and_restores_them(tmp_path, monkeypatch):
    import json as _json

    from flame import tune

    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    default = dict(cfg, BLOCK_M=128)
    table = dict(format=tune.FORMAT, gpu="NVIDIA H200", triton=__import__("triton").__version__, entries={
        "matmul": {"bfloat16": [dict(key=[64, 64, 64, 1], config=cfg, ms=1.0, default_ms=2.0)]}})
    (tmp_path / "nvidia-h200.json").write_text(_json.dumps(table))
    monkeypatch.setenv("FLAME_TUNE_DIR", str(tmp_path))
    tune.reset()
    try:
        def ask():
            return tune.config("matmul", (64, 64, 64, 1), "bfloat16", default, device_name="NVIDIA H200")

        assert ask() == cfg
        with tune.heuristics_only():
            assert ask() == default
            with tune.override("matmul", cfg):  # overrides still apply
                assert ask() == cfg
        assert ask() == cfg
    finally:
        tune.reset()


def test_table_from_stands_in_for_the_gpus_table(tmp_path, monkeypatch):
    import json as _json

    from flame import tune

    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    older = dict(cfg, BLOCK_K=64)
    default = dict(cfg, BLOCK_M=128)

    def write(path, rows):
        path.write_text(_json.dumps(dict(format=tune.FORMAT, gpu="NVIDIA H200", triton=__import__("triton").__version__,
                                         entries={"matmul": {"bfloat16": rows}})))
        return path

    write(tmp_path / "nvidia-h200.json", [dict(key=[64, 64, 64, 1], config=cfg, ms=1.0, default_ms=2.0),
                                          dict(key=[4096, 64, 64, 1], config=cfg, ms=1.0, default_ms=2.0)])
    old = write(tmp_path / "old.json", [dict(key=[64, 64, 64, 1], config=older, ms=1.0, default_ms=2.0)])
    monkeypatch.setenv("FLAME_TUNE_DIR", str(tmp_path))
    tune.reset()
    try:
        def ask(key=(64, 64, 64, 1)):
            return tune.config("matmul", key, "bfloat16", default, device_name="NVIDIA H200")

        assert ask() == cfg
        with tune.table_from(old, device_name="NVIDIA H200"):
            assert ask() == older
            assert ask((4096, 64, 64, 1)) == default  # not in the old table: its heuristic, not the GPU's table
            with tune.override("matmul", cfg):  # overrides still apply
                assert ask() == cfg
        assert ask() == cfg and ask((4096, 64, 64, 1)) == cfg
        with pytest.raises(FileNotFoundError, match="no table file"):
            tune.table_from(tmp_path / "missing.json", device_name="NVIDIA H200")
    finally:
        tune.reset()


def test_bench_rejects_unknown_family():
    r = _run(["scripts/bench.py", "--quick", "--family", "elementwise,nope"], timeout=120)
    assert r.returncode == 2 and "unknown family nope" in r.stderr, r.stderr


# ---- no PyTorch compute in flame/ ---------------------------------------------------------------
# The scanner's logic from ../shared/tools/torch_usage.py, copied so the test does not depend on
# where shared/ lies. It reads the source with `ast` and reports every `torch.<name>` reference
# outside the allow-list (allocation, views, dtype/device objects, host transfers, torch.cuda and
# torch.distributed). It cannot see methods called on tensor objects: a tripwire, not a proof.

ALLOWED_TOP = {
    "empty", "empty_strided", "empty_like", "from_numpy", "is_tensor", "Tensor", "Size", "dtype",
    "device", "finfo", "iinfo", "float16", "bfloat16", "float32", "float64", "half", "float",
    "int8", "int16", "int32", "int64", "uint8", "bool", "long", "int", "cuda", "distributed",
    "utils", "version", "__version__", "float8_e4m3fn", "float8_e5m2", "Stream", "Event",
}
ALLOWED_MODULES = ("torch.cuda", "torch.distributed", "torch.utils.dlpack")


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def scan_torch_usage(root):
    found = []
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as e:
            found.append(f"{path}:{e.lineno}: cannot parse: {e.msg}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                if not node.module.startswith(ALLOWED_MODULES) and node.module != "torch":
                    found.append(f"{path}:{node.lineno}: from {node.module} import ...")
                elif node.module == "torch":
                    bad = [a.name for a in node.names if a.name not in ALLOWED_TOP]
                    if bad:
                        found.append(f"{path}:{node.lineno}: from torch import {', '.join(bad)}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("torch.") and not a.name.startswith(ALLOWED_MODULES):
                        found.append(f"{path}:{node.lineno}: import {a.name}")
            elif isinstance(node, ast.Attribute):
                name = _dotted(node)
                if (name and name.startswith("torch.") and name.count(".") == 1
                        and name.split(".")[1] not in ALLOWED_TOP):
                    found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_flame_calls_no_torch_compute():
    hits = scan_torch_usage(ROOT / "flame")
    assert not hits, "PyTorch compute in flame/ (only allocation, views, dtypes/devices, host transfers " \
                     "and torch.cuda/torch.distributed are allowed):\n" + "\n".join(hits)


def test_torch_usage_scanner_catches_compute(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom torch import matmul, empty\n"
        "def f(x):\n    return torch.exp(x) + torch.empty(3).sum()\n")
    (tmp_path / "good.py").write_text(
        "import torch\nfrom torch.cuda import Stream\n"
        "def g(n):\n    return torch.empty(n, dtype=torch.float32, device=torch.device('cpu'))\n")
    hits = scan_torch_usage(tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == ["import torch.nn.functional", "from torch import matmul",
                                                   "torch.exp"], hits


@pytest.mark.skipif(not (ROOT.parent / "shared" / "tools" / "torch_usage.py").is_file(),
                    reason="../shared/tools/torch_usage.py not beside the repo")
def test_scanner_copy_matches_shared_tool():
    """The copy above agrees with the shared tool it was taken from, when that tool is present."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_usage", ROOT.parent / "shared" / "tools" / "torch_usage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.ALLOWED_TOP == ALLOWED_TOP and mod.ALLOWED_MODULES == ALLOWED_MODULES
    assert mod.scan(ROOT / "flame") == scan_torch_usage(ROOT / "flame")


def test_flame_imported_before_triton_selects_backend():
    # conftest imports flame first; on a machine without CUDA that must have chosen the interpreter.
    if flame.is_interpreter():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert flame.device.type == "cpu"
    else:
        assert flame.device.type == "cuda"


def test_bench_checks_issue_targets_per_timer(monkeypatch):
    bench = _load_bench(monkeypatch)

    def row(case, eager, graph=None):
        r = {"family": "attention", "case": case, "unit": "ms", "timer": "eager", "ratio": eager}
        if graph is not None:
            r["graph"] = {"ratio": graph}
        return r
    rows = [row("fwd B1 H10 Lq4096 Lk4096 D64", 1.05, 0.9), row("fwd B4 H10 Lq4096 Lk4096 D64", 1.2, 1.1),
            row("fwd B2 H16 Lq4096 Lk4096 D128", 1.5, 1.5),  # not an SDXL shape: no target counts it
            row("fwd+bwd B1 H10 Lq4096 Lk4096 D64", 1.1), row("fwd+bwd B1 H20 Lq1024 Lk77 D64", 0.8),
            {"family": "attention", "case": "fwd B1 H20 Lq1024 Lk77 D64", "error": "disagree"}]
    got = {(r["target"].split(" (")[0], r["timer"]): r for r in bench.check_targets(rows, ["attention"])}
    fwd_max = got["forward at most 1.1x on every SDXL shape", "eager"]
    assert fwd_max["value"] == 1.2 and fwd_max["cases"] == 2 and not fwd_max["met"]
    assert got["forward at most 1.1x on every SDXL shape", "graph"]["met"]  # 1.1 <= 1.1
    geo = got["forward+backward at most 1.0x on the geometric mean", "eager"]
    assert geo["value"] == pytest.approx((1.1 * 0.8) ** 0.5) and geo["met"]
    assert ("forward+backward at most 1.0x on the geometric mean", "graph") not in got  # no graph timings
    strict = bench.Target("faster", lambda c: True, "max", 1.0, strict=True)
    monkeypatch.setitem(bench.TARGETS, "attention", (strict,))
    assert not bench.check_targets([row("fwd x", 1.0)], ["attention"])[0]["met"]  # strict: equal is not faster


def test_every_bench_target_selects_cases_of_its_family(monkeypatch):
    # a selector that matches no case name passes silently (check_targets skips it): each target
    # must pick some of its family's full-size cases
    bench = _load_bench(monkeypatch)
    names = {"norms": [f"{k} {op}" for k in ("fwd", "fwd+bwd") for op in (
                 "group_norm 1x320x128x128", "group_norm 1x640x64x64 CL +silu", "layer_norm 4096x640",
                 "rms_norm 4096x640", "cross_entropy 8192x32000")],
             "linear": [f"{k} 4096x640->640 +bias{a}" for k in ("fwd", "fwd+bwd") for a in ("", "+gelu_tanh")],
             "conv": [f"{k} 3x3 1x320x128x128->320 vs torch {f}" for k in ("fwd", "fwd+bwd") for f in ("NCHW", "CL")],
             "attention": [f"{k} B1 H10 Lq4096 Lk4096 D64" for k in ("fwd", "fwd+bwd")]}
    for fam, targets in bench.TARGETS.items():
        for t in targets:
            assert any(t.select(n) for n in names[fam]), (fam, t.text)
