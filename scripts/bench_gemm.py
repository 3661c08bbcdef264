"""GEMMs on Hopper (issue 46): flame's warp-specialised Gluon kernel (flame/kernels/matmul_hopper.py)
in several schedules and tile shapes, flame's TMA kernel (matmul.py) and cuBLAS, at the Flux and SDXL
linear shapes, on one card, in one process.

Problems (``--problems``): ``fwd`` = y = x W^T + b (``linear_``; cuBLAS: F.linear), ``gelu`` = the same
with GELU (tanh) fused (cuBLAS: F.linear then F.gelu; the target is the plain GEMM's time), ``geglu``
= SDXL's GEGLU projection at inference, x (M, K) and W (2N, K) [hidden; gate] to (x W_h^T + b_h) *
gelu(x W_g^T + b_g) (M, N), exact GELU (flame: ``matmul.linear_geglu``, one launch of the Gluon
kernel's gated mode; cuBLAS: F.linear alone, the plain (M, 2N) projection, whose time is the target:
GEGLU at no cost; its row is timed, not checked), ``dx`` = dY W and ``dw`` = dY^T X (``matmul_``;
cuBLAS: torch.matmul). A shape is M x K -> N, N the GEMM's width (for geglu the projection's 2N);
TFLOP/s count that GEMM. Rows: ``cublas``; ``tma`` = flame with the Gluon route off; ``flame`` =
flame's own route (``matmul_hopper.plan``: the Gluon kernel or the TMA one; geglu: ``linear_geglu``);
``gluon plan`` = the Gluon kernel launched directly with the plan's config (geglu has neither tma
nor gluon plan: its plan, ``gated_config``, is the variant pp 64x256); ``torch composed`` (geglu
only) = F.linear, chunk and hidden * F.gelu(gate); ``gluon ...`` = the Gluon kernel forced
to one schedule (``coop`` 2 consumers x BLOCK_M x BLOCK_N per program tile, ``pp`` ping-pong over
BLOCK_M x BLOCK_N tiles; ``sN`` at most N stages, else as many as fit; ``--variants`` on fwd and
gelu, ``--bwd-variants`` among them on dx and dw, ``--geglu-variants`` on geglu, launched gated:
BLOCK_N is a tile's hidden + gate width, 64x256 = 64 rows x (128 hidden + 128 gate columns)). Each
table ends with the stages each Gluon row ran with (``matmul_hopper.config``: a variant's ``sN``
is a cap, so it can equal the default).

Every Gluon variant first runs in worker processes (``--jobs``) on a small problem with tails,
checked against PyTorch: that compiles it into Triton's cache, and a variant that fails or hangs
(each worker has a time limit) is reported and left out of the timing. Then this process checks
every row of every case against an fp32 reference (error at most ``--err-factor`` x PyTorch's: cuBLAS's
row, for geglu the composed one) and
times it: replays of a CUDA graph of as many calls as fill ``--rep-ms`` at cuBLAS's speed, the same
count for every row of a case (the H200 runs these at its 700 W limit, where clocks follow the
load), median of 10, in ``--passes`` passes of alternating order (the fastest kept). Prints a table
per problem (TFLOP/s, time over cuBLAS's) and the geometric means; writes ``gemm.jsonl`` under
``--out`` (default $OUT or .).

    PYTHONPATH=. python3 scripts/bench_gemm.py                       # everything
    PYTHONPATH=. python3 scripts/bench_gemm.py --only flux --problems fwd --variants "coop 2x64x256"
    PYTHONPATH=. python3 scripts/bench_gemm.py --jobs 0 --variants "" --profile  # flame's route only
    PYTHONPATH=. python3 scripts/bench_gemm.py --only sdxl --problems geglu    # the GEGLU projections
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # first: puts the checkout on sys.path and selects the backend
import torch

import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
from flame.kernels.elementwise import GELU, GELU_TANH

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
PROBLEMS = ("fwd", "gelu", "geglu", "dx", "dw")
# the fused problems' shapes (in GROUPS): gelu at MLP up-projections; geglu (M, K, 2N) at SDXL's GEGLU projections
# (batch 2 (CFG) first, then batch 1)
FUSED_SHAPES = {"gelu": [(4608, 3072, 12288), (4096, 640, 5120)],
                "geglu": [(8192, 640, 5120), (2048, 1280, 10240), (4096, 640, 5120), (1024, 1280, 10240)]}
# tails in M and N, more tiles than programs in every schedule; geglu's (2000, 1504) output keeps its rows
# 16-byte aligned (TMA)
SMOKE = {p: (2000, 1000, 3008 if p == "geglu" else 3000) for p in PROBLEMS}

# the Gluon variants (``variant`` reads a name): the default --variants (fwd, gelu) ...
VARIANTS = ("coop 2x64x256", "pp 128x128", "pp 64x256", "coop 2x128x128", "coop 2x64x128", "pp 128x128 s4",
            "pp 64x128", "coop 2x64x160",  # 160 = a 128- and a 32-wide block
            "pp 128x160", "coop 2x64x192")
# ... and --geglu-variants: today's gated_config (pp 64x256, as many stages as fit: 4 on an H200) and its
# neighbours; pp 128x128 is 128 rows x (64 hidden + 64 gate). Stages on an H200 (config's count, 227 KiB):
# pp 64x256 4, pp 128x128 5, coop 2x64x256 3, pp 128x256 2 (with fewer than 2 it would be left out here)
GEGLU_VARIANTS = ("pp 64x256", "pp 64x256 s3", "pp 64x256 s4", "pp 128x128", "pp 128x256", "coop 2x64x256")


def variant(name, gated=False):
    """``matmul_hopper.config``'s arguments of a variant's name: "coop 2xMxN" (2 consumers x M rows x
    N columns per program tile) or "pp MxN" (ping-pong M x N tiles), then " sS" for at most S stages.
    ValueError for another name or a width the kernel cannot split (``split_width``; ``gated``: two
    halves, each a power of two)."""
    m = re.fullmatch(r"(coop 2x|pp )(\d+)x(\d+)(?: s(\d+))?", name)
    if m is None:
        raise ValueError(f"variant {name!r}: expected 'coop 2xMxN' or 'pp MxN', then ' sS' or nothing")
    kind, bm, bn, stages = m.groups()
    bn = int(bn)
    if not int(bm) or not bn or stages == "0":
        raise ValueError(f"variant {name!r}: tile sizes and stages must be positive")
    if gated and (bn % 2 or bn // 2 & (bn // 2 - 1)):
        raise ValueError(f"variant {name!r}: a gated tile's width must be two equal powers of two")
    KH.split_width(bn)
    return dict(coop=kind == "coop 2x", block_m=int(bm), block_n=bn, stages=stages and int(stages))


def geglu(t):
    """hidden * gelu(gate) (exact) over the halves of ``t``'s last dim."""
    hidden, gate = t.chunk(2, dim=-1)
    return hidden * torch.nn.functional.gelu(gate)


class Case:
    """One problem's operands (random, bf16), its fp32 reference and PyTorch's output (cuBLAS's; for
    geglu the composed ops'), whose error a row may have a multiple of."""

    def __init__(self, problem, M, K, N):
        self.problem, self.shape = problem, (M, K, N)
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16()
        if problem in ("fwd", "gelu", "geglu"):  # x (M, K), W (N, K): out (M, N); geglu's (M, N / 2)
            self.a, self.w, self.bias = rnd(M, K), rnd(N, K, scale=K ** -0.5), rnd(N)
            self.b = self.w.t()
        elif problem == "dx":  # dY (M, N), W (N, K): dX (M, K)
            self.a, self.b, self.bias = rnd(M, N), rnd(N, K, scale=N ** -0.5), None
        else:  # dw: dY^T (N, M), X (M, K): dW (N, K)
            self.a, self.b, self.bias = rnd(M, N, scale=M ** -0.5).t(), rnd(M, K), None
        self.m, self.k, self.n = self.a.shape[0], self.a.shape[1], self.b.shape[1]
        self.out = torch.empty(self.m, self.n // 2 if problem == "geglu" else self.n, device="cuda",
                               dtype=torch.bfloat16)
        ref = self.a.float() @ self.b.float()
        if self.bias is not None:
            ref += self.bias.float()
        self.ref = (torch.nn.functional.gelu(ref, approximate="tanh") if problem == "gelu" else
                    geglu(ref) if problem == "geglu" else ref)
        self.torch_out = (self.composed if problem == "geglu" else self.cublas)().clone()
        self.unchecked = ("cublas",) if problem == "geglu" else ()  # rows timed only: geglu's is another product

    @property
    def flops(self):
        return 2 * self.m * self.n * self.k

    def fusion(self):
        return KM.Fusion(self.bias, act={"gelu": GELU_TANH.value, "geglu": GELU.value}.get(self.problem, 0))

    def cublas(self):
        if self.problem in ("fwd", "geglu"):  # geglu: the plain (M, 2N) projection, the time to match
            return torch.nn.functional.linear(self.a, self.w, self.bias)
        if self.problem == "gelu":
            return torch.nn.functional.gelu(torch.nn.functional.linear(self.a, self.w, self.bias), approximate="tanh")
        return self.a @ self.b

    def composed(self):
        """geglu in PyTorch's ops: F.linear (cuBLAS), chunk, hidden * F.gelu(gate)."""
        return geglu(torch.nn.functional.linear(self.a, self.w, self.bias))

    def flame(self):
        """flame's own route: linear_ for fwd and gelu, linear_geglu for geglu (a new buffer), matmul_
        for the gradients."""
        if self.problem == "geglu":
            out = KM.linear_geglu(self.a, self.w, self.bias, tuple(self.out.shape))
            if out is None:
                raise RuntimeError("linear_geglu does not serve this problem here (flame composes linear_ and "
                                   "the GEGLU map)")
            return out
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
        """The Gluon kernel with the launch config ``cfg`` (``matmul_hopper.config``); geglu: gated,
        launched as ``linear_geglu`` launches it (W (2N, K) read along K)."""
        f = self.fusion()
        gated = self.problem == "geglu"
        width = self.out.shape[1]
        layout = ((True, True, self.a.stride(0), self.k, width) if gated else
                  KM._tma_layout(self.out, self.a, self.b, f, self.a.stride(), self.b.stride(), self.out.stride()))
        if layout is None or not KH.usable(self.a, self.b, f):
            raise RuntimeError("the Gluon kernel cannot take this problem")
        return KH.matmul(self.out, self.a, self.w if gated else self.b, self.m, width, self.k, f, layout, cfg,
                         gated=gated)

    def rows(self):
        """(name, fn) of the rows other than the forced Gluon variants."""
        if self.problem == "geglu":
            return [("cublas", self.cublas), ("torch composed", self.composed), ("flame", self.flame)]
        runs = [("cublas", self.cublas), ("tma", self.tma), ("flame", self.flame)]
        plan = self.plan()
        if plan is not None:  # the kernel flame's route picks, launched directly
            runs.append(("gluon plan", functools.partial(self.gluon, plan)))
        return runs

    def plan(self):
        """The Gluon config of flame's route (None: another kernel); geglu: ``gated_config`` where the
        kernel is usable (``linear_geglu`` asks more: its row fails where it declines)."""
        if self.problem == "geglu":
            return KH.gated_config() if KH.ROUTE and KH.usable(self.a, self.w, self.fusion()) else None
        return KH.plan(self.m, self.n, self.k, self.a, self.b, self.fusion())


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
        row["err"], row["cublas_err"] = _err(got, case.ref), _err(case.torch_out, case.ref)
        if not row["err"] <= factor * max(row["cublas_err"], 2 ** -9):
            row["error"] = f"wrong: error {row['err']:.2e} vs PyTorch's {row['cublas_err']:.2e}"
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
        for problem, name in todo:
            out.write(json.dumps(dict(problem=problem, variant=name, state="start")) + "\n")
            out.flush()
            case = Case(problem, *SMOKE[problem])
            row = run_row(case, name, functools.partial(case.gluon, KH.config(**variant(name))), None, 2.0)
            out.write(json.dumps(dict(problem=problem, variant=name, state="done", error=row.get("error"),
                                      err=row.get("err"))) + "\n")
            out.flush()


def _pairs(problems, variants, bwd_variants, geglu_variants):
    """The (problem, Gluon variant) pairs timed: every variant on fwd and gelu, the ``bwd_variants``
    among them on dx and dw, the ``geglu_variants`` on geglu."""
    return [(p, v) for p in problems for v in (geglu_variants if p == "geglu" else variants)
            if p in ("fwd", "gelu", "geglu") or v in bwd_variants]


def run_smoke(args, pairs, out):
    """The workers of ``smoke``, each under a time limit; {(problem, variant): error or None}."""
    log = out / "smoke.jsonl"
    log.unlink(missing_ok=True)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{i}/{args.jobs}", "--smoke-log", str(log),
                               "--problems", args.problems, "--variants", args.variants,
                               "--bwd-variants", args.bwd_variants, "--geglu-variants", args.geglu_variants])
             for i in range(args.jobs)]
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
    ap.add_argument("--problems", default=",".join(PROBLEMS), help=f"comma-separated problems ({', '.join(PROBLEMS)})")
    ap.add_argument("--bwd-only", default="flux", help="shape groups whose dx/dw problems run")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated Gluon variants")
    ap.add_argument("--bwd-variants", default="coop 2x64x256,pp 128x128,pp 64x256",
                    help="the Gluon variants timed on dx/dw")
    ap.add_argument("--geglu-variants", default=",".join(GEGLU_VARIANTS),
                    help="comma-separated Gluon variants timed gated on geglu (BLOCK_N = hidden + gate columns)")
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
    if set(problems) - set(PROBLEMS):
        ap.error(f"--problems: unknown {sorted(set(problems) - set(PROBLEMS))}; known: {', '.join(PROBLEMS)}")
    variants = [v for v in args.variants.split(",") if v]
    pairs = _pairs(problems, variants, args.bwd_variants.split(","), [v for v in args.geglu_variants.split(",") if v])
    for p, v in pairs:  # a misspelt variant stops here, not in a worker
        try:
            variant(v, gated=p == "geglu")
        except ValueError as e:
            ap.error(f"{p}: {e}")
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
            if p in FUSED_SHAPES:
                shapes = [s for s in FUSED_SHAPES[p] if s in GROUPS[group]]
            elif p in ("dx", "dw"):
                shapes = GROUPS[group][:6] if group in args.bwd_only.split(",") else []
            else:
                shapes = GROUPS[group]
            cases += [(group, p, s) for s in shapes]
    rows = []
    with open(out / "gemm.jsonl", "w") as log:
        for group, p, shape in cases:
            case = Case(p, *shape)
            configs = {f"gluon {v}": KH.config(**variant(v)) for q, v in pairs if q == p and not smoked.get((p, v))}
            runs = case.rows() + [(name, functools.partial(case.gluon, cfg)) for name, cfg in configs.items()]
            calls = max(1, round(args.rep_ms / graph_ms(case.cublas, 1, 5)))
            by = {}
            for i in range(args.passes):  # every other pass in reverse order: a drift shows as spread
                for name, fn in runs if i % 2 == 0 else runs[::-1]:
                    if "error" in by.get(name, {}):
                        continue
                    row = run_row(case, name, fn, calls, args.err_factor, time_only=i > 0 or name in case.unchecked)
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
                    row["plan"] = case.plan()
                if name in configs:
                    row["config"] = configs[name]
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
        stages = {r["name"].removeprefix("gluon "): r["config"]["STAGES"] for r in sel if r.get("config")}
        if stages:
            print("stages: " + ", ".join(f"{n} {s}" for n, s in stages.items()))
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
