"""A tiny SDXL pipeline folder in diffusers' layout, for pipeline, cache and trainer tests.

Its UNet is ``SDXLUNetConfig.tiny()`` (cross-attention 32 = 12 + 20 text features, pooled 16); the
text encoders are 2-layer CLIP models 12 and 20 wide (CLIP-L-like with quick_gelu; bigG-like with
gelu and a 16-wide projection); the VAE has four 8-channel blocks (8x down/up-sampling, as SDXL's);
the tokenizers know single letters only (every letter is one token), with SDXL's padding (CLIP-L
pads with its end token, the second tokenizer with "!"; the start and end tokens have the largest
ids, as in CLIP's vocabulary). All weights are seeded random.
"""
import json

import torch

from flame.models import SDXLUNetConfig

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def write_tokenizer(folder, pad_token):
    """A letter tokenizer (CLIPTokenizer files) padding with ``pad_token``; returns its vocabulary size."""
    import transformers
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"!": 0}
    for c in LETTERS:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1  # the largest ids, as in CLIP
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77,
                                     pad_token=pad_token)
    tok.save_pretrained(folder)
    return len(vocab)


def write_tiny_pipeline(path):
    """Write the tiny pipeline into ``path`` (created); returns ``path``."""
    import diffusers
    import transformers
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**SDXLUNetConfig.tiny().to_diffusers()).save_pretrained(path / "unet")
    diffusers.AutoencoderKL(block_out_channels=(8,) * 4, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=4,
                            sample_size=32, scaling_factor=0.13025).save_pretrained(path / "vae")
    for name, hidden, act, pad in (("", 12, "quick_gelu", "<|endoftext|>"), ("_2", 20, "gelu", "!")):
        vocab_size = write_tokenizer(path / f"tokenizer{name}", pad)
        cfg = transformers.CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                          projection_dim=16, hidden_act=act, bos_token_id=0, eos_token_id=2,
                                          pad_token_id=1)  # SDXL's legacy ids: pooled at the largest id
        cls = transformers.CLIPTextModel if not name else transformers.CLIPTextModelWithProjection
        cls(cfg).save_pretrained(path / f"text_encoder{name}")
    diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                     timestep_spacing="leading", steps_offset=1).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline",
                                                       "force_zeros_for_empty_prompt": True}))
    return path
