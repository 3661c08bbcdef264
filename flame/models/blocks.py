"""What several models share: the leaf-layer factory, the channels-last layout helpers, activation
checkpointing of blocks, and the blocks whose architecture is the same in more than one model.

**Leaf layers.** A model describes its architecture once: every block builds its leaf layers
(Linear, Conv2d, GroupNorm, LayerNorm) through a ``LeafLayers`` factory passed down as ``L``.
``LeafLayers(dtype)`` makes flame layers; ``LeafLayers(shapes_only=True)`` makes ``ShapeRecord``
modules of the same parameter names and shapes that allocate nothing, so the same constructor
builds a *skeleton*: the model's module tree with records as leaves. ``skeleton_shapes`` and
``skeleton_layer_names`` read a skeleton (SDXL's 2.57 B parameters are listed without memory). A
model with leaf layers of its own subclasses the factory (``flux._FluxLayers``).

**Layout.** Image activations are logical (B, C, H, W) with channels-last strides. ``nhwc`` and
``nchw`` switch between that tensor and its (B, H, W, C) view without a copy: elementwise ops write
their output in logical order, so adds and concatenations computed on the NHWC view and permuted
back stay channels-last. ``norm_silu`` is GroupNorm followed by SiLU in one kernel.

**Checkpointing.** Blocks that may recompute their activations in the backward derive from
``Checkpointed``; ``switch_checkpointing`` turns a model's blocks of one scope on or off.

Users: ``sdxl_unet`` (all of it), ``vae`` (leaf layers, layout helpers, ``Upsample2D``), ``flux``
(leaf layers, checkpointing).
"""
from __future__ import annotations

from collections import OrderedDict

from .. import nn
from ..autograd import is_grad_enabled
from ..checkpoint import checkpoint
from ..nn import functional as F

# ---- leaf layers ----------------------------------------------------------------------------------


class ShapeRecord(nn.Module):
    """Stand-in for a leaf layer in a skeleton: its ``kind`` ("Linear", "Conv2d", ...) and its
    parameter ``shapes`` {name: shape}, no memory."""

    def __init__(self, kind, **shapes):
        super().__init__()
        self.kind = kind
        self.shapes = OrderedDict((k, v) for k, v in shapes.items() if v is not None)


class LeafLayers:
    """Makes the leaf layers for the blocks: flame layers in ``dtype`` on ``device`` (flame's, or
    "meta": parameters without storage, ``nn.layers.empty_parameter``), or with ``shapes_only``
    ``ShapeRecord``s of the same parameter names and shapes (nothing allocated)."""

    def __init__(self, dtype=None, shapes_only=False, device=None):
        self.dtype, self.shapes_only, self.device = dtype, shapes_only, device

    def linear(self, fan_in, fan_out, bias=True):
        if self.shapes_only:
            return ShapeRecord("Linear", weight=(fan_out, fan_in), bias=(fan_out,) if bias else None)
        return nn.Linear(fan_in, fan_out, bias=bias, device=self.device, dtype=self.dtype)

    def conv(self, cin, cout, k, stride=1, padding=0):
        if self.shapes_only:
            return ShapeRecord("Conv2d", weight=(cout, cin, k, k), bias=(cout,))
        return nn.Conv2d(cin, cout, k, stride=stride, padding=padding, device=self.device, dtype=self.dtype)

    def group_norm(self, groups, c, eps):
        if self.shapes_only:
            return ShapeRecord("GroupNorm", weight=(c,), bias=(c,))
        return nn.GroupNorm(groups, c, eps=eps, device=self.device, dtype=self.dtype)

    def layer_norm(self, c, eps=1e-5):
        if self.shapes_only:
            return ShapeRecord("LayerNorm", weight=(c,), bias=(c,))
        return nn.LayerNorm(c, eps=eps, device=self.device, dtype=self.dtype)


def pack_projections(model: nn.Module, attention: type) -> nn.Module:
    """``pack()`` of every ``attention`` module of ``model`` (each puts its projections of one input
    in one buffer, ``nn.pack_linears``: one GEMM at inference); returns ``model``. What a model does
    when it is built or loaded on the device, and again after its weights are replaced."""
    for m in model.modules():
        if isinstance(m, attention):
            m.pack()
    return model


def skeleton_shapes(skeleton: nn.Module) -> OrderedDict:
    """{state-dict name: shape} of the records in ``skeleton``, in ``state_dict`` order."""
    return OrderedDict((f"{name}.{p}", shape) for name, m in skeleton.named_modules()
                       if isinstance(m, ShapeRecord) for p, shape in m.shapes.items())


def skeleton_layer_names(skeleton: nn.Module, kind: str) -> list:
    """Module names of the ``kind`` records in ``skeleton``, in module order."""
    return [name for name, m in skeleton.named_modules() if isinstance(m, ShapeRecord) and m.kind == kind]


# ---- channels-last layout ---------------------------------------------------------------------------

def nhwc(x):
    """(B, C, H, W) channels-last -> its (B, H, W, C) view (contiguous: no copy)."""
    return x.permute(0, 2, 3, 1)


def nchw(x):
    """The inverse of ``nhwc``: a (B, H, W, C) tensor as (B, C, H, W) with channels-last strides."""
    return x.permute(0, 3, 1, 2)


def norm_silu(norm, x):
    """silu(norm(x)) for an ``nn.GroupNorm`` ``norm``, one fused kernel."""
    return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation="silu")


# ---- activation checkpointing -------------------------------------------------------------------------

class Checkpointed(nn.Module):
    """A module whose forward can run under activation checkpointing (``flame.checkpoint``);
    ``scope``: which scope of ``switch_checkpointing`` (a model's ``enable_gradient_checkpointing``)
    switches it. A block that ``offload.BlockStreamer`` schedules has its ``streamer`` set, which
    then runs it (its frozen weights copied to the device first when they are streamed)."""

    gradient_checkpointing = False
    scope = "blocks"
    streamer = None

    def __call__(self, *args):
        if self.streamer is not None:
            return self.streamer(self, args)
        return self._run(args)

    def _run(self, args):
        if self.gradient_checkpointing and is_grad_enabled():
            return checkpoint(self.forward, *args)
        return self.forward(*args)


def spread(n: int, total: int) -> list:
    """``n`` of ``total`` positions, evenly spaced (the centres of ``n`` equal runs): which blocks
    of a model get a per-block treatment that only some of them need (streamed weights,
    checkpointed activations)."""
    return [int((i + 0.5) * total / n) for i in range(n)]


def switch_checkpointing(model: nn.Module, enabled: bool, scope: str, scopes: tuple, blocks=None) -> None:
    """Turn checkpointing of ``model``'s ``Checkpointed`` modules of ``scope`` on (``enabled``) or
    off, and of every other scope off; ``scopes`` are the ones the model offers (ValueError for any
    other). ``blocks``: how many of the scope's modules to checkpoint, spread evenly over the
    forward's order (``spread``); None: all of them. Each checkpointed block trades its kept
    activations for a second forward of it in the backward, so a count between 0 and all buys
    memory at a proportional cost in time."""
    if scope not in scopes:
        raise ValueError(f"enable_gradient_checkpointing: scope must be one of {', '.join(scopes)}, got {scope!r}")
    members = [m for m in model.modules() if isinstance(m, Checkpointed)]
    in_scope = [m for m in members if m.scope == scope]
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks <= len(in_scope):
            raise ValueError(f"enable_gradient_checkpointing: blocks must be an int from 0 to the {len(in_scope)} "
                             f"{scope} of {type(model).__name__}, got {blocks!r}")
        chosen = {id(in_scope[i]) for i in spread(blocks, len(in_scope))}
    for m in members:
        m.gradient_checkpointing = bool(enabled) and m.scope == scope and (blocks is None or id(m) in chosen)


# ---- shared blocks ------------------------------------------------------------------------------------

class Upsample2D(nn.Module):
    """Nearest-neighbour x2, then a 3x3 convolution (the SDXL UNet's and the VAE decoder's)."""

    def __init__(self, L, c):
        super().__init__()
        self.conv = L.conv(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))
