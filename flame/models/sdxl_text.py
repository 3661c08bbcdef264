"""SDXL's prompt conditioning: both tokenizers and both CLIP text encoders (``SDXLTextEncoders``).

Tokenization is transformers' ``CLIPTokenizer`` (BPE is not reimplemented here), loaded from a
pipeline folder's ``tokenizer/`` and ``tokenizer_2/``. The two differ only in padding: CLIP-L's
pads with its end token, bigG's ``tokenizer_2`` with "!" (id 0).

Long captions follow kohya's scheme. A caption's tokens (without start/end tokens) are cut into
windows of 75; each window is encoded on its own as the 77-token sequence

    BOS, its (up to) 75 tokens, EOS, padding

(an empty window is BOS, EOS, padding). ``max_tokens`` (75, 150 or 225) fixes the number of windows
W for a whole batch; longer captions are cut, with one warning per ``SDXLTextEncoders`` object.
The windows' hidden states are put back together as

    window 0's BOS state, windows 0..W-1's 75 inner states in order, window W-1's last state

i.e. 2 + 75 W states; with one window that is the plain 77-token encoding diffusers'
``StableDiffusionXLPipeline.encode_prompt`` computes. The prompt embedding concatenates both
encoders' penultimate states on features (768 + 1280 = 2048 in SDXL); the pooled embedding is
bigG's projected EOS state of the first window (1280).
"""
from __future__ import annotations

import pathlib
import warnings

import numpy as np

from .. import nn, runtime
from ..autograd import is_grad_enabled
from ..graphs import CapturedStep
from ..ops.creation import tensor
from ..ops.shape import cat
from .clip_text import CLIPTextModel, find_eos

CONTEXT = 77  # tokens per encoded sequence (the encoders' positions)
WINDOW = CONTEXT - 2  # caption tokens per window, between BOS and EOS/padding
MAX_TOKENS = (WINDOW, 2 * WINDOW, 3 * WINDOW)
TOKENIZER_FOLDERS = ("tokenizer", "tokenizer_2")
_TOKENIZER_FILES = ("vocab.json", "merges.txt")  # or transformers' single tokenizer.json


def load_tokenizer(folder):
    """transformers' ``CLIPTokenizer`` from ``folder`` (``vocab.json`` and ``merges.txt``, or
    ``tokenizer.json``, with its ``tokenizer_config.json``); FileNotFoundError names the folder
    and the missing files."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"SDXL tokenizer: the folder {folder} does not exist (a pipeline folder holds "
                                f"{' and '.join(TOKENIZER_FOLDERS)})")
    missing = [f for f in _TOKENIZER_FILES if not (folder / f).is_file()]
    if missing and not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"SDXL tokenizer: {folder} has no {' or '.join(missing)} (nor a tokenizer.json)")
    from transformers import CLIPTokenizer  # lazily: a slow import that only tokenization needs
    return CLIPTokenizer.from_pretrained(str(folder))


def prompt_list(prompts, what: str = "SDXLTextEncoders: prompts") -> list:
    """``prompts`` (a string, or a non-empty list or tuple of strings) as a list; ValueError naming
    ``what`` otherwise."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts) if isinstance(prompts, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{what} must be a string or a non-empty list of strings")
    return prompts


def _stitch(states, batch, windows):
    """(batch * windows, 77, D) window states -> (batch, 2 + 75 * windows, D), kohya's order (the
    module docstring); one window is returned as it is."""
    if windows == 1:
        return states
    D = states.shape[-1]
    h = states.reshape(batch, windows, CONTEXT, D)
    inner = h[:, :, 1:-1].reshape(batch, windows * WINDOW, D)
    return cat([h[:, 0, :1], inner, h[:, windows - 1, -1:]], 1)


class SDXLTextEncoders(nn.Module):
    """SDXL's two text encoders (children ``text_encoder``: CLIP-L, ``text_encoder_2``: OpenCLIP
    bigG with projection, transformers' parameter names below each) with their tokenizers.

    ``encode(prompts, max_tokens=75)`` -> (prompt embeddings (B, 2 + max_tokens, text_dim),
    pooled (B, pooled_dim)), in the encoders' dtype; ``tokenize`` and ``encode_tokens`` are its two
    halves (host token ids, then the device work). On a GPU each encoder's forward is replayed from
    a CUDA graph per batch shape (``cuda_graph``; the 44 layers are about 700 launches, whose host
    cost would otherwise exceed their GPU time): the graphs take the ids and end positions as
    device tensors, and their outputs are copied out before the next call.
    """

    def __init__(self, text_encoder: CLIPTextModel, text_encoder_2: CLIPTextModel, tokenizer, tokenizer_2):
        super().__init__()
        for name, enc in (("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2)):
            if not isinstance(enc, CLIPTextModel):
                raise TypeError(f"SDXLTextEncoders: {name} must be a CLIPTextModel, got {type(enc).__name__}")
            if enc.config.max_position_embeddings < CONTEXT:
                raise ValueError(f"SDXLTextEncoders: {name} has {enc.config.max_position_embeddings} positions, "
                                 f"SDXL encodes {CONTEXT}")
        if not text_encoder_2.with_projection:
            raise ValueError("SDXLTextEncoders: text_encoder_2 needs its text_projection (the pooled embedding)")
        if text_encoder.dtype != text_encoder_2.dtype:
            raise ValueError(f"SDXLTextEncoders: the encoders' dtypes differ ({text_encoder.dtype}, "
                             f"{text_encoder_2.dtype}); their states are concatenated")
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.tokenizers = (tokenizer, tokenizer_2)
        self._warned_truncation = False
        self.cuda_graph = True
        self._steps = [CapturedStep(enc.__call__) for enc in (text_encoder, text_encoder_2)]

    @classmethod
    def from_pretrained(cls, path, dtype=None, tokenizer_path=None, configs=None) -> SDXLTextEncoders:
        """Both encoders of a diffusers SDXL pipeline folder (``text_encoder/``, ``text_encoder_2/``)
        or of one single-file SDXL checkpoint (``.safetensors``), weights in ``dtype`` (flame's
        default when None); the tokenizers from ``tokenizer_path`` (a pipeline folder with
        ``tokenizer/`` and ``tokenizer_2/``), by default ``path`` itself, which a single file
        cannot be. ``configs``: the two ``CLIPTextConfig``s of a single file (default SDXL's; a
        folder's config.json files must agree with them). The tokenizers are read first: a missing
        one fails before any weight loads."""
        source = pathlib.Path(tokenizer_path if tokenizer_path is not None else path)
        if source.is_file():
            raise FileNotFoundError(f"SDXLTextEncoders: {source} is a single file, which holds no tokenizers: pass "
                                    "tokenizer_path=, a pipeline folder with tokenizer/ and tokenizer_2/")
        tokenizers = [load_tokenizer(source / name) for name in TOKENIZER_FOLDERS]
        config, config_2 = configs if configs is not None else (None, None)
        text_encoder = CLIPTextModel.from_pretrained(path, "text_encoder", dtype, with_projection=False, config=config)
        text_encoder_2 = CLIPTextModel.from_pretrained(path, "text_encoder_2", dtype, with_projection=True,
                                                       config=config_2)
        return cls(text_encoder, text_encoder_2, *tokenizers)

    # ---- SDXL's sizes ----------------------------------------------------------------------------
    @property
    def text_dim(self) -> int:
        """Width of the prompt embedding: both encoders' hidden sizes (768 + 1280 = 2048), the UNet's
        cross_attention_dim."""
        return self.text_encoder.config.hidden_size + self.text_encoder_2.config.hidden_size

    @property
    def pooled_dim(self) -> int:
        """Width of the pooled embedding: bigG's projection (1280)."""
        return self.text_encoder_2.config.projection_dim

    @property
    def dtype(self):
        return self.text_encoder.dtype

    @staticmethod
    def sequence_length(max_tokens: int = WINDOW) -> int:
        """Length of the prompt embedding for ``max_tokens``: 2 + max_tokens (77, 152 or 227)."""
        if max_tokens not in MAX_TOKENS:
            raise ValueError(f"SDXLTextEncoders: max_tokens must be one of {MAX_TOKENS}, got {max_tokens!r}")
        return 2 + max_tokens

    # ---- tokens ----------------------------------------------------------------------------------
    def tokenize(self, prompts, max_tokens: int = WINDOW) -> list:
        """Token ids of ``prompts`` (a string or a list) for each encoder: [ids, ids_2], int64
        arrays (B, max_tokens // 75, 77), one row per window as the module docstring lays them out.
        Captions longer than ``max_tokens`` are cut (a warning the first time)."""
        prompts = prompt_list(prompts)
        windows = (self.sequence_length(max_tokens) - 2) // WINDOW
        out, longest = [], 0
        for tok in self.tokenizers:
            captions = tok(prompts, add_special_tokens=False, verbose=False)["input_ids"]
            ids = np.full((len(prompts), windows, CONTEXT), tok.pad_token_id, dtype=np.int64)
            ids[:, :, 0] = tok.bos_token_id
            for b, caption in enumerate(captions):
                longest = max(longest, len(caption))
                for w in range(windows):
                    part = caption[w * WINDOW:(w + 1) * WINDOW]
                    ids[b, w, 1:1 + len(part)] = part
                    ids[b, w, 1 + len(part)] = tok.eos_token_id
            out.append(ids)
        if longest > max_tokens and not self._warned_truncation:
            self._warned_truncation = True
            more = f"; max_tokens={MAX_TOKENS[-1]} keeps up to {MAX_TOKENS[-1]}" if max_tokens < MAX_TOKENS[-1] else ""
            warnings.warn(f"SDXLTextEncoders: a caption of {longest} tokens was cut to max_tokens={max_tokens} "
                          f"({longest - max_tokens} tokens dropped{more}). Shown once per SDXLTextEncoders.",
                          stacklevel=2)
        return out

    # ---- encoding --------------------------------------------------------------------------------
    def encode_tokens(self, ids) -> tuple:
        """(prompt embeddings (B, 2 + 75 W, text_dim), pooled (B, pooled_dim)) of ``tokenize``'s
        output ``ids``: each encoder runs all B x W windows as one batch; the penultimate states are
        re-assembled per caption and concatenated on features, the pooled embedding is bigG's
        projected EOS state of each caption's first window."""
        if len(ids) != 2:
            raise ValueError(f"SDXLTextEncoders.encode_tokens: expected one id array per encoder (2), got {len(ids)}")
        arrays = [np.asarray(a) for a in ids]
        shape = arrays[0].shape
        if len(shape) != 3 or shape[2] != CONTEXT or shape[1] * WINDOW not in MAX_TOKENS or arrays[1].shape != shape:
            raise ValueError(f"SDXLTextEncoders.encode_tokens: expected two integer arrays (B, windows 1 to 3, "
                             f"{CONTEXT}) of one shape, got {[a.shape for a in arrays]}")
        B, W, _ = shape
        rows, eos = [], []
        for enc, a in zip((self.text_encoder, self.text_encoder_2), arrays):
            r = np.ascontiguousarray(a.reshape(B * W, CONTEXT), dtype=np.int64)
            if r.min() < 0 or r.max() >= enc.config.vocab_size:  # the graph cannot check on the device
                raise ValueError(f"SDXLTextEncoders.encode_tokens: token ids must lie in [0, {enc.config.vocab_size}), "
                                 f"got values in [{r.min()}, {r.max()}]")
            rows.append(tensor(r))
            eos.append(tensor(np.asarray(find_eos(r, enc.config.eos_token_id), dtype=np.int64)))
        embeds, pooled = self.encode_rows(rows, eos, B)
        return embeds, pooled.clone()  # the cat in encode_rows copies the states out of the graph, this the pooled

    def encode_rows(self, rows, eos, batch: int) -> tuple:
        """The device half of ``encode_tokens``: (prompt embeddings, pooled) of ``rows``, each
        encoder's (batch * W, 77) int64 token ids as ``tokenize`` lays them out (W windows per
        caption), and ``eos``, each encoder's (batch * W,) int64 pooled positions (``find_eos``), all
        flame Tensors on the device. No host read or upload: a captured training step can run it,
        with gradients to the encoders' adapters (their own CUDA graphs only replay without grad).
        The pooled embedding may be a graph's output buffer, overwritten by the next call."""
        W = rows[0].shape[0] // batch
        states = []
        for enc, step, ids, positions in zip((self.text_encoder, self.text_encoder_2), self._steps, rows, eos):
            step.enabled = self.cuda_graph and not is_grad_enabled() and not runtime.is_interpreter()
            out = (step if step.enabled else enc)(ids, positions)
            states.append(_stitch(out.penultimate, batch, W))  # the cat below copies them out of the graph
        pooled = out.text_embeds if W == 1 else out.text_embeds.reshape(batch, W, -1)[:, 0]
        return cat(states, -1), pooled

    def encode(self, prompts, max_tokens: int = WINDOW) -> tuple:
        """``encode_tokens(tokenize(prompts, max_tokens))``: (prompt embeddings (B, 2 + max_tokens,
        text_dim), pooled (B, pooled_dim)) as flame Tensors."""
        return self.encode_tokens(self.tokenize(prompts, max_tokens))

    def forward(self, prompts, max_tokens: int = WINDOW) -> tuple:
        return self.encode(prompts, max_tokens)

