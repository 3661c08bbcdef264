"""Fused multi-tensor optimizers: ``AdamW``, ``Adam``, ``AdamW8bit``, ``SGD``, ``Lion`` and ``Prodigy``.

``opt.step(grads)`` takes the ``GradientMap`` returned by ``backward()`` (there is no ``.grad``
attribute to zero); parameters without a gradient in the map are skipped, their step counters
included. Each step is two kernel launches per (param group, param dtype, grad dtype) bucket: the
update of every tensor of the bucket, then the advance of their step counters (see
``flame.kernels.optim``). The device tables that describe a bucket are built once and rebuilt only
when its set of (param, state) buffers changes; a step whose gradients are new buffers rewrites
their pointers in the tables.

State is fp32 (moments, momentum buffers) plus an int64 step counter per parameter on the device;
parameters may be fp32, bf16 or fp16 (fp32 math, stored back in the parameter's dtype), in any
dense layout (contiguous, channels-last like flame's conv weights, transposed): the kernels treat
parameter, gradient and state as flat arrays, so the state is allocated in the parameter's layout
and a gradient in another layout is first copied into it (``backward`` already returns a dense
leaf's gradient in the leaf's layout).

``step(grads, found_inf=None, grad_scale=None)``: ``found_inf`` is a 1-element int32 device tensor
(non-zero: the kernels skip the whole update, step counters included, without a host sync);
``grad_scale`` a 1-element fp32 device tensor every gradient is multiplied by before use (fused
unscale for a loss scaler).

``stochastic_rounding=True`` (every optimizer here and ``Adafactor``; per group as a group entry):
bf16 parameters are trained directly, without fp32 master weights. The update is computed in fp32
as always and stored rounded stochastically to one of its two bf16 neighbours, with the
probabilities that make the rounding unbiased (``flame.kernels.optim._round_bf16_stochastic``), so
updates far below half a bf16 ulp still move the weights on average where rounding to nearest
would lose them. fp32 parameters are unaffected (the same kernels as without it), fp16 ones are refused.
The random bits are a pure function of ``rounding_seed`` (a group entry; default: the seed of
``flame.manual_seed``), the parameter's index in the optimizer, its step counter and the element:
nothing is drawn on the host per step (CUDA-graph safe), every data-parallel rank rounds alike, and
``state_dict``/``load_state_dict`` (group entries and step counters) resume bit for bit.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .. import runtime
from ..autograd import GradientMap
from ..kernels import elementwise as KE
from ..kernels import optim as K
from ..ops.creation import get_rng_state
from ..tensor import Tensor

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_flag(x, name, dtype):
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"step: {name} must be a flame Tensor or None, got {type(x).__name__}")
    if x.dtype != dtype or x.numel() != 1:
        raise TypeError(f"step: {name} must be a 1-element {dtype} tensor, got dtype {x.dtype} shape {x.shape}")
    return x._data


def _zeros(shape, dtype):
    buf = runtime.empty(tuple(shape), dtype)
    KE.fill_(buf, 0)
    return buf


def _zeros_like(buf, dtype):
    """Zeros laid out as the dense buffer ``buf``: a parameter's state, updated element for element
    with it by flat kernels."""
    out = runtime.empty_like(buf, dtype)
    KE.fill_(out, 0)
    return out


def _device_f64(values):
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(runtime.device)  # host transfer


def _copy_in(dst, src, what):
    """Copy a saved state value (flame or torch tensor) into device buffer ``dst``."""
    if isinstance(src, Tensor):
        src = src._data
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"load_state_dict: {what} must be a tensor, got {type(src).__name__}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"load_state_dict: {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if src.dtype.is_floating_point != dst.dtype.is_floating_point:
        raise TypeError(f"load_state_dict: {what} is {src.dtype}, expected {dst.dtype}")
    if src.device != dst.device:
        src = src.to(dst.device)  # host transfer
    KE.copy_(dst, src)


class Optimizer:
    """Base class: param groups, per-parameter state, bucketed multi-tensor launches."""

    _state_names: tuple = ()

    def __init__(self, params, defaults, stochastic_rounding=False, rounding_seed=None):
        if rounding_seed is None:
            rounding_seed = get_rng_state()["seed"]  # read, not drawn: the generator does not move
        self.defaults = dict(defaults, stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        self.param_groups = []
        self.state = {}  # param id -> {name: torch buffer}
        self._slots = {}  # param id -> index into the device step counters
        self._steps = None  # int64 device tensor, one counter per parameter
        self._tables = {}  # (group, dtypes) -> [(plan version, step slots), gradient pointers, Tables]
        self._plans = {}  # group index -> (version, entries); see _plan
        self._version = 0
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            "but got a Tensor")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for group in params:
            self.add_param_group(group)

    # ---- groups ---------------------------------------------------------------------------
    def add_param_group(self, group: dict) -> None:
        if not isinstance(group, dict):
            raise TypeError(f"param group must be a dict, got {type(group).__name__}")
        group = dict(group)
        ps = group.get("params")
        if ps is None:
            raise ValueError("param group needs a 'params' entry")
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        seen = set(self._slots)
        for p in ps:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize flame Tensors, got {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{type(self).__name__}: parameters must be fp32, bf16 or fp16, got {p.dtype} "
                                f"(shape {p.shape})")
            if runtime.dense_order(p._data) is None:
                raise ValueError(f"{type(self).__name__}: parameters must be dense (contiguous, channels-last or "
                                 f"another order without gaps), got shape {p.shape} strides {p.stride()}")
            if p.id in seen:
                raise ValueError("some parameters appear in more than one parameter group")
            seen.add(p.id)
        group["params"] = ps
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        self._validate(group)
        self._check_rounding(group)
        self.param_groups.append(group)
        old = self._steps
        for p in ps:
            self._slots[p.id] = len(self._slots)
        steps = _zeros((len(self._slots),), torch.int64)
        if old is not None and old.numel():
            KE.copy_(steps[: old.numel()], old)
        self._steps = steps
        self._tables.clear()
        self._plans.clear()

    def _validate(self, group):
        if group["lr"] < 0:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        if group.get("weight_decay", 0.0) < 0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        for i, b in enumerate(group.get("betas", ())):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        eps = group.get("eps", 0.0)
        if isinstance(eps, (int, float)) and eps < 0:
            raise ValueError(f"Invalid epsilon value: {eps}")

    def _check_rounding(self, group):
        """The group's stochastic-rounding entries: a bool, a seed in [0, 2^63), no fp16 parameter when on."""
        name = type(self).__name__
        on, seed = group["stochastic_rounding"], group["rounding_seed"]
        if not isinstance(on, bool):
            raise TypeError(f"{name}: stochastic_rounding must be True or False, got {on!r}")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"{name}: rounding_seed must be an int in [0, 2**63), got {seed!r}")
        for p in group["params"] if on else ():
            self._rounding(group, p.dtype)

    def _rounding(self, group, p_dtype):
        """The stochastic-rounding seed for the group's ``p_dtype`` parameters: None (round to nearest)
        when it is off or the parameters are fp32."""
        if not group["stochastic_rounding"] or p_dtype == torch.float32:
            return None
        if p_dtype != torch.bfloat16:
            raise ValueError(f"{type(self).__name__}: stochastic_rounding rounds fp32 updates to bf16 parameters; "
                             f"this group has {p_dtype} ones (use bf16 weights, or turn stochastic_rounding off)")
        return int(group["rounding_seed"])

    # ---- state ----------------------------------------------------------------------------
    def _state_for(self, p):
        st = self.state.get(p.id)
        if st is None:
            st = self.state[p.id] = self._new_state(p)
        return st

    def _new_state(self, p) -> dict:
        """A parameter's state buffers, named as ``_state_names`` (at most four, in that order in
        the kernels' tables): fp32 zeros in the parameter's layout unless an optimizer keeps others."""
        return {name: _zeros_like(p._data, torch.float32) for name in self._state_names}

    def _plan(self, gi):
        """Per-group list of (param, its buffer, the buffer's dtype, shape and strides, id, step slot,
        state buffers, numel), built once (and again when a parameter's buffer was swapped, e.g. by
        ``Module.to``)."""
        plan = self._plans.get(gi)
        if plan is not None and all(e[0]._data is e[1] for e in plan[1]):
            return plan
        entries = []
        for p in self.param_groups[gi]["params"]:
            st = self._state_for(p)
            bufs = tuple(st[n] for n in self._state_names)
            pdata = p._data
            entries.append((p, pdata, pdata.dtype, pdata.shape, pdata.stride(), p.id, self._slots[p.id], bufs,
                            p.numel()))
        self._version += 1
        plan = self._plans[gi] = (self._version, entries)
        return plan

    @staticmethod
    def _checked_grad(p, g, held):
        if not isinstance(g, Tensor):
            raise TypeError(f"gradient for parameter of shape {p.shape} is a {type(g).__name__}, "
                            "not a flame Tensor")
        if g.shape != p.shape:
            raise ValueError(f"gradient of shape {g.shape} for parameter of shape {p.shape}")
        if g.dtype not in (torch.float32, p.dtype):
            raise TypeError(f"gradient dtype {g.dtype} for a {p.dtype} parameter (expected float32 or {p.dtype})")
        if runtime.same_dense_layout(g._data, p._data):
            return g._data
        out = runtime.empty_like(p._data, g.dtype)  # the flat kernels need the parameter's layout
        KE.copy_(out, g._data)
        held.append(out)  # the device tables point at it: it must live until the update is launched
        return out

    def _buckets(self, gi, lookup, held):
        """{(param dtype, grad dtype): Tables} for group ``gi``'s parameters that have a gradient.
        The tables are rebuilt only when the set of parameters with a gradient changes; when only
        the gradients' buffers did (a new backward's), their pointers are rewritten in place
        (``Tables.set_grads``). Gradients copied into their parameter's layout go to ``held``, which
        the caller keeps until the update kernels are launched."""
        version, entries = self._plan(gi)
        rows = {}
        f32 = torch.float32
        for p, pdata, pdtype, pshape, pstride, pid, slot, sbufs, numel in entries:
            g = lookup(pid)
            if g is None:
                continue
            gd = g._data if isinstance(g, Tensor) else None
            # the parameter's shape and strides: dense in its layout, as the parameter is (add_param_group)
            if gd is None or (gd.dtype is not f32 and gd.dtype != pdtype) or gd.stride() != pstride \
                    or gd.shape != pshape:
                gd = self._checked_grad(p, g, held)
            key = (pdtype, gd.dtype)
            bucket = rows.get(key)
            if bucket is None:
                bucket = rows[key] = ([], [], [])
            bucket[0].append((pdata, gd, sbufs, numel, slot))
            bucket[1].append(slot)
            bucket[2].append(gd.data_ptr())
        out = {}
        for key, (lst, slots, ptrs) in rows.items():
            sig = (version, slots)
            hit = self._tables.get((gi, key))
            if hit is None or hit[0] != sig:
                tables = K.Tables([((pdata, gd, *sbufs), numel, slot) for pdata, gd, sbufs, numel, slot in lst])
                hit = self._tables[(gi, key)] = [sig, ptrs, tables]
            elif hit[1] != ptrs:
                hit[2].set_grads(ptrs)
                hit[1] = ptrs
            out[key] = hit[2]
        return out

    def step(self, grads, found_inf: Tensor | None = None, grad_scale: Tensor | None = None):
        """Update every parameter that has a gradient in ``grads`` (a GradientMap)."""
        if isinstance(grads, GradientMap):
            lookup = grads.by_id.get
        elif isinstance(grads, dict):
            lookup = {(k if isinstance(k, int) else k.id): v for k, v in grads.items()}.get
        else:
            raise TypeError(f"step expects the GradientMap returned by backward(), got {type(grads).__name__}")
        found = _check_flag(found_inf, "found_inf", torch.int32)
        scale = _check_flag(grad_scale, "grad_scale", torch.float32)
        held = []  # gradients copied for the kernels, alive until the launches below
        self._apply([(group, tables, pd, gd) for gi, group in enumerate(self.param_groups)
                     for (pd, gd), tables in self._buckets(gi, lookup, held).items()], found, scale)

    def _apply(self, buckets, found, scale):
        """Launch the update of every ``(group, Tables, param dtype, grad dtype)`` bucket: each on its
        own (``_update``) unless an optimizer needs statistics over all of them first."""
        for group, tables, pd, gd in buckets:
            self._update(group, tables, pd, gd, found, scale)

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        raise NotImplementedError

    # ---- checkpoints ----------------------------------------------------------------------
    def _flat_params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """``{"state": {index: {"step": int, <name>: Tensor}}, "param_groups": [...]}`` as torch,
        with parameters named by their index across groups. State tensors are copies."""
        steps = self._steps.cpu().numpy() if self._steps is not None else None  # host transfer
        state = {}
        for i, p in enumerate(self._flat_params()):
            st = self.state.get(p.id)
            step = int(steps[self._slots[p.id]])
            if st is None or step == 0:  # never updated: no state, as torch
                continue
            entry = {"step": step}
            for name, buf in st.items():
                if buf is None:  # a state this parameter does not keep (e.g. fp32 moments: no block maxima)
                    continue
                copy = runtime.empty(tuple(buf.shape), buf.dtype)
                KE.copy_(copy, buf)
                entry[name] = Tensor(copy)
            state[i] = entry
        groups = []
        index = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(f"loaded state dict contains a parameter group {i} of {len(saved['params'])} "
                                 f"parameters that doesn't match the size of optimizer's group "
                                 f"({len(mine['params'])})")
        flat = self._flat_params()
        index_of = {}
        for mine, saved in zip(self.param_groups, groups):
            for p, idx in zip(mine["params"], saved["params"]):
                index_of[idx] = p
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if isinstance(v, list) and k == "betas" else v
            self._check_rounding(mine)
        steps = np.zeros(len(self._slots), dtype=np.int64)  # parameters without saved state start afresh
        self.state = {}
        for idx, entry in state_dict["state"].items():
            p = index_of.get(int(idx))
            if p is None:
                raise KeyError(f"load_state_dict: state for parameter index {idx}, which no group holds "
                               f"(this optimizer has {len(flat)} parameters)")
            st = self._state_for(p)
            for name in self._state_names:
                if st[name] is None:
                    continue
                if name not in entry:
                    raise KeyError(f"load_state_dict: state of parameter {idx} lacks {name!r}")
                _copy_in(st[name], entry[name], f"state[{idx}][{name!r}]")
            step = entry.get("step", 0)
            steps[self._slots[p.id]] = int(step.item() if hasattr(step, "item") else step)
        self._steps = torch.from_numpy(steps).to(runtime.device)  # host transfer
        self._tables.clear()
        self._plans.clear()

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for k in sorted(g):
                if k != "params":
                    lines.append(f"    {k}: {g[k]}")
        lines.append(")")
        return "\n".join(lines)


class Adam(Optimizer):
    """Adam with L2 weight decay (``weight_decay * param`` added to the gradient), as ``torch.optim.Adam``."""

    _state_names = ("exp_avg", "exp_avg_sq")
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False, stochastic_rounding=False, rounding_seed=None):
        if amsgrad:
            raise NotImplementedError(f"{type(self).__name__}: amsgrad=True is not supported")
        if maximize:
            raise NotImplementedError(f"{type(self).__name__}: maximize=True is not supported")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=False, maximize=False), stochastic_rounding, rounding_seed)

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        b1, b2 = group["betas"]
        K.adam_step(tables, self._steps, p_dtype, g_dtype, float(group["lr"]), float(b1), float(b2),
                    float(group["eps"]), float(group["weight_decay"]), self._decoupled, found, scale,
                    self._rounding(group, p_dtype))


class AdamW(Adam):
    """Adam with decoupled weight decay (``param *= 1 - lr * weight_decay``), as ``torch.optim.AdamW``."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False, stochastic_rounding=False, rounding_seed=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)


class AdamW8bit(Optimizer):
    """AdamW with its two moments stored in 8 bits per element (bitsandbytes' ``AdamW8bit``, the
    blockwise kind): each block of 256 elements keeps its largest magnitude in fp32 and each element
    the nearest of 256 codes of a dynamic map (dense near zero) to its value over that maximum; the
    update dequantizes, computes in fp32 and quantizes again in the same kernel. Tensors of fewer
    than ``min_8bit_size`` elements keep fp32 moments. About a quarter of AdamW's state memory.
    As bitsandbytes: the weight decay multiplies the parameter after the Adam step; a non-finite
    gradient element resets its moments and leaves its parameter (use ``found_inf`` to skip a step).
    State names are bitsandbytes' (``state1``, ``state2``, ``absmax1``, ``absmax2``)."""

    _state_names = ("state1", "state2", "absmax1", "absmax2")
    BLOCK = 256

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, min_8bit_size=4096,
                 stochastic_rounding=False, rounding_seed=None):
        if min_8bit_size < 0:
            raise ValueError(f"Invalid min_8bit_size: {min_8bit_size}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      min_8bit_size=int(min_8bit_size)), stochastic_rounding, rounding_seed)

    def _new_state(self, p):
        if p.numel() < self.defaults["min_8bit_size"]:
            return {"state1": _zeros_like(p._data, torch.float32), "state2": _zeros_like(p._data, torch.float32),
                    "absmax1": None, "absmax2": None}
        blocks = -(-p.numel() // self.BLOCK)
        return {"state1": _zeros_like(p._data, torch.uint8), "state2": _zeros_like(p._data, torch.uint8),
                "absmax1": _zeros((blocks,), torch.float32), "absmax2": _zeros((blocks,), torch.float32)}

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        b1, b2 = group["betas"]
        K.adam8bit_step(tables, self._steps, p_dtype, g_dtype, float(group["lr"]), float(b1), float(b2),
                        float(group["eps"]), float(group["weight_decay"]), found, scale, self._rounding(group, p_dtype))


class SGD(Optimizer):
    """SGD with momentum, dampening, Nesterov momentum and L2 weight decay, as ``torch.optim.SGD``."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 maximize=False, stochastic_rounding=False, rounding_seed=None):
        if maximize:
            raise NotImplementedError("SGD: maximize=True is not supported")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=False), stochastic_rounding, rounding_seed)

    def _validate(self, group):
        super()._validate(group)
        if group["momentum"] < 0:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @property
    def _state_names(self):
        return ("momentum_buffer",) if any(g["momentum"] != 0 for g in self.param_groups) or \
            self.defaults["momentum"] != 0 else ()

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        K.sgd_step(tables, self._steps, p_dtype, g_dtype, float(group["lr"]), float(group["momentum"]),
                   float(group["dampening"]), float(group["weight_decay"]), bool(group["nesterov"]), found, scale,
                   self._rounding(group, p_dtype))


class Lion(Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolation of momentum and gradient, decoupled
    weight decay, one fp32 moment, as ``lion-pytorch``. Usual settings: a learning rate 3-10x below
    AdamW's and a weight decay as many times above, betas (0.9, 0.99)."""

    _state_names = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, stochastic_rounding=False,
                 rounding_seed=None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), stochastic_rounding,
                         rounding_seed)

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        b1, b2 = group["betas"]
        K.lion_step(tables, self._steps, p_dtype, g_dtype, float(group["lr"]), float(b1), float(b2),
                    float(group["weight_decay"]), found, scale, self._rounding(group, p_dtype))


class Prodigy(Optimizer):
    """Prodigy (Mishchenko & Defazio 2023): Adam whose step size D is estimated on the fly from how
    far the parameters moved against the gradients, so ``lr`` stays 1.0 (a multiplier on D), as
    ``prodigyopt.Prodigy`` 1.1.2. D, its maximum, the estimate's running numerator and the step
    count live on the device and are shared by all parameter groups, which must therefore have one
    ``lr`` (groups with lr 0 are left out). Per parameter: exp_avg, exp_avg_sq, s and p0 (the
    parameter at its first step), fp32. Each step: a statistics launch per bucket, one launch for
    the new D, an update launch per bucket; no host sync. ``slice_p`` and FSDP are not offered."""

    _state_names = ("exp_avg", "exp_avg_sq", "s", "p0")
    _GROUP_SCALARS = {name: slot.value for name, slot in (
        ("d", K.PRODIGY_D), ("d_max", K.PRODIGY_D_MAX), ("d_numerator", K.PRODIGY_NUM), ("k", K.PRODIGY_K),
        ("d_hat", K.PRODIGY_D_HAT))}

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0.0, decouple=True,
                 use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float("inf"),
                 stochastic_rounding=False, rounding_seed=None):
        if not d0 > 0:
            raise ValueError(f"Invalid d0 value: {d0}")
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), beta3=beta3, eps=eps, weight_decay=weight_decay,
                                      decouple=decouple, use_bias_correction=use_bias_correction,
                                      safeguard_warmup=safeguard_warmup, d0=d0, d_coef=d_coef,
                                      growth_rate=growth_rate), stochastic_rounding, rounding_seed)
        self._scalars = _device_f64([d0, d0, 0.0, 0.0, 0.0, d0, 0.0, d0])

    def _new_state(self, p):
        state = super()._new_state(p)
        KE.copy_(state["p0"], p._data)
        return state

    def _apply(self, buckets, found, scale):
        lrs = {float(g["lr"]) for g, *_ in buckets} - {0.0}
        if len(lrs) > 1:
            raise ValueError(f"Prodigy: parameter groups with different learning rates ({sorted(lrs)}); D is one "
                             "estimate for all groups, so their lr (a multiplier on D) must be the same, or 0")
        if not lrs:
            return
        g0 = self.param_groups[0]
        b1, b2 = g0["betas"]
        b3 = g0["beta3"] if g0["beta3"] is not None else math.sqrt(b2)
        K.prodigy_step([(t, pd, gd, float(g["weight_decay"]), float(g["eps"]), self._rounding(g, pd))
                        for g, t, pd, gd in buckets if g["lr"] != 0], self._steps, self._scalars, lrs.pop(), b1, b2,
                       b3, g0["decouple"], g0["d_coef"], g0["growth_rate"], g0["use_bias_correction"],
                       g0["safeguard_warmup"], found, scale)

    def state_dict(self) -> dict:
        """As the base, with the estimate's scalars in every group (as prodigyopt keeps them)."""
        out = super().state_dict()
        values = self._scalars.cpu().tolist()  # host transfer
        for group in out["param_groups"]:
            group.update({name: values[i] for name, i in self._GROUP_SCALARS.items()})
            group["k"] = int(group["k"])
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        values = self._scalars.cpu().tolist()  # host transfer
        for name, i in self._GROUP_SCALARS.items():
            if name in self.param_groups[0]:
                values[i] = float(self.param_groups[0].pop(name))
        for group in self.param_groups[1:]:
            for name in self._GROUP_SCALARS:
                group.pop(name, None)
        values[K.PRODIGY_D0.value] = float(self.param_groups[0]["d0"])
        self._scalars = _device_f64(values)
