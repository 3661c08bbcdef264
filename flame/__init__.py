"""flame: diffusion-model fine-tuning on hand-written Triton kernels.

``import flame`` chooses the backend (CUDA, or Triton's interpreter on the CPU) before Triton is
imported; see ``flame.runtime``.
"""
from . import runtime  # noqa: I001 - must come first: selects the Triton interpreter on CPU
from .runtime import (check_errors, device, device_name, get_default_dtype, is_interpreter, max_memory_allocated,
                      memory_allocated, reset_peak_memory_stats, set_default_dtype, synchronize)
from .tensor import (Tensor, bfloat16, bool_, broadcast_shapes, float16, float32, float64, int32, int64,
                     promote_types, result_type, _bind_methods)
from .autograd import GradientMap, enable_grad, grad, is_grad_enabled, no_grad, set_grad_enabled
from .ops.creation import (arange, empty, empty_like, from_torch, full, full_like, get_rng_state, manual_seed,
                           normal, ones, ones_like, rand, rand_like, randn, randn_like, set_rng_state, tensor,
                           uniform, zeros, zeros_like)
from .ops.elementwise import (abs, add, addcmul, clamp, cos, div, eq, exp, ge, gelu, gt, le, log, lt, maximum,
                              minimum, mul, ne, neg, pow, relu, rsqrt, sigmoid, silu, sin, sqrt, sub, tanh, to, where)
from .ops.reduce import amax, amin, max, mean, min, sum, sum_to_shape, var
from .ops.shape import (broadcast_to, cat, chunk, clone, contiguous, expand, flatten, narrow, pad, permute,
                        reshape, split, squeeze, stack, t, transpose, unsqueeze, view)
from .ops.index import embedding, gather, index_select
from .ops.matmul import bmm, matmul
from . import checkpoint, nn, testing

_bind_methods()
del _bind_methods

half = float16
float = float32  # noqa: A001 - mirrors torch.float
double = float64
long = int64
int = int32  # noqa: A001 - mirrors torch.int
bool = bool_  # noqa: A001 - mirrors torch.bool

__version__ = "0.1.0"
