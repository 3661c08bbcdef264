"""Index copies: a gather along one dim, and its deterministic scatter-add adjoint.

One forward kernel serves ``gather``, ``index_select`` and ``embedding``:

    out[p] = x[xoff(p) + idx[ioff(p)] * x_dim_stride]

over the output's logical shape, where ``xoff`` uses x's strides with the indexed dim's stride set
to 0 and ``ioff`` uses the index's strides (broadcast with stride 0 where the index does not vary:
``index_select`` indexes by the dim position only, ``embedding`` repeats each index over the
channels). Like the strided elementwise map, dims are collapsed and up to four run in one launch.

One backward kernel serves all three too: a scatter-add written as a gather of matches, so every
output element is written by exactly one program and no float atomics are needed (bitwise
reproducible).
"""
import itertools

import triton
import triton.language as tl

from .. import runtime
from .elementwise import _pow2, cdiv, collapse, compute_dtype, offsets_4d, tile_4d
from .launch import launch

_MAX_DIMS = 4


@triton.jit
def _gather_kernel(out_ptr, x_ptr, idx_ptr, rows, D1, D2, D3, x_dim_stride,
                   os0, os1, os2, os3, xs0, xs1, xs2, xs3, is0, is1, is2, is3,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    i0, i1, i2, col, mask = tile_4d(rows, D1, D2, D3, BLOCK_R, BLOCK_C, True)
    idx = tl.load(idx_ptr + offsets_4d(i0, i1, i2, col, is0, is1, is2, is3), mask=mask, other=0).to(tl.int64)
    x_off = offsets_4d(i0, i1, i2, col, xs0, xs1, xs2, xs3) + idx * x_dim_stride
    value = tl.load(x_ptr + x_off, mask=mask, other=0)
    tl.store(out_ptr + offsets_4d(i0, i1, i2, col, os0, os1, os2, os3), value, mask=mask)


# Backward of out[o, n, i] = x[o, idx[o, n, i], i] (x viewed as (OUTER, V, INNER)):
#   dx[o, v, i] = sum_n dout[o, n, i] * [idx[o, n, i] == v] * [v != pad]
# Each program owns one o, a block of destination rows v and a block of columns i, and loops over
# every n; sums run in fp32 (fp64 for fp64) in a fixed order, so the result is deterministic.
# pad = -1 (never a row) except for embedding's padding_idx, whose row gets a zero gradient.
# IDX_1D (index_select, embedding: idx depends on n only): the match test is a (V, N) tile and a
# block with matches is summed as one-hot(V, N) @ dout(N, I) with tl.dot (exact: products by 0/1,
# fp32/fp64 accumulation). Otherwise (gather) the match test is a (V, N, I) tile.
@triton.jit
def _index_add_kernel(gx_ptr, g_ptr, idx_ptr, V, N, INNER, n_vblocks, n_iblocks, pad,
                      gs_o, gs_n, gs_i, is_o, is_n, is_i,
                      CD: tl.constexpr, IDX_1D: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ib = pid % n_iblocks
    rest = pid // n_iblocks
    vb = rest % n_vblocks
    o = rest // n_vblocks
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    col_mask = cols < INNER
    want = tl.where((v < V) & (v != pad), v, -1)  # rows that take no gradient match nothing
    acc = tl.zeros((BLOCK_V, BLOCK_I), CD)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        mask = (n < N)[:, None] & col_mask[None, :]
        g_ptrs = g_ptr + o * gs_o + (n * gs_n)[:, None] + (cols * gs_i)[None, :]
        if IDX_1D:
            idx = tl.load(idx_ptr + o * is_o + n * is_n, mask=n < N, other=-1).to(tl.int64)
            hit = want[:, None] == idx[None, :]  # (BLOCK_V, BLOCK_N)
            if tl.max(hit.to(tl.int32)) > 0:
                g = tl.load(g_ptrs, mask=mask, other=0)
                if UPCAST:  # fp64, and the interpreter (whose bf16 tl.dot is wrong)
                    g = g.to(CD)
                acc += tl.dot(hit.to(g.dtype), g, input_precision="ieee", out_dtype=CD)
        else:
            idx = tl.load(idx_ptr + o * is_o + (n * is_n)[:, None] + (cols * is_i)[None, :], mask=mask, other=-1)
            hit = want[:, None, None] == idx.to(tl.int64)[None, :, :]  # (BLOCK_V, BLOCK_N, BLOCK_I)
            if tl.max(hit.to(tl.int32)) > 0:
                g = tl.load(g_ptrs, mask=mask, other=0).to(CD)
                acc += tl.sum(tl.where(hit, g[None, :, :], 0.0), axis=1)
    out = gx_ptr + (o * V + v)[:, None] * INNER + cols[None, :]
    tl.store(out, acc.to(gx_ptr.dtype.element_ty), mask=(v < V)[:, None] & col_mask[None, :])


# ---- host side ------------------------------------------------------------------------------

def gather_(out, x, idx, x_strides, idx_strides, x_dim_stride):
    """``out[p] = x[sum(p * x_strides) + idx[sum(p * idx_strides)] * x_dim_stride]`` over
    ``out``'s shape, for torch buffers ``out`` (any strides), ``x`` and ``idx`` (int32/int64).
    Indices must already be checked to lie in range."""
    if out.numel() == 0:
        return out
    shape, strides = collapse(out.shape, [out.stride(), list(x_strides), list(idx_strides)])
    lead = max(0, len(shape) - _MAX_DIMS)
    if lead:  # peel leading dims off in Python: each slice is a launch of rank _MAX_DIMS
        for pos in itertools.product(*(range(s) for s in shape[:lead])):
            base = [sum(i * s for i, s in zip(pos, st[:lead])) for st in strides]
            sub_out = out.as_strided(shape[lead:], strides[0][lead:], out.storage_offset() + base[0])
            _launch_gather(sub_out, x.as_strided((1,), (1,), x.storage_offset() + base[1]),
                           idx.as_strided((1,), (1,), idx.storage_offset() + base[2]), shape[lead:],
                           [st[lead:] for st in strides], x_dim_stride)
        return out
    return _launch_gather(out, x, idx, shape, strides, x_dim_stride)


def _launch_gather(out, x, idx, shape, strides, x_dim_stride):
    pad = _MAX_DIMS - len(shape)
    shape = [1] * pad + list(shape)
    strides = [[0] * pad + list(st) for st in strides]
    d3 = shape[3]
    rows = shape[0] * shape[1] * shape[2]
    if runtime.INTERPRETER:
        block_c = _pow2(min(d3, 1 << 12))
        block_r = _pow2(min(rows, max(1, (1 << 14) // block_c)))
    else:
        block_c = min(256, _pow2(d3))
        block_r = min(_pow2(rows), max(1, 2048 // block_c))
    grid = (cdiv(rows, block_r), cdiv(d3, block_c))
    launch(_gather_kernel, grid, out, x, idx, rows, shape[1], shape[2], d3, x_dim_stride,
           *strides[0], *strides[1], *strides[2], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


def index_add_(gx, g, idx, g_strides, idx_strides, pad=-1):
    """Deterministic scatter-add into contiguous ``gx`` viewed as (OUTER, V, INNER):
    ``gx[o, v, i] = sum_n g[o, n, i] * [idx[o, n, i] == v != pad]`` where ``g`` and ``idx`` are
    (OUTER, N, INNER) with ``g_strides`` / ``idx_strides`` (0 where the index does not vary).
    Every element of ``gx`` is written (rows nobody indexes get 0)."""
    outer, V, inner = gx.shape
    n = g.shape[1]
    if gx.numel() == 0:
        return gx
    idx_1d = (outer == 1 or idx_strides[0] == 0) and (inner == 1 or idx_strides[2] == 0)
    cd = compute_dtype(gx.dtype)
    if idx_1d:  # tl.dot tiles: every block at least 16
        big = runtime.INTERPRETER
        block_i = max(16, min(512 if big else 64, _pow2(inner)))
        block_n = max(16, min(256 if big else 32, _pow2(n)))
        block_v = max(16, min(256 if big else 32, _pow2(V)))
    elif runtime.INTERPRETER:
        block_i = _pow2(min(inner, 1 << 9))
        block_n = _pow2(min(max(n, 1), max(1, (1 << 12) // block_i)))
        block_v = _pow2(min(V, max(1, (1 << 17) // (block_i * block_n))))
    else:
        block_i = min(64, _pow2(inner))
        block_n = min(8 if block_i >= 32 else 32, _pow2(max(n, 1)))
        block_v = min(_pow2(V), max(1, 4096 // (block_i * block_n)))
    n_vblocks, n_iblocks = cdiv(V, block_v), cdiv(inner, block_i)
    grid = (outer * n_vblocks * n_iblocks,)
    launch(_index_add_kernel, grid, gx, g, idx, V, n, inner, n_vblocks, n_iblocks, pad, *g_strides, *idx_strides,
           CD=cd, IDX_1D=idx_1d, UPCAST=runtime.INTERPRETER or cd == tl.float64,
           BLOCK_V=block_v, BLOCK_N=block_n, BLOCK_I=block_i, num_warps=4)
    return gx
