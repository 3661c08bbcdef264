"""T5's encoder as transformers builds it (``T5EncoderModel``), on flame's modules and ops: T5 v1.1
(Flux's ``text_encoder_2``, T5-XXL) and the original T5's ReLU feed-forward.

Parameter names and shapes are transformers' (``shared.weight``, ``encoder.embed_tokens.weight``
tied to it, ``encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight``,
``encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight``,
``encoder.block.N.layer.{0,1}.layer_norm.weight``, ``encoder.block.N.layer.1.DenseReluDense.*``,
``encoder.final_layer_norm.weight``), so a diffusers ``text_encoder_2/`` folder or a single file
with those names (``t5xxl_fp16.safetensors``) loads by name. No linear layer has a bias.

The network, per token sequence x (B, L) of ids and its padding mask m (B, L) of 0/1:

    h = shared[x]
    bias[h, i, j] = relative_attention_bias[bucket(j - i), h]  (layer 0's table, used by every layer)
                    + (m[b, j] - 1) * BIG                      (padded keys are left out)
    per block:  h = h + o(softmax(q k^T + bias) v)   with q, k, v of RMSNorm(h): no 1/sqrt(d) scaling
                h = h + wo(gelu_tanh(wi_0(RMSNorm(h))) * wi_1(RMSNorm(h)))   ("gated-gelu", T5 v1.1)
                    or  wo(relu(wi(RMSNorm(h))))                             ("relu", the original T5)
    last_hidden_state = RMSNorm(h)

T5's layer norm is an RMSNorm (no mean, no bias; the mean square in fp32). ``bucket`` is
transformers' bidirectional ``_relative_position_bucket``: the sign takes half of the buckets, of
each half the first half are exact distances, the rest log-spaced up to ``relative_attention_max_distance``.
Not reproduced: transformers' fp16 clamping of infinite activations (run T5 in bf16 or fp32). The
bias enters the attention as its additive mask, which takes no gradient: ``relative_attention_bias``
is not trained (everything else is; Flux keeps T5 frozen anyway).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict

import numpy as np

from .. import io, nn, runtime
from ..nn import functional as F
from ..ops.creation import tensor
from ..ops.elementwise import to
from ..ops.shape import merge_heads, split_heads
from ..tensor import Tensor, check_dtype, float32
from .blocks import pack_projections
from .checkpoints import (
    Source,
    load_pretrained,
    sort_config,
    stored_tensors,
)
from .clip_text import Embedding

_FEED_FORWARD = {"gated-gelu": "gelu_new", "relu": "relu"}  # feed_forward_proj -> transformers' dense_act_fn
# transformers T5Config keys that change nothing in this forward: metadata, the decoder's, dropout
# (this model has none), initialisation and generation settings
_IGNORED = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "dropout_rate",
            "classifier_dropout", "initializer_factor", "num_decoder_layers", "decoder_start_token_id",
            "eos_token_id", "pad_token_id", "bos_token_id", "is_encoder_decoder", "tie_word_embeddings", "use_cache",
            "output_past", "n_positions", "task_specific_params", "gradient_checkpointing", "tokenizer_class",
            "output_hidden_states", "output_attentions", "return_dict", "is_gated_act", "dense_act_fn",
            "scale_decoder_outputs", "chunk_size_feed_forward", "id2label", "label2id", "problem_type")
_FIXED = {"is_decoder": (False,)}
_MODEL_TYPES = ("t5",)
# what a padded key adds to its scores: exp of it underflows to 0 against any unmasked key
_MASKED = 1e9
# tensors of a full T5 (``T5ForConditionalGeneration``) checkpoint that the encoder does not use
_DECODER_PREFIXES = ("decoder.", "lm_head.")
_TIED = "encoder.embed_tokens.weight"  # the same table as ``shared.weight``


@dataclasses.dataclass(frozen=True)
class T5Config:
    """The encoder's architecture with transformers' ``T5Config`` names; the defaults are T5 v1.1
    XXL's (Flux's ``text_encoder_2``). ``feed_forward_proj``: "gated-gelu" (v1.1: ``wi_0``,
    ``wi_1``, ``wo``, tanh-approximated GELU) or "relu" (the original T5: ``wi``, ``wo``)."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    def __post_init__(self):
        sizes = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
                 "relative_attention_max_distance")
        bad = [f"{k}={getattr(self, k)!r}" for k in sizes
               if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        if bad:
            raise ValueError(f"T5Config: {', '.join(bad)}: sizes must be positive integers")
        if self.relative_attention_num_buckets < 4:
            raise ValueError(f"T5Config: relative_attention_num_buckets must be at least 4 (two signs, each with "
                             f"exact and log-spaced buckets), got {self.relative_attention_num_buckets}")
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 4:
            raise ValueError(f"T5Config: relative_attention_max_distance {self.relative_attention_max_distance} must "
                             f"exceed the exact buckets (relative_attention_num_buckets // 4 = "
                             f"{self.relative_attention_num_buckets // 4})")
        if self.feed_forward_proj not in _FEED_FORWARD:
            raise ValueError(f"T5Config: feed_forward_proj={self.feed_forward_proj!r} is not supported (one of "
                             f"{tuple(_FEED_FORWARD)})")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"T5Config: layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")

    @property
    def inner_dim(self) -> int:
        """The width of q, k, v and o's input: heads x head size (not necessarily ``d_model``)."""
        return self.num_heads * self.d_kv

    @classmethod
    def t5_v1_1_xxl(cls) -> T5Config:
        """T5 v1.1 XXL's encoder: 4096 wide, 24 layers of 64 heads of 64, gated-GELU MLP 10240."""
        return cls()

    @classmethod
    def tiny(cls, **changes) -> T5Config:
        """The test/CPU-demo config: 32 wide, 2 layers of 4 heads of 8, gated MLP 48, a 100-token
        vocabulary, 8 buckets up to distance 16; ``changes`` override fields."""
        base = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16)
        return cls(**{**base, **changes})

    def to_transformers(self) -> dict:
        """kwargs for ``transformers.T5Config(**...)`` building the same encoder."""
        return dataclasses.asdict(self)

    @classmethod
    def from_transformers(cls, config: dict) -> T5Config:
        """From a transformers ``config.json`` dict (a diffusers ``text_encoder_2/``); raises
        ValueError for another model type, a decoder config, an unsupported feed-forward, a
        ``dense_act_fn`` that contradicts it, or an unknown key."""
        if config.get("model_type") not in _MODEL_TYPES:
            raise ValueError(f"T5Config.from_transformers: model_type {config.get('model_type')!r} is not T5's "
                             f"({' or '.join(repr(t) for t in _MODEL_TYPES)})")
        kwargs, problems = sort_config(cls, config, _FIXED, ignored=_IGNORED)
        act = config.get("dense_act_fn")
        proj = kwargs.get("feed_forward_proj", cls.feed_forward_proj)
        if act is not None and proj in _FEED_FORWARD and act != _FEED_FORWARD[proj]:
            problems.append(f"dense_act_fn={act!r} with feed_forward_proj={proj!r} (which means "
                            f"{_FEED_FORWARD[proj]!r})")
        if problems:
            raise ValueError("T5Config.from_transformers: unsupported T5 config: " + "; ".join(problems))
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"T5Config.from_transformers: {e}") from None


def relative_position_bucket(relative_position, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """transformers' bidirectional ``T5Attention._relative_position_bucket`` on the host: the bucket
    (int64) of each relative position (key - query) of the integer array ``relative_position``. The
    sign picks a half of ``num_buckets``; in each half, distances below a quarter of ``num_buckets``
    have their own bucket, larger ones log-spaced buckets up to ``max_distance`` (and the last one
    beyond). The logarithm is taken in float32, as transformers does, so the buckets agree exactly."""
    rel = np.asarray(relative_position, dtype=np.int64)
    half = num_buckets // 2
    exact = half // 2
    distance = np.abs(rel)
    with np.errstate(divide="ignore"):  # log(0) of the exact distances, which the where below discards
        log_ratio = np.log(distance.astype(np.float32) / np.float32(exact))
    scaled = log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)
    large = exact + np.trunc(np.where(distance < exact, 0, scaled)).astype(np.int64)
    return np.where(rel > 0, half, 0) + np.where(distance < exact, distance, np.minimum(large, half - 1))


@functools.lru_cache(maxsize=64)
def _bucket_table(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(length, length) buckets of key j seen from query i: ``relative_position_bucket(j - i)``."""
    positions = np.arange(length)
    out = relative_position_bucket(positions[None, :] - positions[:, None], num_buckets, max_distance)
    out.setflags(write=False)
    return out


# ---- layers -----------------------------------------------------------------------------------------

class T5Attention(nn.Module):
    """Bidirectional multi-head self-attention; q/k/v/o without bias, no 1/sqrt(d) scaling (T5
    folds it into the initialisation). The block with ``relative_attention_bias`` (block 0) owns
    the (num_buckets, heads) relative position table."""

    def __init__(self, cfg: T5Config, dtype, relative_bias: bool):
        super().__init__()
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.q = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False, dtype=dtype)
        self.k = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False, dtype=dtype)
        self.v = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False, dtype=dtype)
        self.o = nn.Linear(cfg.inner_dim, cfg.d_model, bias=False, dtype=dtype)
        if relative_bias:
            self.relative_attention_bias = Embedding(cfg.relative_attention_num_buckets, cfg.num_heads, dtype)

    def pack(self):
        """q, k and v in one buffer (``nn.pack_linears``): one GEMM at inference."""
        nn.pack_linears((self.q, self.k, self.v))

    def forward(self, x, bias, residual=None):
        """Self-attention over ``x``, plus ``residual`` if given (in the output projection's epilogue)."""
        q, k, v = (split_heads(t, self.heads) for t in nn.linears(x, (self.q, self.k, self.v)))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(merge_heads(o), residual=residual)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: T5Config, dtype, relative_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(cfg, dtype, relative_bias)
        self.layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, dtype=dtype)

    def forward(self, h, bias):  # the residual add in the output projection's epilogue
        return self.SelfAttention(self.layer_norm(h), bias, residual=h)


class T5DenseGatedGelu(nn.Module):
    """T5 v1.1's feed-forward: wo(gelu_tanh(wi_0(x)) * wi_1(x))."""

    def __init__(self, cfg: T5Config, dtype):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, dtype=dtype)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, dtype=dtype)

    def forward(self, x, residual=None):
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x), residual=residual)


class T5DenseRelu(nn.Module):
    """The original T5's feed-forward: wo(relu(wi(x)))."""

    def __init__(self, cfg: T5Config, dtype):
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, dtype=dtype)

    def forward(self, x, residual=None):
        return self.wo(F.relu(self.wi(x)), residual=residual)


class T5LayerFF(nn.Module):
    def __init__(self, cfg: T5Config, dtype):
        super().__init__()
        dense = T5DenseGatedGelu if cfg.feed_forward_proj == "gated-gelu" else T5DenseRelu
        self.DenseReluDense = dense(cfg, dtype)
        self.layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, dtype=dtype)

    def forward(self, h):  # the residual add in the output projection's epilogue
        return self.DenseReluDense(self.layer_norm(h), residual=h)


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, dtype, relative_bias: bool):
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(cfg, dtype, relative_bias), T5LayerFF(cfg, dtype)])

    def forward(self, h, bias):
        return self.layer[1](self.layer[0](h, bias))


class T5Stack(nn.Module):
    """The encoder: ``embed_tokens`` (the model's ``shared`` table), the blocks, the final norm."""

    def __init__(self, cfg: T5Config, dtype, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([T5Block(cfg, dtype, i == 0) for i in range(cfg.num_layers)])
        self.final_layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, dtype=dtype)


# ---- checkpoint names ---------------------------------------------------------------------------------

def checkpoint_index(files) -> dict:
    """{parameter name: ``Source``} of the T5 encoder tensors of ``files`` (transformers' names):
    the tied ``encoder.embed_tokens.weight`` stands for ``shared.weight`` when that one is absent
    and is dropped otherwise; a full T5's decoder and LM head are left out."""
    out = {}
    for k, (file, shape) in stored_tensors(files).items():
        if not k.startswith(_DECODER_PREFIXES):
            out[k] = Source(file, k, shape)
    tied = out.pop(_TIED, None)
    if tied is not None and "shared.weight" not in out:
        out["shared.weight"] = tied
    return out


def _refuse_scaled_float8(files, what: str) -> None:
    """Raise ValueError for a "scaled" float8 checkpoint (ComfyUI's ``t5xxl_fp8_e4m3fn_scaled``: a
    ``scaled_fp8`` marker and a ``scale_weight`` per tensor, which this loader does not apply), from
    the headers only. Plain float8 files are upcast on load (``flame.io``)."""
    for f in files:
        with io.open_safetensors(f) as opened:
            scaled = [k for k in opened.keys() if k == "scaled_fp8" or k.endswith(".scale_weight")]  # noqa: SIM118
        if scaled:
            raise ValueError(f"{what}: {f} is a scaled float8 checkpoint (e.g. {scaled[0]!r}), whose per-tensor "
                             "scales are not supported: use t5xxl_fp16.safetensors or t5xxl_fp8_e4m3fn.safetensors")


# ---- the model ----------------------------------------------------------------------------------------

class T5EncoderModel(nn.Module):
    """T5's encoder with transformers' parameter names (``T5EncoderModel``).

    ``T5EncoderModel(config=None, dtype=None)``: random init in ``dtype`` (flame's default dtype
    when None); ``config`` defaults to T5 v1.1 XXL. ``model(input_ids, attention_mask=None)`` ->
    the last hidden state (B, L, d_model), transformers' ``last_hidden_state``.
    """

    def __init__(self, config: T5Config | None = None, dtype=None):
        super().__init__()
        cfg = config if config is not None else T5Config()
        if not isinstance(cfg, T5Config):
            raise TypeError(f"T5EncoderModel: config must be a T5Config, got {type(cfg).__name__}")
        self.config = cfg
        dtype = check_dtype(dtype or runtime.get_default_dtype())
        self.shared = Embedding(cfg.vocab_size, cfg.d_model, dtype)
        self.encoder = T5Stack(cfg, dtype, self.shared)  # encoder.embed_tokens is shared: one table
        self._buckets = {}  # sequence length -> its (L, L) bucket indices on the device, copied once
        self.pack_projections()

    def pack_projections(self) -> T5EncoderModel:
        """Each block's q, k and v in one buffer (``blocks.pack_projections``)."""
        return pack_projections(self, T5Attention)

    @staticmethod
    def parameter_shapes(config: T5Config) -> OrderedDict:
        """{state-dict name: shape} of the model (the tied ``encoder.embed_tokens.weight`` listed
        once, as ``shared.weight``), in ``state_dict`` order, without allocating."""
        d, inner, f = config.d_model, config.inner_dim, config.d_ff
        out = OrderedDict([("shared.weight", (config.vocab_size, d))])
        mlp = ((("wi_0", (f, d)), ("wi_1", (f, d))) if config.feed_forward_proj == "gated-gelu" else
               (("wi", (f, d)),)) + (("wo", (d, f)),)
        for i in range(config.num_layers):
            block = f"encoder.block.{i}.layer."
            for p in "qkv":
                out[f"{block}0.SelfAttention.{p}.weight"] = (inner, d)
            out[f"{block}0.SelfAttention.o.weight"] = (d, inner)
            if i == 0:
                out[f"{block}0.SelfAttention.relative_attention_bias.weight"] = (
                    config.relative_attention_num_buckets, config.num_heads)
            out[f"{block}0.layer_norm.weight"] = (d,)
            for name, shape in mlp:
                out[f"{block}1.DenseReluDense.{name}.weight"] = shape
            out[f"{block}1.layer_norm.weight"] = (d,)
        out["encoder.final_layer_norm.weight"] = (d,)
        return out

    @classmethod
    def from_pretrained(cls, path, dtype=None, config: T5Config | None = None,
                        subfolder: str = "text_encoder_2") -> T5EncoderModel:
        """Load ``path``: a diffusers pipeline folder (its ``subfolder``, Flux's ``text_encoder_2``),
        the component folder itself (``config.json`` plus ``model[.fp16].safetensors`` or its sharded
        index), or one ``.safetensors`` file with transformers' names (``t5xxl_fp16.safetensors``),
        whose architecture is ``config`` (T5 v1.1 XXL by default). Weights are cast to ``dtype``
        (flame's default when None); float8 files (``t5xxl_fp8_e4m3fn``) are upcast (their "scaled" variants
        are refused). Missing,
        unexpected or misshapen tensors raise one RuntimeError before anything is read."""
        what = f"T5 encoder ({subfolder})"

        def index(files, cfg):
            _refuse_scaled_float8(files, what)
            return checkpoint_index(files)

        return load_pretrained(cls, path, dtype, config, subfolder=subfolder, what=what, config_class=T5Config,
                               index=index, stem="model", parse=T5Config.from_transformers).pack_projections()

    @property
    def dtype(self):
        return self.shared.weight.dtype

    def _check(self, input_ids, attention_mask):
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"T5EncoderModel: input_ids must be a flame int64 Tensor, got {type(input_ids).__name__}")
        if input_ids.ndim != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] < 1:
            raise ValueError(f"T5EncoderModel: input_ids must be an integer (batch, tokens) Tensor with at least one "
                             f"token, got {input_ids.dtype} of shape {input_ids.shape}")
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor):
                raise TypeError(f"T5EncoderModel: attention_mask must be a flame Tensor or None, got "
                                f"{type(attention_mask).__name__}")
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"T5EncoderModel: attention_mask must have input_ids' shape {input_ids.shape}, got "
                                 f"{attention_mask.shape}")

    def attention_bias(self, length: int, attention_mask: Tensor | None = None) -> Tensor:
        """The additive scores bias of every layer: layer 0's relative position bias (1, H, L, L)
        (from the host-computed buckets of ``length``), plus -1e9 on the keys that
        ``attention_mask`` (B, L; 1 keep, 0 padding) masks, giving (B, H, L, L) in float32."""
        cfg = self.config
        if length not in self._buckets:  # a host-to-device copy per length, not per call (CUDA graphs allow none)
            self._buckets[length] = tensor(_bucket_table(length, cfg.relative_attention_num_buckets,
                                                         cfg.relative_attention_max_distance))
        table = self.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
        bias = table(self._buckets[length]).permute(2, 0, 1).unsqueeze(0)  # (L, L, H) -> (1, H, L, L), a view
        if attention_mask is None:
            return bias
        keep = to(attention_mask, float32)
        padding = (keep * _MASKED - _MASKED).reshape(keep.shape[0], 1, 1, length)  # 0 kept, -BIG padded
        return bias + padding

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Encode ``input_ids`` (B, L) (a flame int64 Tensor); ``attention_mask`` (B, L), 1 for
        tokens and 0 for padding (any dtype), leaves the padded keys out of every attention."""
        self._check(input_ids, attention_mask)
        bias = self.attention_bias(input_ids.shape[1], attention_mask)
        h = self.shared(input_ids)
        for block in self.encoder.block:
            h = block(h, bias)
        return self.encoder.final_layer_norm(h)
