"""Flux.1's prompt conditioning: CLIP-L's pooled vector and T5-XXL's hidden states (``FluxTextEncoders``).

As diffusers' ``FluxPipeline.encode_prompt`` computes them:

- CLIP-L (``text_encoder``, transformers' ``CLIPTextModel``, tokenizer ``tokenizer/``): the prompt
  as 77 tokens (start, up to 75 caption tokens, end, padding; longer captions are cut), and the
  final layer norm's state at the end token, 768 wide (``pooled``; no projection);
- T5 v1.1 XXL (``text_encoder_2``, tokenizer ``tokenizer_2/``, transformers' ``T5TokenizerFast``):
  the prompt as ``max_sequence_length`` tokens (512 for dev, 256 for schnell: the caption, T5's end
  token, padding; longer captions are cut), and the last hidden state (B, L, 4096). The padding is
  not masked (FluxPipeline passes no attention mask), so the states of the padded positions are
  part of the conditioning, as in training.

Tokenization is transformers' (the tokenizers are not reimplemented here). On a GPU each encoder's
forward is replayed from a CUDA graph per batch shape (``cuda_graph``): T5-XXL's 24 layers are
hundreds of launches.
"""
from __future__ import annotations

import pathlib
import warnings

import numpy as np

from .. import nn, runtime
from ..autograd import is_grad_enabled
from ..graphs import CapturedStep
from ..ops.creation import tensor
from .clip_text import CLIPTextConfig, CLIPTextModel, find_eos
from .sdxl_text import CONTEXT, load_tokenizer, prompt_list
from .t5 import T5EncoderModel

MAX_SEQUENCE_LENGTH = {"dev": 512, "schnell": 256}  # T5 tokens FluxPipeline encodes per prompt by default
_T5_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


def load_t5_tokenizer(folder):
    """transformers' fast T5 tokenizer from ``folder`` (``tokenizer.json``, or ``spiece.model``,
    which needs sentencepiece to convert); FileNotFoundError names a missing folder or file."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"T5 tokenizer: the folder {folder} does not exist (a Flux pipeline folder holds "
                                "tokenizer_2/)")
    if not any((folder / f).is_file() for f in _T5_TOKENIZER_FILES):
        raise FileNotFoundError(f"T5 tokenizer: {folder} has no {' or '.join(_T5_TOKENIZER_FILES)}")
    from transformers import T5TokenizerFast  # lazily: a slow import that only tokenization needs
    return T5TokenizerFast.from_pretrained(str(folder))


class FluxTextEncoders(nn.Module):
    """Flux's two text encoders (children ``text_encoder``: CLIP-L, ``text_encoder_2``: T5) with
    their tokenizers.

    ``encode(prompts, max_sequence_length=512)`` -> (T5 states (B, max_sequence_length, text_dim),
    pooled CLIP-L (B, pooled_dim)), in each encoder's dtype; ``tokenize`` and ``encode_tokens`` are
    its two halves (host token ids, then the device work).
    """

    def __init__(self, text_encoder: CLIPTextModel, text_encoder_2: T5EncoderModel, tokenizer, tokenizer_2):
        super().__init__()
        if not isinstance(text_encoder, CLIPTextModel):
            raise TypeError(f"FluxTextEncoders: text_encoder must be a CLIPTextModel, got "
                            f"{type(text_encoder).__name__}")
        if not isinstance(text_encoder_2, T5EncoderModel):
            raise TypeError(f"FluxTextEncoders: text_encoder_2 must be a T5EncoderModel, got "
                            f"{type(text_encoder_2).__name__}")
        if text_encoder.config.max_position_embeddings < CONTEXT:
            raise ValueError(f"FluxTextEncoders: text_encoder has {text_encoder.config.max_position_embeddings} "
                             f"positions, Flux encodes {CONTEXT}")
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.tokenizers = (tokenizer, tokenizer_2)
        self.cuda_graph = True
        self._steps = (CapturedStep(text_encoder.__call__), CapturedStep(text_encoder_2.__call__))
        self._warned = set()

    @classmethod
    def from_pretrained(cls, path, dtype=None, tokenizer_path=None, text_encoder=None,
                        text_encoder_2=None) -> FluxTextEncoders:
        """Both encoders of a diffusers Flux pipeline folder (``text_encoder/``, ``text_encoder_2/``),
        weights in ``dtype`` (flame's default when None); the tokenizers from ``tokenizer_path`` (a
        pipeline folder with ``tokenizer/`` and ``tokenizer_2/``), by default ``path``.
        ``text_encoder``, ``text_encoder_2``: other sources of either encoder (a component folder,
        or the single files people download: ``clip_l.safetensors``, ``t5xxl_fp16.safetensors``),
        which ``path`` may then leave out (None). The tokenizers are read first: a missing one fails
        before any weight loads."""
        if path is None and (text_encoder is None or text_encoder_2 is None):
            raise ValueError("FluxTextEncoders.from_pretrained: give a pipeline folder, or both text_encoder= and "
                             "text_encoder_2=")
        source = tokenizer_path if tokenizer_path is not None else path
        if source is None or pathlib.Path(source).is_file():
            raise FileNotFoundError("FluxTextEncoders: the tokenizers come from a pipeline folder with tokenizer/ and "
                                    f"tokenizer_2/: pass tokenizer_path= (got {source})")
        source = pathlib.Path(source)
        tokenizer, tokenizer_2 = load_tokenizer(source / "tokenizer"), load_t5_tokenizer(source / "tokenizer_2")
        clip_source = text_encoder if text_encoder is not None else path
        clip = CLIPTextModel.from_pretrained(clip_source, "text_encoder", dtype, with_projection=False,
                                             config=CLIPTextConfig.sdxl_clip_l()
                                             if pathlib.Path(clip_source).is_file() else None)
        t5 = T5EncoderModel.from_pretrained(text_encoder_2 if text_encoder_2 is not None else path, dtype)
        return cls(clip, t5, tokenizer, tokenizer_2)

    # ---- sizes -----------------------------------------------------------------------------------
    @property
    def text_dim(self) -> int:
        """Width of the T5 states (4096), the transformer's ``joint_attention_dim``."""
        return self.text_encoder_2.config.d_model

    @property
    def pooled_dim(self) -> int:
        """Width of the pooled CLIP-L vector (768), the transformer's ``pooled_projection_dim``."""
        return self.text_encoder.config.hidden_size

    # ---- tokens ----------------------------------------------------------------------------------
    def _warn_cut(self, which, longest, limit):
        if longest > limit and which not in self._warned:
            self._warned.add(which)
            warnings.warn(f"FluxTextEncoders: a caption of {longest} {which} tokens was cut to {limit} (as "
                          "FluxPipeline does). Shown once per FluxTextEncoders.", stacklevel=3)

    def tokenize(self, prompts, max_sequence_length: int = 512) -> tuple:
        """(CLIP ids (B, 77), T5 ids (B, max_sequence_length)) of ``prompts``, int64 NumPy arrays
        padded and cut as FluxPipeline's tokenizer calls do (a warning the first time a caption is
        cut)."""
        prompts = prompt_list(prompts, "FluxTextEncoders: prompts")
        if not isinstance(max_sequence_length, int) or isinstance(max_sequence_length, bool) or \
                not 1 <= max_sequence_length <= 512:
            raise ValueError(f"FluxTextEncoders: max_sequence_length must be an int in [1, 512], got "
                             f"{max_sequence_length!r}")
        out = []
        for which, tok, length in (("CLIP", self.tokenizers[0], CONTEXT), ("T5", self.tokenizers[1],
                                                                          max_sequence_length)):
            full = tok(prompts, verbose=False)["input_ids"]
            self._warn_cut(which, max(len(ids) for ids in full), length)
            ids = tok(prompts, padding="max_length", max_length=length, truncation=True, verbose=False)["input_ids"]
            out.append(np.asarray(ids, dtype=np.int64))
        return tuple(out)

    # ---- encoding --------------------------------------------------------------------------------
    def encode_tokens(self, clip_ids, t5_ids) -> tuple:
        """(T5 states (B, L, text_dim), pooled (B, pooled_dim)) of ``tokenize``'s arrays."""
        clip_ids, t5_ids = np.asarray(clip_ids), np.asarray(t5_ids)
        if clip_ids.ndim != 2 or t5_ids.ndim != 2 or clip_ids.shape[0] != t5_ids.shape[0] or \
                clip_ids.shape[1] != CONTEXT:
            raise ValueError(f"FluxTextEncoders.encode_tokens: expected CLIP ids (B, {CONTEXT}) and T5 ids (B, L), got "
                             f"{clip_ids.shape} and {t5_ids.shape}")
        graphs = self.cuda_graph and not is_grad_enabled() and not runtime.is_interpreter()
        for step in self._steps:
            step.enabled = graphs
        for enc, ids, vocab in ((self.text_encoder, clip_ids, self.text_encoder.config.vocab_size),
                                (self.text_encoder_2, t5_ids, self.text_encoder_2.config.vocab_size)):
            if ids.min() < 0 or ids.max() >= vocab:  # a graph cannot check on the device
                raise ValueError(f"FluxTextEncoders.encode_tokens: {type(enc).__name__} token ids must lie in "
                                 f"[0, {vocab}), got values in [{ids.min()}, {ids.max()}]")
        eos = tensor(np.asarray(find_eos(clip_ids, self.text_encoder.config.eos_token_id), dtype=np.int64))
        pooled = self._steps[0](tensor(np.ascontiguousarray(clip_ids, dtype=np.int64)), eos).pooled.clone()
        states = self._steps[1](tensor(np.ascontiguousarray(t5_ids, dtype=np.int64))).clone()
        return states, pooled  # cloned: a graph's outputs are overwritten by its next replay

    def encode(self, prompts, max_sequence_length: int = 512) -> tuple:
        """``encode_tokens(*tokenize(prompts, max_sequence_length))``."""
        return self.encode_tokens(*self.tokenize(prompts, max_sequence_length))

    def forward(self, prompts, max_sequence_length: int = 512) -> tuple:
        return self.encode(prompts, max_sequence_length)
