import numpy as np
import pytest
import torch

import flame
import flame.nn.functional as F
from flame.testing import gradcheck
from helpers import (
    DEVICE,
    FLOAT_DTYPES_CPU,
    GPU_ONLY_DTYPES,
    TOL,
    assert_close,
    assert_within_torch_error,
    check_op,
    pair,
)

TORCH_ACT = {
    None: lambda t: t,
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}


def _check(x_shape, n_out, dtype, act, tol, bias=True, weight_t=False, noncontig_x=False):
    """``check_op`` of ``F.linear`` (bias, activation) against torch: output, x, W and b gradients."""
    x = pair(x_shape, dtype, requires_grad=True, noncontig=noncontig_x)
    if weight_t:  # a transposed view of an (in, out) buffer: read in place
        w0, w0t = pair((x_shape[-1], n_out), dtype)
        w = w0.t().detach().requires_grad_(), w0t.t().detach().requires_grad_()
    else:
        w = pair((n_out, x_shape[-1]), dtype, requires_grad=True)
    b = pair((n_out,), dtype, requires_grad=True) if bias else None
    check_op(lambda x, w, b: F.linear(x, w, b, activation=act),
             lambda x, w, b: TORCH_ACT[act](torch.nn.functional.linear(x, w, b)), [x, w, b], tol=tol)


@pytest.mark.parametrize("act", list(TORCH_ACT))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("shape,n_out", [((7, 33), 17), ((2, 5, 16), 8), ((1, 1), 1), ((3, 77, 40), 24)], ids=str)
def test_linear_matches_torch(act, dtype, shape, n_out):
    # GEMMs sum in another order than PyTorch: a few ulp of the sum, not of each element; fp32
    # products run as tf32 on the GPU (10 mantissa bits), exactly in the interpreter
    _check(shape, n_out, dtype, act, dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else _tf32_tol)


def _tf32_tol(want):
    """fp32 products run as tf32 on the GPU: the error scales with the summands (~the output's
    largest magnitude), not with each element; exact products in the interpreter."""
    if flame.is_interpreter():
        return dict(rtol=1e-4, atol=1e-5)
    return dict(rtol=1e-2, atol=2e-3 * float(want.abs().max()))


@pytest.mark.parametrize("act", [None, "gelu"])
def test_linear_strided_operands_and_no_bias(act):
    _check((9, 12), 5, torch.float32, act, _tf32_tol, bias=False, weight_t=True, noncontig_x=True)


@pytest.mark.parametrize("act", list(TORCH_ACT))
def test_linear_gradcheck(act):
    rng = np.random.default_rng(11)
    x = flame.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    w = flame.tensor(rng.standard_normal((5, 4)), requires_grad=True)
    b = flame.tensor(rng.standard_normal(5), requires_grad=True)
    if act == "relu":  # keep pre-activations away from the kink
        with flame.no_grad():
            pre = (x @ w.T + b).numpy()
        assert np.abs(pre).min() > 1e-3
    assert gradcheck(lambda x, w, b: F.linear(x, w, b, activation=act), [x, w, b])


def test_mixed_precision_master_weight():
    # fp32 master weight with fp16 activations: cast once, gradient back in fp32
    def f_fn(x, w):
        y = F.linear(x, w)
        assert y.dtype == torch.float16
        return y.float()

    run = check_op(f_fn, lambda x, w: torch.nn.functional.linear(x, w.half()).float(),
                   [pair((4, 8), torch.float16, requires_grad=True), pair((3, 8), torch.float32, requires_grad=True)],
                   tol=TOL[torch.float16])
    assert run.grads[0].dtype == run.grads[1].dtype == torch.float32


def test_linear_empty_and_zero_k():
    x = flame.empty(0, 4, requires_grad=True)
    w = flame.randn(3, 4, requires_grad=True)
    assert F.linear(x, w).shape == (0, 3)
    xk = flame.empty(2, 0)
    b = flame.tensor([1.0, -2.0, 3.0])
    assert_close(F.linear(xk, flame.empty(3, 0), b, activation="relu"), torch.tensor([[1.0, 0.0, 3.0]] * 2))
    # 3-D input without features: the rows of an empty buffer are still 2 x 4
    assert_close(F.linear(flame.empty(2, 4, 0), flame.empty(3, 0), b), torch.tensor([[[1.0, -2.0, 3.0]] * 4] * 2))


def test_linear_bad_inputs():
    x, w = flame.ones(2, 4), flame.ones(3, 5)
    with pytest.raises(RuntimeError, match="don't match"):
        F.linear(x, w)
    with pytest.raises(RuntimeError, match="bias"):
        F.linear(x, flame.ones(3, 4), flame.ones(4))
    with pytest.raises(ValueError, match="activation"):
        F.linear(x, flame.ones(3, 4), activation="tanh")
    with pytest.raises(TypeError):
        F.linear(flame.ones(2, 4, dtype=flame.int64), flame.ones(3, 4))


def test_linear_checks_each_new_call_signature_and_reads_each_call_s_layout():
    """linear keeps what a call signature resolved to (shapes, strides, dtypes, activation): a kept
    signature's call is right on new buffers, and a bias of another shape or dtype, or an input of
    other strides, is a new signature (checked, cast, read as its own matrix)."""
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(flame.device) for s in ((2, 3, 4), (5, 4), (5,)))
    want = torch.nn.functional.linear(x, w, b).relu()
    for _ in range(2):
        assert_close(F.linear(flame.from_torch(x), flame.from_torch(w), flame.from_torch(b), "relu"), want)
    with pytest.raises(RuntimeError, match="bias"):
        F.linear(flame.from_torch(x), flame.from_torch(w), flame.ones(4, dtype=flame.float64), "relu")
    y = F.linear(flame.from_torch(x), flame.from_torch(w), flame.from_torch(b.float()), "relu")  # the bias cast
    assert y.dtype == torch.float64
    assert_close(y, want)
    crossed = x.transpose(0, 1)  # rows no stride walks: a dense copy's
    assert_close(F.linear(flame.from_torch(crossed), flame.from_torch(w), flame.from_torch(b), "relu"),
                 torch.nn.functional.linear(crossed, w, b).relu())


@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("layout", ["fused", "strided", "broadcast"])
def test_linear_residual_matches_torch(act, dtype, layout):
    """``linear(..., residual=h)`` is ``act(x W^T + b) + h``: read by the GEMM's epilogue when ``h`` is
    laid out as the output (one launch), added by a separate op otherwise; ``h``'s gradient is the
    output's either way."""
    x = pair((2, 5, 16), dtype, requires_grad=True)
    w = pair((8, 16), dtype, requires_grad=True)
    b = pair((8,), dtype, requires_grad=True)
    shape = {"fused": (2, 5, 8), "strided": (2, 8, 5), "broadcast": (8,)}[layout]
    h = pair(shape, dtype, requires_grad=True)
    view = (lambda t: t.transpose(1, 2)) if layout == "strided" else (lambda t: t)
    check_op(lambda x, w, b, h: F.linear(x, w, b, activation=act, residual=view(h)),
             lambda x, w, b, h: TORCH_ACT[act](torch.nn.functional.linear(x, w, b)) + view(h), [x, w, b, h],
             tol=dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else _tf32_tol)
    import flame.kernels.launch as L
    with flame.no_grad():
        L.launches = 0
        F.linear(x[0], w[0], b[0], activation=act, residual=view(h[0]))
        assert L.launches == (1 if layout == "fused" else 2)


def test_linear_residual_gradcheck():
    rng = np.random.default_rng(5)
    shapes = ((2, 3, 4), (5, 4), (5,), (2, 3, 5))
    x, w, b, h = (flame.tensor(rng.standard_normal(s), requires_grad=True) for s in shapes)
    assert gradcheck(lambda x, w, b, h: F.linear(x, w, b, activation="silu", residual=h), [x, w, b, h])
    with pytest.raises(TypeError, match="residual must be a flame Tensor"):
        F.linear(x, w, b, residual=np.zeros((2, 3, 5)))


def _torch_geglu(x, w, b):
    h, gate = torch.nn.functional.linear(x, w, b).chunk(2, dim=-1)
    return h * torch.nn.functional.gelu(gate)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_geglu_is_geglu_of_the_projection(bias):
    """``linear(..., activation="geglu")`` = ``hidden * gelu(gate)`` over the projection's halves, with
    the gradients of the composed ops; a residual adds to it; an odd width is refused."""
    inputs = [pair((2, 5, 16), requires_grad=True), pair((12, 16), requires_grad=True),
              pair((12,), requires_grad=True) if bias else None]
    check_op(lambda x, w, b: F.linear(x, w, b, activation="geglu"), _torch_geglu, inputs, tol=_tf32_tol)
    x, w = inputs[0][0], inputs[1][0]
    h = flame.randn(2, 5, 6)
    with flame.no_grad():
        want = _torch_geglu(x.to_torch(), w.to_torch(), None) + h.to_torch()
        assert_close(F.linear(x, w, activation="geglu", residual=h), want, **_tf32_tol(want))
    with pytest.raises(ValueError, match="even"):
        F.linear(x, flame.randn(7, 16), activation="geglu")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1024, 1280, 5120), (8192, 640, 2560), (3000, 256, 1000)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_geglu_in_the_hopper_epilogue(shape, bias):
    """bf16 at inference on Hopper: one launch (GEGLU in the Gluon GEMM's epilogue: hidden and gate
    blocks side by side in a tile, tails in rows and columns), within bf16 rounding of an fp32
    reference; elsewhere, or with a gradient to record, the composed ops."""
    import flame.kernels.launch as L
    import flame.kernels.matmul_hopper as KH
    *rows, k, n = shape
    x = flame.randn(*rows, k, dtype=flame.bfloat16)
    w = flame.randn(2 * n, k, dtype=flame.bfloat16) * (k ** -0.5)
    b = flame.randn(2 * n, dtype=flame.bfloat16) if bias else None
    with flame.no_grad():
        L.launches = 0
        y = F.linear(x, w, b, activation="geglu")
        fused = L.launches == 1
    want = _torch_geglu(x.to_torch().float(), w.to_torch().float(), None if b is None else b.to_torch().float())
    assert_within_torch_error(y, _torch_geglu(x.to_torch(), w.to_torch(), None if b is None else b.to_torch()),
                              want, 2)
    if KH.available():
        assert fused, "the Hopper kernel did not take a GEGLU projection"


@pytest.mark.gpu
@pytest.mark.parametrize("act,grad,lora", [(None, False, False), (None, True, False), ("gelu", True, False),
                                           (None, True, True)])
def test_linear_bf16_residual_on_the_gpu_routes(act, grad, lora):
    """bf16 at an SDXL transformer shape: the residual read by the Hopper routes' epilogues (Gluon
    without a pre-activation store or with a LoRA term, the TMA kernel with a pre-activation store),
    within bf16 rounding of torch's; with LoRA the input gradient too."""
    x = flame.randn(2, 1024, 1280, dtype=flame.bfloat16, requires_grad=grad)
    w = flame.randn(1280, 1280, dtype=flame.bfloat16) * (1280 ** -0.5)
    b, h = flame.randn(1280, dtype=flame.bfloat16), flame.randn(2, 1024, 1280, dtype=flame.bfloat16)
    h.requires_grad_(grad)
    a, lb = flame.randn(16, 1280) * (1280 ** -0.5), flame.randn(1280, 16) * 0.25
    if lora:
        y = F.lora_linear(x, w, b, a, lb, 0.5, residual=h)
    else:
        y = F.linear(x, w, b, activation=act, residual=h)
    tx, tw, tb, th = (t.to_torch().float() for t in (x, w, b, h))
    want = TORCH_ACT[act](torch.nn.functional.linear(tx, tw, tb)) + th
    if lora:
        want = want + 0.5 * (tx @ a.to_torch().T) @ lb.to_torch().T
    assert_close(y, want.bfloat16(), rtol=2e-2, atol=4e-2)
    if grad:
        g = flame.randn(2, 1024, 1280, dtype=flame.bfloat16)
        grads = y.backward(g)
        assert torch.equal(grads[h].to_torch(), g.to_torch())
        if lora:  # dX = dY W + dH A: the low-rank term in the input gradient's GEMM too
            tx.requires_grad_()
            (torch.nn.functional.linear(tx, tw) + 0.5 * (tx @ a.to_torch().T) @ lb.to_torch().T).backward(
                g.to_torch().float())
            assert_close(grads[x], tx.grad, rtol=2e-2, atol=4e-2)  # a bf16 leaf's gradient is accumulated in fp32


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_linear_bf16_sdxl_shape_error_budget(act):
    # DESIGN rule: error vs an fp32 reference at most 2x (outputs) / 3x (gradients) PyTorch's in bf16
    m, k, n = 1024, 1280, 1280
    x32 = torch.randn(m, k, device="cuda")
    w32 = torch.randn(n, k, device="cuda") / k ** 0.5
    b32 = torch.randn(n, device="cuda")
    g32 = torch.randn(m, n, device="cuda")
    ref = [t.clone().requires_grad_() for t in (x32, w32, b32)]
    y_ref = TORCH_ACT[act](torch.nn.functional.linear(*ref))
    y_ref.backward(g32)
    low = [t.bfloat16().requires_grad_() for t in (x32, w32, b32)]
    y_low = TORCH_ACT[act](torch.nn.functional.linear(*low))
    y_low.backward(g32.bfloat16())
    fx, fw, fb = [flame.from_torch(t.detach().bfloat16(), requires_grad=True) for t in (x32, w32, b32)]
    y = F.linear(fx, fw, fb, activation=act)
    grads = y.backward(flame.from_torch(g32.bfloat16()))
    assert_within_torch_error(y, y_low, y_ref, 2)
    for f, lo, r in ((fx, low[0], ref[0]), (fw, low[1], ref[1]), (fb, low[2], ref[2])):
        assert_within_torch_error(grads[f], lo.grad, r.grad, 3)


# ---- lora_linear: the fused LoRA adapter op ----------------------------------------------------

def _torch_lora(x, w, b, a, lb, scale, xl=None):
    xl = x if xl is None else xl
    y = torch.nn.functional.linear(x, w, b)
    return y + torch.nn.functional.linear(torch.nn.functional.linear(xl, a.to(x.dtype)), lb.to(x.dtype)) * scale


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("x_shape,bias,branch,train_base", [
    ((33, 40), True, False, False),
    ((2, 7, 40), False, False, True),
    ((9, 40), True, True, True),
], ids=str)
def test_lora_linear_matches_composed_torch(dtype, x_shape, bias, branch, train_base):
    n_out, rank = 24, 4
    inputs = [pair(x_shape, dtype, requires_grad=True), pair((n_out, x_shape[-1]), dtype, requires_grad=train_base),
              pair((n_out,), dtype, requires_grad=train_base) if bias else None,
              pair((rank, x_shape[-1]), torch.float32, requires_grad=True),  # fp32 masters
              pair((n_out, rank), torch.float32, requires_grad=True),
              pair(x_shape, dtype, requires_grad=True) if branch else None]
    if dtype != torch.float32:
        tol = dict(rtol=1e-2, atol=6e-2)  # fp16 against fp32 (sums of 160 products of about 1)
    elif flame.is_interpreter():
        tol = dict(rtol=1e-4, atol=1e-4)
    else:  # tf32 products in two chained GEMMs: inputs rounded to 10 mantissa bits, sums of 40 terms
        tol = dict(rtol=1e-2, atol=0.15)
    run = check_op(lambda x, w, b, a, lb, xl: F.lora_linear(x, w, b, a, lb, 0.75, lora_input=xl),
                   lambda x, w, b, a, lb, xl: _torch_lora(x, w, b, a, lb, 0.75, xl), inputs, tol=tol)
    assert run.grads[3].dtype == run.grads[4].dtype == torch.float32  # the masters' own dtype


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fused", "strided"])
def test_lora_linear_residual(layout):
    """``lora_linear(..., residual=h)`` adds ``h`` in the base GEMM's epilogue when it is laid out as
    the output (no launch more than without it), by a separate op otherwise; ``h`` gets the output's
    gradient. DoRA composes it."""
    import flame.kernels.launch as L
    inputs = [pair((2, 7, 40), requires_grad=True), pair((24, 40)), pair((24,)),
              pair((4, 40), requires_grad=True), pair((24, 4), requires_grad=True),
              pair((2, 24, 7) if layout == "strided" else (2, 7, 24), requires_grad=True)]
    view = (lambda t: t.transpose(1, 2)) if layout == "strided" else (lambda t: t)
    check_op(lambda x, w, b, a, lb, h: F.lora_linear(x, w, b, a, lb, 0.75, residual=view(h)),
             lambda x, w, b, a, lb, h: _torch_lora(x, w, b, a, lb, 0.75) + view(h), inputs, tol=_tf32_tol)
    x, w, b, a, lb, h = (t[0] for t in inputs)
    with flame.no_grad():
        L.launches = 0
        F.lora_linear(x, w, b, a, lb, 0.75)
        plain, L.launches = L.launches, 0
        F.lora_linear(x, w, b, a, lb, 0.75, residual=view(h))
        assert L.launches == plain + (layout == "strided")
    m = flame.ones(24).requires_grad_()
    want = F.lora_linear(x, w, b, a, lb, 0.75, magnitude=m) + view(h)
    assert_close(F.lora_linear(x, w, b, a, lb, 0.75, magnitude=m, residual=view(h)), want.to_torch())


def test_lora_linear_gradcheck_and_bad_shapes():
    x = flame.randn(3, 5, dtype=flame.float64).requires_grad_()  # few elements: two forwards each
    w = flame.randn(4, 5, dtype=flame.float64).requires_grad_()
    b = flame.randn(4, dtype=flame.float64).requires_grad_()
    a = flame.randn(2, 5, dtype=flame.float64).requires_grad_()
    lb = flame.randn(4, 2, dtype=flame.float64).requires_grad_()
    xl = flame.randn(3, 5, dtype=flame.float64).requires_grad_()
    assert gradcheck(lambda *t: F.lora_linear(*t, 0.5), (x, w, b, a, lb))
    assert gradcheck(lambda x, w, a, lb, xl: F.lora_linear(x, w, None, a, lb, 2.0, lora_input=xl), (x, w, a, lb, xl))
    with pytest.raises(ValueError, match=r"lora_a \(2, 4\)"):
        F.lora_linear(x, w, b, flame.randn(2, 4, dtype=flame.float64), lb, 1.0)
    with pytest.raises(ValueError, match=r"lora_b \(4, 3\)"):
        F.lora_linear(x, w, b, a, flame.randn(4, 3, dtype=flame.float64), 1.0)
    with pytest.raises(ValueError, match="lora_input"):
        F.lora_linear(x, w, b, a, lb, 1.0, lora_input=flame.randn(3, 7, dtype=flame.float64))



def _count_entry_points(monkeypatch):
    """A list that the GEMM entry points (``linear_``, ``matmul_``) append to per call."""
    from flame.kernels import matmul as KM
    entered = []

    def counted(entry_point):
        return lambda *args, **kwargs: entered.append(1) or entry_point(*args, **kwargs)

    for name in ("linear_", "matmul_"):
        monkeypatch.setattr(KM, name, counted(getattr(KM, name)))
    return entered


def test_lora_linear_repeats_its_gemms_through_kept_routes(monkeypatch):
    """A repeated call signature runs lora_linear's GEMMs by the handles on their kept routes (no entry-point
    call), with each call's own buffers and scale; emptied routes, or another scale, go through the entry
    points again."""
    from flame.kernels import matmul as KM
    entered = _count_entry_points(monkeypatch)

    def step(scale):
        inputs = [pair((2, 7, 40), requires_grad=True), pair((24, 40)), pair((24,)),
                  pair((4, 40), torch.float32, requires_grad=True), pair((24, 4), torch.float32, requires_grad=True)]
        entered.clear()
        check_op(lambda x, w, b, a, lb: F.lora_linear(x, w, b, a, lb, scale),
                 lambda x, w, b, a, lb: _torch_lora(x, w, b, a, lb, scale), inputs, tol=_tf32_tol)
        return len(entered)

    for _ in range(2):  # routes emptied (an earlier test may have kept these signatures): entry points, then handles
        KM._route.cache_clear()
        assert step(0.75) == 6  # down and up forward; dH, dB, dA and dX backward
        assert step(0.75) == 0
    assert step(0.5) == 6


def test_lora_linear_sends_misaligned_buffers_through_the_entry_points(monkeypatch, tma_in_interpreter):
    """On a TMA device lora_linear checks the buffers it did not allocate (input, weights, adapters' casts,
    the output's gradient) for 16-byte alignment, once per op: an input or gradient one element into its
    buffer (the call signature unchanged) sends the GEMMs through the entry points, which route what
    reads it to the pointer kernel (a kept TMA route would refuse its descriptor), and the values are
    right; aligned repeats run by the handles."""
    from flame.kernels import matmul as KM
    entered = _count_entry_points(monkeypatch)
    rows, k, n, rank = 24, 160, 144, 16
    (w, tw), (b, tb) = pair((n, k), torch.float16), pair((n,), torch.float16)
    (a, ta), (lb, tlb) = (pair(shape, torch.float32, requires_grad=True) for shape in ((rank, k), (n, rank)))

    def one_element_in(t, misaligned):
        """``t``'s values in a buffer of its shape and strides, one element into a larger one if ``misaligned``."""
        at = int(misaligned)
        return torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[at:at + t.numel()].view(t.shape).copy_(t)

    def step(x_misaligned=False, g_misaligned=False):
        """Entry-point calls of the forward and of the backward."""
        tx, tg = torch.randn(rows, k, device=DEVICE).half(), torch.randn(rows, n, device=DEVICE).half()
        x = flame.from_torch(one_element_in(tx, x_misaligned), requires_grad=True)
        entered.clear()
        y = F.lora_linear(x, w, b, a, lb, 0.75)
        forward = len(entered)
        grads = y.backward(flame.from_torch(one_element_in(tg, g_misaligned)))
        tx.requires_grad_()
        ta.grad = tlb.grad = None
        ty = _torch_lora(tx.float(), tw.float(), tb.float(), ta, tlb, 0.75)
        ty.backward(tg.float())
        tol = dict(rtol=1e-2, atol=6e-2)  # fp16 against fp32 (sums of 160 products of about 1)
        assert_close(y.to_torch().float(), ty, **tol)
        for got, want in ((x, tx.grad), (a, ta.grad), (lb, tlb.grad)):
            assert_close(grads[got].to_torch().float(), want.float(), **tol)
        return forward, len(entered) - forward

    KM._route.cache_clear()
    assert step() == (2, 4)  # down and up; dH, dB, dA and dX, all kept
    assert step() == (0, 0)
    assert step(x_misaligned=True) == (2, 4)
    assert step(g_misaligned=True) == (0, 4)
    assert step() == (0, 0)


def _torch_dora(leaves, g, scale, dtype):
    """PEFT's DoRA (no dropout) in torch at ``dtype`` (the adapters' products in x's dtype, c rounded
    to it): c * (x W^T + s x A^T B^T) + b, c = m / ||W + s B A|| (detached). ``leaves`` (x, w, b, a, lb,
    m): torch tensors, copied here. Returns the output and the leaves' gradients for ``g``."""
    x, w, b, a, lb, m = (None if t is None else t.detach().to(dtype if i < 3 else torch.float64)
                         .requires_grad_() for i, t in enumerate(leaves))
    lin = torch.nn.functional.linear
    z = lin(x, w) + lin(lin(x, a.to(dtype)), lb.to(dtype)) * scale
    norm = (w.double() + scale * lb @ a).norm(dim=1).detach()
    y = z * (m / norm).to(dtype) + (0 if b is None else b)
    y.backward(g.to(dtype))
    return y.detach(), [None if t is None else t.grad for t in (x, w, b, a, lb, m)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU + [pytest.param(d, marks=pytest.mark.gpu) for d in GPU_ONLY_DTYPES])
@pytest.mark.parametrize("x_shape,n_out,rank,bias,noncontig", [
    ((33, 40), 24, 4, True, False),
    ((2, 7, 40), 17, 20, False, False),
    ((9, 40), 24, 1, True, True),
], ids=str)
def test_dora_linear_matches_torch(dtype, x_shape, n_out, rank, bias, noncontig):
    """``magnitude``: DoRA's output and every gradient (x, W, b, A, B, m; none through the norm)
    against float64, odd sizes, ranks 1..20, a transposed input; 16-bit within 3x PyTorch's own
    error in that dtype."""
    x, tx = pair(x_shape, dtype, requires_grad=True, noncontig=noncontig)
    w, tw = pair((n_out, x_shape[-1]), dtype, requires_grad=True)
    b, tb = pair((n_out,), dtype, requires_grad=True) if bias else (None, None)
    a, ta = pair((rank, x_shape[-1]), torch.float32, requires_grad=True)
    lb, tlb = pair((n_out, rank), torch.float32, requires_grad=True)
    norm = (tw.double() + 0.75 * tlb.double() @ ta.double()).norm(dim=1)
    tm = (norm * (0.5 + torch.rand(n_out, dtype=torch.float64, device=norm.device))).float()
    m = flame.from_torch(tm.clone(), requires_grad=True)
    y = F.lora_linear(x, w, b, a, lb, 0.75, magnitude=m)
    g, tg = pair(tuple(y.shape), dtype)
    grads = y.backward(g)
    leaves = (tx, tw, tb, ta, tlb, tm)
    y64, grads64 = _torch_dora(leaves, tg, 0.75, torch.float64)
    assert y.dtype == dtype and grads[m].dtype == grads[a].dtype == torch.float32
    got = [y] + [None if t is None else grads[t] for t in (x, w, b, a, lb, m)]
    want = [y64] + grads64
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4) if flame.is_interpreter() else dict(rtol=1e-2, atol=0.15)  # tf32
        for g_, w_ in zip(got, want):
            if w_ is not None:
                assert_close(g_.to_torch().double(), w_, torch.float64, **tol)
    else:
        y_low, grads_low = _torch_dora(leaves, tg, 0.75, dtype)
        for g_, lo, w_ in zip(got, [y_low] + grads_low, want):
            if w_ is not None:
                assert_within_torch_error(g_, lo, w_, 3)


def test_dora_linear_gradcheck_and_bad_input():
    x = flame.randn(5, 6, dtype=flame.float64).requires_grad_()
    w = flame.randn(4, 6, dtype=flame.float64)
    b = flame.randn(4, dtype=flame.float64).requires_grad_()
    a, lb = flame.randn(3, 6, dtype=flame.float64), flame.randn(4, 3, dtype=flame.float64)
    m = flame.randn(4, dtype=flame.float64).requires_grad_()
    # the norm is a constant: finite differences only over x, b and m (A, B and W move it)
    assert gradcheck(lambda x, b, m: F.lora_linear(x, w, b, a, lb, 0.5, magnitude=m), (x, b, m))
    with pytest.raises(ValueError, match=r"magnitude must be a floating-point \(4,\) vector, got \(3,\)"):
        F.lora_linear(x, w, b, a, lb, 0.5, magnitude=flame.randn(3, dtype=flame.float64))
    with pytest.raises(ValueError, match="with a separate lora_input"):
        F.lora_linear(x, w, b, a, lb, 0.5, lora_input=x, magnitude=m)
    empty = F.lora_linear(flame.randn(0, 6, dtype=flame.float64), w, b, a, lb, 0.5, magnitude=m)
    assert empty.shape == (0, 4)


def test_dora_with_a_frozen_magnitude_trains_the_adapters():
    """A magnitude that does not train (A and B do) gives A and B the gradients they get when it
    trains (the backward used to read the unsaved pre-scale output then)."""
    x, w, b, g = flame.randn(6, 12), flame.randn(5, 12), flame.randn(5), flame.randn(6, 5)
    a, lb = flame.randn(3, 12).requires_grad_(), flame.randn(5, 3).requires_grad_()
    m = flame.rand(5) + 0.5
    frozen = F.lora_linear(x, w, b, a, lb, 0.5, magnitude=m).backward(g)
    trained = F.lora_linear(x, w, b, a, lb, 0.5, magnitude=flame.from_torch(m.to_torch(), requires_grad=True)
                            ).backward(g)
    for p in (a, lb):
        assert_close(frozen[p], trained[p], rtol=0, atol=0)


def test_lora_linear_launches_fewer_kernels_than_the_composed_ops():
    import flame.kernels.launch as L
    x = flame.randn(16, 32, dtype=flame.float16).requires_grad_()
    w, b = flame.randn(8, 32, dtype=flame.float16), flame.randn(8, dtype=flame.float16)
    a = flame.randn(4, 32).requires_grad_()
    lb = flame.randn(8, 4).requires_grad_()
    g = flame.randn(16, 8, dtype=flame.float16)
    counts = []
    for fn in (lambda: F.lora_linear(x, w, b, a, lb, 0.5),
               lambda: F.linear(x, w, b) + F.linear(F.linear(x, a), lb) * 0.5):
        L.launches = 0
        fn().backward(g)
        counts.append(L.launches)
    # 2 casts + 2 GEMMs forward (the up-projection inside the base GEMM), 4 GEMMs backward (the input
    # gradient's adapter term inside its GEMM), 1 cast of x's gradient into its fp32 accumulator
    assert counts[0] <= 9 and counts[0] < counts[1], counts
    # DoRA adds the norm and the scale-and-bias pass forward, the scale's gradient pass and its sum backward
    m = flame.ones(8).requires_grad_()
    L.launches = 0
    F.lora_linear(x, w, b, a, lb, 0.5, magnitude=m).backward(g)
    assert L.launches <= counts[0] + 4, (L.launches, counts)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_a_frozen_weight_keeps_no_input_for_the_backward(activation):
    """The input is saved for the weight's gradient only: a frozen layer (LoRA training's base
    layers) holds no activation, and the input's gradient is still right."""
    x, xt = pair((6, 10), requires_grad=True)
    w, wt = pair((7, 10))
    b, bt = pair((7,))
    y = F.linear(x, w, b, activation=activation)
    assert y._node.saved[0] is None
    yt = torch.nn.functional.linear(xt, wt, bt)
    yt = torch.nn.functional.gelu(yt) if activation else yt
    g = torch.randn(6, 7, device=flame.device)
    grads = y.backward(flame.from_torch(g))
    yt.backward(g)
    assert_close(grads[x], xt.grad, **_tf32_tol(xt.grad))
    w.requires_grad = True
    assert F.linear(x, w, b, activation=activation)._node.saved[0] is not None
