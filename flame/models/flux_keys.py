"""Flux.1 transformer names: flame's model uses Black Forest Labs' layout (the ``flux1-dev.safetensors``
names, fused q/k/v); diffusers' ``FluxTransformer2DModel`` splits the fused projections. This module maps
between them (module paths and parameters), tells the two namings apart in a checkpoint, and reads a
config's sizes from a checkpoint's tensor shapes.

The map, per module (``N`` a block index):

- ``img_in`` <-> ``x_embedder``, ``txt_in`` <-> ``context_embedder``, ``time_in`` / ``vector_in`` /
  ``guidance_in`` ``.in_layer`` / ``.out_layer`` <-> ``time_text_embed.timestep_embedder`` /
  ``text_embedder`` / ``guidance_embedder`` ``.linear_1`` / ``.linear_2``;
- ``double_blocks.N`` <-> ``transformer_blocks.N``: ``img_mod.lin`` <-> ``norm1.linear``, ``txt_mod.lin``
  <-> ``norm1_context.linear``, ``img_attn.qkv`` <-> ``attn.to_q`` + ``to_k`` + ``to_v`` (rows stacked),
  ``txt_attn.qkv`` <-> ``attn.add_q_proj`` + ``add_k_proj`` + ``add_v_proj``, ``img_attn.proj`` <->
  ``attn.to_out.0``, ``txt_attn.proj`` <-> ``attn.to_add_out``, ``{img,txt}_attn.norm.{query,key}_norm``
  (parameter ``scale``) <-> ``attn.norm_q`` / ``norm_k`` / ``norm_added_q`` / ``norm_added_k``
  (``weight``), ``img_mlp.0`` / ``.2`` <-> ``ff.net.0.proj`` / ``ff.net.2``, ``txt_mlp`` <-> ``ff_context``;
- ``single_blocks.N`` <-> ``single_transformer_blocks.N``: ``linear1`` <-> ``attn.to_q`` + ``to_k`` +
  ``to_v`` + ``proj_mlp``, ``linear2`` <-> ``proj_out``, ``modulation.lin`` <-> ``norm.linear``,
  ``norm.{query,key}_norm`` <-> ``attn.norm_q`` / ``norm_k``;
- ``final_layer.linear`` <-> ``proj_out``, ``final_layer.adaLN_modulation.1`` <-> ``norm_out.linear``
  with its two row halves swapped (BFL: shift, scale; diffusers: scale, shift).

Single files with ``model.diffusion_model.`` before the BFL names (whole-pipeline checkpoints) are
read through those keys only.
"""
from __future__ import annotations

import re

BFL_PREFIX = "model.diffusion_model."
# the one Linear whose diffusers counterpart holds its two row halves in the other order
SWAPPED_HALVES = "final_layer.adaLN_modulation.1"

_TOP = {
    "img_in": ("x_embedder",), "txt_in": ("context_embedder",),
    "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
    "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
    "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
    "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
    "guidance_in.in_layer": ("time_text_embed.guidance_embedder.linear_1",),
    "guidance_in.out_layer": ("time_text_embed.guidance_embedder.linear_2",),
    "final_layer.linear": ("proj_out",), SWAPPED_HALVES: ("norm_out.linear",),
}
_DOUBLE = {
    "img_mod.lin": ("norm1.linear",), "txt_mod.lin": ("norm1_context.linear",),
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",), "txt_attn.proj": ("attn.to_add_out",),
    "img_attn.norm.query_norm": ("attn.norm_q",), "img_attn.norm.key_norm": ("attn.norm_k",),
    "txt_attn.norm.query_norm": ("attn.norm_added_q",), "txt_attn.norm.key_norm": ("attn.norm_added_k",),
    "img_mlp.0": ("ff.net.0.proj",), "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",), "txt_mlp.2": ("ff_context.net.2",),
}
_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",), "norm.query_norm": ("attn.norm_q",), "norm.key_norm": ("attn.norm_k",),
}
_BLOCKS = (("double_blocks", "transformer_blocks", _DOUBLE), ("single_blocks", "single_transformer_blocks", _SINGLE))
_BLOCK = re.compile(r"([a-z_]+)\.(\d+)\.(.+)")
_PARAM = {"weight": "weight", "bias": "bias", "scale": "weight"}  # flame (BFL) -> diffusers parameter


def diffusers_modules(path: str) -> tuple:
    """The diffusers module path of each output part of the flame (BFL) module ``path``, in row
    order: ``double_blocks.0.img_attn.qkv`` -> (``transformer_blocks.0.attn.to_q``, ``...to_k``,
    ``...to_v``); ``img_in`` -> (``x_embedder``,). Raises ValueError for a path outside the map."""
    if path in _TOP:
        return _TOP[path]
    m = _BLOCK.fullmatch(path)
    for flame_blocks, diffusers_blocks, table in _BLOCKS:
        if m and m.group(1) == flame_blocks and m.group(3) in table:
            return tuple(f"{diffusers_blocks}.{m.group(2)}.{d}" for d in table[m.group(3)])
    raise ValueError(f"no diffusers name for the Flux module {path!r}")


_BACK = {d: (f, i) for f, ds in _TOP.items() for i, d in enumerate(ds)}
_BACK_BLOCKS = {diffusers_blocks: (flame_blocks, {d: (f, i) for f, ds in table.items() for i, d in enumerate(ds)})
                for flame_blocks, diffusers_blocks, table in _BLOCKS}


def flame_module(path: str) -> tuple:
    """(flame module path, part index) of the diffusers module ``path``: ``transformer_blocks.3.attn.to_k``
    -> (``double_blocks.3.img_attn.qkv``, 1); ``proj_out`` -> (``final_layer.linear``, 0); the part
    index is the block of rows in ``parts`` order (``norm_out.linear``, whose halves are swapped,
    is part 0 of ``final_layer.adaLN_modulation.1``). Raises ValueError outside the map."""
    if path in _BACK:
        return _BACK[path]
    m = _BLOCK.fullmatch(path)
    if m and m.group(1) in _BACK_BLOCKS:
        flame_blocks, table = _BACK_BLOCKS[m.group(1)]
        if m.group(3) in table:
            name, part = table[m.group(3)]
            return f"{flame_blocks}.{m.group(2)}.{name}", part
    raise ValueError(f"no flame name for the diffusers Flux module {path!r}")


def diffusers_pieces(name: str, shape: tuple, parts: tuple | None) -> tuple:
    """The rows of diffusers tensors that stack into flame's parameter ``name`` of ``shape`` (its
    Linear's output ``parts``, or None): ((diffusers key, first row, end row), ...) in row order."""
    module, _, attr = name.rpartition(".")
    targets, key_attr = diffusers_modules(module), _PARAM[attr]
    if module == SWAPPED_HALVES:
        half = shape[0] // 2
        key = f"{targets[0]}.{key_attr}"
        return (key, half, 2 * half), (key, 0, half)
    sizes = parts if parts is not None else (shape[0],)
    return tuple((f"{t}.{key_attr}", 0, n) for t, n in zip(targets, sizes))


# ---- checkpoints ----------------------------------------------------------------------------------

def is_diffusers(names) -> bool:
    """Whether checkpoint keys ``names`` are diffusers' (else BFL's, with or without the
    ``model.diffusion_model.`` prefix)."""
    return any(k == "x_embedder.weight" or k.startswith(("transformer_blocks.", "single_transformer_blocks."))
               for k in names)


def bfl_keys(names) -> dict:
    """{flame parameter name: stored key} of a BFL checkpoint's keys ``names``: when any key
    carries the ``model.diffusion_model.`` prefix only those do (the rest of a whole-pipeline file
    is other models) and the prefix goes."""
    names = list(names)
    if any(k.startswith(BFL_PREFIX) for k in names):
        return {k[len(BFL_PREFIX):]: k for k in names if k.startswith(BFL_PREFIX)}
    return {k: k for k in names}


def _flame_parameter(key: str) -> str:
    """The flame name of a diffusers parameter key (its module's first part): for reading sizes."""
    module, _, attr = key.rpartition(".")
    name, _ = flame_module(module)
    return f"{name}.{'scale' if name.endswith('_norm') else attr}"


def infer_config(shapes: dict, where: str) -> dict:
    """FluxConfig keyword arguments read from a checkpoint's {key: shape} (BFL or diffusers keys):
    block counts, widths, heads (hidden size / the q-norm's size), guidance embedder. The rotary
    axes cannot be read from weights: Flux.1's (16, 56, 56) for head dim 128, else a ValueError
    asking for the config."""
    if is_diffusers(shapes):
        flame_shapes = {}
        for k, s in shapes.items():
            try:
                flame_shapes.setdefault(_flame_parameter(k), s)
            except ValueError:
                continue
        shapes = flame_shapes
    else:
        shapes = {name: shapes[key] for name, key in bfl_keys(shapes).items()}
    norm = next((k for k in ("double_blocks.0.img_attn.norm.query_norm.scale", "single_blocks.0.norm.query_norm.scale")
                 if k in shapes), None)
    needed = ("img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "final_layer.linear.weight")
    missing = [k for k in needed if k not in shapes] + ([] if norm else ["a query_norm.scale"])
    if missing:
        raise ValueError(f"Flux transformer: cannot read the config from {where}: it has no {', '.join(missing)} "
                         "(not a Flux transformer checkpoint? pass config=)")
    hidden, in_channels = shapes["img_in.weight"]
    head_dim = shapes[norm][0]
    if head_dim != 128:
        raise ValueError(f"Flux transformer: {where} has head dim {head_dim}; its rotary axes (axes_dims_rope) "
                         "cannot be read from the weights: pass config=")
    out = shapes["final_layer.linear.weight"][0]

    def count(blocks):
        return len({m.group(2) for k in shapes for m in [_BLOCK.match(k)] if m and m.group(1) == blocks})

    return dict(in_channels=in_channels, out_channels=None if out == in_channels else out,
                num_layers=count("double_blocks"), num_single_layers=count("single_blocks"),
                attention_head_dim=head_dim, num_attention_heads=hidden // head_dim,
                joint_attention_dim=shapes["txt_in.weight"][1],
                pooled_projection_dim=shapes["vector_in.in_layer.weight"][1],
                guidance_embeds="guidance_in.in_layer.weight" in shapes, axes_dims_rope=(16, 56, 56))
