#!/usr/bin/env python3
"""Benchmark flame's LogicLayer against PyTorch on the same device, in the same run.

For each case (gates G reading an input of IN columns, batch B) it times one training step of the
layer, forward and backward (gradients of the input and of the logits), for:

- ``flame``: ``flame.ops.logic.logic_gates`` with its plan built once (as ``LogicLayer`` caches
  it), the input feature-major as a previous flame logic layer hands it over;
- ``torch-16op``: the formulation people write in PyTorch (difflogic's Python path): the 16
  relaxed functions of ``a = x[:, ia]``, ``b = x[:, ib]`` summed with softmax weights, autograd
  for the backward;
- ``torch-4coef``: PyTorch with the 4-coefficient trick flame uses (``w = softmax(logits) @ C``,
  ``out = w0 + w1 a + w2 b + w3 ab``), batch-major input;
- ``torch-4coef-fm``: the same on a feature-major input (``x_t[ia]`` reads whole rows).

The fastest PyTorch variant is the baseline; ``speedup`` is its time over flame's. Every side is
first checked against the others. Hard-mode inference is timed too: flame on bits packed 32
samples to a word (and on float 0/1 activations) against a PyTorch truth-table lookup, reported in
gate evaluations per second. Times are ``triton.testing.do_bench`` medians on a GPU. On the CPU
interpreter the sizes are tiny and the times mean nothing: that mode smoke-tests this script.

    python3 scripts/bench_logic.py                      # GPU: 64k gates x batch 1024 and the examples' sizes
    python3 scripts/bench_logic.py --dtype bf16 --out out/bench_logic.json
    python3 scripts/bench_logic.py --quick              # tiny cases: a smoke test (the CPU always runs these)
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np
import torch

import flame
from flame.nn.logic import random_wiring
from flame.ops.logic import logic_codes, logic_gates, logic_gates_packed, logic_plan, pack_bits

warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\..*")

TARGET = 5.0  # issue 31: at least 5x the strongest PyTorch reference at 64k gates x batch 1024 (H100)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (name, in_dim, gates, batch): a 64k-gate layer of a 64k-wide network, and the examples' layers
GPU_CASES = [
    ("64k gates x 1024", 65536, 65536, 1024),
    ("64k gates x 4096", 65536, 65536, 4096),
    ("digits hidden 2000 x 64", 2000, 2000, 64),
    ("digits hidden 2000 x 1024", 2000, 2000, 1024),
    ("digits first 256->2000 x 64", 256, 2000, 64),
    ("CA cell 3->16 x 1024", 3, 16, 1024),
]
CPU_CASES = [("tiny 64 x 32", 64, 64, 32), ("tiny 16->48 x 8", 16, 48, 8)]

# op_i = c0 + c1 a + c2 b + c3 ab for the 16 functions in flame's order (index = truth table)
COEF = torch.tensor([[(i >> 3) & 1, ((i >> 1) & 1) - ((i >> 3) & 1), ((i >> 2) & 1) - ((i >> 3) & 1),
                      (i & 1) - ((i >> 1) & 1) - ((i >> 2) & 1) + ((i >> 3) & 1)] for i in range(16)],
                    dtype=torch.float32)


# ---- PyTorch references ---------------------------------------------------------------------------

def torch_16op(x, logits, ia, ib):
    """difflogic's Python formulation: sum_i softmax(logits)_i op_i(a, b), one function at a time."""
    a, b = x[:, ia], x[:, ib]
    p = torch.softmax(logits, -1).to(x.dtype)
    ab = a * b
    ops = (lambda: torch.zeros_like(a), lambda: ab, lambda: a - ab, lambda: a, lambda: b - ab, lambda: b,
           lambda: a + b - 2 * ab, lambda: a + b - ab, lambda: 1 - (a + b - ab), lambda: 1 - (a + b - 2 * ab),
           lambda: 1 - b, lambda: 1 - b + ab, lambda: 1 - a, lambda: 1 - a + ab, lambda: 1 - ab,
           lambda: torch.ones_like(a))
    out = torch.zeros_like(a)
    for i, op in enumerate(ops):
        out = out + p[:, i] * op()
    return out


def torch_4coef(x, logits, ia, ib):
    """The mixture as 4 coefficients per gate, batch-major (B, IN) input."""
    w = (torch.softmax(logits, -1) @ COEF.to(logits.device)).to(x.dtype)
    a, b = x[:, ia], x[:, ib]
    return w[:, 0] + w[:, 1] * a + (w[:, 2] + w[:, 3] * a) * b


def torch_4coef_fm(xt, logits, ia, ib):
    """The same on a feature-major (IN, B) input; returns (G, B)."""
    w = (torch.softmax(logits, -1) @ COEF.to(logits.device)).to(xt.dtype)
    a, b = xt[ia], xt[ib]
    return w[:, 0:1] + w[:, 1:2] * a + (w[:, 2:3] + w[:, 3:4] * a) * b


def torch_hard(xt_bool, codes, ia, ib):
    """Hard inference in PyTorch: each gate's truth table looked up at (a, b), feature-major bools."""
    index = (codes[:, None] >> (3 - (2 * xt_bool[ia].long() + xt_bool[ib].long()))) & 1
    return index.bool()


# ---- timing -------------------------------------------------------------------------------------

def timer(fn, warmup, rep, interpreter):
    """Median milliseconds per call: do_bench on a GPU; on the interpreter a few host-timed calls."""
    if not interpreter:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(name, in_dim, gates, batch, dtype, args, interpreter):
    dev = flame.device
    rng = np.random.default_rng(0)
    ia_np, ib_np = random_wiring(in_dim, gates, 0)
    ia_f, ib_f = flame.tensor(ia_np), flame.tensor(ib_np)
    ia, ib = torch.from_numpy(ia_np).to(dev), torch.from_numpy(ib_np).to(dev)
    x_fm = torch.from_numpy(rng.random((in_dim, batch), dtype=np.float32)).to(dev).to(dtype)  # (IN, B)
    x_rows = x_fm.t().contiguous()  # (B, IN)
    logits = torch.from_numpy(rng.standard_normal((gates, 16)).astype(np.float32)).to(dev)
    g_rows = torch.from_numpy(rng.standard_normal((batch, gates), dtype=np.float32)).to(dev).to(dtype)
    g_fm = g_rows.t().contiguous()

    xf = flame.from_torch(x_fm.t(), requires_grad=True)  # (B, IN) view of the feature-major buffer
    wf = flame.from_torch(logits.clone(), requires_grad=True)
    gf = flame.from_torch(g_fm.t())
    plan = logic_plan(ia_f, ib_f, in_dim)

    def flame_step():
        grads = logic_gates(xf, wf, ia_f, ib_f, plan=plan).backward(gf)
        return grads[xf], grads[wf]

    xr = x_rows.clone().requires_grad_()
    xt = x_fm.clone().requires_grad_()
    wt = logits.clone().requires_grad_()

    def torch_step(fn, x, g):
        return lambda: torch.autograd.grad(fn(x, wt, ia, ib), (x, wt), g)

    sides = {"torch-16op": torch_step(torch_16op, xr, g_rows), "torch-4coef": torch_step(torch_4coef, xr, g_rows),
             "torch-4coef-fm": torch_step(torch_4coef_fm, xt, g_fm)}
    if args.skip_16op and not interpreter:
        del sides["torch-16op"]

    # agreement first: a fast wrong kernel posts no number
    fdx, fdw = flame_step()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    scale = 1.0 + float(g_rows.float().abs().max()) * (batch ** 0.5)
    for side, fn in sides.items():
        dx, dw = fn()
        dx = dx.t() if side.endswith("-fm") else dx
        torch.testing.assert_close(fdx.to_torch().float(), dx.float(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, s=side: f"{name}: dx differs from {s}: {m}")
        torch.testing.assert_close(fdw.to_torch().float(), dw.float(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, s=side: f"{name}: dlogits differ from {s}: {m}")
    del fdx, fdw

    row = dict(case=name, in_dim=in_dim, gates=gates, batch=batch, dtype=str(dtype).removeprefix("torch."))
    row["flame_ms"] = timer(flame_step, args.warmup, args.rep, interpreter)
    for side, fn in sides.items():
        row[f"{side}_ms"] = timer(fn, args.warmup, args.rep, interpreter)
    baseline = min(sides, key=lambda s: row[f"{s}_ms"])
    row["baseline"] = baseline
    row["speedup"] = row[f"{baseline}_ms"] / row["flame_ms"]
    for side in ("flame", *sides):
        row[f"{side}_gates_per_s"] = gates * batch / (row[f"{side}_ms"] * 1e-3)

    # hard inference: packed bits vs float 0/1 vs PyTorch's lookup, checked against each other
    codes = logic_codes(wf)
    xbits = x_fm > 0.5
    bits = pack_bits(flame.from_torch(xbits.t().to(dtype)))
    packed = lambda: logic_gates_packed(bits, codes, ia_f, ib_f)
    xhard = flame.from_torch(xbits.t().to(dtype))
    floats = lambda: logic_gates(xhard, wf.detach(), ia_f, ib_f, hard=True)
    codes_t = codes.to_torch().long()
    looked_up = lambda: torch_hard(xbits, codes_t, ia, ib)
    want = looked_up()
    if not torch.equal(floats().to_torch().t().bool(), want):
        raise AssertionError(f"{name}: flame's hard mode differs from PyTorch's truth-table lookup")
    words = packed().to_torch()
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    unpacked = ((words[:, :, None] >> shifts) & 1).reshape(gates, -1)[:, :batch].bool()
    if not torch.equal(unpacked, want):
        raise AssertionError(f"{name}: flame's packed hard gates differ from PyTorch's truth-table lookup")
    for side, fn in (("flame-packed", packed), ("flame-hard", floats), ("torch-hard", looked_up)):
        row[f"{side}_ms"] = timer(fn, args.warmup, args.rep, interpreter)
        row[f"{side}_gates_per_s"] = gates * batch / (row[f"{side}_ms"] * 1e-3)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="activations (the logits stay fp32)")
    p.add_argument("--case", action="append", default=[], help="run only the cases whose names contain TEXT")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    p.add_argument("--skip-16op", action="store_true",
                   help="leave out the (slow, memory-hungry) 16-function torch side")
    p.add_argument("--quick", action="store_true", help="the tiny smoke-test cases (what the interpreter runs)")
    p.add_argument("--out", help="write the results as JSON to this file")
    args = p.parse_args(argv)
    interpreter = flame.is_interpreter()
    dtype = DTYPES[args.dtype]
    if interpreter and dtype == torch.bfloat16:
        p.error("bf16 needs a GPU (the interpreter's bf16 conversions are not PyTorch's)")
    cases = CPU_CASES if interpreter or args.quick else GPU_CASES
    if args.case:
        cases = [c for c in cases if any(t in c[0] for t in args.case)]
    device = flame.device_name()
    print(f"LogicLayer forward + backward, flame vs PyTorch {torch.__version__} on {device}, {args.dtype}", flush=True)
    if interpreter:
        print("CPU interpreter: tiny sizes, and the times mean nothing (a smoke test of this script)", flush=True)
    rows = []
    for case in cases:
        row = run_case(*case, dtype, args, interpreter)
        rows.append(row)
        sides = "  ".join(f"{k[:-3]} {row[k]:.3f}" for k in row if k.endswith("_ms") and "hard" not in k
                          and "packed" not in k)
        print(f"{row['case']:<30} ms: {sides}  speedup vs {row['baseline']}: {row['speedup']:.2f}x", flush=True)
        print(f"{'':<30} hard inference: flame packed {row['flame-packed_gates_per_s']:.3g} gates/s, flame float "
              f"{row['flame-hard_gates_per_s']:.3g}, torch {row['torch-hard_gates_per_s']:.3g}", flush=True)
    targets = []
    for row in rows:
        if row["case"] == "64k gates x 1024" and not interpreter:
            ok = row["speedup"] >= TARGET
            targets.append(dict(case=row["case"], speedup=row["speedup"], bound=TARGET, met=ok))
            print(f"target: flame at least {TARGET}x the strongest PyTorch step at 64k gates x 1024: "
                  f"{row['speedup']:.2f}x ({'met' if ok else 'NOT met'})", flush=True)
    if args.out:
        doc = dict(gpu=None if interpreter else device, device=device, interpreter=interpreter,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   torch=torch.__version__, triton=__import__("triton").__version__, python=platform.python_version(),
                   command=" ".join(sys.argv), dtype=args.dtype, results=rows, targets=targets)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
