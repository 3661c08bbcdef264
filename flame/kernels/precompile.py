"""Compiling a run's kernels ahead of it, in parallel processes: a cold start without the wait.

A process started with ``FLAME_RECORD_KERNELS=FILE`` appends one JSON line to ``FILE`` for every
kernel variant it launches for the first time (``launch.note_variant``): the kernel's
module and name, what Triton specialises each argument on (a tensor's dtype and 16-byte alignment,
a TMA descriptor's dtype and block shape, an int's value, a float's type, a bool, None) and the
constexprs and launch options. ``compile_ahead(FILE, jobs)`` hands the lines to ``jobs`` worker
processes, which build stand-in arguments of those kinds on the GPU and call each kernel's
``warmup`` (compile, no launch): the compiled kernels land in Triton's on-disk cache, where the run
that follows finds them as if it had compiled them itself. The cache is keyed by the kernel's
source, the specialisation and the options, so a line that no longer matches anything (a kernel
edited since the file was written, another GPU) costs its compile and nothing else; a kernel the
file lacks compiles on first use, as without it.

The JSON lines are the whole interface; they depend on nothing but flame's kernel names, so a file
recorded on one machine serves every machine with the same GPU and Triton.
"""
from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import time

import torch
import triton.language as tl
from tqdm import tqdm

from .. import runtime
from .launch import TensorDescriptor


def _stand_in(a):
    kind = a[0]
    if kind == "tensor":
        buf = runtime.empty((64,), getattr(torch, a[1]))  # the allocator's blocks are 512-byte aligned
        return buf if a[2] else buf[1:]
    if kind == "descriptor":
        base = runtime.empty(tuple(a[2]), getattr(torch, a[1]))
        return TensorDescriptor(base, list(base.shape), list(base.stride()), list(a[2]))
    return 1.5 if kind == "float" else a[1]


def _compile_line(line):
    """Compile one recorded variant into Triton's cache: (kernel name, seconds, error or None)."""
    spec = json.loads(line)
    t0 = time.perf_counter()
    try:
        module, name = spec["kernel"].split(":")
        if not module.startswith("flame.kernels."):  # a recorded file names flame's kernels, nothing else
            raise ValueError(f"{module} is not a flame kernel module")
        kernel = getattr(importlib.import_module(module), name)
        meta = {k: tl.dtype(v["tl"]) if isinstance(v, dict) else v for k, v in spec["meta"].items()}
        kernel.warmup(*[_stand_in(a) for a in spec["args"]], grid=(1,), **meta)
        error = None
    except Exception as e:  # a stale line costs its compile, nothing else
        error = f"{type(e).__name__}: {str(e)[:200]}"
    return spec["kernel"], time.perf_counter() - t0, error


def _worker_init():
    import flame  # noqa: F401 -- selects the device before triton compiles anything


def read_lines(path) -> list:
    """The distinct variant lines of a recorded file, in order."""
    with open(path) as f:
        return list(dict.fromkeys(line.strip() for line in f if line.strip()))


def compile_ahead(path, jobs: int | None = None, progress: bool = True) -> dict:
    """Compile every variant recorded in ``path`` into Triton's on-disk cache, ``jobs`` processes
    at a time (default: the CPU count, at most 32). Returns ``{"variants", "failed", "seconds"}``;
    a variant that fails to compile is counted and left to compile on first use. Does nothing on
    the interpreter (nothing compiles there)."""
    if runtime.INTERPRETER:
        return {"variants": 0, "failed": 0, "seconds": 0.0}
    lines = read_lines(path)
    jobs = max(1, min(jobs or os.cpu_count() or 1, 32, len(lines)))
    t0 = time.perf_counter()
    failed = 0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs, initializer=_worker_init) as pool:
        results = pool.imap_unordered(_compile_line, lines)
        if progress:
            results = tqdm(results, total=len(lines), desc="compiling kernels ahead", unit="kernel")
        for _, _, error in results:
            failed += error is not None
    return {"variants": len(lines), "failed": failed, "seconds": time.perf_counter() - t0}
