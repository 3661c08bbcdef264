import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import flame
import flame.nn.functional as F
from flame import tune
from flame.kernels import softmax as KS
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, check_op


def _f(t, requires_grad=False):
    return flame.from_torch(t.detach().to(DEVICE, copy=True), requires_grad=requires_grad)


def _check(f_fn, t_fn, inputs, grad_mask, g, atol=1e-5, rtol=1e-4):
    """flame vs torch, values and the gradients ``grad_mask`` asks for (``check_op``): ``atol`` and
    ``rtol`` in fp32/fp64, the design's low-precision rule in fp16/bf16."""
    return check_op(f_fn, t_fn, inputs, g, grad_mask=grad_mask, tol=dict(atol=atol, rtol=rtol), lowp=(2, 3)).out


@contextlib.contextmanager
def _tiles(rows, block):
    """Every softmax / cross-entropy launch inside the block takes ``rows`` rows per program and
    blocks of ``block`` elements (longer rows are streamed: the online log-sum-exp)."""
    with contextlib.ExitStack() as stack:
        for kernel in ("softmax_fwd", "softmax_bwd", "cross_entropy_fwd", "cross_entropy_bwd"):
            stack.enter_context(tune.override(kernel, dict(zip(tune.KERNELS[kernel][1], (rows, block, 1)))))
        yield


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64, device=DEVICE) * scale).to(dtype)


# ---- softmax / log_softmax ----------------------------------------------------------------------

SM_CASES = [((5, 3, 20), -1), ((5, 3, 20), 1), ((5, 3, 20), 0), ((7, 33), -1), ((6,), 0), ((), 0)]


@pytest.mark.parametrize("shape,dim", SM_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("log", [False, True])
def test_softmax(shape, dim, dtype, log):
    x = _randn(*shape, dtype=dtype, scale=3.0)
    g = _randn(*shape, dtype=dtype)
    f_fn = (lambda x: F.log_softmax(x, dim)) if log else (lambda x: F.softmax(x, dim))
    t_fn = (lambda x: TF.log_softmax(x, dim)) if log else (lambda x: TF.softmax(x, dim))
    _check(f_fn, t_fn, [x], [True], g)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_streamed_large_logits_noncontig(log, dim):
    # rows longer than the block (online log-sum-exp), logits ~1e4, a transposed input
    x = _randn(4, 37, 3, scale=1e4).transpose(1, 2)
    g = _randn(4, 3, 37)
    f_fn = (lambda x: F.log_softmax(x, dim)) if log else (lambda x: F.softmax(x, dim))
    t_fn = (lambda x: TF.log_softmax(x, dim)) if log else (lambda x: TF.softmax(x, dim))
    with _tiles(2, 8):
        _check(f_fn, t_fn, [x], [True], g, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("streamed", [False, True])
def test_softmax_large_and_infinite_logits(streamed):
    x = torch.tensor([[1e30, 0.0, -1e30, 5.0], [-math.inf, 2.0, -math.inf, 1.0], [88.0, 89.0, 90.0, 91.0]],
                     device=DEVICE)
    full = torch.full((1, 3), -math.inf, device=DEVICE)
    with _tiles(1, 2) if streamed else contextlib.nullcontext():
        assert_close(F.softmax(_f(x), -1), torch.softmax(x, -1))
        assert_close(F.log_softmax(_f(x), -1), torch.log_softmax(x, -1))
        assert np.isnan(F.softmax(_f(full), -1).numpy()).all()


def test_softmax_dtype_and_errors():
    x = _randn(3, 4)
    y = F.softmax(_f(x), 1, dtype=flame.float64)
    assert y.dtype == torch.float64
    assert_close(y, torch.softmax(x, 1, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError):
        F.softmax(_f(x), 2)
    with pytest.raises(TypeError, match="dim"):
        F.softmax(_f(x))
    with pytest.raises(TypeError, match="floating"):
        F.log_softmax(flame.from_torch(torch.ones(3, dtype=torch.int64, device=DEVICE)), 0)
    assert F.softmax(_f(torch.randn(0, 5, device=DEVICE)), 1).shape == (0, 5)
    assert F.log_softmax(_f(torch.randn(3, 0, device=DEVICE)), 1).shape == (3, 0)


def test_softmax_gradcheck():
    rng = np.random.default_rng(2)
    x = flame.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    assert gradcheck(lambda x: F.softmax(x, 1), [x])
    assert gradcheck(lambda x: F.log_softmax(x, 0), [x])


# ---- cross_entropy ------------------------------------------------------------------------------

def _check_ce(x, t, red, ls, dtype, ii=-100, atol=1e-5):
    # inputs: logits (grad) and target (no grad)
    f_ce = lambda x, t: F.cross_entropy(x, t, ignore_index=ii, reduction=red, label_smoothing=ls)
    t_ce = lambda x, t: TF.cross_entropy(x, t, ignore_index=ii, reduction=red, label_smoothing=ls)
    g = _randn(*(t.shape if red == "none" else ()), dtype=dtype)
    return _check(f_ce, t_ce, [x, t], [True, False], g, atol=atol)


@pytest.mark.parametrize("red", ["none", "mean", "sum"])
@pytest.mark.parametrize("ls", [0.0, 0.2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_cross_entropy(red, ls, dtype):
    x = _randn(9, 13, dtype=dtype, scale=3.0)
    t = torch.randint(0, 13, (9,), device=DEVICE)
    t[[2, 5]] = -100
    _check_ce(x, t, red, ls, dtype)


@pytest.mark.parametrize("red", ["none", "mean"])
def test_cross_entropy_spatial_and_1d(red):
    x = _randn(2, 5, 3, 4, scale=2.0)
    t = torch.randint(0, 5, (2, 3, 4), device=DEVICE)
    t[0, 1, 2] = 3
    _check_ce(x, t, red, 0.1, torch.float32, ii=3)
    x1 = _randn(7)
    t1 = torch.tensor(4, device=DEVICE)
    _check_ce(x1, t1, red, 0.0, torch.float32)


@pytest.mark.parametrize("red", ["none", "mean", "sum"])
def test_cross_entropy_streamed_large_logits(red):
    # classes streamed in blocks of 8 (online log-sum-exp), logits ~1e4, int32 targets
    x = _randn(5, 37, scale=1e4)
    t = torch.randint(0, 37, (5,), device=DEVICE, dtype=torch.int32)
    with _tiles(2, 8):
        _check_ce(x, t.long(), red, 0.3, torch.float32, atol=1e-2)
        y = F.cross_entropy(_f(x), _f(t), reduction=red, label_smoothing=0.3)
    assert_close(y, TF.cross_entropy(x, t.long(), reduction=red, label_smoothing=0.3), atol=1e-2, rtol=1e-5)


def test_cross_entropy_all_ignored_and_empty():
    x = _randn(3, 4)
    t = torch.full((3,), -100, device=DEVICE)
    assert np.isnan(F.cross_entropy(_f(x), _f(t)).item())
    assert F.cross_entropy(_f(x), _f(t), reduction="sum").item() == 0.0
    xe = _f(torch.randn(0, 4, device=DEVICE), True)
    te = _f(torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert np.isnan(F.cross_entropy(xe, te).item())
    assert F.cross_entropy(xe, te, reduction="sum").item() == 0.0
    out = F.cross_entropy(xe, te, reduction="none")
    assert out.shape == (0,)
    grads = F.cross_entropy(xe, te, reduction="sum").backward()
    assert grads[xe].shape == (0, 4)


@pytest.mark.parametrize("red", ["none", "mean", "sum"])
@pytest.mark.parametrize("bad", [4, 7, -1, -101])
def test_cross_entropy_out_of_range_target_raises_at_the_next_host_read(red, bad, monkeypatch):
    # as PyTorch, a target outside [0, C) that is not ignore_index raises; the kernel flags it and
    # the error surfaces at the next host read, never inside the call (no sync per call)
    checks = []
    real_check = flame.runtime.check_errors
    monkeypatch.setattr(flame.runtime, "check_errors", lambda: checks.append(1) or real_check())
    x = _f(_randn(3, 4), True)
    t = _f(torch.tensor([1, bad, -100], device=DEVICE))
    loss = F.cross_entropy(x, t, reduction=red)
    loss.sum().backward()
    assert checks == []
    with pytest.raises(IndexError, match=r"cross_entropy: a target is outside \[0, C\)"):
        loss.sum().item()
    assert checks == [1]
    # the flag is cleared: the next read returns the value (NaN for the bad row)
    out = F.cross_entropy(x, t, reduction="none")
    assert np.isnan(out.to_torch()[1].item()) and np.isfinite(out.to_torch()[0].item())
    with pytest.raises(IndexError, match="outside"):
        out.numpy()
    assert np.isfinite(F.cross_entropy(x, _f(torch.tensor([1, 3, -100], device=DEVICE))).item())


def test_cross_entropy_bad_target_flag_is_one_fixed_buffer():
    # flame.check_errors() raises too; the flag buffer keeps its address (a captured CUDA graph
    # replays its stores into it); a good call leaves the flags clear; repr never raises
    x = _f(_randn(2, 5))
    good, bad = _f(torch.tensor([4, 0], device=DEVICE)), _f(torch.tensor([0, 5], device=DEVICE))
    F.cross_entropy(x, good)
    flame.check_errors()
    flag = flame.runtime.error_flag(KS._BAD_TARGET)
    ptr = flag.data_ptr()
    loss = F.cross_entropy(x, bad, reduction="none")
    assert "nan" in repr(loss)
    with pytest.raises(IndexError, match="ignore_index"):
        flame.check_errors()
    flame.check_errors()
    assert flame.runtime.error_flag(KS._BAD_TARGET).data_ptr() == ptr and flag.item() == 0
    want = TF.cross_entropy(x.to_torch(), bad.to_torch(), ignore_index=5).item()
    assert F.cross_entropy(x, bad, ignore_index=5).item() == pytest.approx(want, rel=1e-5)


def test_cross_entropy_gradcheck():
    rng = np.random.default_rng(3)
    x = flame.tensor(rng.standard_normal((4, 5)), requires_grad=True)
    t = flame.tensor(np.array([0, 4, -100, 2]), dtype=flame.int64)
    assert gradcheck(lambda x: F.cross_entropy(x, t, label_smoothing=0.1), [x])
    assert gradcheck(lambda x: F.cross_entropy(x, t, reduction="none"), [x])


def test_cross_entropy_bad_inputs():
    x = _f(_randn(3, 4))
    t = _f(torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="target of shape"):
        F.cross_entropy(x, _f(torch.tensor([0, 1], device=DEVICE)))
    with pytest.raises(TypeError, match="class-index"):
        F.cross_entropy(x, _f(_randn(3, 4)))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        F.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(NotImplementedError):
        F.cross_entropy(x, t, weight=_f(_randn(4)))
    with pytest.raises(TypeError, match="floating"):
        F.cross_entropy(t, t)


# ---- GPU: bf16 and bench shapes -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True])
def test_softmax_bf16_vocab(log):
    x = _randn(512, 32000, dtype=torch.bfloat16, scale=4.0)
    g = _randn(512, 32000, dtype=torch.bfloat16)
    f_fn = (lambda x: F.log_softmax(x, -1)) if log else (lambda x: F.softmax(x, -1))
    t_fn = (lambda x: TF.log_softmax(x, -1)) if log else (lambda x: TF.softmax(x, -1))
    _check(f_fn, t_fn, [x], [True], g)


@pytest.mark.gpu
@pytest.mark.parametrize("red", ["mean", "none"])
def test_cross_entropy_bf16_vocab(red):
    x = _randn(8192, 32000, dtype=torch.bfloat16, scale=4.0)
    t = torch.randint(0, 32000, (8192,), device=DEVICE)
    _check_ce(x, t, red, 0.1, torch.bfloat16)
