"""CUDA-graph capture and replay of a whole function, e.g. a training step's forward and backward.

An eager step pays ~20-60 µs of Python per op (recording the graph node, choosing and launching
the kernel); an SDXL step runs thousands of ops, so the GPU would wait on the host most of the
time. ``CapturedStep(fn)`` runs ``fn`` once eagerly (compiling every kernel it needs), captures
it into a CUDA graph on its second call, and from then on *replays* the graph: the same kernels
with the same arguments, launched by the driver in one call, with no Python in between.

What replay means for ``fn``:

- Inputs: ``fn`` takes flame Tensors (and optionally plain Python values). Each call copies the
  tensors into static buffers that the graph reads; a call whose tensor shapes, dtypes or
  non-tensor arguments differ gets its own graph (e.g. one per aspect bucket). All graphs share
  one memory pool, so they cost the memory of the largest, not the sum.
- Outputs: whatever ``fn`` returned during capture (tensors, a ``GradientMap``, tuples/lists/
  dicts of them) is returned by every replay, its buffers overwritten in place. Use (or copy) the
  results before the next call.
- Everything ``fn`` does on the host happens only during capture: Python-side counters, host
  syncs (``.item()``, printing values) and host-to-device copies must stay outside ``fn``, and
  scalar kernel arguments (a learning rate, say) are frozen into the graph. Random numbers drawn
  inside ``fn`` would replay identically every step; draw noise outside and pass it in.
- Parameters read by ``fn`` are read from their buffers at replay time, so updating them in
  place (as flame's optimizers do) between calls is seen by the next replay.

The graph rules are checked by flame itself (``runtime.graph_rules``): flame's host reads
(``Tensor.numpy``, ``.tolist``, ``.item`` and what uses it, printing values, ``check_errors``),
``runtime.synchronize``, ``flame.tensor`` of host data and every draw from flame's generator raise
``GraphRuleError``, naming the step and the action, inside the capture. On the interpreter backend
(no GPU) ``CapturedStep`` calls ``fn`` every time, under the same rules from a signature's second
call on (the calls a GPU would capture and replay), so CPU tests catch what would break on a GPU.
"""
from __future__ import annotations

import gc
import weakref

import torch

from . import runtime
from .autograd import GradientMap
from .kernels import elementwise as KE
from .runtime import GraphRuleError
from .tensor import Tensor

__all__ = ["CapturedStep", "GraphRuleError"]

_pool = None
_steps = weakref.WeakSet()  # every CapturedStep alive, for release_all


def _shared_pool():
    global _pool
    if _pool is None:
        _pool = torch.cuda.graph_pool_handle()
    return _pool


def _name(fn) -> str:
    """``fn``'s name in errors: ``Class.method`` of a bound method, else its qualified name."""
    name = getattr(fn, "__name__", type(fn).__name__)
    owner = getattr(fn, "__self__", None)
    return f"{type(owner).__name__}.{name}" if owner is not None else getattr(fn, "__qualname__", name)


def _signature(args):
    return tuple((a.shape, a.dtype, a._data.stride()) if isinstance(a, Tensor) else ("value", a) for a in args)


class _Graph:
    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class CapturedStep:
    """``fn(*args)`` eagerly on the first call per input signature, captured on the second, replayed
    after that (see the module docstring). ``enabled=False`` always calls ``fn``; so does the
    interpreter, under the graph rules from a signature's second call on."""

    def __init__(self, fn, enabled: bool = True):
        self.fn = fn
        self.name = _name(fn)
        self.enabled = enabled
        self._graphs = {}
        self._seen = set()
        _steps.add(self)

    @property
    def enabled(self) -> bool:
        """Whether calls are captured and replayed: as asked, on a GPU (always False on the interpreter)."""
        return self._wanted and not runtime.is_interpreter()

    @enabled.setter
    def enabled(self, value: bool):
        self._wanted = bool(value)  # on the interpreter too: the calls a GPU would capture are checked

    def __call__(self, *args):
        if not self._wanted:
            return self.fn(*args)
        key = _signature(args)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:  # warm-up: compiles kernels, fills launch caches
                self._seen.add(key)
                return self.fn(*args)
            if runtime.is_interpreter():  # no graph: the call a GPU would capture or replay, under its rules
                with runtime.graph_rules(self.name):
                    return self.fn(*args)
            entry = self._graphs[key] = self._capture(args)
        for static, a in zip(entry.inputs, args):
            if static is not None and static._data.data_ptr() != a._data.data_ptr():
                KE.copy_(static._data, a._data)
        entry.graph.replay()
        return entry.outputs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Free this step's CUDA graphs; a later call captures anew."""
        for entry in self._graphs.values():
            entry.graph.reset()
        self._graphs.clear()

    def _capture(self, args):
        statics = []
        for a in args:
            if isinstance(a, Tensor):
                buf = runtime.empty_strided(a.shape, a._data.stride(), a.dtype)
                statics.append(Tensor(buf, requires_grad=a.requires_grad))
            else:
                statics.append(None)
        call_args = [s if s is not None else a for s, a in zip(statics, args)]
        runtime.synchronize()
        graph = torch.cuda.CUDAGraph()
        # Garbage from earlier steps (a dropped trainer's graphs, held in reference cycles) must not
        # be freed mid-capture: destroying a CUDA graph while a stream captures invalidates the
        # capture. Collect it now and keep the cyclic collector off until the capture ends.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=_shared_pool()), runtime.graph_rules(self.name):
                outputs = self.fn(*call_args)
        except BaseException as e:  # a broken rule, a failed capture, Ctrl-C: leave no half-made capture behind
            _reset_capture_state()
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise torch.cuda.OutOfMemoryError(
                    f"CapturedStep({self.name}): out of device memory while capturing the step ({e}). The "
                    "captured step's buffers come from a pool of their own, besides the memory eager steps "
                    "left cached; use less memory (a smaller batch, checkpointing, fp8 weights, streamed "
                    "blocks) or run without the CUDA graph") from e
            if isinstance(e, RuntimeError) and not isinstance(e, GraphRuleError):  # the device refused
                raise RuntimeError(f"CapturedStep({self.name}): capturing the step failed ({e}). A captured "
                                   "function must not synchronize with the host (.item(), .numpy(), printing "
                                   "values) or copy host data to the device; move that outside the step.") from e
            raise
        finally:
            if collecting:
                gc.enable()
        _check_outputs(outputs)
        return _Graph(graph, statics, outputs)


def release_all() -> None:
    """Free every CapturedStep's CUDA graphs (after the device finishes its work). Leaving a NCCL
    process group waits forever while graphs that captured its collectives live
    (pytorch/pytorch#115388): ``flame.distributed.shutdown`` calls this first."""
    if runtime.is_interpreter():
        return
    runtime.synchronize()
    for step in list(_steps):
        step.release()


def _reset_capture_state():
    """A capture that fails midway leaves PyTorch's CUDA generator registered for capture (its
    next random draw outside a graph raises "Offset increment outside graph capture"); one empty
    capture, begun and ended cleanly, puts it back. Its memory pool may stay marked as recording
    (an invalidated capture never ends its allocations to the pool; every later capture into it
    then fails with "already recording to mempool_id"), so later graphs share a fresh pool."""
    global _pool
    _pool = None
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        pass


def _check_outputs(out):
    if isinstance(out, (Tensor, GradientMap)) or out is None or isinstance(out, (int, float, bool, str)):
        return
    if isinstance(out, (tuple, list)):
        for o in out:
            _check_outputs(o)
        return
    if isinstance(out, dict):
        for o in out.values():
            _check_outputs(o)
        return
    raise TypeError(f"CapturedStep: fn returned a {type(out).__name__}; return flame Tensors, a GradientMap, "
                    f"or tuples/lists/dicts of them")
