"""Functional ops with PyTorch's names and argument order (``import flame.nn.functional as F``)."""
from ..ops.elementwise import gelu, relu, sigmoid, silu, tanh  # noqa: F401
from ..ops.index import embedding, gather, index_select  # noqa: F401
from ..ops.matmul import matmul  # noqa: F401
from ..ops.shape import pad  # noqa: F401
