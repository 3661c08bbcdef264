"""Repository-level checks: the README's commands, the scripts, and the rule that flame/ calls no
PyTorch compute (tests/torch_usage.py)."""
import ast
import builtins
import contextlib
import importlib.util
import itertools
import json
import keyword
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch_usage

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

@pytest.mark.extended  # bench.py's tuning compare: the baseline-table test

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


@pytest.mark.extended  # bench.py's other modes: the tests around it
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


# ---- no PyTorch compute in flame/ (the checks live in tests/torch_usage.py) ---------------------

def test_static_check_passes_on_flame():
    hits = torch_usage.scan(ROOT / "flame")
    assert not hits, "PyTorch compute in flame/ (torch_usage.TORCH_API lists what is allowed):\n" + \
        "\n".join(map(str, hits))
    # the aliases are followed in flame's own code: ``import torch.distributed as dist`` there
    refs = torch_usage.references((ROOT / "flame" / "distributed.py").read_text())
    assert ("torch.distributed.all_reduce", "distributed") in {(h.name, h.reason) for h in refs}


def test_static_check_follows_how_a_module_binds_torch():
    source = """\
import torch as th
import torch.nn.functional as F
from torch import cuda as c, empty, matmul as mm
relu = F.relu
def f(x, n):
    a = th.exp(x)
    b = mm(x, x)
    c.synchronize()
    buf = empty(n, dtype=th.float32, device=th.device("cpu")).view(-1).to(th.device("cpu"))
    return relu(a), getattr(th, "tanh")(b), buf, [th.sigmoid(v) for v in x]
def shadowed(th, F):
    return th.exp(1), F.relu(2), (lambda mm: mm(1))(3)
class K:
    mm = None
    def m(self):
        global grab
        grab = th.nn.functional
        return mm(1, 2)
"""
    hits = torch_usage.scan_source(source, "planted.py")
    assert [(h.line, h.name) for h in hits] == [
        (2, "torch.nn.functional"), (3, "torch.matmul"), (4, "torch.nn.functional.relu"), (6, "torch.exp"),
        (7, "torch.matmul"), (10, "torch.nn.functional.relu"), (10, "torch.sigmoid"), (10, "torch.tanh"),
        (17, "torch.nn.functional"), (18, "torch.matmul")], "\n".join(map(str, hits))
    assert hits[0].reason == "compute (not in the allow-list)"
    assert str(hits[1]) == "planted.py:3: torch.matmul: compute (not in the allow-list)"
    # the allowed uses were resolved too, each with its category
    refs = {(h.line, h.name): h.reason for h in torch_usage.references(source)}
    assert refs[3, "torch.cuda"] == refs[8, "torch.cuda.synchronize"] == "CUDA runtime"
    assert refs[3, "torch.empty"] == refs[9, "torch.empty"] == "allocation"
    assert refs[9, "torch.float32"] == refs[9, "torch.device"] == "dtypes/devices"
    # an exception carved out of an allowed module; what cannot be followed is reported as such
    assert [h.reason for h in torch_usage.scan_source("import torch.cuda.amp\n")] == \
        ["compute (an exception listed inside an allowed module)"]
    hits = torch_usage.scan_source("from torch import *\nimport torch\nf = getattr(torch, name)\ng(torch)\n")
    assert [(h.line, h.reason.split(":")[0]) for h in hits] == [
        (1, "a star import"), (3, "an attribute looked up by a computed name cannot be followed"),
        (4, "a torch module used as a value")]


def test_dynamic_check_passes_on_flame(tmp_path):
    with torch_usage.AtenRecorder() as rec:
        out = torch_usage.workload(tmp_path)
    assert out["merged"] and out["unmerged"] and out["loaded"] == ["b", "w", "x"] and out["adamw_state"] == 10
    assert not out["skipped"] and all(math.isfinite(v) for v in out["losses"] + out["bias"])
    seen = {c.category for c in rec.calls}
    assert {"allocation", "views/metadata", "host transfer"} <= seen, seen
    if flame.is_interpreter():  # the interpreter's own argument copies are attributed to Triton
        assert rec.others.get("triton", 0) > 0, rec.others
    found = rec.violations()
    assert not found, "PyTorch compute issued by flame/ (torch_usage.ATEN_OPS lists what is allowed):\n" + \
        "\n".join(map(str, found))


def test_dynamic_check_catches_tensor_methods(tmp_path):
    """Ops from a file under a (fake) flame/ folder are flame's; the same ops issued here are not."""
    (tmp_path / "flame").mkdir()
    planted = tmp_path / "flame" / "planted.py"
    planted.write_text("""\
import numpy as np
import torch
def bad(buf, x):
    s = buf.sum()
    c = x.clone()
    x.mul_(2)
    buf.copy_(x)
    return s, c, x.to(torch.float64)
def good(buf, n):
    e = torch.empty(n, device=buf.device)
    v = buf.view(-1)[1:].unsqueeze(0).t()
    host = torch.from_numpy(np.ones(n, dtype=np.float32))
    dev = host.to(buf.device, copy=True)
    return e, v, host.to("cpu"), dev, buf.reshape(-1)[0].item()
""")
    spec = importlib.util.spec_from_file_location("flame_planted", planted)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buf, x = torch.ones(4, device=flame.device), torch.ones(4, device=flame.device)
    with torch_usage.AtenRecorder(roots=[tmp_path / "flame"]) as rec:
        mod.good(buf, 4)
        assert not rec.violations(), rec.violations()
        mod.bad(buf, x)
        buf.sum()  # issued by this test: not flame's
    assert {(c.path, c.function) for c in rec.violations()} == {("flame/planted.py", "bad")}
    got = [(c.line, c.op.split(".")[1], c.category) for c in rec.violations()]
    assert got == [(4, "sum", "compute"), (5, "clone", "compute"), (6, "mul_", "compute"),
                   (7, "copy_", f"compute (a copy within {buf.device})"),
                   (8, "_to_copy", "compute (a cast from torch.float32 to torch.float64)")], got
    assert str(rec.violations()[0]) == "flame/planted.py:4: aten.sum.default in bad: compute"
    allowed = {(c.line, c.op.split(".")[1]): c.category for c in rec.calls if c.line >= 10}
    assert allowed[10, "empty"] == "allocation" and allowed[11, "view"] == allowed[11, "t"] == "views/metadata"
    assert allowed[13, "_to_copy"] == allowed[14, "_local_scalar_dense"] == "host transfer", allowed
    assert rec.others.get("tests", 0) >= 1, rec.others


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
                 "rms_norm 4096x640")],
             "softmax": [f"{k} {op} 8192x32000" for k in ("fwd", "fwd+bwd") for op in ("softmax", "cross_entropy")],
             "matmul": [f"{k} 4096x640->640 +bias{a}" for k in ("fwd", "fwd+bwd") for a in ("", "+gelu_tanh")]
             + ["fwd 8192x640->5120 +bias+geglu vs plain"],
             "conv2d": [f"{k} 3x3 1x320x128x128->320 vs torch {f}" for k in ("fwd", "fwd+bwd") for f in ("NCHW", "CL")],
             "attention": [f"{k} B1 H10 Lq4096 Lk4096 D64{v}" for k in ("fwd", "fwd+bwd") for v in ("", " vs cuDNN")]}
    for fam, targets in bench.TARGETS.items():
        for t in targets:
            assert any(t.select(n) for n in names[fam]), (fam, t.text)


# ---- layers: imports go down (docs/design.md, section 1) ----------------------------------------------

LAYER_OF = {"runtime": 0, "tune": 1, "autotune": 2, "kernels": 3, "autograd": 4, "tensor": 4, "ops": 5,
            "nn": 6, "optim": 6, "amp": 6, "checkpoint": 6, "graphs": 6, "io": 6, "distributed": 6, "testing": 6,
            "models": 7, "sharding": 7, "diffusion": 8, "data": 8, "pipeline": 9, "train": 10}
# (importer, imported top-level part) pairs that go up or sideways between services, each inside a function,
# each with its reason in docs/design.md's table "Imports that go against the order"
AGAINST_THE_ORDER = {("flame.amp", "nn"), ("flame.autograd", "ops"), ("flame.autotune", "kernels"),
                  ("flame.autotune", "tensor"), ("flame.distributed", "graphs"), ("flame.io", "nn"),
                  ("flame.tensor", "ops"), ("flame.tune", "io")}


# function-level imports that go down the layers, each to break a cycle or to keep a start fast
LAZY_IMPORTS = {
    ("flame.autograd", "flame.tensor"): "tensor imports autograd",
    ("flame.train.cli", "flame.data"): "--help and config errors answer before torch and the models load",
    ("flame.train.cli", "flame.train.trainer"): "--help and config errors answer before torch and the models load",
    ("flame.pipeline.cli", "flame.pipeline.images"): "--help answers before the pipeline loads",
    ("flame.pipeline.cli", "flame.pipeline.sdxl"): "--help answers before the pipeline loads",
    ("flame.pipeline.cli", "flame.pipeline.flux"): "--help answers before the pipeline loads",
    ("flame.pipeline.cli", "flame.pipeline.stages"): "--help answers before the pipeline loads",
    ("flame.train.families.sdxl", "flame.train.samples"): "the pipeline loads only when sample.prompts is set",
    ("flame.train.families.flux", "flame.train.samples"): "the pipeline loads only when sample.prompts is set",
}


def _flame_imports(path):
    """(imported flame module, line, inside a function) for each import in the file at ``path``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts
    found = []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = list(package[: len(package) - child.level + 1]) if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                for alias in child.names:  # `from . import x` names a module; `from .m import x` names m
                    found.append((module if child.module else f"{module}.{alias.name}", child.lineno, in_function))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            walk(child, nested)

    walk(ast.parse(path.read_text()), False)
    return [(m, line, lazy) for m, line, lazy in found if m.startswith("flame.")]


def _layer_violations(root):
    """(imports against the order, the documented ones made) over the flame package under ``root``."""
    wrong, used = [], set()
    for path in sorted((root / "flame").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if len(parts) < 2 or parts[1] == "__init__":
            continue  # the package's __init__ sits on top
        me = ".".join(parts[:2])
        for module, line, lazy in _flame_imports(path):
            theirs = module.split(".")[1]
            up = LAYER_OF[theirs] > LAYER_OF[parts[1]]
            sideways = LAYER_OF[theirs] == LAYER_OF[parts[1]] == 6 and theirs != parts[1]  # one service to another
            if not (up or sideways):
                if lazy and (".".join(parts), module) not in LAZY_IMPORTS:
                    wrong.append(f"{path.relative_to(root)}:{line} imports {module} inside a function (at module "
                                 "level, or in LAZY_IMPORTS with its reason)")
                continue
            if (me, theirs) in AGAINST_THE_ORDER and lazy:
                used.add((me, theirs))
            else:
                wrong.append(f"{path.relative_to(root)}:{line} imports {module} ("
                             f"{'a higher layer' if up else 'another service'}{'' if lazy else ', at module level'})")
    return wrong, used


def test_imports_go_down_the_layers():
    """And only the documented imports hide inside functions (LAZY_IMPORTS, AGAINST_THE_ORDER)."""
    wrong, used = _layer_violations(ROOT)
    assert not wrong, "imports against docs/design.md's layer order:\n" + "\n".join(wrong)
    assert used == AGAINST_THE_ORDER, f"documented imports no longer made: {sorted(AGAINST_THE_ORDER - used)}"


def test_the_layer_check_sees_relative_imports(tmp_path, monkeypatch):
    kernels = tmp_path / "flame" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "bad.py").write_text("from ..ops import shape\nfrom . import launch\n\ndef f():\n"
                                    "    from ..train.trainer import Trainer\n")
    (tmp_path / "flame" / "io.py").write_text("def f():\n    from .nn import lora\n")
    (tmp_path / "flame" / "optim.py").write_text("from .amp import Policy\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _flame_imports(kernels / "bad.py") == [("flame.ops", 1, False), ("flame.kernels.launch", 2, False),
                                                  ("flame.train.trainer", 5, True)]
    wrong, used = _layer_violations(tmp_path)
    assert wrong == ["flame/kernels/bad.py:1 imports flame.ops (a higher layer, at module level)",
                     "flame/kernels/bad.py:5 imports flame.train.trainer (a higher layer)",
                     "flame/optim.py:1 imports flame.amp (another service, at module level)"]
    assert used == {("flame.io", "nn")}  # documented, lazy: allowed


# ---- docs/design.md: every file and name it cites exists ---------------------------------------------

CODE_DIRS = ("flame", "scripts", "tests")
# names design.md cites from other libraries where flame has a class of the same name
OTHER_LIBRARIES = {"FluxPipeline.encode_prompt"}  # diffusers'
# a span that cites code: an optional "@", a dotted name, optionally its call "(...)"
_CITED_NAME = re.compile(r"@?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?", re.S)
_FILE_TYPES = {"json", "jsonl", "md", "py", "safetensors", "yaml"}  # `config.json` is a file's name, not code


def _bound(node):
    """Names ``node`` itself binds: a def, class, parameter, import alias or assignment target (``self.x``: x)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = {ast.Assign: lambda n: n.targets, ast.AnnAssign: lambda n: [n.target],
               ast.AugAssign: lambda n: [n.target], ast.For: lambda n: [n.target]}.get(type(node), lambda n: [])
    return {t.id if isinstance(t, ast.Name) else t.attr for target in targets(node) for t in ast.walk(target)
            if isinstance(t, (ast.Name, ast.Attribute))}


def _bound_in(path):
    return set().union(*map(_bound, ast.walk(ast.parse(path.read_text()))))


class _CodeIndex:
    """What the code under CODE_DIRS names.

    ``scopes``: {module, package or class name: the names bound in it}; a package holds its ``__init__``'s
    names and its modules, a class the names bound anywhere in its body (methods, ``self.`` attributes) and
    its bases'. ``bound``: every name bound anywhere, and Python's own; ``known``: those and every name
    written as a string literal (route names, cache fields, config keys). ``variables``: names also bound
    as a parameter or a plain variable (in ``loss.backward``, ``loss`` is a value, not flame/ops/loss.py).
    ``foreign``: names imported from other libraries."""

    def __init__(self, root):
        self.scopes, self.variables, bases, imports = {}, set(), {}, []
        self.bound, strings = set(dir(builtins)) | set(keyword.kwlist), set()
        for path in sorted(p for d in CODE_DIRS for p in (root / d).rglob("*.py")):
            names = set()
            for node in ast.walk(ast.parse(path.read_text())):
                names |= _bound(node)
                if isinstance(node, ast.arg):
                    self.variables.add(node.arg)
                elif isinstance(node, (ast.Assign, ast.For)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    self.variables |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                    source = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    imports.append((source.split(".")[0], _bound(node)))
                elif isinstance(node, ast.ClassDef):
                    self.scopes.setdefault(node.name, set()).update(*map(_bound, ast.walk(node)))
                    bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"[\w.]+", node.value):
                    strings.update(node.value.split("."))
            package = path.parent.parent if path.stem == "__init__" else path.parent
            module = path.parent.name if path.stem == "__init__" else path.stem
            self.scopes.setdefault(module, set()).update(names)
            if package != root:
                self.scopes.setdefault(package.name, set()).add(module)
            self.bound |= names | {module, package.name}
        self.known = self.bound | strings
        self.foreign = set().union(*(bound for source, bound in imports if source not in self.scopes))
        for cls, parents in bases.items():  # inherited members, through the code's own classes
            while parents:
                parent = parents.pop()
                self.scopes[cls] |= self.scopes.get(parent, set())
                parents |= bases.get(parent, set()) - {cls}

    def missing(self, dotted, options):
        """Why the dotted name names nothing in the code, or None. The first part may be any name the code
        knows; each later part must be bound in the module or class that the part before it names or, when
        that is also a variable's name or names no module or class, bound anywhere. A name whose first part
        is another library's is not followed; ``section.option`` may be a trainer option (``options``: the
        config schema)."""
        parts = dotted.split(".")
        if len(parts) == 2 and parts[1] in options.get(parts[0], ()):
            return None
        if parts[0] in self.foreign and parts[0] not in self.scopes:
            return None
        if parts[0] not in self.known:
            return f"{parts[0]} is named nowhere"
        for owner, part in itertools.pairwise(parts):
            precise = owner in self.scopes and owner not in self.variables
            if part not in (self.scopes[owner] if precise else self.bound):
                return f"{part} is not in {owner}" if precise else f"{part} is defined nowhere"
        return None


def _design_citations():
    """(cited (path, name or None), cited names) of docs/design.md's backticked spans. A span whose first word
    has a "/" or ends in .py cites a path of the repository when it starts at its top or in flame/ (a
    ":name" or "::name" after it cites a name in that file); a span that is a dotted name, with an optional
    "@" before and call arguments after, cites a name. Other spans (options, shell lines, templates with
    <...> or *, ``.sum`` methods, file names, folders a run writes) are prose."""
    roots = {p.name for p in (*ROOT.iterdir(), *(ROOT / "flame").iterdir())}
    paths, names = [], []
    for span in re.findall(r"`([^`]+)`", (ROOT / "docs" / "design.md").read_text()):
        word = span.split()[0]
        if "/" in word or word.endswith(".py"):
            path, _, name = span.partition(":")
            if not re.search(r"[<*]", path) and ("/" not in path or path.split("/")[0] in roots):
                paths.append((path.split()[0], re.match(r":?(\w+)", name).group(1) if name else None))
        elif (m := _CITED_NAME.fullmatch(span)) and m.group(1).split(".")[-1] not in _FILE_TYPES:
            names.append(m.group(1))
    return paths, names


def _cited_files(path):
    """The files or folders ``path`` may mean: under the repository or flame/, or (a bare name) any code file
    of that name."""
    if "/" not in path:
        return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob(path))
    return [p for p in (ROOT / path, ROOT / "flame" / path) if p.exists()]


def _design_doc_problems(options):
    """What docs/design.md cites that the code under ROOT does not have (``options``: the config schema)."""
    code = _CodeIndex(ROOT)
    paths, names = _design_citations()
    wrong = []
    for path, name in paths:
        files = _cited_files(path)
        if not files:
            wrong.append(f"{path}: no such file or folder")
        elif name and not any(name in _bound_in(f) for f in files if f.suffix == ".py"):
            wrong.append(f"{path}: binds no {name}")
    for dotted in names:
        if dotted not in OTHER_LIBRARIES and (why := code.missing(dotted, options)):
            wrong.append(f"{dotted}: {why}")
    return wrong


def test_design_doc_cites_only_files_and_names_that_exist():
    """docs/design.md is true to the code: every file it cites exists, and every code name it cites is
    bound in the code (in the module or class it is qualified with), written there as a string, a trainer
    option, or another library's."""
    from flame.train.config import SCHEMA

    paths, names = _design_citations()
    assert len(paths) > 100 and len(names) > 300, "docs/design.md's citations were not found"
    wrong = _design_doc_problems(SCHEMA)
    assert not wrong, "docs/design.md cites what the code does not have:\n" + "\n".join(wrong)


def test_the_design_doc_check_finds_stale_citations(tmp_path, monkeypatch):
    planted = {
        "flame/tune.py": "import torch\ndef config(key):\n    return key\nclass Spec:\n    def __init__(self):\n"
                         "        self.key = None\nclass Tuned(Spec):\n    pass\n",
        "flame/kernels/__init__.py": "", "flame/kernels/optim.py": "def axpby_(): pass\n",
        "flame/routes.py": 'ROUTES = ("wgrad_tma",)\n', "scripts/run.py": "", "tests/test_run.py": "",
        "docs/design.md": "Good: `tune.config(key)`, `@tune.Spec`, `Tuned.key`, `wgrad_tma`, `flame/kernels/optim.py:"
                          "axpby_`, `kernels/optim.py`, `optim.py`, `torch.anything()`, `lora.dropout`, `config.json`, "
                          "`flame/<family>.py`, `.sum`, `--help`. Stale: `tune.old`, `Spec.gone`, `_Gone`, "
                          "`flame/gone.py`, `kernels/optim.py:gone_`."}
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _design_doc_problems({"lora": {"dropout": None}}) == [
        "flame/gone.py: no such file or folder", "kernels/optim.py: binds no gone_", "tune.old: old is not in tune",
        "Spec.gone: gone is not in Spec", "_Gone: _Gone is named nowhere"]
