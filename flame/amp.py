"""Mixed precision: ``autocast``, a precision ``Policy``, and dynamic loss scaling with PyTorch
``GradScaler`` semantics kept entirely on the device.

``with flame.amp.autocast(torch.bfloat16): ...`` runs the ops on PyTorch's CUDA lower-precision
list (matmul/bmm/``@``, linear, conv, scaled-dot-product attention) in the compute dtype, casting
their floating inputs once (parameters once per region), while the ops on its fp32 list (group,
layer and RMS norm, softmax/log-softmax, cross-entropy and the pointwise losses, sum) cast
fp16/bf16 inputs up and return fp32. Other ops run in their inputs' dtype (type promotion as
usual). The state is per thread; backward runs outside it, in the dtypes the forward recorded,
and gradients of fp32 parameters come back fp32 through the recorded casts.

``scaler = DynamicLossScaler()`` (init 2**16, growth 2.0, backoff 0.5, growth interval 2000)::

    grads = scaler.scale(loss).backward()
    scaler.unscale_(grads)            # optional (e.g. before clipping): g *= 1/scale, inf/NaN check
    scaler.step(optimizer, grads)     # skips the update on the device if any gradient is inf/NaN
    scaler.update()                   # backoff or growth of the scale, on the device

The scale (fp32), its fp32 reciprocal, the growth counter (int32) and the found-inf flag (int32)
are device tensors; no call above reads them on the host, so a step can be captured in a CUDA
graph. ``step`` without a prior ``unscale_`` runs only the check and lets the fused optimizer
kernel multiply by the reciprocal (``optimizer.step(grads, found_inf=..., grad_scale=...)``).

One found-inf flag serves a whole iteration: with several optimizers, a non-finite gradient seen
by any check before ``update()`` skips every ``step`` that follows it in that iteration (PyTorch
keeps one flag per optimizer; its ``update`` combines them the same way).
"""
from __future__ import annotations

import numpy as np
import torch

from . import runtime
from .autograd import GradientMap
from .kernels import amp as KA
from .kernels import elementwise as KE
from .kernels import optim as KO
from .kernels.optim import _split
from .ops._autocast import autocast_state, get_autocast
from .ops.elementwise import mul, parameter_copies, to
from .tensor import FLOAT_DTYPES, Tensor

__all__ = ["DynamicLossScaler", "GradScaler", "ParameterCasts", "Policy", "autocast", "get_autocast_dtype",
           "is_autocast_enabled"]


class autocast(autocast_state):
    """``torch.autocast`` for flame: a context manager (or decorator) that runs the
    lower-precision ops in ``dtype`` (fp16 or bf16; fp32 is allowed and casts to fp32) and the
    fp32-list ops in fp32. ``enabled=False`` turns autocast off inside the block (e.g. around
    a part that must run in full precision); ``cache_enabled`` keeps one cast per parameter."""

    def __init__(self, dtype=torch.bfloat16, enabled: bool = True, cache_enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__}")
        super().__init__(dtype if enabled else None, cache=cache_enabled)

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast_state(self.dtype, self.cache):
                return fn(*args, **kwargs)

        return wrapper


def is_autocast_enabled() -> bool:
    return get_autocast() is not None


def get_autocast_dtype():
    """The current compute dtype, or None outside autocast."""
    return get_autocast()


def _cast_tree(x, dtype):
    if isinstance(x, Tensor):
        return to(x, dtype) if x.dtype in FLOAT_DTYPES and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_tree(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_tree(v, dtype) for k, v in x.items()}
    return x


class Policy:
    """A mixed-precision policy: ``param_dtype`` for the trained (master) parameters, the
    ``compute_dtype`` activations and the lower-precision ops run in, and ``output_dtype`` for
    what the model hands back (e.g. to the loss).

    ``Policy()`` is fp32 params, bf16 compute, fp32 output. ``policy.autocast()`` is the region;
    ``cast_to_param/compute/output(tree)`` cast floating tensors in a tensor, tuple, list or
    dict (recorded casts, so gradients flow back); ``apply(module, frozen_dtype=None)`` stores
    the parameters that require grad in ``param_dtype`` and, when ``frozen_dtype`` is given,
    the frozen ones in it (e.g. a bf16 base under fp32 LoRA adapters).
    """

    def __init__(self, param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=None):
        for name, dt in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype),
                         ("output_dtype", output_dtype)):
            if dt is not None and dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"Policy: {name} must be torch.float32, torch.bfloat16 or torch.float16, got {dt}")
        self.param_dtype = param_dtype
        self.compute_dtype = compute_dtype
        self.output_dtype = param_dtype if output_dtype is None else output_dtype

    def autocast(self) -> autocast:
        return autocast(self.compute_dtype)

    def cast_to_param(self, x):
        return _cast_tree(x, self.param_dtype)

    def cast_to_compute(self, x):
        return _cast_tree(x, self.compute_dtype)

    def cast_to_output(self, x):
        return _cast_tree(x, self.output_dtype)

    def apply(self, module, frozen_dtype=None):
        """Cast ``module``'s parameters in place (see the class docstring); returns ``module``."""
        from .nn.module import _cast
        for _, p in module.named_parameters():
            want = self.param_dtype if p.requires_grad else frozen_dtype
            if want is not None and p.dtype != want and p.dtype in FLOAT_DTYPES:
                p._data = _cast(p._data, want)
        return module

    def __repr__(self):
        return (f"Policy(param_dtype={self.param_dtype}, compute_dtype={self.compute_dtype}, "
                f"output_dtype={self.output_dtype})")


class ParameterCasts:
    """Copies of parameters in a compute dtype, made at once: a context manager.

    ``with ParameterCasts(params, torch.bfloat16): ...`` casts every floating parameter of
    ``params`` that is not already bf16 (the fp32 master weights of LoRA adapters) into one new
    buffer on entry, one launch per source dtype; inside, every cast of such a parameter to
    ``dtype`` (``to``, so the recorded casts of ``F.linear``, ``conv2d`` and autocast, and
    ``F.lora_linear``'s adapters) is its copy, not a launch each: an SDXL step with rank-16 LoRA
    on attn launches one kernel where it launched 1,120. Gradients still reach the parameters;
    a cast's result is shared, so it must not be written in place. The copies are of the values
    at entry: the parameters must not change inside the region (the optimizer steps after it, as
    with PyTorch's autocast weight cache).
    Each entry makes fresh copies, so a graph recorded in one region stays valid after the next;
    a region can be captured in a CUDA graph (the tables of buffer addresses are built on the
    first entry, or when a parameter's buffer moves, and must not be during a capture)."""

    def __init__(self, params, dtype=torch.bfloat16):
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"ParameterCasts: dtype must be torch.float16, torch.bfloat16 or torch.float32, "
                            f"got {dtype}")
        params = list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"ParameterCasts: expected flame Tensors, got {type(p).__name__}")
        # dense floating parameters of another dtype (any dim order: channels-last conv weights too), each
        # copied as its memory lies; the rest the ops cast themselves
        self.params = [p for p in params if p.dtype in FLOAT_DTYPES and p.dtype != dtype and p.numel()
                       and runtime.dense_order(p._data) is not None]
        self.dtype = dtype
        self._pointers, self._groups, self._layouts, self._total = None, [], [], 0
        self._prev = []

    def _plan(self):
        """Each copy's offset in the buffer (16-byte aligned, as TMA reads need), the launch tables,
        one per source dtype, and the layouts of the copies' views: the parameters of one shape and
        strides lie one after another, a view of them all (``_layouts``: its sizes, strides and first
        offset, and their keys) unbound into theirs on entry, a torch call per layout instead of one
        per copy. Rebuilt when a parameter's buffer has moved."""
        pointers = tuple(p._data.data_ptr() for p in self.params)
        if pointers == self._pointers:
            return
        align = 16 // self.dtype.itemsize
        alike = {}
        for p in self.params:
            alike.setdefault((tuple(p.shape), p._data.stride()), []).append(p)
        rows, self._layouts, offset = {}, [], 0
        for (shape, strides), group in alike.items():
            step = -(-group[0].numel() // align) * align
            self._layouts.append(((len(group), *shape), (step, *strides), offset,
                                  [(p.id, self.dtype) for p in group]))
            for p in group:
                rows.setdefault(p.dtype, []).append(((offset, p._data), p.numel(), 0))
                offset += step
        self._groups = [(dtype, KO.Tables(r)) for dtype, r in rows.items()]
        self._pointers, self._total = pointers, offset

    def __enter__(self):
        self._plan()
        buf = runtime.empty((max(self._total, 1),), self.dtype)
        for src_dtype, tables in self._groups:
            KO.axpby_(tables, src_dtype, self.dtype, 1.0, 0.0, dst_base=buf)
        copies = {}
        for shape, strides, offset, keys in self._layouts:
            copies.update(zip(keys, buf.as_strided(shape, strides, offset).unbind(0)))
        self._prev.append(parameter_copies(copies))
        return self

    def __exit__(self, *exc):
        parameter_copies(self._prev.pop())
        return False


def _device_scalar(value, dtype):
    host = torch.from_numpy(np.array(value, dtype=np.float32 if dtype == torch.float32 else np.int32))
    buf = runtime.empty((), dtype)
    KE.copy_(buf, host.to(runtime.device))  # host transfer (no sync)
    return buf


class DynamicLossScaler:
    """PyTorch's ``GradScaler`` (same defaults, update rule and state dict), device-resident."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if growth_factor <= 1.0:
            raise ValueError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise ValueError("The backoff factor must be < 1.0.")
        if not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._scale = _device_scalar(self._init_scale, torch.float32)
        self._inv_scale = _device_scalar(np.float32(1.0 / np.float64(np.float32(self._init_scale))), torch.float32)
        self._tracker = _device_scalar(0, torch.int32)
        self._found = runtime.empty((2,), torch.int32)  # [this iteration, last update's verdict]
        KE.fill_(self._found, 0)
        self._unscaled = {}  # id(grads) -> grads, for the current iteration
        self._tables = {}

    # ---- properties -----------------------------------------------------------------------
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def scale_tensor(self) -> Tensor:
        """The current scale: a 0-d fp32 device tensor (no host sync)."""
        return Tensor(self._scale)

    @property
    def inv_scale_tensor(self) -> Tensor:
        return Tensor(self._inv_scale)

    @property
    def found_inf(self) -> Tensor:
        """This iteration's flag (0-d int32, non-zero: a non-finite gradient was seen)."""
        return Tensor(self._found[0])

    def get_scale(self) -> float:
        """The scale as a Python float (a host sync); 1.0 when disabled, as PyTorch."""
        return float(self._scale.cpu().item()) if self._enabled else 1.0  # host transfer

    def get_growth_tracker(self) -> int:
        return int(self._tracker.cpu().item()) if self._enabled else 0  # host transfer

    def last_step_skipped(self) -> bool:
        """Whether the last ``update()`` saw a non-finite gradient (a host sync)."""
        return bool(self._found[1].cpu().item()) if self._enabled else False  # host transfer

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    # ---- the step -------------------------------------------------------------------------
    def scale(self, loss):
        """``loss * scale`` (differentiable; the scale is a device tensor)."""
        if not self._enabled:
            return loss
        if not isinstance(loss, Tensor):
            raise TypeError(f"DynamicLossScaler.scale expects a flame Tensor, got {type(loss).__name__}")
        return mul(loss, Tensor(self._scale))

    def _buckets(self, grads):
        if isinstance(grads, (GradientMap, dict)):
            values = list(grads.values())
        else:
            raise TypeError(f"expected the GradientMap returned by backward(), got {type(grads).__name__}")
        rows = {}
        for g in values:
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise TypeError(f"gradient is a {type(g).__name__}, not a flame Tensor")
            if g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients: keep trained parameters in fp32 "
                                 "(fp32 master weights) so their gradients are fp32")
            if g.dtype not in (torch.float32, torch.bfloat16, torch.float64):
                raise TypeError(f"cannot unscale a {g.dtype} gradient of shape {g.shape}")
            if runtime.dense_order(g._data) is None:
                raise ValueError(f"gradient of shape {g.shape} is not dense (strides {g.stride()}): its elements "
                                 "must fill their memory without gaps, in any order")
            if g.numel():
                rows.setdefault(g.dtype, []).append(g._data)
        out = []
        for dtype, bufs in rows.items():
            key = tuple((b.data_ptr(), b.numel()) for b in bufs)
            hit = self._tables.get(dtype)
            if hit is None or hit[0] != key:
                hit = self._tables[dtype] = (key, KA.Tables([((None, b, None, None), b.numel(), 0) for b in bufs]))
            out.append((hit[1], dtype))
        return out

    def unscale_(self, grads):
        """Multiply every gradient by the fp32 reciprocal of the scale, in place, and record on the
        device whether any is inf/NaN. At most once per iteration for a given GradientMap."""
        if not self._enabled:
            return
        if id(grads) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on these gradients since the last update().")
        for tables, dtype in self._buckets(grads):
            KA.check_(tables, dtype, self._found, self._inv_scale)
        self._unscaled[id(grads)] = grads

    unscale_and_check = unscale_

    def step(self, optimizer, grads):
        """``optimizer.step(grads)`` unless a gradient is inf/NaN (decided on the device)."""
        if not self._enabled:
            return optimizer.step(grads)
        found = Tensor(self._found[0])
        if id(grads) in self._unscaled:
            return optimizer.step(grads, found_inf=found)
        for tables, dtype in self._buckets(grads):
            KA.check_(tables, dtype, self._found)
        return optimizer.step(grads, found_inf=found, grad_scale=Tensor(self._inv_scale))

    def update(self, new_scale=None):
        """Back off or grow the scale on the device (PyTorch's rule); ``new_scale`` (a float or a
        1-element fp32 tensor, read on the host) sets it instead,
        leaving the growth counter as it is. Clears the iteration's found-inf flag."""
        if not self._enabled:
            return
        self._unscaled.clear()
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if new_scale.numel() != 1 or new_scale.dtype != torch.float32:
                    raise ValueError("new_scale should be a float or a 1-element fp32 tensor")
                new_scale = new_scale.item()  # host sync (rarely used)
            v = float(new_scale)
            KE.fill_(self._scale, v)
            KE.fill_(self._inv_scale, float(np.float32(1.0 / np.float64(np.float32(v)))))
            KE.copy_(self._found[1:], self._found[:1])
            KE.fill_(self._found[:1], 0)
            return
        KA.update_(self._scale, self._inv_scale, self._tracker, self._found, _split(self._growth_factor),
                   _split(self._backoff_factor), self._growth_interval)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """PyTorch's GradScaler state dict (host values: a sync, done at checkpoint time)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self.get_growth_tracker()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        scale = float(state_dict["scale"])
        self._init_scale = scale
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        KE.fill_(self._scale, scale)
        KE.fill_(self._inv_scale, float(np.float32(1.0 / np.float64(np.float32(scale)))))
        KE.fill_(self._tracker, int(state_dict.get("_growth_tracker", 0)))
        KE.fill_(self._found, 0)
        self._unscaled.clear()


GradScaler = DynamicLossScaler
