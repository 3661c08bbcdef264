import math

import numpy as np
import pytest
import torch

import flame
from flame.testing import gradcheck
from helpers import FLOAT_DTYPES_CPU, assert_close, check_op, pair

UNARY = {
    "neg": (flame.neg, torch.neg, None),
    "abs": (flame.abs, torch.abs, None),
    "exp": (flame.exp, torch.exp, None),
    "log": (flame.log, torch.log, (0.1, 3.0)),
    "sqrt": (flame.sqrt, torch.sqrt, (0.1, 3.0)),
    "rsqrt": (flame.rsqrt, torch.rsqrt, (0.1, 3.0)),
    "sin": (flame.sin, torch.sin, None),
    "cos": (flame.cos, torch.cos, None),
    "tanh": (flame.tanh, torch.tanh, None),
    "sigmoid": (flame.sigmoid, torch.sigmoid, None),
    "relu": (flame.relu, torch.relu, None),
    "silu": (flame.silu, torch.nn.functional.silu, None),
    "gelu": (flame.gelu, torch.nn.functional.gelu, None),
    "gelu_tanh": (lambda x: flame.gelu(x, approximate="tanh"),
                  lambda x: torch.nn.functional.gelu(x, approximate="tanh"), None),
    "clamp": (lambda x: flame.clamp(x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7), None),
    "clamp_min": (lambda x: x.clamp(min=0.1), lambda x: x.clamp(min=0.1), None),
    "pow_scalar": (lambda x: x ** 3, lambda x: x ** 3, None),
    "pow_frac": (lambda x: x ** 1.5, lambda x: x ** 1.5, (0.1, 3.0)),
    "rpow": (lambda x: 2.0 ** x, lambda x: 2.0 ** x, None),
    "to_fp64_and_back": (lambda x: x.to(flame.float64).to(x.dtype), lambda x: x.double().to(x.dtype), None),
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("noncontig", [False, True])
def test_unary_forward_backward(name, dtype, noncontig):
    f_op, t_op, rng = UNARY[name]
    low, high = rng if rng else (None, None)
    check_op(f_op, t_op, [pair((7, 33), dtype, requires_grad=True, noncontig=noncontig, low=low, high=high)])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_bf16(name):
    test_unary_forward_backward(name, torch.bfloat16, False)


@pytest.mark.parametrize("name", [n for n in UNARY if n not in ("to_fp64_and_back",)])
def test_unary_gradcheck(name):
    f_op, _, rng = UNARY[name]
    low, high = rng if rng else (-2.0, 2.0)
    x = flame.tensor(np.random.default_rng(1).uniform(low, high, (3, 4)), requires_grad=True)
    if name in ("relu", "abs", "clamp", "clamp_min"):  # keep away from the kinks
        x = flame.tensor(np.where(np.abs(x.numpy()) < 0.05, 0.3, x.numpy()), requires_grad=True)
        if name.startswith("clamp"):
            v = x.numpy()
            v = np.where(np.abs(v + 0.5) < 0.05, 0.0, v)
            v = np.where(np.abs(v - 0.7) < 0.05, 0.0, v)
            v = np.where(np.abs(v - 0.1) < 0.05, 0.0, v)
            x = flame.tensor(v, requires_grad=True)
    assert gradcheck(f_op, [x])


BINARY = {
    "add": (flame.add, torch.add),
    "sub": (flame.sub, torch.sub),
    "mul": (flame.mul, torch.mul),
    "div": (flame.div, torch.div),
    "pow": (lambda a, b: flame.abs(a) ** b, lambda a, b: torch.abs(a) ** b),
    "maximum": (flame.maximum, torch.maximum),
    "minimum": (flame.minimum, torch.minimum),
}

SHAPES = [((5, 6), (5, 6)), ((5, 6), (6,)), ((4, 1, 3), (5, 1)), ((1,), (3, 4)), ((), (2, 3)), ((2, 0, 3), (3,))]


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_binary_broadcast(name, shapes, dtype):
    f_op, t_op = BINARY[name]
    inputs = [pair(shapes[0], dtype, requires_grad=True), pair(shapes[1], dtype, requires_grad=True, low=0.5, high=2.0)]
    check_op(f_op, t_op, inputs, grad_tol=[{}, dict(rtol=2e-2) if name == "pow" and dtype == torch.float16 else {}])


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_gradcheck(name):
    f_op = BINARY[name][0]
    rng = np.random.default_rng(2)
    a = flame.tensor(rng.uniform(0.5, 2.0, (3, 4)), requires_grad=True)
    b = flame.tensor(rng.uniform(0.5, 2.0, (4,)), requires_grad=True)
    assert gradcheck(f_op, [a, b])


@pytest.mark.parametrize("op", ["+", "-", "*", "/", "**"])
@pytest.mark.parametrize("scalar", [2, 0.5, -1.5])
def test_scalar_operands_both_sides(op, scalar):
    f = eval(f"lambda x: (x {op} s) + (s {op} x)", {"s": scalar})
    check_op(f, f, [pair((4, 5), torch.float32, requires_grad=True, low=0.5, high=2.0)])


def test_scalar_gradcheck():
    x = flame.tensor(np.random.default_rng(3).uniform(0.5, 2.0, (3, 3)), requires_grad=True)
    assert gradcheck(lambda x: (3.0 - x) * 2.5 / (x + 1) + 2.0 / x - x ** 2 + 1.5 ** x, [x])


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(op):
    a, at = pair((6, 7), torch.float32)
    b, bt = pair((7,), torch.float32)
    assert_close(getattr(flame, op)(a, b), getattr(torch, op)(at, bt))
    assert_close(getattr(a, op)(0.25), getattr(at, op)(0.25))
    # reflected: 0.25 < a is a > 0.25
    assert_close(a > 0.25, at > 0.25)
    ai, ait = pair((5,), torch.int64)
    assert_close(getattr(ai, op)(1), getattr(ait, op)(1))


def test_where_forward_backward_and_gradcheck():
    c, ct = pair((4, 5), torch.bool)
    inputs = [(c, ct), pair((4, 5), requires_grad=True), pair((5,), requires_grad=True)]
    run = check_op(flame.where, torch.where, inputs)
    (a, b), (at, bt) = run.inputs[1:], run.ref_inputs[1:]
    assert_close(flame.where(c, a, 0.0), torch.where(ct, at, 0.0))
    assert_close(flame.where(c, 1.0, b), torch.where(ct, 1.0, bt))
    assert_close(flame.where(c, 1.0, 2.0), torch.where(ct, 1.0, 2.0))
    a64 = flame.tensor(np.random.default_rng(0).standard_normal((4, 5)), requires_grad=True)
    assert gradcheck(lambda a: flame.where(c, a, a * 2), [a64])


def test_nan_propagation():
    x = flame.tensor([1.0, float("nan"), -1.0])
    y = flame.tensor([0.0, 0.0, float("nan")])
    assert np.isnan(flame.maximum(x, y).numpy()[1:]).all()
    assert np.isnan(flame.relu(x).numpy()[1])
    assert np.isnan(flame.exp(x).numpy()[1])


def test_extreme_values_are_stable():
    x = flame.tensor([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    xt = torch.tensor([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    assert_close(flame.sigmoid(x), torch.sigmoid(xt))
    assert_close(flame.tanh(x), torch.tanh(xt))
    assert_close(flame.silu(x), torch.nn.functional.silu(xt))
    assert_close(flame.gelu(x), torch.nn.functional.gelu(xt))
    small = flame.tensor([1e-6, -3e-5, 1e-3, 0.09, 0.11])
    assert_close(flame.tanh(small), torch.tanh(torch.tensor([1e-6, -3e-5, 1e-3, 0.09, 0.11])))


def test_negative_base_integer_powers():
    x = flame.tensor([-2.0, -0.5, 0.0, 3.0])
    xt = torch.tensor([-2.0, -0.5, 0.0, 3.0])
    for p in (0, 1, 2, 3, -1):
        assert_close(x ** p, xt ** p)
    assert np.isnan((x ** 0.5).numpy()[:2]).all()


def test_integer_arithmetic_and_promotion():
    a, at = pair((3, 4), torch.int64)
    b, bt = pair((3, 4), torch.int32)
    assert_close(a + b, at + bt)
    assert_close(a * 3, at * 3)
    assert_close(a - b, at - bt)
    assert (a / 2).dtype == torch.float32
    assert_close(a / 2, at / 2)
    assert (a + 1.5).dtype == torch.float32
    h, _ht = pair((3,), torch.float16)
    bf = flame.ones(3, dtype=flame.bfloat16)
    assert (h + bf).dtype == torch.float32
    assert (h * 2.0).dtype == torch.float16
    assert (h + flame.tensor(1.0)).dtype == torch.float16  # zero-dim tensors don't promote within a category
    assert (a + flame.tensor(1.0)).dtype == torch.float32


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.float64])
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.float64])
def test_casts(src, dst):
    x, xt = pair((5, 3), src, noncontig=True)
    if src.is_floating_point:
        x, xt = x * 3, xt * 3
    assert_close(x.to(dst), xt.to(dst))


def test_float64_to_bfloat16_goes_through_float32():
    """fp64 to bf16 as torch converts it (through fp32): the Triton interpreter's own direct conversion
    returned garbage (1.5 -> 9.2e-41); its fp32 -> bf16 step truncates, so one bf16 step apart there."""
    x, xt = pair((5, 3), torch.float64, noncontig=True)
    x, xt = x * 300, xt * 300
    assert_close(x.to(flame.bfloat16), xt.to(torch.bfloat16), rtol=2 ** -7, atol=0)


def test_cast_backward_returns_input_dtype():
    x, _xt = pair((4,), torch.float16, requires_grad=True)
    y = x.to(flame.float32) * 2
    grads = y.sum().backward()
    assert grads[x].dtype == torch.float32  # fp16 leaves accumulate in fp32
    assert_close(grads[x], torch.full((4,), 2.0))


def test_empty_tensors():
    x = flame.empty(0, 3, requires_grad=True)
    y = (x * 2).exp()
    assert y.shape == (0, 3)
    g = y.sum().backward()
    assert g[x].shape == (0, 3)


def test_high_rank_strided_operands():
    # more than four non-mergeable dims goes through the peeled path
    x, xt = pair((2, 3, 2, 3, 2, 3), torch.float32)
    y, yt = pair((3, 3, 3, 2, 2, 2), torch.float32)
    xp, xtp = x.permute(0, 2, 4, 1, 3, 5), xt.permute(0, 2, 4, 1, 3, 5)
    yp, ytp = y.permute(5, 4, 3, 2, 1, 0), yt.permute(5, 4, 3, 2, 1, 0)
    assert_close(xp + yp, xtp + ytp)


def test_bad_inputs_raise_clearly():
    x = flame.ones(3, 4)
    with pytest.raises(ValueError, match="broadcast"):
        x + flame.ones(5)
    with pytest.raises(TypeError, match="operand"):
        x + "a"
    with pytest.raises(TypeError):
        flame.add(1, 2)
    with pytest.raises(TypeError, match="bool"):
        flame.where(x, x, x)
    with pytest.raises(ValueError, match="approximate"):
        flame.gelu(x, approximate="fast")
    with pytest.raises(RuntimeError, match="only floating-point"):
        flame.ones(3, dtype=flame.int64, requires_grad=True)
    with pytest.raises(ValueError):
        flame.clamp(x)


def test_large_contiguous_uses_many_programs():
    n = (1 << 16) + 3
    x = flame.rand(n)
    y = x * 2 + 1
    xt = x.to_torch()
    assert_close(y, xt * 2 + 1)
    assert math.isclose(float(y.numpy()[-1]), float(xt[-1]) * 2 + 1, rel_tol=1e-6)


def _torch_geglu(x):
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * torch.nn.functional.gelu(gate)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("shape,noncontig", [((3, 5, 18), False), ((7, 34), True), ((0, 6), False)])
def test_geglu_forward_backward(dtype, shape, noncontig):
    check_op(flame.nn.functional.geglu, _torch_geglu, [pair(shape, dtype, requires_grad=True, noncontig=noncontig)])


@pytest.mark.parametrize("view", ["rows", "row_slice", "unmerged"])
def test_geglu_backward_is_one_pass_when_rows_merge(view, monkeypatch):
    """The gradient is one _geglu_backward_kernel launch when the leading dims of the input and
    of the output's gradient merge into rows (contiguous, or a slice of wider rows); otherwise
    two strided maps. Both against PyTorch in float64."""
    import flame.kernels.elementwise as KE
    base = torch.randn(3, 6, 22, dtype=torch.float64, device=flame.device)
    view_t = {"rows": base[..., :18].contiguous(), "row_slice": base[..., 2:20], "unmerged": base[:, :4, :18]}[view]
    x = flame.from_torch(view_t, requires_grad=True)
    assert x._data.stride() == view_t.stride()
    xt = view_t.detach().clone().requires_grad_(True)
    gt = torch.randn(*xt.shape[:-1], 9, dtype=torch.float64, device=flame.device)
    launched = []
    real = KE.launch
    monkeypatch.setattr(KE, "launch", lambda k, *a, **kw: launched.append(k.fn.__name__) or real(k, *a, **kw))
    grads = flame.nn.functional.geglu(x).backward(flame.from_torch(gt))
    _torch_geglu(xt).backward(gt)
    torch.testing.assert_close(grads[x].to_torch(), xt.grad, rtol=1e-12, atol=1e-12)
    backward = launched[1:3]  # after the forward's map (autograd may then lay the gradient out like x)
    one_pass = view != "unmerged"
    assert backward[:1 if one_pass else 2] == (["_geglu_backward_kernel"] if one_pass else ["_map_strided_kernel"] * 2)


@pytest.mark.gpu
def test_geglu_bf16():
    test_geglu_forward_backward(torch.bfloat16, (64, 4096), False)


def test_geglu_gradcheck_and_errors():
    x = flame.randn(4, 10, dtype=flame.float64, requires_grad=True)
    assert gradcheck(flame.nn.functional.geglu, [x])
    with pytest.raises(ValueError, match="even"):
        flame.nn.functional.geglu(flame.randn(3, 5))
    with pytest.raises(TypeError, match="floating-point"):
        flame.nn.functional.geglu(flame.arange(6))


# ---- addcmul -------------------------------------------------------------------------------------

ADDCMUL_SHAPES = [((2, 5, 6), (2, 1, 6), (2, 5, 6)),  # the gated residual x + gate[:, None] * y
                  ((6,), (4, 1, 1), (5, 1)),  # every operand broadcast
                  ((3, 4), (3, 4), (3, 4))]


@pytest.mark.parametrize("shapes", ADDCMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("value", [1.0, -0.5])
def test_addcmul(shapes, dtype, value):
    inputs = [pair(shape, dtype, requires_grad=True) for shape in shapes]
    check_op(lambda x, a, b: flame.addcmul(x, a, b, value=value), lambda x, a, b: torch.addcmul(x, a, b, value=value),
             inputs, lowp=(2, 3))


def test_addcmul_one_launch_gradients_only_where_needed_and_gradcheck():
    import flame.kernels.launch as L
    x, gate, y = (flame.randn(*s, dtype=flame.float64) for s in ((2, 2, 3), (2, 1, 3), (2, 2, 3)))
    gate.requires_grad_()
    before = L.launches
    out = flame.addcmul(x, gate, y, value=0.5)
    assert L.launches - before == 1
    grads = out.backward(flame.ones(2, 2, 3, dtype=flame.float64))
    assert list(grads.by_id) == [gate.id]  # no gradient for x and y, nor a map for y's
    assert_close(grads[gate], 0.5 * y.to_torch().sum(1, keepdim=True))
    for t in (x, y):
        t.requires_grad_()
    assert gradcheck(lambda x, g, y: flame.addcmul(x, g, y, value=0.5), [x, gate, y])


def test_addcmul_integers_and_bad_inputs():
    a, at = pair((3, 4), torch.int64)
    b, bt = pair((4,), torch.int64)
    assert_close(flame.addcmul(a, b, a, value=3), torch.addcmul(at, bt, at, value=3))
    with pytest.raises(TypeError, match="integer"):
        flame.addcmul(a, b, a, value=0.5)
    with pytest.raises(TypeError, match="from_torch"):
        flame.addcmul(flame.ones(3), at, flame.ones(3))
    with pytest.raises(TypeError, match="value must be a number"):
        flame.addcmul(a, a, a, value=flame.ones(1))
    with pytest.raises(ValueError, match="broadcast"):
        flame.addcmul(flame.ones(3), flame.ones(4), flame.ones(3))


@pytest.mark.gpu
def test_addcmul_bf16_flux_gated_residual():
    inputs = [pair(s, torch.bfloat16, requires_grad=True) for s in ((1, 4608, 3072), (1, 1, 3072), (1, 4608, 3072))]
    check_op(flame.addcmul, torch.addcmul, inputs, lowp=(2, 3))


# ---- output layout: elementwise results follow the first full-shape operand's layout -------------

def test_elementwise_output_keeps_channels_last_and_runs_contiguous(monkeypatch):
    import flame.kernels.elementwise as KE
    cl = torch.channels_last
    x = flame.from_torch(torch.randn(2, 6, 5, 3, device=flame.device).contiguous(memory_format=cl))
    y = flame.from_torch(torch.randn(2, 6, 5, 3, device=flame.device).contiguous(memory_format=cl))
    b = flame.from_torch(torch.randn(1, 6, 1, 1, device=flame.device))
    kernels = []
    real = KE.launch
    monkeypatch.setattr(KE, "launch", lambda kernel, *a, **k: kernels.append(kernel) or real(kernel, *a, **k))
    s = x + y
    assert s.stride() == x.stride() and kernels == [KE._map_contiguous_kernel]  # one contiguous pass
    assert_close(s, x.to_torch() + y.to_torch())
    t = x * b  # a broadcast operand keeps the full-shape operand's layout
    assert t.stride() == x.stride()
    assert_close(t, x.to_torch() * b.to_torch())
    u = flame.exp(x)
    assert u.stride() == x.stride()
    # the first full-shape operand decides: contiguous first -> contiguous result
    c = flame.from_torch(torch.randn(2, 6, 5, 3, device=flame.device))
    assert (c + x).is_contiguous() and (b + x).stride() == x.stride()
    # not dense (a slice): contiguous result
    wide = flame.from_torch(torch.randn(2, 6, 5, 6, device=flame.device))
    assert (wide[..., :3] + 1.0).is_contiguous()
    # gradients through a channels-last add keep their values
    xg = flame.from_torch(x.to_torch().clone(), requires_grad=True)
    grads = (xg * y).sum().backward()
    assert_close(grads[xg], y.to_torch())


def test_map_op_memoises_each_signature(monkeypatch):
    """map_op keeps one recipe per (op, output dtype, operands' dtypes, shapes and strides): a repeated
    map reuses it (its output laid out as before, no new kernel plan asked); a changed stride, dtype
    or shape is a new signature; tune.override empties the recipes with the kernels' plans."""
    from flame import tune
    from flame.kernels import elementwise as KE
    from flame.ops import elementwise as E
    E._recipes.clear()
    a, b = torch.randn(4, 6, device=flame.device), torch.randn(4, 6, device=flame.device)
    x, y = flame.from_torch(a), flame.from_torch(b)
    assert_close(x + y, a + b)
    assert len(E._recipes) == 1
    monkeypatch.setattr(KE, "map_plan", lambda *args: pytest.fail("a repeated signature asked for a plan"))
    for _ in range(2):
        assert_close(x + y, a + b)
    monkeypatch.undo()
    cl = torch.randn(2, 3, 4, 5, device=flame.device).to(memory_format=torch.channels_last)
    xc = flame.from_torch(cl)
    for _ in range(2):  # the output keeps the channels-last layout on a hit too
        out = xc * 2.0
        assert out.stride() == cl.stride()
        assert_close(out, cl * 2.0)
    cases = [(x.t(), y.t(), a.t() + b.t()),  # strides
             (x.to(flame.float64), y.to(flame.float64), a.double() + b.double()),  # dtype (and two casts)
             (x, flame.from_torch(b[0]), a + b[0])]  # shape: a broadcast operand
    for p, q, ref in cases:
        before = len(E._recipes)
        assert_close(p + q, ref)
        assert_close(p + q, ref)
        assert len(E._recipes) > before
    with tune.override("map_contiguous", dict(BLOCK_SIZE=64, num_warps=1)) as o:
        assert not E._recipes  # emptied with the kernels' plans
        assert_close(x + y, a + b)
        assert o.served == 1
