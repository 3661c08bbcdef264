"""lora (ops/matmul.py lora_linear, kernels/dora.py): LoRA and DoRA adapters on a Linear, benchmarked
against the same formulas in PyTorch. Nothing to tune of its own: its GEMMs are matmul's."""
from __future__ import annotations

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, fwd_bwd_cases, randn

LORA_SHAPES = common.sdxl_rows("matmul", [(4096, 640, 640), (77, 2048, 640), (1024, 1280, 1280),
                                          (77, 2048, 1280)])  # SDXL's attention projections


def _torch_lora(x, w, a, b, m, scale):
    """LoRA (``m`` None) or PEFT's DoRA on a Linear in torch: the base product, the two adapter
    products in x's dtype, and for DoRA the scale m / ||W + s B A|| (fp32, detached)."""
    lin = torch.nn.functional.linear
    z = lin(x, w) + lin(lin(x, a.to(x.dtype)), b.to(x.dtype)) * scale
    if m is None:
        return z
    return z * (m / (w.float() + scale * b @ a).norm(dim=1).detach()).to(z.dtype)


def lora_cases(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    cases = []
    shapes = LORA_SHAPES if not ctx.quick else [(256, 128, 192)]
    if ctx.interpreter:
        shapes = [(16, 24, 32)]
    for m, k, n in shapes:
        x, tx = randn(m, k, dtype=ctx.dtype, requires_grad=True)
        w, tw = randn(n, k, dtype=ctx.dtype)
        a, ta = randn(16, k, dtype=torch.float32, requires_grad=True)
        lb, tlb = randn(n, 16, dtype=torch.float32, requires_grad=True)
        with flame.no_grad():
            mag = (flame.rand(n) + 20.0).requires_grad_()
        tmag = mag.to_torch().detach().clone().requires_grad_()
        g = flame.randn(m, n, dtype=ctx.dtype)
        for dora in (False, True):
            f_in, t_in = ((x, w, a, lb, mag), (tx, tw, ta, tlb, tmag)) if dora else ((x, w, a, lb), (tx, tw, ta, tlb))
            cases += fwd_bwd_cases(f"{'dora' if dora else 'lora'} {m}x{k}->{n}",
                                   lambda x, w, a, b, mag=None: F.lora_linear(x, w, None, a, b, 0.5, magnitude=mag),
                                   lambda x, w, a, b, mag=None: _torch_lora(x, w, a, b, mag, 0.5), f_in, t_in, g,
                                   g.to_torch(), flops=2 * m * n * (k + 16) + 2 * m * k * 16,
                                   check_dtype=ctx.dtype)  # fp32 adapter gradients of 16-bit products
    return cases


BENCH = BenchFamily("lora", "F.lora_linear: LoRA and DoRA (magnitude) adapters, rank 16, on SDXL's attention "
                    "projections", lora_cases, kernels=("matmul", "matmul_tma"))
TUNING = {}
