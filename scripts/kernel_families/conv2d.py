"""conv2d (flame/kernels/conv2d.py, ops/conv2d.py): convolutions on channels-last maps, benchmarked
against cuDNN on NCHW and channels-last tensors, and their three passes tuned per SDXL shape."""
from __future__ import annotations

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame.kernels import conv2d as KC
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, Target, fwd_bwd_cases, leaf, randn, starts
from .problems import Bench, Problem, Tuning
from .problems import Ctx as TuneCtx

# ---- benchmark ---------------------------------------------------------------------------------

_CONV_S1 = dict(without=(" s2", "up2x", "x4x128x128", "->4 "))
TARGETS = tuple(
    t for kind in ("fwd ", "fwd+bwd") for t in (
        Target(f"3x3 {kind.strip()} faster than PyTorch NCHW on every shape (issue 5)",
               starts(kind, "3x3", "vs torch NCHW", without=("up2x",)), "max", 1.0, strict=True),
        Target(f"3x3 stride-1 {kind.strip()} at most 1.15x cuDNN channels-last, geometric mean (issue 5)",
               starts(kind, "3x3", "vs torch CL", **_CONV_S1), "geo", 1.15))
)


def _sdxl_convs(rows):
    """``rows`` of CONV_SHAPES, each checked against the SDXL shapes file: a k x k convolution is a
    row of its conv section (the input size after the upsampler's 2x), a 1x1 one a row of its linear
    section (batch x pixels, Ci, Co: it runs on the GEMM)."""
    for n, ci, h, w, co, k, s, up in rows:
        if k == 1:
            common.sdxl_rows("matmul", [(n * h * w, ci, co)])
        else:
            common.sdxl_rows("conv2d", [(n, ci, 2 * h if up else h, 2 * w if up else w, co, k, s)])
    return rows


CONV_SHAPES = _sdxl_convs([  # (N, Ci, H, W, Co, kernel, stride, nearest-2x upsample first): SDXL's convs at 1024x1024
    (1, 320, 128, 128, 320, 3, 1, False), (1, 640, 64, 64, 640, 3, 1, False), (1, 1280, 32, 32, 1280, 3, 1, False),
    (4, 320, 128, 128, 320, 3, 1, False),
    (1, 2560, 32, 32, 1280, 3, 1, False), (1, 1920, 64, 64, 640, 3, 1, False), (1, 960, 128, 128, 320, 3, 1, False),
    (1, 320, 128, 128, 320, 3, 2, False), (1, 640, 64, 64, 640, 3, 2, False),
    (1, 4, 128, 128, 320, 3, 1, False), (1, 320, 128, 128, 4, 3, 1, False),  # conv_in, conv_out
    (1, 2560, 32, 32, 1280, 1, 1, False), (1, 960, 128, 128, 320, 1, 1, False),  # 1x1 shortcuts
    (1, 1280, 32, 32, 1280, 3, 1, True), (1, 640, 64, 64, 640, 3, 1, True),  # up-samplers
    # batch 2: a guided text-to-image step's (the unconditional and conditional rows), forward-heavy ones
    (2, 320, 128, 128, 320, 3, 1, False), (2, 640, 64, 64, 640, 3, 1, False), (2, 1280, 32, 32, 1280, 3, 1, False),
    (2, 2560, 32, 32, 1280, 3, 1, False), (2, 1920, 64, 64, 640, 3, 1, False), (2, 960, 128, 128, 320, 3, 1, False),
])


def _conv_fn(lib, k, stride, up):
    """``fn(x, w, b)``: [nearest 2x upsample, then] conv2d with 'same' padding for odd ``k``."""
    def fn(x, w, b):
        if up:
            x = lib.interpolate(x, scale_factor=2, mode="nearest")
        return lib.conv2d(x, w, b, stride=stride, padding=k // 2)
    return fn


def conv_cases(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    small = [(1, 16, 8, 8, 16, 3, 1, False), (1, 16, 9, 7, 24, 3, 2, False), (1, 4, 8, 8, 16, 3, 1, False),
             (1, 24, 8, 8, 16, 1, 1, False), (1, 16, 4, 4, 16, 3, 1, True)]
    quick_gpu = [(n, ci, h // 4, wd // 4, *rest) for n, ci, h, wd, *rest in CONV_SHAPES]
    cases = []
    for n, ci, h, wd, co, k, s, up in ctx.shape(CONV_SHAPES, quick_gpu, small):
        x, tx = leaf((n, ci, h, wd), ctx.dtype, channels_last=True)  # flame keeps activations channels-last
        w, _ = randn(co, ci, k, k, dtype=ctx.dtype)
        with flame.no_grad():
            w = w * (1.0 / (ci * k * k) ** 0.5)
        # flame's weight channels-last, as nn.Conv2d stores it
        w = flame.from_torch(w.to_torch().contiguous(memory_format=torch.channels_last)).requires_grad_()
        b, tb = randn(co, dtype=ctx.dtype, requires_grad=True)
        ho, wo = ((size * (2 if up else 1) - 1) // s + 1 for size in (h, wd))  # padding k // 2, odd k
        g = leaf((n, co, ho, wo), ctx.dtype, channels_last=True)[0].detach()  # channels-last, as flame's output
        flops = 2 * n * ho * wo * co * ci * k * k
        name = f"{'up2x+' if up else ''}{k}x{k}{f' s{s}' if s > 1 else ''} {n}x{ci}x{h}x{wd}->{co}"
        for fmt, tag in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "CL")):
            tx_f, tw_f = (t.detach().contiguous(memory_format=fmt).requires_grad_() for t in (tx, w.to_torch()))
            cases += fwd_bwd_cases(f"{name} vs torch {tag}", _conv_fn(F, k, s, up),
                                   _conv_fn(torch.nn.functional, k, s, up), (x, w, b), (tx_f, tw_f, tb), g,
                                   g.to_torch().contiguous(memory_format=fmt), flops=flops)
    return cases


_CONV_KERNELS = ("conv2d", "conv2d_tma", "conv2d_fold", "conv2d_dgrad", "conv2d_dgrad_tma", "conv2d_wgrad",
                 "conv2d_wgrad_tma")
BENCH = BenchFamily("conv2d", "conv2d (+bias) fwd and fwd+bwd on SDXL shapes: flame channels-last vs torch NCHW and "
                    "channels-last", conv_cases, TARGETS, kernels=_CONV_KERNELS, aliases=("conv",))


# ---- tuning ------------------------------------------------------------------------------------

CONV_FIELDS = ("N", "Ci", "H", "W", "Co", "k", "stride")
QUICK = ((1, 8, 6, 5, 12, 3, 1), (1, 8, 7, 6, 8, 3, 2))


def _conv_name(shape, what):
    nb, ci, h, w, co, k, s = shape
    return f"{what} {k}x{k}{f' s{s}' if s > 1 else ''} {nb}x{ci}x{h}x{w}->{co}"


def _conv_out_size(size, k, s):
    return (size + 2 * (k // 2) - k) // s + 1


def forward_problems(ctx: TuneCtx, shape) -> list[Problem]:
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


def input_grad_problems(ctx: TuneCtx, shape) -> list[Problem]:
    """conv2d's input gradient (kernel conv2d_dgrad, or conv2d_dgrad_tma, conv2d_fold, matmul for 1x1), channels-last"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # flame/ops/conv2d.py _conv2d_backward for a channels-last input
        g = ctx.randn(nb, co, ho, wo, channels_last=True)
        wt = ctx.randn(co, ci, k, k, scale=(co * k * k) ** -0.5, channels_last=True)
        out = ctx.empty(nb, ci, h, w, channels_last=True)
        want = torch.nn.grad.conv2d_input((nb, ci, h, w), wt.float(), g.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_input_grad_(out, g, wt, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "dgrad"), build)]


def weight_grad_problems(ctx: TuneCtx, shape) -> list[Problem]:
    """conv2d's weight gradient (kernel conv2d_wgrad, or conv2d_wgrad_tma, matmul for 1x1), channels-last"""
    nb, ci, h, w, co, k, s = shape
    ho, wo = _conv_out_size(h, k, s), _conv_out_size(w, k, s)

    def build():  # flame/ops/conv2d.py _conv2d_backward: dW in the layout of flame's (channels-last) weights
        g = ctx.randn(nb, co, ho, wo, channels_last=True)
        x = ctx.randn(nb, ci, h, w, scale=(nb * ho * wo) ** -0.5, channels_last=True)
        out = ctx.empty(co, ci, k, k, channels_last=True)  # every element written each run (kernel or split-K sum)
        want = torch.nn.grad.conv2d_weight(x.float(), (co, ci, k, k), g.float(), stride=s, padding=k // 2)
        return Bench(lambda: KC.conv2d_weight_grad_(out, g, x, (s, s), (k // 2, k // 2), (1, 1)), out, want)

    return [Problem(_conv_name(shape, "wgrad"), build)]


TUNING = {
    "conv2d": Tuning(forward_problems, "conv2d", CONV_FIELDS, quick=QUICK,
                     kernels=("conv2d", "conv2d_tma", "conv2d_fold")),
    "conv2d_dgrad": Tuning(input_grad_problems, "conv2d", CONV_FIELDS, quick=QUICK,
                           kernels=("conv2d_dgrad", "conv2d_dgrad_tma", "conv2d_fold")),
    "conv2d_wgrad": Tuning(weight_grad_problems, "conv2d", CONV_FIELDS, quick=QUICK,
                           kernels=("conv2d_wgrad", "conv2d_wgrad_tma")),
}
