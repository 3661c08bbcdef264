"""Models with diffusers / transformers parameter names, loaded from diffusers pipeline folders or
single-file (LDM/SGM) checkpoints through one loader (``flame.models.checkpoints``): the SDXL UNet
(``SDXLUNet``), SDXL's two CLIP text encoders with their tokenizers (``SDXLTextEncoders``,
``CLIPTextModel``) and its VAE (``AutoencoderKL``); the Flux.1 transformer (``FluxTransformer2DModel``,
BFL names, diffusers or BFL files); Flux's T5 v1.1 text encoder (``T5EncoderModel``)."""
from .clip_text import CLIPTextConfig, CLIPTextModel, CLIPTextOutput, find_eos, openclip_to_transformers
from .flux import FluxConfig, FluxTransformer2DModel
from .sdxl_config import SDXLUNetConfig
from .sdxl_keys import diffusers_to_ldm, ldm_to_diffusers
from .sdxl_text import SDXLTextEncoders
from .sdxl_unet import SDXLUNet
from .t5 import T5Config, T5EncoderModel
from .vae import AutoencoderKL, AutoencoderKLConfig, DiagonalGaussian, diffusers_to_ldm_vae, ldm_to_diffusers_vae

__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "CLIPTextConfig", "CLIPTextModel", "CLIPTextOutput",
           "DiagonalGaussian", "FluxConfig", "FluxTransformer2DModel", "SDXLTextEncoders", "SDXLUNet",
           "SDXLUNetConfig", "T5Config", "T5EncoderModel", "diffusers_to_ldm", "diffusers_to_ldm_vae", "find_eos",
           "ldm_to_diffusers", "ldm_to_diffusers_vae", "openclip_to_transformers"]
