#!/usr/bin/env python3
"""Benchmark results as data: store ``scripts/bench.py --out`` runs per card, and write BENCHMARKS.md's
tables from the stored files.

    python3 scripts/bench_tables.py add out/bench.json [--commit SHA]  # into benchmarks/<card>.json, then write
    python3 scripts/bench_tables.py write                              # BENCHMARKS.md's tables from benchmarks/
    python3 scripts/bench_tables.py check                              # exit 1 when BENCHMARKS.md is stale
    python3 scripts/bench_tables.py compare before.json after.json     # two runs of one card, case by case

``benchmarks/<card>.json`` (the card's name in file-name form, as the tuning tables are named) holds
the newest run of each (family, dtype) on that card: ``add`` replaces a family's run with the one it
is given, so a file may combine runs of different dates; older runs are in git's history. Its format:

    {"format": 1, "card": "NVIDIA H200",
     "runs": [{"family": "matmul", "dtype": "bf16", "command": "scripts/bench.py ...", "date": "...",
               "commit": "d1e17d0", "dirty": false, "torch": "...", "triton": "...", "timer": "graph",
               "tuning": "table",
               "cases": [{"case": "fwd 4096x640->640 +bias", "unit": "ms", "timer": "graph",
                          "flame": 0.0144, "torch": 0.0115, "ratio": 1.26, "tuned_speedup": 1.02}, ...],
               "targets": [{"target": "...", "timer": "graph", "stat": "max", "value": 1.385,
                            "bound": 1.1, "met": false, "cases": 8}, ...]}, ...]}

Times are milliseconds ("unit": "ms", device time) or microseconds of host time per op ("us/op");
ratio = flame / torch. A case timed both ways keeps the eager numbers under "eager". Optional:
"source" (where hand-copied numbers came from), "error" on a case that failed its check, torch or
flame null where a number was not recorded.

BENCHMARKS.md holds, for each family, a block between ``<!-- bench-table FAMILY -->`` and
``<!-- /bench-table -->`` (``<!-- bench-table tuning -->``: the --tuning compare summary); ``write``
rewrites only those blocks, so the prose around them stays.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from flame.tune import slug  # noqa: E402  (the tuning tables' file names: one spelling per card)

OLD_FAMILY_NAMES = {"linear": "matmul", "conv": "conv2d"}  # bench.py's family names before kernel_families

FORMAT = 1
STORE = ROOT / "benchmarks"
DOC = ROOT / "BENCHMARKS.md"
# bench.py's families (scripts/kernel_families) in the stored files' order (a family not listed here goes last)
FAMILIES = ("elementwise", "overhead", "matmul", "lora", "norms", "softmax", "attention", "conv2d")
PASSES = {"fwd": "forward", "fwd+bwd": "forward+backward"}
# Rows a family's table leaves out, to keep BENCHMARKS.md short (every case stays in the JSON): the
# GroupNorms show NCHW without SiLU and channels-last with it (SDXL's resnets), not the other two.
HIDDEN = {"norms": lambda row: row.startswith("group_norm") and (" CL" in row) != ("+silu" in row)}
BLOCK = re.compile(r"(<!-- bench-table (\S+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)


# ---- storing runs ------------------------------------------------------------------------------

def _dtype(name: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name)


def _case(row: dict, graph: bool) -> dict:
    """A bench.py result row as stored: the shown timer's times (CUDA-graph replays when the run
    took them), the eager ones kept under "eager", and the tuning comparison."""
    out = {"case": row["case"], "unit": row.get("unit")}
    if "error" in row:
        return {**out, "error": row["error"]}
    g = row.get("graph")
    if graph and g and row.get("timer") != "graph":
        out.update(timer="graph", flame=g["flame"], torch=g["torch"], ratio=g["ratio"],
                   eager={k: row[k] for k in ("flame", "torch", "ratio")})
    else:
        out.update({k: row[k] for k in ("flame", "torch", "ratio")})
        if row.get("unit") == "ms":
            out["timer"] = row.get("timer", "eager")
    out.update({k: row[k] for k in ("tuned_speedup", "tuned_same_configs", "tuned_timer") if k in row})
    return out


def runs_of(doc: dict, commit: str | None = None) -> tuple[str, list[dict]]:
    """(card, one stored run per family) of a ``bench.py --out`` document. ``commit`` fills in a
    commit the run could not record (a tree copied to the GPU machine without its .git)."""
    if doc.get("backend") != "cuda" or not doc.get("gpu"):
        raise ValueError("not a GPU run (interpreter times mean nothing)")
    if doc.get("quick"):
        raise ValueError("a --quick run (small shapes): not stored")
    graph = doc.get("timer") in ("graph", "both")
    meta = {"dtype": _dtype(doc.get("dtype", "")), "command": doc.get("command"), "date": doc.get("date"),
            "commit": doc.get("commit") or commit, "dirty": doc.get("dirty", False), "torch": doc.get("torch"),
            "triton": doc.get("triton"), "timer": "graph" if graph else "eager", "tuning": doc.get("tuning", "table")}
    if doc.get("baseline_table"):
        meta["baseline_table"] = doc["baseline_table"]
    runs = []
    for fam in doc.get("families", []):
        cases = [_case(r, graph) for r in doc.get("results", []) if r.get("family") == fam]
        if not cases:
            continue
        targets = [{k: t[k] for k in ("target", "timer", "stat", "value", "bound", "met", "cases")}
                   for t in doc.get("targets", []) if t.get("family") == fam]
        if graph and any(t["timer"] == "graph" for t in targets):
            targets = [t for t in targets if t["timer"] == "graph"]  # the shown timer's
        runs.append({"family": fam, **meta, "cases": cases, "targets": targets})
    return doc["gpu"], runs


def _order(run: dict):
    fam = run["family"]
    return (FAMILIES.index(fam) if fam in FAMILIES else len(FAMILIES), fam, run["dtype"] != "bf16", run["dtype"])


def load_card(path: Path) -> dict:
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT}")
    return doc


def add(paths, store: Path = STORE, commit: str | None = None) -> list[Path]:
    """Fold each ``bench.py --out`` file into ``store/<card>.json``: its families' runs replace the
    stored runs of the same family and dtype. Returns the files written."""
    written = []
    for path in paths:
        try:
            card, runs = runs_of(json.loads(Path(path).read_text()), commit)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        target = store / f"{slug(card)}.json"
        doc = load_card(target) if target.exists() else {"format": FORMAT, "card": card, "runs": []}
        new = {(r["family"], r["dtype"]) for r in runs}
        kept = [r for r in doc["runs"] if (r["family"], r["dtype"]) not in new]
        doc["runs"] = sorted(kept + runs, key=_order)
        store.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=1) + "\n")
        written.append(target)
    return written


# ---- tables ------------------------------------------------------------------------------------

def _short(card: str) -> str:
    """The card's column label: "NVIDIA H100 80GB HBM3" -> "H100"."""
    words = [w for w in card.split() if w.upper() not in ("NVIDIA", "AMD", "GEFORCE", "TESLA")]
    return words[0] if words else card


def _num(v: float) -> str:
    return f"{v:.1f}" if abs(v) < 1e4 else f"{v:.0f}"


def _cell(case: dict, timer: str) -> str:
    """"flame / torch (flame/torch)", in µs (device time) or µs per op (host time); "eager" marks a
    case timed eagerly in a run that shows graph replays."""
    if "error" in case:
        return "check failed"
    scale = 1e3 if case.get("unit") == "ms" else 1.0
    times = [_num(case[k] * scale) for k in ("flame", "torch") if case.get(k) is not None]
    ratio = f"{case['ratio']:.2f}x" if case.get("ratio") is not None else "-"
    text = f"{' / '.join(times)} ({ratio})" if times else ratio
    return text + (" eager" if case.get("unit") == "ms" and case.get("timer") != timer else "")


def _split(name: str, passes: bool) -> tuple[str | None, str, str | None]:
    """(pass, row, variant) of a case name: "fwd+bwd 3x3 1x4x8x8->16 vs torch CL" -> ("fwd+bwd",
    "3x3 1x4x8x8->16", "CL"). ``passes``: split the pass off (in families that time both passes of
    a case; overhead's "fwd no_grad, ..." rows are names of their own)."""
    pass_, rest = None, name
    for p in ("fwd+bwd", "fwd"):
        if passes and name.startswith(p + " "):
            pass_, rest = p, name[len(p) + 1:]
            break
    row, _, variant = rest.partition(" vs torch ")
    return pass_, row, variant or None


def _has_passes(cases) -> bool:
    """Whether some case is timed both forward and forward+backward."""
    names = [c["case"] for c in cases]
    return bool({n[4:] for n in names if n.startswith("fwd ")} & {n[8:] for n in names if n.startswith("fwd+bwd ")})


def _date(run: dict) -> str:
    return (run.get("date") or "date unknown")[:10]


def _describe(runs) -> list[str]:
    """One line per run, its targets at the end, or per group of runs without targets that differ
    only in their card and commit."""
    groups = {}
    for card, run in runs:
        how = "graph replays" if run.get("timer") == "graph" else "eager calls"
        tuning = "heuristic configs" if run.get("tuning") == "defaults" else "tuned tables"
        key = tuple(p for p in (f"`{run.get('command')}`", _date(run), f"torch {run.get('torch')}",
                                f"Triton {run.get('triton')}", run["dtype"], how, tuning) if p)
        commit = run.get("commit") or "commit unknown"
        groups.setdefault((key, run.get("source"), _targets(run) or ""), []).append(
            f"{card} ({commit}{' with local changes' if run.get('dirty') else ''})")
    lines = []
    for (key, source, targets), cards in groups.items():
        line = f"{', '.join(cards)}: " + ", ".join(key) + (f" ({source})" if source else "")
        lines.append(line + (f". {targets}" if targets else ""))
    return lines


def _targets(run: dict) -> str | None:
    if not run.get("targets"):
        return None
    parts = [f"{t['target']}: {t['value']:.3f}x {'geo-mean' if t['stat'] == 'geo' else 'max'} "
             f"{'met' if t['met'] else '**missed**'}" for t in run["targets"]]
    return f"Targets ({run['targets'][0]['timer']}): " + "; ".join(parts) + "."


def family_table(family: str, cards: list[dict]) -> str:
    """The block of one family: one table with a column group per card (and dtype, variant, pass),
    then a line per card's run (command, date, commit, versions; its targets)."""
    runs = [(c["card"], r) for c in cards for r in c["runs"] if r["family"] == family]
    if not runs:
        return (f"No stored run yet: `PYTHONPATH=. python3 scripts/bench.py --family {family} --out out/bench.json`"
                " on a GPU, then `python3 scripts/bench_tables.py add out/bench.json`.\n")
    dtypes = {r["dtype"] for _, r in runs}
    hidden = HIDDEN.get(family, lambda row: False)
    columns, rows, cells, left_out = [], [], {}, set()
    order, variants = {}, []  # column -> (card, dtype, pass, variant) rank: every card's groups in one order
    for card, run in runs:
        passes = _has_passes(run["cases"])
        for case in run["cases"]:
            pass_, row, variant = _split(case["case"], passes)
            if hidden(row):
                left_out.add(row)
                continue
            label = " ".join(p for p in (_short(card) if len(cards) > 1 else None,
                                         run["dtype"] if len(dtypes) > 1 else None,
                                         PASSES.get(pass_), f"vs {variant}" if variant else None) if p)
            col = label or "flame / torch (ratio)"
            if variant not in variants:
                variants.append(variant)
            if col not in columns:
                columns.append(col)
                order[col] = ([c["card"] for c in cards].index(card), run["dtype"], list(PASSES).index(pass_)
                              if pass_ in PASSES else -1, variants.index(variant))
            if row not in rows:
                rows.append(row)
            cells[row, col] = (case, run["timer"])
    columns.sort(key=order.__getitem__)
    lines = ["| case | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    lines += [f"| {row} | " + " | ".join(_cell(*cells[row, col]) if (row, col) in cells else "-" for col in columns)
              + " |" for row in rows]
    notes = _describe(runs)
    if left_out:
        notes.append(f"{len(left_out)} more cases (the other variants) are in `benchmarks/`.")
    return "\n".join(lines + [""] + [n + "\\" for n in notes[:-1]] + notes[-1:]) + "\n"  # one paragraph, a line each


def _geo(values) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def tuning_table(cards: list[dict]) -> str:
    """One row per card whose stored runs compared the tuned table with the heuristics."""
    lines = ["| card | cases the table changes | geo-mean speedup | worst case | cases > 5% slower | per family |",
             "| --- | --- | --- | --- | --- | --- |"]
    for card in cards:
        runs = [r for r in card["runs"] if r.get("tuning") == "compare" and not r.get("baseline_table")]
        timed = [(r["family"], c) for r in runs for c in r["cases"] if c.get("tuned_speedup")]
        if not timed:
            continue
        same = sum(1 for r in runs for c in r["cases"] if c.get("tuned_same_configs"))
        worst_fam, worst = min(timed, key=lambda fc: fc[1]["tuned_speedup"])
        slower = sum(1 for _, c in timed if c["tuned_speedup"] < 0.95)
        per = ", ".join(f"{f} {_geo(c['tuned_speedup'] for g, c in timed if g == f):.3f}x "
                        f"({sum(1 for g, _ in timed if g == f)})" for f in dict.fromkeys(f for f, _ in timed))
        dates = sorted({_date(r) for r in runs})
        lines.append(f"| {card['card']} ({', '.join(dates)}) | {len(timed)} ({same} launch the heuristic's configs "
                     f"either way) | {_geo(c['tuned_speedup'] for _, c in timed):.3f}x | "
                     f"{worst['tuned_speedup']:.3f}x ({worst_fam}: {worst['case']}) | {slower} | {per} |")
    if len(lines) == 2:
        return ("No stored run compares the tuned tables yet: `bench.py --tuning compare` on a GPU, then "
                "`bench_tables.py add`.\n")
    return "\n".join(lines) + "\n"


def load_cards(store: Path = STORE) -> list[dict]:
    return [load_card(p) for p in sorted(store.glob("*.json"))]


def render(text: str, cards: list[dict]) -> str:
    """``text`` (BENCHMARKS.md) with every bench-table block rewritten from ``cards``."""
    def block(m):
        name = m.group(2)
        body = tuning_table(cards) if name == "tuning" else family_table(name, cards)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(block, text)



def compare(before: Path, after: Path, out=sys.stdout) -> dict:
    """Two ``bench.py --out`` runs of one card (before and after a change, ideally in one call),
    case by case: flame's time after over before, and torch's (the machine's drift between the two
    runs: torch did not change); per family the geometric mean and the largest change of flame's
    ratio, and of flame's ratio over torch's. Returns {family: (geo-mean, largest |change|)}."""
    def cases(path):
        card, runs = runs_of(json.loads(path.read_text()))
        return card, {(OLD_FAMILY_NAMES.get(r["family"], r["family"]), c["case"]): c
                      for r in runs for c in r["cases"] if c.get("flame") and c.get("torch")}

    card_b, b = cases(before)
    card_a, a = cases(after)
    if card_a != card_b:
        raise ValueError(f"runs of different cards: {card_b} and {card_a}")
    print(f"{card_a}: flame after / before (torch after / before: the drift), {before.name} -> {after.name}", file=out)
    by_family, summary = {}, {}
    for key in sorted(set(a) & set(b)):
        fl, tr = a[key]["flame"] / b[key]["flame"], a[key]["torch"] / b[key]["torch"]
        by_family.setdefault(key[0], []).append((key[1], fl, tr))
    for fam, rows in by_family.items():
        print(f"\n{fam}", file=out)
        for case, fl, tr in rows:
            print(f"  {case:<52} {fl:6.3f}  ({tr:.3f})", file=out)
        geo = math.exp(statistics.fmean(math.log(fl) for _, fl, _ in rows))
        rel = [fl / tr for _, fl, tr in rows]
        worst = max(rows, key=lambda r: abs(math.log(r[1])))
        summary[fam] = (geo, worst[1])
        rel_geo = math.exp(statistics.fmean(math.log(r) for r in rel))
        rel_worst = max(rel, key=lambda r: abs(math.log(r)))
        print(f"  geo-mean {geo:.3f}, largest change {worst[1]:.3f} ({worst[0]}); over torch's drift: geo-mean "
              f"{rel_geo:.3f}, largest {rel_worst:.3f}", file=out)
    left = sorted(set(a) ^ set(b))
    if left:
        print(f"\nin one run only: {', '.join(f'{f}/{c}' for f, c in left)}", file=out)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=("add", "write", "check", "compare"),
                   default="write")
    p.add_argument("runs", nargs="*", type=Path, help="add: bench.py --out files; compare: before and after")
    p.add_argument("--commit", default=None, help="add: the commit the runs measured, where they lack one")
    p.add_argument("--store", type=Path, default=STORE, help="the per-card files (default: benchmarks/)")
    p.add_argument("--doc", type=Path, default=DOC,
                   help="the document with bench-table blocks (default: BENCHMARKS.md)")
    args = p.parse_args(argv)
    if args.action == "compare":
        if len(args.runs) != 2:
            p.error("compare: name two bench.py --out files, before and after")
        compare(*args.runs)
        return 0
    if args.action == "add":
        if not args.runs:
            p.error("add: name the bench.py --out files")
        for path in add(args.runs, args.store, args.commit):
            print(f"wrote {path}")
    elif args.runs:
        p.error(f"{args.action} takes no files")
    cards = load_cards(args.store)
    text = args.doc.read_text()
    new = render(text, cards)
    known = {m.group(2) for m in BLOCK.finditer(text)}
    missing = sorted({r["family"] for c in cards for r in c["runs"]} - known)
    if missing:
        print(f"note: {args.doc.name} has no bench-table block for {', '.join(missing)}", file=sys.stderr)
    if args.action == "check":
        if new != text:
            print(f"{args.doc} is stale: run python3 scripts/bench_tables.py write", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
