"""Tuning on first use (``FLAME_AUTOTUNE=1``): launch configs measured where a shape first runs.

``scripts/autotune.py`` tunes a shape set ahead of time and writes the tables that ``flame.tune``
reads. With ``FLAME_AUTOTUNE=1`` a process also tunes, on first use, every launch whose (kernel,
shape key, dtype) neither the GPU's table nor the user's cache table holds exactly:

1. The launch runs at once with the heuristic config (its results are the ones the caller gets),
   and ``flame.tune`` notes the unknown key.
2. The kernel entry point that made it (a function decorated with ``@tunable``: the launchers of
   ``flame/kernels/`` that write a whole result into output buffers; the kernel tuned is the last
   one the call asked ``flame.tune`` for, the one that ran, not counting the helper maps and
   reductions launched around it: ``launched_kernel``) then runs again with each
   candidate of the kernel's search space (``search_stages``, the space ``scripts/autotune.py``
   uses) under ``flame.tune.override``, into fresh output buffers poisoned with NaN: its inputs
   are untouched, and an input that aliases an output (an in-place residual) is read as it is
   now by every candidate alike. A candidate whose outputs differ from the heuristic's rerun by
   more than the dtype's tolerance is rejected; one that fails to compile or fit is skipped; the
   others are timed as CUDA-graph replays, device time as ``scripts/autotune.py`` and
   ``scripts/bench.py`` measure it (``graph_time_ms``; CUDA events around each call when a call
   cannot be captured): a short screen, then the fastest few and the heuristic again for longer.
3. The fastest (the heuristic is a contender) goes into the cache table (``flame.tune.remember``:
   ``$FLAME_CACHE_DIR/autotune/<gpu-slug>.json``, default ``~/.cache/flame/autotune``, or under
   ``$XDG_CACHE_HOME``), format 1 of ``configs/autotune/README.md``, rewritten atomically and
   merged with what other processes wrote. Later launches of that key, in this process and in
   any later one with ``FLAME_AUTOTUNE=1``, use it. One line per tuned key goes to stderr.

Nothing is tuned during CUDA-graph capture (the launch keeps the heuristic and the key stays
unknown until an eager call meets it) or inside another tunable call's tuning. Without
``FLAME_AUTOTUNE=1`` a decorated entry point costs two flag tests per call, and ``flame.tune.call_entry``'s
bookkeeping (a counter) while entries of another Triton release may be served (``tune.direct_entries``),
and the cache table is not read. Tuning on first use costs
seconds per key (compiling the candidates): warm up a job's shapes once, then the cache serves
every later run.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import statistics
import sys
import time

import torch
import triton
import triton.testing

from . import runtime, tune

# Largest error allowed against the heuristic's rerun, as a fraction of its largest magnitude:
# the output's own rounding (bf16 2^-8, fp16 2^-11; fp32 runs tf32 products) with room to spare.
CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-2, torch.float64: 1e-9}
SCREEN_REPS, FINAL_REPS, FINALISTS = 5, 20, 3  # ms of graph replays (or eager calls) per timing


_busy = False  # a tunable call is tuning: nested entry points just run
_inside = 0  # tunable calls making their first (untuned) run: nested helper entry points just run


def tunable(*outputs: str, helper: bool = False):
    """Decorate a kernel entry point whose parameters named in ``outputs`` are the buffers it
    writes (torch tensors, or None when not wanted); returned tensors count as outputs too. With
    ``FLAME_AUTOTUNE=1`` a call that meets launch configs no table knows tunes them (module
    docstring); otherwise the call goes straight through ``flame.tune.call_entry`` (which runs it
    again with the heuristic when a table entry from another Triton release fails to launch).
    ``helper``: an entry point that others call for small jobs (fills, casts, sums of split
    partials; its kernels' specs say ``helper``): called inside another tunable call it just
    runs, and that call tunes its own kernel."""

    def deco(fn):
        names = list(inspect.signature(fn).parameters)
        missing = [n for n in outputs if n not in names]
        if missing:
            raise TypeError(f"tunable({', '.join(outputs)}): {fn.__qualname__} has no parameter {missing[0]!r}")
        places = tuple((names.index(n), n) for n in outputs)  # (position, keyword) of each output

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            if not tune._autotune or _busy or (helper and _inside):  # one test when FLAME_AUTOTUNE is off
                if tune.direct_entries:  # no tuning-table entry to prove or drop (flame.tune): the call itself
                    return fn(*args, **kwargs)
                return tune.call_entry(fn, args, kwargs)
            return _run_and_tune(fn, places, args, kwargs)

        return entry

    return deco


def launched_kernel(kernels) -> str:
    """The kernel a call runs (and tunes), from the kernels it asked ``flame.tune`` for, in order:
    the last one (a 16-bit GEMM on Hopper asks "matmul", then runs "matmul_tma") that is not a
    helper (``flame.tune.Spec.helper``: zero fills, casts, split-K sums that entry points launch
    around their main kernel; a split-K GEMM sums its splits with "reduce"), else the last one."""
    main = [k for k in kernels if not (k in tune.SPECS and tune.SPECS[k].helper)]
    return (main or kernels)[-1]


def _run_and_tune(fn, places, args, kwargs):
    global _busy, _inside
    _inside += 1
    try:
        with tune.asked_configs() as asked:
            result = tune.call_entry(fn, args, kwargs)
    finally:
        _inside -= 1
    # as scripts/autotune.py decides: (kernel, key, dtype name) -> the query
    main = launched_kernel([q[0] for q in asked]) if asked else None
    todo = {q[:3]: q[:4] for q in asked if q[4] and q[0] == main}
    if not todo or (runtime.INTERPRETER and not _INTERPRETER_OK) or _capturing():
        return result
    _busy = True
    try:
        for query in todo.values():
            _tune_key(fn, places, args, kwargs, *query)
    finally:
        _busy = False
    return result


_INTERPRETER_OK = False  # tests switch this on to exercise the machinery on the CPU


def _capturing() -> bool:
    return not runtime.INTERPRETER and torch.cuda.is_current_stream_capturing()


def _fresh_call(fn, places, args, kwargs):
    """Run ``fn`` with fresh NaN-filled buffers in place of its output arguments. Returns its
    outputs (those buffers and any tensors it returns) and a function that reruns it so."""
    from .kernels.elementwise import fill_

    args, kwargs = list(args), dict(kwargs)

    def fresh(t):
        buf = runtime.empty_strided(tuple(t.shape), t.stride(), t.dtype)
        if buf.dtype.is_floating_point and buf.numel():
            fill_(buf, math.nan)
        return buf

    outs = []
    for i, name in places:
        holder, at = (args, i) if i < len(args) else (kwargs, name)
        if (holder is args or at in kwargs) and isinstance(holder[at], torch.Tensor):
            holder[at] = fresh(holder[at])
            outs.append(holder[at])
    result = fn(*args, **kwargs)
    returned = result if isinstance(result, tuple) else (result,)
    return outs + [t for t in returned if isinstance(t, torch.Tensor)], lambda: fn(*args, **kwargs)


def _max_abs(t) -> float:
    from .tensor import Tensor

    return float(Tensor(t).float().abs().max().item()) if t.numel() else 0.0


def _mismatch(outs, want, dtype):
    """None when every output matches the heuristic's within the tolerance, else why not."""
    from .tensor import Tensor

    for i, (got, ref) in enumerate(zip(outs, want)):
        if not got.is_floating_point() or not got.numel():
            continue
        err = float((Tensor(got).float() - Tensor(ref).float()).abs().max().item())
        scale = _max_abs(ref)
        tol = CHECK_TOL.get(got.dtype, 1e-2) * max(scale, 1e-6)
        if not err <= tol:  # NaN: an element never written
            return f"output {i}: max |error| {err:.3g} > {tol:.3g}"
    return None


def graph_time_ms(fn, rep_ms) -> float | None:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph
    (``triton.testing.do_bench_cudagraph``, about ``rep_ms`` of replays): its kernels' device time,
    as ``scripts/bench.py`` reports it. Timed eagerly, a call whose host work outlasts its kernels
    measures the host (H200: the 1x1280x32x32 conv forward with split-K, two launches, 0.156 ms
    eagerly and 0.076 ms replayed), which favours configs with fewer launches over faster ones.
    None when ``fn`` cannot be captured. Both tuners time their candidates with it."""
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except RuntimeError:  # not capturable (torch's capture errors are RuntimeErrors)
        torch.cuda.synchronize()
        return None


def _time_ms(run, reps) -> float:
    """Median milliseconds of ``run()``: on the GPU ``graph_time_ms`` over ``reps`` ms of replays,
    or, when ``run`` cannot be captured, CUDA events around each of ``reps`` calls; host time of
    ``reps`` calls on the interpreter."""
    run()
    if not runtime.INTERPRETER:
        ms = graph_time_ms(run, reps)
        if ms is not None:
            return ms
    times = []
    for _ in range(reps):
        if runtime.INTERPRETER:
            t0 = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shared_memory():
    """Shared memory per block of the current GPU in bytes (None on the interpreter: no limit)."""
    if runtime.INTERPRETER:
        return None
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return props["max_shared_mem"]


def search(stages, default, default_ms, screen, final, prepare=lambda configs: None, expired=lambda: False):
    """The search both tuners run (``scripts/autotune.py`` and tuning on first use). Stage by
    stage (``stages``, as ``search_stages`` gives them), each built on the fastest config screened
    so far, the new candidates go to ``prepare(configs)`` and then one by one to ``screen(cfg)``:
    a screening time in ms, or None for a candidate that is wrong or does not compile or fit.
    ``default_ms`` is the heuristic ``default``'s screening time. The FINALISTS fastest and the
    default (``final(None)``) are then timed again with ``final(cfg)``. Returns (best config, its
    final ms, the default's final ms, how many configs were tried), or None when ``expired()``
    before a candidate."""
    screened = [(default_ms, default)]
    tried = [default]
    for stage in stages:
        fresh = [c for c in unique(stage(min(screened, key=lambda t: t[0])[1])) if c not in tried]
        prepare(fresh)
        for cfg in fresh:
            tried.append(cfg)
            if expired():
                return None
            ms = screen(cfg)
            if ms is not None:
                screened.append((ms, cfg))
    finalists = [c for _, c in sorted(screened, key=lambda t: t[0]) if c != default][:FINALISTS]
    default_final = best_ms = final(None)
    best = default
    for cfg in finalists:
        ms = final(cfg)
        if ms < best_ms:
            best_ms, best = ms, cfg
    return best, best_ms, default_final, len(tried)


def _tune_key(fn, places, args, kwargs, kernel, key, dtype_name, default):
    """Search ``kernel``'s space at ``key`` for this call; the winner goes into the cache table."""
    dtype = getattr(torch, dtype_name)
    want, run_default = _fresh_call(fn, places, args, kwargs)  # rerunning it rewrites the same values
    failed = dict(wrong=0, unfit=0)

    def screen(cfg):
        try:
            with tune.override(kernel, cfg):
                outs, run = _fresh_call(fn, places, args, kwargs)
                if _mismatch(outs, want, dtype):
                    failed["wrong"] += 1
                    return None
                return _time_ms(run, SCREEN_REPS)
        except Exception as e:  # compile failure, out of resources: not a candidate here
            if any(s in str(e) for s in ("illegal memory access", "unspecified launch failure")):
                raise
            failed["unfit"] += 1
            return None

    def final(cfg):
        if cfg is None:
            return _time_ms(run_default, FINAL_REPS)
        with tune.override(kernel, cfg):
            _, run = _fresh_call(fn, places, args, kwargs)
            return _time_ms(run, FINAL_REPS)

    stages = search_stages(Space(dtype, smem=shared_memory()), kernel, key)
    best, best_ms, default_ms, tried = search(stages, default, _time_ms(run_default, SCREEN_REPS), screen, final)
    path = tune.remember(kernel, key, dtype_name, best, best_ms, default_ms)
    print(f"flame autotune: {kernel} {list(key)} {dtype_name}: {tried} configs ({failed['wrong']} wrong, "
          f"{failed['unfit']} did not compile or fit), best {best_ms:.4g} ms vs heuristic {default_ms:.4g} ms "
          f"({default_ms / best_ms:.2f}x) -> {path}", file=sys.stderr)


# ---- search spaces (scripts/autotune.py and tuning on first use) -------------------------------
# Each kernel's space lives in its spec (``flame.tune.Spec``: ``space``, ``quick``, ``stages``,
# ``keep``), next to the kernel; here are the pieces they share: the GEMM tile space and the
# helpers that cut, combine and filter candidates.

# The GEMM config space: tile sides, BLOCK_K with the pipeline depths worth trying for it
# (thinner K slices want deeper pipelines), warps by tile area. --quick: a few tiny tiles.
TILES, K_STAGES = (64, 128, 256), {32: (4,), 64: (3, 4), 128: (2, 3)}
QUICK_TILES, QUICK_K_STAGES = (16, 32), {16: (2,), 32: (2,)}
GEMM_SPACE, QUICK_GEMM_SPACE = dict(tiles=TILES, k_stages=K_STAGES), dict(tiles=QUICK_TILES, k_stages=QUICK_K_STAGES)
MAX_TILE_AREA = 128 * 256  # 256 x 256 fp32 accumulators do not fit in registers


@dataclasses.dataclass
class Space:
    """The candidate configs of each kernel for one dtype: ``quick`` gives a few tiny blocks (the
    interpreter's smoke tests), ``smem`` is the GPU's shared memory per block in bytes (None: no
    limit)."""

    dtype: torch.dtype
    quick: bool = False
    smem: int | None = None

    def choices(self, spec):
        """``spec``'s search space: its quick one with ``quick``, else its full one."""
        return spec.quick if self.quick else spec.space

    def gemm_space(self, m, n, k, group_m):
        """Candidate configs of an (m x k) @ (k x n) tile loop: no block larger than its
        dimension's next power of two (at least 16), stages that fit in shared memory."""
        tiles, k_stages = (QUICK_TILES, QUICK_K_STAGES) if self.quick else (TILES, K_STAGES)
        es = self.dtype.itemsize
        pairs = sorted({(fit(bk, k), s) for bk, stages in k_stages.items() for s in stages})
        space = []
        for bm in sorted({fit(b, m) for b in tiles}):
            for bn in sorted({fit(b, n) for b in tiles}):
                area = bm * bn
                if area > MAX_TILE_AREA:
                    continue
                warps = (4,) if self.quick or area < 128 * 128 else (8,) if area > 128 * 128 else (4, 8)
                for (bk, stages), w in ((p, w) for p in pairs for w in warps):
                    if self.smem is not None and (bm * bk + bk * bn) * es * stages > self.smem:
                        continue
                    group = dict(GROUP_M=8) if group_m else {}
                    space.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **group, num_warps=w, num_stages=stages))
        return space

    def fits(self, resident_rows, streamed_rows, scratch, bd):
        """Whether rows of a ``bd``-wide tile held for the whole program, rows loaded per pipeline
        stage and ``scratch`` elements (score tiles as dot operands) fit in shared memory."""
        return self.smem is None or ((resident_rows + streamed_rows) * bd + scratch) * self.dtype.itemsize <= self.smem


def gemm_stages(ctx: Space, key: tuple, spec) -> list:
    """The stages of a tile-loop kernel (GEMM, conv): one, the GEMM space over (M, N, K) =
    ``key[:3]``, cut to the kernel's fields (conv2d_fold: no BLOCK_K)."""
    fields = spec.fields
    return [lambda best: unique([{f: v for f, v in c.items() if f in fields}
                                 for c in ctx.gemm_space(*key[:3], group_m="GROUP_M" in fields)])]


def fit(block, dim):
    """``block`` cut to ``dim`` rounded up to a power of two (at least 16, tl.dot's minimum)."""
    return min(block, max(16, triton.next_power_of_2(dim)))


def fitted(choices, **dims):
    """``choices`` with the block sizes of the fields named in ``dims`` cut to those dimensions."""
    return dict(choices, **{f: tuple(sorted({fit(b, dim) for b in choices[f]})) for f, dim in dims.items()})


def product(choices, base=None):
    """Every combination of ``choices`` (field -> values) over the config ``base``, without repeats."""
    return unique([dict(base or {}, **dict(zip(choices, values))) for values in itertools.product(*choices.values())])


def unique(configs):
    """``configs`` without repeats, in order."""
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def per_thread_ok(elements, warps):
    """Whether a tile of ``elements`` gives each thread of ``warps`` warps 2 to 64 of them."""
    return 2 <= elements // (32 * warps) <= 64


def search_stages(ctx: Space, kernel: str, key: tuple) -> list:
    """The configs to try for ``kernel`` at shape ``key``, in stages: each a function from the
    fastest config found so far (at first the heuristic default) to the configs to try next; the
    kernel's spec (``flame.tune.SPECS``) says which (``stages``, filtered by ``keep``)."""
    spec = tune.SPECS.get(kernel)
    if spec is None or spec.stages is None:
        fields = tune.KERNELS[kernel][1] if kernel in tune.KERNELS else "unknown"
        raise LookupError(f"no candidate space for kernel {kernel!r} (config fields {list(fields)}): give its "
                          "flame.tune.Spec a stages function")
    stages = spec.stages(ctx, key, spec)
    if spec.keep is None:
        return stages
    return [lambda best, stage=stage: [c for c in stage(best) if spec.keep(c, key)] for stage in stages]
