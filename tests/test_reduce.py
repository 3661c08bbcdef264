import math

import numpy as np
import pytest
import torch

import flame
from flame.testing import gradcheck
from helpers import FLOAT_DTYPES_CPU, assert_close, check_op, pair

CASES = [
    ((6, 7), None, False),
    ((6, 7), 1, False),
    ((6, 7), 0, True),
    ((6, 7), -1, True),
    ((3, 4, 5), (0, 2), False),   # non-adjacent dims: goes through the permute-and-copy path
    ((3, 4, 5), (1, 2), True),
    ((2, 3, 4, 5), (0, 1), False),
    ((5, 1, 3), 1, False),
    ((129,), 0, False),
    ((), None, False),
]


@pytest.mark.parametrize("shape,dim,keepdim", CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "var"])
@pytest.mark.parametrize("noncontig", [False, True])
def test_reductions(shape, dim, keepdim, dtype, op, noncontig):
    f_op = {"amax": flame.max, "amin": flame.min}.get(op, getattr(flame, op))
    t_op = getattr(torch, op)
    kw = {"dim": dim if dim is not None else tuple(range(len(shape))), "keepdim": keepdim}
    if op == "var" and math.prod(shape) < 2:
        pytest.skip("variance of one element")
    check_op(lambda x: f_op(x, dim=dim, keepdim=keepdim), lambda t: t_op(t, **kw) if shape else t_op(t),
             [pair(shape, dtype, requires_grad=True, noncontig=noncontig)],
             tol=dict(rtol=2e-3) if dtype == torch.float16 and op in ("sum", "var", "mean") else None, grad_tol={})


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "var"])
def test_reductions_bf16(op):
    test_reductions((33, 65), 1, False, torch.bfloat16, op, False)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "var"])
def test_gradcheck(op):
    x = flame.tensor(np.random.default_rng(5).standard_normal((2, 3)), requires_grad=True)
    assert gradcheck(lambda x: getattr(flame, op)(x, dim=1), [x])
    assert gradcheck(lambda x: getattr(flame, op)(x, dim=0, keepdim=True), [x])
    assert gradcheck(lambda x: getattr(flame, op)(x), [x])


def test_ties_share_gradient_like_amax():
    check_op(lambda x: flame.max(x, dim=1), lambda t: torch.amax(t, dim=1),
             [torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])])


def test_integer_sum_and_extrema():
    x, xt = pair((5, 6), torch.int32)
    assert_close(x.sum(), xt.sum())
    assert_close(x.sum(dim=0), xt.sum(dim=0))
    assert_close(x.max(dim=1), xt.amax(dim=1))
    b, bt = pair((5, 6), torch.bool)
    assert_close(b.sum(dim=1), bt.sum(dim=1))
    with pytest.raises(TypeError):
        x.mean()


def test_nan_and_inf():
    x = flame.tensor([[1.0, float("nan"), 2.0], [float("-inf"), 0.0, 1.0]])
    out = flame.max(x, dim=1).numpy()
    assert np.isnan(out[0]) and out[1] == 1.0
    assert flame.min(x, dim=1).numpy()[1] == -np.inf


def test_empty_reductions():
    x = flame.empty(0, 4)
    assert_close(x.sum(dim=0), torch.zeros(4))
    assert np.isnan(x.mean(dim=0).numpy()).all()
    assert x.sum(dim=1).shape == (0,)
    with pytest.raises(RuntimeError, match="zero-size"):
        x.max(dim=0)


def test_large_reduction_matches_float64():
    x, xt = pair((3, 70001), torch.float32)
    assert_close(x.sum(dim=1), xt.double().sum(dim=1).float(), rtol=1e-5, atol=1e-3)
    assert_close(x.sum(), xt.double().sum().float(), rtol=1e-5, atol=1e-2)
    assert_close(x.var(dim=1), xt.double().var(dim=1).float(), rtol=1e-4, atol=1e-5)


def test_sum_to_shape():
    g, gt = pair((4, 3, 5), torch.float32)
    assert_close(flame.sum_to_shape(g, (3, 1)), gt.sum(dim=(0, 2)).reshape(3, 1))
    assert_close(flame.sum_to_shape(g, (5,)), gt.sum(dim=(0, 1)))
    assert_close(flame.sum_to_shape(g, ()), gt.sum())


def test_bad_dims():
    x = flame.ones(2, 3)
    with pytest.raises(IndexError, match="out of range"):
        x.sum(dim=2)
    with pytest.raises(RuntimeError, match="multiple"):
        x.sum(dim=(1, -1))
    with pytest.raises(TypeError):
        x.sum(dim=1.0)
