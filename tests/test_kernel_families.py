"""scripts/kernel_families: every kernel flame.tune registers has a problem builder (tuned by the family named
as its kernel file) and a benchmark case, and a missing one is caught; the scripts' names come from the package."""
import dataclasses
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from flame import tune

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
kernel_families = importlib.import_module("kernel_families")


def test_every_tunable_kernel_has_a_problem_builder_and_a_bench_case():
    assert tune.SPECS, "flame.kernels registered no tunable kernel"
    assert kernel_families.uncovered(tune.SPECS) == []


def _changed(**changes):
    """MODULES with each module named in ``changes`` replaced by a copy whose attributes its dict replaces."""
    def swap(m):
        name = kernel_families.family_name(m)
        if name not in changes:
            return m
        copy = types.ModuleType(m.__name__)
        copy.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")}, **changes[name])
        return copy
    return tuple(map(swap, kernel_families.MODULES))


def test_a_kernel_without_a_problem_builder_or_a_bench_case_is_caught():
    norms = kernel_families.norms
    no_layer_norm = _changed(norms=dict(TUNING={"group_norm": norms.TUNING["group_norm"]}))
    assert kernel_families.uncovered(tune.SPECS, no_layer_norm) == [
        "kernel 'layer_norm_fwd' has no problem builder (no family's TUNING declares it)",
        "kernel 'layer_norm_bwd' has no problem builder (no family's TUNING declares it)"]
    no_bench = _changed(softmax=dict(BENCH=None))
    assert kernel_families.uncovered(tune.SPECS, no_bench) == [
        f"kernel {k!r} has no benchmark case (no family's BENCH declares it)"
        for k in ("softmax_fwd", "softmax_bwd", "cross_entropy_fwd", "cross_entropy_bwd")]
    # a kernel registered tomorrow with neither
    new = dataclasses.replace(tune.SPECS["softmax_fwd"], name="softmax_online_fwd")
    assert kernel_families.uncovered({**tune.SPECS, new.name: new}) == [
        "kernel 'softmax_online_fwd' has no problem builder (no family's TUNING declares it)",
        "kernel 'softmax_online_fwd' has no benchmark case (no family's BENCH declares it)"]


def test_a_kernel_is_tuned_by_the_family_named_as_its_kernel_file():
    softmax_only = dict(kernel_families.softmax.TUNING)
    cross_entropy = softmax_only.pop("cross_entropy")
    modules = _changed(softmax=dict(TUNING=softmax_only),
                       norms=dict(TUNING={**kernel_families.norms.TUNING, "cross_entropy": cross_entropy}))
    assert kernel_families.uncovered(tune.SPECS, modules) == [
        f"kernel {k!r} (flame/kernels/softmax.py) is tuned by family 'norms', not 'softmax'"
        for k in ("cross_entropy_fwd", "cross_entropy_bwd")]
    stale = _changed(matmul=dict(TUNING={"matmul": dataclasses.replace(
        kernel_families.matmul.TUNING["matmul"], kernels=("matmul", "matmul_tma", "matmul_gone"))}))
    assert kernel_families.uncovered(tune.SPECS, stale) == [
        "kernel 'matmul_gone' is declared here but flame.tune registers no such kernel"]


def test_family_modules_are_named_as_kernel_files():
    kernel_files = {p.stem for p in (ROOT / "flame" / "kernels").glob("*.py")}
    not_kernels = {"lora", "overhead"}  # a layer of GEMMs, the host's cost per op (the package's docstring)
    names = {kernel_families.family_name(m) for m in kernel_families.MODULES}
    assert names - not_kernels <= kernel_files
    # a family's bench name is its module's
    assert all(m.BENCH is None or m.BENCH.name == kernel_families.family_name(m) for m in kernel_families.MODULES)


def _script(name):
    spec = importlib.util.spec_from_file_location(f"kernel_families_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripts():
    yield _script("bench"), _script("autotune")
    for name in ("bench", "autotune"):
        sys.modules.pop(f"kernel_families_{name}", None)


def test_the_scripts_take_their_families_and_old_names_from_the_package(scripts):
    bench, autotune = scripts
    assert list(bench.FAMILIES) == list(kernel_families.bench_families())
    assert bench.parse_args(["--family", "linear,conv", "--family", "softmax"]).family == [
        "matmul", "conv2d", "softmax"]
    assert list(autotune.FAMILIES) == ["matmul", "conv2d", "conv2d_dgrad", "conv2d_wgrad", "attention",
                                       "group_norm", "layer_norm", "softmax", "cross_entropy", "elementwise", "reduce"]
    args = autotune.parse_args(["--quick", "--out", "unused.json", "--family", "norms,softmax"])
    assert args.family == ["group_norm", "layer_norm", "softmax"]
    assert autotune.QUICK_SHAPES["conv2d"] == list(kernel_families.conv2d.QUICK)


def _misnamed(kernel_files, root=ROOT) -> list[str]:
    """One line per place a family named ``kernel_files`` (flame/kernels/<family>.py stems) lacks: its op
    file flame/ops/<family>.py, its tests tests/test_<family>.py, its scripts/kernel_families/<family>.py."""
    places = ("flame/ops/{}.py", "tests/test_{}.py", "scripts/kernel_families/{}.py")
    return [f"family {family!r} (flame/kernels/{family}.py) has no {place.format(family)}"
            for family in sorted(kernel_files) for place in places if not (root / place.format(family)).is_file()]


def test_a_family_with_a_tunable_kernel_has_one_name_across_kernel_op_test_and_script_files():
    # Every kernel file that registers a tunable kernel; the Gluon variants (attention_hopper.py,
    # matmul_hopper.py) register none: they are routes of attention's and matmul's ops, tested in
    # tests/test_<variant>.py. No family is an exception.
    kernel_files = {spec.heuristic.__module__.rsplit(".", 1)[-1] for spec in tune.SPECS.values()}
    assert {"matmul", "conv2d", "attention", "norms", "softmax", "elementwise", "reduce"} <= kernel_files
    assert _misnamed(kernel_files) == []
    # a family registered tomorrow under a kernel file with no namesakes is caught
    assert _misnamed({"softmax", "fused_adam"}) == [
        f"family 'fused_adam' (flame/kernels/fused_adam.py) has no {place}"
        for place in ("flame/ops/fused_adam.py", "tests/test_fused_adam.py", "scripts/kernel_families/fused_adam.py")]


def test_shapes_sections_are_named_as_their_family_and_the_old_names_still_read(scripts, tmp_path):
    _, autotune = scripts
    common = importlib.import_module("common")
    assert {"matmul", "conv2d"} <= set(common.load_shapes()) and not {"linear", "conv"} & set(common.load_shapes())
    assert {t.section for t in kernel_families.tunings().values()} >= {"matmul", "conv2d"}
    old = tmp_path / "old.yaml"
    old.write_text("linear: [[8, 16, 24]]\nconv: [[1, 4, 8, 8, 16, 3, 1]]\n")
    want = {"matmul": [(8, 16, 24)], "conv2d": [(1, 4, 8, 8, 16, 3, 1)]}
    assert common.load_shapes(old) == want

    def error(msg):
        raise AssertionError(msg)

    assert autotune.load_shapes(old, ["matmul", "conv2d"], error) == want


def test_the_rope_family_checks_the_op_against_diffusers_steps(scripts):
    """``bench.py --family rope``'s quick cases (Flux's double and single block prologues, forward and
    forward + backward) agree with PyTorch's composed steps before anything is timed."""
    import torch

    bench, _ = scripts
    ctx = kernel_families.cases.Ctx(dtype=torch.float32, quick=True, warmup=1, rep=1)
    cases = kernel_families.rope.BENCH.cases(ctx)
    assert [c.name.split(" ", 1)[0] for c in cases] == ["fwd", "fwd+bwd"] * 2
    assert [bench.check_case(c) for c in cases] == [None] * 4
