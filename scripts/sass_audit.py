"""Global memory accesses by width in the machine code of a run's kernels (GPU only).

Each line of the recorded lists (``configs/kernels/*.jsonl``, or a file a run wrote with
``FLAME_RECORD_KERNELS``) is compiled as ``flame.kernels.precompile`` compiles it (the kernel's
``warmup`` on stand-in arguments that Triton specialises as the run's did), and its cubin is read with
the ``cuobjdump`` Triton ships. One row per variant: registers, spilled bytes (the stack frame), and
the global loads and stores by width. A memory-bound kernel should move 16 bytes per access; 1- and
2-byte accesses (``narrow``) mean addresses the compiler could not prove contiguous and aligned
(a column offset it cannot analyse, a tile whose unit-stride run spans two dims): rows with any are
marked ``!``. Kernels whose global traffic goes through TMA (descriptors) show none.

    PYTHONPATH=. python3 scripts/sass_audit.py                       # the shipped lists for this GPU
    PYTHONPATH=. python3 scripts/sass_audit.py run.jsonl --only rope  # a run's list, kernels whose name has "rope"
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# isort: off
import common  # noqa: F401  (first: puts the checkout on sys.path and imports flame, which selects the backend)
import flame
from flame.kernels import precompile
import triton
# isort: on

# a global load, store or copy to shared memory (cp.async) and its width: LDG.E.128, STG.E.U16,
# LDGSTS.E.BYPASS.LTC128B.128, LDG.E.64.CONSTANT, ... (no width suffix: 32 bits)
ACCESS = re.compile(r"\b(LDGSTS|LDG|STG)\.E((?:\.[A-Z0-9]+)*)")
WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def accesses(sass: str) -> collections.Counter:
    """{(``"LDG"``, ``"STG"`` or ``"LDGSTS"``, bytes): instructions} of a kernel's SASS."""
    counts = collections.Counter()
    for op, suffixes in ACCESS.findall(sass):
        width = next((WIDTHS[s] for s in suffixes.split(".") if s in WIDTHS), 4)
        counts[op, width] += 1
    return counts


def resources(usage: str) -> tuple[int, int]:
    """(registers, stack bytes) from ``cuobjdump --dump-resource-usage``."""
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def audit_line(line: str, tool: Path, scratch: Path) -> dict:
    """One variant's row: its kernel, meta, registers, stack bytes and accesses; or its error."""
    spec = json.loads(line)
    row = {"kernel": spec["kernel"].split(":")[1], "meta": spec["meta"]}
    try:
        compiled = precompile.compile_variant(spec)
    except Exception as e:  # a line the kernels no longer match
        return {**row, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    scratch.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(tool), "--dump-sass", str(scratch)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(scratch)], capture_output=True, text=True,
                           check=True).stdout
    regs, stack = resources(usage)
    return {**row, "registers": regs, "stack": stack, "accesses": accesses(sass)}


def _describe(counts: collections.Counter) -> str:
    return " ".join(f"{op}x{width}B:{n}" for (op, width), n in sorted(counts.items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lists", nargs="*", help="recorded kernel lists (default: the shipped lists for this GPU)")
    ap.add_argument("--only", default="", help="kernels whose name contains this text")
    args = ap.parse_args(argv)
    if flame.is_interpreter():
        sys.exit("sass_audit.py reads the machine code compiled for a GPU: run it on one (FLAME_DEVICE=cuda)")
    paths = args.lists or precompile.auto_paths(shipped=True)
    lines = sorted({line for path in paths for line in precompile.read_lines(path) if args.only in line})
    tool = _cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "kernel.cubin"
        for line in lines:
            row = audit_line(line, tool, scratch)
            if "error" in row:
                print(f"  {row['kernel']:32s} {row['error']}")
                continue
            narrow = sum(n for (_, width), n in row["accesses"].items() if width < 4)
            print(f"{'!' if narrow else ' '} {row['kernel']:32s} regs {row['registers']:3d} stack {row['stack']:4d} "
                  f"{_describe(row['accesses'])}  {json.dumps(row['meta'], sort_keys=True)}", flush=True)


if __name__ == "__main__":
    main()
