"""The direct-launch cache key (flame/kernels/launch.py): two launches share a compiled kernel
only when Triton would specialise them alike. The direct path itself runs on CUDA only; the key
is plain Python and is checked here on any backend."""
import types

import pytest
import torch
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

import flame
from flame.kernels import launch as L


def _fake_kernel(names, no_spec=()):
    return types.SimpleNamespace(arg_names=list(names), do_not_specialize=list(no_spec))


KERNEL = _fake_kernel(["x", "y", "n", "seed", "eps", "flag", "BLOCK"], no_spec=["seed"])


def _key(*args, **meta):
    return L._key(id(KERNEL), KERNEL, args, meta or {"BLOCK": 64})


def test_keys_follow_what_triton_specialises_on():
    x, y = torch.zeros(64), torch.zeros(64)
    base = _key(x, y, 64, 7, 1e-5, True)
    assert _key(torch.ones(64), torch.ones(64), 64, 7, 1e-5, True) == base  # other tensors, same kind
    assert _key(x, y, 64, 123456, 1e-6, True) == base  # a do-not-specialise int and a float: not keyed
    for other in (_key(x, y, 65, 7, 1e-5, True),  # a specialised int's value
                  _key(x, y, 1, 7, 1e-5, True),
                  _key(x, y, 64, 2 ** 40, 1e-5, True),  # the no-spec int no longer fits in 32 bits
                  _key(x, y, 64, 7, 1, True),  # an int where a float was
                  _key(x, y, 64, 7, 1e-5, False),  # a bool's value
                  _key(x.half(), y, 64, 7, 1e-5, True),  # a pointer's dtype
                  _key(x[1:], y[1:], 64, 7, 1e-5, True),  # pointers 4 bytes off 16-byte alignment
                  _key(x, y, 64, 7, 1e-5, True, BLOCK=128)):  # a constexpr
        assert other != base
    assert _key(x[4:], y[4:], 64, 7, 1e-5, True) == base  # 16 bytes in: still aligned


def test_layouts_are_kept_per_type_signature():
    x = torch.zeros(8)
    L._layouts.pop(id(KERNEL), None)
    _key(x, x, 8, 1, 0.5, True)
    _key(x, x, 8, 1, 2, True)
    assert len(L._layouts[id(KERNEL)]) == 2


def test_host_tma_descriptors_are_keyed_by_dtype_and_block_shape():
    # Triton specialises a host-built descriptor on its dtype and block shape; its base, shape
    # and strides are runtime values (an unhashable dataclass must not reach the key as it is)
    def desc(t, shape, block):
        return TensorDescriptor(t, list(shape), [shape[1], 1], list(block))

    kernel = _fake_kernel(["d", "n", "BLOCK"])
    a, b = torch.zeros(64, 64), torch.zeros(128, 32)

    def key(d, n=8):
        return L._key(id(kernel), kernel, (d, n), {"BLOCK": 64})

    base = key(desc(a, (64, 64), (16, 32)))
    assert hash(base) is not None
    assert key(desc(b, (128, 32), (16, 32))) == base  # another buffer, shape and strides
    for other in (key(desc(a.half(), (64, 64), (16, 32))),  # dtype
                  key(desc(a, (64, 64), (32, 32))),  # block shape
                  key(desc(a, (64, 64), (16, 32)), n=9)):  # the other arguments still count
        assert other != base



def test_without_host_tma_descriptors_the_tma_kernels_stay_off(monkeypatch):
    # Triton before 3.3 has no triton.tools.tensor_descriptor: launch.py still loads (a copy of it,
    # loaded with that import failing) and matmul's TMA check says no on any GPU
    import builtins
    import importlib.util

    import flame.kernels.matmul as KM
    real_import = builtins.__import__

    def old_triton_import(name, *args, **kwargs):
        if name == "triton.tools.tensor_descriptor":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", old_triton_import)
    spec = importlib.util.spec_from_file_location("flame.kernels._launch_on_old_triton", L.__file__)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert old.TensorDescriptor is None
    kernel = _fake_kernel(["x", "n", "BLOCK"])
    assert old._key(id(kernel), kernel, (torch.zeros(4), 4), {"BLOCK": 4}) is not None
    monkeypatch.setattr(KM, "TensorDescriptor", None)
    monkeypatch.setattr(KM, "_tma_ready", None)
    monkeypatch.setattr(KM.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert KM.tma_available() is False


class _SharedMemoryKernel:
    """A stand-in for a JIT kernel whose configs need more shared memory than a 99 KB card has
    beyond ``fits`` pipeline stages (Triton raises OutOfResources when it loads such a kernel)."""

    __name__ = "_fake_gemm"
    arg_names = ["x", "BLOCK"]

    def __init__(self, fits, resource="shared memory"):
        self.fits, self.resource, self.tried = fits, resource, []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.tried.append(meta.get("num_stages"))
            if meta.get("num_stages", L.DEFAULT_STAGES) > self.fits:
                raise OutOfResources(50_000 * meta.get("num_stages", L.DEFAULT_STAGES), 101_376, self.resource)
            return "compiled"
        return run


def test_a_config_short_of_shared_memory_runs_with_fewer_stages(monkeypatch):
    monkeypatch.setattr(L, "_fit_warned", False)
    kernel = _SharedMemoryKernel(fits=2)
    with pytest.warns(RuntimeWarning, match=r"more shared memory per block than this GPU has \(_fake_gemm: 200000 "
                                            r"> 101376 bytes\).*fewer pipeline stages"):
        assert L._through_triton(kernel, (1,), (0,), {"BLOCK": 64, "num_stages": 4}) == "compiled"
    assert kernel.tried == [4, 3, 2]
    kernel.tried.clear()
    L._through_triton(kernel, (1,), (0,), {"BLOCK": 64, "num_stages": 4})  # remembered: no failing tries
    assert kernel.tried == [2]
    kernel.tried.clear()
    L._through_triton(kernel, (1,), (0,), {"BLOCK": 64})  # Triton's default stage count is tried first
    assert kernel.tried == [None, 2]
    with pytest.raises(OutOfResources):  # one stage that does not fit: the tile itself is too large
        L._through_triton(_SharedMemoryKernel(fits=0), (1,), (0,), {"BLOCK": 64, "num_stages": 2})
    with pytest.raises(OutOfResources):  # registers are not shared memory: raised as it was
        L._through_triton(_SharedMemoryKernel(fits=1, resource="registers"), (1,), (0,), {"num_stages": 3})


@pytest.mark.skipif(not flame.is_interpreter(), reason="the interpreter's helper calls (CPU backend)")
def test_interpreter_helper_calls_skip_repatching_the_language(monkeypatch):
    """flame.kernels.interpreter: inside a launch, a helper whose language modules the launch has
    patched is not patched again (one patch per launch, not one per helper call); a helper that
    sees another module (tl.randn's triton.language.core) is patched once; results are right."""
    import triton.runtime.interpreter as interp

    from flame.kernels import interpreter
    assert getattr(interp.InterpretedFunction.__call__, "flame_installed", False)  # installed as flame loads
    assert interpreter.install()  # installing again changes nothing
    calls = []
    real = interp._patch_lang
    monkeypatch.setattr(interp, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    x = torch.randn(6, 5, 7)
    y = flame.from_torch(x).permute(2, 0, 1) * 3.0 + 1.0  # strided maps: tile_4d, offsets_4d, loads, store
    assert torch.allclose(y.to_torch(), x.permute(2, 0, 1) * 3.0 + 1.0)
    assert len(calls) == 2, calls  # two launches, each patched once for all its helper calls
    calls.clear()
    flame.manual_seed(0)
    r = flame.randn(4096).to_torch()
    assert calls.count("_random_kernel") == 1 and len(calls) <= 2, calls  # the launch, then tl.randn's module once
    assert abs(r.mean().item()) < 0.05 and abs(r.std().item() - 1) < 0.05


def test_descriptors_of_one_layout_share_a_validated_template():
    """launch.descriptor equals Triton's TensorDescriptor of the same arguments; the second of a
    layout is made from the first's fields (no second validation) with its own base, the template
    keeps no buffer alive, and an unaligned base is refused."""
    import gc
    import weakref

    L._descriptor_fields.clear()
    a = torch.zeros(64, 32, dtype=torch.float16, device=flame.device)
    b = torch.ones(64, 32, dtype=torch.float16, device=flame.device)
    first = L.descriptor(a, [64, 32], [32, 1], [16, 32])
    assert first == TensorDescriptor(a, [64, 32], [32, 1], [16, 32])
    second = L.descriptor(b, [64, 32], [32, 1], [16, 32])
    assert second == TensorDescriptor(b, [64, 32], [32, 1], [16, 32]) and second.base is b
    assert len(L._descriptor_fields) == 1
    gone = weakref.ref(a)
    del a, first
    gc.collect()
    assert gone() is None
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        L.descriptor(b.view(-1)[1:], [63], [1], [16])


class _Compiled:
    """A compiled kernel as launch.py's direct path uses it: its ``run`` records each launch."""

    function = packed_metadata = "handle"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


def _stub_triton(monkeypatch, counted_by):
    """launch.py's direct path with a stand-in for Triton: ``(runs, compiles)``, the arguments of each
    launch that reaches a compiled kernel's launcher, and each compile counted under
    ``counted_by(kernel, meta)``."""
    import collections
    runs, compiles = [], collections.Counter()

    def through_triton(kernel, grid, args, meta):
        compiles[counted_by(kernel, meta)] += 1
        return _Compiled(runs)

    monkeypatch.setattr(L, "_through_triton", through_triton)
    monkeypatch.setattr(L, "_direct", True)
    monkeypatch.setattr(L, "_stream", lambda: "stream")
    return runs, compiles


def test_the_direct_path_reuses_a_compiled_kernel_per_key(monkeypatch):
    """On CUDA, a launch whose key (``_key``, or ``sig=`` and its tensors' dtypes and alignment) was
    compiled before goes straight to the compiled kernel's launcher: grid padded to 3 dims, the
    current stream, the runtime arguments, then the constexprs in the kernel's order. Any other key
    goes through Triton first (checked here with a stand-in compiler, on any backend)."""
    runs, compiles = _stub_triton(monkeypatch, lambda kernel, meta: tuple(meta.items()))
    kernel = _fake_kernel(["x", "y", "n", "seed", "eps", "flag", "BLOCK"], no_spec=["seed"])
    x, y = torch.zeros(64), torch.zeros(64)
    before = L.launches
    L.launch(kernel, (4,), x, y, 64, 7, 1e-5, True, BLOCK=64)
    assert runs == [] and sum(compiles.values()) == 1
    L.launch(kernel, (4, 2), x + 1, y, 64, 8, 2e-5, True, BLOCK=64)  # same key: straight to run
    assert runs == [(4, 2, 1, "stream", "handle", "handle", None, None, None, *(runs[0][9:11]), 64, 8, 2e-5, True,
                     64)]
    assert runs[0][9] is not x
    for other in ((x[1:], y[1:], 63, 7, 1e-5, True), (x.double(), y, 64, 7, 1e-5, True),
                  (x, y, 64, 7, 1e-5, False)):
        L.launch(kernel, (4,), *other, BLOCK=64)
    L.launch(kernel, (4,), x, y, 64, 7, 1e-5, True, BLOCK=128)
    assert len(runs) == 1 and sum(compiles.values()) == 5
    sig_kernel = _fake_kernel(["x", "y", "n", "BLOCK"])
    L.launch(sig_kernel, (1,), x, y, 64, sig="plan 1", BLOCK=64)
    L.launch(sig_kernel, (1,), y, x, 65, sig="plan 1", BLOCK=64)  # sig= stands for every non-tensor argument
    L.launch(sig_kernel, (1,), x[1:], y, 63, sig="plan 1", BLOCK=64)  # but not for the tensors' alignment
    L.launch(sig_kernel, (1,), x, y, 64, sig="plan 2", BLOCK=64)
    assert len(runs) == 2 and runs[1][9:] == (y, x, 65, 64) and sum(compiles.values()) == 8
    assert L.launches == before + 10


def test_a_launch_the_direct_path_cannot_keep_turns_it_off_with_a_warning(monkeypatch):
    """A first launch whose constexprs the direct path cannot read from its keywords (here one left
    out: a signature default) runs through Triton, then turns the direct path off for the process,
    saying so: without the warning every later launch would pay Triton's host cost unnoticed."""
    runs, compiles = _stub_triton(monkeypatch, lambda kernel, meta: tuple(meta.items()))
    kernel = _fake_kernel(["x", "n", "BLOCK", "STAGES"])
    x = torch.zeros(64)
    with pytest.warns(RuntimeWarning, match="direct launch path is off.*STAGES"):
        L.launch(kernel, (1,), x, 64, BLOCK=64)
    assert not L._direct and sum(compiles.values()) == 1
    L.launch(kernel, (1,), x, 64, BLOCK=64)
    assert runs == [] and sum(compiles.values()) == 2  # through Triton again


def test_plans_key_their_tensors_descriptors_and_free_ints(monkeypatch):
    """A ``Plan`` (passed as ``sig``, or to ``launch_plan`` with the arguments as a tuple) pins every
    other argument: its launches are keyed by their tensors' dtypes and alignment, their
    descriptors' dtypes and the ints at ``by_value``; each
    hashable ``sig`` stands for a plan of its own, keyed by the tensors where its first launch had
    them (another sig may have a tensor where the first had None)."""
    runs, compiles = _stub_triton(monkeypatch, lambda kernel, meta: kernel.arg_names[0])
    kernel = _fake_kernel(["d", "bias", "n", "s_bias", "BLOCK"])
    plan = L.Plan(kernel, {"BLOCK": 64}, by_value=(3,))
    x, bias = torch.zeros(64, 64), torch.zeros(64)

    def desc(t):
        return L.descriptor_like(L.descriptor_template(t, (64, 64), (64, 1), (16, 16)), t)

    L.launch(kernel, (1,), desc(x), bias, 64, 1, sig=plan, BLOCK=64)
    L.launch(kernel, (1,), desc(x + 1), bias + 1, 65, 1, sig=plan, BLOCK=64)  # n is the plan's: not keyed
    assert len(runs) == 1 and runs[0][11:] == (65, 1, 64) and runs[0][9].base is not x
    for other in ((desc(x.double()), bias, 64, 1),  # a descriptor's dtype
                  (desc(x), bias.double(), 64, 1),  # a tensor's dtype
                  (desc(x), bias[1:], 64, 1),  # a tensor's alignment
                  (desc(x), bias, 64, 2)):  # an int the plan leaves free
        L.launch(kernel, (1,), *other, sig=plan, BLOCK=64)
    assert len(runs) == 1 and compiles["d"] == 5 and len(plan.compiled) == 5
    before = L.launches
    L.launch_plan(plan, (2, 3), (desc(x), bias, 66, 1))  # the same launch as a tuple, without keywords
    assert L.launches == before + 1 and runs[1][:3] == (2, 3, 1) and runs[1][11:] == (66, 1, 64)
    sig_kernel = _fake_kernel(["x", "bias", "n", "BLOCK"])
    L.launch(sig_kernel, (1,), x, None, 64, sig="no bias", BLOCK=64)
    L.launch(sig_kernel, (1,), x, bias, 64, sig="bias", BLOCK=64)
    L.launch(sig_kernel, (1,), x, bias[1:], 64, sig="bias", BLOCK=64)  # the bias's alignment counts under its sig
    L.launch(sig_kernel, (1,), x + 1, None, 64, sig="no bias", BLOCK=64)
    assert compiles["x"] == 3 and len(runs) == 3 and runs[2][10] is None


def test_plan_ints_by_width_are_keyed_by_their_32_or_64_bits(monkeypatch):
    """A plan's ``by_width`` ints (do-not-specialise scalars, an integer map's) share a compiled kernel
    while they fit in 32 bits and get another one past that, as Triton types them."""
    compiles = []
    monkeypatch.setattr(L, "_through_triton", lambda kernel, grid, args, meta: compiles.append(args) or _Compiled([]))
    monkeypatch.setattr(L, "_direct", True)
    monkeypatch.setattr(L, "_stream", lambda: "stream")
    plan = L.Plan(_fake_kernel(["x", "s0", "s1", "BLOCK"], no_spec=["s0", "s1"]), {"BLOCK": 64}, by_width=(1, 2))
    x = torch.zeros(64)
    for s0, s1 in ((3, 4), (-2 ** 31, 2 ** 31 - 1), (2 ** 31, 4), (3, -2 ** 40), (2 ** 40, 5)):
        L.launch_plan(plan, (1,), (x, s0, s1))
    assert [args[1:] for args in compiles] == [(3, 4), (2 ** 31, 4), (3, -2 ** 40)]


def test_maps_launch_their_plans_without_keywords_unless_launch_is_watched(monkeypatch):
    """An elementwise map launches the ``Plan`` its signature memoises through ``launch_via``; with
    elementwise's ``launch`` replaced, through that, with the plan as ``sig``."""
    import flame.kernels.elementwise as KE
    plans, watched = [], []
    monkeypatch.setattr(KE, "launch_via", lambda launcher, plan, grid, args, real=L.launch_via:
                        plans.append(plan) or real(launcher, plan, grid, args))
    a, out = torch.arange(6, device=flame.device), torch.empty(6, dtype=torch.int64, device=flame.device)
    KE.map_(out, [a], KE.ADD, 2 ** 40)
    assert len(plans) == 1 and plans[0].kernel is KE._map_contiguous_kernel and plans[0].by_width == (4, 5)
    monkeypatch.setattr(KE, "launch", lambda kernel, grid, *args, real=KE.launch, **meta:
                        watched.append(meta) or real(kernel, grid, *args, **meta))
    KE.map_(out, [a], KE.ADD, 1)
    assert plans == [plans[0]] * 2 and watched[0]["sig"] is plans[0]
    assert out.tolist() == [1, 2, 3, 4, 5, 6]


def test_gemm_routes_launch_with_plans_that_leave_only_the_bias_stride_free():
    """matmul's kernel routes carry a ``Plan`` of their kernel and config whose one free argument is
    the bias stride (``s_bias``): every other launch argument is the route's problem's."""
    import flame.kernels.matmul as KM
    dense, bf16 = KM.GemmProblem.dense, torch.bfloat16
    routes = {r.kernel: r for r in (KM.plan(dense(33, 70, 45, torch.float32)),
                                    KM.plan(dense(16, 640, 8192, bf16, a_transposed=True, tma=True, sms=132)),
                                    KM.plan(dense(4096, 640, 640, bf16, tma=True, sms=132, bias=True)))}
    assert set(routes) == {"pointer", "split_k", "tma"}
    for route in routes.values():
        plan = route.launch
        assert plan.meta is route.config and plan.kernel.arg_names[plan.by_value[0]] == "s_bias", route
    assert KM.plan(dense(64, 48, 40, torch.float32, rank=70)).launch is None  # a composite route: its steps' plans


def test_gemm_routes_launch_their_plans_without_keywords_unless_launch_is_watched(monkeypatch):
    """A GEMM launches its route's plan through ``launch_via``; with matmul's ``launch`` replaced (a
    test's or a tool's watcher) it goes through that instead, with the plan as ``sig`` and the config
    as keywords."""
    import flame.kernels.matmul as KM
    plans, watched = [], []
    monkeypatch.setattr(KM, "launch_via", lambda launcher, plan, grid, args, real=L.launch_via:
                        plans.append(plan) or real(launcher, plan, grid, args))
    a, b = torch.randn(8, 5, device=flame.device), torch.randn(5, 7, device=flame.device)
    out = torch.empty(8, 7, device=flame.device)
    KM.matmul_(out, a, b)
    assert len(plans) == 1 and plans[0].kernel is KM._matmul_kernel
    monkeypatch.setattr(KM, "launch", lambda kernel, grid, *args, real=KM.launch, **meta:
                        watched.append(meta) or real(kernel, grid, *args, **meta))
    KM.matmul_(out, a, b)
    assert plans == [plans[0]] * 2 and watched[0]["sig"] is plans[0]  # the watcher's launch runs the same plan
    assert watched[0]["BLOCK_M"] == plans[0].meta["BLOCK_M"]
    assert torch.allclose(out, a @ b, rtol=2e-2, atol=2e-2)  # tf32 on a GPU


def test_layer_norm_launches_leave_only_their_row_strides_free():
    """LayerNorm's forward and backward launch plans (``norms._launches``) leave only the row
    strides free, and a second call of one shape takes the same plans."""
    import flame.nn.functional as F
    from flame.kernels import norms as KN
    KN._launches.clear()
    x = flame.randn(6, 40, requires_grad=True)
    w, b = flame.randn(40, requires_grad=True), flame.randn(40, requires_grad=True)
    F.layer_norm(x, (40,), w, b).sum().backward()
    plans = dict(KN._launches)
    assert {key[0] for key in plans} >= {KN._ln_fwd_kernel, KN._ln_bwd_kernel}
    for plan in plans.values():
        assert all(plan.kernel.arg_names[i].endswith("s_m") for i in plan.by_value), plan.kernel
    F.layer_norm(x, (40,), w, b).sum().backward()
    assert KN._launches == plans


def test_group_norm_and_conv_launch_through_kept_plans(monkeypatch):
    """GroupNorm's passes (forward and backward), the TMA convolution and its split-K sum launch kept
    plans, not keyword launches: a watcher of ``launch`` sees each with its plan as ``sig``, and a
    second call of one shape takes the same plans."""
    import flame.nn.functional as F
    from flame.kernels import conv2d as KC
    from flame.kernels import matmul as KM
    from flame.kernels import norms as KN
    monkeypatch.setattr(KM, "TMA", True)  # the interpreter emulates tensor descriptors
    monkeypatch.setattr(KM, "tma_available", lambda: True)
    monkeypatch.setattr(KC, "_wave_splits", lambda programs, steps, sms: 2)
    KC._route.cache_clear()
    seen = []
    for mod in (KN, KC, KM):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, *a, real=mod.launch, **meta:
                            seen.append((kernel.fn.__name__, meta.get("sig"))) or real(kernel, grid, *a, **meta))
    x = flame.randn(2, 16, 6, 6, dtype=flame.float16, requires_grad=True)
    w, b = flame.randn(16, dtype=flame.float16, requires_grad=True), flame.randn(16, dtype=flame.float16)
    cw = flame.from_torch(torch.randn(16, 16, 3, 3, dtype=torch.float16, device=flame.runtime.device)
                         .contiguous(memory_format=torch.channels_last))

    def run():
        seen.clear()
        F.group_norm(F.conv2d(x, cw, b, padding=1), 4, w, b).sum().backward()
        return [(name, sig) for name, sig in seen if name.startswith(("_gn", "_conv_tma", "_split_k"))]

    first = run()
    assert {name for name, _ in first} >= {"_gn_partial_kernel", "_gn_combine_kernel", "_gn_apply_kernel",
                                           "_gn_bwd_combine_kernel", "_conv_tma_kernel", "_split_k_sum_kernel"}
    assert all(sig is not None for _, sig in first), first
    assert run() == first


def test_no_kernel_leaves_a_parameter_to_its_default():
    """The direct path reads a kernel's constexprs from its launch's keywords (``_first_launch``): one
    left to a default in the signature turns the direct path off for the whole process, so every flame
    kernel (Triton's and Gluon's) takes each parameter from its launch."""
    import importlib
    import inspect
    import pkgutil

    import flame.kernels

    defaulted = []
    for info in pkgutil.iter_modules(flame.kernels.__path__):
        module = importlib.import_module(f"flame.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if callable(fn) and hasattr(obj, "arg_names") and obj.__module__ == module.__name__:
                defaulted += [f"{info.name}.{name}({p.name})" for p in inspect.signature(fn).parameters.values()
                              if p.default is not inspect.Parameter.empty]
    assert defaulted == []


@pytest.mark.gpu
@pytest.mark.skipif(flame.is_interpreter(), reason="the direct path runs on CUDA only")
def test_direct_launches_equal_tritons_own(monkeypatch):
    """On a GPU, launches whose key was compiled before skip Triton's launch path (``_key`` for
    plain launches, ``sig=`` for plans: a strided map, a bf16 GEMM, layer norm, attention, a TMA GEMM
    whose descriptors the direct path encodes itself): their results equal those of the same
    launches through Triton (``FLAME_TRITON_LAUNCH=1``)."""
    import sys

    import flame.kernels.matmul
    import flame.nn.functional as F
    through, expanders = [], []
    real, real_expander = L._through_triton, L._descriptor_expander
    monkeypatch.setattr(L, "_through_triton", lambda *a: through.append(a[0]) or real(*a))
    monkeypatch.setattr(L, "_descriptor_expander", lambda *a: expanders.append(a) or real_expander(*a))
    x = flame.randn(300, 40, dtype=flame.bfloat16)
    w = flame.randn(72, 40, dtype=flame.bfloat16)
    y = flame.randn(40, dtype=flame.bfloat16)
    q = flame.randn(2, 3, 77, 64, dtype=flame.bfloat16)
    a, b = flame.randn(520, 256, dtype=flame.bfloat16), flame.randn(384, 256, dtype=flame.bfloat16)  # a TMA GEMM
    c = flame.randn(384, dtype=flame.bfloat16)

    def step():
        h = F.layer_norm(x.t().contiguous().t() * y + 1.0, (40,))
        return [t.to_torch().clone() for t in (h, F.linear(h, w), F.scaled_dot_product_attention(q, q, q),
                                                F.linear(a, b, c))]

    step()  # compiles every key through Triton
    through.clear()
    direct = step()
    assert not through, f"launched through Triton again: {through}"
    driver = sys.modules.get("triton.backends.nvidia.driver")
    if flame.kernels.matmul.tma_available() and getattr(driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO":
        assert expanders, "a kernel with host-built descriptors kept Triton's launcher"
    monkeypatch.setattr(L, "_direct", False)
    for got, want in zip(direct, step()):
        assert torch.equal(got, want)


def test_a_pinned_plan_launches_its_first_compiled_kernel_without_a_key(monkeypatch):
    """A ``pinned`` plan (its launcher guarantees one key for all its launches: a GEMM route on a TMA
    device) compiles once and builds no argument key; an unpinned one keys each launch."""
    runs, compiles = _stub_triton(monkeypatch, lambda kernel, meta: kernel.arg_names[0])
    kernel = _fake_kernel(["x", "n", "BLOCK"])
    pinned, keyed = L.Plan(kernel, {"BLOCK": 64}, pinned=True), L.Plan(kernel, {"BLOCK": 64})
    x = torch.zeros(64)
    for plan in (pinned, keyed):
        L.launch_plan(plan, (1,), (x, 64))
        L.launch_plan(plan, (1,), (x.double(), 64))  # another key: the pinned plan's caller rules it out
    assert pinned.key is None and list(pinned.compiled) == [None] and len(keyed.compiled) == 2
    assert compiles["x"] == 3 and len(runs) == 1
