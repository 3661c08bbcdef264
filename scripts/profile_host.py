#!/usr/bin/env python3
"""Where flame's host time goes: cProfile of a chain of small ops (forward and backward).

    PYTHONPATH=. python3 scripts/profile_host.py [--iters 200] [--top 25]
"""
import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (it puts the checkout on the path)
import common  # first: imports flame, which selects the backend

import flame


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    x = flame.randn(64, 64)
    w = flame.randn(64, 64, requires_grad=True)
    b = flame.randn(64, requires_grad=True)

    def chain():
        y = x
        for _ in range(10):
            y = flame.exp(flame.tanh(y * w + b)) * 0.3
        return y.sum()

    def step():
        chain().backward()

    per_op = common.host_us_per_op(step, 20, args.iters, ops=51)
    print(f"fwd+bwd: {per_op:.1f} us per forward op (51 ops per chain) on {flame.device_name()}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step()
    flame.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
