"""SDXL UNet checkpoints: the diffusers <-> original LDM/SGM (kohya, ComfyUI, A1111) name map, and
loading a checkpoint's tensors into an ``SDXLUNet``.

The map, with n = layers_per_block + 1 (3 in SDXL):

- ``down_blocks.i.resnets.j`` <-> ``input_blocks.{n*i + j + 1}.0``, ``down_blocks.i.attentions.j`` <->
  ``input_blocks.{n*i + j + 1}.1``, ``down_blocks.i.downsamplers.0.conv`` <-> ``input_blocks.{n*(i + 1)}.0.op``;
- ``mid_block.resnets.j`` <-> ``middle_block.{2j}``, ``mid_block.attentions.0`` <-> ``middle_block.1``;
- ``up_blocks.i.resnets.j`` <-> ``output_blocks.{n*i + j}.0``, ``up_blocks.i.attentions.j`` <->
  ``output_blocks.{n*i + j}.1``, ``up_blocks.i.upsamplers.0`` <-> ``output_blocks.{n*i + n - 1}.2``
  (``.1`` when the block has no attentions);
- inside resnets ``norm1, conv1, norm2, conv2, time_emb_proj, conv_shortcut`` <-> ``in_layers.0,
  in_layers.2, out_layers.0, out_layers.3, emb_layers.1, skip_connection``; names inside the
  transformers are the same in both;
- ``conv_in`` <-> ``input_blocks.0.0``, ``time_embedding.linear_{1,2}`` <-> ``time_embed.{0,2}``,
  ``add_embedding.linear_{1,2}`` <-> ``label_emb.0.{0,2}``, ``conv_norm_out`` <-> ``out.0``,
  ``conv_out`` <-> ``out.2``.

Full SGM checkpoints prefix the UNet with ``model.diffusion_model.`` (and hold the VAE and text
encoders under other prefixes, which loading ignores).
"""
from __future__ import annotations

import re

from .checkpoints import Source, stored_tensors
from .sdxl_config import SDXLUNetConfig

LDM_PREFIX = "model.diffusion_model."

_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
        "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0", "conv_out": "out.2"}
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}

_DIFF_BLOCK = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)")
_DIFF_MID = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")
_LDM_BLOCK = re.compile(r"(input_blocks|output_blocks)\.(\d+)\.(\d+)\.(.+)")
_LDM_MID = re.compile(r"middle_block\.(\d+)\.(.+)")


def _config(config):
    return config if config is not None else SDXLUNetConfig()


def _rename_prefix(rest, table, key, direction):
    for src, dst in table.items():
        if rest.startswith(src + "."):
            return dst + rest[len(src):]
    raise ValueError(f"no {direction} name for {key!r}")


def diffusers_to_ldm(key: str, config=None) -> str:
    """The LDM/SGM name (without ``model.diffusion_model.``) of a diffusers UNet state-dict key;
    ``config`` (an SDXLUNetConfig, default SDXL base) gives layers_per_block and which up blocks
    have attentions. Raises ValueError for a key outside the map."""
    cfg = _config(config)
    n = cfg.layers_per_block + 1
    for src, dst in _TOP.items():
        if key.startswith(src + "."):
            return dst + key[len(src):]
    m = _DIFF_MID.fullmatch(key)
    if m:
        kind, j, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * j}." + _rename_prefix(rest, _RESNET, key, "LDM")
    m = _DIFF_BLOCK.fullmatch(key)
    if not m:
        raise ValueError(f"no LDM name for {key!r}")
    blocks, i, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
    if blocks == "down_blocks":
        if kind == "downsamplers":
            return f"input_blocks.{n * (i + 1)}.0.op." + rest.removeprefix("conv.")
        base = f"input_blocks.{n * i + j + 1}"
    else:
        if kind == "upsamplers":
            slot = 2 if cfg.up_block_types[i] == "CrossAttnUpBlock2D" else 1
            return f"output_blocks.{n * i + n - 1}.{slot}.{rest}"
        base = f"output_blocks.{n * i + j}"
    if kind == "attentions":
        return f"{base}.1.{rest}"
    return f"{base}.0." + _rename_prefix(rest, _RESNET, key, "LDM")


_RESNET_BACK = {v: k for k, v in _RESNET.items()}


def ldm_to_diffusers(key: str, config=None) -> str:
    """The diffusers name of an LDM/SGM UNet key (a leading ``model.diffusion_model.`` is
    dropped); ``config`` gives layers_per_block (default SDXL base). Raises ValueError for a key
    outside the map."""
    n = _config(config).layers_per_block + 1
    key = key.removeprefix(LDM_PREFIX)
    for dst, src in _TOP.items():
        if key.startswith(src + "."):
            return dst + key[len(src):]
    m = _LDM_MID.fullmatch(key)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == 1:
            return f"mid_block.attentions.0.{rest}"
        if idx in (0, 2):
            return f"mid_block.resnets.{idx // 2}." + _rename_prefix(rest, _RESNET_BACK, key, "diffusers")
        raise ValueError(f"no diffusers name for {key!r}")
    m = _LDM_BLOCK.fullmatch(key)
    if not m:
        raise ValueError(f"no diffusers name for {key!r}")
    blocks, idx, slot, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    if blocks == "input_blocks":
        i, j = divmod(idx - 1, n)
        if j == n - 1 and slot == 0 and rest.startswith("op."):
            return f"down_blocks.{i}.downsamplers.0.conv." + rest[3:]
        prefix = f"down_blocks.{i}"
    else:
        i, j = divmod(idx, n)
        # the upsampler follows the resnet (slot 1) or the resnet and its transformer (slot 2);
        # transformers have no top-level "conv"
        if j == n - 1 and (slot == 2 or (slot == 1 and rest.startswith("conv."))):
            return f"up_blocks.{i}.upsamplers.0.{rest}"
        prefix = f"up_blocks.{i}"
    if slot == 1 and j < n - (blocks == "input_blocks"):
        return f"{prefix}.attentions.{j}.{rest}"
    if slot == 0 and j < n - (blocks == "input_blocks"):
        return f"{prefix}.resnets.{j}." + _rename_prefix(rest, _RESNET_BACK, key, "diffusers")
    raise ValueError(f"no diffusers name for {key!r}")


def to_ldm(state_dict: dict, config=None, prefix: str = LDM_PREFIX) -> dict:
    """A diffusers-named UNet state dict renamed to LDM/SGM names (values shared, not copied)."""
    return {prefix + diffusers_to_ldm(k, config): v for k, v in state_dict.items()}


# ---- checkpoint files -------------------------------------------------------------------------------

def checkpoint_index(files, config=None) -> dict:
    """{diffusers name: ``Source``} for the UNet tensors of ``files``, whose naming (diffusers, LDM,
    or SGM with ``model.diffusion_model.``) is detected from the keys. In an SGM file only the
    prefixed keys are the UNet's; LDM keys outside the map keep their name (and so are reported as
    unexpected)."""
    stored = stored_tensors(files)
    names = list(stored)
    ldm_roots = ("input_blocks.", "middle_block.", "output_blocks.")
    if any(k.startswith(LDM_PREFIX) for k in names):
        names = [k for k in names if k.startswith(LDM_PREFIX)]
        ldm = True
    else:
        ldm = any(k.startswith(ldm_roots) for k in names)
    out = {}
    for k in names:
        name = k
        if ldm:
            try:
                name = ldm_to_diffusers(k, config)
            except ValueError:
                name = k
        out[name] = Source(stored[k][0], k, stored[k][1])
    return out
