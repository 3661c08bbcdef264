"""The 2-D pools ``max_pool2d`` and ``avg_pool2d`` and nearest ``interpolate`` (a nearest upsample is
the backward of an average pool with divisor 1, so both run on ``kernels/pool.py``), with PyTorch's
semantics, forward beside backward. Inputs NCHW-contiguous or channels-last; outputs keep the
input's layout.
"""
from __future__ import annotations

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import pool as KP
from ..tensor import Tensor, int64
from ._util import check_tensor
from .conv2d import _empty_nhwc, _is_channels_last, _pair
from .shape import expand, permute, reshape, squeeze, unsqueeze


def _factors(in_sizes, size, scale_factor, op):
    """Integer upsampling factors per spatial dim from ``size`` or ``scale_factor``."""
    n = len(in_sizes)
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{op}: exactly one of size and scale_factor must be given")
    if size is not None:
        sizes = (size,) * n if isinstance(size, int) else tuple(size)
        if len(sizes) != n:
            raise ValueError(f"{op}: size {size} must have {n} entries for input spatial shape {tuple(in_sizes)}")
        if any(s <= 0 or s % i for s, i in zip(sizes, in_sizes)):
            raise NotImplementedError(f"{op}: only integer upsampling is implemented; size {tuple(sizes)} is not a "
                                      f"multiple of the input's spatial shape {tuple(in_sizes)}")
        return tuple(s // i for s, i in zip(sizes, in_sizes))
    scales = (scale_factor,) * n if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
    if len(scales) != n:
        raise ValueError(f"{op}: scale_factor {scale_factor} must have {n} entries")
    if any(float(s) != int(s) or int(s) < 1 for s in scales):
        raise NotImplementedError(f"{op}: only positive integer scale factors are implemented, got {scale_factor}")
    return tuple(int(s) for s in scales)


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,  # noqa: A002
                recompute_scale_factor=None, antialias=False):
    """``torch.nn.functional.interpolate`` for ``mode="nearest"`` (or "nearest-exact", the same
    for these) with integer factors on (N, C, L) and (N, C, H, W) inputs: each input element is
    repeated ``factor`` times per spatial dim. 4-D outputs are channels-last. One gather kernel
    each way: the pool kernels with a (fh, fw) window, stride (fh, fw) and divisor 1 (see
    ``_upsample_nearest_backward``)."""
    op = "interpolate"
    check_tensor(input, "input", op)
    if mode not in ("nearest", "nearest-exact"):
        raise NotImplementedError(f"{op}: mode {mode!r} is not implemented (only 'nearest')")
    if align_corners is not None:
        raise ValueError(f"{op}: align_corners only applies to linear modes, got {align_corners!r} with mode {mode!r}")
    if antialias:
        raise ValueError(f"{op}: antialias only applies to bilinear/bicubic modes")
    if input.ndim not in (3, 4):
        raise ValueError(f"{op}: expected a 3-D (N, C, L) or 4-D (N, C, H, W) input, got shape {input.shape}")
    spatial = input.shape[2:]
    f = _factors(spatial, size, scale_factor, op)
    if all(k == 1 for k in f):
        return input
    nb, c = input.shape[:2]
    if input.ndim == 3:
        xl = permute(input, 0, 2, 1)  # (N, L, C)
        y = expand(reshape(xl, nb, spatial[0], 1, c), nb, spatial[0], f[0], c)
        return permute(reshape(y, nb, spatial[0] * f[0], c), 0, 2, 1)
    h, w = spatial
    xb = input._data
    out = _empty_nhwc((nb, c, h * f[0], w * f[1]), xb.dtype)
    if out.numel():
        KP.pool2d_backward_(out, xb, None, *_block_geometry(f), divisor=1)
    y = Tensor(out)
    if needs_grad(input):
        record(y, (input,), _upsample_nearest_backward, x_shape=tuple(xb.shape), x_nhwc=_is_channels_last(xb),
               factors=f)
    return y


def _block_geometry(f):
    """(kernel, stride, padding, dilation) of non-overlapping (fh, fw) blocks."""
    return tuple(f), tuple(f), (0, 0), (1, 1)


# Y[oh, ow] = X[oh // fh, ow // fw] (nearest upsampling by integer factors), G = dL/dY:
#   dX[ih, iw] = sum over the (fh, fw) block of G at (ih * fh, iw * fw)
# which is sum pooling (average pooling with divisor 1) of G with window = stride = (fh, fw); and
# the forward is that pool's backward: each Y position lies in exactly one window, so it gathers
# X of its window with weight 1.
def _upsample_nearest_backward(node, g):
    a = node.attrs
    dx = _empty_nhwc(a["x_shape"], g.dtype) if a["x_nhwc"] else runtime.empty(a["x_shape"], g.dtype)
    if dx.numel():
        KP.pool2d_forward_(dx, None, g._data, *_block_geometry(a["factors"]), divisor=1)
    return Tensor(dx)


def _pool_output_size(size, k, s, p, d, ceil_mode):
    """PyTorch's pooled length: with ``ceil_mode`` a last window that would start in the
    right/bottom padding (or past the input) is dropped."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(x, kernel_size, stride, padding, dilation, ceil_mode, op):
    """Checked (kernel, stride, padding, dilation) pairs and the (OH, OW) output size of a 2-D
    pool of a 4-D ``x``, with PyTorch's rules."""
    kernel = _pair(kernel_size, "kernel_size", op)
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        stride = kernel
    stride = _pair(stride, "stride", op)
    padding = _pair(padding, "padding", op)
    dilation = _pair(dilation, "dilation", op)
    for name, v in (("kernel_size", kernel), ("stride", stride), ("dilation", dilation)):
        if min(v) < 1:
            raise ValueError(f"{op}: {name} must be positive, got {v}")
    if min(padding) < 0:
        raise ValueError(f"{op}: padding must be non-negative, got {padding}")
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"{op}: padding {padding} must be at most half of kernel_size {kernel}")
    _, _, h, w = x.shape
    oh, ow = (_pool_output_size(n, k, s, p, d, ceil_mode)
              for n, k, s, p, d in zip((h, w), kernel, stride, padding, dilation))
    if oh < 1 or ow < 1:
        raise ValueError(f"{op}: input {x.shape} with kernel_size {kernel}, stride {stride}, padding {padding}, "
                         f"dilation {dilation} gives output size ({oh}, {ow}): too small")
    return (kernel, stride, padding, dilation), (oh, ow)


def _pool_input(x, op):
    check_tensor(x, "input", op)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point input, got {x.dtype}")
    if x.ndim not in (3, 4) or 0 in x.shape[-3:]:
        raise ValueError(f"{op}: expected a 3-D (C, H, W) or 4-D (N, C, H, W) input with non-zero C, H and W "
                         f"(the batch may be empty), got shape {x.shape}")


# Y = pool(X), G = dL/dY (any strides); dX in X's memory format, written whole by one gather
# kernel (flame.kernels.pool): max routes G[oh, ow] to the saved argmax of its window, average
# spreads G[oh, ow] / divisor over its window.
def _pool2d_backward(node, g):
    a = node.attrs
    shape, dtype = a["x_shape"], a["x_dtype"]
    dx = _empty_nhwc(shape, dtype) if a["x_nhwc"] else runtime.empty(shape, dtype)
    KP.pool2d_backward_(dx, g._data, node.saved[0], *a["geometry"], a["divisor"], a["count_include_pad"])
    return Tensor(dx)


def _pool2d(x, geometry, out_hw, max_pool, divisor=0, count_include_pad=True):
    """One pooling launch over a 4-D input: (output, int64 indices or None); the output (and
    the indices) take the input's memory format."""
    xb = x._data
    shape = (*xb.shape[:2], *out_hw)
    nhwc = _is_channels_last(xb)
    empty = _empty_nhwc if nhwc else runtime.empty
    out = empty(shape, xb.dtype)
    idx = empty(shape, int64) if max_pool else None
    KP.pool2d_forward_(out, idx, xb, *geometry, divisor, count_include_pad)
    y = Tensor(out)
    if needs_grad(x):
        record(y, (x,), _pool2d_backward, saved=(idx,), x_shape=tuple(xb.shape), x_dtype=xb.dtype, x_nhwc=nhwc,
               geometry=geometry, divisor=divisor, count_include_pad=count_include_pad)
    return y, None if idx is None else Tensor(idx)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    """``torch.nn.functional.max_pool2d``: ``input`` (N, C, H, W) or unbatched (C, H, W),
    NCHW-contiguous or channels-last (the output follows the input's memory format); ``stride``
    defaults to ``kernel_size``; ``padding`` (implicit -inf) at most half the kernel; windows
    spaced by ``dilation``. With ``return_indices`` also returns the int64 flat index
    (``h * W + w``) of each maximum in its (H, W) plane. NaN propagates; ties keep the first
    position in row-major window order, as PyTorch."""
    op = "max_pool2d"
    _pool_input(input, op)
    if input.ndim == 3:
        out = max_pool2d(unsqueeze(input, 0), kernel_size, stride, padding, dilation, ceil_mode, return_indices)
        return (squeeze(out[0], 0), squeeze(out[1], 0)) if return_indices else squeeze(out, 0)
    geometry, out_hw = _pool_geometry(input, kernel_size, stride, padding, dilation, ceil_mode, op)
    y, idx = _pool2d(input, geometry, out_hw, True)
    return (y, idx) if return_indices else y


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,  # noqa: A002
               divisor_override=None):
    """``torch.nn.functional.avg_pool2d``: the mean of each window, over the window clipped to
    the padded input (``count_include_pad``) or to the input itself, or divided by
    ``divisor_override`` (a non-zero int, may be negative) when given. Same input forms, ``stride`` default,
    padding and ``ceil_mode`` rules and memory format as ``max_pool2d``."""
    op = "avg_pool2d"
    _pool_input(input, op)
    if divisor_override is not None:
        if not isinstance(divisor_override, int) or isinstance(divisor_override, bool):
            raise TypeError(f"{op}: divisor_override must be an int or None, got {divisor_override!r}")
        if divisor_override == 0:
            raise ValueError(f"{op}: divisor_override must not be zero")
    if input.ndim == 3:
        return squeeze(avg_pool2d(unsqueeze(input, 0), kernel_size, stride, padding, ceil_mode, count_include_pad,
                                  divisor_override), 0)
    geometry, out_hw = _pool_geometry(input, kernel_size, stride, padding, 1, ceil_mode, op)
    return _pool2d(input, geometry, out_hw, False, divisor_override or 0, bool(count_include_pad))[0]
