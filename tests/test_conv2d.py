import numpy as np
import pytest
import torch

import flame
import flame.nn.functional as F
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, assert_within_torch_error, pair


@pytest.fixture(autouse=True)
def _fresh_routes():
    """Routes are memoised per problem (kernels/conv2d.py): each test plans afresh, so one that
    patches the planner's helpers (split counts, config lookups) reaches them."""
    from flame.kernels.conv2d import _route
    _route.cache_clear()
    yield
    _route.cache_clear()


def _tol(want, dtype):
    """Convolutions sum in another order than PyTorch: the error scales with the summands (~the
    largest magnitude of the result), not with each element. fp32 products run as tf32 on the
    GPU (10 mantissa bits) and exactly in the interpreter."""
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    if dtype == torch.float16:
        return dict(rtol=2e-3, atol=2e-3 * max(scale, 1.0))
    if dtype == torch.float32 and not flame.is_interpreter():
        return dict(rtol=1e-2, atol=2e-3 * scale)
    return dict(rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def _run(x_shape, w_shape, dtype=torch.float32, bias=True, channels_last=False, noncontig=False, **kw):
    x, xt = pair(x_shape, dtype, requires_grad=True, noncontig=noncontig)
    if channels_last:
        xt = xt.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(xt.detach().clone(memory_format=torch.preserve_format), requires_grad=True)
        assert x.stride(1) == 1
    w, wt = pair(w_shape, dtype, requires_grad=True)
    b, bt = pair((w_shape[0],), dtype, requires_grad=True) if bias else (None, None)
    y = F.conv2d(x, w, b, **kw)
    yt = torch.nn.functional.conv2d(xt, wt, bt, **kw)
    g, gt = pair(tuple(yt.shape), dtype)
    grads = y.backward(g)
    yt.backward(gt)
    pairs = [("out", y, yt), ("input", grads[x], xt.grad), ("weight", grads[w], wt.grad)]
    if bias:
        pairs.append(("bias", grads[b], bt.grad))
    for name, got, want in pairs:
        got = got.to(dtype)
        try:
            assert_close(got, want, dtype, **_tol(want, dtype))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    return y


CASES = [  # (x shape, w shape, kwargs)
    ((2, 5, 7, 9), (6, 5, 3, 3), dict(padding=1)),
    ((2, 5, 7, 9), (6, 5, 3, 3), dict(stride=2, padding=1)),
    ((2, 5, 8, 8), (6, 5, 3, 3), dict(stride=2, padding=1)),
    ((2, 5, 7, 9), (4, 5, 1, 1), dict()),
    ((1, 3, 9, 7), (4, 3, 5, 5), dict(padding=2)),
    ((1, 3, 9, 7), (4, 3, 3, 3), dict(padding="same", dilation=2)),
    ((1, 3, 7, 9), (4, 3, 2, 4), dict(padding="same")),
    ((1, 3, 7, 9), (2, 3, 3, 3), dict(padding="valid")),
    ((1, 3, 9, 7), (4, 3, 5, 3), dict(stride=(2, 3), padding=(2, 0), dilation=(1, 2))),
    ((1, 3, 1, 1), (2, 3, 3, 3), dict(padding=1)),
    ((1, 3, 1, 1), (2, 3, 1, 1), dict()),
    ((2, 4, 7, 9), (6, 2, 3, 3), dict(padding=1, groups=2)),
    ((2, 4, 7, 9), (8, 1, 3, 3), dict(stride=2, padding=1, groups=4)),  # depthwise, multiplier 2
    ((2, 4, 7, 9), (4, 1, 3, 3), dict(padding=1, groups=4)),  # depthwise, multiplier 1
    ((2, 5, 7, 9), (4, 5, 1, 1), dict(stride=2)),  # 1x1 stride 2: odd rows/columns get no gradient
    ((1, 3, 7, 9), (4, 3, 3, 3), dict(stride=2)),  # padding 0, stride 2, odd sizes: last row/column unused
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("x_shape,w_shape,kw", CASES, ids=str)
def test_conv2d_matches_torch(dtype, x_shape, w_shape, kw):
    _run(x_shape, w_shape, dtype, **kw)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("groups", [1, 5])
def test_conv2d_channels_last_input_and_output(stride, groups):
    y = _run((2, 5, 7, 9), (10, 5 // groups, 3, 3), channels_last=True, stride=stride, padding=1, groups=groups)
    # the output is channels-last: logical NCHW shape, NHWC strides
    _, c, h, w = y.shape
    assert y.stride() == (h * w * c, 1, w * c, c)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
def test_conv2d_weight_gradient_into_any_layout(layout):
    """The weight-gradient kernel writes dW in the buffer's own layout (flame's backward gives it the
    weight's: channels-last weights get ci-contiguous tile stores)."""
    import flame.kernels.conv2d as KC
    xt = torch.randn(2, 6, 7, 9, device=DEVICE).contiguous(memory_format=torch.channels_last)
    g = torch.randn(2, 4, 7, 9, device=DEVICE).contiguous(memory_format=torch.channels_last)
    dw = {"nchw": torch.empty(4, 6, 3, 3, device=DEVICE),
          "channels_last": torch.empty(4, 6, 3, 3, device=DEVICE).contiguous(memory_format=torch.channels_last),
          "strided": torch.empty(4, 12, 3, 3, device=DEVICE)[:, ::2]}[layout]
    KC.conv2d_weight_grad_(dw, g, xt, (1, 1), (1, 1), (1, 1))
    want = torch.nn.grad.conv2d_weight(xt.double(), (4, 6, 3, 3), g.double(), padding=1)
    assert_close(dw.double(), want, torch.float64, **_tol(want, torch.float32))


@pytest.mark.parametrize("x_shape,w_shape,kw,route", [
    ((2, 4, 9, 11), (16, 4, 3, 3), dict(padding=1), "fold"),  # conv_in: 4 channels x 9 taps
    ((2, 5, 9, 7), (8, 5, 3, 3), dict(padding=1, stride=2), "fold"),
    ((1, 2, 9, 7), (8, 2, 5, 5), dict(padding=(1, 2)), "fold"),
    ((2, 4, 6, 6), (6, 2, 3, 3), dict(padding=1, groups=2), "fold"),
    ((2, 24, 9, 11), (4, 24, 3, 3), dict(padding=1), "swap"),  # conv_out: 4 output channels
    ((1, 24, 8, 10), (3, 24, 3, 3), dict(padding=2, dilation=2), "swap"),
    ((1, 20, 9, 7), (2, 20, 5, 5), dict(padding=(2, 1)), "swap"),
    ((1, 3, 9, 7), (8, 3, 5, 5), dict(padding=2), "per tap"),  # 75 (tap, ci) columns: one program per tap
], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_conv2d_weight_gradient_folds_taps_for_few_channels(x_shape, w_shape, kw, route, channels_last, splits,
                                                              monkeypatch):
    """Few input channels: the pointer weight gradient puts every (tap, ci) in one column tile; few
    output channels at stride 1: it swaps the operands (dY convolved by x), stores transposed and
    tap-flipped, and folds those. Values against PyTorch in float64, both layouts, with the rows in
    one piece or split 3 ways (partial sums in dW's memory order, then summed)."""
    import flame.kernels.conv2d as KC
    from flame import tune
    monkeypatch.setattr(KC, "_wgrad_splits", lambda programs, units: splits)
    launches = []
    real = KC.launch
    monkeypatch.setattr(KC, "launch", lambda k, grid, *a, **m: launches.append((grid, m)) or real(k, grid, *a, **m))
    cl = torch.channels_last if channels_last else torch.contiguous_format
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(x_shape, **f64).contiguous(memory_format=cl)
    y_shape = torch.nn.functional.conv2d(x, torch.zeros(w_shape, **f64), **kw).shape
    g = torch.randn(y_shape, **f64).contiguous(memory_format=cl)
    dw = torch.full(w_shape, float("nan"), **f64).contiguous(memory_format=cl)
    stride, padding, dilation = (torch.nn.modules.utils._pair(kw.get(k, v))
                                 for k, v in (("stride", 1), ("padding", 0), ("dilation", 1)))
    with tune.override("conv2d_wgrad", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)):
        KC.conv2d_weight_grad_(dw, g, x, stride, padding, dilation, kw.get("groups", 1))
    assert_close(dw, torch.nn.grad.conv2d_weight(x, w_shape, g, **kw), torch.float64)
    (grid, meta), = launches  # (the sum of the splits is the reduction kernel's launch)
    taps = w_shape[2] * w_shape[3]
    assert (meta["FOLD_TAPS"], grid[1]) == ((False, taps) if route == "per tap" else (True, 1))
    assert (grid[2] > 1) == (splits > 1)


@pytest.mark.parametrize("x_shape,w_shape,kw,route", [
    ((2, 4, 9, 11), (24, 4, 3, 3), dict(padding=1), ("fold", "gemm")),  # conv_in: 16 taps (9 padded) x 4 channels
    ((2, 24, 9, 8), (4, 24, 3, 3), dict(padding=1), ("gemm", "fold")),  # conv_out: its input gradient over 4
    ((1, 2, 9, 7), (8, 2, 3, 3), dict(padding=(1, 2), dilation=(2, 1)), ("fold", "gemm")),  # K 16 x 2; 16 x 8 = 128
    ((1, 2, 9, 7), (8, 2, 1, 1), dict(stride=2, padding=1), ("fold", "gemm")),  # one tap, K padded to 16; strided
    ((2, 7, 9, 8), (4, 7, 3, 3), dict(padding=1, stride=2), ("gemm", "gemm")),  # 16 x 8 columns; strided input grad
    ((2, 4, 6, 6), (6, 2, 3, 3), dict(padding=1, groups=2), ("gemm", "gemm")),  # groups never fold
], ids=str)
def test_conv2d_few_channels_fold_every_tap_into_one_k_block(x_shape, w_shape, kw, route, monkeypatch):
    """Few channels on the reduction side (the forward's input channels, the input gradient's
    output channels), one group, no stride in the input gradient: _conv_fold_kernel gathers all
    taps x channels of a row as one K block. Which kernel runs, and values against PyTorch in
    float64 for both layouts of the input."""
    import flame.kernels.conv2d as KC
    kernels = []
    real = KC.launch

    def record(kernel, grid, *a, **meta):
        kernels.append("fold" if kernel is KC._conv_fold_kernel else "gemm" if kernel is KC._conv_gemm_kernel
                       else "other")
        return real(kernel, grid, *a, **meta)

    monkeypatch.setattr(KC, "launch", record)
    for channels_last in (False, True):
        kernels.clear()
        _run(x_shape, w_shape, torch.float64, channels_last=channels_last, **kw)
        assert tuple(kernels[:2]) == route, kernels


def test_conv2d_fold_width():
    """The fold's K block: taps and channels each rounded up to a power of two, at least 16 and at most 64 wide."""
    import flame.kernels.conv2d as KC
    assert KC._fold_shape(4, 9) == dict(TAPS_P2=16, C_P2=4) and KC.folds(4, 9)
    assert KC._fold_shape(2, 1) == dict(TAPS_P2=1, C_P2=16) and KC.folds(64, 1) and not KC.folds(65, 1)
    assert KC._fold_shape(1, 25) == dict(TAPS_P2=32, C_P2=1) and KC.folds(2, 25) and not KC.folds(3, 25)
    assert not KC.folds(5, 9) and KC.folds(1, 49) and not KC.folds(2, 49)


def test_dense_order():
    from flame import runtime  # the layout helper the weight gradient's split-K scratch follows
    assert runtime.dense_order(torch.empty(4, 6, 3, 3)) == (0, 1, 2, 3)
    assert runtime.dense_order(torch.empty(4, 6, 3, 3).contiguous(memory_format=torch.channels_last)) == (0, 2, 3, 1)
    assert runtime.dense_order(torch.empty(4, 6, 1, 1)) == (0, 1, 2, 3)
    assert runtime.dense_order(torch.empty(4, 12, 3, 3)[:, ::2]) is None
    assert runtime.dense_order(torch.empty(8, 6, 3, 3)[:4]) == (0, 1, 2, 3)  # a leading slice is dense
    assert runtime.dense_order(torch.empty(6, 4, 3, 3).transpose(0, 1)) == (1, 0, 2, 3)


@pytest.mark.parametrize("w_shape,kw", [
    ((4, 5, 1, 1), dict()),
    ((4, 5, 5, 5), dict(padding=2)),
    ((4, 5, 3, 3), dict(padding="same", dilation=2)),
    ((5, 1, 3, 3), dict(stride=2, padding=1, groups=5)),  # depthwise
], ids=str)
def test_conv2d_channels_last_fp16(w_shape, kw):
    y = _run((2, 5, 7, 9), w_shape, torch.float16, channels_last=True, **kw)
    assert y.stride(1) == 1
    _run((1, 5, 1, 1), (3, 5, 1, 1), torch.float16, channels_last=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("x_shape,channels_last,kw,routes", [
    # routes: (GEMM calls, implicit-GEMM conv launches) over forward + input grad + weight grad
    ((1, 7, 4, 5), True, dict(), (3, 0)),
    ((1, 7, 4, 5), False, dict(), (3, 0)),  # NCHW N=1: dx is an (H*W, Ci) matrix with column stride H*W
    ((2, 7, 4, 5), True, dict(dilation=2), (3, 0)),
    ((2, 7, 4, 5), False, dict(), (2, 1)),  # NCHW N=2: dx's (N, H, W) rows have no one stride
    ((2, 7, 4, 5), True, dict(stride=2), (0, 3)),
    ((1, 7, 4, 5), False, dict(padding=1), (0, 3)),
], ids=str)
def test_conv2d_1x1_runs_as_plain_gemm(monkeypatch, dtype, x_shape, channels_last, kw, routes):
    # 1x1, stride 1, no padding, one group: the GEMM kernel (linear_ with the bias fused in the
    # forward, matmul_ for both gradients); otherwise the implicit-GEMM kernels, same results
    from flame.kernels import conv2d as KC
    calls = {"gemm": 0, "conv": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for fn in ("linear_", "matmul_"):
        monkeypatch.setattr(KC, fn, counting("gemm", getattr(KC, fn)))
    monkeypatch.setattr(KC, "launch", counting("conv", KC.launch))
    _run(x_shape, (5, 7, 1, 1), dtype, channels_last=channels_last, **kw)
    assert (calls["gemm"], calls["conv"]) == routes


def test_conv2d_float64_matches_torch():
    _run((2, 3, 7, 9), (4, 3, 3, 3), torch.float64, stride=2, padding=1)
    _run((2, 3, 7, 9), (4, 3, 3, 3), torch.float64, channels_last=True, padding="same", dilation=2)


def test_conv2d_noncontiguous_input_no_bias():
    _run((2, 4, 6, 5), (3, 4, 3, 3), bias=False, noncontig=True, padding=1)


def test_conv2d_noncontiguous_weight():
    # a weight stored (Ci, Co, kh, kw) and viewed (Co, Ci, kh, kw): the kernels read it through strides
    x, xt = pair((2, 4, 7, 6), requires_grad=True)
    wt0 = torch.randn(4, 5, 3, 3, dtype=torch.float32).to(DEVICE)
    w = flame.from_torch(wt0.clone(), requires_grad=True)
    wt = wt0.clone().requires_grad_()
    y = F.conv2d(x, w.transpose(0, 1), stride=2, padding=1)
    yt = torch.nn.functional.conv2d(xt, wt.transpose(0, 1), stride=2, padding=1)
    g, gt = pair(tuple(yt.shape))
    grads = y.backward(g)
    yt.backward(gt)
    for got, want in ((y, yt), (grads[x], xt.grad), (grads[w], wt.grad)):
        assert_close(got, want, **_tol(want, torch.float32))


@pytest.mark.parametrize("trained", ["input", "weight"])
def test_conv2d_gradient_of_one_operand(trained):
    # frozen weights (LoRA: only the activations' gradient flows) and frozen inputs (first layer)
    x, xt = pair((2, 3, 7, 9), requires_grad=trained == "input")
    w, wt = pair((4, 3, 3, 3), requires_grad=trained == "weight")
    b, bt = pair((4,), requires_grad=trained == "weight")
    y = F.conv2d(x, w, b, stride=2, padding=1)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=2, padding=1)
    g, gt = pair(tuple(yt.shape))
    grads = y.backward(g)
    yt.backward(gt)
    live = [x] if trained == "input" else [w, b]
    assert len(grads) == len(live)
    for f, t in ((x, xt), (w, wt), (b, bt)):
        if f.requires_grad:
            assert_close(grads[f], t.grad, **_tol(t.grad, torch.float32))


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=1)], ids=str)
def test_conv2d_many_tiles(kw):
    # more channels than one reduction block (130 > 128), more output channels than one column
    # tile (136 > 128), more rows than one row tile and the weight gradient's reduction block
    _run((2, 130, 5, 6), (136, 130, 3, 3), **kw)
    _run((2, 3, 19, 17), (5, 3, 3, 3), **kw)


def test_conv2d_unbatched_and_mixed_precision():
    _run((3, 7, 9), (4, 3, 3, 3), padding=1)
    # fp32 master weight with fp16 activations: cast once, gradient back in fp32
    x, xt = pair((1, 3, 5, 6), torch.float16, requires_grad=True)
    w, wt = pair((2, 3, 3, 3), torch.float32, requires_grad=True)
    y = F.conv2d(x, w, padding=1)
    assert y.dtype == torch.float16
    grads = y.float().sum().backward()
    assert grads[w].dtype == torch.float32
    yt = torch.nn.functional.conv2d(xt, wt.half(), padding=1)
    yt.float().sum().backward()
    assert_close(grads[w], wt.grad, **_tol(wt.grad, torch.float16))


@pytest.mark.slow  # extended settings: their gradients are checked against torch's in test_conv2d_matches_torch
@pytest.mark.parametrize("kw", [pytest.param(dict(stride=2, padding=1), marks=pytest.mark.extended),
                                pytest.param(dict(padding="same", dilation=2), marks=pytest.mark.extended),
                                pytest.param(dict(stride=(1, 2)), marks=pytest.mark.extended),
                                pytest.param(dict(padding=1, groups=2), marks=pytest.mark.extended),
                                dict(stride=2, dilation=2, padding=1)], ids=str)
def test_conv2d_gradcheck(kw):
    rng = np.random.default_rng(3)
    g = kw.get("groups", 1)
    x = flame.tensor(rng.standard_normal((1, 2, 4, 3)), requires_grad=True)
    w = flame.tensor(rng.standard_normal((2, 2 // g, 3, 3)), requires_grad=True)  # few outputs: fewer forwards
    b = flame.tensor(rng.standard_normal(2), requires_grad=True)
    assert gradcheck(lambda x, w, b: F.conv2d(x, w, b, **kw), [x, w, b])


def test_conv2d_empty_batch_and_zero_channels():
    x = flame.randn(0, 3, 5, 5, requires_grad=True)
    w = flame.randn(4, 3, 3, 3, requires_grad=True)
    b = flame.randn(4, requires_grad=True)
    y = F.conv2d(x, w, b, padding=1)
    assert y.shape == (0, 4, 5, 5)
    grads = y.sum().backward()
    assert_close(grads[w], torch.zeros(4, 3, 3, 3))
    assert_close(grads[b], torch.zeros(4))
    # no input channels: the output is the bias
    y = F.conv2d(flame.randn(2, 0, 5, 5), flame.randn(4, 0, 3, 3), b, padding=1)
    assert_close(y, b.to_torch().view(1, 4, 1, 1).expand(2, 4, 5, 5))


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=2, dilation=2), dict(padding="same"),
                                dict(stride=(2,), groups=2)], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 11), (4, 11)], ids=str)
def test_conv1d_matches_torch(kw, shape):
    x, xt = pair(shape, requires_grad=True)
    w, wt = pair((6, 4 // kw.get("groups", 1), 3), requires_grad=True)
    b, bt = pair((6,), requires_grad=True)
    y = F.conv1d(x, w, b, **kw)
    yt = torch.nn.functional.conv1d(xt, wt, bt, **kw)
    g, gt = pair(tuple(yt.shape))
    grads = y.backward(g)
    yt.backward(gt)
    for got, want in ((y, yt), (grads[x], xt.grad), (grads[w], wt.grad), (grads[b], bt.grad)):
        assert_close(got, want, **_tol(want, torch.float32))
    with pytest.raises(ValueError, match=r"2-D \(C, L\) or 3-D"):
        F.conv1d(flame.ones(1, 4, 5, 5), w)
    with pytest.raises(ValueError, match="weight must be 3-D"):
        F.conv1d(x, flame.ones(6, 4, 3, 3))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("w_shape,kw", [
    ((6, 4, 1), dict(stride=2)),
    ((6, 4, 5), dict(padding=2)),
    ((4, 1, 3), dict(padding="valid", groups=4)),  # depthwise
], ids=str)
def test_conv1d_kernel_sizes_dtypes_and_channels_innermost_input(w_shape, kw, dtype):
    # (N, L, C) storage viewed as (N, C, L): channels innermost, as a transformer's tokens
    xt0 = torch.randn(2, 9, 4, dtype=dtype).to(DEVICE)
    xl = flame.from_torch(xt0.clone(), requires_grad=True)
    xt = xt0.clone().requires_grad_()
    x = xl.permute(0, 2, 1)
    w, wt = pair(w_shape, dtype, requires_grad=True)
    b, bt = pair((w_shape[0],), dtype, requires_grad=True)
    y = F.conv1d(x, w, b, **kw)
    yt = torch.nn.functional.conv1d(xt.permute(0, 2, 1), wt, bt, **kw)
    g, gt = pair(tuple(yt.shape), dtype)
    grads = y.backward(g)
    yt.backward(gt)
    for got, want in ((y, yt), (grads[xl].to(dtype), xt.grad), (grads[w].to(dtype), wt.grad),
                      (grads[b].to(dtype), bt.grad)):
        assert_close(got, want, dtype, **_tol(want, dtype))


def test_conv1d_gradcheck_and_bad_inputs():
    rng = np.random.default_rng(4)
    x = flame.tensor(rng.standard_normal((1, 2, 6)), requires_grad=True)
    w = flame.tensor(rng.standard_normal((2, 1, 3)), requires_grad=True)
    assert gradcheck(lambda x, w: F.conv1d(x, w, stride=2, padding=1, groups=2), [x, w])
    with pytest.raises(ValueError, match=r"\(1, 2, 6\).*\(2, 3, 3\)"):
        F.conv1d(x, flame.ones(2, 3, 3, dtype=flame.float64))
    with pytest.raises(ValueError, match="larger than the padded input"):
        F.conv1d(x, flame.ones(2, 2, 7, dtype=flame.float64))
    with pytest.raises(TypeError, match="stride"):
        F.conv1d(x, w, stride=(1, 2))


@pytest.mark.parametrize("shape,kw,channels_last", [
    ((2, 3, 5, 7), dict(scale_factor=2), False),
    ((2, 3, 5, 7), dict(scale_factor=2.0), True),
    ((2, 3, 5, 7), dict(size=(10, 21)), False),
    ((1, 4, 3, 3), dict(scale_factor=(1, 2)), False),
    ((2, 3, 5), dict(scale_factor=3), False),
], ids=str)
def test_interpolate_nearest_matches_torch(shape, kw, channels_last):
    x, xt = pair(shape, requires_grad=True)
    if channels_last:
        xt = xt.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(xt.detach().clone(memory_format=torch.preserve_format), requires_grad=True)
    y = F.interpolate(x, **kw)
    yt = torch.nn.functional.interpolate(xt, **kw)
    g, gt = pair(tuple(yt.shape))
    grads = y.backward(g)
    yt.backward(gt)
    assert_close(y, yt)
    assert_close(grads[x], xt.grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_interpolate_dtypes_layout_and_gradcheck(dtype):
    x, xt = pair((1, 3, 4, 5), dtype, requires_grad=True)
    y = F.interpolate(x, scale_factor=2, mode="nearest-exact")
    assert y.stride() == (8 * 10 * 3, 1, 10 * 3, 3)  # channels-last output (1, 3, 8, 10)
    yt = torch.nn.functional.interpolate(xt, scale_factor=2, mode="nearest-exact")
    g, gt = pair(tuple(yt.shape), dtype)
    grads = y.backward(g)
    yt.backward(gt)
    assert_close(y, yt)
    assert_close(grads[x].to(dtype), xt.grad)
    y1 = F.interpolate(pair((2, 3, 5), dtype)[0], size=15)
    assert y1.shape == (2, 3, 15)
    x64 = flame.tensor(np.random.default_rng(2).standard_normal((1, 2, 2, 3)), requires_grad=True)
    assert gradcheck(lambda t: F.interpolate(t, scale_factor=(2, 3)), [x64])


@pytest.mark.parametrize("channels_last", [False, True])
def test_upsample_then_conv_matches_torch(channels_last):
    # SDXL's Upsample2D: nearest 2x, then a 3x3 conv with padding 1
    x, xt = pair((1, 6, 3, 5), requires_grad=True)
    if channels_last:
        xt = xt.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        x = flame.from_torch(xt.detach().clone(memory_format=torch.preserve_format), requires_grad=True)
    w, wt = pair((4, 6, 3, 3), requires_grad=True)
    b, bt = pair((4,), requires_grad=True)
    y = F.conv2d(F.interpolate(x, scale_factor=2), w, b, padding=1)
    yt = torch.nn.functional.conv2d(torch.nn.functional.interpolate(xt, scale_factor=2), wt, bt, padding=1)
    g, gt = pair(tuple(yt.shape))
    grads = y.backward(g)
    yt.backward(gt)
    for got, want in ((y, yt), (grads[x], xt.grad), (grads[w], wt.grad), (grads[b], bt.grad)):
        assert_close(got, want, **_tol(want, torch.float32))


def test_interpolate_bad_inputs():
    x = flame.ones(1, 2, 4, 4)
    with pytest.raises(NotImplementedError, match="bilinear"):
        F.interpolate(x, scale_factor=2, mode="bilinear")
    with pytest.raises(NotImplementedError, match="integer"):
        F.interpolate(x, scale_factor=1.5)
    with pytest.raises(NotImplementedError, match="multiple"):
        F.interpolate(x, size=(6, 6))
    with pytest.raises(ValueError, match="exactly one"):
        F.interpolate(x)
    with pytest.raises(ValueError, match="3-D"):
        F.interpolate(flame.ones(2, 4), scale_factor=2)


def test_conv2d_bad_inputs():
    x, w = flame.ones(1, 3, 5, 5), flame.ones(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"3 channels.*\(4, 2, 3, 3\)"):
        F.conv2d(x, flame.ones(4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"3-D .* or 4-D"):
        F.conv2d(flame.ones(3, 5), w)
    with pytest.raises(ValueError, match="weight must be 4-D"):
        F.conv2d(x, flame.ones(4, 3, 3))
    with pytest.raises(ValueError, match="stride must be positive"):
        F.conv2d(x, w, stride=0)
    with pytest.raises(TypeError, match="stride"):
        F.conv2d(x, w, stride=(1, 2, 3))
    with pytest.raises(ValueError, match="padding must be non-negative"):
        F.conv2d(x, w, padding=-1)
    with pytest.raises(ValueError, match="padding"):
        F.conv2d(x, w, padding="full")
    with pytest.raises(ValueError, match="strided"):
        F.conv2d(x, w, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"padded input \(2, 2\); input \(1, 3, 2, 2\), weight \(4, 3, 3, 3\)"):
        F.conv2d(flame.ones(1, 3, 2, 2), w)
    with pytest.raises(ValueError, match=r"larger than the padded input \(4, 4\)"):
        F.conv2d(flame.ones(1, 3, 2, 2), flame.ones(4, 3, 5, 5), padding=1)
    with pytest.raises(ValueError, match="bias"):
        F.conv2d(x, w, flame.ones(3))
    with pytest.raises(ValueError, match=r"groups=3 must divide .*input \(1, 4, 5, 5\), weight \(4, 2, 3, 3\)"):
        F.conv2d(flame.ones(1, 4, 5, 5), flame.ones(4, 2, 3, 3), groups=3)
    with pytest.raises(ValueError, match=r"expects 6 .*groups=3"):
        F.conv2d(flame.ones(1, 3, 5, 5), flame.ones(3, 2, 3, 3), groups=3)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        F.conv2d(x, w, groups=0)
    with pytest.raises(TypeError):
        F.conv2d(flame.ones(1, 3, 5, 5, dtype=flame.int64), w)


@pytest.mark.gpu
def test_conv2d_fp32_gpu_tf32():
    _run((2, 64, 33, 31), (96, 64, 3, 3), padding=1)
    _run((2, 64, 33, 31), (96, 64, 3, 3), stride=2, padding=1, channels_last=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,co,kw", [
    ((1, 320, 128, 128), 320, dict(padding=1)),
    ((1, 640, 64, 64), 640, dict(stride=2, padding=1)),
    ((1, 4, 128, 128), 320, dict(padding=1)),
    ((1, 320, 128, 128), 4, dict(padding=1)),
    ((1, 960, 128, 128), 320, dict()),
    ((1, 2560, 32, 32), 1280, dict(padding=1)),
    ((1, 2560, 32, 32), 1280, dict()),
], ids=str)
def test_conv2d_bf16_sdxl_shape_error_budget(shape, co, kw):
    # DESIGN rule: error vs an fp32 reference at most 2x (outputs) / 3x (gradients) PyTorch's in bf16
    k = 1 if not kw else 3
    x32 = torch.randn(shape, device=DEVICE).contiguous(memory_format=torch.channels_last)
    w32 = torch.randn(co, shape[1], k, k, device=DEVICE) / (shape[1] * k * k) ** 0.5
    b32 = torch.randn(co, device=DEVICE)
    ref = [t.clone().requires_grad_() for t in (x32, w32, b32)]
    y_ref = torch.nn.functional.conv2d(*ref, **kw)
    g32 = torch.randn(y_ref.shape, device=DEVICE)
    y_ref.backward(g32)
    low = [t.bfloat16().requires_grad_() for t in (x32, w32, b32)]
    y_low = torch.nn.functional.conv2d(*low, **kw)
    y_low.backward(g32.bfloat16())
    fx, fw, fb = [flame.from_torch(t.detach().bfloat16(), requires_grad=True) for t in (x32, w32, b32)]
    y = F.conv2d(fx, fw, fb, **kw)
    grads = y.backward(flame.from_torch(g32.bfloat16()))
    assert_within_torch_error(y, y_low, y_ref, 2)
    for f, lo, r in ((fx, low[0], ref[0]), (fw, low[1], ref[1]), (fb, low[2], ref[2])):
        assert_within_torch_error(grads[f], lo.grad, r.grad, 3)


ALL_TMA = ["_conv_tma_kernel", "_conv_tma_kernel", "_conv_wgrad_tma_kernel"]


def _check_tma_convolution(dtype, shape, co, k, kw, monkeypatch, tma_kernels=ALL_TMA):
    """A convolution with channels-last activations and weights (as flame's model keeps them) and
    channels a multiple of 8 takes the TMA kernels ``tma_kernels`` (sorted; by default for its
    forward, input and weight gradient; None: not checked), and all three match PyTorch."""
    import flame.kernels.conv2d as KC
    taken = []
    real = KC.launch
    monkeypatch.setattr(KC, "launch", lambda kernel, *a, **k: taken.append(kernel.fn.__name__) or real(kernel, *a, **k))
    cl = torch.channels_last
    x32 = torch.randn(shape, device=DEVICE).contiguous(memory_format=cl)
    w32 = (torch.randn(co, shape[1], k, k, device=DEVICE) / (shape[1] * k * k) ** 0.5).contiguous(memory_format=cl)
    b32 = torch.randn(co, device=DEVICE)
    ref = [t.double().requires_grad_() for t in (x32, w32, b32)]
    y_ref = torch.nn.functional.conv2d(*ref, **kw)
    g32 = torch.randn(y_ref.shape, device=DEVICE).contiguous(memory_format=cl)
    y_ref.backward(g32.double())
    low = [t.to(dtype).requires_grad_() for t in (x32, w32, b32)]
    y_low = torch.nn.functional.conv2d(*low, **kw)
    y_low.backward(g32.to(dtype))
    fx, fw, fb = [flame.from_torch(t.detach().to(dtype), requires_grad=True) for t in (x32, w32, b32)]
    y = F.conv2d(fx, fw, fb, **kw)
    grads = y.backward(flame.from_torch(g32.to(dtype)))
    assert_within_torch_error(y, y_low, y_ref.detach(), 2)
    for f, lo, r in ((fx, low[0], ref[0]), (fw, low[1], ref[1]), (fb, low[2], ref[2])):
        assert_within_torch_error(grads[f], lo.grad, r.grad, 3)
    tma = [name for name in taken if "tma" in name]
    assert tma_kernels is None or sorted(tma) == tma_kernels, taken


# Stride 2 reads (forward, weight gradient) and writes (input gradient) through the phase views;
# stride (2, 1) has one phased axis; channels 48 and 24 need channel blocks cut to divide them.
TMA_SHAPES = [
    ((1, 16, 9, 7), 24, 3, dict(padding=1)),
    ((2, 32, 16, 16), 40, 3, dict(padding=2, dilation=2)),
    ((1, 64, 12, 20), 64, 5, dict(padding=2)),
    ((1, 24, 10, 144), 16, 3, dict(padding=0)),
    ((2, 32, 16, 16), 48, 3, dict(stride=2, padding=1)),
    ((1, 48, 12, 20), 64, 5, dict(stride=2, padding=2)),
    ((1, 64, 8, 12), 24, 3, dict(stride=(2, 1), padding=1)),
    ((1, 32, 10, 14), 32, 3, dict(stride=2, padding=0)),
    ((2, 16, 6, 32), 16, 3, dict(padding=1)),  # weight gradient: tiles of 2 whole rows, 2 images
    ((1, 16, 4, 128), 16, 3, dict(padding=1)),  # weight gradient: tiles of half a row
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,co,k,kw", TMA_SHAPES + [
    ((1, 320, 64, 64), 320, 3, dict(padding=1)),
    ((1, 128, 32, 32), 256, 3, dict(padding=1)),
    ((1, 320, 128, 128), 320, 3, dict(stride=2, padding=1)),
    ((1, 640, 64, 64), 640, 3, dict(stride=2, padding=1)),
], ids=str)
def test_conv2d_tma_forward_and_both_gradients(dtype, shape, co, k, kw, monkeypatch):
    import flame.kernels.matmul as KM
    if not KM.TMA or not KM.tma_available():
        pytest.skip("no TMA on this GPU / Triton")
    monkeypatch.setattr(KM.matmul_hopper, "ROUTE", False)  # the TMA kernels (Gluon's: the next test)
    _check_tma_convolution(dtype, shape, co, k, kw, monkeypatch)


# (shape, co, k, kwargs, the directions on the Gluon kernel): blocks of one row segment (OW 256),
# one row (OW 64 at 64 rows per consumer block, or two at 128), two or four rows (OW 32); 200 input
# channels (a tap's last channel block runs into the next tap's weights against zero-filled source
# channels; the input gradient's last column tile past its 200 outputs); 328 output channels; a
# 5x5 kernel with dilation 2; K split in 2 (cooperative tiles; ping-pong for the input gradient
# of 256 channels, whose forward has too few tiles and K to split).
# The weight gradient (on the Gluon kernel where a tile's columns divide Ci): cooperative 2 x 64 x
# (128 + 32) tiles with K in 2 splits, ping-pong 128 x 128 over blocks of two pixel rows, and K in 5
# splits under the 5x5 dilated kernel; 64 and 200 input channels (no tile divides them) stay on the
# TMA kernel.
GLUON_SHAPES = [
    ((2, 320, 64, 64), 320, 3, dict(padding=1), ("forward", "input_grad", "weight_grad")),
    ((4, 640, 32, 32), 640, 3, dict(padding=1), ("forward", "input_grad", "weight_grad")),
    ((1, 64, 64, 256), 512, 3, dict(padding=1), ("forward",)),
    ((4, 200, 64, 64), 328, 3, dict(padding=1), ("forward", "input_grad")),
    ((4, 128, 64, 64), 256, 5, dict(padding=4, dilation=2), ("forward", "weight_grad")),
    ((1, 1280, 32, 32), 1280, 3, dict(padding=1), ("forward", "input_grad", "weight_grad")),
    ((2, 256, 32, 32), 512, 3, dict(padding=1), ("input_grad",)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,co,k,kw,directions", GLUON_SHAPES, ids=str)
def test_conv2d_on_the_warp_specialised_gemm(dtype, shape, co, k, kw, directions, monkeypatch):
    """Stride-1 convolutions run on matmul_hopper's kernel where it has the tiles (K split where
    they fill less than a wave), forward and both gradients, and match PyTorch within its own error."""
    import flame.kernels.conv2d as KC
    if not KC._gluon_on():
        pytest.skip("needs an sm_90 GPU with triton.experimental.gluon")
    taken = []
    monkeypatch.setattr(KC, "plan", lambda p, real=KC.plan: taken.append((p.direction, real(p).kernel)) or real(p))
    _check_tma_convolution(dtype, shape, co, k, kw, monkeypatch, None)
    assert sorted(d for d, kernel in taken if kernel.startswith("gluon")) == sorted(directions), taken


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernels")
@pytest.mark.parametrize("shape,co,k,kw", TMA_SHAPES, ids=str)
def test_conv2d_tma_kernels_in_the_interpreter(shape, co, k, kw, monkeypatch, tma_in_interpreter):
    """The TMA kernels' indexing (phase views included), run by the interpreter's emulation of
    tensor descriptors (fp16: its bf16 dot is wrong)."""
    _check_tma_convolution(torch.float16, shape, co, k, kw, monkeypatch)


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernels")
@pytest.mark.parametrize("padding", [1, 2])
def test_conv2d_tma_stride_and_dilation_in_the_interpreter(padding, monkeypatch, tma_in_interpreter):
    """Stride 2 with dilation 2: the forward and weight gradient read through the phase view (tap
    offsets -p, 2 - p, 4 - p: one phase, shifts from -1), the input gradient takes the pointer
    kernel (its phase views need unit dilation)."""
    _check_tma_convolution(torch.float16, (1, 32, 12, 16), 16, 3, dict(stride=2, padding=padding, dilation=2),
                           monkeypatch, ["_conv_tma_kernel", "_conv_wgrad_tma_kernel"])


# (x shape, Co, kernel size, stride, padding, which conv), batch 2 (images split * 2 + n of the
# scratch): 80 reduction channels are two channel blocks of 64; stride 2's input gradient has 4
# phases, meeting 4, 2, 2 and 1 taps (8, 4, 4, 2 loop steps) in splits of 3 steps: the first split
# ends inside a tap's channel blocks, and the shorter phases' last splits have no steps at all.
TMA_SPLIT_CASES = [
    ((2, 80, 7, 9), 24, 5, 1, 2, "forward"),
    ((2, 40, 7, 9), 80, 3, 1, 1, "input_grad"),
    ((2, 32, 8, 10), 80, 3, 2, 1, "input_grad"),
]


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernels")
@pytest.mark.parametrize("shape,co,k,stride,padding,which", TMA_SPLIT_CASES, ids=str)
def test_conv2d_tma_split_k_in_the_interpreter(shape, co, k, stride, padding, which, monkeypatch,
                                               tma_in_interpreter):
    """Split-K of the TMA conv kernel, forced to 3 splits: each split stores its fp32 partial sums
    to the scratch (through the phase view with stride 2, zeros from splits past a phase's shorter
    loop), and the sum pass adds them in order, with the forward's bias, into ``out``."""
    import flame.kernels.conv2d as KC
    import flame.kernels.matmul as KM
    taken = []
    for mod in (KC, KM):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, *a, real=mod.launch, **k:
                            taken.append((kernel.fn.__name__, tuple(grid))) or real(kernel, grid, *a, **k))
    monkeypatch.setattr(KC, "_wave_splits", lambda programs, steps, sms: 3)
    cl = torch.channels_last
    kw = dict(stride=stride, padding=padding)
    x = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=cl)
    w = (torch.randn(co, shape[1], k, k, dtype=torch.float64) / (shape[1] * k * k) ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(co, dtype=torch.float64)
    if which == "forward":
        ref = torch.nn.functional.conv2d(x, w, b, **kw)
        low = torch.nn.functional.conv2d(x.half(), w.half(), b.half(), **kw)
        got = torch.full(tuple(ref.shape), float("nan"), dtype=torch.float16).contiguous(memory_format=cl)
        KC.conv2d_forward_(got, x.half(), w.half(), b.half(), (stride,) * 2, (padding,) * 2, (1, 1))
    else:
        dy = torch.randn(torch.nn.functional.conv2d(x, w, **kw).shape, dtype=torch.float64).contiguous(memory_format=cl)
        ref = torch.nn.grad.conv2d_input(shape, w, dy, **kw)
        low = torch.nn.grad.conv2d_input(shape, w.half(), dy.half(), **kw)
        got = torch.full(shape, float("nan"), dtype=torch.float16).contiguous(memory_format=cl)
        KC.conv2d_input_grad_(got, dy.half(), w.half(), (stride,) * 2, (padding,) * 2, (1, 1))
    assert [name for name, _ in taken] == ["_conv_tma_kernel", "_split_k_sum_kernel"], taken
    assert taken[0][1][2] == 3, taken
    assert_within_torch_error(got, low, ref, 2)


def test_wave_splits():
    """Split-K of the TMA conv kernel only under one wave, for the fewest waves per unit of work
    with a split's scratch round trip counted, each split at least 4 loop steps long."""
    from flame.kernels.conv2d import _wave_splits
    assert _wave_splits(80, 180, 132) == 3      # SDXL 32x32, 1280 channels: 240 programs in 2 waves
    assert _wave_splits(132, 180, 132) == 1     # a full wave already
    assert _wave_splits(500, 180, 132) == 1
    assert _wave_splits(10, 1000, 132) == 8     # at most 8 splits
    assert _wave_splits(10, 12, 132) == 3       # 12 steps: at most 3 splits of 4
    assert _wave_splits(80, 8, 132) == 1        # 2 splits of 4 steps: 2 waves for half the work each
    assert _wave_splits(5, 1000, 1) == 1        # the interpreter: 1 SM


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernels")
@pytest.mark.parametrize("shape,co,k,kw", [TMA_SHAPES[1], TMA_SHAPES[4], TMA_SHAPES[-2]], ids=str)
def test_conv2d_tma_weight_gradient_split_k_in_the_interpreter(shape, co, k, kw, monkeypatch, tma_in_interpreter):
    """The TMA weight gradient with its spatial tiles split 3 ways: partial sums into a scratch in
    the channels-last weight's memory order, then summed (dilation, stride 2, whole-row tiles)."""
    import flame.kernels.conv2d as KC
    monkeypatch.setattr(KC, "_wgrad_splits", lambda programs, units: min(3, units))
    _check_tma_convolution(torch.float16, shape, co, k, kw, monkeypatch)


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernels")
def test_conv2d_tma_stride2_input_gradient_is_tuned_per_phase(monkeypatch, tma_in_interpreter):
    """A stride-2 input gradient looks its config up as one phase's problem (a quarter of the pixels,
    ceil(3 / 2)^2 = 4 taps), not as the stride-1 problem with the same (M, N, C, taps)."""
    import flame.kernels.conv2d as KC
    keys = []
    real = KC._conv_tma_config
    monkeypatch.setattr(KC, "_conv_tma_config", lambda *a: keys.append((a[-1], a[:2] + a[2:3] + a[4:5])) or real(*a))
    _check_tma_convolution(torch.float16, (2, 32, 16, 16), 48, 3, dict(stride=2, padding=1), monkeypatch)
    assert ("conv2d", (2 * 8 * 8, 48, 32, 9)) in keys
    assert ("conv2d_dgrad", (2 * 16 * 16 // 4, 32, 48, 4)) in keys


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                                 dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=3),
                                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)])
def test_tma_weight_grad_configs_that_once_failed_at_32x32(cfg):
    """Weight-gradient TMA configs that gave wrong results on the H200 at 32x32 pixels while
    their spatial tiles spanned two or four rows as 4-D boxes; such tiles read dY as 2-D boxes now."""
    import flame.kernels.conv2d as KC
    from flame import tune
    x = torch.randn(1, 640, 32, 32, device=flame.device).to(torch.bfloat16, memory_format=torch.channels_last)
    g = torch.randn(1, 1280, 32, 32, device=flame.device).to(torch.bfloat16, memory_format=torch.channels_last)
    want = torch.nn.grad.conv2d_weight(x.float(), (1280, 640, 3, 3), g.float(), padding=1)
    dw = torch.full((1280, 640, 3, 3), float("nan"), device=flame.device, dtype=torch.bfloat16)
    with tune.override("conv2d_wgrad_tma", cfg):
        KC.conv2d_weight_grad_(dw, g, x, (1, 1), (1, 1), (1, 1))
    err = (dw.float() - want).abs().max() / want.abs().max()
    assert err < 1e-2, (cfg, float(err))


def test_tma_weight_grad_spatial_tiles():
    """The weight gradient's TMA tiles: whole rows or exact row segments when dY is a pixel matrix
    (never crossing into the next row or image), else one row cut to BLOCK_K."""
    import flame.kernels.conv2d as KC
    assert KC._wgrad_spatial_tile(64, 32, 32, True) == (2, 32, True)
    assert KC._wgrad_spatial_tile(128, 32, 32, True) == (4, 32, True)
    assert KC._wgrad_spatial_tile(64, 8, 8, True) == (8, 8, True)
    assert KC._wgrad_spatial_tile(64, 5, 16, True) == (1, 16, True)  # 4 rows would cross images
    assert KC._wgrad_spatial_tile(64, 128, 128, True) == (1, 64, True)
    assert KC._wgrad_spatial_tile(64, 144, 144, True) == (1, 64, False)  # 64 does not divide 144
    assert KC._wgrad_spatial_tile(64, 56, 72, True) == (1, 64, False)
    assert KC._wgrad_spatial_tile(64, 32, 32, False) == (1, 32, False)
    assert KC._wgrad_spatial_tile(64, 9, 7, True) == (1, 16, False)


def test_tma_launch_configs_name_registered_tuning_kernels():
    """The TMA launchers' tuning-table names exist (tune.config raises on unknown kernels), so
    the GPU path cannot fail on a missing registration that the interpreter never reaches."""
    import flame.kernels.conv2d as KC
    import flame.kernels.matmul as KM
    for kernel in ("conv2d", "conv2d_dgrad"):
        cfg = KC._conv_tma_config(4096, 320, 320, torch.bfloat16, 9, kernel)
        assert cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] > 0
    assert KM._tma_config(4096, 640, 640, torch.bfloat16)["BLOCK_M"] in (64, 128, 256)
    assert KC._spatial_tile(128, 144, 144) == (8, 16)  # 144 = 9 x 16: no wasted columns
    assert KC._spatial_tile(128, 128, 128) == (1, 128)


# ---- routes: plan() names the path a convolution takes ------------------------------------------

F64, F16 = torch.float64, torch.float16
ROUTE_CASES = [  # (route, direction, x shape, w shape, dtype, kwargs, TMA device)
    ("gemm", "forward", (2, 8, 5, 6), (4, 8, 1, 1), F64, dict(), False),
    ("gemm", "input_grad", (2, 8, 5, 6), (4, 8, 1, 1), F64, dict(), False),
    ("gemm", "weight_grad", (2, 8, 5, 6), (4, 8, 1, 1), F64, dict(), False),
    ("none", "forward", (0, 8, 5, 6), (4, 8, 3, 3), F64, dict(padding=(1, 1)), False),
    ("zero_fill", "weight_grad", (0, 8, 5, 6), (4, 8, 3, 3), F64, dict(padding=(1, 1)), False),
    ("fold", "forward", (2, 4, 9, 11), (16, 4, 3, 3), F64, dict(padding=(1, 1)), False),  # conv_in
    ("fold", "input_grad", (2, 24, 9, 8), (4, 24, 3, 3), F64, dict(padding=(1, 1)), False),  # conv_out's dX
    ("implicit_gemm", "forward", (2, 24, 7, 9), (8, 24, 3, 3), F64, dict(padding=(1, 1)), False),
    ("implicit_gemm", "forward", (2, 8, 7, 9), (6, 4, 3, 3), F64, dict(padding=(1, 1), groups=2), False),
    ("implicit_gemm", "input_grad", (2, 8, 7, 9), (16, 8, 3, 3), F64, dict(stride=(2, 2), padding=(1, 1)), False),
    ("tma", "forward", (1, 16, 9, 7), (24, 16, 3, 3), F16, dict(padding=(1, 1)), True),
    ("tma", "input_grad", (2, 32, 16, 16), (48, 32, 3, 3), F16, dict(stride=(2, 2), padding=(1, 1)), True),
    ("implicit_gemm", "forward", (1, 16, 9, 7), (24, 16, 3, 3), F16, dict(padding=(1, 1)), False),  # no TMA
    ("wgrad_tma", "weight_grad", (1, 16, 9, 7), (24, 16, 3, 3), F16, dict(padding=(1, 1)), True),
    ("wgrad_swap", "weight_grad", (2, 24, 9, 11), (4, 24, 3, 3), F64, dict(padding=(1, 1)), False),  # conv_out
    ("wgrad_fold", "weight_grad", (2, 4, 9, 11), (16, 4, 3, 3), F64, dict(padding=(1, 1)), False),  # conv_in
    ("wgrad", "weight_grad", (1, 3, 9, 7), (8, 3, 5, 5), F64, dict(padding=(2, 2)), False),  # 75 (tap, ci) columns
    ("wgrad", "weight_grad", (2, 16, 7, 9), (6, 8, 3, 3), F64, dict(padding=(1, 1), groups=2), False),
]


def _route_problem(direction, x_shape, w_shape, dtype, kw, tma):
    import flame.kernels.conv2d as KC
    return KC.ConvProblem.dense(direction, x_shape, w_shape, dtype, tma=tma, **kw)


@pytest.mark.parametrize("route,direction,x_shape,w_shape,dtype,kw,tma", ROUTE_CASES, ids=str)
def test_plan_names_each_route(route, direction, x_shape, w_shape, dtype, kw, tma):
    """Which path a problem takes, from its description alone (no buffers, no launch)."""
    import flame.kernels.conv2d as KC
    got = KC.plan(_route_problem(direction, x_shape, w_shape, dtype, kw, tma))
    assert got.kernel == route, got
    if route in ("none", "zero_fill"):
        assert got.reason and got.splits == 0
    else:  # tiny problems: one split on the interpreter's single SM, split-K to fill a GPU's
        assert got.reason and (got.splits == 1 if flame.is_interpreter() else got.splits >= 1), got


# one launch per route (the first case of each), against PyTorch
ROUTE_LAUNCHES = [c for i, c in enumerate(ROUTE_CASES) if c[0] not in [d[0] for d in ROUTE_CASES[:i]]]


@pytest.mark.parametrize("route,direction,x_shape,w_shape,dtype,kw,tma", ROUTE_LAUNCHES, ids=str)
def test_each_route_runs_and_matches_torch(route, direction, x_shape, w_shape, dtype, kw, tma, monkeypatch, request):
    """The launchers take the route plan() names for their buffers, and its result matches PyTorch."""
    import flame.kernels.conv2d as KC
    if tma and flame.is_interpreter():
        request.getfixturevalue("tma_in_interpreter")
    taken = []
    monkeypatch.setattr(KC, "plan", lambda p, real=KC.plan: taken.append(real(p)) or taken[-1])
    cl = torch.channels_last
    p = _route_problem(direction, x_shape, w_shape, dtype, kw, tma)
    dev = flame.device
    x, w = (torch.randn(s, dtype=F64, device=dev).contiguous(memory_format=cl) for s in (x_shape, w_shape))
    y = torch.randn(p.y.shape, dtype=F64, device=dev).contiguous(memory_format=cl)
    args = (p.stride, p.padding, p.dilation, p.groups)
    torch_kw = dict(stride=p.stride, padding=p.padding, dilation=p.dilation, groups=p.groups)
    low = [t.to(dtype) for t in (x, w, y)]
    x, w, y = (t.double() for t in low)  # the reference sees the rounded inputs
    if direction == "forward":
        want = torch.nn.functional.conv2d(x, w, **torch_kw)
        got = torch.full(want.shape, float("nan"), dtype=dtype, device=dev).contiguous(memory_format=cl)
        KC.conv2d_forward_(got, low[0], low[1], None, *args)
    elif direction == "input_grad":
        want = torch.nn.grad.conv2d_input(x_shape, w, y, **torch_kw)
        got = torch.full(x_shape, float("nan"), dtype=dtype, device=dev).contiguous(memory_format=cl)
        KC.conv2d_input_grad_(got, low[2], low[1], *args)
    else:
        want = torch.nn.grad.conv2d_weight(x, w_shape, y, **torch_kw)
        got = torch.full(w_shape, float("nan"), dtype=dtype, device=dev).contiguous(memory_format=cl)
        KC.conv2d_weight_grad_(got, low[2], low[0], *args)
    assert [r.kernel for r in taken] == [route], taken
    assert_close(got.double(), want, dtype, **_tol(want, dtype))


@pytest.mark.parametrize("direction,x_shape,w_shape,kw,route,box_h", [
    ("forward", (2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1)), "gluon", 1),
    ("input_grad", (2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1)), "gluon", 1),
    ("forward", (4, 640, 32, 32), (640, 640, 3, 3), dict(padding=(1, 1)), "gluon", 2),  # 64 pixels: 2 rows
    ("forward", (2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1), stride=(2, 2)), "tma", None),  # stride 2
    ("input_grad", (2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1), stride=(2, 2)), "tma", None),
    ("forward", (2, 320, 64, 64), (320, 320, 3, 3), dict(), "tma", None),  # 62 x 62 outputs: no pixel boxes
    ("forward", (1, 320, 32, 32), (320, 320, 3, 3), dict(padding=(1, 1)), "tma", None),  # under a wave of tiles
    ("forward", (1, 1280, 32, 32), (1280, 1280, 3, 3), dict(padding=(1, 1)), "gluon", 2),  # K split in 2
], ids=str)
def test_plan_takes_the_warp_specialised_gemm_on_hopper(direction, x_shape, w_shape, kw, route, box_h, monkeypatch):
    """On an H200 with Gluon (132 SMs, 227 KiB of shared memory), stride-1 convolutions whose tiles of
    output pixels are TMA boxes take matmul_hopper's kernel where they make a wave of tiles, or of
    tiles times splits of a long K; the rest stay on the TMA kernel."""
    import flame.kernels.conv2d as KC
    monkeypatch.setattr(KC.KM.autotune, "shared_memory", lambda: 232_448)
    monkeypatch.setattr(KC.runtime, "num_sms", lambda: 132)
    got = KC.plan(KC.ConvProblem.dense(direction, x_shape, w_shape, torch.bfloat16, tma=True, gluon=True, **kw))
    assert got.kernel == route and got.config.get("BOX_H") == box_h, got
    assert route != "gluon" or got.splits == got.config["SPLIT_K"] == (2 if x_shape[1] == 1280 else 1), got
    assert KC.plan(KC.ConvProblem.dense(direction, x_shape, w_shape, torch.bfloat16, tma=True, **kw)).kernel == "tma"


@pytest.mark.parametrize("x_shape,w_shape,kw,route,splits", [
    ((2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1)), "gluon_wgrad", 2),
    ((1, 1280, 32, 32), (1280, 1280, 3, 3), dict(padding=(1, 1)), "gluon_wgrad", 1),
    ((2, 200, 64, 64), (320, 200, 3, 3), dict(padding=(1, 1)), "wgrad_tma", None),  # no tile's columns divide 200
    ((2, 320, 64, 64), (64, 320, 3, 3), dict(padding=(1, 1)), "wgrad_tma", None),  # under a tile's 128 rows
    ((2, 320, 64, 64), (320, 320, 3, 3), dict(padding=(1, 1), stride=(2, 2)), "wgrad_tma", None),
    ((2, 320, 62, 62), (320, 320, 3, 3), dict(padding=(1, 1)), "wgrad_tma", None),  # no pixel boxes
], ids=str)
def test_plan_takes_the_warp_specialised_gemm_for_weight_gradients(x_shape, w_shape, kw, route, splits,
                                                                    monkeypatch):
    """On an H200 with Gluon, stride-1 weight gradients of at least 128 output channels whose blocks
    of 64 output pixels are TMA boxes and whose Ci a tile's columns divide take matmul_hopper's
    kernel, K (the pixels) split where the tiles fill less than a wave."""
    import flame.kernels.conv2d as KC
    monkeypatch.setattr(KC.KM.autotune, "shared_memory", lambda: 232_448)
    monkeypatch.setattr(KC.runtime, "num_sms", lambda: 132)
    got = KC.plan(KC.ConvProblem.dense("weight_grad", x_shape, w_shape, torch.bfloat16, tma=True, gluon=True, **kw))
    assert got.kernel == route and (splits is None or got.splits == splits), got
    if route == "gluon_wgrad":
        assert x_shape[1] % got.config["BLOCK_N"] == 0 and got.splits == got.config["SPLIT_K"], got


def test_box_rows():
    """A block of output pixels is one TMA box when it is a segment of a row that tiles the row, or
    whole rows that tile the image; never when it would straddle rows or images."""
    from flame.kernels.matmul_hopper import box_rows
    assert box_rows(128, 128, 128) == 1 and box_rows(64, 64, 256) == 1
    assert box_rows(128, 64, 64) == 2 and box_rows(64, 32, 32) == 2 and box_rows(128, 32, 32) == 4
    assert box_rows(128, 62, 62) is None  # straddles rows
    assert box_rows(128, 8, 8) is None  # 2 images
    assert box_rows(128, 5, 32) is None  # 4 rows do not tile 5


def test_debug_routes_prints_each_problem_once(monkeypatch, capsys):
    """FLAME_DEBUG_ROUTES=1 (read at import; here switched on directly): one line per distinct
    problem on stderr, naming the route and why."""
    import flame.kernels.conv2d as KC
    monkeypatch.setattr(KC, "DEBUG_ROUTES", True)
    monkeypatch.setattr(KC, "_reported", set())
    fold = _route_problem(*ROUTE_CASES[5][1:])
    for p in (fold, fold, _route_problem(*ROUTE_CASES[-2][1:]), fold):
        KC.plan(p)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "fold" in lines[0] and "one K block" in lines[0] and "wgrad" in lines[1], lines


def test_a_frozen_conv_keeps_no_input_for_the_backward():
    """The input is saved for the weight's gradient only: a frozen conv holds no activation, and the
    input's gradient is still right (its layout too)."""
    x, xt = pair((2, 3, 6, 5), requires_grad=True)
    w, wt = pair((4, 3, 3, 3))
    y = F.conv2d(x, w, padding=1)
    assert y._node.saved[0] is None
    g = torch.randn(2, 4, 6, 5, device=flame.device)
    grads = y.backward(flame.from_torch(g))
    torch.nn.functional.conv2d(xt, wt, padding=1).backward(g)
    assert_close(grads[x], xt.grad, **_tol(xt.grad, torch.float32))
    w.requires_grad = True
    assert F.conv2d(x, w, padding=1)._node.saved[0] is not None
