"""fp8 base weights for frozen layers: ``quantize_linears_`` turns a model's frozen ``Linear``
layers (and the base layers of its ``LoRALinear`` adapters) into fp8-weight layers in place.

Each converted layer's ``weight`` becomes an ``Fp8Parameter``: float8_e4m3fn codes with one fp32
scale per output channel (``flame.ops.quant``), which ``linear`` and ``lora_linear`` read inside
their GEMMs, forward and input gradient. Biases, norms, LoRA adapters and optimizer states keep
their dtypes; the layer classes stay the same (a ``LoRALinear`` over an fp8 base trains as before,
``inject_lora`` after the conversion wraps fp8 layers, and LoRA files are saved as before).
Merging or folding a LoRA into an fp8 base dequantises, adds and quantises again (fresh scales);
DoRA over an fp8 base is refused, naming the layer.

Call it last: ``Module.to``/``load_state_dict`` on a converted model would cast or copy codes
without their scales. ``use_w8a8_`` then makes the forward products over the fp8 weights round their
inputs to e4m3 too (W8A8 on the fp8 tensor cores).
"""
from __future__ import annotations

from .. import runtime
from ..ops.quant import FORMATS, Fp8Weight, quantize_fp8
from .layers import Linear
from .lora import LoRALinear, fp8_dora_error, matching_layers
from .module import Module, Parameter


class Fp8Parameter(Fp8Weight, Parameter):
    """An ``Fp8Weight`` registered as a module's parameter (always frozen)."""

    __slots__ = ()


def fp8_layers(model: Module, skip=()) -> list:
    """(name, layer) of ``model``'s ``Linear`` layers and ``LoRALinear`` wrappers in module order,
    but those matching ``skip`` (``inject_lora``'s target syntax): the layers ``quantize_linears_``
    stores in fp8 (and ``flame.models.placement`` when a model is loaded in fp8)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, (Linear, LoRALinear))]
    skipped = set(matching_layers([name for name, _ in layers], skip)) if skip else set()
    return [(name, m) for name, m in layers if name not in skipped]


def use_w8a8_(model: Module, enabled: bool = True) -> int:
    """W8A8 for every fp8 weight of ``model`` (``Fp8Weight.w8a8``): the forward products of
    ``linear``/``lora_linear`` over them round their input to e4m3 per row (per token) and run on the
    fp8 tensor cores (Hopper; elsewhere emulated, slower); the input gradients stay weight-only.
    ``enabled=False`` turns it off. Returns how many weights it set."""
    if not isinstance(model, Module):
        raise TypeError(f"use_w8a8_: model must be a flame.nn.Module, got {type(model).__name__}")
    weights = [w for w in model.parameters() if isinstance(w, Fp8Weight)]
    for w in weights:
        w.w8a8 = bool(enabled)
    return len(weights)


def quantize_linears_(model: Module, dtype: str = "fp8_e4m3", skip=(), scale: str = "absmax") -> list:
    """Store the weights of ``model``'s frozen ``Linear`` layers, and of the base layers inside its
    ``LoRALinear`` wrappers, as fp8 (``dtype``: "fp8_e4m3", e4m3fn codes with a per-output-channel
    fp32 scale), in place. Returns the converted layers' dotted names (a weight shared by several
    layers is converted once and stays shared; layers already in fp8 are left as they are).

    ``skip``: layers to leave as they are, named as ``inject_lora``'s targets (dotted suffixes,
    regular expressions, presets). ``scale``: "absmax" (each channel's largest magnitude / 448) or
    "one" (the weights are e4m3 numbers already: a model loaded from a ``*_fp8_e4m3fn`` checkpoint,
    stored exactly). All or nothing: a layer whose weight requires grad, a DoRA layer, or (on a GPU) a
    weight in host memory (a streamed block loaded with ``host_blocks``: load it with
    ``weight_dtype="fp8_e4m3"`` instead) raises, naming it, before anything is converted."""
    op = "quantize_linears_"
    if not isinstance(model, Module):
        raise TypeError(f"{op}: model must be a flame.nn.Module, got {type(model).__name__}")
    if dtype not in FORMATS:
        raise ValueError(f"{op}: dtype must be one of {list(FORMATS)}, got {dtype!r}")
    if scale not in ("absmax", "one"):
        raise ValueError(f"{op}: scale must be 'absmax' or 'one', got {scale!r}")
    todo = []
    for name, m in fp8_layers(model, skip):
        if isinstance(m.weight, Fp8Weight):
            continue
        label = f"{op}: layer {name or type(m).__name__!r}"
        if isinstance(m, LoRALinear) and m.dora:
            raise fp8_dora_error(label, m.weight.shape)
        if m.weight.requires_grad:
            raise ValueError(f"{label} has a trainable weight (requires_grad): an fp8 weight is frozen; freeze it "
                             "(model.requires_grad_(False) before inject_lora) or skip the layer")
        if m.weight.device.type == "cpu" and not runtime.is_interpreter():
            raise ValueError(f"{label} has its weight in host memory (a streamed block loaded with host_blocks): "
                             "quantise it on load instead (from_pretrained(..., weight_dtype='fp8_e4m3'))")
        todo.append((name, m))
    converted, done = [], {}
    for name, m in todo:
        w = m.weight
        new = done.get(w.id)
        if new is None:
            q = quantize_fp8(w, scale)
            new = done[w.id] = Fp8Parameter(q._data, q.scale)
        m.weight = new
        if isinstance(m, LoRALinear):
            m._base_layer.weight = new  # the layer fold_lora puts back
        converted.append(name)
    return converted

