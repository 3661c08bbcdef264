"""Adafactor with transformers' semantics (``transformers.optimization.Adafactor``), fused kernels.

Same constructor, defaults and argument errors; the same per-parameter state under the same names
and shapes (``exp_avg`` with ``beta1``; ``exp_avg_sq_row`` of shape ``shape[:-1]`` and
``exp_avg_sq_col`` of shape ``shape[:-2] + shape[-1:]`` for parameters of 2 or more dims, the
factoring over their last two logical dims whatever their memory layout; ``exp_avg_sq`` otherwise;
``RMS``, a 0-d tensor; ``step``), so state dicts load either way. Each step is five launches per
(param group, param dtype, grad dtype) bucket (``flame.kernels.adafactor``); everything stays on
the device, the step counters (which drive the relative step size and ``beta2t``) included, so a
``found_inf`` skip needs no host sync. State is fp32; parameters may be fp32, bf16 or fp16 (fp32
math, stored back in the parameter's dtype; ``stochastic_rounding`` and ``rounding_seed`` as for
``flame.optim.AdamW``: bf16 parameters rounded stochastically, the group entries saved).

One difference: ``lr=None`` with ``relative_step=False`` raises ValueError here (transformers fails
later, inside ``step``).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels import adafactor as KA
from .optimizers import Optimizer, _copy_in, _zeros, _zeros_like


class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern 2018): factored second moments, update clipping, relative step
    sizes scaled by the parameter's RMS. For an external schedule use ``scale_parameter=False,
    relative_step=False`` and an ``lr``."""

    _state_names = ()  # per parameter: factored or not, with or without exp_avg (see _new_state)

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False,
                 stochastic_rounding=False, rounding_seed=None):
        if lr is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        self._group_of = {}  # param id -> its group
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init),
                         stochastic_rounding, rounding_seed)

    def add_param_group(self, group: dict) -> None:
        super().add_param_group(group)
        added = self.param_groups[-1]
        self._group_of.update((p.id, added) for p in added["params"])

    def _validate(self, group):
        if group["lr"] is None and not group["relative_step"]:
            raise ValueError("Adafactor: relative_step=False needs an external `lr`")
        if len(tuple(group["eps"])) != 2:
            raise ValueError(f"Adafactor: eps must be a pair (eps for the squared gradient, eps for the "
                             f"parameter scale), got {group['eps']!r}")
        for p in group["params"]:
            KA.geometry(p._data)  # factored layouts the kernels can't index raise here

    def _new_state(self, p) -> dict:
        shape = tuple(p.shape)
        st = {}
        if self._group_of[p.id]["beta1"] is not None:
            st["exp_avg"] = _zeros_like(p._data, torch.float32)
        if len(shape) >= 2:
            st["exp_avg_sq_row"] = _zeros(shape[:-1], torch.float32)
            st["exp_avg_sq_col"] = _zeros(shape[:-2] + shape[-1:], torch.float32)
        else:
            st["exp_avg_sq"] = _zeros_like(p._data, torch.float32)
        st["RMS"] = _zeros((), torch.float32)
        return st

    def _buckets(self, gi, lookup, held):
        """{(param dtype, grad dtype): kernels.adafactor.Tables} for group ``gi``'s parameters that
        have a gradient, rebuilt only when the set of (parameter, gradient, state) buffers changes."""
        version, entries = self._plan(gi)
        beta1 = self.param_groups[gi]["beta1"]
        rows = {}
        for p, pdata, _, _, _, pid, slot, _, _ in entries:
            g = lookup(pid)
            if g is None:
                continue
            gdata = self._checked_grad(p, g, held)
            st = self.state[pid]
            if beta1 is not None and "exp_avg" not in st:  # beta1 set on the group after the state was made
                st["exp_avg"] = _zeros_like(pdata, torch.float32)
            rows.setdefault((pdata.dtype, gdata.dtype), []).append((pdata, gdata, st, slot))
        out = {}
        for key, lst in rows.items():
            sig = (version, tuple((slot, gdata.data_ptr(), "exp_avg" in st) for _, gdata, st, slot in lst))
            hit = self._tables.get((gi, key))
            if hit is None or hit[0] != sig:
                hit = self._tables[(gi, key)] = (sig, KA.Tables(lst))
            out[key] = hit[1]
        return out

    def _update(self, group, tables, p_dtype, g_dtype, found, scale):
        KA.adafactor_step(tables, self._steps, p_dtype, g_dtype, lr=group["lr"], eps=tuple(group["eps"]),
                          clip_threshold=group["clip_threshold"], decay_rate=group["decay_rate"],
                          beta1=group["beta1"], weight_decay=group["weight_decay"],
                          scale_parameter=group["scale_parameter"], relative_step=group["relative_step"],
                          warmup_init=group["warmup_init"], found_inf=found, grad_scale=scale,
                          rounding=self._rounding(group, p_dtype))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of transformers' Adafactor (same names and shapes)."""
        super().load_state_dict(state_dict)  # groups, step counters, fresh state for the saved parameters
        index_of = {idx: p for mine, saved in zip(self.param_groups, state_dict["param_groups"])
                    for p, idx in zip(mine["params"], saved["params"])}
        for idx, entry in state_dict["state"].items():
            st = self.state[index_of[int(idx)].id]
            for name, buf in st.items():
                if name not in entry:
                    raise KeyError(f"load_state_dict: state of parameter {idx} lacks {name!r}")
                value = entry[name]
                if not hasattr(value, "shape"):  # transformers' RMS before a first step: a number
                    value = torch.from_numpy(np.asarray(float(value), dtype=np.float32))
                _copy_in(buf, value, f"state[{idx}][{name!r}]")
