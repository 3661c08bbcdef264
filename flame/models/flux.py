"""The Flux.1 transformer (diffusers' ``FluxTransformer2DModel``) on flame's modules and ops.

Parameter and module names are Black Forest Labs' (the ``flux1-dev.safetensors`` layout): q, k and v
are one fused Linear per stream (``img_attn.qkv``), and a single block's attention and MLP inputs are
one Linear (``linear1``), so each is one GEMM. Such Linears carry ``parts``, their output sizes in
row order (the diffusers projections they stack); every other Linear has ``parts = None``.
``flame.models.flux_keys`` maps the names to diffusers' and back; diffusers folders and BFL or
diffusers single files load through ``flame.models.checkpoints``.

Computation follows diffusers 0.42 step for step (same conventions, inputs and outputs):

- ``vec`` = MLP(sinusoids(1000 t)) [+ MLP(sinusoids(1000 guidance))] + MLP(pooled); its SiLU is
  computed once per forward and feeds every modulation Linear;
- double blocks: per stream (image, text) LayerNorm without affine (eps 1e-6) modulated by
  ``x * (1 + scale) + shift``, fused QKV, RMSNorm of q and k per head (eps 1e-6, learned scale),
  joint attention over [text; image] tokens with RoPE, output projection and tanh-GELU MLP, each a
  gated residual;
- single blocks over [text; image] (concatenated once after the double blocks, as BFL's code does:
  diffusers' per-block concatenation and split is the same arithmetic): ``linear1`` gives q, k, v
  and the MLP input, ``linear2`` maps [attention out, GELU(MLP in)];
- the final layer: modulated LayerNorm (BFL's (shift, scale) order) and a Linear, over the image
  tokens.

Activations run in the model's dtype (bf16 or fp32). RoPE tables are made from the ids with flame
ops once per forward (angles in fp64 as diffusers, tables in fp32). The LayerNorm with its
modulation, the gated residuals and the attention prologue (QK RMSNorm, RoPE and the head split of
one or two streams, read in place from the fused projections) are one kernel each. The forward has
no host syncs, host-to-device copies or random draws (CUDA-graph friendly); its two lazily made
constant tables (the RoPE and timestep frequencies) are made by the first call, which a
``CapturedStep`` runs eagerly.

Copies left: each single block concatenates its attention output and GELU(MLP in) before
``linear2``, and for batches above 1 the attention output's text and image parts are row-strided
views that the projections copy.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections import OrderedDict

import numpy as np

from .. import nn, runtime
from ..autograd import no_grad
from ..nn import functional as F
from ..nn.init import ones_
from ..nn.layers import empty_parameter
from ..ops.creation import arange, full, tensor, zeros
from ..ops.elementwise import addcmul, cos, exp, log, sin, to
from ..ops.shape import cat, merge_heads
from ..tensor import Tensor, check_dtype, float32, float64
from . import flux_keys
from .blocks import (
    Checkpointed,
    LeafLayers,
    ShapeRecord,
    skeleton_layer_names,
    skeleton_shapes,
    switch_checkpointing,
)
from .checkpoints import (
    Rows,
    Source,
    check_index,
    load_pretrained,
    resolve_component,
    sort_config,
    stored_tensors,
)

_EPS = 1e-6  # every LayerNorm and q/k RMSNorm
_THETA = 10000  # RoPE base
_TIME_CHANNELS = 256  # sinusoids of the timestep and the guidance scale
_MLP_RATIO = 4
CHECKPOINT_SCOPES = ("blocks",)

# LoRA target presets over flame's (BFL) names, in flame.nn.lora's "re:" syntax. A single block's
# attention and MLP share linear1 and linear2, so "attn" covers its MLP input and output too.
_ATTN = [r"re:double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)", r"re:single_blocks\.\d+\.linear[12]"]
_MLP = [r"re:double_blocks\.\d+\.(img|txt)_mlp\.[02]"]
_REST = [r"re:double_blocks\.\d+\.(img|txt)_mod\.lin", r"re:single_blocks\.\d+\.modulation\.lin",
         r"re:img_in|txt_in|final_layer\.linear|final_layer\.adaLN_modulation\.1",
         r"re:(time_in|vector_in|guidance_in)\.(in_layer|out_layer)"]
LORA_PRESETS = {"attn": _ATTN, "attn-mlp": _ATTN + _MLP, "all-linear": _ATTN + _MLP + _REST}


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """The transformer's architecture with diffusers' config names; the defaults are Flux.1-dev
    (``guidance_embeds=False`` is Flux.1-schnell). ``out_channels`` None means ``in_channels``.

    ``FluxConfig.tiny()`` is the test config: 16 input channels (4-channel latents packed 2x2), two
    double and two single blocks, 2 heads of 16 (hidden 32, MLP 128), RoPE axes (4, 6, 6), text
    features 32, pooled 16, with the guidance embedder."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = True
    axes_dims_rope: tuple = (16, 56, 56)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("out_channels", "guidance_embeds", "axes_dims_rope")}
        if self.out_channels is not None:
            sizes["out_channels"] = self.out_channels
        for name, v in list(sizes.items()) + [("axes_dims_rope entries", a) for a in self.axes_dims_rope]:
            low = 0 if name in ("num_layers", "num_single_layers") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"FluxConfig: {name} must be an int >= {low}, got {v!r}")
        axes = self.axes_dims_rope
        if any(a % 2 for a in axes) or sum(axes) != self.attention_head_dim:
            raise ValueError(f"FluxConfig: axes_dims_rope {axes} must be even sizes summing to attention_head_dim "
                             f"({self.attention_head_dim})")

    @classmethod
    def tiny(cls) -> FluxConfig:
        """The small config documented in the class docstring."""
        return cls(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_size(self) -> int:
        return _MLP_RATIO * self.hidden_size

    @property
    def latent_channels(self) -> int:
        """Channels of the latents before 2x2 packing (16 for Flux.1)."""
        return self.in_channels // 4

    @property
    def output_size(self) -> int:
        """Features of each output token."""
        return self.patch_size ** 2 * (self.out_channels or self.in_channels)

    def to_diffusers(self) -> dict:
        """kwargs for ``diffusers.FluxTransformer2DModel(**...)`` building the same model."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return d

    @classmethod
    def from_diffusers(cls, config: dict) -> FluxConfig:
        """From a diffusers ``transformer/config.json`` dict (keys starting with "_" are ignored; an
        absent ``guidance_embeds`` is diffusers' default, False); any other key is an error."""
        kwargs, problems = sort_config(cls, config, {})
        if problems:
            raise ValueError("FluxConfig.from_diffusers: unsupported transformer config: " + "; ".join(problems))
        kwargs.setdefault("guidance_embeds", False)
        return cls(**kwargs)


# ---- the fused pieces of a block ---------------------------------------------------------------------
# LayerNorm + adaLN modulation, the gated residual and the attention prologue (QK RMSNorm, RoPE, the
# head split of both streams) are one kernel each (ops.norms.layer_norm_modulated, addcmul,
# ops.rope.qk_norm_rope).

def _modulate(x, shift, scale):
    """``LayerNorm(x) * (1 + scale) + shift`` over (B, L, H) (no affine, eps 1e-6); ``shift`` and
    ``scale`` (B, H), read in place from the modulation's output."""
    return F.layer_norm_modulated(x, shift, scale, _EPS)


def _gated_add(x, gate, y):
    """The gated residual ``x + gate * y`` over (B, L, H), ``gate`` (B, H)."""
    return addcmul(x, gate.unsqueeze(1), y)


def _qk_norm_rope(qkvs, norm_weights, cos_table, sin_table, num_heads, tail=None):
    """(q, k, v), each (B, heads, L, D), from the fused projections ``qkvs`` (1 or 2 streams) with
    QK RMSNorm (eps 1e-6) and RoPE (``F.qk_norm_rope``); with ``tail`` also that activation of the
    columns past q, k and v (the single block's MLP input)."""
    return F.qk_norm_rope(qkvs, norm_weights, cos_table, sin_table, num_heads, _EPS, tail)


class _FluxLayers(LeafLayers):
    """``blocks.LeafLayers`` with Linears marked by their ``parts`` and the q/k-norm scales."""

    def linear(self, fan_in, fan_out, bias=True, parts=None):
        layer = super().linear(fan_in, fan_out, bias)
        layer.parts = None if parts is None else tuple(parts)
        return layer

    def rms_scale(self, dim):
        if self.shapes_only:
            return ShapeRecord("RMSNorm", scale=(dim,))
        return _RMSScale(dim, self.dtype, self.device)


class _RMSScale(nn.Module):
    """The learned ``scale`` (BFL's name; ones at init) of a q or k RMSNorm over the head dim."""

    def __init__(self, dim, dtype, device):
        super().__init__()
        self.scale = ones_(empty_parameter((dim,), dtype, device))


def _linear_act(layer, x, activation):
    """``activation(layer(x))`` ("silu" or "gelu_tanh"), fused into the GEMM when ``layer`` is a plain
    Linear (a LoRA-wrapped one runs its own forward first)."""
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias, activation=activation)
    y = layer(x)
    return F.silu(y) if activation == "silu" else F.gelu(y, approximate="tanh")


def _heads(x, heads):
    """(B, L, heads * D) -> (B, L, heads, D) (a view)."""
    return x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)


def _attention(q, k, v):
    """Attention over (B, heads, L, D) q, k, v laid out (B, L, heads, D): (B, L, heads * D), a view
    of the output (laid out like q)."""
    return merge_heads(F.scaled_dot_product_attention(q, k, v))


class MLPEmbedder(nn.Module):
    """``out_layer(silu(in_layer(x)))``: the timestep, guidance and pooled-text embedders."""

    def __init__(self, L, fan_in, hidden):
        super().__init__()
        self.in_layer = L.linear(fan_in, hidden)
        self.out_layer = L.linear(hidden, hidden)

    def forward(self, x):
        return self.out_layer(_linear_act(self.in_layer, x, "silu"))


class Modulation(nn.Module):
    """``lin`` of silu(vec) -> its ``n`` (B, H) chunks (views): (shift, scale, gate) per modulated
    sub-layer."""

    def __init__(self, L, hidden, n):
        super().__init__()
        self.n = n
        self.lin = L.linear(hidden, n * hidden)

    def forward(self, vec_act):
        return self.lin(vec_act).chunk(self.n, -1)


class QKNorm(nn.Module):
    """The q and k RMSNorm scales of one attention."""

    def __init__(self, L, head_dim):
        super().__init__()
        self.query_norm = L.rms_scale(head_dim)
        self.key_norm = L.rms_scale(head_dim)

    def weights(self):
        return self.query_norm.scale, self.key_norm.scale


class SelfAttention(nn.Module):
    """One stream's attention weights in a double block: fused ``qkv``, its q/k ``norm``, ``proj``."""

    def __init__(self, L, hidden, head_dim):
        super().__init__()
        self.qkv = L.linear(hidden, 3 * hidden, parts=(hidden,) * 3)
        self.norm = QKNorm(L, head_dim)
        self.proj = L.linear(hidden, hidden)


def _mlp(mlp, x):
    return mlp[2](_linear_act(mlp[0], x, "gelu_tanh"))


class DoubleStreamBlock(Checkpointed):
    """Image and text streams, each modulated by silu(vec), meeting in one joint attention."""

    def __init__(self, L, cfg):
        super().__init__()
        H, M, D = cfg.hidden_size, cfg.mlp_hidden_size, cfg.attention_head_dim
        self.heads = cfg.num_attention_heads
        self.img_mod = Modulation(L, H, 6)
        self.img_attn = SelfAttention(L, H, D)
        self.img_mlp = nn.ModuleList([L.linear(H, M), nn.GELU("tanh"), L.linear(M, H)])
        self.txt_mod = Modulation(L, H, 6)
        self.txt_attn = SelfAttention(L, H, D)
        self.txt_mlp = nn.ModuleList([L.linear(H, M), nn.GELU("tanh"), L.linear(M, H)])

    def forward(self, img, txt, vec_act, cos_table, sin_table):
        """``img`` (B, L_img, H), ``txt`` (B, L_txt, H) -> (txt, img)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.img_mod(vec_act)
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = self.txt_mod(vec_act)
        qkvs = [self.txt_attn.qkv(_modulate(txt, c_shift1, c_scale1)),
                self.img_attn.qkv(_modulate(img, shift1, scale1))]
        weights = [self.txt_attn.norm.weights(), self.img_attn.norm.weights()]
        o = _attention(*_qk_norm_rope(qkvs, weights, cos_table, sin_table, self.heads))
        n_txt = txt.shape[1]
        img = _gated_add(img, gate1, self.img_attn.proj(o[:, n_txt:]))
        img = _gated_add(img, gate2, _mlp(self.img_mlp, _modulate(img, shift2, scale2)))
        txt = _gated_add(txt, c_gate1, self.txt_attn.proj(o[:, :n_txt]))
        txt = _gated_add(txt, c_gate2, _mlp(self.txt_mlp, _modulate(txt, c_shift2, c_scale2)))
        return txt, img


class SingleStreamBlock(Checkpointed):
    """Attention and MLP in parallel over the joint tokens: ``linear1`` -> q, k, v, MLP input;
    ``linear2`` over [attention out, GELU(MLP input)]."""

    def __init__(self, L, cfg):
        super().__init__()
        H, M = cfg.hidden_size, cfg.mlp_hidden_size
        self.heads = cfg.num_attention_heads
        self.linear1 = L.linear(H, 3 * H + M, parts=(H, H, H, M))
        self.linear2 = L.linear(H + M, H)
        self.norm = QKNorm(L, cfg.attention_head_dim)
        self.modulation = Modulation(L, H, 3)

    def forward(self, x, vec_act, cos_table, sin_table):
        shift, scale, gate = self.modulation(vec_act)
        h = self.linear1(_modulate(x, shift, scale))
        q, k, v, mlp = _qk_norm_rope([h], [self.norm.weights()], cos_table, sin_table, self.heads, "gelu_tanh")
        return _gated_add(x, gate, self.linear2(cat([_attention(q, k, v), mlp], -1)))


class LastLayer(nn.Module):
    """Modulated LayerNorm (``adaLN_modulation.1`` gives shift, then scale) and ``linear``."""

    def __init__(self, L, hidden, out):
        super().__init__()
        self.linear = L.linear(hidden, out)
        self.adaLN_modulation = nn.ModuleList([nn.SiLU(), L.linear(hidden, 2 * hidden)])

    def forward(self, x, vec_act):
        shift, scale = self.adaLN_modulation[1](vec_act).chunk(2, -1)
        return self.linear(_modulate(x, shift, scale))


# ---- the model -------------------------------------------------------------------------------------

_WHAT = "Flux transformer"


def _where(files) -> str:
    return ", ".join(str(f) for f in files)


def _inferred_config(files) -> FluxConfig:
    """The config of single-file weights, from their tensor shapes (``flux_keys.infer_config``)."""
    stored = stored_tensors(files)
    return FluxConfig(**flux_keys.infer_config({k: s for k, (_, s) in stored.items()}, _where(files)))


class FluxTransformer2DModel(nn.Module):
    """The Flux.1 transformer with BFL's parameter names.

    ``FluxTransformer2DModel(config=None, dtype=None)``: random init (PyTorch's Linear defaults, norm
    scales ones) in ``dtype`` (flame's default when None); ``config`` defaults to Flux.1-dev;
    ``device="meta"``: without storage (``flame.models.placement``).
    ``model(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
    guidance=None)`` -> (B, L_img, output_size), diffusers' inputs and conventions (see ``forward``).
    """

    def __init__(self, config: FluxConfig | None = None, dtype=None, *, device=None, _layers: LeafLayers | None = None):
        super().__init__()
        cfg = config if config is not None else FluxConfig()
        if not isinstance(cfg, FluxConfig):
            raise TypeError(f"FluxTransformer2DModel: config must be a FluxConfig, got {type(cfg).__name__}")
        self.config = cfg
        L = _layers or _FluxLayers(check_dtype(dtype or runtime.get_default_dtype()), device=device)
        H = cfg.hidden_size
        self.img_in = L.linear(cfg.in_channels, H)
        self.time_in = MLPEmbedder(L, _TIME_CHANNELS, H)
        self.vector_in = MLPEmbedder(L, cfg.pooled_projection_dim, H)
        self.guidance_in = MLPEmbedder(L, _TIME_CHANNELS, H) if cfg.guidance_embeds else None
        self.txt_in = L.linear(cfg.joint_attention_dim, H)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(L, cfg) for _ in range(cfg.num_layers)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(L, cfg) for _ in range(cfg.num_single_layers)])
        self.final_layer = LastLayer(L, H, cfg.output_size)
        self._tables = {}  # constant frequency tables, made on first use

    # ---- structure without memory ----------------------------------------------------------------
    @classmethod
    def skeleton(cls, config: FluxConfig | None = None) -> FluxTransformer2DModel:
        """The module tree of ``config`` with shape records (``kind``, ``shapes``, ``parts`` on
        Linears) as leaves: the model's module names, nothing allocated; not runnable."""
        return cls(config, _layers=_FluxLayers(shapes_only=True))

    @classmethod
    def parameter_shapes(cls, config: FluxConfig | None = None) -> OrderedDict:
        """{state-dict name: shape} of ``config``'s model in ``state_dict`` order, without allocating."""
        return skeleton_shapes(cls.skeleton(config))

    @classmethod
    def layer_names(cls, config: FluxConfig | None = None, kind: str = "Linear") -> list:
        """Names of the ``kind`` ("Linear", "RMSNorm") layers, without allocating."""
        return skeleton_layer_names(cls.skeleton(config), kind)

    def diffusers_names(self, path: str) -> tuple:
        """The diffusers module path of each output part of the module at ``path`` (flame's name), in
        row order: ``double_blocks.0.img_attn.qkv`` -> (``transformer_blocks.0.attn.to_q``, ``...to_k``,
        ``...to_v``), ``single_blocks.3.linear1`` -> (``...attn.to_q``, ``to_k``, ``to_v``,
        ``single_transformer_blocks.3.proj_mlp``), ``img_in`` -> (``x_embedder``,).
        ``final_layer.adaLN_modulation.1`` -> (``norm_out.linear``,), whose two row halves diffusers
        stores swapped (``flux_keys.SWAPPED_HALVES``)."""
        try:
            self.get_submodule(path)
        except AttributeError:
            raise ValueError(f"FluxTransformer2DModel.diffusers_names: the model has no module {path!r}") from None
        return flux_keys.diffusers_modules(path)

    def diffusers_rows(self, path: str):
        """Row segments of the module at ``path`` in the order diffusers stores them, or None when
        it is flame's order: diffusers' ``norm_out.linear`` holds the final modulation's (shift,
        scale) halves as (scale, shift) (LoRA files follow it)."""
        if path != flux_keys.SWAPPED_HALVES:
            return None
        h = self.config.hidden_size
        return ((h, 2 * h), (0, h))

    def diffusers_state_dict(self) -> OrderedDict:
        """The base weights under diffusers' names: views of the parameters (fused ones split into
        their parts), except ``norm_out.linear``'s, a copy with its halves swapped."""
        params = dict(self.named_parameters())
        blocks = OrderedDict()
        with no_grad():
            for name, (_, pieces) in _diffusers_layout(self.config).items():
                row = 0
                for key, start, stop in pieces:
                    blocks.setdefault(key, []).append((start, params[name].narrow(0, row, stop - start)))
                    row += stop - start
        out = OrderedDict()
        for key, parts in blocks.items():
            parts.sort(key=lambda b: b[0])
            out[key] = parts[0][1] if len(parts) == 1 else cat([t for _, t in parts], 0)
        return out

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype=None, config: FluxConfig | None = None, *, host_blocks=(),
                        weight_dtype=None, fp8_skip=()) -> FluxTransformer2DModel:
        """Load a diffusers pipeline folder holding ``transformer/``, that folder (config.json plus
        ``diffusion_pytorch_model[.fp16].safetensors`` or its sharded index), or one ``.safetensors``
        file with BFL names (``flux1-dev.safetensors``; ``model.diffusion_model.``-prefixed keys of a
        whole-pipeline file) or diffusers names. A single file's config is ``config`` or, when None,
        read from its tensor shapes (``flux_keys.infer_config``). diffusers' separate q, k, v (and a
        single block's MLP input) are stacked into the fused parameters. Weights are cast to ``dtype``
        (flame's default when None). Missing, unexpected or misshapen tensors raise one RuntimeError,
        in the file's own names, before anything is loaded.

        ``host_blocks``: names of blocks (``double_blocks.3``, ``single_blocks.10``; an
        ``offload.OffloadPlan``'s ``streamed``) whose weights are read into pinned host memory, one
        buffer per block, never the device: ``offload.BlockStreamer`` streams them from there.
        ``weight_dtype="fp8_e4m3"``: the Linear weights but those matching ``fp8_skip`` stored as fp8
        (as ``nn.quantize_linears_`` would store them), quantised one tensor at a time as they load
        (Flux's dtype is ``img_in``'s: skip the embedders and the final layer)."""
        def index(files, cfg):
            return _checkpoint_index(stored_tensors(files), cfg, _WHAT, _where(files))

        return load_pretrained(cls, path, dtype, config, subfolder="transformer", what=_WHAT, config_class=FluxConfig,
                               index=index, default=_inferred_config, host_blocks=host_blocks,
                               weight_dtype=weight_dtype, fp8_skip=fp8_skip)

    @staticmethod
    def pretrained_config(path) -> FluxConfig:
        """The config ``from_pretrained(path)`` would build, read without loading any weight: a folder's
        config.json, or a single file's tensor shapes."""
        folder = pathlib.Path(path)
        for candidate in (folder / "config.json", folder / "transformer" / "config.json"):
            if folder.is_dir() and candidate.is_file():  # the weights need not be there
                return FluxConfig.from_diffusers(json.loads(candidate.read_text()))
        _, files = resolve_component(path, "transformer", "diffusion_pytorch_model", _WHAT)
        return _inferred_config(files)

    # ---- running ---------------------------------------------------------------------------------
    @property
    def dtype(self):
        return self.img_in.weight.dtype

    def enable_gradient_checkpointing(self, enabled: bool = True, scope: str = "blocks",
                                      blocks: int | None = None) -> FluxTransformer2DModel:
        """Recompute each double and single block's activations in the backward
        (``flame.checkpoint.checkpoint``) instead of keeping them; ``scope`` "blocks" is the one
        scope; ``blocks``: how many of the 57 (19 + 38 at Flux.1's size), spread evenly (None: all);
        ``enabled=False`` turns it off."""
        switch_checkpointing(self, enabled, scope, CHECKPOINT_SCOPES, blocks)
        return self

    def _table(self, name, make):
        if name not in self._tables:
            self._tables[name] = make()
        return self._tables[name]

    def _rope_frequencies(self):
        """(D/2,) fp64: theta^(-2j/d) for pair j of each rotary axis of d dims, axes concatenated.
        Every operand is a fp64 tensor of integers: kernels take Python scalars as fp32."""
        exponents = cat([arange(0, d, 2, dtype=float64) / full((), d, float64) for d in self.config.axes_dims_rope])
        return exp(-(exponents * log(full((), _THETA, float64))))

    def _rope(self, txt_ids, img_ids):
        """(cos, sin) tables (L, D/2) fp32 of the joint tokens' pair angles (text first), angle =
        position on the pair's axis x its frequency in fp64: diffusers' FluxPosEmbed without the
        repeat of each value for the pair's two entries."""
        ids = to(cat([txt_ids, img_ids], 0), float64)
        n = ids.shape[0]
        pos = cat([ids[:, a:a + 1].expand(n, d // 2) for a, d in enumerate(self.config.axes_dims_rope)], -1)
        angles = pos * self._table("rope", self._rope_frequencies)
        return to(cos(angles), float32), to(sin(angles), float32)

    def _embed_scalar(self, mlp, t):
        """``mlp`` of diffusers' timestep projection of 1000 ``t`` (rounded to the model's dtype first,
        as diffusers): [cos | sin] of 1000 t * exp(-ln(10000) i / 128), i < 128, in fp32. The
        arguments reach 1000 radians, where one ulp of a frequency shows: the exponents are rounded
        as diffusers rounds them and exponentiated in fp64 (fp32 exp kernels are a few ulp off)."""
        half = _TIME_CHANNELS // 2
        freqs = self._table("time", lambda: to(exp(to(arange(half, dtype=float32) * -math.log(10000) / half,
                                                      float64)), float32))
        args = to(to(t, self.dtype) * 1000.0, float32).reshape(t.shape[0], 1) * freqs.reshape(1, half)
        return mlp(to(cat([cos(args), sin(args)], -1), self.dtype))

    def _check_inputs(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                      guidance):
        """The checks of ``forward``, before any launch; returns (img_ids, txt_ids) as 2-D."""
        cfg, who = self.config, "FluxTransformer2DModel"
        named = (("hidden_states", hidden_states), ("encoder_hidden_states", encoder_hidden_states),
                 ("pooled_projections", pooled_projections), ("timestep", timestep), ("img_ids", img_ids),
                 ("txt_ids", txt_ids), ("guidance", guidance))
        for name, x in named:
            if not isinstance(x, Tensor) and not (name == "guidance" and x is None):
                raise TypeError(f"{who}: {name} must be a flame Tensor, got {type(x).__name__}")
        if cfg.guidance_embeds and guidance is None:
            raise ValueError(f"{who}: this model embeds the guidance scale (guidance_embeds=True, as Flux.1-dev): "
                             "pass guidance, shape (B,) (e.g. 3.5 to sample, 1.0 to train)")
        if not cfg.guidance_embeds and guidance is not None:
            raise ValueError(f"{who}: this model has no guidance embedder (guidance_embeds=False, as "
                             "Flux.1-schnell): pass guidance=None")
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != cfg.in_channels:
            raise ValueError(f"{who}: hidden_states must be packed latents (B, L_img, {cfg.in_channels}) "
                             f"(see flux.pack_latents), got {hidden_states.shape}")
        B, n_img = hidden_states.shape[:2]
        want = {"encoder_hidden_states": (B, None, cfg.joint_attention_dim),
                "pooled_projections": (B, cfg.pooled_projection_dim), "timestep": (B,), "guidance": (B,)}
        for name, x in named:
            shape = want.get(name)
            if shape is None or x is None:
                continue
            if x.ndim != len(shape) or any(w not in (None, s) for s, w in zip(x.shape, shape)):
                shown = tuple("L_txt" if w is None else w for w in shape)
                raise ValueError(f"{who}: {name} must have shape {shown} for hidden_states of batch {B}, "
                                 f"got {x.shape}")
        n_txt = encoder_hidden_states.shape[1]
        return self._ids(img_ids, n_img, "img_ids"), self._ids(txt_ids, n_txt, "txt_ids")

    def _ids(self, ids, n, name):
        axes = len(self.config.axes_dims_rope)
        if ids.ndim == 3 and ids.shape[0] == 1:  # diffusers' deprecated batched ids
            ids = ids.reshape(ids.shape[1:])
        if ids.shape != (n, axes):
            raise ValueError(f"FluxTransformer2DModel: {name} must have shape ({n}, {axes}) (one row per token, "
                             f"shared by the batch; a leading batch dim of 1 is dropped), got {ids.shape}")
        return ids

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None):
        """diffusers' ``FluxTransformer2DModel.forward`` (its keyword names): ``hidden_states`` (B, L_img,
        in_channels) packed latents (``pack_latents``), ``encoder_hidden_states`` (B, L_txt,
        joint_attention_dim), ``pooled_projections`` (B, pooled_projection_dim), ``timestep`` (B,) in
        [0, 1] (x1000 inside), ``img_ids`` (L_img, 3) and ``txt_ids`` (L_txt, 3) (``latent_image_ids``,
        ``text_ids``), ``guidance`` (B,) (x1000 inside), required exactly when ``guidance_embeds``.
        Inputs are cast to the model's dtype. Returns (B, L_img, output_size) in the model's dtype."""
        img_ids, txt_ids = self._check_inputs(hidden_states, encoder_hidden_states, pooled_projections, timestep,
                                              img_ids, txt_ids, guidance)
        dtype = self.dtype
        img = self.img_in(to(hidden_states, dtype))
        vec = self._embed_scalar(self.time_in, timestep)
        if guidance is not None:
            vec = vec + self._embed_scalar(self.guidance_in, guidance)
        vec_act = F.silu(vec + self.vector_in(to(pooled_projections, dtype)))
        txt = self.txt_in(to(encoder_hidden_states, dtype))
        cos_table, sin_table = self._rope(txt_ids, img_ids)
        for block in self.double_blocks:
            txt, img = block(img, txt, vec_act, cos_table, sin_table)
        n_txt = txt.shape[1]
        x = cat([txt, img], 1)
        for block in self.single_blocks:
            x = block(x, vec_act, cos_table, sin_table)
        return self.final_layer(x[:, n_txt:], vec_act)


# ---- checkpoints --------------------------------------------------------------------------------------

def _diffusers_layout(config) -> OrderedDict:
    """{flame parameter name: (shape, diffusers pieces)} of ``config``'s model (``flux_keys.diffusers_pieces``)."""
    out = OrderedDict()
    for path, m in FluxTransformer2DModel.skeleton(config).named_modules():
        if isinstance(m, ShapeRecord):
            for attr, shape in m.shapes.items():
                name = f"{path}.{attr}"
                out[name] = (shape, flux_keys.diffusers_pieces(name, shape, getattr(m, "parts", None)))
    return out


def _checkpoint_index(stored, config, what, where) -> dict:
    """{flame parameter name: Source or Rows} for the stored tensors {key: (file, shape)}, checked
    (``check_index``) in the file's naming: diffusers keys against the shapes diffusers' model of
    ``config`` has, BFL keys against this model's."""
    if not flux_keys.is_diffusers(stored):
        index = {name: Source(stored[key][0], key, stored[key][1]) for name, key in flux_keys.bfl_keys(stored).items()}
        check_index(index, FluxTransformer2DModel.parameter_shapes(config), what, where)
        return index
    layout = _diffusers_layout(config)
    expected = {}
    for shape, pieces in layout.values():
        for key, _, stop in pieces:
            expected[key] = (max(stop, expected.get(key, (0,))[0]), *shape[1:])
    check_index({k: Source(f, k, s) for k, (f, s) in stored.items()}, expected, what, where)
    index = {}
    for name, (shape, pieces) in layout.items():
        blocks = [Source(stored[key][0], key, (stop - start, *shape[1:]),
                         rows=None if (start, stop) == (0, expected[key][0]) else (start, stop))
                  for key, start, stop in pieces]
        index[name] = blocks[0] if len(blocks) == 1 else Rows(tuple(blocks))
    return index


# ---- latents and ids -----------------------------------------------------------------------------------

def _check_even(name, height, width):
    if height % 2 or width % 2:
        raise ValueError(f"{name}: latent height and width must be even (2x2 patches), got {height}x{width}")


def pack_latents(latents):
    """(B, C, H, W) latents -> (B, H/2 * W/2, 4 C) tokens: the 2x2 patches in raster order, each
    token (channel, row in patch, column in patch): ``FluxPipeline._pack_latents``' order. One copy
    (recorded: gradients flow back)."""
    if not isinstance(latents, Tensor) or latents.ndim != 4:
        raise ValueError(f"pack_latents: expected a (B, C, H, W) flame Tensor, got "
                         f"{getattr(latents, 'shape', type(latents).__name__)}")
    B, C, H, W = latents.shape
    _check_even("pack_latents", H, W)
    x = latents.reshape(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.contiguous().reshape(B, (H // 2) * (W // 2), 4 * C)


def unpack_latents(packed, height, width):
    """The inverse of ``pack_latents`` for a (``height``, ``width``) latent: (B, L, 4 C) -> (B, C, height,
    width) (``FluxPipeline._unpack_latents``' element order) with channels-last strides, as flame's
    convolutions write them. One copy."""
    if not isinstance(packed, Tensor) or packed.ndim != 3:
        raise ValueError(f"unpack_latents: expected a (B, L, 4 C) flame Tensor, got "
                         f"{getattr(packed, 'shape', type(packed).__name__)}")
    _check_even("unpack_latents", height, width)
    B, n, F4 = packed.shape
    if n != (height // 2) * (width // 2) or F4 % 4:
        raise ValueError(f"unpack_latents: {packed.shape} is not a packed {height}x{width} latent "
                         f"(expected (B, {(height // 2) * (width // 2)}, 4 C))")
    x = packed.reshape(B, height // 2, width // 2, F4 // 4, 2, 2).permute(0, 1, 4, 2, 5, 3)
    return x.contiguous().reshape(B, height, width, F4 // 4).permute(0, 3, 1, 2)


def latent_image_ids(height, width) -> Tensor:
    """(height/2 * width/2, 3) fp32 ids of the packed tokens of a (``height``, ``width``) latent:
    (0, patch row, patch column) in raster order (``FluxPipeline._prepare_latent_image_ids`` of the
    packed grid). Made on the host and copied over: build it outside a captured step."""
    _check_even("latent_image_ids", height, width)
    rows, cols = np.meshgrid(np.arange(height // 2), np.arange(width // 2), indexing="ij")
    return tensor(np.stack([np.zeros_like(rows), rows, cols], -1).reshape(-1, 3).astype(np.float32))


def text_ids(n) -> Tensor:
    """(n, 3) fp32 zeros: the text tokens' ids (all at position 0)."""
    return zeros(n, 3, dtype=float32)
