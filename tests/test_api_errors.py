"""Mistakes a PyTorch user makes first get messages that say what to do instead (issue 32)."""
import numpy as np
import pytest
import torch

import flame
import flame.nn.functional as F
from helpers import DEVICE


def test_no_grad_attribute_points_to_the_gradient_map():
    w = flame.ones(3, requires_grad=True)
    grads = (w * w).sum().backward()
    hint = r"no \.grad.*grads = loss\.backward\(\); grads\[w\].*flame\.grad"
    with pytest.raises(AttributeError, match=hint):
        w.grad  # noqa: B018
    with pytest.raises(AttributeError, match=hint):
        w.grad = None
    assert not hasattr(w, "grad") and getattr(w, "grad", "absent") == "absent"
    np.testing.assert_allclose(grads[w].numpy(), [2.0, 2.0, 2.0])


_X = lambda: flame.ones(2, 3)
_W = lambda: flame.ones(4, 3)
_IMG = lambda: flame.ones(1, 2, 3, 3)
_CONV_W = lambda: flame.ones(2, 2, 1, 1)

# (name, call with a foreign array built by `arr(shape)`)
CALLS = [
    ("add", lambda arr: flame.add(_X(), arr((3,)))),
    ("add", lambda arr: flame.add(arr((3,)), _X())),
    ("add", lambda arr: _X() + arr((3,))),
    ("mul", lambda arr: _X() * arr((2, 3))),
    ("sub", lambda arr: flame.sub(arr((3,)), 1.0)),
    ("where", lambda arr: flame.where(_X() > 0, arr((3,)), 0.0)),
    ("matmul", lambda arr: _X() @ arr((3, 2))),
    ("matmul", lambda arr: flame.matmul(arr((2, 3)), _W().t())),
    ("linear", lambda arr: F.linear(arr((2, 3)), _W())),
    ("linear", lambda arr: F.linear(_X(), arr((4, 3)))),
    ("conv2d", lambda arr: F.conv2d(_IMG(), arr((2, 2, 1, 1)))),
    ("conv2d", lambda arr: F.conv2d(arr((1, 2, 3, 3)), _CONV_W())),
    ("sum", lambda arr: flame.sum(arr((3,)))),
    ("mean", lambda arr: flame.mean(arr((3,)), dim=0)),
    ("exp", lambda arr: flame.exp(arr((3,)))),
    ("scaled_dot_product_attention", lambda arr: F.scaled_dot_product_attention(arr((1, 2, 3)), _X()[None],
                                                                                _X()[None])),
    ("group_norm", lambda arr: F.group_norm(_IMG(), 1, arr((2,)))),
    ("layer_norm", lambda arr: F.layer_norm(_X(), (3,), arr((3,)))),
]
ARRAYS = {
    "torch": (lambda shape: torch.ones(shape, device=DEVICE),
              r"got torch\.Tensor: .*flame\.from_torch\(t\).*flame\.tensor\(t\)"),
    "numpy": (lambda shape: np.ones(shape, dtype=np.float32), r"got numpy\.ndarray: .*flame\.tensor\(a\)"),
}


@pytest.mark.parametrize("kind", list(ARRAYS))
@pytest.mark.parametrize("op, call", CALLS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(CALLS)])
def test_foreign_arrays_are_named_with_the_conversion(op, call, kind):
    arr, match = ARRAYS[kind]
    with pytest.raises(TypeError, match=rf"^{op}: [\w ]+ must be a flame Tensor.*{match}"):
        call(arr)


def test_reflected_operators_with_foreign_arrays():
    # numpy and torch defer to flame's reflected operators, which name the foreign array too
    x = _X()
    for left in (np.ones(3, dtype=np.float32), torch.ones(3, device=DEVICE)):
        with pytest.raises(TypeError, match=r"add: .*got (numpy\.ndarray|torch\.Tensor)"):
            left + x
    with pytest.raises(TypeError, match=r"matmul: .*got numpy\.ndarray"):
        np.ones((2, 2), dtype=np.float32) @ x
