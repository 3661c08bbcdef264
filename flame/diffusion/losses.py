"""The training losses of kohya's sd-scripts (``--loss_type``, ``--huber_schedule``, ``--huber_c``,
``--huber_scale``), built on flame ops.

Formulas read from kohya-ss/sd-scripts ``library/train_util.py`` at commit ``48d368f`` (2026-02-16):
``conditional_loss`` and ``get_huber_threshold_if_needed``. With ``d = pred - target`` and ``c``
the Huber threshold of each sample:

- ``"l2"``: ``d^2``; ``"l1"``: ``|d|``;
- ``"huber"`` (pseudo-Huber): ``2 c (sqrt(d^2 + c^2) - c)``, which is ``~ d^2`` for ``|d| << c`` and
  ``~ 2 c |d|`` for ``|d| >> c``;
- ``"smooth_l1"``: ``2 (sqrt(d^2 + c^2) - c)``, the same curve divided by ``c``: ``~ d^2 / c`` near 0
  and ``~ 2 |d|`` in the tails (kohya's, not PyTorch's piecewise ``smooth_l1_loss``).

Every type is reduced as kohya's ``train_network.py`` does: mean over the non-batch dims of each
sample, times the per-sample weight (min-SNR and the like), mean over the batch. The inputs are
computed in fp32 (kohya's ``.float()``) and the loss is a 0-d fp32 tensor.

``c`` per timestep (``huber_c_per_timestep``), ``T = num_train_timesteps``:

- ``"constant"``: ``huber_c * huber_scale``;
- ``"exponential"``: ``huber_scale * exp(-alpha t)`` with ``alpha = -ln(huber_c) / T``, so ``c`` goes
  from ``huber_scale`` at ``t = 0`` to ``huber_c * huber_scale`` at ``t = T``;
- ``"snr"``: ``(1 - huber_c) / (1 + sigma_t)^2 + huber_c`` with ``sigma_t = sqrt((1 - abar_t) /
  abar_t) = 1 / sqrt(snr_t)``: ``c ~ 1`` at low noise, ``-> huber_c`` at high noise. As in kohya,
  this schedule ignores ``huber_scale``.
"""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch

from ..ops.creation import full
from ..ops.elementwise import add, div, exp, mul, rsqrt, sqrt, sub, to
from ..ops.loss import l1_loss, mse_loss
from ..ops.reduce import mean
from ..tensor import Tensor

if TYPE_CHECKING:
    from .schedule import DDPMSchedule

LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")


def _positive(value, name, op) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 < value < math.inf:
        raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
    return float(value)


def _per_sample(value, name, batch, ndim, op) -> Tensor:
    """A (B,) floating tensor as fp32 (B, 1, ..., 1), broadcasting against a (B, ...) tensor."""
    if not isinstance(value, Tensor) or not value.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a floating-point flame Tensor of shape ({batch},), got "
                         f"{getattr(value, 'dtype', type(value).__name__)}")
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{op}: {name} must have shape ({batch},) (one value per sample), got {tuple(value.shape)}")
    return to(value.reshape((batch,) + (1,) * (ndim - 1)), torch.float32)


def diffusion_loss(pred: Tensor, target: Tensor, loss_type: str = "l2", weights: Tensor | None = None,
                   huber_c: Tensor | float | None = None) -> Tensor:
    """``mean_b(w_b * mean_{c,h,w}(loss(pred_b - target_b)))`` as a 0-d fp32 tensor (module doc for
    each ``loss_type``), differentiable in ``pred`` and ``target``.

    ``weights``: per-sample (B,) weights or None (all ones: the plain mean). ``huber_c``: the
    threshold ``c`` of ``"huber"`` and ``"smooth_l1"`` (required by those, refused by the others),
    a positive float or a (B,) tensor such as ``huber_c_per_timestep``'s (its values must be
    positive; they are not read back to check, so a CUDA-graph step does not sync).
    """
    op = "diffusion_loss"
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{op}: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    for name, v in (("pred", pred), ("target", target)):
        if not isinstance(v, Tensor) or v.ndim == 0 or not v.dtype.is_floating_point:
            raise ValueError(f"{op}: {name} must be a batched floating-point flame Tensor, got "
                             f"{getattr(v, 'shape', type(v).__name__)} {getattr(v, 'dtype', '')}".rstrip())
    if pred.shape != target.shape:
        raise ValueError(f"{op}: pred {tuple(pred.shape)} and target {tuple(target.shape)} must have the same shape")
    batch, ndim = pred.shape[0], pred.ndim
    w = None if weights is None else _per_sample(weights, "weights", batch, ndim, op)
    huber = loss_type in ("huber", "smooth_l1")
    if huber and huber_c is None:
        raise ValueError(f"{op}: loss_type {loss_type!r} needs huber_c (a positive float or a ({batch},) tensor)")
    if not huber and huber_c is not None:
        raise ValueError(f"{op}: huber_c is used only by 'huber' and 'smooth_l1', not by {loss_type!r}")
    pred, target = to(pred, torch.float32), to(target, torch.float32)

    if not huber:  # one fused kernel: sum_i w_i l_i, then / numel (every sample has numel / B elements)
        fn = mse_loss if loss_type == "l2" else l1_loss
        if w is None:
            return fn(pred, target)
        return mul(fn(pred, target, reduction="sum", weight=w), 1.0 / max(1, pred.numel()))

    if isinstance(huber_c, Tensor):
        c = _per_sample(huber_c, "huber_c", batch, ndim, op)
    else:
        c = full((batch,) + (1,) * (ndim - 1), _positive(huber_c, "huber_c", op), dtype=torch.float32)
    d = sub(pred, target)
    r = sub(sqrt(add(mul(d, d), mul(c, c))), c)  # sqrt(d^2 + c^2) - c
    # The per-sample factor in front of r: 2c (huber) or 2 (smooth_l1), times the weight; the mean
    # of w_b f_b r over all elements is the batch mean of the per-sample means (equal sample sizes).
    factor = mul(c, 2.0) if loss_type == "huber" else 2.0
    if w is not None:
        factor = mul(w, factor)
    return mean(mul(r, factor))


def weighted_mse_loss(pred: Tensor, target: Tensor, weights: Tensor | None = None) -> Tensor:
    """``mean_b(w_b * mean_{c,h,w}((pred - target)^2))`` as a 0-d fp32 tensor; ``weights`` is (B,)
    or None (all ones: the plain mean). ``diffusion_loss(pred, target, "l2", weights)``."""
    return diffusion_loss(pred, target, "l2", weights)


def huber_c_per_timestep(timesteps: Tensor, schedule: DDPMSchedule, huber_schedule: str = "snr",
                         huber_c: float = 0.1, huber_scale: float = 1.0, check: bool = True) -> Tensor:
    """The Huber threshold ``c`` of each sample for its timestep: an fp32 (B,) device tensor for
    ``diffusion_loss(..., huber_c=...)``. The formulas (module doc) and the defaults (``"snr"``,
    0.1, 1.0) are kohya's ``--huber_schedule``, ``--huber_c`` and ``--huber_scale``.

    ``timesteps``: an int64/int32 (B,) tensor. ``schedule``: the ``DDPMSchedule`` that noised the
    batch (its ``num_train_timesteps`` and, for ``"snr"``, its SNR table). Everything stays on the
    device (flame ops and one table gather), so a captured training step can replay it;
    ``check=False`` skips the host-side range check of the ``"snr"`` lookup, as
    ``DDPMSchedule.coefficients`` does, for timesteps in ``[0, T)`` by construction (the other
    schedules look nothing up).
    """
    op = "huber_c_per_timestep"
    if huber_schedule not in HUBER_SCHEDULES:
        raise ValueError(f"{op}: huber_schedule must be one of {HUBER_SCHEDULES}, got {huber_schedule!r}")
    huber_c = _positive(huber_c, "huber_c", op)
    huber_scale = _positive(huber_scale, "huber_scale", op)
    if not isinstance(timesteps, Tensor) or timesteps.dtype not in (torch.int64, torch.int32) \
            or timesteps.ndim != 1:
        raise ValueError(f"{op}: timesteps must be a 1-d int64 or int32 flame Tensor, got "
                         f"{getattr(timesteps, 'shape', type(timesteps).__name__)} {getattr(timesteps, 'dtype', '')}")
    if not (hasattr(schedule, "coefficients") and hasattr(schedule, "num_train_timesteps")):
        raise ValueError(f"{op}: schedule must be a DDPMSchedule, got {type(schedule).__name__}")

    if huber_schedule == "constant":
        return full((timesteps.shape[0],), huber_c * huber_scale, dtype=torch.float32)
    if huber_schedule == "exponential":
        alpha = -math.log(huber_c) / schedule.num_train_timesteps
        return mul(exp(mul(to(timesteps, torch.float32), -alpha)), huber_scale)
    sigma = rsqrt(schedule.snr(timesteps, check))  # sqrt((1 - abar) / abar)
    one_plus = add(sigma, 1.0)
    return add(div(1.0 - huber_c, mul(one_plus, one_plus)), huber_c)
