"""Convolutions with PyTorch's semantics: ``conv2d`` (forward, input, weight and bias gradients)
and ``conv1d`` (pools and nearest ``interpolate``: ``ops/pool.py``).

Computed as implicit GEMMs over channels-last data (``flame.kernels.conv2d``). Inputs may be
NCHW-contiguous or channels-last (or any strided 4-D view); the output is channels-last by
default (logical NCHW shape, NHWC strides, as PyTorch's ``torch.channels_last``), so a model that
keeps its activations channels-last never transposes.
"""
from __future__ import annotations

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import conv2d as KC
from ..kernels import elementwise as KE
from ..kernels import reduce as KR
from ..tensor import Tensor
from . import _autocast, reduce
from ._util import check_tensor
from .elementwise import cast_params, to
from .shape import squeeze, unsqueeze


def _pair(v, name, op):
    if isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    if isinstance(v, int):
        return (v, v)
    try:
        t = tuple(v)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}") from None
    if len(t) == 1:
        t = (t[0], t[0])
    if len(t) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in t):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    return t


def _empty_nhwc(shape, dtype):
    n, c, h, w = shape
    return runtime.empty((n, h, w, c), dtype).permute(0, 3, 1, 2)


def _nhwc_data(buf):
    """``buf`` (N, C, H, W) itself when its channels are contiguous (stride 1: the kernels' loads
    along C vectorise), else a channels-last copy (one copy-kernel pass)."""
    if buf.stride(1) == 1 or buf.shape[1] == 1 or buf.numel() == 0:
        return buf
    out = _empty_nhwc(tuple(buf.shape), buf.dtype)
    KE.copy_(out, buf)
    return out


def _is_channels_last(buf):
    return buf.shape[1] > 1 and buf.stride(1) == 1


# Y = conv2d(X, W) + b, X: (N, Ci, H, W), W: (Co, Ci, KH, KW), G = dL/dY: (N, Co, Ho, Wo).
#   dX[n, ci, ih, iw] = sum_{co, kh, kw} G[n, co, oh, ow] * W[co, ci, kh, kw]
#                       over (oh, ow) with oh * s - p + kh * d = ih (a transposed convolution)
#   dW[co, ci, kh, kw] = sum_{n, oh, ow} G[n, co, oh, ow] * X[n, ci, oh * s - p + kh * d, ...]
#   db[co] = sum_{n, oh, ow} G[n, co, oh, ow]
def _conv2d_backward(node, g):
    x, w = node.saved  # x only when the weight needs a gradient
    need_x, need_w, need_b = node.needs_input_grad
    a = node.attrs
    stride, padding, dilation, groups = a["stride"], a["padding"], a["dilation"], a["groups"]
    x_shape, x_dtype = a["x_shape"], a["x_dtype"]
    gd = g._data
    if gd.dtype != x_dtype:
        gd = to(Tensor(gd), x_dtype)._data
    gd = _nhwc_data(gd)
    dx = dw = db = None
    if need_x:
        # the input's own layout, so an NCHW leaf's gradient needs no copy in the engine
        dxb = _empty_nhwc(x_shape, x_dtype) if a["x_nhwc"] else runtime.empty(x_shape, x_dtype)
        KC.conv2d_input_grad_(dxb, gd, w, stride, padding, dilation, groups)
        dx = Tensor(dxb)
    if need_w:
        dwb = runtime.empty_like(w, w.dtype)  # the weight's layout: channels-last keeps ci innermost
        KC.conv2d_weight_grad_(dwb, gd, x, stride, padding, dilation, groups)
        dw = Tensor(dwb)
    if need_b:
        rows = KC.as_rows(gd)  # channels-last: an (N*H*W, Co) matrix
        db = (reduce.sum(Tensor(gd), dim=(0, 2, 3)) if rows is None
              else Tensor(KR.column_sum_(runtime.empty((gd.shape[1],), gd.dtype), rows)))
    return dx, dw, db


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """2-D convolution with ``torch.nn.functional.conv2d``'s semantics.

    ``input`` (N, Ci, H, W) or unbatched (Ci, H, W), NCHW-contiguous or channels-last;
    ``weight`` (Co, Ci, KH, KW) as PyTorch stores it; ``bias`` (Co,) or None; ``stride``,
    ``padding`` and ``dilation`` an int or a pair; ``padding`` may also be "valid" or "same"
    (stride 1, extra padding on the bottom/right when the total is odd, as PyTorch). Weight and
    bias are cast to the input's dtype. The output is channels-last (NHWC strides). ``groups``
    splits the channels into independent convolutions (depthwise: groups = in_channels), one
    grid row of the same kernels per group (not tuned for depthwise: tiles are at least 16
    channels wide on the GPU).
    """
    op = "conv2d"
    check_tensor(input, "input", op)
    check_tensor(weight, "weight", op)
    input, weight, bias = _autocast.lower(input, weight, bias)  # noqa: A001
    if not input.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(f"{op}: expected floating-point input and weight, got {input.dtype} and {weight.dtype}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    if weight.ndim != 4:
        raise ValueError(f"{op}: weight must be 4-D (out_channels, in_channels/groups, kH, kW), "
                         f"got shape {weight.shape}")
    if input.ndim == 3:  # unbatched (C, H, W)
        return squeeze(conv2d(unsqueeze(input, 0), weight, bias, stride, padding, dilation, groups), 0)
    if input.ndim != 4:
        raise ValueError(f"{op}: expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape {input.shape}")
    nb, ci, h, w_in = input.shape
    co, ci_w, kh, kw = weight.shape
    if ci % groups or co % groups:
        raise ValueError(f"{op}: groups={groups} must divide in_channels ({ci}) and out_channels ({co}); "
                         f"input {input.shape}, weight {weight.shape}")
    if ci_w * groups != ci:
        raise ValueError(f"{op}: input {input.shape} has {ci} channels but weight {weight.shape} expects "
                         f"{ci_w * groups} (in_channels/groups={ci_w}, groups={groups})")
    stride = _pair(stride, "stride", op)
    dilation = _pair(dilation, "dilation", op)
    if min(stride) < 1:
        raise ValueError(f"{op}: stride must be positive, got {stride}")
    if min(dilation) < 1:
        raise ValueError(f"{op}: dilation must be positive, got {dilation}")
    if isinstance(padding, str):
        if padding == "valid":
            pads = ((0, 0), (0, 0))
        elif padding == "same":
            if stride != (1, 1):
                raise ValueError(f"{op}: padding='same' is not supported for strided convolutions (stride {stride})")
            pads = tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for d, k in zip(dilation, (kh, kw)))
        else:
            raise ValueError(f"{op}: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    else:
        p = _pair(padding, "padding", op)
        if min(p) < 0:
            raise ValueError(f"{op}: padding must be non-negative, got {p}")
        pads = ((p[0], p[0]), (p[1], p[1]))
    ho = (h + pads[0][0] + pads[0][1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w_in + pads[1][0] + pads[1][1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"{op}: kernel ({kh}, {kw}) with dilation {dilation} is larger than the padded input "
                         f"({h + pads[0][0] + pads[0][1]}, {w_in + pads[1][0] + pads[1][1]}); "
                         f"input {input.shape}, weight {weight.shape}")
    weight, bias = cast_params(weight, bias, co, input.dtype, op, ValueError)
    top_left = (pads[0][0], pads[1][0])
    out = _empty_nhwc((nb, co, ho, wo), input.dtype)
    x0, wb = input._data, weight._data
    x = _nhwc_data(x0)
    if ci == 0:
        KE.fill_(out, 0.0)
        y = Tensor(out)
        return y if bias is None else y + bias.reshape(1, co, 1, 1)
    KC.conv2d_forward_(out, x, wb, None if bias is None else bias._data, stride, top_left, dilation, groups)
    y = Tensor(out)
    if needs_grad(input, weight, bias):
        # the input is kept for the weight's gradient only: a frozen conv (LoRA training) saves none
        record(y, (input, weight, bias), _conv2d_backward, saved=(x if weight.requires_grad else None, wb),
               stride=stride, padding=top_left, dilation=dilation, groups=groups, x_nhwc=_is_channels_last(x0),
               x_shape=tuple(x.shape), x_dtype=x.dtype)
    return y


def _single(v, name, op):
    if isinstance(v, (tuple, list)) and len(v) == 1:
        v = v[0]
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be an int or a 1-tuple of ints, got {v!r}")
    return v


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """1-D convolution with ``torch.nn.functional.conv1d``'s semantics: ``input`` (N, Ci, L) or
    unbatched (Ci, L), ``weight`` (Co, Ci/groups, K). Computed as ``conv2d`` on the (N, Ci, 1, L)
    view (same kernels, same gradients); the output is (N, Co, Lo) with channels innermost."""
    op = "conv1d"
    check_tensor(input, "input", op)
    check_tensor(weight, "weight", op)
    if input.ndim not in (2, 3):
        raise ValueError(f"{op}: expected a 2-D (C, L) or 3-D (N, C, L) input, got shape {input.shape}")
    if weight.ndim != 3:
        raise ValueError(f"{op}: weight must be 3-D (out_channels, in_channels/groups, k), got shape {weight.shape}")
    stride, dilation = _single(stride, "stride", op), _single(dilation, "dilation", op)
    pad = padding if isinstance(padding, str) else (0, _single(padding, "padding", op))
    try:
        y = conv2d(unsqueeze(input, -2), unsqueeze(weight, 2), bias, (1, stride), pad, (1, dilation), groups)
    except ValueError as e:  # conv2d names the (N, C, 1, L) views: say what the caller passed
        raise ValueError(f"{op}: input {input.shape}, weight {weight.shape}: {e}") from None
    return squeeze(y, -2)
