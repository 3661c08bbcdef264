#!/usr/bin/env python3
"""Where flame's host time goes: cProfile of a chain of small ops (forward and backward; with
``--stub`` its launches left out, so that flame's own path and torch's allocations are timed
alone on a GPU host too), or
with ``--sdxl`` of one SDXL LoRA training step with every kernel launch left out (with
``--inference``: one no-grad UNet forward at batch 2, a guided text-to-image step's, instead).

    PYTHONPATH=. python3 scripts/profile_host.py [--iters 200] [--top 25] [--stub]
    PYTHONPATH=. python3 scripts/profile_host.py --sdxl [--inference] [--resolution 1024] [--top 25]

    PYTHONPATH=. python3 scripts/profile_host.py --sdxl --against ../other-checkout [--rounds 6]
    PYTHONPATH=. FLAME_DEVICE=cuda python3 scripts/profile_host.py --launcher

``--launcher`` (GPU) times Triton's C launcher alone on one compiled kernel with 4 tensor arguments,
given the tensors (what flame's direct path passes it: the launcher calls each one's ``data_ptr`` and
asks the driver whether the address is a device one), their addresses as ints (neither), and addresses
read in Python first, beside a whole torch op for scale: microseconds a launch, medians of 30 rounds of
500 launches.

``--sdxl`` runs on the interpreter (no GPU needed) with the launcher stubbed out: shapes, buffers
and the graph are real, no kernel runs (the values are garbage), routed as on a 132-SM Hopper
card (TMA paths, split-K). Launches take a GPU's host path (``launch.py``'s direct path: key,
cache lookup, current stream, the compiled kernel's launcher, here a counter), so the count
includes what ``launch`` itself costs; Triton's own launcher (C, plus its Python wrapper and TMA
descriptor encoding) is left out. It prints the launches per kernel of one eager step (forward,
backward, AdamW on rank-16 LoRA on attn, bf16; the first step also zero-fills the optimizer's
state and builds the timestep embedding's tables: 2,249 launches that later steps skip), the
median host time of ``--steps`` more and the host profile of one (``--sort cumulative`` for the
callers' view), headed by the count of Python and builtin calls in that step per launch: a GPU-free
count of what a change adds or removes, exact where the times drift with the machine. Host times are this
machine's, not a GPU host's. ``--inference`` does the same for what each of the text-to-image
pipeline's steps runs (``pipeline.sdxl.denoise`` with guidance: the UNet without LoRA over the
unconditional and conditional rows, under ``no_grad``). On a GPU (``FLAME_DEVICE=cuda``) ``--sdxl``
runs the same step with its kernels (random weights): the median wall time of a synchronised step
and the host profile of one, where the eager step's host time goes on that machine.

``--sdxl --against DIR`` compares this checkout's step with another checkout's (DIR: a worktree or
``git archive`` of another commit): ``--rounds`` rounds, each running both checkouts' own
``profile_host.py --sdxl`` in turn (every other round in reverse order), then each round's ratio of
their host times and the medians. A CI-class machine's speed drifts by 10-15% within an hour, more
than most host-path changes move the step: compare two trees so, in one run, not across runs.
"""
import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for common (it puts the checkout on the path)
import common  # first: imports flame, which selects the backend

import flame


class _StubCompiled:
    """What ``launch.py``'s direct path takes from a compiled kernel, with a ``run`` that only counts."""

    def __init__(self, name, counts):
        self.name, self.counts = name, counts
        self.function = self.packed_metadata = None

    def run(self, *args):
        self.counts[self.name] += 1


def stub_launches(counts):
    """Leave every kernel launch out, counting them per kernel name in ``counts``, along the host
    path of a GPU (``launch.py``'s direct path: key, cache lookup, current stream, the compiled
    kernel's launcher), not the interpreter's: the first launch of each key goes "through Triton"
    (here: counted, and a stub compiled kernel kept), later ones straight to the stub's ``run``."""
    import types

    from flame.kernels import launch as L

    compiled = {}

    def through_triton(kernel, grid, launch_args, meta):
        name = getattr(kernel, "fn", kernel).__name__
        counts[name] += 1
        if name not in compiled:
            compiled[name] = _StubCompiled(name, counts)
        return compiled[name]

    L._through_triton = through_triton
    L._direct = True
    L._driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                                   get_current_stream=lambda device: 0))


def sdxl_setup(args):
    """The stubbed SDXL step (see ``sdxl_step``): ``(step, counts)``, ``counts`` the launches per
    kernel name so far. ``args.inference``: the pipeline's guided no-grad UNet forward instead of
    the LoRA training step."""
    import collections

    from bench_sdxl import CHECKPOINT_SCOPES, inputs_shape

    from flame import amp, nn, optim
    from flame.kernels import matmul as KM
    from flame.models import SDXLUNet
    counts = collections.Counter()
    if flame.is_interpreter():
        stub_launches(counts)
        flame.runtime.num_sms = lambda: 132
        KM.TMA, KM.tma_available = True, lambda: True
    model = SDXLUNet(dtype=flame.bfloat16)
    model.requires_grad_(False)
    args.batch = 2 if args.inference else 1  # guidance: the unconditional and conditional rows in one batch
    shapes = inputs_shape(args, model.config)
    sample, context, pooled, time_ids = (flame.randn(*s, dtype=flame.bfloat16) for s in shapes)
    if args.inference:
        timesteps = flame.full((args.batch,), 500.0, dtype=flame.float32)  # as pipeline.stages.sampler_loop

        def step():
            with flame.no_grad():
                model(sample, timesteps, context, pooled, time_ids)
    else:
        nn.inject_lora(model, "attn", rank=16, alpha=16)
        if args.checkpointing != "off":
            model.enable_gradient_checkpointing(True, scope=CHECKPOINT_SCOPES[args.checkpointing])
        params = nn.lora_parameters(model)
        opt = optim.AdamW(params, lr=1e-4)
        adapter_casts = amp.ParameterCasts(params, flame.bfloat16)  # as the trainer

        def step():
            with adapter_casts:
                pred = model(sample, flame.full((1,), 500, dtype=flame.int64), context, pooled, time_ids)
                loss = flame.nn.functional.mse_loss(pred.to(flame.float32), sample.to(flame.float32))
                grads = loss.backward()
            opt.step(grads)

    if not args.no_freeze:  # as the trainer: the run's long-lived objects out of the cyclic collector's passes
        import gc
        gc.collect()
        gc.freeze()
    return step, counts


def sdxl_step(args):
    """One stubbed SDXL step (training, or with ``--inference`` the pipeline's UNet forward):
    launches per kernel, then a profiled later step."""
    step, counts = sdxl_setup(args)
    stubbed = flame.is_interpreter()
    counts.clear()
    step()
    if args.inference:
        what, setting = "UNet forward (no grad, batch 2)", ""
    else:
        what, setting = "step", f", checkpointing {args.checkpointing}"
    if stubbed:
        print(f"one eager SDXL {'LoRA step' if what == 'step' else what}, {args.resolution}x{args.resolution}"
              f"{setting}: {sum(counts.values())} launches")
        for name, n in counts.most_common(args.top):
            print(f"  {n:6d}  {name}")
    times = common.wall_times(step, args.steps, warmup=1)
    if times:
        ran = "no kernel runs" if stubbed else f"kernels run on {flame.device_name()}, synchronised"
        print(f"host time of an eager {what} ({ran}), median of {len(times)}: "
              f"{1e3 * statistics.median(times):.1f} ms")
    if not stubbed and times:  # how much of that the host alone takes: until step() returns, unsynchronised
        issued = common.wall_times(step, args.steps, sync=lambda: None)
        flame.synchronize()
        print(f"  of which the host issuing the step's launches: {1e3 * statistics.median(issued):.0f} ms "
              f"(median of {len(issued)}; the rest waits for the kernels)")
    from flame.kernels import launch as L
    before = L.launches
    prof = cProfile.Profile()
    prof.enable()
    step()
    flame.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    launched = L.launches - before
    # a count, so free of the machine's speed: what a host-path change removes shows here exactly
    print(f"Python and builtin calls in the profiled {what}: {stats.total_calls} for its {launched} launches "
          f"({stats.total_calls / max(launched, 1):.1f} a launch)")
    stats.sort_stats(args.sort).print_stats(args.top)


def launcher_probe():
    """``--launcher``: Triton's C launcher with tensor and with int pointer arguments (see above)."""
    import time

    import torch
    import triton
    import triton.language as tl

    from flame.kernels import launch as L

    @triton.jit
    def add3(a, b, c, d, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(d + i, tl.load(a + i, mask=m) + tl.load(b + i, mask=m) + tl.load(c + i, mask=m), mask=m)

    x = [torch.randn(256, device="cuda") for _ in range(4)]
    run, function, lead, consts, _ = L._entry(add3[(1,)](*x, 256, BLOCK=256), (256,))
    stream = torch.cuda.current_stream().cuda_stream
    addresses = [t.data_ptr() for t in x]
    ways = {"tensors": lambda: run(1, 1, 1, stream, function, *lead, *x, 256, *consts),
            "ints": lambda: run(1, 1, 1, stream, function, *lead, *addresses, 256, *consts),
            "ints read in Python": lambda: run(1, 1, 1, stream, function, *lead, *[t.data_ptr() for t in x], 256,
                                               *consts),
            "torch.add(out=) (for scale: a whole torch op, its launch included)":
                lambda: torch.add(x[0], x[1], out=x[3])}
    for name, fn in ways.items():
        rounds = []
        for _ in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            rounds.append((time.perf_counter() - t0) / 500 * 1e6)
        torch.cuda.synchronize()
        what = name if name.startswith("torch") else f"Triton's C launcher, 4 pointer arguments as {name}"
        print(f"{what}: {statistics.median(rounds):.2f} us a launch")


def against(args):
    """``--against DIR``: this checkout's and DIR's stubbed step, alternately (see the docstring)."""
    import re
    import subprocess

    options = ["--sdxl", "--top", "0", "--steps", str(args.steps), "--resolution", str(args.resolution),
               "--checkpointing", args.checkpointing] + (["--inference"] if args.inference else []) + \
        (["--no-freeze"] if args.no_freeze else [])
    sides = {"this": Path(__file__).resolve().parents[1], "other": Path(args.against).resolve()}
    if not (sides["other"] / "scripts" / "profile_host.py").is_file():
        raise SystemExit(f"--against {args.against}: no scripts/profile_host.py there (a checkout of flame?)")
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            root = sides[name]
            done = subprocess.run([sys.executable, str(root / "scripts" / "profile_host.py"), *options], cwd=root,
                                  capture_output=True, text=True)
            found = re.search(r"host time of an eager .*: ([0-9.]+) ms", done.stdout)
            if done.returncode or found is None:
                raise SystemExit(f"{root}: profile_host.py failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
            times[name].append(float(found.group(1)))
        print(f"round {r + 1}: this {times['this'][-1]:.1f} ms, other {times['other'][-1]:.1f} ms, "
              f"this / other {times['this'][-1] / times['other'][-1]:.3f}", flush=True)
    ratios = [a / b for a, b in zip(times["this"], times["other"])]
    this, other = statistics.median(times["this"]), statistics.median(times["other"])
    print(f"medians of {args.rounds} rounds: this {this:.1f} ms ({sides['this']}), other {other:.1f} ms "
          f"({sides['other']}), this / other {statistics.median(ratios):.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative, ncalls)")
    ap.add_argument("--sdxl", action="store_true", help="one SDXL LoRA step on stubbed launches (see above)")
    ap.add_argument("--inference", action="store_true",
                    help="--sdxl: the text-to-image pipeline's guided UNet forward (no grad, batch 2) instead")
    ap.add_argument("--resolution", type=int, default=1024, help="--sdxl: image side in pixels")
    ap.add_argument("--checkpointing", choices=["off", "on", "ff"], default="off", help="--sdxl: as bench_sdxl.py")
    ap.add_argument("--steps", type=int, default=5, help="--sdxl: unprofiled steps timed after the first")
    ap.add_argument("--no-freeze", action="store_true",
                    help="--sdxl: keep the model's objects in the cyclic collector's passes (the trainer freezes them)")
    ap.add_argument("--stub", action="store_true",
                    help="the chain with every kernel launch left out (as --sdxl does): flame's own host path and "
                         "torch's allocations alone, on the GPU host too")
    ap.add_argument("--against", metavar="DIR",
                    help="--sdxl: compare with the checkout in DIR, alternately in one run (see above)")
    ap.add_argument("--rounds", type=int, default=4, help="--against: rounds of the two checkouts")
    ap.add_argument("--launcher", action="store_true", help="Triton's C launcher alone, tensors against ints (GPU)")
    args = ap.parse_args()
    if args.launcher:
        return launcher_probe()
    if args.against:
        if not args.sdxl:
            ap.error("--against needs --sdxl")
        if args.steps < 1 or args.rounds < 1:
            ap.error("--against needs --steps and --rounds of at least 1")
        return against(args)
    if args.sdxl:
        return sdxl_step(args)
    if args.stub:
        import collections
        stub_launches(collections.Counter())
    x = flame.randn(64, 64)
    w = flame.randn(64, 64, requires_grad=True)
    b = flame.randn(64, requires_grad=True)

    def chain():
        y = x
        for _ in range(10):
            y = flame.exp(flame.tanh(y * w + b)) * 0.3
        return y.sum()

    def forward():
        with flame.no_grad():
            chain()

    def step():
        chain().backward()

    launches = "launches left out" if args.stub else "launches"
    for what, fn in (("fwd no_grad", forward), ("fwd+bwd", step)):
        per_op = common.host_us_per_op(fn, 20, args.iters, ops=51)
        print(f"{what}: {per_op:.2f} us per forward op (51 ops per chain, {launches}) on {flame.device_name()}")
    per_alloc = common.host_us_per_op(lambda: flame.runtime.empty((64, 64), flame.float32), 200, 20 * args.iters)
    print(f"of which an op's output allocation (runtime.empty, 64x64 fp32): {per_alloc:.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step()
    flame.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
