"""Index ops: gather, index_select and embedding, as PyTorch defines them.

All three forwards are one strided gather kernel (``flame.kernels.copy.gather_``) and all three
backwards one deterministic scatter-add kernel (``flame.kernels.copy.index_add_``): each gradient
element is summed by a single program in a fixed order, so results are reproducible bit for bit.
Indices are range-checked (a min/max reduction and one host transfer) before any kernel reads them.
"""
from __future__ import annotations

import math

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import copy as K
from ..kernels import elementwise as KE
from ..kernels import reduce as KR
from ..tensor import Tensor
from ._util import check_tensor, new, normalize_dim

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_index(index, op, name="index"):
    check_tensor(index, name, op)
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{op}: expected dtype int64 or int32 for {name}, got {index.dtype}")
    return index


def _check_range(index, size, op, what):
    """IndexError unless every value of ``index`` lies in [0, size): min and max by the reduce
    kernel, then one host transfer. Skipped inside a CUDA-graph capture, where no host read can
    happen: a captured function's caller checks its indices (``SDXLTextEncoders`` checks the token
    ids on the host)."""
    n = index.numel()
    if n == 0 or runtime.is_capturing():
        return
    flat = _view3(index._data, 1, n, 1)
    lohi = new((2,), torch.int64)._data
    for k, op_code in enumerate((KR.MIN, KR.MAX)):
        KR.reduce_(lohi[k:k + 1], flat, 1, n, 1, (0, flat.stride(1), 0), op_code)
    lo, hi = lohi.tolist()
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{op}: index {bad} is out of range for {what} (size {size}): "
                         f"indices must lie in [0, {size}), got values in [{lo}, {hi}]")


def _view3(buf, outer, n, inner):
    """``buf`` seen as (outer, n, inner): a view when its strides allow, else a dense copy."""
    try:
        return buf.view(outer, n, inner)
    except RuntimeError:
        dense = new(buf.shape, buf.dtype)._data
        KE.copy_(dense, buf)
        return dense.view(outer, n, inner)


def _scatter_add(shape3, g3, idx3, pad=-1):
    """dx (outer, V, inner), contiguous, in g's dtype: dx[o, v, i] = sum_n g[o, n, i] [idx[o, n, i] == v]."""
    gx = new(shape3, g3.dtype)
    K.index_add_(gx._data, g3, idx3, g3.stride(), idx3.stride(), pad)
    return gx


# ---- gather -----------------------------------------------------------------------------------

def _gather_backward(node, g):
    # dx[..., v, ...] = sum_k g[..., k, ...] [index[..., k, ...] == v]; zero outside index's extent
    (index,) = node.saved
    dim, x_shape = node.attrs["dim"], node.attrs["shape"]
    ishape = index.shape if index.ndim else (1,)
    outer, k, inner = math.prod(ishape[:dim]), ishape[dim], math.prod(ishape[dim + 1:])
    V = x_shape[dim] if x_shape else 1
    idx3 = _view3(index._data, outer, k, inner)
    gx = _scatter_add((outer, V, inner), _view3(g._data, outer, k, inner), idx3)
    full = tuple(x_shape) or (1,)
    region = ishape[:dim] + (V,) + ishape[dim + 1:]
    if region == full:
        return Tensor(gx._data.view(x_shape))
    dx = new(full, g.dtype)
    KE.fill_(dx._data, 0)
    KE.copy_(dx._data[tuple(slice(0, s) for s in region)], gx._data.view(region))
    return Tensor(dx._data.view(x_shape))


def gather(x, dim, index):
    """``out[i][j][k] = x[index[i][j][k]][j][k]`` (for dim 0), as torch.gather: ``index`` has
    x's number of dims and, apart from ``dim``, sizes no larger than x's; out has index's shape."""
    check_tensor(x, "input", "gather")
    _check_index(index, "gather")
    nd = max(x.ndim, 1)
    if max(index.ndim, 1) != nd:
        raise RuntimeError(f"gather: index tensor must have the same number of dimensions as input "
                           f"(input {x.shape}, index {index.shape})")
    d = normalize_dim(dim, x.ndim, "gather")
    xs = x.shape or (1,)
    xst = x.stride() or (1,)
    ishape = index.shape or (1,)
    if index.numel():
        for i in range(nd):
            if i != d and ishape[i] > xs[i]:
                raise RuntimeError(f"gather: size does not match at dimension {i}: expected index {index.shape} "
                                   f"to be no larger than input {x.shape} apart from dimension {d}")
    _check_range(index, xs[d], "gather", f"dimension {d} of input {x.shape}")
    out = new(index.shape, x.dtype)
    x_strides = tuple(0 if i == d else s for i, s in enumerate(xst))
    K.gather_(out._data.view(ishape), x._data, index._data, x_strides, index.stride() or (1,), xst[d])
    if needs_grad(x):
        record(out, (x, None), _gather_backward, saved=(index,), dim=d, shape=x.shape)
    return out


# ---- index_select and embedding ----------------------------------------------------------------

def _select(x, d, index, out_shape):
    """out[..., n, ...] = x[..., index[n], ...] along dim ``d`` (index 0-d or 1-d)."""
    xs, xst = x.shape or (1,), x.stride() or (1,)
    out = new(out_shape, x.dtype)
    shape = xs[:d] + (index.numel(),) + xs[d + 1:]
    x_strides = tuple(0 if i == d else s for i, s in enumerate(xst))
    idx_strides = tuple(index.stride()[0] if (i == d and index.ndim) else 0 for i in range(len(xs)))
    K.gather_(out._data.view(shape), x._data, index._data, x_strides, idx_strides, xst[d])
    return out


def _select_backward(node, g):
    # dx[..., v, ...] = sum_n g[..., n, ...] [index[n] == v]   (rows equal to padding_idx get 0)
    (index,) = node.saved
    d, x_shape, pad = node.attrs["dim"], node.attrs["shape"], node.attrs["pad"]
    xs = x_shape or (1,)
    outer, V, inner = math.prod(xs[:d]), xs[d], math.prod(xs[d + 1:])
    n = index.numel()
    s = index.stride()[0] if index.ndim else 0
    idx = index._data.as_strided((1, n, 1), (0, s, 0), index._data.storage_offset())
    gx = _scatter_add((outer, V, inner), _view3(g._data, outer, n, inner), idx, pad)
    return Tensor(gx._data.view(x_shape))


def index_select(x, dim, index):
    """Rows of ``x`` along ``dim`` picked by the 1-D (or 0-d) integer ``index``, as torch.index_select."""
    check_tensor(x, "input", "index_select")
    _check_index(index, "index_select")
    if index.ndim > 1:
        raise IndexError(f"index_select: index is supposed to be a vector (0-d or 1-d), got shape {index.shape}")
    d = normalize_dim(dim, x.ndim, "index_select")
    if x.ndim == 0 and index.numel() != 1:
        raise RuntimeError(f"index_select: index to a scalar can have only 1 value, got {index.numel()}")
    xs = x.shape or (1,)
    _check_range(index, xs[d], "index_select", f"dimension {d} of input {x.shape}")
    out_shape = () if x.ndim == 0 else x.shape[:d] + (index.numel(),) + x.shape[d + 1:]
    out = _select(x, d, index, out_shape)
    if needs_grad(x):
        record(out, (x, None), _select_backward, saved=(index,), dim=d, shape=x.shape, pad=-1)
    return out


def embedding(index, weight, padding_idx=None):
    """``weight[index]`` for an integer ``index`` of any shape and a 2-D ``weight`` (V, C); out has
    shape ``index.shape + (C,)``. Rows equal to ``padding_idx`` get no gradient (torch semantics)."""
    _check_index(index, "embedding", "indices")
    check_tensor(weight, "weight", "embedding")
    if weight.ndim != 2:
        raise RuntimeError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {weight.shape}")
    V, C = weight.shape
    pad = -1
    if padding_idx is not None:
        if not -V <= padding_idx < V:
            raise ValueError(f"embedding: padding_idx {padding_idx} must be within num_embeddings {V}")
        pad = padding_idx % V
    flat = index if index.ndim == 1 else Tensor(_view3(index._data, 1, index.numel(), 1).view(-1))
    _check_range(flat, V, "embedding", f"num_embeddings of weight {weight.shape}")
    out = _select(weight, 0, flat, index.shape + (C,))
    if needs_grad(weight):
        record(out, (None, weight), _embedding_backward, saved=(flat,), dim=0, shape=weight.shape, pad=pad)
    return out


def _embedding_backward(node, g):
    return None, _select_backward(node, g)
