import numpy as np
import pytest
import torch

import flame
from helpers import DEVICE, assert_close


def test_tensor_from_data_infers_dtypes():
    assert flame.tensor([1.0, 2.0]).dtype == flame.float32
    assert flame.tensor([1, 2]).dtype == flame.int64
    assert flame.tensor([True, False]).dtype == flame.bool
    assert flame.tensor(np.arange(3, dtype=np.int32)).dtype == flame.int32
    assert flame.tensor(np.ones(2)).dtype == flame.float64  # NumPy arrays keep their dtype
    assert flame.tensor([1, 2], dtype=flame.float16).dtype == flame.float16
    assert flame.tensor(3.5).shape == ()
    x = flame.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    assert x.requires_grad and x.is_leaf and x.shape == (2, 2) and x.ndim == 2 and x.numel() == 4
    with pytest.raises(TypeError):
        flame.tensor([[1, 2], [3]])
    with pytest.raises(TypeError):
        flame.tensor(["a"])


def test_zero_copy_interop():
    t = torch.arange(6, dtype=torch.float32, device=DEVICE).reshape(2, 3)
    x = flame.from_torch(t)
    assert x.data_ptr() == t.data_ptr()
    assert x.to_torch() is not None and x.to_torch().data_ptr() == t.data_ptr()
    y = x * 2
    assert_close(y, t * 2)
    with pytest.raises(TypeError):
        flame.from_torch(np.ones(2))
    with pytest.raises(TypeError):
        flame.from_torch(torch.ones(2, dtype=torch.uint8, device=DEVICE))


def test_item_numpy_tolist_repr():
    x = flame.tensor([[1.5, -2.0]])
    assert x[0, 1].item() == -2.0
    np.testing.assert_array_equal(x.numpy(), [[1.5, -2.0]])
    assert x.tolist() == [[1.5, -2.0]]
    assert "1.5" in repr(x) and repr(x).startswith("tensor(")
    assert "bfloat16" in repr(x.to(flame.bfloat16))
    assert "grad_fn" in repr(flame.ones(1, requires_grad=True) * 2)
    with pytest.raises(RuntimeError):
        x.item()
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(x)
    assert float(flame.tensor(2.5)) == 2.5 and int(flame.tensor(3)) == 3


@pytest.mark.parametrize("fn,value", [(flame.zeros, 0.0), (flame.ones, 1.0)])
def test_filled_factories(fn, value):
    x = fn(2, 3)
    assert x.shape == (2, 3) and x.dtype == flame.float32
    np.testing.assert_array_equal(x.numpy(), np.full((2, 3), value))
    assert fn((4,), dtype=flame.int32).dtype == flame.int32
    assert_close(flame.full((2,), 7), torch.full((2,), 7))
    assert flame.full((2,), 7).dtype == flame.int64
    like = flame.zeros_like(flame.ones(3, dtype=flame.float16))
    assert like.dtype == flame.float16 and like.shape == (3,)
    assert flame.ones_like(x).numpy().sum() == 6
    assert flame.full_like(x, 2.0).numpy().sum() == 12
    assert flame.empty_like(x).shape == (2, 3)


def test_arange():
    assert_close(flame.arange(5), torch.arange(5))
    assert_close(flame.arange(1, 7, 2), torch.arange(1, 7, 2))
    assert_close(flame.arange(0, 1, 0.25), torch.arange(0, 1, 0.25))
    assert flame.arange(0).shape == (0,)
    with pytest.raises(ValueError):
        flame.arange(0, 5, 0)


def test_random_is_seeded_and_distributed():
    flame.manual_seed(123)
    a = flame.randn(4096)
    flame.manual_seed(123)
    b = flame.randn(4096)
    c = flame.randn(4096)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not np.array_equal(b.numpy(), c.numpy())
    assert abs(a.numpy().mean()) < 0.1 and abs(a.numpy().std() - 1) < 0.1
    u = flame.rand(4096).numpy()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.05
    assert flame.randn(3, dtype=flame.float16).dtype == flame.float16
    assert flame.randn_like(flame.ones(2, 2)).shape == (2, 2)
    state = flame.get_rng_state()
    d = flame.rand(8)
    flame.set_rng_state(state)
    np.testing.assert_array_equal(flame.rand(8).numpy(), d.numpy())
    with pytest.raises(TypeError):
        flame.randn(3, dtype=flame.int64)


def test_operators_and_methods():
    a = flame.tensor([[1.0, 2.0], [3.0, 4.0]])
    at = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert_close(-a + a * 2 - a / 2 + a ** 2, -at + at * 2 - at / 2 + at ** 2)
    assert_close(abs(-a), at)
    assert_close(a == 2.0, at == 2.0)
    assert_close(a.float(), at)
    assert a.half().dtype == flame.float16 and a.bfloat16().dtype == flame.bfloat16
    assert a.long().dtype == flame.int64 and a.double().dtype == flame.float64
    assert a.to("cpu" if DEVICE.type == "cpu" else "cuda") is a
    with pytest.raises(RuntimeError, match="flame runs on"):
        a.to("meta")


def test_default_dtype_and_unsupported():
    assert flame.get_default_dtype() == flame.float32
    with pytest.raises(TypeError):
        flame.set_default_dtype(flame.int32)
    with pytest.raises(TypeError):
        flame.zeros(2, dtype=torch.complex64)
    with pytest.raises(ValueError):
        flame.zeros(-1)


def test_memory_stats_and_synchronize():
    flame.synchronize()
    flame.reset_peak_memory_stats()
    x = flame.empty(1 << 20)
    if not flame.is_interpreter():
        assert flame.max_memory_allocated() >= x.numel() * 4
        assert flame.memory_allocated() >= x.numel() * 4
    else:
        assert flame.memory_allocated() == 0
