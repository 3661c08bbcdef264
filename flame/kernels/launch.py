"""One entry point for every kernel launch, with a thin host path on CUDA.

``launch(kernel, grid, *args, **meta)`` is ``kernel[grid](*args, **meta)``. Triton's own launch
path rebinds and re-specialises every argument and rebuilds its cache key on each call (tens of
microseconds per launch on the H100/H200 hosts, more than many kernels take to run). Here the
compiled kernel is cached under a key that determines what Triton specialises on — the argument
types, each pointer's dtype and 16-byte alignment, each integer's value (or, for integers the
kernel marks ``do_not_specialize``, whether it fits in 32 bits), the constexprs and launch options
— built with C-level tuple operations, and later calls go straight to the compiled kernel's
launcher. Keying integers by value keeps the key cheap; a kernel fed ever-new values (not the
case in training loops, whose shapes repeat) restarts its cache after ``_MAX_KEYS`` entries.
A launcher that memoises its launch plans passes ``sig=`` (a ``Plan`` it keeps with each, or a
hashable standing for one): such a launch is keyed by its tensors' dtypes and alignment alone.
``launch_via(launch, plan, grid, args)`` launches a kept ``Plan`` without a keyword call (the
GEMM routes, LayerNorm, elementwise maps): on a loaded CI-class host the call of ``launch`` with ~15 keyword
constexprs cost about 3 us, as much as the rest of the direct path.

The first call of every key goes through Triton (compiling if needed); if the direct call is not
available (the interpreter, or a Triton whose CompiledKernel lacks the launcher fields this uses),
every call does. Set ``FLAME_TRITON_LAUNCH=1`` to force Triton's path, e.g. under a profiler
that relies on Triton's launch hooks, which the direct path does not call.

Every launch through Triton's path reports to ``flame.tune`` how it went (``tune.launched``, or
``tune.launch_failed`` when Triton could not build the kernel for its config): how configs from
tuning-table entries of another Triton release are proven or dropped. A failure that dropped
some raises ``tune.EntryDropped`` (from Triton's error; kernel entry points then run again with
the heuristic); a config short of shared memory on this GPU runs with fewer pipeline stages
(``_through_triton``); any other failure is raised as it was.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import sys
import warnings

import torch
import triton.language as tl
from triton.runtime import jit as _jit
from triton.runtime.errors import OutOfResources

from .. import runtime, tune

try:  # host-built TMA descriptors (Triton 3.3 on); without them flame's TMA kernels stay off (matmul.tma_available)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

if not runtime.INTERPRETER:
    from triton.runtime.driver import driver as _driver
else:
    from . import interpreter

    interpreter.install()  # helper calls skip re-patching the language (a quarter of the CPU time)

_direct = not runtime.INTERPRETER and os.environ.get("FLAME_TRITON_LAUNCH", "") != "1"
_caches: dict = {}  # id(kernel) -> {key: _entry(): (run, function, lead, constexpr values, expand)}
_layouts: dict = {}  # id(kernel) -> {argument types: _Layout}
_sig_plans: dict = {}  # id(kernel) -> {sig: Plan}: launch(sig=)'s plans
_MAX_KEYS = 4096  # compiled-kernel entries per kernel before its cache starts afresh
_stream = None  # () -> the current CUDA stream of flame's device (the direct path's)
launches = 0  # every launch() so far: tests count kernel launches with it
DEFAULT_STAGES = 3  # Triton's num_stages when a launch names none
_fitted: dict = {}  # (id(kernel), meta items) -> the meta that fits this GPU's shared memory
_fit_warned = False


class _Layout:
    """Where a kernel's arguments of one type signature sit, and how each enters the key:
    tensors by (dtype, 16-byte alignment); host-built TMA descriptors by (dtype, block shape),
    their shape and strides being runtime values; floats by type alone (the types are part of the key);
    ints that Triton specialises, bools and anything else by value (finer than Triton's classes,
    and as cheap as a tuple); ints marked ``do_not_specialize`` only by whether they fit in 32 bits.
    ``key(args)`` builds that tuple in one generated expression (``_key_function``)."""

    def __init__(self, kernel, args):
        names = kernel.arg_names
        dns = set(getattr(kernel, "do_not_specialize", None)  # the interpreter's kernels keep it in kwargs
                  or getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        self.tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.descriptors = tuple(i for i, a in enumerate(args)
                                 if TensorDescriptor is not None and isinstance(a, TensorDescriptor))
        self.nospec = tuple(i for i, a in enumerate(args)
                            if type(a) is int and (names[i] in dns or i in dns))
        skip = (set(self.tensors) | set(self.descriptors) | set(self.nospec)
                | {i for i, a in enumerate(args) if type(a) is float})
        by_value = [i for i in range(len(args)) if i not in skip]
        self.key = _key_function([f"a[{i}]" for i in by_value]
                                 + [_WIDTH_KEY.format(i) for i in self.nospec]
                                 + [f"a[{i}].base.dtype, (*a[{i}].block_shape,)" for i in self.descriptors]
                                 + [_TENSOR_KEY.format(i) for i in self.tensors])


_TENSOR_KEY = "a[{0}].dtype, a[{0}].data_ptr() & 15 == 0"  # a pointer argument: what Triton specialises on
_WIDTH_KEY = "-2147483648 <= a[{0}] < 2147483648"  # a do_not_specialize int: its 32 or 64 bits


def _key_function(parts):
    """``lambda a: (part, part, ...)``: the key of an argument tuple ``a`` from the Python
    expressions ``parts``, compiled once per layout so that a launch builds its key in one call
    instead of a loop over its (up to ~40) arguments."""
    return eval("lambda a: (" + "".join(p + ", " for p in parts) + ")")  # the parts are built from ints alone


def _key(kid, kernel, args, meta):
    """The cache key of a launch: the ``_Layout`` of its argument types (hashed by identity: the
    types are hashed once, to find it) and what Triton specialises on (a superset: two launches
    with one key compile to the same kernel)."""
    types = tuple(map(type, args))
    layouts = _layouts.get(kid)
    if layouts is None:
        layouts = _layouts[kid] = {}
    lay = layouts.get(types)
    if lay is None:
        lay = layouts[types] = _Layout(kernel, args)
    return lay, lay.key(args), tuple(meta), tuple(meta.values())  # names and values: two flat tuples


def _through_triton(kernel, grid, args, meta):
    """``kernel[grid](*args, **meta)``, reported to ``flame.tune``; returns the compiled kernel.

    A config that needs more shared memory per block than this GPU has (tiles and pipeline depths
    chosen for Hopper's 227 KB on a card with 99 KB, say) runs with fewer pipeline stages, the
    first count that fits, remembered per kernel and config; one warning per process says so."""
    if not _settled:
        settle_cache_keys()
    fit_key = (id(kernel), tuple(meta.items()))
    run_meta = _fitted.get(fit_key, meta)
    while True:
        try:
            compiled = kernel[grid](*args, **run_meta)
            break
        except tune.LAUNCH_ERRORS as e:
            dropped = tune.launch_failed(e)
            if dropped is not None:
                raise dropped from e
            stages = run_meta.get("num_stages", DEFAULT_STAGES)
            if not (isinstance(e, OutOfResources) and e.name == "shared memory" and stages > 1):
                raise
            run_meta = _fitted[fit_key] = {**run_meta, "num_stages": stages - 1}
            _warn_fitted(kernel, e)
    tune.launched()
    return compiled


def _kernel_name(kernel):
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "a kernel")


def _warn_fitted(kernel, error):
    global _fit_warned
    if not _fit_warned:
        _fit_warned = True
        warnings.warn(f"some launch configs need more shared memory per block than this GPU has "
                      f"({_kernel_name(kernel)}: {error.required} > {error.limit} bytes); they run with fewer "
                      "pipeline stages. Configs tuned for this card are faster: scripts/autotune.py", RuntimeWarning,
                      stacklevel=4)


# ---- Triton's on-disk cache across processes ----------------------------------------------------

_settled = False


def settle_cache_keys(functions=None) -> None:
    """Give every jit function the cache key it would have in any other process.

    In Triton before 3.7 (triton-lang/triton#10494) a function's key folds in the globals of the
    jit functions it calls *as far as those have been hashed yet*, so the same kernel gets another
    key, and misses Triton's on-disk cache, in a process that happened to compile other kernels
    first: kernels compiled ahead (``precompile``) were compiled again by the run. Hashing
    ``functions`` (default: every jit function of ``flame.kernels``, all its modules imported)
    again until no key changes leaves each key a function of the sources alone. Called before the
    first compile of a process; does nothing on the interpreter."""
    global _settled
    _settled = True
    if runtime.INTERPRETER and functions is None:
        return
    if functions is None:
        package = sys.modules[__package__]
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{info.name}")
        seen, functions = set(), []
        for name in sorted(m for m in sys.modules if m.startswith(__package__ + ".")):
            for v in vars(sys.modules[name]).values():
                if isinstance(v, _jit.JITFunction) and id(v) not in seen:
                    seen.add(id(v))
                    functions.append(v)
    functions = [f for f in functions if hasattr(f, "hash")]  # a Triton without the attribute: nothing to do
    keys = None
    for _ in range(16):  # one round per level of calls; flame's kernels nest a few deep
        for f in functions:
            f.hash = None
        new = [f.cache_key for f in functions]
        if new == keys:
            return
        keys = new


# ---- TMA descriptors built on the host ---------------------------------------------------------

_descriptor_fields: dict = {}  # (dtype, shape, strides, block shape) -> a validated descriptor's fields, base None
_new = object.__new__


def descriptor(base, shape, strides, block_shape):
    """A TMA tensor descriptor of ``base`` (Triton's host-side ``TensorDescriptor``). Triton checks
    a descriptor's arguments as it builds it, ~10 us of host time each (about a sixth of an eager
    SDXL step's host time, 7,400 descriptors, in ``profile_host.py --sdxl``); here only the first
    of each (dtype, shape, strides, block shape) is built that way and later ones take its fields
    with their own ``base``, whose 16-byte alignment, the one check that depends on it, is made here."""
    if base.data_ptr() % 16:
        raise ValueError(f"TMA descriptor: the base at {base.data_ptr():#x} is not 16-byte aligned")
    return descriptor_like(descriptor_template(base, shape, strides, block_shape), base)


def descriptor_template(base, shape, strides, block_shape):
    """The fields of ``descriptor(base, shape, strides, block_shape)`` (its base None), validated by
    Triton once per (dtype, shape, strides, block shape): what ``descriptor_like`` makes descriptors
    of other bases of that dtype from. A launcher that memoises them per plan (matmul's TMA route)
    builds each descriptor without a lookup."""
    key = (base.dtype, tuple(shape), tuple(strides), tuple(block_shape))
    fields = _descriptor_fields.get(key)
    if fields is None:
        fields = dict(vars(TensorDescriptor(base, list(shape), list(strides), list(block_shape))))
        fields["base"] = None  # the cache must not keep a buffer alive
        if len(_descriptor_fields) > 4096:
            _descriptor_fields.clear()
        _descriptor_fields[key] = fields
    return fields


def descriptor_like(template, base):
    """A descriptor of ``base`` with the fields of ``template`` (``descriptor_template`` of a buffer of
    ``base``'s dtype), unchecked: the caller knows ``base`` starts 16-byte aligned."""
    made = _new(TensorDescriptor)
    fields = template.copy()  # a dict copy and one store: cheaper than filling the new object's own dict
    fields["base"] = base
    made.__dict__ = fields
    return made


# ---- recording the variants a run compiles (kernels/precompile.py compiles them ahead) ----------

RECORD_ENV = "FLAME_RECORD_KERNELS"
_noted: set = set()  # variant lines this process has recorded, or was told are known
_recorded: list = []  # lines this process compiled and wrote to the record file since take_recorded()


def _int_class(v: int) -> int:
    """An int that Triton specialises as it does ``v`` (1, a multiple of 16, or neither; 32 or 64
    bits): variants that differ only in such values compile to one kernel, so they share a line."""
    if v == 1 or not -2**63 <= v < 2**63:
        return v
    return (0 if -2**31 <= v < 2**31 else 2**32) + (16 if v % 16 == 0 else 3)


GLUON_DESCRIPTOR_MODULE = "triton.experimental.gluon.nvidia.hopper"  # Gluon's host-built TMA descriptors


def _describe_arg(a):
    if isinstance(a, bool) or a is None:
        return ["value", a]
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0]
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        return ["descriptor", str(a.base.dtype).removeprefix("torch."), list(a.block_shape)]
    if isinstance(a, int):
        return ["value", _int_class(a)]
    if isinstance(a, float):
        return ["float"]
    gluon = sys.modules.get(GLUON_DESCRIPTOR_MODULE)  # imported wherever one of its descriptors exists
    if gluon is not None and isinstance(a, gluon.TensorDescriptor):
        return ["gluon_descriptor", str(a.base.dtype).removeprefix("torch."), list(a.block_shape),
                *_describe_layout(a.layout)]
    raise TypeError(type(a).__name__)


def _describe_layout(layout):
    """``[class name, {field: value}]`` of a Gluon descriptor's shared layout: the fields its repr
    shows. Triton specialises a Gluon descriptor on its dtype, block shape and ``repr(layout)``
    (the type string ``tensordesc<bf16[64, 64],NVMMASharedLayout(swizzle_byte_width=128, ...)>``,
    from which the compiler rebuilds the layout); a layout that ``gluon_layout`` would not rebuild
    to the same repr from the JSON form (a field JSON cannot hold, or one that is not an argument)
    raises TypeError: such a variant is not recorded."""
    if not dataclasses.is_dataclass(layout) or not type(layout).__name__.endswith("SharedLayout"):
        raise TypeError(type(layout).__name__)
    name = type(layout).__name__
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.repr}
    try:
        again = gluon_layout(name, json.loads(json.dumps(fields)))
    except (TypeError, ValueError, AssertionError) as e:
        raise TypeError(f"{name}: {e}") from e
    if repr(again) != repr(layout):
        raise TypeError(f"{name} is not rebuilt from its fields")
    return [name, fields]


def gluon_layout(name, fields):
    """The Gluon shared layout ``gl.<name>(**fields)`` (``_describe_layout``'s form)."""
    from triton.experimental.gluon import language as gl
    cls = getattr(gl, name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("SharedLayout")):
        raise ValueError(f"{name} is not a Gluon shared layout")
    return cls(**fields)


def _describe_meta(v):
    if isinstance(v, tl.dtype):
        return {"tl": v.name}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(type(v).__name__)


def describe_variant(kernel, args, meta):
    """The JSON line of one launch's variant, or None for arguments it cannot describe."""
    fn = getattr(kernel, "fn", None)
    if fn is None:
        return None
    try:
        spec = {"kernel": f"{fn.__module__}:{fn.__qualname__}", "args": [_describe_arg(a) for a in args],
                "meta": {k: _describe_meta(v) for k, v in meta.items()}}
    except TypeError:
        return None
    return json.dumps(spec, sort_keys=True)


def note_known(lines) -> None:
    """Variant lines already recorded (a list the run compiles ahead): not written again."""
    _noted.update(lines)


def note_variant(kernel, args, meta):
    """Record a launch's variant when ``FLAME_RECORD_KERNELS`` names a file (once per process)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = describe_variant(kernel, args, meta)
    if line is None or line in _noted:
        return
    _noted.add(line)
    with open(path, "a") as f:  # one write per line: a crash loses nothing already noted
        f.write(line + "\n")
    _recorded.append(line)


def take_recorded() -> list:
    """The variant lines recorded since the last call, in order (then forgotten)."""
    lines = _recorded[:]
    _recorded.clear()
    return lines


class Plan:
    """A launch of ``kernel`` with everything but its tensors pinned down: the trailing constexprs
    and launch options ``meta``, and what Triton specialises every other argument on (its value,
    its type, or None), except the ints at the positions ``by_value``, which enter the key by value
    (an argument the plan leaves free, such as a bias stride), and those at ``by_width``, which enter
    it by whether they fit in 32 bits (free ints the kernel marks ``do_not_specialize``, such as an
    integer map's scalars). A launcher keeps one per plan it memoises (a GEMM route, a norm's shape,
    a map's signature) and launches it with ``launch_plan(plan, grid, args)`` (or ``launch(...,
    sig=plan, **meta)``); the plan keeps the kernels compiled for it, keyed by its tensors' dtypes
    and 16-byte alignment, its host-built descriptors' dtypes (their block shapes are the plan's),
    the ``by_value`` ints and the widths of the ``by_width`` ones, so a repeated launch builds no
    argument key. The tensors sit where they sat in the plan's first launch (a None there stays
    None). ``memo`` holds what the launcher keeps with the plan (matmul: its TMA descriptors'
    templates and the descriptor objects its launches fill). A ``pinned`` plan's launcher guarantees
    that all its launches have one key (it looked at those dtypes and alignments itself, as a GEMM
    route's call signature does): the compiled kernel of its first launch serves the others, no key
    built."""

    __slots__ = ("kernel", "meta", "by_value", "by_width", "pinned", "key", "compiled", "memo")

    def __init__(self, kernel, meta, by_value=(), by_width=(), pinned=False):
        self.kernel, self.meta, self.by_value, self.by_width = kernel, meta, tuple(by_value), tuple(by_width)
        self.pinned = pinned
        self.key = None  # lambda args: the key of a launch (_key_function), made at the first launch
        self.compiled = {}  # key -> _entry(): (run, function, lead, constexpr values, expand); a pinned plan's: None ->
        self.memo = None


def launch(kernel, grid, *args, sig=None, **meta):
    """Launch ``kernel`` on ``grid`` (a tuple of up to 3 ints): ``kernel[grid](*args, **meta)``.

    ``args`` are the kernel's leading runtime arguments in order; ``meta`` holds its trailing
    constexprs and launch options (num_warps, num_stages). A caller that has already pinned down
    everything except the tensors may pass ``sig``: a ``Plan`` of ``kernel`` and ``meta``, or a
    hashable that determines the specialisation of every non-tensor argument (None ones included)
    and ``meta``, which stands for a plan of its own; the launch is then keyed by the plan's
    tensors' dtypes and alignment (see ``Plan``), without looking at the other arguments.
    """
    global launches
    if sig is not None:
        if type(sig) is not Plan:
            plans = _sig_plans.get(id(kernel))
            sig = (plans.get(sig) if plans is not None else None) or _sig_plan(kernel, sig, meta)
        launch_via(launch, sig, grid, args)
        return
    launches += 1
    if not _direct:
        _through_triton(kernel, grid, args, meta)
        return
    kid = id(kernel)
    cache = _caches.get(kid)
    if cache is None:
        cache = _caches[kid] = {}
    key = _key(kid, kernel, args, meta)
    entry = cache.get(key)
    if entry is None:
        _first_launch(kernel, grid, args, meta, cache, key)
        return
    _run(entry, grid, args)


def launch_plan(plan, grid, args):
    """``launch(plan.kernel, grid, *args, sig=plan, **plan.meta)`` with the runtime arguments as one
    tuple and no keywords (``launch_via`` from this module)."""
    launch_via(launch, plan, grid, args)


def launch_via(launcher, plan, grid, args):
    """``launch_plan(plan, grid, args)`` from a launcher module whose name ``launch`` is ``launcher``;
    when that name has been replaced (a test's or a tool's watcher), through it instead, with the
    plan as ``sig`` and its meta as keywords, so that the watcher sees every launch as it was made.
    No keyword call: one of ~15 constexprs costs about as much host time as the rest of a launch.
    On CUDA a repeated launch is the plan's key of ``args``, one lookup in its cache and the
    compiled kernel's launcher, in this one frame (the hot path of every plan's launch)."""
    global _stream, launches
    if launcher is not launch:
        launcher(plan.kernel, grid, *args, sig=plan, **plan.meta)
        return
    launches += 1
    if not _direct:
        _through_triton(plan.kernel, grid, args, plan.meta)
        return
    if plan.pinned:
        key = None
    else:
        key_of = plan.key
        if key_of is None:
            key_of = plan.key = _plan_key_function(args, plan.by_value, plan.by_width)
        key = key_of(args)
    entry = plan.compiled.get(key)
    if entry is None:
        _first_launch(plan.kernel, grid, args, plan.meta, plan.compiled, key)
        return
    run, function, lead, consts, expand = entry  # _run, inline
    if _stream is None:
        _stream = functools.partial(_driver.active.get_current_stream, _driver.active.get_current_device())
    if expand is not None:
        args = expand(args)
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(), function, *lead, *args, *consts)


def _run(entry, grid, args):
    """The direct path: the compiled kernel's launcher on the current stream."""
    global _stream
    run, function, lead, consts, expand = entry
    if _stream is None:
        _stream = functools.partial(_driver.active.get_current_stream, _driver.active.get_current_device())
    if expand is not None:
        args = expand(args)
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(), function, *lead, *args, *consts)


def _sig_plan(kernel, sig, meta):
    """The ``Plan`` that a hashable ``sig`` of ``kernel`` stands for (made at its first launch)."""
    plans = _sig_plans.get(id(kernel))
    if plans is None:
        plans = _sig_plans[id(kernel)] = {}
    plan = plans.get(sig)
    if plan is None:
        if len(plans) >= _MAX_KEYS:
            plans.clear()
        plan = plans[sig] = Plan(kernel, meta)
    return plan


def _plan_key_function(args, by_value, by_width):
    """A ``Plan``'s key of an argument tuple like ``args``: each tensor's dtype and alignment, each
    host-built descriptor's dtype (its block shape is the plan's), the ints at ``by_value``, whether
    those at ``by_width`` fit in 32 bits."""
    return _key_function([_TENSOR_KEY.format(i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                         + [f"a[{i}].base.dtype" for i, a in enumerate(args)
                            if TensorDescriptor is not None and isinstance(a, TensorDescriptor)]
                         + [f"a[{i}]" for i in by_value]
                         + [_WIDTH_KEY.format(i) for i in by_width])


def _first_launch(kernel, grid, args, meta, cache, key):
    """A key's first launch: through Triton (compiling if needed), recorded, its compiled kernel
    kept in ``cache`` for the direct path (which an unexpected Triton turns off)."""
    global _direct
    compiled = _through_triton(kernel, grid, args, meta)
    note_variant(kernel, args, _fitted.get((id(kernel), tuple(meta.items())), meta))  # as compiled
    try:
        consts = tuple(meta[name] for name in kernel.arg_names[len(args):])
        if len(cache) >= _MAX_KEYS:
            cache.clear()
        cache[key] = _entry(compiled, consts)
    except (AttributeError, KeyError, TypeError) as e:  # an unexpected Triton, or a constexpr not passed
        _direct = False
        warnings.warn(f"flame's direct launch path is off for this process ({_kernel_name(kernel)}: {type(e).__name__} "
                      f"{e}); every launch now goes through Triton's, which costs more host time", RuntimeWarning,
                      stacklevel=2)


def _entry(compiled, consts):
    """What the direct path keeps of a compiled kernel: ``(run, function, lead, consts, expand)``,
    a launch being ``run(gx, gy, gz, stream, function, *lead, *expand(args), *consts)``.

    Triton's launcher object (``compiled.run``) allocates no scratch for flame's kernels but asks
    twice per call, and for a kernel with host-built TMA descriptors wraps its C launch function in
    a Python loop over every argument that encodes each descriptor (``wrap_handle_tensordesc``):
    ~40% of an eager SDXL UNet forward's host time on an H200 host went to that launcher (cProfile,
    ``profile_host.py --sdxl --inference``). Where the launcher is the one this was written against
    (Triton 3.4-3.6's CUDA launcher: ``_BASE_ARGS_FORMAT``, no scratch), the entry calls its C
    function directly, its leading arguments fixed in ``lead``, and ``expand`` (None without
    descriptors) encodes the descriptors in one generated expression (``_descriptor_expander``);
    anything else keeps Triton's launcher."""
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    kept = run, function, (packed, None, None, None), consts, None
    raw = getattr(run, "launch", None)
    if (raw is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(sys.modules.get("triton.backends.nvidia.driver"), "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"):
        return kept
    expand = None
    code = getattr(raw, "__code__", None)
    if code is not None:  # wrap_handle_tensordesc's closure around the C function
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in raw.__closure__ or ())))
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
            return kept
        indices = sorted(cells["tensordesc_indices"])
        expand = _descriptor_expander(indices, cells["tensordesc_meta"] or [None] * len(indices))
        if expand is None:
            return kept
        raw = cells["launcher"]
    return raw, function, (run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None), \
        consts, expand


def _descriptor_expander(indices, metas):
    """``lambda a: ...``: the argument tuple ``a`` with the host-built TMA descriptor at each of
    ``indices`` replaced by what Triton's C launcher takes for it (``make_tensordesc_arg``): an
    encoded ``CUtensorMap`` (``metas``: the compiled kernel's ``tensordesc_meta``), its shape and
    strides; or, for a descriptor the compiler lowered to a pointer (meta None), the base, shape,
    strides, padding flag, shape and strides. None where a meta is of a kind this does not know."""
    from triton.backends.nvidia import driver as nvidia
    fill = _driver.active.utils.fill_tma_descriptor
    env, parts, start = {"_pointer": _pointer_descriptor}, [], 0
    for j, (i, meta) in enumerate(zip(indices, metas)):
        parts.append(f"*a[{start}:{i}]")
        if meta is None:
            parts.append(f"*_pointer(a[{i}])")
        else:
            if meta.get("fp4_padded"):
                return None
            env[f"_d{j}"] = functools.partial(_encoded_descriptor, fill, meta["swizzle"], meta["elem_size"],
                                              nvidia.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"])
            parts.append(f"*_d{j}(a[{i}])")
        start = i + 1
    parts.append(f"*a[{start}:]")
    return eval("lambda a: (" + ", ".join(parts) + ",)", env)  # the parts are built from ints alone


def _encoded_descriptor(fill, swizzle, elem_size, elem_type, block_size, d):
    shape, strides = d.shape, d.strides
    if strides[-1] != 1:
        raise ValueError(f"TMA descriptor: the last stride must be 1, got strides {list(strides)}")
    return (fill(d.base.data_ptr(), swizzle, elem_size, elem_type, block_size, shape, strides, d.padding == "nan"),
            *shape, *strides)


def _pointer_descriptor(d):
    shape, strides = d.shape, d.strides
    return (d.base, *shape, *strides, d.padding == "nan", *shape, *strides)
