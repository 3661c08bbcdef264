import math

import numpy as np
import pytest
import torch

import flame
import flame.nn.functional as F
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, GPU_ONLY_DTYPES, assert_close, check_op, pair

tf = torch.nn.functional


def _inputs(shape, dtype, channels_last=False, noncontig=False):
    x, xt = pair(shape, dtype, requires_grad=True, noncontig=noncontig)
    if channels_last:
        xt = xt.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(xt.detach().clone(memory_format=torch.preserve_format), requires_grad=True)
        assert x.stride(1) == 1
    return x, xt


def _layout(t):
    """The strides of the dims longer than 1 (what the memory format decides)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def _check(op, shape, dtype=torch.float32, channels_last=False, noncontig=False, **kw):
    """flame's op against torch's: values, (max) indices, input gradient, memory format of the
    output and of the gradient that reaches the input."""
    x, xt = _inputs(shape, dtype, channels_last, noncontig)
    seen, idx = [], []
    x.register_hook(lambda g: seen.append(g.to_torch()))
    f_pool, t_pool = (F.max_pool2d, tf.max_pool2d) if op == "max" else (F.avg_pool2d, tf.avg_pool2d)

    def f_fn(x):
        if op != "max":
            return f_pool(x, **kw)
        y, i = f_pool(x, return_indices=True, **kw)
        idx.append(i)
        return y

    # The reference runs on an NCHW copy: torch's CUDA channels-last avg_pool2d backward drops the
    # padding offset (pytorch/pytorch#188344, fixed by #188345 in July 2026, present in torch 2.11
    # on the GPU machine): there, it and not flame was wrong with padding.
    y = check_op(f_fn, lambda t: t_pool(t.contiguous(), **kw), [(x, xt)]).out
    if op == "max":
        assert torch.equal(idx[0].to_torch(), t_pool(xt.detach(), return_indices=True, **kw)[1]), "indices differ"
        assert idx[0].stride() == y.stride()
    # torch makes empty outputs NCHW
    assert _layout(y) == _layout(t_pool(xt.detach(), **kw)) or y.numel() == 0
    if x.numel():
        assert _layout(seen[0]) == _layout(xt if channels_last else xt.contiguous())
    return y


MAX_CASES = [  # (shape, kwargs)
    ((2, 3, 7, 9), dict(kernel_size=3, stride=2, padding=1)),
    ((2, 3, 7, 9), dict(kernel_size=2)),  # stride = kernel: windows don't overlap, odd sizes drop the edge
    ((1, 4, 8, 5), dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0))),
    ((2, 3, 8, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ((1, 3, 5, 5), dict(kernel_size=2, stride=2, padding=1, ceil_mode=True)),  # last window would start in padding
    ((1, 3, 9, 8), dict(kernel_size=3, stride=1, padding=1, dilation=2)),
    ((1, 2, 11, 10), dict(kernel_size=(2, 3), stride=(3, 2), padding=(1, 1), dilation=(3, 2), ceil_mode=True)),
    ((1, 3, 1, 1), dict(kernel_size=1)),
    ((1, 3, 1, 2), dict(kernel_size=2, padding=1)),
]

AVG_CASES = [
    ((2, 3, 7, 9), dict(kernel_size=3, stride=2, padding=1)),
    ((2, 3, 7, 9), dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    ((2, 3, 7, 9), dict(kernel_size=2)),
    ((1, 4, 8, 5), dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 1), count_include_pad=False)),
    ((2, 3, 8, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ((2, 3, 8, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ((1, 3, 5, 5), dict(kernel_size=2, stride=2, padding=1, ceil_mode=True)),
    ((1, 3, 6, 7), dict(kernel_size=(2, 3), stride=1, divisor_override=5)),
    ((1, 3, 6, 7), dict(kernel_size=3, padding=1, ceil_mode=True, divisor_override=-2)),
    # 5 rows, stride 2, padding 1: the first rows' lowest window floor((ih + 1 - 5) / 2) + 1 has a
    # negative numerator (ih = 1: floor -1, truncation 0); the kernel clamps it before dividing
    ((1, 2, 7, 6), dict(kernel_size=(5, 3), stride=2, padding=1)),
    ((1, 3, 1, 1), dict(kernel_size=1)),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("shape,kw", MAX_CASES, ids=str)
def test_max_pool2d_matches_torch(shape, kw, channels_last, dtype):
    _check("max", shape, dtype, channels_last, **kw)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("shape,kw", AVG_CASES, ids=str)
def test_avg_pool2d_matches_torch(shape, kw, channels_last, dtype):
    _check("avg", shape, dtype, channels_last, **kw)


@pytest.mark.parametrize("op", ["max", "avg"])
def test_pool2d_float64_noncontiguous_and_many_programs(op):
    _check(op, (2, 3, 7, 6), torch.float64, noncontig=True, kernel_size=3, stride=2, padding=1, ceil_mode=True)
    # more elements than one interpreter block (2 ** 14): several programs, a masked last one
    _check(op, (2, 8, 40, 60), torch.float32, channels_last=op == "max", kernel_size=3, stride=1, padding=1)


def test_pool2d_unbatched_and_empty_batch():
    y = _check("max", (3, 7, 9), kernel_size=3, stride=2)
    assert y.shape == (3, 3, 4)
    _check("avg", (3, 7, 9), kernel_size=2, padding=1)
    x, xt = pair((3, 6, 5))
    y, idx = F.max_pool2d(x, 2, return_indices=True)
    yt, idxt = tf.max_pool2d(xt, 2, return_indices=True)
    assert_close(y, yt)
    assert torch.equal(idx.to_torch(), idxt)
    for op in ("max", "avg"):
        for cl in (False, True):
            y = _check(op, (0, 3, 5, 5), channels_last=cl, kernel_size=2)
            assert y.shape == (0, 3, 2, 2)


def test_max_pool2d_nan_inf_and_ties_follow_torch():
    x = torch.randn(1, 2, 6, 6)
    x[0, 0, 1, 1] = float("nan")
    x[0, 0, 4, 4] = x[0, 0, 4, 5] = float("nan")  # two NaNs in one window: the later one's index
    x[0, 1, :3, :3] = float("-inf")  # a window of -inf: index of its first in-bounds position
    x[0, 1, 3:, 3:] = 1.0  # ties: the first position in row-major window order
    for cl in (False, True):
        xt = x.contiguous(memory_format=torch.channels_last) if cl else x
        for kw in (dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, dilation=2)):
            y, idx = F.max_pool2d(flame.from_torch(xt.to(DEVICE)), return_indices=True, **kw)
            yt, idxt = tf.max_pool2d(xt, return_indices=True, **kw)
            assert_close(y, yt)
            assert torch.equal(idx.to_torch().cpu(), idxt), kw


def test_max_pool2d_gradient_of_tied_window_goes_to_one_element():
    x = flame.ones(1, 1, 4, 4, requires_grad=True)
    grads = F.max_pool2d(x, 2).sum().backward()
    want = torch.zeros(1, 1, 4, 4)
    want[..., ::2, ::2] = 1.0
    assert_close(grads[x], want)
    # overlapping windows sharing one maximum add their gradients there
    run = check_op(lambda x: F.max_pool2d(x, 3, stride=1), lambda t: tf.max_pool2d(t, 3, stride=1),
                   [torch.arange(25.0).reshape(1, 1, 5, 5)], g=torch.ones(1, 1, 3, 3))
    assert float(run.grads[0].to_torch().max()) == 1.0


@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
                                dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1))], ids=str)
def test_max_pool2d_gradcheck(kw):
    x = flame.tensor(np.random.default_rng(5).standard_normal((1, 1, 5, 6)), requires_grad=True)  # one channel
    assert gradcheck(lambda x: F.max_pool2d(x, **kw), [x])


@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                                dict(kernel_size=(2, 3), stride=1, padding=(1, 0)),
                                dict(kernel_size=2, padding=1, divisor_override=3)], ids=str)
def test_avg_pool2d_gradcheck(kw):
    x = flame.tensor(np.random.default_rng(6).standard_normal((1, 1, 5, 6)), requires_grad=True)
    assert gradcheck(lambda x: F.avg_pool2d(x, **kw), [x])


def test_pool2d_bad_inputs():
    x = flame.ones(1, 3, 6, 6)
    for pool in (F.max_pool2d, F.avg_pool2d):
        with pytest.raises(ValueError, match=r"padding \(2, 2\) must be at most half of kernel_size \(3, 3\)"):
            pool(x, 3, padding=2)
        with pytest.raises(ValueError, match="padding must be non-negative"):
            pool(x, 3, padding=-1)
        with pytest.raises(ValueError, match="kernel_size must be positive"):
            pool(x, 0)
        with pytest.raises(ValueError, match="stride must be positive"):
            pool(x, 2, stride=0)
        with pytest.raises(TypeError, match="kernel_size"):
            pool(x, (2, 2, 2))
        with pytest.raises(TypeError, match="stride"):
            pool(x, 2, stride=1.5)
        with pytest.raises(ValueError, match=r"\(1, 3, 6, 6\) .*output size \(0, 0\): too small"):
            pool(x, 7)
        with pytest.raises(ValueError, match=r"3-D \(C, H, W\) or 4-D .*\(1, 0, 6, 6\)"):
            pool(flame.ones(1, 0, 6, 6), 2)
        with pytest.raises(ValueError, match=r"got shape \(6, 6\)"):
            pool(flame.ones(6, 6), 2)
        with pytest.raises(TypeError, match="floating-point"):
            pool(flame.ones(1, 3, 6, 6, dtype=flame.int64), 2)
    with pytest.raises(ValueError, match="dilation must be positive"):
        F.max_pool2d(x, 2, dilation=0)
    with pytest.raises(ValueError, match=r"output size \(0, 0\)"):
        F.max_pool2d(x, 3, dilation=3)  # effective kernel 7 > 6
    with pytest.raises(ValueError, match="divisor_override must not be zero"):
        F.avg_pool2d(x, 2, divisor_override=0)
    with pytest.raises(TypeError, match="divisor_override must be an int"):
        F.avg_pool2d(x, 2, divisor_override=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_ONLY_DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_pool2d_bf16_gpu(dtype, channels_last):
    _check("max", (2, 64, 33, 31), dtype, channels_last, kernel_size=3, stride=2, padding=1, ceil_mode=True)
    _check("avg", (2, 64, 33, 31), dtype, channels_last, kernel_size=3, stride=2, padding=1, count_include_pad=False)


def test_offsets_are_int64_only_for_buffers_spanning_2_31_elements():
    from flame.kernels import pool as KP

    class Buf:  # shape and strides of a buffer too large to allocate here
        def __init__(self, shape, stride):
            self.shape, self._stride, self.dtype = shape, stride, torch.bfloat16

        def stride(self, dim=None):
            return self._stride if dim is None else self._stride[dim]

        def numel(self):
            return math.prod(self.shape)

    small = Buf((1, 640, 128, 128), (640 * 128 * 128, 1, 128 * 640, 640))  # channels-last
    huge = Buf((1, 640, 2048, 2048), (640 * 2048 * 2048, 1, 2048 * 640, 640))  # 2.7e9 elements
    assert KP._meta(small, small)[1]["WIDE"] is False
    assert KP._meta(small, huge)[1]["WIDE"] is True  # a read spanning 2**31 elements is enough
    assert KP._meta(huge)[1]["WIDE"] is True
