"""Reductions over any set of dims with ``keepdim``: sum, mean, max, min, var; and
``sum_to_shape`` which folds a broadcast gradient back onto its input's shape."""
from __future__ import annotations

import itertools
import math

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import elementwise as KE
from ..kernels import reduce as K
from ..tensor import Tensor
from . import _autocast
from ._util import check_tensor, new, normalize_dims
from .elementwise import map_op


def _group(shape, strides, dims):
    """Collapse ``dims`` (positions, increasing) into one (size, stride), or None if impossible."""
    dims = [d for d in dims if shape[d] != 1]
    if not dims:
        return 1, 0
    for a, b in itertools.pairwise(dims):
        if strides[a] != strides[b] * shape[b]:
            return None
    return math.prod(shape[d] for d in dims), strides[dims[-1]]


def _plan(buf, rdims):
    """View ``buf`` as (outer, R, inner) over the reduced dims, or None if that needs a copy."""
    shape, strides = buf.shape, buf.stride()
    real = [d for d in range(len(shape)) if shape[d] != 1]
    red = [d for d in real if d in rdims]
    if not red:
        return None
    first, last = real.index(red[0]), real.index(red[-1])
    if real[first:last + 1] != red:
        return None  # a kept dim sits between reduced ones
    groups = [_group(shape, strides, dims) for dims in (real[:first], red, real[last + 1:])]
    if any(g is None for g in groups):
        return None
    (outer, so), (r, sr), (inner, si) = groups
    return outer, r, inner, (so, sr, si)


def _reduce(x, dims, keepdim, op, scale=1.0, mean=None, out_dtype=None):
    """Reduce tensor ``x`` over normalized ``dims``; returns a new tensor."""
    shape = x.shape
    kept_shape = tuple(1 if d in dims else s for d, s in enumerate(shape))
    out_shape = kept_shape if keepdim else tuple(s for d, s in enumerate(shape) if d not in dims)
    out = new(out_shape, out_dtype or x.dtype)
    buf = x._data
    plan = _plan(buf, dims)
    if plan is None:
        # move reduced dims last and materialise: (prod kept, prod reduced, 1)
        order = [d for d in range(len(shape)) if d not in dims] + list(dims)
        perm = buf.permute(order)
        buf = runtime.empty(tuple(perm.shape), perm.dtype)
        KE.copy_(buf, perm)
        r = math.prod(shape[d] for d in dims)
        plan = (math.prod(kept_shape), r, 1, (r, 1, 0))
    outer, r, inner, strides = plan
    K.reduce_(out._data, buf, outer, r, inner, strides, op, scale, None if mean is None else mean._data)
    return out


def _expand_back(g, node):
    """View a reduced gradient with the input's shape (keepdim, then stride-0 expand)."""
    shape, dims, keepdim = node.attrs["shape"], node.attrs["dims"], node.attrs["keepdim"]
    kept = tuple(1 if d in dims else s for d, s in enumerate(shape))
    buf = g._data if keepdim else g._data.reshape(kept)
    return Tensor(buf.expand(shape))


# ---- sum / mean -----------------------------------------------------------------------------

# y = scale * sum_{reduced dims} x  =>  dx = scale * g broadcast back over the reduced dims
# (scaled on the small tensor, then a stride-0 expand: no full-size kernel)
def _sum_backward(node, g):
    scale = node.attrs["scale"]
    if scale != 1.0:
        g = map_op(KE.MUL, (g,), g.dtype, scale)
    return _expand_back(g, node)


def sum(x, dim=None, keepdim=False, dtype=None):  # noqa: A001
    """Sum over ``dim`` (int, sequence, or None for all). Integer and bool inputs sum to int64."""
    check_tensor(x, "input", "sum")
    x = x if dtype is not None else _autocast.fp32(x)[0]
    dims = normalize_dims(dim, x.ndim, "sum")
    out_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    y = _reduce(x, dims, keepdim, K.SUM, out_dtype=out_dtype)
    if needs_grad(x):
        record(y, (x,), _sum_backward, shape=x.shape, dims=dims, keepdim=keepdim, scale=1.0)
    return y


def mean(x, dim=None, keepdim=False):
    """Arithmetic mean over ``dim``; floating inputs only."""
    check_tensor(x, "input", "mean")
    if not x.dtype.is_floating_point:
        raise TypeError(f"mean: expected a floating-point input, got dtype {x.dtype}")
    dims = normalize_dims(dim, x.ndim, "mean")
    count = math.prod(x.shape[d] for d in dims)
    scale = 1.0 / count if count else math.nan
    y = _reduce(x, dims, keepdim, K.SUM, scale=scale)
    if needs_grad(x):
        record(y, (x,), _sum_backward, shape=x.shape, dims=dims, keepdim=keepdim, scale=scale)
    return y


# ---- max / min ------------------------------------------------------------------------------

# d max/dx = g / (number of maxima) at every position equal to the maximum, 0 elsewhere
def _extremum_backward(node, g):
    x, y = node.saved
    y_full = _expand_back(y, node)
    hit = map_op(KE.EQ, (x, y_full), torch.bool)
    count = _reduce(hit, node.attrs["dims"], node.attrs["keepdim"], K.SUM, out_dtype=g.dtype)
    share = map_op(KE.DIV, (g, count), g.dtype)
    return map_op(KE.WHERE, (hit, _expand_back(share, node)), g.dtype, 0.0)


def _extremum(name, op):
    def fn(x, dim=None, keepdim=False):
        check_tensor(x, "input", name)
        dims = normalize_dims(dim, x.ndim, name)
        if (x.numel() == 0 and any(x.shape[d] == 0 for d in dims)) or (x.numel() == 0 and not dims):
            raise RuntimeError(f"{name}: cannot reduce over a zero-size dimension (input shape {x.shape})")
        y = _reduce(x, dims, keepdim, op)
        if needs_grad(x):
            record(y, (x,), _extremum_backward, saved=(x, y), shape=x.shape, dims=dims, keepdim=keepdim)
        return y

    fn.__name__ = name
    fn.__doc__ = (f"{name.capitalize()} over ``dim`` (values only, like torch.a{name}); NaN propagates; "
                  "the gradient is shared evenly between tied extrema.")
    return fn


max = _extremum("max", K.MAX)  # noqa: A001
min = _extremum("min", K.MIN)  # noqa: A001
amax, amin = max, min


# ---- var ------------------------------------------------------------------------------------

# d var/dx = 2 (x - mean) / (N - correction) * g
def _var_backward(node, g):
    x, m = node.saved
    diff = map_op(KE.SUB, (x, _expand_back(m, node)), g.dtype)
    denom = node.attrs["denom"]
    gs = map_op(KE.MUL, (g,), g.dtype, 2.0 / denom if denom > 0 else math.inf)
    return map_op(KE.MUL, (diff, _expand_back(gs, node)), g.dtype)


def var(x, dim=None, keepdim=False, correction=1, unbiased=None):
    """Variance over ``dim`` with Bessel's ``correction`` (default 1, as PyTorch)."""
    check_tensor(x, "input", "var")
    if not x.dtype.is_floating_point:
        raise TypeError(f"var: expected a floating-point input, got dtype {x.dtype}")
    if unbiased is not None:
        correction = 1 if unbiased else 0
    dims = normalize_dims(dim, x.ndim, "var")
    count = math.prod(x.shape[d] for d in dims)
    denom = count - correction
    m = _reduce(x, dims, True, K.SUM, scale=1.0 / count if count else math.nan)
    y = _reduce(x, dims, keepdim, K.SQDEV, scale=1.0 / denom if denom > 0 else math.inf, mean=m)
    if needs_grad(x):
        record(y, (x,), _var_backward, saved=(x, m), shape=x.shape, dims=dims, keepdim=keepdim, denom=denom)
    return y


# ---- broadcasting support -------------------------------------------------------------------

def sum_to_shape(g: Tensor, shape: tuple) -> Tensor:
    """Sum ``g`` over the dims that broadcasting expanded so the result has ``shape``."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead < 0:
        raise RuntimeError(f"cannot reduce gradient of shape {g.shape} to shape {shape}")
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    out = _reduce(g, dims, keepdim=False, op=K.SUM)
    return Tensor(out._data.reshape(shape))
