import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import flame
import flame.nn.functional as F
from flame import tune
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, check_op, run_op

# ---- helpers ------------------------------------------------------------------------------------


def _f(t, requires_grad=False):
    return flame.from_torch(t.detach().to(DEVICE, copy=True), requires_grad=requires_grad)


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def _check(f_fn, t_fn, inputs, g, factor_out=2, factor_grad=3):
    """flame vs torch, values and every gradient (``check_op``): torch tolerances in fp32/fp64; in
    fp16/bf16 the design's rule against an fp32 reference computed from the same (rounded) inputs."""
    return check_op(f_fn, t_fn, inputs, g, tol=dict(atol=1e-5, rtol=1e-4), grad_tol=dict(atol=1e-4, rtol=1e-4),
                    lowp=(factor_out, factor_grad)).out


def _gn_torch(G, eps, act):
    def fn(x, w, b):
        y = TF.group_norm(x, G, w, b, eps)
        return TF.silu(y) if act == "silu" else y
    return fn


def _gn_flame(G, eps, act):
    return lambda x, w, b: F.group_norm(x, G, w, b, eps, act)


def _gn_inputs(shape, dtype, affine, channels_last, offset=0.0):
    x = (torch.randn(shape, dtype=torch.float64) + offset).to(dtype).to(DEVICE)
    if channels_last:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        x = x.contiguous(memory_format=fmt)
    C = shape[1]
    w = (1 + 0.5 * torch.randn(C)).to(dtype).to(DEVICE) if affine else None
    b = torch.randn(C).to(dtype).to(DEVICE) if affine else None
    g = torch.randn(shape).to(dtype).to(DEVICE)
    return x, w, b, g


# ---- GroupNorm ----------------------------------------------------------------------------------

GN_CASES = [
    ((2, 6, 7, 9), 3),     # spatial 7x9, 2 channels per group
    ((2, 4, 1, 1), 4),     # spatial 1x1, groups of 1 channel
    ((3, 10, 3, 5), 5),
    ((1, 6, 5, 4), 1),     # one group = LayerNorm over (C, H, W)
]


@pytest.mark.parametrize("shape,G", GN_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
def test_group_norm(shape, G, dtype, channels_last, act):
    x, w, b, g = _gn_inputs(shape, dtype, True, channels_last)
    out = _check(_gn_flame(G, 1e-5, act), _gn_torch(G, 1e-5, act), [x, w, b], g)
    # output keeps the input's memory format
    assert out.stride() == x.stride()


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_group_norm_no_affine_and_eps(affine, eps):
    x, w, b, g = _gn_inputs((2, 6, 3, 4), torch.float32, affine, False)
    _check(_gn_flame(2, eps, None), _gn_torch(2, eps, None), [x, w, b], g)


def test_group_norm_weight_only_and_3d_5d():
    x, w, _, g = _gn_inputs((2, 6, 11), torch.float32, True, False)
    _check(lambda x, w: F.group_norm(x, 3, w), lambda x, w: TF.group_norm(x, 3, w), [x, w], g)
    x, w, b, g = _gn_inputs((1, 4, 2, 3, 3), torch.float32, True, True)
    out = _check(_gn_flame(2, 1e-5, "silu"), _gn_torch(2, 1e-5, "silu"), [x, w, b], g)
    assert out.stride() == x.stride()


@contextlib.contextmanager
def _forced(**configs):
    """Every launch of the kernels named uses the config given (``flame.tune.override``); each of
    them must have been asked for its config inside the block."""
    with contextlib.ExitStack() as stack:
        active = [stack.enter_context(tune.override(kernel, cfg)) for kernel, cfg in configs.items()]
        yield
    assert all(a.served for a in active), [(a.kernel, a.served) for a in active]


def _gn_config(block_c, block_s, splits):
    """A GroupNorm config: the statistics pass in ``block_c`` x ``block_s`` tiles over ``splits``
    splits of each group's positions, the apply pass in 4 x 16 tiles."""
    return dict(BLOCK_C=block_c, BLOCK_S=block_s, SPLITS=splits, num_warps=4, BLOCK_C_APPLY=4, BLOCK_S_APPLY=16,
                num_warps_apply=4)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("batch", [1, 2])
def test_group_norm_split_statistics(channels_last, act, batch):
    # batch-1 path: each group's statistics split over several programs (3 splits of S = 63, the
    # last one short), channel blocks of 4 over C = 6 (not a multiple), then combined; the apply
    # pass in blocks that do not divide C or S either
    x, w, b, g = _gn_inputs((batch, 6, 7, 9), torch.float32, True, channels_last)
    with _forced(group_norm_fwd=_gn_config(4, 8, 3), group_norm_bwd=_gn_config(4, 8, 3)):
        _check(_gn_flame(3, 1e-5, act), _gn_torch(3, 1e-5, act), [x, w, b], g)


def test_group_norm_large_mean_is_stable():
    # |mean| >> std: naive fp32 sum / sum-of-squares would cancel; shifted sums do not
    x = (torch.randn(1, 4, 8, 8, dtype=torch.float64, device=DEVICE) * 0.01 + 1000.0)
    ref = TF.group_norm(x, 2).float()
    with _forced(group_norm_fwd=_gn_config(2, 16, 4)):
        y = F.group_norm(_f(x.float()), 2)
    assert_close(y, ref, atol=2e-2, rtol=0)  # fp32 input rounding of 1000 + 0.01 z alone is ~3e-3 of std


def test_group_norm_stats_fp32_for_fp16():
    x = _f(torch.randn(1, 4, 3, 3, device=DEVICE).half(), True)
    y = F.group_norm(x, 2)
    _, _, _, mean, rstd = y.grad_fn.saved
    assert mean.dtype == torch.float32 and rstd.dtype == torch.float32


def test_group_norm_non_collapsible_input():
    # a permuted view whose spatial dims don't collapse goes through a copy
    base = torch.randn(2, 5, 6, 4, device=DEVICE)
    x = base.permute(0, 3, 2, 1)  # (2, 4, 6, 5), odd strides
    w, b = torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)
    g = torch.randn(2, 4, 6, 5, device=DEVICE)
    _check(_gn_flame(2, 1e-5, None), _gn_torch(2, 1e-5, None), [x, w, b], g)


def test_group_norm_gradcheck():
    rng = np.random.default_rng(0)
    x = flame.tensor(rng.standard_normal((2, 4, 2, 3)), requires_grad=True)
    w = flame.tensor(1 + 0.3 * rng.standard_normal(4), requires_grad=True)
    b = flame.tensor(rng.standard_normal(4), requires_grad=True)
    assert gradcheck(lambda x, w, b: F.group_norm(x, 2, w, b, 1e-5, "silu"), [x, w, b])
    xc = flame.from_torch(torch.from_numpy(rng.standard_normal((1, 3, 2, 2))).to(DEVICE).contiguous(
        memory_format=torch.channels_last), requires_grad=True)
    assert gradcheck(lambda x: F.group_norm(x, 3), [xc])


def test_group_norm_empty():
    for shape in [(0, 4, 3, 3), (2, 4, 0, 3)]:
        x = _f(torch.randn(shape, device=DEVICE), True)
        w, b = _f(torch.randn(4, device=DEVICE), True), _f(torch.randn(4, device=DEVICE), True)
        y = F.group_norm(x, 2, w, b)
        assert y.shape == shape
        grads = y.sum().backward()
        assert grads[x].shape == shape
        assert_close(grads[w], torch.zeros(4))
        assert_close(grads[b], torch.zeros(4))


def test_group_norm_bad_inputs():
    x = _f(torch.randn(2, 6, 3, 3))
    with pytest.raises(ValueError, match="divisible"):
        F.group_norm(x, 4)
    with pytest.raises(ValueError, match="weight"):
        F.group_norm(x, 3, _f(torch.randn(5)))
    with pytest.raises(ValueError, match="bias"):
        F.group_norm(x, 3, _f(torch.randn(6)), _f(torch.randn(6, 1)))
    with pytest.raises(ValueError, match="activation"):
        F.group_norm(x, 3, activation="gelu")
    with pytest.raises(ValueError, match="num_groups"):
        F.group_norm(x, 0)
    with pytest.raises(ValueError, match="shape"):
        F.group_norm(_f(torch.randn(6)), 3)
    with pytest.raises(ValueError, match="eps"):
        F.group_norm(x, 3, eps=-1.0)
    with pytest.raises(TypeError, match="floating"):
        F.group_norm(flame.from_torch(torch.ones(2, 6, 3, 3, dtype=torch.int64, device=DEVICE)), 3)
    with pytest.raises(TypeError, match="weight"):
        F.group_norm(x, 3, torch.randn(6))


# ---- LayerNorm / RMSNorm ------------------------------------------------------------------------

LN_CASES = [
    ((5, 3, 20), (20,)),
    ((7, 33), (33,)),        # D not a power of two
    ((4, 3, 5), (3, 5)),     # two normalised dims
    ((1, 1), (1,)),
]


def _ln_fns(rms, ns, eps):
    if rms:
        return (lambda x, w: F.rms_norm(x, ns, w, eps)), (lambda x, w: TF.rms_norm(x, ns, w, eps))
    return (lambda x, w, b: F.layer_norm(x, ns, w, b, eps)), (lambda x, w, b: TF.layer_norm(x, ns, w, b, eps))


def _ln_inputs(shape, ns, dtype, affine, rms, noncontig=False):
    x = torch.randn(shape, dtype=torch.float64).to(dtype).to(DEVICE)
    if noncontig and len(shape) >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    w = (1 + 0.5 * torch.randn(ns)).to(dtype).to(DEVICE) if affine else None
    b = torch.randn(ns).to(dtype).to(DEVICE) if affine else None
    g = torch.randn(shape).to(dtype).to(DEVICE)
    return ([x, w] if rms else [x, w, b]), g


@pytest.mark.parametrize("shape,ns", LN_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("rms", [False, True])
def test_layer_rms_norm(shape, ns, dtype, rms):
    inputs, g = _ln_inputs(shape, ns, dtype, True, rms)
    f_fn, t_fn = _ln_fns(rms, ns, 1e-5)
    _check(f_fn, t_fn, inputs, g)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_rms_norm_no_affine_noncontig_eps(rms, affine):
    inputs, g = _ln_inputs((6, 10), (10,), torch.float32, affine, rms, noncontig=True)
    for eps in ([None, 1e-3] if rms else [1e-5, 0.1]):
        f_fn, t_fn = _ln_fns(rms, (10,), eps)
        _check(f_fn, t_fn, inputs, g)


@pytest.mark.parametrize("shape, offset, fwd, bwd", [
    ((3, 16411), 5.0, dict(BLOCK_M=2, num_warps=4), None),
    ((11, 37), 50.0, dict(BLOCK_M=2, num_warps=4), dict(BLOCK_M=2, num_warps=4, PROGRAMS=3)),
], ids=["looped-rows", "multi-program"])
@pytest.mark.parametrize("rms", [False, True])
def test_layer_rms_norm_paths(shape, offset, fwd, bwd, rms):
    # rows of 16411, longer than the largest block (16384 here, 8192 on the GPU): the streamed
    # three-pass kernels, the forward two rows per program (the last one masked), the backward one
    # row per program; (11, 37): 3 programs each reducing several 2-row blocks into dW/dB partials
    inputs, g = _ln_inputs(shape, shape[-1:], torch.float32, True, rms)
    inputs[0] = inputs[0] + offset  # offset mean: the looped LayerNorm's centred variance pass
    f_fn, t_fn = _ln_fns(rms, shape[-1:], 1e-5)
    with _forced(layer_norm_fwd=fwd, **({"layer_norm_bwd": bwd} if bwd else {})):
        _check(f_fn, t_fn, inputs, g)


def test_layer_rms_norm_gradcheck():
    rng = np.random.default_rng(1)
    x = flame.tensor(rng.standard_normal((3, 5)), requires_grad=True)
    w = flame.tensor(1 + 0.3 * rng.standard_normal(5), requires_grad=True)
    b = flame.tensor(rng.standard_normal(5), requires_grad=True)
    assert gradcheck(lambda x, w, b: F.layer_norm(x, 5, w, b), [x, w, b])
    assert gradcheck(lambda x, w: F.rms_norm(x, [5], w), [x, w])
    assert gradcheck(lambda x: F.layer_norm(x, (3, 5)), [x])


def test_layer_norm_empty():
    x = _f(torch.randn(0, 8, device=DEVICE), True)
    w, b = _f(torch.randn(8, device=DEVICE), True), _f(torch.randn(8, device=DEVICE), True)
    y = F.layer_norm(x, 8, w, b)
    assert y.shape == (0, 8)
    grads = y.sum().backward()
    assert grads[x].shape == (0, 8)
    assert_close(grads[w], torch.zeros(8))
    assert_close(grads[b], torch.zeros(8))
    assert F.rms_norm(_f(torch.randn(3, 0)), 0).shape == (3, 0)


def test_layer_norm_bad_inputs():
    x = _f(torch.randn(4, 6))
    with pytest.raises(ValueError, match="normalized_shape"):
        F.layer_norm(x, 5)
    with pytest.raises(ValueError, match="normalized_shape"):
        F.layer_norm(x, (2, 4, 6))
    with pytest.raises(ValueError, match="weight"):
        F.layer_norm(x, 6, _f(torch.randn(5)))
    with pytest.raises(ValueError, match="bias"):
        F.layer_norm(x, 6, None, _f(torch.randn(6, 1)))
    with pytest.raises(ValueError, match="weight"):
        F.rms_norm(x, [6], _f(torch.randn(4)))
    with pytest.raises(TypeError, match="floating"):
        F.rms_norm(flame.from_torch(torch.ones(4, 6, dtype=torch.int32, device=DEVICE)), 6)
    with pytest.raises(ValueError, match="eps"):
        F.layer_norm(x, 6, eps=float("nan"))


def test_layer_norm_keeps_each_call_signature_and_reads_each_call_s_buffers():
    """layer_norm keeps what a call signature resolved to (shapes, strides, dtypes, normalized_shape,
    eps): a kept signature is right on new buffers; a strided input or weight (dense copies), a list
    normalized_shape and a weight of another shape are signatures of their own."""
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 5, 6), (6,), (6,)))
        assert_close(F.layer_norm(_f(x), 6, _f(w), _f(b), 1e-3), TF.layer_norm(x, (6,), w, b, 1e-3))
        assert_close(F.rms_norm(_f(x), (6,), _f(w)), TF.rms_norm(x, (6,), w))
    w12 = torch.randn(12, generator=g, dtype=torch.float64)
    xt, wt = x.transpose(0, 1), w12[::2]
    for _ in range(2):  # the weight strided on flame's device too
        assert_close(F.layer_norm(_f(xt), [6], flame.from_torch(w12.to(DEVICE)[::2]), _f(b)),
                     TF.layer_norm(xt, (6,), wt, b))
    with pytest.raises(ValueError, match="weight"):
        F.layer_norm(_f(x), 6, _f(torch.randn(5, dtype=torch.float64)), _f(b), 1e-3)


# ---- GPU: bf16 and SDXL shapes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
def test_group_norm_bf16(channels_last, act):
    x, w, b, g = _gn_inputs((2, 64, 9, 7), torch.bfloat16, True, channels_last)
    _check(_gn_flame(32, 1e-5, act), _gn_torch(32, 1e-5, act), [x, w, b], g)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True])
def test_layer_rms_norm_bf16(rms):
    inputs, g = _ln_inputs((300, 640), (640,), torch.bfloat16, True, rms)
    f_fn, t_fn = _ln_fns(rms, (640,), 1e-5)
    _check(f_fn, t_fn, inputs, g)


SDXL_GN = [(1, 320, 128, 128), (1, 640, 64, 64), (1, 1280, 32, 32), (1, 2560, 32, 32), (4, 320, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SDXL_GN, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
def test_group_norm_sdxl_shapes(shape, channels_last, act):
    x, w, b, g = _gn_inputs(shape, torch.bfloat16, True, channels_last)
    out = _check(_gn_flame(32, 1e-5, act), _gn_torch(32, 1e-5, act), [x, w, b], g)
    assert out.stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 640), (1024, 1280), (16384, 320), (8192, 4096)], ids=str)
@pytest.mark.parametrize("rms", [False, True])
def test_layer_rms_norm_sdxl_shapes(shape, rms):
    inputs, g = _ln_inputs(shape, shape[-1:], torch.bfloat16, True, rms)
    f_fn, t_fn = _ln_fns(rms, shape[-1:], 1e-5)
    _check(f_fn, t_fn, inputs, g)


@pytest.mark.gpu
def test_group_norm_deterministic():
    x, w, b, g = _gn_inputs((1, 320, 64, 64), torch.bfloat16, True, True)
    runs = [run_op(_gn_flame(32, 1e-5, "silu"), _gn_torch(32, 1e-5, "silu"), [x, w, b], g).grads for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a.to_torch(), c.to_torch())


def test_strided_weight_and_bias():
    # parameters that are strided views are read correctly (kernels index them with unit stride)
    x, _, _, g = _gn_inputs((2, 6, 3, 4), torch.float32, False, True)
    w = torch.randn(12, device=DEVICE)[::2]
    b = torch.randn(6, 2, device=DEVICE)[:, 1]
    w2 = torch.randn(3, 4, device=DEVICE).t()  # (4, 3) non-contiguous, two normalised dims
    fw, fb, fw2 = (flame.from_torch(t, requires_grad=True) for t in (w, b, w2))
    assert not fw.is_contiguous() and not fb.is_contiguous() and not fw2.is_contiguous()
    cases = [  # the parameters as (flame view, torch leaf) pairs
        (lambda x, w, b: F.group_norm(x, 3, w, b, 1e-5, "silu"), lambda x, w, b: TF.silu(TF.group_norm(x, 3, w, b)),
         x, g, ((fw, _leaf(w)), (fb, _leaf(b)))),
        (lambda x, w, b: F.layer_norm(x, 6, w, b), lambda x, w, b: TF.layer_norm(x, (6,), w, b),
         x[:, :, 0, 0].contiguous(), g[:, :, 0, 0].contiguous(), ((fw, _leaf(w)), (fb, _leaf(b)))),
        (lambda x, w: F.rms_norm(x, (4, 3), w), lambda x, w: TF.rms_norm(x, (4, 3), w),
         x[:, :4, :, 0].contiguous(), g[:, :4, :, 0].contiguous(), ((fw2, _leaf(w2)),)),
    ]
    for f_fn, t_fn, xt, gt, params in cases:
        _check(f_fn, t_fn, [xt, *params], gt)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True])
def test_layer_rms_norm_deterministic(rms):
    inputs, g = _ln_inputs((4096, 640), (640,), torch.bfloat16, True, rms)
    runs = [run_op(*_ln_fns(rms, (640,), 1e-5), inputs, g).grads for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a.to_torch(), c.to_torch())


@pytest.mark.parametrize("which", ["x", "w", "b"])
def test_partial_requires_grad(which):
    # only one input requires grad: the other gradients are skipped (dx-less / dW-less kernels)
    x, w, b, g = _gn_inputs((2, 6, 3, 4), torch.float32, True, True)
    xl = x[:, :, 0, 0].contiguous()
    gl = g[:, :, 0, 0].contiguous()
    for f_fn, t_fn, xx, gg in [(_gn_flame(3, 1e-5, "silu"), _gn_torch(3, 1e-5, "silu"), x, g),
                               (lambda x, w, b: F.layer_norm(x, 6, w, b), lambda x, w, b: TF.layer_norm(x, (6,), w, b),
                                xl, gl),
                               (lambda x, w, b: F.rms_norm(x, 6, w), lambda x, w, b: TF.rms_norm(x, (6,), w), xl, gl)]:
        want = {"x": 0, "w": 1, "b": 2}[which]
        fl = [_f(t, i == want) for i, t in enumerate((xx, w, b))]
        y = f_fn(*fl)
        if not y.requires_grad:  # rms_norm has no bias
            continue
        grads = y.backward(_f(gg))
        # torch computes every gradient (its CPU GroupNorm backward crashes on channels-last input
        # when the input itself does not require grad)
        leaves = [t.detach().clone().requires_grad_(True) for t in (xx, w, b)]
        t_fn(*leaves).backward(gg)
        assert_close(grads[fl[want]], leaves[want].grad, atol=1e-4, rtol=1e-4)
        assert len(grads) == 1


# ---- layer_norm_modulated (AdaLayerNormZero) ------------------------------------------------------

def _mod_fns(C):
    """(flame, torch) functions of (x, emb): shift and scale are the first and third C-column
    slices of the (B, 6C) modulation output ``emb``, read in place."""
    def flame_fn(x, emb):
        return F.layer_norm_modulated(x, emb[:, :C], emb[:, 2 * C:3 * C])

    def torch_fn(x, emb):
        return TF.layer_norm(x, (C,), eps=1e-6) * (1 + emb[:, None, 2 * C:3 * C]) + emb[:, None, :C]

    return flame_fn, torch_fn


def _mod_inputs(B, L, C, dtype, strided=False):
    """x (B, L, C) (``strided``: a slice of wider rows of a (L + 2, B, C + 3) buffer, transposed:
    batch and row strides of its own), the modulation output (B, 6C) and the output's gradient."""
    if strided:
        x = torch.randn(L + 2, B, C + 3, dtype=torch.float64).to(dtype).to(DEVICE).transpose(0, 1)[:, 1:L + 1, 2:C + 2]
    else:
        x = torch.randn(B, L, C, dtype=torch.float64).to(dtype).to(DEVICE)
    emb = (0.5 * torch.randn(B, 6 * C, dtype=torch.float64)).to(dtype).to(DEVICE)
    return x, emb, torch.randn(B, L, C, dtype=torch.float64).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 3, 32), (3, 1, 6)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
def test_layer_norm_modulated(shape, dtype):
    x, emb, g = _mod_inputs(*shape, dtype)
    _check(*_mod_fns(shape[2]), [x, emb], g)


def test_layer_norm_modulated_reads_strided_input_in_place_and_several_programs(monkeypatch):
    """x with batch and row strides of its own (read in place); blocks of 2 rows, the backward's 3
    programs per batch each summing several row blocks into the modulation's partials."""
    x, emb, g = _mod_inputs(2, 11, 5, torch.float32, strided=True)
    fx = flame.from_torch(x, requires_grad=True)
    assert fx.stride() == x.stride()
    real = flame.kernels.norms._ln_default
    monkeypatch.setattr(flame.kernels.norms, "_ln_default", lambda M, D, bwd: dict(
        real(M, D, bwd), BLOCK_M=2, **({"PROGRAMS": 6} if bwd else {})))
    _check(*_mod_fns(5), [(fx, x.detach().clone().requires_grad_()), emb], g)


def test_layer_norm_modulated_one_launch_forward_and_gradcheck():
    x, emb, _ = _mod_inputs(2, 3, 4, torch.float64)
    fx, femb = _f(x, True), _f(emb, True)
    shift, scale = femb[:, :4], femb[:, 8:12]
    before = flame.kernels.launch.launches
    F.layer_norm_modulated(fx, shift, scale)
    assert flame.kernels.launch.launches - before == 1
    assert gradcheck(lambda x, emb: _mod_fns(4)[0](x, emb), [fx, femb])
    assert gradcheck(lambda x, s, c: F.layer_norm_modulated(x, s, c, eps=0.1), [fx, _f(emb[:, :4], True),
                                                                              _f(emb[:, 4:8], True)])


@pytest.mark.parametrize("which", ["x", "shift", "scale"])
def test_layer_norm_modulated_partial_requires_grad(which):
    x, emb, g = _mod_inputs(2, 4, 6, torch.float32)
    args = [x, emb[:, :6], emb[:, 6:12]]
    want = ["x", "shift", "scale"].index(which)
    fl = [_f(t, i == want) for i, t in enumerate(args)]
    grads = F.layer_norm_modulated(*fl).backward(_f(g))
    leaves = [t.detach().clone().requires_grad_(True) for t in args]
    (TF.layer_norm(leaves[0], (6,), eps=1e-6) * (1 + leaves[2][:, None]) + leaves[1][:, None]).backward(g)
    assert_close(grads[fl[want]], leaves[want].grad, atol=1e-4, rtol=1e-4)
    assert len(grads) == 1


def test_layer_norm_modulated_empty():
    x = _f(torch.randn(2, 0, 4), True)
    s, c = _f(torch.randn(2, 4), True), _f(torch.randn(2, 4), True)
    y = F.layer_norm_modulated(x, s, c)
    assert y.shape == (2, 0, 4)
    grads = y.sum().backward()
    assert_close(grads[s], torch.zeros(2, 4))
    assert_close(grads[c], torch.zeros(2, 4))


def test_layer_norm_modulated_bad_inputs():
    x, s = _f(torch.randn(2, 3, 4)), _f(torch.randn(2, 4))
    wide, wide_mod = _f(torch.randn(1, 1, 8193)), _f(torch.randn(1, 8193))
    bad = [
        (ValueError, r"\(B, L, C\)", lambda: F.layer_norm_modulated(_f(torch.randn(3, 4)), s, s)),
        (ValueError, "contiguous", lambda: F.layer_norm_modulated(_f(torch.randn(2, 4, 3)).transpose(1, 2), s, s)),
        (ValueError, "shift of shape", lambda: F.layer_norm_modulated(x, _f(torch.randn(1, 4)), s)),
        (ValueError, "scale of shape", lambda: F.layer_norm_modulated(x, s, _f(torch.randn(2, 3)))),
        (TypeError, "one dtype", lambda: F.layer_norm_modulated(x, s, _f(torch.randn(2, 4, dtype=torch.float64)))),
        (TypeError, "floating", lambda: F.layer_norm_modulated(x, _f(torch.ones(2, 4, dtype=torch.int32)), s)),
        (TypeError, "from_torch", lambda: F.layer_norm_modulated(x, torch.randn(2, 4), s)),
        (ValueError, "8192", lambda: F.layer_norm_modulated(wide, wide_mod, wide_mod)),
        (ValueError, "eps", lambda: F.layer_norm_modulated(x, s, s, eps=float("inf"))),
    ]
    before = flame.kernels.launch.launches
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    assert flame.kernels.launch.launches == before


@pytest.mark.gpu
def test_layer_norm_modulated_flux_bf16():
    # Flux.1's image stream at 1024x1024 (4096 tokens) and both streams of a single block (4608)
    for L in (4096, 4608):
        x, emb, g = _mod_inputs(1, L, 3072, torch.bfloat16)
        _check(*_mod_fns(3072), [x, emb], g)
    x, emb, g = _mod_inputs(2, 4096, 3072, torch.bfloat16)
    runs = [run_op(*_mod_fns(3072), [x, emb], g).grads for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a.to_torch(), c.to_torch())
