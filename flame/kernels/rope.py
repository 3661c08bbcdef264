"""Flux's attention prologue in one pass: RMSNorm of q and k per head, the rotary embedding, and
q, k, v moved from the fused projections into dense (B, L, H, D) buffers; and its backward.

The input is one or two "streams" (Flux's double block: the text and the image projection; the
single block: linear1's output), each (B, L_s, W_s) with batch and row strides of its own and a
unit column stride, whose first 3 H D columns are [q | k | v] (head h's element d at column
h D + d); the columns past 3 H D are never read. The streams are concatenated along L in order:
token l of stream 1 is token L_0 + l of the outputs and of the cos/sin tables (L_total, D/2).

A program owns BLOCK_L tokens of one stream and one batch, and one head, and does q, k and v.
Its tiles are (BLOCK_L, 2 HB) rows of the head's D columns (HB: D/2 rounded up to a power of two),
read and written as unit-stride runs (vector accesses), and viewed as (BLOCK_L, HB, 2) where the
rotary pairs (x[2i], x[2i+1]) are split into their even and odd halves in registers. The first
B * nb_0 programs of grid axis 0 take stream 0 (nb_s: token blocks of stream s, batch-major), the
rest stream 1; each program selects its stream's pointers and strides. Grid axis 1 is the head.

With TAIL (one stream: the single block's linear1 output, whose columns past 3 H D are the MLP
input) the forward also writes ``tail = gelu_tanh(x[:, :, 3HD:])`` (dense (B, L, W - 3 H D)), each
head's program taking its share of those columns for its rows.

The backward writes each stream's input gradient (dense (B, L_s, W_s): [dq | dk | dv] columns,
past 3 H D the tail's gradient through GELU, or zeros without a tail, so that it has the input's
shape) and, when the norm weights need gradients,
one fp32 partial row per program (q's D columns of sum_tokens dy * xhat, then k's), reduced per
stream by ``reduce_`` afterwards: deterministic, no atomics. Launch configs are a heuristic
(``rope_config``), not tuned.
"""
import triton
import triton.language as tl

from .. import runtime
from .elementwise import GELU_TANH, GELU_TANH_BWD, _apply, _pow2, cdiv, compute_dtype
from .launch import launch
from .reduce import SUM, accumulation_dtype, reduce_


@triton.jit
def _rotate(x, c, s, sign):
    """The (BLOCK_L, 2 HB) rows ``x`` with each pair (x[2i], x[2i+1]) rotated by the angle whose
    cosine and sine are c[:, i], s[:, i] (``sign`` -1: by its inverse)."""
    BLOCK_L: tl.constexpr = x.shape[0]
    HB: tl.constexpr = x.shape[1] // 2
    xe, xo = tl.split(tl.reshape(x, (BLOCK_L, HB, 2)))
    s = s * sign
    return tl.reshape(tl.join(xe * c - xo * s, xo * c + xe * s), (BLOCK_L, 2 * HB))


@triton.jit
def _program(x0_ptr, x1_ptr, B, L0, L1, D, nb0, nb1, xs0_b, xs0_l, xs1_b, xs1_l,
             BLOCK_L: tl.constexpr, HB: tl.constexpr):
    """This program's stream (``first``: stream 0), batch, rows (tokens of its stream) and their
    mask, the rows' tokens in the concatenated sequence, its head, the tile's columns and their
    mask, the tile's mask and the pointers of its head's q columns in the input."""
    pid = tl.program_id(0)
    first = pid < B * nb0
    p = tl.where(first, pid, pid - B * nb0)
    nb = tl.where(first, nb0, nb1)
    b = (p // nb).to(tl.int64)
    rows = ((p % nb) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    rmask = rows < tl.where(first, L0, L1)
    tokens = rows + tl.where(first, 0, L0)
    h = tl.program_id(1)
    col = tl.arange(0, 2 * HB)
    cmask = col < D
    m = rmask[:, None] & cmask[None, :]
    x_row = tl.where(first, x0_ptr, x1_ptr) + b * tl.where(first, xs0_b, xs1_b) + rows * tl.where(first, xs0_l, xs1_l)
    return first, b, rows, rmask, tokens, h, col, cmask, m, x_row[:, None] + h * D + col[None, :]


@triton.jit
def _angles(cos_ptr, sin_ptr, tokens, rmask, D, cs_l, cs_i, ss_l, ss_i, HB: tl.constexpr):
    """cos and sin of the rows' tokens, (BLOCK_L, HB) fp32."""
    i = tl.arange(0, HB)[None, :]
    m = rmask[:, None] & (i < D // 2)
    c = tl.load(cos_ptr + (tokens * cs_l)[:, None] + i * cs_i, mask=m, other=0.0)
    s = tl.load(sin_ptr + (tokens * ss_l)[:, None] + i * ss_i, mask=m, other=0.0)
    return c, s


@triton.jit
def _rstd(x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of each row of a (BLOCK_L, 2 HB) tile (masked entries are 0)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)


@triton.jit
def _norm_rope(x, w_ptr, col, cmask, c, s, D, eps, CD: tl.constexpr):
    # y = x * rstd * w (RMSNorm over the head's D), then the rotation of each pair by the token's angle:
    #   out[2i] = y[2i] cos_i - y[2i+1] sin_i,  out[2i+1] = y[2i+1] cos_i + y[2i] sin_i
    w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(CD)
    return _rotate(x * _rstd(x, D, eps)[:, None] * w[None, :], c, s, 1.0)


@triton.jit
def _tail_share(h, H, D, W):
    """The columns [lo, hi) past 3 H D of a row that head ``h``'s program handles: shares of a
    multiple of 8 columns, so that each starts 16-byte aligned where the row does (vector accesses)."""
    extra = W - 3 * H * D
    share = ((extra + H - 1) // H + 7) // 8 * 8
    return 3 * H * D + tl.minimum(h * share, extra), 3 * H * D + tl.minimum((h + 1) * share, extra)


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope_fwd_kernel(x0_ptr, x1_ptr, wq0_ptr, wk0_ptr, wq1_ptr, wk1_ptr, cos_ptr, sin_ptr,
                             q_ptr, k_ptr, v_ptr, t_ptr, B, L0, L1, H, D, nb0, nb1,
                             xs0_b, xs0_l, xs1_b, xs1_l, cs_l, cs_i, ss_l, ss_i, W0, eps,
                             CD: tl.constexpr, BLOCK_L: tl.constexpr, HB: tl.constexpr, TAIL: tl.constexpr,
                             BLOCK_E: tl.constexpr):
    first, b, rows, rmask, tokens, h, col, cmask, m, x = _program(x0_ptr, x1_ptr, B, L0, L1, D, nb0, nb1, xs0_b, xs0_l,
                                                               xs1_b, xs1_l, BLOCK_L, HB)
    out = ((b * (L0 + L1) + tokens) * H + h) * D
    o = out[:, None] + col[None, :]
    c, s = _angles(cos_ptr, sin_ptr, tokens, rmask, D, cs_l, cs_i, ss_l, ss_i, HB)
    q = _norm_rope(tl.load(x, mask=m, other=0.0).to(CD), tl.where(first, wq0_ptr, wq1_ptr), col, cmask, c, s,
                   D, eps, CD)
    tl.store(q_ptr + o, q.to(q_ptr.dtype.element_ty), mask=m)
    k = _norm_rope(tl.load(x + H * D, mask=m, other=0.0).to(CD), tl.where(first, wk0_ptr, wk1_ptr), col, cmask,
                   c, s, D, eps, CD)
    tl.store(k_ptr + o, k.to(k_ptr.dtype.element_ty), mask=m)
    tl.store(v_ptr + o, tl.load(x + 2 * H * D, mask=m), mask=m)
    if TAIL:  # one stream: tail = gelu_tanh(x[3HD:]), this head's share of the columns
        x_row = x0_ptr + b * xs0_b + rows * xs0_l
        t_row = t_ptr + (b * L0 + rows) * (W0 - 3 * H * D) - 3 * H * D
        lo, hi = _tail_share(h, H, D, W0)
        for e0 in range(lo, hi, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            em = rmask[:, None] & (e < hi)[None, :]
            x_tail = tl.load(x_row[:, None] + e[None, :], mask=em, other=0.0).to(CD)
            tl.store(t_row[:, None] + e[None, :],
                     _apply(x_tail, x_tail, x_tail, 0.0, 0.0, GELU_TANH).to(t_ptr.dtype.element_ty), mask=em)


@triton.jit
def _grad_tile(g_ptr, b, h, tokens, sb, sh, sl, col, m, HAS: tl.constexpr, CD: tl.constexpr,
               BLOCK_L: tl.constexpr, HB: tl.constexpr):
    """A (BLOCK_L, 2 HB) tile of one output's gradient (B, H, L, D), zeros when it has none."""
    if HAS:
        row = b * sb + h * sh + tokens * sl
        return tl.load(g_ptr + row[:, None] + col[None, :], mask=m, other=0.0).to(CD)
    else:
        return tl.zeros((BLOCK_L, 2 * HB), CD)


# Backward of one of q and k. out = R y with y = xhat * w, xhat = x * rstd, and R the rotation of
# each pair by the token's angle; R is orthogonal, so its adjoint is the inverse rotation:
#   dy[2i] = g[2i] cos_i + g[2i+1] sin_i,  dy[2i+1] = g[2i+1] cos_i - g[2i] sin_i
# RMSNorm (rstd recomputed from x; means over the head's D):
#   dxhat = dy * w,  dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
#   dw = sum over tokens, batches and heads of dy * xhat: this tile's sum over its tokens here.
@triton.jit
def _norm_rope_bwd(g, x, w_ptr, col, cmask, c, s, D, eps, CD: tl.constexpr):
    dy = _rotate(g, c, s, -1.0)
    rstd = _rstd(x, D, eps)[:, None]
    xhat = x * rstd
    dxhat = dy * tl.load(w_ptr + col, mask=cmask, other=0.0).to(CD)[None, :]
    k2 = tl.sum(dxhat * xhat, axis=1) / D
    return rstd * (dxhat - xhat * k2[:, None]), tl.sum(dy * xhat, axis=0)


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope_bwd_kernel(x0_ptr, x1_ptr, wq0_ptr, wk0_ptr, wq1_ptr, wk1_ptr, cos_ptr, sin_ptr,
                             dq_ptr, dk_ptr, dv_ptr, dt_ptr, dx0_ptr, dx1_ptr, part_ptr, B, L0, L1, H, D, nb0, nb1,
                             xs0_b, xs0_l, xs1_b, xs1_l, W0, W1, cs_l, cs_i, ss_l, ss_i,
                             dqs_b, dqs_h, dqs_l, dks_b, dks_h, dks_l, dvs_b, dvs_h, dvs_l, dts_b, dts_l, eps,
                             HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr, HAS_DT: tl.constexpr,
                             NEED_W: tl.constexpr, CD: tl.constexpr, BLOCK_L: tl.constexpr, HB: tl.constexpr,
                             BLOCK_E: tl.constexpr):
    # dx (dense (B, L_s, W_s)): columns [0, 3HD) from _norm_rope_bwd for q and k, dv moved for v;
    # columns [3HD, W_s), head h's program taking its share of them for its rows: with the tail's
    # gradient dt (one stream), dx = dt * gelu_tanh'(x) (kernels/elementwise.py: GELU_TANH_BWD); else 0.
    first, b, rows, rmask, tokens, h, col, cmask, m, x = _program(x0_ptr, x1_ptr, B, L0, L1, D, nb0, nb1, xs0_b,
                                                                  xs0_l, xs1_b, xs1_l, BLOCK_L, HB)
    W = tl.where(first, W0, W1)
    dx_row = tl.where(first, dx0_ptr, dx1_ptr) + (b * tl.where(first, L0, L1) + rows) * W
    dx = dx_row[:, None] + h * D + col[None, :]
    c, s = _angles(cos_ptr, sin_ptr, tokens, rmask, D, cs_l, cs_i, ss_l, ss_i, HB)
    g = _grad_tile(dq_ptr, b, h, tokens, dqs_b, dqs_h, dqs_l, col, m, HAS_DQ, CD, BLOCK_L, HB)
    dxq, dwq = _norm_rope_bwd(g, tl.load(x, mask=m, other=0.0).to(CD), tl.where(first, wq0_ptr, wq1_ptr), col,
                              cmask, c, s, D, eps, CD)
    tl.store(dx, dxq.to(dx0_ptr.dtype.element_ty), mask=m)
    g = _grad_tile(dk_ptr, b, h, tokens, dks_b, dks_h, dks_l, col, m, HAS_DK, CD, BLOCK_L, HB)
    dxk, dwk = _norm_rope_bwd(g, tl.load(x + H * D, mask=m, other=0.0).to(CD), tl.where(first, wk0_ptr, wk1_ptr),
                              col, cmask, c, s, D, eps, CD)
    tl.store(dx + H * D, dxk.to(dx0_ptr.dtype.element_ty), mask=m)
    g = _grad_tile(dv_ptr, b, h, tokens, dvs_b, dvs_h, dvs_l, col, m, HAS_DV, CD, BLOCK_L, HB)
    tl.store(dx + 2 * H * D, g.to(dx0_ptr.dtype.element_ty), mask=m)
    if NEED_W:
        part = part_ptr + (tl.program_id(0).to(tl.int64) * H + h) * 2 * D + col
        tl.store(part, dwq, mask=cmask)
        tl.store(part + D, dwk, mask=cmask)
    lo, hi = _tail_share(h, H, D, W)
    for e0 in range(lo, hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = rmask[:, None] & (e < hi)[None, :]
        if HAS_DT:
            dt_row = dt_ptr + b * dts_b + rows * dts_l - 3 * H * D
            g_tail = tl.load(dt_row[:, None] + e[None, :], mask=em, other=0.0).to(CD)
            x_tail = tl.load(x0_ptr + (b * xs0_b + rows * xs0_l)[:, None] + e[None, :], mask=em, other=0.0).to(CD)
            val = _apply(g_tail, x_tail, x_tail, 0.0, 0.0, GELU_TANH_BWD)
        else:
            val = tl.zeros((BLOCK_L, BLOCK_E), CD)
        tl.store(dx_row[:, None] + e[None, :], val.to(dx0_ptr.dtype.element_ty), mask=em)


def rope_config(D, L):
    """The launch config of both kernels for head dim ``D`` and streams of up to ``L`` tokens:
    tiles of BLOCK_L tokens x HB pairs, 2048 elements on the GPU (16 tokens at D = 128), up to
    16384 on the interpreter. (The backward zero-fills ignored columns 2 HB at a time.)"""
    hb = _pow2(D // 2)
    tile = 1 << 14 if runtime.INTERPRETER else 2048
    bl = max(1, min(_pow2(max(L, 1)), tile // (2 * hb)))
    return dict(BLOCK_L=bl, HB=hb, num_warps=4)


def _streams(xs, weights, L_total, D):
    """The per-stream launch arguments shared by both kernels: (x0, x1, weights, B, L0, L1, nb0,
    nb1, config); a single stream is passed as stream 0 with an empty stream 1."""
    B, L0 = xs[0].shape[0], xs[0].shape[1]
    L1 = L_total - L0
    cfg = rope_config(D, max(L0, L1))
    nb0, nb1 = cdiv(L0, cfg["BLOCK_L"]), cdiv(L1, cfg["BLOCK_L"])
    (wq0, wk0), (wq1, wk1) = weights[0], weights[-1]
    return xs[0], xs[-1], (wq0, wk0, wq1, wk1), B, L0, L1, nb0, nb1, cfg


def qk_norm_rope_fwd(q, k, v, xs, weights, cos, sin, H, D, eps, tail=None):
    """q, k, v (dense (B, L_total, H, D) buffers) from the streams ``xs`` (1 or 2 buffers (B, L_s,
    W_s), unit column stride) with per-stream ``weights`` ((q weight, k weight), dense (D,)) and
    the fp32 tables ``cos``, ``sin`` (L_total, D/2), any strides; with ``tail`` (a dense (B, L,
    W - 3 H D) buffer; one stream) also gelu_tanh of the columns past 3 H D. One launch."""
    x0, x1, w, B, L0, L1, nb0, nb1, cfg = _streams(xs, weights, q.shape[1], D)
    if B * (nb0 + nb1) == 0:
        return
    launch(_qk_norm_rope_fwd_kernel, (B * (nb0 + nb1), H), x0, x1, *w, cos, sin, q, k, v,
           tail if tail is not None else q, B, L0, L1, H, D, nb0, nb1, x0.stride(0), x0.stride(1), x1.stride(0),
           x1.stride(1), *cos.stride(), *sin.stride(), x0.shape[2], float(eps), CD=compute_dtype(x0.dtype),
           TAIL=tail is not None, BLOCK_E=2 * cfg["HB"], **cfg)


def _bhl(g):
    """(batch, head, row) strides of a (B, H, L, D) gradient buffer, or zeros for None."""
    return (0, 0, 0) if g is None else g.stride()[:3]


def qk_norm_rope_bwd(dxs, dws, dq, dk, dv, xs, weights, cos, sin, H, D, eps, dt=None):
    """The backward of ``qk_norm_rope_fwd``: writes each stream's input gradient ``dxs[s]`` (dense,
    the input's shape) from the outputs' gradients ``dq``, ``dk``, ``dv`` ((B, H, L_total, D), unit
    last stride; None for none) and the tail's ``dt`` ((B, L, W - 3 H D), unit last stride; None:
    zeros past 3 H D) and, where ``dws[s]`` is a (2D,) buffer, the stream's norm weight
    gradients into it ([q weight | k weight]; None: not wanted). One launch, plus one reduction per
    stream whose weight gradients are wanted."""
    L_total = sum(x.shape[1] for x in xs)
    x0, x1, w, B, L0, L1, nb0, nb1, cfg = _streams(xs, weights, L_total, D)
    programs = B * (nb0 + nb1)
    need_w = any(dw is not None for dw in dws)
    part = runtime.empty((programs * H, 2 * D), accumulation_dtype(x0.dtype)) if need_w else None
    if programs:
        dx0, dx1 = dxs[0], dxs[-1]
        launch(_qk_norm_rope_bwd_kernel, (programs, H), x0, x1, *w, cos, sin, dq if dq is not None else x0,
               dk if dk is not None else x0, dv if dv is not None else x0, dt if dt is not None else x0, dx0, dx1,
               part if need_w else dx0, B, L0, L1, H, D, nb0, nb1, x0.stride(0), x0.stride(1), x1.stride(0),
               x1.stride(1), dx0.shape[2], dx1.shape[2], *cos.stride(), *sin.stride(), *_bhl(dq), *_bhl(dk),
               *_bhl(dv), *(dt.stride()[:2] if dt is not None else (0, 0)), float(eps),
               HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None, HAS_DT=dt is not None,
               NEED_W=need_w,
               CD=compute_dtype(x0.dtype), BLOCK_E=2 * cfg["HB"], **cfg)
    first_row = 0
    for dw, nb in zip(dws, (nb0, nb1)):
        rows = B * nb * H
        if dw is not None:
            reduce_(dw, part[first_row:first_row + rows], 1, rows, 2 * D, (0, 2 * D, 1), SUM)
        first_row += rows
