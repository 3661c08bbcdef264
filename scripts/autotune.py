#!/usr/bin/env python3
"""Measure launch configs per kernel and shape on this GPU; write its table for flame.tune.

    PYTHONPATH=. python3 scripts/autotune.py                                # every family, SDXL shapes, bf16
    PYTHONPATH=. python3 scripts/autotune.py --family matmul --budget-minutes 9   # rerun to continue
    PYTHONPATH=. python3 scripts/autotune.py --family attention --budget-minutes 9
    PYTHONPATH=. python3 scripts/autotune.py --family norms --budget-minutes 9       # group_norm, layer_norm
    PYTHONPATH=. python3 scripts/autotune.py --family softmax,cross_entropy --budget-minutes 9
    PYTHONPATH=. python3 scripts/autotune.py --family elementwise,reduce --budget-minutes 9
    python scripts/autotune.py --quick --out /tmp/table.json                # tiny smoke test (CPU too)

For each family, each shape of the shapes file (``configs/autotune/shapes/sdxl.yaml``) and the
dtype, every problem (one launch as flame makes it) is built once with its PyTorch reference (fp32,
no tf32). It first runs as it is, under ``flame.tune.record`` with the tables hidden: that checks
the heuristic default and tells which kernel of ``flame.tune.KERNELS`` runs (the last one the launch
asks for that is not a helper map or reduction: on Hopper a 16-bit GEMM asks "matmul", then runs
"matmul_tma"; ``flame.autotune.launched_kernel``), its shape key and its default config. Then
each candidate of a pruned config space runs under ``flame.tune.override``: its outputs (poisoned
with NaN first) are checked against the reference (a wrong one is rejected, reported and never
written; one that fails to compile or to fit is skipped), then it is timed as
CUDA-graph replays (median device time, as ``scripts/bench.py`` reports it; see ``time_ms``): a
short screen of the default and every candidate, then the fastest few and the default again with
a longer one. Some spaces come in stages, each built on the fastest config screened so far:
attention's backward tunes its dK/dV program with the dQ program at its default, then the dQ
program with the fastest dK/dV config; GroupNorm its
statistics pass, then its apply pass; LayerNorm's backward its rows per program and warps, then
its persistent programs. The fastest of the final timings goes into the GPU's table (format 1 of
``configs/autotune/README.md``) with its time and the default's. The table is rewritten after
every key, so a run stopped by ``--budget-minutes`` or killed keeps what it finished, and a rerun
skips keys already in the table (``--force`` re-tunes them, the table's config competing as one
more candidate timed in the same run; keys tuned with another Triton release are re-tuned so, and
the table's other entries keep their release in their ``triton`` field). Keys repeated across
shapes and families are tuned once (a GroupNorm without SiLU shares its key with the one with
SiLU). A candidate with large tiles can make the pointer GEMM split K (few output tiles): the split
launches use the candidate too while timing, not at run time; the conv weight gradient's split
follows from its tiles at run time too. Each problem's outputs are buffers that every run
overwrites completely (the weight gradient's through its split-K reduction, the norms' dW and dB
through theirs), so the NaN poison shows any element a candidate leaves unwritten.

Compiling a candidate takes Triton about a second and timing it a few milliseconds, so on a GPU
``--jobs`` worker processes (default: half the CPU cores, at most 8) first run each stage's
candidates once, side by side, filling Triton's on-disk cache; the timing process then loads
them from there and times them one by one while the workers wait.

Adding a kernel to tuning touches three files: its kernel file declares a ``flame.tune.Spec`` (key,
config fields, heuristic, search space) next to the ``@triton.jit`` and registers it; its family's
module in ``scripts/kernel_families/`` a ``Tuning`` in ``TUNING`` (``fn(ctx, shape) ->
list[Problem]`` for one entry of a section of the shapes file, that section's fields and flags, a
tiny ``--quick`` shape), next to the family's benchmark cases; and that section in the shapes file.
``--kernels`` lists the registered kernels.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import concurrent.futures.process
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (also when imported by path)

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame import autotune, runtime, tune
import torch
import triton
import triton.testing
import yaml
from tqdm import tqdm
import kernel_families
from kernel_families.problems import Bench, Ctx, Fatal, Problem  # noqa: F401  (Problem: for tests' problems)
from kernel_families.problems import Tuning as Family
# isort: on

ROOT = common.ROOT
DTYPES = common.DTYPES
# Largest error allowed, as a fraction of the reference's largest magnitude: the library's check of
# a tuned config (flame.autotune.CHECK_TOL), the same job.
CHECK_TOL = common.CHECK_TOL
SCREEN = dict(warmup=2, rep=10)  # ms of timing (time_ms) for the first pass over every candidate
FINAL = dict(warmup=10, rep=50)  # ... and for the finalists and the default
DEFAULT_SHAPES = common.SDXL_SHAPES
# The tunings (scripts/kernel_families: one module per kernel family, its tuning problems next to its
# benchmark cases), each named for the kernel it tunes: {name: Family}; ``--family`` also takes a
# family's name where it is not a tuning's (norms: group_norm and layer_norm).
FAMILIES: dict[str, Family] = kernel_families.tunings()
GROUPS = kernel_families.tuning_groups()
QUICK_SHAPES = {f.section: list(f.quick) for f in FAMILIES.values()}  # --quick's tiny shapes per section

# Errors after which the CUDA context is unusable: the run stops rather than skip every later candidate.
CONTEXT_LOST = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction")

_clock = time.monotonic


def search_stages(ctx: Ctx, kernel: str, key: tuple) -> list:
    """``flame.autotune.search_stages`` for this run's dtype, shared memory and --quick."""
    try:
        return autotune.search_stages(ctx, kernel, key)
    except LookupError as e:
        raise Fatal(str(e)) from None


# ---- measuring ---------------------------------------------------------------------------------

def check(bench: Bench, dtype) -> str | None:
    """None when a launch into the poisoned (NaN) outputs matches the reference, else why not."""
    outs, wants = (bench.out, bench.want) if isinstance(bench.out, tuple) else ((bench.out,), (bench.want,))
    for out in outs:
        out.fill_(math.nan)
    bench.run()
    rel = CHECK_TOL[dtype] * bench.slack
    for i, (out, want) in enumerate(zip(outs, wants)):
        err = float((out.float() - want).abs().max())
        scale = float(want.abs().max())
        tol = rel * max(scale, 1e-6)
        if not err <= tol:  # NaN: an output element was never written
            which = f"output {i}: " if len(outs) > 1 else ""
            return f"{which}max |error| {err:.3g} > {tol:.3g} ({rel:.3g} x max |reference| {scale:.3g})"
    return None


def time_ms(fn, warmup, rep) -> float:
    """Median milliseconds per call of CUDA-graph replays (``flame.autotune.graph_time_ms``: device
    time, as ``scripts/bench.py`` reports it), or ``do_bench``'s for a launch that cannot be
    captured (on the interpreter: host time of two calls, meaningless)."""
    if flame.is_interpreter():
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    ms = autotune.graph_time_ms(fn, rep)
    if ms is None:
        ms = float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return ms


class NotTunable(RuntimeError):
    """A launch that does not take its config from flame.tune: tuning it would time one config."""


@dataclasses.dataclass
class Launch:
    """What a problem's launch asks flame.tune for: the kernel that runs, its shape key, the dtype
    name and the heuristic config (the tables are hidden while tuning)."""

    kernel: str
    key: tuple
    dtype: str
    default: dict


def probe(name: str, bench: Bench, dtype) -> tuple[Launch, str | None]:
    """Run ``bench`` once with no override: what it asks flame.tune (the last kernel asked, at its
    first key) and why its output is wrong (None: right)."""
    with tune.record() as asked:
        problem = check(bench, dtype)
    if not asked:
        raise NotTunable(f"{name}: the launch asked flame.tune for no config on this backend (does its launcher "
                         "call tune.config here?)")
    kernel = autotune.launched_kernel([q[0] for q in asked])
    return Launch(*next(q for q in asked if q[0] == kernel)), problem


@dataclasses.dataclass
class Outcome:
    name: str
    launch: Launch
    entry: dict | None = None  # the table entry; None: nothing to write
    error: str | None = None
    rejected: list = dataclasses.field(default_factory=list)  # (config, why)
    skipped: list = dataclasses.field(default_factory=list)  # (config, exception)


def _timed(kernel, cfg, bench, timing):
    """``bench.run``'s time under ``cfg`` (``None``: the heuristic default, no override)."""
    with tune.override(kernel, cfg) if cfg else contextlib.nullcontext():
        return time_ms(bench.run, **timing)


def tune_launch(name: str, bench: Bench, launch: Launch, ctx: Ctx, deadline: float,
                compile_ahead=lambda configs: None, incumbent: dict | None = None) -> Outcome | None:
    """Check and time every candidate config of ``launch`` (``flame.autotune.search``: stage by
    stage, each stage built on the fastest config screened so far) and its default; None when the
    budget ran out first. ``compile_ahead(configs)`` is called with each stage's new candidates
    before they are timed. ``incumbent``, the table's config for the key when ``--force``
    re-tunes it or another Triton release tuned it, is screened first, in this run like every other
    candidate: a time stored in the table was measured by other code, perhaps on another shape
    with the same key, so it is never compared with."""
    out = Outcome(name, launch)
    stages = search_stages(ctx, launch.kernel, launch.key)
    if incumbent is not None:
        stages = [lambda best: [incumbent]] + stages
    found = autotune.search(stages, launch.default,
                            _timed(launch.kernel, None, bench, SCREEN),  # probe() checked it
                            lambda cfg: _screen(name, bench, launch, cfg, ctx, out),
                            lambda cfg: _timed(launch.kernel, cfg, bench, FINAL),
                            compile_ahead, lambda: _clock() > deadline)
    if found is None:
        return None
    best, best_ms, default_ms, _ = found
    out.entry = dict(key=list(launch.key), config=best, ms=_round(best_ms), default_ms=_round(default_ms))
    return out


def _screen(name, bench, launch, cfg, ctx, out):
    """``cfg``'s screening time; None when it gives a wrong answer (listed in ``out.rejected``) or
    fails to compile or fit (``out.skipped``)."""
    try:
        with tune.override(launch.kernel, cfg) as active:
            problem = check(bench, ctx.dtype)
            if not active.served:
                raise NotTunable(
                    f"{name}: the launch never asked flame.tune for its {launch.kernel} config under "
                    "tune.override (is the launcher's own config cache registered with tune.register_cache?)")
            ms = None if problem else time_ms(bench.run, **SCREEN)
    except NotTunable:
        raise
    except Exception as e:  # compile failure, out of resources: not a candidate on this GPU
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if any(sign in str(e) for sign in CONTEXT_LOST):
            raise Fatal(f"{name}: {launch.kernel} config {cfg} broke the CUDA context ({why}): fix the kernel "
                        "for that config, then rerun (the keys finished so far are kept)") from e
        out.skipped.append((cfg, why))
        return None
    if problem:
        out.rejected.append((cfg, problem))
    return ms


def _round(ms):
    return float(f"{ms:.4g}")


# ---- compiling ahead in worker processes -------------------------------------------------------
# Compiling a candidate costs Triton about a second; timing it, a few milliseconds. With --jobs N,
# N worker processes run each stage's candidates once before they are timed: that compiles them
# side by side into Triton's on-disk cache, from which the timing process then loads them. The
# workers are idle while the timing process measures, so they do not disturb its timings.

_worker = {}  # a compile worker's problems and the one it has built


def _worker_start(families, shapes_doc, dtype_name, quick, smem):
    ctx = Ctx(dtype=DTYPES[dtype_name], quick=quick, smem=smem)
    _worker.update(problems=enumerate_problems(families, shapes_doc, ctx), built=(None, None))
    session = contextlib.ExitStack()  # open for the worker's lifetime: its launches see no table
    session.enter_context(tuning_session())
    _worker["session"] = session


def _worker_compile(index, kernel, cfg, keep=True):
    """Run problem ``index`` once with ``kernel`` under ``cfg`` (compiling it); a worker whose
    CUDA context broke exits, and the timing process compiles that stage itself. With ``keep``
    false the problem's tensors are freed afterwards (a stage too big for every worker to hold)."""
    if _worker["built"][0] != index:
        _worker["built"] = (None, None)
        torch.cuda.empty_cache()
        _worker["built"] = (index, _worker["problems"][index][1].build())
    try:
        with tune.override(kernel, cfg):
            _worker["built"][1].run()
        torch.cuda.synchronize()
    except Exception as e:
        if any(sign in str(e) for sign in CONTEXT_LOST):
            os._exit(1)
        return type(e).__name__
    finally:
        if not keep:
            _worker["built"] = (None, None)
            torch.cuda.empty_cache()
    return None


def _gpu_memory_mark():
    """This process's allocated GPU bytes now, with the peak counter reset (None in the interpreter)."""
    if flame.is_interpreter():
        return None
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _gpu_memory_peak_since(mark):
    """The most GPU bytes allocated since ``_gpu_memory_mark`` gave ``mark``, over what was then."""
    return 0 if mark is None else max(0, torch.cuda.max_memory_allocated() - mark)


def _workers_that_fit(footprint, free_bytes):
    """How many compile workers can hold a problem of ``footprint`` bytes at once in
    ``free_bytes`` of GPU memory (a quarter more than this process's footprint, and 0.5 GiB, each;
    a tenth of the free memory kept back)."""
    return int(0.9 * free_bytes // (1.25 * footprint + 2**29))


class CompileAhead:
    """``jobs`` compile workers for the problems of this run (``--jobs``; none: compile while timing)."""

    def __init__(self, jobs, args, ctx):
        self.jobs = jobs
        self.start = (args.family, args.shapes_doc, args.dtype, args.quick, ctx.smem)
        self.pool = None
        self.compiled = 0  # candidates the workers ran

    def __call__(self, index, kernel, configs, footprint=0):
        """Compile ``configs`` of problem ``index`` ahead in the workers; ``footprint``: the bytes of
        GPU memory the problem took in this process, so that no more workers build it at once than
        the free memory holds (then each frees it after its candidate)."""
        if self.jobs == 0 or len(configs) < 2:
            return
        room = self.jobs if not footprint else _workers_that_fit(footprint, torch.cuda.mem_get_info()[0])
        if room < 2:
            print(f"autotune: {kernel}'s problem takes {footprint / 2**30:.1f} GiB, too much for a second copy in a "
                  "compile worker; compiling this stage while timing", file=sys.stderr)
            return
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                self.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                initargs=self.start)
        keep = room >= self.jobs  # every worker may hold a copy: one map over the stage, no waves
        wave = len(configs) if keep else room
        try:
            for first in range(0, len(configs), wave):
                batch = configs[first:first + wave]
                list(self.pool.map(_worker_compile, [index] * len(batch), [kernel] * len(batch), batch,
                                   [keep] * len(batch)))
                self.compiled += len(batch)
        except concurrent.futures.process.BrokenProcessPool:  # a config broke a worker: start afresh
            self.close()
        except Exception as e:  # a worker that cannot build the problem (memory...): this stage compiles serially
            print(f"autotune: compile workers failed on {kernel} ({type(e).__name__}: {e}); "
                  "compiling this stage while timing", file=sys.stderr)
            self.close()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


# ---- the table -----------------------------------------------------------------------------------

def load_table(path: Path, gpu: str) -> dict:
    """{(kernel, dtype name): {key tuple: entry}} of the table at ``path`` (empty if absent), each
    entry naming the Triton version it was tuned with (``triton``): entries of another release are
    re-tuned when met, and kept with their version until then."""
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Fatal(f"{path}: unreadable ({e}); move it aside or pass --out") from None
    if not isinstance(raw, dict) or raw.get("format") != tune.FORMAT or not isinstance(raw.get("entries"), dict):
        raise Fatal(f"{path}: not a format-{tune.FORMAT} tuning table; move it aside or pass --out")
    if tune.slug(str(raw.get("gpu"))) != tune.slug(gpu):
        raise Fatal(f"{path} holds the table of {raw.get('gpu')!r}, this is {gpu!r}; pass --out")
    table = tune.entries_by_key(raw)
    older = sorted({e.get("triton") for rows in table.values() for e in rows.values()
                    if not tune.this_release(e.get("triton"))}, key=str)
    if older:
        print(f"{path}: entries tuned with Triton {', '.join(map(str, older))}, this is {triton.__version__}: "
              "the keys met are tuned again (their config one more candidate), the others kept")
    return table


# ---- the run -----------------------------------------------------------------------------------

@contextlib.contextmanager
def tuning_session():
    """The launchers see no table (the default runs time the heuristics: ``tune.heuristics_only``)
    and PyTorch's fp32 references use no tf32; both restored afterwards."""
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with tune.heuristics_only():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32


def enumerate_problems(families, shapes, ctx):
    """Every (family, problem) of the shapes, in order."""
    return [(name, p) for name in families for shape in shapes.get(FAMILIES[name].section, ())
            for p in FAMILIES[name].fn(ctx, shape)]


_BLOCK_ORDER = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
_COUNTS = (("GROUP_M", "g"), ("M_GROUP", "g"), ("CHUNKS", "c"), ("SPLITS", "split"), ("PROGRAMS", "p"))


def _cfg_str(cfg):
    """``128x64x32 w4 s3 g8``: blocks (M, N, K first), warps, stages, then group, chunk, split or
    program counts; a second program's fields (suffix ``_DQ``/``_dq``, ``_APPLY``/``_apply``) after
    its name (``dq``, ``apply``)."""
    for tag in ("dq", "apply"):
        second = {k[:-len(tag) - 1]: v for k, v in cfg.items() if k.lower().endswith("_" + tag)}
        if second:
            own = {k: v for k, v in cfg.items() if not k.lower().endswith("_" + tag)}
            return f"{_cfg_str(own)} {tag} {_cfg_str(second)}"
    blocks = sorted((k for k in cfg if k.startswith("BLOCK_")),
                    key=lambda k: _BLOCK_ORDER.index(k) if k in _BLOCK_ORDER else len(_BLOCK_ORDER))
    s = "x".join(str(cfg[b]) for b in blocks) + f" w{cfg['num_warps']}"
    s += f" s{cfg['num_stages']}" if "num_stages" in cfg else ""
    return s + "".join(f" {a}{cfg[k]}" for k, a in _COUNTS if k in cfg)


def print_summary(outcomes):
    """Per family: default and tuned time of each key tuned now, the speedup and its geometric mean."""
    by_family = {}
    for name, o in outcomes:
        by_family.setdefault(name, []).append(o)
    header = ("shape", "kernel", "key", "default ms", "tuned ms", "speedup", "config")
    for name, outs in by_family.items():
        done = [o for o in outs if o.entry]
        rows = [(o.name, o.launch.kernel, str(o.launch.key), f"{o.entry['default_ms']:.4g}", f"{o.entry['ms']:.4g}",
                 f"{o.entry['default_ms'] / o.entry['ms']:.2f}x",
                 "default" if o.entry["config"] == o.launch.default else _cfg_str(o.entry["config"])) for o in done]
        print(f"\n{name}:")
        if rows:
            widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
            for r in (header, tuple("-" * w for w in widths), *rows):
                cells = (c.rjust(w) if 3 <= i <= 5 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                print("  ".join(cells).rstrip())
            gain = math.exp(statistics.fmean(math.log(o.entry["default_ms"] / o.entry["ms"]) for o in done))
            print(f"geometric-mean speedup over the defaults: {gain:.3f}x over {len(rows)} keys")
        errors = [o for o in outs if o.error]
        print(f"candidates rejected (wrong output): {sum(len(o.rejected) for o in outs)}; "
              f"skipped (compile or resources): {sum(len(o.skipped) for o in outs)}; keys that failed: {len(errors)}")
        for o in errors:
            print(f"  FAILED {o.name} ({o.launch.kernel} {list(o.launch.key)}): {o.error}")


def _positive_minutes(text):
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, got {text!r}")
    return v


def load_shapes(path: Path, families, error) -> dict:
    """{section: [shape tuples]} of the shapes file, checked against the families' fields."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        error(f"--shapes {path}: cannot read it ({e})")
    fields = {f.section: f.fields for f in FAMILIES.values()}
    flags = {f.section: f.flags for f in FAMILIES.values()}
    if not isinstance(doc, dict):
        error(f"--shapes {path}: expected sections {sorted(fields)} of shape lists, got {type(doc).__name__}")
    shapes = {}
    for section, rows in doc.items():
        name = common.SECTION_ALIASES.get(section, section)  # errors name the section as the file spells it
        if name not in fields:
            error(f"--shapes {path}: unknown section {section!r} (known: {', '.join(sorted(fields))})")
        want, flag = fields[name], flags[name]
        if not isinstance(rows, list):
            error(f"--shapes {path}: section {section!r} must be a list of {list(want)} lists")
        what = f"integers {list(want)} ({', '.join(flag)} 0 or 1, the others positive)" if flag else \
            f"positive integers {list(want)}"
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == len(want) and all(
                    isinstance(v, int) and not isinstance(v, bool) and (v in (0, 1) if f in flag else v > 0)
                    for f, v in zip(want, row))):
                error(f"--shapes {path}: {section}[{i}] = {row!r} is not {len(want)} {what}")
        shapes[name] = [tuple(r) for r in rows]
    if not any(FAMILIES[f].section in shapes for f in families):
        error(f"--shapes {path}: no shapes for the families {', '.join(families)} "
              f"(sections {', '.join(sorted({FAMILIES[f].section for f in families}))})")
    return shapes


def kernel_table() -> str:
    """The registered kernels as a Markdown table: name, key, config fields, what it is."""
    rows = ["| kernel | key | config fields | what |", "| --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | `[{', '.join(s.key)}]` | `{' '.join(s.fields)}` | {s.doc} |" for s in tune.SPECS.values()]
    return "\n".join(rows)


def _groups_text():
    return "and " + ", ".join(f"{g} ({', '.join(names)})" for g, names in GROUPS.items())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="families:\n" + "\n".join(f"  {k:<13} {f.description}"
                                                                 for k, f in FAMILIES.items()) + f"\n{_groups_text()}")
    p.add_argument("--family", action="extend", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                   default=[], help="family to tune (repeatable or comma-separated; default: all)")
    p.add_argument("--shapes", type=Path, default=None,
                   help=f"shapes file (default: {DEFAULT_SHAPES.relative_to(ROOT)}; --quick: built-in tiny shapes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="element type (default bf16)")
    p.add_argument("--budget-minutes", type=_positive_minutes, default=None,
                   help="stop after about this long, keeping every key finished so far")
    p.add_argument("--force", action="store_true", help="re-tune keys that are already in the table")
    p.add_argument("--problems", type=lambda text: tuple(w.strip() for w in text.split(",") if w.strip()),
                   default=None, help="tune only the launches whose name ends in one of these words, e.g. fwd,dX "
                                      "(a frozen model's GEMMs: LoRA training and inference need no dW)")
    p.add_argument("--out", type=Path, default=None,
                   help="table to write (default: configs/autotune/<gpu-slug>.json, or under $FLAME_TUNE_DIR)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and a few candidates (smoke test)")
    p.add_argument("--kernels", action="store_true", help="list the tunable kernels (flame.tune.SPECS) and exit")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes that compile each stage's candidates ahead of their timing, no more "
                        "at once than the GPU's free memory holds copies of the problem (default: half the CPU "
                        "cores, at most 8, on a GPU; 0 on the interpreter; 0: compile while timing)")
    args = p.parse_args(argv)
    if args.kernels:
        return args
    if args.jobs is None:
        args.jobs = 0 if flame.is_interpreter() else min(8, (os.cpu_count() or 2) // 2)
    if args.jobs < 0:
        p.error(f"--jobs must be 0 or more, got {args.jobs}")
    args.family = list(dict.fromkeys(n for name in args.family or FAMILIES for n in GROUPS.get(name, (name,))))
    if any(n not in FAMILIES for n in args.family):
        p.error(f"unknown family {', '.join(n for n in args.family if n not in FAMILIES)}; "
                f"known: {', '.join(FAMILIES)}; {_groups_text()}")
    if args.out is None and (args.quick or flame.is_interpreter()):
        p.error("--quick and the interpreter backend (no GPU) need --out: their tables are smoke tests, "
                "not tunings for configs/autotune")
    if args.shapes is None and args.quick:
        args.shapes_doc = QUICK_SHAPES
    else:
        args.shapes_doc = load_shapes(args.shapes or DEFAULT_SHAPES, args.family, p.error)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.kernels:
        print(kernel_table())
        return 0
    gpu = runtime.device_name()
    path = args.out or tune.table_path(gpu)
    smem = None
    if not flame.is_interpreter():
        props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
        smem = props["max_shared_mem"]
    ctx = Ctx(dtype=DTYPES[args.dtype], quick=args.quick, smem=smem)
    try:
        table = load_table(path, gpu)
        problems = [(family, problem) for family, problem in enumerate_problems(args.family, args.shapes_doc, ctx)
                    if args.problems is None or problem.name.endswith(args.problems)]
        print(f"autotune on {gpu} (triton {triton.__version__}), {args.dtype}, families {', '.join(args.family)}: "
              f"{len(problems)} launches; table {path}")
        if flame.is_interpreter():
            print("note: no GPU -- kernels run in Triton's interpreter, so these times mean nothing")
        compile_ahead = CompileAhead(args.jobs, args, ctx)
        try:
            outcomes, left, seen, kept = run(problems, table, path, gpu, ctx, args, compile_ahead)
        finally:
            compile_ahead.close()
    except (Fatal, NotTunable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_summary(outcomes)
    if compile_ahead.compiled:
        print(f"\n{compile_ahead.compiled} candidates compiled ahead by {args.jobs} worker processes")
    done = sum(1 for _, o in outcomes if o.entry)
    print(f"\n{done} keys tuned now, {kept} already in the table, {len(seen)} distinct keys met")
    if left:
        print(f"--budget-minutes {args.budget_minutes:g} spent: {left} launches left; "
              "run the same command again to continue")
    if done:
        print(f"wrote {path}")
    return 1 if any(o.error or o.rejected for _, o in outcomes) else 0


def run(problems, table, path, gpu, ctx, args, compile_ahead=lambda index, kernel, configs, footprint=0: None):
    """Tune ``problems`` into ``table`` (written to ``path`` after every key), compiling each
    stage's candidates ahead with ``compile_ahead(problem index, kernel, configs, footprint=the
    problem's GPU bytes)``. Returns (outcomes, how many launches the budget left undone, the
    (kernel, key)s met, how many were already in the table)."""
    deadline = _clock() + 60 * args.budget_minutes if args.budget_minutes else math.inf
    outcomes, seen, kept = [], set(), 0
    torch.manual_seed(0)
    with tuning_session(), tqdm(total=len(problems), unit="launch", desc="autotune", dynamic_ncols=True) as bar:
        for i, (fam, p) in enumerate(problems):
            bar.set_postfix_str(p.name)
            if _clock() > deadline:
                return outcomes, len(problems) - i, seen, kept
            before = _gpu_memory_mark()
            bench = p.build()
            launch, problem = probe(p.name, bench, ctx.dtype)
            footprint = _gpu_memory_peak_since(before)
            ident = (launch.kernel, launch.key)
            entry = table.get((launch.kernel, launch.dtype), {}).get(launch.key)
            known = entry is not None and tune.this_release(entry.get("triton"))  # another release's: tune again
            if ident in seen or (known and not args.force):
                kept += ident not in seen
                seen.add(ident)
                bar.update(1)
                continue
            seen.add(ident)
            if problem:
                out = Outcome(p.name, launch, error=f"the heuristic default {launch.default} disagrees with "
                                                    f"PyTorch: {problem}")
            else:
                incumbent = entry["config"] if entry is not None else None
                out = tune_launch(p.name, bench, launch, ctx, deadline,
                                  functools.partial(compile_ahead, i, launch.kernel, footprint=footprint),
                                  incumbent)
                if out is None:
                    return outcomes, len(problems) - i, seen, kept
            for cfg, why in out.rejected:
                bar.write(f"REJECTED {launch.kernel} {list(launch.key)} ({p.name}) config {cfg}: {why}")
            if out.entry:
                table.setdefault((launch.kernel, launch.dtype), {})[launch.key] = out.entry
                tune.write_table(path, table, gpu)
            outcomes.append((fam, out))
            bar.update(1)
    return outcomes, 0, seen, kept


if __name__ == "__main__":
    sys.exit(main())
