"""Compiling a run's kernels ahead (flame.kernels.precompile): the recorded JSON lines describe what
Triton specialises on, the stand-ins built from a line specialise the same way, a process records
each variant once, and the real compile runs on the GPU (the interpreter compiles nothing)."""
import json
import subprocess
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

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
                            ["value", 3], ["value", 1], ["float"], ["value", True], ["value", None]]
    assert spec["meta"] == {"OP": 3, "CD": {"tl": "fp32"}, "num_warps": 4}
    # ints by what Triton specialises on: 1, a multiple of 16 or neither, 32 or 64 bits
    assert [L._int_class(v) for v in (1, 7, 23, -5, 0, 32, 2**40 + 5, 2**40)] == [1, 3, 3, 3, 16, 16, 2**32 + 3,
                                                                                    2**32 + 16]
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


def test_pending_lines_join_the_lists_and_leave_out_those_compiled_ahead(tmp_path):
    a, b, done = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / precompile.DONE_FILE
    a.write_text("x\ny\nx\n")
    b.write_text("y\n\nz\n")
    assert precompile.pending(a) == ["x", "y"]
    assert precompile.pending([a, b], done) == ["x", "y", "z"]  # no record yet: everything
    done.write_text(precompile._digest("y") + "\n")
    assert precompile.pending([a, b], done) == ["x", "z"]
    assert precompile.pending([a, b]) == ["x", "y", "z"]  # skip_compiled=False reads no record


def test_the_recorded_lists_are_named_by_gpu_and_triton(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path))
    name = precompile.manifest_name("NVIDIA H200")
    assert name.startswith("nvidia-h200-triton") and name.endswith(".jsonl")
    assert precompile.recorded_path().parent == tmp_path / "kernels"


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


# three jit functions, each calling the next; the innermost reads a constexpr global
_SCALE = tl.constexpr(3)


def _inner(x):
    return x * _SCALE


def _middle(x):
    return _inner_fn(x) + 1


def _outer(x):
    return _middle_fn(x) - 1


_inner_fn, _middle_fn, _outer_fn = JITFunction(_inner), JITFunction(_middle), JITFunction(_outer)


def _fresh_keys(order):
    fns = (_outer_fn, _middle_fn, _inner_fn)
    for f in fns:
        f.hash, f.used_global_vals = None, {}
    hashed = [f.cache_key for f in order]  # in this order: callers possibly before their callees
    assert len(hashed) == len(order)
    L.settle_cache_keys(list(order))
    return [f.cache_key for f in fns]


def test_settled_cache_keys_do_not_depend_on_the_order_functions_were_hashed():
    """Triton < 3.7 lets a caller's key depend on whether its callees were hashed before it
    (launch.settle_cache_keys): settled keys are the same whichever order a process hashed them in."""
    callers_first = _fresh_keys((_outer_fn, _middle_fn, _inner_fn))
    callees_first = _fresh_keys((_inner_fn, _middle_fn, _outer_fn))
    assert callers_first == callees_first
    assert len(set(callers_first)) == 3


_KEY_SCRIPT = """
import sys, flame
from flame.kernels import elementwise, launch, matmul
first = elementwise._map_contiguous_kernel if sys.argv[1] == "map" else matmul._matmul_kernel
key = first.cache_key  # this process hashes one kernel (and what it calls) before the others
launch.settle_cache_keys()
print(*(k.cache_key for k in (matmul._matmul_kernel, matmul._split_k_sum_kernel, elementwise._map_contiguous_kernel)))
"""


@pytest.mark.gpu
def test_processes_that_hash_kernels_in_another_order_agree_on_their_keys():
    """The run and the compile-ahead workers must compute the same cache keys (else Triton's
    on-disk cache misses): two processes that hash kernels in different orders agree."""
    keys = [subprocess.run([sys.executable, "-c", _KEY_SCRIPT, first], capture_output=True, text=True, check=True,
                           ).stdout.split() for first in ("map", "matmul")]
    assert keys[0] == keys[1] and len(keys[0]) == 3


def test_variants_a_run_compiled_are_marked_for_the_next_compile_ahead(tmp_path, monkeypatch):
    """What this process recorded (and so compiled into its cache) is listed in the cache's done
    file by mark_compiled: a later compile_ahead of a list holding it skips it."""
    import triton
    path = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(L.RECORD_ENV, str(path))
    monkeypatch.setattr(L, "_noted", set())
    monkeypatch.setattr(L, "_recorded", [])
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setattr(precompile.runtime, "INTERPRETER", False)
    L.note_variant(_map_contiguous_kernel, _args(), {"OP": 3})
    L.note_variant(_map_contiguous_kernel, _args(), {"OP": 4})
    done = tmp_path / "triton" / precompile.DONE_FILE
    assert precompile.pending(path, done) == precompile.read_lines(path)
    precompile.mark_compiled(L.take_recorded())
    assert precompile.pending(path, done) == [] and L.take_recorded() == []
    precompile.mark_compiled([])  # nothing new: the file is left alone
    assert len(done.read_text().split()) == 2


def test_the_shipped_list_is_compiled_ahead_for_sdxls_architecture_only(tmp_path, monkeypatch):
    """``train.compile_ahead: auto`` compiles configs/kernels' list (a full SDXL run's variants)
    only for SDXL's UNet; another model (the tiny configs, the trainer tests' stand-in) compiles
    only what earlier runs on this machine recorded."""
    import dataclasses
    from types import SimpleNamespace

    from flame.models import SDXLUNetConfig
    from flame.train.families.sdxl import is_sdxl_architecture
    assert is_sdxl_architecture(SDXLUNetConfig()) and is_sdxl_architecture(SDXLUNetConfig(sample_size=64))
    assert not is_sdxl_architecture(SDXLUNetConfig.tiny())
    assert not is_sdxl_architecture(dataclasses.replace(SDXLUNetConfig(), transformer_layers_per_block=(1, 1, 1)))
    assert not is_sdxl_architecture(SimpleNamespace(**dataclasses.asdict(SDXLUNetConfig())))
    shipped, recorded = tmp_path / "shipped" / precompile.manifest_name(), tmp_path / "recorded.jsonl"
    for path in (shipped, recorded):
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}\n")
    monkeypatch.setattr(precompile, "SHIPPED_DIR", shipped.parent)
    monkeypatch.setattr(precompile, "recorded_path", lambda: recorded)
    assert precompile.auto_paths() == [shipped, recorded]
    assert precompile.auto_paths(shipped=False) == [recorded]


def test_one_compile_ahead_pool_at_a_time_per_cache_folder(tmp_path, monkeypatch):
    """A compile_ahead while another process holds the cache folder's lock waits for it, then finds
    the lines it compiled done: trainers started together do not each start a pool of workers."""
    import fcntl
    import threading

    import triton
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setattr(precompile.runtime, "INTERPRETER", False)
    path = tmp_path / "kernels.jsonl"
    path.write_text('{"a": 1}\n')
    done = tmp_path / "triton" / precompile.DONE_FILE
    done.parent.mkdir()
    result = {}
    waiter = threading.Thread(target=lambda: result.update(precompile.compile_ahead(path, progress=False)))
    with open(done.with_suffix(".lock"), "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process's pool, compiling the same line
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not result  # waiting for the lock
        precompile._mark_done(done, [precompile._digest('{"a": 1}')])  # the other pool finishes
    waiter.join(10)
    assert result == {"variants": 0, "failed": 0, "seconds": 0.0}


def _runtime_and_constexpr_names(kernel):
    """(the names of ``kernel``'s runtime arguments in order, those of its constexprs)."""
    import inspect

    params = inspect.signature(kernel.fn).parameters.values()
    constexpr = {p.name for p in params  # tl.constexpr, or Gluon's gl.constexpr (a class of its own)
                 if str(getattr(p.annotation, "__name__", p.annotation)).rpartition(".")[2] == "constexpr"}
    return [p.name for p in params if p.name not in constexpr], constexpr


@pytest.mark.parametrize("path", sorted((precompile.Path(__file__).parents[1] / "configs" / "kernels").glob("*.jsonl")),
                         ids=lambda p: p.name)
def test_every_shipped_line_matches_its_kernel(path):
    """A shipped list's line names a flame kernel that exists, with one recorded argument per runtime
    argument and constexprs it has: a kernel whose arguments changed since the list was recorded makes
    its lines fail to compile (time spent, nothing cached). Re-record the list on that GPU
    (``FLAME_RECORD_KERNELS``), or drop the kernel's lines until then."""
    import importlib

    options = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
    stale = []
    for line in precompile.read_lines(path):
        spec = json.loads(line)
        module, name = spec["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name, None)
        if kernel is None:
            stale.append(f"{name}: no such kernel")
            continue
        runtime_args, constexprs = _runtime_and_constexpr_names(kernel)
        if len(spec["args"]) != len(runtime_args) or not set(spec["meta"]) - options <= constexprs:
            stale.append(f"{name}: {len(spec['args'])} arguments for {len(runtime_args)}")
    assert stale == []
