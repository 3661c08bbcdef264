"""Launch configs per kernel, shape, dtype and GPU: measured tables, heuristic fallback.

``config(kernel, shape_key, dtype, default)`` is what a launcher calls to pick its block sizes,
warps and stages. It reads ``configs/autotune/<gpu-slug>.json`` (written by autotuning runs,
format in ``configs/autotune/README.md``) for the current GPU, once, on first use, and answers:

1. the table's entry for exactly ``shape_key``, else
2. the nearest entry in the same bucket: every dimension of the key rounded to the nearest power
   of two (in log space, so 4096 and 5120 share the bucket 4096, 6144 goes to 8192); among the
   entries of the query's bucket the one with the smallest sum of ``|log2(query_i / entry_i)|``,
   else
3. ``default``, the launcher's heuristic (the result with no table at all).

Every entry records the Triton version it was tuned with (the table's ``triton``, or the entry's
own ``triton`` where a merge kept it from an older run). Entries from another release
(major.minor) are used as well, after this release's: in steps 1 and 2 the bucket's entries of
this release come first, the nearest of them, then the nearest of another release. A config from
another release is proven by its first launch: when a launch fails to build
(``LAUNCH_ERRORS``: compile error, out of shared memory or registers) while such entries are
pending, ``flame.kernels.launch`` reports it (``launch_failed``), they are dropped for this process
with one ``TuningTableWarning``, and the kernel entry point (``call_entry``, through
``flame.autotune.tunable``) runs again with the heuristic. A launcher outside entry points (a map
or reduction launched by an op directly) gets the heuristic from its next call on.

An entry whose tuned time beat the heuristic's by less than ``MIN_GAIN`` (3%: run-to-run noise)
answers "the heuristic" in steps 1 and 2.

Answers are cached per (kernel, shape key, dtype, device name), so after the first call a launch
pays one dict lookup. Nothing is timed or tuned here (``flame.autotune`` does that, on first use,
with ``FLAME_AUTOTUNE=1``: see below). On the interpreter backend the current device (the CPU)
has no table: only a named ``device_name`` reads one.

``override(kernel, config)`` makes every launch of ``kernel`` use ``config`` (any key, any backend)
inside a ``with`` block: how ``scripts/autotune.py`` tries a candidate; ``record()`` lists the
queries launchers make inside a block (which kernel, key and config a launch uses). Launchers that
keep their own per-shape config caches hand ``register_cache`` a function that empties them;
``override`` and ``record`` (on entry and exit) and ``reset()`` call it.

A table that cannot be trusted is ignored with one ``TuningTableWarning`` naming the file and the
reason, never an exception: unreadable JSON, another ``format``, a table for another GPU or one
without its ``triton`` version. Bad entries (missing fields, a key of the wrong length, config
fields that are not exactly the kernel's ``KERNELS`` fields, non-positive or non-power-of-two
block sizes, a duplicate key, a ``triton`` that is not a string) are dropped, the rest of the
table is kept, and one warning per file lists them.

Environment:
- ``FLAME_TUNE_DIR``: the folder holding the tables (default: ``configs/autotune`` of this
  checkout). An empty folder gives the heuristics everywhere. Read when a table is first loaded;
  call ``reset()`` after changing it.
- ``FLAME_AUTOTUNE=1``: tune on first use (``flame/autotune.py``). A launch whose kernel, shape
  key and dtype have no exact entry in the GPU's table nor in the user's cache table
  (``cache_path()``, under ``$FLAME_CACHE_DIR``, default ``~/.cache/flame/autotune``) runs with its
  heuristic and is reported to ``asked_configs()`` blocks; the entry point that made it tunes it
  and ``remember()`` adds the winner to the cache table. Nearest-bucket entries and entries from
  another Triton release are not used in this mode (a shape they would serve is tuned instead).
  Read at import and by ``reset()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import triton
from triton.runtime.errors import OutOfResources, PTXASError

from . import runtime

FORMAT = 1

# ---- the tunable kernels: one spec each, next to its @triton.jit ---------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """One tunable kernel, declared by its kernel file next to the ``@triton.jit`` and registered
    with ``register`` when that file is imported (``flame/kernels/__init__.py`` imports them all):

    - ``name``: the tables' kernel name; ``key``: the names of its shape-key dimensions;
      ``fields``: the config fields its launcher takes (a table entry has exactly these);
    - ``heuristic(key, dtype, *extra)``: the default config (a dict of ``fields``) for a shape
      key and dtype (a torch dtype), ``extra`` what else the launcher knows; the launcher asks
      ``spec.config(key, dtype, *extra)``, which is ``config(name, key, dtype, heuristic(...))``;
    - ``space`` and ``quick``: the search space, field (or knob) -> values, full and the few tiny
      candidates of ``scripts/autotune.py --quick``; ``stages(ctx, key, spec)``: the candidates to
      try as stages, each a function from the fastest config so far to the next candidates (``ctx``
      is a ``flame.autotune.Space``: dtype, quick, shared memory); ``keep(config, key)``: candidates
      that fail it are never tried (``flame.autotune.search_stages`` applies it to every stage);
    - ``helper``: a map or reduction that other launchers run around their main kernel (zero
      fills, casts, split-K sums): the tuners tune the main kernel of such a launch, never these;
    - ``doc``: one line for people (``scripts/autotune.py --kernels`` lists them)."""

    name: str
    key: tuple
    fields: tuple
    heuristic: Callable
    stages: Callable | None = None
    space: dict | None = None
    quick: dict | None = None
    keep: Callable | None = None
    helper: bool = False
    doc: str = ""

    def config(self, key: tuple, dtype, *extra) -> dict:
        """The launch config of this kernel at shape ``key`` in ``dtype`` (see ``config``)."""
        return config(self.name, key, dtype, self.heuristic(key, dtype, *extra))


SPECS: dict = {}  # kernel name -> Spec, in registration order
# kernel name -> (names of the shape-key dimensions, the config fields its launcher takes): what the
# tables are checked against, filled by register()
KERNELS: dict = {}


def register(*specs: Spec):
    """Register each of ``specs`` (a kernel file does so at import); returns the first. A name may
    be registered again only with the same key and fields (a reloaded module)."""
    for spec in specs:
        old = SPECS.get(spec.name)
        if old is not None and (old.key, old.fields) != (spec.key, spec.fields):
            raise ValueError(f"tune.register: kernel {spec.name!r} registered twice with different keys or fields")
        SPECS[spec.name] = spec
        KERNELS[spec.name] = (tuple(spec.key), tuple(spec.fields))
    return specs[0]


DTYPES = ("float16", "bfloat16", "float32", "float64")
_ENTRY_FIELDS = ("key", "config", "ms", "default_ms")


class TuningTableWarning(UserWarning):
    """A tuning table (or some of its entries) was ignored; the heuristics stand in."""


def slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_dir() -> Path:
    env = os.environ.get("FLAME_TUNE_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs" / "autotune"


def table_path(device_name: str | None = None) -> Path:
    """Where the table for ``device_name`` (default: the current device) lives."""
    return table_dir() / f"{slug(device_name or runtime.device_name())}.json"


def bucket(shape_key) -> tuple:
    """Each dimension rounded to the nearest power of two in log space (0 stays 0)."""
    return tuple(1 << round(math.log2(d)) if d > 0 else 0 for d in shape_key)


def _distance(a, b) -> float:
    return sum(abs(math.log2(x / y)) for x, y in zip(a, b) if x > 0 and y > 0)


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


# ---- loading ----------------------------------------------------------------------------------

# A tuned entry is used only when it beat the heuristic by more than this in its own timing; below
# that the two are within run-to-run noise, and in a real model (other shapes, a warm or cold L2
# around the launch) the heuristic is at least as likely to win: such entries answer "heuristic".
MIN_GAIN = 1.03
_HEURISTIC = object()


class _Entry:
    """One usable table entry: its key, its config (or _HEURISTIC) and the Triton release it was
    tuned with. An entry from another release than the running one is ``proven`` once a launch
    with its config has compiled and run here, ``rejected`` once one failed (``launch_failed``)."""

    __slots__ = ("kernel", "dtype", "key", "config", "triton", "current", "proven", "pending", "rejected", "path")

    def __init__(self, kernel, dtype, key, config, triton_version, path):
        self.kernel, self.dtype, self.key, self.config = kernel, dtype, key, config
        self.triton, self.path = triton_version, path
        self.current = this_release(triton_version)
        self.proven, self.pending, self.rejected = self.current, False, False

    def __str__(self):
        return f"{self.kernel}/{self.dtype} key {list(self.key)} (Triton {self.triton}, {self.path})"


class _Table:
    """One GPU's entries: per (kernel, dtype name), the entries of each bucket."""

    def __init__(self, path=None):
        self.path = path
        self.buckets = {}  # (kernel, dtype) -> {bucket: [_Entry, ...]}
        self.exact = {}  # (kernel, dtype, key) -> _Entry

    def add(self, kernel, dtype, key, cfg, gain, triton_version):
        """``cfg`` for ``key``, tuned with Triton ``triton_version``; ``gain`` (heuristic time /
        tuned time) below MIN_GAIN stores "heuristic" instead."""
        global direct_entries, _foreign_seen
        e = _Entry(kernel, dtype, key, cfg if gain >= MIN_GAIN else _HEURISTIC, triton_version, self.path)
        if not e.current:  # its first launch proves it: entry points keep call_entry's bookkeeping for good
            direct_entries, _foreign_seen = False, True
        self.buckets.setdefault((kernel, dtype), {}).setdefault(bucket(key), []).append(e)
        self.exact[kernel, dtype, key] = e

    def find(self, kernel, dtype, key):
        """The entry for ``key``: among the entries of its bucket not rejected, those tuned with
        this Triton release first, then the nearest (the exact key is at distance 0); None for none."""
        near = [e for e in self.buckets.get((kernel, dtype), {}).get(bucket(key), ()) if not e.rejected]
        return min(near, key=lambda e: (not e.current, _distance(key, e.key))) if near else None


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _config_problem(kernel, cfg):
    """Why ``cfg`` is not a config of ``kernel`` (fields, values), or None."""
    fields = KERNELS[kernel][1]
    if not isinstance(cfg, dict) or set(cfg) != set(fields):
        got = sorted(cfg) if isinstance(cfg, dict) else cfg
        return f"config fields {got} are not {kernel}'s {sorted(fields)}"
    for name, v in cfg.items():
        if not _is_count(v) or (name.startswith("BLOCK_") and v & (v - 1)):
            return f"config {name}={v!r} (positive integers, powers of two for BLOCK_*)"
    return None


def _entry_problem(kernel, entry, seen):
    """Why ``entry`` of ``kernel`` is unusable, or None (``seen``: keys already taken)."""
    if not isinstance(entry, dict) or any(f not in entry for f in _ENTRY_FIELDS):
        return f"an entry without all of {list(_ENTRY_FIELDS)}"
    key_names = KERNELS[kernel][0]
    key = entry["key"]
    if not isinstance(key, list) or len(key) != len(key_names) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in key):
        return f"key {key!r} is not {len(key_names)} non-negative integers {key_names}"
    if tuple(key) in seen:
        return f"key {key} appears twice"
    problem = _config_problem(kernel, entry["config"])
    if problem:
        return f"{problem} at key {key}"
    if not all(isinstance(entry[f], (int, float)) and not isinstance(entry[f], bool) for f in ("ms", "default_ms")):
        return f"ms/default_ms at key {key} are not numbers"
    if not isinstance(entry.get("triton", ""), str):
        return f"triton {entry['triton']!r} at key {key} is not a version string"
    return None


def this_release(version) -> bool:
    """Whether Triton ``version`` (a version string) is the running Triton's release (major.minor:
    patch releases share tables)."""
    return str(version).split(".")[:2] == triton.__version__.split(".")[:2]


def _parse(raw, device_name, path=None):
    """(_Table or None, list of problems) for the decoded JSON ``raw`` (read from ``path``)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        return None, [f"format is {found!r}, this flame reads format {FORMAT}"]
    if not isinstance(raw.get("gpu"), str) or slug(raw["gpu"]) != slug(device_name):
        return None, [f"written for GPU {raw.get('gpu')!r}, this is {device_name!r}"]
    if not isinstance(raw.get("triton"), str):
        return None, [f"'triton' (the Triton version of its entries) is {raw.get('triton')!r}, not a version string"]
    entries = raw.get("entries")
    if not isinstance(entries, dict):
        return None, ["'entries' is not an object {kernel: {dtype: [entries]}}"]
    table, problems = _Table(path), []
    for kernel, per_dtype in entries.items():
        if kernel not in KERNELS:
            problems.append(f"unknown kernel {kernel!r} (known: {sorted(KERNELS)})")
            continue
        if not isinstance(per_dtype, dict):
            problems.append(f"{kernel}: not an object {{dtype: [entries]}}")
            continue
        for dtype, rows in per_dtype.items():
            if dtype not in DTYPES or not isinstance(rows, list):
                problems.append(f"{kernel}: {dtype!r} is not one of {list(DTYPES)} with a list of entries")
                continue
            seen = set()
            for entry in rows:
                problem = _entry_problem(kernel, entry, seen)
                if problem:
                    problems.append(f"{kernel}/{dtype}: {problem}")
                    continue
                seen.add(tuple(entry["key"]))
                gain = entry["default_ms"] / entry["ms"] if entry["ms"] > 0 else math.inf
                table.add(kernel, dtype, tuple(entry["key"]), dict(entry["config"]), gain,
                          entry.get("triton", raw["triton"]))
    return table, problems


def _load(device_name, path=None):
    path = path or table_path(device_name)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        table, problems = None, [f"unreadable ({type(e).__name__}: {e})"]
    else:
        table, problems = _parse(raw, device_name, path)
    if problems:
        what = "ignored" if table is None else f"{len(problems)} bad entries or sections ignored"
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        warnings.warn(f"tuning table {path}: {what}, heuristic launch configs used instead: {shown}",
                      TuningTableWarning, stacklevel=4)
    return table


# ---- lookup -----------------------------------------------------------------------------------

_tables: dict = {}  # device name -> _Table or None (no usable table)
_chosen: dict = {}  # (kernel, shape key, dtype, device name or None) -> table config or None
_MISS = object()
_overrides: dict = {}  # kernel -> the innermost active Override
_cache_clears: list = []  # launchers' functions that empty their own per-shape config caches
_records: list = []  # the lists of the active record() blocks
_UNKNOWN = object()  # FLAME_AUTOTUNE=1: no exact entry anywhere (answered with the default, not memoised)
_autotune = os.environ.get("FLAME_AUTOTUNE", "") == "1"  # re-read by reset(); the tunable entry points test it
_cache_tables: dict = {}  # device name -> _Table of the user's cache (tuning on first use)
_asked_sinks: list = []  # the lists of the active asked_configs() blocks
_OWN = object()
_standin = _OWN  # inside heuristics_only() (None) or table_from() (a _Table): the only table asked; no cache
# Whether no table entry from another Triton release can be answered: this process's GPU table is loaded
# (the interpreter reads none), no table of this process has held such an entry (_foreign_seen) and no
# heuristics_only()/table_from() block is open. Kernel entry points then call their function directly
# (flame.autotune.tunable): nothing can be pending, so call_entry has nothing to prove or drop.
direct_entries = runtime.INTERPRETER
_foreign_seen = False
# table, no first-use tuning


def autotuning() -> bool:
    """Whether launches of unknown shapes are tuned on first use (``FLAME_AUTOTUNE=1``)."""
    return _autotune


def cache_path(device_name: str | None = None) -> Path:
    """The cache table of tuning on first use for ``device_name`` (default: the current device):
    ``$FLAME_CACHE_DIR/autotune/<gpu-slug>.json``, else under ``$XDG_CACHE_HOME/flame`` or
    ``~/.cache/flame``."""
    if os.environ.get("FLAME_CACHE_DIR"):
        base = Path(os.environ["FLAME_CACHE_DIR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flame"
    return base / "autotune" / f"{slug(device_name or runtime.device_name())}.json"


def _cache_table(name):
    if name not in _cache_tables:
        _cache_tables[name] = _load(name, cache_path(name)) or _Table()
    return _cache_tables[name]


def _first_use_lookup(kernel, key, dtype, default, name):
    """FLAME_AUTOTUNE=1: the exact entry of the GPU's table or of the cache table tuned with this
    Triton release, else _UNKNOWN (an entry from another release is tuned again)."""
    dt = _dtype_name(dtype)
    for table in (_tables[name], _cache_table(name)):
        hit = table.exact.get((kernel, dt, key)) if table is not None else None
        if hit is not None and hit.current:
            return None if hit.config is _HEURISTIC else hit.config
    return _UNKNOWN


def _lookup(kernel, shape_key, dtype, default, device_name):
    global direct_entries
    if kernel not in KERNELS:
        raise ValueError(f"tune.config: unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    key_names, fields = KERNELS[kernel]
    if len(shape_key) != len(key_names) or set(default) != set(fields):
        raise ValueError(f"tune.config({kernel!r}): shape key {shape_key} must be {key_names} and the default "
                         f"config's fields {sorted(default)} must be {sorted(fields)}")
    active = _overrides.get(kernel)
    if active is not None:
        active.served += 1
        return active.config
    if _standin is not _OWN:
        return None if _standin is None else _serve(_standin.find(kernel, _dtype_name(dtype), tuple(shape_key)))
    first_use = device_name is None and autotuning()
    if device_name is None and runtime.INTERPRETER and not first_use:  # the CPU has no table
        return None
    name = device_name or runtime.device_name()
    if name not in _tables:
        _tables[name] = _load(name) if not runtime.INTERPRETER or device_name else None
        if name == runtime.device_name():
            direct_entries = not _foreign_seen
    if first_use:
        return _first_use_lookup(kernel, tuple(shape_key), dtype, default, name)
    table = _tables[name]
    return None if table is None else _serve(table.find(kernel, _dtype_name(dtype), tuple(shape_key)))


def config(kernel: str, shape_key: tuple, dtype, default: dict, device_name: str | None = None) -> dict:
    """The launch config for ``kernel`` on a problem of shape ``shape_key`` (a tuple of ints
    named by ``KERNELS[kernel][0]``) in ``dtype`` (a torch dtype or its name) on ``device_name``
    (default: the current device): inside ``override(kernel, cfg)`` that ``cfg``; else the tuning
    table's exact entry, else its nearest entry in the same power-of-two bucket, else ``default``.
    The returned dict is shared: do not mutate it."""
    ck = (kernel, shape_key, dtype, device_name)
    hit = _chosen.get(ck, _MISS)
    unknown = False
    if hit is _MISS:
        hit = _lookup(kernel, shape_key, dtype, default, device_name)
        if hit is _UNKNOWN:  # asked again until it is tuned
            hit, unknown = None, True
        else:
            if len(_chosen) > 8192:
                _chosen.clear()
            _chosen[ck] = hit
        for asked in _records:
            asked.append((kernel, tuple(shape_key), _dtype_name(dtype), default if hit is None else hit))
    for sink in _asked_sinks:
        sink.append((kernel, tuple(shape_key), _dtype_name(dtype), default, unknown))
    return default if hit is None else hit


def _forget_answers():
    _chosen.clear()
    for clear in _cache_clears:
        clear()


# ---- entries from another Triton release: proven by their first launch ---------------------------

# What a launch raises when Triton cannot build the kernel for its config (a compile error, shared
# memory or registers beyond the GPU's, ptxas failing): what an entry tuned with another Triton
# release may meet. Errors of the running kernel (CUDA faults) are not among them.
LAUNCH_ERRORS = (triton.CompilationError, OutOfResources, PTXASError)

_pending: list = []  # entries from another release answered since the last proof, not yet proven
_entry_calls = 0  # kernel entry-point calls in progress (call_entry)


class EntryDropped(RuntimeError):
    """A launch failed to build its kernel while configs from tuning-table entries of another
    Triton release were in use: those entries are dropped, and the launch's next try gets the
    heuristic (a kernel entry point's call makes it at once: ``call_entry``)."""


def _serve(entry):
    """The config ``entry`` answers (None: the heuristic); an unproven one joins ``_pending``."""
    if entry is None or entry.config is _HEURISTIC:
        return None
    if not entry.proven and not entry.pending:
        entry.pending = True
        _pending.append(entry)
    return entry.config


def _prove():
    for e in _pending:
        e.proven, e.pending = True, False
    _pending.clear()


def launched() -> None:
    """``flame.kernels.launch`` calls this after a launch through Triton (compiled, or taken from
    its cache) returned. Outside kernel entry-point calls it proves the pending entries: a
    launcher asks for its config right before launching with it."""
    if _pending and not _entry_calls:
        _prove()


def launch_failed(error: BaseException) -> EntryDropped | None:
    """``flame.kernels.launch`` calls this when a launch raised one of ``LAUNCH_ERRORS``. When
    entries from another Triton release are pending (answered since the last proof: the failing
    config is among them), they are dropped for this process (until ``reset()``) with one
    ``TuningTableWarning``, cached answers are forgotten, and the ``EntryDropped`` to raise from
    ``error`` is returned; else None: the error is the heuristic's or a proven config's."""
    if not _pending:
        return None
    for e in _pending:
        e.rejected, e.pending = True, False
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    message = (f"a launch failed under Triton {triton.__version__} ({type(error).__name__}: {first}) with "
               f"configs tuned with another Triton release in use; dropped for this process, its launches "
               f"take the heuristic configs from now on: {'; '.join(map(str, _pending))}")
    warnings.warn(message, TuningTableWarning, stacklevel=3)
    _pending.clear()
    _forget_answers()
    return EntryDropped(message)


def call_entry(fn, args, kwargs):
    """``fn(*args, **kwargs)``, a kernel entry point (``flame.autotune.tunable`` calls every one
    through this), run again while a launch of it raises ``EntryDropped`` (the dropped entries'
    launches then get the heuristic; an entry point writes whole outputs and a launch that fails
    to build writes nothing, so the rerun is a clean one). The entries from another Triton release
    answered during the call are proven when it returns."""
    global _entry_calls
    _entry_calls += 1
    try:
        while True:  # each EntryDropped dropped an entry: this ends
            try:
                result = fn(*args, **kwargs)
                break
            except EntryDropped:
                continue
    finally:
        _entry_calls -= 1
    if _pending and not _entry_calls:
        _prove()
    return result


def register_cache(clear_fn):
    """Register ``clear_fn()``, which empties a launcher's own cache of configs per shape, so that
    ``override`` and ``reset`` reach launches whose config that cache would otherwise answer.
    Registering the same function again does nothing. Returns ``clear_fn``."""
    if not callable(clear_fn):
        raise TypeError(f"tune.register_cache: expected a zero-argument callable, got {clear_fn!r}")
    if clear_fn not in _cache_clears:
        _cache_clears.append(clear_fn)
    return clear_fn


def memoised(fn):
    """``fn``, a launcher's pure function of a shape to its launch plan or config, memoised with
    ``functools.lru_cache`` and its memo registered with ``register_cache``: how launchers keep
    the host path to one lookup per shape while ``override`` and ``reset`` still reach them."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    register_cache(cached.cache_clear)
    return cached


class Override:
    """The context manager ``override`` returns. ``served`` counts the launcher queries it has
    answered: 0 after a launch of the kernel means the launcher never asked ``flame.tune`` (its own
    config cache is not registered with ``register_cache``, or it does not call ``config``)."""

    def __init__(self, kernel, config):
        self.kernel, self.config, self.served = kernel, config, 0
        self._outer = None

    def __enter__(self):
        self._outer = _overrides.get(self.kernel)
        _overrides[self.kernel] = self
        _forget_answers()
        return self

    def __exit__(self, *exc):
        if self._outer is None:
            _overrides.pop(self.kernel, None)
        else:
            _overrides[self.kernel] = self._outer
        _forget_answers()
        return False


def override(kernel: str, config: dict) -> Override:
    """``with override(kernel, config):`` every launch of ``kernel``, whatever its shape key, dtype
    or backend (the interpreter too), uses ``config`` (exactly the kernel's ``KERNELS`` fields).
    Cached answers and registered launcher caches are emptied on entry and on exit."""
    if kernel not in KERNELS:
        raise ValueError(f"tune.override: unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    problem = _config_problem(kernel, config)
    if problem:
        raise ValueError(f"tune.override({kernel!r}, {config!r}): {problem}")
    return Override(kernel, dict(config))


@contextlib.contextmanager
def record():
    """``with record() as asked:`` ``asked`` lists ``(kernel, shape key, dtype name, config)`` for
    each config a launcher asks for inside the block, in order. Cached answers and registered
    launcher caches are emptied on entry and on exit, so every shape's first launch asks."""
    asked = []
    _records.append(asked)
    _forget_answers()
    try:
        yield asked
    finally:
        _records[:] = [r for r in _records if r is not asked]
        _forget_answers()


def reset() -> None:
    """Forget loaded tables (and the entries dropped from them) and cached answers, the registered
    launcher caches' included (after changing ``FLAME_TUNE_DIR``, ``FLAME_AUTOTUNE``,
    ``FLAME_CACHE_DIR`` or a table). Active overrides stay."""
    global _autotune, direct_entries
    _tables.clear()
    _cache_tables.clear()
    direct_entries = runtime.INTERPRETER and not _foreign_seen and _standin is _OWN  # a GPU's: once reloaded
    for e in _pending:  # a table_from() table's stay in use
        e.pending = False
    _pending.clear()
    _autotune = os.environ.get("FLAME_AUTOTUNE", "") == "1"
    _forget_answers()


def heuristics_only():
    """``with heuristics_only():`` every launch inside the block gets its launcher's heuristic
    config, as with no table at all: no table or cache-table entry is used and nothing is tuned
    on first use (active ``override`` blocks still apply). How benchmarks and the tuner time the
    defaults. Cached answers and registered launcher caches are emptied on entry and on exit."""
    return _stand_in(None)


def table_from(path, device_name: str | None = None):
    """``with table_from(path):`` as ``heuristics_only()``, but every launch inside the block gets
    the config the table file ``path`` gives (exact entry, else nearest in the bucket, else the
    heuristic), instead of the GPU's own table: how ``scripts/bench.py --baseline-table`` times an
    earlier table against the current one. ``path`` is read and checked as the GPU's own table
    would be (a corrupt file or another GPU's warns and counts as no table); ``device_name``
    defaults to the current device."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tune.table_from: no table file {path}")
    return _stand_in(_load(device_name or runtime.device_name(), path) or _Table())


@contextlib.contextmanager
def _stand_in(table):
    global _standin, direct_entries
    outer, direct = _standin, direct_entries
    _standin, direct_entries = table, False
    _forget_answers()
    try:
        yield
    finally:
        _standin = outer
        direct_entries = direct and not _foreign_seen and (runtime.INTERPRETER or runtime.device_name() in _tables)
        _forget_answers()


@contextlib.contextmanager
def asked_configs():
    """``with asked_configs() as asked:`` ``asked`` lists ``(kernel, shape key, dtype name, default
    config, unknown)`` for each config a launcher asks for inside the block, ``unknown`` True when
    no table holds the key exactly (only ever True with ``FLAME_AUTOTUNE=1``; ``flame.autotune``
    tunes those)."""
    asked = []
    _asked_sinks.append(asked)
    try:
        yield asked
    finally:
        _asked_sinks[:] = [s for s in _asked_sinks if s is not asked]


def entries_by_key(raw) -> dict:
    """{(kernel, dtype name): {key tuple: entry}} of a decoded format-1 table (rows without a
    list key skipped): the form ``dump_table`` writes back. Each entry names the Triton version it
    was tuned with (``triton``: its own, else the table's)."""
    table = {}
    for kernel, per_dtype in raw["entries"].items():
        for dtype, rows in (per_dtype.items() if isinstance(per_dtype, dict) else ()):
            for row in rows if isinstance(rows, list) else ():
                if isinstance(row, dict) and isinstance(row.get("key"), list):
                    if isinstance(raw.get("triton"), str):
                        row = dict(row, triton=row.get("triton", raw["triton"]))
                    table.setdefault((kernel, dtype), {})[tuple(row["key"])] = row
    return table


def dump_table(table: dict, gpu: str) -> str:
    """Format-1 JSON of ``table`` ({(kernel, dtype name): {key tuple: entry}}): one entry per line,
    kernels, dtypes and keys sorted (small diffs). The table's ``triton`` is the running version;
    an entry tuned with another (its ``triton``) keeps that field, the others go without."""
    head = dict(format=FORMAT, gpu=gpu, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "entries": {']
    kernels = sorted({k for k, _ in table})
    for i, kernel in enumerate(kernels):
        lines.append(f"    {json.dumps(kernel)}: {{")
        dtypes = sorted(d for k, d in table if k == kernel)
        for j, dtype in enumerate(dtypes):
            rows = [json.dumps({f: v for f, v in e.items() if (f, v) != ("triton", triton.__version__)})
                    for _, e in sorted(table[kernel, dtype].items())]
            lines.append(f"      {json.dumps(dtype)}: [")
            lines.append(",\n".join(f"        {r}" for r in rows))
            lines.append("      ]" + ("," if j < len(dtypes) - 1 else ""))
        lines.append("    }" + ("," if i < len(kernels) - 1 else ""))
    return "\n".join(lines + ["  }", "}", ""])


def write_table(path: Path, table: dict, gpu: str) -> None:
    """Write ``table`` ({(kernel, dtype name): {key tuple: entry}}) to ``path`` atomically."""
    from .io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    text = dump_table(table, gpu).encode()
    atomic_write(path, lambda f: f.write(text))


def remember(kernel: str, shape_key: tuple, dtype, config: dict, ms: float, default_ms: float) -> Path:
    """Add a tuned entry to the current GPU's cache table, in memory and on disk (format 1,
    merged with the file as other processes left it, written atomically); returns its path.
    Launches of that key use it from now on (FLAME_AUTOTUNE=1)."""
    problem = _config_problem(kernel, config) if kernel in KERNELS else f"unknown kernel {kernel!r}"
    if problem:
        raise ValueError(f"tune.remember: {problem}")
    name, dt, key = runtime.device_name(), _dtype_name(dtype), tuple(int(d) for d in shape_key)
    path = cache_path(name)
    raw = None
    if path.is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
            raw = json.loads(path.read_text())
    # absent, unreadable or another GPU's: start afresh
    table = entries_by_key(raw) if _parse(raw, name)[0] is not None else {}
    table.setdefault((kernel, dt), {})[key] = dict(key=list(key), config=dict(config), ms=float(f"{ms:.4g}"),
                                                   default_ms=float(f"{default_ms:.4g}"))
    write_table(path, table, name)
    _cache_table(name).add(kernel, dt, key, dict(config), default_ms / ms if ms > 0 else math.inf, triton.__version__)
    for sink in _asked_sinks:  # known now: an outer entry point need not tune it again
        sink[:] = [q[:4] + (False,) if q[:3] == (kernel, key, dt) else q for q in sink]
    _forget_answers()
    return path
