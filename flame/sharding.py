"""ZeRO-style sharding of the trained parameters, their gradients and the optimizer state over
``torch.distributed`` (ZeRO-1/2/3; stages ``optimizer``, ``gradients``, ``parameters``).

Layout. The trained parameters are grouped into *units* (a model block's parameters of one dtype,
or consecutive parameters up to ``bucket_numel`` elements); a unit is one flat buffer in the
parameters' dtype holding each parameter in its memory order (channels-last stays channels-last)
at an offset aligned to ``PARAM_ALIGN`` elements, padded to ``world * chunk`` elements with
``chunk`` a multiple of ``align``. Rank r owns positions ``[r * chunk, (r + 1) * chunk)`` of every
unit. Each rank keeps one flat fp32 buffer, the *master*, of its chunks (unit after unit), and the
optimizer (flame's own class, built by the caller's factory over one leaf per unit chunk) keeps
state for those chunks only. The model's parameters become views of their unit's buffer.

Stages:
- ``optimizer`` (ZeRO-1): every rank packs its gradients into one full flat fp32 buffer (one
  kernel per micro-batch); ``step`` all-reduces it unit by unit and each rank updates its chunks.
- ``gradients`` (ZeRO-2): each unit's gradients (a bucket) are reduce-scattered into this rank's
  fp32 gradient shard, so only the shard and unit-sized staging buffers live between micro-batches;
  with ``overlap`` (the default) from the backward, as each unit's gradients are complete (below),
  else all of them in ``pack``. ``reduce_dtype=torch.bfloat16`` reduce-scatters them in bf16 (half
  the traffic; each rank's contribution and the sum rounded to bf16, as FSDP's ``reduce_dtype``),
  then adds them to the fp32 shard.
- ``parameters`` (ZeRO-3): as ``gradients``, and the weights of each entry of ``units`` (a block)
  are whole on a rank only while its block runs: ``run(block, *args)`` all-gathers them into a
  ring of a few device buffers for its forward, the next block's gather issued as it starts, and
  again for its backward (below). The units outside ``units`` (buckets: the weights between the
  blocks) stay whole, as at the ``gradients`` stage. Every rank must run the same blocks in the
  same order. ``gather``/``release`` (or ``gathered``, a context) hold any units whole in memory of
  their own until released, e.g. to read the weights between steps.

After the update each rank's chunks are cast to the units' dtype (a flame kernel) and all-gathered
into the units' buffers, i.e. into the model's parameters (``parameters``: the entries of ``units``
at their next gather).

Gathered weights (``parameters``). The entries of ``units``, in the order given (the order the
forward runs the blocks; entries without trained parameters left out), live in ``slots`` device
buffers (2 by default), each the size of the largest entry's units, allocated at construction:
entry k in slot k mod slots for good, its units' buffers, and so its parameters, views there (256
bytes aligned), as ``flame.models.offload.BlockStreamer`` keeps frozen streamed weights. A gather
casts each unit's master chunk to its dtype and all-gathers it into the slot; nothing is allocated.
``run`` of entry k's block: entry 0 starts a *pass*, which forgets what the slots hold (after a
step they hold old weights, and a CUDA graph must gather what it reads itself); entry k is gathered
unless its slot holds it, the compute stream waits for its gather, and the next entries whose slots
are free (the next one, with 2 slots) are gathered ahead, each after every kernel issued so far
(the slot's previous readers) on the communication stream, while the block runs. While recording,
the block runs as one ``flame.checkpoint.segment`` keeping its sub-graph, whose backward starts by
gathering entry k again if its slot holds another (graph nodes hold views of the slot: the backward
needs the forward's slot) and the entries whose backward comes next (the pass's recorded blocks in
reverse) ahead. The last entries of the forward are still in their slots when the backward starts:
with 2 slots a pass of n entries gathers n of them forward and n - 2 backward. CUDA graphs: the
gathers are collectives on the communication stream joined by events recorded in the same capture,
into buffers made at construction, so the forward and backward capture with them; ``join()`` makes
the compute stream wait for a gather no block waited for (an entry gathered ahead whose block did not
run), which a capture must not leave behind (the trainer calls it at the end of its step). On the
interpreter gloo's gathers run synchronously in the same schedule, so CPU tests catch a block run on
another's weights. Between its uses an entry's parameters read whatever their slot holds: read them
in ``gathered``. ``log=True`` keeps the schedule in ``log`` (``(event, entry, slot, the entry each
slot holds)``; "gather", "forward", "backward").

Overlap (``gradients`` and ``parameters`` on several ranks; ``overlap=False`` or setting
``shards.overlap = False`` between steps turns it off). A post-accumulate hook on every trained
parameter notes its gradient; when a unit's are all there, the unit is packed, times this rank's
weight (``weigh(w)``, given before the backward: a device scalar, so a graph's replay reads the
current one; ranks may weigh differently, e.g. by their rows of an uneven batch), in one multi-tensor
launch into the next of two unit-sized staging slots, and reduce-scattered from there into the
unit's *partial* chunk (all units' partials, in ``reduce_dtype``, are as large as the shard) on a
communication stream that waits for the pack, while the backward goes on; a slot's next pack waits
for the reduce-scatter that read it, and after the last unit the compute stream waits for the
communication stream. ``pack`` then only adds: shard = (``accumulate``: shard +) partials, one
kernel (the numbers of the path without overlap, bit for bit).
Order: NCCL needs every rank to issue its collectives in one order, and the order in which units
complete is the same on every rank only for the same graph, so units launch in one agreed order: a
complete unit waits until every unit before it has launched. The order is the one in which the
units completed in the first backward (the backward's own, for the most overlap), agreed at the
first ``pack`` (an all-gather of each rank's order; the lowest rank that ran a backward wins), whose
units are all launched there. A rank without samples (``pack(None)``, no backward) launches every
unit with zeros in that order; a unit whose gradients never all arrive is reported by ``pack``, as
without overlap. CUDA graphs (``flame.graphs.CapturedStep``): the hooks launch only kernels (the
gradients' pointers go into fixed launch tables through kernel arguments, ``KO.set_sources_``),
stream waits on events recorded in the same capture and the collectives, into buffers made at
construction, so the backward captures with its reduce-scatters; a replay runs no hook, and ``pack``
of the GradientMap a capture returned knows its units were launched. The first backward must run
eagerly (CapturedStep's warm-up call does).

Collectives: NCCL's (and gloo's, PyTorch 2.13) ``all_gather_into_tensor`` and
``reduce_scatter_tensor``; a gloo without ``reduce_scatter`` (older PyTorch) gets an all-reduce of
each bucket, of which every rank keeps its chunk (twice the traffic; the CPU tests force it once).
Errors in a collective become ``flame.distributed.PeerLostError`` as in ``flame.distributed``.

Per step, on every rank (``model``'s blocks run in order; ``world`` ranks)::

    shards = ShardedOptimizer(model.named_parameters(), "parameters",
                              lambda params: AdamW(params, lr=1e-4, weight_decay=1e-2),
                              units=blocks)  # one entry per block (a module or its parameters), in run order
    for i, (x, target) in enumerate(micro_batches):
        shards.weigh(1 / (len(micro_batches) * world))  # this rank's share, before the backward (overlap)
        for block in blocks:
            x = shards.run(block, x)  # gathered for its forward and its backward; a plain call below ZeRO-3
        grads = loss_fn(x, target).backward()  # reduce-scatters each unit as its gradients are complete
        shards.pack(grads, accumulate=i > 0)
    norm = shards.step(lr=lr, max_norm=1.0, found_inf=scaler.found_inf)

``step(lr=None, max_norm=None, found_inf=None, grad_scale=None)``: ``lr`` sets every group's
learning rate; ``max_norm`` clips by the global 2-norm over all shards (each rank's local norm,
one all-reduce of the N norms, then the norm of those) and returns it as a 0-d device tensor
(``float("inf")``: the norm without clipping); the step is skipped on every rank alike when any
rank's gradient shard holds inf/NaN or ``found_inf`` (an int32 device flag, e.g. a loss scaler's)
is set on any rank: the flags are OR-ed with one all-reduce, and the result is written back into
``found_inf`` so a ``DynamicLossScaler.update()`` agrees everywhere. ``grads`` is this rank's
gradient shard as a GradientMap (``scaler.unscale_(shards.grads)`` before clipping).

Checkpoints. ``save(folder, writers=None)`` (collective) writes, as ``flame.train.checkpoints``
does, into a temporary folder beside ``folder``: each rank its shard file
``shard-RRRRR-of-NNNNN.safetensors`` (master and optimizer state, atomically, fsynced), rank 0
``shards.json`` (world size, stage, align, optimizer class, groups and step, and per unit its dtype,
chunk and parameters: name, shape, strides, offset) and ``writers``' files; rank 0 then renames
it to ``folder`` and writes the ``COMPLETE`` marker last (a ``step-NNNNNNNN`` folder under a
checkpoint root is then one that ``flame.train.checkpoints.list_checkpoints`` lists). ``load(folder)``
re-slices the saved shards, parameter by parameter, for this run's world size and units (a
parameter's dtype may differ: the master is fp32 either way; ``AdamW8bit``'s per-block maxima need
the same units). ``export(folder, path)`` writes one safetensors file of the fp32 weights (name ->
tensor, in the parameters' shapes) from the shards, on any one process (``weights(folder)`` yields
them one at a time). ``state_dict`` /
``load_state_dict``: this rank's master and optimizer state, in memory, for the same layout only.
``memory()``: the bytes this rank holds (parameters, master, optimizer state, gradients); at the
``parameters`` stage its parameters are the ring's slots and the units kept whole.

Supported optimizers: the elementwise ones (AdamW, Adam, AdamW8bit, SGD, Lion). Adafactor factors
a 2-D parameter's statistics and Prodigy estimates one step size over all parameters: neither is
defined on a flat slice. One parameter group (the factory's optimizer over the leaves it gets).

Not yet: ZeRO-1's all-reduce from the backward, a bf16 master with stochastic rounding.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import weakref

import numpy as np
import torch
import torch.distributed as dist

from . import distributed, runtime
from .autograd import GradientMap, is_grad_enabled
from .checkpoint import fill_ahead, segment
from .io import atomic_write, fsync_dir, open_safetensors, save_safetensors, to_device
from .kernels import amp as KA
from .kernels import elementwise as KE
from .kernels import optim as KO
from .nn.module import Module
from .optim.optimizers import SGD, Adam, AdamW8bit, Lion
from .tensor import Tensor

STAGES = ("optimizer", "gradients", "parameters")
OPTIMIZERS = (Adam, AdamW8bit, SGD, Lion)  # AdamW is an Adam
PARAM_ALIGN = 64  # each parameter starts on a 64-element boundary of its unit (128 bytes in bf16)
MARKER = "COMPLETE"  # flame.train.checkpoints.MARKER: a folder without it is never loaded
INDEX = "shards.json"
FORMAT = "flame-zero-shards/1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NUMPY = {"F32": np.float32, "U8": np.uint8}  # the saved tensors' dtypes (master and optimizer state)
_native_reduce_scatter = None  # None: not tried yet; False: the backend lacks it (all-reduce instead)


def _round_up(n, m):
    return -(-n // m) * m


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def _state_key(unit: int, name: str) -> str:
    return f"unit.{unit:05d}.{name}"


def _spans(chunk, start, stop):
    """Where unit positions ``[start, stop)`` lie: ``[(rank, position in its chunk, position from
    start, count)]``, split at the chunk boundaries."""
    out, x = [], start
    while x < stop:
        r = x // chunk
        end = min(stop, (r + 1) * chunk)
        out.append((r, x - r * chunk, x - start, end - x))
        x = end
    return out


class _Unit:
    """Parameters of one dtype sharded together (see the module doc): ``members`` are
    ``(name, parameter, offset)``; ``buf`` the unit's flat buffer that the parameters view; ``group``
    the entry of ``units`` it comes from (None: a bucket); ``home`` (a group's unit at the
    ``parameters`` stage) its place in its ring slot, which ``buf`` is but while ``gather`` holds it."""

    def __init__(self, index, dtype, named, world, align, group=None):
        self.index, self.dtype, self.group, self.home = index, dtype, group, None
        self.members, end = [], 0
        for name, p in named:
            self.members.append((name, p, end))
            end = _round_up(end + p.numel(), PARAM_ALIGN)
        self.numel = self.members[-1][2] + self.members[-1][1].numel()
        self.chunk = _round_up(-(-self.numel // world), align)
        self.padded = world * self.chunk
        self.buf = None

    def point(self, buf):
        """The unit's buffer, and its parameters' memory, become ``buf`` (same layout)."""
        self.buf = buf
        for _, p, off in self.members:
            p._data = buf.as_strided(p.shape, p._data.stride(), off)

    def describe(self) -> dict:
        return {"dtype": _dtype_name(self.dtype), "numel": self.numel, "chunk": self.chunk,
                "params": [{"name": n, "shape": list(p.shape), "stride": list(p._data.stride()), "offset": off}
                           for n, p, off in self.members]}


class _Group:
    """An entry of ``units`` at the ``parameters`` stage: its units (one per dtype), its position in
    the forward's order (``units``' order, empty entries left out) and its ring slot."""

    __slots__ = ("position", "units", "slot")

    def __init__(self, position, units, slot):
        self.position, self.units, self.slot = position, units, slot


def _needs_grad(out) -> bool:
    """Whether a block's output needs gradients (its segment recorded a node)."""
    return any(isinstance(o, Tensor) and o.requires_grad for o in ((out,) if isinstance(out, Tensor) else out))


class _Ring:
    """The ``parameters`` stage's ring of slots (see the module doc): ``slots`` device buffers of
    ``slot_bytes``, group k in slot k mod slots for good, each unit's ``home`` its place there (256
    bytes aligned). ``gather(group)`` fills a group's units from the shards (on ``stream``, the
    communication stream, where given, else synchronously). The schedule: ``owner`` (the group each
    slot holds in this pass), ``ready`` (its gather's event, GPU), ``pending`` (slots whose gather
    no block waited for yet), ``recorded`` (the pass's groups whose block recorded a segment, in
    forward order); ``log`` (``log=True``) keeps ``(event, position, slot, the position each slot
    holds after it)``, event "gather", "forward" or "backward"."""

    def __init__(self, units, slots, gather, stream, log):
        entries = {}
        for u in units:
            if u.group is not None:
                entries.setdefault(u.group, []).append(u)
        count = min(slots, len(entries))
        self.groups, layouts = [], []
        for k, (_, members) in enumerate(sorted(entries.items())):
            self.groups.append(_Group(k, members, k % count))
            at = [0]
            for u in members:
                at.append(_round_up(at[-1] + u.padded * u.dtype.itemsize, 256))
            layouts.append(at)
        self.slot_bytes = max(at[-1] for at in layouts)
        self.buffers = [runtime.empty((self.slot_bytes,), torch.uint8) for _ in range(count)]
        for g, at in zip(self.groups, layouts):
            for u, start in zip(g.units, at):
                u.home = self.buffers[g.slot][start:start + u.padded * u.dtype.itemsize].view(u.dtype)
        self.of_unit = {u.index: g for g in self.groups for u in g.units}
        self.gather, self.stream = gather, stream
        self.log = [] if log else None
        self.pending = set()
        self.begin()

    @property
    def nbytes(self) -> int:
        return len(self.buffers) * self.slot_bytes

    def begin(self):
        """A new pass: the slots hold nothing (their contents are stale after a step, and a CUDA graph
        must gather what it reads itself). Gathers no block waited for are joined first; inside a
        capture they were issued before it, and CapturedStep synchronizes before capturing."""
        if not runtime.is_capturing():
            self.join()
        self.pending.clear()
        self.owner = [None] * len(self.buffers)
        self.ready = [None] * len(self.buffers)
        self.recorded = []

    def _note(self, event, g):
        if self.log is not None:
            self.log.append((event, g.position, g.slot, tuple(o and o.position for o in self.owner)))

    def _fill(self, g):
        """Gather ``g`` into its slot; on the communication stream after every kernel issued so far
        (the slot's previous readers), its event recorded there."""
        if self.stream is None:
            self.gather(g)
        else:
            issued = torch.cuda.Event()
            issued.record()
            self.stream.wait_event(issued)
            with torch.cuda.stream(self.stream):
                self.gather(g)
            self.ready[g.slot] = torch.cuda.Event()
            self.ready[g.slot].record(self.stream)
            self.pending.add(g.slot)
        self.owner[g.slot] = g
        self._note("gather", g)

    def _use(self, g):
        """``g`` in its slot before the kernels issued next."""
        if self.owner[g.slot] is not g:
            self._fill(g)
        if g.slot in self.pending:
            torch.cuda.current_stream().wait_event(self.ready[g.slot])
            self.pending.discard(g.slot)

    def _ahead(self, upcoming, busy):
        """Gather the first of ``upcoming`` (groups in the order they will run), up to the first whose
        slot is ``busy`` (the running group's) or taken by an earlier one of them."""
        fill_ahead(upcoming, busy, lambda g: self.owner[g.slot] is g, self._fill)

    def run(self, g, fn, args, kwargs):
        """``fn(*args, **kwargs)``, the block of group ``g``: its forward on the gathered weights, the
        next groups gathered ahead, and while recording one kept segment whose backward gathers them
        again first."""
        if g.position == 0:
            self.begin()
        self._use(g)
        self._note("forward", g)
        self._ahead(self.groups[g.position + 1:], g.slot)
        if not is_grad_enabled():
            return fn(*args, **kwargs)
        recorded = self.recorded
        out = segment(fn, args, kwargs, recompute=False,
                      on_backward=functools.partial(self._backward, recorded, len(recorded)))
        if _needs_grad(out):
            recorded.append(g)
        return out

    def _backward(self, recorded, k):
        """The backward of the pass's k-th recorded group starts: it, then the groups whose backward
        comes next (in reverse forward order) gathered ahead."""
        g = recorded[k]
        self._use(g)
        self._note("backward", g)
        self._ahead(reversed(recorded[:k]), g.slot)

    def join(self):
        """The current stream waits for every gather no block waited for."""
        for slot in self.pending:
            torch.cuda.current_stream().wait_event(self.ready[slot])
        self.pending.clear()


class ShardedOptimizer:
    """ZeRO sharding of ``named_params`` (``(name, Parameter)`` pairs: the trained parameters, e.g.
    ``model.named_parameters()``) at ``stage``; ``optimizer(params) -> Optimizer`` builds flame's
    optimizer over the list of fp32 leaves it is given. ``units``: iterables of parameters (or
    modules) to shard together, e.g. one per block (the ``parameters`` stage gathers whole units);
    the other parameters go into units of at most ``bucket_numel`` elements, in order. ``align``:
    elements each rank's chunk of a unit is a multiple of (256 for ``AdamW8bit``'s blocks).
    ``reduce_dtype``: the dtype the ``gradients`` and ``parameters`` stages reduce-scatter in (fp32,
    or bf16: half the traffic). ``overlap``: those stages reduce-scatter each unit from the backward
    as its gradients are complete (``overlap``, settable between steps; see the module doc). ``slots``:
    the ``parameters`` stage's ring of device buffers that the entries of ``units`` are gathered into,
    each the size of the largest entry (2: one block gathered ahead; see the module doc); ``log=True``
    keeps its schedule in ``log``. Call it alike on every rank (see the module doc)."""

    def __init__(self, named_params, stage: str, optimizer, *, units=None, bucket_numel: int = 1 << 23,
                 align: int = 256, reduce_dtype=torch.float32, overlap: bool = True, slots: int = 2,
                 log: bool = False):
        if stage not in STAGES:
            raise ValueError(f"ShardedOptimizer: unknown stage {stage!r}; one of {', '.join(STAGES)} (ZeRO-1/2/3; "
                             "without sharding use the optimizer itself)")
        if not callable(optimizer):
            raise TypeError("ShardedOptimizer: optimizer must be a callable that builds flame's optimizer over the "
                            f"parameters it is given (lambda ps: AdamW(ps, lr=1e-4)), got {type(optimizer).__name__}")
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"ShardedOptimizer: bucket_numel must be a positive int, got {bucket_numel!r}")
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"ShardedOptimizer: align must be a positive int, got {align!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"ShardedOptimizer: slots must be an int >= 1, got {slots!r}")
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ShardedOptimizer: reduce_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{reduce_dtype!r}")
        self.reduce_dtype = reduce_dtype
        world = distributed.world()
        self.stage, self.rank, self.world, self.align = stage, world.rank, world.size, align
        named = self._checked(named_params)
        self.units = self._group(named, units, bucket_numel)
        self._unit_of = {p.id: u for u in self.units for _, p, _ in u.members}
        # the communication stream (GPU, several ranks): reduce-scatters from the backward, gathers ahead
        self._comm = None if self.world == 1 or runtime.is_interpreter() else torch.cuda.Stream(device=runtime.device)
        self._ring = None
        if stage == "parameters" and any(u.group is not None for u in self.units):
            self._ring = _Ring(self.units, slots, self._gather_group, self._comm, log)
        self.log = self._ring.log if self._ring is not None else None
        offsets = np.cumsum([0] + [u.chunk for u in self.units]).tolist()
        self._master = runtime.empty((offsets[-1],), torch.float32)
        self.masters = []
        for u, at in zip(self.units, offsets):  # one at a time: a ring slot holds one group's units
            buf = u.home if u.home is not None else runtime.empty((u.padded,), u.dtype)
            KE.fill_(buf, 0)
            for _, p, off in u.members:
                KE.copy_(buf.as_strided(p.shape, p._data.stride(), off), p._data)
            u.point(buf)  # the parameters become views of the unit (same layout)
            master = self._master[at:at + u.chunk]
            KE.copy_(master, u.buf[self.rank * u.chunk:(self.rank + 1) * u.chunk])
            self.masters.append(Tensor(master, requires_grad=True))
        self.optimizer = optimizer(list(self.masters))
        self._check_optimizer()
        self._make_gradients(offsets)
        self._found = runtime.empty((1,), torch.int32)
        self._norms = runtime.empty((self.world,), torch.float32)
        self._coef = runtime.empty((1,), torch.float32)
        self._norm_buckets = [(KO.Tables([((None, self._norms, None, None), self.world, 0)]), torch.float32)]
        low = [u for u in self.units if u.dtype != torch.float32]
        self._cast = runtime.empty((max(u.chunk for u in low),), low[0].dtype) if low else None
        self._held = {}  # unit index -> how many gathers hold it (a group's unit: in memory of its own)
        self._weight = runtime.empty((1,), torch.float32)  # this rank's weight of the next backward (``weigh``)
        KE.fill_(self._weight, 1.0)
        self._weighed = 1.0
        self._hooks, self._overlap, self._fired, self._staging = [], False, False, None
        self.overlap = overlap

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def _checked(named_params):
        if isinstance(named_params, dict):
            named_params = named_params.items()
        named, seen = [], set()
        for item in named_params:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"ShardedOptimizer: named_params must yield (name, Parameter) pairs, got {item!r:.80}")
            name, p = item
            if not isinstance(p, Tensor) or not p.is_leaf or not p.requires_grad:
                raise ValueError(f"ShardedOptimizer: {name!r} is not a leaf that requires grad: pass the trained "
                                 "parameters only")
            if p.dtype not in _DTYPES.values():
                raise TypeError(f"ShardedOptimizer: {name!r} is {p.dtype}; trained parameters are fp32, bf16 or fp16")
            if runtime.dense_order(p._data) is None:
                raise ValueError(f"ShardedOptimizer: {name!r} is not dense (shape {p.shape}, strides {p.stride()})")
            if p.id in seen:
                raise ValueError(f"ShardedOptimizer: {name!r} is given twice")
            seen.add(p.id)
            named.append((name, p))
        if not named:
            raise ValueError("ShardedOptimizer: no parameters to shard")
        return named

    def _group(self, named, units, bucket_numel):
        """Units in the order of their first parameter: each given group split by dtype, the other
        parameters in runs of one dtype and at most ``bucket_numel`` elements."""
        group_of = {}
        for g, members in enumerate(units or ()):
            params = members.parameters() if isinstance(members, Module) else members
            for p in params:
                if not isinstance(p, Tensor):
                    raise TypeError(f"ShardedOptimizer: units hold parameters or modules, got {type(p).__name__}")
                if p.id in group_of:
                    raise ValueError(f"ShardedOptimizer: a parameter of shape {p.shape} is in units {group_of[p.id]} "
                                     f"and {g}")
                group_of[p.id] = g
        known = {p.id for _, p in named}
        stray = [i for i in group_of if i not in known]
        if stray:
            raise ValueError(f"ShardedOptimizer: units name {len(stray)} parameter(s) that named_params does not hold")
        runs, bucket, done = [], [], set()  # (group or None, members)
        for name, p in named:
            g = group_of.get(p.id)
            if g is None:
                if bucket and (bucket[-1][1].dtype != p.dtype or
                               sum(q.numel() for _, q in bucket) + p.numel() > bucket_numel):
                    runs.append((None, bucket))
                    bucket = []
                bucket.append((name, p))
            elif g not in done:
                done.add(g)
                members = [(n, q) for n, q in named if group_of.get(q.id) == g]
                for dtype in dict.fromkeys(q.dtype for _, q in members):
                    runs.append((g, [(n, q) for n, q in members if q.dtype == dtype]))
        runs += [(None, bucket)] if bucket else []
        return [_Unit(i, run[0][1].dtype, run, self.world, self.align, g) for i, (g, run) in enumerate(runs)]

    def _check_optimizer(self):
        opt = self.optimizer
        if not isinstance(opt, OPTIMIZERS):
            raise NotImplementedError(
                f"ShardedOptimizer: {type(opt).__name__} cannot run on flat slices of parameters: the elementwise "
                "optimizers can (AdamW, Adam, AdamW8bit, SGD, Lion); Adafactor factors a 2-D parameter's statistics "
                "and Prodigy estimates one step size over all parameters")
        if len(opt.param_groups) != 1 or [p.id for p in opt.param_groups[0]["params"]] != \
                [m.id for m in self.masters]:
            raise ValueError("ShardedOptimizer: the optimizer factory must build the optimizer over exactly the "
                             "parameters it is given, in one parameter group")
        if isinstance(opt, AdamW8bit) and self.align % AdamW8bit.BLOCK:
            raise ValueError(f"ShardedOptimizer: AdamW8bit quantises blocks of {AdamW8bit.BLOCK} elements: align "
                             f"must be a multiple of it, got {self.align}")

    def _make_gradients(self, offsets):
        """The gradient buffers: ZeRO-1 one full flat fp32 buffer (units at ``padded`` strides), the
        others this rank's fp32 shard (laid out as the master); the staging buffers come with
        ``overlap``."""
        full = self.stage == "optimizer"
        starts = np.cumsum([0] + [u.padded for u in self.units]).tolist() if full else offsets
        flat = runtime.empty((starts[-1],), torch.float32)
        KE.fill_(flat, 0)
        self._flat_grad = flat
        self._unit_grad = [flat[s:s + u.padded] for s, u in zip(starts, self.units)] if full else None
        self._grads = GradientMap()
        for u, s, master in zip(self.units, starts, self.masters):
            at = s + self.rank * u.chunk if full else s
            self._grads[master] = Tensor(flat[at:at + u.chunk])
        # where pack writes each parameter's gradient directly (ZeRO-1, or a world of one)
        self._direct = full or self.world == 1
        self._starts = starts
        self._shard_buckets = [(KO.Tables([((None, g._data, None, None), g.numel(), 0)
                                           for g in self._grads.values()]), torch.float32)]
        self._pack_tables = {}  # (unit or None, source pointers) -> [(Tables, source dtype)]

    # ---- gradients ----------------------------------------------------------------------------
    @property
    def grads(self) -> GradientMap:
        """This rank's gradient shard: one fp32 gradient per master leaf (for a loss scaler's
        ``unscale_``)."""
        return self._grads

    def _sources(self, grads, members, dtype=None):
        """Each member's gradient buffer in its parameter's layout (``dtype``: in that dtype)."""
        return [self._source(name, p, grads.get(p), dtype) for name, p, _ in members]

    @staticmethod
    def _source(name, p, g, dtype=None):
        """Parameter ``name``'s gradient ``g`` checked, as a buffer in ``p``'s layout (and ``dtype``)."""
        if g is None:
            raise RuntimeError(f"ShardedOptimizer.pack: no gradient for {name!r}: every rank must produce a "
                               "gradient for every trained parameter")
        if not isinstance(g, Tensor) or g.shape != p.shape:
            raise ValueError(f"ShardedOptimizer.pack: the gradient of {name!r} is "
                             f"{getattr(g, 'shape', type(g).__name__)}, the parameter {p.shape}")
        if g.dtype not in (torch.float32, p.dtype):
            raise TypeError(f"ShardedOptimizer.pack: the gradient of {name!r} is {g.dtype} for a {p.dtype} "
                            "parameter")
        buf = g._data
        if not runtime.same_dense_layout(buf, p._data) or buf.dtype != (dtype or buf.dtype):
            buf = runtime.empty_like(p._data, dtype or g.dtype)
            KE.copy_(buf, g._data)
        return buf

    def _tables(self, unit, dsts, srcs):
        """Cached ``[(Tables, source dtype)]`` of (destination, source) rows, one per source dtype."""
        key = (unit, tuple(s.data_ptr() for s in srcs))
        hit = self._pack_tables.get(key)
        if hit is None:
            by_dtype = {}
            for d, s in zip(dsts, srcs):
                by_dtype.setdefault(s.dtype, []).append(((d, s, None, None), s.numel(), 0))
            hit = [(KO.Tables(rows), dtype) for dtype, rows in by_dtype.items()]
            if len(self._pack_tables) >= 4 * len(self.units):
                self._pack_tables.pop(next(iter(self._pack_tables)))
            self._pack_tables[key] = hit
        return hit

    def weigh(self, weight: float) -> None:
        """This rank's weight of the next backward's gradients (its share of the micro-batch, e.g.
        ``rows / (global rows * micro-batches)``), given before that backward: with ``overlap`` the
        backward reduce-scatters them already weighted (the weight is read from the device, so a
        CUDA graph's replay uses the latest). ``pack``'s weight is this one unless given."""
        if self._fired:
            raise RuntimeError("ShardedOptimizer.weigh: gradients of a backward await pack: weigh before the backward")
        weight = float(weight)
        if weight != self._weighed:
            KE.fill_(self._weight, weight)
            self._weighed = weight

    def pack(self, grads, weight: float | None = None, accumulate: bool = False) -> None:
        """Add ``weight`` (None: ``weigh``'s, 1 by default) times this micro-batch's gradients (the
        GradientMap of ``backward()``) to the step's (``accumulate=False``: replace them). ZeRO-1
        writes the full flat buffer; the other stages reduce-scatter unit by unit into this rank's
        shard (a collective; with ``overlap`` the backward did, and ``weight`` must be ``weigh``'s).
        ``grads`` None: this rank adds nothing (it had no samples, and ran no backward) but takes
        part in the collectives."""
        if grads is not None and not isinstance(grads, GradientMap):
            raise TypeError(f"ShardedOptimizer.pack expects the GradientMap of backward(), got {type(grads).__name__}")
        weight = self._weighed if weight is None else float(weight)
        if self._overlap:
            self._pack_overlapped(grads, weight, accumulate)
            return
        if grads is None:
            self._pack_nothing(accumulate)
            return
        if self._direct:
            members = [m for u in self.units for m in u.members]
            dsts = [self._flat_grad[s + off:s + off + p.numel()] for u, s in zip(self.units, self._starts)
                    for _, p, off in u.members]
            for tables, dtype in self._tables(None, dsts, self._sources(grads, members)):
                KO.axpby_(tables, dtype, torch.float32, weight, 1.0 if accumulate else 0.0)
            return
        for u, shard in zip(self.units, self._grads.values()):
            staging = self._staging[:u.padded]
            KE.fill_(staging, 0)  # the gaps: the staging buffer served other units before
            dsts = [staging[off:off + p.numel()] for _, p, off in u.members]
            for tables, dtype in self._tables(u.index, dsts, self._sources(grads, u.members)):
                KO.axpby_(tables, dtype, self.reduce_dtype, weight, 0.0)
            self._reduce_into(shard._data, staging, u.chunk, accumulate)

    def _pack_nothing(self, accumulate):
        """``pack`` of a rank without gradients: zeros into the step's gradients and the collectives."""
        if self._direct:
            if not accumulate:
                KE.fill_(self._flat_grad, 0)
            return
        for u, shard in zip(self.units, self._grads.values()):
            staging = self._staging[:u.padded]
            KE.fill_(staging, 0)
            self._reduce_into(shard._data, staging, u.chunk, accumulate)

    def _reduce_into(self, shard, staging, chunk, accumulate):
        """This rank's chunk of the ranks' sum of ``staging`` into the fp32 ``shard`` (``accumulate``:
        added to it), reduced in ``reduce_dtype``."""
        if not accumulate and self.reduce_dtype == torch.float32:
            self._reduce_scatter(shard, staging)
            return
        partial = self._partial[:chunk]
        self._reduce_scatter(partial, staging)
        if accumulate:
            KE.map_(shard, [shard, partial], KE.ADD)
        else:
            KE.copy_(shard, partial)

    def _reduce_scatter(self, out, inp):
        """out = this rank's chunk of the sum of ``inp`` over the ranks."""
        global _native_reduce_scatter
        if _native_reduce_scatter is not False:
            try:
                distributed._collective("reduce-scatter", lambda: dist.reduce_scatter_tensor(out, inp))
                _native_reduce_scatter = True
                return
            except distributed.PeerLostError as e:
                if _native_reduce_scatter or "support" not in str(e.__cause__).lower():
                    raise
                _native_reduce_scatter = False  # a backend without it (older gloo): every rank finds the same
        distributed.all_reduce_(inp)
        KE.copy_(out, inp[self.rank * out.numel():(self.rank + 1) * out.numel()])

    # ---- reduce-scatters from the backward (``overlap``) ---------------------------------------
    @property
    def overlap(self) -> bool:
        """Whether each unit's gradients are reduce-scattered from the backward, as soon as they are
        complete (see the module doc): the ``gradients`` and ``parameters`` stages on several ranks,
        unless set False; elsewhere there is nothing to reduce-scatter and it is False. Set it
        between steps."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if self._fired:
            raise RuntimeError("ShardedOptimizer.overlap: gradients of a backward await pack: set it between steps")
        on = bool(on) and not self._direct
        if on == self._overlap and self._staging is not None:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._overlap, self._staging, self._partial = [], on, None, None  # the old buffers go first
        if self._direct:
            return
        padded = max(u.padded for u in self.units)
        if not on:  # one unit staged and reduced at a time, in pack
            self._staging = runtime.empty((padded,), self.reduce_dtype)
            self._partial = runtime.empty((max(u.chunk for u in self.units),), self.reduce_dtype)
            return
        slot = _round_up(padded, PARAM_ALIGN)
        self._staging = runtime.empty((2 * slot,), self.reduce_dtype)  # a ring of two unit-sized slots
        self._slots = [self._staging[:slot], self._staging[slot:]]
        self._partial = runtime.empty((self._starts[-1],), self.reduce_dtype)  # every unit's reduced chunk
        self._partials = [self._partial[s:s + u.chunk] for u, s in zip(self.units, self._starts)]
        gaps = [self._gaps(u) for u in self.units]
        self._zeros = runtime.empty((max([n for g in gaps for _, n in g] + [1]),), torch.float32)
        KE.fill_(self._zeros, 0)
        # per unit: its members' gradients (sources set per call) and zeros into its gaps, at offsets of a slot
        self._unit_tables = [KO.Tables([((off, None), p.numel(), 0) for _, p, off in u.members] +
                                       [((at, self._zeros), n, 0) for at, n in g]) for u, g in zip(self.units, gaps)]
        self._finish_tables = KO.Tables([((self._flat_grad, self._partial, None, None), self._partial.numel(), 0)])
        if self._comm is not None:
            self._packed = torch.cuda.Event()  # compute stream: a slot is packed
            self._freed = [torch.cuda.Event(), torch.cuda.Event()]  # comm stream: slot i's reduce-scatter is done
            self._reduced = torch.cuda.Event()  # comm stream: the last unit's reduce-scatter is done
        self._member_of = {p.id: (u.index, i) for u in self.units for i, (_, p, _) in enumerate(u.members)}
        self._order = None  # the units' launch order, agreed at the first pack (see the module doc)
        self._graphed = weakref.WeakSet()  # GradientMaps of captured backwards (a replay launched their units)
        self._new_round()
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for u in self.units for _, p, _ in u.members]

    @staticmethod
    def _gaps(u):
        """``[(offset, count)]`` of unit ``u``'s positions that no member covers (alignment and padding)."""
        out, end = [], 0
        for _, p, off in u.members:
            if off > end:
                out.append((end, off - end))
            end = off + p.numel()
        return out + ([(end, u.padded - end)] if u.padded > end else [])

    def _new_round(self):
        """No gradients arrived and no unit launched (after ``pack``)."""
        self._got = [None] * len(self.units)  # per unit: its members' gradient buffers as they arrive
        self._missing = [len(u.members) for u in self.units]
        self._completed = []  # units in the order their gradients completed
        self._next = 0  # position in the order of the next unit to launch
        self._launches, self._busy = 0, [False, False]  # ring slots: read by a reduce-scatter of this round
        self._fired = self._capturing = False

    def _arrived(self, leaf, grad):
        """Post-accumulate hook of each member: its gradient is complete; a complete unit launches
        when every unit before it in the order has."""
        ui, mi = self._member_of[leaf.id]
        u = self.units[ui]
        name, p, _ = u.members[mi]
        got = self._got[ui]
        if got is None:
            got = self._got[ui] = [None] * len(u.members)
        if got[mi] is not None:
            raise RuntimeError(f"ShardedOptimizer: a second gradient for {name!r} before pack: with overlap each "
                               "backward's gradients are reduce-scattered as they come; pack them after each backward")
        got[mi] = self._source(name, p, grad, torch.float32)
        self._fired = True
        if runtime.is_capturing():
            if self._order is None:
                raise RuntimeError("ShardedOptimizer: the first backward ran inside a CUDA-graph capture; it must run "
                                   "eagerly (flame.graphs.CapturedStep's first call does): it decides the order in "
                                   "which every rank reduce-scatters the units")
            self._capturing = True
        self._missing[ui] -= 1
        if self._missing[ui] == 0:
            self._completed.append(ui)
            if self._order is not None:
                self._launch_ready(zeros=False)

    def _launch_ready(self, zeros):
        """Launch, in the agreed order, the units whose gradients are all here (``zeros``: every unit
        left, as zeros); once the last has launched the compute stream waits for the reduce-scatters."""
        order = self._order
        while self._next < len(order):
            ui = order[self._next]
            if self._missing[ui] and not zeros:
                return
            self._launch(self.units[ui], None if self._missing[ui] else self._got[ui])
            self._next += 1
        if self._comm is not None:
            self._reduced.record(self._comm)
            torch.cuda.current_stream().wait_event(self._reduced)

    def _launch(self, u, sources):
        """Unit ``u``'s gradients ``sources`` (None: zeros) times the weight into the next ring slot
        (on the compute stream), then reduce-scattered from there into its partial chunk (on the
        communication stream, after the slot is packed; the slot's next use waits for it)."""
        i = self._launches % 2
        self._launches += 1
        slot = self._slots[i][:u.padded]
        if self._busy[i]:
            torch.cuda.current_stream().wait_event(self._freed[i])
        if sources is None:
            KE.fill_(slot, 0)
        else:
            tables = self._unit_tables[u.index]
            KO.set_sources_(tables, sources)
            KO.axpby_(tables, torch.float32, self.reduce_dtype, 1.0, 0.0, dst_base=self._slots[i], scale=self._weight)
        partial = self._partials[u.index]
        if self._comm is None:  # the interpreter: gloo's collectives run synchronously
            self._reduce_scatter(partial, slot)
            return
        self._packed.record()
        self._comm.wait_event(self._packed)
        with torch.cuda.stream(self._comm):
            self._reduce_scatter(partial, slot)
        self._freed[i].record(self._comm)
        self._busy[i] = True

    def _pack_overlapped(self, grads, weight, accumulate):
        """``pack`` with ``overlap``: launch what the backward did not (all of it for a rank without
        samples, at the first pack, or for gradients that came another way), then shard =
        (``accumulate``: shard +) partials, one kernel."""
        if grads is None:
            if self._fired:
                raise RuntimeError("ShardedOptimizer.pack(None): this rank's backward has reduce-scattered its "
                                   "gradients already (overlap); pack them, weighed 0 (weigh(0) before the backward)")
        elif weight != self._weighed:
            raise ValueError(f"ShardedOptimizer.pack: weight {weight!r}, but with overlap the backward reduces the "
                             f"gradients with weigh()'s weight, {self._weighed!r}: call weigh({weight!r}) before the "
                             "backward")
        elif self._fired:
            for u in self.units:
                if self._missing[u.index]:  # a parameter without a gradient: its unit never launched
                    got = self._got[u.index] or [None] * len(u.members)
                    name, p, _ = next(m for m, g in zip(u.members, got) if g is None)
                    self._source(name, p, None)  # raises, naming it
            if self._capturing:
                self._graphed.add(grads)
        elif grads in self._graphed:  # a CUDA graph's replay of a captured backward launched every unit
            self._finish(accumulate)
            return
        else:  # gradients that did not come through the hooks (a GradientMap made otherwise)
            for u in self.units:
                self._got[u.index] = self._sources(grads, u.members, torch.float32)
                self._missing[u.index] = 0
        if self._order is None:
            self._agree_order()
        self._launch_ready(zeros=grads is None)
        self._finish(accumulate)

    def _agree_order(self):
        """The units' launch order, the same on every rank (collectives must be issued in one order):
        the order their gradients completed in the first backward of the lowest rank that ran one
        (each rank's graph is the same), else the reverse of the units' (the backward's direction)."""
        mine = self._completed if self._fired else None
        orders = [None] * self.world
        distributed._collective("all-gather", lambda: dist.all_gather_object(orders, mine))
        self._order = next((o for o in orders if o is not None), list(range(len(self.units)))[::-1])

    def _finish(self, accumulate):
        KO.axpby_(self._finish_tables, self.reduce_dtype, torch.float32, 1.0, 1.0 if accumulate else 0.0)
        self._new_round()

    # ---- the step -----------------------------------------------------------------------------
    def step(self, lr: float | None = None, max_norm: float | None = None, found_inf: Tensor | None = None,
             grad_scale: Tensor | None = None):
        """Update this rank's chunks from the packed gradients and bring the model's parameters up
        to date (see the module doc). Returns the global gradient norm (0-d fp32 device tensor) when
        ``max_norm`` is given, else None."""
        found = self._flag(found_inf, "found_inf", torch.int32)
        if self._flag(grad_scale, "grad_scale", torch.float32) is not None and max_norm is not None:
            raise ValueError("ShardedOptimizer.step: clipping needs unscaled gradients: unscale first "
                             "(scaler.unscale_(shards.grads)) instead of passing grad_scale")
        if lr is not None and not float(lr) >= 0:
            raise ValueError(f"ShardedOptimizer.step: invalid learning rate {lr!r}")
        self._idle("step")
        if self._fired:
            raise RuntimeError("ShardedOptimizer.step: the gradients of a backward await pack")
        if self.stage == "optimizer":
            for g in self._unit_grad:
                distributed.all_reduce_(g)
        if found is None:
            KE.fill_(self._found, 0)
        else:
            KE.copy_(self._found, found)
        for tables, dtype in self._shard_buckets:
            KA.check_(tables, dtype, self._found)
        distributed.all_reduce_(self._found, "max")
        if found is not None:
            KE.copy_(found, self._found)
        norm = None if max_norm is None else self._clip(float(max_norm))
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)
        self.optimizer.step(self._grads, found_inf=Tensor(self._found), grad_scale=grad_scale)
        self._refresh()
        return norm

    @staticmethod
    def _flag(x, name, dtype):
        if x is None:
            return None
        if not isinstance(x, Tensor) or x.dtype != dtype or x.numel() != 1:
            raise TypeError(f"ShardedOptimizer.step: {name} must be a 1-element {dtype} flame Tensor or None, got "
                            f"{getattr(x, 'dtype', type(x).__name__)} of shape {getattr(x, 'shape', None)}")
        return x._data.reshape(1)

    def _clip(self, max_norm):
        """The global 2-norm: each rank's norm into its slot, summed over the ranks (the others are
        0), then the 2-norm of those; the shard's gradients scaled by min(1, max_norm / norm)."""
        KE.fill_(self._norms, 0)
        KO.grad_norm_(self._shard_buckets, self._norms[self.rank:self.rank + 1], self._coef, 2.0, max_norm)
        distributed.all_reduce_(self._norms)
        norm = runtime.empty((), torch.float32)
        KO.grad_norm_(self._norm_buckets, norm, self._coef, 2.0, max_norm)
        KO.scale_(self._shard_buckets, self._coef)
        return Tensor(norm)

    def _fill(self, u, out=None):
        """Unit ``u``'s buffer (the model's parameters; or ``out``) from the ranks' master chunks: cast
        to the unit's dtype, then all-gathered."""
        out = u.buf if out is None else out
        src = self.masters[u.index]._data
        if u.dtype != torch.float32:
            cast = self._cast[:u.chunk]
            KE.copy_(cast, src)
            src = cast
        if self.world == 1:
            KE.copy_(out, src)
        else:
            distributed._collective("all-gather", lambda: dist.all_gather_into_tensor(out, src))

    def _gather_group(self, group):
        """The ring's gather: each unit of ``group`` into its place in the group's slot."""
        for u in group.units:
            self._fill(u, u.home)

    # ---- gathering (``parameters``) -------------------------------------------------------------
    def _units_of(self, params, what):
        params = params.parameters() if isinstance(params, Module) else params
        out = {}
        for p in params:
            u = self._unit_of.get(p.id) if isinstance(p, Tensor) else None
            if u is None:
                if isinstance(p, Tensor) and not p.requires_grad:
                    continue  # a frozen parameter of the block: not sharded
                raise ValueError(f"ShardedOptimizer.{what}: a {type(p).__name__} of shape {getattr(p, 'shape', '?')} "
                                 "that this ShardedOptimizer does not shard")
            out[u.index] = u
        return list(out.values())

    def _acquire(self, units):
        if self._ring is not None:
            self._ring.join()  # the ring's gathers in flight share the cast buffer
        for u in units:
            count = self._held.get(u.index, 0)
            if count == 0 and u.home is not None:  # a group's unit: memory of its own while held
                u.point(runtime.empty((u.padded,), u.dtype))
                self._fill(u)
            self._held[u.index] = count + 1

    def _release(self, units):
        for u in units:
            count = self._held.get(u.index, 0)
            if count == 0:
                raise RuntimeError(f"ShardedOptimizer.release: unit {u.index} is not gathered")
            if count == 1:
                del self._held[u.index]
                if u.home is not None:
                    u.point(u.home)  # back into its ring slot; the memory of its own goes
            else:
                self._held[u.index] = count - 1

    def gather(self, params) -> None:
        """Hold the units of ``params`` (parameters or a module) whole in the model's parameters until
        ``release``: at the ``parameters`` stage an entry of ``units`` is all-gathered into memory of
        its own (a collective; the other units are always whole), e.g. to read the weights between
        steps; a no-op at the other stages."""
        self._acquire(self._units_of(params, "gather"))

    def release(self, params) -> None:
        """Let go of the units holding ``params`` once every ``gather`` of them is released."""
        self._release(self._units_of(params, "release"))

    @contextlib.contextmanager
    def gathered(self, params):
        """``gather(params)`` for the block of a ``with``; ``release`` after."""
        units = self._units_of(params, "gather")
        self._acquire(units)
        try:
            yield
        finally:
            self._release(units)

    def run(self, block, *args, **kwargs):
        """``block(*args, **kwargs)`` (a Module) with its parameters gathered: at the ``parameters``
        stage, in its entry of ``units``' ring slot, gathered ahead while the block before it runs
        and again before its backward (one ``checkpoint.segment`` keeping its sub-graph; see the
        module doc). A block without such an entry, one held by ``gather``, and every block at the
        other stages: ``block(*args, **kwargs)``."""
        if self._ring is None:
            return block(*args, **kwargs)
        units = self._units_of(block, "run")
        groups = {self._ring.of_unit[u.index] for u in units if u.home is not None}
        if not groups or any(u.index in self._held for u in units):
            return block(*args, **kwargs)
        if len(groups) > 1:
            raise ValueError(f"ShardedOptimizer.run: {type(block).__name__}'s parameters lie in {len(groups)} entries "
                             "of units; a block is gathered as one entry: give it (or each of its parts, run one by "
                             "one) as an entry of units")
        (group,) = groups
        return self._ring.run(group, block, args, kwargs)

    def join(self) -> None:
        """Make the current stream wait for the ``parameters`` stage's gathers that no block waited
        for (a block gathered ahead that did not run): at the end of a step captured into a CUDA graph,
        whose capture fails with work left on another stream (see the module doc)."""
        if self._ring is not None:
            self._ring.join()

    # ---- memory -------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes this rank holds now: ``parameters`` (the model's trained parameters: the units' buffers
        kept whole or held by ``gather``, and at the ``parameters`` stage the ring's slots), ``master``,
        ``optimizer`` (its state), ``gradients`` (the gradient buffers)."""
        state = sum(b.numel() * b.element_size() for st in self.optimizer.state.values() for b in st.values()
                    if b is not None)
        grads = [b for b in (self._flat_grad, self._staging, self._partial) if b is not None]
        whole = sum(u.padded * u.dtype.itemsize for u in self.units if u.home is None or u.index in self._held)
        return {"parameters": whole + (self._ring.nbytes if self._ring is not None else 0),
                "master": self._master.numel() * 4, "optimizer": state,
                "gradients": sum(b.numel() * b.element_size() for b in grads)}

    # ---- state --------------------------------------------------------------------------------
    def layout(self) -> dict:
        """The index of a checkpoint of this run (``shards.json``), without the optimizer's step."""
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return {"format": FORMAT, "world_size": self.world, "stage": self.stage, "align": self.align,
                "optimizer": {"class": type(self.optimizer).__name__, "param_groups": groups},
                "units": [u.describe() for u in self.units]}

    def _step_count(self) -> int:
        opt = self.optimizer
        return int(opt._steps[opt._slots[self.masters[0].id]].item())  # host transfer; every unit steps alike

    def state_dict(self) -> dict:
        """This rank's part, in memory: ``{"layout", "master" (a copy), "optimizer"}``."""
        master = runtime.empty(tuple(self._master.shape), torch.float32)
        KE.copy_(master, self._master)
        return {"layout": self.layout(), "master": Tensor(master), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict()`` of a run with this layout (world size, units); ``load`` re-slices."""
        self._idle("load_state_dict")
        mine = self.layout()
        theirs = state.get("layout", {})
        for key in ("world_size", "units"):
            if theirs.get(key) != mine[key]:
                raise ValueError(f"ShardedOptimizer.load_state_dict: saved with another {key.replace('_', ' ')} "
                                 f"({theirs.get('world_size')} ranks): load(folder) re-slices a checkpoint")
        master = state["master"]
        master = master._data if isinstance(master, Tensor) else master
        if tuple(master.shape) != tuple(self._master.shape):
            raise ValueError(f"ShardedOptimizer.load_state_dict: master of shape {tuple(master.shape)}, expected "
                             f"{tuple(self._master.shape)}")
        KE.copy_(self._master, master)
        self.optimizer.load_state_dict(state["optimizer"])
        self._refresh()

    def _idle(self, what):
        """Before the master changes: no ``gather`` holds a unit, and the ring's gathers that read the
        master are waited for."""
        if self._held:
            raise RuntimeError(f"ShardedOptimizer.{what}: parameters are still gathered: release them first")
        self.join()

    def _refresh(self):
        """The model's parameters from the (updated or loaded) master: the units kept whole gathered
        again, the ring's slots forgotten (the next pass gathers every group anew)."""
        for u in self.units:
            if u.home is None:
                self._fill(u)
        if self._ring is not None:
            self._ring.begin()

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, folder, writers: dict | None = None) -> str:
        """Write this run's shards to ``folder`` (collective; see the module doc). ``writers``: rank
        0's other files, ``{name: write(path)}`` as ``flame.train.checkpoints.save_checkpoint``
        takes them. A complete ``folder`` is kept as it is. Returns the folder."""
        folder = os.path.abspath(os.fspath(folder))
        if os.path.isfile(os.path.join(folder, MARKER)):
            return folder
        index = dict(self.layout(), step=self._step_count(),
                     files=[shard_file(r, self.world) for r in range(self.world)])
        tensors = {"master": self._master}
        for u, master in zip(self.units, self.masters):
            for name, buf in self.optimizer.state.get(master.id, {}).items():
                if buf is not None:
                    tensors[_state_key(u.index, name)] = buf
        tmp = None
        if self.rank == 0:
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(folder)}-", dir=os.path.dirname(folder))
        tmp = distributed.broadcast_object(tmp)
        with distributed.hold_exit():
            save_safetensors(tensors, os.path.join(tmp, shard_file(self.rank, self.world)))
        distributed.barrier()
        if self.rank == 0:
            with distributed.hold_exit():
                for name, write in (writers or {}).items():
                    write(os.path.join(tmp, name))
                atomic_write(os.path.join(tmp, INDEX), lambda f: f.write(json.dumps(index, indent=1).encode()))
                fsync_dir(tmp)
                if os.path.exists(folder):  # an incomplete one left by a crash
                    shutil.rmtree(folder)
                os.rename(tmp, folder)
                fsync_dir(os.path.dirname(folder))
                atomic_write(os.path.join(folder, MARKER), lambda f: f.write(f"{index['step']}\n".encode()))
                fsync_dir(folder)
        distributed.barrier()
        return folder

    def load(self, folder) -> None:
        """Load a complete ``save`` of any world size into this run: master and optimizer state re-sliced
        for this rank's chunks, the model's parameters updated (a collective where units are kept whole:
        every unit at the first two stages, those outside ``units`` at the ``parameters`` stage)."""
        self._idle("load")
        saved = read_index(folder)
        where = {p["name"]: (u, p) for u in saved["units"] for p in u["params"]}
        mine = {name: p for u in self.units for name, p, _ in u.members}
        for name, p in mine.items():
            if name not in where:
                raise ValueError(f"ShardedOptimizer.load: {folder}: no parameter {name!r} in the checkpoint")
            if where[name][1]["shape"] != list(p.shape):  # the dtype may differ: the master is fp32 either way
                raise ValueError(f"ShardedOptimizer.load: {folder}: {name!r} has shape {where[name][1]['shape']} in "
                                 f"the checkpoint, {list(p.shape)} here")
        extra = sorted(set(where) - set(mine))
        if extra:
            raise ValueError(f"ShardedOptimizer.load: {folder}: the checkpoint trains parameters this run does not: "
                             f"{extra[:5]}")
        cls = type(self.optimizer).__name__
        if saved["optimizer"]["class"] != cls:
            raise ValueError(f"ShardedOptimizer.load: {folder}: saved with {saved['optimizer']['class']}, this run "
                             f"uses {cls}")
        with _Shards(folder, saved) as shards:
            states = {}
            for u, master in zip(self.units, self.masters):
                KE.copy_(master._data, to_device(torch.from_numpy(shards.elements(u, self.rank, None)))._data)
                if saved["step"]:
                    states[u.index] = {"step": saved["step"]}
                    for name in shards.state_names(u):
                        states[u.index][name] = torch.from_numpy(shards.state(u, self.rank, name))
        groups = [dict(g, params=list(range(len(self.masters)))) for g in saved["optimizer"]["param_groups"]]
        try:
            self.optimizer.load_state_dict({"state": states, "param_groups": groups})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ShardedOptimizer.load: {folder}: the optimizer state does not fit this run ({e}); "
                             "AdamW8bit keeps fp32 moments for chunks below min_8bit_size") from None
        self._refresh()


def read_index(folder) -> dict:
    """The checked index of a complete sharded checkpoint ``folder``."""
    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, MARKER)):
        raise FileNotFoundError(f"{folder}: not a complete sharded checkpoint (no {MARKER} marker: a save that did not "
                                "finish is never loaded)")
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{folder}: {INDEX} is not a flame sharded checkpoint index (format {index.get('format')!r})")
    world = index["world_size"]
    files = [shard_file(r, world) for r in range(world)]
    if index.get("files") != files:
        raise ValueError(f"{folder}: {INDEX} says world size {world} but lists {len(index.get('files', []))} shard "
                         f"files {index.get('files', [])[:4]}")
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise FileNotFoundError(f"{folder}: shard files missing: {missing[:4]}")
    for u in index["units"]:
        if u["dtype"] not in _DTYPES or u["chunk"] * world < u["numel"] or u["chunk"] % index["align"]:
            raise ValueError(f"{folder}: {INDEX}: unit of {u['numel']} elements in chunks of {u['chunk']} does not fit "
                             f"world size {world} and align {index['align']}")
        for p in u["params"]:
            if p["offset"] + int(np.prod(p["shape"])) > u["numel"]:
                raise ValueError(f"{folder}: {INDEX}: {p['name']!r} of shape {p['shape']} at {p['offset']} passes its "
                                 f"unit's {u['numel']} elements")
    return index


class _Shards:
    """The shard files of a checkpoint, read a slice at a time (into host NumPy arrays)."""

    def __init__(self, folder, index):
        self.folder, self.index = os.fspath(folder), index
        self.units = index["units"]
        self.where = {p["name"]: (i, p["offset"]) for i, u in enumerate(self.units) for p in u["params"]}
        self.local = np.cumsum([0] + [u["chunk"] for u in self.units]).tolist()  # unit -> start in "master"
        self._stack = contextlib.ExitStack()
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _file(self, rank):
        f = self._files.get(rank)
        if f is None:
            path = os.path.join(self.folder, self.index["files"][rank])
            f = self._files[rank] = self._stack.enter_context(open_safetensors(path))
        return f

    def read(self, rank, key, start, count):
        part = self._file(rank).get_slice(key)
        if start + count > part.get_shape()[0]:
            raise ValueError(f"{self.folder}: {self.index['files'][rank]}: {key!r} holds {part.get_shape()[0]} "
                             f"elements, the index needs {start + count}")
        return part[start:start + count].numpy()

    def _old_unit(self, unit):
        """The saved unit holding this run's ``unit``'s first parameter."""
        return self.where[unit.members[0][0]][0]

    def _key(self, old_unit, key):
        return "master" if key is None else _state_key(old_unit, key)

    def _size_dtype(self, key):
        part = self._file(0).get_slice(key)
        return part.get_shape()[0], _NUMPY[part.get_dtype()]

    def state_names(self, unit):
        """The optimizer state saved for the unit holding ``unit``'s first parameter."""
        prefix = _state_key(self._old_unit(unit), "")
        return [k[len(prefix):] for k in self._file(0).keys() if k.startswith(prefix)]  # noqa: SIM118 (not a dict)

    def _param_into(self, out, name, first, count, key, at=0):
        """Elements ``[first, first + count)`` of parameter ``name`` of the saved tensor ``key`` (None:
        the master, else an optimizer state's name) into ``out[at:]``."""
        u, offset = self.where[name]
        for r, pos, skip, n in _spans(self.units[u]["chunk"], offset + first, offset + first + count):
            start = self.local[u] + pos if key is None else pos
            out[at + skip:at + skip + n] = self.read(r, self._key(u, key), start, n)

    def elements(self, unit, rank, key):
        """This run's chunk ``rank`` of ``unit`` of the elementwise tensor ``key`` (None: the master),
        parameter by parameter from the saved ranks' chunks (gaps stay 0)."""
        out = np.zeros(unit.chunk, self._size_dtype(self._key(self._old_unit(unit), key))[1])
        lo, hi = rank * unit.chunk, (rank + 1) * unit.chunk
        for name, p, off in unit.members:
            first, last = max(lo, off), min(hi, off + p.numel())
            if first < last:
                self._param_into(out, name, first - off, last - first, key, at=first - lo)
        return out

    def state(self, unit, rank, key):
        """This run's chunk ``rank`` of ``unit`` of the optimizer state ``key``: elementwise, or one
        value per block of 256 elements (AdamW8bit's maxima; only into the same units)."""
        u = self._old_unit(unit)
        saved = self.units[u]
        size, dtype = self._size_dtype(_state_key(u, key))
        if size == saved["chunk"]:
            return self.elements(unit, rank, key)
        block = AdamW8bit.BLOCK
        same = {k: v for k, v in saved.items() if k != "chunk"} == \
            {k: v for k, v in unit.describe().items() if k != "chunk"}
        if size != saved["chunk"] // block or not same:
            raise ValueError(f"ShardedOptimizer.load: {self.folder}: optimizer state {key!r} is kept per block of "
                             f"{block} and can only be re-sliced into the same units (parameters, bucket_numel)")
        blocks = unit.chunk // block
        out = np.zeros(blocks, dtype)
        first, stop = rank * blocks, min((rank + 1) * blocks, -(-saved["numel"] // block))
        for r, pos, skip, n in _spans(size, first, max(first, stop)):
            out[skip:skip + n] = self.read(r, _state_key(u, key), pos, n)
        return out


def weights(folder):
    """The full-precision (fp32) weights of the sharded checkpoint ``folder``, one parameter at a
    time: ``(name, host tensor in the parameter's shape)``, read from the shard files as they go
    (any one process)."""
    index = read_index(folder)
    with _Shards(folder, index) as shards:
        for unit in index["units"]:
            for p in unit["params"]:
                numel = int(np.prod(p["shape"]))
                flat = np.zeros(numel, np.float32)
                shards._param_into(flat, p["name"], 0, numel, None)
                strides = [s * flat.itemsize for s in p["stride"]]
                logical = np.lib.stride_tricks.as_strided(flat, p["shape"], strides)
                yield p["name"], torch.from_numpy(np.ascontiguousarray(logical))


def export(folder, path) -> None:
    """One safetensors file at ``path`` of the full-precision (fp32) weights of the sharded
    checkpoint ``folder``, ``{name: tensor}`` in the parameters' shapes, from any one process."""
    save_safetensors(dict(weights(folder)), path)


__all__ = ["MARKER", "OPTIMIZERS", "STAGES", "ShardedOptimizer", "export", "read_index", "shard_file", "weights"]
