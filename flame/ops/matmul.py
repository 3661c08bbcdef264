"""Matrix products with ``torch.matmul`` semantics: ``matmul`` (``@``) and ``bmm``; and ``linear``.

Every case is brought to one batched problem ``C[..., M, N] = A[..., M, K] @ B[..., K, N]`` on
views: a 1-D left operand is a (1, K) row, a 1-D right operand a (K, 1) column, and the batch dims
broadcast by stride-0 ``expand`` views. The kernel reads any strides, so nothing is copied: a
transposed weight, a sliced activation and a broadcast operand are all read in place. Mixed
float dtypes promote (one cast kernel per operand, before the product).
"""
from __future__ import annotations

import math

import torch

from .. import runtime, tune
from ..autograd import needs_grad, no_grad, record
from ..kernels import dora as KD
from ..kernels import elementwise as KE
from ..kernels import matmul as KM
from ..kernels import reduce as KR
from ..tensor import Tensor, broadcast_shapes, promote_types
from . import _autocast
from . import elementwise as ew
from ._util import check_tensor, dense
from .elementwise import cast_params, parameter_copy, to
from .quant import FP8, Fp8Weight, check_not_raw_fp8, weight_scale


def _check(a, b, op):
    check_tensor(a, "input", op)
    check_tensor(b, "other", op)
    if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        raise TypeError(f"{op}: expected floating-point tensors, got {a.dtype} (shape {a.shape}) "
                        f"and {b.dtype} (shape {b.shape})")
    if FP8 in (a.dtype, b.dtype):
        raise TypeError(f"{op}: float8_e4m3fn operands (fp8 weights) go through linear / lora_linear, which decode "
                        f"them with their scales; got {a.dtype} and {b.dtype}")
    if a.ndim == 0 or b.ndim == 0:
        raise RuntimeError(f"{op}: both arguments need at least 1 dimension, got shapes {a.shape} and {b.shape}")


def _problem(a, b, op):
    """Batched views of ``a`` and ``b`` and the output's shapes.

    Returns (a_view, b_view, batch, M, K, N, out_shape) where the views have shapes
    ``batch + (M, K)`` and ``batch + (K, N)`` (stride-0 where broadcast)."""
    ab = a._data if a.ndim >= 2 else a._data.unsqueeze(0)
    bb = b._data if b.ndim >= 2 else b._data.unsqueeze(-1)
    M, K = ab.shape[-2], ab.shape[-1]
    K2, N = bb.shape[-2], bb.shape[-1]
    if K != K2:
        raise RuntimeError(f"{op}: shapes {a.shape} and {b.shape} cannot be multiplied "
                           f"({M}x{K} and {K2}x{N}: inner dimensions {K} != {K2})")
    try:
        batch = broadcast_shapes(tuple(ab.shape[:-2]), tuple(bb.shape[:-2]))
    except ValueError:
        raise RuntimeError(f"{op}: batch dimensions of shapes {a.shape} and {b.shape} are not broadcastable "
                           f"({tuple(ab.shape[:-2])} vs {tuple(bb.shape[:-2])})") from None
    if tuple(ab.shape[:-2]) != batch:
        ab = ab.expand(batch + (M, K))
    if tuple(bb.shape[:-2]) != batch:
        bb = bb.expand(batch + (K, N))
    out_shape = batch + ((M,) if a.ndim >= 2 else ()) + ((N,) if b.ndim >= 2 else ())
    return ab, bb, batch, M, K, N, out_shape


# C = A @ B over broadcast batch dims, with A: (..., M, K), B: (..., K, N), G = dL/dC: (..., M, N).
#   dA = G @ B^T   (..., M, N) x (..., N, K)
#   dB = A^T @ G   (..., K, M) x (..., M, N)
# B^T and A^T are transposed views (swap the last two strides), never copies. A 1-D operand is
# the (1, K) row / (K, 1) column view used in the forward, so its gradient is that view's
# gradient with the size-1 dim dropped. An operand broadcast over the whole batch gets
# sum_i G[i] @ B[i]^T (resp. A[i]^T @ G[i]), which the kernel computes as one GEMM with the batch
# folded into the reduction when strides allow; a partially broadcast operand gets the full
# batched gradient and the engine sums the broadcast dims back (autograd._fit). The Linear case,
# a 2-D B with A's and G's leading dims merging into R rows (A2: (R, K), G2: (R, N)), is two plain
# GEMMs: dA = G2 @ B^T and dB = A2^T @ G2, the batch sum being part of dB's reduction over R.
def _matmul_backward(node, g):
    a, b = node.saved
    need_a, need_b = node.needs_input_grad
    da, db = a._data, b._data
    if g.dtype != da.dtype:
        g = to(g, da.dtype)
    if db.dim() == 2 and da.dim() >= 2:
        # (..., M, K) @ (K, N) with the leading dims of A and G folding into rows: two 2-D GEMMs
        a2, g2 = KM.matrix(da), KM.matrix(g._data)
        if a2 is not None and g2 is not None:
            ga = gbw = None
            if need_a:
                ga = runtime.empty(da.shape, da.dtype)
                KM.matmul_(ga, g2, KM.transposed(db))
                ga = Tensor(ga)
            if need_b:
                gbw = runtime.empty(db.shape, da.dtype)
                KM.matmul_(gbw, KM.transposed(a2), g2)
                gbw = Tensor(gbw)
            return ga, gbw
    ab, bb, batch, M, K, N, _ = _problem(a, b, "matmul")
    gb = g._data.view(batch + (M, N))  # re-insert the dims dropped for 1-D operands (a view)
    ga = gbw = None
    if need_a:
        ga = _grad_operand(gb, bb.transpose(-1, -2), a, batch, (M, K))
    if need_b:
        gbw = _grad_operand(ab.transpose(-1, -2), gb, b, batch, (K, N))
    return ga, gbw


def _as_rows(buf):
    """Buffer ``buf`` (..., n) as the matrix of its rows the GEMM entry points read (``KM.matrix``):
    in place when its strides allow (a (rows, n) view's), else a dense copy's."""
    m = KM.matrix(buf)
    if m is not None:
        return m
    try:
        return KM.matrix(buf.view(-1, buf.shape[-1]))  # size-1 dims with strides KM.matrix does not merge
    except RuntimeError:  # leading dims that do not merge (or an empty buffer)
        pass
    if buf.numel() == 0:  # nothing to copy (and view(-1, n) cannot infer the rows of an empty buffer)
        return KM.matrix(runtime.empty((math.prod(buf.shape[:-1]), buf.shape[-1]), buf.dtype))
    return KM.matrix(dense(buf))


def _torch_matrix(m):
    """A (rows, columns) torch view of matrix ``m`` (``KM.matrix``), for kernels that take 2-D buffers."""
    buf, rows, cols, row_stride, col_stride = m
    return buf.as_strided((rows, cols), (row_stride, col_stride))


def _grad_operand(x, y, operand, batch, mat_shape):
    """Gradient of ``operand`` = x @ y summed over the batch dims ``operand`` was broadcast along."""
    lead = operand.shape[:-2] if operand.ndim >= 2 else ()
    if math.prod(lead) == 1:  # broadcast over the whole batch (or no batch): one reduction GEMM
        out = runtime.empty(mat_shape, x.dtype)
        KM.matmul_sum_batch_(out, x, y)
        return Tensor(out.view(operand.shape))
    out = runtime.empty(batch + mat_shape, x.dtype)
    KM.matmul_(out, x, y)
    return Tensor(out)  # broadcast shape: the engine reduces it to the operand's shape


def _matmul(a, b, op):
    a, b = _autocast.lower(a, b)
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dtype != b.dtype or not a.dtype.is_floating_point:
        _check(a, b, op)
        dtype = promote_types(a.dtype, b.dtype)
        a, b = to(a, dtype), to(b, dtype)
    da, db = a._data, b._data
    y = None
    if db.dim() == 2 and da.dim() >= 2:  # the common case (..., M, K) @ (K, N), kept thin on the host
        K, (K2, N) = da.shape[-1], db.shape
        if K != K2:
            raise RuntimeError(f"{op}: shapes {a.shape} and {b.shape} cannot be multiplied "
                               f"({da.shape[-2]}x{K} and {K2}x{N}: inner dimensions {K} != {K2})")
        a2 = KM.matrix(da)
        if a2 is not None:
            out = runtime.empty((*da.shape[:-1], N), da.dtype)
            KM.matmul_(out, a2, db)
            y = Tensor(out)
    if y is None:
        if da.dim() == 0 or db.dim() == 0:
            _check(a, b, op)
        ab, bb, batch, M, K, N, out_shape = _problem(a, b, op)
        out = runtime.empty(batch + (M, N), da.dtype)
        KM.matmul_(out, ab, bb)
        y = Tensor(out.view(out_shape))
    if needs_grad(a, b):
        record(y, (a, b), _matmul_backward, saved=(a, b))
    return y


def matmul(a, b):
    """Matrix product with ``torch.matmul`` semantics.

    1-D x 1-D is a dot product (0-d result); a 1-D left (right) operand is treated as a row
    (column) and that dim is dropped from the result; operands with more than 2 dims are batches
    of matrices whose leading dims broadcast. Float dtypes promote; accumulation is fp32 (fp64
    for fp64 inputs).
    """
    return _matmul(a, b, "matmul")


def bmm(a, b):
    """Batched matrix product of two 3-D tensors (B, M, K) @ (B, K, N) -> (B, M, N); no broadcasting."""
    check_tensor(a, "input", "bmm")
    check_tensor(b, "mat2", "bmm")
    if a.ndim != 3 or b.ndim != 3:
        raise RuntimeError(f"bmm: expected 3-D tensors, got shapes {a.shape} and {b.shape}")
    if a.shape[0] != b.shape[0]:
        raise RuntimeError(f"bmm: batch sizes differ: shapes {a.shape} and {b.shape}")
    return _matmul(a, b, "bmm")


# ---- linear: GEMM with bias and activation fused ------------------------------------------------

_ACTIVATIONS = {  # name -> (forward op, backward op) of flame.kernels.elementwise
    None: (KE.IDENTITY.value, 0),
    "relu": (KE.RELU.value, KE.RELU_BWD.value),
    "silu": (KE.SILU.value, KE.SILU_BWD.value),
    "gelu": (KE.GELU.value, KE.GELU_BWD.value),
    "gelu_tanh": (KE.GELU_TANH.value, KE.GELU_TANH_BWD.value),
}


# Y = act(P), P = X W^T + b, with X: (R, K), W: (N, K), b: (N,), G = dL/dY: (R, N).
#   G' = G * act'(P)       (one elementwise pass from the P saved by the forward; G' = G without
#                           an activation, and then P is not saved)
#   dX = G' W              (R, N) x (N, K)
#   dW = G'^T X            (N, R) x (R, K), G'^T a transposed view
#   db = sum_r G'[r, :]    (a column reduction, fp32 accumulation)
# An fp8 weight (Fp8Weight: W = diag(s) Q, s per output channel) is read as codes in both GEMMs:
#   Y = (X Q^T) diag(s)    the scale on the accumulator's columns after the K loop
#   dX = G' diag(s) Q      the scale on Q's rows, the reduction dim: each decoded tile's rows are
#                          scaled in registers (no pass over G'); and W gets no gradient (frozen).
def _linear_backward(node, g):
    x2, w, pre = node.saved  # x2 (a matrix) only when the weight needs a gradient
    need = node.needs_input_grad
    need_x, need_w, need_b = need[:3]
    a = node.attrs
    x_dtype = a["x_dtype"]
    gd = g._data
    if gd.dtype != x_dtype:
        gd = to(g, x_dtype)._data
    if pre is not None:  # the output's shape, as g
        gp = runtime.empty(pre.shape, x_dtype)
        KE.map_(gp, [gd, pre], a["grad_op"])
        gd = gp
    g2 = _as_rows(gd)
    dx = None
    if need_x:
        dx = runtime.empty(a["x_shape"], x_dtype)
        KM.matmul_(dx, g2, w._data, b_scale=weight_scale(w))
        dx = Tensor(dx)
    return _with_residual(need, g, (dx, *_weight_and_bias_grads(g2, x2, w, need_w, need_b)))


def _with_residual(need, g, grads):
    """A layer op's input gradients ``grads``, then its residual's, the output's gradient ``g`` itself,
    when the op took a residual (``need``: the node's ``needs_input_grad``, one flag more)."""
    if len(need) == len(grads):
        return grads
    return (*grads, g if need[-1] else None)


def _weight_and_bias_grads(g2, x2, w, need_w, need_b):
    """(dW = G^T X, db = sum_r G) of a linear layer from the matrices ``g2`` and ``x2``, each None when
    not needed."""
    dw = db = None
    if need_w:
        dw = runtime.empty(w.shape, w.dtype)
        KM.matmul_(dw, KM.transposed(g2), x2)
        dw = Tensor(dw)
    if need_b:
        db = Tensor(KR.column_sum_(runtime.empty((g2[2],), g2[0].dtype), _torch_matrix(g2)))
    return dw, db


def linear(x, weight, bias=None, activation=None, residual=None):
    """``activation(x @ weight^T + bias) + residual`` as one GEMM launch with a fused epilogue.

    ``x`` is (..., in), ``weight`` (out, in) as in PyTorch, ``bias`` (out,) or None;
    ``activation`` is None, "relu", "silu", "gelu" (exact) or "gelu_tanh", or "geglu": GEGLU over
    the output's halves, ``hidden * gelu(gate)`` of width out / 2 (``_linear_geglu``); ``residual`` None or a
    tensor added to the result (a residual connection: ``block(x) + h``), read by the epilogue when
    it has the output's shape and dtype and is contiguous, else added by a separate op (its
    gradient is the output's either way). Weight and bias are
    cast once to ``x``'s dtype (so an fp32 master weight trains under bf16 activations, its
    gradient flowing back through the cast). The backward runs one elementwise pass for the
    activation derivative (dY' = dY * act'(pre), the pre-activation saved by the forward's
    epilogue), then the two gradient GEMMs on dY' and a column sum for the bias gradient. (Fusing
    act' and the bias sum into the gradient GEMMs gave wrong 16-bit weight gradients on Triton 3.6.)
    ``weight`` may be an ``Fp8Weight`` (``flame.ops.quant``): both GEMMs (forward and input
    gradient) read its codes, and it gets no gradient.
    """
    check_tensor(x, "input", "linear")
    check_tensor(weight, "weight", "linear")
    x, weight, bias = _autocast.lower(x, weight, bias)
    if activation == "geglu":
        y = _linear_geglu(x, weight, bias)
        return y if residual is None else y + residual
    xd, wd = x._data, weight._data
    bd = None if bias is None else check_tensor(bias, "bias", "linear")._data
    rd = None if residual is None else check_tensor(residual, "residual", "linear")._data
    key = ("linear", type(weight), xd.shape, xd.stride(), xd.dtype, wd.shape, wd.dtype,
           None if bd is None else (bd.shape, bd.dtype), activation,
           None if rd is None else (rd.shape, rd.stride(), rd.dtype))
    kept = _signatures.calls.get(key)
    if kept is None:
        kept = _linear_signature(key, x, weight, bias, activation, rd)
    out_shape, rows, act, grad_op, cast, fused_residual = kept
    if rd is not None and not fused_residual:
        return linear(x, weight, bias, activation) + residual
    dtype = xd.dtype
    if cast:
        weight, bias = _layer_params(x, weight, bias, out_shape[-1], "linear")
    out = runtime.empty(out_shape, dtype)
    grad = needs_grad(x, weight, bias) or (rd is not None and residual._requires_grad)
    pre = runtime.empty(out_shape, dtype) if grad and grad_op else None
    if rows is not None:
        x2 = (xd, *rows)
    elif xd.shape[-1] == 0:  # empty reduction: act(bias) or act(0)
        KE.fill_(out, 0.0)
        y = Tensor(out)
        y = y if bias is None else y + bias
        y = _apply_activation(y, activation)
        return y if residual is None else y + residual
    else:
        x2 = _as_rows(xd)
    fp8 = isinstance(weight, Fp8Weight)
    KM.linear_(out, x2, weight._data, None if bias is None else bias._data, act, pre,
               w_scale=weight.scale if fp8 else None, w8a8=fp8 and weight.w8a8, residual=rd)
    y = Tensor(out)
    if grad:
        # x is kept for the weight's gradient only: a frozen layer (LoRA training) saves none
        record(y, (x, weight, bias) if rd is None else (x, weight, bias, residual), _linear_backward,
               saved=(x2 if weight.requires_grad else None, weight, pre), grad_op=grad_op, x_shape=key[2],
               x_dtype=dtype)
    return y


def _linear_geglu(x, weight, bias):
    """``geglu(linear(x, weight, bias))``: without a gradient to record, one launch where the Hopper
    kernel serves it (``KM.linear_geglu``: the (..., out) projection is never written), else the
    two ops (their backward keeps the projection)."""
    xd, wd = x._data, weight._data
    if (not isinstance(weight, Fp8Weight) and not needs_grad(x, weight, bias) and len(wd.shape) == 2
            and xd.shape and xd.shape[-1] == wd.shape[1] and wd.shape[0] % 2 == 0
            and (bias is None or tuple(check_tensor(bias, "bias", "linear").shape) == (wd.shape[0],))):
        m = KM.matrix(xd)
        out = None if m is None else KM.linear_geglu(m, wd, None if bias is None else bias._data,
                                                     (*xd.shape[:-1], wd.shape[0] // 2))
        if out is not None:
            return Tensor(out)
    return ew.geglu(linear(x, weight, bias))


def _linear_signature(key, x, weight, bias, activation, residual):
    """What ``linear`` takes from its call signature ``key`` (the types, shapes, strides and dtypes
    of its arguments, the activation), after checking them: ``(out_shape, rows, act, grad_op, cast,
    fused_residual)``, ``rows`` the (rows, in, row stride, column stride) of ``x``'s matrix
    (``KM.matrix``; None when its leading dims do not merge or ``in`` is 0), ``act`` and ``grad_op``
    the activation's op codes, ``cast`` whether the parameters need ``_layer_params`` (a dtype other
    than ``x``'s), ``fused_residual`` whether the ``residual`` buffer (or None) is laid out as the
    output, for the epilogue to read. Kept with ``_signatures`` under ``key``, so a repeated call
    checks nothing again."""
    acts = _ACTIVATIONS.get(activation)
    if acts is None:
        raise ValueError(f"linear: activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    xd, wd = x._data, weight._data
    dtype, w_dtype = xd.dtype, wd.dtype
    if not dtype.is_floating_point or not w_dtype.is_floating_point:
        raise TypeError(f"linear: expected floating-point input and weight, got {x.dtype} and {weight.dtype}")
    fp8 = isinstance(weight, Fp8Weight)
    if w_dtype is FP8 and not fp8:
        check_not_raw_fp8(weight, "linear")
    xs, ws = xd.shape, wd.shape
    if len(ws) != 2 or not xs or xs[-1] != ws[1]:
        raise RuntimeError(f"linear: input {x.shape} and weight {weight.shape} don't match "
                           "(expected x (..., in) and weight (out, in))")
    cast, out_shape, fused_residual = _layer_signature(x, weight, bias, residual, ws[0], "linear")
    m = KM.matrix(xd) if xs[-1] else None
    kept = (out_shape, None if m is None else m[1:], *acts, cast, fused_residual)
    _signatures.keep_call(key, kept)
    return kept


def _layer_signature(x, weight, bias, residual, n_out, op, error=RuntimeError):
    """What a layer op's call signature fixes of its parameters and residual, the bias checked once:
    ``(cast, out_shape, fused_residual)``, ``cast`` whether ``_layer_params`` casts the weight or bias to
    ``x``'s dtype on each call (which checks the bias too), ``fused_residual`` whether the ``residual``
    buffer (or None) is laid out as the output, for the GEMM's epilogue to read."""
    xd = x._data
    dtype = xd.dtype
    cast = ((weight._data.dtype is not dtype and not isinstance(weight, Fp8Weight))
            or (bias is not None and bias.dtype is not dtype))
    if bias is not None and not cast:  # _layer_params' checks of the bias (nothing to cast; a cast checks each call)
        _layer_params(x, weight, bias, n_out, op, error)
    out_shape = (*xd.shape[:-1], n_out)
    fused_residual = (residual is not None and tuple(residual.shape) == out_shape and residual.dtype == dtype
                      and residual.is_contiguous())
    return cast, out_shape, fused_residual


# linear's and lora_linear's call signatures (``_linear_signature``, ``_lora_linear_signature``), emptied with the
# GEMM routes'
_signatures = KM.RouteMemo(None)
tune.register_cache(_signatures.cache_clear)


class _LoRAKept:
    """What one ``lora_linear`` call signature keeps for its calls: the handles on its GEMMs' kept routes
    (``KM.KeptCall``), and the constants its backward reads (its node's attributes: the scale, the input's
    shape, the adapters' shapes and dtypes, the magnitude's dtype or None), one object for all its nodes.
    The signature fixes the forward's two calls (``down``: H = X_l A16^T; ``up``: the base GEMM with H
    B16^T), and with the layout of the output gradient's matrix and the inputs that want gradients the
    backward's (``_LoRABackwardCalls``, kept per such pair in ``backward``)."""

    __slots__ = ("down", "up", "backward", "scale", "x_shape", "a_shape", "a_dtype", "b_shape", "b_dtype", "m_dtype")

    def __init__(self, scale, x_shape, a_shape, a_dtype, b_shape, b_dtype, m_dtype):
        self.down, self.up, self.backward = KM.KeptCall(), KM.KeptCall(), {}
        self.scale, self.x_shape, self.m_dtype = scale, x_shape, m_dtype
        self.a_shape, self.a_dtype, self.b_shape, self.b_dtype = a_shape, a_dtype, b_shape, b_dtype

    def backward_calls(self, g_layout, need):
        """The backward's handles for a gradient matrix of layout ``g_layout`` (rows, columns, strides) and
        the node's ``needs_input_grad`` ``need``."""
        key = (g_layout, need)
        calls = self.backward.get(key)
        if calls is None:
            if len(self.backward) >= 16:  # ever-new gradient layouts: start afresh
                self.backward.clear()
            calls = self.backward[key] = _LoRABackwardCalls()
        return calls


class _LoRABackwardCalls:
    """The handles on ``_lora_linear_backward``'s GEMMs for one gradient layout: dH, dB, dA, dX, dX_l."""

    __slots__ = ("dh", "db", "da", "dx", "dxl")

    def __init__(self):
        self.dh, self.db, self.da, self.dx, self.dxl = (KM.KeptCall() for _ in range(5))


def _layer_params(x, weight, bias, n_out, op, error=RuntimeError):
    """``cast_params``: the layer's weight and bias cast once to ``x``'s dtype; an ``Fp8Weight``
    stays as it is (its GEMMs decode it; ``x``, already in its own dtype, stands in for it)."""
    if isinstance(weight, Fp8Weight):
        return weight, cast_params(x, bias, n_out, x.dtype, op, error)[1]
    return cast_params(weight, bias, n_out, x.dtype, op, error)


def _apply_activation(y, activation):
    return y if activation is None else ew.gelu(y, "tanh") if activation == "gelu_tanh" else getattr(ew, activation)(y)


# Y = X W^T + b + s * H B^T with H = X_l A^T, for X: (R, K), W: (N, K), A: (r, K), B: (N, r), X_l the
# LoRA branch's input (X itself, or X after dropout); A and B (fp32 masters) are cast once to X's
# dtype, A16 and B16. G = dL/dY: (R, N).
#   dH  = s * G B16          (R, N) x (N, r)
#   dB  = s * G^T H          (N, R) x (R, r), written in B's dtype
#   dA  = dH^T X_l           (r, R) x (R, K), written in A's dtype
#   dX  = G W  (+ dH A16 when X_l is X: a rank-r term of the same GEMM, kernels.matmul.Fusion)
#   dX_l = dH A16            (when the branch has its own input)
#   dW  = G^T X, db = sum_r G (only when the base layer trains)
# DoRA (a magnitude m): Y = c * Z + b with Z = X W^T + s * H B^T and c = m / n per column, n the row
# norms of W + s B A (a constant, as in PEFT). The products above take dZ = G * c in place of G
# (db keeps G), and dm = sum_r (G * Z) / n (kernels.dora.scale_grad_: one pass over G and Z).
# An fp8 base (W = diag(s) Q) is read as codes, as in _linear_backward: dX = G diag(s) Q (+ dH A16).
def _lora_linear_backward(node, g):
    # x2, xl2, h, b16: matrices (KM.matrix); inputs_aligned: whether the buffers the forward did not allocate itself
    # start 16-byte aligned (KM.all_aligned); lora_kept: the call signature's _LoRAKept
    x2, xl2, w, h, a16, b16, z, ratio, norm, w_scale, inputs_aligned, lora_kept = node.saved
    need = node.needs_input_grad
    need_x, need_w, need_b, need_a, need_lb, need_xl, need_m = need[:7]
    s = lora_kept.scale
    rows, rank = h[1], h[2]
    dtype = h[0].dtype
    gd = g._data
    if gd.dtype != dtype:
        gd = to(g, dtype)._data
    g2 = _as_rows(gd)
    gz, dm = g2, None
    if ratio is not None:
        gzb = runtime.empty(g2[1:3], dtype)
        if need_m:
            dm = runtime.empty(ratio.shape, lora_kept.m_dtype)
        KD.scale_grad_(gzb, dm, _torch_matrix(g2), None if z is None else z.view(gzb.shape), ratio, norm)
        gz, dm = KM.matrix(gzb), None if dm is None else Tensor(dm)
    dx = da = dlb = dxl = None
    calls = lora_kept.backward_calls(gz[1:], need)
    stamp = KM.call_stamp()
    g_buf, xl = gz[0], x2 if xl2 is None else xl2
    aligned = inputs_aligned and KM.all_aligned(g_buf)  # the rest are this backward's own buffers
    dh = runtime.empty((rows, rank), dtype)
    dhm = KM.dense_matrix(dh, rows, rank)
    if not calls.dh.run(stamp, aligned, dh, g_buf, b16[0]):
        KM.matmul_(dh, gz, b16, alpha=s, handle=calls.dh)
    if need_lb:
        dlb = runtime.empty(lora_kept.b_shape, lora_kept.b_dtype)
        if not calls.db.run(stamp, aligned, dlb, g_buf, h[0]):
            KM.matmul_(dlb, KM.transposed(gz), h, alpha=s, handle=calls.db)
        dlb = Tensor(dlb)
    if need_a:
        da = runtime.empty(lora_kept.a_shape, lora_kept.a_dtype)
        if not calls.da.run(stamp, aligned, da, dh, xl[0]):
            KM.matmul_(da, KM.transposed(dhm), xl, handle=calls.da)
        da = Tensor(da)
    if need_x:
        dx = runtime.empty(lora_kept.x_shape, dtype)
        fused = xl2 is None  # dH A16 added to dX by the same GEMM
        if not calls.dx.run(stamp, aligned, dx, g_buf, w, u=dh if fused else None, v=a16 if fused else None,
                            b_scale=w_scale):
            KM.matmul_(dx, gz, w, low_rank=(dhm, a16, 1.0) if fused else None, b_scale=w_scale, handle=calls.dx)
        dx = Tensor(dx)
    if need_xl and xl2 is not None:
        dxl = runtime.empty(lora_kept.x_shape, dtype)
        if not calls.dxl.run(stamp, aligned, dxl, dh, a16):
            KM.matmul_(dxl, dhm, a16, handle=calls.dxl)
        dxl = Tensor(dxl)
    dw = _weight_and_bias_grads(gz, x2, w, need_w, False)[0]
    db = _weight_and_bias_grads(g2, x2, w, False, need_b)[1]
    return _with_residual(need, g, (dx, dw, db, da, dlb, dxl, dm))


def _cast_once(t, dtype):
    """``t``'s buffer in ``dtype`` (``to``: the copy a ``flame.amp.ParameterCasts`` region made, or
    one cast kernel), not recorded: the caller's backward routes the gradient to ``t`` itself."""
    if t._data.dtype is dtype:
        return t._data
    made = parameter_copy(t, dtype)  # the region's copy, asked first: no grad-mode switch around it
    if made is not None:
        return made
    with no_grad():
        return to(t, dtype)._data


def lora_linear(x, weight, bias, lora_a, lora_b, scale, lora_input=None, magnitude=None, residual=None):
    """``x @ weight^T + bias + scale * (lora_input @ lora_a^T) @ lora_b^T`` as one op: a LoRA
    adapter on a Linear layer, ``lora_input`` defaulting to ``x`` (pass the dropped-out ``x`` for
    LoRA dropout). ``weight`` (N, K), ``bias`` (N,) or None, ``lora_a`` (r, K), ``lora_b`` (N, r);
    the adapter weights (fp32 masters) are cast once to ``x``'s dtype and get gradients in their
    own dtype. Two GEMM launches forward (the down-projection, then the base GEMM with the
    up-projection added to its tiles as a rank-r term), four backward (five with a separate
    ``lora_input``), against about twice that for the composed ops.

    ``magnitude`` (N,): DoRA, ``c * (x @ weight^T + scale * (x @ lora_a^T) @ lora_b^T) + bias`` with
    ``c = magnitude / ||weight + scale * lora_b @ lora_a||`` (rows; the norm a constant, computed
    from ``weight`` as passed, in fp32, in one launch); the scale and bias are one elementwise pass
    and the backward adds two small launches (``kernels.dora``). Not with ``lora_input``: PEFT's
    DoRA with dropout also corrects the base output, which ``nn.LoRALinear`` composes.

    ``weight`` may be an ``Fp8Weight`` (a frozen base in fp8: its codes read by the base GEMM and
    the input gradient's); not with ``magnitude`` (DoRA's norms would need the dequantised weight).
    ``residual``: added to the result, by the base GEMM's epilogue where ``linear`` would (laid out
    as the output; not with ``magnitude``), else by a separate op."""
    op = "lora_linear"
    if not (type(x) is Tensor and isinstance(weight, Tensor) and isinstance(lora_a, Tensor)
            and isinstance(lora_b, Tensor)):  # one test for the usual call, the named error otherwise
        for name, t in (("input", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
            check_tensor(t, name, op)
    stored_weight = weight
    x, weight, bias = _autocast.lower(x, weight, bias)
    if lora_input is not None:
        check_tensor(lora_input, "lora_input", op)
        (lora_input,) = _autocast.lower(lora_input)
        if lora_input.shape != x.shape or lora_input.dtype != x.dtype:
            raise ValueError(f"{op}: lora_input {lora_input.shape} {lora_input.dtype} must match input "
                             f"{x.shape} {x.dtype}")
    xd, wd, ad, bd = x._data, weight._data, lora_a._data, lora_b._data
    bias_d = None if bias is None else check_tensor(bias, "bias", op)._data
    rd = None if residual is None else check_tensor(residual, "residual", op)._data
    key = (op, type(weight), xd.shape, xd.stride(), xd.dtype, wd.shape, wd.stride(), wd.dtype, ad.shape, ad.stride(),
           ad.dtype, bd.shape, bd.stride(), bd.dtype, None if bias_d is None else (bias_d.shape, bias_d.stride(),
                                                                                  bias_d.dtype),
           None if magnitude is None else check_tensor(magnitude, "magnitude", op).dtype,
           None if rd is None else (rd.shape, rd.stride(), rd.dtype),
           None if lora_input is None else lora_input._data.stride(), float(scale))
    kept = _signatures.calls.get(key)
    if kept is None:
        kept = _lora_linear_signature(key, x, weight, bias, lora_a, lora_b, magnitude, rd, float(scale))
    out_shape, rows, degenerate, cast, fused_residual, lora_kept = kept
    if rd is not None and not fused_residual:
        return lora_linear(x, weight, bias, lora_a, lora_b, scale, lora_input, magnitude) + residual
    dtype, n_out, a_shape = xd.dtype, out_shape[-1], ad.shape
    ratio = norm = None
    if magnitude is not None:
        if magnitude.shape != (n_out,) or not magnitude.dtype.is_floating_point:
            raise ValueError(f"{op}: magnitude must be a floating-point ({n_out},) vector, got {magnitude.shape} "
                             f"{magnitude.dtype}")
        if lora_input is not None:
            raise ValueError(f"{op}: DoRA (magnitude) with a separate lora_input (dropout) is not one op; "
                             f"nn.LoRALinear composes it")
        if isinstance(weight, Fp8Weight):
            raise ValueError(f"{op}: DoRA (magnitude) over an fp8 weight {weight.shape} is not supported (its row "
                             "norms need the dequantised weight); keep DoRA layers unquantised")
        wide = torch.float64 in (stored_weight.dtype, lora_a.dtype, lora_b.dtype, magnitude.dtype)
        acc = torch.float64 if wide else torch.float32
        norm, ratio = runtime.empty((n_out,), acc), runtime.empty((n_out,), acc)
        KD.adapted_norms_(norm, stored_weight._data, lora_a._data, lora_b._data, scale, magnitude._data, ratio)
    fp8 = isinstance(weight, Fp8Weight)
    if cast:
        weight, bias = _layer_params(x, weight, bias, n_out, op, ValueError)
    if degenerate:  # no input, no reduction or rank 0: the composed ops handle the edge cases
        branch = lora_input if lora_input is not None else x
        z = linear(x, weight, None if ratio is not None else bias) + linear(linear(branch, lora_a), lora_b) * scale
        if ratio is None:
            return z
        y = z * to(magnitude / Tensor(norm), z.dtype)
        return y if bias is None else y + bias
    rank = a_shape[0]
    x2 = (xd, *rows) if rows is not None else _as_rows(xd)  # matrices of rows (KM.matrix): the GEMMs read them in place
    xl2 = None if lora_input is None else _as_rows(lora_input._data)
    a16, b16 = _cast_once(lora_a, dtype), _cast_once(lora_b, dtype)
    z = runtime.empty(out_shape, dtype)
    h = runtime.empty((x2[1], rank), dtype)
    hm, b16m = KM.dense_matrix(h, x2[1], rank), KM.matrix(b16)
    w_scale = weight.scale if fp8 else None
    xl = x2 if xl2 is None else xl2
    wd, bias_d = weight._data, None if bias is None or ratio is not None else bias._data
    stamp = KM.call_stamp()
    # the buffers this call did not allocate (h and z it did) start 16-byte aligned: checked once for its GEMMs
    inputs_aligned = KM.all_aligned(x2[0], None if xl2 is None else xl2[0], wd, a16, b16, rd)
    if not lora_kept.down.run(stamp, inputs_aligned, h, xl[0], a16):
        KM.linear_(h, xl, a16, handle=lora_kept.down)
    if not lora_kept.up.run(stamp, inputs_aligned, z, x2[0], wd, bias_d, residual=rd, u=h, v=b16, b_scale=w_scale):
        KM.linear_(z, x2, wd, bias_d, low_rank=(hm, KM.transposed(b16m), float(scale)), w_scale=w_scale,
                   w8a8=fp8 and weight.w8a8, residual=rd, handle=lora_kept.up)
    out = z
    if ratio is not None:
        out = runtime.empty(out_shape, dtype)
        per_column = [ratio] + ([] if bias is None else [bias._data])
        op_code = KE.MUL if bias is None else KE.MUL_ADD
        KE.map_(out, [z] + [t.expand(out_shape) for t in per_column], op_code.value)
    y = Tensor(out)
    if needs_grad(x, weight, bias, lora_a, lora_b, lora_input, magnitude, residual):
        keep_z = ratio is not None and magnitude.requires_grad
        inputs = (x, weight, bias, lora_a, lora_b, lora_input, magnitude)
        record(y, inputs if rd is None else (*inputs, residual), _lora_linear_backward,
               saved=(x2, xl2, weight._data, hm, a16, b16m, z if keep_z else None, ratio, norm, w_scale,
                      inputs_aligned, lora_kept))
    return y


def _lora_linear_signature(key, x, weight, bias, lora_a, lora_b, magnitude, residual, scale):
    """What ``lora_linear`` takes from its call signature ``key`` (the types, shapes, strides and dtypes
    of input, weight, bias, adapters, residual and lora_input, the magnitude's dtype or None, the scale),
    after checking them: ``(out_shape, rows, degenerate, cast, fused_residual, lora_kept)``: ``rows`` the
    (rows, in, row stride, column stride) of the input's matrix (``KM.matrix``; None when its leading dims
    do not merge or the call is degenerate), ``degenerate`` an empty input, reduction or rank (the
    composed ops serve it), ``cast`` and ``fused_residual`` as ``_layer_signature`` says (no fused
    residual with a magnitude or a degenerate call), ``lora_kept`` the handles on its GEMMs' kept routes and
    its nodes' constants (``_LoRAKept``: the key fixes both). Kept with ``_signatures`` under ``key``, so a
    repeated call checks nothing again (as ``_linear_signature``)."""
    op = "lora_linear"
    xd, wd, ad, bd = x._data, weight._data, lora_a._data, lora_b._data
    dtype = xd.dtype
    if not (dtype.is_floating_point and wd.dtype.is_floating_point and ad.dtype.is_floating_point
            and bd.dtype.is_floating_point):
        raise TypeError(f"{op}: expected floating-point tensors, got input {x.dtype}, weight {weight.dtype}, "
                        f"lora_a {lora_a.dtype}, lora_b {lora_b.dtype}")
    check_not_raw_fp8(weight, op)
    xs, ws, a_shape, b_shape = xd.shape, wd.shape, ad.shape, bd.shape
    n_out, k = ws if len(ws) == 2 else (None, None)
    if (len(ws) != 2 or not xs or xs[-1] != k or len(a_shape) != 2 or len(b_shape) != 2
            or a_shape[1] != k or b_shape != (n_out, a_shape[0])):
        raise ValueError(f"{op}: shapes don't match: input {x.shape}, weight {weight.shape} (out, in), "
                         f"lora_a {lora_a.shape} (rank, in), lora_b {lora_b.shape} (out, rank)")
    cast, out_shape, fused_residual = _layer_signature(x, weight, bias, residual, n_out, op, ValueError)
    degenerate = xd.numel() == 0 or k == 0 or a_shape[0] == 0
    m = None if degenerate else KM.matrix(xd)
    kept = (out_shape, None if m is None else m[1:], degenerate, cast,
            fused_residual and magnitude is None and not degenerate,
            _LoRAKept(scale, xs, a_shape, ad.dtype, b_shape, bd.dtype, None if magnitude is None else magnitude.dtype))
    _signatures.keep_call(key, kept)
    return kept
