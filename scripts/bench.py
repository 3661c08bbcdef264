#!/usr/bin/env python3
"""Benchmark flame's kernels against PyTorch eager, on one card, in one run.

    PYTHONPATH=. python3 scripts/bench.py                        # every family
    PYTHONPATH=. python3 scripts/bench.py --family elementwise --dtype bf16 --out out/bench.json
    python scripts/bench.py --quick --family elementwise,overhead  # small shapes (CPU smoke test)
    PYTHONPATH=. python3 scripts/bench.py --family linear,conv --tuning compare --repeat 3  # tuned vs defaults

Device-time cases use ``triton.testing.do_bench`` (median of ``--rep`` ms after ``--warmup`` ms) for
flame and for PyTorch alike; host-time cases (the ``overhead`` family) time a Python loop with
``time.perf_counter`` after a warm-up and synchronise at the end. On a GPU, ``--timer`` (default
``both``) also times CUDA-graph replays of both sides: the kernels' device time, free of the host's
cost and noise, next to the eager time a user sees (a case that cannot be captured is eager only).
Each case first checks that flame and PyTorch agree, so a fast wrong kernel cannot post a number.
On the interpreter backend (no GPU) times measure Triton's interpreter and mean nothing; that mode
exists to smoke-test this script.

flame's launch configs come from the GPU's tuning table (``flame.tune``) unless ``--tuning defaults``
hides the tables; ``--tuning compare`` times flame both ways in the same process, alternating with
PyTorch per ``--repeat``, and reports each case's tuned speedup over the heuristic defaults (the
ratio of the two sides' medians). On a GPU the two sides replay CUDA graphs of the case: a launch
config changes device time only, and graph replays keep the shared host's noise out (``tuned_timer``
says "graph", or "eager" where a case cannot be captured). A case whose launches ask ``flame.tune`` for the same configs
with and without the table (no entry applies, or the entries answer "heuristic") is marked
``tuned_same_configs`` and not timed twice: it runs the very same kernels either way.
``--baseline-table PATH`` makes the other side an earlier table file instead of the heuristics
(``flame.tune.table_from``), so a re-tuned table is checked against the one it replaces in one run.

``--case TEXT`` (repeatable) runs only the cases whose names contain one of the texts (no targets
are checked then: they are judged on a family's every case). On a GPU,
``--kernels`` also profiles each device case (torch.profiler, 10 calls per side after the timing)
and reports, per side, its CUDA kernels with launches and device microseconds per call, most time
first: where a ratio comes from, in the same run and on the same card (stored under "kernels").

After a full-size run (not ``--quick``) the acceptance targets of the families' issues
(``Target``: the worst case or the geometric mean of flame/PyTorch time over the cases a target
names, against its bound) are checked for each timer and printed, and stored under "targets" in
the JSON.

Adding a family: write a function that takes a ``Ctx`` and returns a list of ``Case``, and decorate
it with ``@family("name", "one-line description", targets)``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (also when imported by path)

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame import tune
from flame.autograd import run_backward
import torch
# isort: on

DTYPES = common.DTYPES


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


FAMILIES: dict[str, tuple[Callable[[Ctx], list[Case]], str]] = {}
TARGETS: dict[str, tuple[Target, ...]] = {}


def family(name: str, description: str = "", targets: tuple[Target, ...] = ()):
    """Register ``fn(ctx) -> list[Case]`` as the benchmark family ``name``, with the acceptance
    ``targets`` its issue sets."""

    def deco(fn):
        if name in FAMILIES:
            raise ValueError(f"benchmark family {name!r} registered twice")
        FAMILIES[name] = (fn, description or (fn.__doc__ or "").strip().split("\n")[0])
        TARGETS[name] = tuple(targets)
        return fn

    return deco


def _starts(prefix, *parts, without=()):
    """A case selector: names starting with ``prefix`` that contain every one of ``parts`` and
    none of ``without``."""
    return lambda name: (name.startswith(prefix) and all(p in name for p in parts)
                         and not any(w in name for w in without))


_SDXL_LINEAR = dict(without=("8192x8192", "gelu"))
LINEAR_TARGETS = (
    Target("forward at most 1.1x on every SDXL shape (issue 3)", _starts("fwd ", **_SDXL_LINEAR), "max", 1.1),
    Target("forward at most 1.0x on the geometric mean (issue 3)", _starts("fwd ", **_SDXL_LINEAR), "geo", 1.0),
    Target("forward+backward at most 1.0x on every SDXL shape (issue 3)", _starts("fwd+bwd", **_SDXL_LINEAR),
           "max", 1.0),
    Target("bias+GELU forward+backward at least 1.2x faster, geometric mean (issue 3)",
           _starts("fwd+bwd", "gelu"), "geo", 1 / 1.2),
)
NORMS_TARGETS = tuple(
    t for kind in ("fwd", "fwd+bwd") for t in (
        Target(f"GroupNorm batch 1 {kind} at least 3x faster, geometric mean (issue 4)",
               _starts(f"{kind} group_norm 1x"), "geo", 1 / 3),
        Target(f"GroupNorm batch 1 {kind} never slower (issue 4)", _starts(f"{kind} group_norm 1x"),
               "max", 1.0))
) + (
    Target("LayerNorm forward at most 1.0x, geometric mean (issue 4)", _starts("fwd layer_norm"), "geo", 1.0),
    Target("RMSNorm forward at most 1.0x, geometric mean (issue 4)", _starts("fwd rms_norm"), "geo", 1.0),
    Target("LayerNorm forward+backward at least 1.3x faster, geometric mean (issue 4)",
           _starts("fwd+bwd layer_norm"), "geo", 1 / 1.3),
    Target("RMSNorm forward+backward at least 1.3x faster, geometric mean (issue 4)",
           _starts("fwd+bwd rms_norm"), "geo", 1 / 1.3),
    Target("cross_entropy forward+backward faster (issue 4)", _starts("fwd+bwd cross_entropy"), "max", 1.0,
           strict=True),
)
_CONV_S1 = dict(without=(" s2", "up2x", "x4x128x128", "->4 "))
CONV_TARGETS = tuple(
    t for kind in ("fwd ", "fwd+bwd") for t in (
        Target(f"3x3 {kind.strip()} faster than PyTorch NCHW on every shape (issue 5)",
               _starts(kind, "3x3", "vs torch NCHW", without=("up2x",)), "max", 1.0, strict=True),
        Target(f"3x3 stride-1 {kind.strip()} at most 1.15x cuDNN channels-last, geometric mean (issue 5)",
               _starts(kind, "3x3", "vs torch CL", **_CONV_S1), "geo", 1.15))
)
_SDXL_ATTENTION = dict(without=("causal", "D128", "vs cuDNN"))
_VS_CUDNN = dict(without=("causal", "B2 ", "B4 "))  # SDXL's batch-1 shapes and Flux's (D128, 4608 tokens)
ATTENTION_TARGETS = (
    Target("forward at most 1.1x on every SDXL shape (issue 6)", _starts("fwd ", "D64", **_SDXL_ATTENTION),
           "max", 1.1),
    Target("forward+backward at most 1.2x on every SDXL shape (issue 6)",
           _starts("fwd+bwd", "D64", **_SDXL_ATTENTION), "max", 1.2),
    Target("forward+backward at most 1.0x on the geometric mean (issue 6)",
           _starts("fwd+bwd", "D64", **_SDXL_ATTENTION), "geo", 1.0),
    Target("forward at most 0.95x cuDNN SDPA on SDXL's and Flux's shapes (issue 46)",
           _starts("fwd ", "vs cuDNN", **_VS_CUDNN), "max", 0.95),
    Target("forward+backward at most 1.0x cuDNN SDPA on SDXL's and Flux's shapes (issue 46)",
           _starts("fwd+bwd", "vs cuDNN", **_VS_CUDNN), "max", 1.0),
)


# ---- families ----------------------------------------------------------------------------------

def _randn(*shape, dtype, requires_grad=False):
    """A flame tensor and the torch tensor sharing its memory."""
    x = flame.randn(*shape, dtype=dtype)
    t = x.to_torch()
    if requires_grad:
        x.requires_grad_()
        t = t.detach().clone().requires_grad_()
    return x, t


@family("elementwise", "bandwidth on 16M elements: add, broadcast mul, exact gelu, row sum, transpose copy")
def elementwise_family(ctx: Ctx) -> list[Case]:
    m, n = ctx.shape((4096, 4096), (1024, 1024), (64, 96))
    dt, es = ctx.dtype, torch.empty((), dtype=ctx.dtype).element_size()
    numel = m * n
    a, ta = _randn(m, n, dtype=dt)
    b, tb = _randn(m, n, dtype=dt)
    row, trow = _randn(n, dtype=dt)
    gelu = torch.nn.functional.gelu
    shape = f"{m}x{n}"
    return [
        Case(f"add {shape}", lambda: a + b, lambda: ta + tb, nbytes=3 * numel * es),
        Case(f"mul {shape} * ({n},)", lambda: a * row, lambda: ta * trow, nbytes=(2 * numel + n) * es),
        Case(f"gelu {shape}", lambda: flame.gelu(a), lambda: gelu(ta), nbytes=2 * numel * es),
        Case(f"sum(-1) {shape}", lambda: a.sum(-1), lambda: ta.sum(-1), nbytes=(numel + m) * es),
        Case(f"t().contiguous() {shape}", lambda: a.t().contiguous(), lambda: ta.t().contiguous(),
             nbytes=2 * numel * es),
    ]


def _chain(lib, x, w, b, blocks):
    """``blocks`` x 5 elementwise ops plus a final sum: values stay bounded (tanh, then exp <= e)."""
    for _ in range(blocks):
        x = lib.exp(lib.tanh(x * w + b)) * 0.3
    return x.sum()


@family("overhead", "host time per op: a chain of ~50 small ops, forward and forward+backward")
def overhead_family(ctx: Ctx) -> list[Case]:
    blocks = 10
    n_ops = 5 * blocks + 1
    size = 64
    dt = torch.float32  # host cost does not depend on dtype; fp32 keeps the pre-timing check strict
    x, tx = _randn(size, size, dtype=dt)
    w, tw = _randn(size, size, dtype=dt, requires_grad=True)
    b, tb = _randn(size, dtype=dt, requires_grad=True)

    def flame_nograd():
        with flame.no_grad():
            return _chain(flame, x, w, b, blocks)

    def torch_nograd():
        with torch.no_grad():
            return _chain(torch, tx, tw, tb, blocks)

    def flame_fwd():
        return _chain(flame, x, w, b, blocks).detach()

    def torch_fwd():
        return _chain(torch, tx, tw, tb, blocks).detach()

    def flame_fwd_bwd():
        grads = _chain(flame, x, w, b, blocks).backward()
        return grads[w], grads[b]

    def torch_fwd_bwd():
        return torch.autograd.grad(_chain(torch, tx, tw, tb, blocks), (tw, tb))

    tag = f"{n_ops} ops on {size}x{size}"
    return [
        Case(f"fwd no_grad, {tag}", flame_nograd, torch_nograd, timer="host", ops=n_ops),
        Case(f"fwd recording, {tag}", flame_fwd, torch_fwd, timer="host", ops=n_ops),
        Case(f"fwd+bwd, {tag}", flame_fwd_bwd, torch_fwd_bwd, timer="host", ops=n_ops,
             note="per forward op"),
    ]


# Shapes: the SDXL problems bench times (one per layer kind, batch 1 at 1024x1024, a few batch 4)
# are rows of the SDXL shapes file that scripts/autotune.py tunes (common.sdxl_rows checks each);
# the rest are reference sizes outside SDXL. bench keeps its own selection: the file lists every
# SDXL problem at 3 batch sizes and 2 resolutions, too many for a benchmark run.
SDXL_LINEAR = common.sdxl_rows("linear", [  # (M, K, N): the transformers' linears and the text projections
    (4096, 640, 640), (4096, 640, 5120), (4096, 2560, 640), (1024, 1280, 1280), (1024, 1280, 10240),
    (1024, 5120, 1280), (77, 2048, 640), (77, 2048, 1280)])
LINEAR_SHAPES = [  # (M, K, N, activation)
    *((m, k, n, None) for m, k, n in SDXL_LINEAR),
    (16384, 320, 320, None),  # a 320-channel transformer's (SD 1.x; SDXL has none)
    (4096, 640, 5120, "gelu_tanh"), (1024, 1280, 10240, "gelu_tanh"),  # SDXL's feed-forward, bias+GELU fused
    (8192, 8192, 8192, None),  # a big square
]
_TORCH_ACT = {None: lambda t: t, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


@family("linear", "F.linear (+bias, +activation) forward and forward+backward on SDXL shapes", LINEAR_TARGETS)
def linear_family(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    cases = []
    shapes = LINEAR_SHAPES if not ctx.quick else [(256, 128, 192, None), (64, 96, 128, "gelu_tanh")]
    if ctx.interpreter:
        shapes = [(16, 24, 32, None), (8, 16, 24, "gelu_tanh")]
    for m, k, n, act in shapes:
        x, tx = _randn(m, k, dtype=ctx.dtype, requires_grad=True)
        w, _ = _randn(n, k, dtype=ctx.dtype)
        with flame.no_grad():
            w = (w * (1.0 / k ** 0.5)).requires_grad_()
        tw = w.to_torch().detach().clone().requires_grad_()
        b, tb = _randn(n, dtype=ctx.dtype, requires_grad=True)
        g = flame.randn(m, n, dtype=ctx.dtype)
        name = f"{m}x{k}->{n}" + (f" +bias+{act}" if act else " +bias")
        cases += _fwd_bwd_cases(name, lambda x, w, b, act=act: F.linear(x, w, b, activation=act),
                                lambda x, w, b, tact=_TORCH_ACT[act]: tact(torch.nn.functional.linear(x, w, b)),
                                (x, w, b), (tx, tw, tb), g, g.to_torch(), flops=2 * m * k * n)
    return cases


LORA_SHAPES = common.sdxl_rows("linear", [(4096, 640, 640), (77, 2048, 640), (1024, 1280, 1280),
                                          (77, 2048, 1280)])  # SDXL's attention projections


def _torch_lora(x, w, a, b, m, scale):
    """LoRA (``m`` None) or PEFT's DoRA on a Linear in torch: the base product, the two adapter
    products in x's dtype, and for DoRA the scale m / ||W + s B A|| (fp32, detached)."""
    lin = torch.nn.functional.linear
    z = lin(x, w) + lin(lin(x, a.to(x.dtype)), b.to(x.dtype)) * scale
    if m is None:
        return z
    return z * (m / (w.float() + scale * b @ a).norm(dim=1).detach()).to(z.dtype)


@family("lora", "F.lora_linear: LoRA and DoRA (magnitude) adapters, rank 16, on SDXL's attention projections")
def lora_family(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    cases = []
    shapes = LORA_SHAPES if not ctx.quick else [(256, 128, 192)]
    if ctx.interpreter:
        shapes = [(16, 24, 32)]
    for m, k, n in shapes:
        x, tx = _randn(m, k, dtype=ctx.dtype, requires_grad=True)
        w, tw = _randn(n, k, dtype=ctx.dtype)
        a, ta = _randn(16, k, dtype=torch.float32, requires_grad=True)
        lb, tlb = _randn(n, 16, dtype=torch.float32, requires_grad=True)
        with flame.no_grad():
            mag = (flame.rand(n) + 20.0).requires_grad_()
        tmag = mag.to_torch().detach().clone().requires_grad_()
        g = flame.randn(m, n, dtype=ctx.dtype)
        for dora in (False, True):
            f_in, t_in = ((x, w, a, lb, mag), (tx, tw, ta, tlb, tmag)) if dora else ((x, w, a, lb), (tx, tw, ta, tlb))
            cases += _fwd_bwd_cases(f"{'dora' if dora else 'lora'} {m}x{k}->{n}",
                                    lambda x, w, a, b, mag=None: F.lora_linear(x, w, None, a, b, 0.5, magnitude=mag),
                                    lambda x, w, a, b, mag=None: _torch_lora(x, w, a, b, mag, 0.5), f_in, t_in, g,
                                    g.to_torch(), flops=2 * m * n * (k + 16) + 2 * m * k * 16,
                                    check_dtype=ctx.dtype)  # fp32 adapter gradients of 16-bit products
    return cases


def _fwd_bwd_cases(name, f_fn, t_fn, f_inputs, t_inputs, g, tg, nbytes=None, flops=None, bwd_factor=2.0,
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


def _leaf(shape, dtype, channels_last=False):
    x, t = _randn(*shape, dtype=dtype, requires_grad=True)
    if channels_last:
        t = t.detach().to(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(t.detach().clone(), requires_grad=True)
    return x, t


# (N, C, H, W), 32 groups: SDXL's GroupNorms, each NCHW and channels-last, with and without SiLU
GROUP_NORM_SHAPES = [(1, 320, 128, 128), (1, 640, 64, 64), (1, 1280, 32, 32), (1, 2560, 32, 32), (4, 320, 128, 128)]
common.sdxl_rows("group_norm", [(*shape, 32, cl, 1) for shape in GROUP_NORM_SHAPES for cl in (0, 1)])
# (rows, C): SDXL's transformers at 640 and 1280 channels, then two reference sizes
LAYER_NORM_SHAPES = [(4096, 640), (1024, 1280), (16384, 320), (8192, 4096)]
common.sdxl_rows("layer_norm", [(*shape, 0) for shape in LAYER_NORM_SHAPES[:2]])
VOCAB_SHAPES = [(8192, 32000)]  # (rows, classes): softmax and cross-entropy over a Llama-2-sized vocabulary
common.sdxl_rows("softmax", [(*shape, 0) for shape in VOCAB_SHAPES])
common.sdxl_rows("cross_entropy", VOCAB_SHAPES)


@family("norms", "GroupNorm(32)(+SiLU) NCHW/channels-last, LayerNorm, RMSNorm, softmax, cross_entropy",
        NORMS_TARGETS)
def norms_family(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    tf = torch.nn.functional
    dt, es = ctx.dtype, torch.empty((), dtype=ctx.dtype).element_size()
    gn, rows, vocab = GROUP_NORM_SHAPES, LAYER_NORM_SHAPES, VOCAB_SHAPES
    if ctx.quick or ctx.interpreter:
        gn, rows, vocab = [(1, 64, 8, 8)], [(64, 96)], [(16, 100)]
    cases = []
    for shape in gn:
        n = math.prod(shape)
        for cl in (False, True):
            for act in (None, "silu"):
                x, tx = _leaf(shape, dt, cl)
                w, tw = _randn(shape[1], dtype=dt, requires_grad=True)
                b, tb = _randn(shape[1], dtype=dt, requires_grad=True)
                g = flame.from_torch(torch.randn_like(tx))
                name = f"group_norm {'x'.join(map(str, shape))}{' CL' if cl else ''}{' +silu' if act else ''}"

                def t_fn(x, w, b, act=act):
                    y = tf.group_norm(x, 32, w, b, 1e-5)
                    return tf.silu(y) if act else y

                cases += _fwd_bwd_cases(name, lambda x, w, b, act=act: F.group_norm(x, 32, w, b, activation=act),
                                        t_fn, (x, w, b), (tx, tw, tb), g, g.to_torch(), nbytes=2 * n * es,
                                        bwd_factor=1.5)
    for m, c in rows:
        x, tx = _randn(m, c, dtype=dt, requires_grad=True)
        w, tw = _randn(c, dtype=dt, requires_grad=True)
        b, tb = _randn(c, dtype=dt, requires_grad=True)
        g = flame.randn(m, c, dtype=dt)
        cases += _fwd_bwd_cases(f"layer_norm {m}x{c}", lambda x, w, b, c=c: F.layer_norm(x, c, w, b),
                                lambda x, w, b, c=c: tf.layer_norm(x, (c,), w, b), (x, w, b), (tx, tw, tb),
                                g, g.to_torch(), nbytes=2 * m * c * es, bwd_factor=1.5)
        cases += _fwd_bwd_cases(f"rms_norm {m}x{c}", lambda x, w, c=c: F.rms_norm(x, c, w),
                                lambda x, w, c=c: tf.rms_norm(x, (c,), w), (x, w), (tx, tw),
                                g, g.to_torch(), nbytes=2 * m * c * es, bwd_factor=1.5)
    for m, v in vocab:
        x, tx = _randn(m, v, dtype=dt, requires_grad=True)
        g = flame.randn(m, v, dtype=dt)
        cases += _fwd_bwd_cases(f"softmax {m}x{v}", lambda x: F.softmax(x, -1), lambda x: torch.softmax(x, -1),
                                (x,), (tx,), g, g.to_torch(), nbytes=2 * m * v * es, bwd_factor=1.5)
        target = flame.from_torch(torch.randint(0, v, (m,), device=tx.device))
        one = flame.ones((), dtype=dt)
        cases += _fwd_bwd_cases(f"cross_entropy {m}x{v}", lambda x, t=target: F.cross_entropy(x, t),
                                lambda x, t=target: tf.cross_entropy(x, t.to_torch()), (x,), (tx,), one,
                                one.to_torch(), nbytes=m * v * es, bwd_factor=2.0)
    return cases


ATTENTION_SHAPES = [  # (B, H, Lq, Lk, D, causal): SDXL self/cross attention, Flux's and two reference sizes
    *((b, h, lq, lk, d, bool(c)) for b, h, lq, lk, d, c in common.sdxl_rows("attention", [
        (1, 10, 4096, 4096, 64, 0), (1, 20, 1024, 1024, 64, 0), (1, 10, 4096, 77, 64, 0), (1, 20, 1024, 77, 64, 0),
        (4, 10, 4096, 4096, 64, 0)])),
    (1, 24, 4608, 4608, 128, False),  # Flux (1024x1024: 4096 image + 512 text tokens, 24 heads of 128)
    (2, 16, 4096, 4096, 128, False), (4, 32, 2048, 2048, 128, True),
]


def _sdpa_on(backend, causal):
    """``fn(q, k, v)``: PyTorch's SDPA on one backend (``torch.nn.attention.SDPBackend``), or on
    whichever it picks (None)."""
    import torch.nn.attention

    def sdpa(q, k, v):
        if backend is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with torch.nn.attention.sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


@family("attention", "scaled_dot_product_attention vs PyTorch SDPA: SDXL shapes, (B, L, H, D) inputs",
        ATTENTION_TARGETS)
def attention_family(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    shapes = ATTENTION_SHAPES
    if ctx.quick or ctx.interpreter:
        shapes = [(1, 2, 64, 64, 32, False), (1, 2, 64, 17, 32, False)]
    cudnn = None if ctx.interpreter else torch.backends.cuda.SDPBackend.CUDNN_ATTENTION
    cases = []
    for bsz, h, lq, lk, d, causal in shapes:
        # q/k/v as diffusers makes them: (B, L, H, D) projections viewed as (B, H, L, D)
        qkv = []
        for length in (lq, lk, lk):
            x, t = _randn(bsz, length, h, d, dtype=ctx.dtype)
            qkv.append((x.permute(0, 2, 1, 3).detach().requires_grad_(), t.permute(0, 2, 1, 3).requires_grad_()))
        g = flame.randn(bsz, h, lq, d, dtype=ctx.dtype)
        flops = 4 * bsz * h * lq * lk * d // (2 if causal else 1)
        name = f"B{bsz} H{h} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        # PyTorch's own pick, and (CUDA) its cuDNN backend, the fastest on Hopper (issue 46)
        for suffix, backend in [("", None)] + ([(" vs cuDNN", cudnn)] if cudnn is not None else []):
            cases += _fwd_bwd_cases(
                name + suffix, lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                _sdpa_on(backend, causal),
                tuple(f for f, _ in qkv), tuple(t for _, t in qkv), g, g.to_torch(), flops=flops, bwd_factor=2.5)
    return cases


def _sdxl_convs(rows):
    """``rows`` of CONV_SHAPES, each checked against the SDXL shapes file: a k x k convolution is a
    row of its conv section (the input size after the upsampler's 2x), a 1x1 one a row of its linear
    section (batch x pixels, Ci, Co: it runs on the GEMM)."""
    for n, ci, h, w, co, k, s, up in rows:
        if k == 1:
            common.sdxl_rows("linear", [(n * h * w, ci, co)])
        else:
            common.sdxl_rows("conv", [(n, ci, 2 * h if up else h, 2 * w if up else w, co, k, s)])
    return rows


CONV_SHAPES = _sdxl_convs([  # (N, Ci, H, W, Co, kernel, stride, nearest-2x upsample first): SDXL's convs at 1024x1024
    (1, 320, 128, 128, 320, 3, 1, False), (1, 640, 64, 64, 640, 3, 1, False), (1, 1280, 32, 32, 1280, 3, 1, False),
    (4, 320, 128, 128, 320, 3, 1, False),
    (1, 2560, 32, 32, 1280, 3, 1, False), (1, 1920, 64, 64, 640, 3, 1, False), (1, 960, 128, 128, 320, 3, 1, False),
    (1, 320, 128, 128, 320, 3, 2, False), (1, 640, 64, 64, 640, 3, 2, False),
    (1, 4, 128, 128, 320, 3, 1, False), (1, 320, 128, 128, 4, 3, 1, False),  # conv_in, conv_out
    (1, 2560, 32, 32, 1280, 1, 1, False), (1, 960, 128, 128, 320, 1, 1, False),  # 1x1 shortcuts
    (1, 1280, 32, 32, 1280, 3, 1, True), (1, 640, 64, 64, 640, 3, 1, True),  # up-samplers
])


def _conv_fn(lib, k, stride, up):
    """``fn(x, w, b)``: [nearest 2x upsample, then] conv2d with 'same' padding for odd ``k``."""
    def fn(x, w, b):
        if up:
            x = lib.interpolate(x, scale_factor=2, mode="nearest")
        return lib.conv2d(x, w, b, stride=stride, padding=k // 2)
    return fn


@family("conv", "conv2d (+bias) fwd and fwd+bwd on SDXL shapes: flame channels-last vs torch NCHW and channels-last",
        CONV_TARGETS)
def conv_family(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    small = [(1, 16, 8, 8, 16, 3, 1, False), (1, 16, 9, 7, 24, 3, 2, False), (1, 4, 8, 8, 16, 3, 1, False),
             (1, 24, 8, 8, 16, 1, 1, False), (1, 16, 4, 4, 16, 3, 1, True)]
    quick_gpu = [(n, ci, h // 4, wd // 4, *rest) for n, ci, h, wd, *rest in CONV_SHAPES]
    cases = []
    for n, ci, h, wd, co, k, s, up in ctx.shape(CONV_SHAPES, quick_gpu, small):
        x, tx = _leaf((n, ci, h, wd), ctx.dtype, channels_last=True)  # flame keeps activations channels-last
        w, _ = _randn(co, ci, k, k, dtype=ctx.dtype)
        with flame.no_grad():
            w = w * (1.0 / (ci * k * k) ** 0.5)
        # flame's weight channels-last, as nn.Conv2d stores it
        w = flame.from_torch(w.to_torch().contiguous(memory_format=torch.channels_last)).requires_grad_()
        b, tb = _randn(co, dtype=ctx.dtype, requires_grad=True)
        ho, wo = ((size * (2 if up else 1) - 1) // s + 1 for size in (h, wd))  # padding k // 2, odd k
        g = _leaf((n, co, ho, wo), ctx.dtype, channels_last=True)[0].detach()  # channels-last, as flame's output
        flops = 2 * n * ho * wo * co * ci * k * k
        name = f"{'up2x+' if up else ''}{k}x{k}{f' s{s}' if s > 1 else ''} {n}x{ci}x{h}x{wd}->{co}"
        for fmt, tag in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "CL")):
            tx_f, tw_f = (t.detach().contiguous(memory_format=fmt).requires_grad_() for t in (tx, w.to_torch()))
            cases += _fwd_bwd_cases(f"{name} vs torch {tag}", _conv_fn(F, k, s, up),
                                    _conv_fn(torch.nn.functional, k, s, up), (x, w, b), (tx_f, tw_f, tb), g,
                                    g.to_torch().contiguous(memory_format=fmt), flops=flops)
    return cases


# ---- measurement -------------------------------------------------------------------------------

def time_device(fn, ctx: Ctx) -> float:
    """Median milliseconds per call (``do_bench``; the interpreter: host time of a few calls)."""
    return common.device_ms(fn, ctx.warmup, ctx.rep, interpreter_calls=3 if ctx.quick else 5)


PROFILE_CALLS = 10  # calls per side profiled by --kernels


def kernel_times(fn, calls=PROFILE_CALLS) -> list[list]:
    """[kernel name, launches per call, device µs per call] of the CUDA kernels ``fn`` runs, most
    time first: torch.profiler over ``calls`` calls after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    common.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        common.sync()
    return per_call_kernels(prof.events(), calls)


def per_call_kernels(events, calls) -> list[list]:
    """The CUDA ``events`` of a profile of ``calls`` calls, summed per kernel name and divided by
    ``calls``: [name, launches per call, device µs per call], most time first."""
    totals = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches, us = totals.get(e.name, (0, 0.0))
            totals[e.name] = (launches + 1, us + e.device_time)
    rows = [[name, launches / calls, us / calls] for name, (launches, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def time_host(fn, ctx: Ctx, ops: int) -> float:
    """Microseconds of host time per op, averaged over a loop that is synchronised at the end."""
    warmup, iters = (2, 3) if ctx.interpreter else ((5, 20) if ctx.quick else (20, 200))
    return common.host_us_per_op(fn, warmup, iters, ops)


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_case(case: Case) -> str | None:
    """None when flame's and PyTorch's outputs agree (``common.mismatch``: the library's tolerance
    with bench's slack), else a description of the mismatch."""
    got, want = _as_tuple(case.flame()), _as_tuple(case.torch())
    if len(got) != len(want):
        return f"flame returned {len(got)} outputs, torch {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        problem = common.mismatch(g.to_torch() if isinstance(g, flame.Tensor) else g, w, case.check_dtype)
        if problem:
            return f"output {i}: {problem}"
    return None


def _alternated(a, b, ctx):
    """(ms runs of ``a``, ms runs of ``b``), the two timed alternately ``--repeat`` times."""
    return tuple(zip(*[(time_device(a, ctx), time_device(b, ctx)) for _ in range(ctx.repeat)]))


def _tuned_and_default_times(case, ctx, tuned=None):
    """(timer, tuned ms runs, heuristic ms runs) of ``case.flame``, alternating per --repeat.
    A launch config changes the device time, not the host's, so where both can be captured the
    two sides replay CUDA graphs ("graph": device time alone, free of the shared host's noise);
    else both run eagerly ("eager"). ``tuned``: a graph of ``case.flame`` captured already."""
    if not ctx.interpreter:
        tuned = common.captured(case.flame) if tuned is None else tuned
        with ctx.baseline_configs():
            default = common.captured(case.flame)
        if tuned is not None and default is not None:
            return ("graph", *_alternated(tuned.replay, default.replay, ctx))

    def default_run():
        with ctx.baseline_configs():
            return time_device(case.flame, ctx)

    runs = [(time_device(case.flame, ctx), default_run()) for _ in range(ctx.repeat)]
    return ("eager", *zip(*runs))


def _configs_used(case):
    """The launch configs one call of ``case.flame`` asks flame.tune for, in order."""
    with tune.record() as asked:
        case.flame()
    return [q[3] for q in asked]


def _table_changes(case, ctx):
    """Whether the tuning table changes any launch config of ``case`` against the baseline (the
    heuristics or --baseline-table; else both runs launch the very same kernels, and timing both
    measures only noise)."""
    tuned = _configs_used(case)
    with ctx.baseline_configs():
        return _configs_used(case) != tuned


def run_case(fam: str, case: Case, ctx: Ctx) -> dict:
    row = {"family": fam, "case": case.name, "note": case.note}
    problem = check_case(case) if case.check else None
    if problem:
        row.update(error=f"flame and torch disagree: {problem}")
        return row
    if case.timer == "host":
        f, t = time_host(case.flame, ctx, case.ops), time_host(case.torch, ctx, case.ops)
        row.update(unit="us/op", flame=f, torch=t)
    else:
        # --repeat: alternate flame and torch (and flame on its heuristic configs, --tuning compare),
        # keep the median of each side's medians: a transient slowdown of the shared host or card
        # then moves no side
        compare = ctx.tuning == "compare" and _table_changes(case, ctx)
        if ctx.tuning == "compare" and not compare:
            row.update(tuned_same_configs=True)
        # both sides replayed from CUDA graphs: device time alone, without either framework's host cost
        graphs = (None if ctx.interpreter or ctx.timer == "eager"
                  else (common.captured(case.flame), common.captured(case.torch)))
        graphed = _alternated(graphs[0].replay, graphs[1].replay, ctx) if graphs and None not in graphs else None
        if graphed is not None:
            gf, gt = (statistics.median(x) for x in graphed)
            row.update(graph=dict(flame=gf, torch=gt, ratio=gf / gt if gt > 0 else math.inf,
                                  flame_runs=list(graphed[0]), torch_runs=list(graphed[1])))
        if ctx.timer == "graph" and graphed is not None:
            (fs, ts), timer = graphed, "graph"
        else:
            (fs, ts), timer = _alternated(case.flame, case.torch, ctx), "eager"
        f, t = statistics.median(fs), statistics.median(ts)
        row.update(unit="ms", timer=timer, flame=f, torch=t)
        if compare:
            tuned_timer, tuned, default = _tuned_and_default_times(case, ctx, graphs[0] if graphs else None)
            d = statistics.median(default)
            row.update(tuned_timer=tuned_timer, flame_tuned=statistics.median(tuned), flame_defaults=d,
                       flame_tuned_runs=list(tuned), flame_defaults_runs=list(default),
                       tuned_speedup=d / statistics.median(tuned))
        if ctx.repeat > 1:
            row.update(flame_runs=list(fs), torch_runs=list(ts))
        if case.nbytes:
            row.update(bytes=case.nbytes, flame_gbps=case.nbytes / f / 1e6, torch_gbps=case.nbytes / t / 1e6)
        if case.flops:
            row.update(flops=case.flops, flame_tflops=case.flops / f / 1e9, torch_tflops=case.flops / t / 1e9)
        if ctx.kernels and not ctx.interpreter:
            row.update(kernels=dict(flame=kernel_times(case.flame), torch=kernel_times(case.torch)))
    row["ratio"] = f / t if t > 0 else math.inf
    return row


# ---- reporting ---------------------------------------------------------------------------------

def _fmt(v, digits=4):
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.0f}"


def _rate(row, who):
    if f"{who}_tflops" in row:
        return f"{row[f'{who}_tflops']:.1f} TFLOP/s"
    if f"{who}_gbps" in row:
        return f"{row[f'{who}_gbps']:.0f} GB/s"
    return "-"


def print_table(rows: list[dict], baseline: str | None = None) -> None:
    """The results table; ``baseline``: --baseline-table's file (else the compare side is the
    heuristics)."""
    compare = any("flame_defaults" in r for r in rows)
    graphed = any("graph" in r and r.get("timer") == "eager" for r in rows)
    header = ("case", "flame", "torch", "unit", "flame/torch", "flame rate", "torch rate")
    if graphed:
        header += ("graph flame", "graph torch", "graph flame/torch")
    if compare:
        header += ("flame baseline" if baseline else "flame defaults", "tuned speedup")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((f"{r['family']}: {r['case']}", "ERROR", r["error"]))
            continue
        line = (f"{r['family']}: {r['case']}", _fmt(r["flame"]), _fmt(r["torch"]), r["unit"],
                f"{r['ratio']:.2f}x", _rate(r, "flame"), _rate(r, "torch"))
        if graphed:
            g = r.get("graph") if r.get("timer") == "eager" else None
            line += (_fmt(g["flame"]), _fmt(g["torch"]), f"{g['ratio']:.2f}x") if g else ("-", "-", "-")
        if compare:
            line += (_fmt(r.get("flame_defaults")), f"{r['tuned_speedup']:.2f}x" if "tuned_speedup" in r else "-")
        lines.append(line)
    ok = [line for line in lines if line[1] != "ERROR"]
    widths = [max(len(header[i]), *(len(str(line[i])) for line in ok)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        if line[1] == "ERROR":
            print(f"{line[0]:<{widths[0]}}  ERROR: {line[2]}")
        else:
            print(fmt.format(*line))
    speedups = [r["tuned_speedup"] for r in rows if r.get("tuned_speedup", 0) > 0]
    same = sum(1 for r in rows if r.get("tuned_same_configs"))
    if speedups or same:
        geo = math.exp(statistics.fmean(math.log(x) for x in speedups)) if speedups else 1.0
        slower = [r["case"] for r in rows if r.get("tuned_speedup", 1) < 0.95]
        other = f"the table {baseline}" if baseline else "heuristic defaults"
        print(f"tuned table vs {other}: geometric-mean speedup {geo:.3f}x over the {len(speedups)} cases "
              f"the table changes ({same} launch the {'baseline' if baseline else 'heuristic'}'s configs either "
              f"way); {len(slower)} cases more than 5% slower{': ' + ', '.join(slower) if slower else ''}")


def print_kernels(rows: list[dict], top=6) -> None:
    """Each profiled case's ``top`` kernels per side (--kernels), µs per call."""
    for r in rows:
        if "kernels" not in r:
            continue
        print(f"{r['family']}: {r['case']}")
        for side in ("flame", "torch"):
            ks = r["kernels"][side]
            print(f"  {side}: {sum(k[2] for k in ks):.1f} us per call in {sum(k[1] for k in ks):g} launches")
            for name, launches, us in ks[:top]:
                print(f"    {us:9.2f} us  {launches:4g}x  {name[:90]}")


def _ratios(row):
    """{timer: flame/torch time} of a device-time row: its main timer's ratio and the graph's."""
    out = {row.get("timer", "eager"): row["ratio"]}
    if row.get("graph"):
        out["graph"] = row["graph"]["ratio"]
    return out


def check_targets(rows: list[dict], families) -> list[dict]:
    """Each target of ``families`` against ``rows``, per timer that measured its cases: the
    statistic, the bound, how many cases and whether it is met."""
    results = []
    for fam in families:
        for t in TARGETS.get(fam, ()):
            picked = [_ratios(r) for r in rows
                      if r["family"] == fam and "error" not in r and r.get("unit") == "ms" and t.select(r["case"])]
            for timer in ("eager", "graph"):
                vals = [p[timer] for p in picked if timer in p]
                if not vals:
                    continue
                v = max(vals) if t.stat == "max" else math.exp(statistics.fmean(math.log(x) for x in vals))
                results.append(dict(family=fam, target=t.text, timer=timer, stat=t.stat, value=v, bound=t.bound,
                                    cases=len(vals), met=v < t.bound if t.strict else v <= t.bound))
    return results


def print_targets(results: list[dict]) -> None:
    """One line per target: each timer's statistic and whether it meets the bound."""
    if not results:
        return
    print("\nissue targets (flame time / PyTorch time; eager calls, then CUDA-graph replays):")
    lines = {}
    for r in results:
        word = "max" if r["stat"] == "max" else "geo-mean"
        lines.setdefault((r["family"], r["target"], r["bound"]), []).append(
            f"{r['timer']} {word} {r['value']:.3f}x {'met' if r['met'] else 'MISSED'} "
            f"({r['cases']} case{'' if r['cases'] == 1 else 's'})")
    for (fam, text, bound), parts in lines.items():
        print(f"  {fam}: {text} [bound {bound:.3g}x]: " + "; ".join(parts))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="families:\n" + "\n".join(f"  {k:<12} {d}" for k, (_, d) in FAMILIES.items()))
    p.add_argument("--family", action="append", default=[],
                   help="family to run (repeatable or comma-separated; default: all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="element type (default: bf16 on a GPU, fp32 on the interpreter)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="small shapes and few repetitions (smoke test)")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up in ms (default 25, quick 5)")
    p.add_argument("--rep", type=int, default=None, help="do_bench measurement time in ms (default 100, quick 20)")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each device case this many times, alternating flame and torch; report the medians")
    p.add_argument("--tuning", choices=("table", "defaults", "compare"), default="table",
                   help="flame's launch configs: this GPU's tuning table where it has an entry (table, the "
                        "default), the heuristic defaults only (defaults), or both, timed alternately in this "
                        "run with the tuned speedup per case (compare)")
    p.add_argument("--baseline-table", type=Path, default=None, metavar="PATH",
                   help="with --tuning compare: time the current table against this table file (an earlier "
                        "version of configs/autotune/<gpu>.json, say) instead of the heuristic defaults")
    p.add_argument("--timer", choices=("eager", "graph", "both"), default="both",
                   help="device cases on a GPU: time each call as a user makes it (eager: host cost included), "
                        "replays of a CUDA graph of it (graph: device time alone, free of the shared host's "
                        "noise), or both, reporting both ratios (default); the interpreter times eagerly")
    p.add_argument("--case", action="append", default=[], metavar="TEXT",
                   help="run only the cases whose names contain TEXT (repeatable: any of them)")
    p.add_argument("--kernels", action="store_true",
                   help="on a GPU, also profile each device case: its CUDA kernels per side, launches and device "
                        "time per call (torch.profiler)")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    args = p.parse_args(argv)
    names = [n.strip() for spec in args.family for n in spec.split(",") if n.strip()] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    args.family = list(dict.fromkeys(names))
    if args.baseline_table is not None:
        if args.tuning != "compare":
            p.error("--baseline-table needs --tuning compare")
        if not args.baseline_table.is_file():
            p.error(f"--baseline-table: no file {args.baseline_table}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        for name, (_, desc) in FAMILIES.items():
            print(f"{name:<12} {desc}")
        return 0
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if flame.is_interpreter() else torch.bfloat16)
    ctx = Ctx(dtype=dtype, quick=args.quick,
              warmup=args.warmup if args.warmup is not None else (5 if args.quick else 25),
              rep=args.rep if args.rep is not None else (20 if args.quick else 100), repeat=max(1, args.repeat),
              tuning=args.tuning, timer=args.timer, kernels=args.kernels,
              baseline=str(args.baseline_table) if args.baseline_table else None)
    env = common.environment("bench.py", argv)
    print(f"flame bench on {env['device']} ({env['backend']}); torch {env['torch']}, triton {env['triton']}; "
          f"dtype {dtype}; {env['date']}")
    if ctx.interpreter:
        print("note: no GPU -- kernels run in Triton's interpreter, so these times mean nothing")
    rows = []
    partial = args.quick or bool(args.case)  # targets are judged on every full-size case of a family

    def save():  # after every family, so a run stopped midway keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            doc = {**env, "dtype": str(dtype).replace("torch.", ""), "quick": args.quick, "tuning": args.tuning,
                   "baseline_table": ctx.baseline,
                   "timer": args.timer, "families": args.family, "results": rows,
                   "targets": [] if partial else check_targets(rows, args.family)}
            args.out.write_text(json.dumps(doc, indent=2) + "\n")

    with tune.heuristics_only() if args.tuning == "defaults" else contextlib.nullcontext():
        for name in args.family:
            fn, _ = FAMILIES[name]
            flame.manual_seed(0)
            cases = [c for c in fn(ctx) if not args.case or any(text in c.name for text in args.case)]
            for i, case in enumerate(cases):
                rows.append(run_case(name, case, ctx))
                r = rows[-1]
                done = f"ERROR {r['error']}" if "error" in r else f"{r['ratio']:.2f}x ({_fmt(r['flame'])} {r['unit']})"
                print(f"[{name} {i + 1}/{len(cases)}] {case.name}: {done}", file=sys.stderr, flush=True)
            save()
    print_table(rows, ctx.baseline)
    print_kernels(rows)
    if not partial:  # the targets are set on all the full-size shapes
        print_targets(check_targets(rows, args.family))
    if args.out:
        print(f"wrote {args.out}")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
