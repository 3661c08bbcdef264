"""The run from its first step to its last: ``run(trainer)`` is what ``Trainer.train`` does.

It decides when each thing happens and keeps the run's surroundings; the trainer does the things
themselves. Before the steps: the kernels compiled ahead are waited for, a checkpoint is loaded
(``Trainer.load``) or an earlier run's files are cleared, config.yaml is written and the first line
says what trains. Around the steps (``_running``): the stop-signal handlers (``stops.StopSignals``),
the progress bar, the run's long-lived objects kept out of the cyclic collector. The steps
(``_steps``): ``Trainer.train_step``; every ``output.log_every`` steps and before checkpoints the
losses are read back (``flush``); validations (``Trainer.validate``), sample images (``sample``) and
checkpoints (``Trainer.save``) at their intervals; a stop request ends the run after its step with a
checkpoint, a second signal abandons the step in flight (the loader and RNG back at its start). After
them: the run's files, its LoRA or model (also of the moving average: ``trained.save``), and the
summary, or ``TrainingStopped``.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import time

import yaml

from .. import distributed, runtime
from ..kernels import launch, precompile
from ..ops.creation import get_rng_state, set_rng_state
from ..ops.shape import stack
from .config import to_dict
from .console import count
from .preflight import PRECISIONS
from .stops import stopped


def run(t) -> dict:
    """Run (or resume) the trainer ``t`` to ``t.total_steps`` (see ``Trainer.train``)."""
    _wait_for_kernels(t)
    first = _begin(t)
    with _running(t) as (started, started_at):
        checkpoint = _steps(t)
        distributed.barrier()  # no rank leaves (and torchrun stops none) before rank 0's checkpoint is written
    if t.run.stop is not None:
        error = stopped(t.run.stop, t.step, checkpoint)
        t.log(str(error))
        raise error
    if t.world.is_main:
        _save_files(t, started_at, checkpoint)
        _summary(t, t.step - first, time.perf_counter() - started, checkpoint)
    return {"step": t.step, "losses": [t.run.losses[s] for s in sorted(t.run.losses)],
            "val_losses": dict(t.run.val_losses), t.trained.kind: t.output_path(), "checkpoint": checkpoint}


def _wait_for_kernels(t) -> None:
    if t.compiling is None:
        return
    background, t.compiling = t.compiling, None
    ahead = background.wait()
    if ahead is None:
        t.log(f"train.compile_ahead failed ({background.error}); kernels compile on first use")
    elif ahead["variants"]:
        t.log(f"compiled {ahead['variants'] - ahead['failed']} kernels ahead in {ahead['seconds']:.1f} s")


def _begin(t) -> int:
    """The checkpoint loaded (or, from step 0, an earlier run's checkpoints and metrics cleared,
    which output.overwrite allowed at setup), config.yaml written, the first line; returns the step
    the run starts from."""
    c = t.cfg
    if t.resume_from is not None:
        t.load(*t.resume_from)
        t.log(f"resumed from {t.resume_from[0]} at step {t.step}")
    elif t.world.is_main:
        t.checkpoints.clear()
        t.metrics.remove()
    first = t.step
    if t.world.is_main:
        with open(os.path.join(t.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(c), f, sort_keys=False)
    todo = (count(t.total_steps, "step") if first == 0 else
            f"steps {first + 1}-{t.total_steps} of {t.total_steps}" if first < t.total_steps else
            f"no steps (the run finished at step {first} of {t.total_steps})")
    t.log(f"training {t.trained.describe()} on {count(len(t.loader.cache.split('train')), 'sample')}: {todo} "
          f"({c.train.precision}, {runtime.device_name()}"
          + (f", {t.world.size} processes, global batch {t.world.size * c.data.batch_size}"
             if t.world.size > 1 else "") + ")")
    return first


@contextlib.contextmanager
def _running(t):
    """The steps' surroundings; yields when they started (``time.perf_counter()``, ``time.time()``).
    A lost process becomes a ``TrainingError``."""
    handlers = t.signals.install()
    t.console.open(t.step)
    started = t.run.clock = time.perf_counter()
    started_at = time.time()
    # the model's, adapters' and optimizer's objects live for the whole run: kept out of the cyclic
    # collector's passes (gc.freeze), its full collections stop walking them every few eager steps
    gc.collect()
    gc.freeze()
    try:
        yield started, started_at
    except distributed.PeerLostError as e:
        raise t.checkpoints.peer_lost(e) from e
    finally:
        gc.unfreeze()  # a dropped trainer's objects become collectable again
        t.console.close()
        t.signals.restore(handlers)
        t.metrics.close()
        precompile.mark_compiled(launch.take_recorded())  # the next run's compile_ahead skips them


def _steps(t) -> str:
    """The steps, validations and checkpoints up to ``total_steps`` or a stop; returns the
    checkpoint saved last."""
    run, c = t.run, t.cfg
    if t.val_loader is not None and run.step == 0:
        t.validate()
    if t.samples is not None and run.step == 0 and c.sample.at_start:
        sample(t)
    while run.step < t.total_steps and run.stop is None:
        snapshot = (t.loader.state_dict(), get_rng_state())
        try:
            t.train_step()
            t.console.advance()
            _after_step(t)
        except KeyboardInterrupt:  # a second signal (or Ctrl-C without our handler)
            if t.world.size > 1:  # a rank cannot abandon a step alone: quit without saving
                raise
            if not run.step_done:  # abandoned before its update: back to the step boundary
                t.loader.load_state_dict(snapshot[0])
                set_rng_state(snapshot[1])
                run.step_done = True
            if run.stop is None:
                run.stop = ("interrupted", signal.SIGINT)
            break
    flush(t)
    if run.stop is None and t.val_loader is not None and run.step not in run.val_losses:
        t.validate()  # a last validation loss at the end of the run
    if run.stop is None and t.samples is not None and run.sampled != run.step:
        sample(t)  # samples of the final weights
    return t.save()


def _after_step(t) -> None:
    """What is due after the step just done: reading the losses, a validation, samples, a checkpoint."""
    run, c, s = t.run, t.cfg, t.step
    due_save = c.output.save_every and s % c.output.save_every == 0
    if s % c.output.log_every == 0 or s == t.total_steps or due_save:
        flush(t)
    if run.stop is None and t.val_loader is not None and s % c.output.validate_every == 0:
        t.validate()
    every = c.sample.every_n_steps
    if run.stop is None and t.samples is not None and every and s % every == 0:
        sample(t)
    if run.stop is None and due_save and s < t.total_steps:
        t.save()


def flush(t) -> None:
    """Read the pending losses (one host sync), record and show them, and stop on a non-finite one."""
    run = t.run
    if not run.pending:
        return
    pending = run.pending
    values = stack([p[1] for p in pending]).numpy()
    norms = [p[2] for p in pending]
    norm_values = stack(norms).numpy() if all(n is not None for n in norms) else [None] * len(pending)
    now = time.perf_counter()
    its = len(pending) / max(now - run.clock, 1e-9)
    run.clock = now
    records, bad, average = [], None, run.average
    for (step, _, _, lr, epoch), value, norm in zip(pending, values, norm_values):
        value = float(value)
        rec = {"step": step, "loss": value, "loss_smooth": run.smoothed(value), "lr": lr, "epoch": epoch}
        if norm is not None:
            rec["grad_norm"] = float(norm)
        records.append(rec)
        if bad is None and not math.isfinite(value):
            bad = (step, value)
    t.trained.check_same(f"at step {pending[-1][0]}")
    speed = {"step": pending[-1][0], "it_s": its}
    if not runtime.is_interpreter():
        speed["max_memory_gb"] = runtime.max_memory_allocated() / 2 ** 30
    try:
        with t.signals.deferred():  # the records are written once: never twice, never half
            t.metrics.write(records + [speed])
            run.pending = []
            run.losses.update((rec["step"], rec["loss"]) for rec in records)
    finally:
        if run.pending:  # not written: the next flush makes these records again
            run.average = average
    t.console.show(records[-1], its, speed.get("max_memory_gb"), run.val_losses)
    if bad is not None:
        run.stop = ("non_finite", bad)


def sample(t) -> None:
    """Images of the sample prompts from the current weights, their paths into metrics.jsonl."""
    folder = os.path.join(t.out_dir, "samples")
    try:
        paths = t.samples.render_in_run(t.model, t.step, folder, t.ema if t.cfg.sample.use_ema else None, t.text)
    except OSError as e:
        raise t.checkpoints.write_error(e, "sample images", folder) from e
    t.metrics.images(t.step, paths)
    t.console.say(f"step {t.step}: {count(len(paths), 'sample')} in {os.path.dirname(paths[0])}")
    t.run.sampled = t.step


def _save_files(t, started_at, checkpoint) -> None:
    """The run's file (LoRA or model) and, with ``ema.decay``, that of the moving average (rank 0);
    ``checkpoint``: the one saved last, which a sharded run's file is made from."""
    c = t.cfg
    meta = t.trained.metadata(t.step, len(t.loader.cache.split("train")), started_at, time.time(), t.datasets,
                              type(t.optimizer).__name__)
    for path, averaged in ((t.output_path(), False), (t.output_path(ema=True), True)):
        if averaged and t.ema is None:
            continue
        try:
            with t.ema.applied() if averaged else contextlib.nullcontext():
                t.trained.save(path, PRECISIONS[c.output.save_dtype], meta, None if averaged else checkpoint)
        except OSError as e:
            raise t.checkpoints.write_error(e, t.trained.what, path) from e


def _summary(t, steps, seconds, checkpoint) -> None:
    lines = t.console.results(t.run, steps, seconds)
    lines += t.trained.summary_lines(t.output_path())
    if t.ema is not None:
        lines.append(f"  moving average (decay {t.cfg.ema.decay:g}): {t.output_path(ema=True)}")
    lines += [f"  checkpoint: {checkpoint} (--resume continues from it)", f"  metrics: {t.metrics.path}",
              t.trained.usage_line(t.output_path())]
    t.log("\n".join(lines))
