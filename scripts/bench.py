#!/usr/bin/env python3
"""Benchmark flame's kernels against PyTorch eager, on one card, in one run.

    PYTHONPATH=. python3 scripts/bench.py                        # every family
    PYTHONPATH=. python3 scripts/bench.py --family elementwise --dtype bf16 --out out/bench.json
    python scripts/bench.py --quick --family elementwise,overhead  # small shapes (CPU smoke test)
    PYTHONPATH=. python3 scripts/bench.py --family matmul,conv2d --tuning compare --repeat 3  # tuned vs defaults

Device-time cases use ``triton.testing.do_bench`` (median of ``--rep`` ms after ``--warmup`` ms) for
flame and for PyTorch alike; host-time cases (the ``overhead`` family) time a Python loop with
``time.perf_counter`` after a warm-up and synchronise at the end. On a GPU, ``--timer`` (default
``both``) also times CUDA-graph replays of both sides: the kernels' device time, free of the host's
cost and noise, next to the eager time a user sees (a case that cannot be captured is eager only).
Each case first checks that flame and PyTorch agree, so a fast wrong kernel cannot post a number.
On the interpreter backend (no GPU) times measure Triton's interpreter and mean nothing; that mode
exists to smoke-test this script.

flame's launch configs come from the GPU's tuning table (``flame.tune``) unless ``--tuning defaults``
hides the tables; ``--tuning compare`` times flame both ways in the same process, alternating with
PyTorch per ``--repeat``, and reports each case's tuned speedup over the heuristic defaults (the
ratio of the two sides' medians). On a GPU the two sides replay CUDA graphs of the case: a launch
config changes device time only, and graph replays keep the shared host's noise out (``tuned_timer``
says "graph", or "eager" where a case cannot be captured). A case whose launches ask ``flame.tune`` for the same configs
with and without the table (no entry applies, or the entries answer "heuristic") is marked
``tuned_same_configs`` and not timed twice: it runs the very same kernels either way.
``--baseline-table PATH`` makes the other side an earlier table file instead of the heuristics
(``flame.tune.table_from``), so a re-tuned table is checked against the one it replaces in one run.

``--case TEXT`` (repeatable) runs only the cases whose names contain one of the texts (no targets
are checked then: they are judged on a family's every case). On a GPU,
``--kernels`` also profiles each device case (torch.profiler, 10 calls per side after the timing)
and reports, per side, its CUDA kernels with launches and device microseconds per call, most time
first: where a ratio comes from, in the same run and on the same card (stored under "kernels").

After a full-size run (not ``--quick``) the acceptance targets of the families' issues
(``Target``: the worst case or the geometric mean of flame/PyTorch time over the cases a target
names, against its bound) are checked for each timer and printed, and stored under "targets" in
the JSON.

The families and their cases live in ``scripts/kernel_families/`` (one module per kernel family,
named as its kernel file, each declaring its ``BENCH`` next to its tuning problems); ``--family``
also takes the names two of them had before (``linear``: matmul, ``conv``: conv2d).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (also when imported by path)

# isort: off
import common  # first: puts the checkout on sys.path and imports flame, which selects the backend
import flame
from flame import tune
import torch
import kernel_families
from kernel_families.cases import Case, Ctx, Target
# isort: on

DTYPES = common.DTYPES


# The families (scripts/kernel_families: one module per kernel family, its cases next to its tuning
# problems): {name: (cases(ctx) -> list[Case], description)} and each one's issue targets.
FAMILIES: dict[str, tuple[Callable[[Ctx], list[Case]], str]] = {
    name: (fam.cases, fam.description) for name, fam in kernel_families.bench_families().items()}
TARGETS: dict[str, tuple[Target, ...]] = {name: fam.targets for name, fam in kernel_families.bench_families().items()}
ALIASES = kernel_families.bench_aliases()  # older names that commands in the docs use: linear, conv


# ---- measurement -------------------------------------------------------------------------------

def time_device(fn, ctx: Ctx) -> float:
    """Median milliseconds per call (``do_bench``; the interpreter: host time of a few calls)."""
    return common.device_ms(fn, ctx.warmup, ctx.rep, interpreter_calls=3 if ctx.quick else 5)


PROFILE_CALLS = 10  # calls per side profiled by --kernels


def kernel_times(fn, calls=PROFILE_CALLS) -> list[list]:
    """[kernel name, launches per call, device µs per call] of the CUDA kernels ``fn`` runs, most
    time first: torch.profiler over ``calls`` calls after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    common.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        common.sync()
    return per_call_kernels(prof.events(), calls)


def per_call_kernels(events, calls) -> list[list]:
    """The CUDA ``events`` of a profile of ``calls`` calls, summed per kernel name and divided by
    ``calls``: [name, launches per call, device µs per call], most time first."""
    totals = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches, us = totals.get(e.name, (0, 0.0))
            totals[e.name] = (launches + 1, us + e.device_time)
    rows = [[name, launches / calls, us / calls] for name, (launches, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def time_host(fn, ctx: Ctx, ops: int) -> float:
    """Microseconds of host time per op, averaged over a loop that is synchronised at the end."""
    warmup, iters = (2, 3) if ctx.interpreter else ((5, 20) if ctx.quick else (20, 200))
    return common.host_us_per_op(fn, warmup, iters, ops)


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_case(case: Case) -> str | None:
    """None when flame's and PyTorch's outputs agree (``common.mismatch``: the library's tolerance
    with bench's slack), else a description of the mismatch."""
    got, want = _as_tuple(case.flame()), _as_tuple(case.torch())
    if len(got) != len(want):
        return f"flame returned {len(got)} outputs, torch {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        problem = common.mismatch(g.to_torch() if isinstance(g, flame.Tensor) else g, w, case.check_dtype)
        if problem:
            return f"output {i}: {problem}"
    return None


def _alternated(a, b, ctx):
    """(ms runs of ``a``, ms runs of ``b``), the two timed alternately ``--repeat`` times."""
    return tuple(zip(*[(time_device(a, ctx), time_device(b, ctx)) for _ in range(ctx.repeat)]))


def _tuned_and_default_times(case, ctx, tuned=None):
    """(timer, tuned ms runs, heuristic ms runs) of ``case.flame``, alternating per --repeat.
    A launch config changes the device time, not the host's, so where both can be captured the
    two sides replay CUDA graphs ("graph": device time alone, free of the shared host's noise);
    else both run eagerly ("eager"). ``tuned``: a graph of ``case.flame`` captured already."""
    if not ctx.interpreter:
        tuned = common.captured(case.flame) if tuned is None else tuned
        with ctx.baseline_configs():
            default = common.captured(case.flame)
        if tuned is not None and default is not None:
            return ("graph", *_alternated(tuned.replay, default.replay, ctx))

    def default_run():
        with ctx.baseline_configs():
            return time_device(case.flame, ctx)

    runs = [(time_device(case.flame, ctx), default_run()) for _ in range(ctx.repeat)]
    return ("eager", *zip(*runs))


def _configs_used(case):
    """The launch configs one call of ``case.flame`` asks flame.tune for, in order."""
    with tune.record() as asked:
        case.flame()
    return [q[3] for q in asked]


def _table_changes(case, ctx):
    """Whether the tuning table changes any launch config of ``case`` against the baseline (the
    heuristics or --baseline-table; else both runs launch the very same kernels, and timing both
    measures only noise)."""
    tuned = _configs_used(case)
    with ctx.baseline_configs():
        return _configs_used(case) != tuned


def run_case(fam: str, case: Case, ctx: Ctx) -> dict:
    row = {"family": fam, "case": case.name, "note": case.note}
    problem = check_case(case) if case.check else None
    if problem:
        row.update(error=f"flame and torch disagree: {problem}")
        return row
    if case.timer == "host":
        f, t = time_host(case.flame, ctx, case.ops), time_host(case.torch, ctx, case.ops)
        row.update(unit="us/op", flame=f, torch=t)
    else:
        # --repeat: alternate flame and torch (and flame on its heuristic configs, --tuning compare),
        # keep the median of each side's medians: a transient slowdown of the shared host or card
        # then moves no side
        compare = ctx.tuning == "compare" and _table_changes(case, ctx)
        if ctx.tuning == "compare" and not compare:
            row.update(tuned_same_configs=True)
        # both sides replayed from CUDA graphs: device time alone, without either framework's host cost
        graphs = (None if ctx.interpreter or ctx.timer == "eager"
                  else (common.captured(case.flame), common.captured(case.torch)))
        graphed = _alternated(graphs[0].replay, graphs[1].replay, ctx) if graphs and None not in graphs else None
        if graphed is not None:
            gf, gt = (statistics.median(x) for x in graphed)
            row.update(graph=dict(flame=gf, torch=gt, ratio=gf / gt if gt > 0 else math.inf,
                                  flame_runs=list(graphed[0]), torch_runs=list(graphed[1])))
        if ctx.timer == "graph" and graphed is not None:
            (fs, ts), timer = graphed, "graph"
        else:
            (fs, ts), timer = _alternated(case.flame, case.torch, ctx), "eager"
        f, t = statistics.median(fs), statistics.median(ts)
        row.update(unit="ms", timer=timer, flame=f, torch=t)
        if compare:
            tuned_timer, tuned, default = _tuned_and_default_times(case, ctx, graphs[0] if graphs else None)
            d = statistics.median(default)
            row.update(tuned_timer=tuned_timer, flame_tuned=statistics.median(tuned), flame_defaults=d,
                       flame_tuned_runs=list(tuned), flame_defaults_runs=list(default),
                       tuned_speedup=d / statistics.median(tuned))
        if ctx.repeat > 1:
            row.update(flame_runs=list(fs), torch_runs=list(ts))
        if case.nbytes:
            row.update(bytes=case.nbytes, flame_gbps=case.nbytes / f / 1e6, torch_gbps=case.nbytes / t / 1e6)
        if case.flops:
            row.update(flops=case.flops, flame_tflops=case.flops / f / 1e9, torch_tflops=case.flops / t / 1e9)
        if ctx.kernels and not ctx.interpreter:
            row.update(kernels=dict(flame=kernel_times(case.flame), torch=kernel_times(case.torch)))
    row["ratio"] = f / t if t > 0 else math.inf
    return row


# ---- reporting ---------------------------------------------------------------------------------

def _fmt(v, digits=4):
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.0f}"


def _rate(row, who):
    if f"{who}_tflops" in row:
        return f"{row[f'{who}_tflops']:.1f} TFLOP/s"
    if f"{who}_gbps" in row:
        return f"{row[f'{who}_gbps']:.0f} GB/s"
    return "-"


def print_table(rows: list[dict], baseline: str | None = None) -> None:
    """The results table; ``baseline``: --baseline-table's file (else the compare side is the
    heuristics)."""
    compare = any("flame_defaults" in r for r in rows)
    graphed = any("graph" in r and r.get("timer") == "eager" for r in rows)
    header = ("case", "flame", "torch", "unit", "flame/torch", "flame rate", "torch rate")
    if graphed:
        header += ("graph flame", "graph torch", "graph flame/torch")
    if compare:
        header += ("flame baseline" if baseline else "flame defaults", "tuned speedup")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((f"{r['family']}: {r['case']}", "ERROR", r["error"]))
            continue
        line = (f"{r['family']}: {r['case']}", _fmt(r["flame"]), _fmt(r["torch"]), r["unit"],
                f"{r['ratio']:.2f}x", _rate(r, "flame"), _rate(r, "torch"))
        if graphed:
            g = r.get("graph") if r.get("timer") == "eager" else None
            line += (_fmt(g["flame"]), _fmt(g["torch"]), f"{g['ratio']:.2f}x") if g else ("-", "-", "-")
        if compare:
            line += (_fmt(r.get("flame_defaults")), f"{r['tuned_speedup']:.2f}x" if "tuned_speedup" in r else "-")
        lines.append(line)
    ok = [line for line in lines if line[1] != "ERROR"]
    widths = [max(len(header[i]), *(len(str(line[i])) for line in ok)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        if line[1] == "ERROR":
            print(f"{line[0]:<{widths[0]}}  ERROR: {line[2]}")
        else:
            print(fmt.format(*line))
    speedups = [r["tuned_speedup"] for r in rows if r.get("tuned_speedup", 0) > 0]
    same = sum(1 for r in rows if r.get("tuned_same_configs"))
    if speedups or same:
        geo = math.exp(statistics.fmean(math.log(x) for x in speedups)) if speedups else 1.0
        slower = [r["case"] for r in rows if r.get("tuned_speedup", 1) < 0.95]
        other = f"the table {baseline}" if baseline else "heuristic defaults"
        print(f"tuned table vs {other}: geometric-mean speedup {geo:.3f}x over the {len(speedups)} cases "
              f"the table changes ({same} launch the {'baseline' if baseline else 'heuristic'}'s configs either "
              f"way); {len(slower)} cases more than 5% slower{': ' + ', '.join(slower) if slower else ''}")


def print_kernels(rows: list[dict], top=6) -> None:
    """Each profiled case's ``top`` kernels per side (--kernels), µs per call."""
    for r in rows:
        if "kernels" not in r:
            continue
        print(f"{r['family']}: {r['case']}")
        for side in ("flame", "torch"):
            ks = r["kernels"][side]
            print(f"  {side}: {sum(k[2] for k in ks):.1f} us per call in {sum(k[1] for k in ks):g} launches")
            for name, launches, us in ks[:top]:
                print(f"    {us:9.2f} us  {launches:4g}x  {name[:90]}")


def _ratios(row):
    """{timer: flame/torch time} of a device-time row: its main timer's ratio and the graph's."""
    out = {row.get("timer", "eager"): row["ratio"]}
    if row.get("graph"):
        out["graph"] = row["graph"]["ratio"]
    return out


def check_targets(rows: list[dict], families) -> list[dict]:
    """Each target of ``families`` against ``rows``, per timer that measured its cases: the
    statistic, the bound, how many cases and whether it is met."""
    results = []
    for fam in families:
        for t in TARGETS.get(fam, ()):
            picked = [_ratios(r) for r in rows
                      if r["family"] == fam and "error" not in r and r.get("unit") == "ms" and t.select(r["case"])]
            for timer in ("eager", "graph"):
                vals = [p[timer] for p in picked if timer in p]
                if not vals:
                    continue
                v = max(vals) if t.stat == "max" else math.exp(statistics.fmean(math.log(x) for x in vals))
                results.append(dict(family=fam, target=t.text, timer=timer, stat=t.stat, value=v, bound=t.bound,
                                    cases=len(vals), met=v < t.bound if t.strict else v <= t.bound))
    return results


def print_targets(results: list[dict]) -> None:
    """One line per target: each timer's statistic and whether it meets the bound."""
    if not results:
        return
    print("\nissue targets (flame time / PyTorch time; eager calls, then CUDA-graph replays):")
    lines = {}
    for r in results:
        word = "max" if r["stat"] == "max" else "geo-mean"
        lines.setdefault((r["family"], r["target"], r["bound"]), []).append(
            f"{r['timer']} {word} {r['value']:.3f}x {'met' if r['met'] else 'MISSED'} "
            f"({r['cases']} case{'' if r['cases'] == 1 else 's'})")
    for (fam, text, bound), parts in lines.items():
        print(f"  {fam}: {text} [bound {bound:.3g}x]: " + "; ".join(parts))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="families:\n" + "\n".join(f"  {k:<12} {d}" for k, (_, d) in FAMILIES.items())
                                + "\nolder names: " + ", ".join(f"{old} = {new}" for old, new in ALIASES.items()))
    p.add_argument("--family", action="append", default=[],
                   help="family to run (repeatable or comma-separated; default: all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="element type (default: bf16 on a GPU, fp32 on the interpreter)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="small shapes and few repetitions (smoke test)")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up in ms (default 25, quick 5)")
    p.add_argument("--rep", type=int, default=None, help="do_bench measurement time in ms (default 100, quick 20)")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each device case this many times, alternating flame and torch; report the medians")
    p.add_argument("--tuning", choices=("table", "defaults", "compare"), default="table",
                   help="flame's launch configs: this GPU's tuning table where it has an entry (table, the "
                        "default), the heuristic defaults only (defaults), or both, timed alternately in this "
                        "run with the tuned speedup per case (compare)")
    p.add_argument("--baseline-table", type=Path, default=None, metavar="PATH",
                   help="with --tuning compare: time the current table against this table file (an earlier "
                        "version of configs/autotune/<gpu>.json, say) instead of the heuristic defaults")
    p.add_argument("--timer", choices=("eager", "graph", "both"), default="both",
                   help="device cases on a GPU: time each call as a user makes it (eager: host cost included), "
                        "replays of a CUDA graph of it (graph: device time alone, free of the shared host's "
                        "noise), or both, reporting both ratios (default); the interpreter times eagerly")
    p.add_argument("--case", action="append", default=[], metavar="TEXT",
                   help="run only the cases whose names contain TEXT (repeatable: any of them)")
    p.add_argument("--kernels", action="store_true",
                   help="on a GPU, also profile each device case: its CUDA kernels per side, launches and device "
                        "time per call (torch.profiler)")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    args = p.parse_args(argv)
    names = [ALIASES.get(n.strip(), n.strip()) for spec in args.family for n in spec.split(",") if n.strip()]
    names = names or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    args.family = list(dict.fromkeys(names))
    if args.baseline_table is not None:
        if args.tuning != "compare":
            p.error("--baseline-table needs --tuning compare")
        if not args.baseline_table.is_file():
            p.error(f"--baseline-table: no file {args.baseline_table}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        for name, (_, desc) in FAMILIES.items():
            print(f"{name:<12} {desc}")
        return 0
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if flame.is_interpreter() else torch.bfloat16)
    ctx = Ctx(dtype=dtype, quick=args.quick,
              warmup=args.warmup if args.warmup is not None else (5 if args.quick else 25),
              rep=args.rep if args.rep is not None else (20 if args.quick else 100), repeat=max(1, args.repeat),
              tuning=args.tuning, timer=args.timer, kernels=args.kernels,
              baseline=str(args.baseline_table) if args.baseline_table else None)
    env = common.environment("bench.py", argv)
    print(f"flame bench on {env['device']} ({env['backend']}); torch {env['torch']}, triton {env['triton']}; "
          f"dtype {dtype}; {env['date']}")
    if ctx.interpreter:
        print("note: no GPU -- kernels run in Triton's interpreter, so these times mean nothing")
    rows = []
    partial = args.quick or bool(args.case)  # targets are judged on every full-size case of a family

    def save():  # after every family, so a run stopped midway keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            doc = {**env, "dtype": str(dtype).replace("torch.", ""), "quick": args.quick, "tuning": args.tuning,
                   "baseline_table": ctx.baseline,
                   "timer": args.timer, "families": args.family, "results": rows,
                   "targets": [] if partial else check_targets(rows, args.family)}
            args.out.write_text(json.dumps(doc, indent=2) + "\n")

    with tune.heuristics_only() if args.tuning == "defaults" else contextlib.nullcontext():
        for name in args.family:
            fn, _ = FAMILIES[name]
            flame.manual_seed(0)
            cases = [c for c in fn(ctx) if not args.case or any(text in c.name for text in args.case)]
            for i, case in enumerate(cases):
                rows.append(run_case(name, case, ctx))
                r = rows[-1]
                done = f"ERROR {r['error']}" if "error" in r else f"{r['ratio']:.2f}x ({_fmt(r['flame'])} {r['unit']})"
                print(f"[{name} {i + 1}/{len(cases)}] {case.name}: {done}", file=sys.stderr, flush=True)
            save()
    print_table(rows, ctx.baseline)
    print_kernels(rows)
    if not partial:  # the targets are set on all the full-size shapes
        print_targets(check_targets(rows, args.family))
    if args.out:
        print(f"wrote {args.out}")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
