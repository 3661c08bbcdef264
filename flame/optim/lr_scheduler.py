"""Learning-rate schedulers with ``torch.optim.lr_scheduler`` semantics.

A scheduler sets ``group["initial_lr"]`` on creation, applies its value for step 0 at once (as
torch does), and each ``step()`` advances ``last_epoch`` and writes the new learning rate into
every param group. Values come from closed forms of the step count, so resuming from
``state_dict()`` gives exactly the lrs of an uninterrupted run. The optimizer reads
``group["lr"]`` on the host at every ``step`` and passes it to its kernels as a scalar.

Torch's: ``LambdaLR``, ``ConstantLR``, ``LinearLR``, ``StepLR``, ``MultiStepLR``, ``ExponentialLR``,
``CosineAnnealingLR``, ``OneCycleLR``. Diffusers' (``get_scheduler`` names): constant,
constant with warmup, linear with warmup, cosine with warmup.
"""
from __future__ import annotations

import bisect
import math


class LRScheduler:
    def __init__(self, optimizer, last_epoch: int = -1):
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] "
                                   "when resuming an optimizer")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def lr_at(self, base_lr: float, epoch: int, index: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list:
        return [self.lr_at(base, self.last_epoch, i) for i, base in enumerate(self.base_lrs)]

    def step(self) -> None:
        self.last_epoch += 1
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v)
                and k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(step) (one function, or one per group)."""

    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        n = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != n:
                raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * n
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * self.lr_lambdas[index](epoch)


class ConstantLR(LRScheduler):
    """lr = initial_lr * factor for the first ``total_iters`` steps, then initial_lr."""

    def __init__(self, optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        if factor > 1.0 or factor < 0:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        self.factor, self.total_iters = factor, total_iters
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * (self.factor + (epoch >= self.total_iters) * (1 - self.factor))


class LinearLR(LRScheduler):
    """Factor moves linearly from ``start_factor`` to ``end_factor`` over ``total_iters`` steps."""

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1):
        if start_factor > 1.0 or start_factor <= 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor)
                          * min(self.total_iters, epoch) / self.total_iters)


class StepLR(LRScheduler):
    """lr = initial_lr * gamma ** (step // step_size)."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * self.gamma ** (epoch // self.step_size)


class MultiStepLR(LRScheduler):
    """lr = initial_lr * gamma ** (number of milestones reached)."""

    def __init__(self, optimizer, milestones, gamma: float = 0.1, last_epoch: int = -1):
        self.milestones, self.gamma = sorted(milestones), gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * self.gamma ** bisect.bisect_right(self.milestones, epoch)


class ExponentialLR(LRScheduler):
    """lr = initial_lr * gamma ** step."""

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return base_lr * self.gamma ** epoch


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (initial_lr - eta_min) (1 + cos(pi step / T_max)) / 2."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch, index):
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2


class OneCycleLR(LRScheduler):
    """The 1cycle policy (``torch.optim.lr_scheduler.OneCycleLR``), momentum / beta1 cycling included."""

    def __init__(self, optimizer, max_lr, total_steps=None, epochs=None, steps_per_epoch=None, pct_start=0.3,
                 anneal_strategy="cos", cycle_momentum=True, base_momentum=0.85, max_momentum=0.95,
                 div_factor=25.0, final_div_factor=1e4, three_phase=False, last_epoch=-1):
        groups = optimizer.param_groups
        if total_steps is not None:
            if total_steps <= 0 or not isinstance(total_steps, int):
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if epochs <= 0 or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer epochs and steps_per_epoch, got {epochs}, "
                                 f"{steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        if not 0 <= pct_start <= 1 or not isinstance(pct_start, float):
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self.anneal_strategy = anneal_strategy
        t = self.total_steps
        if three_phase:
            self._phases = [
                dict(end_step=float(pct_start * t) - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=float(2 * pct_start * t) - 2, start_lr="max_lr", end_lr="initial_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
                dict(end_step=t - 1, start_lr="initial_lr", end_lr="min_lr",
                     start_momentum="max_momentum", end_momentum="max_momentum"),
            ]
        else:
            self._phases = [
                dict(end_step=float(pct_start * t) - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=t - 1, start_lr="max_lr", end_lr="min_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
            ]
        max_lrs = _per_group(max_lr, groups, "max_lr")
        if last_epoch == -1:
            for lr, group in zip(max_lrs, groups):
                group["initial_lr"] = lr / div_factor
                group["max_lr"] = lr
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
            self.use_beta1 = "betas" in optimizer.defaults
            max_ms = _per_group(max_momentum, groups, "max_momentum")
            base_ms = _per_group(base_momentum, groups, "base_momentum")
            if last_epoch == -1:
                for m_max, m_base, group in zip(max_ms, base_ms, groups):
                    if self.use_beta1:
                        group["betas"] = (m_max, *group["betas"][1:])
                    else:
                        group["momentum"] = m_max
                    group["max_momentum"] = m_max
                    group["base_momentum"] = m_base
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self):
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times. The specified number of total steps is {self.total_steps}")
        lrs = []
        for group in self.optimizer.param_groups:
            start_step = 0.0
            for i, phase in enumerate(self._phases):
                end_step = phase["end_step"]
                if step <= end_step or i == len(self._phases) - 1:
                    pct = (step - start_step) / (end_step - start_step)
                    lr = self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct)
                    if self.cycle_momentum:
                        momentum = self._anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct)
                    break
                start_step = phase["end_step"]
            lrs.append(lr)
            if self.cycle_momentum:
                if self.use_beta1:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        return lrs


def _per_group(value, groups, name):
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(groups)


# ---- diffusers' schedules (``diffusers.optimization``), as picklable-state schedulers --------------

class _Warmup(LRScheduler):
    def __init__(self, optimizer, num_warmup_steps=0, num_training_steps=None, num_cycles=0.5, last_epoch=-1):
        self.num_warmup_steps, self.num_training_steps = num_warmup_steps, num_training_steps
        self.num_cycles = num_cycles
        super().__init__(optimizer, last_epoch)

    def _progress(self, step):
        """The fraction of the decay phase done at ``step`` (after the warmup)."""
        return float(step - self.num_warmup_steps) / float(max(1, self.num_training_steps - self.num_warmup_steps))

    def _warming(self, step):
        return float(step) / float(max(1, self.num_warmup_steps))

    def lr_at(self, base_lr, epoch, index):
        return base_lr * self.factor(epoch)


class ConstantWithWarmupLR(_Warmup):
    """Linear warmup from 0 over ``num_warmup_steps``, then constant (``get_constant_schedule_with_warmup``)."""

    def factor(self, step):
        if step < self.num_warmup_steps:
            return float(step) / float(max(1.0, self.num_warmup_steps))
        return 1.0


class LinearWithWarmupLR(_Warmup):
    """Linear warmup, then linear decay to 0 at ``num_training_steps`` (``get_linear_schedule_with_warmup``)."""

    def factor(self, step):
        if step < self.num_warmup_steps:
            return float(step) / float(max(1, self.num_warmup_steps))
        return max(0.0, float(self.num_training_steps - step)
                   / float(max(1, self.num_training_steps - self.num_warmup_steps)))


class CosineWithWarmupLR(_Warmup):
    """Linear warmup, then a cosine decay (``get_cosine_schedule_with_warmup``)."""

    def factor(self, step):
        if step < self.num_warmup_steps:
            return self._warming(step)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * self._progress(step))))


class CosineWithHardRestartsLR(_Warmup):
    """Linear warmup, then ``num_cycles`` cosine decays from the peak to 0, each restarting at the
    peak (``get_cosine_with_hard_restarts_schedule_with_warmup``); 0 from ``num_training_steps`` on."""

    def factor(self, step):
        if step < self.num_warmup_steps:
            return self._warming(step)
        progress = self._progress(step)
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(self.num_cycles) * progress) % 1.0))))


class PolynomialWithWarmupLR(_Warmup):
    """Linear warmup, then a polynomial decay of the optimizer's default lr to ``lr_end``: factor
    ((lr - lr_end) (1 - progress)^power + lr_end) / lr, ``lr_end / lr`` from ``num_training_steps``
    on (``get_polynomial_decay_schedule_with_warmup``; groups with their own lr get the same factor)."""

    def __init__(self, optimizer, num_warmup_steps, num_training_steps, lr_end=1e-7, power=1.0, last_epoch=-1):
        self.lr_init, self.lr_end, self.power = float(optimizer.defaults["lr"]), float(lr_end), float(power)
        if not self.lr_init > self.lr_end:
            raise ValueError(f"polynomial schedule: lr_end ({self.lr_end}) must be below the lr ({self.lr_init})")
        super().__init__(optimizer, num_warmup_steps, num_training_steps, last_epoch=last_epoch)

    def factor(self, step):
        if step < self.num_warmup_steps:
            return self._warming(step)
        if step > self.num_training_steps:
            return self.lr_end / self.lr_init
        decayed = (self.lr_init - self.lr_end) * (1.0 - self._progress(step)) ** self.power + self.lr_end
        return decayed / self.lr_init


def get_constant_schedule(optimizer, last_epoch=-1):
    return ConstantWithWarmupLR(optimizer, 0, last_epoch=last_epoch)


def get_constant_schedule_with_warmup(optimizer, num_warmup_steps, last_epoch=-1):
    return ConstantWithWarmupLR(optimizer, num_warmup_steps, last_epoch=last_epoch)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    return LinearWithWarmupLR(optimizer, num_warmup_steps, num_training_steps, last_epoch=last_epoch)


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles=0.5, last_epoch=-1):
    return CosineWithWarmupLR(optimizer, num_warmup_steps, num_training_steps, num_cycles, last_epoch=last_epoch)


_SCHEDULES = {
    "constant": lambda opt, w, t, cycles, power: get_constant_schedule(opt),
    "constant_with_warmup": lambda opt, w, t, cycles, power: get_constant_schedule_with_warmup(opt, w),
    "linear": lambda opt, w, t, cycles, power: get_linear_schedule_with_warmup(opt, w, t),
    "cosine": lambda opt, w, t, cycles, power: get_cosine_schedule_with_warmup(opt, w, t),
    "cosine_with_restarts": lambda opt, w, t, cycles, power: CosineWithHardRestartsLR(opt, w, t, cycles or 1),
    "polynomial": lambda opt, w, t, cycles, power: PolynomialWithWarmupLR(opt, w, t, power=power or 1.0),
}
SCHEDULE_NAMES = tuple(_SCHEDULES)


def get_scheduler(name, optimizer, num_warmup_steps=0, num_training_steps=None, num_cycles=None, power=None):
    """Diffusers' ``get_scheduler`` for the names above (``num_cycles``: cosine_with_restarts,
    default 1; ``power``: polynomial, default 1)."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown scheduler {name!r}; expected one of {sorted(_SCHEDULES)}")
    if name not in ("constant", "constant_with_warmup") and num_training_steps is None:
        raise ValueError(f"{name} schedule needs num_training_steps")
    return _SCHEDULES[name](optimizer, num_warmup_steps, num_training_steps, num_cycles, power)
