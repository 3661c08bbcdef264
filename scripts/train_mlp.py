#!/usr/bin/env python3
"""Train a small MLP regressor with plain SGD, written entirely on flame ops.

A fixed random "teacher" network makes the targets; a two-layer student
``y = tanh(x @ W1 + b1) @ W2 + b2`` learns them by full-batch gradient descent on the mean squared
error. Every floating-point operation (data, forward, backward, the SGD update) is a flame op and
so a Triton kernel; on a machine without a GPU they run through Triton's interpreter, with a tiny
default configuration.

    python scripts/train_mlp.py                 # tiny on CPU, larger on a GPU
    python scripts/train_mlp.py --steps 200 --hidden 256

Exits with status 1 when the loss did not go down.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import flame  # must be imported before anything that imports triton

# (CPU interpreter, GPU) defaults.
DEFAULTS = {
    "steps": (60, 300),
    "batch": (64, 8192),
    "in_dim": (8, 256),
    "hidden": (32, 1024),
    "out_dim": (1, 16),
    "lr": (0.2, 0.1),
}


def parse_args(argv=None):
    cpu = flame.is_interpreter()
    pick = {k: v[0] if cpu else v[1] for k, v in DEFAULTS.items()}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=pick["steps"], help="SGD steps")
    p.add_argument("--batch", type=int, default=pick["batch"], help="training samples (full batch)")
    p.add_argument("--in-dim", type=int, default=pick["in_dim"], help="input features")
    p.add_argument("--hidden", type=int, default=pick["hidden"], help="hidden units")
    p.add_argument("--out-dim", type=int, default=pick["out_dim"], help="regression targets per sample")
    p.add_argument("--lr", type=float, default=pick["lr"], help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="flame.manual_seed")
    p.add_argument("--log-every", type=int, default=0, help="print every N steps (0: about 10 lines)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "in_dim", "hidden", "out_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.lr > 0:
        p.error("--lr must be positive")
    return args


def init_linear(fan_in, fan_out):
    """A (weight, bias) pair of leaves that require grad, LeCun-normal weights and zero bias."""
    with flame.no_grad():
        w = flame.randn(fan_in, fan_out) * (1.0 / math.sqrt(fan_in))
    b = flame.zeros(fan_out)
    return w.requires_grad_(), b.requires_grad_()


def student(params, x):
    w1, b1, w2, b2 = params
    return flame.tanh(x @ w1 + b1) @ w2 + b2


def mse(pred, target):
    diff = pred - target
    return (diff * diff).mean()


def make_data(n, in_dim, out_dim):
    """Inputs ~ N(0, 1) and targets from a fixed random teacher MLP (no graph)."""
    with flame.no_grad():
        x = flame.randn(n, in_dim)
        t1 = flame.randn(in_dim, 16) * (2.0 / math.sqrt(in_dim))
        t2 = flame.randn(16, out_dim) * (1.0 / math.sqrt(16))
        y = flame.relu(x @ t1) @ t2
    return x, y


def main(argv=None) -> int:
    args = parse_args(argv)
    flame.manual_seed(args.seed)
    log_every = args.log_every or max(1, args.steps // 10)
    print(f"flame MLP regression on {flame.device_name()} ({'interpreter' if flame.is_interpreter() else 'cuda'}): "
          f"batch={args.batch} in={args.in_dim} hidden={args.hidden} out={args.out_dim} "
          f"steps={args.steps} lr={args.lr} seed={args.seed}", flush=True)

    x, y = make_data(args.batch, args.in_dim, args.out_dim)
    params = [*init_linear(args.in_dim, args.hidden), *init_linear(args.hidden, args.out_dim)]

    losses = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = mse(student(params, x), y)
        grads = loss.backward()  # GradientMap: grads[p] for every leaf that requires grad
        with flame.no_grad():
            params = [(p - args.lr * grads[p]).requires_grad_() for p in params]  # rebind: new leaves
        value = loss.item()
        losses.append(value)
        if not math.isfinite(value):
            print(f"step {step:5d}  loss {value}  (diverged)", flush=True)
            break
        if step == 1 or step % log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss {value:.6f}", flush=True)
    flame.synchronize()
    elapsed = time.perf_counter() - t0

    with flame.no_grad():
        final = mse(student(params, x), y).item()
    first = losses[0]
    ok = math.isfinite(final) and final < first
    print(f"done: {len(losses)} steps in {elapsed:.2f}s ({1e3 * elapsed / len(losses):.1f} ms/step); "
          f"loss {first:.6f} -> {final:.6f} ({final / first if first else float('nan'):.3f}x)"
          + ("" if ok else "  -- FAILED: the loss did not go down"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
