"""What a run shows and records as it goes: ``Console`` (the tqdm progress bar with the last read
step's loss, smoothed loss, lr, speed, memory and validation loss, or without a bar a log line per
read of the losses; lines said above the bar; the closing summary's first lines) and ``MetricsFile``
(output.dir/metrics.jsonl, which resuming reads back, and the trackers of ``output.report_to``).
Ranks other than 0 show nothing (their log is ``quiet``) and write no metrics.
"""
from __future__ import annotations

import json
import os

from ..io import atomic_write


def count(n, word) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def duration(seconds) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def quiet(*args, **kwargs):
    """The log of ranks other than 0: they print nothing (rank 0 says the same)."""


class Console:
    """The run's lines for the user: ``log`` (a print-like callable), a tqdm bar while the steps run
    (``progress``: True, False, or None for "when stderr is a terminal"), ``total_steps`` for the
    bar and the log lines."""

    def __init__(self, log, progress, total_steps: int):
        self.log, self.progress, self.total_steps = log, progress, total_steps
        self.bar = None
        self.step_fields = {}  # the bar's fields of the step whose loss was read last

    def open(self, initial: int) -> None:
        """The progress bar from step ``initial`` (none when ``progress`` says so)."""
        from tqdm import tqdm
        self.step_fields = {}
        bar = tqdm(total=self.total_steps, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if self.progress is None else not self.progress)
        self.bar = None if bar.disable else bar

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def advance(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def say(self, text) -> None:
        """A line for the user, above the progress bar when there is one."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            self.log(text)

    def show(self, rec, its, mem, val_losses) -> None:
        """The bar's fields (a log line without a bar) of the metrics record ``rec`` of the step read
        last: its loss, the smoothed loss, lr, speed ``its``, memory ``mem`` (GiB or None), and the
        latest of ``val_losses``."""
        self.step_fields = {"loss": f"{rec['loss']:.4f}", "smoothed": f"{rec['loss_smooth']:.4f}",
                            "lr": f"{rec['lr']:.3g}", "it/s": f"{its:.2f}"}
        if mem is not None:
            self.step_fields["mem"] = f"{mem:.1f}G" if mem >= 1 else f"{mem * 1024:.0f}M"
        fields = self.fields(val_losses)
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=True)
        else:
            self.log(f"step {rec['step']}/{self.total_steps}  " + "  ".join(f"{k} {v}" for k, v in fields.items()))

    def show_validation(self, val_losses) -> None:
        """A validation runs after its step's losses are read: the bar shows its loss at once."""
        if self.bar is not None:
            self.bar.set_postfix(self.fields(val_losses), refresh=True)

    def fields(self, val_losses) -> dict:
        """The fields shown: the last read step's and the latest of ``val_losses``."""
        fields = dict(self.step_fields)
        if val_losses:
            fields["val"] = f"{val_losses[max(val_losses)]:.4f}"
        return fields

    def results(self, run, steps: int, seconds: float) -> list:
        """The summary's first lines: ``steps`` steps of the run ``run`` (a ``RunState``) took
        ``seconds``; its smoothed and last training loss, its first and last validation losses."""
        rate = f", {steps / seconds:.2f} steps/s" if steps and seconds > 0 else ""
        lines = [f"done: {count(steps, 'step')} in {duration(seconds)}{rate}, step {run.step} of {self.total_steps}"]
        if run.average[1]:
            last = max(run.losses) if run.losses else None
            lines.append(f"  training loss (smoothed): {run.smoothed():.4f}"
                         + (f" (step {last}: {run.losses[last]:.4f})" if run.losses else ""))
        val = run.val_losses
        if val:
            first, last = min(val), max(val)
            lines.append(f"  validation loss: {val[last]:.4f} at step {last}"
                         + (f" ({val[first]:.4f} at step {first})" if first != last else ""))
        return lines


class MetricsFile:
    """``path`` (output.dir/metrics.jsonl) and ``trackers`` (``outputs.Trackers``), written by rank 0
    alone (``main``); ``write_error(e, what, where)`` makes the exception a failed write raises."""

    def __init__(self, path, trackers, main: bool, write_error):
        self.path, self.trackers, self.main, self.write_error = path, trackers, main, write_error

    def write(self, records) -> None:
        """Append ``records`` to metrics.jsonl in one write, and send them to the trackers."""
        if not self.main:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json_lines(records))
        except OSError as e:
            raise self.write_error(e, "metrics", self.path) from e
        self.trackers.log(records)

    def images(self, step: int, paths) -> None:
        """Sample images of ``step``: their paths into metrics.jsonl, the images to the trackers."""
        self.write([{"step": step, "samples": paths}])
        self.trackers.log_images(step, paths)

    def trim(self, step: int, log) -> list:
        """Keep the records up to ``step`` (later ones belong to the run that was cut short; a line cut
        off by a crash mid-write is dropped, and ``log`` says so); returns them."""
        if not os.path.isfile(self.path):
            return []
        kept, damaged = [], 0
        with open(self.path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                    damaged += 1
                elif rec["step"] <= step:
                    kept.append(rec)
        if damaged:
            log(f"{self.path}: dropped {count(damaged, 'damaged line')} (a crash while writing)")
        atomic_write(self.path, lambda f: f.write(json_lines(kept).encode()))
        return kept

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def close(self) -> None:
        self.trackers.close()


def json_lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)
