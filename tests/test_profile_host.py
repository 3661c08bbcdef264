"""scripts/profile_host.py --sdxl, issue 51's GPU-free check of flame's host path: its two lines (the
first step's launches, a later step's host time), and --against, which alternates two checkouts in one
run (here the checkout against itself, at a small resolution)."""
import re
import subprocess
import sys
from pathlib import Path

import flame

ROOT = Path(__file__).resolve().parents[1]


def _run(*options):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_host.py"), "--sdxl", "--resolution", "256",
                           "--steps", "1", *options], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_sdxl_step_prints_its_launches_and_host_time():
    """On the interpreter the launches are stubbed and counted; on a GPU the step's kernels run."""
    done = _run("--top", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    if flame.is_interpreter():
        launches = re.search(r"one eager SDXL LoRA step, 256x256, checkpointing off: (\d+) launches", done.stdout)
        assert launches and int(launches.group(1)) > 1000
    ran = "no kernel runs" if flame.is_interpreter() else "kernels run on .*, synchronised"
    assert re.search(rf"host time of an eager step \({ran}\), median of 1: [0-9.]+ ms", done.stdout), done.stdout
    calls = re.search(r"Python and builtin calls in the profiled step: (\d+) for its (\d+) launches", done.stdout)
    assert calls and int(calls.group(1)) > 10 * int(calls.group(2)) > 0


def test_against_alternates_two_checkouts_and_reports_their_ratio(tmp_path):
    done = _run("--against", str(ROOT), "--rounds", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    rounds = re.findall(r"round (\d): this [0-9.]+ ms, other [0-9.]+ ms, this / other ([0-9.]+)", done.stdout)
    assert [r for r, _ in rounds] == ["1", "2"]
    assert re.search(r"medians of 2 rounds: this [0-9.]+ ms \(.*\), other [0-9.]+ ms \(.*\), this / other [0-9.]+",
                     done.stdout)
    bad = _run("--against", str(tmp_path))
    assert bad.returncode != 0 and "no scripts/profile_host.py there" in bad.stderr
