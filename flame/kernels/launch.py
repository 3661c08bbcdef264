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

_direct = not runtime.INTERPRETER and os.environ.get("FLAME_TRITON_LAUNCH", "") != "1"
_caches: dict = {}  # id(kernel) -> {key: (run, function, packed metadata, constexpr values)}
_no_spec: dict = {}  # id(kernel) -> per-argument "do not specialize" flags
_tensor_args: dict = {}  # id(kernel) -> positions of its tensor arguments
_device = None
launches = 0  # every launch() so far: tests count kernel launches with it


def _nospec_flags(kernel, nargs):
    names = kernel.arg_names
    dns = set(kernel.do_not_specialize or ())
    return tuple((names[i] in dns or i in dns) for i in range(nargs))


def _arg_key(args, nospec):
    """What Triton specialises on, per argument (see the module docstring)."""
    key = []
    append = key.append
    for a, ns in zip(args, nospec):
        t = type(a)
        if t is int:
            fits = -2147483648 <= a < 2147483648
            append(fits if ns else fits + 2 * (a == 1) + 4 * (a & 15 == 0))
        elif t is float:
            append(-1)
        elif t is bool:
            append(("b", a))
        elif isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15 == 0))
        else:
            append((t, a))
    return tuple(key)


def launch(kernel, grid, *args, sig=None, **meta):
    """Launch ``kernel`` on ``grid`` (a tuple of up to 3 ints): ``kernel[grid](*args, **meta)``.

    ``args`` are the kernel's leading runtime arguments in order; ``meta`` holds its trailing
    constexprs and launch options (num_warps, num_stages). A caller that has already pinned down
    everything except the tensors may pass ``sig``: a hashable that determines the
    specialisation of every non-tensor argument and ``meta``; the key then only adds each
    tensor's dtype and alignment, skipping the per-argument inspection.
    """
    global _direct, _device, launches
    launches += 1
    if not _direct:
        kernel[grid](*args, **meta)
        return
    kid = id(kernel)
    cache = _caches.get(kid)
    if cache is None:
        cache = _caches[kid] = {}
        _no_spec[kid] = _nospec_flags(kernel, len(args))
        _tensor_args[kid] = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if sig is None:
        key = (_arg_key(args, _no_spec[kid]), tuple(meta.items()))
    else:
        key = (sig, *[(args[i].dtype, args[i].data_ptr() & 15 == 0) for i in _tensor_args[kid]])
    entry = cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        try:
            consts = tuple(meta[name] for name in kernel.arg_names[len(args):])
            cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, consts)
        except (AttributeError, KeyError, TypeError):  # an unexpected Triton: keep its own path
            _direct = False
        return
    run, function, packed, consts = entry
    if _device is None:
        _device = _driver.active.get_current_device()
    stream = _driver.active.get_current_stream(_device)
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, packed, None, None, None,
        *args, *consts)
