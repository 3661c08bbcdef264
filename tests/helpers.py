"""Shared test helpers: paired flame/torch tensors and per-dtype comparisons."""
import numpy as np
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


def numpy64(x):
    return np.asarray(to_torch(x).detach().double().cpu())
