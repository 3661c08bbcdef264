"""gather, index_select and embedding against PyTorch: values, gradients, errors."""
import pytest
import torch
import torch.nn.functional as TF

import flame
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, assert_within_torch_error, check_op, pair

ALL_DTYPES = FLOAT_DTYPES_CPU + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _f(t, requires_grad=False):
    """A flame tensor on flame's device holding torch tensor ``t``'s values (strides kept)."""
    return flame.from_torch(t.to(DEVICE), requires_grad=requires_grad)


def _run(f_fn, t_fn, x_shape, dtype, noncontig=False):
    """Forward values must match exactly (a copy); gradients against torch in the same dtype
    (fp32) or within 3x torch's own error against an fp32 reference (fp16/bf16)."""
    x = pair(x_shape, dtype, requires_grad=True, noncontig=noncontig)
    run = check_op(f_fn, t_fn, [x], tol=dict(rtol=0, atol=0), grad_tol={}, lowp=(None, 3))
    return run.out, run.grads[0]


# ---- index_select ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape,dim,noncontig", [((7,), 0, False), ((5, 9), 0, True), ((5, 9), -1, False),
                                                 ((3, 6, 5), 1, True), ((2, 3, 4, 5), -2, False)])
def test_index_select(shape, dim, noncontig, dtype):
    n = shape[dim]
    index = torch.tensor([n - 1, 0, 2 % n, n - 1, 1 % n, n - 1], dtype=torch.int64)  # duplicates
    _run(lambda x: flame.index_select(x, dim, _f(index)), lambda x: torch.index_select(x, dim, index.to(DEVICE)),
         shape, dtype, noncontig)


def test_index_select_int32_noncontig_index_and_method():
    fx, tx = pair((6, 4), requires_grad=True)
    base = torch.tensor([[5, 0], [1, 1], [5, 2]], dtype=torch.int32, device=DEVICE)
    index = base[:, 0]  # stride 2
    fy = fx.index_select(0, _f(index))
    ty = tx.index_select(0, index)
    assert_close(fy, ty, rtol=0, atol=0)
    g = torch.randn(3, 4, device=DEVICE)
    tx.index_select(0, index).backward(g)
    assert_close(fy.backward(_f(g))[fx], tx.grad)


def test_index_select_empty_and_scalar():
    fx, tx = pair((4, 3), requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    fy = flame.index_select(fx, 1, _f(empty))
    assert fy.shape == (4, 0)
    gx = flame.grad(flame.sum(fy), fx)
    assert_close(gx, torch.zeros(4, 3))
    fy = flame.index_select(fx, 0, _f(torch.tensor(2)))  # 0-d index keeps the dim
    assert_close(fy, torch.index_select(tx, 0, torch.tensor(2, device=DEVICE)).detach(), rtol=0, atol=0)
    s = _f(torch.tensor(3.5), requires_grad=True)
    ys = flame.index_select(s, 0, _f(torch.tensor([0])))
    assert ys.shape == () and ys.item() == 3.5
    assert flame.grad(ys * 2.0, s).item() == 2.0


# ---- gather ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("x_shape,dim,i_shape,noncontig", [
    ((9,), 0, (13,), False),                   # index longer than x along dim
    ((5, 7), 0, (11, 7), True),                # many duplicates along dim 0
    ((5, 7), -1, (3, 4), False),               # index smaller than x in the other dim
    ((3, 5, 6), 1, (3, 8, 6), True),
    ((4, 3, 5), -3, (2, 2, 5), False),
    ((2, 3, 2, 3, 5), 2, (2, 2, 3, 2, 4), True),  # > 4 uncollapsible dims
])
def test_gather(x_shape, dim, i_shape, noncontig, dtype):
    n = x_shape[dim]
    index = torch.randint(0, n, i_shape, dtype=torch.int64)
    _run(lambda x: flame.gather(x, dim, _f(index)), lambda x: torch.gather(x, dim, index.to(DEVICE)),
         x_shape, dtype, noncontig)


def test_gather_noncontig_index_int_values_and_method():
    base = torch.randint(0, 4, (6, 5), dtype=torch.int64, device=DEVICE)
    index = base.t()[:, :3]  # (5, 3), transposed strides
    x = torch.arange(5 * 4, dtype=torch.int32, device=DEVICE).reshape(5, 4)
    got = _f(x).gather(1, _f(index))
    assert_close(got, torch.gather(x, 1, index), rtol=0, atol=0)
    xb = torch.rand(5, 4, device=DEVICE) > 0.5
    assert_close(flame.gather(_f(xb), 1, _f(index)), torch.gather(xb, 1, index))


def test_gather_broadcast_index_and_scalar():
    index = torch.tensor([[2, 0, 2]], device=DEVICE).expand(4, 3)  # stride 0 over rows
    _run(lambda x: flame.gather(x, 1, _f(index)), lambda x: torch.gather(x, 1, index), (4, 5), torch.float32)
    s = _f(torch.tensor(1.5), requires_grad=True)
    y = flame.gather(s, -1, _f(torch.tensor([0, 0])))
    assert y.shape == (2,) and y.tolist() == [1.5, 1.5]
    assert flame.grad(flame.sum(y), s).item() == 2.0


def test_gather_empty():
    fx, _ = pair((3, 4), requires_grad=True)
    fy = flame.gather(fx, 1, _f(torch.zeros(3, 0, dtype=torch.int64)))
    assert fy.shape == (3, 0)
    assert_close(flame.grad(flame.sum(fy), fx), torch.zeros(3, 4))
    fe = _f(torch.zeros(0, 4), requires_grad=True)
    ye = flame.gather(fe, 0, _f(torch.zeros(0, 2, dtype=torch.int64)))
    assert ye.shape == (0, 2)
    assert flame.grad(flame.sum(ye), fe).shape == (0, 4)


# ---- embedding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("i_shape,padding_idx,noncontig", [((6,), None, False), ((3, 5), 2, True),
                                                          ((2, 3, 4), -1, False), ((), None, False)])
def test_embedding(i_shape, padding_idx, noncontig, dtype):
    V, C = 9, 13
    index = torch.randint(0, V, i_shape, dtype=torch.int64)
    if len(i_shape):
        index.view(-1)[:3] = torch.tensor([2, V - 1, 2])  # the padding rows and duplicates occur
    _run(lambda w: flame.embedding(_f(index), w, padding_idx=padding_idx),
         lambda w: TF.embedding(index.to(DEVICE), w, padding_idx=padding_idx), (V, C), dtype, noncontig)


def test_embedding_empty_and_functional():
    import flame.nn.functional as F
    fw, tw = pair((5, 3), requires_grad=True)
    idx = torch.tensor([[4, 0], [0, 4]], dtype=torch.int32)
    fy = F.embedding(_f(idx), fw)
    assert_close(fy, TF.embedding(idx.to(DEVICE), tw).detach(), rtol=0, atol=0)
    ye = flame.embedding(_f(torch.zeros(2, 0, dtype=torch.int64)), fw)
    assert ye.shape == (2, 0, 3)
    assert_close(flame.grad(flame.sum(ye), fw), torch.zeros(5, 3))


# ---- determinism and accumulation ---------------------------------------------------------------

def test_backward_deterministic_many_duplicates_fp16():
    # 300 copies of few rows: fp32 accumulation beats fp16 torch; two runs agree bit for bit
    V, C = 4, 7
    index = torch.randint(0, V, (300,), dtype=torch.int64)
    g = torch.randn(300, C, dtype=torch.float64)
    fw = _f(torch.randn(V, C).half(), requires_grad=True)
    runs = []
    for _ in range(2):
        fy = flame.embedding(_f(index), fw)
        runs.append(fy.backward(_f(g.half()))[fw].to_torch().clone())
    assert torch.equal(runs[0], runs[1])
    ref = torch.zeros(V, C, dtype=torch.float64).index_add_(0, index, g.half().double()).to(DEVICE)
    # summed in fp32, rounded once to fp16: within one fp16 ulp of the exact sum
    assert_close(runs[0], ref.half().float(), rtol=2 ** -10, atol=0)
    torch16 = torch.zeros(V, C, dtype=torch.float16, device=DEVICE).index_add_(0, index.to(DEVICE), g.half().to(DEVICE))
    assert_within_torch_error(runs[0], torch16, ref, 1)


# ---- errors ------------------------------------------------------------------------------------

def test_errors():
    x = _f(torch.randn(4, 5))
    i = torch.tensor([[0, 1]], dtype=torch.int64)
    with pytest.raises(TypeError, match="int64 or int32"):
        flame.gather(x, 0, _f(i.float()))
    with pytest.raises(TypeError, match="int64 or int32"):
        flame.index_select(x, 0, _f(torch.tensor([True])))
    with pytest.raises(TypeError, match="int64 or int32"):
        flame.embedding(_f(torch.tensor([1.0])), x)
    with pytest.raises(TypeError, match="flame Tensor"):
        flame.gather(x, 0, i)
    with pytest.raises(IndexError, match=r"index 4 is out of range .*size 4"):
        flame.gather(x, 0, _f(torch.tensor([[0, 4]])))
    with pytest.raises(IndexError, match=r"index -1 is out of range"):
        flame.index_select(x, 1, _f(torch.tensor([0, -1])))
    with pytest.raises(IndexError, match=r"index 5 is out of range .* num_embeddings"):
        flame.embedding(_f(torch.tensor([[5]])), x)
    with pytest.raises(IndexError, match="dimension out of range"):
        flame.gather(x, 2, _f(i))
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        flame.gather(x, 0, _f(torch.tensor([0, 1])))
    with pytest.raises(RuntimeError, match="no larger than input"):
        flame.gather(x, 0, _f(torch.zeros(1, 6, dtype=torch.int64)))
    with pytest.raises(IndexError, match="vector"):
        flame.index_select(x, 0, _f(i))
    with pytest.raises(RuntimeError, match="2-D"):
        flame.embedding(_f(torch.tensor([0])), _f(torch.randn(4)))
    with pytest.raises(ValueError, match="padding_idx"):
        flame.embedding(_f(torch.tensor([0])), x, padding_idx=4)


# ---- finite differences in float64 --------------------------------------------------------------

def test_gradcheck():
    gather_idx = _f(torch.tensor([[2, 0, 2], [1, 1, 0]]))
    select_idx = _f(torch.tensor([3, 0, 3]))
    emb_idx = _f(torch.tensor([[1, 3], [3, 0]]))

    def x64(*shape):
        return _f(torch.randn(*shape, dtype=torch.float64), requires_grad=True)

    assert flame.testing.gradcheck(lambda x: flame.gather(x, 0, gather_idx), [x64(3, 4)])
    assert flame.testing.gradcheck(lambda x: flame.index_select(x, -1, select_idx), [x64(2, 4)])
    assert flame.testing.gradcheck(lambda w: flame.embedding(emb_idx, w), [x64(4, 2)])
