"""norms (flame/kernels/norms.py, ops/norms.py): GroupNorm (+ SiLU), LayerNorm and RMSNorm,
benchmarked against PyTorch and tuned per SDXL shape."""
from __future__ import annotations

import math

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame.kernels import norms as KN
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, Target, element_size, fwd_bwd_cases, leaf, randn, starts
from .problems import Bench, Fatal, Problem, Tuning, reference
from .problems import Ctx as TuneCtx

# ---- benchmark ---------------------------------------------------------------------------------

TARGETS = tuple(
    t for kind in ("fwd", "fwd+bwd") for t in (
        Target(f"GroupNorm batch 1 {kind} at least 3x faster, geometric mean (issue 4)",
               starts(f"{kind} group_norm 1x"), "geo", 1 / 3),
        Target(f"GroupNorm batch 1 {kind} never slower (issue 4)", starts(f"{kind} group_norm 1x"),
               "max", 1.0))
) + (
    Target("LayerNorm forward at most 1.0x, geometric mean (issue 4)", starts("fwd layer_norm"), "geo", 1.0),
    Target("RMSNorm forward at most 1.0x, geometric mean (issue 4)", starts("fwd rms_norm"), "geo", 1.0),
    Target("LayerNorm forward+backward at least 1.3x faster, geometric mean (issue 4)",
           starts("fwd+bwd layer_norm"), "geo", 1 / 1.3),
    Target("RMSNorm forward+backward at least 1.3x faster, geometric mean (issue 4)",
           starts("fwd+bwd rms_norm"), "geo", 1 / 1.3),
)

# (N, C, H, W), 32 groups: SDXL's GroupNorms, each NCHW and channels-last, with and without SiLU
GROUP_NORM_SHAPES = [(1, 320, 128, 128), (1, 640, 64, 64), (1, 1280, 32, 32), (1, 2560, 32, 32), (4, 320, 128, 128)]
common.sdxl_rows("group_norm", [(*shape, 32, cl, 1) for shape in GROUP_NORM_SHAPES for cl in (0, 1)])
# (rows, C): SDXL's transformers at 640 and 1280 channels, then two reference sizes
LAYER_NORM_SHAPES = [(4096, 640), (1024, 1280), (16384, 320), (8192, 4096)]
common.sdxl_rows("layer_norm", [(*shape, 0) for shape in LAYER_NORM_SHAPES[:2]])


def norms_cases(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    tf = torch.nn.functional
    dt, es = ctx.dtype, element_size(ctx.dtype)
    gn, rows = GROUP_NORM_SHAPES, LAYER_NORM_SHAPES
    if ctx.quick or ctx.interpreter:
        gn, rows = [(1, 64, 8, 8)], [(64, 96)]
    cases = []
    for shape in gn:
        n = math.prod(shape)
        for cl in (False, True):
            for act in (None, "silu"):
                x, tx = leaf(shape, dt, cl)
                w, tw = randn(shape[1], dtype=dt, requires_grad=True)
                b, tb = randn(shape[1], dtype=dt, requires_grad=True)
                g = flame.from_torch(torch.randn_like(tx))
                name = f"group_norm {'x'.join(map(str, shape))}{' CL' if cl else ''}{' +silu' if act else ''}"

                def t_fn(x, w, b, act=act):
                    y = tf.group_norm(x, 32, w, b, 1e-5)
                    return tf.silu(y) if act else y

                cases += fwd_bwd_cases(name, lambda x, w, b, act=act: F.group_norm(x, 32, w, b, activation=act),
                                       t_fn, (x, w, b), (tx, tw, tb), g, g.to_torch(), nbytes=2 * n * es,
                                       bwd_factor=1.5)
    for m, c in rows:
        x, tx = randn(m, c, dtype=dt, requires_grad=True)
        w, tw = randn(c, dtype=dt, requires_grad=True)
        b, tb = randn(c, dtype=dt, requires_grad=True)
        g = flame.randn(m, c, dtype=dt)
        cases += fwd_bwd_cases(f"layer_norm {m}x{c}", lambda x, w, b, c=c: F.layer_norm(x, c, w, b),
                               lambda x, w, b, c=c: tf.layer_norm(x, (c,), w, b), (x, w, b), (tx, tw, tb),
                               g, g.to_torch(), nbytes=2 * m * c * es, bwd_factor=1.5)
        cases += fwd_bwd_cases(f"rms_norm {m}x{c}", lambda x, w, c=c: F.rms_norm(x, c, w),
                               lambda x, w, c=c: tf.rms_norm(x, (c,), w), (x, w), (tx, tw),
                               g, g.to_torch(), nbytes=2 * m * c * es, bwd_factor=1.5)
    return cases


BENCH = BenchFamily("norms", "GroupNorm(32)(+SiLU) NCHW/channels-last, LayerNorm, RMSNorm", norms_cases, TARGETS,
                    kernels=("group_norm_fwd", "group_norm_bwd", "layer_norm_fwd", "layer_norm_bwd"))


# ---- tuning ------------------------------------------------------------------------------------

def _ns(t):
    """(n, c, position) strides of an (N, C, H, W) map, NCHW or channels-last: its (N, C, H*W) view."""
    return t.stride(0), t.stride(1), t.stride(3)


def group_norm_problems(ctx: TuneCtx, shape) -> list[Problem]:
    """GroupNorm (+ SiLU) forward (kernel group_norm_fwd) and backward (group_norm_bwd), NCHW or channels-last"""
    nb, c, h, w, g, cl, silu = shape
    if c % g:
        raise Fatal(f"group_norm shape {list(shape)}: C = {c} is not a multiple of G = {g}")
    eps = 1e-5

    def torch_fn(x, wt, b):
        y = torch.nn.functional.group_norm(x, g, wt, b, eps)
        return torch.nn.functional.silu(y) if silu else y

    def inputs():  # as flame/ops/norms.py group_norm passes them: (N, C, S) strides of the map
        x, out = ctx.randn(nb, c, h, w, channels_last=cl), ctx.empty(nb, c, h, w, channels_last=cl)
        wt, b = 1 + ctx.randn(c, scale=0.5), ctx.randn(c)
        return x, wt, b, out

    def forward():
        x, wt, b, y = inputs()
        return Bench(lambda: KN.group_norm_fwd(y, x, wt, b, nb, c, h * w, g, eps, bool(silu), _ns(x), _ns(y)),
                     y, reference(torch_fn, (x, wt, b)))

    def backward():  # from flame's forward statistics (heuristic config)
        x, wt, b, dx = inputs()
        mean, rstd = KN.group_norm_fwd(ctx.empty(nb, c, h, w, channels_last=cl), x, wt, b, nb, c, h * w, g, eps,
                                       bool(silu), _ns(x), _ns(dx))
        dy, dw, db = ctx.randn(nb, c, h, w, channels_last=cl), ctx.empty(c), ctx.empty(c)

        def run():
            KN.group_norm_bwd(dx, dw, db, dy, x, wt, b, mean, rstd, nb, c, h * w, g, bool(silu), _ns(x), _ns(dy),
                              _ns(dx))

        return Bench(run, (dx, dw, db), reference(torch_fn, (x, wt, b), dy))

    name = f"group_norm {nb}x{c}x{h}x{w} G{g}{' channels-last' if cl else ''}{' silu' if silu else ''}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


def layer_norm_problems(ctx: TuneCtx, shape) -> list[Problem]:
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
                     reference(torch_fn, (x, wt, b)))

    def backward():  # from flame's forward statistics (heuristic config); RMSNorm has no bias
        x, wt, b, dx = inputs()
        mean, rstd = KN.layer_norm_fwd(ctx.empty(m, d), x, wt, b, m, d, eps, bool(rms), d, d)
        dy, dw, db = ctx.randn(m, d), ctx.empty(d), None if rms else ctx.empty(d)
        want = reference(torch_fn, (x, wt, b), dy)
        outs = (dx, dw) if rms else (dx, dw, db)
        return Bench(lambda: KN.layer_norm_bwd(dx, dw, db, dy, x, wt, mean, rstd, m, d, bool(rms), d, d, d),
                     outs, want[:len(outs)])

    name = f"{'rms_norm' if rms else 'layer_norm'} {m}x{d}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


TUNING = {
    "group_norm": Tuning(group_norm_problems, "group_norm", ("N", "C", "H", "W", "G", "channels_last", "silu"),
                         flags=("channels_last", "silu"),
                         quick=((1, 6, 5, 7, 3, 1, 1), (2, 4, 3, 5, 2, 0, 0)),  # channels-last + SiLU, NCHW
                         kernels=("group_norm_fwd", "group_norm_bwd")),
    "layer_norm": Tuning(layer_norm_problems, "layer_norm", ("M", "D", "rms"), flags=("rms",),
                         quick=((10, 24, 0), (7, 40, 1)),  # LayerNorm, RMSNorm
                         kernels=("layer_norm_fwd", "layer_norm_bwd")),
}
