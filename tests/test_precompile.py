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
import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
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


def test_the_trainer_records_new_variants_for_this_machine_and_every_one_into_a_named_file(tmp_path, monkeypatch):
    """``compile_ahead: auto`` records into this machine's list only what the lists it compiles ahead do
    not hold; a FLAME_RECORD_KERNELS file the user names gets every variant of the run (so a list
    re-recorded with the trainer is complete)."""
    from flame.train import preflight

    listed = tmp_path / "shipped.jsonl"
    listed.write_text('{"a": 1}\n')
    machine = tmp_path / "cache" / "kernels" / "gpu.jsonl"
    monkeypatch.setattr(precompile, "recorded_path", lambda: machine)
    noted = []
    monkeypatch.setattr(L, "note_known", lambda lines: noted.extend(lines))
    monkeypatch.setenv(L.RECORD_ENV, "unset below; restored after the test")
    monkeypatch.delenv(L.RECORD_ENV)
    preflight._record_new_kernels([listed], print)
    assert L.os.environ[L.RECORD_ENV] == str(machine) and machine.parent.is_dir() and noted == ['{"a": 1}']
    noted.clear()
    preflight._record_new_kernels([listed], print)  # a second run in this process: the same
    assert noted == ['{"a": 1}']
    noted.clear()
    monkeypatch.setenv(L.RECORD_ENV, str(tmp_path / "mine.jsonl"))
    preflight._record_new_kernels([listed], print)
    assert L.os.environ[L.RECORD_ENV] == str(tmp_path / "mine.jsonl") and noted == []


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


# ---- Gluon's host-built descriptors (the warp-specialised GEMM and convolution, matmul_hopper.py) ------------

needs_gluon = pytest.mark.skipif(KH.gluon is None, reason="needs triton.experimental.gluon (its host descriptors)")
GLUON_CASES = ["forward", "input_grad", "residual", "low_rank", "split_k", "w8a8", "gated", "conv"]


def _gluon_launch(case, monkeypatch):
    """(kernel, arguments, meta) of the Gluon GEMM's launch for one kind of problem, as
    ``matmul_hopper.matmul`` makes it (host side, no GPU: the call of ``launch`` is captured, its
    descriptors copied there, since the kept ones drop their bases after the call)."""
    import copy

    from flame.kernels.elementwise import GELU_TANH
    monkeypatch.setattr(KH, "_launches", {})  # nothing kept past the test
    monkeypatch.setattr(KH.autotune, "shared_memory", lambda: 232_448)  # an H200's, whatever runs the test
    monkeypatch.setattr(KM, "split_k_sum_", lambda *args: None)  # split K's sum pass: not this kernel
    calls = []
    monkeypatch.setattr(KH, "launch", lambda kernel, grid, *args, sig=None, **meta: calls.append(
        (kernel, [copy.copy(a) if isinstance(a, KH.TensorDescriptor) else a for a in args], meta)))

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=DEVICE)

    M, K, N = 1000, 272, 520  # rows of 16-byte multiples for fp8 codes too, as TMA needs
    a, w, out = empty(M, K), empty(N, K), empty(M, N)
    forward = (True, True, K, K, N)  # matmul._tma_layout's (A along K, B = W^T along K), which needs a TMA device
    cfg = KH.config(coop=True, block_m=64, block_n=160)
    if case == "forward":
        KH.matmul(out, a, w.t(), M, N, K, KM.Fusion(empty(N)), forward, cfg)
    elif case == "input_grad":  # B (K, N) read along N, ping-pong tiles, the pre-activation kept
        f = KM.Fusion(act=GELU_TANH.value, pre_out=empty(M, N))
        KH.matmul(out, a, empty(K, N), M, N, K, f, (True, False, K, N, N), KH.config(coop=False))
    elif case == "residual":
        KH.matmul(out, a, w.t(), M, N, K, KM.Fusion(alpha=0.5, residual=empty(M, N)), forward, cfg)
    elif case == "low_rank":
        f = KM.Fusion(alpha=0.75, low_rank=(empty(M, 16), empty(N, 16).t(), 0.5))
        KH.matmul(out, a, w.t(), M, N, K, f, forward, cfg)
    elif case == "split_k":  # C is the fp32 scratch of the splits' products
        KH.matmul(out, a, w.t(), M, N, K, KM.Fusion(empty(N)), forward, KH.config(block_n=256, split_k=2))
    elif case == "w8a8":  # e4m3 codes, 128 of K a block, scales per row of A and column of B
        codes_a, codes_w = empty(M, K, dtype=torch.float8_e4m3fn), empty(N, K, dtype=torch.float8_e4m3fn)
        f = KM.Fusion(b_scale=empty(N, dtype=torch.float32))
        KH.matmul(out, codes_a, codes_w.t(), M, N, K, f, forward, cfg, a_scale=empty(M, dtype=torch.float32))
    elif case == "gated":  # B's hidden and gate halves: one (2N, K) descriptor, passed twice
        KH.matmul(out, a, empty(2 * N, K).t(), M, N, K, KM.Fusion(empty(2 * N)), forward,
                  KH.config(coop=False, block_m=64, block_n=256), gated=True)
    else:  # a 3x3 convolution's implicit GEMM: the source as a 4-D descriptor of pixel boxes
        nb, hw, c, n = 2, 32, 200, 320
        cl = torch.channels_last
        src = empty(nb, c, hw, hw).contiguous(memory_format=cl)
        weight = empty(n, c, 3, 3).contiguous(memory_format=cl)
        y = empty(nb, n, hw, hw).contiguous(memory_format=cl)
        conv = KH.Conv(nb, hw, hw, c, (src.stride(0), src.stride(2), src.stride(3)), hw, hw, 3, 3, -1, 1, -1, 1,
                       KH.box_rows(64, hw, hw))
        KH.matmul(y, src, weight, nb * hw * hw, n, 9 * c, KM.Fusion(), (True, True, 0, weight.stride(0), n), cfg,
                  conv=conv)
    assert len(calls) == 1
    return calls[0]


def _triton_specialisation(kernel, args, meta):
    """What Triton 3.6+ compiles a launch of ``kernel`` for on an sm_90 GPU: its binder's specialisation
    of every argument (type string and attribute, e.g. ``('*bf16', 'D')``, ``('tensordesc<bf16[64, 64],
    NVMMASharedLayout(...)>', None)``; constexprs by value), and what ``_pack_args`` makes of it: the
    signature, constexprs and attributes that, with the kernel's own key and the options, make up the
    compiled kernel's cache key (``ASTSource.hash``, which needs a GPU build of the kernel's callees)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(meta), bound, specialization, options)
    return specialization, signature, constexprs, attrs, str(options)


@needs_gluon
@pytest.mark.parametrize("case", GLUON_CASES)
def test_a_gluon_launch_is_recorded_and_its_stand_ins_specialise_alike(case, monkeypatch):
    """The Gluon GEMM's launch (host-built Gluon TMA descriptors, which Triton specialises on dtype,
    block shape and shared layout) is recorded; the stand-ins rebuilt from its JSON line describe as
    the same line, and Triton specialises every one of them as it does the run's argument: the
    compile-ahead worker's ``warmup`` compiles the variant (the cache key) the run will look up."""
    kernel, args, meta = _gluon_launch(case, monkeypatch)
    line = L.describe_variant(kernel, args, meta)
    assert line is not None
    spec = json.loads(line)
    assert spec["kernel"] == "flame.kernels.matmul_hopper:_gemm_hopper_kernel"
    described = [a for a in spec["args"] if a[0] == "gluon_descriptor"]
    assert len(described) == sum(a is not None and not isinstance(a, (int, float, torch.Tensor)) for a in args) >= 3
    stand_ins = [precompile._stand_in(a) for a in spec["args"]]
    assert L.describe_variant(kernel, stand_ins, meta) == line
    real, again = _triton_specialisation(kernel, args, meta), _triton_specialisation(kernel, stand_ins, meta)
    types = [t for t, _ in real[0] if isinstance(t, str) and t.startswith("tensordesc<")]
    assert len(types) == len(described) and all("NVMMASharedLayout(" in t for t in types)
    for i, (want, got) in enumerate(zip(real[0], again[0])):
        assert want == got, (kernel.arg_names[i], want, got)
    assert real[1:] == again[1:]


@needs_gluon
def test_a_gluon_stand_in_with_another_layout_specialises_otherwise(monkeypatch):
    """The comparison above sees the layout: a stand-in whose swizzle differs from the recorded one's
    specialises to another kernel (so a description without the layout could not pass it)."""
    kernel, args, meta = _gluon_launch("forward", monkeypatch)
    spec = json.loads(L.describe_variant(kernel, args, meta))
    spec["args"][0][4]["swizzle_byte_width"] //= 2
    stand_ins = [precompile._stand_in(a) for a in spec["args"]]
    assert _triton_specialisation(kernel, stand_ins, meta)[0][0] != _triton_specialisation(kernel, args, meta)[0][0]


@needs_gluon
def test_a_gluon_descriptor_line_names_its_layouts_fields():
    """The JSON form of a Gluon descriptor argument: dtype, block shape, the layout's class and the
    fields its repr shows (which Triton's type string carries); a layout that would not be rebuilt
    from that form (not one of Gluon's) is not recorded."""
    import dataclasses

    base = torch.empty(256, 128, dtype=torch.bfloat16, device=DEVICE)
    desc = KH.TensorDescriptor(base, [256, 128], [128, 1], [64, 64], KH._shared_layout(torch.bfloat16, (64, 64)))
    kind, dtype, block, name, fields = json.loads(json.dumps(L._describe_arg(desc)))
    assert (kind, dtype, block, name) == ("gluon_descriptor", "bfloat16", [64, 64], "NVMMASharedLayout")
    assert fields["swizzle_byte_width"] == 128 and fields["element_bitwidth"] == 16 and fields["rank"] == 2
    assert not fields["transposed"] and not fields["fp4_padded"]
    assert repr(L.gluon_layout(name, fields)) == repr(desc.layout)

    @dataclasses.dataclass(frozen=True)
    class OtherSharedLayout:
        width: int = 128

    stray = object.__new__(KH.TensorDescriptor)
    stray.__dict__ = {**vars(desc), "layout": OtherSharedLayout()}
    assert L.describe_variant(KH._gemm_hopper_kernel, (stray,), {}) is None
    with pytest.raises(ValueError, match="not a Gluon shared layout"):
        L.gluon_layout("OtherSharedLayout", {"width": 128})


class _Sm90Driver:
    """Triton's active driver as an sm_90 GPU's would answer, for the host side of a launch on any machine."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


@needs_gluon
@pytest.mark.parametrize("case", GLUON_CASES)
def test_compiling_a_gluon_line_ahead_asks_for_the_runs_kernel(case, monkeypatch):
    """``compile_variant`` of a recorded Gluon line (``GluonJITFunction.warmup`` of its stand-ins,
    grid (1,), the recorded constexprs and options) reaches Triton's compile with the key, signature,
    constexprs, attributes and options of the run's own first launch ``kernel[grid](*args, **meta)``
    (``launch._through_triton``): Triton's pre-compile hook sees both and stops each short of compiling
    (no GPU), an sm_90 target standing in for the driver's."""
    from triton import knobs
    from triton.runtime.driver import driver

    kernel, args, meta = _gluon_launch(case, monkeypatch)
    line = L.describe_variant(kernel, args, meta)
    asked = []
    monkeypatch.setattr(driver, "_active", _Sm90Driver())
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **hook: asked.append(hook["compile"]) or True)
    assert precompile.compile_variant(json.loads(line)) is None  # the hook stopped it
    assert kernel[(132,)](*args, **meta) is None
    ahead, run = asked
    assert ahead["is_warmup"] and not run["is_warmup"]
    assert any(t.startswith("tensordesc<") for t in run["signature"].values())
    for name in ("key", "signature", "constants", "configs", "num_warps", "specialization_data"):
        assert ahead[name] == run[name], name


_GLUON_GEMM = """
import torch, flame
import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
M, K, N = 4608, 3072, 3072
x, w = (torch.randn(M, K, device=flame.device).bfloat16(), torch.randn(N, K, device=flame.device).bfloat16())
assert KH.plan(M, N, K, x, w.t(), KM.Fusion()) is not None, "not routed to the Gluon GEMM"
KM.linear_(torch.empty(M, N, device=flame.device, dtype=torch.bfloat16), x, w)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@needs_gluon
def test_a_gluon_gemm_compiled_ahead_is_not_compiled_again(tmp_path):
    """End to end on an H200, in fresh processes as a trainer would run them: a Gluon GEMM's launch is
    recorded, ``compile_ahead`` of that list fills an empty Triton cache without a failure, and the
    same launch then compiles nothing (no cubin is added to the cache)."""
    import os
    if not KH.available():
        pytest.skip("needs an sm_90 GPU")
    path, cache = tmp_path / "kernels.jsonl", tmp_path / "cache"
    record = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "recording"), L.RECORD_ENV: str(path)}
    subprocess.run([sys.executable, "-c", _GLUON_GEMM], env=record, check=True)
    assert any('"gluon_descriptor"' in line for line in precompile.read_lines(path))
    env = {k: v for k, v in record.items() if k != L.RECORD_ENV} | {"TRITON_CACHE_DIR": str(cache)}
    ahead = ("import sys; from flame.kernels import precompile; "
             "s = precompile.compile_ahead(sys.argv[1], jobs=2, progress=False); assert s['failed'] == 0, s")
    subprocess.run([sys.executable, "-c", ahead, str(path)], env=env, check=True)
    compiled = {str(p.relative_to(cache)) for p in cache.rglob("*.cubin")}
    assert compiled
    subprocess.run([sys.executable, "-c", _GLUON_GEMM], env=env, check=True)
    assert {str(p.relative_to(cache)) for p in cache.rglob("*.cubin")} == compiled
