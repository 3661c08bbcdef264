"""How a run ends before its last step: the errors ``Trainer.train`` raises (``TrainingStopped``
after saving a checkpoint, ``TrainingError`` when it could not go on) and the stop signals
(``StopSignals``: SIGINT / SIGTERM while it runs; the protocol is in ``flame.train.trainer``'s
docstring).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading


class TrainingStopped(RuntimeError):
    """The run stopped before its last step (``reason``: "interrupted" by the signal ``signum``, or
    "non_finite"); a checkpoint of the last good state was saved at ``checkpoint``."""

    def __init__(self, message, reason, step, checkpoint, signum=None):
        super().__init__(message)
        self.reason, self.step, self.checkpoint, self.signum = reason, step, checkpoint, signum


class TrainingError(RuntimeError):
    """The run could not go on (a file could not be written, e.g. a full disk); the message says what
    was kept and what to do."""


def stopped(stop, step: int, checkpoint: str) -> TrainingStopped:
    """The ``TrainingStopped`` of a run that stopped at ``step`` for ``stop`` (``RunState.stop``)
    after saving ``checkpoint``, with the message that says what to do."""
    reason, info = stop
    if reason == "non_finite":
        msg = (f"stopped: the loss at step {info[0]} is {info[1]} (non-finite). Updates with a non-finite "
               f"loss or gradient were skipped, so the checkpoint {checkpoint} (step {step}) holds finite "
               "weights; lower train.lr, use train.precision=fp32 or fp16, or check the cache for bad latents")
        return TrainingStopped(msg, reason, step, checkpoint, None)
    msg = (f"interrupted at step {step} ({signal.Signals(info).name}): checkpoint saved to "
           f"{checkpoint}; continue with --resume (resume=latest)")
    return TrainingStopped(msg, reason, step, checkpoint, info)


class StopSignals:
    """SIGINT / SIGTERM during a run of ``world_size`` processes, recorded in ``run`` (a ``RunState``).

    One process: the first asks for a checkpoint at the end of this step (``run.stop``); the next one
    abandons the step (``KeyboardInterrupt``), after the weight update when it is under way (inside
    ``deferred()``). Several: the first is this rank's stop request (``requested``; the ranks stop
    together, see ``Trainer.train_step``), the second changes nothing and the third quits without
    saving."""

    def __init__(self, run, world_size: int):
        self.run, self.world_size = run, world_size
        self.requested, self.seen = None, 0  # several processes: this rank's stop request, signals seen
        self._deferring, self._deferred = 0, False

    def handle(self, signum, frame):
        """The signal handler (see the class docstring)."""
        if self.world_size > 1:
            self.seen += 1
            if self.seen == 1:
                self.requested = signum
                _notice(f"\n{signal.Signals(signum).name}: the {self.world_size} processes finish the step they agree "
                        "on and save a checkpoint (a third signal quits without saving)\n")
            elif self.seen >= 3:
                raise KeyboardInterrupt
            return
        if self.run.stop is None:
            self.run.stop = ("interrupted", signum)
            _notice(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint (again: stop "
                    "sooner, saving the last finished step)\n")
        elif self._deferring:
            self._deferred = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        """Inside, a stop signal that would interrupt waits until the block is done (a few launches)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    def install(self) -> dict:
        """Handle SIGINT and SIGTERM (from the main thread only); returns the handlers to ``restore``."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def restore(handlers: dict) -> None:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _notice(text):
    """Write ``text`` to stderr from a signal handler (no Python-level buffers: no reentrancy)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
