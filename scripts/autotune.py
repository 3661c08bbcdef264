#!/usr/bin/env python3
"""Measure launch configs per kernel and shape on this GPU; write its table for flame.tune.

    PYTHONPATH=. python3 scripts/autotune.py                                # every family, SDXL shapes, bf16
    PYTHONPATH=. python3 scripts/autotune.py --family matmul --budget-minutes 9   # rerun to continue
    python scripts/autotune.py --quick --out /tmp/table.json                # tiny smoke test (CPU too)

For each family, each shape of the shapes file (``configs/autotune/shapes/sdxl.yaml``) and the
dtype, every problem (one launch as flame makes it) is built once with its PyTorch reference (fp32,
no tf32). It first runs as it is, under ``flame.tune.record`` with the tables hidden: that checks
the heuristic default and tells which kernel of ``flame.tune.KERNELS`` runs (the last one the launch
asks for: on Hopper a 16-bit GEMM asks "matmul", then runs "matmul_tma"), its shape key and its
default config. Then each candidate of a pruned config space runs under ``flame.tune.override``:
its output is checked against the reference first (a wrong one is rejected, reported and never
written; one that fails to compile or to fit is skipped), then it is timed with
``triton.testing.do_bench`` (median): a short screen of every candidate, then the fastest few and
the default again with a longer one. The fastest of those goes into the GPU's table (format 1 of
``configs/autotune/README.md``) with its time and the default's. The table is rewritten after
every key, so a run stopped by ``--budget-minutes`` or killed keeps what it finished, and a rerun
skips keys already in the table (``--force`` re-tunes them). Keys repeated across shapes and
families are tuned once. A candidate with large tiles can make the pointer GEMM split K (few
output tiles): the split launches use the candidate too while timing, not at run time.

Adding a family: a function ``fn(ctx, shape) -> list[Problem]`` for one entry of a section of the
shapes file, decorated with ``@family(name, section, fields)``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# isort: off
import flame  # first: selects the backend (the interpreter sets TRITON_INTERPRET) before triton is imported
from flame import io, runtime, tune
from flame.kernels import conv2d as KC
from flame.kernels import matmul as KM
import torch
import triton
import triton.testing
import yaml
from tqdm import tqdm
# isort: on

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Largest error allowed, as a fraction of the reference's largest magnitude: the output's own
# rounding (bf16: 2^-8, fp16: 2^-11) or tf32 products (fp32 on the GPU), with room to spare.
CHECK_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-3}
SCREEN = dict(warmup=2, rep=10)  # do_bench ms for the first pass over every candidate
FINAL = dict(warmup=10, rep=50)  # ... and for the finalists and the default
FINALISTS = 3
DEFAULT_SHAPES = ROOT / "configs" / "autotune" / "shapes" / "sdxl.yaml"
QUICK_SHAPES = {"linear": [(24, 16, 40)], "conv": [(1, 8, 6, 5, 12, 3, 1), (1, 8, 7, 6, 8, 3, 2)]}

# The GEMM config space: tile sides, BLOCK_K with the pipeline depths worth trying for it
# (thinner K slices want deeper pipelines), warps by tile area. --quick: a few tiny tiles.
TILES, K_STAGES = (64, 128, 256), {32: (4,), 64: (3, 4), 128: (2, 3)}
QUICK_TILES, QUICK_K_STAGES = (16, 32), {16: (2,), 32: (2,)}
MAX_TILE_AREA = 128 * 256  # 256 x 256 fp32 accumulators do not fit in registers

# Errors after which the CUDA context is unusable: the run stops rather than skip every later candidate.
CONTEXT_LOST = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction")

_clock = time.monotonic


@dataclasses.dataclass
class Ctx:
    dtype: torch.dtype
    quick: bool
    smem: int | None  # shared memory per block in bytes (None: no limit, the interpreter)

    def randn(self, *shape, scale=1.0, channels_last=False):
        t = (torch.randn(shape, device=runtime.device) * scale).to(self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    def empty(self, *shape, channels_last=False):
        t = torch.empty(shape, device=runtime.device, dtype=self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    def gemm_space(self, m, n, k, group_m):
        """Candidate configs of an (m x k) @ (k x n) tile loop: no block larger than its
        dimension's next power of two (at least 16), stages that fit in shared memory."""
        tiles, k_stages = (QUICK_TILES, QUICK_K_STAGES) if self.quick else (TILES, K_STAGES)
        es = torch.empty((), dtype=self.dtype).element_size()
        pairs = sorted({(_fit(bk, k), s) for bk, stages in k_stages.items() for s in stages})
        space = []
        for bm in sorted({_fit(b, m) for b in tiles}):
            for bn in sorted({_fit(b, n) for b in tiles}):
                area = bm * bn
                if area > MAX_TILE_AREA:
                    continue
                warps = (4,) if self.quick or area < 128 * 128 else (8,) if area > 128 * 128 else (4, 8)
                for (bk, stages), w in ((p, w) for p in pairs for w in warps):
                    if self.smem is not None and (bm * bk + bk * bn) * es * stages > self.smem:
                        continue
                    group = dict(GROUP_M=8) if group_m else {}
                    space.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **group, num_warps=w, num_stages=stages))
        return space


def _fit(block, dim):
    return min(block, max(16, triton.next_power_of_2(dim)))


@dataclasses.dataclass
class Bench:
    """One problem's buffers: ``run()`` launches the kernel writing ``out``; ``want`` is the
    PyTorch reference (fp32)."""

    run: Callable[[], object]
    out: torch.Tensor
    want: torch.Tensor


@dataclasses.dataclass
class Problem:
    """One launch to tune, named for people; ``build()`` allocates its buffers and reference."""

    name: str
    build: Callable[[], Bench]


def candidates(ctx: Ctx, kernel: str, key: tuple) -> list:
    """The configs to try for ``kernel`` at shape ``key``: the GEMM space over (M, N, K) =
    ``key[:3]`` for the tile-loop kernels (every kernel of flame.tune today)."""
    fields = tune.KERNELS[kernel][1]
    if not set(fields) <= {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}:
        raise Fatal(f"no candidate space for kernel {kernel!r} (config fields {list(fields)}): "
                    "add one to scripts/autotune.py candidates()")
    return ctx.gemm_space(*key[:3], group_m="GROUP_M" in fields)


@dataclasses.dataclass
class Family:
    fn: Callable[[Ctx, tuple], list]
    section: str
    fields: tuple
    description: str


FAMILIES: dict[str, Family] = {}


def family(name: str, section: str, fields: tuple):
    """Register ``fn(ctx, shape) -> list[Problem]`` as family ``name``, fed with each entry of the
    shapes file's ``section`` (a tuple of ints named ``fields``)."""

    def deco(fn):
        if name in FAMILIES:
            raise ValueError(f"autotune family {name!r} registered twice")
        FAMILIES[name] = Family(fn, section, tuple(fields), (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


# ---- families ----------------------------------------------------------------------------------

@family("matmul", "linear", ("M", "K", "N"))
def matmul_family(ctx: Ctx, shape) -> list[Problem]:
    """a linear layer's GEMMs (kernel matmul or matmul_tma): x @ W^T, dX = dY @ W, dW = dY^T @ X"""
    m, k, n = shape

    def forward():  # what F.linear(x, W) launches, into a buffer of our own
        x, w, out = ctx.randn(m, k), ctx.randn(n, k, scale=k ** -0.5), ctx.empty(m, n)
        return Bench(lambda: KM.linear_(out, x, w), out, x.float() @ w.float().t())

    def input_grad():  # flame/ops/matmul.py _linear_backward: matmul_(dx, g, w)
        g, w, out = ctx.randn(m, n), ctx.randn(n, k, scale=n ** -0.5), ctx.empty(m, k)
        return Bench(lambda: KM.matmul_(out, g, w), out, g.float() @ w.float())

    def weight_grad():  # ... matmul_(dw, g.t(), x)
        g, x, out = ctx.randn(m, n), ctx.randn(m, k, scale=m ** -0.5), ctx.empty(n, k)
        return Bench(lambda: KM.matmul_(out, g.t(), x), out, g.float().t() @ x.float())

    name = f"linear {m}x{k}->{n}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} dX", input_grad), Problem(f"{name} dW", weight_grad)]


CONV_FIELDS = ("N", "Ci", "H", "W", "Co", "k", "stride")


def _conv_name(shape, what):
    nb, ci, h, w, co, k, s = shape
    return f"{what} {k}x{k}{f' s{s}' if s > 1 else ''} {nb}x{ci}x{h}x{w}->{co}"


def _conv_out_size(size, k, s):
    return (size + 2 * (k // 2) - k) // s + 1


@family("conv2d", "conv", CONV_FIELDS)
def conv2d_family(ctx: Ctx, shape) -> list[Problem]:
    """conv2d's forward (kernel conv2d, or conv2d_tma, matmul for 1x1), channels-last input and weight"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # what F.conv2d launches for a channels-last input, into a buffer of our own
        x = ctx.randn(nb, ci, h, w, channels_last=True)
        wt = ctx.randn(co, ci, k, k, scale=(ci * k * k) ** -0.5, channels_last=True)
        out = ctx.empty(nb, co, ho, wo, channels_last=True)
        want = torch.nn.functional.conv2d(x.float(), wt.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_forward_(out, x, wt, None, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "conv"), build)]


@family("conv2d_dgrad", "conv", CONV_FIELDS)
def conv2d_dgrad_family(ctx: Ctx, shape) -> list[Problem]:
    """conv2d's input gradient (kernel conv2d_dgrad, or conv2d_dgrad_tma, matmul for 1x1), channels-last"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # flame/ops/conv.py _conv2d_backward for a channels-last input
        g = ctx.randn(nb, co, ho, wo, channels_last=True)
        wt = ctx.randn(co, ci, k, k, scale=(co * k * k) ** -0.5, channels_last=True)
        out = ctx.empty(nb, ci, h, w, channels_last=True)
        want = torch.nn.grad.conv2d_input((nb, ci, h, w), wt.float(), g.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_input_grad_(out, g, wt, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "dgrad"), build)]


# ---- measuring ---------------------------------------------------------------------------------

def check(bench: Bench, dtype) -> str | None:
    """None when a launch into the poisoned (NaN) output matches the reference, else why not."""
    bench.out.fill_(math.nan)
    bench.run()
    got, want = bench.out.float(), bench.want
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    tol = CHECK_TOL[dtype] * max(scale, 1e-6)
    if not err <= tol:  # NaN: an output element was never written
        return f"max |error| {err:.3g} > {tol:.3g} ({CHECK_TOL[dtype]} x max |reference| {scale:.3g})"
    return None


def time_ms(fn, warmup, rep) -> float:
    """Median milliseconds per call (on the interpreter: host time of two calls, meaningless)."""
    if flame.is_interpreter():
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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
    kernel = asked[-1][0]
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


def tune_launch(name: str, bench: Bench, launch: Launch, ctx: Ctx, deadline: float) -> Outcome | None:
    """Check and time every candidate config of ``launch`` and its default; None when the budget
    ran out first."""
    out = Outcome(name, launch)
    screened = []
    for cfg in candidates(ctx, launch.kernel, launch.key):
        if cfg == launch.default:
            continue
        if _clock() > deadline:
            return None
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
            continue
        if problem:
            out.rejected.append((cfg, problem))
        else:
            screened.append((ms, cfg))
    finalists = [cfg for _, cfg in sorted(screened, key=lambda t: t[0])[:FINALISTS]]
    default_ms = _timed(launch.kernel, None, bench, FINAL)
    best_ms, best = default_ms, launch.default
    for cfg in finalists:
        ms = _timed(launch.kernel, cfg, bench, FINAL)
        if ms < best_ms:
            best_ms, best = ms, cfg
    out.entry = dict(key=list(launch.key), config=best, ms=_round(best_ms), default_ms=_round(default_ms))
    return out


def _round(ms):
    return float(f"{ms:.4g}")


# ---- the table -----------------------------------------------------------------------------------

class Fatal(Exception):
    """A run that cannot start (or go on): the message says why."""


def _release(version):
    return str(version).split(".")[:2]


def load_table(path: Path, gpu: str) -> dict:
    """{(kernel, dtype name): {key tuple: entry}} of the table at ``path`` (empty if absent or
    written with another Triton release: stale entries are re-tuned)."""
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
    if _release(raw.get("triton")) != _release(triton.__version__):
        print(f"{path}: tuned with Triton {raw.get('triton')}, this is {triton.__version__}: its entries are stale "
              "and every key is tuned afresh")
        return {}
    table = {}
    for kernel, per_dtype in raw["entries"].items():
        for dtype, rows in (per_dtype.items() if isinstance(per_dtype, dict) else ()):
            for row in rows if isinstance(rows, list) else ():
                if isinstance(row, dict) and isinstance(row.get("key"), list):
                    table.setdefault((kernel, dtype), {})[tuple(row["key"])] = row
    return table


def dump_table(table: dict, gpu: str) -> str:
    """Format-1 JSON, one entry per line, kernels, dtypes and keys sorted (small diffs)."""
    head = dict(format=tune.FORMAT, gpu=gpu, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "entries": {']
    kernels = sorted({k for k, _ in table})
    for i, kernel in enumerate(kernels):
        lines.append(f"    {json.dumps(kernel)}: {{")
        dtypes = sorted(d for k, d in table if k == kernel)
        for j, dtype in enumerate(dtypes):
            rows = [json.dumps(e) for _, e in sorted(table[kernel, dtype].items())]
            lines.append(f"      {json.dumps(dtype)}: [")
            lines.append(",\n".join(f"        {r}" for r in rows))
            lines.append("      ]" + ("," if j < len(dtypes) - 1 else ""))
        lines.append("    }" + ("," if i < len(kernels) - 1 else ""))
    return "\n".join(lines + ["  }", "}", ""])


def write_table(path: Path, table: dict, gpu: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dump_table(table, gpu).encode()
    io.atomic_write(path, lambda f: f.write(text))


# ---- the run -----------------------------------------------------------------------------------

@contextlib.contextmanager
def tuning_session():
    """The launchers see no table (the default runs time the heuristics) and PyTorch's fp32
    references use no tf32; both restored afterwards."""
    saved_env = os.environ.get("FLAME_TUNE_DIR")
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with tempfile.TemporaryDirectory() as empty:
        os.environ["FLAME_TUNE_DIR"] = empty
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        tune.reset()
        try:
            yield
        finally:
            if saved_env is None:
                os.environ.pop("FLAME_TUNE_DIR", None)
            else:
                os.environ["FLAME_TUNE_DIR"] = saved_env
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32
            tune.reset()


def enumerate_problems(families, shapes, ctx):
    """Every (family, problem) of the shapes, in order."""
    return [(name, p) for name in families for shape in shapes.get(FAMILIES[name].section, ())
            for p in FAMILIES[name].fn(ctx, shape)]


def _cfg_str(cfg):
    s = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
    return s + (f" g{cfg['GROUP_M']}" if "GROUP_M" in cfg else "")


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
    if not isinstance(doc, dict):
        error(f"--shapes {path}: expected sections {sorted(fields)} of shape lists, got {type(doc).__name__}")
    shapes = {}
    for section, rows in doc.items():
        if section not in fields:
            error(f"--shapes {path}: unknown section {section!r} (known: {', '.join(sorted(fields))})")
        want = fields[section]
        if not isinstance(rows, list):
            error(f"--shapes {path}: section {section!r} must be a list of {list(want)} lists")
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == len(want)
                    and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row)):
                error(f"--shapes {path}: {section}[{i}] = {row!r} is not {len(want)} positive integers {list(want)}")
        shapes[section] = [tuple(r) for r in rows]
    if not any(FAMILIES[f].section in shapes for f in families):
        error(f"--shapes {path}: no shapes for the families {', '.join(families)} "
              f"(sections {', '.join(sorted({FAMILIES[f].section for f in families}))})")
    return shapes


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="families:\n" + "\n".join(f"  {k:<13} {f.description}"
                                                                 for k, f in FAMILIES.items()))
    p.add_argument("--family", action="extend", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                   default=[], help="family to tune (repeatable or comma-separated; default: all)")
    p.add_argument("--shapes", type=Path, default=None,
                   help=f"shapes file (default: {DEFAULT_SHAPES.relative_to(ROOT)}; --quick: built-in tiny shapes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="element type (default bf16)")
    p.add_argument("--budget-minutes", type=_positive_minutes, default=None,
                   help="stop after about this long, keeping every key finished so far")
    p.add_argument("--force", action="store_true", help="re-tune keys that are already in the table")
    p.add_argument("--out", type=Path, default=None,
                   help="table to write (default: configs/autotune/<gpu-slug>.json, or under $FLAME_TUNE_DIR)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and a few candidates (smoke test)")
    args = p.parse_args(argv)
    args.family = list(dict.fromkeys(args.family or FAMILIES))
    if any(n not in FAMILIES for n in args.family):
        p.error(f"unknown family {', '.join(n for n in args.family if n not in FAMILIES)}; "
                f"known: {', '.join(FAMILIES)}")
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
    gpu = runtime.device_name()
    path = args.out or tune.table_path(gpu)
    smem = None
    if not flame.is_interpreter():
        props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
        smem = props["max_shared_mem"]
    ctx = Ctx(dtype=DTYPES[args.dtype], quick=args.quick, smem=smem)
    try:
        table = load_table(path, gpu)
        problems = enumerate_problems(args.family, args.shapes_doc, ctx)
        print(f"autotune on {gpu} (triton {triton.__version__}), {args.dtype}, families {', '.join(args.family)}: "
              f"{len(problems)} launches; table {path}")
        if flame.is_interpreter():
            print("note: no GPU -- kernels run in Triton's interpreter, so these times mean nothing")
        outcomes, left, seen, kept = run(problems, table, path, gpu, ctx, args)
    except (Fatal, NotTunable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_summary(outcomes)
    done = sum(1 for _, o in outcomes if o.entry)
    print(f"\n{done} keys tuned now, {kept} already in the table, {len(seen)} distinct keys met")
    if left:
        print(f"--budget-minutes {args.budget_minutes:g} spent: {left} launches left; "
              "run the same command again to continue")
    if done:
        print(f"wrote {path}")
    return 1 if any(o.error or o.rejected for _, o in outcomes) else 0


def run(problems, table, path, gpu, ctx, args):
    """Tune ``problems`` into ``table`` (written to ``path`` after every key). Returns (outcomes,
    how many launches the budget left undone, the (kernel, key)s met, how many were already in
    the table)."""
    deadline = _clock() + 60 * args.budget_minutes if args.budget_minutes else math.inf
    outcomes, seen, kept = [], set(), 0
    torch.manual_seed(0)
    with tuning_session(), tqdm(total=len(problems), unit="launch", desc="autotune", dynamic_ncols=True) as bar:
        for i, (fam, p) in enumerate(problems):
            bar.set_postfix_str(p.name)
            if _clock() > deadline:
                return outcomes, len(problems) - i, seen, kept
            bench = p.build()
            launch, problem = probe(p.name, bench, ctx.dtype)
            ident = (launch.kernel, launch.key)
            known = launch.key in table.get((launch.kernel, launch.dtype), {})
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
                out = tune_launch(p.name, bench, launch, ctx, deadline)
                if out is None:
                    return outcomes, len(problems) - i, seen, kept
            for cfg, why in out.rejected:
                bar.write(f"REJECTED {launch.kernel} {list(launch.key)} ({p.name}) config {cfg}: {why}")
            if out.entry:
                table.setdefault((launch.kernel, launch.dtype), {})[launch.key] = out.entry
                write_table(path, table, gpu)
            outcomes.append((fam, out))
            bar.update(1)
    return outcomes, 0, seen, kept


if __name__ == "__main__":
    sys.exit(main())
