"""Differentiable logic-gate layers (Petersen et al. 2022, "Deep Differentiable Logic Gate Networks").

A layer of G gates reads a (B, IN) input ``x`` with values in [0, 1]. Gate g reads the two columns
``a = x[:, ia[g]]`` and ``b = x[:, ib[g]]`` and mixes the 16 two-input Boolean functions by
``p = softmax(logits[g])`` (16 logits). Function i is numbered by its truth table: bit 3 of i is its
value at (a, b) = (0, 0), bit 2 at (0, 1), bit 1 at (1, 0), bit 0 at (1, 1) (0 False, 1 AND, 3 A,
6 XOR, 7 OR, 8 NOR, 14 NAND, 15 True, ...). Each function's real-valued relaxation is the bilinear
interpolation of its truth table, ``op_i = c0 + c1 a + c2 b + c3 ab`` with
``c0 = t00, c1 = t10 - t00, c2 = t01 - t00, c3 = t11 - t10 - t01 + t00``; so is their mixture:

    out = w0 + w1 a + w2 b + w3 ab,    w = sum_i p_i c(i)   (4 coefficients per gate)

and no (B, G, 16) tensor is ever formed. The kernels:

- ``forward_``: one pass over (gate block, batch range) tiles; each program computes its gates' 4
  coefficients from the logits in registers (and saves them for backward), then streams the batch.
  ``hard=True`` replaces the softmax by the argmax function (first maximum) and evaluates it as a
  truth-table lookup on inputs thresholded at 0.5.
- ``backward_``: the logits' gradient needs, per gate, the four batch sums
  ``S = (sum g, sum g a, sum g b, sum g a b)`` (g = dL/dout), since
  ``dL/dlogit_i = p_i (c(i) - w) . S``. The input gradient is a scatter,
  ``dx[:, j] = sum over gates reading j as a of g (w1 + w3 b) + as b of g (w2 + w3 a)``, done as a
  gather: a plan (``LogicPlan``, host-built once per wiring) lists, for every input column, the
  (gate, side) entries that read it in increasing order (CSR), so each dx element is summed by one
  program in a fixed order: no atomics, bit-for-bit repeatable. One kernel walks the columns (in
  the plan's order: longest lists first, so a block's columns have about the same work), writes dx
  and, at each gate's ``a`` entry, that gate's partial sums S for its batch block; without dx a
  gate-major kernel writes the sums. A last small kernel adds the partial sums in block order and
  forms the 16 logit gradients.
- Hard inference on packed bits: ``pack_`` thresholds a (B, F) input into int32 words (feature-major
  (F, ceil(B / 32)), bit t of word w is sample 32 w + t), ``codes_`` takes each gate's argmax
  function, ``packed_`` evaluates 32 samples per word with bitwise operations, ``unpack_`` and
  ``group_count_`` (GroupSum on bits: a popcount per group, divided by tau) read them back.

Index values that only the device sees are checked there: a wiring index outside [0, IN) sets a
device error flag (IndexError at the next host read) and reads column 0 instead; the backward
compares the live wiring with the one its plan was built from and flags a stale plan.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from .. import runtime
from .elementwise import _pow2, cdiv, compute_dtype, fill_
from .launch import launch

_INTERPRETER_TILE = 1 << 17  # elements per program on the interpreter (see _forward_config)

_BAD_INDEX = runtime.device_error(IndexError, "logic_gates: a wiring index (a_index / b_index) lies outside "
                                              "[0, in_dim)")
_STALE_PLAN = runtime.device_error(RuntimeError, "logic_gates: the wiring (a_index / b_index) changed after its "
                                                 "backward plan was built, so the input gradient is wrong; build "
                                                 "a new plan (LogicLayer.rewire())")


# ---- per-gate tables ----------------------------------------------------------------------------

# Nested @triton.jit calls (tl.sum and tl.max among them) cost milliseconds each on the interpreter,
# which re-patches triton.language at every call: the kernels keep them out of their loops.

@triton.jit
def _probabilities(w_ptr, offs_g, mask_g, swg, swi, CD: tl.constexpr, HARD: tl.constexpr):
    # (BLOCK_G, 16): softmax of each gate's logits, or the one-hot of its first maximum (HARD)
    i = tl.arange(0, 16)
    logits = tl.load(w_ptr + offs_g[:, None] * swg + i[None, :] * swi, mask=mask_g[:, None], other=0.0).to(CD)
    if HARD:
        p = (i[None, :] == tl.argmax(logits, axis=1, tie_break_left=True)[:, None]).to(CD)
    else:
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
    return p


# coef[g] = (w0, w1, w2, w3) = (T00, T10 - T00, T01 - T00, T11 - T10 - T01 + T00), where
# T_xy = sum_i p_i t_xy(i) is the mixture's probability of a 1 at corner (x, y) and t_xy(i) is bit
# 3 (x, y = 0, 0), 2 (0, 1), 1 (1, 0) or 0 (1, 1) of i.
@triton.jit
def _coef_kernel(w_ptr, coef_ptr, G, swg, swi, CD: tl.constexpr, HARD: tl.constexpr, BLOCK_G: tl.constexpr):
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    p = _probabilities(w_ptr, offs_g, mask_g, swg, swi, CD, HARD)
    i = tl.arange(0, 16)
    t00 = ((i >> 3) & 1).to(CD)[None, :]
    t01 = ((i >> 2) & 1).to(CD)[None, :]
    t10 = ((i >> 1) & 1).to(CD)[None, :]
    t11 = (i & 1).to(CD)[None, :]
    c = coef_ptr + offs_g * 4
    tl.store(c, tl.sum(p * t00, axis=1), mask=mask_g)
    tl.store(c + 1, tl.sum(p * (t10 - t00), axis=1), mask=mask_g)
    tl.store(c + 2, tl.sum(p * (t01 - t00), axis=1), mask=mask_g)
    tl.store(c + 3, tl.sum(p * (t11 - t10 - t01 + t00), axis=1), mask=mask_g)


@triton.jit
def _columns(a_ptr, b_ptr, offs, mask, IN, err_ptr):
    # both wiring indices as int64; one outside [0, IN) sets the error flag and reads column 0
    ja = tl.load(a_ptr + offs, mask=mask, other=0).to(tl.int64)
    jb = tl.load(b_ptr + offs, mask=mask, other=0).to(tl.int64)
    bad_a = mask & ((ja < 0) | (ja >= IN))
    bad_b = mask & ((jb < 0) | (jb >= IN))
    tl.store(err_ptr + ja * 0, 1, mask=bad_a | bad_b)  # every such lane stores the same 1
    return tl.where(bad_a, 0, ja), tl.where(bad_b, 0, jb)


def coef_(coef, weight, hard=False):
    """``coef`` (G, 4), contiguous in the compute dtype: each gate's (w0, w1, w2, w3) from ``weight``
    (G, 16) logits (``hard``: of its argmax function). Returns ``coef``."""
    G = weight.shape[0]
    if G:
        bg = _pow2(min(G, 4096)) if runtime.INTERPRETER else 64
        launch(_coef_kernel, (cdiv(G, bg),), weight, coef, G, *weight.stride(), CD=compute_dtype(weight.dtype),
               HARD=bool(hard), BLOCK_G=bg, num_warps=4)
    return coef


# ---- forward ------------------------------------------------------------------------------------

# out = w0 + w1 a + (w2 + w3 a) b;  HARD: the truth-table entry T[a > 1/2, b > 1/2], T00 = w0,
# T10 = w0 + w1, T01 = w0 + w2, T11 = w0 + w1 + w2 + w3 (exact: the argmax function's w are integers)
@triton.jit
def _forward_kernel(x_ptr, coef_ptr, a_ptr, b_ptr, out_ptr, err_ptr, B, G, IN, batch_per_program,
                    sxb, sxf, sob, sog,
                    CD: tl.constexpr, HARD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    c = coef_ptr + offs_g * 4
    w0 = tl.load(c, mask=mask_g, other=0.0).to(CD)[:, None]
    w1 = tl.load(c + 1, mask=mask_g, other=0.0).to(CD)[:, None]
    w2 = tl.load(c + 2, mask=mask_g, other=0.0).to(CD)[:, None]
    w3 = tl.load(c + 3, mask=mask_g, other=0.0).to(CD)[:, None]
    col_a, col_b = _columns(a_ptr, b_ptr, offs_g, mask_g, IN, err_ptr)
    row_a = (col_a * sxf)[:, None]
    row_b = (col_b * sxf)[:, None]
    lo = tl.program_id(1).to(tl.int64) * batch_per_program
    hi = tl.minimum(lo + batch_per_program, B)
    for b0 in range(lo, hi, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = mask_g[:, None] & (offs_b < hi)[None, :]
        xa = tl.load(x_ptr + row_a + offs_b[None, :] * sxb, mask=mask, other=0.0).to(CD)
        xb = tl.load(x_ptr + row_b + offs_b[None, :] * sxb, mask=mask, other=0.0).to(CD)
        if HARD:
            on_b = xb > 0.5
            out = tl.where(xa > 0.5, tl.where(on_b, w0 + w1 + w2 + w3, w0 + w1), tl.where(on_b, w0 + w2, w0))
        else:
            out = w0 + w1 * xa + (w2 + w3 * xa) * xb
        tl.store(out_ptr + offs_g[:, None] * sog + offs_b[None, :] * sob, out.to(out_ptr.dtype.element_ty), mask=mask)


_l2 = None


def _batch_block(rows: int, elem_bytes: int) -> int:
    """GPU: samples per program (a power of two from 32 to 128), the most for which the slices of
    the ``rows`` rows a launch reads and writes fit in a third of the L2 cache. The grids run batch
    block after batch block (it is their slow axis), so the repeated reads of a row slice (an input
    column several gates read, a gate's gradient read at both its inputs) come from L2, not DRAM."""
    global _l2
    if _l2 is None:
        props = torch.cuda.get_device_properties(runtime.device)
        _l2 = int(getattr(props, "L2_cache_size", 0) or (50 << 20))
    bb = 128
    while bb > 32 and rows * bb * elem_bytes > _l2 // 3:
        bb //= 2
    return bb


def _forward_config(G, B, IN, elem_bytes):
    """(BLOCK_G, BLOCK_B, batch ranges per gate block). GPU: one tile of 2048 outputs per program,
    ``_batch_block`` samples (rows of 128-512 contiguous bytes of a feature-major input) by the gates
    that fill it, gates the fast axis of the grid. Interpreter: a program per tile of up to 2^17
    elements, looping over the batch (a program costs ~10 ms of Python whatever its size; 2^17
    halves the time of 2^15)."""
    if runtime.INTERPRETER:
        block_b = _pow2(min(max(B, 1), 1024))
        return _pow2(min(G, max(1, _INTERPRETER_TILE // block_b))), block_b, 1
    block_b = min(_batch_block(IN + G, elem_bytes), _pow2(B))
    return min(2048 // block_b, _pow2(G)), block_b, cdiv(B, block_b)


def forward_(out, x, coef, a_index, b_index, hard=False):
    """Gate outputs ``out[b, g]`` (any 2-D strides and float dtype) of ``x`` (B, IN) with any
    strides, from the gates' ``coef`` (``coef_``) and wiring ``a_index``/``b_index`` (G,) int32 or
    int64. ``hard``: ``coef`` of the argmax functions (``coef_(..., hard=True)``), inputs thresholded
    at 0.5. Returns ``out``."""
    B, IN = x.shape
    G = coef.shape[0]
    if G == 0 or B == 0:
        return out
    block_g, block_b, ranges = _forward_config(G, B, IN, max(x.element_size(), out.element_size()))
    per = block_b * cdiv(B, block_b * ranges)
    launch(_forward_kernel, (cdiv(G, block_g), cdiv(B, per)), x, coef, a_index, b_index, out,
           runtime.error_flag(_BAD_INDEX), B, G, IN, per, *x.stride(), *out.stride(),
           CD=compute_dtype(x.dtype, coef.dtype), HARD=bool(hard), BLOCK_G=block_g, BLOCK_B=block_b, num_warps=4)
    return out


# ---- backward -----------------------------------------------------------------------------------

class LogicPlan:
    """The input gradient's gather plan for one wiring, built on the host (NumPy) and uploaded once.

    Entry ``e = 2 g + s`` is gate g's input a (s = 0) or b (s = 1), reading column ``col[e]``. For
    each column, its entries in increasing order (CSR): ``offsets`` (IN + 1,), ``entries`` (2G,)
    and ``others`` (2G,), the column the same gate reads on its other side; ``order`` (IN,) lists
    the columns by decreasing entry count (stable). ``wiring`` (2, G) keeps the indices the plan
    was built from: the backward checks them against the live ones. All int32 on the device.
    ``a_index``/``b_index``: integer NumPy arrays of one length G, values already checked to lie in
    [0, in_dim)."""

    def __init__(self, a_index, b_index, in_dim: int):
        a = np.asarray(a_index, dtype=np.int64)
        b = np.asarray(b_index, dtype=np.int64)
        G = a.shape[0]
        if 2 * G >= 2 ** 31 or in_dim >= 2 ** 31:
            raise ValueError(f"logic plan: {G} gates or {in_dim} inputs is more than int32 indexing allows")
        self.in_dim, self.gates = int(in_dim), int(G)
        col = np.stack([a, b], axis=1).reshape(-1)  # entry e = 2 g + s
        other = np.stack([b, a], axis=1).reshape(-1)
        entries = np.argsort(col, kind="stable")  # by column, then by entry
        counts = np.bincount(col, minlength=in_dim)
        offsets = np.zeros(in_dim + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        order = np.argsort(-counts, kind="stable")
        self.max_readers = int(counts.max()) if in_dim else 0
        host = dict(offsets=offsets, entries=entries, others=other[entries], order=order,
                    wiring=np.stack([a, b]))
        for name, arr in host.items():
            buf = torch.from_numpy(np.ascontiguousarray(arr, np.int32))
            setattr(self, name, buf.to(runtime.device))  # host transfer


# Gate-major partial sums (no input gradient): part[k, g, :] = S of gate g over batch block k.
@triton.jit
def _gate_sums_kernel(x_ptr, a_ptr, b_ptr, g_ptr, part_ptr, err_ptr, B, G, IN, sxb, sxf, sgb, sgg,
                      CD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    pid_b = tl.program_id(1).to(tl.int64)
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = mask_g[:, None] & (offs_b < B)[None, :]
    col_a, col_b = _columns(a_ptr, b_ptr, offs_g, mask_g, IN, err_ptr)
    xa = tl.load(x_ptr + (col_a * sxf)[:, None] + offs_b[None, :] * sxb, mask=mask, other=0.0).to(CD)
    xb = tl.load(x_ptr + (col_b * sxf)[:, None] + offs_b[None, :] * sxb, mask=mask, other=0.0).to(CD)
    gv = tl.load(g_ptr + offs_g[:, None] * sgg + offs_b[None, :] * sgb, mask=mask, other=0.0).to(CD)
    p = part_ptr + (pid_b * G + offs_g) * 4
    ga = gv * xa
    tl.store(p, tl.sum(gv, axis=1), mask=mask_g)
    tl.store(p + 1, tl.sum(ga, axis=1), mask=mask_g)
    tl.store(p + 2, tl.sum(gv * xb, axis=1), mask=mask_g)
    tl.store(p + 3, tl.sum(ga * xb, axis=1), mask=mask_g)


# Column-major input gradient: for column j and entries e = 2 g + s in its list (increasing e),
#   dx[:, j] = sum_e g[:, g] (w_{1+s} + w3 x[:, other(e)])
# (d out / d a = w1 + w3 b, d out / d b = w2 + w3 a). A program holds BLOCK_J columns x BLOCK_B samples
# and takes BLOCK_K entries of each column at a time, a (BLOCK_J, BLOCK_K, BLOCK_B) tile summed over
# its entry axis in order. At an a entry (s = 0) the tile holds the gate's g, a = x[:, j] and
# b = x[:, other]: its partial sums S for this batch block are written there.
@triton.jit
def _input_grad_kernel(x_ptr, g_ptr, coef_ptr, offsets_ptr, entries_ptr, others_ptr, order_ptr, dx_ptr, part_ptr,
                       B, G, IN, sxb, sxf, sgb, sgg, sdb, sdf, CD: tl.constexpr, SUMS: tl.constexpr,
                       BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    pid_b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    mask_j = offs < IN
    col = tl.load(order_ptr + offs, mask=mask_j, other=0).to(tl.int64)
    start = tl.load(offsets_ptr + col, mask=mask_j, other=0)
    count = tl.load(offsets_ptr + col + 1, mask=mask_j, other=0) - start
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    b3 = offs_b[None, None, :]
    if SUMS:
        xj = tl.load(x_ptr + (col * sxf)[:, None, None] + b3 * sxb,
                     mask=mask_j[:, None, None] & mask_b[None, None, :], other=0.0).to(CD)
    acc = tl.zeros((BLOCK_J, BLOCK_B), CD)
    part = part_ptr + pid_b * G * 4
    slot = tl.arange(0, BLOCK_K)[None, :]
    for k0 in range(0, tl.max(count, axis=0), BLOCK_K):
        valid = (k0 + slot) < count[:, None]  # (BLOCK_J, BLOCK_K)
        pos = start[:, None] + k0 + slot
        e = tl.load(entries_ptr + pos, mask=valid, other=0)
        gate = (e >> 1).to(tl.int64)
        side = e & 1
        other = tl.load(others_ptr + pos, mask=valid, other=0).to(tl.int64)
        w_lin = tl.load(coef_ptr + gate * 4 + 1 + side, mask=valid, other=0.0)[:, :, None]
        w3 = tl.load(coef_ptr + gate * 4 + 3, mask=valid, other=0.0)[:, :, None]
        mask = valid[:, :, None] & mask_b[None, None, :]
        gv = tl.load(g_ptr + (gate * sgg)[:, :, None] + b3 * sgb, mask=mask, other=0.0).to(CD)
        xo = tl.load(x_ptr + (other * sxf)[:, :, None] + b3 * sxb, mask=mask, other=0.0).to(CD)
        acc += tl.sum(gv * (w_lin + w3 * xo), axis=1)
        if SUMS:
            first = valid & (side == 0)
            p = part + gate * 4
            ga = gv * xj
            tl.store(p, tl.sum(gv, axis=2), mask=first)
            tl.store(p + 1, tl.sum(ga, axis=2), mask=first)
            tl.store(p + 2, tl.sum(gv * xo, axis=2), mask=first)
            tl.store(p + 3, tl.sum(ga * xo, axis=2), mask=first)
    tl.store(dx_ptr + (col * sdf)[:, None] + offs_b[None, :] * sdb, acc.to(dx_ptr.dtype.element_ty),
             mask=mask_j[:, None] & mask_b[None, :])


# dL/dlogit_i = p_i (c(i) - w) . S, S summed over the batch blocks in order; c(i) = (t00, t10 - t00,
# t01 - t00, t11 - t10 - t01 + t00) of function i and w = sum_i p_i c(i) the gate's coefficients.
# CHECK: the live wiring must equal the plan's (else the stale-plan flag).
@triton.jit
def _weight_grad_kernel(part_ptr, w_ptr, coef_ptr, dw_ptr, a_ptr, b_ptr, plan_ptr, err_ptr, G, blocks,
                        swg, swi, sdg, sdi, CD: tl.constexpr, CHECK: tl.constexpr, BLOCK_G: tl.constexpr):
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    s0 = tl.zeros((BLOCK_G,), CD)
    s1 = tl.zeros((BLOCK_G,), CD)
    s2 = tl.zeros((BLOCK_G,), CD)
    s3 = tl.zeros((BLOCK_G,), CD)
    for k in range(0, blocks):
        p = part_ptr + (k * G + offs_g) * 4
        s0 += tl.load(p, mask=mask_g, other=0.0)
        s1 += tl.load(p + 1, mask=mask_g, other=0.0)
        s2 += tl.load(p + 2, mask=mask_g, other=0.0)
        s3 += tl.load(p + 3, mask=mask_g, other=0.0)
    c = coef_ptr + offs_g * 4
    mixed = (tl.load(c, mask=mask_g, other=0.0) * s0 + tl.load(c + 1, mask=mask_g, other=0.0) * s1
             + tl.load(c + 2, mask=mask_g, other=0.0) * s2 + tl.load(c + 3, mask=mask_g, other=0.0) * s3)
    i = tl.arange(0, 16)
    t00 = ((i >> 3) & 1).to(CD)[None, :]
    t01 = ((i >> 2) & 1).to(CD)[None, :]
    t10 = ((i >> 1) & 1).to(CD)[None, :]
    t11 = (i & 1).to(CD)[None, :]
    pure = (t00 * s0[:, None] + (t10 - t00) * s1[:, None] + (t01 - t00) * s2[:, None]
            + (t11 - t10 - t01 + t00) * s3[:, None])
    dw = _probabilities(w_ptr, offs_g, mask_g, swg, swi, CD, False) * (pure - mixed[:, None])
    tl.store(dw_ptr + offs_g[:, None] * sdg + i[None, :] * sdi, dw.to(dw_ptr.dtype.element_ty), mask=mask_g[:, None])
    if CHECK:
        live_a = tl.load(a_ptr + offs_g, mask=mask_g, other=0).to(tl.int64)
        live_b = tl.load(b_ptr + offs_g, mask=mask_g, other=0).to(tl.int64)
        plan_a = tl.load(plan_ptr + offs_g, mask=mask_g, other=0).to(tl.int64)
        plan_b = tl.load(plan_ptr + G + offs_g, mask=mask_g, other=0).to(tl.int64)
        stale = mask_g & ((live_a != plan_a) | (live_b != plan_b))
        tl.store(err_ptr + live_a * 0, 1, mask=stale)


def _backward_config(G, IN, B, readers, elem_bytes):
    """Blocks of the three backward kernels: (BLOCK_G, BLOCK_B) of the gate sums, (BLOCK_J, BLOCK_K,
    BLOCK_B) of the input gradient, BLOCK_G of the logit gradient. ``readers``: the mean entries per
    column; BLOCK_K is its power of two (GPU: at most 16), so that a tile's columns take about one
    pass each. GPU: tiles of 2048 elements, ``_batch_block`` samples wide (the grids' slow axis).
    Interpreter: tiles of up to 2^17 elements, one entry per column at a time unless the columns
    have four or more."""
    k = 1 << max(0, int(readers).bit_length() - 1)  # the power of two at or below the mean
    if runtime.INTERPRETER:
        bb = _pow2(min(max(B, 1), 1024))
        bk = min(k, 64) if readers >= 4 else 1
        bb = min(bb, max(1, _INTERPRETER_TILE // bk))
        bj = _pow2(min(max(IN, 1), max(1, _INTERPRETER_TILE // (bb * bk))))
        return _pow2(min(max(G, 1), max(1, _INTERPRETER_TILE // bb))), bb, bj, bk, bb, _pow2(min(max(G, 1), 4096))
    bb = min(_batch_block(2 * IN + G, elem_bytes), _pow2(max(B, 1)))
    bk = min(16, k, 2048 // bb)
    return min(2048 // bb, _pow2(max(G, 1))), bb, min(_pow2(max(IN, 1)), max(1, 2048 // (bb * bk))), bk, bb, 64


# Whether the input-gradient kernel also writes the logits' partial sums (one pass over g and x
# instead of two). Off on the interpreter, where its four extra reductions per entry block cost more
# than the separate gate-major pass; tests switch it to cover both paths.
FUSED_SUMS = not runtime.INTERPRETER


def backward_(g, x, weight, coef, a_index, b_index, dweight=None, dx=None, plan=None):
    """Gradients of ``forward_`` given ``g = dL/dout`` (B, G) with any strides: ``dweight`` (G, 16)
    and/or ``dx`` (B, IN) (any strides; needs ``plan``, a ``LogicPlan`` of this wiring), both
    optional. ``coef`` is what the forward used (``coef_``). Returns ``(dweight, dx)``."""
    B, IN = x.shape
    G = weight.shape[0]
    cd = compute_dtype(x.dtype, weight.dtype)
    acc = torch.float64 if cd == tl.float64 else torch.float32
    gb, gbb, bj, bk, bjb, wg = _backward_config(G, IN, B, 2 * G / max(IN, 1), max(x.element_size(), g.element_size()))
    fused = FUSED_SUMS and dx is not None and dweight is not None
    part, blocks = None, 1
    if dweight is not None:
        blocks = max(1, cdiv(B, bjb if fused else gbb))
        part = runtime.empty((blocks, G, 4), acc)
        if B == 0:  # an empty batch's sums
            fill_(part, 0)
        elif not fused and G:
            launch(_gate_sums_kernel, (cdiv(G, gb), blocks), x, a_index, b_index, g, part,
                   runtime.error_flag(_BAD_INDEX), B, G, IN, *x.stride(), *g.stride(), CD=cd, BLOCK_G=gb,
                   BLOCK_B=gbb, num_warps=4)
    if dx is not None and B and IN:
        launch(_input_grad_kernel, (cdiv(IN, bj), cdiv(B, bjb)), x, g, coef, plan.offsets, plan.entries, plan.others,
               plan.order, dx, coef if part is None else part, B, G, IN, *x.stride(), *g.stride(), *dx.stride(),
               CD=cd, SUMS=fused, BLOCK_J=bj, BLOCK_K=bk, BLOCK_B=bjb, num_warps=4)
    if dweight is not None and G:
        launch(_weight_grad_kernel, (cdiv(G, wg),), part, weight, coef, dweight, a_index, b_index,
               a_index if plan is None else plan.wiring, runtime.error_flag(_STALE_PLAN), G, blocks,
               *weight.stride(), *dweight.stride(), CD=cd, CHECK=plan is not None, BLOCK_G=wg, num_warps=4)
    return dweight, dx


# ---- hard inference on packed bits --------------------------------------------------------------

# bits[f, w] = sum_t [x[32 w + t, f] > threshold] 2^t over the samples of word w (int32, two's complement)
@triton.jit
def _pack_kernel(x_ptr, bits_ptr, B, F, W, threshold, sxb, sxf, sbf, sbw,
                 BLOCK_F: tl.constexpr, BLOCK_W: tl.constexpr):
    offs_f = tl.program_id(0).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_w = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    t = tl.arange(0, 32)
    sample = offs_w[None, :, None] * 32 + t[None, None, :]
    mask = (offs_f < F)[:, None, None] & (sample < B)
    x = tl.load(x_ptr + offs_f[:, None, None] * sxf + sample * sxb, mask=mask, other=0.0)
    word = tl.sum(tl.where(mask & (x > threshold), tl.full((1, 1, 32), 1, tl.int64) << t[None, None, :], 0), axis=2)
    tl.store(bits_ptr + offs_f[:, None] * sbf + offs_w[None, :] * sbw, word.to(tl.int32),
             mask=(offs_f < F)[:, None] & (offs_w < W)[None, :])


# code[g] = argmax_i logits[g, i] (first maximum): the index of the gate's function, its truth table
@triton.jit
def _codes_kernel(w_ptr, codes_ptr, G, swg, swi, CD: tl.constexpr, BLOCK_G: tl.constexpr):
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    i = tl.arange(0, 16)
    logits = tl.load(w_ptr + offs_g[:, None] * swg + i[None, :] * swi, mask=mask_g[:, None], other=0.0).to(CD)
    tl.store(codes_ptr + offs_g, tl.argmax(logits, axis=1, tie_break_left=True).to(tl.int32), mask=mask_g)


# out word = A ? (B ? T11 : T10) : (B ? T01 : T00), bitwise over 32 samples; T_xy all ones where the
# gate's function is 1 at (x, y) (bit 3 of the code: (0, 0), bit 2: (0, 1), bit 1: (1, 0), bit 0: (1, 1))
@triton.jit
def _packed_kernel(bits_ptr, codes_ptr, a_ptr, b_ptr, out_ptr, err_ptr, G, W, IN, sbf, sbw, sof, sow,
                   BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    offs_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    code = tl.load(codes_ptr + offs_g, mask=mask_g, other=0)
    t11 = (-(code & 1))[:, None]
    t10 = (-((code >> 1) & 1))[:, None]
    t01 = (-((code >> 2) & 1))[:, None]
    t00 = (-((code >> 3) & 1))[:, None]
    row_a, row_b = _columns(a_ptr, b_ptr, offs_g, mask_g, IN, err_ptr)
    row_a *= sbf
    row_b *= sbf
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        mask = mask_g[:, None] & (offs_w < W)[None, :]
        va = tl.load(bits_ptr + row_a[:, None] + offs_w[None, :] * sbw, mask=mask, other=0)
        vb = tl.load(bits_ptr + row_b[:, None] + offs_w[None, :] * sbw, mask=mask, other=0)
        nb = ~vb
        out = (va & ((vb & t11) | (nb & t10))) | (~va & ((vb & t01) | (nb & t00)))
        tl.store(out_ptr + offs_g[:, None] * sof + offs_w[None, :] * sow, out, mask=mask)


# out[b, f] = bit b % 32 of bits[f, b // 32]
@triton.jit
def _unpack_kernel(bits_ptr, out_ptr, B, F, sbf, sbw, sob, sof, BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_f = tl.program_id(0).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_b = tl.program_id(1).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (offs_f < F)[:, None] & (offs_b < B)[None, :]
    word = tl.load(bits_ptr + offs_f[:, None] * sbf + (offs_b // 32)[None, :] * sbw, mask=mask, other=0)
    bit = (word >> (offs_b % 32).to(tl.int32)[None, :]) & 1
    tl.store(out_ptr + offs_b[None, :] * sob + offs_f[:, None] * sof, bit.to(out_ptr.dtype.element_ty), mask=mask)


# GroupSum: out[b, c] = scale * sum_{r < size} x[b, c size + r], x float (B, K size) with any strides,
# or BITS: bit b of packed row c size + r (x (K size, words(B)) int32). BLOCK_R rows of a group at a time.
@triton.jit
def _group_sum_kernel(x_ptr, out_ptr, B, K, size, scale, sxb, sxf, sob, sok, CD: tl.constexpr, BITS: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_b = tl.program_id(1).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_kb = (offs_k < K)[:, None] & (offs_b < B)[None, :]
    shift = (offs_b % 32).to(tl.int32)[None, None, :]
    if BITS:
        step_b = (offs_b // 32)[None, None, :] * sxb
    else:
        step_b = offs_b[None, None, :] * sxb
    rows = offs_k[:, None, None] * size + tl.arange(0, BLOCK_R)[None, :, None]
    acc = tl.zeros((BLOCK_K, BLOCK_B), CD)
    for r in range(0, size, BLOCK_R):
        mask = mask_kb[:, None, :] & (tl.arange(0, BLOCK_R) < size - r)[None, :, None]
        v = tl.load(x_ptr + (rows + r) * sxf + step_b, mask=mask, other=0)
        if BITS:
            acc += tl.sum(((v >> shift) & 1).to(CD), axis=1)
        else:
            acc += tl.sum(v.to(CD), axis=1)
    tl.store(out_ptr + offs_b[None, :] * sob + offs_k[:, None] * sok, (acc * scale).to(out_ptr.dtype.element_ty),
             mask=mask_kb)


# GroupSum's backward: dx[b, f] = scale * g[b, f // size]
@triton.jit
def _group_sum_grad_kernel(g_ptr, dx_ptr, B, F, size, scale, sgb, sgk, sdb, sdf, CD: tl.constexpr,
                           BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_f = tl.program_id(0).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_b = tl.program_id(1).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (offs_f < F)[:, None] & (offs_b < B)[None, :]
    g = tl.load(g_ptr + ((offs_f // size) * sgk)[:, None] + offs_b[None, :] * sgb, mask=mask, other=0.0).to(CD)
    tl.store(dx_ptr + (offs_f * sdf)[:, None] + offs_b[None, :] * sdb, (g * scale).to(dx_ptr.dtype.element_ty),
             mask=mask)


def _tile(rows, cols, interpreter_tile=_INTERPRETER_TILE, gpu=(32, 32)):
    """(BLOCK_rows, BLOCK_cols) of a bit kernel: GPU ``gpu`` (cut to the sizes), interpreter a few big tiles."""
    if runtime.INTERPRETER:
        bc = _pow2(min(max(cols, 1), 1024))
        return _pow2(min(max(rows, 1), max(1, interpreter_tile // bc))), bc
    return min(gpu[0], _pow2(max(rows, 1))), min(gpu[1], _pow2(max(cols, 1)))


def words(batch):
    """int32 words per feature that hold ``batch`` samples."""
    return cdiv(batch, 32)


def pack_(bits, x, threshold=0.5):
    """``bits`` (F, words(B)) int32 from ``x`` (B, F) any strides: bit t of word w is
    ``x[32 w + t, f] > threshold`` (padding bits 0). Returns ``bits``."""
    B, F = x.shape
    W = bits.shape[1]
    if F == 0 or W == 0:
        return bits
    bf, bw = _tile(F, W, _INTERPRETER_TILE // 32, (32, 4))
    launch(_pack_kernel, (cdiv(F, bf), cdiv(W, bw)), x, bits, B, F, W, float(threshold), *x.stride(),
           *bits.stride(), BLOCK_F=bf, BLOCK_W=bw, num_warps=4)
    return bits


def codes_(codes, weight):
    """``codes[g]`` (int32) = the first argmax of ``weight[g]`` (G, 16): gate g's function."""
    G = weight.shape[0]
    if G:
        bg = _pow2(min(G, 4096)) if runtime.INTERPRETER else 64
        launch(_codes_kernel, (cdiv(G, bg),), weight, codes, G, *weight.stride(), CD=compute_dtype(weight.dtype),
               BLOCK_G=bg, num_warps=4)
    return codes


def packed_(out, bits, codes, a_index, b_index):
    """Packed hard gates: ``out`` (G, W) int32 from ``bits`` (IN, W) int32, ``codes`` (G,) int32 and
    the wiring (G,). Any strides."""
    G, W = out.shape
    if G == 0 or W == 0:
        return out
    bg, bw = _tile(G, W, gpu=(32, 32))
    launch(_packed_kernel, (cdiv(G, bg),), bits, codes, a_index, b_index, out, runtime.error_flag(_BAD_INDEX),
           G, W, bits.shape[0], *bits.stride(), *out.stride(), BLOCK_G=bg, BLOCK_W=bw, num_warps=4)
    return out


def unpack_(out, bits):
    """``out[b, f]`` (B, F), any float dtype and strides, from ``bits`` (F, words(B)) int32."""
    B, F = out.shape
    if B == 0 or F == 0:
        return out
    bf, bb = _tile(F, B, gpu=(16, 128))
    launch(_unpack_kernel, (cdiv(F, bf), cdiv(B, bb)), bits, out, B, F, *bits.stride(), *out.stride(),
           BLOCK_F=bf, BLOCK_B=bb, num_warps=4)
    return out


def group_sum_(out, x, scale, bits=False):
    """``out[b, c] = scale * sum of x[b, c size + r] over r < size`` for ``out`` (B, K) float (any
    strides) and ``x`` (B, K size) float with any strides; ``bits``: ``x`` is packed (K size,
    words(B)) int32 and the sum counts its ones. Returns ``out``."""
    B, K = out.shape
    if B == 0 or K == 0:
        return out
    size = (x.shape[0] if bits else x.shape[1]) // K
    bk, bb = _tile(K, B, gpu=(16, 128))
    br = _pow2(min(size, max(1, _INTERPRETER_TILE // (bk * bb)))) if runtime.INTERPRETER else 1
    sxb, sxf = (x.stride(1), x.stride(0)) if bits else x.stride()
    launch(_group_sum_kernel, (cdiv(K, bk), cdiv(B, bb)), x, out, B, K, size, float(scale), sxb, sxf, *out.stride(),
           CD=compute_dtype(out.dtype), BITS=bool(bits), BLOCK_K=bk, BLOCK_R=br, BLOCK_B=bb, num_warps=4)
    return out


def group_sum_grad_(dx, g, scale):
    """GroupSum's input gradient: ``dx[b, f] = scale * g[b, f // size]``, ``dx`` (B, K size) and
    ``g`` (B, K), any strides. Returns ``dx``."""
    B, F = dx.shape
    if B == 0 or F == 0:
        return dx
    bf, bb = _tile(F, B, gpu=(16, 128))
    launch(_group_sum_grad_kernel, (cdiv(F, bf), cdiv(B, bb)), g, dx, B, F, F // g.shape[1], float(scale),
           *g.stride(), *dx.stride(), CD=compute_dtype(dx.dtype), BLOCK_F=bf, BLOCK_B=bb, num_warps=4)
    return dx
