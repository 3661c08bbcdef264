"""Frozen block weights streamed from pinned host memory (``train.offload: blocks``, issue 49).

**What moves.** Each *streamed* block (a ``blocks.Checkpointed``: a Flux double or single block, an
SDXL resnet or transformer block) has its *frozen* tensors (parameters that do not require grad,
and buffers) packed at setup, 256-byte aligned, into one pinned host buffer, and their ``_data``
pointed for good into one of ``slots`` device buffers (2 by default, each the size of the largest
streamed block): the k-th streamed block in execution order uses slot k mod slots. Before a block
runs, its whole host buffer is copied into its slot in one host-to-device copy on a side stream,
and the compute stream waits for the copy's event. Nothing travels back (frozen weights do not
change). LoRA adapters stay on the device; so would any other trainable parameter, but the planner
refuses blocks with trainable base weights (an unfrozen model is a mistake, and its bytes would be
counted wrong). fp8 weights stream their codes; their per-channel scales stay on the device.

**Forward.** Every scheduled block (``streamable_blocks``, streamed or resident) calls the streamer
first (``Checkpointed.streamer``). The first of them starts a *pass*, which forgets what the slots
hold, so every pass (and every CUDA graph) copies in what it uses itself, whatever ran before. A
streamed block waits for its copy (issuing it now if no prefetch did) and prefetches the next
streamed blocks into the other slots; a resident block prefetches the next ``slots`` streamed
blocks. A copy into a slot first waits for every kernel issued so far on the compute stream, so
the readers of the slot's previous block are done before it is overwritten: only the running block
is in use when a copy is issued, and its slot is never the target.

**Backward.** flame's graph nodes hold the weight tensors, whose buffers are slot memory that later
blocks overwrite, so a block's weights must be copied in again before any of its backward runs and
stay until all of it has. A marker op at each block boundary, whose backward would trigger the
copy, cannot bound a block's backward: the engine orders nodes by dependencies only, and a node of
block k that reads no activation needing gradients (a LoRA'd modulation Linear of the conditioning
vector) may run after the marker on block k's inputs, on weights already overwritten. So a streamed
block whose outputs need gradients runs as one ``flame.checkpoint.segment``: with gradient
checkpointing on, the checkpoint's recomputation; off, a segment that keeps the block's sub-graph as
a plain call does. Either way the block's whole backward runs inside one engine step, after the
segment's ``on_backward`` hook: there the streamer copies the block's weights in if its slot holds
another block's, waits for them, and prefetches the streamed blocks whose backward comes next in
this pass (those that recorded a segment, in reverse order). One segment runs its backward at a
time, so every other slot is free then. The last blocks of the forward are still in their slots
when the backward starts: with 2 slots a pass of n streamed blocks copies n of them forward and
n - 2 backward.

**CUDA graphs.** Copies from pinned memory and event records and waits on a side stream are
captured like kernels: the copy stream joins the capture by waiting on an event of the capturing
stream, and is joined back when the compute stream waits on a copy. Each pass starts with empty
slots, so replays do not depend on what ran between them. Every copy issued is waited on by the
block it is for; if a prefetched block may not run (a pass stopped early, a block whose outputs
get no gradient), call ``join()`` at the end of the captured step: a capture with unjoined work
fails.

**CPU (interpreter).** No streams: host and device are both the CPU; the host buffers (the
streamer's and the loader's) are NumPy memory and the copies plain ``copy_``s in the same schedule,
so CPU tests run the same slot reuse: a block run on another block's weights gives wrong numbers.

**Loading straight into host memory.** A model that does not fit the device once is planned before
its weights exist and loaded with its streamed blocks in host memory: ``plan =
plan_offload_from_config(config, dtype, budget_bytes=... | count=..., weight_dtype=..., fp8_skip=...)``
(on the model built without memory, ``device="meta"``); ``from_pretrained(path, dtype,
host_blocks=plan.streamed, weight_dtype=..., fp8_skip=...)`` (``flame.models.placement``: each
streamed block's weights read into one pinned host buffer laid out as ``_pack`` lays a block out, the
rest on the device; fp8 weights quantised one stored tensor at a time as they load, scales on the
device); then freeze, inject LoRA and ``BlockStreamer(model, plan)``, which takes those buffers as
its sources as they are. The device holds the resident weights and one stored tensor being read,
then the slots. Quantise streamed blocks on load: ``nn.quantize_linears_`` afterwards would need
their weights on the device (it refuses host weights on a GPU) and a second host copy of them. The
plan must stream every block loaded into host memory (the streamer refuses one left resident).

**Setting up.** Last: after loading, casting, LoRA injection, fp8 conversion and freezing.
``Module.to``, ``amp.Policy.apply``, ``load_state_dict``, ``merge_lora``/``fold_lora`` write into or
replace the tensors' slot memory; ``restore()`` puts the weights back on the device first (a block
called with a streamed tensor replaced or made trainable raises). A scheduled block must read the
outer graph's tensors through its arguments only, as flame's blocks do; streamed blocks must not run
inside a larger checkpointed region.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import io, nn, runtime
from ..autograd import is_grad_enabled
from ..checkpoint import fill_ahead, segment
from ..nn.lora import lora_parameters
from ..ops.quant import Fp8Weight
from ..tensor import Tensor
from .blocks import Checkpointed, spread
from .flux import FluxConfig, FluxTransformer2DModel
from .placement import bytes_of, host_buffer, layout, nbytes, packed_on_host, place, resolve_blocks
from .sdxl_config import SDXLUNetConfig
from .sdxl_unet import SDXLUNet

__all__ = ["BlockStreamer", "OffloadPlan", "offload_blocks", "plan_offload", "plan_offload_from_config",
           "streamable_blocks"]


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- which blocks ---------------------------------------------------------------------------------

def _sdxl_order(unet):
    """SDXL's resnets and transformer blocks as its forward runs them: in each down, mid and up
    block, resnet i, then the blocks of transformer i."""
    order = []
    parts = [(f"down_blocks.{i}", b) for i, b in enumerate(unet.down_blocks)] + [("mid_block", unet.mid_block)]
    parts += [(f"up_blocks.{i}", b) for i, b in enumerate(unet.up_blocks)]
    for prefix, part in parts:
        attentions = part.attentions or []
        for i, resnet in enumerate(part.resnets):
            order.append((f"{prefix}.resnets.{i}", resnet))
            if i < len(attentions):
                order += [(f"{prefix}.attentions.{i}.transformer_blocks.{j}", b)
                          for j, b in enumerate(attentions[i].transformer_blocks)]
    return order


def streamable_blocks(model: nn.Module) -> list:
    """(name, block) of the blocks of ``model`` that can be streamed, in the order its forward runs
    them: a Flux transformer's double then single blocks; an SDXL UNet's resnets and transformer
    blocks; for another model its outermost ``Checkpointed`` modules in module order."""
    if isinstance(model, FluxTransformer2DModel):
        return [(f"double_blocks.{i}", b) for i, b in enumerate(model.double_blocks)] + \
               [(f"single_blocks.{i}", b) for i, b in enumerate(model.single_blocks)]
    if isinstance(model, SDXLUNet):
        return _sdxl_order(model)
    found = []
    for name, m in model.named_modules():
        if isinstance(m, Checkpointed) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def _frozen_tensors(name, block, who):
    """The frozen tensors of the block ``name`` as (name, tensor): parameters not requiring grad, then
    buffers, each once. ValueError when it has trainable parameters that are not LoRA adapters, or
    nothing frozen."""
    adapters = {p.id for p in lora_parameters(block)}
    frozen, trainable = [], []
    for pname, p in block.named_parameters():
        if not p.requires_grad:
            frozen.append((pname, p))
        elif p.id not in adapters:
            trainable.append(pname)
    if trainable:
        raise ValueError(f"{who}: block {name!r} has trainable base parameters ({', '.join(trainable)}); streamed "
                         "weights are frozen copies: freeze the model (model.requires_grad_(False)) before injecting "
                         "LoRA, whose adapters stay on the device")
    frozen += list(block.named_buffers())
    if not frozen:
        raise ValueError(f"{who}: block {name!r} has no frozen weights to stream")
    return frozen


def _layout(tensors) -> tuple:
    """``placement.layout`` of the (name, tensor) pairs ``tensors``."""
    return layout(nbytes(t._data) for _, t in tensors)


# ---- the planner ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What ``plan_offload`` chose. ``blocks``: every schedulable block's name in execution order;
    ``streamed``: those whose frozen tensors live in pinned host memory (``streamed_bytes`` in all);
    ``slots`` device buffers of ``slot_bytes`` each; ``resident_bytes``: the model's parameters and
    buffers left on the device; ``device_bytes``: resident plus slots; ``model_bytes``: all of them."""

    blocks: tuple
    streamed: tuple
    slots: int
    slot_bytes: int
    streamed_bytes: int
    resident_bytes: int
    model_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.slots * self.slot_bytes

    def summary(self) -> str:
        """One line for the trainer's log."""
        if not self.streamed:
            return f"offload: no block streamed; weights on the device {_gib(self.model_bytes)}"
        return (f"offload: {len(self.streamed)} of {len(self.blocks)} blocks streamed from pinned host memory "
                f"({_gib(self.streamed_bytes)}) through {self.slots} device slots of {_mib(self.slot_bytes)}; "
                f"weights on the device {_gib(self.device_bytes)} of {_gib(self.model_bytes)}")


# Which blocks stream: ``blocks.spread``, evenly spaced in execution order.
#
# The bytes a step moves are fixed by how much must leave the device, whichever blocks carry them;
# what the choice decides is how much compute each copy hides behind. A block's copy can start
# once its slot's previous block has run and must end before the block runs, so it overlaps the
# blocks in between, resident ones included. Evenly spaced streamed blocks give every copy the
# same, largest share of that compute. "Largest first" would bunch them where the large blocks
# sit (Flux's 19 double blocks in a row, SDXL's 1280-wide transformer blocks around the middle),
# and "last used" is a contiguous tail where each copy hides behind one block only (it saves the
# two copies that open the backward, which any choice saves). The slots' cost, twice the largest
# streamed block, is counted by the planner.


def _check_count(count, total):
    if count == "all":
        return total
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"plan_offload: count must be an int or 'all', got {count!r}")
    if count < 0:
        raise ValueError(f"plan_offload: count must be >= 0, got {count}")
    if count > total:
        raise ValueError(f"plan_offload: count {count} is more than the {total} blocks that can be streamed")
    return count


def _model_bytes(model) -> int:
    """The bytes of ``model``'s parameters and buffers, fp8 weights' scales included."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.id not in seen:
            seen.add(t.id)
            total += nbytes(t._data) + (nbytes(t.scale) if isinstance(t, Fp8Weight) else 0)
    return total


def plan_offload(model: nn.Module, *, count=None, budget_bytes=None, blocks=None, slots: int = 2) -> OffloadPlan:
    """Which of ``model``'s blocks to stream from pinned host memory, and what stays on the device.

    ``model`` may be without memory (``device="meta"``: ``plan_offload_from_config``).
    ``blocks``: the names of the blocks that may be streamed, in the order the forward runs them
    (default: ``streamable_blocks(model)``). Give one of ``count`` (how many: an int or "all") and
    ``budget_bytes`` (how many bytes the model's parameters and buffers may take on the device,
    slots included; the fewest streamed blocks that fit are chosen). The chosen blocks are spread
    evenly over the execution order (``blocks.spread``; the comment above says why). ``slots``: device
    buffers, each the size of the largest streamed block (2: a block's copy overlaps the compute
    before it; 1: no overlap).
    Raises ValueError when nothing fits the budget (naming the least it can do), when a chosen block
    has trainable base parameters (freeze the model before injecting LoRA) or nothing frozen."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_offload: model must be a flame.nn.Module, got {type(model).__name__}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"plan_offload: slots must be an int >= 1, got {slots!r}")
    if (count is None) == (budget_bytes is None):
        raise ValueError("plan_offload: give exactly one of count (blocks to stream) and budget_bytes (device bytes "
                         "for the weights)")
    names = [n for n, _ in streamable_blocks(model)] if blocks is None else list(blocks)
    modules = resolve_blocks(model, names, "plan_offload")
    if not names:
        raise ValueError(f"plan_offload: {type(model).__name__} has no blocks that can be streamed")
    total = _model_bytes(model)
    layouts = {}

    def plan(chosen):
        for i in chosen:
            if i not in layouts:
                tensors = _frozen_tensors(names[i], modules[i], "plan_offload")
                layouts[i] = (sum(nbytes(t._data) for _, t in tensors), _layout(tensors)[1])
        streamed = sum(layouts[i][0] for i in chosen)
        return OffloadPlan(tuple(names), tuple(names[i] for i in chosen), slots,
                           max((layouts[i][1] for i in chosen), default=0), streamed, total - streamed, total)

    if count is not None:
        return plan(spread(_check_count(count, len(names)), len(names)))
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
        raise ValueError(f"plan_offload: budget_bytes must be a positive number, got {budget_bytes!r}")
    least = None
    for n in range(len(names) + 1):
        p = plan(spread(n, len(names)))
        if p.device_bytes <= budget_bytes:
            return p
        least = p if least is None or p.device_bytes < least.device_bytes else least
    raise ValueError(f"plan_offload: the weights need at least {_gib(least.device_bytes)} on the device "
                     f"({_gib(least.resident_bytes)} resident with {len(least.streamed)} of {len(names)} blocks "
                     f"streamed, plus {slots} slots of {_mib(least.slot_bytes)}), more than the budget of "
                     f"{_gib(budget_bytes)}: raise the budget, or make the weights smaller (fp8)")


_MODELS = {FluxConfig: FluxTransformer2DModel, SDXLUNetConfig: SDXLUNet}


def plan_offload_from_config(config, dtype=None, *, count=None, budget_bytes=None, blocks=None, slots: int = 2,
                             weight_dtype=None, fp8_skip=()) -> OffloadPlan:
    """``plan_offload`` of the model ``config`` (a ``FluxConfig`` or ``SDXLUNetConfig``) describes, before
    any weight exists: the same plan as for that model loaded in ``dtype`` (flame's default when None)
    and frozen, with ``weight_dtype="fp8_e4m3"`` its Linear weights but those matching ``fp8_skip`` in
    fp8 (loaded so, or converted by ``nn.quantize_linears_``; their scales counted as resident).
    LoRA adapters, injected later, are not counted. The model is built without memory
    (``device="meta"``, ``placement.place``); pass the plan's ``streamed`` to ``from_pretrained``'s
    ``host_blocks`` and the plan itself to ``BlockStreamer``."""
    model = model_without_memory(config, dtype, weight_dtype, fp8_skip, "plan_offload_from_config")
    return plan_offload(model, count=count, budget_bytes=budget_bytes, blocks=blocks, slots=slots)


def model_without_memory(config, dtype=None, weight_dtype=None, fp8_skip=(), what="model_without_memory"):
    """The frozen model ``config`` (a ``FluxConfig`` or ``SDXLUNetConfig``) describes, built on
    ``device="meta"``: its tensors have shapes and dtypes (fp8 Linear weights as
    ``plan_offload_from_config`` says) and no memory, for planning before any weight is read."""
    cls = _MODELS.get(type(config))
    if cls is None:
        raise TypeError(f"{what}: config must be a FluxConfig or an SDXLUNetConfig, got {type(config).__name__}")
    model = cls(config, dtype=dtype, device="meta")
    place(model, (), weight_dtype, fp8_skip, what)
    model.requires_grad_(False)
    return model


# ---- the streamer ---------------------------------------------------------------------------------

class _Streamed:
    """One streamed block: its frozen tensors (name, tensor, offset, (shape, strides, dtype)), its
    pinned host copy ``host`` of ``nbytes``, its index among the streamed blocks and its slot."""

    __slots__ = ("name", "tensors", "host", "nbytes", "index", "slot")

    def __init__(self, name, tensors, nbytes, index, slot):
        self.name, self.tensors, self.nbytes, self.index, self.slot = name, tensors, nbytes, index, slot
        self.host = None


class _Entry:
    """What a scheduled block's ``streamer`` attribute holds: its position, and its ``_Streamed``
    record or None when its weights stay resident."""

    __slots__ = ("streamer", "position", "name", "streamed")

    def __init__(self, streamer, position, name, streamed):
        self.streamer, self.position, self.name, self.streamed = streamer, position, name, streamed

    def __call__(self, block, args):
        return self.streamer._run(self, block, args)


def _records(out) -> bool:
    """Whether a block's output needs gradients (its segment recorded a node)."""
    outs = (out,) if isinstance(out, Tensor) else out
    return any(isinstance(o, Tensor) and o.requires_grad for o in outs)


class BlockStreamer:
    """Runs ``model``'s blocks of ``plan`` with the frozen weights of ``plan.streamed`` in pinned host
    memory, copied to device slots as the module docstring describes. ``log=True`` keeps the
    schedule in ``log``: ``(event, block, slot, the block in each slot after the event)``, event
    "copy" (a copy issued), "forward" or "backward" (a block starts; slot None when resident).
    ``copies``, ``copied_bytes``: host-to-device copies issued so far."""

    def __init__(self, model: nn.Module, plan: OffloadPlan, *, log: bool = False):
        who = "BlockStreamer"
        if not isinstance(plan, OffloadPlan):
            raise TypeError(f"{who}: plan must be an OffloadPlan (plan_offload), got {type(plan).__name__}")
        modules = resolve_blocks(model, plan.blocks, who)
        unknown = set(plan.streamed) - set(plan.blocks)
        if unknown:
            raise ValueError(f"{who}: streamed blocks {sorted(unknown)} are not among the plan's blocks")
        for name, m in zip(plan.blocks, modules):
            if m.streamer is not None:
                raise RuntimeError(f"{who}: block {name!r} is scheduled by another streamer; restore() that first")
        streamed = tuple(f"{name}." for name in plan.streamed)
        stranded = [n for n, t in model.named_parameters() if t.device != runtime.device and not n.startswith(streamed)]
        if stranded:
            raise ValueError(f"{who}: {stranded[0]} is in host memory (loaded with host_blocks), but the plan does not "
                             "stream its block: stream every block loaded into host memory")
        self.plan, self.model = plan, model
        self.log = [] if log else None
        self.copies = self.copied_bytes = 0
        self._streamed = self._pack(model, plan, modules)
        slot_bytes = max((r.nbytes for r in self._streamed), default=0)
        self._slots = [runtime.empty((slot_bytes,), torch.uint8) for _ in range(plan.slots if self._streamed else 0)]
        for rec in self._streamed:  # the tensors live in their slot from now on
            for _, t, offset, (shape, stride, dtype) in rec.tensors:
                n = torch.Size(shape).numel() * dtype.itemsize
                t._data = self._slots[rec.slot][offset:offset + n].view(dtype).as_strided(shape, stride)
        self._checks = {rec.name: [(name, t, t._data.data_ptr()) for name, t, _, _ in rec.tensors]
                        for rec in self._streamed}
        self._copy_stream = None if runtime.is_interpreter() or not self._streamed else \
            torch.cuda.Stream(device=runtime.device)
        self._begin_pass()
        by_name = {r.name: r for r in self._streamed}
        self._entries = [(m, _Entry(self, p, name, by_name.get(name))) for p, (name, m)
                         in enumerate(zip(plan.blocks, modules))] if self._streamed else []
        # the index among the streamed blocks of the first one after each position
        self._next, k = [], 0
        for _, entry in self._entries:
            k += entry.streamed is not None
            self._next.append(k)
        for m, entry in self._entries:
            m.streamer = entry

    def _pack(self, model, plan, modules):
        """The streamed blocks' records and host buffers: a block whose frozen tensors fill one host
        buffer (loaded with ``host_blocks``: ``placement.packed_on_host``) keeps it as it is; the
        others' tensors are copied into a new pinned buffer and their memory released (``_data``
        points into the host copy until the slots exist)."""
        records, owner = [], {}
        for name, m in zip(plan.blocks, modules):
            if name not in plan.streamed:
                continue
            tensors = _frozen_tensors(name, m, "BlockStreamer")
            for tname, t in tensors:
                if runtime.dense_order(t._data) is None:
                    raise ValueError(f"BlockStreamer: {name}.{tname} is not dense (strides {t._data.stride()}); "
                                     "only dense tensors can be packed")
                if t.id in owner:
                    raise ValueError(f"BlockStreamer: {name}.{tname} is also {owner[t.id]}: a tensor shared by "
                                     "several blocks cannot be streamed")
                owner[t.id] = f"{name}.{tname}"
            packed = packed_on_host(tensors)
            host, offsets = packed if packed is not None else (None, _layout(tensors)[0])
            rec = _Streamed(name, [(tname, t, off, (tuple(t.shape), t._data.stride(), t.dtype))
                                   for (tname, t), off in zip(tensors, offsets)],
                            host.numel() if packed is not None else _layout(tensors)[1], len(records),
                            len(records) % plan.slots)
            rec.host = host
            records.append(rec)
        for full, t in model.named_parameters(remove_duplicate=False):
            if t.id in owner and not any(full.startswith(f"{r.name}.") for r in records):
                raise ValueError(f"BlockStreamer: {owner[t.id]} is also {full}, outside the streamed blocks: a "
                                 "tensor used outside its block cannot be streamed")
        for rec in records:
            if rec.host is not None:
                continue
            rec.host = host_buffer(rec.nbytes)
            for _, t, offset, _ in rec.tensors:
                n = nbytes(t._data)
                io.copy_to_host(rec.host[offset:offset + n], bytes_of(t._data))
                t._data = rec.host[offset:offset + n].view(t.dtype).as_strided(t.shape, t._data.stride())
        return records

    # ---- the schedule ------------------------------------------------------------------------
    def _begin_pass(self):
        self._owner = [None] * len(self._slots)  # the block whose weights each slot holds
        self._ready = [None] * len(self._slots)  # the event of each slot's last copy (GPU)
        self._pass = []  # the streamed blocks that recorded a segment in this pass, in forward order

    def _note(self, event, name, slot):
        if self.log is not None:
            self.log.append((event, name, slot, tuple(r.name if r is not None else None for r in self._owner)))

    def _fill(self, rec):
        """Copy ``rec``'s host buffer into its slot, after every kernel issued so far."""
        dst = self._slots[rec.slot][:rec.nbytes]
        if self._copy_stream is None:
            dst.copy_(rec.host)  # host transfer
        else:
            issued = torch.cuda.Event()
            issued.record()  # the compute stream: the slot's previous readers
            self._copy_stream.wait_event(issued)
            with torch.cuda.stream(self._copy_stream):
                dst.copy_(rec.host, non_blocking=True)  # host transfer
            self._ready[rec.slot] = torch.cuda.Event()
            self._ready[rec.slot].record(self._copy_stream)
        self._owner[rec.slot] = rec
        self.copies += 1
        self.copied_bytes += rec.nbytes
        self._note("copy", rec.name, rec.slot)

    def _use(self, rec):
        """Have ``rec``'s weights in its slot before the kernels issued next."""
        if self._owner[rec.slot] is not rec:
            self._fill(rec)
        if self._ready[rec.slot] is not None:
            torch.cuda.current_stream().wait_event(self._ready[rec.slot])

    def _prefetch(self, upcoming, busy):
        """Copy in the first of ``upcoming`` (streamed blocks in the order they will run), up to the
        first whose slot is ``busy`` (the running block's) or taken by an earlier one of them."""
        fill_ahead(upcoming, busy, lambda rec: self._owner[rec.slot] is rec, self._fill)

    def _check(self, rec):
        for name, t, ptr in self._checks[rec.name]:
            if t.requires_grad or t._data.data_ptr() != ptr:
                what = "requires grad now" if t.requires_grad else "was given other memory (Module.to, a load?)"
                raise RuntimeError(f"BlockStreamer: {rec.name}.{name}, a streamed frozen weight, {what}; call "
                                   "restore() before changing streamed weights, then stream again")

    def _run(self, entry, block, args):
        if entry.position == 0:
            self._begin_pass()
        rec = entry.streamed
        if rec is None:
            self._note("forward", entry.name, None)
            self._prefetch(self._streamed[self._next[entry.position]:], None)
            return block._run(args)
        self._check(rec)
        self._use(rec)
        self._note("forward", rec.name, rec.slot)
        self._prefetch(self._streamed[rec.index + 1:], rec.slot)
        if not is_grad_enabled():
            return block.forward(*args)
        this = self._pass
        out = segment(block.forward, args, recompute=block.gradient_checkpointing,
                      on_backward=functools.partial(self._backward, this, len(this)))
        if _records(out):
            this.append(rec)
        return out

    def _backward(self, this, k):
        """The backward of ``this`` pass's k-th recorded block starts."""
        rec = this[k]
        self._use(rec)
        self._note("backward", rec.name, rec.slot)
        self._prefetch(reversed(this[:k]), rec.slot)

    # ---- public ------------------------------------------------------------------------------
    def join(self) -> None:
        """Make the current stream wait for every copy issued so far (see the module docstring)."""
        if self._copy_stream is not None:
            done = torch.cuda.Event()
            done.record(self._copy_stream)
            torch.cuda.current_stream().wait_event(done)

    def restore(self) -> None:
        """Put every streamed tensor back in device memory of its own and stop scheduling the blocks."""
        runtime.synchronize()
        for rec in self._streamed:
            for _, t, offset, (shape, stride, dtype) in rec.tensors:
                buf = runtime.empty_strided(shape, stride, dtype)
                bytes_of(buf).copy_(rec.host[offset:offset + nbytes(buf)])  # host transfer
                t._data = buf
        for m, _ in self._entries:
            m.streamer = None
        self._streamed, self._entries, self._slots, self._checks = [], [], [], {}
        self._begin_pass()


def offload_blocks(model: nn.Module, *, count=None, budget_bytes=None, slots: int = 2) -> BlockStreamer:
    """``BlockStreamer(model, plan_offload(model, count=..., budget_bytes=..., slots=...))``."""
    return BlockStreamer(model, plan_offload(model, count=count, budget_bytes=budget_bytes, slots=slots))
