"""The tuning side of a family: what ``scripts/autotune.py`` tunes.

A family's ``TUNING`` maps a tuning name (the kernel it tunes, without its pass: ``group_norm``
tunes ``group_norm_fwd`` and ``group_norm_bwd``) to a ``Tuning``: a function from the run's ``Ctx``
and one entry of a section of the shapes file (``configs/autotune/shapes/sdxl.yaml``) to the
``Problem`` launches to tune, each built with its PyTorch reference (fp32, no tf32).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
from flame import autotune, runtime
import torch
# isort: on


class Fatal(Exception):
    """A run that cannot start (or go on): the message says why."""


@dataclasses.dataclass
class Ctx(autotune.Space):
    """The run's search spaces (``flame.autotune.Space``: dtype, --quick, shared memory) and
    the buffers of its problems."""

    def randn(self, *shape, scale=1.0, channels_last=False):
        t = (torch.randn(shape, device=runtime.device) * scale).to(self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    def empty(self, *shape, channels_last=False):
        t = torch.empty(shape, device=runtime.device, dtype=self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t


@dataclasses.dataclass
class Bench:
    """One problem's buffers: ``run()`` launches the kernel writing ``out`` (a tensor or a tuple
    of them); ``want`` is the PyTorch reference (fp32, the same structure); ``slack`` scales the
    check's tolerance (``CHECK_TOL``) for outputs rounded more than once."""

    run: Callable[[], object]
    out: torch.Tensor | tuple
    want: torch.Tensor | tuple
    slack: float = 1.0


@dataclasses.dataclass
class Problem:
    """One launch to tune, named for people; ``build()`` allocates its buffers and reference."""

    name: str
    build: Callable[[], Bench]


@dataclasses.dataclass
class Tuning:
    """``fn(ctx, shape) -> list[Problem]``, fed with each entry of the shapes file's ``section`` (a
    tuple of ints named ``fields``; those named in ``flags`` 0 or 1, the others positive);
    ``description`` (default: ``fn``'s first docstring line) for ``--help``; ``quick``: the tiny
    shapes of ``--quick`` (one list per section: the tunings of a section share it); ``kernels``:
    the ``flame.tune.SPECS`` kernels its problems tune (on some GPU: ``matmul_tma`` on Hopper)."""

    fn: Callable[[Ctx, tuple], list]
    section: str
    fields: tuple
    description: str = ""
    flags: tuple = ()
    quick: tuple = ()
    kernels: tuple = ()

    def __post_init__(self):
        self.description = self.description or (self.fn.__doc__ or "").strip().split("\n")[0]


def reference(fn, inputs, dy=None):
    """``fn(*inputs)`` in fp32 PyTorch, or with ``dy`` the gradients of ``inputs`` (None ones stay
    None) from the output gradient ``dy``."""
    leaves = [None if t is None else t.float().requires_grad_(dy is not None) for t in inputs]
    with torch.set_grad_enabled(dy is not None):
        y = fn(*leaves)
        if dy is None:
            return y
        grads = iter(torch.autograd.grad(y, [t for t in leaves if t is not None], dy.float()))
        return tuple(None if t is None else next(grads) for t in leaves)
