"""``EMA``: an exponential moving average of parameters, kept on the device in fp32.

    ema = d * ema + (1 - d) * p,   d = min(decay, (1 + n) / (10 + n))

after the n-th update (n = 0 for the first), as diffusers' ``EMAModel`` without warm-up: the average
follows the weights closely at first and settles to ``decay``. Each update is one multi-tensor launch
per parameter dtype (``kernels.optim.axpby_``); the decay is a kernel argument, so nothing waits on
the host. ``applied()`` puts the averages into the parameters for a while (to sample or save them)
and restores the trained weights after.
"""
from __future__ import annotations

import contextlib

import torch

from .. import runtime
from ..kernels import optim as K
from ..tensor import Tensor


class EMA:
    """The moving average of ``params`` (flame Parameters), starting from their current values."""

    def __init__(self, params, decay: float = 0.999):
        decay = float(decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA: decay must be in [0, 1), got {decay}")
        self.params, self.decay, self.updates = list(params), decay, 0
        self.shadow = [Tensor(runtime.empty(tuple(p.shape), torch.float32)) for p in self.params]
        self._update_tables = (None, None)  # (buffer pointers, tables) of the per-step update, built once
        self._copy(self.shadow, self.params)

    @staticmethod
    def _tables(dst, src):
        """{(src dtype, dst dtype): Tables} over the (dst, src) pairs, and their buffers' pointers."""
        groups = {}
        for d, s in zip(dst, src):
            if d.numel():
                groups.setdefault((s.dtype, d.dtype), []).append(((d._data, s._data), d.numel(), 0))
        return EMA._pointers(dst, src), {key: K.Tables(rows) for key, rows in groups.items()}

    @staticmethod
    def _pointers(dst, src):
        return tuple(b.data_ptr() for d, s in zip(dst, src) if d.numel() for b in (d._data, s._data))

    def _copy(self, dst, src, a=1.0, b=0.0):
        """dst = a * src + b * dst for each pair, one launch per (src dtype, dst dtype)."""
        for (s_dtype, d_dtype), tables in self._tables(dst, src)[1].items():
            K.axpby_(tables, s_dtype, d_dtype, a, b)

    def current_decay(self) -> float:
        """The decay the next update uses."""
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    def update(self) -> None:
        """Move the averages towards the parameters' current values."""
        d = self.current_decay()
        # the device tables are reused while the buffers stay: a host transfer per step would stall it
        if self._update_tables[0] != self._pointers(self.shadow, self.params):
            self._update_tables = self._tables(self.shadow, self.params)
        for (s_dtype, d_dtype), tables in self._update_tables[1].items():
            K.axpby_(tables, s_dtype, d_dtype, 1.0 - d, d)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self):
        """Inside, the parameters hold the averages (cast to their dtype); after, their own values."""
        saved = [Tensor(runtime.empty(tuple(p.shape), p.dtype)) for p in self.params]
        self._copy(saved, self.params)
        self._copy(self.params, self.shadow)
        try:
            yield self
        finally:
            self._copy(self.params, saved)

    def state_dict(self) -> dict:
        """``{"updates": n, "decay": d, "shadow": [fp32 tensors]}`` (the tensors are the live buffers)."""
        return {"updates": self.updates, "decay": self.decay, "shadow": list(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(tuple(a.shape) != tuple(b.shape)
                                                  for a, b in zip(shadow, self.shadow)):
            raise ValueError(f"EMA state holds {len(shadow)} tensors of other shapes than this EMA's "
                             f"{len(self.shadow)}")
        self._copy(self.shadow, shadow)
        self.updates = int(state["updates"])
