"""The SDXL UNet as diffusers 0.42 builds it (``UNet2DConditionModel`` with the SDXL base config),
on flame's modules and ops.

Parameter names and shapes are diffusers' (``state_dict`` keys match 1:1), so a diffusers ``unet/``
folder loads by name; original LDM/SGM checkpoints load through the map in ``flame.models.sdxl_keys``.

Layout: activations are logical (B, C, H, W) with channels-last strides end to end. Convolutions
and GroupNorm read and write that layout; the transformers use its (B, H*W, C) view (no copy);
residual adds, the time-embedding add and the skip concatenation run on the (B, H, W, C) permuted
view, so their outputs stay channels-last too. Fusions: GroupNorm+SiLU in one kernel, bias+SiLU in
the time-embedding GEMM, GEGLU as one map; SiLU of the time embedding is computed once per forward
for all resnets (diffusers recomputes it in each).

The architecture is described once: every block builds its leaf layers through a ``_Layers``
factory, which makes flame layers for a model or shape-only records for ``SDXLUNet.parameter_shapes``
(the full SDXL config listed without allocating its 2.57 B parameters).
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from .. import nn, runtime
from ..autograd import is_grad_enabled
from ..checkpoint import checkpoint
from ..nn import functional as F
from ..ops.creation import arange, full
from ..ops.elementwise import cos, exp, sin, to
from ..ops.shape import cat
from ..tensor import Tensor, check_dtype, float32
from .checkpoints import load_pretrained, sort_config
from .sdxl_keys import checkpoint_index, diffusers_to_ldm

_DOWN_TYPES = ("DownBlock2D", "CrossAttnDownBlock2D")
_UP_TYPES = ("UpBlock2D", "CrossAttnUpBlock2D")

# diffusers config keys whose value must be what SDXL uses (anything else is another architecture).
_FIXED = {
    "act_fn": ("silu",), "addition_embed_type": ("text_time",), "attention_type": ("default",),
    "center_input_sample": (False,), "class_embed_type": (None,), "class_embeddings_concat": (False,),
    "conv_in_kernel": (3,), "conv_out_kernel": (3,), "cross_attention_norm": (None,), "downsample_padding": (1,),
    "dropout": (0.0,), "dual_cross_attention": (False,), "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,), "mid_block_only_cross_attention": (None, False),
    "mid_block_type": ("UNetMidBlock2DCrossAttn",), "num_attention_heads": (None,), "num_class_embeds": (None,),
    "only_cross_attention": (False,), "resnet_skip_time_act": (False,), "resnet_time_scale_shift": ("default",),
    "reverse_transformer_layers_per_block": (None,), "time_cond_proj_dim": (None,),
    "time_embedding_act_fn": (None,), "time_embedding_dim": (None,), "time_embedding_type": ("positional",),
    "timestep_post_act": (None,), "use_linear_projection": (True,),
}
# keys that change nothing here: addition_embed_type_num_heads only matters for other embed types, and
# upcast_attention only for diffusers' non-SDPA attention path (flame's kernels keep softmax in fp32).
_IGNORED = ("addition_embed_type_num_heads", "upcast_attention")


def _per_block(value, n, name):
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    if len(values) != n:
        raise ValueError(f"SDXLUNetConfig: {name} has {len(values)} entries, expected one per block ({n})")
    return values


@dataclasses.dataclass(frozen=True)
class SDXLUNetConfig:
    """The UNet's architecture, with diffusers' config names; the defaults are stable-diffusion-xl-base-1.0.

    ``attention_head_dim`` keeps diffusers' legacy meaning: the **number of heads** per block (head
    size = channels / heads, 64 in SDXL). ``projection_class_embeddings_input_dim`` = pooled text
    embedding width + 6 x ``addition_time_embed_dim`` (the six size/crop ids).

    ``SDXLUNetConfig.tiny()`` is the test/CPU-demo config: the same block structure (DownBlock2D, two
    CrossAttnDownBlock2D, the cross-attention mid block, two CrossAttnUpBlock2D, UpBlock2D; two resnets
    per down block, three per up block, so the LDM name map is SDXL's) with small widths:

    - block_out_channels (32, 48, 64): three different widths, so a wrong skip or channel wiring is a
      shape error rather than a silent bug; up-block resnet inputs 128, 128, 112 / 112, 96, 80 / 80, 64, 64;
    - norm_num_groups 8 (4 to 16 channels per group, as SDXL's 10 to 80 keeps statistics over
      several channels; 32 groups would leave one channel per group at width 32);
    - attention_head_dim (1, 2, 4) heads: head sizes 24 (not a power of two: exercises the attention
      kernel's masks) and 16; transformer depth 1 everywhere (11 transformer blocks, SDXL 70): the
      forward is depth-agnostic and SDXL's per-level depths (1, 2, 10) are checked through the
      full config's names, so the tiny one saves the launches (a CPU test or demo step is bound
      by the interpreter's per-launch cost);
    - cross_attention_dim 32, pooled text embedding 16, addition_time_embed_dim 8 (input 16 + 6 x 8 = 64);
      time embedding 4 x 32 = 128 wide;
    - sample_size 16 (latent 16x16 -> 8x8 -> 4x4).
    About 2.1 M parameters (500 tensors). Through Triton's interpreter a forward is about 550 kernel
    launches and costs 5 to 10 s whatever the latent size (per-launch cost dominates); tests use 8x8
    latents.
    """

    sample_size: int = 128
    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
    up_block_types: tuple = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")
    block_out_channels: tuple = (320, 640, 1280)
    layers_per_block: int = 2
    transformer_layers_per_block: tuple = (1, 2, 10)
    attention_head_dim: tuple = (5, 10, 20)
    cross_attention_dim: int = 2048
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    addition_time_embed_dim: int = 256
    projection_class_embeddings_input_dim: int = 2816
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    mid_block_scale_factor: float = 1.0
    resnet_out_scale_factor: float = 1.0

    def __post_init__(self):
        n = len(self.block_out_channels)
        fix = {"down_block_types": tuple(self.down_block_types), "up_block_types": tuple(self.up_block_types),
               "block_out_channels": tuple(int(c) for c in self.block_out_channels),
               "transformer_layers_per_block": _per_block(self.transformer_layers_per_block, n,
                                                          "transformer_layers_per_block"),
               "attention_head_dim": _per_block(self.attention_head_dim, n, "attention_head_dim")}
        for k, v in fix.items():
            object.__setattr__(self, k, v)
        if n == 0 or len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError(f"SDXLUNetConfig: down_block_types {self.down_block_types}, up_block_types "
                             f"{self.up_block_types} and block_out_channels {self.block_out_channels} "
                             "must have the same non-zero length")
        bad = [t for t in self.down_block_types if t not in _DOWN_TYPES] + \
              [t for t in self.up_block_types if t not in _UP_TYPES]
        if bad:
            raise ValueError(f"SDXLUNetConfig: unsupported block type(s) {bad}; down blocks are one of "
                             f"{_DOWN_TYPES}, up blocks one of {_UP_TYPES}")
        if isinstance(self.layers_per_block, (tuple, list)) or self.layers_per_block < 1:
            raise ValueError(f"SDXLUNetConfig: layers_per_block must be a positive int (the same for every "
                             f"block), got {self.layers_per_block!r}")
        g = self.norm_num_groups
        widths = set(self.block_out_channels)
        for level, (c, heads) in enumerate(zip(self.block_out_channels, self.attention_head_dim)):
            if c % heads:
                raise ValueError(f"SDXLUNetConfig: block {level} has {c} channels, not divisible by "
                                 f"{heads} attention heads")
        for cin, _ in self.up_resnet_channels():
            widths.add(cin)
        if any(w % g for w in widths):
            raise ValueError(f"SDXLUNetConfig: norm_num_groups={g} must divide every GroupNorm width, got "
                             f"{sorted(widths)}")
        if self.pooled_dim <= 0:
            raise ValueError(f"SDXLUNetConfig: projection_class_embeddings_input_dim "
                             f"({self.projection_class_embeddings_input_dim}) must exceed 6 x addition_time_embed_dim "
                             f"({6 * self.addition_time_embed_dim})")

    @classmethod
    def tiny(cls) -> SDXLUNetConfig:
        """The small SDXL-shaped config documented in the class docstring."""
        return cls(sample_size=16, block_out_channels=(32, 48, 64), transformer_layers_per_block=(1, 1, 1),
                   attention_head_dim=(1, 2, 4), cross_attention_dim=32, norm_num_groups=8,
                   addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8)

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def pooled_dim(self) -> int:
        """Width of the pooled text embedding (1280 for SDXL's CLIP-G)."""
        return self.projection_class_embeddings_input_dim - 6 * self.addition_time_embed_dim

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]

    def up_resnet_channels(self):
        """(input, output) channels of every up-block resnet, in module order (skip concat included)."""
        out = []
        rev = self.block_out_channels[::-1]
        prev = rev[0]
        for i, c in enumerate(rev):
            skip_last = rev[min(i + 1, len(rev) - 1)]
            for j in range(self.layers_per_block + 1):
                cin = (prev if j == 0 else c) + (skip_last if j == self.layers_per_block else c)
                out.append((cin, c))
            prev = c
        return out

    # ---- diffusers interop -------------------------------------------------------------------
    def to_diffusers(self) -> dict:
        """kwargs for ``diffusers.UNet2DConditionModel(**...)`` building the same model."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("down_block_types", "up_block_types", "block_out_channels", "transformer_layers_per_block",
                  "attention_head_dim"):
            d[k] = list(d[k])
        d.update(act_fn="silu", addition_embed_type="text_time", mid_block_type="UNetMidBlock2DCrossAttn",
                 use_linear_projection=True, downsample_padding=1)
        return d

    @classmethod
    def from_diffusers(cls, config: dict) -> SDXLUNetConfig:
        """From a diffusers ``unet/config.json`` dict; raises ValueError for settings this model
        does not implement (another addition embedding, conv projections, class embeddings, ...)."""
        kwargs, problems = sort_config(cls, config, _FIXED, ignored=_IGNORED)
        for k in ("layers_per_block", "cross_attention_dim"):  # diffusers allows one per block
            v = kwargs.get(k)
            if isinstance(v, (tuple, list)):
                if len(set(v)) != 1:
                    problems.append(f"{k}={v!r} (must be the same for every block)")
                else:
                    kwargs[k] = v[0]
        if problems:
            raise ValueError("SDXLUNetConfig.from_diffusers: unsupported UNet config: " + "; ".join(problems))
        return cls(**kwargs)


# ---- leaf layers ----------------------------------------------------------------------------------

class _Shapes(nn.Module):
    """Stand-in for a leaf layer in a shape-only skeleton: its kind and parameter shapes, no memory."""

    def __init__(self, kind, **shapes):
        super().__init__()
        self.kind = kind
        self.shapes = OrderedDict((k, v) for k, v in shapes.items() if v is not None)


class _Layers:
    """Makes the leaf layers for the blocks: flame layers in ``dtype``, or with ``shapes_only``
    ``_Shapes`` records of the same parameter names and shapes (nothing allocated)."""

    def __init__(self, dtype=None, shapes_only=False):
        self.dtype, self.shapes_only = dtype, shapes_only

    def linear(self, fan_in, fan_out, bias=True):
        if self.shapes_only:
            return _Shapes("Linear", weight=(fan_out, fan_in), bias=(fan_out,) if bias else None)
        return nn.Linear(fan_in, fan_out, bias=bias, dtype=self.dtype)

    def conv(self, cin, cout, k, stride=1, padding=0):
        if self.shapes_only:
            return _Shapes("Conv2d", weight=(cout, cin, k, k), bias=(cout,))
        return nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dtype=self.dtype)

    def group_norm(self, groups, c, eps):
        if self.shapes_only:
            return _Shapes("GroupNorm", weight=(c,), bias=(c,))
        return nn.GroupNorm(groups, c, eps=eps, dtype=self.dtype)

    def layer_norm(self, c, eps=1e-5):
        if self.shapes_only:
            return _Shapes("LayerNorm", weight=(c,), bias=(c,))
        return nn.LayerNorm(c, eps=eps, dtype=self.dtype)


# ---- channels-last helpers --------------------------------------------------------------------------

def _nhwc(x):
    """(B, C, H, W) channels-last -> its (B, H, W, C) view (contiguous: no copy). Adds and concats
    run on these views: elementwise ops write their output in logical order, so computing on the
    NHWC view and permuting back keeps the result channels-last."""
    return x.permute(0, 2, 3, 1)


def _nchw(x):
    return x.permute(0, 3, 1, 2)


def _norm_silu(norm, x):
    return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation="silu")


def _linear_silu(layer, x):
    """silu(layer(x)), with bias and SiLU fused into the GEMM when ``layer`` is a plain Linear
    (a LoRA-wrapped one runs its own forward first)."""
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias, activation="silu")
    return F.silu(layer(x))


# ---- blocks ---------------------------------------------------------------------------------------

CHECKPOINT_SCOPES = ("blocks", "feed_forward")


class _Checkpointed(nn.Module):
    """A module whose forward can run under activation checkpointing (``flame.checkpoint``);
    ``scope``: which ``enable_gradient_checkpointing`` scope switches it."""

    gradient_checkpointing = False
    scope = "blocks"

    def __call__(self, *args):
        if self.gradient_checkpointing and is_grad_enabled():
            return checkpoint(self.forward, *args)
        return self.forward(*args)


class TimestepEmbedding(nn.Module):
    def __init__(self, L, fan_in, dim):
        super().__init__()
        self.linear_1 = L.linear(fan_in, dim)
        self.linear_2 = L.linear(dim, dim)

    def forward(self, x):
        return self.linear_2(_linear_silu(self.linear_1, x))


class ResnetBlock2D(_Checkpointed):
    """GroupNorm+SiLU -> conv3x3 -> + time embedding -> GroupNorm+SiLU -> conv3x3, plus the (1x1-conv
    when the width changes) shortcut, divided by ``output_scale_factor``."""

    def __init__(self, L, cin, cout, temb, groups, eps, output_scale_factor=1.0):
        super().__init__()
        self.norm1 = L.group_norm(groups, cin, eps)
        self.conv1 = L.conv(cin, cout, 3, padding=1)
        self.time_emb_proj = L.linear(temb, cout)
        self.norm2 = L.group_norm(groups, cout, eps)
        self.conv2 = L.conv(cout, cout, 3, padding=1)
        self.conv_shortcut = L.conv(cin, cout, 1) if cin != cout else None
        self.output_scale_factor = float(output_scale_factor)

    def forward(self, x, temb_act):
        """``x`` (B, C, H, W) channels-last; ``temb_act`` = silu(time embedding), (B, T)."""
        h = self.conv1(_norm_silu(self.norm1, x))
        t = self.time_emb_proj(temb_act)
        h = _nchw(_nhwc(h) + t.reshape(t.shape[0], 1, 1, t.shape[1]))
        h = self.conv2(_norm_silu(self.norm2, h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        out = _nhwc(x) + _nhwc(h)
        if self.output_scale_factor != 1.0:
            out = out / self.output_scale_factor
        return _nchw(out)


class Attention(nn.Module):
    """Multi-head attention: to_q/to_k/to_v without bias, to_out.0 with bias (to_out.1 is
    diffusers' dropout, p = 0). ``context`` None means self-attention."""

    def __init__(self, L, dim, heads, context_dim=None):
        super().__init__()
        self.heads = heads
        self.to_q = L.linear(dim, dim, bias=False)
        self.to_k = L.linear(context_dim or dim, dim, bias=False)
        self.to_v = L.linear(context_dim or dim, dim, bias=False)
        self.to_out = nn.ModuleList([L.linear(dim, dim), nn.Dropout(0.0)])

    def _split(self, x):
        """(B, L, H*D) -> (B, H, L, D) view (the attention kernels take any B/H/L strides)."""
        return x.reshape(x.shape[0], x.shape[1], self.heads, x.shape[2] // self.heads).transpose(1, 2)

    def forward(self, x, context=None):
        src = x if context is None else context
        q, k, v = self._split(self.to_q(x)), self._split(self.to_k(src)), self._split(self.to_v(src))
        o = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head size), as diffusers
        o = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # output laid out like q: a view
        return self.to_out[0](o)


class GEGLU(_Checkpointed):
    """The feed-forward's projection and gate. Checkpointed (scope ``feed_forward``), it keeps its
    (B, L, dim) input instead of the (B, L, 8 dim) projection GEGLU's backward needs, and recomputes
    the projection in the backward: an eighth of the largest activation of the step, for one GEMM."""

    scope = "feed_forward"

    def __init__(self, L, dim, inner):
        super().__init__()
        self.proj = L.linear(dim, 2 * inner)

    def forward(self, x):
        return F.geglu(self.proj(x))  # hidden * gelu(gate), exact GELU


class FeedForward(nn.Module):
    def __init__(self, L, dim, mult=4):
        super().__init__()
        self.net = nn.ModuleList([GEGLU(L, dim, mult * dim), nn.Dropout(0.0), L.linear(mult * dim, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(_Checkpointed):
    """Pre-LayerNorm self-attention, cross-attention and GEGLU feed-forward, each residual."""

    def __init__(self, L, dim, heads, context_dim):
        super().__init__()
        self.norm1 = L.layer_norm(dim)
        self.attn1 = Attention(L, dim, heads)
        self.norm2 = L.layer_norm(dim)
        self.attn2 = Attention(L, dim, heads, context_dim)
        self.norm3 = L.layer_norm(dim)
        self.ff = FeedForward(L, dim)

    def forward(self, h, context):
        h = self.attn1(self.norm1(h)) + h
        h = self.attn2(self.norm2(h), context) + h
        return self.ff(self.norm3(h)) + h


class Transformer2DModel(nn.Module):
    """GroupNorm (eps 1e-6) -> linear proj_in on the (B, H*W, C) view -> transformer blocks ->
    proj_out -> + input."""

    def __init__(self, L, dim, heads, depth, context_dim, groups):
        super().__init__()
        self.norm = L.group_norm(groups, dim, 1e-6)
        self.proj_in = L.linear(dim, dim)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(L, dim, heads, context_dim)
                                                 for _ in range(depth)])
        self.proj_out = L.linear(dim, dim)

    def forward(self, x, context):
        B, C, H, W = x.shape
        n = self.norm
        h = F.group_norm(x, n.num_groups, n.weight, n.bias, n.eps)
        h = self.proj_in(_nhwc(h).reshape(B, H * W, C))
        for block in self.transformer_blocks:
            h = block(h, context)
        h = self.proj_out(h)
        return _nchw(h.reshape(B, H, W, C) + _nhwc(x))


class Downsample2D(nn.Module):
    def __init__(self, L, c):
        super().__init__()
        self.conv = L.conv(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour x2, then a 3x3 convolution (the UNet's and the VAE decoder's)."""

    def __init__(self, L, c):
        super().__init__()
        self.conv = L.conv(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class _Block(nn.Module):
    """A down or up block: resnets, optional transformers after each resnet, optional resampler."""

    def _transformers(self, L, cfg, level, count, depth, width):
        heads = cfg.attention_head_dim[level]
        self.attentions = nn.ModuleList([Transformer2DModel(L, width, heads, depth, cfg.cross_attention_dim,
                                                            cfg.norm_num_groups) for _ in range(count)])

    def _layer(self, i, h, temb_act, context):
        h = self.resnets[i](h, temb_act)
        if self.attentions is not None:
            h = self.attentions[i](h, context)
        return h


class DownBlock(_Block):
    """DownBlock2D / CrossAttnDownBlock2D: each output (and the downsampled one) is a skip."""

    def __init__(self, L, cfg, level, cin):
        super().__init__()
        c, n = cfg.block_out_channels[level], cfg.layers_per_block
        self.resnets = nn.ModuleList([ResnetBlock2D(L, cin if j == 0 else c, c, cfg.time_embed_dim,
                                                    cfg.norm_num_groups, cfg.norm_eps, cfg.resnet_out_scale_factor)
                                      for j in range(n)])
        self.attentions = None
        if cfg.down_block_types[level] == "CrossAttnDownBlock2D":
            self._transformers(L, cfg, level, n, cfg.transformer_layers_per_block[level], c)
        last = level == len(cfg.block_out_channels) - 1
        self.downsamplers = None if last else nn.ModuleList([Downsample2D(L, c)])

    def forward(self, h, temb_act, context, skips):
        for i in range(len(self.resnets)):
            h = self._layer(i, h, temb_act, context)
            skips.append(h)
        if self.downsamplers is not None:
            h = self.downsamplers[0](h)
            skips.append(h)
        return h


class UpBlock(_Block):
    """UpBlock2D / CrossAttnUpBlock2D: each resnet takes the running tensor concatenated with the
    latest skip along channels."""

    def __init__(self, L, cfg, level, channels):
        super().__init__()
        rev = len(cfg.block_out_channels) - 1 - level
        c = cfg.block_out_channels[rev]
        self.resnets = nn.ModuleList([ResnetBlock2D(L, cin, cout, cfg.time_embed_dim, cfg.norm_num_groups,
                                                    cfg.norm_eps, cfg.resnet_out_scale_factor)
                                      for cin, cout in channels])
        self.attentions = None
        if cfg.up_block_types[level] == "CrossAttnUpBlock2D":
            # diffusers takes heads and depth from the reversed per-block lists
            self._transformers(L, cfg, rev, len(channels), cfg.transformer_layers_per_block[rev], c)
        self.upsamplers = None if rev == 0 else nn.ModuleList([Upsample2D(L, c)])

    def forward(self, h, temb_act, context, skips):
        for i in range(len(self.resnets)):
            h = _nchw(cat([_nhwc(h), _nhwc(skips.pop())], -1))  # channel concat, channels-last
            h = self._layer(i, h, temb_act, context)
        if self.upsamplers is not None:
            h = self.upsamplers[0](h)
        return h


class UNetMidBlock2DCrossAttn(nn.Module):
    def __init__(self, L, cfg):
        super().__init__()
        c = cfg.block_out_channels[-1]
        self.attentions = nn.ModuleList([Transformer2DModel(L, c, cfg.attention_head_dim[-1],
                                                            cfg.transformer_layers_per_block[-1],
                                                            cfg.cross_attention_dim, cfg.norm_num_groups)])
        self.resnets = nn.ModuleList([ResnetBlock2D(L, c, c, cfg.time_embed_dim, cfg.norm_num_groups, cfg.norm_eps,
                                                    cfg.mid_block_scale_factor) for _ in range(2)])

    def forward(self, h, temb_act, context):
        h = self.resnets[0](h, temb_act)
        h = self.attentions[0](h, context)
        return self.resnets[1](h, temb_act)


# ---- the model ------------------------------------------------------------------------------------

class SDXLUNet(nn.Module):
    """SDXL's denoising UNet with diffusers' parameter names.

    ``SDXLUNet(config=None, dtype=None)``: random init (PyTorch/diffusers default initialisers) in
    ``dtype`` (flame's default dtype when None); ``config`` defaults to SDXL base.
    ``model(sample, timestep, encoder_hidden_states, text_embeds, time_ids)`` -> (B, out_channels, h, w).
    """

    def __init__(self, config: SDXLUNetConfig | None = None, dtype=None, *, _layers: _Layers | None = None):
        super().__init__()
        cfg = config if config is not None else SDXLUNetConfig()
        if not isinstance(cfg, SDXLUNetConfig):
            raise TypeError(f"SDXLUNet: config must be an SDXLUNetConfig, got {type(cfg).__name__}")
        self.config = cfg
        L = _layers or _Layers(check_dtype(dtype or runtime.get_default_dtype()))
        c0 = cfg.block_out_channels[0]
        self.conv_in = L.conv(cfg.in_channels, c0, 3, padding=1)
        self.time_embedding = TimestepEmbedding(L, c0, cfg.time_embed_dim)
        self.add_embedding = TimestepEmbedding(L, cfg.projection_class_embeddings_input_dim, cfg.time_embed_dim)
        downs, cin = [], c0
        for level in range(len(cfg.block_out_channels)):
            downs.append(DownBlock(L, cfg, level, cin))
            cin = cfg.block_out_channels[level]
        self.down_blocks = nn.ModuleList(downs)
        self.mid_block = UNetMidBlock2DCrossAttn(L, cfg)
        per_level = cfg.layers_per_block + 1
        ch = cfg.up_resnet_channels()
        self.up_blocks = nn.ModuleList([UpBlock(L, cfg, i, ch[i * per_level:(i + 1) * per_level])
                                        for i in range(len(cfg.block_out_channels))])
        self.conv_norm_out = L.group_norm(cfg.norm_num_groups, c0, cfg.norm_eps)
        self.conv_out = L.conv(c0, cfg.out_channels, 3, padding=1)
        self._freqs = {}  # sinusoid frequency tables by half-width, made on first use

    # ---- structure without memory ----------------------------------------------------------------
    @classmethod
    def skeleton(cls, config: SDXLUNetConfig | None = None) -> SDXLUNet:
        """The module tree of ``config`` with shape records (``kind``, ``shapes``) as leaves:
        same module names as the model, nothing allocated; not runnable."""
        return cls(config, _layers=_Layers(shapes_only=True))

    @classmethod
    def parameter_shapes(cls, config: SDXLUNetConfig | None = None) -> OrderedDict:
        """{state-dict name: shape} of ``config``'s model in ``state_dict`` order, without allocating."""
        out = OrderedDict()
        for name, m in cls.skeleton(config).named_modules():
            if isinstance(m, _Shapes):
                for p, shape in m.shapes.items():
                    out[f"{name}.{p}"] = shape
        return out

    def original_name(self, path: str) -> str:
        """The module at ``path`` (a diffusers name) under its name in the original LDM/SGM layout,
        as kohya's sd-scripts and ComfyUI name LoRA layers: ``down_blocks.1.attentions.0.proj_in`` ->
        ``input_blocks.4.1.proj_in``, ``down_blocks.0.resnets.0.conv1`` -> ``input_blocks.1.0.in_layers.2``."""
        return diffusers_to_ldm(path + ".weight", self.config)[: -len(".weight")]

    @classmethod
    def layer_names(cls, config: SDXLUNetConfig | None = None, kind: str = "Linear") -> list:
        """Names of the ``kind`` ("Linear", "Conv2d", "GroupNorm", "LayerNorm") layers, without allocating."""
        return [n for n, m in cls.skeleton(config).named_modules() if isinstance(m, _Shapes) and m.kind == kind]

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype=None, config: SDXLUNetConfig | None = None) -> SDXLUNet:
        """Load a diffusers ``unet/`` folder (or a pipeline folder holding one): config.json plus
        ``diffusion_pytorch_model[.fp16].safetensors`` or its sharded index; or one ``.safetensors``
        file with diffusers or LDM/SGM names (auto-detected; a full SDXL checkpoint's UNet part is
        taken, the rest ignored), for which ``config`` (default SDXL base) gives the architecture.
        Weights are cast to ``dtype`` (flame's default dtype when None). Missing, unexpected or
        misshapen tensors raise RuntimeError before anything is loaded."""
        return load_pretrained(cls, path, dtype, config,
                               subfolder="unet", what="SDXL UNet", config_class=SDXLUNetConfig,
                               index=checkpoint_index)

    # ---- running ---------------------------------------------------------------------------------
    @property
    def dtype(self):
        return self.conv_in.weight.dtype

    def enable_gradient_checkpointing(self, enabled: bool = True, scope: str = "blocks") -> SDXLUNet:
        """Recompute activations in the backward (``flame.checkpoint.checkpoint``) instead of keeping
        them. ``scope``: ``blocks``, each resnet's and each transformer block's (the most memory
        saved, a second forward of nearly the whole UNet); ``feed_forward``, each transformer
        block's GEGLU projection only (the largest activation the step keeps, for one more GEMM
        per block). ``enabled=False`` turns both off."""
        if scope not in CHECKPOINT_SCOPES:
            raise ValueError(f"enable_gradient_checkpointing: scope must be one of {', '.join(CHECKPOINT_SCOPES)}, "
                             f"got {scope!r}")
        for m in self.modules():
            if isinstance(m, _Checkpointed):
                m.gradient_checkpointing = bool(enabled) and m.scope == scope
        return self

    def _sinusoids(self, t, dim):
        """diffusers' ``get_timestep_embedding`` in fp32: [cos | sin] (or [sin | cos]) of t * freqs,
        freqs = exp(-ln(10000) * i / (dim/2 - freq_shift))."""
        half = dim // 2
        freqs = self._freqs.get(half)
        if freqs is None:
            freqs = exp(arange(half, dtype=float32) * -math.log(10000)
                        / (half - self.config.freq_shift))
            self._freqs[half] = freqs
        args = to(t, float32).reshape(t.shape[0], 1) * freqs.reshape(1, half)
        parts = [cos(args), sin(args)] if self.config.flip_sin_to_cos else [sin(args), cos(args)]
        emb = cat(parts, -1)
        return F.pad(emb, (0, 1)) if dim % 2 else emb

    def _timesteps(self, timestep, batch):
        if isinstance(timestep, Tensor):
            if timestep.ndim == 0 or timestep.shape == (1,):
                return timestep.reshape(1).expand(batch)
            if timestep.shape != (batch,):
                raise ValueError(f"SDXLUNet: timestep must be a scalar or have shape ({batch},), "
                                 f"got {timestep.shape}")
            return timestep
        if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
            return full((batch,), float(timestep), dtype=float32)
        raise TypeError(f"SDXLUNet: timestep must be a flame Tensor or a number, got {type(timestep).__name__}")

    def _check_inputs(self, sample, encoder_hidden_states, text_embeds, time_ids):
        cfg = self.config
        for name, x in (("sample", sample), ("encoder_hidden_states", encoder_hidden_states),
                        ("text_embeds", text_embeds), ("time_ids", time_ids)):
            if not isinstance(x, Tensor):
                raise TypeError(f"SDXLUNet: {name} must be a flame Tensor, got {type(x).__name__}")
        if sample.ndim != 4 or sample.shape[1] != cfg.in_channels:
            raise ValueError(f"SDXLUNet: sample must be (B, {cfg.in_channels}, h, w), got {sample.shape}")
        B, factor = sample.shape[0], 2 ** (len(cfg.block_out_channels) - 1)
        if sample.shape[2] % factor or sample.shape[3] % factor:
            raise ValueError(f"SDXLUNet: sample height and width must be multiples of {factor}, got {sample.shape}")
        expect = {"encoder_hidden_states": (B, None, cfg.cross_attention_dim), "text_embeds": (B, cfg.pooled_dim),
                  "time_ids": (B, 6)}
        for name, x in (("encoder_hidden_states", encoder_hidden_states), ("text_embeds", text_embeds),
                        ("time_ids", time_ids)):
            want = expect[name]
            if x.ndim != len(want) or any(w is not None and s != w for s, w in zip(x.shape, want)):
                shape = tuple("L" if w is None else w for w in want)
                raise ValueError(f"SDXLUNet: {name} must have shape {shape} for a sample of batch {B}, "
                                 f"got {x.shape}")

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        """``sample`` (B, in_channels, h, w) of any float dtype (cast to the model's dtype);
        ``timestep`` (B,) or scalar, int or float; ``encoder_hidden_states`` (B, L, cross_attention_dim);
        ``text_embeds`` (B, pooled_dim); ``time_ids`` (B, 6). Returns (B, out_channels, h, w) in the
        model's dtype with channels-last strides."""
        self._check_inputs(sample, encoder_hidden_states, text_embeds, time_ids)
        cfg, dtype, B = self.config, self.dtype, sample.shape[0]
        t_emb = to(self._sinusoids(self._timesteps(timestep, B), cfg.block_out_channels[0]), dtype)
        ids = self._sinusoids(time_ids.reshape(-1), cfg.addition_time_embed_dim).reshape(B, -1)
        add = cat([to(text_embeds, dtype), to(ids, dtype)], -1)
        temb_act = F.silu(self.time_embedding(t_emb) + self.add_embedding(add))
        context = to(encoder_hidden_states, dtype)
        h = self.conv_in(to(sample, dtype))
        skips = [h]
        for block in self.down_blocks:
            h = block(h, temb_act, context, skips)
        h = self.mid_block(h, temb_act, context)
        for block in self.up_blocks:
            h = block(h, temb_act, context, skips)
        return self.conv_out(_norm_silu(self.conv_norm_out, h))
