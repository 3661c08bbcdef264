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

The architecture (``SDXLUNetConfig``) is in ``flame.models.sdxl_config``. It is described once: every
block builds its leaf layers through ``flame.models.blocks.LeafLayers``, which makes flame layers for
a model or shape-only records for ``SDXLUNet.parameter_shapes`` (the full SDXL config listed without
allocating its 2.57 B parameters).
"""
from __future__ import annotations

import math
from collections import OrderedDict

from .. import nn, runtime
from ..nn import functional as F
from ..ops.creation import arange, full
from ..ops.elementwise import cos, exp, sin, to
from ..ops.shape import cat, merge_heads, split_heads
from ..tensor import Tensor, check_dtype, float32
from .blocks import (
    Checkpointed,
    LeafLayers,
    Upsample2D,
    nchw,
    nhwc,
    norm_silu,
    pack_projections,
    skeleton_layer_names,
    skeleton_shapes,
    switch_checkpointing,
)
from .checkpoints import load_pretrained
from .sdxl_config import SDXLUNetConfig
from .sdxl_keys import checkpoint_index, diffusers_to_ldm

# ---- blocks ---------------------------------------------------------------------------------------

CHECKPOINT_SCOPES = ("blocks", "feed_forward")


def _linear_silu(layer, x):
    """silu(layer(x)), with bias and SiLU fused into the GEMM when ``layer`` is a plain Linear
    (a LoRA-wrapped one runs its own forward first)."""
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias, activation="silu")
    return F.silu(layer(x))


class TimestepEmbedding(nn.Module):
    def __init__(self, L, fan_in, dim):
        super().__init__()
        self.linear_1 = L.linear(fan_in, dim)
        self.linear_2 = L.linear(dim, dim)

    def forward(self, x):
        return self.linear_2(_linear_silu(self.linear_1, x))


class ResnetBlock2D(Checkpointed):
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
        h = self.conv1(norm_silu(self.norm1, x))
        t = self.time_emb_proj(temb_act)
        h = nchw(nhwc(h) + t.reshape(t.shape[0], 1, 1, t.shape[1]))
        h = self.conv2(norm_silu(self.norm2, h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        out = nhwc(x) + nhwc(h)
        if self.output_scale_factor != 1.0:
            out = out / self.output_scale_factor
        return nchw(out)


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

    def pack(self):
        """One buffer for the projections of one input (``nn.pack_linears``): q, k and v of a
        self-attention, k and v of a cross-attention, each group one GEMM at inference."""
        cross = self.to_k.in_features != self.to_q.in_features
        nn.pack_linears((self.to_k, self.to_v) if cross else (self.to_q, self.to_k, self.to_v))

    def forward(self, x, context=None, residual=None):
        """Attention over ``x`` (keys and values from ``context`` if given), plus ``residual`` if given
        (added by the output projection's epilogue)."""
        if context is None:
            q, k, v = nn.linears(x, (self.to_q, self.to_k, self.to_v))
        else:
            q, (k, v) = self.to_q(x), nn.linears(context, (self.to_k, self.to_v))
        # (B, L, H*D) -> (B, H, L, D) views (the attention kernels take any B/H/L strides)
        heads = self.heads
        q, k, v = split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)
        o = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head size), as diffusers
        return self.to_out[0](merge_heads(o), residual=residual)  # output laid out like q: a view


class GEGLU(Checkpointed):
    """The feed-forward's projection and gate. Checkpointed (scope ``feed_forward``), it keeps its
    (B, L, dim) input instead of the (B, L, 8 dim) projection GEGLU's backward needs, and recomputes
    the projection in the backward: an eighth of the largest activation of the step, for one GEMM."""

    scope = "feed_forward"

    def __init__(self, L, dim, inner):
        super().__init__()
        self.proj = L.linear(dim, 2 * inner)

    def forward(self, x):  # hidden * gelu(gate), exact GELU: in the projection's epilogue where it can
        proj = self.proj
        if type(proj) is nn.Linear:
            return F.linear(x, proj.weight, proj.bias, activation="geglu")
        return F.geglu(proj(x))


class FeedForward(nn.Module):
    def __init__(self, L, dim, mult=4):
        super().__init__()
        self.net = nn.ModuleList([GEGLU(L, dim, mult * dim), nn.Dropout(0.0), L.linear(mult * dim, dim)])

    def forward(self, x, residual=None):
        return self.net[2](self.net[0](x), residual=residual)


class BasicTransformerBlock(Checkpointed):
    """Pre-LayerNorm self-attention, cross-attention and GEGLU feed-forward, each residual."""

    def __init__(self, L, dim, heads, context_dim):
        super().__init__()
        self.norm1 = L.layer_norm(dim)
        self.attn1 = Attention(L, dim, heads)
        self.norm2 = L.layer_norm(dim)
        self.attn2 = Attention(L, dim, heads, context_dim)
        self.norm3 = L.layer_norm(dim)
        self.ff = FeedForward(L, dim)

    def forward(self, h, context):  # each residual add in the epilogue of the sublayer's last GEMM
        h = self.attn1(self.norm1(h), residual=h)
        h = self.attn2(self.norm2(h), context, residual=h)
        return self.ff(self.norm3(h), residual=h)


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
        h = self.proj_in(nhwc(h).reshape(B, H * W, C))
        for block in self.transformer_blocks:
            h = block(h, context)
        h = self.proj_out(h, residual=nhwc(x).reshape(B, H * W, C))
        return nchw(h.reshape(B, H, W, C))


class Downsample2D(nn.Module):
    def __init__(self, L, c):
        super().__init__()
        self.conv = L.conv(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


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
            h = nchw(cat([nhwc(h), nhwc(skips.pop())], -1))  # channel concat, channels-last
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
    ``dtype`` (flame's default dtype when None); ``config`` defaults to SDXL base; ``device="meta"``:
    without storage (``flame.models.placement``).
    ``model(sample, timestep, encoder_hidden_states, text_embeds, time_ids)`` -> (B, out_channels, h, w).
    """

    def __init__(self, config: SDXLUNetConfig | None = None, dtype=None, *, device=None,
                 _layers: LeafLayers | None = None):
        super().__init__()
        cfg = config if config is not None else SDXLUNetConfig()
        if not isinstance(cfg, SDXLUNetConfig):
            raise TypeError(f"SDXLUNet: config must be an SDXLUNetConfig, got {type(cfg).__name__}")
        self.config = cfg
        L = _layers or LeafLayers(check_dtype(dtype or runtime.get_default_dtype()), device=device)
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
        if _layers is None and (device is None or str(device) != "meta"):
            self.pack_projections()

    def pack_projections(self) -> SDXLUNet:
        """Give each attention's projections of one input one buffer (``Attention.pack``): at
        inference q, k and v of a self-attention run as one GEMM, k and v of a cross-attention as
        another (210 launches fewer per SDXL forward). Names, values and state dict stay as they
        are; layers with fp8 weights, LoRA wrappers or weights on the host are left unpacked
        (``blocks.pack_projections``)."""
        return pack_projections(self, Attention)

    # ---- structure without memory ----------------------------------------------------------------
    @classmethod
    def skeleton(cls, config: SDXLUNetConfig | None = None) -> SDXLUNet:
        """The module tree of ``config`` with shape records (``kind``, ``shapes``) as leaves:
        same module names as the model, nothing allocated; not runnable."""
        return cls(config, _layers=LeafLayers(shapes_only=True))

    @classmethod
    def parameter_shapes(cls, config: SDXLUNetConfig | None = None) -> OrderedDict:
        """{state-dict name: shape} of ``config``'s model in ``state_dict`` order, without allocating."""
        return skeleton_shapes(cls.skeleton(config))

    def original_name(self, path: str) -> str:
        """The module at ``path`` (a diffusers name) under its name in the original LDM/SGM layout,
        as kohya's sd-scripts and ComfyUI name LoRA layers: ``down_blocks.1.attentions.0.proj_in`` ->
        ``input_blocks.4.1.proj_in``, ``down_blocks.0.resnets.0.conv1`` -> ``input_blocks.1.0.in_layers.2``."""
        return diffusers_to_ldm(path + ".weight", self.config)[: -len(".weight")]

    @classmethod
    def layer_names(cls, config: SDXLUNetConfig | None = None, kind: str = "Linear") -> list:
        """Names of the ``kind`` ("Linear", "Conv2d", "GroupNorm", "LayerNorm") layers, without allocating."""
        return skeleton_layer_names(cls.skeleton(config), kind)

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype=None, config: SDXLUNetConfig | None = None, *, host_blocks=(),
                        weight_dtype=None, fp8_skip=()) -> SDXLUNet:
        """Load a diffusers ``unet/`` folder (or a pipeline folder holding one): config.json plus
        ``diffusion_pytorch_model[.fp16].safetensors`` or its sharded index; or one ``.safetensors``
        file with diffusers or LDM/SGM names (auto-detected; a full SDXL checkpoint's UNet part is
        taken, the rest ignored), for which ``config`` (default SDXL base) gives the architecture.
        Weights are cast to ``dtype`` (flame's default dtype when None). Missing, unexpected or
        misshapen tensors raise RuntimeError before anything is loaded. ``host_blocks`` (resnets and
        transformer blocks, ``offload.streamable_blocks``' names), ``weight_dtype`` and ``fp8_skip``:
        as ``FluxTransformer2DModel.from_pretrained``'s."""
        model = load_pretrained(cls, path, dtype, config,
                                subfolder="unet", what="SDXL UNet", config_class=SDXLUNetConfig,
                                index=checkpoint_index, host_blocks=host_blocks, weight_dtype=weight_dtype,
                                fp8_skip=fp8_skip)
        return model if host_blocks else model.pack_projections()  # streamed blocks keep their host packing

    # ---- running ---------------------------------------------------------------------------------
    @property
    def dtype(self):
        return self.conv_in.weight.dtype

    def enable_gradient_checkpointing(self, enabled: bool = True, scope: str = "blocks",
                                      blocks: int | None = None) -> SDXLUNet:
        """Recompute activations in the backward (``flame.checkpoint.checkpoint``) instead of keeping
        them. ``scope``: ``blocks``, each resnet's and each transformer block's (the most memory
        saved, a second forward of nearly the whole UNet); ``feed_forward``, each transformer
        block's GEGLU projection only (the largest activation the step keeps, for one more GEMM
        per block). ``blocks``: how many of the scope's modules, spread evenly (None: all).
        ``enabled=False`` turns both off."""
        switch_checkpointing(self, enabled, scope, CHECKPOINT_SCOPES, blocks)
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
        return self.conv_out(norm_silu(self.conv_norm_out, h))
