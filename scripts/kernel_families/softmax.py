"""softmax (flame/kernels/softmax.py, ops/softmax.py): softmax, log_softmax and cross-entropy over
rows, benchmarked against PyTorch and tuned on vocabulary-sized rows."""
from __future__ import annotations

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame import runtime
from flame.kernels import softmax as KS
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, Target, element_size, fwd_bwd_cases, randn, starts
from .problems import Bench, Problem, Tuning, reference
from .problems import Ctx as TuneCtx

# ---- benchmark ---------------------------------------------------------------------------------

TARGETS = (Target("cross_entropy forward+backward faster (issue 4)", starts("fwd+bwd cross_entropy"), "max", 1.0,
                  strict=True),)

VOCAB_SHAPES = [(8192, 32000)]  # (rows, classes): softmax and cross-entropy over a Llama-2-sized vocabulary
common.sdxl_rows("softmax", [(*shape, 0) for shape in VOCAB_SHAPES])
common.sdxl_rows("cross_entropy", VOCAB_SHAPES)


def softmax_cases(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    dt, es = ctx.dtype, element_size(ctx.dtype)
    cases = []
    for m, v in [(16, 100)] if ctx.quick or ctx.interpreter else VOCAB_SHAPES:
        x, tx = randn(m, v, dtype=dt, requires_grad=True)
        g = flame.randn(m, v, dtype=dt)
        cases += fwd_bwd_cases(f"softmax {m}x{v}", lambda x: F.softmax(x, -1), lambda x: torch.softmax(x, -1),
                               (x,), (tx,), g, g.to_torch(), nbytes=2 * m * v * es, bwd_factor=1.5)
        target = flame.from_torch(torch.randint(0, v, (m,), device=tx.device))
        one = flame.ones((), dtype=dt)
        cases += fwd_bwd_cases(f"cross_entropy {m}x{v}", lambda x, t=target: F.cross_entropy(x, t),
                               lambda x, t=target: torch.nn.functional.cross_entropy(x, t.to_torch()), (x,), (tx,),
                               one, one.to_torch(), nbytes=m * v * es, bwd_factor=2.0)
    return cases


BENCH = BenchFamily("softmax", "softmax and cross_entropy over a Llama-2-sized vocabulary", softmax_cases, TARGETS,
                    kernels=("softmax_fwd", "softmax_bwd", "cross_entropy_fwd", "cross_entropy_bwd"))


# ---- tuning ------------------------------------------------------------------------------------

# The softmax backward's outputs are rounded twice (the saved output y, then dx).
SOFTMAX_SLACK = 2.0


def softmax_problems(ctx: TuneCtx, shape) -> list[Problem]:
    """softmax or log_softmax over the last dim of (ROWS, R), forward (kernel softmax_fwd) and backward (softmax_bwd)"""
    rows, r, log = shape
    strides = (r, 1, 1)  # (outer, R, inner) strides of a contiguous (ROWS, R) tensor, as flame/ops/softmax.py

    def torch_fn(x):
        return torch.log_softmax(x, -1) if log else torch.softmax(x, -1)

    def forward():
        x, y = ctx.randn(rows, r, scale=2.0), ctx.empty(rows, r)
        return Bench(lambda: KS.softmax_fwd(y, x, rows, r, 1, strides, strides, bool(log)), y,
                     reference(torch_fn, (x,)))

    def backward():  # from flame's forward output (heuristic config), as the op saves it
        x, g, dx = ctx.randn(rows, r, scale=2.0), ctx.randn(rows, r), ctx.empty(rows, r)
        y = KS.softmax_fwd(ctx.empty(rows, r), x, rows, r, 1, strides, strides, bool(log))
        return Bench(lambda: KS.softmax_bwd(dx, y, g, rows, r, 1, strides, strides, strides, bool(log)), dx,
                     reference(torch_fn, (x,), g)[0], SOFTMAX_SLACK)

    name = f"{'log_softmax' if log else 'softmax'} {rows}x{r}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


def cross_entropy_problems(ctx: TuneCtx, shape) -> list[Problem]:
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

        want = reference(lambda x: (torch.nn.functional.cross_entropy(x, t), torch.logsumexp(x, -1)), (x,))
        return Bench(run, (loss, lse), want)

    def backward():  # from flame's forward (heuristic config): the log-sum-exp and the count it saves
        x, t = inputs()
        _, lse, count = KS.cross_entropy_fwd(x, t, rows, c, 1, strides, "mean", -100, 0.0, ctx.dtype)
        g, dx = ctx.randn(), ctx.empty(rows, c)
        want = reference(lambda x: torch.nn.functional.cross_entropy(x, t), (x,), g)[0]
        return Bench(lambda: KS.cross_entropy_bwd(dx, x, t, lse, g, count, rows, c, 1, strides, strides, "mean",
                                                  -100, 0.0), dx, want)

    name = f"cross_entropy {rows}x{c}"
    return [Problem(f"{name} fwd", forward), Problem(f"{name} bwd", backward)]


TUNING = {
    "softmax": Tuning(softmax_problems, "softmax", ("ROWS", "R", "log"), flags=("log",),
                      quick=((10, 40, 0), (7, 100, 1)),  # softmax, log_softmax
                      kernels=("softmax_fwd", "softmax_bwd")),
    "cross_entropy": Tuning(cross_entropy_problems, "cross_entropy", ("ROWS", "C"), quick=((7, 100),),
                            kernels=("cross_entropy_fwd", "cross_entropy_bwd")),
}
