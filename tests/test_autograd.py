import sys
import threading

import numpy as np
import pytest
import torch

import flame
from helpers import DEVICE, assert_close, pair


def test_long_chain_needs_no_recursion():
    # 10,000 recorded nodes (views: no kernels, so the interpreter stays fast) plus a scaling op;
    # deeper than Python's recursion limit, so a recursive engine would fail here
    x = flame.tensor([0.5, 1.5], requires_grad=True)
    y = x * 3.0
    for i in range(10_000):
        y = y.unsqueeze(0) if i % 2 == 0 else y.squeeze(0)
    assert sys.getrecursionlimit() < 10_000
    grads = y.sum().backward()
    np.testing.assert_allclose(grads[x].numpy(), [3.0, 3.0])


def test_arithmetic_chain():
    x = flame.tensor([0.5], requires_grad=True)
    y = x
    for _ in range(100):
        y = y * 1.01
    np.testing.assert_allclose(y.sum().backward()[x].numpy(), [1.01 ** 100], rtol=1e-5)


def test_diamond_fan_in_is_summed():
    x, xt = pair((3, 4), requires_grad=True)
    a = x.exp()
    b, c = a * 2, a.sin()
    y = (b + c).sum()
    at = xt.exp()
    yt = (at * 2 + at.sin()).sum()
    grads = y.backward()
    yt.backward()
    assert_close(grads[x], xt.grad)


def test_tensor_reused_in_several_ops():
    x, xt = pair((5,), requires_grad=True)
    y = (x * x * x + x.exp() * x - x).sum()
    yt = (xt * xt * xt + xt.exp() * xt - xt).sum()
    grads = y.backward()
    yt.backward()
    assert_close(grads[x], xt.grad)


def test_retain_graph_twice_then_release():
    x = flame.tensor([1.0, 2.0], requires_grad=True)
    y = (x.exp() * x).sum()
    g1 = y.backward(retain_graph=True)
    g2 = y.backward(retain_graph=True)
    assert_close(g1[x], g2[x])
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_second_backward_without_retain_raises():
    x = flame.tensor([1.0, 2.0], requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()


def test_gradient_map_api_and_accumulation():
    w = flame.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = flame.tensor([0.5], requires_grad=True)
    frozen = flame.tensor([1.0, 1.0, 1.0])
    grads = ((w * frozen + b) ** 2).sum().backward()
    assert w in grads and b in grads and frozen not in grads
    assert len(grads) == 2
    assert grads.get(frozen) is None
    ids = {tid for tid, _ in grads}
    assert ids == {w.id, b.id}
    assert_close(grads.by_id[w.id], grads[w])
    assert set(grads.by_id) == set(grads.keys()) == ids and dict(grads.items()) == dict(grads.by_id)
    with pytest.raises(KeyError):
        grads[frozen]
    more = ((w * frozen + b) ** 2).sum().backward()
    total = flame.GradientMap()
    total += grads
    total += more
    assert_close(total[w], grads[w] * 2)
    # accumulation sums in place into the first map's buffers, not aliasing the source
    assert total[w].data_ptr() != grads[w].data_ptr()


def test_gradient_map_keys_are_tensors():
    # a name or an int is not a key (an int used to mean a tensor id silently); ids go through by_id
    w = flame.tensor([1.0, 2.0], requires_grad=True)
    grads = (w * w).sum().backward()
    for key, match in (("w", r"keys are flame Tensors .*got str 'w'.*grads\[model.weight\]"),
                       (w.id, rf"got int {w.id}; .*grads.by_id\[{w.id}\]"), (0, "by_id"), (1.5, "got float"),
                       (torch.ones(2), r"got torch\.Tensor$")):
        with pytest.raises(TypeError, match=match):
            grads[key]
        with pytest.raises(TypeError, match="keys are flame Tensors"):
            key in grads  # noqa: B015
        with pytest.raises(TypeError, match="keys are flame Tensors"):
            grads.get(key)
        with pytest.raises(TypeError, match="keys are flame Tensors"):
            grads[key] = grads[w]
    with pytest.raises(TypeError, match=r"does not support item assignment"):
        grads.by_id[w.id] = grads[w]
    with pytest.raises(TypeError, match="expects a GradientMap"):
        grads.accumulate({w.id: grads[w]})
    assert len(grads) == 1 and grads.by_id.get(w.id) is grads[w]


def test_broadcast_inputs_get_reduced_gradients():
    x, xt = pair((4, 1, 3), requires_grad=True)
    b, bt = pair((5, 1), requires_grad=True)
    grads = (x * b).sum().backward()
    (xt * bt).sum().backward()
    assert grads[x].shape == (4, 1, 3) and grads[b].shape == (5, 1)
    assert_close(grads[x], xt.grad)
    assert_close(grads[b], bt.grad)


def test_no_grad_and_enable_grad():
    x = flame.ones(3, requires_grad=True)
    with flame.no_grad():
        y = x * 2
        with flame.enable_grad():
            z = x * 2
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad

    @flame.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad
    assert flame.is_grad_enabled()


def test_grad_mode_is_thread_local():
    seen = {}

    def worker():
        seen["enabled"] = flame.is_grad_enabled()

    with flame.no_grad():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["enabled"] is True


def test_flame_grad_for_leaves_and_interior():
    x, xt = pair((3,), requires_grad=True)
    h = x.exp()
    y = (h * h).sum()
    gx, gh = flame.grad(y, [x, h])
    ht = xt.exp()
    ht.retain_grad()
    (ht * ht).sum().backward()
    assert_close(gx, xt.grad)
    assert_close(gh, ht.grad)
    unused = flame.ones(2, requires_grad=True)
    z = (x * 2).sum()
    with pytest.raises(RuntimeError, match="not used"):
        flame.grad(z, [unused])
    z2 = (x * 2).sum()
    assert flame.grad(z2, [x, unused], allow_unused=True)[1] is None


def test_hooks_replace_gradient_and_post_accumulate_hook():
    x = flame.tensor([1.0, 2.0], requires_grad=True)
    calls = []
    h = x.register_hook(lambda g: g * 10)
    x.register_post_accumulate_grad_hook(lambda t, g: calls.append((t.id, g.numpy().tolist())))
    mid = x * 3
    mid.register_hook(lambda g: g + 1)  # interior hook sees dL/dmid = 1, returns 2
    grads = mid.sum().backward()
    np.testing.assert_allclose(grads[x].numpy(), [60.0, 60.0])
    assert calls == [(x.id, [60.0, 60.0])]
    h.remove()
    grads = (x * 3).sum().backward()
    np.testing.assert_allclose(grads[x].numpy(), [3.0, 3.0])


def test_half_leaves_accumulate_in_fp32():
    x = flame.ones(4, dtype=flame.bfloat16, requires_grad=True)
    grads = (x * x).sum().backward()
    assert grads[x].dtype == flame.float32
    h = flame.ones(4, dtype=flame.float16, requires_grad=True)
    assert (h * 2).sum().backward()[h].dtype == flame.float32


def test_explicit_grad_and_errors():
    x = flame.ones(2, 3, requires_grad=True)
    y = x * 2
    with pytest.raises(RuntimeError, match="scalar outputs"):
        y.backward()
    with pytest.raises(RuntimeError, match="shape"):
        y.backward(flame.ones(3))
    grads = y.backward(flame.full((2, 3), 0.5))
    assert_close(grads[x], torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="does not require grad"):
        flame.ones(3).sum().backward()
    with pytest.raises(RuntimeError, match="floating-point"):
        flame.arange(3).requires_grad_()


def test_leaf_backward_and_detach():
    x = flame.ones(1, requires_grad=True)
    assert_close(x.backward()[x], torch.ones(1))
    d = (x * 2).detach()
    assert d.is_leaf and not d.requires_grad


def test_interior_gradients_are_freed():
    # the engine drops each node's incoming gradient once its backward has run
    x = flame.ones(8, requires_grad=True)
    y = x
    nodes = []
    for _ in range(5):
        y = y.exp()
        nodes.append(y.grad_fn)
    y.sum().backward()
    assert all(n.saved is None and n.released for n in nodes)


def test_branch_without_gradient_is_skipped():
    x = flame.ones(3, requires_grad=True)
    c = x > 0  # comparison: no gradient path
    y = flame.where(c, x * 2, x * 3).sum()
    grads = y.backward()
    assert_close(grads[x], torch.full((3,), 2.0))


def test_leaf_gradients_are_dense():
    # sum's backward is a stride-0 expand; the stored gradient must own its memory
    w = flame.ones(3, 4, requires_grad=True)
    grads = w.sum().backward()
    assert grads[w].is_contiguous() and grads[w].stride() == (4, 1)
    total = flame.GradientMap()
    total += grads
    total += w.sum().backward()
    assert_close(total[w], torch.full((3, 4), 2.0))


def test_leaf_gradients_keep_a_dense_leafs_layout():
    # as torch's .grad: a channels-last or transposed leaf gets its gradient in its own layout
    # (the optimizers update parameter, gradient and state as flat arrays), also after a
    # GradientMap accumulates it; a leaf with gaps (a strided view) gets a contiguous one
    cl = flame.from_torch(torch.randn(4, 3, 2, 5, device=DEVICE).contiguous(memory_format=torch.channels_last),
                          requires_grad=True)
    tr = flame.from_torch(torch.randn(5, 3, device=DEVICE).t(), requires_grad=True)
    gappy = flame.from_torch(torch.randn(3, 10, device=DEVICE)[:, ::2], requires_grad=True)
    # contiguous, with a stride of its own on its size-1 dim: its gradient is the usual contiguous one
    odd = flame.from_torch(torch.randn(3, device=DEVICE).as_strided((1, 3), (9, 1)), requires_grad=True)
    contiguous = {id(gappy): (5, 1), id(odd): (3, 1)}
    for leaf in (cl, tr, gappy, odd):
        want_stride = contiguous.get(id(leaf)) or leaf.to_torch().clone(memory_format=torch.preserve_format).stride()
        grads = (leaf * 2.0).sum().backward()
        assert grads[leaf].stride() == want_stride
        assert_close(grads[leaf], torch.full(tuple(leaf.shape), 2.0))
        total = flame.GradientMap()
        total += grads
        total += (leaf * 3.0).sum().backward()
        assert total[leaf].stride() == want_stride
        assert_close(total[leaf], torch.full(tuple(leaf.shape), 5.0))


def test_a_node_keeps_flat_plain_input_metadata():
    """``record``: one edge per input (its producing node, the leaf itself, or None without a gradient)
    and each input's (shape, dtype) in one flat tuple of plain tuples, dtypes and None (the collector
    stops tracking it); ``needs_input_grad`` follows the edges."""
    import gc

    import flame.nn.functional as F
    x = flame.randn(5, 3)
    w = flame.randn(4, 3, requires_grad=True)
    h = (x * 2.0).requires_grad_() * 1.0
    node = F.linear(h, w).grad_fn  # inputs: an interior tensor, a leaf, no bias
    e0, e1, e2 = node.edges
    assert e0 is h.grad_fn and e1 is w and e2 is None and node.needs_input_grad == (True, True, False)
    assert node.input_meta == ((5, 3), torch.float32, (4, 3), torch.float32, None, None)
    assert all(type(m) is tuple for m in node.input_meta[::2] if m is not None)
    gc.collect()
    gc.collect()  # the shapes' tuples are untracked in one pass, the tuple holding them in the next
    assert not gc.is_tracked(node.input_meta)
