"""F.qk_norm_rope (Flux's attention prologue: q/k RMSNorm per head, rotary embedding, head split)
against PyTorch composed as diffusers does it, and against diffusers' own modules."""
import pytest
import torch

import flame
import flame.kernels.launch as L
import flame.kernels.rope as KR
import flame.nn.functional as F
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, assert_within_torch_error

EPS = 1e-6


def _f(t, requires_grad=False):
    return flame.from_torch(t.detach().to(DEVICE, copy=True), requires_grad=requires_grad)


# ---- the torch reference -------------------------------------------------------------------------

def _rms_norm(x, w):
    """diffusers' RMSNorm: statistics in fp32; a half-precision weight multiplies in its dtype."""
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    if w.dtype in (torch.float16, torch.bfloat16):
        y = y.to(w.dtype)
    return (y * w).to(x.dtype)


def _rotate(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real_unbind_dim=-1, sequence_dim=1) on (B, L, H, D) with the
    (L, D/2) tables repeat-interleaved to (L, D)."""
    c = cos.repeat_interleave(2, -1)[None, :, None, :]
    s = sin.repeat_interleave(2, -1)[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


def _reference(xs, weights, cos, sin, H):
    """(q, k, v) as (B, H, L_total, D): per stream q, k, v split from the first 3 H D columns and
    normalised, the streams concatenated along L, then rotated."""
    parts = []
    for x, (wq, wk) in zip(xs, weights):
        D = wq.shape[0]
        q, k, v = x[..., :3 * H * D].unflatten(-1, (3, H, D)).unbind(2)
        parts.append((_rms_norm(q, wq), _rms_norm(k, wk), v))
    q, k, v = (torch.cat(p, dim=1) for p in zip(*parts))
    return tuple(t.transpose(1, 2) for t in (_rotate(q, cos, sin), _rotate(k, cos, sin), v))


# ---- inputs ---------------------------------------------------------------------------------------

def _stream(B, L, W, dtype, batch_strided=False):
    """(B, L, W); ``batch_strided``: a (L, B, W) buffer transposed (batch stride W, row stride B W)."""
    if batch_strided:
        return torch.randn(L, B, W, dtype=torch.float64).to(dtype).to(DEVICE).transpose(0, 1)
    return torch.randn(B, L, W, dtype=torch.float64).to(dtype).to(DEVICE)


def _case(B, H, D, lengths, extra, dtype, weight_dtype=None, batch_strided=False):
    """Streams of ``lengths`` tokens whose widths are 3 H D + ``extra[i]``, their norm weights, the
    tables of the concatenated sequence and random gradients for q, k, v."""
    xs = [_stream(B, n, 3 * H * D + e, dtype, batch_strided) for n, e in zip(lengths, extra)]
    wd = weight_dtype or dtype
    weights = [tuple((1 + 0.3 * torch.randn(D, dtype=torch.float64)).to(wd).to(DEVICE) for _ in range(2))
               for _ in lengths]
    angles = torch.randn(sum(lengths), D // 2, dtype=torch.float64) * 3
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    gs = [torch.randn(B, H, sum(lengths), D, dtype=torch.float64).to(dtype).to(DEVICE) for _ in range(3)]
    return xs, weights, cos, sin, gs


def _flame_run(xs, weights, cos, sin, gs, H, parts=(0, 1, 2)):
    """flame's (q, k, v) and the gradients of every stream, then every weight (q, k per stream),
    backpropagating ``gs`` from the outputs named in ``parts``."""
    fx = [flame.from_torch(x, requires_grad=True) for x in xs]
    fw = [tuple(_f(w, True) for w in pair) for pair in weights]
    outs = F.qk_norm_rope(fx, fw, _f(cos), _f(sin), H, EPS)
    grads = flame.grad([outs[i] for i in parts], fx + [w for pair in fw for w in pair], [_f(gs[i]) for i in parts])
    return outs, grads


def _torch_run(xs, weights, cos, sin, gs, H, parts=(0, 1, 2), upcast=False):
    tx = [(x.float() if upcast else x).detach().clone().requires_grad_() for x in xs]
    tw = [tuple((w.float() if upcast else w).detach().clone().requires_grad_() for w in pair) for pair in weights]
    outs = _reference(tx, tw, cos, sin, H)
    torch.autograd.backward([outs[i] for i in parts], [gs[i].float() if upcast else gs[i] for i in parts])
    leaves = tx + [w for pair in tw for w in pair]
    return [o.detach() for o in outs], [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _compare(xs, weights, cos, sin, gs, H, parts=(0, 1, 2)):
    """flame against the reference: PyTorch's tolerances in fp32/fp64, the low-precision rule in
    fp16/bf16 (factor 2 on outputs, 3 on gradients; v is a copy, exact)."""
    outs, grads = _flame_run(xs, weights, cos, sin, gs, H, parts)
    ref, ref_grads = _torch_run(xs, weights, cos, sin, gs, H, parts)
    B, L_total, D = xs[0].shape[0], cos.shape[0], weights[0][0].shape[0]
    for o in outs:
        assert o.shape == (B, H, L_total, D) and o.dtype == xs[0].dtype
        base = o._data._base if o._data._base is not None else o._data
        assert base.shape == (B, L_total, H, D) and base.is_contiguous()  # a permuted dense (B, L, H, D) buffer
    assert_close(outs[2], ref[2], rtol=0, atol=0)
    if xs[0].dtype in (torch.float16, torch.bfloat16):
        up, up_grads = _torch_run(xs, weights, cos, sin, gs, H, parts, upcast=True)
        for got, low, want in zip(outs[:2], ref[:2], up[:2]):
            assert_within_torch_error(got, low, want, 2)
        for got, low, want in zip(grads, ref_grads, up_grads):
            assert got.shape == low.shape
            assert_within_torch_error(got.to(low.dtype), low, want, 3)
        return
    for got, want in zip(outs[:2], ref[:2]):
        assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert_close(got.to(want.dtype), want, atol=1e-4, rtol=1e-4)


# ---- values and gradients --------------------------------------------------------------------------

CASES = {
    "one-stream": dict(B=2, H=2, D=8, lengths=(7,), extra=(0,)),
    "one-wide-stream": dict(B=1, H=3, D=4, lengths=(6,), extra=(10,)),  # the single block's linear1 output
    "two-streams-odd": dict(B=2, H=2, D=6, lengths=(3, 5), extra=(0, 5)),  # D / 2 = 3 pairs: masked columns
    "two-streams-batch-strided": dict(B=2, H=1, D=4, lengths=(5, 3), extra=(3, 0), batch_strided=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_qk_norm_rope_matches_reference(case, dtype):
    _compare(*_case(dtype=dtype, **CASES[case]), CASES[case]["H"])


def test_fp32_weights_with_fp16_input_and_strided_weights():
    xs, weights, cos, sin, gs = _case(2, 2, 6, (3, 4), (0, 0), torch.float16, weight_dtype=torch.float32)
    _compare(xs, weights, cos, sin, gs, 2)
    strided = [tuple(torch.stack([w, w], -1)[:, 0] for w in pair) for pair in weights]  # (D,) views, stride 2
    outs, _ = _flame_run(xs, strided, cos, sin, gs, 2)
    want, _ = _flame_run(xs, weights, cos, sin, gs, 2)
    for a, b in zip(outs, want):
        assert torch.equal(a.to_torch(), b.to_torch())


def test_several_token_blocks_and_zero_columns_in_several_passes(monkeypatch):
    """Blocks of 2 tokens (streams of 3 and 5: the last block of each masked), and 37 ignored
    columns shared by 2 heads in passes of 8 columns: the gradient there is zero."""
    real = KR.rope_config
    monkeypatch.setattr(KR, "rope_config", lambda D, L: dict(real(D, L), BLOCK_L=2))
    xs, weights, cos, sin, gs = _case(2, 2, 6, (3, 5), (0, 37), torch.float32)
    _compare(xs, weights, cos, sin, gs, 2)
    _, grads = _flame_run(xs, weights, cos, sin, gs, 2)
    assert torch.count_nonzero(grads[1].to_torch()[..., 36:]) == 0


@pytest.mark.parametrize("parts", [(0, 2), (1,), (2,)], ids=["q-v", "k", "v"])
def test_only_some_outputs_take_part(parts):
    # an output without a gradient contributes zeros (its columns' gradient, its weights')
    _compare(*_case(1, 2, 4, (3, 2), (0, 1), torch.float32), 2, parts=parts)


def test_frozen_weights_and_one_launch_each_way():
    """Forward: one launch. Backward: one launch when only the inputs need gradients (LoRA training:
    the norm weights are frozen), plus one reduction per stream for the weights' gradients. The
    outputs' gradients reach the op's backward through empty tensors: no launch of their own."""
    xs, weights, cos, sin, gs = _case(2, 2, 4, (3, 5), (0, 6), torch.float32)
    fx = [_f(x, True) for x in xs]
    fw = [tuple(_f(w) for w in pair) for pair in weights]
    before = L.launches
    q, k, v = F.qk_norm_rope(fx, fw, _f(cos), _f(sin), 2)
    assert L.launches - before == 1
    fg = [_f(g) for g in gs]
    before = L.launches
    grads = flame.grad([q, k, v], fx, fg)
    assert L.launches - before == 1
    _, ref_grads = _torch_run(xs, weights, cos, sin, gs, 2)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, atol=1e-4, rtol=1e-4)
    fw = [tuple(_f(w, True) for w in pair) for pair in weights]
    q, k, v = F.qk_norm_rope(fx, fw, _f(cos), _f(sin), 2)
    before = L.launches
    flame.grad([q, k, v], fx + [w for pair in fw for w in pair], fg)
    assert L.launches - before == 3  # a reduction per stream (of 4 partial rows: not split on the GPU either)


def test_second_backward_with_retain_graph():
    xs, weights, cos, sin, gs = _case(1, 1, 4, (2, 3), (0, 0), torch.float32)
    fx = [_f(x, True) for x in xs]
    fw = [tuple(_f(w) for w in pair) for pair in weights]
    outs = F.qk_norm_rope(fx, fw, _f(cos), _f(sin), 1)
    fg = [_f(g) for g in gs]
    first = flame.grad(list(outs), fx, fg, retain_graph=True)
    second = flame.grad(list(outs), fx, fg)
    for a, b in zip(first, second):
        assert torch.equal(a.to_torch(), b.to_torch())


def test_gradcheck():
    torch.manual_seed(0)
    xs = [flame.tensor(torch.randn(1, n, 12 + e, dtype=torch.float64).numpy(), requires_grad=True)
          for n, e in ((2, 0), (1, 1))]
    ws = [flame.tensor((1 + 0.3 * torch.randn(4, dtype=torch.float64)).numpy(), requires_grad=True) for _ in range(4)]
    angles = torch.randn(3, 2, dtype=torch.float64)
    cos, sin = _f(angles.cos().float()), _f(angles.sin().float())

    def fn(x0, x1, wq0, wk0, wq1, wk1):
        return flame.cat(list(F.qk_norm_rope([x0, x1], [(wq0, wk0), (wq1, wk1)], cos, sin, 1)), 1)

    assert gradcheck(fn, [*xs, *ws])


def test_matches_diffusers_modules():
    """diffusers' FluxPosEmbed tables (every other column: they are repeat-interleaved), RMSNorm
    modules and apply_rotary_emb, on a text stream and an image stream."""
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    B, H, D, Lt, side = 2, 2, 8, 3, 2
    ids = torch.cat([torch.zeros(Lt, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side * 1.0),
                                                                   torch.arange(side * 1.0), indexing="ij"), -1)
                     .reshape(-1, 3)])
    xs, weights, _, _, gs = _case(B, H, D, (Lt, side * side), (0, 4), torch.float32)
    cos_full, sin_full = FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4])(ids.to(xs[0].device))
    norms = []
    for wq, wk in weights:
        pair = [RMSNorm(D, eps=EPS).to(wq.device), RMSNorm(D, eps=EPS).to(wq.device)]
        with torch.no_grad():
            pair[0].weight.copy_(wq)
            pair[1].weight.copy_(wk)
        norms.append(pair)
    parts = []
    for x, (nq, nk) in zip(xs, norms):
        q, k, v = x[..., :3 * H * D].unflatten(-1, (3, H, D)).unbind(2)
        parts.append((nq(q), nk(k), v))
    q, k, v = (torch.cat(p, dim=1) for p in zip(*parts))
    want = [apply_rotary_emb(t, (cos_full, sin_full), sequence_dim=1).transpose(1, 2) for t in (q, k)]
    outs, _ = _flame_run(xs, weights, cos_full[:, ::2].contiguous(), sin_full[:, ::2].contiguous(), gs, H)
    for got, ref in zip(outs, want + [v.transpose(1, 2)]):
        assert_close(got, ref.detach(), atol=1e-5, rtol=1e-5)


def test_empty_stream():
    xs, weights, cos, sin, gs = _case(2, 1, 4, (0, 3), (0, 0), torch.float32)
    _compare(xs, weights, cos, sin, gs, 1)


# ---- bad input -------------------------------------------------------------------------------------

def test_bad_inputs_raise_before_any_launch():
    xs, weights, cos, sin, _ = _case(2, 2, 4, (3, 5), (0, 0), torch.float32)
    fx = [_f(x) for x in xs]
    fw = [tuple(_f(w) for w in pair) for pair in weights]
    fc, fs = _f(cos), _f(sin)
    narrow = _f(torch.randn(2, 3, 23))
    half_stream, half_cos = _f(xs[1].half()), _f(cos.half())
    fp64_weights = [tuple(_f(w.double()) for w in pair) for pair in weights]
    bad = [
        (TypeError, "list of 1 or 2", lambda: F.qk_norm_rope(fx[0], fw, fc, fs, 2)),
        (TypeError, "list of 1 or 2", lambda: F.qk_norm_rope(fx * 2, fw * 2, fc, fs, 2)),
        (TypeError, "from_torch", lambda: F.qk_norm_rope([xs[0], fx[1]], fw, fc, fs, 2)),
        (ValueError, "fewer than 3", lambda: F.qk_norm_rope([narrow, fx[1]], fw, fc, fs, 2)),
        (ValueError, "3-D", lambda: F.qk_norm_rope([_f(torch.randn(3, 24)), fx[1]], fw, fc, fs, 2)),
        (ValueError, "contiguous", lambda: F.qk_norm_rope([_f(torch.randn(2, 24, 3)).transpose(1, 2), fx[1]], fw,
                                                          fc, fs, 2)),
        (TypeError, "one dtype", lambda: F.qk_norm_rope([fx[0], half_stream], fw, fc, fs, 2)),
        (ValueError, "batch", lambda: F.qk_norm_rope([fx[0], _f(torch.randn(1, 5, 24))], fw, fc, fs, 2)),
        (ValueError, "num_heads", lambda: F.qk_norm_rope(fx, fw, fc, fs, 0)),
        (TypeError, "pairs", lambda: F.qk_norm_rope(fx, fw[:1], fc, fs, 2)),
        (ValueError, "even", lambda: F.qk_norm_rope(fx, [(_f(torch.ones(3)),) * 2] * 2, _f(torch.ones(8, 1)),
                                                    _f(torch.ones(8, 1)), 2)),
        (ValueError, "one shape and dtype", lambda: F.qk_norm_rope(fx, [fw[0], (fw[1][0], _f(torch.ones(6)))],
                                                                   fc, fs, 2)),
        (TypeError, "float32 or the input's dtype", lambda: F.qk_norm_rope(fx, fp64_weights, fc, fs, 2)),
        (ValueError, r"\(L_total, D / 2\) = \(8, 2\)", lambda: F.qk_norm_rope(fx, fw, fc[:7], fs, 2)),
        (ValueError, "sin must have shape", lambda: F.qk_norm_rope(fx, fw, fc, _f(torch.ones(8, 4)), 2)),
        (TypeError, "cos must be a float32 table", lambda: F.qk_norm_rope(fx, fw, half_cos, fs, 2)),
        (ValueError, "eps", lambda: F.qk_norm_rope(fx, fw, fc, fs, 2, eps=-1.0)),
    ]
    before = L.launches
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    assert L.launches == before


# ---- the tail: the single block's MLP input through GELU ---------------------------------------------

def _tail_case(B, H, D, L, extra, dtype):
    xs, weights, cos, sin, gs = _case(B, H, D, (L,), (extra,), dtype)
    gt = torch.randn(B, L, extra, dtype=torch.float64).to(dtype).to(DEVICE)
    return xs[0], weights, cos, sin, gs, gt


def _tail_runs(x, weights, cos, sin, gs, gt, H, upcast=False):
    """flame's (q, k, v, tail) and gradients (input, weights) against torch's: q, k, v as
    ``_reference``, tail = gelu_tanh(x[..., 3HD:]), every output's gradient backpropagated."""
    fx = flame.from_torch(x, requires_grad=True)
    fw = [tuple(_f(w, True) for w in pair) for pair in weights]
    outs = F.qk_norm_rope([fx], fw, _f(cos), _f(sin), H, EPS, tail="gelu_tanh")
    grads = flame.grad(list(outs), [fx, *fw[0]], [_f(g) for g in (*gs, gt)])
    tx = (x.float() if upcast else x).detach().clone().requires_grad_()
    tw = [(w.float() if upcast else w).detach().clone().requires_grad_() for w in weights[0]]
    D = weights[0][0].shape[0]
    ref = (*_reference([tx], [tw], cos, sin, H), torch.nn.functional.gelu(tx[..., 3 * H * D:], approximate="tanh"))
    torch.autograd.backward(list(ref), [g.float() if upcast else g for g in (*gs, gt)])
    return outs, grads, [r.detach() for r in ref], [tx.grad, *(w.grad for w in tw)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_tail_is_gelu_of_the_mlp_columns_and_the_input_gets_one_gradient(dtype):
    x, weights, cos, sin, gs, gt = _tail_case(2, 2, 4, 5, 11, dtype)
    outs, grads, ref, ref_grads = _tail_runs(x, weights, cos, sin, gs, gt, 2)
    assert outs[3].shape == (2, 5, 11) and outs[3]._data.is_contiguous()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for got, want in zip(outs, ref):
        assert_close(got, want, **tol)
    gtol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for got, want in zip(grads, ref_grads):
        assert_close(got.to(want.dtype), want, **gtol)


def test_tail_launches_and_gradcheck():
    x, weights, cos, sin, gs, gt = _tail_case(1, 2, 4, 6, 9, torch.float32)
    fx = flame.from_torch(x, requires_grad=True)
    fw = [_f(w) for w in weights[0]]
    before = L.launches
    outs = F.qk_norm_rope([fx], [tuple(fw)], _f(cos), _f(sin), 2, EPS, tail="gelu_tanh")
    assert L.launches - before == 1
    before = L.launches
    flame.grad(list(outs), [fx], [_f(g) for g in (*gs, gt)])
    assert L.launches - before == 1  # one backward kernel writes the whole input gradient, tail included
    torch.manual_seed(1)
    x64 = flame.tensor(torch.randn(1, 2, 12 + 3, dtype=torch.float64).numpy(), requires_grad=True)
    ws = [flame.tensor((1 + 0.3 * torch.randn(4, dtype=torch.float64)).numpy()) for _ in range(2)]
    angles = torch.randn(2, 2, dtype=torch.float64)
    c, s = _f(angles.cos().float()), _f(angles.sin().float())

    def fn(x0):
        q, k, v, t = F.qk_norm_rope([x0], [tuple(ws)], c, s, 1, tail="gelu_tanh")
        return flame.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1), t.reshape(-1)], 0)

    assert gradcheck(fn, [x64])


def test_tail_errors():
    xs, weights, cos, sin, _ = _case(1, 1, 4, (2, 3), (4, 4), torch.float32)
    fx, fw = [_f(x) for x in xs], [tuple(_f(w) for w in p) for p in weights]
    with pytest.raises(ValueError, match="tail needs one stream"):
        F.qk_norm_rope(fx, fw, _f(cos), _f(sin), 1, tail="gelu_tanh")
    one, w1, c1, s1, _ = _case(1, 1, 4, (3,), (0,), torch.float32)
    with pytest.raises(ValueError, match="tail needs one stream with columns past"):
        F.qk_norm_rope([_f(one[0])], [tuple(_f(w) for w in w1[0])], _f(c1), _f(s1), 1, tail="gelu_tanh")
    with pytest.raises(ValueError, match="tail must be None or 'gelu_tanh'"):
        F.qk_norm_rope(fx[:1], fw[:1], _f(cos[:2]), _f(sin[:2]), 1, tail="relu")


# ---- GPU: bf16 at Flux's sizes ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block", ["double", "single"])
def test_flux_sizes_bf16(block):
    """Flux.1: 24 heads of 128; the double block's text (512 tokens) and image (4096) projections of
    3 H D columns, or the single block's linear1 output (4608 tokens, 3 H D + 12288 columns); bf16
    weights. Weight gradients are bitwise the same when run again."""
    lengths, extra = ((512, 4096), (0, 0)) if block == "double" else ((4608,), (12288,))
    case = _case(1, 24, 128, lengths, extra, torch.bfloat16)
    _compare(*case, 24)
    if block == "single":  # and as the model runs it: the MLP columns through GELU in the same launches
        x, weights, cos, sin, gs, gt = _tail_case(1, 24, 128, 4608, 12288, torch.bfloat16)
        outs, grads, low, low_grads = _tail_runs(x, weights, cos, sin, gs, gt, 24)
        _, _, want, want_grads = _tail_runs(x, weights, cos, sin, gs, gt, 24, upcast=True)
        for got, lo, hi in zip((outs[0], outs[1], outs[3]), (low[0], low[1], low[3]), (want[0], want[1], want[3])):
            assert_within_torch_error(got, lo, hi, 2)
        for got, lo, hi in zip(grads, low_grads, want_grads):
            assert_within_torch_error(got.to(lo.dtype), lo, hi, 3)
    runs = [_flame_run(*case, 24)[1] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a.to_torch(), b.to_torch())
