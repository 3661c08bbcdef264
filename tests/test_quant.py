"""fp8 base weights: quantisation against torch's float8_e4m3fn casts, the fp8-weight GEMMs (linear's
forward with its epilogues, the input gradient, the TMA and split-K routes), LoRA over an fp8 base,
``quantize_linears_``, and bad input.

Triton's interpreter runs every fp8 path on the CPU: the kernels encode and decode e4m3 codes with
integer and fp32 arithmetic (``flame/kernels/quant.py``), not Triton's float8 casts, whose rounding
the interpreter gets wrong. bf16 (and speed) is tested on the GPU only (``gpu`` marks)."""
import math

import pytest
import torch
from test_linear import TORCH_ACT

import flame
import flame.nn.functional as F
from flame import nn
from flame.kernels import matmul as KM
from flame.kernels import quant as KQ
from flame.ops.quant import Fp8Weight, dequantize_fp8, quantize_fp8
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, assert_within_torch_error, pair

E4M3 = torch.float8_e4m3fn


def torch_quantize(w, scale):
    """The reference: per-row absmax / 448 scales (1 for a zero row), and torch's e4m3fn cast of w
    over ``scale`` (flame's: torch on CUDA divides by a number as a multiplication by its reciprocal,
    a unit in the last place off IEEE division at times)."""
    s = (w.float().abs().amax(1).double() / 448).float()  # IEEE fp32 division (CUDA's "/ 448" multiplies)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (w.float() / scale[:, None]).to(E4M3), s


def codes(t):
    return t.view(torch.uint8)


def weight(n, k, dtype=torch.float32, seed=0):
    """A weight at the scale of PyTorch's Linear init, a zero row and a row of tiny values (e4m3's
    subnormals after scaling) included."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k)
    if n > 2:
        w[1] = 0
        w[2] *= 1e-3
        w[2, : min(k, 7)] = 1.0  # one large value: the rest of the row lands among the subnormals
    return w.to(dtype).to(DEVICE)


def rel_tol(dtype):
    """Errors of a K-term sum scale with the output's magnitude, not each element's (fp32 products
    run as tf32 on the GPU: inputs rounded to 10 mantissa bits, exact on the interpreter)."""
    r = 2e-3 if dtype == torch.float16 or not flame.is_interpreter() else 1e-5
    return lambda want: dict(rtol=r, atol=r * float(want.detach().abs().max()))


# ---- quantisation --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(37, 300), (5, 1100), (1, 1)], ids=str)
def test_quantize_matches_torch_cast(dtype, shape):
    w = weight(*shape, dtype)
    q = quantize_fp8(flame.from_torch(w))
    want_q, want_s = torch_quantize(w, q.scale)
    assert q.dtype == E4M3 and q.shape == shape and q.scale.dtype == torch.float32
    assert torch.equal(q.scale.cpu(), want_s.cpu())
    assert torch.equal(codes(q._data).cpu(), codes(want_q).cpu())


def test_quantize_reads_strides_and_rounds_ties_to_even():
    # every e4m3 value, and the midpoints between neighbours (ties), at scale 1: a transposed view
    finite = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    finite = finite[~finite.isnan()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, torch.tensor([0.0, 600.0, -1e4])])
    values = torch.cat([values, torch.zeros(-values.numel() % 8)]).reshape(8, -1).to(DEVICE)
    q = quantize_fp8(flame.from_torch(values.t().contiguous().t()), scale="one")
    want = values.clamp(-448, 448).to(E4M3)  # saturating (torch's cast gives NaN past 464)
    assert torch.equal(codes(q._data).cpu(), codes(want).cpu())
    assert torch.equal(q.scale.cpu(), torch.ones(8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_dequantize_matches_torch(dtype):
    w = weight(9, 70)
    q = quantize_fp8(flame.from_torch(w))
    got = dequantize_fp8(q, dtype)
    assert torch.equal(got.to_torch().cpu(), (q._data.float() * q.scale[:, None]).to(dtype).cpu())
    assert torch.equal(q.dequantize().to_torch(), dequantize_fp8(q).to_torch())


def test_fp8_codes_as_stored_keep_scale_one():
    """A tensor of float8_e4m3fn codes (a *_fp8_e4m3fn checkpoint's) is taken as it is."""
    raw = (weight(6, 40) * 300).to(E4M3)
    q = quantize_fp8(flame.Tensor(raw))
    assert torch.equal(codes(q._data).cpu(), codes(raw).cpu())
    assert torch.equal(q.scale.cpu(), torch.ones(6))
    # the same values decoded to bf16/fp32 by flame.io, quantised with scale="one": the same codes
    again = quantize_fp8(flame.from_torch(raw.float()), scale="one")
    assert torch.equal(codes(again._data).cpu(), codes(raw).cpu())


# ---- the fp8-weight GEMMs -------------------------------------------------------------------------

def _linear_case(x_shape, n_out, dtype, act, bias=True, seed=0):
    """flame's linear over an fp8 weight against torch's on the dequantised weight (fp32): output,
    and the gradients of x and the bias."""
    w = weight(n_out, x_shape[-1], seed=seed)
    q = quantize_fp8(flame.from_torch(w))
    wd = q._data.float() * q.scale[:, None]
    x, xt = pair(x_shape, dtype, requires_grad=True)
    b, bt = pair((n_out,), dtype, requires_grad=True) if bias else (None, None)
    y = F.linear(x, q, b, activation=act)
    g = torch.randn(y.shape, dtype=torch.float64).to(dtype).to(DEVICE)
    grads = (y * flame.from_torch(g)).sum().backward()
    xt32 = xt.detach().float().requires_grad_(True)
    bt32 = None if bt is None else bt.detach().float().requires_grad_(True)
    yt = TORCH_ACT[act](torch.nn.functional.linear(xt32, wd, bt32))
    (yt * g.float()).sum().backward()
    tol = rel_tol(dtype)
    assert_close(y.to_torch().float(), yt.detach(), **tol(yt))
    assert_close(grads[x].to_torch().float(), xt32.grad, **tol(xt32.grad))
    if bias:
        assert_close(grads[b].to_torch().float(), bt32.grad, **tol(bt32.grad))
    assert q not in grads


@pytest.mark.parametrize("act", list(TORCH_ACT))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_fp8_linear_matches_torch(act, dtype):
    _linear_case((2, 7, 33), 17, dtype, act)


@pytest.mark.parametrize("shape,n_out", [((5, 600), 300), ((1, 1), 1), ((40, 16), 3)], ids=str)
def test_fp8_linear_odd_shapes(shape, n_out):
    # K past the interpreter's 512-wide K block and N past its 256-wide N block: masked tails
    _linear_case(shape, n_out, torch.float32, None, bias=n_out != 3)


def test_fp8_linear_gradcheck():
    q = quantize_fp8(flame.from_torch(weight(5, 4)))
    x = flame.from_torch(torch.randn(2, 3, 4, dtype=torch.float64).to(DEVICE), requires_grad=True)
    b = flame.from_torch(torch.randn(5, dtype=torch.float64).to(DEVICE), requires_grad=True)
    gradcheck(lambda x, b: F.linear(x, q, b, activation="gelu"), [x, b])


def test_fp8_gemms_on_tma_route(tma_in_interpreter, monkeypatch):
    """The TMA kernel (emulated descriptors): forward with K-contiguous codes, input gradient with
    the codes read along N, both 16-byte aligned (K, N multiples of 16)."""
    routes = []  # ((M, N, K), route) of each GEMM
    monkeypatch.setattr(KM, "plan", lambda p, real=KM.plan: routes.append((p[:3], real(p))) or routes[-1][1])
    _linear_case((24, 160), 144, torch.float16, "silu")
    assert {mnk for mnk, route in routes if route.kernel == "tma"} == {(24, 144, 160), (24, 160, 144)}


def test_fp8_gemms_split_k(monkeypatch):
    """Split-K slices: the column scale applies to each slice's product, the row scale (dX) reads
    the slice's own rows."""
    monkeypatch.setattr(KM, "_k_splits", lambda tiles, K, block_k, sms: 3 if K % 3 == 0 else 1)
    KM._route.cache_clear()  # routes are memoised per problem: these plan afresh, and are forgotten after
    _linear_case((6, 48), 30, torch.float32, None)
    KM._route.cache_clear()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_fp8_gemms_through_a_dequantised_copy(monkeypatch, dtype):
    """The route the GPU takes for many rows: the weight dequantised to the activations' dtype, then
    the plain GEMM (forward and dX; LoRA's fused low-rank term too)."""
    monkeypatch.setattr(KM, "FP8_ROUTE", "dequant")
    _linear_case((2, 7, 33), 17, dtype, "gelu")
    _lora_case(dtype)


def test_fp8_linear_low_rank_term_apart():
    """lora_linear with a rank above the fused maximum: two launches, the first reading the codes."""
    _lora_case(torch.float32, rank=KM._MAX_FUSED_RANK + 1, dropout=0.0)


def _w8a8_reference(x, wd, bias, act):
    """torch's W8A8 forward in fp32: x's rows rounded to e4m3 with absmax / 448 scales, as flame's
    kernel (x times 448 / absmax, both quotients IEEE: through float64), times the dequantised weight."""
    x = x.float()
    amax = x.abs().amax(1).double()
    s = torch.where(amax > 0, amax / 448, 1.0).float()
    inverse = torch.where(amax > 0, 448 / amax, 1.0).float()
    xq = (x * inverse[:, None]).to(E4M3).float() * s[:, None]
    return TORCH_ACT[act](torch.nn.functional.linear(xq, wd, None if bias is None else bias.float()))


@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_w8a8_linear_rounds_activations_per_row(act):
    """W8A8 (``Fp8Weight.w8a8``, ``nn.use_w8a8_``): the forward rounds x to e4m3 per row (here,
    without the fp8 kernel: the codes decoded again), the input gradient is the weight-only one (x's
    rounding passed straight through), and the LoRA branch reads x unrounded."""
    q = quantize_fp8(flame.from_torch(weight(20, 48)))
    q.w8a8 = True
    wd = q._data.float() * q.scale[:, None]
    x32 = torch.randn(9, 48, dtype=torch.float64).float().to(DEVICE)
    x32[3] = 0  # a zero row: scale 1
    b32 = torch.randn(20).to(DEVICE)
    x = flame.from_torch(x32, requires_grad=True)
    y = F.linear(x, q, flame.from_torch(b32), activation=act)
    tol = rel_tol(torch.float32)  # tf32 products on the GPU
    want = _w8a8_reference(x32, wd, b32, act)
    assert_close(y.to_torch(), want, **tol(want))
    g = torch.randn(9, 20).to(DEVICE)
    dx = (y * flame.from_torch(g)).sum().backward()[x].to_torch()
    ref_pre = _w8a8_reference(x32, wd, b32, None)
    yt = TORCH_ACT[act](ref_pre.requires_grad_(True))
    (yt * g).sum().backward()
    want = ref_pre.grad @ wd
    assert_close(dx, want, **tol(want))
    layer, _ = _lora_pair(torch.float32, 4, 0.0, n_in=48, n_out=20, bias=False)
    assert nn.use_w8a8_(layer) == 1
    lx = flame.from_torch(x32)
    wq = layer.weight._data.float() * layer.weight.scale[:, None]
    lora = (x32 @ layer.lora_A.to_torch().t()) @ layer.lora_B.to_torch().t() * layer.scale
    want = _w8a8_reference(x32, wq, None, None) + lora
    assert_close(layer(lx).to_torch(), want, **tol(want))


# ---- LoRA over an fp8 base -------------------------------------------------------------------------

def _lora_pair(dtype, rank, dropout, n_in=24, n_out=20, bias=True):
    """(LoRALinear over an fp8 base, LoRALinear over an fp32 base holding the dequantised weight),
    the same adapters in both."""
    base = nn.Linear(n_in, n_out, bias=bias)
    base.weight._data.copy_(weight(n_out, n_in))
    ref = nn.Linear(n_in, n_out, bias=bias)
    fp8 = nn.Sequential(base)
    fp8.requires_grad_(False)
    ref.requires_grad_(False)
    nn.inject_lora(fp8, ["0"], rank=rank, alpha=rank / 2, dropout=dropout)
    nn.quantize_linears_(fp8)
    layer = fp8[0]
    ref.weight._data.copy_(layer.weight.dequantize()._data)
    if bias:
        ref.bias._data.copy_(base.bias._data)
    ref = nn.LoRALinear(ref, rank, rank / 2, dropout=dropout)
    layer.lora_B._data.copy_(torch.randn(layer.lora_B.shape).to(DEVICE) * 0.1)
    for p, r in ((layer.lora_A, ref.lora_A), (layer.lora_B, ref.lora_B)):
        r._data.copy_(p._data)
    if dtype != torch.float32:
        for m in (layer, ref):
            if m.bias is not None:
                m.bias._data = m.bias._data.to(dtype)
    return layer, ref


def _lora_case(dtype, rank=4, dropout=0.0):
    layer, ref = _lora_pair(dtype, rank, dropout)
    x = flame.from_torch(torch.randn(3, 5, 24).to(dtype).to(DEVICE), requires_grad=True)
    g = flame.from_torch(torch.randn(3, 5, 20).to(dtype).to(DEVICE))
    runs = []
    for m in (layer, ref):
        flame.manual_seed(7)  # the same dropout masks
        y = m(x)
        grads = (y * g).sum().backward()
        runs.append((y, grads[x], grads[m.lora_A], grads[m.lora_B]))
    tol = rel_tol(dtype)
    for got, want in zip(runs[0], runs[1]):
        want = want.to_torch().float()
        assert_close(got.to_torch().float(), want, **tol(want))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_over_fp8_base_matches_dequantised_base(dtype, dropout):
    _lora_case(dtype, dropout=dropout)


def test_lora_merge_and_fold_over_fp8_base():
    layer, ref = _lora_pair(torch.float32, 4, 0.0)
    x = flame.from_torch(torch.randn(4, 24).to(DEVICE))
    want = ref(x).to_torch()
    before = layer.weight.dequantize().to_torch()
    layer.merge()
    assert isinstance(layer.weight, Fp8Weight) and layer._base_layer.weight is layer.weight
    # W + s B A rounded to e4m3 once more: within half a code step of each channel
    merged = layer(x).to_torch()
    merged_w = layer.weight.dequantize().to_torch()
    assert_close(merged, want, rtol=0.1, atol=0.05 * float(want.abs().max()))
    layer.unmerge()
    # back to within e4m3's rounding: half a step of each value (2^-4 relative) twice, the merged
    # rows' steps bounding the first
    err = (layer.weight.dequantize().to_torch() - before).abs()
    assert (err <= 2 ** -4 * (before.abs() + merged_w.abs().amax(1, keepdim=True))).all()
    base = layer.fold(1.0)
    assert isinstance(base.weight, Fp8Weight)
    assert_close(base(x).to_torch(), want, rtol=0.1, atol=0.05 * float(want.abs().max()))
    lora = nn.lora_state_dict(nn.Sequential(ref))
    assert sorted(lora) == ["unet.0.lora_A.weight", "unet.0.lora_B.weight"]


# ---- quantize_linears_ -------------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
                                     for _ in range(2)])
        self.norm = nn.LayerNorm(16)
        self.proj_out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            x = x + block(x)
        return self.proj_out(self.norm(x))


def test_quantize_linears_converts_frozen_layers_in_place():
    net = Net()
    net.requires_grad_(False)
    net.blocks[1][2].weight = net.blocks[0][2].weight  # tied: converted once, stays shared
    nn.inject_lora(net, ["blocks.0.0"], rank=2)
    x = flame.from_torch(torch.randn(3, 8).to(DEVICE))
    done = nn.quantize_linears_(net, "fp8_e4m3", skip=["proj_out"])
    assert done == ["proj_in", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert net.blocks[1][2].weight is net.blocks[0][2].weight
    assert not isinstance(net.proj_out.weight, Fp8Weight) and net.norm.weight.dtype == torch.float32
    lora = net.blocks[0][0]
    assert isinstance(lora.weight, Fp8Weight) and lora._base_layer.weight is lora.weight
    assert lora.lora_A.dtype == torch.float32 and lora.lora_A.requires_grad and lora.bias.dtype == torch.float32
    assert nn.quantize_linears_(net) == ["proj_out"]  # the rest is fp8 already
    assert net(x).shape == (3, 4)
    # inject_lora after quantising wraps the fp8 layer; its adapters train
    nn.inject_lora(net, ["proj_in"], rank=2)
    y = net.proj_in(x)
    grads = y.sum().backward()
    assert net.proj_in.lora_A in grads and net.proj_in.weight not in grads


def test_quantize_linears_refuses_clearly():
    net = Net()
    with pytest.raises(ValueError, match=r"layer 'proj_in' has a trainable weight"):
        nn.quantize_linears_(net)
    assert not any(isinstance(p, Fp8Weight) for p in net.parameters())  # nothing converted
    net.requires_grad_(False)
    with pytest.raises(ValueError, match=r"dtype must be one of \['fp8_e4m3'\], got 'fp8_e5m2'"):
        nn.quantize_linears_(net, "fp8_e5m2")
    with pytest.raises(ValueError, match="scale must be"):
        nn.quantize_linears_(net, scale="max")
    nn.inject_lora(net, ["blocks.0.0"], rank=2, dora=True)
    with pytest.raises(ValueError, match=r"layer 'blocks.0.0': DoRA over an fp8 base weight"):
        nn.quantize_linears_(net)
    nn.quantize_linears_(net, skip=["blocks.0.0"])
    with pytest.raises(ValueError, match=r"inject_lora: layer 'blocks.1.0': DoRA over an fp8 base weight"):
        nn.inject_lora(net, ["blocks.1.0"], rank=2, dora=True)
    with pytest.raises(RuntimeError, match="frozen and cannot require gradients"):
        net.requires_grad_(True)


# the embedders and the output layer stay unquantised (what fp8 trainers leave in bf16; Flux's dtype is img_in's)
FLUX_SKIP = [r"re:(img_in|txt_in|time_in|vector_in|guidance_in|final_layer)(\..*)?"]


def test_flux_lora_over_fp8_base_matches_dequantised_base():
    """A tiny Flux transformer (one block of each kind; fused QKV layers with an adapter per part) with
    its blocks' linears in fp8: output and adapter gradients as with the dequantised weights in fp32."""
    pytest.importorskip("diffusers")
    import dataclasses

    from tiny_flux import flux_inputs

    from flame.models import FluxConfig, FluxTransformer2DModel
    cfg = dataclasses.replace(FluxConfig.tiny(), num_layers=1, num_single_layers=1)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(cfg)
    model.requires_grad_(False)
    nn.inject_lora(model, ["qkv", "proj", "linear1", "linear2", "img_mlp.0"], rank=4)
    for p in nn.lora_parameters(model):
        p._data.copy_(torch.randn(p.shape).to(DEVICE) * 0.1)
    done = nn.quantize_linears_(model, skip=FLUX_SKIP)
    assert "double_blocks.0.img_attn.qkv" in done and "single_blocks.0.linear2" in done and "img_in" not in done
    assert model.dtype == torch.float32
    inp = {k: flame.from_torch(v.to(DEVICE)) for k, v in flux_inputs(cfg, batch=1, n_txt=3, height=4, width=4).items()}
    adapters = nn.lora_parameters(model)
    runs = []
    for _ in range(2):
        y = model(**inp)
        grads = (y * y).sum().backward()
        runs.append([y.to_torch()] + [grads[p].to_torch() for p in adapters])
        for name, m in model.named_modules():  # the same model over the dequantised weights
            if name and isinstance(getattr(m, "weight", None), Fp8Weight):
                m.weight = nn.Parameter(m.weight.dequantize(), requires_grad=False)
                if isinstance(m, nn.LoRALinear):
                    m._base_layer.weight = m.weight
    # tf32 products on the GPU (10-bit mantissas): fp8 codes decoded in the GEMMs against the dequantised fp32
    # weights rounded inside them, through the forward and backward GEMMs of two blocks (0.3% of the largest
    # adapter gradient apart on an H200)
    r = 1e-4 if flame.is_interpreter() else 5e-3
    for got, want in zip(*runs):
        assert_close(got, want, rtol=r, atol=r * float(want.abs().max()))


def test_fp8_bad_input_errors():
    w = flame.from_torch(weight(4, 6))
    with pytest.raises(ValueError, match=r"quantize_fp8: weight must be 2-D"):
        quantize_fp8(flame.from_torch(torch.zeros(2, 3, 4).to(DEVICE)))
    with pytest.raises(TypeError, match=r"quantize_fp8: weight must be float32"):
        quantize_fp8(flame.from_torch(torch.zeros(2, 3, dtype=torch.int32).to(DEVICE)))
    with pytest.raises(ValueError, match=r"quantize_fp8: weight \(4, 6\) requires grad"):
        quantize_fp8(flame.from_torch(weight(4, 6), requires_grad=True))
    with pytest.raises(ValueError, match="scale must be one of"):
        quantize_fp8(w, scale="max")
    q = quantize_fp8(w)
    with pytest.raises(TypeError, match="is an Fp8Weight already"):
        quantize_fp8(q)
    with pytest.raises(RuntimeError, match="frozen and cannot require gradients"):
        q.requires_grad_(True)
    x = flame.from_torch(torch.randn(2, 6).to(DEVICE))
    with pytest.raises(TypeError, match="linear: weight is a float8_e4m3fn tensor without scales"):
        F.linear(x, flame.Tensor(q._data))
    with pytest.raises(TypeError, match="matmul: float8_e4m3fn operands"):
        flame.matmul(x, q)
    a, b = flame.from_torch(torch.zeros(2, 6).to(DEVICE)), flame.from_torch(torch.zeros(4, 2).to(DEVICE))
    with pytest.raises(ValueError, match=r"lora_linear: DoRA .* over an fp8 weight"):
        F.lora_linear(x, q, None, a, b, 1.0, magnitude=flame.from_torch(torch.ones(4).to(DEVICE)))
    out = torch.empty(2, 4, device=DEVICE)
    with pytest.raises(TypeError, match="a float8_e4m3fn weight and its scale come together"):
        KM.linear_(out, x._data, q._data)
    with pytest.raises(ValueError, match=r"contiguous fp32 \(4,\) vector"):
        KM.linear_(out, x._data, q._data, w_scale=q.scale[:3])
    with pytest.raises(TypeError, match="dequantize_fp8: weight must be an Fp8Weight"):
        dequantize_fp8(w)


# ---- GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3072, 3072), (5, 20000)], ids=str)  # rows read once; rows in chunks
def test_quantize_bf16_weights_on_gpu_matches_torch(shape):
    w = weight(*shape, torch.bfloat16)
    q = quantize_fp8(flame.from_torch(w))
    want_q, want_s = torch_quantize(w, q.scale)
    assert_close(q.scale, want_s, rtol=2 ** -23, atol=0)
    assert torch.equal(codes(q._data), codes(want_q))
    assert torch.equal(dequantize_fp8(q, torch.bfloat16).to_torch(), (want_q.float() * q.scale[:, None]).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1024, 3072, 3072), (1000, 3000, 1000), (77, 768, 3072)], ids=str)
def test_fp8_linear_bf16_on_gpu(shape, act):
    """bf16 activations over an fp8 weight: output and dX within 2x (3x for dX) torch's own bf16
    error on the dequantised weight, against fp32."""
    r, k, n = shape
    q = quantize_fp8(flame.from_torch(weight(n, k)))
    wd = q._data.float() * q.scale[:, None]
    x32 = torch.randn(r, k, device=DEVICE)
    g32 = torch.randn(r, n, device=DEVICE)
    x = flame.from_torch(x32.bfloat16(), requires_grad=True)
    y = F.linear(x, q, None, activation=act)
    dx = (y * flame.from_torch(g32.bfloat16())).sum().backward()[x]
    for dtype in (torch.float32, torch.bfloat16):
        xt = x32.clone().to(dtype).requires_grad_(True)
        yt = TORCH_ACT[act](torch.nn.functional.linear(xt, wd.to(dtype)))
        (yt * g32.to(dtype)).sum().backward()
        if dtype == torch.float32:
            ref, ref_dx = yt.detach(), xt.grad
        else:
            low, low_dx = yt.detach(), xt.grad
    assert_within_torch_error(y.to_torch(), low, ref, 2)
    assert_within_torch_error(dx.to_torch(), low_dx, ref_dx, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,act", [((4608, 3072, 3072), None), ((4096, 3072, 12288), "gelu_tanh"),
                                       ((1000, 3000, 1024), None), ((77, 768, 3072), None)], ids=str)
def test_w8a8_linear_on_gpu(shape, act):
    """The W8A8 forward (the fp8 Gluon product on sm_90; elsewhere, or for K not a multiple of 16 or
    few rows, A decoded again) against torch's fp32 product of the same rounded operands: within
    2x the error of torch._scaled_mm (cuBLAS's fp8 GEMM) where PyTorch has it, else 1%."""
    r, k, n = shape
    q = quantize_fp8(flame.from_torch(weight(n, k)))
    q.w8a8 = True
    wd = q._data.float() * q.scale[:, None]
    x = torch.randn(r, k, device=DEVICE).bfloat16()
    b = torch.randn(n, device=DEVICE).bfloat16()
    y = F.linear(flame.from_torch(x), q, flame.from_torch(b), activation=act).to_torch().float()
    want = _w8a8_reference(x, wd, b, act)
    err = float((y - want).norm() / want.norm())
    bound = 1e-2
    if hasattr(torch, "_scaled_mm") and k % 16 == 0 and n % 16 == 0:
        s = torch_quantize(x, torch.ones(r, device=DEVICE))[1]
        xq = (x.float() / s[:, None]).to(E4M3)
        cublas = torch._scaled_mm(xq, q._data.t(), scale_a=s[:, None], scale_b=q.scale[None, :],
                                  bias=b, out_dtype=torch.bfloat16)
        cublas = TORCH_ACT[act](cublas.float())
        bound = max(2 * float((cublas - want).norm() / want.norm()), 4e-3)
    assert err <= bound, (err, bound)


@pytest.mark.gpu
def test_lora_over_fp8_base_bf16_on_gpu():
    layer, ref = _lora_pair(torch.bfloat16, 16, 0.0, n_in=1024, n_out=1536)
    x = flame.from_torch(torch.randn(512, 1024, device=DEVICE).bfloat16(), requires_grad=True)
    g = flame.from_torch(torch.randn(512, 1536, device=DEVICE).bfloat16())
    got = []
    for m in (layer, ref):
        y = m(x)
        grads = (y * g).sum().backward()
        got.append([y.to_torch().float(), grads[x].to_torch().float(), grads[m.lora_A].to_torch()])
    for a, b in zip(*got):
        assert (a - b).norm() <= 1e-2 * b.norm()


@pytest.mark.gpu
def test_quant_kernels_decode_every_code_on_gpu():
    every = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(E4M3).reshape(2, 128)
    q = quantize_fp8(flame.Tensor(every))
    got = dequantize_fp8(q).to_torch()
    want = every.float()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert KQ.DECODE_FACTOR.value == 256.0
