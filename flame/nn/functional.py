"""Functional ops with PyTorch's names and argument order (``import flame.nn.functional as F``)."""
from ..ops.attention import scaled_dot_product_attention  # noqa: F401
from ..ops.conv2d import conv1d, conv2d  # noqa: F401
from ..ops.dropout import dropout  # noqa: F401
from ..ops.elementwise import geglu, gelu, relu, sigmoid, silu, tanh  # noqa: F401
from ..ops.index import embedding, gather, index_select  # noqa: F401
from ..ops.loss import huber_loss, l1_loss, mse_loss, smooth_l1_loss  # noqa: F401
from ..ops.matmul import linear, lora_linear, matmul  # noqa: F401
from ..ops.norms import group_norm, layer_norm, layer_norm_modulated, rms_norm  # noqa: F401
from ..ops.pool import avg_pool2d, interpolate, max_pool2d  # noqa: F401
from ..ops.rope import qk_norm_rope  # noqa: F401
from ..ops.shape import pad  # noqa: F401
from ..ops.softmax import cross_entropy, log_softmax, softmax  # noqa: F401
