"""Logic-gate ops (Petersen et al. 2022): a layer of soft two-input gates, its hard (argmax) form,
and hard inference on bits packed 32 samples to an int32 word. Kernels and the math:
``flame/kernels/logic.py``.

``logic_gates(x, weight, a_index, b_index)`` takes ``x`` (B, IN) in [0, 1] with any strides and
returns (B, G) as a transposed view of a feature-major (G, B) buffer: the next layer then reads each
wiring column as one contiguous row. Its backward needs, for the input's gradient, a ``LogicPlan``
of the wiring (built on the host, once per wiring: pass one, or one is built at the forward); the
logits' gradient needs none.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import runtime
from ..autograd import needs_grad, no_grad, record
from ..kernels import logic as K
from ..kernels.logic import LogicPlan
from ..tensor import Tensor
from ._util import check_tensor
from .reduce import amax, amin

__all__ = ["LogicPlan", "group_count", "group_sum", "logic_codes", "logic_gates", "logic_gates_packed", "logic_plan",
           "pack_bits", "unpack_bits", "wiring_array"]

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_wiring(a_index, b_index, gates, op):
    for name, t in (("a_index", a_index), ("b_index", b_index)):
        check_tensor(t, name, op)
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{op}: {name} must be int64 or int32, got {t.dtype}")
        if t.shape != (gates,):
            raise ValueError(f"{op}: {name} must have shape ({gates},) (one index per gate), got {t.shape}")


def wiring_array(values, name: str, gates: int, in_dim: int, op: str) -> np.ndarray:
    """``values`` (a flame integer Tensor, read to the host, or anything NumPy takes) as an int64
    array of ``gates`` indices, checked to lie in [0, in_dim)."""
    arr = values.numpy() if isinstance(values, Tensor) else np.asarray(values)
    if arr.shape != (gates,) or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise ValueError(f"{op}: {name} must hold {gates} integer indices (one per gate), got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= in_dim):
        raise IndexError(f"{op}: {name} values must lie in [0, {in_dim}) (in_dim), got values in "
                         f"[{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64)


def logic_plan(a_index, b_index, in_dim: int) -> LogicPlan:
    """The input-gradient plan of a wiring (``LogicPlan``): reads the indices to the host (a sync),
    checks that they lie in [0, in_dim) and builds the per-column reader lists."""
    op = "logic_plan"
    check_tensor(a_index, "a_index", op)
    _check_wiring(a_index, b_index, a_index.shape[0] if a_index.ndim == 1 else a_index.numel(), op)
    gates = a_index.shape[0]
    return LogicPlan(wiring_array(a_index, "a_index", gates, in_dim, op),
                     wiring_array(b_index, "b_index", gates, in_dim, op), in_dim)


def _check_unit_range(x, op):
    """strict mode: every input in [0, 1] (a min and a max, read back: a host sync)."""
    if x.numel() == 0:
        return
    with no_grad():
        lo, hi = amin(x).item(), amax(x).item()
    if not (lo >= 0.0 and hi <= 1.0):  # NaN fails too
        raise ValueError(f"{op}: strict mode: inputs must lie in [0, 1], got values in [{lo}, {hi}]")


# out = w0 + w1 a + w2 b + w3 ab with w = sum_i softmax(logits)_i c(i), a = x[:, a_index], b = x[:, b_index]:
#   dL/dlogit_i = p_i (c(i) - w) . (sum g, sum g a, sum g b, sum g a b)   (sums over the batch)
#   dL/dx[:, j] = sum over gates reading j as a: g (w1 + w3 b), as b: g (w2 + w3 a)   (a plan's gather)
def _logic_gates_backward(node, g):
    x, weight, coef, a_index, b_index, plan = node.saved
    need_x, need_w = node.needs_input_grad
    dweight = runtime.empty(tuple(weight.shape), weight.dtype) if need_w else None
    dx = runtime.empty_dense_like(x, x.dtype) if need_x else None
    K.backward_(g._data, x, weight, coef, a_index, b_index, dweight=dweight, dx=dx, plan=plan if need_x else None)
    return (None if dx is None else Tensor(dx)), (None if dweight is None else Tensor(dweight))


def logic_gates(x, weight, a_index, b_index, plan: LogicPlan | None = None, hard: bool = False,
                strict: bool = False) -> Tensor:
    """A layer of G two-input logic gates on ``x`` (B, IN), values in [0, 1].

    ``weight`` (G, 16): each gate's logits over the 16 functions (index = truth table, see
    ``flame.kernels.logic``); ``a_index``, ``b_index`` (G,) int64/int32: the columns each gate reads.
    Soft (default): ``out[:, g] = sum_i softmax(weight[g])_i op_i(a, b)`` with the functions' bilinear
    relaxations; differentiable in ``x`` and ``weight``. ``hard``: the argmax function of each gate on
    inputs thresholded at 0.5, exactly 0 or 1 (not differentiable: nothing is recorded). ``plan``: a
    ``logic_plan`` of this wiring, needed for the input gradient (built here, with a host sync, when
    ``x`` requires grad and none is given). ``strict``: raise unless every input lies in [0, 1]
    (a host sync). An index outside [0, IN) raises IndexError at the next host read.

    Returns (B, G) in ``x``'s dtype, a transposed view of a contiguous (G, B) buffer."""
    op = "logic_gates"
    check_tensor(x, "input", op)
    check_tensor(weight, "weight", op)
    if not x.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(f"{op}: expected floating-point input and weight, got {x.dtype} and {weight.dtype} (pack "
                        f"Boolean inputs with pack_bits for logic_gates_packed)")
    if x.ndim != 2:
        raise ValueError(f"{op}: input must be 2-D (batch, in_dim), got shape {x.shape}")
    if weight.ndim != 2 or weight.shape[1] != 16:
        raise ValueError(f"{op}: weight must be (gates, 16) logits, got shape {weight.shape}")
    G = weight.shape[0]
    _check_wiring(a_index, b_index, G, op)
    B, IN = x.shape
    if IN == 0 and G:
        raise ValueError(f"{op}: {G} gates cannot read an input with no columns (shape {x.shape})")
    if plan is not None and (not isinstance(plan, LogicPlan) or plan.gates != G or plan.in_dim != IN):
        got = f"{plan.gates} gates, in_dim {plan.in_dim}" if isinstance(plan, LogicPlan) else type(plan).__name__
        raise ValueError(f"{op}: plan must be a LogicPlan of {G} gates reading {IN} columns, got {got}")
    if strict:
        _check_unit_range(x, op)
    grad = not hard and needs_grad(x, weight)
    if grad and plan is None and x.requires_grad:
        plan = logic_plan(a_index, b_index, IN)
    wide = torch.float64 in (x.dtype, weight.dtype)
    coef = K.coef_(runtime.empty((G, 4), torch.float64 if wide else torch.float32), weight._data, hard=hard)
    out = runtime.empty((G, B), x.dtype)
    K.forward_(out.t(), x._data, coef, a_index._data, b_index._data, hard=hard)
    y = Tensor(out.t())
    if grad:
        record(y, (x, weight), _logic_gates_backward,
               saved=(x._data, weight._data, coef, a_index._data, b_index._data, plan))
    return y


# ---- hard inference on packed bits --------------------------------------------------------------

def pack_bits(x, threshold: float = 0.5) -> Tensor:
    """``x`` (B, F) thresholded (``x > threshold``) and packed: (F, ceil(B / 32)) int32, bit t of
    word w holding sample 32 w + t. Not differentiable."""
    op = "pack_bits"
    check_tensor(x, "input", op)
    if x.ndim != 2:
        raise ValueError(f"{op}: input must be 2-D (batch, features), got shape {x.shape}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: expected a floating-point input, got {x.dtype}")
    bits = runtime.empty((x.shape[1], K.words(x.shape[0])), torch.int32)
    return Tensor(K.pack_(bits, x._data, threshold))


def _check_bits(bits, op, name="bits"):
    check_tensor(bits, name, op)
    if bits.dtype != torch.int32 or bits.ndim != 2:
        raise TypeError(f"{op}: {name} must be a 2-D int32 tensor of packed words (pack_bits), got {bits.dtype} "
                        f"of shape {bits.shape}")


def logic_codes(weight) -> Tensor:
    """Each gate's argmax function (first maximum of its 16 logits) as int32 (G,)."""
    op = "logic_codes"
    check_tensor(weight, "weight", op)
    if weight.ndim != 2 or weight.shape[1] != 16 or not weight.dtype.is_floating_point:
        raise ValueError(f"{op}: weight must be floating-point (gates, 16) logits, got {weight.dtype} {weight.shape}")
    return Tensor(K.codes_(runtime.empty((weight.shape[0],), torch.int32), weight._data))


def logic_gates_packed(bits, codes, a_index, b_index) -> Tensor:
    """Hard gates on packed bits: ``bits`` (IN, W) int32 words, ``codes`` (G,) int32 functions
    (``logic_codes``), wiring (G,); returns (G, W) int32 words. An index outside [0, IN) raises
    IndexError at the next host read."""
    op = "logic_gates_packed"
    _check_bits(bits, op)
    check_tensor(codes, "codes", op)
    if codes.dtype != torch.int32 or codes.ndim != 1:
        raise TypeError(f"{op}: codes must be a 1-D int32 tensor (logic_codes), got {codes.dtype} {codes.shape}")
    G = codes.shape[0]
    _check_wiring(a_index, b_index, G, op)
    if bits.shape[0] == 0 and G:
        raise ValueError(f"{op}: {G} gates cannot read bits with no rows (shape {bits.shape})")
    out = runtime.empty((G, bits.shape[1]), torch.int32)
    return Tensor(K.packed_(out, bits._data, codes._data, a_index._data, b_index._data))


def _check_batch(bits, batch, op):
    if not isinstance(batch, (int, np.integer)) or isinstance(batch, bool) or batch < 0:
        raise TypeError(f"{op}: batch must be a non-negative int, got {batch!r}")
    if K.words(batch) != bits.shape[1]:
        raise ValueError(f"{op}: {bits.shape[1]} words per row hold {32 * bits.shape[1]} samples at most, not "
                         f"batch={batch} (ceil(batch / 32) words expected)")


def unpack_bits(bits, batch: int, dtype=torch.float32) -> Tensor:
    """(batch, F) 0/1 values in ``dtype`` from packed ``bits`` (F, ceil(batch / 32))."""
    op = "unpack_bits"
    _check_bits(bits, op)
    _check_batch(bits, batch, op)
    out = runtime.empty((batch, bits.shape[0]), dtype)
    return Tensor(K.unpack_(out, bits._data))


def _group_sum_backward(node, g):
    (x_shape, x_dtype, x_layout), scale = node.saved, node.attrs["scale"]
    dx = runtime.empty_strided(x_shape, x_layout, x_dtype)
    return (Tensor(K.group_sum_grad_(dx, g._data, scale)),)


def group_sum(x, k: int, tau: float = 1.0) -> Tensor:
    """GroupSum (Petersen et al.): (B, n) -> (B, k), entry (b, c) the sum of ``x[b, c n/k ... (c + 1) n/k - 1]``
    divided by ``tau``; ``x`` with any strides; differentiable."""
    op = "group_sum"
    check_tensor(x, "input", op)
    if not x.dtype.is_floating_point or x.ndim != 2:
        raise ValueError(f"{op}: input must be a 2-D floating-point (batch, n) tensor, got {x.dtype} {x.shape}")
    _check_groups(k, tau, x.shape[1], op)
    out = runtime.empty((x.shape[0], k), x.dtype)
    K.group_sum_(out, x._data, 1.0 / tau)
    y = Tensor(out)
    if needs_grad(x):
        # the gradient in x's layout when it is dense (a LogicLayer's feature-major output), else row-major
        layout = x.stride() if runtime.dense_order(x._data) is not None else (x.shape[1], 1)
        record(y, (x,), _group_sum_backward, saved=(tuple(x.shape), x.dtype, layout), scale=1.0 / tau)
    return y


def _check_groups(k, tau, n, op):
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1 or n % k:
        raise ValueError(f"{op}: k must be a positive int dividing the {n} inputs, got {k!r}")
    if not tau > 0:
        raise ValueError(f"{op}: tau must be positive, got {tau!r}")


def group_count(bits, batch: int, k: int, tau: float = 1.0, dtype=torch.float32) -> Tensor:
    """GroupSum on packed bits: (batch, k), entry (b, c) = the number of ones among rows
    c F/k ... (c + 1) F/k - 1 at sample b, divided by ``tau``."""
    op = "group_count"
    _check_bits(bits, op)
    _check_batch(bits, batch, op)
    _check_groups(k, tau, bits.shape[0], op)
    out = runtime.empty((batch, k), dtype)
    return Tensor(K.group_sum_(out, bits._data, 1.0 / tau, bits=True))
