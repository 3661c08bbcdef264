"""rope (flame/kernels/rope.py, ops/rope.py): Flux's attention prologue, ``F.qk_norm_rope`` (q/k
RMSNorm per head, the rotary embedding, the head split; in the single block also GELU of the MLP
columns), against the same steps composed in PyTorch as diffusers runs them. The op moves memory
only, so its rows report GB/s: what the kernels read and write once. Nothing to tune (a heuristic
launch config, ``rope_config``)."""
from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
import flame
import torch
# isort: on

from .cases import BenchFamily, Case, Ctx, element_size, fwd_bwd_cases, randn

# Flux.1's blocks at 1024x1024 (24 heads of 128, 512 text + 4096 image tokens): the double block's two
# streams (text, image) of [q | k | v] projections, and the single block's linear1 output (q, k, v
# and 12288 MLP columns), as (name, token counts per stream, columns per stream)
FLUX_BLOCKS = [("double", (512, 4096), 3 * 3072), ("single", (4608,), 3 * 3072 + 12288)]
HEADS, HEAD_DIM = 24, 128


def _torch_prologue(xs, weights, cos, sin, heads, tail):
    """diffusers' steps: per stream q, k, v split from the projection and q, k RMS-normalised
    (statistics in fp32), the streams concatenated along the tokens, q and k rotated by the
    repeat-interleaved tables; the single block's GELU (tanh) of the columns past 3 H D."""
    parts = []
    for x, (wq, wk) in zip(xs, weights):
        d = wq.shape[0]
        q, k, v = x[..., :3 * heads * d].unflatten(-1, (3, heads, d)).unbind(2)
        parts.append(tuple(t if w is None else (t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                                                ).to(t.dtype) * w for t, w in ((q, wq), (k, wk), (v, None))))
    q, k, v = (torch.cat(p, dim=1) for p in zip(*parts))
    c = cos.repeat_interleave(2, -1)[None, :, None, :]
    s = sin.repeat_interleave(2, -1)[None, :, None, :]

    def rotate(t):
        real, imag = t.reshape(*t.shape[:-1], -1, 2).unbind(-1)
        return (t.float() * c + torch.stack([-imag, real], dim=-1).flatten(3).float() * s).to(t.dtype)

    out = tuple(t.transpose(1, 2) for t in (rotate(q), rotate(k), v))
    if tail:
        out += (torch.nn.functional.gelu(xs[0][..., 3 * heads * q.shape[-1]:], approximate="tanh"),)
    return out


def rope_cases(ctx: Ctx) -> list[Case]:
    import flame.nn.functional as F

    heads, d, blocks = HEADS, HEAD_DIM, FLUX_BLOCKS
    if ctx.quick or ctx.interpreter:
        heads, d = 2, 16
        blocks = [("double", (8, 24), 3 * 2 * 16), ("single", (32,), 3 * 2 * 16 + 64)]
    es = element_size(ctx.dtype)
    cases = []
    for name, tokens, width in blocks:
        total = sum(tokens)
        tail = len(tokens) == 1
        streams = [randn(1, n, width, dtype=ctx.dtype, requires_grad=True) for n in tokens]
        weights = [[randn(d, dtype=ctx.dtype, requires_grad=True) for _ in range(2)] for _ in tokens]
        angles = flame.rand(total, d // 2).to_torch() * 6.0  # fp32 tables, as Flux's
        cos, sin = angles.cos(), angles.sin()
        f_cos, f_sin = flame.from_torch(cos), flame.from_torch(sin)
        f_in = [x for x, _ in streams] + [w for pair in weights for w, _ in pair]
        t_in = [t for _, t in streams] + [t for pair in weights for _, t in pair]
        n_streams = len(tokens)

        def f_fn(*inputs, n_streams=n_streams, tail=tail, tables=(f_cos, f_sin)):
            xs, ws = inputs[:n_streams], inputs[n_streams:]
            return F.qk_norm_rope(list(xs), [ws[2 * i:2 * i + 2] for i in range(n_streams)], *tables, heads,
                                  tail="gelu_tanh" if tail else None)

        def t_fn(*inputs, n_streams=n_streams, tail=tail, tables=(cos, sin)):
            xs, ws = inputs[:n_streams], inputs[n_streams:]
            return _torch_prologue(xs, [ws[2 * i:2 * i + 2] for i in range(n_streams)], *tables, heads, tail)

        outputs = [(1, heads, total, d)] * 3 + ([(1, total, width - 3 * heads * d)] if tail else [])
        grads = [flame.randn(*shape, dtype=ctx.dtype) for shape in outputs]
        used = total * (width if tail else 3 * heads * d)  # the input columns read, the outputs' elements written
        cases += fwd_bwd_cases(f"qk_norm_rope {name} {'+'.join(map(str, tokens))}x{width}", f_fn, t_fn, f_in, t_in,
                               tuple(grads), tuple(g.to_torch() for g in grads), nbytes=2 * used * es,
                               bwd_factor=1.5)
    return cases


BENCH = BenchFamily("rope", "F.qk_norm_rope: Flux's attention prologue (q/k RMSNorm, rotary embedding, head split; "
                    "the single block's GELU) at Flux.1's 1024x1024 blocks", rope_cases)
TUNING = {}
