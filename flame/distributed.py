"""Data parallelism over ``torch.distributed``: one process per GPU, started by ``torchrun``.

flame's autograd is its own, so torch's DistributedDataParallel (which hooks torch's autograd) does
not apply. The gradients flame trains -- LoRA adapters, 93 MB in fp32 for rank 16 on SDXL's
attention -- are small enough that one collective per optimizer step is all it takes:

- ``init(timeout)`` joins the process group that the launcher describes in the environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on GPUs (each
  process already on ``cuda:LOCAL_RANK``, see ``flame.runtime``), gloo on the CPU interpreter. A
  process started without those variables is a world of one, where everything here is a no-op.
  flame's generator is left alone: every rank draws the same numbers (a model's random init) until
  the caller gives each rank its own stream (``flame.ops.creation.set_rng_substream(rank)``).
- ``GradientBucket(params)``: one persistent flat fp32 buffer holding a view per parameter's
  gradient, a slot for the loss and one for a stop request. After each micro-batch one kernel adds
  the weighted gradients, the loss and the flag into it (``pack``); after the last, one collective
  sums it over the ranks (``all_reduce``). Optimizer and clipping read the summed views
  (``grads``), so every rank takes the same step from the same numbers. A non-finite loss or
  gradient on any rank is non-finite in the sum on every rank, so skipping such a step is decided
  alike everywhere.
- ``broadcast_`` (the same start on every rank), ``broadcast_object``, ``barrier``, ``all_reduce_``
  and ``check_same`` (a checksum compared across ranks: diverged weights fail loudly).

Faults. A watcher thread per rank records its host and process id in the launcher's store and
beats there every second. A collective that fails (gloo reports a closed connection at once)
raises ``PeerLostError`` naming the rank(s) whose process ended (same host) or whose heartbeat
stopped (another host). NCCL instead waits on the device for the lost rank, so once a peer is found
lost the watcher prints the same message and ends the process with exit status 1 (after any
``hold_exit`` block, e.g. rank 0 writing a checkpoint, is finished).
A rank that hangs while alive stops the others after ``timeout`` seconds, the collectives' own
timeout. Files are written atomically (``flame.train.checkpoints``), so an ended process never
leaves a half-written checkpoint that could be resumed from.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import math
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from . import runtime
from .autograd import GradientMap
from .kernels import elementwise as KE
from .kernels import optim as KO
from .ops.creation import set_rng_substream
from .tensor import Tensor

HEARTBEAT_S = 1.0  # how often each rank beats
SILENT_LOST_S = 60.0  # a rank on another host whose heartbeat stopped this long is lost
LEAVE_TIMEOUT_S = 10.0  # the most an exiting rank waits to leave the process group
_ALIGN = 4  # each gradient's segment starts on a 16-byte boundary


class PeerLostError(RuntimeError):
    """A collective failed because another rank's process ended, stopped answering or timed out."""


class World:
    """This process's place in the run: ``rank`` of ``size`` processes, ``local_rank`` on its host."""

    def __init__(self, rank=0, size=1, local_rank=0, backend=None):
        self.rank, self.size, self.local_rank, self.backend = rank, size, local_rank, backend

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def __repr__(self):
        return f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, backend={self.backend})"


_world = World()
_watch = None


def world() -> World:
    return _world


def init(timeout: float = 600.0) -> World:
    """Join the process group described by the environment (a no-op without ``WORLD_SIZE`` > 1,
    or when already joined). ``timeout``: seconds a collective waits for the other ranks."""
    global _world, _watch
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1 or dist.is_initialized():
        return _world
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={size} but {', '.join(missing)} unset: start the processes with torchrun "
                           "(torchrun --nproc-per-node N ...), which sets them")
    backend = "gloo" if runtime.is_interpreter() else "nccl"
    extra = {} if runtime.is_interpreter() else {"device_id": runtime.device}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(timeout)), **extra)
    _world = World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0") or 0), backend)
    _watch = _PeerWatch(dist.distributed_c10d._get_default_store(), _world.rank, _world.size)
    _watch.start()
    atexit.register(shutdown)
    return _world


def shutdown() -> None:
    """Leave the process group (this rank is done: its peers no longer watch it)."""
    global _world, _watch
    if _watch is not None:
        _watch.finish()
        _watch = None
    if dist.is_initialized():
        from .graphs import release_all  # a service beside this one (docs/design.md: imports against the order)
        release_all()  # first: NCCL work captured in a live graph makes leaving the group hang
        _leave_group()
    _world = World()
    set_rng_substream(0)


def _leave_group(timeout: float = LEAVE_TIMEOUT_S) -> None:
    """``destroy_process_group`` without hanging the exit: NCCL collectives captured in a CUDA graph
    can make it wait forever (pytorch/pytorch#115388; seen with ZeRO-2's reduce-scatters captured in
    the step), so it runs on a daemon thread and the process moves on after ``timeout`` seconds."""
    done = threading.Event()

    def leave():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        done.set()

    threading.Thread(target=leave, name="flame-leave-group", daemon=True).start()
    done.wait(timeout)


def hold_exit():
    """A context in which this rank finishes local work (writing a checkpoint) even when a peer is
    found lost meanwhile; the watcher ends the process only after it."""
    return _watch.holding() if _watch is not None else contextlib.nullcontext()


def _buffer(t):
    return t._data if isinstance(t, Tensor) else t


def _collective(what, fn):
    """Run a collective; a failure becomes a ``PeerLostError`` naming the lost rank(s) when known."""
    try:
        return fn()
    except (RuntimeError, dist.DistError) as e:
        lost = _watch.verdict(wait=3.0) if _watch is not None else None
        cause = f"{lost}" if lost else f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        raise PeerLostError(f"rank {_world.rank}: the {what} failed: {cause}") from e


def all_reduce_(t, op: str = "sum"):
    """Sum (or ``op``: "max", "min") ``t`` over the ranks, in place on every rank."""
    if _world.size > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        _collective("all-reduce", lambda: dist.all_reduce(_buffer(t), op=ops[op]))
    return t


def broadcast_(tensors, src: int = 0):
    """Overwrite ``tensors`` (flame or torch tensors) on every rank with rank ``src``'s values."""
    if _world.size > 1:
        for t in tensors:
            _collective("broadcast", lambda t=t: dist.broadcast(_buffer(t), src))
    return tensors


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    if _world.size <= 1:
        return obj
    box = [obj if _world.rank == src else None]
    _collective("broadcast", lambda: dist.broadcast_object_list(box, src))
    return box[0]


def barrier() -> None:
    if _world.size > 1:
        _collective("barrier", dist.barrier)


def check_same(tensors, what: str) -> None:
    """Raise when ``tensors`` differ between ranks (compares an fp32 sum of squares: one multi-tensor
    reduction and one collective; a host sync)."""
    if _world.size <= 1:
        return
    bufs = [_buffer(t) for t in tensors if _buffer(t).numel()]
    by_dtype = {}
    for b in bufs:
        by_dtype.setdefault(b.dtype, []).append(b)
    buckets = [(KO.Tables([((None, b, None, None), b.numel(), 0) for b in lst]), d) for d, lst in by_dtype.items()]
    norm = runtime.empty((), torch.float32)
    coef = runtime.empty((1,), torch.float32)
    KO.grad_norm_(buckets, norm, coef, 2.0, 1.0)
    high, low = runtime.empty((1,), torch.float32), runtime.empty((1,), torch.float32)
    KE.copy_(high, norm.reshape(1))
    KE.copy_(low, norm.reshape(1))
    all_reduce_(high, "max")
    all_reduce_(low, "min")
    high, low = high.item(), low.item()  # host transfer
    if high != low and not (math.isnan(high) and math.isnan(low)):
        raise RuntimeError(f"rank {_world.rank}: the ranks' {what} differ (checksums from {low!r} to {high!r}); "
                           "the run cannot go on consistently. Please report this with the config")


class GradientBucket:
    """The persistent flat fp32 buffer one collective sums (see the module doc).

    Layout: each parameter's gradient (in ``params`` order, each segment 16-byte aligned), then the
    loss, then the stop flag. ``grads`` maps every parameter to its view; ``loss`` is a 0-d view.
    """

    def __init__(self, params):
        self.params = list(params)
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += -(-p.numel() // _ALIGN) * _ALIGN
        self.flat = runtime.empty((total + 2,), torch.float32)
        KE.fill_(self.flat, 0)
        self.grads = GradientMap()
        self._views = []
        for p, off in zip(self.params, offsets):
            view = self.flat[off:off + p.numel()].view(p.shape)
            self._views.append(view)
            self.grads[p] = Tensor(view)
        self.loss = Tensor(self.flat[total:total + 1].view(()))
        self._flag = self.flat[total + 1:total + 2]
        self._tables = {}  # source pointers -> [(Tables, source dtype)]
        self._probes = []  # (host copy of the flag, event) of the last all-reduces, newest last

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * 4

    def _plan(self, grads, loss):
        srcs = []
        for p in self.params:
            g = grads.get(p)
            if g is None:
                raise RuntimeError(f"GradientBucket: no gradient for a parameter of shape {tuple(p.shape)}: every rank "
                                   "must produce a gradient for every parameter it trains")
            if g.shape != p.shape:
                raise RuntimeError(f"GradientBucket: a gradient of shape {tuple(g.shape)} for a parameter of shape "
                                   f"{tuple(p.shape)}")
            srcs.append(g._data if g._data.is_contiguous() else g.contiguous()._data)
        srcs.append(loss._data)
        key = tuple(s.data_ptr() for s in srcs)
        hit = self._tables.get(key)
        if hit is None:
            dsts = self._views + [self.loss._data]
            by_dtype = {}
            for d, s in zip(dsts, srcs):
                by_dtype.setdefault(s.dtype, []).append(((d, s, None, None), s.numel(), 0))
            hit = [(KO.Tables(rows), dtype) for dtype, rows in by_dtype.items()]
            if len(self._tables) >= 8:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = hit
        return hit, srcs

    def pack(self, grads, loss, weight: float, accumulate: bool, stop: bool = False) -> None:
        """flat = weight * [grads, loss] (``accumulate``: +=) and the stop flag = ``stop``, in one
        launch per gradient dtype. ``grads is None``: this rank had no samples (adds nothing)."""
        if grads is None:
            if not accumulate:
                KE.fill_(self.flat, 0)
            KE.fill_(self._flag, float(stop))
            return
        tables, _ = self._plan(grads, loss)
        for i, (t, dtype) in enumerate(tables):
            KO.axpby_(t, dtype, torch.float32, weight, 1.0 if accumulate else 0.0, self._flag if i == 0 else None,
                      float(stop))

    def all_reduce(self) -> None:
        """Sum the buffer over the ranks (one collective), then start copying the summed stop flag
        to the host, to be read a step later (``stop_requested``) without waiting for the device."""
        all_reduce_(self.flat)
        if runtime.is_interpreter():
            host, event = self._flag.tolist(), None  # host transfer (the interpreter's buffers are on the host)
        else:
            host = torch.empty((1,), dtype=torch.float32, pin_memory=True)
            host.copy_(self._flag, non_blocking=True)  # host transfer, no stream sync
            event = torch.cuda.Event()
            event.record()
        self._probes = (self._probes + [(host, event)])[-2:]

    def stop_requested(self) -> bool:
        """Whether any rank asked to stop in the all-reduce before the latest one (waits only for that
        one's copy, which the device has long finished when the latest step is queued). Every rank
        reads the same sum at the same step, so they stop together."""
        if len(self._probes) < 2:
            return False
        host, event = self._probes[0]
        if event is not None:
            event.synchronize()
        return bool(host[0] != 0)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class _PeerWatch(threading.Thread):
    """The heartbeat and liveness watcher of one rank (see the module doc)."""

    def __init__(self, store, rank, size):
        super().__init__(name="flame-peer-watch", daemon=True)
        self.store = dist.PrefixStore("flame-peers", store)
        self.rank, self.size = rank, size
        self.host = socket.gethostname()
        self.store.set(f"who/{rank}", json.dumps({"host": self.host, "pid": os.getpid()}))
        self._stop = threading.Event()
        self._peers = {}  # rank -> {"host", "pid"}
        self._beats = {}  # rank -> (last beat seen, monotonic time it changed)
        self._holding = 0  # > 0 while the main thread writes files that must be finished (``hold_exit``)
        self._lock = threading.Lock()

    def run(self):
        beat = 0
        while not self._stop.wait(HEARTBEAT_S):
            beat += 1
            try:
                self.store.set(f"beat/{self.rank}", str(beat))
            except Exception:  # the store's host is gone: a collective will fail and name it
                continue
            lost = self.verdict()
            if lost and not self._stop.is_set():
                # the main thread may be waiting on the device for a collective that never ends (NCCL):
                # end the process, after giving a failing collective (gloo) time to raise there first and
                # letting a file being written be finished
                self._stop.wait(2 * HEARTBEAT_S)
                while self._holding and not self._stop.is_set():
                    time.sleep(0.1)
                if not self._stop.is_set():
                    with contextlib.suppress(OSError):
                        os.write(2, f"\nrank {self.rank}: {lost}; stopping (exit status 1). Nothing half-written was "
                                    "kept: continue from the newest complete checkpoint with --resume\n".encode())
                    os._exit(1)

    @contextlib.contextmanager
    def holding(self):
        with self._lock:
            self._holding += 1
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1

    def verdict(self, wait: float = 0.0) -> str | None:
        """A sentence naming the lost ranks, or None when all look alive (polls up to ``wait`` s)."""
        deadline = time.monotonic() + wait
        while True:
            lost = self._lost()
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.2)

    def _lost(self):
        gone = []
        try:
            for r in range(self.size):
                if r == self.rank or self.store.check([f"done/{r}"]):
                    continue
                if r not in self._peers:
                    if not self.store.check([f"who/{r}"]):
                        continue
                    self._peers[r] = json.loads(self.store.get(f"who/{r}"))
                peer = self._peers[r]
                if peer["host"] == self.host:
                    if _process_gone(peer["pid"]):
                        gone.append(f"rank {r} (process {peer['pid']}) ended")
                    continue
                beat = self.store.get(f"beat/{r}") if self.store.check([f"beat/{r}"]) else b""
                seen, since = self._beats.get(r, (None, time.monotonic()))
                if beat != seen:
                    self._beats[r] = (beat, time.monotonic())
                elif time.monotonic() - since > SILENT_LOST_S:
                    gone.append(f"rank {r} on {peer['host']} has not answered for {SILENT_LOST_S:.0f} s")
        except Exception as e:  # the store lives with rank 0 (or torchrun's agent): its host is gone
            return f"the launcher's store is unreachable ({type(e).__name__}): rank 0 or its host is gone"
        return "; ".join(gone) or None

    def finish(self):
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")


__all__ = ["GradientBucket", "PeerLostError", "World", "all_reduce_", "barrier", "broadcast_", "broadcast_object",
           "check_same", "hold_exit", "init", "shutdown", "world"]
