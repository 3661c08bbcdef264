"""A training run's host-side state as one object (``RunState``): the step, the losses read back from
the device and those still on it, the smoothed loss, the validation losses, why the run is stopping,
and the bookkeeping of the step in flight and of the console's speed.

The trainer's step (``Trainer.train_step``) writes it, the loop (``loop.py``) and the console read it,
resuming (``Trainer.load``) restores it from a checkpoint and metrics.jsonl. What lives on the device
or in other objects stays there and reaches checkpoints from them: the weights and the optimizer, the
lr scheduler, the loss scaler, the moving average, flame's RNG and the data loader's position
(``Trainer.state``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SMOOTHING = 0.98  # the loss shown: an exponential moving average over ~50 steps, bias-corrected


@dataclass
class RunState:
    """``step``: optimizer steps done; ``losses`` / ``val_losses``: {step: loss} as read on the host;
    ``pending``: ``(step, loss, grad norm or None, lr, epoch)`` of the steps whose losses are still on
    the device; ``average``: (biased moving average of the losses, losses in it); ``stop``: why the
    run ends after this step, ``("interrupted", signum)`` or ``("non_finite", (step, loss))``, else
    None; ``sampled``: the step whose sample images were made last; ``step_done``: False while a
    step's state changes are not all applied; ``clock``: ``time.perf_counter()`` when the losses were
    last read (the speed shown)."""

    step: int = 0
    losses: dict = field(default_factory=dict)
    val_losses: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)
    average: tuple = (0.0, 0)
    stop: tuple | None = None
    sampled: int | None = None
    step_done: bool = True
    clock: float | None = None

    def smoothed(self, value=None) -> float:
        """The smoothed loss shown beside the step's: the exponential moving average with Adam's bias
        correction (divided by 1 - SMOOTHING^n after n losses, so that it is the weighted mean of the
        losses so far, not pulled towards its zero start), with ``value`` taken in first (unless it is
        None or not finite); NaN before any loss."""
        avg, n = self.average
        if value is not None and math.isfinite(value):
            avg, n = SMOOTHING * avg + (1 - SMOOTHING) * value, n + 1
            self.average = (avg, n)
        return avg / (1 - SMOOTHING ** n) if n else math.nan

    def restore(self, records) -> None:
        """Take the smoothed loss and the validation losses from the metric ``records`` of a resumed run."""
        for rec in records:
            if isinstance(rec.get("loss"), (int, float)):
                self.smoothed(rec["loss"])
            if isinstance(rec.get("val_loss"), (int, float)):
                self.val_losses[rec["step"]] = rec["val_loss"]
