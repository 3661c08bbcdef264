"""GEMM routes (kernels/matmul.py): which kernel ``plan`` names for a problem and why, from its
description alone (an H200's routes on the CPU), every route of the comment block planned, the
launchers taking the route planned for their buffers, the memo following ``tune``, and
``FLAME_DEBUG_ROUTES``. The routes' numerics are tested in test_matmul.py, test_linear.py and
test_quant.py (they record the routes they take)."""
import re
from pathlib import Path

import pytest
import torch

import flame
import flame.kernels.matmul as KM
from flame import tune
from flame.kernels.elementwise import GELU_TANH
from tests.helpers import DEVICE, assert_within_torch_error

F32, BF16 = torch.float32, torch.bfloat16
H200 = dict(tma=True, gluon=True, sms=132)  # what an H200 with Gluon runs
LINEAR = dict(b_transposed=True)  # x W^T: the weight (N, K) read as B = W^T


@pytest.fixture(autouse=True)
def _fresh_routes(monkeypatch):
    """Each test plans afresh; the Gluon kernel's stages fit an H200's shared memory (the
    interpreter knows no limit)."""
    monkeypatch.setattr(KM.autotune, "shared_memory", lambda: 232_448)
    KM._route.cache_clear()
    yield
    KM._route.cache_clear()


def dense(M, N, K, dtype, **kw):
    return KM.GemmProblem.dense(M, N, K, dtype, **kw)


# (route, words of its reason, problem); configs are this process's (the interpreter's big blocks on
# the CPU), so the split-K problems have K long enough to split at those blocks too
ROUTE_CASES = [
    ("pointer", "no TMA", dense(33, 70, 45, F32)),
    ("pointer", "batch entries", dense(64, 48, 40, BF16, batch=(2, 3), **H200)),
    ("pointer", "K = 64 < 128", dense(256, 256, 64, BF16, **LINEAR, **H200)),
    ("pointer", "TMA cannot describe", dense(256, 264, 256, BF16, misaligned=("a",), **H200)),
    ("pointer", "TMA cannot describe", dense(256, 264, 256, BF16, out_dtype=F32, **H200)),  # C not in A's dtype
    ("pointer", "TMA cannot describe", dense(256, 260, 256, BF16, **H200)),  # C's rows not 16-byte multiples
    ("split_k", "slices of", dense(16, 16, 8192, F32, a_transposed=True, sms=132)),  # LoRA dA, fp32
    ("split_k", "K = 8192", dense(16, 640, 8192, BF16, a_transposed=True, **H200)),  # past _FEW_TILES_TMA_MAX_K
    ("tma", "16-bit operands TMA can describe", dense(4096, 640, 640, BF16, bias=True, **LINEAR, tma=True, sms=132)),
    # LoRA's low-rank term: the Gluon kernel's last k block where U's rows and V's (in B's layout) are TMA rows
    ("gluon", "tiles per consumer", dense(4608, 3072, 3072, BF16, rank=16, sv=(1, 16), **LINEAR, **H200)),  # Y
    ("gluon", "tiles per consumer", dense(4608, 3072, 3072, BF16, rank=16, **H200)),  # dX = dY W + dH A
    ("tma", "Gluon kernel does not take it", dense(4608, 3072, 3072, BF16, rank=16, **LINEAR, **H200)),  # V along N
    ("tma", "Gluon kernel does not take it", dense(4608, 3072, 3072, BF16, rank=12, **H200)),  # 24-byte rows of U
    ("tma", "Gluon kernel does not take it", dense(4608, 3072, 3072, BF16, rank=16, misaligned=("u",), **H200)),
    ("tma", "Gluon kernel does not take it", dense(4096, 320, 640, BF16, **LINEAR, **H200)),  # fewer tiles than SMs
    ("gluon", "tiles per consumer", dense(4608, 3072, 3072, BF16, **LINEAR, **H200)),
    ("gluon", "tiles per consumer", dense(4608, 3072, 3072, BF16, act=GELU_TANH.value, pre_out=True, bias=True,
                                          **LINEAR, **H200)),
    ("low_rank_apart", "rank 70 above 64", dense(64, 48, 40, F32, rank=70)),
    ("low_rank_apart", "K splits", dense(16, 16, 8192, F32, a_transposed=True, rank=16, sms=132)),
    ("fp8_dequant", "4608 rows", dense(4608, 3072, 3072, BF16, b_fp8=1, bias=True, **LINEAR, **H200)),
    ("fp8_dequant", "FLAME_FP8_GEMM=dequant", dense(7, 17, 33, F32, b_fp8=2, fp8_gemm="dequant")),
    ("tma", "fp8 B decoded in the main loop", dense(256, 3072, 1024, BF16, b_fp8=1, **LINEAR, **H200)),
    ("pointer", "fp8 B decoded in the main loop", dense(4608, 17, 33, F32, b_fp8=2)),  # the interpreter: inline
    ("fp8_w8a8", "fp8 x fp8 wgmma", dense(4608, 3072, 3072, BF16, b_fp8=1, fp8_gemm="w8a8", bias=True, **LINEAR,
                                          **H200)),
    ("fp8_w8a8", "without the fp8 kernel here", dense(33, 17, 48, F32, b_fp8=1, fp8_gemm="w8a8", **LINEAR)),
    ("fp8_w8a8", "without the fp8 kernel here", dense(4608, 3072, 3000, BF16, b_fp8=1, fp8_gemm="w8a8", **LINEAR,
                                                      **H200)),  # K not a multiple of 16: codes TMA cannot read
]


@pytest.mark.parametrize("route,why,problem", ROUTE_CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_plan_names_each_route(route, why, problem):
    got = KM.plan(problem)
    assert got.kernel == route and why in got.reason, got
    assert got.splits > 1 if route == "split_k" else got.splits >= 1, got
    assert (got.grid == ()) == (route in ("gluon", "low_rank_apart", "fp8_dequant", "fp8_w8a8")), got
    assert (got.layout is not None) == (route in ("tma", "gluon") or (route == "fp8_w8a8" and not got.then)), got


def test_composite_routes_name_their_steps():
    """low_rank_apart: the GEMM without the term, then the term (U V into the output, K = rank);
    fp8_dequant: the plain GEMM on a dequantised B of A's dtype (contiguous in the codes' shape)."""
    apart = KM.plan(dense(16, 16, 8192, F32, a_transposed=True, rank=16, sms=132))
    (base_p, base), (term_p, term) = apart.then
    assert (base.kernel, term.kernel, apart.splits) == ("split_k", "pointer", base.splits)
    assert (base_p.rank, base_p.K, term_p.K, term_p.residual, term_p.sa, term_p.sb) == (
        0, 8192, 16, True, (0, 0, 16, 1), (0, 0, 16, 1))
    with pytest.raises(ValueError, match="without an activation"):
        KM.plan(dense(64, 48, 40, F32, rank=70, act=GELU_TANH.value))
    dequant = KM.plan(dense(4608, 3072, 1024, BF16, b_fp8=1, **LINEAR, **H200))
    ((plain_p, plain),) = dequant.then
    assert plain.kernel == "gluon" and plain_p.b_fp8 == 0 and plain_p.sb == (0, 0, 1, 1024)
    rows = KM.plan(dense(4608, 1024, 3072, BF16, b_fp8=2, **H200))  # dX = dY W: B is W itself
    assert rows.kernel == "fp8_dequant" and rows.then[0][0].sb == (0, 0, 1024, 1)
    with pytest.raises(ValueError, match="FLAME_FP8_GEMM must be one of auto, inline, dequant, w8a8"):
        KM.plan(dense(7, 17, 33, F32, b_fp8=2, fp8_gemm="sometimes"))
    # W8A8: a LoRA term by a second GEMM after the fp8 product; with an activation, the weight-only route;
    # the input gradient (a scale per row of B) as without W8A8
    w8a8 = dict(b_fp8=1, fp8_gemm="w8a8", **LINEAR, **H200)
    lora = KM.plan(dense(4608, 3072, 3072, BF16, rank=16, **w8a8))
    assert [step.kernel for _, step in lora.then] == ["pointer", "fp8_w8a8"] and lora.config["term_first"]
    assert lora.then[1][0].residual and not lora.then[0][0].residual  # the product reads the term back
    assert KM.plan(dense(4608, 3072, 3072, BF16, rank=16, act=GELU_TANH.value, **w8a8)).kernel == "fp8_dequant"
    assert KM.plan(dense(4608, 1024, 3072, BF16, b_fp8=2, fp8_gemm="w8a8", **H200)).kernel == "fp8_dequant"
    emulated = KM.plan(dense(33, 17, 48, F32, b_fp8=1, fp8_gemm="w8a8", **LINEAR))
    ((codes_p, then),) = emulated.then
    assert codes_p.sa == (0, 0, 48, 1) and codes_p.fp8_gemm == "auto" and then.kernel == "pointer"


def test_every_route_of_the_comment_block_is_planned():
    """The routes listed above ``ROUTES`` in kernels/matmul.py are ROUTES, each has a runner, and
    ROUTE_CASES plans every one of them."""
    source = (Path(KM.__file__)).read_text()
    block = source[source.index("# ---- routes: which kernel runs a GEMM"):source.index("\nROUTES = ")]
    listed = re.findall(r'^#   "(\w+)"', block, re.M)
    assert listed == list(KM.ROUTES) and set(KM._RUN) == set(listed)
    assert {case[0] for case in ROUTE_CASES} == set(listed)


def test_routes_are_memoised_and_follow_tune():
    """One Route per problem until ``tune.override`` or ``tune.reset`` empties the memo."""
    p = dense(40, 36, 24, F32)
    first = KM.plan(p)
    assert KM.plan(KM.GemmProblem(*p)) is first
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)
    with tune.override("matmul", cfg):
        assert KM.plan(p).config["BLOCK_M"] == 16
    assert KM.plan(p).config == first.config


# what the entry points launch, as problems described from shapes: (call, problems by dense)
def _linear(x, w, bias):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=DEVICE)
    KM.linear_(out, x, w, bias, act=GELU_TANH.value)


def test_launchers_plan_the_problem_of_their_buffers(monkeypatch, tma_in_interpreter):
    """``_launch`` describes real buffers as ``GemmProblem.dense`` describes their shapes (a
    linear's forward, its input and weight gradients, a batched matmul), and runs the route of it."""
    seen = []
    monkeypatch.setattr(KM, "plan", lambda p, real=KM.plan: seen.append(p) or real(p))
    gluon = KM.matmul_hopper.ROUTE and KM.matmul_hopper.available()
    device = dict(tma=True, gluon=gluon, gpu=not flame.is_interpreter(), sms=flame.runtime.num_sms())
    x = torch.randn(24, 160, device=DEVICE).half()
    w = torch.randn(144, 160, device=DEVICE).half()
    g = torch.randn(24, 144, device=DEVICE).half()
    _linear(x, w, torch.randn(144, device=DEVICE).half())
    KM.matmul_(torch.empty(24, 160, dtype=torch.half, device=DEVICE), g, w)
    KM.matmul_(torch.empty(144, 160, dtype=torch.half, device=DEVICE), g.t(), x)
    a, b = torch.randn(2, 3, 8, 5, device=DEVICE), torch.randn(2, 3, 5, 7, device=DEVICE)
    KM.matmul_(torch.empty(2, 3, 8, 7, device=DEVICE), a, b)
    assert seen == [
        dense(24, 144, 160, torch.half, bias=True, act=GELU_TANH.value, **LINEAR, **device),
        dense(24, 160, 144, torch.half, **device),
        dense(144, 160, 24, torch.half, a_transposed=True, **device),
        dense(8, 7, 5, F32, batch=(6,), **dict(device, tma=False, gluon=False)),  # (2, 3) collapsed
    ]


def test_launches_plan_each_call_signature_once(monkeypatch, tma_in_interpreter):
    """``_launch`` describes a call signature once (one ``GemmProblem``) and takes its route from the
    memo after that; what the problem is made of changes the signature: an operand's alignment, the
    TMA switch, FLAME_FP8_GEMM read at call time. ``tune``'s resets empty the memo, and while ``plan``
    is replaced every launch asks it."""
    monkeypatch.setattr(KM, "launch", lambda kernel, grid, *args, **meta: None)  # routes only: no kernel runs
    built = []
    monkeypatch.setattr(KM, "_problem", lambda *args, real=KM._problem: built.append(real(*args)) or built[-1])

    def routes_of(call, times=2):
        """The kernels of the routes of the problems ``call`` described (``times`` calls of it)."""
        first = len(built)
        for _ in range(times):
            call()
        return [KM.plan(p).kernel for p in built[first:]]

    x = torch.randn(24 * 160 + 8, device=DEVICE).half()
    w = torch.randn(144, 160, device=DEVICE).half()
    codes, scale = w.float().to(torch.float8_e4m3fn), torch.ones(144, device=DEVICE)
    out = torch.empty(24, 144, dtype=torch.half, device=DEVICE)
    aligned, misaligned = x[:-8].view(24, 160), x[1:-7].view(24, 160)
    assert routes_of(lambda: KM.linear_(out, aligned, w), times=3) == ["tma"]
    assert routes_of(lambda: KM.linear_(out, misaligned, w)) == ["pointer"] and built[-1].misaligned == ("a",)
    assert routes_of(lambda: KM.linear_(out, aligned, codes, w_scale=scale)) == ["tma"]
    monkeypatch.setattr(KM, "FP8_ROUTE", "dequant")
    assert routes_of(lambda: KM.linear_(out, aligned, codes, w_scale=scale)) == ["fp8_dequant"]
    monkeypatch.setattr(KM, "TMA", False)
    assert routes_of(lambda: KM.linear_(out, aligned, w)) == ["pointer"]
    with tune.override("matmul", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)):
        assert routes_of(lambda: KM.linear_(out, aligned, w)) == ["pointer"]
        assert KM.plan(built[-1]).config["BLOCK_M"] == 16
    assert routes_of(lambda: KM.linear_(out, aligned, w)) == ["pointer"]  # planned again after the override
    monkeypatch.setattr(KM, "plan", lambda p, real=KM.plan: real(p))
    assert routes_of(lambda: KM.linear_(out, aligned, w)) == ["pointer", "pointer"]


def test_switched_off_operands_are_none(monkeypatch):
    """No dummy pointers: a plain GEMM passes None for every fusion operand and split-K's scratch
    (Triton specialises them away); a bias is passed as itself."""
    launched = []
    monkeypatch.setattr(KM, "launch", lambda kernel, grid, *args, **meta: launched.append(args))
    a, b, bias = torch.randn(8, 5), torch.randn(5, 7), torch.randn(7)
    KM.matmul_(torch.empty(8, 7), a, b)
    KM.linear_(torch.empty(8, 7), a, b.t(), bias)
    plain, with_bias = launched
    assert plain[3:11] == (None,) * 8  # bias, pre_out, residual, u, v, b_scale, part, counts
    assert with_bias[3] is bias and with_bias[4:11] == (None,) * 7


def test_debug_routes_prints_each_problem_once(monkeypatch, capsys):
    """FLAME_DEBUG_ROUTES=1 (read at import; here switched on directly): one line per distinct
    problem on stderr, naming the route and why."""
    monkeypatch.setattr(KM, "DEBUG_ROUTES", True)
    monkeypatch.setattr(KM, "_reported", set())
    apart = dense(64, 48, 40, F32, rank=70)
    for p in (apart, apart, dense(33, 70, 45, F32), apart):
        KM.plan(p)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "low_rank_apart" in lines[0] and "rank 70" in lines[0], lines
    assert "pointer" in lines[1] and "no TMA" in lines[1], lines


@pytest.mark.gpu
def test_gpu_launches_take_the_planned_routes(monkeypatch):
    """On an H200: SDXL/Flux-sized GEMMs take gluon, tma, split_k and fp8_dequant for real buffers,
    each within 2x PyTorch's bf16 error."""
    from flame.ops.quant import quantize_fp8
    if not (KM.TMA and KM.tma_available()):
        pytest.skip("no TMA on this GPU / Triton")
    taken = []
    monkeypatch.setattr(KM, "plan", lambda p, real=KM.plan: taken.append(real(p).kernel) or real(p))
    x = torch.randn(4608, 3072, device=DEVICE).bfloat16()
    w = (torch.randn(3072, 3072, device=DEVICE) / 3072 ** 0.5).bfloat16()
    out = torch.empty(4608, 3072, dtype=BF16, device=DEVICE)
    KM.linear_(out, x, w)
    assert_within_torch_error(out, x @ w.t(), x.float() @ w.float().t(), 2)
    q = quantize_fp8(flame.from_torch(w.float()))
    wd = (q._data.float() * q.scale[:, None]).bfloat16()
    KM.linear_(out, x, q._data, w_scale=q.scale)
    assert_within_torch_error(out, x @ wd.t(), x.float() @ wd.float().t(), 2)
    h, dz = torch.randn(4096, 16, device=DEVICE).bfloat16(), torch.randn(4096, 640, device=DEVICE).bfloat16()
    da = torch.empty(16, 640, dtype=BF16, device=DEVICE)
    KM.matmul_(da, h.t(), dz)  # LoRA's dA over 4096 tokens
    assert_within_torch_error(da, h.t() @ dz, h.float().t() @ dz.float(), 2)
    y = torch.empty(4096, 320, dtype=BF16, device=DEVICE)
    KM.linear_(y, dz, w[:320, :640])  # fewer 128x128 tiles than SMs: not the Gluon kernel
    gluon = KM.matmul_hopper.available() and KM.matmul_hopper.ROUTE
    assert taken == ["gluon" if gluon else "tma", "fp8_dequant", "split_k", "tma"], taken
