"""elementwise (flame/kernels/elementwise.py, ops/elementwise.py): maps over dense and broadcast
operands, benchmarked for bandwidth against PyTorch (with a row sum and a transposing copy, the
other memory-bound launches of a step) and tuned on SDXL activations."""
from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
import flame
from flame.kernels import elementwise as KE
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, element_size, randn
from .problems import Bench, Problem, Tuning, reference
from .problems import Ctx as TuneCtx

# ---- benchmark ---------------------------------------------------------------------------------


def bandwidth_cases(ctx: Ctx) -> list[Case]:
    m, n = ctx.shape((4096, 4096), (1024, 1024), (64, 96))
    dt, es = ctx.dtype, element_size(ctx.dtype)
    numel = m * n
    a, ta = randn(m, n, dtype=dt)
    b, tb = randn(m, n, dtype=dt)
    row, trow = randn(n, dtype=dt)
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


# the row sum times the reduce family's kernel: its benchmark case lives here, with the other bandwidth cases
BENCH = BenchFamily("elementwise", "bandwidth on 16M elements: add, broadcast mul, exact gelu, row sum, transpose copy",
                    bandwidth_cases, kernels=("map_contiguous", "map_strided", "reduce"))


# ---- tuning ------------------------------------------------------------------------------------

def map_problems(ctx: TuneCtx, shape) -> list[Problem]:
    """elementwise maps of an (N, C, H, W) activation: a + b and GELU (kernel map_contiguous, one
    key: tuned once), x * a per-channel scale (map_strided)"""
    n, c, h, w = shape

    def binary(op, torch_fn, b_shape):  # as flame's ops launch it: b broadcast (expanded) to x's shape
        def build():
            x, b, out = ctx.randn(n, c, h, w), ctx.randn(*b_shape), ctx.empty(n, c, h, w)
            return Bench(lambda: KE.map_(out, [x, b.expand(x.shape)], op), out, reference(torch_fn, (x, b)))
        return build

    def gelu():
        x, out = ctx.randn(n, c, h, w), ctx.empty(n, c, h, w)
        return Bench(lambda: KE.map_(out, [x], KE.GELU), out, reference(torch.nn.functional.gelu, (x,)))

    name = f"{n}x{c}x{h}x{w}"
    return [Problem(f"add {name}", binary(KE.ADD, torch.add, (n, c, h, w))),
            Problem(f"mul {name} by (1, {c}, 1, 1)", binary(KE.MUL, torch.mul, (1, c, 1, 1))),
            Problem(f"gelu {name}", gelu)]


TUNING = {"elementwise": Tuning(map_problems, "elementwise", ("N", "C", "H", "W"), quick=((1, 3, 5, 7),),
                                kernels=("map_contiguous", "map_strided"))}
