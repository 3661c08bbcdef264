"""Differentiable logic-gate networks (Petersen et al. 2022): ``LogicLayer``, ``GroupSum`` and
``Bits``, hard activations packed 32 samples to an int32 word for fast inference.

A ``LogicLayer(in_dim, out_dim, seed)`` has ``out_dim`` gates; gate g reads input columns
``a_index[g]`` and ``b_index[g]`` (int64 buffers, fixed, drawn from ``seed``, saved in the state
dict) and learns ``weight[g]`` (16 logits, one per two-input Boolean function, numbered by truth
table: 0 False, 1 AND, 2 A AND NOT B, 3 A, 4 NOT A AND B, 5 B, 6 XOR, 7 OR, 8 NOR, 9 XNOR, 10 NOT B,
11 B IMPLIES A, 12 NOT A, 13 A IMPLIES B, 14 NAND, 15 True). Soft mode (training) outputs the
softmax-weighted mixture of the functions' real relaxations on inputs in [0, 1]; hard mode
(``layer.hard()``, or ``set_hard(model)``) the argmax function, exactly, on inputs thresholded at
0.5, on float tensors or on ``Bits``. ``GroupSum(k, tau)`` sums each of k equal groups of outputs
and divides by tau: class scores.

Recurrent use needs nothing special: apply the layers to a state T times and back-propagate
through the unrolled graph (gradients of a layer used at every step add up); wrap chunks of
steps in ``flame.checkpoint.checkpoint`` to keep memory flat in T (``scripts/train_logic_rnn.py``).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import runtime
from ..kernels import elementwise as KE
from ..ops import logic as L
from ..ops.creation import tensor as _to_device
from ..tensor import Tensor, check_dtype
from . import init
from .module import Members, Module, Parameter

__all__ = ["Bits", "GroupSum", "LogicLayer", "random_wiring", "set_hard"]

FUNCTIONS = ("False", "AND", "A AND NOT B", "A", "NOT A AND B", "B", "XOR", "OR", "NOR", "XNOR", "NOT B",
             "B IMPLIES A", "NOT A", "A IMPLIES B", "NAND", "True")
PASS_A = 3  # the index of the function "A": residual initialisation favours it


def truth_table(code: int) -> np.ndarray:
    """Function ``code``'s outputs as a (2, 2) array indexed [a, b]."""
    return np.array([[(code >> 3) & 1, (code >> 2) & 1], [(code >> 1) & 1, code & 1]], dtype=np.int64)


def random_wiring(in_dim: int, out_dim: int, seed: int = 0, connections: str = "random"):
    """Two (out_dim,) int64 NumPy arrays of input indices drawn from ``seed``.

    ``"random"``: the 2 out_dim inputs are a shuffled sequence in which every input appears about
    equally often (each input used ``2 out_dim / in_dim`` times, rounded), and no gate reads one
    input twice when ``in_dim > 1``. ``"uniform"``: independent uniform draws."""
    if connections not in ("random", "uniform"):
        raise ValueError(f"connections must be 'random' or 'uniform', got {connections!r}")
    rng = np.random.default_rng(seed)
    if connections == "uniform":
        return rng.integers(0, in_dim, out_dim), rng.integers(0, in_dim, out_dim)
    slots = rng.permutation(np.resize(rng.permutation(in_dim), 2 * out_dim))
    a, b = slots[:out_dim].copy(), slots[out_dim:].copy()
    if in_dim > 1:
        for g in np.flatnonzero(a == b):
            for h in rng.permutation(out_dim):  # swap b with a gate that can take this one's
                if b[h] != a[g] and a[h] != a[g]:
                    b[g], b[h] = b[h], b[g]
                    break
    return a.astype(np.int64), b.astype(np.int64)


class Bits:
    """Boolean activations packed 32 samples to an int32 word: ``data`` (features, ceil(batch / 32))
    int32, bit t of word w holding sample 32 w + t, and ``batch``. ``LogicLayer`` (hard) maps Bits
    to Bits; ``GroupSum`` counts them."""

    __slots__ = ("batch", "data")

    def __init__(self, data: Tensor, batch: int):
        if not isinstance(data, Tensor) or data.dtype != torch.int32 or data.ndim != 2:
            raise TypeError("Bits: data must be a 2-D int32 flame Tensor of packed words")
        if data.shape[1] != -(-batch // 32):
            raise ValueError(f"Bits: {data.shape[1]} words per feature do not hold batch={batch}")
        self.data, self.batch = data, int(batch)

    @classmethod
    def pack(cls, x: Tensor, threshold: float = 0.5) -> Bits:
        """``x`` (batch, features) thresholded (``x > threshold``) and packed."""
        return cls(L.pack_bits(x, threshold), x.shape[0])

    def unpack(self, dtype=torch.float32) -> Tensor:
        """(batch, features) 0/1 values."""
        return L.unpack_bits(self.data, self.batch, dtype)

    @property
    def shape(self) -> tuple:
        return (self.batch, self.data.shape[0])

    def __repr__(self):
        return f"Bits(batch={self.batch}, features={self.data.shape[0]})"


class _WiringBuffers(Members):
    """A LogicLayer's buffer table. ``Module.state_dict`` reads it through ``items()`` and
    ``load_state_dict`` then writes the wiring in place, which no one tells the layer: any such walk,
    or a buffer assignment, marks the layer's input-gradient plan stale, so the next forward that
    needs it rebuilds it from the buffers (one host read). Lookups by name (``layer.a_index``) do not."""

    def __init__(self, mirror=None):
        super().__init__(mirror)
        self.stale = True

    def items(self):
        self.stale = True
        return super().items()

    def __setitem__(self, key, value):
        self.stale = True
        super().__setitem__(key, value)


class LogicLayer(Module):
    """``out_dim`` learned two-input logic gates on ``in_dim`` inputs in [0, 1] (see the module).

    ``seed``, ``connections``: the wiring (``random_wiring``), or give ``a_index`` and ``b_index``
    (sequences or int tensors of ``out_dim`` indices in [0, in_dim)). ``init``: ``"gaussian"``
    (logits N(0, 1), the paper's) or ``"residual"`` (logit ``residual_logit`` for the function A,
    0 for the rest: each gate starts as a pass-through of its first input, which lets deep and
    recurrent networks train). ``strict``: check every input lies in [0, 1] (a host sync per call).
    ``hard``: start in hard mode."""

    def __init__(self, in_dim: int, out_dim: int, seed: int = 0, connections: str = "random", a_index=None,
                 b_index=None, init: str = "gaussian", residual_logit: float = 5.0, strict: bool = False,
                 hard: bool = False, device=None, dtype=None):
        super().__init__()
        object.__setattr__(self, "_buffers", _WiringBuffers(self.__dict__))
        for name, v in (("in_dim", in_dim), ("out_dim", out_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LogicLayer: {name} must be a positive int, got {v!r}")
        if init not in ("gaussian", "residual"):
            raise ValueError(f"LogicLayer: init must be 'gaussian' or 'residual', got {init!r}")
        runtime.resolve_device(device)
        dtype = check_dtype(dtype or runtime.get_default_dtype())
        if not dtype.is_floating_point:
            raise TypeError(f"LogicLayer: parameters must be floating point, got {dtype}")
        self.in_dim, self.out_dim = int(in_dim), int(out_dim)
        self.init_mode, self.residual_logit = init, float(residual_logit)
        self.strict, self.is_hard = bool(strict), bool(hard)
        self.weight = Parameter(Tensor(runtime.empty((self.out_dim, 16), dtype)))
        if (a_index is None) != (b_index is None):
            raise ValueError("LogicLayer: give both a_index and b_index, or neither (then seed draws them)")
        if a_index is None:
            a_index, b_index = random_wiring(self.in_dim, self.out_dim, seed, connections)
        self.register_buffer("a_index", Tensor(runtime.empty((self.out_dim,), torch.int64)))
        self.register_buffer("b_index", Tensor(runtime.empty((self.out_dim,), torch.int64)))
        self.rewire(a_index, b_index)
        self._plan = None
        self.reset_parameters()

    def reset_parameters(self):
        if self.init_mode == "gaussian":
            init.normal_(self.weight)
        else:
            init.zeros_(self.weight)
            if not init._skipping:
                KE.fill_(self.weight._data[:, PASS_A], self.residual_logit)

    # ---- wiring ---------------------------------------------------------------------------------
    def rewire(self, a_index=None, b_index=None) -> LogicLayer:
        """Set the wiring (checked on the host: shapes, values in [0, in_dim)), or with no
        arguments just rebuild the input-gradient plan from the buffers at the next forward."""
        if a_index is not None or b_index is not None:
            if a_index is None or b_index is None:
                raise ValueError("LogicLayer.rewire: give both a_index and b_index")
            for name, v in (("a_index", a_index), ("b_index", b_index)):
                arr = L.wiring_array(v, name, self.out_dim, self.in_dim, "LogicLayer")
                KE.copy_(getattr(self, name)._data, _to_device(arr)._data)
        self._buffers.stale = True
        return self

    def plan(self) -> L.LogicPlan:
        """The input-gradient plan of the current wiring (built when stale: one host read)."""
        if self._plan is None or self._buffers.stale:
            self._plan = L.logic_plan(self.a_index, self.b_index, self.in_dim)  # raises on a bad wiring
            self._buffers.stale = False
        return self._plan

    # ---- modes ----------------------------------------------------------------------------------
    def hard(self, mode: bool = True) -> LogicLayer:
        """Evaluate the argmax gates exactly (``mode=True``) or the soft mixture (False)."""
        self.is_hard = bool(mode)
        return self

    def soft(self) -> LogicLayer:
        return self.hard(False)

    def codes(self) -> Tensor:
        """Each gate's argmax function (int32 (out_dim,), index into ``FUNCTIONS``)."""
        return L.logic_codes(self.weight)

    # ---- calling --------------------------------------------------------------------------------
    def forward(self, x):
        if isinstance(x, Bits):
            if x.data.shape[0] != self.in_dim:
                raise ValueError(f"LogicLayer: Bits of {x.data.shape[0]} features, expected in_dim={self.in_dim}")
            return Bits(L.logic_gates_packed(x.data, self.codes(), self.a_index, self.b_index), x.batch)
        if not isinstance(x, Tensor):
            raise TypeError(f"LogicLayer: input must be a flame Tensor or Bits, got {type(x).__name__}")
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"LogicLayer: input must be (batch, {self.in_dim}), got shape {x.shape}")
        plan = self.plan() if x.requires_grad and not self.is_hard else None
        return L.logic_gates(x, self.weight, self.a_index, self.b_index, plan=plan, hard=self.is_hard,
                             strict=self.strict)

    def extra_repr(self):
        return (f"in_dim={self.in_dim}, out_dim={self.out_dim}, {'hard' if self.is_hard else 'soft'}"
                + (", strict" if self.strict else ""))


class GroupSum(Module):
    """Class scores from gate outputs: (batch, n) -> (batch, k), the sum of each of k consecutive
    groups of n / k outputs, divided by ``tau``. On ``Bits``: the count of ones per group / tau."""

    def __init__(self, k: int, tau: float = 1.0):
        super().__init__()
        L._check_groups(k, tau, k, "GroupSum")
        self.k, self.tau = int(k), float(tau)

    def forward(self, x):
        n = x.shape[1] if isinstance(x, (Tensor, Bits)) and len(x.shape) == 2 else None
        if n is None or n % self.k:
            raise ValueError(f"GroupSum: input must be (batch, n) with n a multiple of k={self.k}, got "
                             f"{type(x).__name__} of shape {getattr(x, 'shape', None)}")
        if isinstance(x, Bits):
            return L.group_count(x.data, x.batch, self.k, self.tau)
        return L.group_sum(x, self.k, self.tau)

    def extra_repr(self):
        return f"k={self.k}, tau={self.tau}"


def set_hard(module: Module, mode: bool = True) -> Module:
    """Put every LogicLayer in ``module`` into hard (``mode=True``) or soft mode; returns ``module``."""
    for m in module.modules():
        if isinstance(m, LogicLayer):
            m.hard(mode)
    return module
