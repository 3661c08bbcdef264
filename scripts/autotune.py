#!/usr/bin/env python3
"""Measure launch configs per kernel and shape on this GPU; write its table for flame.tune.

    PYTHONPATH=. python3 scripts/autotune.py                                # every family, SDXL shapes, bf16
    PYTHONPATH=. python3 scripts/autotune.py --family matmul --budget-minutes 9   # rerun to continue
    PYTHONPATH=. python3 scripts/autotune.py --family attention --budget-minutes 9
    PYTHONPATH=. python3 scripts/autotune.py --family group_norm,layer_norm --budget-minutes 9
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
config fields, heuristic, search space) next to the ``@triton.jit`` and registers it; here, a
function ``fn(ctx, shape) -> list[Problem]`` for one entry of a section of the shapes file,
decorated with ``@family(name, section, fields, flags)`` (with a tiny shape in ``QUICK_SHAPES``);
and that section in the shapes file. ``--kernels`` lists the registered kernels.
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (also when imported by path)

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame import autotune, runtime, tune
from flame.kernels import attention as KA
from flame.kernels import conv2d as KC
from flame.kernels import elementwise as KE
from flame.kernels import matmul as KM
from flame.kernels import norms as KN
from flame.kernels import reduce as KR
from flame.kernels import softmax as KS
import torch
import triton
import triton.testing
import yaml
from tqdm import tqdm
# isort: on

ROOT = common.ROOT
DTYPES = common.DTYPES
# Largest error allowed, as a fraction of the reference's largest magnitude: the library's check of
# a tuned config (flame.autotune.CHECK_TOL), the same job.
CHECK_TOL = common.CHECK_TOL
SCREEN = dict(warmup=2, rep=10)  # ms of timing (time_ms) for the first pass over every candidate
FINAL = dict(warmup=10, rep=50)  # ... and for the finalists and the default
DEFAULT_SHAPES = common.SDXL_SHAPES
QUICK_SHAPES = {"linear": [(24, 16, 40)], "conv": [(1, 8, 6, 5, 12, 3, 1), (1, 8, 7, 6, 8, 3, 2)],
                "attention": [(1, 2, 24, 136, 16, 0), (1, 2, 24, 9, 16, 1)],  # the interpreter's long, short K/V
                "group_norm": [(1, 6, 5, 7, 3, 1, 1), (2, 4, 3, 5, 2, 0, 0)],  # channels-last + SiLU, NCHW
                "layer_norm": [(10, 24, 0), (7, 40, 1)],  # LayerNorm, RMSNorm
                "softmax": [(10, 40, 0), (7, 100, 1)], "cross_entropy": [(7, 100)],  # softmax, log_softmax
                "elementwise": [(1, 3, 5, 7)], "reduce": [(1, 40, 24), (6, 100, 1)]}  # column sum, row sum

# Errors after which the CUDA context is unusable: the run stops rather than skip every later candidate.
CONTEXT_LOST = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction")

_clock = time.monotonic


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


def search_stages(ctx: Ctx, kernel: str, key: tuple) -> list:
    """``flame.autotune.search_stages`` for this run's dtype, shared memory and --quick."""
    try:
        return autotune.search_stages(ctx, kernel, key)
    except LookupError as e:
        raise Fatal(str(e)) from None


@dataclasses.dataclass
class Family:
    fn: Callable[[Ctx, tuple], list]
    section: str
    fields: tuple
    description: str
    flags: tuple = ()  # fields that are 0 or 1 (the others are positive)


FAMILIES: dict[str, Family] = {}


def family(name: str, section: str, fields: tuple, flags: tuple = ()):
    """Register ``fn(ctx, shape) -> list[Problem]`` as family ``name``, fed with each entry of the
    shapes file's ``section`` (a tuple of ints named ``fields``; those named in ``flags`` 0 or 1,
    the others positive)."""

    def deco(fn):
        if name in FAMILIES:
            raise ValueError(f"autotune family {name!r} registered twice")
        FAMILIES[name] = Family(fn, section, tuple(fields), (fn.__doc__ or "").strip().split("\n")[0], tuple(flags))
        return fn

    return deco


# ---- families ----------------------------------------------------------------------------------

@family("matmul", "linear", ("M", "K", "N"))
def matmul_family(ctx: Ctx, shape) -> list[Problem]:
    """a linear layer's GEMMs (kernel matmul or matmul_tma): x @ W^T + b, dX = dY @ W, dW = dY^T @ X"""
    m, k, n = shape

    # the forward is what F.linear(x, W, b) launches, into a buffer of our own: SDXL's feed-forward, output and
    # projection layers have a bias, and the bias epilogue moved one H100 entry's ranking by 6% (timed without it, a
    # config won that the bench, with it, measured slower)
    def forward():
        x, w, b, out = ctx.randn(m, k), ctx.randn(n, k, scale=k ** -0.5), ctx.randn(n), ctx.empty(m, n)
        return Bench(lambda: KM.linear_(out, x, w, b), out, torch.addmm(b.float(), x.float(), w.float().t()))

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
    """conv2d's forward (kernel conv2d, or conv2d_tma, conv2d_fold for few channels, matmul for 1x1), channels-last"""
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
    """conv2d's input gradient (kernel conv2d_dgrad, or conv2d_dgrad_tma, conv2d_fold, matmul for 1x1), channels-last"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # flame/ops/conv.py _conv2d_backward for a channels-last input
        g = ctx.randn(nb, co, ho, wo, channels_last=True)
        wt = ctx.randn(co, ci, k, k, scale=(co * k * k) ** -0.5, channels_last=True)
        out = ctx.empty(nb, ci, h, w, channels_last=True)
        want = torch.nn.grad.conv2d_input((nb, ci, h, w), wt.float(), g.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_input_grad_(out, g, wt, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "dgrad"), build)]


@family("conv2d_wgrad", "conv", CONV_FIELDS)
def conv2d_wgrad_family(ctx: Ctx, shape) -> list[Problem]:
    """conv2d's weight gradient (kernel conv2d_wgrad, or conv2d_wgrad_tma, matmul for 1x1), channels-last"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # flame/ops/conv.py _conv2d_backward: dW in the layout of flame's (channels-last) weights
        g = ctx.randn(nb, co, ho, wo, channels_last=True)
        x = ctx.randn(nb, ci, h, w, scale=(nb * ho * wo) ** -0.5, channels_last=True)
        out = ctx.empty(co, ci, k, k, channels_last=True)  # every element written each run (kernel or split-K sum)
        want = torch.nn.grad.conv2d_weight(x.float(), (co, ci, k, k), g.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_weight_grad_(out, g, x, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "wgrad"), build)]


# The bf16 attention outputs are rounded twice (P or dS to the dot's input type, then the result):
# an emulation of the kernels' roundings at SDXL sizes gives max errors of ~0.4% of the reference's
# largest magnitude, too close to CHECK_TOL for a check that must never reject the heuristic.
ATTN_SLACK = 2.0


@family("attention", "attention", ("B", "H", "Lq", "Lk", "D", "causal"), flags=("causal",))
def attention_family(ctx: Ctx, shape) -> list[Problem]:
    """flash attention's forward (kernel attention_fwd) and backward (attention_bwd), (B, L, H, D) inputs"""
    nb, h, lq, lk, d, causal = shape
    scale = d ** -0.5

    def heads(length):  # as diffusers makes q/k/v (and flame its outputs): (B, L, H, D) viewed as (B, H, L, D)
        return ctx.randn(nb, length, h, d).permute(0, 2, 1, 3)

    def fwd_args(q, k, v, o, lse):
        return q, k, v, o, lse, _bh(q), _bh(k), _bh(v), _bh(o)

    def inputs():
        q, k, v = heads(lq), heads(lk), heads(lk)
        o = ctx.empty(nb, lq, h, d).permute(0, 2, 1, 3)
        lse = torch.empty(nb * h, lq, device=runtime.device, dtype=KA.stats_dtype(ctx.dtype))
        return q, k, v, o, lse

    def forward():
        q, k, v, o, lse = inputs()
        want_o, want_lse = _attention_reference(q, k, v, causal, scale)
        return Bench(lambda: KA.attention_fwd(*fwd_args(q, k, v, o, lse), nb, h, lq, lk, d, scale, causal),
                     (o, lse), (want_o, want_lse), ATTN_SLACK)

    def backward():  # from flame's forward (heuristic config): O and the log-sum-exp it saves
        q, k, v, o, lse = inputs()
        KA.attention_fwd(*fwd_args(q, k, v, o, lse), nb, h, lq, lk, d, scale, causal)
        do = heads(lq)
        grads = tuple(ctx.empty(nb, n, h, d).permute(0, 2, 1, 3) for n in (lq, lk, lk))
        want = _attention_reference(q, k, v, causal, scale, do)

        def run():
            KA.attention_bwd(q, k, v, o, do, lse, *grads, _bh(q), _bh(k), _bh(v), _bh(o), _bh(do),
                             *(_bh(g) for g in grads), nb, h, lq, lk, d, scale, causal)

        return Bench(run, grads, want, ATTN_SLACK)

    name = f"attention B{nb} H{h} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


def _bh(t):
    """(batch, head, row) strides of a (B, H, L, D) view."""
    return t.stride(0), t.stride(1), t.stride(2)


def _attention_reference(q, k, v, causal, scale, do=None):
    """fp32 PyTorch attention (top-left causal mask): (O, base-2 log-sum-exp as (B*H, Lq)), or
    with ``do`` the gradients (dQ, dK, dV)."""
    q, k, v = (t.float().requires_grad_(do is not None) for t in (q, k, v))
    with torch.set_grad_enabled(do is not None):
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -math.inf)
        o = torch.softmax(s, -1) @ v
        if do is not None:
            return torch.autograd.grad(o, (q, k, v), do.float())
    return o, torch.logsumexp(s, -1).flatten(0, 1) / math.log(2)


def _reference(fn, inputs, dy=None):
    """``fn(*inputs)`` in fp32 PyTorch, or with ``dy`` the gradients of ``inputs`` (None ones stay
    None) from the output gradient ``dy``."""
    leaves = [None if t is None else t.float().requires_grad_(dy is not None) for t in inputs]
    with torch.set_grad_enabled(dy is not None):
        y = fn(*leaves)
        if dy is None:
            return y
        grads = iter(torch.autograd.grad(y, [t for t in leaves if t is not None], dy.float()))
        return tuple(None if t is None else next(grads) for t in leaves)


@family("group_norm", "group_norm", ("N", "C", "H", "W", "G", "channels_last", "silu"), flags=("channels_last", "silu"))
def group_norm_family(ctx: Ctx, shape) -> list[Problem]:
    """GroupNorm (+ SiLU) forward (kernel group_norm_fwd) and backward (group_norm_bwd), NCHW or channels-last"""
    nb, c, h, w, g, cl, silu = shape
    if c % g:
        raise Fatal(f"group_norm shape {list(shape)}: C = {c} is not a multiple of G = {g}")
    eps = 1e-5

    def torch_fn(x, wt, b):
        y = torch.nn.functional.group_norm(x, g, wt, b, eps)
        return torch.nn.functional.silu(y) if silu else y

    def inputs():  # as flame/ops/norm.py group_norm passes them: (N, C, S) strides of the map
        x, out = ctx.randn(nb, c, h, w, channels_last=cl), ctx.empty(nb, c, h, w, channels_last=cl)
        wt, b = 1 + ctx.randn(c, scale=0.5), ctx.randn(c)
        return x, wt, b, out

    def forward():
        x, wt, b, y = inputs()
        return Bench(lambda: KN.group_norm_fwd(y, x, wt, b, nb, c, h * w, g, eps, bool(silu), _ns(x), _ns(y)),
                     y, _reference(torch_fn, (x, wt, b)))

    def backward():  # from flame's forward statistics (heuristic config)
        x, wt, b, dx = inputs()
        mean, rstd = KN.group_norm_fwd(ctx.empty(nb, c, h, w, channels_last=cl), x, wt, b, nb, c, h * w, g, eps,
                                       bool(silu), _ns(x), _ns(dx))
        dy, dw, db = ctx.randn(nb, c, h, w, channels_last=cl), ctx.empty(c), ctx.empty(c)

        def run():
            KN.group_norm_bwd(dx, dw, db, dy, x, wt, b, mean, rstd, nb, c, h * w, g, bool(silu), _ns(x), _ns(dy),
                              _ns(dx))

        return Bench(run, (dx, dw, db), _reference(torch_fn, (x, wt, b), dy))

    name = f"group_norm {nb}x{c}x{h}x{w} G{g}{' channels-last' if cl else ''}{' silu' if silu else ''}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


def _ns(t):
    """(n, c, position) strides of an (N, C, H, W) map, NCHW or channels-last: its (N, C, H*W) view."""
    return t.stride(0), t.stride(1), t.stride(3)


@family("layer_norm", "layer_norm", ("M", "D", "rms"), flags=("rms",))
def layer_norm_family(ctx: Ctx, shape) -> list[Problem]:
    """LayerNorm or RMSNorm forward (kernel layer_norm_fwd) and backward (layer_norm_bwd) over M rows of D"""
    m, d, rms = shape
    eps = 1e-6 if rms else 1e-5

    def torch_fn(x, wt, b):
        if rms:
            return torch.nn.functional.rms_norm(x, (d,), wt, eps)
        return torch.nn.functional.layer_norm(x, (d,), wt, b, eps)

    def inputs():
        return ctx.randn(m, d), 1 + ctx.randn(d, scale=0.5), None if rms else ctx.randn(d), ctx.empty(m, d)

    def forward():
        x, wt, b, y = inputs()
        return Bench(lambda: KN.layer_norm_fwd(y, x, wt, b, m, d, eps, bool(rms), d, d), y,
                     _reference(torch_fn, (x, wt, b)))

    def backward():  # from flame's forward statistics (heuristic config); RMSNorm has no bias
        x, wt, b, dx = inputs()
        mean, rstd = KN.layer_norm_fwd(ctx.empty(m, d), x, wt, b, m, d, eps, bool(rms), d, d)
        dy, dw, db = ctx.randn(m, d), ctx.empty(d), None if rms else ctx.empty(d)
        want = _reference(torch_fn, (x, wt, b), dy)
        outs = (dx, dw) if rms else (dx, dw, db)
        return Bench(lambda: KN.layer_norm_bwd(dx, dw, db, dy, x, wt, mean, rstd, m, d, bool(rms), d, d, d),
                     outs, want[:len(outs)])

    name = f"{'rms_norm' if rms else 'layer_norm'} {m}x{d}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


# The softmax backward's outputs are rounded twice (the saved output y, then dx).
SOFTMAX_SLACK = 2.0


@family("softmax", "softmax", ("ROWS", "R", "log"), flags=("log",))
def softmax_family(ctx: Ctx, shape) -> list[Problem]:
    """softmax or log_softmax over the last dim of (ROWS, R), forward (kernel softmax_fwd) and backward (softmax_bwd)"""
    rows, r, log = shape
    strides = (r, 1, 1)  # (outer, R, inner) strides of a contiguous (ROWS, R) tensor, as flame/ops/softmax.py

    def torch_fn(x):
        return torch.log_softmax(x, -1) if log else torch.softmax(x, -1)

    def forward():
        x, y = ctx.randn(rows, r, scale=2.0), ctx.empty(rows, r)
        return Bench(lambda: KS.softmax_fwd(y, x, rows, r, 1, strides, strides, bool(log)), y,
                     _reference(torch_fn, (x,)))

    def backward():  # from flame's forward output (heuristic config), as the op saves it
        x, g, dx = ctx.randn(rows, r, scale=2.0), ctx.randn(rows, r), ctx.empty(rows, r)
        y = KS.softmax_fwd(ctx.empty(rows, r), x, rows, r, 1, strides, strides, bool(log))
        return Bench(lambda: KS.softmax_bwd(dx, y, g, rows, r, 1, strides, strides, strides, bool(log)), dx,
                     _reference(torch_fn, (x,), g)[0], SOFTMAX_SLACK)

    name = f"{'log_softmax' if log else 'softmax'} {rows}x{r}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


@family("cross_entropy", "cross_entropy", ("ROWS", "C"))
def cross_entropy_family(ctx: Ctx, shape) -> list[Problem]:
    """cross-entropy (mean) of (ROWS, C) logits, forward (kernel cross_entropy_fwd) and backward (cross_entropy_bwd)"""
    rows, c = shape
    strides = (c, 1, 1)

    def inputs():
        return ctx.randn(rows, c, scale=2.0), torch.randint(0, c, (rows,), device=runtime.device)

    def forward():  # the launcher allocates its outputs: the run copies them into buffers of our own
        x, t = inputs()
        loss = torch.empty((), device=runtime.device, dtype=ctx.dtype)
        lse = torch.empty(rows, device=runtime.device, dtype=torch.float32)

        def run():
            got = KS.cross_entropy_fwd(x, t, rows, c, 1, strides, "mean", -100, 0.0, ctx.dtype)
            loss.copy_(got[0])
            lse.copy_(got[1])

        want = _reference(lambda x: (torch.nn.functional.cross_entropy(x, t), torch.logsumexp(x, -1)), (x,))
        return Bench(run, (loss, lse), want)

    def backward():  # from flame's forward (heuristic config): the log-sum-exp and the count it saves
        x, t = inputs()
        _, lse, count = KS.cross_entropy_fwd(x, t, rows, c, 1, strides, "mean", -100, 0.0, ctx.dtype)
        g, dx = ctx.randn(), ctx.empty(rows, c)
        want = _reference(lambda x: torch.nn.functional.cross_entropy(x, t), (x,), g)[0]
        return Bench(lambda: KS.cross_entropy_bwd(dx, x, t, lse, g, count, rows, c, 1, strides, strides, "mean",
                                                  -100, 0.0), dx, want)

    name = f"cross_entropy {rows}x{c}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


@family("elementwise", "elementwise", ("N", "C", "H", "W"))
def elementwise_family(ctx: Ctx, shape) -> list[Problem]:
    """elementwise maps of an (N, C, H, W) activation: a + b and GELU (kernel map_contiguous, one
    key: tuned once), x * a per-channel scale (map_strided)"""
    n, c, h, w = shape

    def binary(op, torch_fn, b_shape):  # as flame's ops launch it: b broadcast (expanded) to x's shape
        def build():
            x, b, out = ctx.randn(n, c, h, w), ctx.randn(*b_shape), ctx.empty(n, c, h, w)
            return Bench(lambda: KE.map_(out, [x, b.expand(x.shape)], op), out, _reference(torch_fn, (x, b)))
        return build

    def gelu():
        x, out = ctx.randn(n, c, h, w), ctx.empty(n, c, h, w)
        return Bench(lambda: KE.map_(out, [x], KE.GELU), out, _reference(torch.nn.functional.gelu, (x,)))

    name = f"{n}x{c}x{h}x{w}"
    return [Problem(f"add {name}", binary(KE.ADD, torch.add, (n, c, h, w))),
            Problem(f"mul {name} by (1, {c}, 1, 1)", binary(KE.MUL, torch.mul, (1, c, 1, 1))),
            Problem(f"gelu {name}", gelu)]


@family("reduce", "reduce", ("outer", "R", "inner"))
def reduce_family(ctx: Ctx, shape) -> list[Problem]:
    """sums over R of an (outer, R, inner) tensor (kernel reduce): column sums (outer 1, a bias
    gradient), row sums (inner 1)"""
    outer, r, inner = shape

    def build():
        x, out = ctx.randn(outer, r, inner), ctx.empty(outer * inner)
        return Bench(lambda: KR.reduce_(out, x, outer, r, inner, x.stride(), KR.SUM), out,
                     _reference(lambda x: x.sum(1).flatten(), (x,)))

    what = "column sum" if outer == 1 else "row sum" if inner == 1 else "sum over R of"
    return [Problem(f"{what} {outer}x{r}x{inner}", build)]


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

class Fatal(Exception):
    """A run that cannot start (or go on): the message says why."""


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
        if section not in fields:
            error(f"--shapes {path}: unknown section {section!r} (known: {', '.join(sorted(fields))})")
        want, flag = fields[section], flags[section]
        if not isinstance(rows, list):
            error(f"--shapes {path}: section {section!r} must be a list of {list(want)} lists")
        what = f"integers {list(want)} ({', '.join(flag)} 0 or 1, the others positive)" if flag else \
            f"positive integers {list(want)}"
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == len(want) and all(
                    isinstance(v, int) and not isinstance(v, bool) and (v in (0, 1) if f in flag else v > 0)
                    for f, v in zip(want, row))):
                error(f"--shapes {path}: {section}[{i}] = {row!r} is not {len(want)} {what}")
        shapes[section] = [tuple(r) for r in rows]
    if not any(FAMILIES[f].section in shapes for f in families):
        error(f"--shapes {path}: no shapes for the families {', '.join(families)} "
              f"(sections {', '.join(sorted({FAMILIES[f].section for f in families}))})")
    return shapes


def kernel_table() -> str:
    """The registered kernels as a Markdown table: name, key, config fields, what it is."""
    rows = ["| kernel | key | config fields | what |", "| --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | `[{', '.join(s.key)}]` | `{' '.join(s.fields)}` | {s.doc} |" for s in tune.SPECS.values()]
    return "\n".join(rows)


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
