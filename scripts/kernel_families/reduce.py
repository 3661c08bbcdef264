"""reduce (flame/kernels/reduce.py, ops/reduce.py): sums over one axis, tuned on SDXL's bias
gradients and row sums. Its benchmark case, a row sum, is one of elementwise's bandwidth cases."""
from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
from flame.kernels import reduce as KR
# isort: on

from .problems import Bench, Ctx, Problem, Tuning, reference


def sum_problems(ctx: Ctx, shape) -> list[Problem]:
    """sums over R of an (outer, R, inner) tensor (kernel reduce): column sums (outer 1, a bias
    gradient), row sums (inner 1)"""
    outer, r, inner = shape

    def build():
        x, out = ctx.randn(outer, r, inner), ctx.empty(outer * inner)
        return Bench(lambda: KR.reduce_(out, x, outer, r, inner, x.stride(), KR.SUM), out,
                     reference(lambda x: x.sum(1).flatten(), (x,)))

    what = "column sum" if outer == 1 else "row sum" if inner == 1 else "sum over R of"
    return [Problem(f"{what} {outer}x{r}x{inner}", build)]


BENCH = None  # see the module's docstring
TUNING = {"reduce": Tuning(sum_problems, "reduce", ("outer", "R", "inner"),
                           quick=((1, 40, 24), (6, 100, 1)),  # column sum, row sum
                           kernels=("reduce",))}
