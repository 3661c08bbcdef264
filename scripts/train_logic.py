#!/usr/bin/env python3
"""Train a differentiable logic-gate network (Petersen et al. 2022) on scikit-learn's digits.

Each 8x8 digit becomes 256 Boolean features (pixel > 2/16, 6/16, 10/16, 14/16: a thermometer code),
read by a stack of ``flame.nn.LogicLayer``s (random fixed wiring, 16 learned logits per gate) and a
``GroupSum`` of the last layer's gates into 10 class scores. Training uses the soft relaxation; the
hard network (each gate its most likely Boolean function, ``flame.nn.set_hard``) is then scored on
the same test images, as float 0/1 activations and again on bits packed 32 samples to a word
(``flame.nn.Bits``), which must agree exactly. Same fixed split as ``scripts/train_digits.py``.

    python scripts/train_logic.py                 # full: 3 x 2000 gates, 40 epochs (>= 90%, hard within 1 point)
    python scripts/train_logic.py --quick         # a smoke run, seconds on the CPU

The last two lines printed are ``test accuracy: 0.xxxx`` (soft) and ``hard test accuracy: 0.xxxx``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np
from train_digits import OPTIMIZERS, SCHEDULES, load_digits_split, predict, say_quick_run, train

import flame
from flame import nn

THRESHOLDS = (2 / 16, 6 / 16, 10 / 16, 14 / 16)


def binarize(x, thresholds=THRESHOLDS):
    """(n, 64) pixels in [0, 1] -> (n, 64 * len(thresholds)) 0/1 features, one block per threshold."""
    return np.concatenate([(x > t).astype(np.float32) for t in thresholds], axis=1)


def build(in_dim, width, depth, tau, seed, init):
    layers = [nn.LogicLayer(in_dim if i == 0 else width, width, seed=seed * 1000 + i, init=init) for i in range(depth)]
    return nn.Sequential(*layers, nn.GroupSum(10, tau))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=None, help="passes over the training set (default 40; quick 1)")
    p.add_argument("--width", type=int, default=None, help="gates per layer (default 2000; quick 300)")
    p.add_argument("--depth", type=int, default=None, help="logic layers (default 3; quick 2)")
    p.add_argument("--tau", type=float, default=None, help="GroupSum temperature (default 15; quick 6)")
    p.add_argument("--init", choices=("gaussian", "residual"), default="gaussian")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--schedule", choices=SCHEDULES, default="none")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="wiring, initialisation and batch order (the split is fixed)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch of a small network on 256 images")
    args = p.parse_args(argv)
    for key, full, quick in (("epochs", 40, 1), ("width", 2000, 300), ("depth", 3, 2), ("tau", 15.0, 6.0)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.epochs < 1 or args.depth < 1 or args.batch_size < 1 or args.width < 10 or args.width % 10:
        p.error("--epochs, --depth and --batch-size must be positive; --width a multiple of 10 (GroupSum)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    flame.manual_seed(args.seed)
    xtr, ytr, xte, yte = load_digits_split()
    xtr, xte = binarize(xtr), binarize(xte)
    if args.quick:
        xtr, ytr = xtr[:256], ytr[:256]
    model = build(xtr.shape[1], args.width, args.depth, args.tau, args.seed, args.init)
    print(f"logic network on sklearn digits: {xtr.shape[1]} binary features -> {args.depth} x {args.width} gates -> "
          f"GroupSum(10, tau={args.tau}); {len(xtr)} train / {len(xte)} test, {args.epochs} epochs, batch "
          f"{args.batch_size}, {args.optimizer} lr {args.lr}, seed {args.seed}, {flame.device_name()}", flush=True)
    if args.quick:
        say_quick_run(">= 90%")
    t0 = time.perf_counter()
    loss = train(model, xtr, ytr, args, "logic")
    soft = float((predict(model, xte).argmax(1) == yte).mean())
    nn.set_hard(model)
    scores = predict(model, xte)
    hard = float((scores.argmax(1) == yte).mean())
    with flame.no_grad():
        packed = model(nn.Bits.pack(flame.tensor(xte))).numpy()
    if not np.array_equal(packed, scores):
        print("packed-bit inference disagrees with the float hard network", file=sys.stderr)
        return 1
    codes = np.concatenate([m.codes().numpy() for m in model.modules() if isinstance(m, nn.LogicLayer)])
    common = np.bincount(codes, minlength=16).argsort()[::-1][:4]
    print(f"final training loss {loss:.4f}; {time.perf_counter() - t0:.1f} s; most used gates: "
          + ", ".join(f"{nn.logic.FUNCTIONS[c]} {np.mean(codes == c):.0%}" for c in common), flush=True)
    print(f"test accuracy: {soft:.4f}", flush=True)
    print(f"hard test accuracy: {hard:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
