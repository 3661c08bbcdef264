"""Low-rank adapters (LoRA) for Linear layers, with PEFT/diffusers and kohya key names.

``inject_lora(model, targets, rank, alpha)`` replaces every matching ``Linear`` by a
``LoRALinear`` that keeps the base weight (frozen: ``requires_grad`` False, so no gradient is
computed for it) and adds ``(alpha / rank) * B(A(dropout(x)))`` with A (rank, in) and B (out, rank)
fp32 master parameters. ``W + BA`` is never materialised in training: the adapter is two small
GEMMs through flame's ``linear`` (which casts A and B once per forward to the activation dtype,
their gradients flowing back through that cast in fp32).

Names: the base layer keeps its ``weight``/``bias`` parameter names (so a diffusers checkpoint
still loads by name into the injected model); the adapters are the parameters ``lora_A`` and
``lora_B`` of the wrapped module. ``lora_state_dict`` writes them with the file key names of
``shared/reference/sdxl.md``:

- PEFT/diffusers: ``<prefix>.<module path>.lora_A.weight`` (rank, in), ``...lora_B.weight`` (out, rank);
- kohya: ``lora_<prefix>_<module path with '_'>.lora_down.weight``, ``.lora_up.weight``, ``.alpha`` (0-d).
"""
from __future__ import annotations

import math
import re

import torch

from .. import runtime
from ..autograd import no_grad
from ..kernels import elementwise as KE
from ..kernels import matmul as KM
from ..ops.dropout import dropout as _dropout
from ..ops.matmul import linear
from ..tensor import Tensor
from . import init
from .layers import Linear
from .module import Module, Parameter

PRESETS = {
    "attn": ("to_q", "to_k", "to_v", "to_out.0"),
    "attn-mlp": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"),
}

_SUFFIX = re.compile(r"^[A-Za-z0-9_.]+$")


class LoRALinear(Module):
    """``y = x W^T + b + scale * (dropout(x) A^T) B^T`` with ``scale = alpha / rank``; W, b frozen."""

    def __init__(self, base: Linear, rank: int, alpha: float | None = None, init_mode: str = "kaiming",
                 dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, Linear):
            raise TypeError(f"LoRALinear wraps a flame.nn.Linear, got {type(base).__name__}")
        rank = int(rank)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        if init_mode not in ("kaiming", "gaussian"):
            raise ValueError(f"LoRA init must be 'kaiming' or 'gaussian', got {init_mode!r}")
        self.in_features, self.out_features = base.in_features, base.out_features
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
        f32 = torch.float32
        self.lora_A = Parameter(Tensor(runtime.empty((rank, self.in_features), f32)))
        self.lora_B = Parameter(Tensor(runtime.empty((self.out_features, rank), f32)))
        self.reset_lora(init_mode)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def reset_lora(self, init_mode: str = "kaiming"):
        """A: kaiming-uniform(a=sqrt(5)) (kohya, PEFT default) or N(0, (1/rank)^2) (PEFT "gaussian"); B: zeros."""
        if init_mode == "kaiming":
            init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        else:
            init.normal_(self.lora_A, 0.0, 1.0 / self.rank)
        init.zeros_(self.lora_B)

    def forward(self, x):
        if not isinstance(x, Tensor):
            raise TypeError(f"LoRALinear: input must be a flame Tensor, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise RuntimeError(f"LoRALinear: input of shape {x.shape} does not end in in_features={self.in_features}")
        y = linear(x, self.weight, self.bias)
        if self.merged:
            return y
        h = _dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        z = linear(linear(h, self.lora_A), self.lora_B)
        return y + z * self.scale

    # ---- merge: W += scale * B @ A (fp32 product, one add kernel into W's dtype) -------------
    def _delta(self):
        prod = runtime.empty((self.out_features, self.in_features), torch.float32)
        KM.matmul_(prod, self.lora_B._data, self.lora_A._data)
        KE.map_(prod, [prod], KE.MUL.value, float(self.scale))
        return prod

    def merge(self):
        if self.merged:
            return
        w = self.weight._data
        KE.map_(w, [w, self._delta()], KE.ADD.value)
        self.merged = True

    def unmerge(self):
        if not self.merged:
            return
        w = self.weight._data
        KE.map_(w, [w, self._delta()], KE.SUB.value)
        self.merged = False

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}, merged={self.merged}")


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


def _set_module(model, path, new):
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    parent._modules[child] = new  # keeps the child's position


def inject_lora(model: Module, targets, rank: int, alpha: float | None = None, init: str = "kaiming",
                dropout: float = 0.0) -> list:
    """Wrap every ``Linear`` of ``model`` whose dotted name matches ``targets`` in a ``LoRALinear``.

    ``targets``: a preset name ("attn", "attn-mlp"), dotted suffixes ("to_q", "to_out.0": match the
    name or its end after a '.'), regular expressions (a ``re.Pattern``, a string prefixed "re:",
    or any string with regex characters, matched against the whole name), or a list of these.
    ``alpha`` defaults to ``rank``. Freezes nothing else; returns the wrapped module names.
    """
    if isinstance(model, Linear):
        raise TypeError("inject_lora: pass the model containing the Linear layers, not the layer itself")
    tgts = _expand_targets(targets)
    names = []
    for name, m in list(model.named_modules()):
        if name and type(m) is Linear and _matches(name, tgts):
            names.append(name)
    if not names:
        raise ValueError(f"inject_lora: no Linear layer matches targets {targets!r}")
    for name in names:
        _set_module(model, name, LoRALinear(model.get_submodule(name), rank, alpha, init, dropout))
    return names


def lora_modules(model: Module):
    """(name, LoRALinear) pairs of ``model`` in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def lora_parameters(model: Module) -> list:
    """The trainable adapter parameters (A then B of each layer)."""
    out = []
    for _, m in lora_modules(model):
        out += [m.lora_A, m.lora_B]
    return out


def _kohya_name(path, prefix):
    return f"lora_{prefix}_{path.replace('.', '_')}" if prefix else f"lora_{path.replace('.', '_')}"


def lora_state_dict(model: Module, format: str = "peft", prefix: str = "unet") -> dict:  # noqa: A002
    """Adapter tensors by file key name (``format`` "peft" or "kohya"); the values share memory
    with the parameters except kohya's ``.alpha`` (a new 0-d fp32 tensor)."""
    if format not in ("peft", "kohya"):
        raise ValueError(f"lora_state_dict: format must be 'peft' or 'kohya', got {format!r}")
    out = {}
    for path, m in lora_modules(model):
        a, b = Tensor(m.lora_A._data), Tensor(m.lora_B._data)
        if format == "peft":
            key = f"{prefix}.{path}" if prefix else path
            out[f"{key}.lora_A.weight"] = a
            out[f"{key}.lora_B.weight"] = b
        else:
            key = _kohya_name(path, prefix)
            out[f"{key}.lora_down.weight"] = a
            out[f"{key}.lora_up.weight"] = b
            alpha = runtime.empty((), torch.float32)
            KE.fill_(alpha, m.alpha)
            out[f"{key}.alpha"] = Tensor(alpha)
    return out


def detect_format(keys) -> str:
    keys = list(keys)
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "kohya"
    if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
        return "peft"
    raise ValueError("not a LoRA state dict: no '.lora_A.weight'/'.lora_B.weight' (PEFT) or "
                     "'.lora_down.weight'/'.lora_up.weight' (kohya) keys")


def _buf(v):
    if isinstance(v, Tensor):
        return v._data
    if isinstance(v, torch.Tensor):
        return v.detach().to(runtime.device) if v.device.type != runtime.device.type else v.detach()
    raise TypeError(f"expected a tensor, got {type(v).__name__}")


def load_lora_state_dict(model: Module, state_dict: dict, alpha=None, prefix: str = "unet",
                         inject: bool = True) -> list:
    """Load adapters in either file format (detected from the key names) into ``model``.

    ``alpha``: for PEFT files, a number or a {module path: alpha} dict (from the file metadata);
    missing means alpha = rank. Layers that are plain ``Linear`` get an adapter injected when
    ``inject`` (rank from the tensors); unknown module paths raise. Returns the loaded paths.
    """
    fmt = detect_format(state_dict.keys())
    entries = {}  # module name as written -> {"A", "B", "alpha"}
    if fmt == "peft":
        for k, v in state_dict.items():
            for suffix, slot in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
                if k.endswith(suffix):
                    entries.setdefault(k[: -len(suffix)], {})[slot] = v
    else:
        for k, v in state_dict.items():
            for suffix, slot in ((".lora_down.weight", "A"), (".lora_up.weight", "B"), (".alpha", "alpha")):
                if k.endswith(suffix):
                    entries.setdefault(k[: -len(suffix)], {})[slot] = v
    # module paths of candidate layers, in the file's spelling
    lookup = {}
    for name, m in model.named_modules():
        if isinstance(m, (Linear, LoRALinear)) and name:
            if fmt == "peft":
                for p in (f"{prefix}.{name}" if prefix else name, name, f"base_model.model.{name}"):
                    lookup.setdefault(p, name)
            else:
                lookup.setdefault(_kohya_name(name, prefix), name)
                lookup.setdefault(_kohya_name(name, ""), name)
    unknown = [k for k in entries if k not in lookup]
    if unknown:
        raise KeyError(f"load_lora: {len(unknown)} adapter(s) match no Linear layer of the model, e.g. {unknown[:3]}")
    loaded = []
    for key, e in entries.items():
        if "A" not in e or "B" not in e:
            raise KeyError(f"load_lora: adapter {key!r} lacks its {'A/down' if 'A' not in e else 'B/up'} weight")
        path = lookup[key]
        a, b = _buf(e["A"]), _buf(e["B"])
        m = model.get_submodule(path)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[1] != m.in_features \
                or b.shape[0] != m.out_features:
            raise ValueError(f"load_lora: {key}: A {tuple(a.shape)} and B {tuple(b.shape)} don't fit a layer "
                             f"({m.out_features}, {m.in_features})")
        rank = a.shape[0]
        if "alpha" in e:
            al = e["alpha"]
            al = float(al.item() if isinstance(al, (Tensor, torch.Tensor)) else al)  # host transfer
        elif isinstance(alpha, dict):
            al = float(alpha.get(path, rank))
        elif alpha is not None:
            al = float(alpha)
        else:
            al = float(rank)
        if type(m) is Linear:
            if not inject:
                raise KeyError(f"load_lora: layer {path!r} has no adapter (inject_lora first, or inject=True)")
            m = LoRALinear(m, rank, al)
            _set_module(model, path, m)
        elif m.rank != rank:
            raise ValueError(f"load_lora: {key}: rank {rank} in the file, the model's adapter has rank {m.rank}")
        if m.merged:
            raise RuntimeError(f"load_lora: {path} is merged; unmerge_lora first")
        m.alpha = al
        KE.copy_(m.lora_A._data, a)
        KE.copy_(m.lora_B._data, b)
        loaded.append(path)
    return loaded


@no_grad()
def merge_lora(model: Module) -> Module:
    """W += (alpha/rank) B A in every adapter layer (the adapters then stop adding their branch)."""
    for _, m in lora_modules(model):
        m.merge()
    return model


@no_grad()
def unmerge_lora(model: Module) -> Module:
    """Undo ``merge_lora``: W -= (alpha/rank) B A (exact up to rounding in W's dtype)."""
    for _, m in lora_modules(model):
        m.unmerge()
    return model
