"""Shape ops. Views (reshape of compatible strides, permute, transpose, narrow, expand, squeeze,
unsqueeze, flatten, basic indexing) share storage and launch nothing; materialising ops (contiguous,
clone, cat, stack, pad) go through the strided copy kernel."""
from __future__ import annotations

import math
import numbers

import torch

from .. import runtime
from ..autograd import needs_grad, record
from ..kernels import copy as KC
from ..kernels import elementwise as KE
from ..tensor import Tensor, result_type
from ._util import check_tensor, dense, new, normalize_dim


def _view(x: Tensor, buf, backward, **attrs) -> Tensor:
    out = Tensor(buf)
    if x._requires_grad and needs_grad(x):  # needs_grad only for an input that may be recorded
        record(out, (x,), backward, **attrs)
    return out


def _grad_into_zeros(shape, g, region):
    """A zero tensor of ``shape`` with ``g`` written into the view ``region(buf)``."""
    gx = new(shape, g.dtype)
    KE.fill_(gx._data, 0)
    KE.copy_(region(gx._data), g._data)
    return gx


# ---- reshape family ---------------------------------------------------------------------------

def _infer_shape(shape, numel, op="reshape"):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if all(type(s) is int and s >= -1 for s in shape):  # the common case: plain ints, perhaps one -1
        size = math.prod(shape)  # with one -1: minus the other dims' product
        if size < 0:
            if numel % size == 0 and shape.count(-1) == 1:
                return tuple(s if s != -1 else numel // -size for s in shape)
        elif size == numel and -1 not in shape:
            return tuple(shape)
    shape = list(shape)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1:
        raise RuntimeError(f"{op}: only one dimension can be inferred, got shape {tuple(shape)}")
    for s in shape:
        if not isinstance(s, numbers.Integral) or s < -1:
            raise RuntimeError(f"{op}: invalid shape {tuple(shape)}")
    known = math.prod(s for s in shape if s != -1)
    if unknown:
        if known == 0 or numel % known:
            raise RuntimeError(f"{op}: shape {tuple(shape)} is invalid for input of size {numel}")
        shape[unknown[0]] = numel // known
    if math.prod(shape) != numel:
        raise RuntimeError(f"{op}: shape {tuple(shape)} is invalid for input of size {numel}")
    return tuple(int(s) for s in shape)


# The view ops run for every attention head split and layout change of a model, forward and backward:
# their argument checks are memoised per (arguments, input size or rank), and a view's backward is
# the inverse view of the gradient's buffer (backward rules run without recording).

_MAX_MEMO = 4096  # entries of a memo before it starts afresh


class _Memo(dict):
    """``memo[args]`` is ``resolve(*args)``, kept from the first call: a repeat is a dict lookup and
    no Python call. A resolve that raises keeps nothing (a bad call raises every time); an
    unhashable argument (a list inside) raises TypeError, and the caller then resolves it each time."""

    def __init__(self, resolve):
        super().__init__()
        self.resolve = resolve

    def __missing__(self, args):
        if len(self) >= _MAX_MEMO:
            self.clear()
        value = self[args] = self.resolve(*args)
        return value


_shapes = _Memo(_infer_shape)  # (reshape's shape arguments, numel) -> the shape they resolve to


def _reshape_backward(node, g):
    shape = node.input_meta[0]  # the input's shape (a recorded view's one input requires grad)
    try:  # sizes as arguments: torch's parser tries a lone tuple as an int first, formatting a TypeError it drops
        return Tensor(g._data.view(*shape) if shape else g._data.view(shape))
    except RuntimeError:  # a gradient whose strides allow no view: a copy
        return reshape(g, shape)


def reshape(x, *shape):
    """A tensor with ``shape`` and the same elements; a view when the strides allow, else a copy."""
    if type(x) is not Tensor:
        check_tensor(x, "input", "reshape")
    data = x._data
    numel = data.numel()
    try:
        shape = _shapes[shape, numel]
    except TypeError:  # an unhashable argument
        shape = _infer_shape(shape, numel)
    try:
        buf = data.view(*shape) if shape else data.view(shape)  # sizes as arguments (see _reshape_backward)
    except RuntimeError:
        buf = dense(data).view(shape)
    return _view(x, buf, _reshape_backward)


view = reshape


def flatten(x, start_dim=0, end_dim=-1):
    check_tensor(x, "input", "flatten")
    if x.ndim == 0:
        return reshape(x, 1)
    s = normalize_dim(start_dim, x.ndim, "flatten")
    e = normalize_dim(end_dim, x.ndim, "flatten")
    if s > e:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    return reshape(x, x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:])


def unsqueeze(x, dim):
    check_tensor(x, "input", "unsqueeze")
    d = normalize_dim(dim, x.ndim + 1, "unsqueeze")
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def squeeze(x, dim=None):
    check_tensor(x, "input", "squeeze")
    if dim is None:
        shape = tuple(s for s in x.shape if s != 1)
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        dims = {normalize_dim(d, x.ndim, "squeeze") for d in dims} if x.ndim else set()
        shape = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, shape)


# ---- permutations -----------------------------------------------------------------------------

def _permute_backward(node, g):
    inverse = node.attrs["inverse"]
    return Tensor(g._data.permute(*inverse) if inverse else g._data.permute(inverse))  # dims as arguments


def _permutation(dims, ndim):
    """``(dims, inverse)``: permute's ``dims`` checked against ``ndim`` and normalised, and the
    permutation that undoes them."""
    if len(dims) != ndim:
        raise RuntimeError(f"permute: number of dims {len(dims)} doesn't match the input's {ndim} dims")
    if not all(type(d) is int and 0 <= d < ndim for d in dims):  # else already normalised
        dims = tuple(normalize_dim(d, ndim, "permute") for d in dims)
    if len(set(dims)) != len(dims):
        raise RuntimeError(f"permute: repeated dim in {dims}")
    inverse = [0] * ndim
    for i, d in enumerate(dims):
        inverse[d] = i
    return tuple(dims), tuple(inverse)


_permutations = _Memo(_permutation)  # (permute's dims, ndim) -> (the dims, normalised; their inverse)


def permute(x, *dims):
    if type(x) is not Tensor:
        check_tensor(x, "input", "permute")
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    data = x._data
    ndim = data.dim()
    try:
        dims, inverse = _permutations[dims, ndim]
    except TypeError:  # an unhashable argument
        dims, inverse = _permutation(dims, ndim)
    buf = data.permute(*dims) if dims else data.permute(dims)  # dims as arguments: see reshape
    return _view(x, buf, _permute_backward, inverse=inverse)


def _transposition(dim0, dim1, ndim):
    """``(d0, d1, inverse)``: transpose's dims checked against ``ndim`` and normalised, and the
    permutation that undoes the swap (the swap itself)."""
    d0, d1 = normalize_dim(dim0, ndim, "transpose"), normalize_dim(dim1, ndim, "transpose")
    dims = list(range(ndim))
    dims[d0], dims[d1] = d1, d0
    return d0, d1, tuple(dims)


_transpositions = _Memo(_transposition)  # (transpose's two int dims, ndim) -> (the dims, normalised; the inverse)


def transpose(x, dim0, dim1):
    if type(x) is not Tensor:
        check_tensor(x, "input", "transpose")
    data = x._data
    ndim = data.dim()
    if ndim == 0:
        return x
    if type(dim0) is int and type(dim1) is int:  # keyed by plain ints only: 1.0 and True hash as 1
        d0, d1, inverse = _transpositions[dim0, dim1, ndim]
    else:
        d0, d1, inverse = _transposition(dim0, dim1, ndim)
    return _view(x, data.transpose(d0, d1), _permute_backward, inverse=inverse)


def t(x):
    """Transpose of a tensor of at most 2 dims."""
    check_tensor(x, "input", "t")
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return transpose(x, 0, 1) if x.ndim == 2 else x


# ---- attention heads --------------------------------------------------------------------------
# An attention layer splits each (B, L, H*D) projection into heads and merges its (B, H, L, D) output
# back, per layer and step: each is one strided view (one torch view, one tensor, one node) instead of
# a reshape and a transpose, and each one's backward is the other.

def _split_heads_backward(node, g):
    return merge_heads(g)


def split_heads(x, heads):
    """The (B, H, L, D) view of a (B, L, H*D) tensor with ``heads`` heads: as
    ``x.reshape(B, L, H, D).transpose(1, 2)``, in one view."""
    if type(x) is not Tensor:
        check_tensor(x, "input", "split_heads")
    data = x._data
    if data.dim() != 3:
        raise ValueError(f"split_heads: input must be (B, L, heads * head size), got shape {tuple(data.shape)}")
    B, L, C = data.shape
    if type(heads) is not int or heads <= 0 or C % heads:
        raise ValueError(f"split_heads: heads must be a positive int dividing the input's {C} channels, got {heads!r}")
    sb, sl, sc = data.stride()
    size = C // heads
    # as_strided keeps the storage offset
    return _view(x, data.as_strided((B, heads, L, size), (sb, size * sc, sl, sc)), _split_heads_backward)


def _merge_heads_backward(node, g):
    return split_heads(g, node.attrs["heads"])


def merge_heads(x):
    """The (B, L, H*D) tensor of a (B, H, L, D) one: as ``x.transpose(1, 2).reshape(B, L, H * D)``, a
    view when each row's heads lie side by side (an attention output laid out like its query), else a
    copy."""
    if type(x) is not Tensor:
        check_tensor(x, "input", "merge_heads")
    data = x._data
    if data.dim() != 4:
        raise ValueError(f"merge_heads: input must be (B, heads, L, head size), got shape {tuple(data.shape)}")
    B, H, L, D = data.shape
    sb, sh, sl, sd = data.stride()
    if sh != D * sd:
        return reshape(transpose(x, 1, 2), B, L, H * D)
    return _view(x, data.as_strided((B, L, H * D), (sb, sl, sd)), _merge_heads_backward, heads=H)


# ---- expand -----------------------------------------------------------------------------------

def _expand_backward(node, g):
    return g  # the engine sums the broadcast dims back to the input's shape


def expand(x, *shape):
    """Broadcast ``x`` to ``shape`` as a stride-0 view (-1 keeps a dim)."""
    check_tensor(x, "input", "expand")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) < x.ndim:
        raise RuntimeError(f"expand: the number of sizes provided ({len(shape)}) must be >= "
                           f"the number of dims ({x.ndim})")
    lead = len(shape) - x.ndim
    full = []
    for i, s in enumerate(shape):
        src = x.shape[i - lead] if i >= lead else 1
        if s == -1:
            if i < lead:
                raise RuntimeError(f"expand: -1 is not allowed in a new leading dim (shape {shape})")
            s = src
        if src != 1 and src != s:
            raise RuntimeError(f"expand: the expanded size {s} must match the existing size {src} at dim {i} "
                               f"(input {x.shape}, target {tuple(shape)})")
        full.append(int(s))
    full = tuple(full)
    if full == x.shape:
        return x
    return _view(x, x._data.expand(full), _expand_backward)


broadcast_to = expand


# ---- narrow and basic indexing ----------------------------------------------------------------

def _narrow_backward(node, g):
    dim, start, length = node.attrs["dim"], node.attrs["start"], node.attrs["length"]
    return _grad_into_zeros(node.attrs["shape"], g, lambda b: b.narrow(dim, start, length))


def narrow(x, dim, start, length):
    check_tensor(x, "input", "narrow")
    d = normalize_dim(dim, x.ndim, "narrow")
    size = x.shape[d]
    if start < 0:
        start += size
    if not (0 <= start <= size and 0 <= length <= size - start):
        raise IndexError(f"narrow: start {start} + length {length} exceeds dimension {d} of size {size}")
    return _view(x, x._data.narrow(d, start, length), _narrow_backward, dim=d, start=start, length=length,
                 shape=x.shape)


def _check_index(index, x):
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if isinstance(it, Tensor):
            raise TypeError("indexing with a tensor is not basic indexing: use index_select or gather")
        if isinstance(it, slice) and it.step is not None and it.step <= 0:
            raise ValueError(f"slice step must be positive, got {it.step}")
        if not (it is None or it is Ellipsis or isinstance(it, (slice, numbers.Integral))):
            raise TypeError(f"unsupported index {it!r} (basic indexing: ints, slices, None, ...)")
    return index


def _getitem_backward(node, g):
    index = node.attrs["index"]
    return _grad_into_zeros(node.attrs["shape"], g, lambda b: b[index])


def getitem(x, index):
    """Basic indexing (ints, slices with positive steps, None, Ellipsis) as a view."""
    _check_index(index, x)
    return _view(x, x._data[index], _getitem_backward, index=index, shape=x.shape)


# ---- materialising ops ------------------------------------------------------------------------

def _identity_backward(node, g):
    return g


def contiguous(x):
    """``x`` itself if already contiguous, else a dense copy."""
    check_tensor(x, "input", "contiguous")
    if x._data.is_contiguous():
        return x
    return copy_as(x)


def clone(x):
    """A copy of ``x`` in ``x``'s own layout when that is dense (a channels-last tensor stays
    channels-last: torch's ``preserve_format``), else contiguous."""
    check_tensor(x, "input", "clone")
    return copy_as(x, x._data)


def copy_as(x, like=None):
    """A copy of ``x`` laid out as the buffer ``like`` (same shape) when that is dense, else (or
    without ``like``) contiguous."""
    out = new(x.shape, x.dtype) if like is None else Tensor(runtime.empty_dense_like(like, x.dtype))
    KE.copy_(out._data, x._data)
    if needs_grad(x):
        record(out, (x,), _identity_backward)
    return out


def _cat_backward(node, g):
    dim = node.attrs["dim"]
    grads, start = [], 0
    for size in node.attrs["sizes"]:
        grads.append(Tensor(g._data.narrow(dim, start, size)))
        start += size
    return tuple(grads)


def cat(tensors, dim=0):
    """Concatenate along ``dim``; every other dim must match. Dtypes promote."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    for i, x in enumerate(tensors):
        check_tensor(x, f"tensors[{i}]", "cat")
    ref = next((x for x in tensors if x.shape != (0,)), tensors[0])  # PyTorch skips legacy 1-D empties
    d = normalize_dim(dim, ref.ndim, "cat")
    dtype = result_type(*tensors)
    parts = [x for x in tensors if not (x.shape == (0,) and ref.ndim != 1)]
    for x in parts:
        if x.ndim != ref.ndim or any(a != b for i, (a, b) in enumerate(zip(x.shape, ref.shape)) if i != d):
            raise RuntimeError(f"cat: sizes of tensors must match except in dimension {d}; "
                               f"got {ref.shape} and {x.shape}")
    sizes = [x.shape[d] for x in parts]
    out_shape = ref.shape[:d] + (sum(sizes),) + ref.shape[d + 1:]
    out = new(out_shape, dtype)
    start = 0
    for x, size in zip(parts, sizes):
        KE.copy_(out._data.narrow(d, start, size), x._data)
        start += size
    if needs_grad(*parts):
        record(out, tuple(parts), _cat_backward, dim=d, sizes=sizes)
    return out


def stack(tensors, dim=0):
    """Stack equally shaped tensors along a new ``dim``."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    for i, x in enumerate(tensors):
        check_tensor(x, f"tensors[{i}]", "stack")
        if x.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got {tensors[0].shape} "
                               f"at entry 0 and {x.shape} at entry {i}")
    d = normalize_dim(dim, tensors[0].ndim + 1, "stack")
    return cat([unsqueeze(x, d) for x in tensors], d)


def split(x, split_size_or_sections, dim=0):
    """Views of consecutive pieces along ``dim`` (an int piece size, or a list of sizes)."""
    check_tensor(x, "input", "split")
    d = normalize_dim(dim, x.ndim, "split")
    size = x.shape[d]
    if isinstance(split_size_or_sections, numbers.Integral):
        step = int(split_size_or_sections)
        if step <= 0:
            raise ValueError(f"split: split_size must be positive, got {step}")
        sections = [min(step, size - s) for s in range(0, size, step)] or [0]
    else:
        sections = [int(s) for s in split_size_or_sections]
        if sum(sections) != size:
            raise RuntimeError(f"split: sections {sections} don't sum to dimension {d}'s size {size}")
    pieces, start = [], 0
    for s in sections:
        pieces.append(narrow(x, d, start, s))
        start += s
    return tuple(pieces)


def chunk(x, chunks, dim=0):
    """``chunks`` views along ``dim`` (the last may be smaller), as torch.chunk."""
    check_tensor(x, "input", "chunk")
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    d = normalize_dim(dim, x.ndim, "chunk")
    step = max(1, -(-x.shape[d] // chunks))
    return split(x, step, d)


# ---- block-diagonal matrices of row blocks -----------------------------------------------------

_BLOCK_LAYOUTS = {}  # (sizes, device) -> (mask, part): the constants of one partition of the rows


def _block_layout(sizes):
    """(mask (N, P) fp32, 1 where row n lies in block p and 0 elsewhere; part (N,) int64, the block
    of row n) of the row partition ``sizes``: made once per partition (P + 1 fills) and kept."""
    key = (sizes, str(runtime.device))
    layout = _BLOCK_LAYOUTS.get(key)
    if layout is None:
        mask = runtime.empty((sum(sizes), len(sizes)), torch.float32)
        part = runtime.empty((sum(sizes),), torch.int64)
        KE.fill_(mask, 0.0)
        start = 0
        for p, size in enumerate(sizes):
            KE.fill_(mask[start:start + size, p], 1.0)
            KE.fill_(part[start:start + size], p)
            start += size
        layout = _BLOCK_LAYOUTS[key] = (mask, part)
    return layout


def _check_blocks(x, sizes, op, name):
    """``sizes`` as a tuple of positive ints summing to the rows of the 2-D float tensor ``x``."""
    check_tensor(x, name, op)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{op}: {name} must be 2-D, got shape {x.shape}")
    if isinstance(sizes, numbers.Integral) or not all(isinstance(s, numbers.Integral) and s > 0 for s in sizes):
        raise ValueError(f"{op}: sizes must be a sequence of positive ints, got {sizes!r}")
    sizes = tuple(int(s) for s in sizes)
    if not sizes or sum(sizes) != x.shape[0]:
        raise ValueError(f"{op}: sizes {sizes} must sum to the {x.shape[0]} rows of {name} {x.shape}")
    return sizes


# Y = block_diagonal(X), X: (N, r), rows split into P blocks; Y: (N, P * r) with
#   Y[n, p * r + j] = X[n, j] if row n lies in block p, else 0.
#   dX[n, j] = dY[n, part(n) * r + j]     (the diagonal blocks of dY: diagonal_blocks)
def _block_diagonal_backward(node, g):
    return diagonal_blocks(g, node.attrs["sizes"])


def block_diagonal(x, sizes):
    """The block-diagonal matrix of ``x``'s row blocks: ``x`` (N, r) with rows split in order into
    blocks of ``sizes`` (P blocks summing to N) gives (N, P * r) whose block p, its rows in columns
    p * r to (p + 1) * r, is ``x``'s and every other entry zero (a LoRA up-projection of one rank-r
    adapter per block, as one matrix). One launch: ``x`` times the partition's 0/1 mask."""
    sizes = _check_blocks(x, sizes, "block_diagonal", "input")
    mask, _ = _block_layout(sizes)
    (n, r), p = x.shape, len(sizes)
    out = new((n, p, r), x.dtype)
    KE.map_(out._data, [x._data[:, None, :].expand(n, p, r), mask[:, :, None].expand(n, p, r)], KE.MUL.value)
    y = Tensor(out._data.view(n, p * r))
    if needs_grad(x):
        record(y, (x,), _block_diagonal_backward, sizes=sizes)
    return y


# X = diagonal_blocks(Y), X[n, j] = Y[n, part(n) * r + j]:
#   dY = block_diagonal(dX)     (dX in the diagonal blocks, zeros elsewhere)
def _diagonal_blocks_backward(node, g):
    return block_diagonal(g, node.attrs["sizes"])


def diagonal_blocks(y, sizes):
    """The inverse of ``block_diagonal`` on its image: ``y`` (N, P * r) with rows split into blocks of
    ``sizes`` gives (N, r) holding, for each row, the r columns of its own block (p * r to (p + 1) * r
    for a row of block p); entries outside the diagonal blocks are not read. One gather launch."""
    sizes = _check_blocks(y, sizes, "diagonal_blocks", "input")
    if y.shape[1] % len(sizes):
        raise ValueError(f"diagonal_blocks: the {y.shape[1]} columns of input {y.shape} are not {len(sizes)} "
                         "blocks of equal width")
    _, part = _block_layout(sizes)
    n, r = y.shape[0], y.shape[1] // len(sizes)
    out = new((n, r), y.dtype)
    s0, s1 = y.stride()
    KC.gather_(out._data, y._data, part, (s0, s1), (part.stride(0), 0), r * s1)
    if needs_grad(y):
        record(out, (y,), _diagonal_blocks_backward, sizes=sizes)
    return out


def _pad_amounts(ndim, pad, d):
    i = ndim - 1 - d  # pad lists the last dim first
    return (pad[2 * i], pad[2 * i + 1]) if 2 * i < len(pad) else (0, 0)


def _pad_regions(shape, pad):
    """Per dim: (input start, output start, length) of the region the input and output share."""
    regions = []
    for d, size in enumerate(shape):
        left, right = _pad_amounts(len(shape), pad, d)
        regions.append((max(-left, 0), max(left, 0), max(size + min(left, 0) + min(right, 0), 0)))
    return regions


def _region(buf, regions, which):
    for d, r in enumerate(regions):
        buf = buf.narrow(d, r[which], r[2])
    return buf


def _pad_backward(node, g):
    regions = node.attrs["regions"]
    return _grad_into_zeros(node.attrs["shape"], Tensor(_region(g._data, regions, 1)), lambda b: _region(b, regions, 0))


def pad(x, pad, mode="constant", value=0.0):
    """Constant padding as torch.nn.functional.pad: ``pad`` = (last_left, last_right, ...);
    negative entries crop."""
    check_tensor(x, "input", "pad")
    if mode != "constant":
        raise NotImplementedError(f"pad: mode {mode!r} is not implemented (only 'constant')")
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ValueError(f"pad: padding length {len(pad)} must be even and at most 2 * ndim ({2 * x.ndim})")
    regions = _pad_regions(x.shape, pad)
    out_shape = []
    for d, s in enumerate(x.shape):
        left, right = _pad_amounts(x.ndim, pad, d)
        if s + left + right < 0:
            raise RuntimeError(f"pad: padding {pad} gives a negative size for dim {d} of input {x.shape}")
        out_shape.append(s + left + right)
    out = new(out_shape, x.dtype)
    KE.fill_(out._data, value)
    KE.copy_(_region(out._data, regions, 1), _region(x._data, regions, 0))
    if needs_grad(x):
        record(out, (x,), _pad_backward, regions=regions, shape=x.shape)
    return out
