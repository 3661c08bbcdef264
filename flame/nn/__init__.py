"""Neural-network building blocks; ``flame.nn.functional`` holds the functional ops."""
from . import functional, init
from .layers import GELU, Dropout, GroupNorm, Identity, LayerNorm, Linear, ModuleList, RMSNorm, Sequential, SiLU
from .module import Module, Parameter
