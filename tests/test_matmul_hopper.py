"""The warp-specialised Gluon GEMM for Hopper (flame/kernels/matmul_hopper.py): every schedule and
tile shape against PyTorch (fp32 references, tails in M, N and K), each epilogue, the backward
products' operand layouts, matmul.py's portable kernel, and the route; on the interpreter, that
the dispatch never picks it."""

import pytest
import torch

import flame
import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
from flame.kernels.elementwise import GELU_TANH
from tests.helpers import DEVICE, assert_within_torch_error, without_gluon

# (COOP, BLOCK_M, BLOCK_N) per consumer: the shapes _choose picks from (the first four; 160 columns are
# a 128-wide and a 32-wide block) and three more (192 = 128 + 64)
SCHEDULES = [(True, 64, 256), (False, 128, 128), (False, 64, 128), (True, 64, 160), (False, 64, 256),
             (True, 128, 128), (False, 128, 160), (True, 64, 192)]
# (M, K, N): tails in every dim (row strides stay multiples of 16 bytes, as TMA needs), a problem
# smaller than one tile, and one with more tiles than SMs
SHAPES = [(333, 264, 520), (1000, 1000, 1000), (64, 128, 64), (4608, 3072, 3072)]


def _needs_hopper():
    if not KH.available():
        pytest.skip("needs an sm_90 GPU with triton.experimental.gluon")


def _gluon(out, a, b, f, schedule, split_k=1):
    """``out`` = the epilogue ``f`` of a @ b (b (K, N), any strides) by the Gluon kernel with this
    schedule and ``split_k`` splits of K, its stages as many as fit."""
    coop, bm, bn = schedule
    M, K = a.shape
    N = b.shape[1]
    layout = KM._tma_layout(out, a, b, f, a.stride(), b.stride(), out.stride())
    assert layout is not None and KH.usable(a, b, f, layout[1])
    return KH.matmul(out, a, b, M, N, K, f, layout, KH.config(coop=coop, block_m=bm, block_n=bn, split_k=split_k))


def _inputs(M, K, N, dtype=torch.bfloat16):
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    return x, w, bias


def _nan(M, N, dtype=torch.bfloat16):
    return torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_gpu_linear_within_torch_error(schedule, M, K, N):
    """y = x W^T + b, x (M, K) and W (N, K) row-major (the forward linear): every element written,
    error against fp32 at most 2x PyTorch's bf16 one."""
    _needs_hopper()
    x, w, bias = _inputs(M, K, N)
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(bias), schedule)
    assert not out.isnan().any()
    ref = x.float() @ w.float().t() + bias.float()
    assert_within_torch_error(out, torch.nn.functional.linear(x, w, bias), ref, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES[:4])
def test_gpu_epilogues(schedule):
    """Bias + GELU (tanh) with and without the pre-activation stored; alpha with a residual, also
    accumulated in place (the residual is the output); fp16 operands."""
    _needs_hopper()
    M, K, N = 777, 520, 392
    x, w, bias = _inputs(M, K, N)
    pre_ref = x.float() @ w.float().t() + bias.float()
    gelu = torch.nn.functional.gelu
    want = gelu(pre_ref, approximate="tanh")
    torch_out = gelu(torch.nn.functional.linear(x, w, bias), approximate="tanh")
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(bias, act=GELU_TANH.value), schedule)
    assert_within_torch_error(out, torch_out, want, 2)
    pre = _nan(M, N)
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(bias, act=GELU_TANH.value, pre_out=pre), schedule)
    assert_within_torch_error(out, torch_out, want, 2)
    assert_within_torch_error(pre, torch.nn.functional.linear(x, w, bias), pre_ref, 2)

    r = torch.randn(M, N, device=DEVICE).bfloat16()
    want = 0.5 * (x.float() @ w.float().t()) + r.float()
    torch_out = 0.5 * (x @ w.t()) + r
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(alpha=0.5, residual=r), schedule)
    assert_within_torch_error(out, torch_out, want, 2)
    out = r.clone()
    _gluon(out, x, w.t(), KM.Fusion(alpha=0.5, residual=out), schedule)
    assert_within_torch_error(out, torch_out, want, 2)

    x16, w16, bias16 = _inputs(M, K, N, torch.float16)
    out = _gluon(_nan(M, N, torch.float16), x16, w16.t(), KM.Fusion(bias16), schedule)
    ref = x16.float() @ w16.float().t() + bias16.float()
    assert_within_torch_error(out, torch.nn.functional.linear(x16, w16, bias16), ref, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES[:4])
@pytest.mark.parametrize("split_k", [2, 3])
def test_gpu_split_k(schedule, split_k):
    """K in 2 or 3 splits (16 k blocks: the last split of 3 runs 2 blocks past K, zero-filled),
    each split's fp32 product summed with the whole epilogue (bias, GELU, pre-activation, alpha and
    a residual) by the split-K sum; 1000 rows: the last program tile's rows past M stay in its split's
    slice of the scratch (slices rounded up to tiles)."""
    _needs_hopper()
    M, K, N = 1000, 1000, 392
    x, w, bias = _inputs(M, K, N)
    pre_ref = x.float() @ w.float().t() + bias.float()
    gelu = torch.nn.functional.gelu
    pre = _nan(M, N)
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(bias, act=GELU_TANH.value, pre_out=pre), schedule, split_k)
    assert_within_torch_error(out, gelu(torch.nn.functional.linear(x, w, bias), approximate="tanh"),
                              gelu(pre_ref, approximate="tanh"), 2)
    assert_within_torch_error(pre, torch.nn.functional.linear(x, w, bias), pre_ref, 2)
    r = torch.randn(M, N, device=DEVICE).bfloat16()
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(alpha=0.5, residual=r), schedule, split_k)
    assert_within_torch_error(out, 0.5 * (x @ w.t()) + r, 0.5 * (x.float() @ w.float().t()) + r.float(), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES[:4] + SCHEDULES[6:7])
@pytest.mark.parametrize("rank", [16, 40])
def test_gpu_low_rank_term(schedule, rank):
    """LoRA's low-rank term U V as each tile's last k block (the rank zero-filled up to BLOCK_K):
    the forward's layout (B = W^T and V = B_lora^T read along K, beta != alpha, a bias and a residual)
    and the input gradient's (B = W and V = A_lora read along N, with a pre-activation kept)."""
    _needs_hopper()
    M, K, N = 1000, 264, 520
    x, w, bias = _inputs(M, K, N)
    u = torch.randn(M, rank, device=DEVICE).bfloat16()
    lora_b = (torch.randn(N, rank, device=DEVICE) * rank ** -0.5).bfloat16()
    r = torch.randn(M, N, device=DEVICE).bfloat16()
    f = KM.Fusion(bias, alpha=0.75, residual=r, low_rank=(u, lora_b.t(), 0.5))
    assert KH.usable(x, w.t(), f)
    out = _gluon(_nan(M, N), x, w.t(), f, schedule)
    ref = 0.75 * (x.float() @ w.float().t()) + 0.5 * (u.float() @ lora_b.float().t()) + bias.float() + r.float()
    composed = 0.75 * (x @ w.t()) + 0.5 * (u @ lora_b.t()) + bias + r
    assert_within_torch_error(out, composed, ref, 2)
    dy = torch.randn(M, N, device=DEVICE).bfloat16()
    lora_a = (torch.randn(rank, K, device=DEVICE) * rank ** -0.5).bfloat16()
    pre = _nan(M, K)
    f = KM.Fusion(act=GELU_TANH.value, pre_out=pre, low_rank=(u, lora_a, 1.0))
    assert KH.usable(dy, w, f, b_k=False)
    out = _gluon(_nan(M, K), dy, w, f, schedule)
    ref = dy.float() @ w.float() + u.float() @ lora_a.float()
    gelu = torch.nn.functional.gelu
    assert_within_torch_error(pre, dy @ w + u @ lora_a, ref, 2)
    assert_within_torch_error(out, gelu(dy @ w + u @ lora_a, approximate="tanh"), gelu(ref, approximate="tanh"), 2)


def test_choose_splits_long_k_below_a_wave(monkeypatch):
    """``_choose(split=True)`` (convolutions) splits the long K of a problem under a wave of tiles where
    that is predicted faster; plain GEMMs under a wave and short K stay unsplit (None: the TMA
    kernel)."""
    monkeypatch.setattr(KH.autotune, "shared_memory", lambda: 232_448)
    assert KH._choose(1024, 1280, 11520, sms=132, split=True)["SPLIT_K"] == 2  # SDXL's 32x32 convolution
    assert KH._choose(1024, 1280, 11520, sms=132) is None
    assert KH._choose(1024, 1280, 1280, sms=132, split=True) is None
    assert KH._choose(1000, 1280, 11520, sms=132, split=True)["SPLIT_K"] == 2
    assert KH.split_rows(1000, KH.config(coop=True, block_m=64)) == 1024
    assert KH._choose(32768, 320, 2880, sms=132, split=True)["SPLIT_K"] == 1


@pytest.mark.skipif(KH.gluon is None, reason="needs triton.experimental.gluon (its host descriptors)")
@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "input_grad"])
def test_conv_launch_describes_pixel_boxes(transposed, monkeypatch):
    """What a convolution's launch hands the kernel (host side, no GPU): the source as a 4-D
    descriptor of boxes of BLOCK_M output pixels' rows x 64 channels, the weight as a (Co, taps * Ci)
    matrix read along K (forward) or N (input gradient), C as the (pixels, channels) rows, every tap's
    channel blocks as K, the geometry with the taps' stride along B; with K split, C is the fp32
    scratch of the splits' products."""
    monkeypatch.setattr(KH.autotune, "shared_memory", lambda: 232_448)
    nb, hw, c, n = 2, 32, 200, 320  # 200 channels: 4 blocks of 64 a tap, the last past C
    src = torch.empty(nb, c, hw, hw, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.empty(c, n, 3, 3, dtype=torch.bfloat16) if transposed else torch.empty(n, c, 3, 3, dtype=torch.bfloat16)
    w = w.contiguous(memory_format=torch.channels_last)
    out = torch.empty(nb, n, hw, hw, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    M = nb * hw * hw
    strides = (src.stride(0), src.stride(2), src.stride(3))
    conv = KH.Conv(nb, hw, hw, c, strides, hw, hw, 3, 3, 1 if transposed else -1, -1 if transposed else 1,
                   1 if transposed else -1, -1 if transposed else 1, KH.box_rows(64, hw, hw))
    layout = (True, not transposed, 0, w.stride(0), n)
    for splits in (1, 2):
        cfg = KH.config(coop=True, block_m=64, block_n=160, split_k=splits)
        kept = KH._Launch(out, src, w, M, n, 9 * c, KM.Fusion(), layout, cfg, False, False, conv)
        a, b, bt, c_desc, ct = kept.descriptors[:5]
        assert (a.shape, a.strides, a.block_shape) == ([nb, hw, hw, c], [*strides, 1], [1, 2, 32, 64])
        want_b = ([c, 9 * n], [64, 128], [64, 32]) if transposed else ([n, 9 * c], [128, 64], [32, 64])
        assert (b.shape, b.block_shape, bt.block_shape) == want_b
        assert c_desc.shape == [splits * M, n] and (c_desc.block_shape, ct.block_shape) == ([64, 128], [64, 32])
        assert kept.k == 9 * 4 * 64 and kept.geometry == (hw, hw, c, 3, *conv[9:13], n if transposed else c)
        assert kept.plan.meta["BOX_H"] == 2 and kept.plan.meta["SPLIT_K"] == splits


@pytest.mark.skipif(KH.gluon is None, reason="needs triton.experimental.gluon (its host descriptors)")
@pytest.mark.parametrize("layout", ["forward", "input_grad"])
def test_low_rank_launch_describes_u_and_v(layout, monkeypatch):
    """What a launch with LoRA's low-rank term hands the kernel (host side, no GPU): U (M, r) as A's
    blocks of BLOCK_M rows x a 64-deep k block and V as B's, in B's layout (forward: V^T = B_lora (N, r)
    read along the rank; input gradient: A_lora (r, N) read along N), a block per part of the tile's
    columns (160 = 128 + 32); the accumulator's ratio alpha / beta; none of the three without a term."""
    monkeypatch.setattr(KH.autotune, "shared_memory", lambda: 232_448)
    M, K, N, r = 1000, 264, 520, 16
    a = torch.empty(M, K, dtype=torch.bfloat16)
    u = torch.empty(M, r, dtype=torch.bfloat16)
    if layout == "forward":  # B = W^T, W (N, K); V = B_lora^T, B_lora (N, r)
        b, v = torch.empty(N, K, dtype=torch.bfloat16).t(), torch.empty(N, r, dtype=torch.bfloat16).t()
        want_v = ([N, r], [128, 64], [32, 64])
    else:  # B = W (K, N) row-major; V = A_lora (r, N)
        b, v = torch.empty(K, N, dtype=torch.bfloat16), torch.empty(r, N, dtype=torch.bfloat16)
        want_v = ([r, N], [64, 128], [64, 32])
    out = torch.empty(M, N, dtype=torch.bfloat16)
    f = KM.Fusion(alpha=0.75, low_rank=(u, v, 0.5))
    b_k = layout == "forward"
    lay = (True, b_k, K, K if b_k else N, N)  # matmul._tma_layout's, which needs a TMA device

    def serves(f):
        return KH.serves(torch.bfloat16, f.rank, False, False, f.u_strides, f.v_strides, b_k)

    assert serves(f)
    cfg = KH.config(coop=True, block_m=64, block_n=160)
    kept = KH._Launch(out, a, b, M, N, K, f, lay, cfg, False, False, None)
    u_desc, v_desc, vt_desc = kept.descriptors[9:12]
    assert (u_desc.shape, u_desc.block_shape) == ([M, r], [64, 64])
    assert (v_desc.shape, v_desc.block_shape, vt_desc.block_shape) == want_v
    assert kept.plan.meta["LOW_RANK"] and f.rank_ratio == 1.5 and f.scale == 0.5
    with pytest.raises(ValueError, match="low-rank term"):
        KH.matmul(out, a, b, M, N, K, f, lay, KH.config(coop=True, block_m=64, block_n=160, split_k=2))
    plain = KH._Launch(out, a, b, M, N, K, KM.Fusion(), lay, cfg, False, False, None)
    assert plain.descriptors[9:12] == (None, None, None) and not plain.plan.meta["LOW_RANK"]
    across = v.contiguous() if layout == "forward" else v.t().contiguous().t()  # V not in B's layout
    assert not serves(KM.Fusion(low_rank=(u, across, 0.5)))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES[:4])
def test_gpu_backward_layouts(schedule):
    """The linear's backward products: dX = dY W (B row-major (K, N): N-contiguous blocks) and
    dW = dY^T X (A = dY^T, M-contiguous: transposed A blocks)."""
    _needs_hopper()
    M, K, N = 1000, 264, 520  # the forward's rows, in and out features
    x, w, _ = _inputs(M, K, N)
    dy = torch.randn(M, N, device=DEVICE).bfloat16()
    dx = _gluon(_nan(M, K), dy, w, KM.Fusion(), schedule)
    assert_within_torch_error(dx, dy @ w, dy.float() @ w.float(), 2)
    dw = _gluon(_nan(N, K), dy.t(), x, KM.Fusion(), schedule)
    assert_within_torch_error(dw, dy.t() @ x, dy.float().t() @ x.float(), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES[:4])
def test_gpu_matches_portable_kernel(monkeypatch, schedule):
    """The same problem through matmul.py's portable kernel (TMA and Gluon routes off): both
    accumulate in fp32 and round once, so they differ by at most a bf16 rounding step."""
    _needs_hopper()
    M, K, N = 1000, 1000, 1000
    x, w, bias = _inputs(M, K, N)
    out = _gluon(_nan(M, N), x, w.t(), KM.Fusion(bias, act=GELU_TANH.value), schedule)
    monkeypatch.setattr(KM, "TMA", False)
    portable = KM.linear_(_nan(M, N), x, w, bias, act=GELU_TANH.value)
    torch.testing.assert_close(out, portable, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_route(monkeypatch):
    """linear_ takes the Gluon kernel where ``plan`` gives a config (a big Flux GEMM), the TMA
    kernel where it gives none, and never with FLAME_MATMUL_GLUON=0 (``ROUTE``)."""
    _needs_hopper()
    calls = []
    real = KH.matmul
    monkeypatch.setattr(KH, "matmul", lambda *a: calls.append(a[3:6]) or real(*a))
    for M, K, N in ((4608, 3072, 3072), (64, 128, 64)):
        x, w, bias = _inputs(M, K, N)
        out = KM.linear_(_nan(M, N), x, w, bias)
        assert_within_torch_error(out, torch.nn.functional.linear(x, w, bias), x.float() @ w.float().t() + bias, 2)
    assert calls == [(M, N, K) for M, K, N in ((4608, 3072, 3072), (64, 128, 64))
                     if KH.plan(M, N, K, x, w, KM.Fusion()) is not None]
    monkeypatch.setattr(KH, "ROUTE", False)
    calls.clear()
    x, w, bias = _inputs(4608, 3072, 3072)
    KM.linear_(_nan(4608, 3072), x, w, bias)
    assert calls == []


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's dispatch")
def test_interpreter_never_routes_to_gluon(monkeypatch, tma_in_interpreter):
    """On the interpreter (even with the TMA kernel routed there) a 16-bit linear never reaches
    the Gluon kernel: it is not available and plans nothing."""
    def forbidden(*args):
        raise AssertionError("the Gluon GEMM was launched on the interpreter")

    monkeypatch.setattr(KH, "matmul", forbidden)
    monkeypatch.setattr(KH, "MIN_TILES_PER_SM", 0)
    assert not KH.available() and not KH.ROUTE
    x = torch.randn(16, 32, dtype=torch.float16)
    w = torch.randn(16, 32, dtype=torch.float16)
    assert KH.plan(16, 16, 32, x, w, KM.Fusion()) is None
    out = KM.linear_(torch.empty(16, 16, dtype=torch.float16), x, w)
    torch.testing.assert_close(out, (x.float() @ w.float().t()).half(), rtol=2e-3, atol=2e-3)


def test_module_loads_without_gluon(monkeypatch):
    """A Triton without ``triton.experimental.gluon``: the module still imports and plans nothing."""
    mod = without_gluon(KH, monkeypatch)
    assert not hasattr(mod, "_gemm_hopper_kernel")
    x = torch.zeros(256, 256, dtype=torch.bfloat16, device=DEVICE)
    assert not mod.usable(x, x, KM.Fusion())


def test_split_width():
    """A tile's columns as a power-of-two block and a smaller power-of-two tail (Gluon's blocks are
    powers of two); widths that do not split so are refused by name."""
    assert [KH.split_width(n) for n in (128, 160, 192, 256, 80)] == [(128, 0), (128, 32), (128, 64), (256, 0),
                                                                      (64, 16)]
    for n in (136, 224, 72):
        with pytest.raises(ValueError, match=f"BLOCK_N={n}"):
            KH.split_width(n)
