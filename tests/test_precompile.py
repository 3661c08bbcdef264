"""Compiling a run's kernels ahead (flame.kernels.precompile): the recorded JSON lines describe what
Triton specialises on, the stand-ins built from a line specialise the same way, a process records
each variant once, and the real compile runs on the GPU (the interpreter compiles nothing)."""
import json

import pytest
import torch
import triton.language as tl

import flame
from flame.kernels import launch as L
from flame.kernels import precompile
from flame.kernels.elementwise import _map_contiguous_kernel
from helpers import DEVICE


def _args():
    x = torch.empty(64, dtype=torch.bfloat16, device=DEVICE)
    return (x, x[1:], torch.empty(8, dtype=torch.int64, device=DEVICE), 7, 1, 0.5, True, None)


def test_a_variant_line_names_what_triton_specialises_on():
    line = L.describe_variant(_map_contiguous_kernel, _args(), {"OP": 3, "CD": tl.float32, "num_warps": 4})
    spec = json.loads(line)
    assert spec["kernel"] == "flame.kernels.elementwise:_map_contiguous_kernel"
    assert spec["args"] == [["tensor", "bfloat16", True], ["tensor", "bfloat16", False], ["tensor", "int64", True],
                            ["value", 7], ["value", 1], ["float"], ["value", True], ["value", None]]
    assert spec["meta"] == {"OP": 3, "CD": {"tl": "fp32"}, "num_warps": 4}
    # stand-ins rebuilt from the line describe as the same variant
    stand_ins = [precompile._stand_in(a) for a in spec["args"]]
    assert L.describe_variant(_map_contiguous_kernel, stand_ins, {"OP": 3, "CD": tl.float32, "num_warps": 4}) == line
    assert tl.dtype(spec["meta"]["CD"]["tl"]) == tl.float32
    # what it cannot describe is not recorded
    assert L.describe_variant(_map_contiguous_kernel, (object(),), {}) is None
    assert L.describe_variant(object(), (), {}) is None


@pytest.mark.skipif(L.TensorDescriptor is None, reason="this Triton has no host-built tensor descriptors")
def test_a_descriptor_is_described_by_dtype_and_block_shape():
    base = torch.empty(256, 128, dtype=torch.float16, device=DEVICE)
    desc = L.TensorDescriptor(base, [256, 128], [128, 1], [64, 32])
    assert L._describe_arg(desc) == ["descriptor", "float16", [64, 32]]
    again = precompile._stand_in(L._describe_arg(desc))
    assert L._describe_arg(again) == ["descriptor", "float16", [64, 32]]


def test_each_variant_is_recorded_once(tmp_path, monkeypatch):
    path = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(L.RECORD_ENV, str(path))
    monkeypatch.setattr(L, "_noted", set())
    for _ in range(3):
        L.note_variant(_map_contiguous_kernel, _args(), {"OP": 3})
    L.note_variant(_map_contiguous_kernel, _args(), {"OP": 4})
    lines = precompile.read_lines(path)
    assert len(lines) == 2 and len(path.read_text().splitlines()) == 2
    monkeypatch.delenv(L.RECORD_ENV)
    L.note_variant(_map_contiguous_kernel, _args(), {"OP": 5})  # not recording: nothing written
    assert len(path.read_text().splitlines()) == 2


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter path")
def test_the_interpreter_compiles_nothing_ahead(tmp_path):
    path = tmp_path / "kernels.jsonl"
    path.write_text(L.describe_variant(_map_contiguous_kernel, _args(), {"OP": 3}) + "\n")
    assert precompile.compile_ahead(path) == {"variants": 0, "failed": 0, "seconds": 0.0}


@pytest.mark.gpu
def test_compiled_ahead_variants_are_found_by_the_run(tmp_path, monkeypatch):
    """A recorded variant compiled in a worker process lands in Triton's cache: the same launch in
    this process then loads it instead of compiling (a fresh cache directory for both)."""
    x = flame.randn(1000)
    path = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(L.RECORD_ENV, str(path))
    monkeypatch.setattr(L, "_noted", set())
    (x * 3.0).sum()
    lines = precompile.read_lines(path)
    assert lines
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    stats = precompile.compile_ahead(path, jobs=2, progress=False)
    assert stats["variants"] == len(lines) and stats["failed"] == 0, stats
    assert any((tmp_path / "cache").rglob("*.cubin"))
