"""Each kernel family's benchmark cases and tuning problems, side by side: one module per family,
named as its kernel file is (``flame/kernels/<family>.py``), that ``scripts/bench.py`` and
``scripts/autotune.py`` iterate. PyTorch references are allowed here (this is not ``flame/``).

A family module declares:

- ``BENCH``: a ``cases.BenchFamily`` (``bench.py --family <family>``: flame against PyTorch, the
  issues' targets, the tunable kernels its cases time), or None where another family's cases time
  its kernels (``reduce``'s row sum is one of ``elementwise``'s bandwidth cases);
- ``TUNING``: {tuning name: ``problems.Tuning``} (``autotune.py --family <tuning name>``): the
  problems of one section of the shapes file, named for the kernel they tune (``group_norm`` tunes
  ``group_norm_fwd`` and ``group_norm_bwd``), each with tiny ``--quick`` shapes.

Two families are not kernel files: ``lora`` (a layer of GEMMs and DoRA's norm) and ``overhead``
(the host's cost per op); they benchmark and tune nothing of their own.

Adding a kernel family: its kernel file registers a ``flame.tune.Spec`` per tunable kernel; here,
a module with its ``BENCH`` and ``TUNING``, listed in ``MODULES``; its section in
``configs/autotune/shapes/sdxl.yaml``. ``tests/test_kernel_families.py`` fails while a registered
kernel has no problem builder or no benchmark case (``uncovered``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for common (also when a test imports us)

# isort: off
from . import matmul, lora, conv2d, attention, norms, rope, softmax, elementwise, reduce, overhead
# isort: on

# The scripts' order: autotune's tunings and bench's families run in it (GEMMs first).
MODULES = (matmul, lora, conv2d, attention, norms, rope, softmax, elementwise, reduce, overhead)


def family_name(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def bench_families(modules=MODULES) -> dict:
    """{family name: BenchFamily} of ``modules``, in order."""
    return {m.BENCH.name: m.BENCH for m in modules if m.BENCH is not None}


def bench_aliases(modules=MODULES) -> dict:
    """{an older bench family name the docs' commands use: the family's name}."""
    return {alias: m.BENCH.name for m in modules if m.BENCH is not None for alias in m.BENCH.aliases}


def tunings(modules=MODULES) -> dict:
    """{tuning name: Tuning} of ``modules``, in order."""
    out = {}
    for m in modules:
        for name, tuning in m.TUNING.items():
            if name in out:
                raise ValueError(f"tuning {name!r} declared twice")
            out[name] = tuning
    return out


def tuning_groups(modules=MODULES) -> dict:
    """{family name: its tuning names} of the families whose name is not a tuning name itself
    (``norms``: group_norm and layer_norm), for ``autotune.py --family <family>``."""
    names = tunings(modules)
    return {family_name(m): tuple(m.TUNING) for m in modules if m.TUNING and family_name(m) not in names}


def _kernel_file(spec) -> str:
    """The name of the kernel file that registers ``spec`` (where its heuristic is defined)."""
    return spec.heuristic.__module__.rsplit(".", 1)[-1]


def uncovered(specs, modules=MODULES) -> list[str]:
    """What breaks "every tunable kernel of ``specs`` ({name: flame.tune.Spec}) has a problem builder
    and a benchmark case in ``modules``, and is tuned by the family named as its kernel file": one
    line per problem (a kernel without either, a kernel tuned by another family, a declared kernel
    that flame.tune does not register); none when all holds."""
    tuned = {k: (family_name(m), name) for m in modules for name, t in m.TUNING.items() for k in t.kernels}
    timed = {k: b.name for b in bench_families(modules).values() for k in b.kernels}
    problems = []
    for name, spec in specs.items():
        if name not in tuned:
            problems.append(f"kernel {name!r} has no problem builder (no family's TUNING declares it)")
        elif tuned[name][0] != _kernel_file(spec):
            problems.append(f"kernel {name!r} (flame/kernels/{_kernel_file(spec)}.py) is tuned by family "
                            f"{tuned[name][0]!r}, not {_kernel_file(spec)!r}")
        if name not in timed:
            problems.append(f"kernel {name!r} has no benchmark case (no family's BENCH declares it)")
    for kernel in sorted(({*tuned, *timed}) - set(specs)):
        problems.append(f"kernel {kernel!r} is declared here but flame.tune registers no such kernel")
    return problems
