"""Activation checkpointing: trade a second forward for the memory of a segment's activations.

``checkpoint(fn, *args)`` runs ``fn`` with recording off, so none of its intermediates are kept;
it keeps only ``args`` and the random-number state. While it runs, ``autograd.track_inputs``
notes every tensor from outside the segment that requires grad and reaches an op inside it: the
tensors among ``args``, the parameters ``fn`` reads from its modules, and closed-over interior
tensors. The outputs get one node whose edges point at those tensors, so the engine orders the
segment correctly in the surrounding graph and routes their gradients like any other op's.

In backward the node re-runs ``fn`` with recording on (same random state, so dropout masks
replay; same autocast state), then back-propagates through the recomputed sub-graph with the
outside tensors as its boundary: the walk stops there and hands their gradients back to the
outer engine, which accumulates parameter gradients and carries on into the graph before the
segment. The recomputed sub-graph is released as it is walked, so at most one segment's
activations are alive at a time during backward (PyTorch's ``use_reentrant=False`` semantics).

A segment with several outputs records one node per output, each feeding a shared "hub" node
that owns the recomputation; the engine runs the hub only after every output's gradient has
arrived, so the segment is recomputed and walked once.

``segment(fn, args, recompute=False)`` is the same node without the recomputation: ``fn`` runs
with recording on, on fresh leaves standing for its tensor arguments, and the hub walks the kept
sub-graph in the backward. Either way the segment's whole backward runs inside one engine step
(the hub's), between ``on_backward()``, called first, and the hub's return: what
``flame.models.offload`` needs to have a block's streamed weights on the device exactly while
anything of that block runs in the backward.
"""
from __future__ import annotations

from . import runtime
from .autograd import Node, enable_grad, is_grad_enabled, no_grad, record, run_backward, track_inputs
from .ops._autocast import autocast_state, get_autocast
from .ops.creation import get_rng_state, set_rng_state
from .tensor import Tensor, float32

__all__ = ["checkpoint", "checkpoint_sequential", "fill_ahead", "segment"]


def _empty_grad():
    """What an output node hands its hub: the hub's placeholder output has no elements."""
    return Tensor(runtime.empty((0,), float32))


def _edge_key(t):
    return t._node if t._node is not None else t.id


class _Segment:
    """What the hub keeps between forward and backward: the call and its RNG/autocast state (or, not
    recomputing, the outputs it kept), the boundary key of each outside tensor (its edge, in
    order), and the output gradients as they arrive."""

    __slots__ = ("fn", "args", "kwargs", "keys", "rng", "autocast", "kept", "on_backward", "grads", "n_out")

    def __init__(self, fn, args, kwargs, keys, rng, autocast, kept, on_backward, n_out):
        self.fn, self.args, self.kwargs, self.keys = fn, args, kwargs, keys
        self.rng, self.autocast, self.kept, self.on_backward = rng, autocast, kept, on_backward
        self.grads = {}
        self.n_out = n_out


def _output_backward(node, g):
    node.saved.grads[node.attrs["slot"]] = g
    return _empty_grad()


def _recompute(seg):
    outer_rng = get_rng_state()
    set_rng_state(seg.rng)
    try:
        with autocast_state(seg.autocast), enable_grad():
            outs = seg.fn(*seg.args, **seg.kwargs)
    finally:
        set_rng_state(outer_rng)
    return (outs,) if isinstance(outs, Tensor) else tuple(outs)


def _hub_backward(node, _):
    seg = node.saved
    if seg.on_backward is not None:
        seg.on_backward()
    outs = _recompute(seg) if seg.kept is None else seg.kept
    if len(outs) != seg.n_out:
        raise RuntimeError(f"checkpoint: the recomputation returned {len(outs)} outputs, the forward {seg.n_out}")
    roots, root_grads = [], []
    grads, seg.grads = seg.grads, {}  # empty again for a second backward (retain_graph=True)
    for slot, g in grads.items():
        out = outs[slot]
        if not out.requires_grad:
            raise RuntimeError(
                f"checkpoint: output {slot} does not require grad in the recomputation although it did in the "
                "forward (does fn depend on global state that changed between forward and backward?)"
            )
        roots.append(out)
        root_grads.append(g)
    del outs, grads
    _, captured = run_backward(roots, root_grads, boundary=set(seg.keys))
    return tuple(captured.get(k) for k in seg.keys)


def _fresh_leaf(a, originals):
    """A leaf standing for the tensor argument ``a`` inside a kept segment (``a`` itself when it
    needs no gradient); ``originals`` maps the leaf's id back to ``a``."""
    if not isinstance(a, Tensor) or not a.requires_grad:
        return a
    leaf = Tensor(a._data, requires_grad=True)
    originals[leaf.id] = a
    return leaf


def _kept_boundary(outs, originals):
    """(outside tensors, their boundary keys) of a segment recorded on fresh leaves: every leaf its
    outputs' sub-graph reaches, the fresh ones standing for the arguments ``originals`` maps them to
    (edges go to the argument), the others (parameters, closed-over leaves) as themselves."""
    externals, keys, seen = [], [], set()
    stack = [o._node if o._node is not None else o for o in outs if isinstance(o, Tensor) and o.requires_grad]
    while stack:
        item = stack.pop()
        if isinstance(item, Node):
            if item not in seen:
                seen.add(item)
                stack.extend(e for e in item.edges if e is not None)
        elif item.id not in seen:
            seen.add(item.id)
            externals.append(originals.get(item.id, item))
            keys.append(item.id)
    return tuple(externals), tuple(keys)


def segment(fn, args=(), kwargs=None, *, recompute=True, on_backward=None):
    """``fn(*args, **kwargs)`` recorded as one node of the graph, whose backward runs the whole of
    ``fn``'s backward (see the module docstring). ``recompute=True`` is ``checkpoint``: nothing of
    ``fn`` is kept and its backward recomputes it. ``recompute=False`` keeps ``fn``'s sub-graph, as
    a plain call would, recorded on fresh leaves for its tensor arguments; ``fn`` must then read
    tensors of the outer graph through its arguments only (parameters and other leaves may be read
    directly). ``on_backward``: called with no arguments when the node's backward starts, before
    anything of ``fn`` runs again. With recording off this is ``fn(*args, **kwargs)``."""
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    kwargs = {} if kwargs is None else kwargs
    if not is_grad_enabled():
        return fn(*args, **kwargs)
    rng, autocast = get_rng_state(), get_autocast()
    if recompute:
        with no_grad(), track_inputs() as seen:
            outs = fn(*args, **kwargs)
    else:
        originals = {}  # fresh leaf id -> the argument it stands for
        outs = fn(*[_fresh_leaf(a, originals) for a in args],
                  **{k: _fresh_leaf(v, originals) for k, v in kwargs.items()})
    single = isinstance(outs, Tensor)
    if not single and not isinstance(outs, (tuple, list)):
        raise TypeError(f"checkpoint: fn must return a Tensor or a tuple of Tensors, got {type(outs).__name__}")
    outs = (outs,) if single else tuple(outs)
    if recompute:
        for out in outs:  # an output fn passed through unchanged (no op saw it)
            if isinstance(out, Tensor) and out.requires_grad:
                seen[out.id] = out
        externals = tuple(seen.values())
        seg = _Segment(fn, args, kwargs, tuple(_edge_key(t) for t in externals), rng, autocast, None, on_backward,
                       len(outs))
    else:
        externals, keys = _kept_boundary(outs, originals)
        seg = _Segment(fn, None, None, keys, None, None, outs, on_backward, len(outs))
    if not externals:  # nothing inside requires grad: no node to record
        return outs[0] if single else outs
    hub = _empty_grad()  # the hub's placeholder output
    record(hub, externals, _hub_backward, saved=seg)
    result = []
    for slot, out in enumerate(outs):
        if isinstance(out, Tensor) and out.dtype.is_floating_point:
            out = Tensor(out._data)  # a fresh tensor even when fn handed back one of its inputs
            record(out, (hub,), _output_backward, saved=seg, slot=slot)
        result.append(out)
    return result[0] if single else tuple(result)


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without keeping its intermediates; they are recomputed in backward.

    ``fn`` returns a Tensor or a tuple/list of Tensors (non-Tensor and non-floating entries pass
    through without gradient). Gradients reach ``args``, the parameters ``fn`` uses and any other
    tensor requiring grad it reads, as if ``fn`` had been called directly. ``fn`` must compute the
    same thing when re-run (flame's random state is restored for the re-run, so dropout is fine).
    With recording off (``flame.no_grad()``) this is just ``fn(*args, **kwargs)``.
    """
    return segment(fn, args, kwargs)


def checkpoint_sequential(functions, segments: int, x):
    """Run ``functions`` (a ``Sequential``, or a list of callables/modules) one after another on
    ``x``, checkpointing them in ``segments`` consecutive chunks, as
    ``torch.utils.checkpoint.checkpoint_sequential`` (the last chunk runs without checkpointing:
    backward needs its activations at once)."""
    fns = list(functions.children()) if hasattr(functions, "children") else list(functions)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be a positive int, got {segments!r}")
    segments = min(segments, max(len(fns), 1))
    size = len(fns) // segments

    def run(start, end):
        def chunk(h):
            for f in fns[start:end]:
                h = f(h)
            return h
        return chunk

    plain_from = size * (segments - 1)
    for start in range(0, plain_from, size):
        x = checkpoint(run(start, start + size), x)
    return run(plain_from, len(fns))(x)


def fill_ahead(upcoming, busy, holds, fill):
    """The rule by which blocks run as segments on weights kept in a ring of slots are filled ahead of
    their use (``flame.models.offload``'s streamed blocks, ``flame.sharding``'s gathered ones):
    ``fill(rec)`` each of ``upcoming`` (records with a ``slot``, in the order they will run) whose slot
    does not hold it (``holds(rec)``), up to the first whose slot is ``busy`` (the running block's) or
    taken by an earlier one of them."""
    taken = {busy}
    for rec in upcoming:
        if rec.slot in taken:
            return
        taken.add(rec.slot)
        if not holds(rec):
            fill(rec)
