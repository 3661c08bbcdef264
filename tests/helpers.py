"""Shared test helpers: paired flame/torch tensors, per-dtype comparisons, and ``check_op``, which
runs a flame op and its PyTorch reference on the same inputs and compares outputs and gradients."""
import dataclasses
import importlib.util
import sys

import torch

import flame

DEVICE = flame.device

# PyTorch's own defaults, loosened slightly for fp32 where flame's transcendental functions
# differ from PyTorch's by a few ulp.
TOL = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}

FLOAT_DTYPES_CPU = [torch.float32, torch.float16]

# fp32 matrix products run as tf32 on the GPU (inputs rounded to 10 mantissa bits) and exactly in
# the interpreter: fp32 results that went through a GEMM get this tolerance on the GPU.
TF32_TOL = {} if flame.is_interpreter() else dict(rtol=1e-2, atol=1e-2)
# The interpreter converts fp32 to bf16 by truncating the mantissa (Triton 3.6's _convert_float),
# twice round-to-nearest's error and biased: bf16 results are compared on the GPU.
GPU_ONLY_DTYPES = [torch.bfloat16]


def pair(shape, dtype=torch.float32, requires_grad=False, noncontig=False, low=None, high=None, gen=None):
    """(flame tensor, torch tensor) holding the same values; ``noncontig`` gives a transposed
    layout for 2+ dims and a strided slice for 1 dim."""
    if dtype.is_floating_point:
        t = torch.randn(shape, dtype=torch.float64)
        if low is not None:
            t = low + (high - low) * torch.rand(shape, dtype=torch.float64)
        t = t.to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape) > 0.5
    else:
        t = torch.randint(-5 if low is None else low, 6 if high is None else high, shape, dtype=dtype)
    t = t.to(DEVICE)
    if noncontig and len(shape) >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif noncontig and len(shape) == 1:
        t = torch.stack([t, t], -1)[:, 0]
    f = flame.from_torch(t.clone() if not noncontig else t, requires_grad=requires_grad and dtype.is_floating_point)
    tt = t.detach().clone().requires_grad_(requires_grad and dtype.is_floating_point)
    return f, tt


def to_torch(x):
    return x.to_torch() if isinstance(x, flame.Tensor) else x


def assert_close(got, want, dtype=None, **kw):
    got, want = to_torch(got), to_torch(want)
    dtype = dtype or want.dtype
    tol = dict(TOL.get(dtype, dict(rtol=0, atol=0)))
    tol.update({k: v for k, v in kw.items() if v is not None})
    assert tuple(got.shape) == tuple(want.shape), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), equal_nan=True, **tol)


def rel_err(x, ref):
    x, ref = to_torch(x).detach().double().cpu(), to_torch(ref).detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_within_torch_error(got, torch_lowp, ref32, factor):
    """The low-precision rule (docs/design.md, Testing): flame's error against an fp32 reference is at most
    ``factor`` times PyTorch's own error in the same dtype (plus a floor of one bf16 ulp)."""
    e_flame, e_torch = rel_err(got, ref32), rel_err(torch_lowp, ref32)
    assert e_flame <= factor * max(e_torch, 2 ** -9), \
        f"flame error {e_flame:.3g} > {factor} x torch error {e_torch:.3g}"


# ---- one op against its PyTorch reference ------------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class OpRun:
    """Both sides of one forward+backward: outputs, inputs as passed, and each input's gradient
    (None where the input takes none; flame's as flame Tensors)."""

    out: object
    ref: torch.Tensor
    grads: list
    ref_grads: list
    inputs: list
    ref_inputs: list


def _sides(x, wants_grad, upcast=False):
    """(flame input, torch input) for one entry of ``check_op``'s ``inputs``."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], flame.Tensor):
        f, t = x
        if upcast and t.dtype in LOW_PRECISION:
            t = t.detach().float().requires_grad_(t.requires_grad)
        return f, t
    if not isinstance(x, torch.Tensor):
        return x, x
    rg = wants_grad and x.dtype.is_floating_point
    t = x.detach().float() if upcast and x.dtype in LOW_PRECISION else x.detach()
    return flame.from_torch(x.detach().to(DEVICE, copy=True), requires_grad=rg), t.clone().requires_grad_(rg)


def run_op(f_fn, t_fn, inputs, g=None, grad_mask=None, flame_side=True, upcast=False) -> OpRun:
    """Forward and backward of ``f_fn`` (flame) and ``t_fn`` (torch) on the same ``inputs``: each a
    torch tensor (both sides get copies of its values; floating ones require grad unless
    ``grad_mask`` says no), a ``(flame, torch)`` pair such as ``pair()`` makes (used as given), or
    anything else (passed to both). ``g``: the output's gradient, a torch tensor (default: random,
    of the reference's shape and dtype). ``flame_side=False`` runs only torch; ``upcast`` runs torch
    on fp32 copies of fp16/bf16 inputs, with ``g`` in fp32 (the reference of the low-precision rule)."""
    mask = grad_mask if grad_mask is not None else [True] * len(inputs)
    sides = [_sides(x, m, upcast) for x, m in zip(inputs, mask)]
    ref_inputs = [t for _, t in sides]
    ref = t_fn(*ref_inputs)
    if g is None:
        g = torch.randn(ref.shape, dtype=torch.float64).to(ref.dtype).to(ref.device)
    ref.backward(g.float() if upcast else g)
    ref_grads = [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in ref_inputs]
    out, grads, f_inputs = None, [], [f for f, _ in sides]
    if flame_side:
        out = f_fn(*f_inputs)
        gmap = out.backward(flame.from_torch(g.detach().to(DEVICE, copy=True)))
        grads = [gmap[f] if isinstance(f, flame.Tensor) and f.requires_grad else None for f in f_inputs]
    return OpRun(out, ref.detach(), grads, ref_grads, f_inputs, ref_inputs)


def check_op(f_fn, t_fn, inputs, g=None, *, grad_mask=None, tol=None, grad_tol=None, lowp=None) -> OpRun:
    """``run_op``, then flame's output and every input gradient against PyTorch's: ``assert_close``
    with the reference dtype's ``TOL``, or ``tol`` (output) and ``grad_tol`` (gradients; default
    ``tol``; a list gives one per input, None there meaning ``tol``). A tolerance is a dict or a
    function of the reference tensor returning one (errors that scale with its magnitude).
    ``lowp=(out_factor, grad_factor)``: for fp16/bf16 outputs, the low-precision rule
    instead (``assert_within_torch_error`` against torch on fp32 copies; an out_factor of None keeps
    ``tol`` for the output, for ops that only copy). Returns the ``OpRun``."""
    run = run_op(f_fn, t_fn, inputs, g, grad_mask)
    grad_tols = grad_tol if isinstance(grad_tol, list) else [grad_tol] * len(inputs)
    if lowp is not None and run.ref.dtype in LOW_PRECISION:
        assert run.out.dtype == run.ref.dtype, f"dtype {run.out.dtype} != {run.ref.dtype}"
        up = run_op(f_fn, t_fn, inputs, g, grad_mask, flame_side=False, upcast=True)
        if lowp[0] is None:
            assert_close(run.out, run.ref, **_tol(tol, run.ref))
        else:
            assert_within_torch_error(run.out, run.ref, up.ref, lowp[0])
        for got, low, want in zip(run.grads, run.ref_grads, up.ref_grads):
            if want is not None:
                assert_within_torch_error(got, low, want, lowp[1])
        return run
    assert_close(run.out, run.ref, **_tol(tol, run.ref))
    for got, want, gt in zip(run.grads, run.ref_grads, grad_tols):
        if want is not None:
            assert_close(got.to_torch().to(want.dtype), want, **_tol(tol if gt is None else gt, want))
    return run


def _tol(spec, want):
    """``check_op``'s tolerance for the reference ``want``: a dict, a function of ``want``, or None."""
    return (spec(want) if callable(spec) else spec) or {}


def without_gluon(module, monkeypatch):
    """A fresh copy of the kernel ``module`` imported as a Triton without ``triton.experimental.gluon``
    would import it (the Hopper kernel files must still load, and then serve no call)."""
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)
    spec = importlib.util.spec_from_file_location(f"{module.__name__}_without_gluon", module.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.gluon is None
    copy.available.cache_clear()
    assert not copy.available()
    return copy
