"""SDXL: the UNet a run trains (its config from a name or a diffusers config, its weights from a
checkpoint), trained as a DDPM noise predictor on cached SDXL latents and both text encoders' states."""
from __future__ import annotations

import dataclasses
import os

from ...data import write_synthetic_cache_for
from ...models import SDXLUNet, SDXLUNetConfig
from ..memory import ActivationProfile
from ..objectives import DDPMObjective
from .base import Family, config_from

CONFIG_NAMES = ("tiny", "sdxl")
BLOCKS = ("down", "mid", "up", "other")


def block_of(name: str) -> str:
    """The UNet part a module path belongs to: "down" (``down_blocks.*``), "mid" (``mid_block.*``),
    "up" (``up_blocks.*``) or "other" (conv_in, the time and text-time embeddings, conv_out)."""
    head = name.split(".", 1)[0]
    return {"down_blocks": "down", "mid_block": "mid", "up_blocks": "up"}.get(head, "other")


def unet_config(spec) -> SDXLUNetConfig:
    """``"tiny"`` (SDXLUNetConfig.tiny()), ``"sdxl"`` (SDXL base), an ``SDXLUNetConfig``, or the path
    of a diffusers UNet ``config.json`` (or of a folder holding one, directly or in ``unet/``)."""
    return config_from(spec, {"tiny": SDXLUNetConfig.tiny, "sdxl": SDXLUNetConfig}, SDXLUNetConfig, "unet", "UNet")


def is_sdxl_architecture(config) -> bool:
    """Whether ``config`` is SDXL's UNet (any ``sample_size``): the model the kernel lists in
    ``configs/kernels/`` were recorded for."""
    return (isinstance(config, SDXLUNetConfig)
            and dataclasses.replace(config, sample_size=SDXLUNetConfig.sample_size) == SDXLUNetConfig())


def build_unet(path=None, config="sdxl", dtype=None, **placement) -> SDXLUNet:
    """``SDXLUNet.from_pretrained(path, **placement)`` when ``path`` is given (a diffusers ``unet/`` or
    pipeline folder, or one .safetensors file whose architecture is ``config``), else a random init of
    ``config``."""
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"model.path {path!r} does not exist")
        single_file = os.path.isfile(path)
        return SDXLUNet.from_pretrained(path, dtype=dtype, config=unet_config(config) if single_file else None,
                                        **placement)
    return SDXLUNet(unet_config(config), dtype=dtype)


class SDXLFamily(Family):
    """SDXL's ``Family``."""

    name = "sdxl"
    config_names = CONFIG_NAMES
    lora_prefix = "unet"
    blocks = BLOCKS
    full_precision_layers = (r"re:(time_embedding|add_embedding)\..*",)
    base_model_version = "sdxl_base_v1-0"
    architecture = "stable-diffusion-xl-v1-base/lora"
    diffusers_class = "UNet2DConditionModel"
    diffusers_subfolder = "unet"
    activation_profile = ActivationProfile(
        tokens=128 * 128, per_block=0.0413, rest=0.47,
        measured="H200, scripts/bench_sdxl.py --batch 1 --resolution 1024 --checkpointing off|on --checkpoint-blocks "
                 "20/40/87: peaks 9.23/8.42/7.61/5.64 GiB, LoRA rank 16 on attn")

    def model_config(self, spec):
        return unet_config(spec)

    def build(self, path, config, dtype, **placement):
        return build_unet(path, config, dtype, **placement)

    def layer_names(self, mcfg, kind: str) -> list:
        return SDXLUNet.layer_names(mcfg, kind)

    def parameter_names(self, mcfg) -> list:
        return list(SDXLUNet.parameter_shapes(mcfg))  # diffusers' names: diffusers_tensors keeps them

    def lora_targets(self, targets):
        return targets  # flame.nn.lora's presets are SDXL's

    def cache_dims(self, mcfg) -> dict:
        return {"latent_channels": mcfg.in_channels, "text_dim": mcfg.cross_attention_dim,
                "pooled_dim": mcfg.pooled_dim}

    def write_synthetic_cache(self, path, num_samples, mcfg, latent_sizes, **kwargs):
        return write_synthetic_cache_for(path, num_samples, mcfg, latent_sizes, **kwargs)

    def kernel_list(self, mcfg) -> str | None:
        return "" if is_sdxl_architecture(mcfg) else None

    def block_of(self, name: str) -> str:
        return block_of(name)

    def lr_scales(self, lora_cfg) -> dict:
        return {"down": lora_cfg.lr_down, "mid": lora_cfg.lr_mid, "up": lora_cfg.lr_up, "other": 1.0}

    def objective(self, cfg, log):
        return DDPMObjective(cfg.diffusion, cfg.model.path, log)

    def conditioning(self, batch, latent_shape, text_len) -> tuple:
        """The step's inputs besides latents, text states and pooled vector: SDXL's size/crop ids."""
        return (batch.time_ids,)

    def predict(self, model, noisy, levels, embeds, pooled, time_ids):
        return model(noisy, levels, embeds, pooled, time_ids)

    def make_samples(self, sample_cfg, source, dtype, mcfg, text_encoders=None):
        from ..samples import sdxl_samples
        return sdxl_samples(sample_cfg, source, dtype, default_size=8 * mcfg.sample_size, text_encoders=text_encoders)
