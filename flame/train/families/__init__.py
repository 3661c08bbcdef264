"""Model families the trainer knows: what differs between training an SDXL UNet and a Flux
transformer, behind one interface (``Family``), so that the trainer has one loop, one
checkpoint/resume path and one CLI for both.

A family says how to build its model (a config name, a diffusers config, a folder or a single
file), which names its Linear/Conv2d layers have (for LoRA targets, checked before any weight is
read), its LoRA presets and file prefixes, the cache fields its model reads, how a synthetic cache
looks, what objective it trains (``flame.train.objectives``), the conditioning tensors of a batch
besides the text embeddings, how a prediction is made from noised latents, and its kohya/modelspec
metadata. ``detect(path, config)`` picks the family of a checkpoint or config name.
"""
from __future__ import annotations

import os

from ...models.families import checkpoint_family, config_family
from .flux import FluxFamily
from .sdxl import SDXLFamily

FAMILIES = {"sdxl": SDXLFamily, "flux": FluxFamily}
CONFIG_NAMES = tuple(dict.fromkeys(n for f in FAMILIES.values() for n in f.config_names))


def detect(path, config) -> str:
    """The family of ``model.path`` (``flame.models.families.checkpoint_family``: a pipeline
    folder's model_index.json, a component folder's config.json, or a single file's tensor names),
    else of ``model.config`` (a family's config name, or a diffusers config.json); SDXL when nothing
    says otherwise (``"tiny"``: SDXL's tiny UNet; set ``model.family: flux`` for the tiny Flux)."""
    if path and os.path.exists(path):
        found = checkpoint_family(path)
        if found is not None:
            return found
    for family, cls in FAMILIES.items():
        if config in cls.config_names and config != "tiny":
            return family
    if isinstance(config, str) and os.path.exists(config):
        return config_family(config) or "sdxl"
    return "sdxl"


def get(name: str, cfg=None):
    """The family object for ``name`` ("sdxl" or "flux") in a run of config ``cfg``."""
    return FAMILIES[name](cfg)
