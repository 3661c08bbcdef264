"""Elementwise map kernels: one kernel per memory layout, every operation a constexpr switch.

A map reads up to three tensor operands ``a, b, c`` and writes one output. Operands that are not
tensors come from the two scalar arguments in order (``NIN == 1``: ``b = s0, c = s1``;
``NIN == 2``: ``c = s0``; ``NIN == 0``: ``a = s0``), so ``x + 2`` is ``ADD`` with one tensor input,
``clamp(x, lo, hi)`` is ``CLAMP(a, lo, hi)`` and a fill is ``IDENTITY`` with none.

Values are converted to the compute dtype ``CD`` (fp32 for 16/32-bit floats, fp64 for fp64,
int64 for integer and bool work), combined, and stored in the output's dtype.

Two layouts share the same op switch:
- ``_map_contiguous_kernel``: every operand dense with the same layout (a 1-D stream), few
  arguments so the host launch stays cheap;
- ``_map_strided_kernel``: up to four (collapsed) dimensions with any strides per operand,
  broadcasting by stride 0, tiled 2-D so that the innermost dimension is read in rows.

Launch configs come from ``flame.tune``: kernel "map_contiguous" (key (numel,), fields BLOCK_SIZE,
num_warps) and "map_strided" (key (ROWS, COLS, transposed): the collapsed rows, the innermost
dim's length and 1 when some operand is not unit-stride innermost; fields BLOCK_R, BLOCK_C,
num_warps), looked up in the output's dtype, a tuning table's entry on the GPU or the heuristics
here. The config is part of the per-signature plan ``map_`` memoises (``_plans``, registered with
``tune.register_cache``), so a launch pays no lookup. The strided kernel's blocks are cut to its
dims rounded up to powers of two.
"""
import itertools
import math

import torch
import triton
import triton.language as tl

from .. import autotune, runtime, tune
from ..autotune import tunable
from .launch import Plan, launch, launch_via


def _codes(start, count):
    # jit code may only read globals that are tl.constexpr; launchers pass ``.value``
    return tuple(tl.constexpr(start + i) for i in range(count))


# ---- op codes (forward) -------------------------------------------------------------------
IDENTITY, NEG, ABS, EXP, LOG, SQRT, RSQRT, SIN, COS, TANH, SIGMOID, RELU, SILU, GELU, GELU_TANH = _codes(0, 15)
(ADD, SUB, RSUB, MUL, DIV, RDIV, POW, RPOW, MAXIMUM, MINIMUM, CLAMP, WHERE, WHERE_INV, GEGLU, MUL_ADD,
 ADDCMUL) = _codes(20, 16)
EQ, NE, LT, LE, GT, GE = _codes(40, 6)
# ---- op codes (backward: the incoming gradient is always operand a) ------------------------
(ABS_BWD, SQRT_BWD, RSQRT_BWD, SIN_BWD, COS_BWD, TANH_BWD, SIGMOID_BWD, RELU_BWD, SILU_BWD,
 GELU_BWD, GELU_TANH_BWD, CLAMP_BWD, DIV_BWD_B, POW_BWD_BASE, POW_BWD_EXP, MAXIMUM_BWD,
 MINIMUM_BWD, SCALE_MUL, GEGLU_GATE_BWD) = _codes(60, 19)

# GELU constants, written inline in jit code: sqrt(2/pi) = 0.7978845608028654,
# 1/sqrt(2) = 0.7071067811865476, 1/sqrt(2 pi) = 0.3989422804014327


@triton.jit
def _tanh(x):
    # tanh from exp, accurate near 0 by a short odd series (|x| < 0.1: error < 1e-10 relative)
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.1, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _pow(a, b):
    # a ** b for real a, b with PyTorch's conventions: x ** 0 == 1, negative base only for
    # integral exponents (sign from the exponent's parity), NaN otherwise.
    mag = tl.exp(b * tl.log(tl.abs(a)))
    b_int = tl.floor(b) == b
    b_odd = b_int & (tl.floor(b * 0.5) * 2.0 != b)
    signed = tl.where(b_odd, -mag, mag)
    res = tl.where(a < 0, tl.where(b_int, signed, float("nan")), mag)
    return tl.where(b == 0, 1.0, res)


@triton.jit
def _gelu(x):  # exact: x Phi(x)
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_slope(x):  # d gelu / dx = Phi(x) + x phi(x)
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    return cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def _apply(a, b, c, s0, s1, OP: tl.constexpr):
    if OP == IDENTITY:
        return a
    elif OP == NEG:
        return -a
    elif OP == ABS:
        return tl.abs(a)
    elif OP == EXP:
        return tl.exp(a)
    elif OP == LOG:
        return tl.log(a)
    elif OP == SQRT:
        return tl.sqrt(a)
    elif OP == RSQRT:
        return 1.0 / tl.sqrt(a)
    elif OP == SIN:
        return tl.sin(a)
    elif OP == COS:
        return tl.cos(a)
    elif OP == TANH:
        return _tanh(a)
    elif OP == SIGMOID:
        return _sigmoid(a)
    elif OP == RELU:
        return tl.where(a < 0, 0, a)  # NaN passes through, as in torch.relu
    elif OP == SILU:
        return a * _sigmoid(a)
    elif OP == GELU:
        return _gelu(a)
    elif OP == GELU_TANH:
        # 0.5 (1 + tanh(u)) = sigmoid(2 u): one exp and one division, no cancellation near 0
        return a * _sigmoid(1.5957691216057308 * (a + 0.044715 * a * a * a))
    elif OP == ADD:
        return a + b
    elif OP == SUB:
        return a - b
    elif OP == RSUB:
        return b - a
    elif OP == MUL:
        return a * b
    elif OP == DIV:
        return a / b
    elif OP == RDIV:
        return b / a
    elif OP == POW:
        return _pow(a, b)
    elif OP == RPOW:
        return _pow(b, a)
    elif OP == MAXIMUM:
        # NaN propagates, as in torch.maximum
        return tl.where((a > b) | (a != a), a, b)
    elif OP == MINIMUM:
        return tl.where((a < b) | (a != a), a, b)
    elif OP == CLAMP:
        return tl.where(a < b, b, tl.where(a > c, c, a))
    elif OP == WHERE:
        return tl.where(a != 0, b, c)
    elif OP == WHERE_INV:
        return tl.where(a != 0, c, b)
    elif OP == GEGLU:  # hidden * gelu(gate); also the hidden half's gradient g * gelu(gate)
        return a * _gelu(b)
    elif OP == MUL_ADD:  # rounded once: a per-channel scale and bias in one pass
        return a * b + c
    elif OP == ADDCMUL:  # torch.addcmul: a + value * b * c (value = s0), rounded once; a gated residual
        return a + s0 * b * c
    elif OP == EQ:
        return a == b
    elif OP == NE:
        return a != b
    elif OP == LT:
        return a < b
    elif OP == LE:
        return a <= b
    elif OP == GT:
        return a > b
    elif OP == GE:
        return a >= b
    # Backward ops. a = dL/dy; x = the op's input, y = its output.
    elif OP == ABS_BWD:  # d|x|/dx = sign(x), 0 at 0
        return tl.where(b > 0, a, tl.where(b < 0, -a, 0.0))
    elif OP == SQRT_BWD:  # y = sqrt(x): dx = g / (2y)
        return a * 0.5 / b
    elif OP == RSQRT_BWD:  # y = x^-1/2: dx = -g y^3 / 2
        return -0.5 * a * b * b * b
    elif OP == SIN_BWD:  # dx = g cos(x)
        return a * tl.cos(b)
    elif OP == COS_BWD:  # dx = -g sin(x)
        return -a * tl.sin(b)
    elif OP == TANH_BWD:  # dx = g (1 - y^2)
        return a * (1.0 - b * b)
    elif OP == SIGMOID_BWD:  # dx = g y (1 - y)
        return a * b * (1.0 - b)
    elif OP == RELU_BWD:  # dx = g [x > 0]
        return tl.where(b > 0, a, 0.0)
    elif OP == SILU_BWD:  # s = sigmoid(x): dx = g (s + x s (1 - s))
        s = _sigmoid(b)
        return a * (s + b * s * (1.0 - s))
    elif OP == GELU_BWD:  # dx = g (Phi(x) + x phi(x))
        return a * _gelu_slope(b)
    elif OP == GELU_TANH_BWD:
        # u = k (x + 0.044715 x^3), t = tanh(u): dx = g (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2));
        # with s = sigmoid(2 u) = 0.5 (1 + t), 1 - t^2 = 4 s (1 - s): dx = g s (1 + 2 x (1 - s) du)
        sg = _sigmoid(1.5957691216057308 * (b + 0.044715 * b * b * b))
        du = 0.7978845608028654 * (1.0 + 0.134145 * b * b)
        return a * sg * (1.0 + 2.0 * b * (1.0 - sg) * du)
    elif OP == CLAMP_BWD:  # operands (g, x), bounds (s0, s1): dx = g [lo <= x <= hi]
        return tl.where((b >= s0) & (b <= s1), a, 0.0)
    elif OP == DIV_BWD_B:  # y = p / q: dq = -g y / q   (operands g, y, q)
        return -a * b / c
    elif OP == POW_BWD_BASE:  # y = p ** q: dp = g q p^(q-1)   (operands g, p, q)
        return a * c * _pow(b, c - 1.0)
    elif OP == POW_BWD_EXP:  # y = p ** q: dq = g y log(p)   (operands g, y, p); 0 where y == 0
        return tl.where(b == 0, 0.0, a * b * tl.log(c))
    elif OP == MAXIMUM_BWD:  # dx = g [x > z] + g/2 [x == z]   (operands g, x, z)
        return tl.where(b > c, a, tl.where(b == c, 0.5 * a, 0.0))
    elif OP == MINIMUM_BWD:
        return tl.where(b < c, a, tl.where(b == c, 0.5 * a, 0.0))
    elif OP == SCALE_MUL:  # g * y * s   (rpow backward: y = s0 ** x, s = log(s0))
        return a * b * c
    elif OP == GEGLU_GATE_BWD:  # y = h gelu(x): dx = g h gelu'(x)   (operands g, x, h)
        return a * c * _gelu_slope(b)
    else:
        tl.static_assert(False, "unknown elementwise op")


@triton.jit
def _operands(a_ptr, b_ptr, c_ptr, a_off, b_off, c_off, mask, s0, s1, NIN: tl.constexpr, CD: tl.constexpr):
    if NIN == 0:
        a = tl.cast(s0, CD)
        b = tl.cast(s1, CD)
        c = tl.cast(s1, CD)
    elif NIN == 1:
        a = tl.load(a_ptr + a_off, mask=mask).to(CD)
        b = tl.cast(s0, CD)
        c = tl.cast(s1, CD)
    elif NIN == 2:
        a = tl.load(a_ptr + a_off, mask=mask).to(CD)
        b = tl.load(b_ptr + b_off, mask=mask).to(CD)
        c = tl.cast(s0, CD)
    else:
        a = tl.load(a_ptr + a_off, mask=mask).to(CD)
        b = tl.load(b_ptr + b_off, mask=mask).to(CD)
        c = tl.load(c_ptr + c_off, mask=mask).to(CD)
    return a, b, c


@triton.jit
def _store(out_ptr, off, value, mask, OUT_BOOL: tl.constexpr):
    if OUT_BOOL:
        tl.store(out_ptr + off, value != 0, mask=mask)
    else:
        dst: tl.constexpr = out_ptr.dtype.element_ty
        if value.dtype == tl.float64 and dst == tl.bfloat16:  # through fp32: the interpreter's direct cast is garbage
            value = value.to(tl.float32)
        tl.store(out_ptr + off, value.to(dst), mask=mask)


@triton.jit
def _index(pid, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    # int32 index math unless some offset can reach 2**31 (64-bit multiplies cost real time)
    if WIDE:
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def tile_4d(rows, D1, D2, D3, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    """This program's tile of a logical (D0, D1, D2, D3) array whose rows = D0 * D1 * D2 run along
    grid axis 0 and whose last dim runs along axis 1: row coordinates (i0, i1, i2), columns, mask."""
    r = _index(tl.program_id(0), BLOCK_R, WIDE)
    col = _index(tl.program_id(1), BLOCK_C, WIDE)
    i2 = r % D2
    rest = r // D2
    i1 = rest % D1
    i0 = rest // D1
    mask = (r < rows)[:, None] & (col < D3)[None, :]
    return i0, i1, i2, col, mask


@triton.jit
def offsets_4d(i0, i1, i2, col, s0, s1, s2, s3):
    return (i0 * s0 + i1 * s1 + i2 * s2)[:, None] + (col * s3)[None, :]


@triton.jit(do_not_specialize=["s0", "s1"])
def _map_contiguous_kernel(out_ptr, a_ptr, b_ptr, c_ptr, s0, s1, n,
                           NIN: tl.constexpr, OP: tl.constexpr, CD: tl.constexpr,
                           OUT_BOOL: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    offs = _index(tl.program_id(0), BLOCK, WIDE)
    mask = offs < n
    a, b, c = _operands(a_ptr, b_ptr, c_ptr, offs, offs, offs, mask, s0, s1, NIN, CD)
    out = _apply(a, b, c, s0, s1, OP)
    _store(out_ptr, offs, out, mask, OUT_BOOL)


@triton.jit(do_not_specialize=["s0", "s1"])
def _map_strided_kernel(out_ptr, a_ptr, b_ptr, c_ptr, s0, s1,
                        rows, D1, D2, D3,
                        os0, os1, os2, os3, as0, as1, as2, as3,
                        bs0, bs1, bs2, bs3, cs0, cs1, cs2, cs3,
                        NIN: tl.constexpr, OP: tl.constexpr, CD: tl.constexpr, OUT_BOOL: tl.constexpr,
                        WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    i0, i1, i2, col, mask = tile_4d(rows, D1, D2, D3, BLOCK_R, BLOCK_C, WIDE)
    o_off = offsets_4d(i0, i1, i2, col, os0, os1, os2, os3)
    a_off = offsets_4d(i0, i1, i2, col, as0, as1, as2, as3)
    b_off = offsets_4d(i0, i1, i2, col, bs0, bs1, bs2, bs3)
    c_off = offsets_4d(i0, i1, i2, col, cs0, cs1, cs2, cs3)
    a, b, c = _operands(a_ptr, b_ptr, c_ptr, a_off, b_off, c_off, mask, s0, s1, NIN, CD)
    out = _apply(a, b, c, s0, s1, OP)
    _store(out_ptr, o_off, out, mask, OUT_BOOL)


# GEGLU's backward in one pass. y = h * gelu(x) with (h, x) the two halves of each input row and
# g = dL/dy:  dh = g * gelu(x),  dx = g * h * gelu'(x)  (_apply's GEGLU and GEGLU_GATE_BWD), written
# into the two halves of each gradient row: g and x are read once (two maps read them twice).
# Rows (of H per half) have their own stride in each operand, columns are unit-stride.
@triton.jit
def _geglu_backward_kernel(grad_ptr, g_ptr, inp_ptr, rows, H, s_grad, s_g, s_inp, CD: tl.constexpr,
                           WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = _index(tl.program_id(0), BLOCK_R, WIDE)
    col = _index(tl.program_id(1), BLOCK_C, WIDE)[None, :]
    mask = (r < rows)[:, None] & (col < H)
    g = tl.load(g_ptr + (r * s_g)[:, None] + col, mask=mask).to(CD)
    inp = inp_ptr + (r * s_inp)[:, None] + col
    h = tl.load(inp, mask=mask).to(CD)
    x = tl.load(inp + H, mask=mask).to(CD)
    grad = grad_ptr + (r * s_grad)[:, None] + col
    tl.store(grad, _apply(g, x, x, 0.0, 0.0, GEGLU).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.store(grad + H, _apply(g, x, h, 0.0, 0.0, GEGLU_GATE_BWD).to(grad_ptr.dtype.element_ty), mask=mask)


# ---- host side ------------------------------------------------------------------------------

_MAX_DIMS = 4


def collapse(shape, stride_lists):
    """Drop size-1 dims and merge dims that are contiguous with each other in every operand.

    Returns (shape, [strides per operand]) with at least one dim.
    """
    dims = [(s, [st[i] for st in stride_lists]) for i, s in enumerate(shape) if s != 1]
    if not dims:
        return [1], [[0] for _ in stride_lists]
    out_shape = [dims[0][0]]
    out_strides = [[st] for st in dims[0][1]]
    for size, strides in dims[1:]:
        if all(prev[-1] == st * size for prev, st in zip(out_strides, strides)):
            out_shape[-1] *= size
            for prev, st in zip(out_strides, strides):
                prev[-1] = st
        else:
            out_shape.append(size)
            for prev, st in zip(out_strides, strides):
                prev.append(st)
    return out_shape, out_strides


_compute_dtypes: dict = {}


def compute_dtype(*dtypes):
    """fp64 if any operand is fp64, else fp32 if any is floating, else int64."""
    cd = _compute_dtypes.get(dtypes)
    if cd is None:
        if torch.float64 in dtypes:
            cd = tl.float64
        elif any(d.is_floating_point for d in dtypes):
            cd = tl.float32
        else:
            cd = tl.int64
        _compute_dtypes[dtypes] = cd
    return cd


def cdiv(a, b):
    return -(-a // b)


def _pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


_plans: dict = {}  # plan signature -> plan; emptied by flame.tune (override, record, reset)
tune.register_cache(_plans.clear)


def map_(out, inputs, op, s0=0.0, s1=0.0, cd=None):
    """out[...] = op(*inputs, s0, s1) over torch buffers with any strides.

    ``inputs`` are torch tensors already broadcast (expanded) to ``out``'s shape; ``cd`` is the
    compute dtype (a ``tl`` dtype), by default derived from all operands' dtypes. The launch plan
    (kernel, grid, size and stride arguments, constexprs and the launch config) depends only on
    op, dtypes, shape and strides, so it is computed once per such combination and reused. With
    ``FLAME_AUTOTUNE=1`` a call that needs a new plan goes through ``_map_first_use`` (tuning on
    first use); calls with a plan never pay for it.
    """
    if not isinstance(op, int):
        op = op.value
    key = (op, cd, out.dtype, out.shape, out.stride(), *[(t.dtype, t.stride()) for t in inputs])
    plan = _plans.get(key)
    if plan is None:
        if tune.autotuning():
            return _map_first_use(out, inputs, op, s0, s1, cd, key)
        plan = _plans[key] = _new_plan(out, inputs, op, cd)
    return run_map(plan, out, inputs, op, s0, s1, cd)


def map_plan(out, inputs, op, cd=None):
    """The plan ``map_`` launches for buffers of this signature (op, compute dtype, ``out``'s and
    the inputs' dtypes, shapes and strides), made and kept as ``map_`` keeps it (``flame.tune``
    empties them): a caller that memoises its own signatures keeps it and launches later calls with
    ``run_map``, without ``map_``'s key. None when tuning on first use would make it (``map_`` then)."""
    if not isinstance(op, int):
        op = op.value
    key = (op, cd, out.dtype, out.shape, out.stride(), *[(t.dtype, t.stride()) for t in inputs])
    plan = _plans.get(key)
    if plan is None and not tune.autotuning():
        plan = _plans[key] = _new_plan(out, inputs, op, cd)
    return plan


def run_map(plan, out, inputs, op, s0=0.0, s1=0.0, cd=None):
    """``map_(out, inputs, op, s0, s1, cd)`` with ``plan``, the plan of buffers of this signature
    (``map_plan``). Returns ``out``."""
    if plan is _EMPTY:
        return out
    if plan is _PEEL:
        return _map_peeled(out, inputs, op, s0, s1, cd)
    _, grid, ints, meta, kept = plan
    if meta["CD"] is tl.int64:
        s0, s1 = int(s0), int(s1)
    else:
        s0, s1 = float(s0), float(s1)
    launch_via(launch, kept, grid, (out, *inputs, *[out] * (3 - len(inputs)), s0, s1, *ints))
    return out


@tunable("out", helper=True)
def _map_first_use(out, inputs, op, s0, s1, cd, key):
    """map_ with a new plan (``key``) when tuning on first use: the ``flame.autotune`` entry point
    of the map kernels (it writes all of ``out``). A helper: inside another entry point's call
    (a cast, a zero fill) it just runs with the heuristic, and its plan keeps that config until
    ``flame.tune`` empties the plans (the next key tuned anywhere does)."""
    _plans[key] = _new_plan(out, inputs, op, cd)
    return map_(out, inputs, op, s0, s1, cd)


def _new_plan(out, inputs, op, cd):
    """``_plan_map``'s plan with the ``launch.Plan`` it launches: every launch argument but the tensors
    and the scalars is the plan's; an integer map's scalars (``s0``, ``s1``: arguments 4 and 5, which
    the kernels do not specialise) enter its compiled kernels' key by their width."""
    plan = _plan_map(out, inputs, op, cd)
    if isinstance(plan, tuple):
        kernel, _, _, meta = plan
        plan += (Plan(kernel, meta, by_width=(4, 5) if meta["CD"] is tl.int64 else ()),)
    return plan


_EMPTY, _PEEL = object(), object()


def _contiguous_default(n, tile):
    """map_contiguous's heuristic config: GPU tiles of ``tile`` elements (~8 KiB per operand), the
    interpreter's whole streams up to 65536."""
    block = _pow2(min(n, 1 << 16)) if runtime.INTERPRETER else tile
    return dict(BLOCK_SIZE=block, num_warps=8 if block >= 2048 else 4)


def _strided_default(rows, d3, transposed, tile):
    """map_strided's heuristic config: rows of up to 1024 elements stacked to ``tile``, or 64 x 64
    tiles when an operand is not unit-stride innermost (both sides then read whole rows); the
    interpreter's: up to 16384 elements."""
    if runtime.INTERPRETER:
        block_c = _pow2(min(d3, 1 << 12))
        block_r = _pow2(min(rows, max(1, (1 << 14) // block_c)))
    elif transposed:
        block_c = min(64, _pow2(d3))
        block_r = min(64, _pow2(rows))
    else:
        block_c = min(1024, _pow2(d3))
        block_r = min(_pow2(rows), max(1, tile // block_c))
    return dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8 if block_r * block_c >= 4096 else 4)


# The maps' search space: map_contiguous takes BLOCK elements per program (its BLOCK_SIZE);
# map_strided BLOCK_R x BLOCK_C tiles of BLOCK elements, rows of BLOCK_C. Blocks are cut to the
# dims rounded up to powers of two, and the warps give each thread 2 to 64 elements of the tile.
SPACE = dict(BLOCK=(256, 512, 1024, 2048, 4096, 8192), BLOCK_C=(64, 256, 1024), num_warps=(2, 4, 8, 16))
QUICK_SPACE = dict(BLOCK=(64, 128), BLOCK_C=(8, 32), num_warps=(1,))


def _map_stages(ctx, key, spec):
    """The candidate map_contiguous (key (numel,)) or map_strided (key (ROWS, COLS, transposed))
    configs as stages: one, block (tile) sizes x warps."""
    space = ctx.choices(spec)
    if spec.name == "map_contiguous":
        tiles = [dict(BLOCK_SIZE=b) for b in space["BLOCK"]]
    else:
        rows, cols = triton.next_power_of_2(key[0]), triton.next_power_of_2(key[1])
        tiles = autotune.unique([dict(BLOCK_R=min(rows, max(1, b // c)), BLOCK_C=min(cols, c))
                                 for b in space["BLOCK"] for c in space["BLOCK_C"]])
    configs = [dict(t, num_warps=w) for t in tiles for w in space["num_warps"]
               if autotune.per_thread_ok(math.prod(t.values()), w)]
    return [lambda best: configs]


def _tile(dtype):
    """Elements per GPU tile of a map whose narrowest operand has ``dtype`` (~8 KiB per operand)."""
    return 8192 // dtype.itemsize


# elementwise maps (dtype: the output's; ``tile`` as _plan_map computes it). A dense stream of numel
# elements in BLOCK_SIZE-element programs; otherwise ROWS collapsed rows of COLS (the innermost dim;
# transposed 1 when some operand is not unit-stride there) in BLOCK_R x BLOCK_C tiles, cut to the
# dims rounded up to powers of two
MAP_CONTIGUOUS = tune.register(tune.Spec(
    "map_contiguous", ("numel",), ("BLOCK_SIZE", "num_warps"),
    lambda key, dtype, tile=None: _contiguous_default(key[0], tile or _tile(dtype)), _map_stages, SPACE, QUICK_SPACE,
    helper=True, doc="_map_contiguous_kernel: a map over dense operands of one layout"))
MAP_STRIDED = tune.register(tune.Spec(
    "map_strided", ("ROWS", "COLS", "transposed"), ("BLOCK_R", "BLOCK_C", "num_warps"),
    lambda key, dtype, tile=None: _strided_default(*key, tile or _tile(dtype)), _map_stages, SPACE, QUICK_SPACE,
    helper=True, doc="_map_strided_kernel: any other map (broadcasts, transposes), up to four collapsed dims"))


def _plan_map(out, inputs, op, cd):
    """Choose the kernel, grid and launch arguments of one map (see map_)."""
    n = out.numel()
    if n == 0:
        return _EMPTY
    if cd is None:
        cd = compute_dtype(out.dtype, *[t.dtype for t in inputs])
    nin = len(inputs)
    meta = dict(NIN=nin, OP=op, CD=cd, OUT_BOOL=out.dtype == torch.bool)
    # walk the dims in out's memory order (elementwise work is order-free): operands that share
    # out's layout, e.g. channels-last activations, then collapse to one contiguous run
    order = sorted(range(out.dim()), key=lambda i: -out.stride(i))
    shape, strides = collapse([out.shape[i] for i in order],
                              [[st[i] for i in order] for st in [out.stride()] + [t.stride() for t in inputs]])
    # GPU tiles move ~8 KiB per operand, so 16-bit dtypes get twice the elements of fp32 and
    # each thread keeps 32 bytes in flight
    tile = 8192 // min([out.element_size()] + [t.element_size() for t in inputs])
    if len(shape) == 1 and all(st[0] == 1 for st in strides):
        cfg = MAP_CONTIGUOUS.config((n,), out.dtype, tile)
        block = cfg["BLOCK_SIZE"]
        meta.update(WIDE=n + block >= 2 ** 31, BLOCK=block, num_warps=cfg["num_warps"])
        return _map_contiguous_kernel, (cdiv(n, block),), (n,), meta
    if len(shape) > _MAX_DIMS:
        return _PEEL
    pad = _MAX_DIMS - len(shape)
    shape = [1] * pad + shape
    strides = [[0] * pad + st for st in strides] + [[0] * _MAX_DIMS] * (3 - nin)
    d3 = shape[3]
    rows = shape[0] * shape[1] * shape[2]
    # some operand not unit-stride innermost (a transpose): the GPU heuristic takes square tiles
    transposed = int(any(st[3] not in (0, 1) for st in strides))
    cfg = MAP_STRIDED.config((rows, d3, transposed), out.dtype, tile)
    block_r, block_c = min(cfg["BLOCK_R"], _pow2(rows)), min(cfg["BLOCK_C"], _pow2(d3))
    ints = (rows, shape[1], shape[2], d3, *[s for st in strides for s in st])
    meta.update(WIDE=needs_int64(shape, strides, block_r, block_c), BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=cfg["num_warps"])
    return _map_strided_kernel, (cdiv(rows, block_r), cdiv(d3, block_c)), ints, meta


def _map_peeled(out, inputs, op, s0, s1, cd):
    """More than four dims that don't merge: peel the leading ones off in Python."""
    shape, strides = collapse(out.shape, [out.stride()] + [t.stride() for t in inputs])
    lead = len(shape) - _MAX_DIMS
    for idx in itertools.product(*(range(s) for s in shape[:lead])):
        views = [t.as_strided(shape[lead:], st[lead:], t.storage_offset() + sum(i * s for i, s in zip(idx, st[:lead])))
                 for t, st in zip([out, *inputs], strides)]
        map_(views[0], views[1:], op, s0, s1, cd)
    return out


def needs_int64(shape, strides, *blocks):
    """True when an index or offset of this launch can reach 2**31 (blocks overshoot by one tile)."""
    span = max(sum((s - 1) * abs(st) for s, st in zip(shape, sts)) for sts in strides)
    overshoot = max(blocks) * (1 + max(abs(st) for sts in strides for st in sts))
    return max(span, math.prod(shape)) + overshoot >= 2 ** 31


def geglu_halves(buf):
    """The (hidden, gate) halves of ``buf``'s last dim: GEGLU's operands, as views."""
    half = buf.shape[-1] // 2
    return buf.narrow(-1, 0, half), buf.narrow(-1, half, half)


def geglu_backward_(grad, g, inp):
    """GEGLU's input gradient: ``grad[..., :H] = g * gelu(x)``, ``grad[..., H:] = g * h * gelu'(x)``
    for ``y = h * gelu(x)``, ``(h, x)`` the halves of ``inp``'s last dim (2H) and ``g`` (..., H)
    the output's gradient. One launch when every operand's leading dims merge into rows and its
    last dim is unit-stride (the usual case: contiguous activations), else two maps."""
    if g.numel() == 0:
        return grad
    key = (_geglu_backward_kernel, g.shape, grad.stride(), g.stride(), inp.stride(), g.dtype, inp.dtype)
    kept = _plans.get(key, _UNPLANNED)  # (Plan, grid, size and stride arguments), or None: two maps
    if kept is _UNPLANNED:
        kept = _plans[key] = _geglu_backward_launch(g.shape, key[2:5], g.dtype, inp.dtype)
    if kept is None:
        (hidden, gate), (grad_hidden, grad_gate) = geglu_halves(inp), geglu_halves(grad)
        map_(grad_hidden, [g, gate], GEGLU)
        return map_(grad_gate, [g, gate, hidden], GEGLU_GATE_BWD)
    plan, grid, args = kept
    launch_via(launch, plan, grid, (grad, g, inp, *args))
    return grad


_UNPLANNED = object()


def _geglu_backward_launch(g_shape, strides, g_dtype, inp_dtype):
    """The kept launch of ``geglu_backward_`` for the gradient's shape ``g_shape``, the (grad, g, inp)
    ``strides`` and the dtypes, or None when an operand's leading dims do not merge into rows or its
    last dim is not unit-stride."""
    if any(st[-1] != 1 for st in strides):
        return None
    shape, strides = collapse(g_shape[:-1], [st[:-1] for st in strides])
    if len(shape) > 1:
        return None
    rows, H = shape[0], g_shape[-1]
    cfg = _strided_default(rows, H, False, _tile(g_dtype))
    block_r, block_c = cfg["BLOCK_R"], cfg["BLOCK_C"]
    wide = needs_int64((rows, 2 * H), [(st[0], 1) for st in strides], block_r, block_c)
    plan = Plan(_geglu_backward_kernel, dict(CD=compute_dtype(g_dtype, inp_dtype), WIDE=wide, BLOCK_R=block_r,
                                             BLOCK_C=block_c, num_warps=cfg["num_warps"]))
    return plan, (cdiv(rows, block_r), cdiv(H, block_c)), (rows, H, *(st[0] for st in strides))


def fill_(out, value):
    """Write ``value`` into every element of ``out`` (any strides)."""
    return map_(out, [], IDENTITY, value, 0.0)


def copy_(dst, src):
    """dst[...] = src, casting to dst's dtype; src must already have dst's shape (expand it)."""
    return map_(dst, [src], IDENTITY)

