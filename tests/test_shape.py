import numpy as np
import pytest
import torch

import flame
from flame.ops.shape import merge_heads, split_heads
from flame.testing import gradcheck
from helpers import DEVICE, FLOAT_DTYPES_CPU, assert_close, check_op, pair


def _check(f_op, t_op, shapes, dtype=torch.float32, noncontig=False):
    """``check_op`` on inputs of ``shapes``: values and every input's gradient (views' backward
    rules see a random incoming gradient)."""
    return check_op(f_op, t_op, [pair(s, dtype, requires_grad=True, noncontig=noncontig) for s in shapes]).out


VIEWS = {
    "reshape": (lambda x: x.reshape(3, -1), lambda x: x.reshape(3, -1), [(6, 4)]),
    "reshape_copy": (lambda x: x.t().reshape(-1), lambda x: x.t().reshape(-1), [(6, 4)]),
    "view_tuple": (lambda x: x.view((2, 12)), lambda x: x.reshape((2, 12)), [(6, 4)]),
    "permute": (lambda x: x.permute(2, 0, 1), lambda x: x.permute(2, 0, 1), [(2, 3, 4)]),
    "transpose": (lambda x: x.transpose(0, -1), lambda x: x.transpose(0, -1), [(2, 3, 4)]),
    "T": (lambda x: x.T, lambda x: x.T, [(3, 5)]),
    "narrow": (lambda x: x.narrow(1, 1, 2), lambda x: x.narrow(1, 1, 2), [(3, 5)]),
    "expand": (lambda x: x.expand(4, 3, 5), lambda x: x.expand(4, 3, 5), [(3, 1)]),
    "expand_keep": (lambda x: x.expand(-1, 5), lambda x: x.expand(-1, 5), [(3, 1)]),
    "unsqueeze": (lambda x: x.unsqueeze(-1), lambda x: x.unsqueeze(-1), [(3, 5)]),
    "squeeze": (lambda x: x.squeeze(1), lambda x: x.squeeze(1), [(3, 1, 5)]),
    "squeeze_all": (lambda x: x.squeeze(), lambda x: x.squeeze(), [(1, 3, 1, 5)]),
    "flatten": (lambda x: x.flatten(1), lambda x: x.flatten(1), [(2, 3, 4)]),
    "getitem": (lambda x: x[1:, ::2, None, -1], lambda x: x[1:, ::2, None, -1], [(4, 5, 3)]),
    "getitem_int": (lambda x: x[2], lambda x: x[2], [(4, 5)]),
    "getitem_ellipsis": (lambda x: x[..., 1:3], lambda x: x[..., 1:3], [(2, 3, 4)]),
    "contiguous": (lambda x: x.t().contiguous(), lambda x: x.t().contiguous(), [(3, 5)]),
    "clone": (lambda x: x.clone(), lambda x: x.clone(), [(3, 5)]),
    "cat0": (lambda a, b: flame.cat([a, b]), lambda a, b: torch.cat([a, b]), [(2, 3), (4, 3)]),
    "cat1": (lambda a, b: flame.cat([a, b], dim=-1), lambda a, b: torch.cat([a, b], dim=-1), [(2, 3), (2, 1)]),
    "stack": (lambda a, b: flame.stack([a, b], 1), lambda a, b: torch.stack([a, b], 1), [(2, 3), (2, 3)]),
    "split": (lambda x: x.split(2, 1)[1] * 3 + x.split(2, 1)[2].sum(),
              lambda x: x.split(2, 1)[1] * 3 + x.split(2, 1)[2].sum(), [(3, 5)]),
    "split_sections": (lambda x: flame.split(x, [1, 4], 1)[1], lambda x: torch.split(x, [1, 4], 1)[1], [(3, 5)]),
    "chunk": (lambda x: x.chunk(3, 0)[2], lambda x: x.chunk(3, 0)[2], [(7, 2)]),
    "pad": (lambda x: flame.pad(x, (1, 2, 0, 3), value=0.5),
            lambda x: torch.nn.functional.pad(x, (1, 2, 0, 3), value=0.5), [(3, 4)]),
    "pad_crop": (lambda x: flame.pad(x, (-1, 2)), lambda x: torch.nn.functional.pad(x, (-1, 2)), [(3, 4)]),
    "split_heads": (lambda x: split_heads(x, 3), lambda x: x.reshape(2, 5, 3, 2).transpose(1, 2), [(2, 5, 6)]),
    "merge_heads": (lambda x: merge_heads(split_heads(x * 1.0, 2)),
                    lambda x: (x * 1.0).reshape(2, 5, 2, 3).transpose(1, 2).transpose(1, 2).reshape(2, 5, 6),
                    [(2, 5, 6)]),
    "merge_heads_copy": (lambda x: merge_heads(x), lambda x: x.transpose(1, 2).reshape(2, 5, 12), [(2, 3, 5, 4)]),
}


@pytest.mark.parametrize("name", list(VIEWS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES_CPU)
@pytest.mark.parametrize("noncontig", [False, True])
def test_shape_ops(name, dtype, noncontig):
    f_op, t_op, shapes = VIEWS[name]
    _check(f_op, t_op, shapes, dtype, noncontig)


@pytest.mark.parametrize("name", list(VIEWS))
def test_shape_gradcheck(name):
    f_op, _, shapes = VIEWS[name]
    rng = np.random.default_rng(7)
    xs = [flame.tensor(rng.standard_normal(s), requires_grad=True) for s in shapes]
    assert gradcheck(lambda *a: f_op(*a) * 1.0, xs)


def test_views_share_memory_and_launch_nothing():
    x = flame.randn(4, 6)
    for v in (x.reshape(2, 12), x.t(), x[1:3], x.narrow(1, 2, 3), x.unsqueeze(0).expand(5, 4, 6), x.permute(1, 0)):
        base = x.data_ptr()
        span = x.numel() * x.element_size()
        assert base <= v.data_ptr() < base + span


def test_clone_keeps_a_dense_layout_and_contiguous_makes_one():
    # as torch: clone preserves a dense layout (channels-last, transposed), a tensor with gaps
    # becomes contiguous; contiguous() always gives the row-major layout; both pass gradients
    cases = [torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.randn(5, 3).t(),
             torch.randn(4, 6)[:, ::2]]
    for t in cases:
        x = flame.from_torch(t.to(DEVICE), requires_grad=True)
        y = x.clone()
        assert y.stride() == t.clone().stride()
        assert x.contiguous().stride() == t.contiguous().stride()
        grads = (y * 2.0).sum().backward()
        assert_close(grads[x], torch.full(tuple(t.shape), 2.0))


def test_cat_promotes_and_skips_legacy_empty():
    a = flame.ones(2, 3, dtype=flame.float16)
    b = flame.ones(1, 3)
    assert flame.cat([a, b]).dtype == torch.float32
    assert flame.cat([a, flame.empty(0)]).shape == (2, 3)


def test_bad_shapes_raise():
    x = flame.ones(2, 3)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        x.reshape(4, -1)
    with pytest.raises(RuntimeError, match="only one dimension"):
        x.reshape(-1, -1)
    with pytest.raises(RuntimeError, match="must match"):
        x.expand(4, 4)
    with pytest.raises(RuntimeError, match="sizes of tensors must match"):
        flame.cat([x, flame.ones(2, 4)])
    with pytest.raises(IndexError):
        x.narrow(1, 2, 2)
    with pytest.raises(RuntimeError, match="dims"):
        x.permute(0)
    with pytest.raises(ValueError, match="step"):
        x[::-1]
    with pytest.raises(RuntimeError, match="equal size"):
        flame.stack([x, flame.ones(3, 2)])
    with pytest.raises(NotImplementedError, match="reflect"):
        flame.pad(x, (1, 1), mode="reflect")


def test_empty_shape_ops():
    x = flame.empty(0, 3, requires_grad=True)
    y = flame.cat([x, x], 0).reshape(-1, 3).t()
    assert y.shape == (3, 0)
    assert flame.pad(x, (1, 1)).shape == (0, 5)


def test_block_diagonal_and_diagonal_blocks():
    """block_diagonal puts each row block of x (N, r) in its own r columns, zeros elsewhere (as
    torch.block_diag of the blocks); diagonal_blocks reads them back, from strided input too; each
    is the other's adjoint (float64 gradcheck, through the other's backward too)."""
    from flame.ops.shape import block_diagonal, diagonal_blocks
    sizes = (3, 1, 4)
    x, xt = pair((8, 2))
    y = block_diagonal(x, sizes)
    assert_close(y, torch.block_diag(xt[:3], xt[3:4], xt[4:]), rtol=0, atol=0)
    wide = flame.randn(6, 8).t()  # (8, 6), strided
    blocks = diagonal_blocks(wide, sizes)
    wt = wide.to_torch()
    assert_close(blocks, torch.cat([wt[:3, 0:2], wt[3:4, 2:4], wt[4:, 4:6]]), rtol=0, atol=0)
    assert_close(diagonal_blocks(y, list(sizes)), xt, rtol=0, atol=0)
    rng = np.random.default_rng(3)
    a = flame.tensor(rng.standard_normal((8, 2)), requires_grad=True)
    assert gradcheck(lambda t: block_diagonal(t, sizes) * 1.0, [a])
    assert gradcheck(lambda t: diagonal_blocks(block_diagonal(t, sizes) * 2.0, sizes), [a])
    b = flame.tensor(rng.standard_normal((8, 6)), requires_grad=True)
    assert gradcheck(lambda t: diagonal_blocks(t, sizes) * 1.0, [b])
    with pytest.raises(ValueError, match=r"block_diagonal: sizes \(3, 4\) must sum to the 8 rows"):
        block_diagonal(x, (3, 4))
    with pytest.raises(ValueError, match="sequence of positive ints"):
        block_diagonal(x, (8, 0))
    with pytest.raises(ValueError, match="not 3 blocks of equal width"):
        diagonal_blocks(flame.randn(8, 7), sizes)
    with pytest.raises(TypeError, match="block_diagonal: input must be a floating-point"):
        block_diagonal(flame.zeros(8, 2, dtype=flame.int64), sizes)
    with pytest.raises(TypeError, match="block_diagonal: input must be a flame Tensor"):
        block_diagonal(xt, sizes)


def test_view_arguments_are_memoised_and_checked():
    """reshape, permute and transpose resolve their arguments once per (arguments, size or rank): a repeat
    takes the memo, a bad call raises every time, an unhashable argument still works; a view's
    backward is the inverse view, or a copy when the gradient's strides allow no view."""
    from flame.ops import shape as S
    S._shapes.clear()
    S._permutations.clear()
    S._transpositions.clear()
    a = torch.randn(2, 3, 4, device=DEVICE)
    x = flame.from_torch(a)
    for _ in range(2):
        assert_close(x.reshape(4, -1), a.reshape(4, -1))
        assert_close(x.permute(2, -3, 1), a.permute(2, 0, 1))
    assert len(S._shapes) == 1 and len(S._permutations) == 1
    b = torch.randn(4, 5, device=DEVICE)
    assert_close(flame.from_torch(b).reshape(4, -1), b)  # the same arguments over another size: a second entry
    assert len(S._shapes) == 2
    assert_close(x.reshape([6, 4]), a.reshape(6, 4))  # a list argument: resolved, not kept
    for _ in range(2):
        with pytest.raises(RuntimeError, match="invalid for input of size 24"):
            x.reshape(5, -1)
        with pytest.raises(RuntimeError, match="repeated dim"):
            x.permute(0, 0, 1)
        with pytest.raises(IndexError, match="out of range"):
            x.transpose(0, 3)
        assert_close(x.transpose(-1, 0), a.transpose(2, 0))
        with pytest.raises(TypeError, match="transpose: dim must be an int"):
            x.transpose(True, 0)  # hashes as 1, yet is checked, not taken from the memo
    assert len(S._transpositions) == 1
    # the backward of reshape when the incoming gradient is transposed: no view, a copy
    w = flame.from_torch(torch.randn(2, 3, device=DEVICE), requires_grad=True)
    g = torch.randn(2, 3, device=DEVICE)
    gw = flame.grad(w.reshape(3, 2), w, grad_outputs=flame.from_torch(g.t()))
    assert_close(gw, g.t().reshape(2, 3))


def test_split_and_merge_heads_are_one_view_each():
    """split_heads is reshape + transpose in one view of the same memory (a strided input, at a
    storage offset, too); merge_heads gives a view for heads side by side (an attention output laid
    out like its query), a copy otherwise; each records one node; bad input raises."""
    base = torch.randn(3, 2, 7, 12, device=DEVICE)
    a = base[1].transpose(0, 1)  # (7, 2, 12) at an offset, strided: split as (B=7, L=2, 4 heads of 3)
    x = flame.from_torch(a)
    q = split_heads(x, 4)
    want = a.reshape(7, 2, 4, 3).transpose(1, 2)
    assert q.shape == tuple(want.shape) and q.stride() == want.stride() and q.data_ptr() == want.data_ptr()
    o = merge_heads(q)
    assert o.stride() == a.stride() and o.data_ptr() == a.data_ptr()
    dense_heads = flame.randn(2, 3, 5, 4)  # (B, H, L, D) contiguous: the heads are not side by side
    assert_close(merge_heads(dense_heads), dense_heads.to_torch().transpose(1, 2).reshape(2, 5, 12), rtol=0, atol=0)
    w = flame.randn(2, 5, 6, requires_grad=True)
    assert split_heads(w, 3).grad_fn.name == "_split_heads_backward"
    assert merge_heads(split_heads(w, 3)).grad_fn.name == "_merge_heads_backward"
    with pytest.raises(ValueError, match="split_heads: heads must be a positive int dividing the input's 6"):
        split_heads(w, 4)
    with pytest.raises(ValueError, match=r"split_heads: input must be \(B, L, heads \* head size\)"):
        split_heads(flame.ones(2, 6), 2)
    with pytest.raises(ValueError, match="merge_heads: input must be"):
        merge_heads(w)
    with pytest.raises(TypeError, match="split_heads: input must be a flame Tensor"):
        split_heads(torch.ones(2, 5, 6), 3)
