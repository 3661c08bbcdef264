"""GEMMs on Hopper (issue 46): flame's warp-specialised Gluon kernel (flame/kernels/matmul_hopper.py)
in several schedules and tile shapes, flame's TMA kernel (matmul.py) and cuBLAS, at the Flux and SDXL
linear shapes, on one card, in one process.

Problems (``--problems``): ``fwd`` = y = x W^T + b (``linear_``; cuBLAS: F.linear), ``gelu`` = the same
with GELU (tanh) fused (cuBLAS: F.linear then F.gelu; the target is the plain GEMM's time), ``dx`` =
dY W and ``dw`` = dY^T X (``matmul_``; cuBLAS: torch.matmul). Rows: ``cublas``; ``tma`` = flame with
the Gluon route off; ``flame`` = flame's own route (``matmul_hopper.plan``: the Gluon kernel or the
TMA one); ``gluon plan`` = the Gluon kernel launched directly with the plan's config; ``gluon ...``
= the Gluon kernel forced to one schedule (``coop`` 2 consumers x BLOCK_M x BLOCK_N per program tile,
``pp`` ping-pong over BLOCK_M x BLOCK_N tiles; ``sN`` N stages, else as many as fit).

Every Gluon variant first runs in worker processes (``--jobs``) on a small problem with tails,
checked against PyTorch: that compiles it into Triton's cache, and a variant that fails or hangs
(each worker has a time limit) is reported and left out of the timing. Then this process checks
every row of every case against an fp32 reference (error at most ``--err-factor`` x cuBLAS's) and
times it: replays of a CUDA graph of as many calls as fill ``--rep-ms`` at cuBLAS's speed, the same
count for every row of a case (the H200 runs these at its 700 W limit, where clocks follow the
load), median of 10, in ``--passes`` passes of alternating order (the fastest kept). Prints a table
per problem (TFLOP/s, time over cuBLAS's) and the geometric means; writes ``gemm.jsonl`` under
``--out`` (default $OUT or .).

    PYTHONPATH=. python3 scripts/bench_gemm.py                       # everything
    PYTHONPATH=. python3 scripts/bench_gemm.py --only flux --problems fwd --variants "coop 2x64x256"
    PYTHONPATH=. python3 scripts/bench_gemm.py --jobs 0 --variants "" --profile  # flame's route only
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # first: puts the checkout on sys.path and selects the backend
import torch

import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
from flame.kernels.elementwise import GELU_TANH

# (M, K, N) of x (M, K) @ W (N, K)^T
FLUX = [(4608, 3072, 3072), (4608, 3072, 9216), (4608, 3072, 12288), (4608, 3072, 21504), (4608, 12288, 3072),
        (4608, 15360, 3072),  # the issue's set: single blocks' token count for every width
        (4096, 3072, 3072), (4096, 3072, 9216), (4096, 3072, 12288), (4096, 12288, 3072)]  # double blocks' images
SDXL = common.sdxl_rows("matmul", [  # the transformers' linears at batch 1 and 2 (CFG)
    (4096, 640, 640), (4096, 640, 5120), (4096, 2560, 640), (1024, 1280, 1280), (1024, 1280, 10240),
    (1024, 5120, 1280), (8192, 640, 640), (8192, 640, 5120), (8192, 2560, 640), (2048, 1280, 1280),
    (2048, 1280, 10240), (2048, 5120, 1280)])
SQUARE = [(8192, 8192, 8192)]  # every schedule's main loop, whole waves (97% of the last one busy)
GROUPS = {"flux": FLUX, "sdxl": SDXL, "square": SQUARE}
GELU_SHAPES = [(4608, 3072, 12288), (4096, 640, 5120)]  # MLP up-projections
SMOKE = (2000, 1000, 3000)  # tails in M and N, more tiles than programs in every schedule

# name -> matmul_hopper.config arguments
VARIANTS = {
    "coop 2x64x256": dict(coop=True, block_m=64, block_n=256),
    "pp 128x128": dict(coop=False, block_m=128, block_n=128),
    "pp 64x256": dict(coop=False, block_m=64, block_n=256),
    "coop 2x128x128": dict(coop=True, block_m=128, block_n=128),
    "coop 2x64x128": dict(coop=True, block_m=64, block_n=128),
    "pp 128x128 s4": dict(coop=False, block_m=128, block_n=128, stages=4),
    "pp 64x128": dict(coop=False, block_m=64, block_n=128),
    "coop 2x64x160": dict(coop=True, block_m=64, block_n=160),  # 160 = a 128- and a 32-wide block
    "pp 128x160": dict(coop=False, block_m=128, block_n=160),
    "coop 2x64x192": dict(coop=True, block_m=64, block_n=192),
}


class Case:
    """One problem's operands (random, bf16), its fp32 reference and cuBLAS's output."""

    def __init__(self, problem, M, K, N):
        self.problem, self.shape = problem, (M, K, N)
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16()
        if problem in ("fwd", "gelu"):  # x (M, K), W (N, K): out (M, N)
            self.a, self.w, self.bias = rnd(M, K), rnd(N, K, scale=K ** -0.5), rnd(N)
            self.b = self.w.t()
        elif problem == "dx":  # dY (M, N), W (N, K): dX (M, K)
            self.a, self.b, self.bias = rnd(M, N), rnd(N, K, scale=N ** -0.5), None
        else:  # dw: dY^T (N, M), X (M, K): dW (N, K)
            self.a, self.b, self.bias = rnd(M, N, scale=M ** -0.5).t(), rnd(M, K), None
        self.m, self.k, self.n = self.a.shape[0], self.a.shape[1], self.b.shape[1]
        self.out = torch.empty(self.m, self.n, device="cuda", dtype=torch.bfloat16)
        ref = self.a.float() @ self.b.float()
        if self.bias is not None:
            ref += self.bias.float()
        self.ref = torch.nn.functional.gelu(ref, approximate="tanh") if problem == "gelu" else ref
        self.cublas_out = self.cublas().clone()

    @property
    def flops(self):
        return 2 * self.m * self.n * self.k

    def fusion(self):
        return KM.Fusion(self.bias, act=GELU_TANH.value if self.problem == "gelu" else 0)

    def cublas(self):
        if self.problem == "fwd":
            return torch.nn.functional.linear(self.a, self.w, self.bias)
        if self.problem == "gelu":
            return torch.nn.functional.gelu(torch.nn.functional.linear(self.a, self.w, self.bias), approximate="tanh")
        return self.a @ self.b

    def flame(self):
        """flame's own route: linear_ for the forward problems, matmul_ for the gradients."""
        if self.problem in ("fwd", "gelu"):
            return KM.linear_(self.out, self.a, self.w, self.bias, act=self.fusion().act)
        return KM.matmul_(self.out, self.a, self.b)

    def tma(self):
        """flame's route with the Gluon kernel off: matmul.py's TMA kernel."""
        KH.ROUTE = False
        try:
            return self.flame()
        finally:
            KH.ROUTE = True

    def gluon(self, cfg):
        """The Gluon kernel with the launch config ``cfg`` (``matmul_hopper.config``)."""
        f = self.fusion()
        layout = KM._tma_layout(self.out, self.a, self.b, f, self.a.stride(), self.b.stride(), self.out.stride())
        if layout is None or not KH.usable(self.a, self.b, f):
            raise RuntimeError("the Gluon kernel cannot take this problem")
        return KH.matmul(self.out, self.a, self.b, self.m, self.n, self.k, f, layout, cfg)


def _err(got, want):
    return float((got.float() - want).norm() / want.norm())


def graph_ms(fn, calls, replays=10):
    """Median ms per call of ``fn`` over ``replays`` replays of a CUDA graph of ``calls`` calls. Every
    row of a case is timed with the same ``calls``: replays of one length (the card runs at its
    700 W limit, where clocks follow the recent load)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def kernels(fn, calls=10):
    """[(kernel name, device us per call)] of ``calls`` calls of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.key[:60], round(e.device_time_total / calls, 1)) for e in prof.key_averages() if e.device_time_total > 0]


def run_row(case, name, fn, calls, factor, time_only=False):
    """Check ``fn`` (NaN-poisoned output first) against the fp32 reference, then (``calls``) time
    it; ``time_only``: time it unchecked."""
    row = dict(problem=case.problem, shape=case.shape, name=name)
    try:
        if time_only:
            row["ms"] = graph_ms(fn, calls)
            return row
        case.out.fill_(float("nan"))
        got = fn()
        torch.cuda.synchronize()
        row["err"], row["cublas_err"] = _err(got, case.ref), _err(case.cublas_out, case.ref)
        if not row["err"] <= factor * max(row["cublas_err"], 2 ** -9):
            row["error"] = f"wrong: error {row['err']:.2e} vs cuBLAS {row['cublas_err']:.2e}"
            return row
        if calls:
            row["ms"] = graph_ms(fn, calls)
            row["tflops"] = case.flops / row["ms"] * 1e-9
    except Exception as e:  # one variant failing must not stop the others
        lines = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
    return row


def smoke(worker, jobs, pairs, log):
    """Worker ``worker`` of ``jobs``: every ``jobs``-th (problem, variant) of ``pairs`` once on the
    SMOKE problem, checked against fp32; one JSON line per result (a "start" line first: a hang
    names its variant)."""
    with open(log, "a") as out:
        todo = pairs[worker::jobs]
        for problem, variant in todo:
            out.write(json.dumps(dict(problem=problem, variant=variant, state="start")) + "\n")
            out.flush()
            case = Case(problem, *SMOKE)
            row = run_row(case, variant, functools.partial(case.gluon, KH.config(**VARIANTS[variant])), None, 2.0)
            out.write(json.dumps(dict(problem=problem, variant=variant, state="done", error=row.get("error"),
                                      err=row.get("err"))) + "\n")
            out.flush()


def _pairs(problems, variants, bwd_variants):
    """The (problem, Gluon variant) pairs timed: every variant on the forward problems, the
    ``bwd_variants`` among them on dx and dw."""
    return [(p, v) for p in problems for v in variants if p in ("fwd", "gelu") or v in bwd_variants]


def run_smoke(args, pairs, out):
    """The workers of ``smoke``, each under a time limit; {(problem, variant): error or None}."""
    log = out / "smoke.jsonl"
    log.unlink(missing_ok=True)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{i}/{args.jobs}", "--smoke-log", str(log),
                               "--problems", args.problems, "--variants", args.variants,
                               "--bwd-variants", args.bwd_variants]) for i in range(args.jobs)]
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, args.smoke_timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
    result = dict.fromkeys(pairs, "never ran")
    for line in log.read_text().splitlines() if log.exists() else []:
        r = json.loads(line)
        result[r["problem"], r["variant"]] = "hung or crashed" if r["state"] == "start" else r["error"]
    print(f"smoke: {len(result)} variants in {time.time() - t0:.0f} s; failed: "
          f"{ {k: e for k, e in result.items() if e} }", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="flux,sdxl,square", help="comma-separated shape groups (flux, sdxl, square)")
    ap.add_argument("--problems", default="fwd,gelu,dx,dw", help="comma-separated problems (fwd, gelu, dx, dw)")
    ap.add_argument("--bwd-only", default="flux", help="shape groups whose dx/dw problems run")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated Gluon variants")
    ap.add_argument("--bwd-variants", default="coop 2x64x256,pp 128x128,pp 64x256",
                    help="the Gluon variants timed on dx/dw")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--smoke-timeout", type=float, default=120.0, help="seconds for all smoke workers")
    ap.add_argument("--rep-ms", type=int, default=25, help="ms of replays per timing (10 timings, median)")
    ap.add_argument("--passes", type=int, default=2, help="timings of each row (every other pass reversed; min kept)")
    ap.add_argument("--err-factor", type=float, default=2.0)
    ap.add_argument("--profile", action="store_true", help="list the kernels of the first case's first rows")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke-log", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    problems = args.problems.split(",")
    variants = [v for v in args.variants.split(",") if v]
    pairs = _pairs(problems, variants, args.bwd_variants.split(","))
    if args.worker:
        i, n = map(int, args.worker.split("/"))
        smoke(i, n, pairs, args.smoke_log)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(common.environment("bench_gemm.py", argv or sys.argv[1:])), flush=True)
    smoked = run_smoke(args, pairs, out) if args.jobs else {}
    cases = []
    for group in args.only.split(","):
        for p in problems:
            if p == "gelu":
                shapes = [s for s in GELU_SHAPES if s in GROUPS[group]]
            elif p in ("dx", "dw"):
                shapes = GROUPS[group][:6] if group in args.bwd_only.split(",") else []
            else:
                shapes = GROUPS[group]
            cases += [(group, p, s) for s in shapes]
    rows = []
    with open(out / "gemm.jsonl", "w") as log:
        for group, p, shape in cases:
            case = Case(p, *shape)
            runs = [("cublas", case.cublas), ("tma", case.tma), ("flame", case.flame)]
            plan = KH.plan(case.m, case.n, case.k, case.a, case.b, case.fusion())
            if plan is not None:  # the kernel flame's route picks, launched directly
                runs.append(("gluon plan", functools.partial(case.gluon, plan)))
            runs += [(f"gluon {v}", functools.partial(case.gluon, KH.config(**VARIANTS[v]))) for q, v in pairs
                     if q == p and not smoked.get((p, v))]
            calls = max(1, round(args.rep_ms / graph_ms(case.cublas, 1, 5)))
            by = {}
            for i in range(args.passes):  # every other pass in reverse order: a drift shows as spread
                for name, fn in runs if i % 2 == 0 else runs[::-1]:
                    if "error" in by.get(name, {}):
                        continue
                    row = run_row(case, name, fn, calls, args.err_factor, time_only=i > 0)
                    if name not in by:
                        by[name] = dict(row, group=group, times=[])
                    if "ms" in row:
                        by[name]["times"].append(row["ms"])
            if args.profile and shape == cases[0][2]:
                for name, fn in runs[:4]:
                    print(f"kernels of {name} {shape} {p}: {kernels(fn)}", flush=True)
            for name, row in by.items():
                if row["times"]:
                    row["ms"] = min(row["times"])
                    row["tflops"] = case.flops / row["ms"] * 1e-9
                if name == "flame":
                    row["plan"] = KH.plan(case.m, case.n, case.k, case.a, case.b, case.fusion())
                rows.append(row)
                log.write(json.dumps(row, default=str) + "\n")
            log.flush()
            del case
            torch.cuda.empty_cache()
    report(rows)


def report(rows):
    """Per problem: one line per shape (TFLOP/s of each row, and flame's and the best Gluon's time
    over cuBLAS's), then the geometric means over the shapes of each group and of all."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    for problem in dict.fromkeys(r["problem"] for r in rows):
        sel = [r for r in rows if r["problem"] == problem]
        print(f"\n== {problem}: TFLOP/s (time / cuBLAS's)  [flame's plan]")
        print(f"{'M x K -> N':22}" + "".join(f"{n.removeprefix('gluon ')[:16]:>17}" for n in names))
        ratios = {}  # name -> [(group, ratio)]
        for shape in dict.fromkeys(r["shape"] for r in sel):
            by = {r["name"]: r for r in sel if r["shape"] == shape}
            base = by.get("cublas", {}).get("ms")
            cells = []
            for n in names:
                r = by.get(n)
                if r is None or "ms" not in r:
                    cells.append(f"{'-' if r is None else 'ERR':>17}")
                    continue
                ratio = r["ms"] / base if base else float("nan")
                ratios.setdefault(n, []).append((r["group"], ratio))
                cells.append(f"{r['tflops']:9.0f} ({ratio:4.2f})")
            gl = [by[n]["ms"] for n in names if n.startswith("gluon") and "ms" in by.get(n, {})]
            if gl and base:
                ratios.setdefault("best gluon", []).append((by["cublas"]["group"], min(gl) / base))
                if "ms" in by.get("tma", {}):
                    ratios.setdefault("best of tma, gluon", []).append((by["cublas"]["group"],
                                                                        min(gl + [by["tma"]["ms"]]) / base))
            plan = by.get("flame", {}).get("plan")
            plan = "tma" if plan is None else f"{'coop' if plan['COOP'] else 'pp'} {plan['BLOCK_M']}x{plan['BLOCK_N']}"
            print(f"{'{} x {} -> {}'.format(*shape):22}" + "".join(cells) + f"  [{plan}]")
        for r in sel:
            if "error" in r:
                print(f"  {r['name']} {r['shape']}: {r['error']}")
        print("geo-mean time / cuBLAS's (max):")
        for n, vals in ratios.items():
            parts = []
            for group in [None, *dict.fromkeys(g for g, _ in vals)]:
                v = [x for g, x in vals if group is None or g == group]
                parts.append(f"{group or 'all'} {math.exp(sum(map(math.log, v)) / len(v)):.3f} ({max(v):.2f})")
            print(f"  {n:24} " + "  ".join(parts))
        spread = sorted(max(r["times"]) / min(r["times"]) for r in sel if len(r.get("times", ())) > 1)
        if spread:
            print(f"spread of a row's timings (max / min): median {spread[len(spread) // 2]:.3f}, "
                  f"90th percentile {spread[int(0.9 * (len(spread) - 1))]:.3f}, max {spread[-1]:.3f}")


if __name__ == "__main__":
    main()
