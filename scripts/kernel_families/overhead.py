"""overhead (flame/autograd.py, tensor.py, kernels/launch.py): the host's cost per op, recording and
launching, against PyTorch autograd. No kernel of its own, nothing to tune."""
from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
import flame
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, randn


def _chain(lib, x, w, b, blocks):
    """``blocks`` x 5 elementwise ops plus a final sum: values stay bounded (tanh, then exp <= e)."""
    for _ in range(blocks):
        x = lib.exp(lib.tanh(x * w + b)) * 0.3
    return x.sum()


def host_cases(ctx: Ctx) -> list[Case]:
    blocks = 10
    n_ops = 5 * blocks + 1
    size = 64
    dt = torch.float32  # host cost does not depend on dtype; fp32 keeps the pre-timing check strict
    x, tx = randn(size, size, dtype=dt)
    w, tw = randn(size, size, dtype=dt, requires_grad=True)
    b, tb = randn(size, dtype=dt, requires_grad=True)

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


BENCH = BenchFamily("overhead", "host time per op: a chain of ~50 small ops, forward and forward+backward",
                    host_cases)
TUNING = {}
