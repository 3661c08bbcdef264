"""Compiling a run's kernels ahead of it, in parallel processes: a cold start without the wait.

A process started with ``FLAME_RECORD_KERNELS=FILE`` appends one JSON line to ``FILE`` for every
kernel variant it launches for the first time (``launch.note_variant``): the kernel's
module and name, what Triton specialises each argument on (a tensor's dtype and 16-byte alignment,
a TMA descriptor's dtype and block shape, and a Gluon one's also its shared layout; an int's value,
a float's type, a bool, None) and the constexprs and launch options. ``compile_ahead(FILE, jobs)``
hands the lines to ``jobs`` worker processes, which build stand-in arguments of those kinds on the
GPU and call each kernel's ``warmup`` (compile, no launch) and load the result (which builds its
host launcher): kernels and launchers land in Triton's on-disk cache, where the run that follows
finds them as if it had compiled them itself. The cache is keyed by the kernel's source, the
specialisation and the options, so a line that no longer matches anything (a kernel edited since
the file was written, another GPU) costs its compile and nothing else; a kernel the file lacks
compiles on first use, as without it.

The JSON lines are the whole interface; they depend on nothing but flame's kernel names, so a file
recorded on one machine serves every machine with the same GPU and Triton. A digest of every line
compiled lands in ``flame-compiled-ahead.txt`` in Triton's cache folder, so a warm cache skips the
work (``pending``). ``configs/kernels/<gpu>-triton<version>.jsonl`` holds the lists recorded for
full SDXL runs on the GPUs flame is measured on; the trainer (``train.compile_ahead: auto``)
compiles those and the variants its earlier runs on this machine recorded (``recorded_path``)
in the background while it loads the model (``Background``).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from tqdm import tqdm

try:  # POSIX: one pool per cache folder at a time (_one_pool_at_a_time)
    import fcntl
except ImportError:
    fcntl = None

from .. import runtime, tune
from . import launch
from .launch import descriptor


def _stand_in(a):
    kind = a[0]
    if kind == "tensor":
        buf = runtime.empty((64,), getattr(torch, a[1]))  # the allocator's blocks are 512-byte aligned
        return buf if a[2] else buf[1:]
    if kind in ("descriptor", "gluon_descriptor"):  # a block-sized buffer
        base = runtime.empty(tuple(a[2]), getattr(torch, a[1]))
        shape, strides, block = list(base.shape), list(base.stride()), list(a[2])
        if kind == "descriptor":
            return descriptor(base, shape, strides, block)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
        return GluonDescriptor(base, shape, strides, block, launch.gluon_layout(a[3], a[4]))  # its shared layout
    return 1.5 if kind == "float" else a[1]


def compile_variant(spec):
    """Compile one recorded variant (a parsed line) into Triton's cache and return the compiled
    kernel, its host launcher built."""
    module, name = spec["kernel"].split(":")
    if not module.startswith("flame.kernels."):  # a recorded file names flame's kernels, nothing else
        raise ValueError(f"{module} is not a flame kernel module")
    kernel = getattr(importlib.import_module(module), name)
    meta = {k: tl.dtype(v["tl"]) if isinstance(v, dict) else v for k, v in spec["meta"].items()}
    compiled = kernel.warmup(*[_stand_in(a) for a in spec["args"]], grid=(1,), **meta)
    load = getattr(compiled, "_init_handles", None)
    if load is not None:  # loading builds the host launcher too (C, compiled and cached by Triton < 3.7)
        load()
    return compiled


def _compile_line(line):
    """Compile one recorded variant into Triton's cache: (the line, seconds, error or None)."""
    t0 = time.perf_counter()
    try:
        compile_variant(json.loads(line))
        error = None
    except Exception as e:  # a stale line costs its compile, nothing else
        error = f"{type(e).__name__}: {str(e)[:200]}"
    return line, time.perf_counter() - t0, error


def _worker_init():
    import flame  # noqa: F401 -- selects the device before triton compiles anything
    launch.settle_cache_keys()  # the keys the run will compute (launch.settle_cache_keys says why)


WORKER_BYTES = 1 << 30  # device memory a compile worker may hold (context ~0.5 GB, stand-ins a few MB)
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "configs" / "kernels"
DONE_FILE = "flame-compiled-ahead.txt"


def manifest_name(device_name: str | None = None, model: str = "") -> str:
    """``<gpu-slug>-triton<version>[-<model>].jsonl``: a recorded list serves one GPU model and Triton
    release, and a shipped one one model architecture (SDXL's has no suffix, Flux's ``-flux``)."""
    suffix = f"-{model}" if model else ""
    return f"{tune.slug(device_name or runtime.device_name())}-triton{triton.__version__}{suffix}.jsonl"


def recorded_path() -> Path:
    """Where the trainer records the variants its runs compile, for the next run on this machine:
    ``kernels/<manifest_name()>`` in flame's cache folder (next to ``tune.cache_path()``'s)."""
    return tune.cache_path().parent.parent / "kernels" / manifest_name()


def auto_paths(shipped: bool = True, model: str = "") -> list:
    """The recorded lists that exist for this GPU and Triton: the shipped one of ``model`` (recorded
    for full SDXL runs, or with ``model="flux"`` full Flux.1 runs: ``shipped=False`` leaves it out
    for another architecture), then this machine's."""
    paths = [SHIPPED_DIR / manifest_name(model=model)] if shipped else []
    return [p for p in paths + [recorded_path()] if p.exists()]


def _digest(line: str) -> str:
    return hashlib.sha1(f"{triton.__version__} {line}".encode()).hexdigest()[:20]


def read_lines(path) -> list:
    """The distinct variant lines of a recorded file, in order."""
    with open(path) as f:
        return list(dict.fromkeys(line.strip() for line in f if line.strip()))


def pending(paths, done_file=None) -> list:
    """The distinct lines of ``paths`` (one file or several) not yet compiled into the cache whose
    ``done_file`` lists the digests of the lines compiled ahead into it (None: every line)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    lines = list(dict.fromkeys(line for p in paths for line in read_lines(p)))
    done = set(Path(done_file).read_text().split()) if done_file and Path(done_file).exists() else set()
    return [line for line in lines if _digest(line) not in done]


def compile_ahead(paths, jobs: int | None = None, progress: bool = True, skip_compiled: bool = True) -> dict:
    """Compile every variant recorded in ``paths`` (a file or several) into Triton's on-disk cache,
    ``jobs`` processes at a time (default: the CPU count, at most 32 and at most one per
    ``WORKER_BYTES`` in a quarter of the device's free memory, so a small card keeps room for the
    model loading meanwhile). ``skip_compiled``: leave out the lines already compiled ahead into
    this cache folder. Returns ``{"variants", "failed", "seconds"}`` (the lines compiled now); a
    variant that fails to compile is counted and left to compile on first use. One process at a time
    compiles into a cache folder (``_one_pool_at_a_time``). Does nothing on the interpreter (nothing
    compiles there)."""
    if runtime.INTERPRETER:
        return {"variants": 0, "failed": 0, "seconds": 0.0}
    done_file = _done_file()
    with _one_pool_at_a_time(done_file):
        return _compile_pending(paths, jobs, progress, skip_compiled, done_file)


@contextlib.contextmanager
def _one_pool_at_a_time(done_file):
    """Hold an advisory lock next to ``done_file``: one compile-ahead pool per Triton cache folder at a
    time. Runs started together on one machine (a sweep, the GPU test suite) would otherwise each start
    workers, each with a CUDA context, for the same variants; a later one waits and then finds them
    compiled. Without POSIX locks or a writable folder, no lock."""
    with contextlib.ExitStack() as stack:
        if fcntl is not None:
            try:
                done_file.parent.mkdir(parents=True, exist_ok=True)
                lock = stack.enter_context(open(done_file.with_suffix(".lock"), "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            except OSError:  # a read-only cache folder: no lock
                pass
        yield


def _compile_pending(paths, jobs, progress, skip_compiled, done_file) -> dict:
    lines = pending(paths, done_file if skip_compiled else None)
    t0 = time.perf_counter()
    if not lines:
        return {"variants": 0, "failed": 0, "seconds": 0.0}
    if jobs is None:  # each worker holds a CUDA context and stand-ins: a quarter of the free memory at most
        jobs = min(os.cpu_count() or 1, 32, runtime.free_memory() // 4 // WORKER_BYTES)
    jobs = max(1, min(jobs, len(lines)))
    compiled, failed = [], 0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs, initializer=_worker_init) as pool:
        results = pool.imap_unordered(_compile_line, lines)
        if progress:
            results = tqdm(results, total=len(lines), desc="compiling kernels ahead", unit="kernel")
        for line, _, error in results:
            failed += error is not None
            if error is None:
                compiled.append(_digest(line))
    _mark_done(done_file, compiled)
    return {"variants": len(lines), "failed": failed, "seconds": time.perf_counter() - t0}


def mark_compiled(lines) -> None:
    """Note ``lines`` (variant lines this process compiled: ``launch.take_recorded()``) as compiled
    into Triton's cache folder, so that a later ``compile_ahead`` of a list holding them skips them
    instead of starting workers that would only find them in the cache."""
    if not runtime.INTERPRETER:
        _mark_done(_done_file(), [_digest(line) for line in lines])


def _done_file() -> Path:
    """The list of lines compiled ahead into Triton's cache folder (as Triton resolves it)."""
    return Path(triton.knobs.cache.dir) / DONE_FILE


def _mark_done(done_file, digests):
    if not digests:
        return
    try:
        done_file.parent.mkdir(parents=True, exist_ok=True)
        with open(done_file, "a") as f:
            f.write("".join(d + "\n" for d in digests))
    except OSError:  # a read-only cache: the next run compiles these ahead again
        pass


class Background:
    """``compile_ahead(paths, jobs)`` on a thread (the compiles run in worker processes), for a
    caller with other work meanwhile (the trainer loads its model). ``wait()`` returns its result,
    or None when it failed (``error`` says why): compiling ahead only saves time, so a failure
    costs the compiles on first use and nothing else."""

    def __init__(self, paths, jobs: int | None = None):
        self.result, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(paths, jobs), name="flame-compile-ahead", daemon=True)
        self._thread.start()

    def _run(self, paths, jobs):
        try:
            self.result = compile_ahead(paths, jobs, progress=False)
        except Exception as e:  # reported by wait(), never raised into the run
            self.error = f"{type(e).__name__}: {e}"

    def wait(self) -> dict | None:
        self._thread.join()
        return self.result
