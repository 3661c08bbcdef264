"""matmul / bmm: values against PyTorch, torch.matmul's shape semantics, gradients, errors."""
import math

import pytest
import torch

import flame
import flame.kernels.elementwise as KE
from tests.helpers import DEVICE, assert_within_torch_error, pair

ON_GPU = not flame.is_interpreter()


@pytest.fixture(autouse=True)
def _fresh_routes():
    """Routes are memoised per problem (kernels/matmul.py): each test plans afresh, so one that
    patches the planner's helpers (split counts, configs, the TMA switches) reaches them."""
    from flame.kernels.matmul import _route
    _route.cache_clear()
    yield
    _route.cache_clear()


def _steps(p, route):
    """(problem, route) of a route and of the steps of a composite one, in the order they run."""
    yield p, route
    for q, r in route.then:
        yield from _steps(q, r)


def _spy_routes(monkeypatch, record):
    """``record(problem, route)`` for every route a GEMM launch takes from here on (and every step
    of a composite one)."""
    import flame.kernels.matmul as KM

    def spy(p, real=KM.plan):
        route = real(p)
        for step in _steps(p, route):
            record(*step)
        return route
    monkeypatch.setattr(KM, "plan", spy)


@pytest.fixture
def routes(monkeypatch):
    """The (problem, route) of every GEMM launched from here on, composite routes' steps too."""
    taken = []
    _spy_routes(monkeypatch, lambda p, r: taken.append((p, r)))
    return taken


def _tol(dtype, K):
    """Per-dtype tolerance against a float64 reference rounded to ``dtype``. Outputs are sums of
    K products of N(0, 1) values (typical size sqrt(K)), so the absolute part scales with sqrt(K)."""
    s = math.sqrt(max(K, 1))
    if dtype == torch.float64:
        return dict(rtol=1e-10, atol=1e-10 * s)
    if dtype == torch.float32:
        if ON_GPU:  # tf32 products: inputs rounded to 10 mantissa bits
            return dict(rtol=5e-3, atol=5e-3 * s)
        return dict(rtol=1e-5, atol=2e-6 * s)
    if dtype == torch.float16:  # one fp16 ulp of the output, fp32 accumulation
        return dict(rtol=2e-3, atol=1e-3)
    return dict(rtol=1.6e-2, atol=1e-2)  # bfloat16


def _ref(ta, tb):
    """torch.matmul in float64, rounded to the inputs' promoted dtype."""
    dtype = torch.promote_types(ta.dtype, tb.dtype)
    return torch.matmul(ta.detach().double(), tb.detach().double()).to(dtype)


def _check(got, want, K):
    got = got.to_torch() if isinstance(got, flame.Tensor) else got
    assert tuple(got.shape) == tuple(want.shape), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), **_tol(want.dtype, K))


def _no_copies(monkeypatch):
    """Make any elementwise kernel launch (the strided copy included) fail."""
    def forbidden(*args, **kwargs):
        raise AssertionError("matmul launched an elementwise/copy kernel")
    monkeypatch.setattr(KE, "map_", forbidden)


DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

# (M, N, K): none of them multiples of the block; 1 and 130 cross the small/large edges
ODD_SHAPES = [(1, 1, 1), (7, 33, 77), (33, 130, 7), (130, 77, 33), (77, 1, 130), (1, 7, 33), (130, 130, 130)]


# ---- forward values ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", ODD_SHAPES)
def test_matmul_2d_values(dtype, M, N, K):
    a, ta = pair((M, K), dtype)
    b, tb = pair((K, N), dtype)
    _check(a @ b, _ref(ta, tb), K)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_fp64_and_mixed_dtypes(dtype):
    a, ta = pair((33, 77), torch.float64)
    b, tb = pair((77, 7), torch.float64)
    _check(flame.matmul(a, b), _ref(ta, tb), 77)
    # mixed: promoted once, result in the promoted dtype (fp32 for fp16/bf16 x fp32)
    c, tc = pair((7, 33), dtype)
    d, td = pair((33, 5), torch.float32)
    out = c @ d
    assert out.dtype == torch.promote_types(dtype, torch.float32)
    _check(out, _ref(tc, td), 33)


def test_noncontiguous_operands_read_in_place(monkeypatch):
    x, tx = pair((77, 33))
    w, tw = pair((130, 33))  # a Linear weight (out, in): y = x @ w^T
    at, tat = pair((33, 77), noncontig=True)  # column-major storage
    big, tbig = pair((40, 70))
    _no_copies(monkeypatch)
    _check(x @ w.t(), _ref(tx, tw.t()), 33)
    _check(at @ x, _ref(tat, tx), 77)
    _check(big[3:36:2, 1:70:3] @ x[:23, :7], _ref(tbig[3:36:2, 1:70:3], tx[:23, :7]), 23)
    _check(w.t().t() @ x.t(), _ref(tw, tx.t()), 33)


@pytest.mark.parametrize("sa,sb", [
    ((2, 3, 7, 33), (33, 5)),           # weight broadcast over the batch: folded into M
    ((4, 7, 33), (4, 33, 5)),           # plain batch
    ((2, 1, 7, 9), (1, 3, 9, 5)),       # two batch dims that do not collapse
    ((2, 1, 3, 4, 5), (2, 1, 5, 6)),    # three batch dims, broadcast in two of them
    ((1, 7, 9), (3, 9, 5)),             # size-1 batch on the left
    ((5, 9), (2, 3, 9, 4)),             # matrix times a batch
])
def test_matmul_broadcast_batch(sa, sb, monkeypatch):
    a, ta = pair(sa)
    b, tb = pair(sb)
    _no_copies(monkeypatch)
    _check(a @ b, _ref(ta, tb), sa[-1])


def test_matmul_batch_strides():
    # batch dims with strides that collapse neither with each other nor with M
    x, tx = pair((5, 4, 3, 9))
    w, tw = pair((4, 9, 6))
    xv, txv = x.permute(1, 2, 0, 3), tx.permute(1, 2, 0, 3)  # (4, 3, 5, 9)
    wv, twv = w.unsqueeze(1), tw.unsqueeze(1)  # (4, 1, 9, 6)
    u, tu = pair((5, 9, 6))
    _check(xv @ wv, _ref(txv, twv), 9)
    _check(x.transpose(0, 1) @ u, _ref(tx.transpose(0, 1), tu), 9)  # (4, 5, 3, 9) @ (5, 9, 6)


@pytest.mark.parametrize("sa,sb", [
    ((33,), (33,)), ((7,), (7, 5)), ((5, 7), (7,)), ((7,), (3, 7, 5)), ((2, 3, 5, 7), (7,)), ((1,), (1,)),
])
def test_matmul_1d(sa, sb):
    a, ta = pair(sa)
    b, tb = pair(sb)
    out = a @ b
    want = _ref(ta, tb)
    assert out.shape == tuple(want.shape)
    _check(out, want, sa[-1])


def test_bmm_values():
    a, ta = pair((3, 7, 33), torch.float16)
    b, tb = pair((3, 33, 77), torch.float16, noncontig=True)
    _check(flame.bmm(a, b), torch.bmm(ta.float(), tb.float()).half(), 33)


def test_empty_dims():
    # K == 0: a sum of nothing is zero
    a, _ = pair((3, 0))
    b, _ = pair((0, 4))
    out = a @ b
    assert out.shape == (3, 4)
    assert (out.to_torch() == 0).all()
    e, _ = pair((0,))
    assert (e @ e).shape == () and (e @ e).item() == 0.0
    # M == 0 / N == 0 / empty batch: empty results of the right shape
    m, _ = pair((0, 5))
    n, _ = pair((5, 0))
    w, _ = pair((5, 4))
    assert (m @ w).shape == (0, 4)
    assert (w.t() @ n).shape == (4, 0)
    z, _ = pair((0, 3, 5))
    assert (z @ w).shape == (0, 3, 4)


# ---- gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", [
    ((7, 33), (33, 77)),
    ((2, 3, 7, 33), (33, 5)),        # weight gradient: batch folded into the reduction
    ((4, 7, 9), (4, 9, 5)),
    ((2, 1, 7, 9), (1, 3, 9, 5)),    # partial broadcast: engine sums the broadcast dims
    ((1, 7, 9), (3, 9, 5)),
    ((33,), (33,)), ((7,), (3, 7, 5)), ((2, 5, 7), (7,)),
])
def test_matmul_grads_vs_torch(sa, sb):
    a, ta = pair(sa, requires_grad=True)
    b, tb = pair(sb, requires_grad=True)
    ref = ta @ tb
    v, tv = pair(tuple(ref.shape))
    out = a @ b
    grads = (out * v).sum().backward()
    (ref * tv).sum().backward()
    _check(out, ref.detach(), sa[-1])
    # dA reduces over N, dB over the batch and M: the longest reduction sets the tolerance
    reduction = max(ref.numel(), sa[-1])
    _check(grads[a], ta.grad, reduction)
    _check(grads[b], tb.grad, reduction)


def test_matmul_grads_noncontiguous_and_fp16():
    # activations stored (M, B, K) and read as (B, M, K): the weight gradient cannot fold the
    # batch into one reduction and goes through the batched GEMM + sum path
    x, tx = pair((9, 4, 33), requires_grad=True)
    w, tw = pair((5, 33), requires_grad=True)
    out = x.transpose(0, 1) @ w.t()
    ref = tx.transpose(0, 1) @ tw.t()
    v, tv = pair(tuple(ref.shape))
    grads = (out * v).sum().backward()
    (ref * tv).sum().backward()
    _check(out, ref.detach(), 33)
    _check(grads[x], tx.grad, 5)
    _check(grads[w], tw.grad, 36)
    # fp16 leaves
    a, ta = pair((4, 7, 33), torch.float16, requires_grad=True)
    b, tb = pair((33, 6), torch.float16, requires_grad=True)
    grads = (a @ b).sum().backward()
    (ta.float() @ tb.float()).sum().backward()
    torch.testing.assert_close(grads[a].to_torch(), ta.grad.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(grads[b].to_torch(), tb.grad.float(), rtol=2e-3, atol=2e-2)


def test_matmul_grads_mixed_dtypes_and_empty():
    a, ta = pair((3, 5), torch.float16, requires_grad=True)
    b, tb = pair((5, 4), torch.float32, requires_grad=True)
    grads = (a @ b).sum().backward()
    (ta.float() @ tb).sum().backward()
    assert grads[a].dtype == torch.float32 and grads[b].dtype == torch.float32
    torch.testing.assert_close(grads[a].to_torch(), ta.grad.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(grads[b].to_torch(), tb.grad, rtol=1e-3, atol=1e-3)
    # M == 0: dB is a sum over nothing; K == 0: empty gradients
    m, _ = pair((0, 5), requires_grad=True)
    w, _ = pair((5, 4), requires_grad=True)
    grads = (m @ w).sum().backward()
    assert grads[m].shape == (0, 5)
    assert grads[w].shape == (5, 4) and (grads[w].to_torch() == 0).all()
    k, _ = pair((3, 0), requires_grad=True)
    k2, _ = pair((0, 4), requires_grad=True)
    grads = (k @ k2).sum().backward()
    assert grads[k].shape == (3, 0) and grads[k2].shape == (0, 4)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 2)), ((2, 1, 3, 2), (3, 2, 2)), ((3,), (2, 3, 2)), ((2, 3), (3,))])
def test_gradcheck_float64(sa, sb):
    a, _ = pair(sa, torch.float64, requires_grad=True)
    b, _ = pair(sb, torch.float64, requires_grad=True)
    assert flame.testing.gradcheck(flame.matmul, (a, b))


def test_gradcheck_bmm_transposed():
    a, _ = pair((2, 3, 2), torch.float64, requires_grad=True)
    b, _ = pair((2, 4, 2), torch.float64, requires_grad=True)
    assert flame.testing.gradcheck(lambda x, y: flame.bmm(x, y.transpose(1, 2)), (a, b))


# ---- errors -----------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    a, _ = pair((3, 4))
    b, _ = pair((5, 6))
    with pytest.raises(RuntimeError, match=r"\(3, 4\).*\(5, 6\)"):
        a @ b
    v, _ = pair((5,))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ v
    s = flame.tensor(2.0)
    with pytest.raises(RuntimeError, match="at least 1 dimension"):
        flame.matmul(s, a)
    c, _ = pair((2, 3, 4))
    d, _ = pair((3, 4, 5))
    with pytest.raises(RuntimeError, match="not broadcastable"):
        c @ d
    i, _ = pair((3, 4), torch.int64)
    with pytest.raises(TypeError, match=r"floating-point.*int64"):
        flame.matmul(i, a.t())
    with pytest.raises(TypeError, match="flame Tensor"):
        flame.matmul(a, torch.ones(4, 2))
    with pytest.raises(RuntimeError, match=r"bmm: expected 3-D.*\(3, 4\)"):
        flame.bmm(a, a.t())
    e, _ = pair((3, 4, 5))
    with pytest.raises(RuntimeError, match=r"bmm: batch sizes differ"):
        flame.bmm(c, e)


# ---- GPU: bf16 numerics on a real problem ------------------------------------------------------

@pytest.mark.gpu
def test_bf16_1024x1280x1280_within_torch_error():
    M, K, N = 1024, 1280, 1280
    a32 = torch.randn(M, K, device=DEVICE)
    w32 = torch.randn(N, K, device=DEVICE) / math.sqrt(K)  # Linear weight, read transposed
    a16, w16 = a32.bfloat16(), w32.bfloat16()
    ref = a16.float() @ w16.float().t()
    a = flame.from_torch(a16, requires_grad=True)
    w = flame.from_torch(w16, requires_grad=True)
    out = a @ w.t()
    assert out.dtype == torch.bfloat16
    assert_within_torch_error(out, a16 @ w16.t(), ref, 2)
    # gradients (3x rule): dA = G W, dW = G^T A
    g32 = torch.randn(M, N, device=DEVICE)
    g16 = g32.bfloat16()
    grads = out.backward(flame.from_torch(g16))
    ref_da = g16.float() @ w16.float()
    ref_dw = g16.float().t() @ a16.float()
    assert_within_torch_error(grads[a], (g16 @ w16).float(), ref_da, 3)
    assert_within_torch_error(grads[w], (g16.t() @ a16).float(), ref_dw, 3)


# ---- split-K (few output tiles, long K: LoRA's weight gradients) --------------------------------

@pytest.fixture
def split_k_everywhere(monkeypatch):
    """A 132-SM card with 16x16x16 tiles, so small problems take the split-K path here too; the
    split counts of the split-K launches from here on."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM.runtime, "num_sms", lambda: 132)
    monkeypatch.setattr(KM, "_config", lambda M, N, K, dtype, batch=1: dict(
        BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=1))
    calls = []
    _spy_routes(monkeypatch, lambda p, r: r.kernel == "split_k" and calls.append(r.splits))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_matches_torch(dtype, split_k_everywhere):
    a, ta = pair((20, 515), dtype)  # 515 = 5 * 103: 5 slices, each not a multiple of the block
    b, tb = pair((515, 9), dtype)
    _check(a @ b, _ref(ta, tb), 515)
    # transposed operands read in place; a strided (transposed) output through linear's weight grad
    x, tx = pair((512, 12), dtype, requires_grad=True)
    w, tw = pair((16, 12), dtype, requires_grad=True)
    y = flame.nn.functional.linear(x, w)
    g, tg = pair((512, 16), dtype)
    grads = y.backward(g)
    torch.nn.functional.linear(tx, tw).backward(tg)
    _check(grads[w].to(dtype), tw.grad, 512)
    assert split_k_everywhere and min(split_k_everywhere) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_applies_the_whole_epilogue_once(dtype, split_k_everywhere):
    # bias + GELU (its backward reads the stored pre-activation) and a residual accumulation, each
    # applied to the sum of the slices
    x, tx = pair((9, 515), dtype, requires_grad=True)
    w, tw = pair((20, 515), dtype, requires_grad=True)
    b, tb = pair((20,), dtype, requires_grad=True)
    y = flame.nn.functional.linear(x, w, b, activation="gelu")
    ty = torch.nn.functional.gelu(torch.nn.functional.linear(tx.double(), tw.double(), tb.double()))
    _check(y, ty.to(dtype), 515)
    assert split_k_everywhere  # the forward's bias + GELU GEMM split
    g, tg = pair((9, 20), dtype)
    grads = y.backward(g)
    ty.backward(tg.double())
    for t, tt in ((x, tx), (w, tw), (b, tb)):
        _check(grads[t].to(dtype), tt.grad.to(dtype), 515)
    import flame.kernels.matmul as KM
    a, ta = pair((12, 515), dtype)
    c, tc = pair((515, 10), dtype)
    r, tr = pair((12, 10), dtype)
    out = r.to_torch().clone()
    KM.matmul_(out, a.to_torch(), c.to_torch(), alpha=0.5, residual=out)  # in place: out += 0.5 a @ c
    _check(flame.from_torch(out), (0.5 * _ref(ta, tc).double() + tr.double()).to(dtype), 515)
    assert split_k_everywhere and min(split_k_everywhere) > 1


def test_split_k_is_one_launch_that_leaves_its_arrival_counts_at_zero(split_k_everywhere, monkeypatch):
    """The tile's last K slice to arrive sums the slices: one _matmul_kernel launch, no sum pass;
    every counter it used is zero again, and launches take the buffer's slots in turn, wrapping
    at its end. Results repeat bit for bit (the slices are summed in slice order, whichever
    program arrives last)."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM, "_ARRIVAL_SLOTS", 8)  # (20, 9) in 16x16 tiles: 2 counters a launch
    monkeypatch.setattr(KM, "_arrivals", None)
    monkeypatch.setattr(KM, "_arrival_next", 0)
    launched = []
    real_launch = KM.launch
    monkeypatch.setattr(KM, "launch", lambda kernel, *a, **k: launched.append(kernel.fn.__name__ if hasattr(
        kernel, "fn") else kernel.__name__) or real_launch(kernel, *a, **k))
    a, ta = pair((20, 515), torch.float32)
    b, tb = pair((515, 9), torch.float32)
    first = (a @ b).to_torch()
    _check(flame.from_torch(first), _ref(ta, tb), 515)
    assert split_k_everywhere == [5] and launched == ["_matmul_kernel"], (split_k_everywhere, launched)
    starts = [KM._arrival_next]
    for _ in range(4):  # 2 + 2 + 2 + 2 slots: the fourth launch wraps to slot 0
        assert torch.equal((a @ b).to_torch(), first)
        starts.append(KM._arrival_next)
    assert starts == [2, 4, 6, 8, 2]
    assert KM._arrivals.numel() == 8 and not KM._arrivals.any()


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture")
@pytest.mark.parametrize("warm", [True, False])
def test_split_k_in_a_captured_graph(split_k_everywhere, monkeypatch, warm):
    """Replays give the eager result bit for bit, with the device's counters (made by the eager run)
    or, first needed inside the capture, with counters of the graph's own (their fill captured)."""
    import flame.kernels.matmul as KM
    from flame.graphs import CapturedStep
    monkeypatch.setattr(KM, "_arrivals", None)
    a, _ = pair((20, 515), torch.bfloat16)
    b, _ = pair((515, 9), torch.bfloat16)
    eager = (a @ b).to_torch().clone()
    step = CapturedStep(lambda x, y: x @ y)
    assert torch.equal(step(a, b).to_torch(), eager)  # the eager call
    if not warm:
        monkeypatch.setattr(KM, "_arrivals", None)
    for _ in range(3):  # the capture, replays
        assert torch.equal(step(a, b).to_torch(), eager)
    assert split_k_everywhere and step.num_graphs == 1
    assert (KM._arrivals is None) != warm
    if warm:
        assert not KM._arrivals.any()


@pytest.mark.skipif(not ON_GPU, reason="the GPU's memory ordering between programs")
@pytest.mark.parametrize("M, K, N", [(16, 4096, 640), (640, 4096, 16), (16, 16384, 1280)])
def test_split_k_lora_weight_gradients_repeat_exactly(M, K, N):
    """LoRA's weight-gradient shapes at their own configs (16 to 64 slices, 10 to 20 tiles): the
    last program reads every other program's slice (stored on other SMs just before), so a missing
    release or a stale cached line would show as a result that differs now and then."""
    import flame.kernels.matmul as KM
    assert KM._k_splits(KM.cdiv(M, 64) * KM.cdiv(N, 64), K, 64, flame.runtime.num_sms()) > 1
    a, ta = pair((K, M), torch.bfloat16)  # read transposed, as dA = dH^T X reads dH
    b, tb = pair((K, N), torch.bfloat16)
    first = (a.t() @ b).to_torch().clone()
    _check(flame.from_torch(first), _ref(ta.t(), tb), K)
    for _ in range(50):
        assert torch.equal((a.t() @ b).to_torch(), first)
    assert not KM._arrivals.any()


def test_split_k_not_taken_for_short_k_or_many_tiles(split_k_everywhere):
    import flame.kernels.matmul as KM
    assert KM._k_splits(tiles=200, K=4096, block_k=64, sms=132) == 1   # enough tiles already
    assert KM._k_splits(tiles=5, K=512, block_k=64, sms=132) == 1      # K too short to cut
    assert KM._k_splits(tiles=5, K=4096, block_k=64, sms=132) == 16    # LoRA dA: 16 slices of 256
    assert KM._k_splits(tiles=5, K=4097, block_k=64, sms=132) == 1     # prime-ish K: no equal slices
    a, ta = pair((7, 33))
    b, tb = pair((33, 5))
    _check(a @ b, _ref(ta, tb), 33)
    assert not split_k_everywhere


@pytest.mark.parametrize("splits", [1, 5, 37])
def test_split_k_sum_adds_every_slice_in_chunks(splits):
    """The sum pass loads up to 16 slices at once: 37 = 16 + 16 + 5 (a masked last chunk), into a
    transposed output with bias and a residual; fp64 partials sum to the float64 reference."""
    import flame.kernels.matmul as KM
    dev = flame.device
    part = torch.randn(splits, 7, 45, dtype=torch.float64, device=dev)
    bias = torch.randn(45, dtype=torch.float64, device=dev)
    res = torch.randn(45, 7, dtype=torch.float64, device=dev).t()  # (7, 45), column-major
    out = res.clone().t().contiguous().t()  # the residual is the output itself: out += ...
    KM.split_k_sum_(out, out.stride(), part, KM.Fusion(bias=bias, alpha=0.5, residual=out))
    torch.testing.assert_close(out, 0.5 * part.sum(0) + bias + res, rtol=1e-12, atol=1e-12)


def test_split_k_sum_blocks_spread_a_thin_result_over_more_programs(monkeypatch):
    """On a GPU, LoRA's (16, 640) weight gradient of 16 slices: one load per program, 20 programs
    (32x128 tiles made 5 programs each waiting on 16 loads in turn), each load within 8192 values."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM.runtime, "INTERPRETER", False)
    for (splits, M, N), want in {(16, 16, 640): (16, 8, 64), (16, 640, 16): (16, 32, 16),
                                 (3, 1280, 1280): (4, 32, 64), (64, 1, 5): (16, 1, 8)}.items():
        bs, bm, bn = KM._sum_blocks(splits, M, N)
        assert (bs, bm, bn) == want and bs * bm * bn <= 8192, (splits, M, N)
    assert KM.cdiv(16, 8) * KM.cdiv(640, 64) == 20


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernel")
def test_few_tiles_take_the_tma_kernel_up_to_a_k_bound(split_k_everywhere, routes, monkeypatch, tma_in_interpreter):
    """A few-tile 16-bit GEMM that split-K would take runs unsplit on the TMA kernel's small tiles
    while K <= _FEW_TILES_TMA_MAX_K (the 77-token text projections), split-K beyond (LoRA's
    rank-16 weight gradients over thousands of tokens)."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM, "_FEW_TILES_TMA_MAX_K", 256)
    for K, route in ((256, "tma"), (512, "split")):
        routes.clear()
        split_k_everywhere.clear()
        a, ta = pair((16, K), torch.float16)
        b, tb = pair((K, 40), torch.float16)
        _check(a @ b, _ref(ta, tb).to(torch.float16), K)
        tma = [p.K for p, r in routes if r.kernel == "tma"]
        assert (tma, bool(split_k_everywhere)) == (([K], False) if route == "tma" else ([], True))
    assert KM._tma_config(16, 40, 256, torch.float16)["BLOCK_K"] == 128  # few tiles: long K blocks


# ---- GPU: the TMA kernel (16-bit, aligned 2-D problems) -----------------------------------------

def _check_tma_linear(dtype, M, K, N, act, monkeypatch):
    """The linear's three GEMMs (x W^T, dY W, dY^T x) cover the three operand layouts of the TMA
    kernel; sizes are multiples of 8 (16-byte rows), at least 128 (the TMA route's minimum K),
    mostly not multiples of any block."""
    import flame.kernels.matmul as KM
    taken = []
    _spy_routes(monkeypatch, lambda p, r: r.kernel == "tma" and taken.append(r.layout[:2]))
    # few-tile long-K GEMMs (136x2048->640) would split K and skip TMA; split-K has its own tests; the
    # Gluon kernel (tests/test_matmul_hopper.py) would take the problems of a wave of tiles or more
    monkeypatch.setattr(KM, "_k_splits", lambda *a: 1)
    monkeypatch.setattr(KM.matmul_hopper, "ROUTE", False)
    x, tx = pair((M, K), dtype, requires_grad=True)
    w, tw = pair((N, K), dtype, requires_grad=True)
    b, tb = pair((N,), dtype, requires_grad=True)
    g, tg = pair((M, N), dtype)

    def torch_linear(x, w, b):
        y = torch.nn.functional.linear(x, w, b)
        return torch.nn.functional.gelu(y, approximate="tanh") if act else y

    y = flame.nn.functional.linear(x, w, b, activation=act)
    grads = y.backward(g)
    ty = torch_linear(tx, tw, tb)
    ty.backward(tg)
    leaves64 = [t.detach().double().requires_grad_() for t in (tx, tw, tb)]
    ref = torch_linear(*leaves64)
    ref.backward(tg.double())
    assert_within_torch_error(y, ty.detach(), ref.detach(), 2)
    for leaf, t, t64 in ((x, tx, leaves64[0]), (w, tw, leaves64[1])):
        assert_within_torch_error(grads[leaf], t.grad, t64.grad, 3)
    assert {(True, True), (True, False), (False, False)} <= set(taken), taken


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", [(1000, 264, 136), (136, 2048, 640), (128, 128, 128), (4096, 640, 640)])
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_tma_linear_forward_and_both_gradients(dtype, M, K, N, act, monkeypatch):
    import flame.kernels.matmul as KM
    if not KM.TMA or not KM.tma_available():
        pytest.skip("no TMA on this GPU / Triton")
    _check_tma_linear(dtype, M, K, N, act, monkeypatch)


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernel")
@pytest.mark.parametrize("M,K,N", [(136, 264, 136), (264, 128, 200), (128, 128, 128)])
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_tma_linear_in_the_interpreter(M, K, N, act, monkeypatch, tma_in_interpreter):
    """The TMA GEMM's indexing, run by the interpreter's emulation of tensor descriptors (fp16:
    its bf16 dot is wrong)."""
    _check_tma_linear(torch.float16, M, K, N, act, monkeypatch)


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernel")
def test_tma_residual_in_the_interpreter(monkeypatch, tma_in_interpreter):
    """The TMA kernel's scaled in-place accumulation, out += 0.5 A @ B (A K-major, B N-major)."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM, "_k_splits", lambda *a: 1)
    taken = []
    _spy_routes(monkeypatch, lambda p, r: r.kernel == "tma" and taken.append(r.layout[:2]))
    a, ta = pair((136, 264), torch.float16)
    c, tc = pair((264, 200), torch.float16)
    r, tr = pair((136, 200), torch.float16)
    out = r.to_torch().clone()
    KM.matmul_(out, a.to_torch(), c.to_torch(), alpha=0.5, residual=out)
    _check(flame.from_torch(out), (0.5 * _ref(ta, tc).double() + tr.double()).to(torch.float16), 264)
    assert taken == [(True, False)], taken


# ---- a low-rank term in the GEMM (LoRA's up-projection inside the base GEMM) --------------------

def _low_rank_case(M, N, K, r, dtype, act=None, roundings=1):
    """out = act(0.5 A B + 0.25 U V + bias) + R by one ``Fusion``, against float64. U is read
    transposed in place (a (r, M) buffer's .t()), as LoRA's B16.t() is. ``roundings``: how many
    times the output is rounded to ``dtype`` on the way (the tolerance scales with it)."""
    import flame.kernels.matmul as KM
    a, ta = pair((M, K), dtype)
    b, tb = pair((K, N), dtype)
    u, tu = pair((r, M), dtype)
    v, tv = pair((r, N), dtype)
    bias, tbias = pair((N,), dtype)
    r_, tr = pair((M, N), dtype)
    ref = 0.5 * ta.double() @ tb.double() + 0.25 * tu.double().t() @ tv.double() + tbias.double()
    if act:
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    out = r_.to_torch().clone()
    fusion = KM.Fusion(bias.to_torch(), KE.GELU_TANH.value if act else 0, alpha=0.5, residual=out,
                       low_rank=(u.to_torch().t(), v.to_torch(), 0.25))
    st = ta.stride(), tb.stride(), out.stride()
    KM._launch(out, a.to_torch(), b.to_torch(), M, N, K, (), *st, fusion)
    tol = {k: roundings * t for k, t in _tol(dtype, K + r).items()}
    torch.testing.assert_close(out.cpu(), (ref + tr.double()).to(dtype).cpu(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r", [3, 16, 17, 64])
def test_low_rank_term_in_the_pointer_kernel(dtype, r, routes):
    for act in (None, "gelu_tanh"):
        _low_rank_case(33, 70, 45, r, dtype, act)  # K < 128: the pointer kernel on every device
    padded = max(16, 1 << (r - 1).bit_length())  # fused, the rank padded to a power of two >= 16
    assert [(route.kernel, route.config["RANK"]) for _, route in routes] == [("pointer", padded)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_rank_term_apart_for_split_k_and_high_ranks(dtype, split_k_everywhere, monkeypatch):
    """Split-K problems and ranks above 64 add the term in a second GEMM (no activation allowed)."""
    apart = []
    _spy_routes(monkeypatch, lambda p, r: r.kernel == "low_rank_apart" and apart.append(p.rank))
    _low_rank_case(20, 9, 515, 16, dtype, roundings=2)  # split-K (out rounded before the term's GEMM)
    assert split_k_everywhere and apart == [16]
    split_k_everywhere.clear()
    _low_rank_case(12, 40, 33, 70, dtype, roundings=2)  # rank 70
    assert apart == [16, 70]
    with pytest.raises(ValueError, match="without an activation"):
        _low_rank_case(12, 40, 33, 70, dtype, "gelu_tanh")


def test_low_rank_term_in_the_tma_kernel(monkeypatch, request):
    """The TMA kernel's term (fp16, 16-byte aligned rows, K >= 128): on the GPU, or by the
    interpreter's emulation of tensor descriptors."""
    import flame.kernels.matmul as KM
    if flame.is_interpreter():
        request.getfixturevalue("tma_in_interpreter")
    elif not KM.TMA or not KM.tma_available():
        pytest.skip("no TMA on this GPU / Triton")
    monkeypatch.setattr(KM, "_k_splits", lambda *a: 1)
    taken = []
    _spy_routes(monkeypatch, lambda p, r: r.kernel == "tma" and taken.append(p.rank))
    for r in (5, 16):
        for act in (None, "gelu_tanh"):
            _low_rank_case(136, 200, 264, r, torch.float16, act)
    assert taken == [5, 5, 16, 16], taken


def test_low_rank_term_cuts_tma_stages_to_fit_shared_memory(monkeypatch):
    """On an H200 (232,448 bytes a block) a rank-16 term fits beside 128x128x64 tiles of 5 stages
    (204,800 bytes) but not beside tuned 128x128x128 tiles of 3 (237,568): those run 2."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM.autotune, "shared_memory", lambda: 232_448)
    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    assert KM._stages_with_room_for_low_rank(cfg, 16, 2) == 5
    assert KM._stages_with_room_for_low_rank(dict(cfg, BLOCK_K=128, num_stages=3), 16, 2) == 2
    assert KM._stages_with_room_for_low_rank(dict(cfg, BLOCK_N=256, num_stages=3), 64, 2) == 2
    monkeypatch.setattr(KM.autotune, "shared_memory", lambda: None)  # the interpreter: no limit
    assert KM._stages_with_room_for_low_rank(dict(cfg, BLOCK_K=128, num_stages=3), 64, 2) == 3


def test_low_rank_term_of_the_wrong_shape_or_dtype_raises():
    import flame.kernels.matmul as KM
    a, b, out = torch.randn(8, 12), torch.randn(12, 10), torch.empty(8, 10)
    with pytest.raises(ValueError, match=r"low_rank u \(8, 4\) and v \(3, 10\) must be \(8, r\) and \(r, 10\)"):
        KM.matmul_(out, a, b, low_rank=(torch.randn(8, 4), torch.randn(3, 10), 1.0))
    with pytest.raises(TypeError, match=r"low_rank u and v must be torch\.float32"):
        KM.linear_(out, a, b.t(), low_rank=(torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 10), 1.0))


def test_matrix_operands_are_read_in_place():
    """The GEMM entry points take matrices without torch views (kernels/matmul.py ``matrix``): a
    buffer whose leading dims merge into rows, a transposed matrix tuple, a transposed low-rank V;
    the same launch (one route memo entry) as the 2-D views they stand for."""
    import flame.kernels.matmul as KM
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=g, dtype=torch.float64).to(DEVICE)  # an activation (B, L, C)
    w = torch.randn(10, 12, generator=g, dtype=torch.float64).to(DEVICE)
    u = torch.randn(10, 3, generator=g, dtype=torch.float64).to(DEVICE)
    v = torch.randn(12, 3, generator=g, dtype=torch.float64).to(DEVICE)
    assert KM.matrix(x)[0] is x and KM.matrix(x)[1:] == (10, 12, 12, 1)
    assert KM.transposed(x)[0] is x and KM.transposed(x)[1:] == (12, 10, 1, 12)
    ref = x.reshape(10, 12) @ w.t()
    out = torch.empty(2, 5, 10, dtype=torch.float64, device=DEVICE)
    KM.linear_(out, x, w)
    torch.testing.assert_close(out.reshape(10, 10), ref)
    problems = len(KM._route.problems)
    out2 = torch.empty(10, 10, dtype=torch.float64, device=DEVICE)
    KM.linear_(out2, x.view(10, 12), w)  # the 2-D view: the same problem
    assert len(KM._route.problems) == problems
    torch.testing.assert_close(out2, ref)
    # dW = G^T X from the activations as they are; a low-rank V given as U's transpose
    dw = torch.empty(10, 12, dtype=torch.float64, device=DEVICE)
    KM.matmul_(dw, KM.transposed(out), KM.matrix(x), low_rank=(u, KM.transposed(v), 0.5))
    torch.testing.assert_close(dw, out.reshape(10, 10).t() @ x.reshape(10, 12) + 0.5 * u @ v.t())
    # a size-1 dim with any stride merges, as in a view; dims that do not merge are refused
    one = torch.randn(5, 12, dtype=torch.float64, device=DEVICE).as_strided((1, 5, 12), (7, 12, 1))
    assert KM.matrix(one)[1:] == (5, 12, 12, 1)
    row = torch.randn(12, dtype=torch.float64, device=DEVICE)  # a vector: one row
    assert KM.matrix(row)[1:] == (1, 12, 12, 1)
    out1 = torch.empty(10, dtype=torch.float64, device=DEVICE)
    KM.linear_(out1, row, w)
    torch.testing.assert_close(out1, w @ row)
    crossed = x.transpose(0, 1)  # (5, 2, 12): rows that no stride walks
    assert KM.matrix(crossed) is None
    with pytest.raises(ValueError, match=r"x of shape \(5, 2, 12\) .* is not a matrix"):
        KM.linear_(torch.empty(5, 2, 10, dtype=torch.float64, device=DEVICE), crossed, w)
    with pytest.raises(ValueError, match="matrix tuples need a 2-D problem"):
        KM.matmul_(torch.empty(2, 5, 10, dtype=torch.float64, device=DEVICE), KM.matrix(x),
                   torch.randn(2, 12, 10, device=DEVICE))


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's run of the TMA kernel")
def test_tma_route_fills_its_kept_descriptors_per_launch(monkeypatch, tma_in_interpreter):
    """A "tma" route's launch plan keeps one descriptor object each for A, B and C: a launch sees
    its own buffers in them (values right for two calls on different buffers), and between launches
    they hold none (no activation kept alive by the plan)."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM, "_k_splits", lambda *a: 1)
    seen, real = [], KM.launch

    def watch(kernel, grid, *args, **meta):
        seen.append(tuple(d.base.data_ptr() for d in args[:3]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(KM, "launch", watch)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, w = torch.randn(136, 264, generator=g).half(), torch.randn(200, 264, generator=g).half()
        out = torch.empty(136, 200, dtype=torch.float16)
        KM.linear_(out, x, w)
        _check(flame.from_torch(out), _ref(x, w.t()).half(), 264)
        assert seen[-1] == (x.data_ptr(), w.data_ptr(), out.data_ptr())
    (route,) = KM._route.problems.values()
    assert route.kernel == "tma" and all(d.base is None for d in route.launch.memo[1])


def test_gemm_plans_are_pinned_where_the_call_signature_holds_every_key(tma_in_interpreter):
    """On a TMA device a route's launch plan is pinned (launch.Plan: no key per launch) when the call
    signature holds every operand's dtype and alignment: not with a bias (nor codes of B, a
    pre-activation or a residual); operands of two dtypes are refused."""
    import flame.kernels.matmul as KM
    x = torch.randn(16, 32, dtype=torch.float16, device=DEVICE)
    w = torch.randn(24, 32, dtype=torch.float16, device=DEVICE)
    out = torch.empty(16, 24, dtype=torch.float16, device=DEVICE)
    KM.linear_(out, x, w)
    KM.linear_(out, x, w, torch.randn(24, dtype=torch.float16, device=DEVICE))
    pinned = [route.launch.pinned for route in KM._route.problems.values()]
    assert pinned == [True, False]
    with pytest.raises(TypeError, match="a and b must have one dtype"):
        KM.matmul_(out, x, w.t().float())


def test_a_kept_call_signature_runs_on_each_call_s_own_buffers(monkeypatch, tma_in_interpreter):
    """An entry point's repeated call signature runs its kept route (no ``_launch``) with that call's
    buffers (bias, pre-activation, low-rank term, residual); a buffer off 16-byte alignment on a TMA
    device goes through ``_launch`` each call."""
    import flame.kernels.matmul as KM
    launched, real = [], KM._launch
    monkeypatch.setattr(KM, "_launch", lambda *a: launched.append(a[3:6]) or real(*a))
    g = torch.Generator().manual_seed(2)
    relu = KE.RELU.value
    for _ in range(2):
        x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE) for s in ((2, 3, 8), (5, 8), (5,)))
        u, v = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE) for s in ((6, 2), (2, 5)))
        out = torch.empty(2, 3, 5, dtype=torch.float64, device=DEVICE)
        pre = torch.empty(2, 3, 5, dtype=torch.float64, device=DEVICE)
        KM.linear_(out, x, w, b, relu, pre, low_rank=(u, v, 0.5))
        want = x.reshape(6, 8) @ w.t() + 0.5 * u @ v + b
        torch.testing.assert_close(pre.reshape(6, 5), want)
        torch.testing.assert_close(out.reshape(6, 5), want.clamp_min(0))
        res = torch.randn(5, 8, generator=g, dtype=torch.float64).to(DEVICE)
        dw = res.clone()
        KM.matmul_(dw, KM.transposed(out), KM.matrix(x), alpha=2.0, residual=dw)
        torch.testing.assert_close(dw, 2.0 * out.reshape(6, 5).t() @ x.reshape(6, 8) + res)
    assert len(launched) == 2  # the first call of each signature
    h = torch.randn(2, 65, generator=g).half().to(DEVICE)  # on the device before the view is taken
    for _ in range(2):  # a view one element in: misaligned, described each call
        out = torch.empty(2, 16, dtype=torch.float16, device=DEVICE)
        KM.linear_(out, h[:, 1:], torch.randn(16, 64, generator=g).half().to(DEVICE))
    assert len(launched) == 4
