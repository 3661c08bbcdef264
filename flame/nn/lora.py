"""Low-rank adapters (LoRA) for Linear and Conv2d layers, with PEFT/diffusers and kohya key names.

``inject_lora(model, targets, rank, alpha)`` replaces every matching ``Linear`` by a
``LoRALinear`` that keeps the base weight (frozen: ``requires_grad`` False, so no gradient is
computed for it) and adds ``(alpha / rank) * B(A(dropout(x)))`` with A (rank, in) and B (out, rank)
fp32 master parameters. ``W + BA`` is never materialised in training: the adapter is two small
GEMMs through flame's ``linear`` (which casts A and B once per forward to the activation dtype,
their gradients flowing back through that cast in fp32; a step inside
``flame.amp.ParameterCasts(lora_parameters(model), dtype)`` casts every adapter in one
launch, as the trainer does). ``Conv2d`` layers (by name, or all of
them with ``conv=True``) get a ``LoRAConv2d`` ("LoCon"): A a conv with the base's geometry to
``rank`` channels, B a 1x1 conv, A (rank, in, kh, kw) and B (out, rank, 1, 1).

Names: the base layer keeps its ``weight``/``bias`` parameter names (so a diffusers checkpoint
still loads by name into the injected model); the adapters are the parameters ``lora_A`` and
``lora_B`` of the wrapped module. ``lora_state_dict`` writes them with the file key names that
PEFT/diffusers and kohya's sd-scripts use:

- PEFT/diffusers: ``<prefix>.<module path>.lora_A.weight`` (rank, in), ``...lora_B.weight`` (out, rank);
- kohya: ``lora_<prefix>_<module path with '_'>.lora_down.weight``, ``.lora_up.weight``, ``.alpha`` (0-d),
  where the module path is the model's original name for the module when the model has one
  (``model.original_name(path)``: SDXL's LDM/SGM layout, ``input_blocks.4.1.transformer_blocks.0.attn1.to_q``
  for ``down_blocks.1.attentions.0...``, as kohya's sd-scripts write SDXL files and ComfyUI reads them).
  Files with kohya keys over the diffusers paths load too. kohya's sd-scripts call every denoiser
  ``unet`` (``lora_unet_...``), a DiT too: the PEFT prefix ``transformer`` is ``unet`` in kohya keys.

Fused layers: a base ``Linear`` with ``parts`` (output sizes in row order, set by the model: Flux's
``img_attn.qkv`` (q, k, v), ``linear1`` (q, k, v, MLP in)) gets one adapter of ``rank`` per part, as
PEFT on diffusers' separate layers (``LoRALinear``). Its files: PEFT/diffusers one adapter per part
under the names ``model.diffusers_names(path)`` gives (``transformer_blocks.0.attn.to_q``, ...: A
(rank, in), B (part, rank)); a model without that method keeps its paths, and a fused layer then
writes, as kohya files always do, one adapter for the whole layer: A (P * rank, in), B the
block-diagonal (out, P * rank), alpha P * alpha (so alpha / rank, what every loader scales by, is the
layer's). sd-scripts' ``split_qkv`` writes the same matrices but keeps alpha (its
``LoRANetwork.state_dict``), so its files apply such layers at 1 / P strength (sd-scripts issue #2204);
flame reads a whole-layer file at its own alpha / rank. A whole-layer adapter loads into a fused
layer block by block when its up matrix is block-diagonal (rank P * r), or as kohya's fused-QKV
form, one down matrix shared by the parts (rank r: every part's A is the down matrix, B the up
matrix): both are exactly the file's delta (``_plan_whole``).

DoRA (``dora=True``; Liu et al. 2024, "weight-decomposed low-rank adaptation", as PEFT's
``use_dora`` builds it): the layer also has a trainable fp32 magnitude ``lora_magnitude`` m, one
value per output channel, initialised to the row norms of ``W + scale * B A`` (= ``||W||`` at init,
B being zero). With ``c = m / ||W + scale * B A||`` (norm per output row of W, over (in) for a
Linear and (in, kh, kw) for a Conv2d, computed outside the graph: no gradient flows through it, as
in PEFT and the paper's section 4.3) the layer outputs ``c * (W x + scale * B A x) + b``. A Linear
runs it as one op (``lora_linear(..., magnitude=m)``: the norm in one launch, the scale and bias in
one pass after the LoRA GEMMs); with dropout, and for a Conv2d, it is composed of graph ops. Merged
or folded, ``W' = c * (W + scale * B A)``. File keys: PEFT/diffusers
``<prefix>.<module path>.lora_magnitude_vector`` ((out,) for a Linear, (1, out, 1, 1) for a Conv2d,
as PEFT saves them and diffusers' ``load_lora_weights`` reads them); kohya ``<name>.dora_scale``
((out, 1) or (out, 1, 1, 1): LyCORIS's ``dora_wd`` with ``wd_on_output``, the orientation ComfyUI
takes for the output axis). On a fused layer the magnitude is the whole layer's (out,), one per
output row: PEFT's per-part magnitudes one after another (per part in PEFT files).

Loading (``load_lora_state_dict``, ``flame.io.load_lora``) is all or nothing: ``plan_lora_load``
checks every adapter against the model from the tensors' shapes and dtypes, then
``apply_lora_load`` injects and copies; a load that fails leaves the model as it was. An adapter
with a magnitude in the file is DoRA, one without plain LoRA.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import re

import torch

from .. import runtime
from ..autograd import no_grad
from ..kernels import dora as KD
from ..kernels import elementwise as KE
from ..kernels import matmul as KM
from ..ops.conv2d import conv2d
from ..ops.dropout import dropout as _dropout
from ..ops.elementwise import abs as abs_
from ..ops.elementwise import sub
from ..ops.elementwise import to as _to
from ..ops.matmul import linear, lora_linear
from ..ops.quant import Fp8Weight, dequantize_fp8, requantize_fp8_
from ..ops.reduce import amax
from ..ops.shape import block_diagonal, diagonal_blocks
from ..tensor import Tensor
from . import init
from .layers import Conv2d, Linear
from .module import Module, Parameter

PRESETS = {
    "attn": ("to_q", "to_k", "to_v", "to_out.0"),
    "attn-mlp": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"),
    # Conv2d sets (``conv=``): the resnets' convolutions, and with them the down/upsamplers' (kohya's LoCon)
    "resnets": (r"re:.*resnets\.\d+\.(conv1|conv2|conv_shortcut)",),
    "locon": (r"re:.*resnets\.\d+\.(conv1|conv2|conv_shortcut)", r"re:.*(downsamplers|upsamplers)\.0\.conv"),
}

_SUFFIX = re.compile(r"^[A-Za-z0-9_.]+$")


class _LoRALayer(Module):
    """What ``LoRALinear`` and ``LoRAConv2d`` share: the frozen base parameters (same names as the
    base layer), rank/alpha/dropout, the fp32 adapters ``lora_A``/``lora_B`` (and DoRA's
    ``lora_magnitude``), init, the DoRA forward and merge."""

    def _wrap(self, base, rank, alpha, init_mode, dropout, a_shape, b_shape, dora=False, adapters=1):
        rank = int(rank)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        if init_mode not in ("kaiming", "gaussian"):
            raise ValueError(f"LoRA init must be 'kaiming' or 'gaussian', got {init_mode!r}")
        object.__setattr__(self, "_base_layer", base)  # not a submodule: put back by fold_lora
        self.weight = base.weight
        self.weight.requires_grad_(False)
        if base.bias is not None:
            self.bias = base.bias
            self.bias.requires_grad_(False)
        else:
            self.register_parameter("bias", None)
        self.rank = rank
        self.alpha = float(rank if alpha is None else alpha)
        self.dropout = float(dropout)
        self.merged = False
        self.dora = bool(dora)
        if self.dora:
            _refuse_fp8_dora(base, f"{type(self).__name__}(dora=True)")
        self._merged_norm = None  # DoRA: the row norms a merge divided by, which unmerge needs
        f32 = torch.float32
        self.lora_A = Parameter(Tensor(runtime.empty((adapters * rank, *a_shape), f32)))
        self.lora_B = Parameter(Tensor(runtime.empty((b_shape[0], rank, *b_shape[1:]), f32)))
        if self.dora:
            self.lora_magnitude = Parameter(Tensor(runtime.empty((b_shape[0],), f32)))
        else:
            self.register_parameter("lora_magnitude", None)
        self.reset_lora(init_mode)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def reset_lora(self, init_mode: str = "kaiming"):
        """A: kaiming-uniform(a=sqrt(5)) (kohya, PEFT default) or N(0, (1/rank)^2) (PEFT "gaussian"); B: zeros;
        DoRA's magnitude: the base weight's row norms."""
        if init_mode == "kaiming":
            init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        else:
            init.normal_(self.lora_A, 0.0, 1.0 / self.rank)
        init.zeros_(self.lora_B)
        if self.dora:
            self.init_magnitude()

    def init_magnitude(self):
        """DoRA: m = ||W + scale * B A|| per output channel (PEFT's init), with which the layer outputs
        exactly what plain LoRA with these A, B would (c = 1)."""
        if self.merged:
            raise RuntimeError(f"{type(self).__name__}.init_magnitude: the layer is merged; unmerge it first")
        self._adapted_norm(out=self.lora_magnitude._data)

    def _per_channel(self, t):
        """A per-output-channel vector ``t`` (out,) shaped to broadcast over this layer's output."""
        return t

    def forward(self, x):
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__}: input must be a flame Tensor, got {type(x).__name__}")
        if self.merged:
            return self._base(x)
        if self.dora:
            return self._dora_forward(x)
        h = _dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        return self._base(x) + self._up(self._down(h)) * self.scale

    def _adapted(self, h):
        """``W h + scale * B(A(h))`` without the bias."""
        return self._base(h, bias=False) + self._up(self._down(h)) * self.scale

    def _dora_forward(self, x):
        # PEFT (tuners/lora/variants.py, Dora*Variant.forward and dora.py): without dropout (or in
        # eval) the layer gives base(x) + (c - 1) W x + c s B A x = c (W x + s B A x) + b. With
        # dropout PEFT feeds the dropped input h to the whole DoRA term, its base correction
        # included (base_result=None makes DoraLinearLayer recompute W h): base(x) + (c - 1) W h
        # + c s B A h = W (x - h) + b + c (W h + s B A h). We do the same; the bias is never scaled.
        drop = self.dropout > 0 and self.training
        h = _dropout(x, self.dropout, True) if drop else x
        y = self._adapted(h)
        y = y * self._per_channel(_to(self._magnitude_scale(), y.dtype))
        if drop:
            return y + self._base(x - h)
        if self.bias is None:
            return y
        return y + self._per_channel(_to(self.bias, y.dtype))

    def _magnitude_scale(self):
        """DoRA's ``c = m / ||W + scale * B A||`` (out,): a graph op on m, the norm a constant."""
        return self.lora_magnitude / Tensor(self._adapted_norm())

    def _adapted_norm(self, strength=1.0, out=None):
        """``||W + strength * scale * B A||`` per output channel (fp32, (out,); into ``out`` if given),
        in one launch without forming the sum."""
        norm = runtime.empty((self.weight.shape[0],), torch.float32) if out is None else out
        return KD.adapted_norms_(norm, self.weight._data, self.lora_A._data, self._up_buffer(), self.scale * strength)

    def _up_buffer(self):
        """The up-projection B as a buffer (fp32): ``lora_B``'s (a LoRALinear of several parts: the
        block-diagonal matrix of its parts' B)."""
        return self.lora_B._data

    # ---- merge: W += scale * B @ A (fp32 product over the flattened A, one add kernel into W's dtype)
    def _delta(self, strength=1.0, plus_weight=False):
        """``strength * scale * B @ A`` as a new fp32 buffer shaped like W; ``plus_weight``: ``+ W``
        (added in the GEMM's epilogue when W is contiguous: a channels-last conv weight is not a
        strided (out, in * kh * kw) matrix, so it gets an add kernel)."""
        a = self.lora_A._data.reshape(self.lora_A.shape[0], -1)
        b = self._up_buffer().reshape(-1, a.shape[0])
        w = self.weight._data
        prod = runtime.empty((b.shape[0], a.shape[1]), torch.float32)
        fused = plus_weight and w.is_contiguous()
        KM.matmul_(prod, b, a, alpha=float(self.scale * strength), residual=w.view(prod.shape) if fused else None)
        if plus_weight and not fused:
            KE.map_(prod.view(w.shape), [prod.view(w.shape), w], KE.ADD.value)
        return prod.view(w.shape)

    def _adapted_weight(self, strength=1.0):
        """``W + strength * scale * B A`` as a new fp32 (out, K) buffer (K: in, or in * kh * kw)."""
        v = self._delta(strength, plus_weight=True)
        return v.view(v.shape[0], -1)

    def _dora_into_weight(self, strength):
        """W = c * v with v = W + strength * scale * B A and c = m / ||v|| (rows): computed in fp32,
        rounded once into W's dtype. Returns ||v|| (fp32, (out,))."""
        v = self._adapted_weight(strength)
        norm = self._adapted_norm(strength)
        c = runtime.empty(norm.shape, torch.float32)
        KE.map_(c, [self.lora_magnitude._data, norm], KE.DIV.value)
        w = self.weight._data
        KE.map_(w, [v.view(w.shape), self._channel_buffer(c)], KE.MUL.value)
        return norm

    def _channel_buffer(self, c):
        """A (out,) buffer broadcast (stride 0) to the weight's shape."""
        w = self.weight._data
        return c.view(c.shape[0], *([1] * (w.ndim - 1))).expand(w.shape)

    def _add_to_weight(self, delta, op=KE.ADD):
        """W = op(W, delta) for an fp32 ``delta`` shaped like W (merge, unmerge, fold): one map
        kernel; an fp8 base (``Fp8Weight``) is dequantised to fp32, combined and quantised again with
        fresh scales (so an unmerge restores it to within e4m3's rounding, not exactly)."""
        w = self.weight
        if isinstance(w, Fp8Weight):
            v = dequantize_fp8(w)
            KE.map_(v._data, [v._data, delta], op.value)
            requantize_fp8_(w, v)
        else:
            KE.map_(w._data, [w._data, delta], op.value)

    def merge(self):
        """W += scale * B A (DoRA: W = c * (W + scale * B A), keeping the norm for ``unmerge``)."""
        if self.merged:
            return
        if self.dora:
            self._merged_norm = self._dora_into_weight(1.0)
        else:
            self._add_to_weight(self._delta())
        self.merged = True

    def unmerge(self):
        """Undo ``merge`` (up to rounding in W's dtype). DoRA, as PEFT: W = W' / c - scale * B A with
        c = m / (the norm the merge used), in fp32 and rounded once."""
        if not self.merged:
            return
        w = self.weight._data
        if self.dora:
            c = runtime.empty(self._merged_norm.shape, torch.float32)
            KE.map_(c, [self.lora_magnitude._data, self._merged_norm], KE.DIV.value)
            v = runtime.empty(w.shape, torch.float32)
            KE.map_(v, [w, self._channel_buffer(c)], KE.DIV.value)
            KE.map_(w, [v, self._delta()], KE.SUB.value)
            self._merged_norm = None
        else:
            self._add_to_weight(self._delta(), KE.SUB)
        self.merged = False

    def fold(self, strength: float = 1.0) -> Module:
        """W += strength * scale * B A, then the base layer (holding W, b) to put in this one's place.

        DoRA: W = c_s * (W + strength * scale * B A) with c_s = m / ||W + strength * scale * B A||,
        which is what diffusers computes for a DoRA adapter at ``set_adapters(..., weights=strength)``
        (PEFT's scaling becomes strength * alpha / rank in both the norm and the update). The
        magnitude always applies in full: strength 0 gives ``m * W / ||W||``, not W (ComfyUI and
        LyCORIS instead interpolate, W + strength * (W_dora - W))."""
        if self.merged:
            self.unmerge()
        if self.dora:
            self._dora_into_weight(strength)
        else:
            self._add_to_weight(self._delta(strength))
        base = self._base_layer
        base.weight = self.weight
        if self.bias is not None:
            base.bias = self.bias
        return base

    def _lora_repr(self):
        return (f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}, dora={self.dora}, "
                f"merged={self.merged}")


class LoRALinear(_LoRALayer):
    """``y = x W^T + b + scale * (dropout(x) A^T) B^T`` with ``scale = alpha / rank``; W, b frozen.
    ``dora``: DoRA, ``y = c * (x W^T + scale * (x A^T) B^T) + b`` with ``c = m / ||W + scale B A||``
    (rows; see the module docstring).

    A base layer with ``parts`` (output sizes in row order: a fused projection such as Flux's QKV)
    gets one rank-``rank`` adapter per part, as PEFT gives each of the separate layers the fused
    one stands for: ``lora_A`` (P * rank, in) holds the parts' A one after another, ``lora_B``
    (out, rank) their B, part p's rows of B using A's rows p * rank to (p + 1) * rank. The layer
    runs as one adapter of rank P * rank whose up-projection is the block-diagonal matrix of the
    parts' B (``ops.shape.block_diagonal``, one launch per forward; its backward one gather)."""

    def __init__(self, base: Linear, rank: int, alpha: float | None = None, init_mode: str = "kaiming",
                 dropout: float = 0.0, dora: bool = False):
        super().__init__()
        if not isinstance(base, Linear):
            raise TypeError(f"LoRALinear wraps a flame.nn.Linear, got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = layer_parts(base)
        self._wrap(base, rank, alpha, init_mode, dropout, (self.in_features,), (self.out_features,), dora,
                   adapters=len(self.parts or (1,)))

    def _check(self, x):
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise RuntimeError(f"LoRALinear: input of shape {x.shape} does not end in in_features={self.in_features}")

    def _base(self, x, bias=True):
        self._check(x)
        return linear(x, self.weight, self.bias if bias else None)

    def _up_weight(self):
        """B as the graph sees it: ``lora_B``, or the block-diagonal matrix of the parts' B."""
        return self.lora_B if self.parts is None else block_diagonal(self.lora_B, self.parts)

    def _up_buffer(self):
        if self.parts is None:
            return super()._up_buffer()
        return block_diagonal(Tensor(self.lora_B._data), self.parts)._data

    def _adapted(self, h):
        self._check(h)
        return lora_linear(h, self.weight, None, self.lora_A, self._up_weight(), self.scale)

    def forward(self, x, residual=None):
        """The adapted layer's output, plus ``residual`` if given (as ``Linear.forward``: in the base GEMM's
        epilogue where ``lora_linear`` can)."""
        drop = self.dropout > 0 and self.training
        if self.merged or (self.dora and drop) or not isinstance(x, Tensor):
            y = super().forward(x)  # DoRA with dropout: composed, as PEFT (see _dora_forward)
            return y if residual is None else y + residual
        self._check(x)
        h = _dropout(x, self.dropout, True) if drop else None
        return lora_linear(x, self.weight, self.bias, self.lora_A, self._up_weight(), self.scale, lora_input=h,
                           magnitude=self.lora_magnitude, residual=residual)

    def _down(self, h):
        return linear(h, self.lora_A)

    def _up(self, h):
        return linear(h, self._up_weight())

    def extra_repr(self):
        parts = f"parts={self.parts}, " if self.parts else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                + parts + self._lora_repr())


def layer_parts(layer) -> tuple | None:
    """The output parts of a ``Linear`` (its ``parts`` attribute, set by the model: output sizes in
    row order summing to ``out_features``) or ``LoRALinear``, None for a layer of one part."""
    parts = getattr(layer, "parts", None)
    if parts is None or not isinstance(layer, (Linear, LoRALinear)):
        return None
    if isinstance(parts, numbers.Integral) or not all(isinstance(p, numbers.Integral) and p > 0 for p in parts):
        raise ValueError(f"LoRA: a Linear's parts must be a sequence of positive ints, got {parts!r}")
    parts = tuple(int(p) for p in parts)
    if sum(parts) != layer.out_features:
        raise ValueError(f"LoRA: a Linear's parts {parts} must sum to its out_features={layer.out_features}")
    return parts if len(parts) > 1 else None


class LoRAConv2d(_LoRALayer):
    """LoRA for a ``Conv2d`` ("LoCon", as PEFT and kohya build it): A is a conv with the base's
    kernel size, stride, padding and dilation from the input channels to ``rank`` channels, B a
    1x1 conv from ``rank`` to the output channels, ``y = conv(x; W, b) + scale * B(A(dropout(x)))``.
    ``lora_A`` is (rank, in, kh, kw) and ``lora_B`` (out, rank, 1, 1), fp32; W, b frozen. Base
    convs with groups > 1 are not supported (PEFT's LoRA does not cover them either). ``dora``:
    DoRA as PEFT's ``DoraConv2dLayer``, the norms over (in, kh, kw) of ``W + scale * B A`` (B A the
    flattened product, as a merge adds it), one magnitude per output channel."""

    def __init__(self, base: Conv2d, rank: int, alpha: float | None = None, init_mode: str = "kaiming",
                 dropout: float = 0.0, dora: bool = False):
        super().__init__()
        if not isinstance(base, Conv2d):
            raise TypeError(f"LoRAConv2d wraps a flame.nn.Conv2d, got {type(base).__name__}")
        if base.groups != 1:
            raise ValueError(f"LoRAConv2d: base conv has groups={base.groups}; only groups=1 is supported")
        self.in_channels, self.out_channels = base.in_channels, base.out_channels
        self.kernel_size, self.stride = base.kernel_size, base.stride
        self.padding, self.dilation = base.padding, base.dilation
        self._wrap(base, rank, alpha, init_mode, dropout, (self.in_channels, *self.kernel_size),
                   (self.out_channels, 1, 1), dora)

    def _base(self, x, bias=True):
        return conv2d(x, self.weight, self.bias if bias else None, self.stride, self.padding, self.dilation)

    def _per_channel(self, t):
        return t.reshape(t.shape[0], 1, 1)  # over (N, out, H, W)

    def _down(self, h):
        return conv2d(h, self.lora_A, None, self.stride, self.padding, self.dilation)

    def _up(self, h):
        return conv2d(h, self.lora_B)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}, " + self._lora_repr())


_WRAPPERS = {Linear: LoRALinear, Conv2d: LoRAConv2d}


def fp8_dora_error(where: str, shape) -> ValueError:
    """The error for DoRA on a layer with an fp8 weight (``Fp8Weight``) of ``shape``: DoRA's row
    norms of ``W + scale * B A`` would need the dequantised weight, which flame does not implement."""
    return ValueError(f"{where}: DoRA over an fp8 base weight {tuple(shape)} is not supported (its row norms need "
                      "the dequantised weight): use plain LoRA there, or leave the layer unquantised "
                      "(quantize_linears_(..., skip=...))")


def _refuse_fp8_dora(layer, where: str) -> None:
    if isinstance(layer.weight, Fp8Weight):
        raise fp8_dora_error(where, layer.weight.shape)


def _expand_targets(targets):
    if isinstance(targets, (str, re.Pattern)):
        targets = [targets]
    out = []
    for t in targets:
        if isinstance(t, str) and t in PRESETS:
            out.extend(PRESETS[t])
        else:
            out.append(t)
    return out


def _matches(name, targets):
    for t in targets:
        if isinstance(t, re.Pattern):
            if t.fullmatch(name):
                return True
        elif t.startswith("re:"):
            if re.fullmatch(t[3:], name):
                return True
        elif _SUFFIX.match(t):  # a dotted module-name suffix
            if name == t or name.endswith("." + t):
                return True
        elif re.fullmatch(t, name):
            return True
    return False


def target_pattern_error(target: str) -> str | None:
    """Why the target string ``target`` is not a valid regular expression (None when it is fine:
    a preset, a dotted suffix or a regex that compiles)."""
    if target in PRESETS or _SUFFIX.match(target):
        return None
    try:
        re.compile(target[3:] if target.startswith("re:") else target)
    except re.error as e:
        return str(e)
    return None


def adaptable_layers(model) -> list:
    """The dotted names of ``model``'s modules that ``inject_lora`` can wrap (Linear, Conv2d)."""
    return [name for name, m in model.named_modules() if name and type(m) in _WRAPPERS]


def matching_layers(names, targets) -> list:
    """The module ``names`` that ``targets`` (as ``inject_lora`` takes them) selects."""
    tgts = _expand_targets(targets)
    return [n for n in names if _matches(n, tgts)]


def _set_module(model, path, new):
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    parent._modules[child] = new  # keeps the child's position


def inject_lora(model: Module, targets, rank: int, alpha: float | None = None, init: str = "kaiming",
                dropout: float = 0.0, conv=False, conv_rank: int | None = None,
                conv_alpha: float | None = None, dora: bool = False) -> list:
    """Wrap every ``Linear`` and ``Conv2d`` of ``model`` whose dotted name matches ``targets`` in a
    ``LoRALinear`` / ``LoRAConv2d``.

    ``targets``: a preset name ("attn", "attn-mlp": Linear layers only; "resnets", "locon": the
    resnets' convolutions, "locon" with the down/upsamplers' as kohya's LoCon), dotted suffixes ("to_q",
    "to_out.0", "conv1": match the name or its end after a '.'), regular expressions (a
    ``re.Pattern``, a string prefixed "re:", or any string with regex characters, matched against
    the whole name), or a list of these. ``conv``: False (Conv2d layers only where ``targets``
    name them), True (every Conv2d as well: kohya's LoCon) or a targets spec of its own selecting
    Conv2d layers. Conv adapters use ``conv_rank``/``conv_alpha`` (default ``rank``/``alpha``).
    ``alpha`` defaults to ``rank``. ``dora``: DoRA adapters (a magnitude per output channel, Linear
    and Conv2d alike). Freezes nothing else; returns the wrapped module names.
    """
    if type(model) in _WRAPPERS:
        raise TypeError("inject_lora: pass the model containing the layers, not the layer itself")
    tgts = _expand_targets(targets)
    conv_tgts = _expand_targets(conv) if not isinstance(conv, bool) else None
    names = []
    for name, m in list(model.named_modules()):
        if not name or type(m) not in _WRAPPERS:
            continue
        if _matches(name, tgts) or (type(m) is Conv2d and (conv is True or (conv_tgts and _matches(name, conv_tgts)))):
            names.append(name)
    if not names:
        raise ValueError(f"inject_lora: no Linear or Conv2d layer matches targets {targets!r} (conv={conv!r})")
    if dora:
        for name in names:
            _refuse_fp8_dora(model.get_submodule(name), f"inject_lora: layer {name!r}")
    for name in names:
        base = model.get_submodule(name)
        if type(base) is Conv2d:
            layer = LoRAConv2d(base, conv_rank or rank, alpha if conv_alpha is None else conv_alpha, init, dropout,
                               dora)
        else:
            layer = LoRALinear(base, rank, alpha, init, dropout, dora)
        _set_module(model, name, layer)
    return names


def lora_modules(model: Module):
    """(name, LoRA layer) pairs of ``model`` in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _LoRALayer)]


def lora_parameters(model: Module) -> list:
    """The trainable adapter parameters (A, B, and DoRA's magnitude, of each layer in turn)."""
    out = []
    for _, m in lora_modules(model):
        out += [m.lora_A, m.lora_B] + ([m.lora_magnitude] if m.dora else [])
    return out


# The models of a pipeline's LoRA file: PEFT/diffusers prefix -> kohya's. sd-scripts name every denoiser's
# adapters "lora_unet_...", a DiT's too (whose PEFT/diffusers files use the prefix "transformer": sd-scripts'
# networks/lora_flux.py, LORA_PREFIX_FLUX), and SDXL's text encoders "lora_te1_..." (CLIP-L, diffusers'
# "text_encoder") and "lora_te2_..." (OpenCLIP bigG, "text_encoder_2"); "lora_te_" is SD 1.x's one encoder.
COMPONENT_PREFIXES = {"unet": "unet", "transformer": "unet", "text_encoder": "te1", "text_encoder_2": "te2"}
_KOHYA_LEADS = ("lora_unet_", "lora_te1_", "lora_te2_", "lora_te_")


def _kohya_name(path, prefix):
    prefix = COMPONENT_PREFIXES.get(prefix, prefix)
    return f"lora_{prefix}_{path.replace('.', '_')}" if prefix else f"lora_{path.replace('.', '_')}"


def component_keys(keys, prefix: str, bare: bool = True) -> list:
    """The keys of a LoRA file that belong to the model of PEFT ``prefix`` ("unet", "text_encoder",
    ...): those under ``prefix.`` or its kohya lead (``lora_te1_`` for "text_encoder"), and with
    ``bare`` those under no model's prefix of ``COMPONENT_PREFIXES`` (a file of one model's module
    paths). Keys of the pipeline's other models (diffusers' and kohya's SDXL files hold the UNet's
    and both text encoders' adapters) are left out."""
    lead = f"lora_{COMPONENT_PREFIXES.get(prefix, prefix)}_"
    out = []
    for k in keys:
        head = k.split(".", 1)[0]
        kohya = next((p for p in _KOHYA_LEADS if k.startswith(p)), None)
        if head in COMPONENT_PREFIXES:
            mine = head == prefix
        elif kohya is not None:
            mine = kohya == lead
        else:
            mine = bare
        if mine:
            out.append(k)
    return out


def _original_name(model, path):
    """``path`` in the model's original layout (``model.original_name``), or as it is."""
    rename = getattr(model, "original_name", None)
    return rename(path) if rename is not None else path


def _diffusers_names(model, path, parts):
    """The PEFT/diffusers module path(s) of layer ``path``: ``model.diffusers_names(path)`` (one per
    part, or one for the whole layer) when the model defines it, else the path itself."""
    rename = getattr(model, "diffusers_names", None)
    if rename is None:
        return (path,)
    names = tuple(rename(path))
    if len(names) not in (1, len(parts or (1,))):
        raise ValueError(f"{type(model).__name__}.diffusers_names({path!r}) gives {len(names)} names {names}; "
                         f"the layer has {len(parts or (1,))} part(s)")
    return names


def _diffusers_rows(model, path, n_out):
    """Layer ``path``'s output rows in the order its diffusers module holds them, as (start, stop)
    segments: ``model.diffusers_rows(path)`` when the model defines it and gives segments (Flux's
    final modulation, whose two halves diffusers swaps), else all rows in order."""
    order = getattr(model, "diffusers_rows", None)
    segments = None if order is None else order(path)
    if segments is None:
        return ((0, n_out),)
    segments = tuple((int(lo), int(hi)) for lo, hi in segments)
    ordered = sorted(segments)
    gaps = any(a[1] != b[0] for a, b in itertools.pairwise(ordered)) or any(lo >= hi for lo, hi in segments)
    if gaps or ordered[0][0] != 0 or ordered[-1][1] != n_out:
        raise ValueError(f"{type(model).__name__}.diffusers_rows({path!r}) gives {segments}, which do not split "
                         f"the layer's {n_out} output rows")
    return segments


@dataclasses.dataclass(frozen=True)
class FileAdapter:
    """One adapter as a LoRA file holds it: ``name`` the module path the file gives it (without the
    prefix), ``path`` the flame layer it belongs to, ``part`` the layer's part it covers (None: the
    whole layer) and ``rows`` the layer's output rows it covers, (start, stop) segments in the order
    the file holds them (one segment but for ``diffusers_rows``)."""

    name: str
    path: str
    part: int | None
    rows: tuple

    @property
    def n_out(self) -> int:
        return sum(hi - lo for lo, hi in self.rows)


def _file_adapters(model, path, layer, fmt) -> list:
    """The ``FileAdapter``s of ``model``'s layer ``path`` in a file of ``fmt``. PEFT/diffusers: one per
    part where ``model.diffusers_names`` names each part (the separate layers diffusers has for a
    fused one), else one under the path (as diffusers, or flame's path); kohya: one for the whole
    layer under its original name, a fused layer included (as sd-scripts write Flux's QKV)."""
    n_out = layer.weight.shape[0]
    parts = layer_parts(layer)
    if fmt == "kohya":
        return [FileAdapter(_original_name(model, path), path, None, ((0, n_out),))]
    names, rows = _diffusers_names(model, path, parts), _diffusers_rows(model, path, n_out)
    if rows != ((0, n_out),) and (parts is not None or isinstance(layer, (Conv2d, LoRAConv2d))):
        raise ValueError(f"{type(model).__name__}: layer {path!r} has reordered diffusers rows {rows} and parts "
                         f"{parts} (or is a Conv2d): not supported")
    if len(names) == 1:
        return [FileAdapter(names[0], path, None, rows)]
    starts = list(itertools.accumulate(parts, initial=0))
    return [FileAdapter(n, path, p, ((starts[p], starts[p + 1]),)) for p, n in enumerate(names)]


def _file_rank_alpha(m, fa):
    """(rank, alpha) of LoRA layer ``m``'s adapter ``fa`` in the file. A fused layer of P parts
    written whole is one adapter of rank P * rank with alpha P * alpha, so that alpha / rank (the
    scale every loader applies) stays the layer's."""
    n = 1 if fa.part is not None else len(layer_parts(m) or (1,))
    return n * m.rank, n * m.alpha


def _file_tensors(m, fa):
    """(A, B, DoRA magnitude or None) of LoRA layer ``m``'s adapter ``fa``: views of the parameters
    (a part's rows of A, B and the magnitude), except a fused layer's B written whole (the new
    block-diagonal matrix of its parts' B) and rows in another order (new copies)."""
    mag = m.lora_magnitude._data if m.dora else None
    if fa.part is None:
        b = m._up_buffer()
    else:
        a = m.lora_A._data[fa.part * m.rank:(fa.part + 1) * m.rank]
        b = m.lora_B._data
    if len(fa.rows) > 1:
        b, mag = (None if t is None else _rows_in_order(t, fa.rows) for t in (b, mag))
    else:
        (lo, hi), = fa.rows
        b, mag = b[lo:hi], None if mag is None else mag[lo:hi]
    return (m.lora_A._data if fa.part is None else a), b, mag


def _rows_in_order(buf, segments):
    """A new buffer of ``buf``'s row ``segments`` one after another (one copy each)."""
    out = runtime.empty((sum(hi - lo for lo, hi in segments), *buf.shape[1:]), buf.dtype)
    start = 0
    for lo, hi in segments:
        KE.copy_(out[start:start + hi - lo], buf[lo:hi])
        start += hi - lo
    return out


def _magnitude_shapes(m, n_out=None) -> dict:
    """{format: the shape DoRA's magnitude has in a file of that format} for layer ``m`` (``n_out``:
    for a part of that many output rows): PEFT saves (out,) for a Linear and (1, out, 1, 1) for a
    Conv2d (its conv norm is taken keepdim, then transposed); LyCORIS's ``dora_scale`` on the output
    axis is (out, 1) or (out, 1, 1, 1)."""
    if isinstance(m, (Conv2d, LoRAConv2d)):
        return {"peft": (1, m.out_channels, 1, 1), "kohya": (m.out_channels, 1, 1, 1)}
    n_out = m.out_features if n_out is None else n_out
    return {"peft": (n_out,), "kohya": (n_out, 1)}


def lora_state_dict(model: Module, format: str = "peft", prefix: str = "unet") -> dict:  # noqa: A002
    """Adapter tensors by file key name (``format`` "peft" or "kohya"); the values share memory
    with the parameters except kohya's ``.alpha`` (a new 0-d fp32 tensor) and a fused layer's
    block-diagonal B. DoRA layers add their magnitude: ``.lora_magnitude_vector`` (PEFT/diffusers)
    or ``.dora_scale`` (kohya/LyCORIS), in the shapes ``_magnitude_shapes`` gives. Where the adapters
    go and under which names: ``_file_adapters``."""
    if format not in ("peft", "kohya"):
        raise ValueError(f"lora_state_dict: format must be 'peft' or 'kohya', got {format!r}")
    out = {}
    for path, m in lora_modules(model):
        for fa in _file_adapters(model, path, m, format):
            a, b, mag = _file_tensors(m, fa)
            shapes = _magnitude_shapes(m, fa.n_out)
            if format == "peft":
                key = f"{prefix}.{fa.name}" if prefix else fa.name
                out[f"{key}.lora_A.weight"] = Tensor(a)
                out[f"{key}.lora_B.weight"] = Tensor(b)
                if mag is not None:
                    out[f"{key}.lora_magnitude_vector"] = Tensor(mag.view(shapes["peft"]))
            else:
                key = _kohya_name(fa.name, prefix)
                out[f"{key}.lora_down.weight"] = Tensor(a)
                out[f"{key}.lora_up.weight"] = Tensor(b)
                alpha = runtime.empty((), torch.float32)
                KE.fill_(alpha, _file_rank_alpha(m, fa)[1])
                out[f"{key}.alpha"] = Tensor(alpha)
                if mag is not None:
                    out[f"{key}.dora_scale"] = Tensor(mag.view(shapes["kohya"]))
    return out


# a root module that transformers 5 no longer builds (CLIPTextModel's ``text_model``, which files keep
# and diffusers strips from a text encoder's keys): PEFT matches target names by suffix, so names
# without it match either layout
_DROPPED_ROOTS = ("text_model.",)


def peft_target_name(name: str) -> str:
    """Module ``name`` as PEFT metadata (target_modules, rank/alpha patterns) gives it."""
    root = next((r for r in _DROPPED_ROOTS if name.startswith(r)), "")
    return name[len(root):]


def peft_config(model: Module) -> dict:
    """The PEFT ``LoraConfig`` fields of ``model``'s adapters under the module names a PEFT/diffusers
    file gives them (diffusers' ``lora_adapter_metadata``): r, lora_alpha, target_modules, the rank
    and alpha patterns of the modules that differ from the first, use_dora. A CLIP text encoder's
    names leave out ``text_model.`` (``_DROPPED_ROOTS``)."""
    adapters = [(peft_target_name(fa.name), *_file_rank_alpha(m, fa), m.dora) for path, m in lora_modules(model)
                for fa in _file_adapters(model, path, m, "peft")]
    if not adapters:
        raise ValueError("peft_config: the model has no LoRA layers (inject_lora first)")
    _, r0, a0, _ = adapters[0]
    return {"r": r0, "lora_alpha": a0, "target_modules": sorted({n for n, *_ in adapters}),
            "rank_pattern": {n: r for n, r, _, _ in adapters if r != r0},
            "alpha_pattern": {n: a for n, _, a, _ in adapters if a != a0},
            "init_lora_weights": True, "use_dora": any(d for *_, d in adapters), "lora_bias": False}


def detect_format(keys) -> str:
    keys = list(keys)
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "kohya"
    if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
        return "peft"
    raise ValueError("not a LoRA state dict: no '.lora_A.weight'/'.lora_B.weight' (PEFT) or "
                     "'.lora_down.weight'/'.lora_up.weight' (kohya) keys")


def _adapter_shapes(m, rank, n_out=None):
    """The (A, B) shapes an adapter of ``rank`` has on layer ``m`` (plain or wrapped; ``n_out``: on
    a part of that many output rows)."""
    if isinstance(m, (Conv2d, LoRAConv2d)):
        return (rank, m.in_channels, *m.kernel_size), (m.out_channels, rank, 1, 1)
    return (rank, m.in_features), (m.out_features if n_out is None else n_out, rank)


_SLOTS = {"peft": ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_magnitude_vector", "mag")),
          "kohya": ((".lora_down.weight", "A"), (".lora_up.weight", "B"), (".alpha", "alpha"), (".dora_scale", "mag"))}


@dataclasses.dataclass(frozen=True)
class LoadStep:
    """One layer of a checked LoRA load (``plan_lora_load``): the layer's module ``path``, the
    ``rank`` and ``alpha`` of its adapter(s), whether an adapter is injected there first (``inject``:
    the layer is a plain Linear/Conv2d; ``dora``: a DoRA one), and the ``copies`` that fill it, each
    ``(parameter, file key, rows, region)``: parameter "A", "B" or "mag" (DoRA's magnitude), the
    destination rows (start, stop) of the parameter (None: all of it) and the source region
    ((row start, stop), (column start, stop) or None: all columns) of the file tensor (None: all of
    it). A DoRA adapter
    without a magnitude copy starts from ``init_magnitude``."""

    path: str
    rank: int
    alpha: float
    inject: bool
    dora: bool
    copies: tuple


def _lookup(model, fmt, prefix):
    """{module path as the file spells it: its ``FileAdapter``} for the layers that can take an
    adapter: PEFT under ``_file_adapters``' names and the flame path (a fused layer's whole adapter),
    each also without a root transformers 5 dropped (``peft_target_name``), each bare, with
    ``prefix`` or PEFT's ``base_model.model``; kohya under the original name and the
    flame path, with the (kohya) prefix or without."""
    lookup = {}
    for name, m in model.named_modules():
        if not name or not (type(m) in _WRAPPERS or isinstance(m, _LoRALayer)):
            continue
        whole = ((0, m.weight.shape[0]),)
        if fmt == "peft":
            for fa in [*_file_adapters(model, name, m, "peft"), FileAdapter(name, name, None, whole)]:
                for n in dict.fromkeys((fa.name, peft_target_name(fa.name))):  # diffusers' text encoders under
                    for spelled in (f"{prefix}.{n}" if prefix else n, n, f"base_model.model.{n}"):  # transformers 5
                        lookup.setdefault(spelled, fa)
        else:
            for path in dict.fromkeys((_original_name(model, name), name)):
                fa = FileAdapter(path, name, None, whole)
                lookup.setdefault(_kohya_name(path, prefix), fa)
                lookup.setdefault(_kohya_name(path, ""), fa)
    return lookup


def _file_alpha(e, specs, scalar, alpha, fa, rank):
    """The alpha of a file adapter: its kohya ``.alpha`` tensor, else ``alpha`` (a number, or a dict
    by the file's module name or the flame path), else its rank."""
    if "alpha" in e:
        shape, dt = specs[e["alpha"]]
        if math.prod(shape) != 1 or dt == torch.bool:
            raise ValueError(f"load_lora: {e['alpha']} is a {dt} tensor of shape {tuple(shape)}, not one number")
        return float(scalar(e["alpha"]))
    if isinstance(alpha, dict):
        for name in (fa.name, peft_target_name(fa.name), fa.path):
            if name in alpha:
                return float(alpha[name])
        return float(rank)
    return float(rank if alpha is None else alpha)


def _check_weights(m, key, e, specs, rank, n_out=None):
    """A file adapter's A and B: floating-point, of the shapes layer ``m`` (or its part of ``n_out``
    rows) takes at ``rank``."""
    (a_shape, a_dtype), (b_shape, b_dtype) = specs[e["A"]], specs[e["B"]]
    for k, dt in ((e["A"], a_dtype), (e["B"], b_dtype)):
        if not dt.is_floating_point:
            raise TypeError(f"load_lora: {k} is {dt}, not a floating-point tensor")
    a_want, b_want = _adapter_shapes(m, rank, n_out)
    if rank < 1 or tuple(a_shape) != a_want or tuple(b_shape) != b_want:
        what = "the layer" if n_out is None else f"its part of {n_out} output rows"
        raise ValueError(f"load_lora: {key}: A {tuple(a_shape)} and B {tuple(b_shape)} don't fit {what} "
                         f"(weight {tuple(m.weight.shape)}: expected A {a_want} and B {b_want})")


def _check_target(m, path, key, rank, mag, fmt, inject, strict):
    """Whether layer ``m`` can take an adapter of ``rank`` (per part) from file adapter ``key``
    (``mag``: its magnitude's key, or None)."""
    if type(m) in _WRAPPERS:
        if not inject:
            raise KeyError(f"load_lora: layer {path!r} has no adapter (inject_lora first, or inject=True)")
        if mag is not None:
            _refuse_fp8_dora(m, f"load_lora: {key}: layer {path!r}")
    elif m.rank != rank:
        raise ValueError(f"load_lora: {key}: rank {rank} in the file, the model's adapter has rank {m.rank}")
    elif m.merged:
        raise RuntimeError(f"load_lora: {path} is merged; unmerge_lora first")
    elif mag is not None and not m.dora:
        raise ValueError(f"load_lora: {key}: the file has a DoRA magnitude ({mag}), the model's adapter at "
                         f"{path!r} is plain LoRA (inject_lora(..., dora=True); the trainer's lora.dora)")
    elif mag is None and m.dora and strict:
        raise KeyError(f"load_lora: {key}: the model's adapter at {path!r} is DoRA, the file has no magnitude "
                       "for it (strict)")


def _is_block_diagonal(buf, parts) -> bool:
    """Whether the (out, P * r) matrix ``buf`` is zero outside the diagonal blocks of the row
    partition ``parts`` (a few launches and one host transfer)."""
    up = Tensor(buf)
    rebuilt = block_diagonal(diagonal_blocks(up, parts), parts)
    return float(amax(abs_(sub(up, rebuilt))).item()) == 0.0


def _plan_whole(m, path, key, e, fa, specs, scalar, read, alpha, fmt, inject, strict):
    """The ``LoadStep`` of one file adapter for the whole layer ``m``. Into a fused layer of P parts:
    an adapter of rank P * r whose up matrix is block-diagonal (what flame and sd-scripts write)
    gives part p the rows p * r to (p + 1) * r of the down matrix and the diagonal block p of the up
    matrix, alpha / P; one of rank r with a shared down matrix (kohya's fused QKV) gives every part
    that down matrix and its rows of the up matrix, alpha unchanged. Either is exactly the file's
    delta (alpha / rank) up @ down. A layer with adapters of rank r takes the form its rank says."""
    (a_shape, _) = specs[e["A"]]
    rank = a_shape[0] if a_shape else 0
    _check_weights(m, key, e, specs, rank)
    al = _file_alpha(e, specs, scalar, alpha, fa, rank)
    mag = e.get("mag")
    if mag is not None:
        _check_magnitude(m, mag, fmt, *specs[mag])
    parts = layer_parts(m)
    copies = [("A", e["A"], None, None), ("B", e["B"], None, None)]
    if parts is not None:
        n, have = len(parts), None if type(m) in _WRAPPERS else m.rank
        if have is None:
            blocks = rank % n == 0 and _is_block_diagonal(read(e["B"]), parts)
        elif rank == n * have:
            blocks = True
            if not _is_block_diagonal(read(e["B"]), parts):
                raise ValueError(f"load_lora: {key}: its up matrix has non-zero entries outside the diagonal blocks "
                                 f"of layer {path!r}'s parts {parts}, whose {n} adapters of rank {have} cannot hold "
                                 "it")
        elif rank == have:
            blocks = False
        else:
            raise ValueError(f"load_lora: {key}: rank {rank} in the file; layer {path!r} has {n} adapters of rank "
                             f"{have} (parts {parts}), which take a block-diagonal adapter of rank {n * have} or "
                             f"one of rank {have} with a shared down matrix")
        starts = list(itertools.accumulate(parts, initial=0))
        if blocks:
            rank, al = rank // n, al / n
            copies[1:] = [("B", e["B"], (lo, hi), ((lo, hi), (p * rank, (p + 1) * rank)))
                          for p, (lo, hi) in enumerate(itertools.pairwise(starts))]
        else:
            copies[:1] = [("A", e["A"], (p * rank, (p + 1) * rank), None) for p in range(n)]
    if mag is not None:
        copies.append(("mag", mag, None, None))
    if len(fa.rows) > 1:  # rows in another order: each segment its own copy
        starts = list(itertools.accumulate((hi - lo for lo, hi in fa.rows), initial=0))
        copies = [c for c in copies if c[0] == "A"] + [
            (target, k, (lo, hi), ((f, f + hi - lo), None)) for target, k, _, _ in copies if target != "A"
            for f, (lo, hi) in zip(starts, fa.rows)]
    _check_target(m, path, key, rank, mag, fmt, inject, strict)
    return LoadStep(path, rank, al, type(m) in _WRAPPERS, mag is not None, tuple(copies))


def _plan_parts(model, m, path, got, specs, scalar, alpha, fmt, inject, strict, prefix):
    """The ``LoadStep`` of the per-part adapters ``got`` ({part: (file key, slots, FileAdapter)}) of
    fused layer ``m``: every part present, one rank and one alpha for all, DoRA magnitudes for all or
    none."""
    parts = layer_parts(m)
    if len(got) != len(parts):
        names = [fa.name for fa in _file_adapters(model, path, m, "peft")]
        missing = [f"{prefix}.{names[p]}" if prefix else names[p] for p in range(len(parts)) if p not in got]
        raise KeyError(f"load_lora: layer {path!r} takes one adapter per part ({len(parts)} parts {parts}); the file "
                       f"lacks {[k + s for k in missing for s in ('.lora_A.weight', '.lora_B.weight')]}")
    ranks, alphas, copies, mags = set(), set(), [], []
    for p in range(len(parts)):
        key, e, fa = got[p]
        (a_shape, _) = specs[e["A"]]
        rank = a_shape[0] if a_shape else 0
        (lo, hi), = fa.rows
        _check_weights(m, key, e, specs, rank, hi - lo)
        ranks.add(rank)
        alphas.add(_file_alpha(e, specs, scalar, alpha, fa, rank))
        copies += [("A", e["A"], (p * rank, (p + 1) * rank), None), ("B", e["B"], (lo, hi), None)]
        if "mag" in e:
            _check_magnitude(m, e["mag"], fmt, *specs[e["mag"]], hi - lo)
            copies.append(("mag", e["mag"], (lo, hi), None))
            mags.append(e["mag"])
    keys = [got[p][0] for p in range(len(parts))]
    if len(ranks) > 1 or len(alphas) > 1:
        raise ValueError(f"load_lora: the adapters {keys} of layer {path!r}'s parts have ranks {sorted(ranks)} and "
                         f"alphas {sorted(alphas)}: a fused layer's parts take one rank and one alpha")
    if mags and len(mags) != len(parts):
        raise ValueError(f"load_lora: only some of the adapters {keys} of layer {path!r}'s parts have a DoRA "
                         "magnitude")
    rank = ranks.pop()
    _check_target(m, path, keys[0], rank, mags[0] if mags else None, fmt, inject, strict)
    return LoadStep(path, rank, alphas.pop(), type(m) in _WRAPPERS, bool(mags), tuple(copies))


def plan_lora_load(model: Module, specs: dict, scalar, alpha=None, prefix: str = "unet", inject: bool = True,
                   strict: bool = False, read=None) -> list:
    """Check a load of adapters (either file format, detected from the key names) into ``model``
    from their shapes and dtypes, before anything is written: returns its ``LoadStep``s for
    ``apply_lora_load``, or raises (KeyError, ValueError, TypeError, RuntimeError) naming what
    does not fit.

    ``specs``: {file key: (shape tuple, torch dtype)}; ``scalar(key)``: the value of a one-element
    tensor (kohya's ``.alpha``); ``read(key)``: a tensor's values as a buffer on flame's device,
    needed where a file's adapter for a whole fused layer (``parts``) may be block-diagonal
    (``_plan_whole``), whose up matrix is then checked. Checked: every adapter's key names a
    Linear/Conv2d layer of the model, or a part of a fused one (``_file_adapters``; no two adapters
    the same layer or part, a fused layer's parts all present with one rank and alpha) and has both
    weights, floating-point, of the shapes the layer takes for their rank; a layer without an
    adapter needs ``inject``, one with an adapter the same rank and not merged. A DoRA magnitude
    (``.lora_magnitude_vector`` / ``.dora_scale``) must be floating-point, of the shape
    ``_magnitude_shapes`` gives for the layer (or (out,)), and goes to a layer that gets a DoRA
    adapter injected or has one; a DoRA adapter without a magnitude in the file starts from
    ``init_magnitude`` (not with ``strict``). With ``strict`` every key is a LoRA weight and every
    adapter layer the model already has gets weights. ``alpha`` as ``load_lora_state_dict`` takes it.
    """
    fmt = detect_format(specs)
    entries, stray = {}, []  # module name as written -> {"A", "B", "alpha", "mag": file key}
    for k in specs:
        for suffix, slot in _SLOTS[fmt]:
            if k.endswith(suffix):
                entries.setdefault(k[: -len(suffix)], {})[slot] = k
                break
        else:
            stray.append(k)
    if strict and stray:
        raise KeyError(f"load_lora: {len(stray)} key(s) are not {fmt} LoRA weights (strict), e.g. {stray[:3]}")
    lookup = _lookup(model, fmt, prefix)
    unknown = [k for k in entries if k not in lookup]
    if unknown:
        raise KeyError(f"load_lora: {len(unknown)} adapter(s) match no Linear or Conv2d layer of the model, "
                       f"e.g. {unknown[:3]}")
    layers = {}  # layer path -> {part (None: the whole layer): (adapter key, slots, FileAdapter)}
    for key, e in entries.items():
        if "A" not in e or "B" not in e:
            raise KeyError(f"load_lora: adapter {key!r} lacks its {'A/down' if 'A' not in e else 'B/up'} weight")
        fa = lookup[key]
        got = layers.setdefault(fa.path, {})
        clash = got.get(fa.part) or (next(iter(got.values())) if got and None in (fa.part, *got) else None)
        if clash is not None:  # the same layer or part twice, or a whole layer and one of its parts
            raise ValueError(f"load_lora: adapters {clash[0]!r} and {key!r} both name layer {fa.path!r}")
        got[fa.part] = (key, e, fa)
    if read is None:
        def read(k):
            raise TypeError(f"plan_lora_load: {k} must be read (a fused layer's adapter), pass read=")
    steps = []
    for path, got in layers.items():
        m = model.get_submodule(path)
        if None in got:
            key, e, fa = got[None]
            steps.append(_plan_whole(m, path, key, e, fa, specs, scalar, read, alpha, fmt, inject, strict))
        else:
            steps.append(_plan_parts(model, m, path, got, specs, scalar, alpha, fmt, inject, strict, prefix))
    if strict:
        missing = [n for n, _ in lora_modules(model) if n not in layers]
        if missing:
            raise KeyError(f"load_lora: {len(missing)} adapter(s) of the model get no weights (strict), "
                           f"e.g. {missing[:3]}")
    return steps


def _check_magnitude(m, key, fmt, shape, dtype, n_out=None):
    """A DoRA magnitude of file ``fmt`` for layer ``m`` (or its part of ``n_out`` output rows):
    floating-point, on the output axis."""
    if not dtype.is_floating_point:
        raise TypeError(f"load_lora: {key} is {dtype}, not a floating-point tensor")
    shape, want = tuple(shape), _magnitude_shapes(m, n_out)[fmt]
    n_in = m.weight.shape[1]
    n_out = m.weight.shape[0] if n_out is None else n_out
    if shape in (want, (n_out,)):
        return
    axis = (" (LyCORIS's decomposition on the input axis, wd_on_output=False, which flame does not implement: "
            "PEFT's DoRA normalises the output rows)") if shape in ((1, n_in), (1, n_in, 1, 1)) else ""
    expected = " or ".join(str(s) for s in dict.fromkeys((want, (n_out,))))
    raise ValueError(f"load_lora: {key}: a DoRA magnitude of shape {shape} doesn't fit the layer (weight "
                     f"{tuple(m.weight.shape)}: expected {expected}){axis}")


def apply_lora_load(model: Module, steps: list, read) -> list:
    """Carry out a load checked by ``plan_lora_load``: inject the adapters it plans (DoRA ones
    where the step says so), set each alpha and copy ``read(key)`` (a torch buffer on flame's
    device, any floating dtype: the copy kernel casts it), or its region, into the rows of A, B and
    the magnitude each copy names; a DoRA adapter the file gives no magnitude gets
    ``init_magnitude`` from the loaded weights. Returns the loaded module paths."""
    for step in steps:
        m = model.get_submodule(step.path)
        if step.inject:
            m = _WRAPPERS[type(m)](m, step.rank, step.alpha, dora=step.dora)
            _set_module(model, step.path, m)
        m.alpha = step.alpha
        params = {"A": m.lora_A, "B": m.lora_B, "mag": m.lora_magnitude}
        for target, key, rows, region in step.copies:
            dst, src = params[target]._data, read(key)
            if rows is not None:
                dst = dst[rows[0]:rows[1]]
            if region is not None:
                (r0, r1), cols = region
                src = src[r0:r1] if cols is None else src[r0:r1, cols[0]:cols[1]]
            KE.copy_(dst.view(src.shape), src)
        if m.dora and not any(c[0] == "mag" for c in step.copies):
            m.init_magnitude()
    return [step.path for step in steps]


def load_lora_state_dict(model: Module, state_dict: dict, alpha=None, prefix: str = "unet",
                         inject: bool = True, strict: bool = False) -> list:
    """Load adapters in either file format (detected from the key names) into ``model``.

    ``alpha``: for PEFT files, a number or a {module name: alpha} dict (the file's module names
    without the prefix, or flame's paths; from the file metadata); missing means alpha = rank.
    Layers that are plain ``Linear``/``Conv2d`` get an adapter injected when ``inject`` (rank from
    the tensors); unknown module paths raise. All or nothing: every adapter is checked first
    (``plan_lora_load``, ``strict`` included), so an error leaves the model as it was. Returns the
    loaded paths.
    """
    bufs = {}
    for k, v in state_dict.items():
        if isinstance(v, Tensor):
            bufs[k] = v._data
        elif isinstance(v, torch.Tensor):
            bufs[k] = v.detach()
        else:
            raise TypeError(f"load_lora: {k!r} is a {type(v).__name__}, not a tensor")
    specs = {k: (tuple(b.shape), b.dtype) for k, b in bufs.items()}

    def read(k):
        b = bufs[k]
        return b.to(runtime.device) if b.device.type != runtime.device.type else b  # host transfer

    steps = plan_lora_load(model, specs, lambda k: bufs[k].item(), alpha=alpha, prefix=prefix,  # host transfer
                           inject=inject, strict=strict, read=read)
    return apply_lora_load(model, steps, read)


@no_grad()
def merge_lora(model: Module) -> Module:
    """W += (alpha/rank) B A in every adapter layer (the adapters then stop adding their branch;
    DoRA layers: W = c * (W + (alpha/rank) B A))."""
    for _, m in lora_modules(model):
        m.merge()
    return model


@no_grad()
def fold_lora(model: Module, strength: float = 1.0) -> list:
    """W += strength * (alpha/rank) B A in every adapter layer, and the adapter layers replaced by
    their base layers (the adapters are released): inference with LoRA files at chosen strengths,
    each loaded (``flame.io.load_lora``) and folded in turn. DoRA layers fold as ``_LoRALayer.fold``
    says (diffusers' adapter weight; each DoRA file folded in turn normalises the weight the earlier
    ones left, where diffusers, with several DoRA adapters active at once, normalises each against
    the base weight). Returns the folded layers' names."""
    names = []
    for name, m in lora_modules(model):
        _set_module(model, name, m.fold(strength))
        names.append(name)
    return names


@no_grad()
def unmerge_lora(model: Module) -> Module:
    """Undo ``merge_lora``: W -= (alpha/rank) B A (DoRA: W = W / c - (alpha/rank) B A); exact up to
    rounding in W's dtype."""
    for _, m in lora_modules(model):
        m.unmerge()
    return model
