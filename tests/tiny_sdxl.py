"""A tiny SDXL pipeline folder in diffusers' layout, for pipeline, cache and trainer tests.

Its UNet (``UNET``) is smaller than ``SDXLUNetConfig.tiny()`` to keep the interpreter's launches few:
two levels, one resnet per down block, one transformer block per attention level (cross-attention
32 = 12 + 20 text features, pooled 16, latents a multiple of 2); the
text encoders and tokenizers are ``test_clip_text``'s tiny ones (2-layer CLIP models 12 and 20 wide,
CLIP-L-like and bigG-like with a 16-wide projection; letter tokenizers with SDXL's padding); the
VAE has two 8-channel blocks (2x down/up-sampling where SDXL's has 8x: half the launches; its
32-pixel sample size makes images up to 32x32 decode untiled). All weights are seeded random.
"""
import json

import torch
from test_clip_text import write_tiny_text_encoders

from flame.models import SDXLUNetConfig

UNET = SDXLUNetConfig(sample_size=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                      up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(32, 48),
                      layers_per_block=1, transformer_layers_per_block=(1, 1), attention_head_dim=(1, 2),
                      cross_attention_dim=32, norm_num_groups=8, addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=16 + 6 * 8)

MODEL_INDEX = {  # what diffusers' StableDiffusionXLPipeline.save_pretrained writes for these parts
    "_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
    "feature_extractor": [None, None], "image_encoder": [None, None],
    "scheduler": ["diffusers", "EulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def write_tiny_pipeline(path, vae_levels=2):
    """Write the tiny pipeline into ``path`` (created); returns ``path``. ``vae_levels``: the VAE's
    blocks (2: 2x down-sampling; 4: SDXL's 8x, for training on images of the smallest bucket, 64 px,
    at the UNet's 8x8 sample size)."""
    import diffusers
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**UNET.to_diffusers()).save_pretrained(path / "unet")
    diffusers.AutoencoderKL(block_out_channels=(8,) * vae_levels, down_block_types=("DownEncoderBlock2D",) * vae_levels,
                            up_block_types=("UpDecoderBlock2D",) * vae_levels, latent_channels=4, norm_num_groups=4,
                            sample_size=32, scaling_factor=0.13025).save_pretrained(path / "vae")
    write_tiny_text_encoders(path)
    diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                     timestep_spacing="leading", steps_offset=1).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    return path
