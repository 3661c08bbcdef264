"""Neural-network building blocks; ``flame.nn.functional`` holds the functional ops."""
from . import functional, init
from .layers import (
    GELU,
    Conv2d,
    Dropout,
    GroupNorm,
    Identity,
    LayerNorm,
    Linear,
    ModuleList,
    RMSNorm,
    Sequential,
    SiLU,
    linears,
    pack_linears,
)
from .logic import Bits, GroupSum, LogicLayer, set_hard
from .lora import (
    LoRAConv2d,
    LoRALinear,
    fold_lora,
    inject_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
)
from .module import Module, Parameter
from .quant import Fp8Parameter, quantize_linears_, use_w8a8_
