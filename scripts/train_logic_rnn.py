#!/usr/bin/env python3
"""Learn an elementary cellular automaton with a recurrent differentiable logic network, by BPTT.

A row of ``--cells`` Boolean cells (circular) evolves by Wolfram's rule ``--rule`` (30 by default:
new = left XOR (center OR right)). The model is one cell update shared by every cell: its
neighbourhood (left, center, right) goes through ``flame.nn.LogicLayer``s, and the mean of the last
layer's (odd number of) gates is the new state. The update is applied ``--steps`` times to a batch
of random rows, unrolled through flame's graph; the loss is the mean squared error against the true
rule at every step, so each step's gradient flows back through all the steps before it (BPTT).
``--accumulate N`` adds the gradients of N rollouts per update (``GradientMap.accumulate``);
``--checkpoint K`` recomputes every K steps in backward (``flame.checkpoint``: memory flat in T).

Scored on held-out random rows (another seed), over the same number of steps: the fraction of
cells right at every step, for the soft network (states thresholded at 0.5) and for the hard one
(``flame.nn.set_hard``: each gate its argmax Boolean function).

    python scripts/train_logic_rnn.py                 # full: rule 30, 8 steps (100% held out)
    python scripts/train_logic_rnn.py --quick         # a smoke run, seconds on the CPU
    python scripts/train_logic_rnn.py --rule 110 --steps 12 --checkpoint 4 --accumulate 2

The last two lines printed are ``test accuracy: x.xxxx`` and ``hard test accuracy: x.xxxx``.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np
from tqdm import tqdm
from train_digits import say_quick_run

import flame
import flame.nn.functional as F
from flame import nn, optim
from flame.checkpoint import checkpoint

warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\..*")


def ca_step(rows: np.ndarray, rule: int) -> np.ndarray:
    """One step of the elementary CA ``rule`` on Boolean rows (circular)."""
    left, right = np.roll(rows, 1, axis=1), np.roll(rows, -1, axis=1)
    return (rule >> (4 * left + 2 * rows + right)) & 1


def ca_rollout(rows: np.ndarray, rule: int, steps: int) -> np.ndarray:
    """(steps, batch, cells): the states after 1..steps updates."""
    out = []
    for _ in range(steps):
        rows = ca_step(rows, rule)
        out.append(rows)
    return np.stack(out).astype(np.float32)


class LogicCA(nn.Module):
    """A cell update shared by every cell: (left, center, right) -> LogicLayers -> the mean of the
    last layer's gates (an odd count: a majority in hard mode, where the next step thresholds at 0.5)."""

    def __init__(self, cells: int, widths=(16, 16, 5), seed: int = 0, init: str = "gaussian"):
        super().__init__()
        if widths[-1] % 2 == 0:
            raise ValueError("LogicCA: the last layer needs an odd number of gates (a majority)")
        self.cells = cells
        dims = (3, *widths)
        self.layers = nn.Sequential(*[nn.LogicLayer(dims[i], dims[i + 1], seed=seed * 100 + i, init=init)
                                      for i in range(len(widths))])
        self.vote = nn.GroupSum(1, tau=float(widths[-1]))
        # neighbourhood columns: left (w - 1), center (w), right (w + 1), each over every cell w
        w = np.arange(cells)
        self.register_buffer("neighbours", flame.tensor(np.concatenate([(w - 1) % cells, w, (w + 1) % cells])),
                             persistent=False)

    def forward(self, state):
        """(batch, cells) states in [0, 1] -> the next states."""
        batch = state.shape[0]
        hood = flame.index_select(state, 1, self.neighbours).reshape(batch, 3, self.cells)
        hood = hood.permute(0, 2, 1).contiguous().reshape(batch * self.cells, 3)
        return self.vote(self.layers(hood)).reshape(batch, self.cells)


def rollout(model, state, steps: int, every: int = 0):
    """The states after 1..steps updates (a list); ``every`` > 0 checkpoints chunks of that many steps."""
    def chunk(s, n):
        out = []
        for _ in range(n):
            s = model(s)
            out.append(s)
        return tuple(out)

    states = []
    t = 0
    while t < steps:
        n = min(every or steps, steps - t)
        part = checkpoint(chunk, state, n) if every else chunk(state, n)
        states += list(part)
        state = states[-1]
        t += n
    return states


def loss_of(model, rows, targets, steps, every):
    states = rollout(model, flame.tensor(rows.astype(np.float32)), steps, every)
    return sum(F.mse_loss(s, flame.tensor(targets[t])) for t, s in enumerate(states)) * (1.0 / steps)


def cell_accuracy(model, rows, targets, steps) -> float:
    """Fraction of cells whose state (> 0.5) is right, over every step of the held-out rollouts."""
    with flame.no_grad():
        states = rollout(model, flame.tensor(rows.astype(np.float32)), steps)
        got = np.stack([s.numpy() > 0.5 for s in states])
    return float((got == targets.astype(bool)).mean())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rule", type=int, default=30, help="Wolfram code of the elementary CA (0-255)")
    p.add_argument("--cells", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="unrolled steps T (default 8; quick 3)")
    p.add_argument("--batch", type=int, default=32, help="rows per rollout")
    p.add_argument("--epochs", type=int, default=None, help="epochs of --updates optimizer steps (default 10)")
    p.add_argument("--updates", type=int, default=10, help="optimizer steps per epoch")
    p.add_argument("--accumulate", type=int, default=1, help="rollouts whose gradients each step adds up")
    p.add_argument("--checkpoint", type=int, default=0, metavar="K", help="recompute every K steps in backward")
    p.add_argument("--widths", default="16,16,5", help="gates per logic layer (the last odd)")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--init", choices=("gaussian", "residual"), default="gaussian", help="LogicLayer init")
    p.add_argument("--seed", type=int, default=0, help="wiring, initialisation and training rows")
    p.add_argument("--test-rows", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 updates of 3-step rollouts")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.quick else 8
    if args.epochs is None:
        args.epochs = 1 if args.quick else 10
    if args.quick:
        args.updates = 2
    args.widths = tuple(int(w) for w in args.widths.split(","))
    if not 0 <= args.rule <= 255:
        p.error("--rule must be in [0, 255]")
    for name in ("cells", "steps", "batch", "epochs", "updates", "accumulate", "test_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint < 0 or any(w < 1 for w in args.widths) or args.widths[-1] % 2 == 0:
        p.error("--checkpoint must be >= 0 and --widths positive, the last odd")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    flame.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = LogicCA(args.cells, args.widths, args.seed, args.init)
    opt = optim.Adam(list(model.parameters()), lr=args.lr)
    test_rng = np.random.default_rng([args.seed, 1])  # a separate stream: rows never used in training
    test_rows = test_rng.integers(0, 2, (args.test_rows, args.cells))
    test_targets = ca_rollout(test_rows, args.rule, args.steps)
    print(f"rule {args.rule} on {args.cells} cells, {args.steps} unrolled steps, logic cell {args.widths}, "
          f"{args.epochs} x {args.updates} updates of {args.accumulate} x {args.batch} rows, checkpoint every "
          f"{args.checkpoint or 'never'}, seed {args.seed}, {flame.device_name()}", flush=True)
    if args.quick:
        say_quick_run("100% of held-out rows")
    t0 = time.perf_counter()
    total = args.epochs * args.updates
    with tqdm(total=total, desc="bptt", unit="update", dynamic_ncols=True) as bar:
        for epoch in range(args.epochs):
            for _ in range(args.updates):
                grads, value = None, 0.0
                for _ in range(args.accumulate):
                    rows = rng.integers(0, 2, (args.batch, args.cells))
                    loss = loss_of(model, rows, ca_rollout(rows, args.rule, args.steps), args.steps, args.checkpoint)
                    part = loss.backward()
                    grads = part if grads is None else grads.accumulate(part)
                    value += loss.item() / args.accumulate
                opt.step(grads)
                bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{value:.4f}")
    soft = cell_accuracy(model, test_rows, test_targets, args.steps)
    nn.set_hard(model)
    hard = cell_accuracy(model, test_rows, test_targets, args.steps)
    with flame.no_grad():  # whole rows right at every step
        states = rollout(model, flame.tensor(test_rows.astype(np.float32)), args.steps)
        exact = np.all(np.stack([s.numpy() > 0.5 for s in states]) == test_targets.astype(bool), axis=(0, 2))
    print(f"final loss {value:.4f}; {time.perf_counter() - t0:.1f} s; held-out rows right at every step (hard): "
          f"{int(exact.sum())}/{len(exact)}", flush=True)
    print(f"test accuracy: {soft:.4f}", flush=True)
    print(f"hard test accuracy: {hard:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
