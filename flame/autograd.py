"""The define-by-run graph: grad mode, nodes, the backward engine and ``GradientMap``.

Every differentiable op that runs with grad mode on and an input requiring grad records one
``Node`` for its (single) output. A node points at what produced its inputs: the producing
node for an interior tensor, the tensor itself for a leaf. It holds only what its backward rule
saved, never the input tensors themselves, so interior activations are freed as soon as nothing
else refers to them.

``backward`` walks the graph iteratively (Kahn's algorithm on consumer counts), so a graph
thousands of nodes deep needs no recursion. Gradients of interior tensors are freed as soon as
their node has run; gradients of leaves are accumulated into a ``GradientMap``.
"""
from __future__ import annotations

import functools
import threading
import types

import torch

from . import runtime


class _State(threading.local):
    enabled = True  # grad mode of this thread
    seen = None  # inside track_inputs(): {tensor id: tensor} of what ops would have recorded edges to


_state = _State()


def is_grad_enabled() -> bool:
    return _state.enabled


def set_grad_enabled(mode: bool) -> None:
    _state.enabled = bool(mode)


class _GradMode:
    """Context manager and decorator that sets grad mode for the current thread."""

    _mode = True

    def __enter__(self):
        self._prev = is_grad_enabled()
        set_grad_enabled(self._mode)
        return self

    def __exit__(self, *exc):
        set_grad_enabled(self._prev)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradMode):
    """Disable graph recording in this thread: ``with flame.no_grad(): ...`` or ``@flame.no_grad()``."""

    _mode = False


class enable_grad(_GradMode):
    """Re-enable graph recording inside a ``no_grad`` region."""

    _mode = True


class RemovableHandle:
    def __init__(self, hooks: list, fn):
        self._hooks = hooks
        self._fn = fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Node:
    """One recorded op. ``backward(node, grad_out)`` returns one gradient (or None) per input.
    ``edges``: per input, its producing node, the leaf itself, or None (no gradient wanted);
    ``input_meta``: per input, its shape and dtype, flat (``shape0, dtype0, shape1, ...``)."""

    __slots__ = ("backward_fn", "edges", "input_meta", "saved", "attrs", "hooks", "released")

    def __init__(self, backward_fn, edges, input_meta, saved, attrs):
        self.backward_fn = backward_fn
        self.edges = edges
        self.input_meta = input_meta
        self.saved = saved
        self.attrs = attrs
        self.hooks = None
        self.released = False

    @property
    def name(self) -> str:
        return self.backward_fn.__name__

    @property
    def needs_input_grad(self):
        return tuple([e is not None for e in self.edges])  # a list first: no generator resumed per edge

    def __repr__(self):
        return f"<Node {self.name}>"


def needs_grad(*tensors) -> bool:
    """True when an op over these inputs must be recorded."""
    for t in tensors:  # a plain loop: this runs for every op
        if t is not None and t._requires_grad:
            break
    else:  # no input requires grad: nothing to record in any grad mode, and nothing for track_inputs
        return False
    if _state.enabled:  # a thread-local read, only for an input that requires grad
        return True
    seen = _state.seen
    if seen is not None:  # inside track_inputs(): note what the op would have recorded edges to
        for t in tensors:
            if t is not None and t._requires_grad:
                seen[t.id] = t
    return False


class track_inputs:
    """While grad mode is off, collect every tensor requiring grad that an op receives.

    ``with track_inputs() as seen: ...`` leaves ``seen`` as ``{tensor id: tensor}``: the tensors
    from outside the region that the ops inside it would have recorded edges to (tensors made
    inside a ``no_grad`` region never require grad). Activation checkpointing uses it to find the
    parameters and closed-over tensors of a segment it runs without recording. Nests: an inner
    region's tensors are also reported to the outer one.
    """

    def __enter__(self):
        self._prev = _state.seen
        self.seen = {}
        _state.seen = self.seen
        return self.seen

    def __exit__(self, *exc):
        _state.seen = self._prev
        if self._prev is not None:
            self._prev.update(self.seen)
        return False


_NO_META = (None, None)  # the (shape, dtype) of an input without a gradient


def record(out, inputs, backward_fn, saved=(), **attrs):
    """Attach a node to ``out``; ``inputs`` are the op's tensor inputs (None for non-tensors).

    The node keeps each input's (shape, dtype) in one flat tuple of plain tuples, dtypes and None,
    which the garbage collector stops tracking at its first pass: of the objects an op leaves alive
    until its backward, only the node, its edges and what its rule saved stay tracked (the fewer
    there are, the rarer Python's full collections over every live object)."""
    if len(inputs) == 1:  # most ops: one tensor input (views, unary maps, casts)
        (t,) = inputs
        if t is None or not t._requires_grad:
            edges, meta = (None,), _NO_META
        else:
            data = t._data
            edges, meta = (t._node or t,), (tuple(data.shape), data.dtype)
    else:  # a plain loop: generator expressions cost a frame per element here
        edges, meta = [], []
        for t in inputs:
            if t is None or not t._requires_grad:
                edges.append(None)
                meta += _NO_META
            else:
                edges.append(t._node or t)
                data = t._data
                meta += (tuple(data.shape), data.dtype)
        edges, meta = tuple(edges), tuple(meta)
    if not out._data.dtype.is_floating_point:
        out.requires_grad = True  # raises, naming the dtype
    out._node = Node(backward_fn, edges, meta, saved, attrs)
    out._requires_grad = True
    return out


class GradientMap:
    """Gradients of leaf tensors, indexed by the tensor itself.

    ``grads[w]`` (KeyError when ``w`` has no gradient), ``w in grads``, ``grads.get(w, default)``,
    ``grads[w] = g``: keys are flame Tensors, and anything else (a name, an int) raises TypeError.
    The map holds tensor ids, not the tensors (it keeps no parameter alive), so ``keys()`` gives
    tensor ids, ``values()`` the gradients, and ``items()`` and iteration ``(tensor id, gradient)``
    pairs; ``by_id`` is a read-only ``{tensor id: gradient}`` view for code that holds ids (the
    optimizers look their parameters up by id). ``len(grads)``; ``grads += other`` /
    ``grads.accumulate(other)`` for gradient accumulation across micro-batches (sums in place,
    adds new keys).
    """

    def __init__(self):
        self._grads = {}

    @staticmethod
    def _key(t):
        if isinstance(t, _deps()[3]):
            return t.id
        cls = type(t)
        got = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(t, int) and not isinstance(t, bool):
            got += f" {t}; to look a gradient up by tensor id use grads.by_id[{t}]"
        elif isinstance(t, str):
            got += f" {t!r}; names are not keys: index by the parameter itself (grads[model.weight])"
        raise TypeError(f"GradientMap keys are flame Tensors (grads[w] for a leaf w that requires grad), got {got}")

    def __getitem__(self, t):
        key = self._key(t)
        if key not in self._grads:
            raise KeyError(f"no gradient for tensor id {key} (not a leaf that requires grad in this graph?)")
        return self._grads[key]

    def __setitem__(self, t, grad):
        self._grads[self._key(t)] = grad

    def __contains__(self, t):
        return self._key(t) in self._grads

    def get(self, t, default=None):
        return self._grads.get(self._key(t), default)

    @property
    def by_id(self):
        """A read-only ``{tensor id: gradient}`` view of this map."""
        return types.MappingProxyType(self._grads)

    def __len__(self):
        return len(self._grads)

    def __iter__(self):
        """``(tensor id, gradient)`` pairs, as ``items()``."""
        return iter(self._grads.items())

    def keys(self):
        return self._grads.keys()

    def values(self):
        return self._grads.values()

    def items(self):
        return self._grads.items()

    def accumulate(self, other: GradientMap) -> GradientMap:
        from .ops.elementwise import add_
        if not isinstance(other, GradientMap):
            raise TypeError(f"accumulate expects a GradientMap, got {type(other).__name__}")
        for key, grad in other._grads.items():
            mine = self._grads.get(key)
            if mine is None:
                self._grads[key] = grad.clone()  # in the gradient's own layout
            else:
                if mine.shape != grad.shape:
                    raise RuntimeError(f"gradient for tensor id {key} has shape {mine.shape} here and "
                                       f"{grad.shape} in the other map")
                add_(mine, grad)
        return self

    def __iadd__(self, other):
        return self.accumulate(other)

    def __repr__(self):
        return f"GradientMap({len(self)} tensors)"


# Gradients of fp16/bf16 leaves are accumulated in fp32; of any other dtype, in the leaf's own.
_LEAF_GRAD_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _collect(root_nodes, boundary):
    """Count, for each node and each leaf (by id), how many edges of the reachable graph point at it.

    Edges into ``boundary`` (nodes and leaf ids) are neither counted nor followed."""
    node_deps = dict.fromkeys(root_nodes, 0)
    leaf_deps = {}
    stack = list(node_deps)
    while stack:
        node = stack.pop()
        if node.released:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors "
                "after they have already been freed). Saved intermediate values of the graph are freed "
                "when you call backward(); pass retain_graph=True to backward the first time if you need "
                f"to backward through it again (node {node.name})."
            )
        for edge in node.edges:
            if edge is None:
                continue
            if isinstance(edge, Node):
                if edge in boundary:
                    continue
                if edge in node_deps:
                    node_deps[edge] += 1
                else:
                    node_deps[edge] = 1
                    stack.append(edge)
            elif edge.id not in boundary:
                leaf_deps[edge.id] = leaf_deps.get(edge.id, 0) + 1
    return node_deps, leaf_deps


def _fit(grad, shape, dtype):
    """Reduce a broadcast gradient to its input's shape and cast it to its input's dtype."""
    if grad.shape != shape:
        from .ops.reduce import sum_to_shape
        grad = sum_to_shape(grad, shape)
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    return grad


_engine_deps = None  # (autocast_state, add, ones_like, Tensor): imported on first use (they import this module)


def _deps():
    global _engine_deps
    if _engine_deps is None:
        from .ops._autocast import autocast_state
        from .ops.creation import ones_like
        from .ops.elementwise import add
        from .tensor import Tensor
        _engine_deps = (autocast_state, add, ones_like, Tensor)
    return _engine_deps


def _roots(root, grad):
    """``(tensor, gradient)`` pairs from one root or a sequence of roots (and their gradients)."""
    _, _, ones_like, Tensor = _deps()

    roots = [root] if isinstance(root, Tensor) else list(root)
    grad_list = [grad] if isinstance(root, Tensor) or grad is None else list(grad)
    if grad is None:
        grad_list = [None] * len(roots)
    if len(grad_list) != len(roots):
        raise ValueError(f"backward: {len(roots)} roots but {len(grad_list)} gradients")
    pairs = []
    for r, g in zip(roots, grad_list):
        if not isinstance(r, Tensor):
            raise TypeError(f"backward() needs a flame Tensor, got {type(r).__name__}")
        if not r.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        if g is None:
            if r.numel() != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs; got shape {r.shape}: "
                    "pass grad= with the output's shape"
                )
            g = ones_like(r)
        else:
            if not isinstance(g, Tensor):
                raise TypeError(f"grad must be a flame Tensor, got {type(g).__name__}")
            if g.shape != r.shape:
                raise RuntimeError(f"grad has shape {g.shape} but the output has shape {r.shape}")
            if g.dtype != r.dtype:
                g = g.to(r.dtype)
        pairs.append((r, g))
    return pairs


def run_backward(root, grad=None, retain_graph=False, capture=(), accumulate_leaves=True, boundary=()):
    """The engine behind ``Tensor.backward`` and ``flame.grad``.

    ``root`` is a tensor or a sequence of tensors (``grad`` then a matching sequence or None).
    ``capture`` holds nodes and leaf ids whose total gradient the caller wants back; returns
    ``(GradientMap, {node or leaf id: gradient})``. ``boundary`` holds nodes and leaf ids where the
    walk stops: the gradient reaching each is summed into the returned dict and goes no further
    (no backward rule, hook or accumulation runs for it).
    """
    autocast_state, add, _, _ = _deps()
    pairs = _roots(root, grad)
    captured = {}
    grads = GradientMap()

    with no_grad(), autocast_state(None):  # backward rules run in the dtypes the forward recorded
        pending = {}  # gradient flowing into each node's output, summed over consumers
        leaf_pending = {}  # leaf id -> gradient so far
        for r, g in pairs:
            key = r._node if r._node is not None else r.id
            if key in boundary:
                _add_pending(captured, key, g, add)
            elif r._node is None:  # backward of a leaf onto itself
                _add_pending(leaf_pending, r.id, g, add)
            else:
                _add_pending(pending, r._node, g, add)
        node_deps, leaf_deps = _collect(list(pending), boundary)
        leaves = {r.id: r for r, _ in pairs if r._node is None}
        for leaf_id in list(leaf_pending):
            if leaf_id not in leaf_deps:  # a leaf root that no other root reaches
                _finish_leaf(leaves[leaf_id], leaf_pending.pop(leaf_id), grads, capture, captured,
                             accumulate_leaves)
        ready = [n for n in pending if node_deps[n] == 0]
        while ready:
            node = ready.pop()
            g = pending.pop(node)
            for hook in node.hooks or ():
                new = hook(g)
                if new is not None:
                    g = new
            if node in capture:
                captured[node] = g
            in_grads = node.backward_fn(node, g)
            del g
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            meta = iter(node.input_meta)  # (shape, dtype) of each input, flat: zip takes two from it per edge
            for edge, shape, dtype, ig in zip(node.edges, meta, meta, in_grads):
                if edge is None:
                    continue
                if ig is not None:
                    data = ig._data
                    if data.shape != shape or data.dtype != dtype:
                        ig = _fit(ig, shape, dtype)
                if type(edge) is Node:
                    if edge in boundary:
                        _add_pending(captured, edge, ig, add)
                        continue
                    if ig is not None:  # _add_pending, inline: once per edge of the graph
                        prev = pending.get(edge)
                        pending[edge] = ig if prev is None else add(prev, ig)
                    left = node_deps[edge] - 1
                    node_deps[edge] = left
                    if left == 0:
                        if edge in pending:
                            ready.append(edge)
                        else:  # no gradient flowed into this branch: nothing to propagate
                            for leaf in _skip(edge, node_deps, leaf_deps, pending, ready, boundary):
                                if leaf.id in leaf_pending:  # its other uses did send a gradient
                                    _finish_leaf(leaf, leaf_pending.pop(leaf.id), grads, capture, captured,
                                                 accumulate_leaves)
                elif edge.id in boundary:
                    _add_pending(captured, edge.id, ig, add)
                else:  # a leaf: its gradient summed over its uses, finished at the last
                    leaf_id = edge.id
                    left = leaf_deps[leaf_id] - 1
                    leaf_deps[leaf_id] = left
                    if left:
                        _add_pending(leaf_pending, leaf_id, ig, add)
                        continue
                    prev = leaf_pending.pop(leaf_id, None)
                    if prev is not None:
                        ig = prev if ig is None else add(prev, ig)
                    if ig is not None:
                        _finish_leaf(edge, ig, grads, capture, captured, accumulate_leaves)
            if not retain_graph:
                node.saved = None
                node.released = True
    return grads, captured


def _skip(node, node_deps, leaf_deps, pending, ready, boundary):
    """Propagate 'no gradient' through a branch whose every consumer produced None; returns the
    leaves whose last consumer was in that branch."""
    done = []
    stack = [node]
    while stack:
        n = stack.pop()
        for edge in n.edges:
            if edge is None:
                continue
            if isinstance(edge, Node):
                if edge in boundary:
                    continue
                node_deps[edge] -= 1
                if node_deps[edge] == 0:
                    if edge in pending:
                        ready.append(edge)
                    else:
                        stack.append(edge)
            elif edge.id not in boundary:
                leaf_deps[edge.id] -= 1
                if leaf_deps[edge.id] == 0:
                    done.append(edge)
    return done


def _add_pending(pending, key, grad, add):
    if grad is None:
        return
    prev = pending.get(key)
    pending[key] = grad if prev is None else add(prev, grad)


def _finish_leaf(leaf, grad, grads, capture, captured, accumulate):
    """A leaf's gradient is complete: run its hooks, store it, run its post-accumulate hooks."""
    for hook in leaf._hooks or ():
        new = hook(grad)
        if new is not None:
            grad = new
    dtype = leaf._data.dtype
    want = _LEAF_GRAD_DTYPES.get(dtype, dtype)
    if grad._data.dtype != want:
        grad = grad.to(want)
    grad = _in_leaf_layout(grad, leaf)
    if leaf.id in capture:
        captured[leaf.id] = grad
    if accumulate:
        grads._grads[leaf.id] = grad  # grads[leaf], the key known to be a Tensor's
        for hook in leaf._post_hooks or ():
            hook(leaf, grad)


def _in_leaf_layout(grad, leaf):
    """``grad`` laid out as ``leaf`` is when the leaf is dense (a channels-last conv weight gets a
    channels-last gradient: torch's rule for ``.grad``, and what the optimizers update in place
    with flat kernels), else contiguous; a stride-0 expand from sum's backward becomes dense."""
    gd, ld = grad._data, leaf._data
    # the usual case, at once: both contiguous (then their strides differ at most where a dim has size 1)
    if gd.is_contiguous() and ld.is_contiguous() and gd.shape == ld.shape:
        return grad
    if runtime.same_dense_layout(gd, ld):
        return grad
    from .ops.shape import copy_as
    return copy_as(grad, leaf._data)


def grad(outputs, inputs, grad_outputs=None, retain_graph=False, allow_unused=False):
    """Gradients of ``outputs`` with respect to ``inputs`` (leaves or interior tensors).

    Returns a tuple aligned with ``inputs``; an input the output does not depend on raises unless
    ``allow_unused=True`` (then its entry is None).
    """
    from .tensor import Tensor
    single = isinstance(inputs, Tensor)
    inputs = (inputs,) if single else tuple(inputs)
    for t in inputs:
        if not isinstance(t, Tensor):
            raise TypeError(f"flame.grad inputs must be Tensors, got {type(t).__name__}")
        if not t.requires_grad:
            raise RuntimeError(f"flame.grad: input tensor {t.id} does not require grad")
    keys = [t._node if t._node is not None else t.id for t in inputs]
    _, captured = run_backward(outputs, grad_outputs, retain_graph=retain_graph, capture=set(keys),
                               accumulate_leaves=False)
    result = []
    for t, key in zip(inputs, keys):
        g = captured.get(key)
        if g is None and not allow_unused:
            raise RuntimeError(f"flame.grad: input tensor {t.id} was not used in the graph (pass allow_unused=True)")
        result.append(g)
    return result[0] if single else tuple(result)
