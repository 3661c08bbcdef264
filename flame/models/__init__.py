"""Models with diffusers-compatible parameter names: the SDXL UNet (``SDXLUNet``, ``SDXLUNetConfig``)
and its LDM/SGM checkpoint name map (``flame.models.sdxl_keys``)."""
from .sdxl_keys import diffusers_to_ldm, ldm_to_diffusers
from .sdxl_unet import SDXLUNet, SDXLUNetConfig

__all__ = ["SDXLUNet", "SDXLUNetConfig", "diffusers_to_ldm", "ldm_to_diffusers"]
