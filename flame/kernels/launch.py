"""One entry point for every kernel launch, with a thin host path on CUDA.

``launch(kernel, grid, *args, **meta)`` is ``kernel[grid](*args, **meta)``. Triton's own launch
path rebinds and re-specialises every argument and rebuilds its cache key on each call (tens of
microseconds per launch on the H100/H200 hosts, more than many kernels take to run). Here the
compiled kernel is cached under a key that captures exactly what Triton specialises on — each
pointer's dtype and 16-byte alignment, each integer's width and whether it equals 1 or is a
multiple of 16 (unless the kernel opts out with ``do_not_specialize``), the constexprs and launch
options — and later calls go straight to the compiled kernel's launcher.

The first call of every key goes through Triton (compiling if needed); if the direct call is not
available (the interpreter, or a Triton whose CompiledKernel lacks the launcher fields this uses),
every call does. Set ``FLAME_TRITON_LAUNCH=1`` to force Triton's path, e.g. under a profiler
that relies on Triton's launch hooks, which the direct path does not call.
"""
from __future__ import annotations

import os

import torch

from .. import runtime

if not runtime.INTERPRETER:
    from triton.runtime.driver import driver as _driver

_INT32 = (-(2 ** 31), 2 ** 31)
_direct = not runtime.INTERPRETER and os.environ.get("FLAME_TRITON_LAUNCH", "") != "1"
_cache: dict = {}
_no_spec: dict = {}


def _nospec_flags(kernel, nargs):
    flags = _no_spec.get(kernel)
    if flags is None:
        names = kernel.arg_names
        dns = set(kernel.do_not_specialize or ())
        flags = tuple((names[i] in dns or i in dns) for i in range(nargs))
        _no_spec[kernel] = flags
    return flags


def _arg_key(args, nospec):
    key = []
    append = key.append
    for a, ns in zip(args, nospec):
        if isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, bool):
            append(("b", a))
        elif isinstance(a, int):
            fits = _INT32[0] <= a < _INT32[1]
            append(fits if ns else (fits, a == 1, a & 15 == 0))
        elif isinstance(a, float):
            append("f")
        else:
            append((type(a), a))
    return tuple(key)


def launch(kernel, grid, *args, **meta):
    """Launch ``kernel`` on ``grid`` (a tuple of up to 3 ints): ``kernel[grid](*args, **meta)``.

    ``args`` are the kernel's leading runtime arguments in order; ``meta`` holds its trailing
    constexprs and launch options (num_warps, num_stages).
    """
    global _direct
    if not _direct:
        kernel[grid](*args, **meta)
        return
    key = (kernel, _arg_key(args, _nospec_flags(kernel, len(args))), tuple(meta.items()))
    entry = _cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        try:
            consts = tuple(meta[name] for name in kernel.arg_names[len(args):])
            _cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, consts)
        except (AttributeError, KeyError, TypeError):  # an unexpected Triton: keep its own path
            _direct = False
        return
    run, function, packed, consts = entry
    active = _driver.active
    stream = active.get_current_stream(active.get_current_device())
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, stream, function, packed, None, None, None, *args, *consts)
