"""Backend selection, allocation and device bookkeeping.

The backend is chosen once, when flame is imported: CUDA when ``torch.cuda.is_available()``,
otherwise Triton's interpreter on CPU tensors. ``FLAME_DEVICE=cpu|cuda`` overrides the choice.
On CUDA, flame uses one GPU per process: ``cuda:LOCAL_RANK`` when the launcher set ``LOCAL_RANK``
(``torchrun`` does, one process per GPU), else the current device. It is made the current device
at import, before anything is allocated or launched, so every allocation, kernel launch, launch
cache, CUDA graph and tuning lookup of the process belongs to that one GPU.
``TRITON_INTERPRET=1`` must be set before ``triton`` is imported for the interpreter to take
effect, so this module must be imported before any kernel module (``flame/__init__.py`` does so).

Allocation goes through ``torch.empty*`` only: zero-filling is a Triton kernel like everything
else that touches values.

Device-side errors. A kernel that meets input it cannot handle (a class target outside [0, C) in
``cross_entropy``) cannot raise, and checking such input on the host would cost a device sync on
every call. Instead it sets a flag: ``device_error(exc, message)`` registers an error once (at
import, by the kernel module) and returns its code; the launcher passes ``error_flag(code)``, a
one-element int32 view of one shared buffer, and the kernel stores 1 there when it sees bad
input (and computes something harmless, never reading out of bounds). ``check_errors()`` reads the
flags back, clears them and raises the first one set, ``exc(message)``; flame calls it at every
host read of a value (``Tensor.item``, ``.numpy``, ``.tolist`` and what uses them), and it is
public as ``flame.check_errors()``. Until a kernel has been handed a flag it costs nothing (no
read, no sync). The buffer is allocated once, on first use, and only ever cleared in place:
its address is fixed, so a kernel captured in a CUDA graph still reports into it on replay
(use a flag once before capturing: its first allocation cannot happen during a capture).

CUDA-graph rules. ``with graph_rules(name):`` runs code under the rules of a captured function
(``flame.graphs.CapturedStep`` does, on the interpreter too): flame's host reads, host-to-device
copies, random draws and ``synchronize`` each call ``graph_rule(kind, action)``, which raises
``GraphRuleError`` inside such a region and costs one attribute read outside it. The flag is
per thread, so a captured function on one thread leaves another thread's work alone.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import numpy as np
import torch


def _choose_device() -> str:
    requested = os.environ.get("FLAME_DEVICE", "").strip().lower()
    if requested not in ("", "cpu", "cuda"):
        raise RuntimeError(f"FLAME_DEVICE must be 'cpu' or 'cuda', got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("FLAME_DEVICE=cuda but torch.cuda.is_available() is False")
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE_TYPE: str = _choose_device()
INTERPRETER: bool = DEVICE_TYPE == "cpu"

if INTERPRETER:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "flame must be imported before triton when running on the CPU: the interpreter is "
            "selected by TRITON_INTERPRET=1, which triton reads at import time"
        )
    os.environ["TRITON_INTERPRET"] = "1"



def _choose_index():
    """The GPU of this process: ``LOCAL_RANK`` when set (made current), else the current one."""
    local = os.environ.get("LOCAL_RANK", "").strip()
    if not local:
        return torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not local.isdigit() or int(local) >= count:
        raise RuntimeError(f"LOCAL_RANK={local!r} names no GPU of this machine's {count} "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at "
                           f"most {count} processes per machine (torchrun --nproc-per-node {count})")
    torch.cuda.set_device(int(local))
    return int(local)


device = torch.device("cpu") if INTERPRETER else torch.device("cuda", _choose_index())
_default_dtype = torch.float32


def is_interpreter() -> bool:
    """True when kernels run through Triton's interpreter on CPU tensors."""
    return INTERPRETER


def default_device() -> torch.device:
    return device


def get_default_dtype() -> torch.dtype:
    return _default_dtype


def set_default_dtype(dtype: torch.dtype) -> None:
    global _default_dtype
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"default dtype must be a floating dtype, got {dtype}")
    _default_dtype = dtype


def resolve_device(dev) -> torch.device:
    """Map a user's device argument to flame's one device, or raise a clear error."""
    if dev is None:
        return device
    d = torch.device(dev)
    if d.type != device.type:
        raise RuntimeError(
            f"flame runs on {device.type!r} in this process (FLAME_DEVICE/CUDA availability); "
            f"got device={str(dev)!r}"
        )
    return device


def to_args(args, dtype=None, device=None):
    """The dtype named by ``.to(...)``-style arguments (positional dtypes and devices, or the
    keywords); a device must be flame's own (see ``resolve_device``)."""
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        else:
            device = a
    resolve_device(device)
    return dtype


class _Prototypes(dict):
    """dtype -> an empty buffer of that dtype on flame's device (``empty`` allocates like it), made on
    first use: ``_prototypes[dtype]`` is one subscript, no call."""

    def __missing__(self, dtype):
        proto = self[dtype] = torch.empty((0,), dtype=dtype, device=device)
        return proto


_prototypes = _Prototypes()


def empty(shape, dtype) -> torch.Tensor:
    """Uninitialised, contiguous, of ``shape`` (a tuple or list of sizes, or an int) and ``dtype``: a
    ``new_empty`` of a buffer of that dtype, the sizes as arguments, which torch parses faster than
    ``torch.empty``'s keywords (a lone tuple would first be tried as an int: a TypeError formatted and
    dropped per call)."""
    if type(shape) is int:
        return _prototypes[dtype].new_empty(shape)
    return _prototypes[dtype].new_empty(*shape) if shape else _prototypes[dtype].new_empty(())


def empty_like(buf, dtype) -> torch.Tensor:
    """Uninitialised, shaped like ``buf``: its strides when it is dense and non-overlapping
    (torch's preserve_format), else contiguous."""
    return torch.empty_like(buf, dtype=dtype, device=device)


def empty_strided(shape, strides, dtype) -> torch.Tensor:
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def empty_dense_like(buf, dtype) -> torch.Tensor:
    """Uninitialised, shaped like ``buf``: in its memory order when that is dense (``dense_order``),
    else contiguous."""
    return empty_like(buf, dtype) if dense_order(buf) is not None else empty(tuple(buf.shape), dtype)


def dense_order(buf):
    """The dims of ``buf`` from outermost to innermost in memory when its strides are a permutation
    of a contiguous layout (no gaps, no overlap: NCHW, channels-last, ...), else None."""
    if buf.is_contiguous():  # the common case, without sorting (optimizer and backward hot paths)
        return tuple(range(buf.dim()))
    order = tuple(sorted(range(buf.dim()), key=lambda d: -buf.stride(d)))
    expected = 1
    for d in reversed(order):
        if buf.shape[d] != 1 and buf.stride(d) != expected:
            return None
        expected *= buf.shape[d]
    return order


def same_dense_layout(a, b) -> bool:
    """Whether buffers ``a`` and ``b`` have one shape, are both dense (``dense_order``) and lay their
    elements out in the same order: element i of one's memory is element i of the other's, so a
    kernel may treat both as flat arrays of ``numel`` elements."""
    if a.shape != b.shape or dense_order(a) is None:
        return False
    return a.stride() == b.stride() or (dense_order(b) is not None and
                                        all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride())))


def synchronize() -> None:
    graph_rule("sync", "runtime.synchronize")
    if not INTERPRETER:
        torch.cuda.synchronize()


def memory_allocated() -> int:
    """Bytes currently held by tensors (CUDA only; 0 on the interpreter backend)."""
    return torch.cuda.memory_allocated() if not INTERPRETER else 0


def free_memory() -> int:
    """Bytes the device has free, as the CUDA driver reports them (0 on the interpreter backend)."""
    return torch.cuda.mem_get_info(device)[0] if not INTERPRETER else 0


def max_memory_allocated() -> int:
    return torch.cuda.max_memory_allocated() if not INTERPRETER else 0


def reset_peak_memory_stats() -> None:
    if not INTERPRETER:
        torch.cuda.reset_peak_memory_stats()


def use_expandable_segments() -> bool:
    """Have PyTorch's caching allocator grow and shrink its segments in place (its
    ``expandable_segments`` setting) unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise: freed blocks
    are not stranded in half-used segments, which matters most when a CUDA graph's pool and the eager
    allocations share a small card (Flux.1 on 24 GiB: 21.9 GiB held instead of 27.3 for the same
    21.6 GiB of tensors). True when it is on. No-op on the interpreter."""
    if INTERPRETER:
        return False
    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        return True
    return "expandable_segments:true" in os.environ["PYTORCH_CUDA_ALLOC_CONF"].lower().replace(" ", "")


_num_sms = None


def num_sms() -> int:
    """Streaming multiprocessors on the device (1 on the interpreter backend); read once."""
    global _num_sms
    if _num_sms is None:
        _num_sms = 1 if INTERPRETER else torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (host reads are impossible then)."""
    return not INTERPRETER and torch.cuda.is_current_stream_capturing()


def device_name() -> str:
    return torch.cuda.get_device_name() if not INTERPRETER else "cpu-interpreter"


def device_capability() -> tuple:
    """The GPU's compute capability (major, minor); None on the interpreter."""
    return None if INTERPRETER else torch.cuda.get_device_capability(device)


# ---- device-side error flags (module docstring) -------------------------------------------------

_ERROR_SLOTS = 32
_errors: list = []  # (exception class, message) of each registered code
_flags = None  # int32 (_ERROR_SLOTS,): nonzero where a kernel reported that code's error
_flag_views: dict = {}  # code -> one-element view of _flags


def device_error(exc: type, message: str) -> int:
    """Register an error kernels can report; returns its code, for ``error_flag``. When a kernel
    has set the flag, the next ``check_errors()`` raises ``exc(message)``."""
    if len(_errors) == _ERROR_SLOTS:
        raise RuntimeError(f"device_error: all {_ERROR_SLOTS} error codes are taken")
    _errors.append((exc, message))
    return len(_errors) - 1


def error_flag(code: int) -> torch.Tensor:
    """The int32 one-element buffer a kernel stores nonzero into to report error ``code``."""
    global _flags
    view = _flag_views.get(code)
    if view is None:
        if _flags is None:
            if is_capturing():
                raise RuntimeError("flame's device error flags are first needed inside a CUDA-graph capture; run "
                                   "the captured function once eagerly first (flame.graphs.CapturedStep does)")
            _flags = torch.from_numpy(np.zeros(_ERROR_SLOTS, np.int32)).to(device)  # host transfer
        view = _flag_views[code] = _flags[code:code + 1]
    return view


def check_errors() -> None:
    """Raise the first error a kernel has reported since the last check, after clearing every flag.
    Reads the flags back (a host sync) once any kernel has been handed one; a no-op before."""
    graph_rule("host read", "flame.check_errors")
    if _flags is None:
        return
    codes = [i for i, f in enumerate(_flags.tolist()) if f]  # host transfer
    if not codes:
        return
    _flags.copy_(torch.from_numpy(np.zeros(_ERROR_SLOTS, np.int32)))  # host transfer, into the same buffer
    exc, message = _errors[codes[0]]
    also = "".join(f"; also: {_errors[c][1]}" for c in codes[1:])
    raise exc(f"{message} (reported by a kernel, raised at the first host read after its launch){also}")


# ---- CUDA-graph rules (module docstring) --------------------------------------------------------

class GraphRuleError(RuntimeError):
    """A captured function (``flame.graphs.CapturedStep``) did something a CUDA graph cannot replay."""


_GRAPH_RULES = {  # kind -> (what happened, why a graph cannot have it and what to do instead)
    "host read": ("a device-to-host read", "a CUDA graph cannot hand values to the host (the capture fails, and a "
                  "replay runs no Python); read the outputs after the call"),
    "sync": ("a host synchronization", "a CUDA graph cannot wait for the device (the capture fails); synchronize "
             "after the call"),
    "host copy": ("a host-to-device copy", "a CUDA graph cannot copy host data (the capture fails, and a replay "
                  "would not see new data); make the tensor before the call and pass it in, or build it once and "
                  "reuse it"),
    "random draw": ("a random draw from flame's generator", "its key and offset are frozen into a CUDA graph, so "
                    "every replay would repeat the same numbers; draw them before the call and pass them in (or "
                    "run with enabled=False)"),
}


class _GraphRules(threading.local):
    step = None  # the name of the captured function this thread runs under the graph rules, else None


_graph_rules = _GraphRules()


@contextlib.contextmanager
def graph_rules(name: str):
    """Run the body under the CUDA-graph rules: ``graph_rule`` raises there, naming ``name``."""
    outer, _graph_rules.step = _graph_rules.step, name
    try:
        yield
    finally:
        _graph_rules.step = outer


def graph_rule(kind: str, action: str) -> None:
    """Raise ``GraphRuleError`` when this thread runs a captured function (``graph_rules``):
    ``action`` (e.g. ``Tensor.numpy``) is of ``kind``, a key of ``_GRAPH_RULES``."""
    step = _graph_rules.step
    if step is None:
        return
    what, why = _GRAPH_RULES[kind]
    raise GraphRuleError(f"CapturedStep({step}): {what} ({action}) inside a captured function; {why}")
