"""Which model family a checkpoint holds: ``checkpoint_family(path)`` -> "flux", "sdxl" or None.

A pipeline folder says it in ``model_index.json`` (``_class_name``), a component folder in its
``config.json`` (directly, or in ``transformer/`` or ``unet/``); a single ``.safetensors`` file by
its tensor names (read from the header only): a Flux transformer has BFL's or diffusers' names of
its first double block, anything else is taken for an SDXL checkpoint.
"""
from __future__ import annotations

import json
import os

from ..io import stored_shapes

PIPELINE_CLASSES = {"FluxPipeline": "flux", "StableDiffusionXLPipeline": "sdxl"}
MODEL_CLASSES = {"FluxTransformer2DModel": "flux", "UNet2DConditionModel": "sdxl"}
# tensor names only a Flux single file has (BFL's layout, or diffusers' names in one file)
FLUX_SINGLE_FILE_MARKS = ("double_blocks.0.img_attn.qkv.weight", "transformer_blocks.0.attn.add_q_proj.weight")


def class_name(path):
    """The ``_class_name`` of a diffusers JSON file, None when it is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def config_family(path):
    """The family of a diffusers model ``config.json`` or of a folder holding one (directly, in
    ``transformer/`` or in ``unet/``); None if none names a known model class."""
    candidates = ([os.path.join(path, sub, "config.json") for sub in ("", "transformer", "unet")]
                  if os.path.isdir(path) else [path])
    for candidate in candidates:
        if class_name(candidate) in MODEL_CLASSES:
            return MODEL_CLASSES[class_name(candidate)]
    return None


def checkpoint_family(path):
    """The family of the checkpoint at ``path`` (see the module docstring); None for a folder that
    names no known pipeline or model, or a path that does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        name = class_name(os.path.join(path, "model_index.json"))
        return PIPELINE_CLASSES[name] if name in PIPELINE_CLASSES else config_family(path)
    if os.path.isfile(path):
        try:
            keys = stored_shapes(path)
        except (OSError, ValueError):
            keys = {}
        return "flux" if any(k.endswith(FLUX_SINGLE_FILE_MARKS) for k in keys) else "sdxl"
    return None
