"""Text-encoder LoRA for SDXL (``lora.text_encoder``): both CLIP text encoders with trainable
adapters, trained with the UNet.

The encoders of ``model.path`` (a pipeline folder, or a single file with ``sample.tokenizers``;
transformers' layer names, ``flame.models.clip_text``) load frozen in the run's precision. Adapters
go on ``lora.text_encoder_targets`` (``attn-mlp`` by default: every layer's q/k/v/out projections and
fc1/fc2, kohya's choice) with their own rank, alpha and learning rate (``lora.text_encoder_*``).
CLIP-L's last layer takes none: SDXL conditions on the penultimate states (that layer's input), so
its output never reaches the UNet and its adapters would get no gradient. bigG's last layer feeds the
pooled embedding and takes them.

Each step the batch's captions (the cache's ``caption`` of each sample) are tokenized on the host
(``SDXLTextEncoders.tokenize``: kohya's 75-token windows, as many as the cache's text length holds;
one for a cache of another length) and uploaded, outside the captured step, as its two text inputs:
both encoders' token ids (2, B * W, 77) and EOS positions (2, B * W), int64. Caption dropout swaps a
sample's rows for the empty caption's on the device (``where`` on the coin the trainer draws), so the
empty caption is encoded by the encoders being trained, not read from the cache. Inside the step
``encode`` runs both encoders (``SDXLTextEncoders.encode_rows``: no host read, gradients to the
adapters) and the UNet reads what they give. Validation and sample images encode with them too.

Memory: the encoders' activations are not checkpointed (``train.gradient_checkpointing`` is the
UNet's). What their backward keeps is about 0.13 GB per sample of 77 tokens in bf16 (bigG's 32
layers ~100 MB, CLIP-L's 12 ~30 MB), small beside the UNet's.

Files: these adapters go into the run's LoRA file beside the UNet's, under diffusers' prefixes
``text_encoder.`` / ``text_encoder_2.`` (PEFT, read by ``StableDiffusionXLPipeline.load_lora_weights``)
or kohya's ``lora_te1_`` / ``lora_te2_``, with transformers' module paths
(``text_model.encoder.layers.N.self_attn.q_proj``).
"""
from __future__ import annotations

import numpy as np

from ..models.checkpoints import resolve_component
from ..models.clip_text import CLIPTextConfig, CLIPTextModel, find_eos
from ..models.sdxl_text import CONTEXT, MAX_TOKENS, WINDOW, SDXLTextEncoders
from ..nn import inject_lora, lora_parameters
from ..nn.lora import lora_modules, matching_layers
from ..ops.creation import tensor
from ..ops.elementwise import where
from .datasets import encoder_source_problem
from .errors import ConfigError

PREFIXES = ("text_encoder", "text_encoder_2")  # the encoders' PEFT prefixes (kohya: lora_te1_, lora_te2_)
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
PRESETS = {"attn": _ATTN, "attn-mlp": (*_ATTN, "mlp.fc1", "mlp.fc2")}
_DEFAULT_CONFIGS = {"text_encoder": CLIPTextConfig.sdxl_clip_l, "text_encoder_2": CLIPTextConfig.sdxl_clip_g}


def expand_targets(targets) -> list:
    """``lora.text_encoder_targets`` with its presets (attn, attn-mlp) expanded."""
    targets = [targets] if isinstance(targets, str) else targets
    return [name for t in targets for name in PRESETS.get(t, (t,))]


def encoder_configs(path) -> tuple:
    """Both encoders' ``CLIPTextConfig``s: from a pipeline folder's config.json files, SDXL's for a
    single file (its weights are checked against them when they load)."""
    configs = []
    for sub in PREFIXES:
        cfg, _ = resolve_component(path, sub, "model", f"CLIP text encoder ({sub})")
        configs.append(_DEFAULT_CONFIGS[sub]() if cfg is None else CLIPTextConfig.from_transformers(cfg))
    return tuple(configs)


def encoder_layers(config: CLIPTextConfig, prefix: str) -> list:
    """The Linear layers of encoder ``prefix`` that can take adapters: all but the embeddings' and,
    for CLIP-L (whose penultimate states are all SDXL reads), its last layer's."""
    with_projection = prefix == "text_encoder_2"
    names = [k[:-len(".weight")] for k, shape in CLIPTextModel.parameter_shapes(config, with_projection).items()
             if k.endswith(".weight") and len(shape) == 2 and ".embeddings." not in k]
    if not with_projection:
        last = f"text_model.encoder.layers.{config.num_hidden_layers - 1}."
        names = [n for n in names if not n.startswith(last)]
    return names


def check_source(cfg) -> None:
    """The encoders and tokenizers of ``model.path`` (``sample.tokenizers`` for a single file) exist,
    and ``lora.text_encoder_targets`` selects some of their layers: checked from the folders and
    configs alone, before any weight loads (a ConfigError)."""
    path, targets = cfg.model.path, cfg.lora.text_encoder_targets
    problem = encoder_source_problem("sdxl", path, cfg.sample.tokenizers)
    if problem:
        raise ConfigError(f"lora.text_encoder: the text encoders and tokenizers of model.path: {problem}")
    try:
        configs = encoder_configs(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"lora.text_encoder: cannot read the text encoders' configs of {path}: {e}") from None
    names = [n for prefix, cfg in zip(PREFIXES, configs) for n in encoder_layers(cfg, prefix)]
    if not matching_layers(names, expand_targets(targets)):
        raise ConfigError(f"lora.text_encoder_targets: {targets!r} matches none of the text encoders' {len(names)} "
                          f"Linear layers (names look like {names[0]}; presets: {', '.join(PRESETS)})")


class TextEncoderLoRA:
    """Both SDXL text encoders with adapters, the captions of the run's cache, and the step's text
    inputs (see the module docstring). ``captions``: the caption of every sample index of the cache;
    ``text_len``: the cache's text length (its windows); ``lora``: the config's lora section."""

    def __init__(self, encoders: SDXLTextEncoders, captions: list, text_len: int, lora, dropout: bool):
        self.encoders = encoders
        encoders.requires_grad_(False)
        encoders.cuda_graph = False  # they run inside the trainer's step (and its graph)
        self.captions = captions
        self.max_tokens = text_len - 2 if text_len - 2 in MAX_TOKENS else WINDOW
        self.windows = self.max_tokens // WINDOW
        for tok, enc in zip(encoders.tokenizers, self.models.values()):
            if len(tok) > enc.config.vocab_size:
                raise ConfigError(f"lora.text_encoder: a tokenizer has {len(tok)} tokens, its encoder's vocabulary "
                                  f"{enc.config.vocab_size}: the tokenizers do not belong to these encoders")
        targets = expand_targets(lora.text_encoder_targets)
        rank = lora.text_encoder_rank or lora.rank
        alpha = lora.text_encoder_alpha if lora.text_encoder_alpha is not None else lora.alpha
        self.layers = []
        for prefix, enc in self.models.items():
            names = matching_layers(encoder_layers(enc.config, prefix), targets)
            if names:  # the names themselves: a suffix target would also match CLIP-L's last layer
                inject_lora(enc, names, rank, alpha, lora.init, lora.dropout, dora=lora.dora)
            self.layers += [f"{prefix}.{n}" for n in names]
        self.rank, self.alpha = rank, float(rank if alpha is None else alpha)
        self._empty = self._upload(*self._tokens([""])) if dropout else None

    @classmethod
    def load(cls, cfg, dtype, cache) -> TextEncoderLoRA:
        """The encoders of ``model.path`` (tokenizers: ``sample.tokenizers`` for a single file) in
        ``dtype`` with the ``lora`` section's adapters, for the captions of ``cache`` (a
        ``LatentCache`` or ``CacheSet``, whose text widths they must give); a source that cannot be
        loaded is a ConfigError naming it."""
        path = cfg.model.path
        try:
            encoders = SDXLTextEncoders.from_pretrained(path, dtype=dtype, tokenizer_path=cfg.sample.tokenizers)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"lora.text_encoder: cannot load the text encoders of {path}: {e}") from None
        dims = {"text_dim": encoders.text_dim, "pooled_dim": encoders.pooled_dim}
        bad = [f"{k} {v} (the cache's {getattr(cache, k)})" for k, v in dims.items() if v != getattr(cache, k)]
        if bad:
            raise ConfigError(f"lora.text_encoder: the text encoders of {path} give {', '.join(bad)}: they are not "
                              "the encoders the cache (and the UNet) was made for")
        return cls(encoders, cache_captions(cache), cache.text_len, cfg.lora, bool(cfg.data.caption_dropout))

    @property
    def models(self) -> dict:
        """{PEFT prefix: encoder}: the LoRA file's parts besides the UNet."""
        return {"text_encoder": self.encoders.text_encoder, "text_encoder_2": self.encoders.text_encoder_2}

    def parameters(self) -> list:
        """The adapters' trainable parameters, CLIP-L's then bigG's."""
        return [p for enc in self.models.values() for p in lora_parameters(enc)]

    def param_groups(self, lr: float, plus_ratio: float) -> list:
        """One optimizer group per (encoder, A or B side), as the UNet's parts: ``lr`` (B's times
        LoRA+'s ``plus_ratio``); DoRA's magnitudes with A."""
        groups = []
        for enc in self.models.values():
            modules = [m for _, m in lora_modules(enc)]
            if not modules:
                continue
            a = [p for m in modules for p in ([m.lora_A] + ([m.lora_magnitude] if m.dora else []))]
            groups += [{"params": a, "lr": lr}, {"params": [m.lora_B for m in modules], "lr": lr * plus_ratio}]
        return groups

    def train(self, mode: bool = True) -> None:
        self.encoders.train(mode)

    # ---- the step's inputs (host) and its encoding (device)
    def _tokens(self, captions) -> tuple:
        """Host int64 arrays: token ids (2, B, W, 77) and EOS positions (2, B, W) of ``captions``."""
        ids = np.stack(self.encoders.tokenize(captions, self.max_tokens))
        B, W = ids.shape[1:3]
        eos = np.stack([np.asarray(find_eos(a.reshape(B * W, CONTEXT), enc.config.eos_token_id)).reshape(B, W)
                        for a, enc in zip(ids, self.models.values())])
        return ids, eos.astype(np.int64)

    @staticmethod
    def _upload(ids, eos) -> tuple:
        return tensor(ids), tensor(eos)  # host -> device

    def inputs(self, indices, keep=None) -> tuple:
        """The step's text inputs for the cache samples ``indices``: token ids (2, B * W, 77) and EOS
        positions (2, B * W), int64 on the device; where ``keep`` (a device bool (B,), caption
        dropout) is false, the empty caption's."""
        ids, eos = self._upload(*self._tokens([self.captions[i] for i in indices]))
        if keep is not None:
            empty_ids, empty_eos = self._empty
            ids = where(keep.reshape(1, -1, 1, 1), ids, empty_ids)
            eos = where(keep.reshape(1, -1, 1), eos, empty_eos)
        B = len(indices)
        return ids.reshape(2, B * self.windows, CONTEXT), eos.reshape(2, B * self.windows)

    def encode(self, ids, eos) -> tuple:
        """(prompt embeddings (B, 2 + 75 W, text dim), pooled (B, pooled dim)) of the step's text
        inputs, through both encoders and their adapters: device work alone (a captured step's)."""
        return self.encoders.encode_rows([ids[0], ids[1]], [eos[0], eos[1]], ids.shape[1] // self.windows)


def cache_captions(cache) -> list:
    """The caption of every sample index of ``cache`` (a ``LatentCache``, or a ``CacheSet``, whose
    indices run over its caches in order)."""
    caches = [c for c, _, _ in cache.parts] if hasattr(cache, "parts") else [cache]
    return [str(s.get("caption", "")) for c in caches for s in c.samples]
