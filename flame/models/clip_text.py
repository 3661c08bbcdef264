"""CLIP's text transformer as transformers builds it (``CLIPTextModel`` and
``CLIPTextModelWithProjection``), on flame's modules and ops: SDXL's two text encoders, OpenAI's
CLIP ViT-L/14 (``text_encoder/``) and OpenCLIP ViT-bigG/14 (``text_encoder_2/``).

Parameter names and shapes are transformers' (``text_model.embeddings.token_embedding.weight``,
``text_model.encoder.layers.N.self_attn.q_proj.weight``, ..., ``text_model.final_layer_norm.*``,
``text_projection.weight``), so a diffusers ``text_encoder/`` folder loads by name.
transformers 5 saves a ``CLIPTextModel`` without the ``text_model.`` prefix; such files load too.

The network, per token sequence x (B, L) of ids:

    h = token_embedding[x] + position_embedding[0:L]
    per layer:  h = h + out_proj(causal_attention(q_proj, k_proj, v_proj of LayerNorm1(h)))
                h = h + fc2(act(fc1(LayerNorm2(h))))        act: quick_gelu or exact gelu
    last_hidden_state = final_layer_norm(h)
    pooled = last_hidden_state at each row's EOS position;  text_embeds = pooled @ P^T

SDXL conditions its UNet on ``penultimate``: the input of the last layer (transformers'
``hidden_states[-2]``), not normalised.

Single-file SDXL (SGM) checkpoints hold CLIP-L under ``conditioner.embedders.0.transformer.`` with
transformers' names, and OpenCLIP bigG under ``conditioner.embedders.1.model.`` with OpenCLIP's
(``openclip_to_transformers`` maps those: q, k and v fused in one ``in_proj`` tensor, the
projection stored as the (hidden, projection) matrix that multiplies from the right).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .. import nn, runtime
from ..nn import functional as F
from ..nn import init
from ..ops.creation import arange, empty, tensor
from ..ops.elementwise import add
from ..ops.index import index_select
from ..ops.shape import merge_heads, narrow, split_heads
from ..tensor import Tensor, check_dtype
from .blocks import pack_projections
from .checkpoints import (
    Source,
    check_index,
    component_config,
    load_into,
    resolve_component,
    sort_config,
    stored_tensors,
)

_ACTIVATIONS = ("quick_gelu", "gelu")
# transformers CLIPTextConfig keys that change nothing in this forward: metadata, initialisation and output flags
_IGNORED = ("_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype", "initializer_range",
            "initializer_factor", "output_hidden_states", "output_attentions", "return_dict", "use_cache")
# ... and those whose value must be what this model implements
_FIXED = {"attention_dropout": (0, 0.0), "dropout": (0, 0.0)}
_ARCHITECTURES = ("CLIPTextModel", "CLIPTextModelWithProjection")
# the legacy eos_token_id of transformers' CLIP configs before its PR #24773 (SDXL's among them): the
# pooled position is then the row's largest id, which is the EOS token in CLIP's vocabulary
_LEGACY_EOS = 2


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The text transformer's architecture with transformers' ``CLIPTextConfig`` names; the defaults
    are SDXL's CLIP ViT-L/14 (``sdxl_clip_l``). ``projection_dim`` is only used with a projection.
    ``eos_token_id`` picks the pooled position (see ``find_eos``); SDXL's configs keep the
    legacy value 2."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    bos_token_id: int = 0
    eos_token_id: int = 2
    pad_token_id: int = 1

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
                 "num_attention_heads", "max_position_embeddings")
        bad = [f"{k}={getattr(self, k)!r}" for k in sizes
               if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        if bad:
            raise ValueError(f"CLIPTextConfig: {', '.join(bad)}: sizes must be positive integers")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"CLIPTextConfig: hidden_act={self.hidden_act!r} is not supported (one of {_ACTIVATIONS})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIPTextConfig: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if not isinstance(self.eos_token_id, int) or isinstance(self.eos_token_id, bool):
            raise ValueError(f"CLIPTextConfig: eos_token_id must be one integer, got {self.eos_token_id!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"CLIPTextConfig: layer_norm_eps must be positive, got {self.layer_norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def sdxl_clip_l(cls) -> CLIPTextConfig:
        """SDXL's ``text_encoder``: OpenAI CLIP ViT-L/14, 768 wide, 12 layers of 12 heads, quick_gelu."""
        return cls()

    @classmethod
    def sdxl_clip_g(cls) -> CLIPTextConfig:
        """SDXL's ``text_encoder_2``: OpenCLIP ViT-bigG/14, 1280 wide, 32 layers of 20 heads, exact
        gelu, projection to 1280."""
        return cls(hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
                   num_attention_heads=20, hidden_act="gelu")

    @classmethod
    def tiny(cls, **changes) -> CLIPTextConfig:
        """The CLIP-L-like test/CPU-demo config: 12 wide, 2 layers of 2 heads (head size 6), MLP 24,
        quick_gelu, projection 16, a 64-token vocabulary and SDXL's 77 positions; ``changes``
        override fields. With ``tiny_g`` (20 wide) the two give 12 + 20 = 32 text features and a
        16-wide pooled embedding: ``SDXLUNetConfig.tiny()``'s cross-attention and pooled widths."""
        base = dict(vocab_size=64, hidden_size=12, intermediate_size=24, projection_dim=16, num_hidden_layers=2,
                    num_attention_heads=2)
        return cls(**{**base, **changes})

    @classmethod
    def tiny_g(cls, **changes) -> CLIPTextConfig:
        """The bigG-like partner of ``tiny``: 20 wide (head size 10), MLP 40, exact gelu."""
        return cls.tiny(**{"hidden_size": 20, "intermediate_size": 40, "hidden_act": "gelu", **changes})

    def to_transformers(self) -> dict:
        """kwargs for ``transformers.CLIPTextConfig(**...)`` building the same model."""
        return dataclasses.asdict(self)

    @classmethod
    def from_transformers(cls, config: dict) -> CLIPTextConfig:
        """From a transformers ``config.json`` dict (a diffusers ``text_encoder/`` or
        ``text_encoder_2/``); raises ValueError for another model type or architecture, dropout,
        an unsupported activation or an unknown key."""
        if config.get("model_type") != "clip_text_model":
            raise ValueError(f"CLIPTextConfig.from_transformers: model_type {config.get('model_type')!r} is not a "
                             "CLIP text encoder's ('clip_text_model')")
        kwargs, problems = sort_config(cls, config, _FIXED, ignored=(*_IGNORED, "model_type", "architectures"))
        archs = config.get("architectures")
        if archs is not None and any(a not in _ARCHITECTURES for a in archs):
            problems.append(f"architectures={archs!r} (supported: {' or '.join(_ARCHITECTURES)})")
        if kwargs.get("projection_dim", 0) is None:
            kwargs.pop("projection_dim")  # transformers allows None for a model without projection
        if problems:
            raise ValueError("CLIPTextConfig.from_transformers: unsupported CLIP text config: " + "; ".join(problems))
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"CLIPTextConfig.from_transformers: {e}") from None


def find_eos(input_ids, eos_token_id: int) -> list:
    """Each row's pooled position in the (B, L) host array ``input_ids``, transformers' rule: the
    first ``eos_token_id`` of the row, or with the legacy ``eos_token_id == 2`` of older configs
    (SDXL's) the row's largest id (the first one on ties), which is CLIP's EOS token. A row without
    EOS gives 0, as in transformers."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"find_eos: input_ids must be 2-D (batch, tokens), got shape {ids.shape}")
    hits = ids if eos_token_id == _LEGACY_EOS else ids == eos_token_id
    return hits.argmax(-1).tolist()  # argmax gives the first maximum


# ---- checkpoint names ---------------------------------------------------------------------------------

SGM_PREFIXES = {"text_encoder": "conditioner.embedders.0.transformer.",
                "text_encoder_2": "conditioner.embedders.1.model."}
SGM_OPENCLIP = "text_encoder_2"  # the embedder an SGM file stores with OpenCLIP's names
_OPENCLIP_TOP = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                 "positional_embedding": "text_model.embeddings.position_embedding.weight",
                 "ln_final.weight": "text_model.final_layer_norm.weight",
                 "ln_final.bias": "text_model.final_layer_norm.bias",
                 "text_projection": "text_projection.weight"}
_OPENCLIP_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                   "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_OPENCLIP_UNUSED = ("logit_scale", "attn_mask")  # the contrastive temperature; a constant causal mask
_OPENCLIP_TRANSPOSED = "text_projection"  # x @ P in OpenCLIP, x @ W^T in transformers: W = P^T
_TRANSFORMERS_ROOTS = ("embeddings.", "encoder.", "final_layer_norm.")  # a CLIPTextModel saved by transformers 5


def openclip_to_transformers(key: str) -> tuple:
    """transformers' name(s) of OpenCLIP text-tower tensor ``key`` (without the checkpoint's
    prefix): three names (q, k, v, in row order) for a fused ``attn.in_proj_weight``/``_bias``,
    none for tensors the model does not use (``logit_scale``, ``attn_mask``), else one. A key
    outside the map is returned unchanged (and so reported as unexpected when loading)."""
    if key in _OPENCLIP_UNUSED:
        return ()
    if key in _OPENCLIP_TOP:
        return (_OPENCLIP_TOP[key],)
    head, sep, rest = key.partition("transformer.resblocks.")
    n, _, leaf = rest.partition(".")
    if head or not sep or not n.isdigit():
        return (key,)
    layer = f"text_model.encoder.layers.{n}."
    if leaf in ("attn.in_proj_weight", "attn.in_proj_bias"):
        kind = leaf.rpartition("_")[2]
        return tuple(f"{layer}self_attn.{p}_proj.{kind}" for p in "qkv")
    module, _, param = leaf.rpartition(".")
    if module in _OPENCLIP_BLOCK:
        return (f"{layer}{_OPENCLIP_BLOCK[module]}.{param}",)
    return (key,)


def _transformers_name(key: str):
    """The model's name of a transformers-named tensor (None for the ``position_ids`` buffer that
    older transformers releases saved)."""
    if key.endswith("embeddings.position_ids"):
        return None
    return "text_model." + key if key.startswith(_TRANSFORMERS_ROOTS) else key


def _openclip_sources(file, key: str, rest: str, shape: tuple) -> dict:
    """{parameter name: ``Source``} of OpenCLIP tensor ``key`` (``rest``: its name without the prefix)."""
    names = openclip_to_transformers(rest)
    if rest == _OPENCLIP_TRANSPOSED and len(shape) == 2:
        return {names[0]: Source(file, key, shape[::-1], transpose=True)}
    if len(names) == 3:  # q, k, v stacked along the rows
        n = shape[0] // 3
        return {name: Source(file, key, (n, *shape[1:]), rows=(i * n, (i + 1) * n)) for i, name in enumerate(names)}
    return {name: Source(file, key, shape) for name in names}


def checkpoint_index(files, subfolder: str) -> dict:
    """{parameter name: ``Source``} for the text encoder tensors of ``files``: in an SGM checkpoint
    (detected by ``SGM_PREFIXES[subfolder]``) only that embedder's tensors, else every tensor with
    transformers' names."""
    stored = stored_tensors(files)
    prefix = SGM_PREFIXES.get(subfolder, "")
    keys = [k for k in stored if prefix and k.startswith(prefix)]
    openclip = bool(keys) and subfolder == SGM_OPENCLIP
    if not keys:
        keys, prefix = list(stored), ""
    out = {}
    for k in keys:
        file, shape = stored[k]
        rest = k[len(prefix):]
        if openclip:
            out.update(_openclip_sources(file, k, rest, shape))
            continue
        name = _transformers_name(rest)
        if name is not None:
            out[name] = Source(file, k, shape)
    return out


# ---- layers -----------------------------------------------------------------------------------------

class Embedding(nn.Module):
    """A (num_embeddings, embedding_dim) lookup table, initialised N(0, 0.02) as transformers' CLIP."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(empty(num_embeddings, embedding_dim, dtype=dtype))
        init.normal_(self.weight, std=0.02)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class CLIPAttention(nn.Module):
    """Causal multi-head self-attention; q/k/v/out projections with bias, scale 1/sqrt(head size)."""

    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.heads = cfg.num_attention_heads
        d = cfg.hidden_size
        self.k_proj = nn.Linear(d, d, dtype=dtype)
        self.v_proj = nn.Linear(d, d, dtype=dtype)
        self.q_proj = nn.Linear(d, d, dtype=dtype)
        self.out_proj = nn.Linear(d, d, dtype=dtype)

    def pack(self):
        """q, k and v in one buffer (``nn.pack_linears``): one GEMM at inference."""
        nn.pack_linears((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x, residual=None):
        """Causal self-attention over ``x``, plus ``residual`` if given (in the output projection's epilogue)."""
        q, k, v = (split_heads(t, self.heads) for t in nn.linears(x, (self.q_proj, self.k_proj, self.v_proj)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # token i sees tokens j <= i
        return self.out_proj(merge_heads(o), residual=residual)  # laid out like q: a view


class CLIPMLP(nn.Module):
    """fc1 -> activation -> fc2. Exact GELU is fused into fc1's GEMM (for a plain Linear: a
    LoRA-wrapped one runs its own forward first); quick_gelu(x) = x * sigmoid(1.702 x), OpenAI's
    approximation, is composed from flame's maps."""

    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x, residual=None):
        if self.act == "gelu":
            fc1 = self.fc1
            h = F.linear(x, fc1.weight, fc1.bias, activation="gelu") if type(fc1) is nn.Linear else F.gelu(fc1(x))
        else:
            h = self.fc1(x)
            h = h * F.sigmoid(h * 1.702)
        return self.fc2(h, residual=residual)


class CLIPEncoderLayer(nn.Module):
    """Pre-LayerNorm residual block: causal self-attention, then the MLP."""

    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.self_attn = CLIPAttention(cfg, dtype)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, h):  # each residual add in the epilogue of the sublayer's last GEMM
        h = self.self_attn(self.layer_norm1(h), residual=h)
        return self.mlp(self.layer_norm2(h), residual=h)


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.token_embedding = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.position_embedding = Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype)

    def forward(self, ids):
        # positions 0..L-1: the table's first L rows, broadcast over the batch
        return self.token_embedding(ids) + narrow(self.position_embedding.weight, 0, 0, ids.shape[1])


class CLIPEncoder(nn.Module):
    """The layers (run by ``CLIPTextTransformer``, which keeps the penultimate state)."""

    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers)])


class CLIPTextTransformer(nn.Module):
    def __init__(self, cfg: CLIPTextConfig, dtype):
        super().__init__()
        self.embeddings = CLIPTextEmbeddings(cfg, dtype)
        self.encoder = CLIPEncoder(cfg, dtype)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, ids):
        """(penultimate, last_hidden_state) for the ids (B, L)."""
        h = self.embeddings(ids)
        penultimate = h
        for layer in self.encoder.layers:
            penultimate = h  # ends as the last layer's input: transformers' hidden_states[-2]
            h = layer(h)
        return penultimate, self.final_layer_norm(h)


class CLIPTextOutput(NamedTuple):
    """``penultimate`` (B, L, hidden): the last layer's input, what SDXL conditions on;
    ``last_hidden_state`` (B, L, hidden): after the final LayerNorm; ``pooled`` (B, hidden):
    ``last_hidden_state`` at each row's EOS; ``text_embeds`` (B, projection_dim): ``pooled``
    projected, None for a model without projection."""
    penultimate: Tensor
    last_hidden_state: Tensor
    pooled: Tensor
    text_embeds: Tensor | None


# ---- the model ----------------------------------------------------------------------------------------

class CLIPTextModel(nn.Module):
    """CLIP's text encoder with transformers' parameter names: ``CLIPTextModel`` or, with
    ``with_projection``, ``CLIPTextModelWithProjection`` (adds ``text_projection``, no bias).

    ``CLIPTextModel(config=None, dtype=None, with_projection=False)``: random init in ``dtype``
    (flame's default dtype when None); ``config`` defaults to SDXL's CLIP-L.
    ``model(input_ids, eos_positions=None)`` -> ``CLIPTextOutput``.
    """

    def __init__(self, config: CLIPTextConfig | None = None, dtype=None, with_projection: bool = False):
        super().__init__()
        cfg = config if config is not None else CLIPTextConfig()
        if not isinstance(cfg, CLIPTextConfig):
            raise TypeError(f"CLIPTextModel: config must be a CLIPTextConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.with_projection = bool(with_projection)
        dtype = check_dtype(dtype or runtime.get_default_dtype())
        self.text_model = CLIPTextTransformer(cfg, dtype)
        if self.with_projection:
            self.text_projection = nn.Linear(cfg.hidden_size, cfg.projection_dim, bias=False, dtype=dtype)
        self.pack_projections()

    def pack_projections(self) -> CLIPTextModel:
        """Each layer's q, k and v in one buffer (``blocks.pack_projections``)."""
        return pack_projections(self, CLIPAttention)

    @staticmethod
    def parameter_shapes(config: CLIPTextConfig, with_projection: bool = False) -> OrderedDict:
        """{state-dict name: shape} of the model, in ``state_dict`` order, without allocating."""
        d, m = config.hidden_size, config.intermediate_size
        out = OrderedDict([("text_model.embeddings.token_embedding.weight", (config.vocab_size, d)),
                           ("text_model.embeddings.position_embedding.weight", (config.max_position_embeddings, d))])
        per_layer = (("self_attn.k_proj", d, d), ("self_attn.v_proj", d, d), ("self_attn.q_proj", d, d),
                     ("self_attn.out_proj", d, d), ("layer_norm1", None, d), ("mlp.fc1", d, m), ("mlp.fc2", m, d),
                     ("layer_norm2", None, d))  # (module, fan-in (None: a LayerNorm), width)
        for i in range(config.num_hidden_layers):
            for name, fan_in, fan_out in per_layer:
                prefix = f"text_model.encoder.layers.{i}.{name}"
                out[f"{prefix}.weight"] = (fan_out,) if fan_in is None else (fan_out, fan_in)
                out[f"{prefix}.bias"] = (fan_out,)
        out["text_model.final_layer_norm.weight"] = out["text_model.final_layer_norm.bias"] = (d,)
        if with_projection:
            out["text_projection.weight"] = (config.projection_dim, d)
        return out

    @classmethod
    def from_pretrained(cls, path, subfolder: str = "text_encoder", dtype=None, with_projection: bool | None = None,
                        config: CLIPTextConfig | None = None) -> CLIPTextModel:
        """Load ``path``: a diffusers pipeline folder (its ``subfolder``), the component folder itself
        (``config.json`` plus ``model[.fp16].safetensors`` or its sharded index), or one
        ``.safetensors`` file: an SDXL (SGM) checkpoint, whose embedder ``subfolder`` names
        (``text_encoder``: CLIP-L, ``text_encoder_2``: OpenCLIP bigG), or a file with transformers'
        names. A single file's architecture is ``config``, by default SDXL's for ``subfolder``.
        ``with_projection``: None takes the projection when the checkpoint has one; False leaves it
        out; True requires it. Weights are cast to ``dtype`` (flame's default when None). Missing,
        unexpected or misshapen tensors raise one RuntimeError before anything is read."""
        what = f"CLIP text encoder ({subfolder})"
        cfg_dict, files = resolve_component(path, subfolder, "model", what)
        config = component_config(cfg_dict, config, CLIPTextConfig.from_transformers, "CLIPTextModel", path)
        if config is None:
            defaults = {"text_encoder": CLIPTextConfig.sdxl_clip_l, "text_encoder_2": CLIPTextConfig.sdxl_clip_g}
            if subfolder not in defaults:
                raise ValueError(f"CLIPTextModel.from_pretrained: {path} is a single file and subfolder={subfolder!r} "
                                 f"has no SDXL default config: pass config= (or subfolder one of {list(defaults)})")
            config = defaults[subfolder]()
        where = ", ".join(str(f) for f in files)
        index = checkpoint_index(files, subfolder)
        if not any(k.startswith("text_model.") for k in index):
            sgm = SGM_PREFIXES.get(subfolder)
            raise RuntimeError(f"Error loading the {what} from {where}: it holds no CLIP text encoder tensors "
                               f"(transformers' 'text_model.*' names" + (f", or SDXL's '{sgm}*'" if sgm else "")
                               + f"); found e.g. {sorted(index)[:3]}")
        if with_projection is None:
            with_projection = "text_projection.weight" in index
        elif not with_projection:
            index.pop("text_projection.weight", None)
        check_index(index, cls.parameter_shapes(config, with_projection), what, where)
        with nn.init.skip_init():  # every parameter is loaded next
            model = cls(config, dtype=dtype, with_projection=with_projection)
        load_into(model, index, model.dtype)
        return model.pack_projections()

    @property
    def dtype(self):
        return self.text_model.final_layer_norm.weight.dtype

    def _check_ids(self, input_ids, eos):
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"CLIPTextModel: input_ids must be a flame int64 Tensor, got {type(input_ids).__name__}")
        if input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"CLIPTextModel: input_ids must be an integer (batch, tokens) Tensor, got "
                             f"{input_ids.dtype} of shape {input_ids.shape}")
        B, L = input_ids.shape
        if not 0 < L <= self.config.max_position_embeddings:
            raise ValueError(f"CLIPTextModel: {L} tokens per row, the model takes 1 to "
                             f"{self.config.max_position_embeddings} (max_position_embeddings)")
        if isinstance(eos, Tensor):  # on the device: only its shape can be checked without a sync
            if eos.shape != (B,) or eos.dtype.is_floating_point:
                raise ValueError(f"CLIPTextModel: eos_positions as a Tensor must be integer of shape ({B},), got "
                                 f"{eos.dtype} of shape {eos.shape}")
        elif eos is not None and (len(eos) != B or any(not 0 <= int(p) < L for p in eos)):
            raise ValueError(f"CLIPTextModel: eos_positions must give one position in [0, {L}) per row ({B} rows), "
                             f"got {list(eos)}")

    def forward(self, input_ids: Tensor, eos_positions=None) -> CLIPTextOutput:
        """Encode ``input_ids`` (B, L) (a flame int64 Tensor, L <= max_position_embeddings).
        ``eos_positions``: each row's pooled position, as ``find_eos`` computes it from the ids on
        the host (a tokenizer's output is there anyway), or those positions as an int64 Tensor (B,)
        already on the device (a CUDA graph can take it as an input); None reads the ids back from
        the device."""
        self._check_ids(input_ids, eos_positions)
        if eos_positions is None:
            eos_positions = find_eos(input_ids.numpy(), self.config.eos_token_id)
        penultimate, last = self.text_model(input_ids)
        B, L, D = last.shape
        if isinstance(eos_positions, Tensor):  # row b's position p is row b * L + p of the flattened states
            rows = add(eos_positions, arange(0, B * L, L, dtype=eos_positions.dtype))
        else:
            rows = tensor([b * L + int(p) for b, p in enumerate(eos_positions)])  # host -> device, int64
        pooled = index_select(last.reshape(B * L, D), 0, rows)
        text_embeds = self.text_projection(pooled) if self.with_projection else None
        return CLIPTextOutput(penultimate, last, pooled, text_embeds)
