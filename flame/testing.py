"""Testing utilities: a finite-difference gradient checker in float64, and a smaller card's
shared memory simulated on a larger one."""
from __future__ import annotations

import os

import numpy as np

from . import runtime
from .autograd import grad as _grad
from .autograd import no_grad
from .ops.creation import tensor
from .tensor import Tensor, float64


def _as_output(out):
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: fn must return a flame Tensor, got {type(out).__name__}")
    return out


def gradcheck(fn, inputs, eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-3,
              seed: int = 0, raise_exception: bool = True) -> bool:
    """Compare ``fn``'s analytical gradients against central finite differences.

    ``inputs`` is a sequence of arguments; every ``Tensor`` among them with ``requires_grad``
    must be float64. The output (any shape) is reduced to a scalar ``L = sum(out * v)`` with a
    fixed random ``v``, so one backward gives the analytical gradient of every input; the
    numerical gradient perturbs each element by ``±eps``. Returns True, or raises
    ``AssertionError`` naming the input and the worst element (returns False when
    ``raise_exception=False``).
    """

    inputs = list(inputs)
    wrt = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    if not wrt:
        raise ValueError("gradcheck: no input requires grad")
    for i in wrt:
        if inputs[i].dtype != float64:
            raise TypeError(f"gradcheck: input {i} must be float64 for finite differences, got {inputs[i].dtype}")

    out = _as_output(fn(*inputs))
    rng = np.random.default_rng(seed)
    v = tensor(rng.standard_normal(out.shape), dtype=out.dtype)

    def objective(args):
        with no_grad():
            return float((fn(*args) * v).sum().item())

    analytical = _grad((out * v).sum(), [inputs[i] for i in wrt], allow_unused=True)
    for k, i in enumerate(wrt):
        base = inputs[i].numpy()
        numeric = np.zeros_like(base)
        flat = base.reshape(-1)
        for j in range(flat.size):
            plus, minus = flat.copy(), flat.copy()
            plus[j] += eps
            minus[j] -= eps
            args_p, args_m = list(inputs), list(inputs)
            args_p[i] = tensor(plus.reshape(base.shape))
            args_m[i] = tensor(minus.reshape(base.shape))
            numeric.reshape(-1)[j] = (objective(args_p) - objective(args_m)) / (2 * eps)
        got = np.zeros_like(base) if analytical[k] is None else analytical[k].numpy()
        err = np.abs(got - numeric)
        bad = err > atol + rtol * np.abs(numeric)
        if bad.any():
            worst = np.unravel_index(np.argmax(err - rtol * np.abs(numeric)), base.shape)
            msg = (f"gradcheck failed for input {i} (shape {base.shape}) at index {tuple(int(w) for w in worst)}: "
                   f"analytical {got[worst]:.8g} vs numerical {numeric[worst]:.8g} "
                   f"({int(bad.sum())} of {bad.size} elements off)")
            if raise_exception:
                raise AssertionError(msg)
            return False
    return True


def simulate_shared_memory_limit(limit_bytes: int | None = None) -> None:
    """Make Triton refuse kernels that need more than ``limit_bytes`` of shared memory per block, as
    it does on a card that has only that much (Ampere consumer and Ada cards: 101376; the A100:
    166912), so that a Hopper card runs what such a card would. ``limit_bytes`` defaults to the
    environment variable ``FLAME_TEST_MAX_SHARED_MEMORY``; without either, or on the interpreter,
    nothing changes. Call it before the first kernel launch of the process."""
    if limit_bytes is None:
        limit_bytes = int(os.environ.get("FLAME_TEST_MAX_SHARED_MEMORY") or 0)
    if not limit_bytes or runtime.is_interpreter():
        return
    import triton.compiler.compiler as compiler
    real = compiler.max_shared_mem
    compiler.max_shared_mem = lambda device: min(real(device), limit_bytes)
