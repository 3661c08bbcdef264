"""What the scripts share: dtypes by name, the correctness tolerance, the SDXL shapes file, timers
and a run's environment (card, versions, command, commit).

A script imports it as ``import common`` after putting ``scripts/`` on ``sys.path`` (a script in
``scripts/`` has it there already: Python puts the script's folder first); importing it puts the
checkout's root on the path too, so flame imports without installing.
"""
from __future__ import annotations

import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# isort: off
import flame  # first: selects the backend (the interpreter sets TRITON_INTERPRET) before triton is imported
from flame import autotune
import torch
import triton
import triton.testing
# isort: on

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (the names of ``DTYPES``; other dtypes as torch spells them)."""
    return next((name for name, dt in DTYPES.items() if dt == dtype), str(dtype).replace("torch.", ""))


# ---- tolerance ---------------------------------------------------------------------------------

# The library's bound (flame.autotune.CHECK_TOL): the largest error against a reference, as a
# fraction of the reference's largest magnitude. scripts/autotune.py checks candidates with it.
CHECK_TOL = autotune.CHECK_TOL

# bench.py checks each case before timing it, against PyTorch and after whole forward+backward
# passes: both sides round their intermediates to the compute dtype, in different orders (a conv's
# weight gradient sums 16384 bf16 products per element, attention's backward recomputes P), where
# the library compares two launch configs of one kernel on the same inputs. So bench allows this
# many times the library's bound (bf16 5e-2, fp16 1e-2: the values bench used before the bound was
# shared), relative to max(1, largest magnitude). It only has to catch a broken case: a wrong
# kernel is off by the output's own size.
BENCH_SLACK = 2.5


def mismatch(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None,
             slack: float = BENCH_SLACK) -> str | None:
    """None when ``got`` matches ``want`` within ``slack`` x ``CHECK_TOL[dtype]`` (default: ``want``'s
    dtype) of max(1, max |want|), else why not (shape, dtype or the error)."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return f"flame {tuple(got.shape)} {got.dtype} vs torch {tuple(want.shape)} {want.dtype}"
    g64, w64 = got.detach().double().cpu(), want.detach().double().cpu()
    err = float((g64 - w64).abs().max()) if g64.numel() else 0.0
    scale = float(w64.abs().max()) if w64.numel() else 0.0
    tol = slack * CHECK_TOL.get(dtype or want.dtype, 1e-2) * max(1.0, scale)
    return None if err <= tol else f"max abs error {err:.3g} > {tol:.3g}"  # NaN fails too


# ---- shapes ------------------------------------------------------------------------------------

SDXL_SHAPES = ROOT / "configs" / "autotune" / "shapes" / "sdxl.yaml"
# Sections renamed after their family (issue 50: one name per family); files with the old names still read.
SECTION_ALIASES = {"linear": "matmul", "conv": "conv2d"}


def load_shapes(path: Path = SDXL_SHAPES) -> dict[str, list[tuple]]:
    """{section: [shape tuple, ...]} of a shapes file (YAML: sections of integer lists), unchecked."""
    import yaml  # only the scripts that read a shapes file need PyYAML

    doc = yaml.safe_load(Path(path).read_text()) or {}
    return {SECTION_ALIASES.get(section, section): [tuple(row) for row in rows] for section, rows in doc.items()}


_sdxl: dict[str, list[tuple]] = {}


def sdxl_rows(section: str, rows) -> list[tuple]:
    """``rows`` (shape tuples of ``section``), each checked to be a row of the SDXL shapes file: a
    script that times a subset of SDXL's problems takes them from that file's problems, so the two
    cannot drift apart. Raises ``ValueError`` naming a row the file lacks."""
    if not _sdxl:
        _sdxl.update(load_shapes())
    rows = [tuple(r) for r in rows]
    known = set(_sdxl.get(section, ()))
    missing = [r for r in rows if r not in known]
    if missing:
        raise ValueError(f"{SDXL_SHAPES.relative_to(ROOT)}: section {section!r} has no row {list(missing[0])}")
    return rows


# ---- timers ------------------------------------------------------------------------------------

def sync() -> None:
    """Wait for flame's and PyTorch's queued GPU work (nothing to wait for on the interpreter)."""
    flame.synchronize()
    if torch.cuda.is_available() and not flame.is_interpreter():
        torch.cuda.synchronize()


def wall_times(fn, calls: int, warmup: int = 0, sync=sync) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn`` (after ``warmup`` calls), each between two
    ``sync()`` calls: what a user waits, launches and host work included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def host_us_per_op(fn, warmup: int, iters: int, ops: int = 1) -> float:
    """Microseconds of host time per op: ``iters`` calls of ``fn`` (``ops`` ops each) in a loop
    that is synchronised only at its end, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / (iters * ops)


def device_ms(fn, warmup: int, rep: int, interpreter_calls: int = 5) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` (``warmup`` ms, then ``rep`` ms of
    calls; eager, so a call's host work counts where it outlasts its kernels). do_bench needs CUDA
    events: on the interpreter, the median host time of ``interpreter_calls`` calls after one."""
    if not flame.is_interpreter():
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return 1e3 * statistics.median(wall_times(fn, interpreter_calls, warmup=1))


# CUDA-graph replays, the kernels' device time alone (median ms; None when fn cannot be captured).
graph_ms = autotune.graph_time_ms


def captured(fn):
    """A ``torch.cuda.CUDAGraph`` of ``fn``'s launches (captured after one eager call), or None
    where capturing fails (a host sync, an uncapturable call): time such a call eagerly."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    except Exception:
        torch.cuda.synchronize()
        return None


# ---- the run -----------------------------------------------------------------------------------

def git_commit(root=ROOT) -> tuple[str | None, bool]:
    """(short commit of the checkout at ``root``, whether tracked files differ from it); (None, False)
    where ``root`` is not a checkout's top level: a copied tree on a GPU machine, or an exported
    snapshot inside another checkout, whose commit would be the outer one's (``bench_tables.py add
    --commit`` fills it)."""
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return None, False
        return git("rev-parse", "--short=12", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, False


def environment(script: str, argv) -> dict:
    """Where and when a run happens: card, backend, date (UTC), versions, the command and the commit."""
    commit, dirty = git_commit()
    return {
        "gpu": torch.cuda.get_device_name() if not flame.is_interpreter() else None,
        "device": flame.device_name(),
        "backend": "interpreter" if flame.is_interpreter() else "cuda",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flame": flame.__version__,
        "python": platform.python_version(),
        "command": " ".join([f"scripts/{script}", *argv]),
        "commit": commit,
        "dirty": dirty,
    }
