"""The benchmark side of a family: what ``scripts/bench.py`` times.

A family's ``BENCH`` is a ``BenchFamily``: a function from the run's ``Ctx`` to ``Case`` rows (the
same computation in flame and in PyTorch), the acceptance ``Target`` bounds its issues set, and the
tunable kernels its cases launch (``flame.tune.SPECS`` names: ``tests/test_kernel_families.py``
checks that every one is benchmarked somewhere).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
import flame
from flame import tune
from flame.autograd import run_backward
import torch
# isort: on


@dataclasses.dataclass
class Ctx:
    dtype: torch.dtype
    quick: bool
    warmup: int  # ms for do_bench; iterations for host timing
    rep: int
    repeat: int = 1  # device-time measurements per side (median taken)
    tuning: str = "table"  # flame's launch configs: "table", "defaults" or "compare" (see --tuning)
    timer: str = "both"  # device cases: "eager", "graph" or "both" (see --timer)
    kernels: bool = False  # per-kernel device times of each device case (see --kernels)
    baseline: str | None = None  # --tuning compare against this table file instead of the heuristics
    interpreter: bool = flame.is_interpreter()

    def baseline_configs(self):
        """The context of --tuning compare's other side: the heuristics, or --baseline-table's file."""
        return tune.table_from(self.baseline) if self.baseline else tune.heuristics_only()

    def shape(self, full, quick_gpu, interp):
        """The problem size for this run: ``full`` normally, smaller under --quick."""
        if not self.quick:
            return full
        return interp if self.interpreter else quick_gpu


@dataclasses.dataclass
class Case:
    """One row: the same computation in flame and in PyTorch.

    ``flame`` and ``torch`` take no arguments and return what they computed (a flame Tensor / a
    torch tensor, or a tuple of them), compared once before timing. ``nbytes`` (memory traffic:
    inputs read + outputs written) or ``flops`` turn times into GB/s or TFLOP/s. ``timer='host'``
    times a Python loop instead (``ops`` flame ops per call; reported as µs per op).
    """

    name: str
    flame: Callable
    torch: Callable
    nbytes: int | None = None
    flops: int | None = None
    timer: str = "device"
    ops: int = 1
    check: bool = True
    note: str = ""
    check_dtype: torch.dtype | None = None  # the check's tolerance for every output (default: each output's dtype)


@dataclasses.dataclass(frozen=True)
class Target:
    """An issue's acceptance bound on flame/PyTorch time ratios: ``stat`` of the ratios of the
    cases whose names ``select`` picks ("max": every case; "geo": their geometric mean) must be at
    most ``bound`` (below it with ``strict``). Checked on full-size runs, for each timer."""

    text: str
    select: Callable[[str], bool]
    stat: str
    bound: float
    strict: bool = False


@dataclasses.dataclass(frozen=True)
class BenchFamily:
    """``scripts/bench.py --family NAME``: ``cases(ctx) -> list[Case]``, described in one line for
    ``--list``, with its issues' ``targets`` and the tunable ``kernels`` its cases launch;
    ``aliases``: names it had before it took its kernel file's (commands in the docs use them)."""

    name: str
    description: str
    cases: Callable[[Ctx], list[Case]]
    targets: tuple[Target, ...] = ()
    kernels: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


def starts(prefix, *parts, without=()):
    """A case selector: names starting with ``prefix`` that contain every one of ``parts`` and
    none of ``without``."""
    return lambda name: (name.startswith(prefix) and all(p in name for p in parts)
                         and not any(w in name for w in without))


def randn(*shape, dtype, requires_grad=False):
    """A flame tensor and the torch tensor sharing its memory."""
    x = flame.randn(*shape, dtype=dtype)
    t = x.to_torch()
    if requires_grad:
        x.requires_grad_()
        t = t.detach().clone().requires_grad_()
    return x, t


def leaf(shape, dtype, channels_last=False):
    """``randn`` of a leaf that requires grad, in channels-last memory when asked."""
    x, t = randn(*shape, dtype=dtype, requires_grad=True)
    if channels_last:
        t = t.detach().to(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(t.detach().clone(), requires_grad=True)
    return x, t


def element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fwd_bwd_cases(name, f_fn, t_fn, f_inputs, t_inputs, g, tg, nbytes=None, flops=None, bwd_factor=2.0,
                  check_dtype=None):
    """A forward case (no graph) and a forward+backward case for one op; ``f_fn(*inputs)`` and
    ``t_fn(*inputs)`` compute it, ``g``/``tg`` is the incoming gradient. Backward work is counted as
    ``bwd_factor`` times the forward's; ``check_dtype``: see ``Case``. Both sides return the gradients
    of the inputs that require them, as ``torch.autograd.grad`` does: flame's backward stops at the
    inputs (no accumulation into fp32 leaf gradients, which torch's side does not do either)."""
    f_leaves = [x for x in f_inputs if isinstance(x, flame.Tensor) and x.requires_grad]
    t_leaves = [x for x in t_inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    boundary = {x.id for x in f_leaves}

    def f_fwd():
        with flame.no_grad():
            return f_fn(*f_inputs)

    def t_fwd():
        with torch.no_grad():
            return t_fn(*t_inputs)

    def f_bwd():
        _, grads = run_backward(f_fn(*f_inputs), g, boundary=boundary)
        return tuple(grads[x.id].to(x.dtype) for x in f_leaves)

    def t_bwd():
        return torch.autograd.grad(t_fn(*t_inputs), t_leaves, tg)

    scale = 1 + bwd_factor
    return [
        Case(f"fwd {name}", f_fwd, t_fwd, nbytes=nbytes, flops=flops, check_dtype=check_dtype),
        Case(f"fwd+bwd {name}", f_bwd, t_bwd, nbytes=None if nbytes is None else int(nbytes * scale),
             flops=None if flops is None else int(flops * scale), check_dtype=check_dtype),
    ]

