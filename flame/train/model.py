"""The UNet a run trains: its config from a name or a diffusers config, its weights from a checkpoint."""
from __future__ import annotations

import dataclasses
import json
import os

from ..models import SDXLUNet, SDXLUNetConfig

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
    if isinstance(spec, SDXLUNetConfig):
        return spec
    if spec == "tiny":
        return SDXLUNetConfig.tiny()
    if spec == "sdxl":
        return SDXLUNetConfig()
    path = os.fspath(spec)
    for candidate in (path, os.path.join(path, "config.json"), os.path.join(path, "unet", "config.json")):
        if os.path.isfile(candidate):
            with open(candidate) as f:
                return SDXLUNetConfig.from_diffusers(json.load(f))
    raise ValueError(f"model config must be one of {CONFIG_NAMES} or a diffusers UNet config.json (or a folder "
                     f"holding one), got {spec!r}")


def is_sdxl_architecture(config) -> bool:
    """Whether ``config`` is SDXL's UNet (any ``sample_size``): the model the kernel lists in
    ``configs/kernels/`` were recorded for."""
    return (isinstance(config, SDXLUNetConfig)
            and dataclasses.replace(config, sample_size=SDXLUNetConfig.sample_size) == SDXLUNetConfig())


def build_unet(path=None, config="sdxl", dtype=None) -> SDXLUNet:
    """``SDXLUNet.from_pretrained(path)`` when ``path`` is given (a diffusers ``unet/`` or pipeline
    folder, or one .safetensors file whose architecture is ``config``), else a random init of ``config``."""
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"model.path {path!r} does not exist")
        single_file = os.path.isfile(path)
        return SDXLUNet.from_pretrained(path, dtype=dtype, config=unet_config(config) if single_file else None)
    return SDXLUNet(unet_config(config), dtype=dtype)
