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
``FLAME_AUTOTUNE=1`` a decorated entry point costs one flag test and ``flame.tune.call_entry``'s
bookkeeping (a counter) per call, and the cache table is not read. Tuning on first use costs
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
    partials; its kernels are ``AUXILIARY``): called inside another tunable call it just runs, and
    that call tunes its own kernel."""

    def deco(fn):
        names = list(inspect.signature(fn).parameters)
        missing = [n for n in outputs if n not in names]
        if missing:
            raise TypeError(f"tunable({', '.join(outputs)}): {fn.__qualname__} has no parameter {missing[0]!r}")
        places = tuple((names.index(n), n) for n in outputs)  # (position, keyword) of each output

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            if not tune._autotune or _busy or (helper and _inside):  # one test when FLAME_AUTOTUNE is off
                return tune.call_entry(fn, args, kwargs)
            return _run_and_tune(fn, places, args, kwargs)

        return entry

    return deco


# Helper kernels that entry points launch around their main one (zero fills, casts, split-K sums).
AUXILIARY = ("map_contiguous", "map_strided", "reduce")


def launched_kernel(kernels) -> str:
    """The kernel a call runs (and tunes), from the kernels it asked ``flame.tune`` for, in order:
    the last one (a 16-bit GEMM on Hopper asks "matmul", then runs "matmul_tma") that is not
    ``AUXILIARY`` (a split-K GEMM then sums its splits with "reduce"), else the last one."""
    main = [k for k in kernels if k not in AUXILIARY]
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


def _shared_memory():
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
        fresh = [c for c in _unique(stage(min(screened, key=lambda t: t[0])[1])) if c not in tried]
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

    stages = search_stages(Space(dtype, smem=_shared_memory()), kernel, key)
    best, best_ms, default_ms, tried = search(stages, default, _time_ms(run_default, SCREEN_REPS), screen, final)
    path = tune.remember(kernel, key, dtype_name, best, best_ms, default_ms)
    print(f"flame autotune: {kernel} {list(key)} {dtype_name}: {tried} configs ({failed['wrong']} wrong, "
          f"{failed['unfit']} did not compile or fit), best {best_ms:.4g} ms vs heuristic {default_ms:.4g} ms "
          f"({default_ms / best_ms:.2f}x) -> {path}", file=sys.stderr)


# ---- search spaces (scripts/autotune.py and tuning on first use) -------------------------------

# The GEMM config space: tile sides, BLOCK_K with the pipeline depths worth trying for it
# (thinner K slices want deeper pipelines), warps by tile area. --quick: a few tiny tiles.
TILES, K_STAGES = (64, 128, 256), {32: (4,), 64: (3, 4), 128: (2, 3)}
QUICK_TILES, QUICK_K_STAGES = (16, 32), {16: (2,), 32: (2,)}
MAX_TILE_AREA = 128 * 256  # 256 x 256 fp32 accumulators do not fit in registers

# The attention config spaces, field -> values (from a sweep of every config on an H200):
# the forward on long K/V ("fwd") and on short K/V ("fwd_short": every key in one block of the
# padded Lk, M_GROUP query blocks per program); the backward's dK/dV program ("kv"; tuned with
# the dQ fields at the default), then its dQ program ("dq", with the fastest dK/dV config), or on
# short K/V the fused program ("kv_short") with CHUNKS from PROGRAMS_PER_SM: about that many
# programs per SM over the query chunks. --quick: a few tiny blocks.
ATTN_SPACE = dict(
    fwd=dict(BLOCK_M=(64, 128), BLOCK_N=(32, 64, 128), M_GROUP=(1,), num_warps=(4, 8), num_stages=(1, 2, 3, 4)),
    fwd_short=dict(BLOCK_M=(64, 128), M_GROUP=(1, 2, 4), num_warps=(4, 8), num_stages=(1, 2)),
    kv=dict(BLOCK_M=(32, 64, 128), BLOCK_N=(64, 128), num_warps=(4, 8), num_stages=(1, 2, 3)),
    dq=dict(BLOCK_M_DQ=(64, 128), BLOCK_N_DQ=(32, 64), num_warps_dq=(4, 8), num_stages_dq=(2, 3)),
    kv_short=dict(BLOCK_M=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2), PROGRAMS_PER_SM=(1, 2, 4, 8)),
)
QUICK_ATTN_SPACE = dict(
    fwd=dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), M_GROUP=(1,), num_warps=(4,), num_stages=(1,)),
    fwd_short=dict(BLOCK_M=(16,), M_GROUP=(1, 2), num_warps=(4,), num_stages=(1,)),
    kv=dict(BLOCK_M=(16, 32), BLOCK_N=(16,), num_warps=(4,), num_stages=(1,)),
    dq=dict(BLOCK_M_DQ=(16, 32), BLOCK_N_DQ=(16,), num_warps_dq=(4,), num_stages_dq=(1,)),
    kv_short=dict(BLOCK_M=(16,), num_warps=(4,), num_stages=(1,), PROGRAMS_PER_SM=(1, 4)),
)
MAX_ATTN_BWD_AREA = 128 * 64  # dK/dV tiles of 128 x 128 spill registers (the sweep skipped them)

# The norm config spaces. layer_norm_fwd/bwd: BLOCK_M rows of BLOCK_D (D rounded up, derived) per
# program, at most MAX_LN_TILE elements (the backward holds four such tiles: half, its fastest on
# the H100 held 8192), warps that give each thread 2 to 64 of them; then the backward's persistent
# programs, PROGRAMS_PER_SM per SM.
# group_norm_fwd/bwd: the statistics pass's tiles of TILE elements, channels innermost for
# channels-last input (BLOCK_C channels, BLOCK_S = TILE / BLOCK_C positions), positions for NCHW
# (BLOCK_S), its warps and SPLITS of each group's positions, chosen so that about PROGRAMS_PER_SM
# programs per SM share the statistics; then the apply pass's tiles and warps (the same choices).
LN_SPACE = dict(BLOCK_M=(1, 2, 4, 8, 16, 32), num_warps=(1, 2, 4, 8, 16), PROGRAMS_PER_SM=(1, 2, 4, 8))
QUICK_LN_SPACE = dict(BLOCK_M=(2, 4), num_warps=(1,), PROGRAMS_PER_SM=(1, 3))
MAX_LN_TILE = 16384
# softmax_fwd/bwd, cross_entropy_fwd/bwd: BLOCK_ROWS rows of BLOCK_R (or BLOCK_C) elements per
# program, blocks cut to the row's length rounded up to a power of two (a softmax row that fits one
# block is read whole, longer rows are streamed through such blocks), at most MAX_SOFTMAX_TILE
# elements (halved for the kernels that hold two tiles: softmax's backward, y and g; a quarter
# for cross-entropy's forward, three running tiles), warps that give each thread 2 to 64 of them.
SOFTMAX_SPACE = dict(BLOCK_ROWS=(1, 2, 4, 8, 16, 32), BLOCK_R=(1024, 2048, 4096, 8192, 16384),
                     num_warps=(1, 2, 4, 8, 16))
QUICK_SOFTMAX_SPACE = dict(BLOCK_ROWS=(2, 4), BLOCK_R=(32, 64), num_warps=(1,))
MAX_SOFTMAX_TILE = 16384
_SOFTMAX_TILE_SHARE = dict(softmax_fwd=1, softmax_bwd=2, cross_entropy_fwd=4, cross_entropy_bwd=2)
# map_contiguous: BLOCK elements per program (its BLOCK_SIZE); map_strided: BLOCK_R x BLOCK_C
# tiles of BLOCK elements, rows of BLOCK_C; reduce: BLOCK_R x BLOCK_I tiles (BLOCK_I 1 when
# reducing rows, inner == 1) of REDUCE_AREA elements (or the whole of a shorter R). Blocks are cut
# to the dims rounded up to powers of two, and the warps give each thread 2 to 64 elements of the
# (cut) tile.
MAP_SPACE = dict(BLOCK=(256, 512, 1024, 2048, 4096, 8192), BLOCK_C=(64, 256, 1024), num_warps=(2, 4, 8, 16))
QUICK_MAP_SPACE = dict(BLOCK=(64, 128), BLOCK_C=(8, 32), num_warps=(1,))
REDUCE_SPACE = dict(BLOCK_R=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), BLOCK_I=(32, 64, 128),
                    REDUCE_AREA=(1024, 2048, 4096, 8192), num_warps=(1, 2, 4, 8, 16))
QUICK_REDUCE_SPACE = dict(BLOCK_R=(16, 32, 64, 128), BLOCK_I=(4, 8), REDUCE_AREA=(64, 128), num_warps=(1,))
GN_SPACE = dict(BLOCK_C=(16, 32, 64, 128), BLOCK_S=(256, 512, 1024, 2048), TILE=(2048, 4096, 8192), num_warps=(4, 8),
                PROGRAMS_PER_SM=(2, 4, 8))
QUICK_GN_SPACE = dict(BLOCK_C=(2, 4), BLOCK_S=(8, 16), TILE=(32,), num_warps=(4,), PROGRAMS_PER_SM=(4, 16))


@dataclasses.dataclass
class Space:
    """The candidate configs of each kernel for one dtype: ``quick`` gives a few tiny blocks (the
    interpreter's smoke tests), ``smem`` is the GPU's shared memory per block in bytes (None: no
    limit)."""

    dtype: torch.dtype
    quick: bool = False
    smem: int | None = None

    def gemm_space(self, m, n, k, group_m):
        """Candidate configs of an (m x k) @ (k x n) tile loop: no block larger than its
        dimension's next power of two (at least 16), stages that fit in shared memory."""
        tiles, k_stages = (QUICK_TILES, QUICK_K_STAGES) if self.quick else (TILES, K_STAGES)
        es = self.dtype.itemsize
        pairs = sorted({(_fit(bk, k), s) for bk, stages in k_stages.items() for s in stages})
        space = []
        for bm in sorted({_fit(b, m) for b in tiles}):
            for bn in sorted({_fit(b, n) for b in tiles}):
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

    def attention_fwd_space(self, lq, lk, d, bh):
        """Candidate attention_fwd configs at key (Lq, Lk, D, B*H) that fit in shared memory: the
        query tile, the K and V blocks of every pipeline stage and the probabilities P."""
        space, es, bd = self._attn_space(), self.dtype.itemsize, max(16, triton.next_power_of_2(d))
        if _short_kv(lk, d, es):  # K/V loaded once, query tiles pipelined
            bn = max(16, triton.next_power_of_2(lk))
            configs = _product(_fitted(space["fwd_short"], BLOCK_M=lq), dict(BLOCK_N=bn))
            return [c for c in configs if self._fits(2 * bn, c["num_stages"] * c["BLOCK_M"], c["BLOCK_M"] * bn, bd)]
        configs = _product(_fitted(space["fwd"], BLOCK_M=lq, BLOCK_N=lk))
        return [c for c in configs if self._fits(c["BLOCK_M"], c["num_stages"] * 2 * c["BLOCK_N"],
                                                 c["BLOCK_M"] * c["BLOCK_N"], bd)]

    def attention_bwd_stages(self, lq, lk, d, bh):
        """The candidate attention_bwd configs at key (Lq, Lk, D, B*H) as ``tune_launch`` stages:
        on long K/V the dK/dV program's (K and V resident, Q and dO tiles pipelined), then the dQ
        program's (Q and dO resident, K and V pipelined) over the fastest so far; on short K/V the
        fused program's block, warps, stages and query chunks."""
        space, es, bd = self._attn_space(), self.dtype.itemsize, max(16, triton.next_power_of_2(d))

        def kv_fits(c, bn):
            return self._fits(2 * bn, c["num_stages"] * 2 * c["BLOCK_M"], 2 * c["BLOCK_M"] * bn, bd)

        if _short_kv(lk, d, es):
            bn = max(16, triton.next_power_of_2(lk))
            choices = _fitted(space["kv_short"], BLOCK_M=lq)
            per_sm = choices.pop("PROGRAMS_PER_SM")

            def fused(best):
                configs = []
                for bm in choices["BLOCK_M"]:
                    nm = -(-lq // bm)
                    chunks = sorted({max(1, min(nm, p * runtime.num_sms() // bh)) for p in per_sm})
                    configs += _product(dict(choices, BLOCK_M=(bm,), CHUNKS=chunks), dict(best, BLOCK_N=bn))
                return [c for c in configs if kv_fits(c, bn)]

            return [fused]

        def dkdv(best):
            return [c for c in _product(_fitted(space["kv"], BLOCK_M=lq, BLOCK_N=lk), dict(best, CHUNKS=1))
                    if c["BLOCK_M"] * c["BLOCK_N"] <= MAX_ATTN_BWD_AREA and kv_fits(c, c["BLOCK_N"])]

        def dq(best):
            return [c for c in _product(_fitted(space["dq"], BLOCK_M_DQ=lq, BLOCK_N_DQ=lk), best)
                    if self._fits(2 * c["BLOCK_M_DQ"], c["num_stages_dq"] * 2 * c["BLOCK_N_DQ"],
                                  c["BLOCK_M_DQ"] * c["BLOCK_N_DQ"], bd)]

        return [dkdv, dq]

    def layer_norm_stages(self, kernel, m, d):
        """The candidate layer_norm_fwd/bwd configs at key (M, D) as ``tune_launch`` stages: rows per
        program and warps, then (backward) the persistent programs, each at most one per row block.
        Rows longer than one block are streamed, in the backward one row per program: warps only."""
        space = QUICK_LN_SPACE if self.quick else LN_SPACE
        from .kernels.norms import row_block

        bd, bwd = row_block(d), kernel == "layer_norm_bwd"
        streamed = bd < d
        rows = (1,) if bwd and streamed else sorted({min(r, triton.next_power_of_2(m)) for r in space["BLOCK_M"]})
        cap = MAX_LN_TILE // 2 if bwd else MAX_LN_TILE
        tiles = [(r, w) for r in rows for w in space["num_warps"]
                 if (r == 1 or r * bd <= cap) and 2 <= r * bd // (32 * w) <= 64]

        def blocks(best):
            return [dict(best, BLOCK_M=r, num_warps=w) for r, w in tiles]

        def programs(best):
            row_blocks = triton.cdiv(m, best["BLOCK_M"])
            counts = {min(p * runtime.num_sms(), row_blocks) for p in space["PROGRAMS_PER_SM"]}
            return [dict(best, PROGRAMS=p) for p in sorted(counts - {min(best["PROGRAMS"], row_blocks)})]

        return [blocks, programs] if bwd and not streamed else [blocks]

    def group_norm_stages(self, n, c, s, g, cl):
        """The candidate group_norm_fwd/bwd configs at key (N, C, S, G, channels_last) as
        ``tune_launch`` stages: the statistics pass's tiles, warps and splits (the apply pass at its
        default), then the apply pass's tiles and warps over the fastest statistics config."""
        space = QUICK_GN_SPACE if self.quick else GN_SPACE
        pc, ps = triton.next_power_of_2(c), triton.next_power_of_2(s)
        tiles = set()
        for t, b in itertools.product(space["TILE"], space["BLOCK_C" if cl else "BLOCK_S"]):
            tiles.add((min(b, pc), min(max(1, t // b), ps)) if cl else (min(max(1, t // b), pc), min(b, ps)))
        choices = list(itertools.product(sorted(tiles), space["num_warps"]))

        def statistics(best):
            configs = []
            for ((bc, bs), w), per_sm in itertools.product(choices, space["PROGRAMS_PER_SM"]):
                want = triton.cdiv(per_sm * runtime.num_sms(), n * triton.cdiv(c, bc))
                per_split = triton.cdiv(triton.cdiv(s, max(1, min(want, triton.cdiv(s, bs)))), bs) * bs
                configs.append(dict(best, BLOCK_C=bc, BLOCK_S=bs, SPLITS=triton.cdiv(s, per_split), num_warps=w))
            return _unique(configs)

        def apply(best):
            return [dict(best, BLOCK_C_APPLY=bc, BLOCK_S_APPLY=bs, num_warps_apply=w) for (bc, bs), w in choices]

        return [statistics, apply]

    def softmax_stages(self, kernel, rows, r):
        """The candidate softmax_fwd/bwd or cross_entropy_fwd/bwd configs at key (ROWS, R or C) as
        ``tune_launch`` stages: one, rows per program x block length x warps."""
        space = QUICK_SOFTMAX_SPACE if self.quick else SOFTMAX_SPACE
        block = tune.KERNELS[kernel][1][1]  # BLOCK_R or BLOCK_C
        row_counts = sorted({min(m, triton.next_power_of_2(rows)) for m in space["BLOCK_ROWS"]})
        lengths = sorted({min(b, triton.next_power_of_2(r)) for b in space["BLOCK_R"]})
        cap = MAX_SOFTMAX_TILE // _SOFTMAX_TILE_SHARE[kernel]
        configs = [{"BLOCK_ROWS": m, block: b, "num_warps": w} for m in row_counts for b in lengths
                   for w in space["num_warps"] if m * b <= cap and 2 <= m * b // (32 * w) <= 64]
        return [lambda best: configs]

    def map_stages(self, kernel, key):
        """The candidate map_contiguous (key (numel,)) or map_strided (key (ROWS, COLS,
        transposed)) configs as ``tune_launch`` stages: one, block (tile) sizes x warps."""
        space = QUICK_MAP_SPACE if self.quick else MAP_SPACE
        if kernel == "map_contiguous":
            tiles = [dict(BLOCK_SIZE=b) for b in space["BLOCK"]]
        else:
            rows, cols = triton.next_power_of_2(key[0]), triton.next_power_of_2(key[1])
            tiles = _unique([dict(BLOCK_R=min(rows, max(1, b // c)), BLOCK_C=min(cols, c))
                             for b in space["BLOCK"] for c in space["BLOCK_C"]])
        configs = [dict(t, num_warps=w) for t in tiles for w in space["num_warps"]
                   if 2 <= math.prod(t.values()) // (32 * w) <= 64]
        return [lambda best: configs]

    def reduce_stages(self, outer, r, inner):
        """The candidate reduce configs at key (outer, R, inner) as ``tune_launch`` stages: one,
        BLOCK_R x BLOCK_I tiles (rows: BLOCK_I 1) x warps."""
        space = QUICK_REDUCE_SPACE if self.quick else REDUCE_SPACE
        widths = [1] if inner == 1 else sorted({min(i, triton.next_power_of_2(inner)) for i in space["BLOCK_I"]})
        lengths = sorted({min(b, triton.next_power_of_2(r)) for b in space["BLOCK_R"]})
        tiles = [(b, i) for i in widths for b in lengths
                 if b * i in space["REDUCE_AREA"] or (b * i < min(space["REDUCE_AREA"]) and b == lengths[-1])]
        return [lambda best: [dict(BLOCK_R=b, BLOCK_I=i, num_warps=w) for b, i in tiles for w in space["num_warps"]
                              if 2 <= b * i // (32 * w) <= 64]]

    def _attn_space(self):
        return QUICK_ATTN_SPACE if self.quick else ATTN_SPACE

    def _fits(self, resident_rows, streamed_rows, scratch, bd):
        """Whether rows of the head dim (``bd`` wide) held for the whole program, rows loaded per
        pipeline stage and ``scratch`` elements (score tiles as dot operands) fit in shared memory."""
        return self.smem is None or ((resident_rows + streamed_rows) * bd + scratch) * self.dtype.itemsize <= self.smem


def _short_kv(lk, d, es):
    from .kernels.attention import short_kv  # the kernels import this module (tunable)

    return short_kv(lk, d, es)


def _fit(block, dim):
    return min(block, max(16, triton.next_power_of_2(dim)))


def _fitted(choices, **dims):
    """``choices`` with the block sizes of the fields named in ``dims`` cut to those dimensions."""
    return dict(choices, **{f: tuple(sorted({_fit(b, dim) for b in choices[f]})) for f, dim in dims.items()})


def _product(choices, base=None):
    """Every combination of ``choices`` (field -> values) over the config ``base``, without repeats."""
    return _unique([dict(base or {}, **dict(zip(choices, values))) for values in itertools.product(*choices.values())])


def _unique(configs):
    """``configs`` without repeats, in order."""
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def search_stages(ctx: Space, kernel: str, key: tuple) -> list:
    """The configs to try for ``kernel`` at shape ``key``, in stages: each a function from the
    fastest config found so far (at first the heuristic default) to the configs to try next. The
    tile-loop kernels: the GEMM space over (M, N, K) = ``key[:3]`` (cut to the kernel's fields), one
    stage; attention, the norms, softmax, cross-entropy, the elementwise maps and the reduction:
    their own."""
    if kernel == "attention_fwd":
        return [lambda best: ctx.attention_fwd_space(*key)]
    if kernel == "attention_bwd":
        return ctx.attention_bwd_stages(*key)
    if kernel in ("layer_norm_fwd", "layer_norm_bwd"):
        return ctx.layer_norm_stages(kernel, *key)
    if kernel in ("group_norm_fwd", "group_norm_bwd"):
        return ctx.group_norm_stages(*key)
    if kernel in _SOFTMAX_TILE_SHARE:
        return ctx.softmax_stages(kernel, *key)
    if kernel in ("map_contiguous", "map_strided"):
        return ctx.map_stages(kernel, key)
    if kernel == "reduce":
        return ctx.reduce_stages(*key)
    fields = tune.KERNELS[kernel][1]
    if not set(fields) <= {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}:
        raise LookupError(f"no candidate space for kernel {kernel!r} (config fields {list(fields)}): "
                          "add one to flame/autotune.py search_stages()")
    if kernel == "conv2d_wgrad_tma":
        # On the H200 (Triton 3.6) wgrad TMA configs with BLOCK_M = 256 or BLOCK_K = 128 gave wrong
        # weight gradients at 32x32 pixels (relative error 0.17, in a sweep of every config). The
        # kernel's indexing holds for any TH x TW = BLOCK_K tile (_spatial_tile), so the cause, likely
        # in the compiler's handling of those 4-D descriptor tiles, is not understood yet: they stay
        # out rather than reach untested shapes through the table's bucket fallback.
        return [lambda best: [c for c in ctx.gemm_space(*key[:3], group_m=False)
                              if c["BLOCK_M"] < 256 and c["BLOCK_K"] < 128]]
    # a kernel without some GEMM field (conv2d_fold: no BLOCK_K) takes the space's other choices
    return [lambda best: _unique([{f: v for f, v in c.items() if f in fields}
                                  for c in ctx.gemm_space(*key[:3], group_m="GROUP_M" in fields)])]
