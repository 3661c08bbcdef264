"""The check behind the rule that flame/ uses PyTorch for memory and runtime handles only.

Every floating-point operation in flame/ is a flame Triton kernel. PyTorch may allocate memory,
describe it (views, shapes, dtypes, devices), move it between host and device, and hand out CUDA
runtime objects and ``torch.distributed`` collectives. Two layers check this; each sees what the
other cannot:

``scan`` (static, ``ast``)
    Follows how each module binds torch (``import torch as th``, ``import torch.nn.functional as
    F``, ``from torch import cuda as c, empty``, names assigned from torch attributes, literal
    ``getattr`` and ``importlib.import_module``), resolves every name and attribute chain through
    those bindings, scope by scope, and classifies the torch API it reaches with ``TORCH_API``.
    It covers code that no workload runs, but not methods called on tensor objects
    (``buf.sum()``).

``AtenRecorder`` (dynamic, a ``TorchDispatchMode``)
    Records every ATen op run while a workload runs and attributes it to the first Python frame
    outside torch and the standard library. Ops issued from flame's files are classified with
    ``ATEN_OPS``; those issued elsewhere (Triton's interpreter moving kernel arguments, the tests)
    are counted and ignored. It sees tensor methods and the copies torch makes behind a call (a
    ``reshape`` of a layout that cannot be viewed clones), on the paths the workload takes.

Limits: the static layer reports a torch object where a module binds it; its uses through another
object (``self.op = torch.exp``) or another module (a re-export) are not followed further, and
string annotations are not read. The dynamic layer sees only the paths the workload takes, in the
thread that records.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import pathlib
import sys

# ==== the static layer's allow-list ============================================================
# Keys: categories. Values: dotted torch names; "name.*" covers the name and everything under it
# (a module, or an object whose attributes are all metadata), a plain name only itself. The
# longest matching entry decides, so a "compute" entry carves an exception out of an allowed
# module. A name that no entry covers is compute: the rule's default.
TORCH_API = {
    # The package itself (``import torch``): each name used from it is classified on its own.
    "package": (
        "torch",
    ),
    # Memory without values. (Filling it, zeros/ones/full/rand*, is a flame kernel's work.)
    "allocation": (
        "torch.empty", "torch.empty_like", "torch.empty_strided",
    ),
    # What a buffer is, never what it holds: the tensor and size types (isinstance checks,
    # annotations) and memory formats. Views themselves are tensor methods: the dynamic layer's.
    "views/metadata": (
        "torch.Tensor", "torch.Size", "torch.is_tensor", "torch.memory_format", "torch.channels_last",
        "torch.contiguous_format", "torch.preserve_format", "torch.strided", "torch.layout",
    ),
    # Element types, their limits, devices.
    "dtypes/devices": (
        "torch.dtype", "torch.device", "torch.finfo", "torch.iinfo",
        "torch.float16.*", "torch.bfloat16.*", "torch.float32.*", "torch.float64.*", "torch.half.*",
        "torch.float.*", "torch.double.*", "torch.float8_e4m3fn.*", "torch.float8_e5m2.*",
        "torch.int8.*", "torch.int16.*", "torch.int32.*", "torch.int64.*", "torch.uint8.*",
        "torch.int.*", "torch.long.*", "torch.short.*", "torch.bool.*",
    ),
    # Host memory seen as a tensor without a copy (the copy to the device is ``.to``, a method).
    "host transfer": (
        "torch.from_numpy", "torch.frombuffer", "torch.utils.dlpack.*",
    ),
    # Streams, events, graphs, devices, memory statistics.
    "CUDA runtime": (
        "torch.cuda.*", "torch.Stream", "torch.Event",
    ),
    # Process groups and collectives (their reductions run in NCCL or Gloo, as the rule allows).
    "distributed": (
        "torch.distributed.*",
    ),
    # Host-side tools that touch no flame buffer: the version, the TensorBoard writer.
    "tooling": (
        "torch.__version__", "torch.version.*", "torch.utils.tensorboard.*",
    ),
    # Compute inside the modules allowed above: autocast and GradScaler, scatter/gather helpers
    # that add, NCCL called directly, torch's RNG, and the distributed packages that run torch ops
    # on tensors (DTensor, FSDP, DDP hooks, optimizers, autograd-aware collectives, checkpoints).
    "compute": (
        "torch.cuda.amp.*", "torch.cuda.comm.*", "torch.cuda.nccl.*", "torch.cuda.random.*",
        "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
        "torch.distributed.tensor.*", "torch.distributed._tensor.*", "torch.distributed.fsdp.*",
        "torch.distributed._composable.*", "torch.distributed.algorithms.*", "torch.distributed.optim.*",
        "torch.distributed.nn.*", "torch.distributed.checkpoint.*", "torch.distributed.pipelining.*",
    ),
}

# References the scan cannot follow (``getattr`` on torch with a computed name, a module imported
# by a computed name), read by hand and accepted: the call's source text -> (its file, what it
# reaches). Keyed by text rather than line, so that edits around it do not invalidate it.
REVIEWED_DYNAMIC = {
    "getattr(torch, dtype_name)": ("flame/autotune.py", "a dtype by name (tuning tables key dtypes by name)"),
    "getattr(torch, a[1])": ("flame/kernels/precompile.py", "a dtype by name (a recorded kernel variant's argument)"),
    "importlib.import_module(module)": ("flame/kernels/precompile.py", "a module under flame.kernels (checked first) "
                                                                       "holding a recorded kernel"),
    'importlib.import_module(f"{__package__}.{info.name}")': ("flame/kernels/launch.py", "each module of flame.kernels "
                                                                                         "(settle_cache_keys)"),
}

_ENTRIES = {name: category for category, names in TORCH_API.items() for name in names}


def classify(name: str) -> str:
    """The category of the dotted torch name ``name`` ("compute" when no entry covers it)."""
    if name in _ENTRIES:
        return _ENTRIES[name]
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        category = _ENTRIES.get(".".join(parts[:n]) + ".*")
        if category is not None:
            return category
    return "compute"


@dataclasses.dataclass(frozen=True, order=True)
class Hit:
    """A torch reference: ``reason`` is its category, or why it cannot be followed."""
    path: str
    line: int
    name: str
    reason: str
    code: str = dataclasses.field(default="", compare=False)  # source text, for REVIEWED_DYNAMIC

    def __str__(self):
        return f"{self.path}:{self.line}: {self.name}: {self.reason}"


# ==== the static layer =========================================================================
# Scopes follow Python's rules: a name bound anywhere in a function is local to it, class bodies
# are not visible from their methods, ``global``/``nonlocal`` redirect a binding, comprehensions
# have their own scope, := binds in the enclosing function. A name bound several ways in a scope
# may hold any of the torch objects among them (a conservative union).

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SCOPES = (ast.Module, ast.ClassDef, *_FUNCTIONS, *_COMPREHENSIONS)
_OTHER = object()  # a binding to something that is not a torch object
_LEAVES = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.Constant)


class _Scope:
    def __init__(self, node, parent):
        self.node, self.parent = node, parent
        self.bindings = {}  # name -> [torch path, (expression, the scope evaluating it), or _OTHER]
        self.declared = {}  # name -> "global" | "nonlocal"

    def module(self):
        scope = self
        while scope.parent is not None:
            scope = scope.parent
        return scope

    def enclosing_binder(self, name):
        """The nearest enclosing function (or the module) that binds ``name``."""
        scope = self.parent
        while scope is not None and (isinstance(scope.node, ast.ClassDef) or name not in scope.bindings):
            scope = scope.parent
        return scope


def _split_scope(node):
    """(the parts of a scope-opening node evaluated outside it, the parts evaluated inside)."""
    if isinstance(node, ast.Module):
        return [], node.body
    if isinstance(node, _COMPREHENSIONS):
        first, *rest = node.generators
        inner = [node.elt] if not isinstance(node, ast.DictComp) else [node.key, node.value]
        inner += [cond for gen in node.generators for cond in gen.ifs] + [gen.iter for gen in rest]
        return [first.iter], inner + [gen.target for gen in node.generators]
    outer = list(getattr(node, "decorator_list", ()))
    if isinstance(node, ast.ClassDef):
        return outer + node.bases + node.keywords, node.body
    a = node.args
    outer += [d for d in (*a.defaults, *a.kw_defaults) if d is not None]
    if not isinstance(node, ast.Lambda):
        args = (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
        outer += [arg.annotation for arg in args if arg is not None and arg.annotation is not None]
        outer += [node.returns] if node.returns is not None else []
    return outer, node.body if isinstance(node.body, list) else [node.body]


def _chain(node):
    """(base expression, ["attr", ...]) of an ``<expression>.attr.attr`` chain."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _literal_str(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


@functools.cache
def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError, AttributeError):
        return False


class _Module:
    """One file: pass 1 builds its scopes and their bindings, pass 2 (``references``) resolves and
    classifies every torch reference."""

    def __init__(self, tree, path, source):
        self.path, self.source = path, source
        self.scope_of = {}  # id(scope node) -> _Scope
        self.hits = set()
        self._nonlocal = []  # (scope, name, value): bound once every enclosing scope is known
        self._parent = {}  # id(node) -> the node pass 2 reached it from
        self._open(tree, None)
        for scope, name, value in self._nonlocal:
            binder = scope.enclosing_binder(name)
            if binder is not None:
                binder.bindings[name].append(value)

    # ---- pass 1: bindings ----------------------------------------------------------------------
    def _bind(self, scope, name, value, evaluated_in=None):
        if isinstance(value, ast.AST):
            value = (value, evaluated_in or scope)
        how = scope.declared.get(name)
        if how == "nonlocal":
            self._nonlocal.append((scope, name, value))
        else:
            (scope.module() if how == "global" else scope).bindings.setdefault(name, []).append(value)

    def _bind_target(self, scope, target, value=None, evaluated_in=None):
        if isinstance(target, ast.Starred):
            target = target.value
        if isinstance(target, ast.Name):
            self._bind(scope, target.id, _OTHER if value is None else value, evaluated_in)
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) \
                else [None] * len(target.elts)
            for t, v in zip(target.elts, values):
                self._bind_target(scope, t, v, evaluated_in)

    def _open(self, node, parent):
        scope = self.scope_of[id(node)] = _Scope(node, parent)
        if isinstance(node, _FUNCTIONS):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    self._bind(scope, arg.arg, _OTHER)
        elif isinstance(node, _COMPREHENSIONS):
            for gen in node.generators:
                self._bind_target(scope, gen.target)
        for child in _split_scope(node)[1]:
            self._collect(child, scope)

    def _collect(self, node, scope):
        """Record the bindings ``node`` makes in ``scope``; recurse, opening nested scopes."""
        if isinstance(node, (*_LEAVES, ast.Name)):
            return
        if isinstance(node, _SCOPES):
            if not isinstance(node, (ast.Lambda, *_COMPREHENSIONS)):
                self._bind(scope, node.name, _OTHER)
            for child in _split_scope(node)[0]:
                self._collect(child, scope)
            self._open(node, scope)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                torch = _is_torch(alias.name)
                if alias.asname:
                    self._bind(scope, alias.asname, alias.name if torch else _OTHER)
                else:  # ``import torch.nn.functional`` binds ``torch``
                    self._bind(scope, alias.name.split(".")[0], "torch" if torch else _OTHER)
        elif isinstance(node, ast.ImportFrom):
            torch = node.level == 0 and _is_torch(node.module or "")
            for alias in node.names:
                if alias.name != "*":  # a star import is reported in pass 2
                    self._bind(scope, alias.asname or alias.name, f"{node.module}.{alias.name}" if torch else _OTHER)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                scope.declared[name] = "global" if isinstance(node, ast.Global) else "nonlocal"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_target(scope, target, node.value)
        elif isinstance(node, ast.AnnAssign):
            self._bind_target(scope, node.target, node.value)
        elif isinstance(node, ast.NamedExpr):  # binds outside any comprehension it stands in
            binder = scope
            while isinstance(binder.node, _COMPREHENSIONS):
                binder = binder.parent
            self._bind_target(binder, node.target, node.value, evaluated_in=scope)
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)):
            self._bind_target(scope, node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind_target(scope, node.optional_vars)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                self._bind_target(scope, target)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            self._bind(scope, node.name, _OTHER)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            self._bind(scope, node.rest, _OTHER)
        for child in ast.iter_child_nodes(node):
            self._collect(child, scope)

    # ---- resolution ----------------------------------------------------------------------------
    def _binder(self, name, scope):
        """The scope whose binding of ``name`` a load in ``scope`` sees (None: a builtin)."""
        first = scope
        while scope is not None:
            how = scope.declared.get(name)
            if how == "global":
                scope = scope.module()
                return scope if name in scope.bindings else None
            if how != "nonlocal" and name in scope.bindings and (
                    scope is first or not isinstance(scope.node, ast.ClassDef)):
                return scope
            scope = scope.parent
        return None

    def resolve_name(self, name, scope, seen):
        """The torch paths that ``name`` may hold in ``scope`` (empty: none)."""
        binder = self._binder(name, scope)
        if binder is None or (id(binder), name) in seen:
            return set()
        seen = seen | {(id(binder), name)}
        paths = set()
        for value in binder.bindings[name]:
            if isinstance(value, str):
                paths.add(value)
            elif isinstance(value, tuple):
                paths |= self.resolve(*value, seen)
        return paths

    def resolve(self, node, scope, seen=frozenset()):
        """The torch paths an expression may evaluate to: an attribute chain on a name bound to
        torch, on a literal ``getattr``/``import_module`` of torch, or on a choice of those
        (``a if c else b``, ``a or b``, ``(n := a)``)."""
        base, attrs = _chain(node)
        if isinstance(base, ast.Name):
            paths = self.resolve_name(base.id, scope, seen)
        elif isinstance(base, ast.Call):
            target = self._lookup(base, scope, seen)
            paths = {target[0]} if target is not None and target[1] is None else set()
        elif isinstance(base, (ast.IfExp, ast.BoolOp, ast.NamedExpr)):
            options = [base.body, base.orelse] if isinstance(base, ast.IfExp) else \
                base.values if isinstance(base, ast.BoolOp) else [base.value]
            paths = set().union(*(self.resolve(o, scope, seen) for o in options))
        else:
            return set()
        return {".".join([p, *attrs]) for p in paths}

    def _lookup(self, call, scope, seen=frozenset()):
        """For ``getattr(<torch object>, name)``, ``importlib.import_module(name)`` and
        ``__import__(name)``: (the torch path, None) for a literal ``name``, (the torch path of
        the base or "?", why it cannot be followed) for a computed one. None for other calls."""
        func, args = call.func, call.args
        if isinstance(func, ast.Name) and func.id == "getattr" and len(args) >= 2:
            bases = sorted(self.resolve(args[0], scope, seen))
            if not bases:
                return None
            attr = _literal_str(args[1])
            if attr is None:
                return bases[0], "an attribute looked up by a computed name cannot be followed"
            return f"{bases[0]}.{attr}", None
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in ("import_module", "__import__"):
            module = _literal_str(args[0]) if args else None
            if module is None:
                return "?", "a module imported by a computed name cannot be followed"
            return (module, None) if _is_torch(module) else None
        return None

    # ---- pass 2: references --------------------------------------------------------------------
    def references(self, tree):
        """Every torch reference of the file, allowed or not."""
        self._visit(tree, self.scope_of[id(tree)], None)
        return sorted(self.hits)

    def _report(self, node, name, reason=None):
        code = (ast.get_source_segment(self.source, node) or "") if reason else ""
        self.hits.add(Hit(self.path, node.lineno, name, reason or classify(name), code))

    def _followed(self, node):
        """Whether the value of ``node`` is one the scan follows: bound to a name (also through
        ``a if c else b``, ``a or b``, := and tuple assignment) or the base of an attribute chain."""
        parent = self._parent.get(id(node))
        while isinstance(parent, (ast.IfExp, ast.BoolOp, ast.Tuple, ast.List)) and \
                not (isinstance(parent, ast.IfExp) and node is parent.test):
            node, parent = parent, self._parent.get(id(parent))
        return isinstance(parent, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.Attribute)) and parent.value is node

    def _visit(self, node, scope, parent):
        self._parent[id(node)] = parent
        if isinstance(node, _LEAVES):
            return
        if isinstance(node, _SCOPES) and node is not scope.node:
            outer, inner = _split_scope(node)
            for child in outer:
                self._visit(child, scope, node)
            for child in inner:
                self._visit(child, self.scope_of[id(node)], node)
            return
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch(alias.name):
                    self._report(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _is_torch(node.module or ""):
                for alias in node.names:
                    if alias.name == "*":
                        self._report(node, f"{node.module}.*", "a star import: its names cannot be followed")
                    else:
                        self._report(node, f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Call):
            target = self._lookup(node, scope)
            if target is not None:
                self._report(node, *target)
                children = node.args[2 if isinstance(node.func, ast.Name) and node.func.id == "getattr" else 1:]
                children += node.keywords
        elif isinstance(node, (ast.Attribute, ast.Name)):
            base = _chain(node)[0]
            paths = self.resolve(node, scope)
            for path in paths:
                self._report(node, path)
                if isinstance(node.ctx, ast.Load) and _is_module(path) and not self._followed(node):
                    self._report(node, path, "a torch module used as a value: its uses cannot be followed")
            if isinstance(base, ast.Name):
                return
            if paths and isinstance(base, ast.Call):  # getattr(torch, "x").y: the call's other arguments
                children = [*base.args[1:], *base.keywords]
            else:
                children = [base]
        for child in children:
            self._visit(child, scope, node)


def _compute_reason(name):
    listed = name in _ENTRIES or any(e.endswith(".*") and name.startswith(e[:-1]) for e in _ENTRIES)
    return "compute (an exception listed inside an allowed module)" if listed else "compute (not in the allow-list)"


def _violation(hit: Hit):
    """The hit, with the reason it fails, or None for an allowed use."""
    if hit.reason not in TORCH_API:  # a reference the scan cannot follow
        reviewed = REVIEWED_DYNAMIC.get(hit.code)
        return None if reviewed and pathlib.PurePath(hit.path).as_posix().endswith(reviewed[0]) else hit
    if hit.reason != "compute":
        return None
    return dataclasses.replace(hit, reason=_compute_reason(hit.name))


def references(source: str, path: str = "<string>") -> list[Hit]:
    """Every torch reference of one module's source, allowed or not."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        return [Hit(path, e.lineno or 0, "?", f"cannot parse: {e.msg}")]
    return _Module(tree, path, source).references(tree)


def scan_source(source: str, path: str = "<string>") -> list[Hit]:
    """The torch references of one module's source that the rule does not allow."""
    return [v for v in map(_violation, references(source, path)) if v is not None]


def scan(root) -> list[Hit]:
    """The torch references the rule does not allow in every ``*.py`` under ``root`` (or one file)."""
    root = pathlib.Path(root)
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    return [hit for path in files for hit in scan_source(path.read_text(), str(path))]


# ==== the dynamic layer's allow-list ===========================================================
# ATen op names: the overload packet, so "view" covers aten.view.default and aten.view.dtype.
# Any other op that flame's code issues is compute.
ATEN_OPS = {
    # Memory without values; ``lift_fresh`` is ``torch.from_numpy`` wrapping host memory as it is,
    # ``set_`` a tensor pointed at a storage as it is (the safetensors package's ``get_tensor``).
    "allocation": (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "set_",
    ),
    # Another description of the same storage: no element read or written.
    "views/metadata": (
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "t", "transpose", "permute", "expand",
        "slice", "select", "narrow", "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes",
        "unbind", "unfold", "diagonal",
    ),
    # A buffer moved whole between host and device, unchanged (``_transfer`` checks each copy):
    # from one device to another or, where the device is the host (Triton's interpreter), from
    # host memory that ``torch.from_numpy`` wrapped to a device buffer. Any other copy, and a cast
    # on the way, is compute (flame has its own copy kernel). ``_local_scalar_dense``: ``.item()``.
    "host transfer": (
        "_to_copy", "copy_", "_local_scalar_dense",
    ),
}
_ATEN = {name: category for category, names in ATEN_OPS.items() for name in names}


def _storage(t):
    return t.untyped_storage().data_ptr()


def _transfer(name, args, out, host_storages):
    """Why a ``_to_copy``/``copy_`` is not a transfer (None when it is one). ``host_storages``:
    the addresses of storages that ``torch.from_numpy`` made."""
    import torch

    src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return "not a tensor copy"
    if src.dtype != dst.dtype:
        return f"a cast from {src.dtype} to {dst.dtype}"
    if src.device != dst.device or (_storage(src) in host_storages and _storage(dst) not in host_storages):
        return None
    return f"a copy within {dst.device}"


def classify_op(func, args=(), out=None, host_storages=frozenset()) -> str:
    """The category of an ATen op call; "compute ..." when the rule does not allow it."""
    name = func.overloadpacket.__name__
    category = _ATEN.get(name)
    if category is None:
        return "compute"
    if name in ("_to_copy", "copy_"):
        why = _transfer(name, args, out, host_storages)
        if why is not None:
            return f"compute ({why})"
    return category


@dataclasses.dataclass(frozen=True, order=True)
class OpCall:
    path: str  # relative to the folder holding the recorded root: "flame/ops/matmul.py"
    line: int
    function: str  # the function issuing the op
    op: str  # "aten.sum.dim_IntList"
    category: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.op} in {self.function}: {self.category}"


def _owner(path):
    """Who issued an op that is not flame's: a package (``triton``) or a folder (``tests``)."""
    parts = pathlib.PurePath(path).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    return pathlib.PurePath(path).parent.name


class AtenRecorder:
    """A context manager recording every ATen op this thread runs while it is open.

    An op belongs to the first frame of its Python stack that is not in torch, the standard
    library or this file. Ops whose frame is in a file under ``roots`` (flame/ by default) are
    appended to ``calls``; the others (Triton's interpreter moving kernel arguments, the tests
    building inputs) are only counted in ``others``, by owner."""

    def __init__(self, roots=None):
        if roots is None:
            import flame

            roots = [pathlib.Path(flame.__file__).parent]
        import torch

        self.roots = tuple(str(pathlib.Path(r).resolve()) + os.sep for r in roots)
        self.calls: list[OpCall] = []
        self.others: dict = {}
        self._torch_dir = str(pathlib.Path(torch.__file__).parent.resolve()) + os.sep
        self._stdlib_dir = str(pathlib.Path(os.__file__).parent.resolve()) + os.sep
        self._this = str(pathlib.Path(__file__).resolve())
        self._files = {}  # code filename -> resolved path, or None for a frame to look through
        self._owners = {}  # resolved path -> owner, for ``others``
        self._host = set()  # addresses of the storages torch.from_numpy made (host memory)
        self._mode = None

    def _resolve(self, filename):
        path = self._files.get(filename, False)
        if path is False:
            path = None
            if not filename.startswith("<"):  # <frozen ...>, <string>: look through
                path = str(pathlib.Path(filename).resolve())
                in_stdlib = path.startswith(self._stdlib_dir) and \
                    "site-packages" not in pathlib.PurePath(path[len(self._stdlib_dir):]).parts
                if in_stdlib or path.startswith(self._torch_dir) or path == self._this:
                    path = None
            self._files[filename] = path
        return path

    def caller(self, frame):
        """The first frame from ``frame`` outwards not looked through, and its resolved file."""
        while frame is not None:
            path = self._resolve(frame.f_code.co_filename)
            if path is not None:
                return frame, path
            frame = frame.f_back
        return None, None

    def record(self, func, args, out, frame):
        import torch

        # Track host memory first: from_numpy's storages; an address any other op returns afresh (not
        # a view, not written in place) has been reused by torch's allocator, so this op's own output
        # (a copy's destination) is no host memory of from_numpy's when the op is classified.
        name = func.overloadpacket.__name__
        if name not in ATEN_OPS["views/metadata"] and name != "copy_":
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    (self._host.add if name == "lift_fresh" else self._host.discard)(_storage(t))
        frame, path = self.caller(frame)
        root = next((r for r in self.roots if path is not None and path.startswith(r)), None)
        if root is not None:
            short = pathlib.PurePath(path).relative_to(pathlib.PurePath(root).parent).as_posix()
            self.calls.append(OpCall(short, frame.f_lineno, frame.f_code.co_name, str(func),
                                     classify_op(func, args, out, self._host)))
        else:
            owner = self._owners.get(path)
            if owner is None:
                owner = self._owners[path] = "?" if path is None else _owner(path)
            self.others[owner] = self.others.get(owner, 0) + 1

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                recorder.record(func, args, out, sys._getframe(1))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._mode = None

    def violations(self) -> list[OpCall]:
        """The recorded ops the rule does not allow, once per place and op."""
        return sorted({c for c in self.calls if c.category.startswith("compute")})


# ==== the workload the dynamic layer watches ===================================================

def workload(tmp_dir) -> dict:
    """A tiny training run through flame's main paths: Conv2d, GroupNorm, SiLU, Linear,
    LayerNorm, causal attention, GELU, a token mean, cross-entropy and MSE, backward, gradient
    clipping, AdamW, Lion, EMA, a LoRA layer trained a step then merged and unmerged, autocast
    (fp16) with DynamicLossScaler, safetensors save/load, state dicts, host reads. Returns values
    a test can check."""
    import flame
    import flame.nn.functional as F
    from flame import amp, io, nn, optim

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.norm = nn.GroupNorm(2, 4)
            self.proj = nn.Linear(4, 8)
            self.ln = nn.LayerNorm(8)
            self.out = nn.Linear(8, 5)

        def forward(self, x):
            h = flame.silu(self.norm(self.conv(x)))  # (2, 4, 3, 3)
            h = self.ln(self.proj(h.flatten(2).transpose(1, 2)))  # (2, 9, 8): tokens
            q = h.view(2, 9, 2, 4).transpose(1, 2)  # (2, 2, 9, 4): heads
            a = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 9, 8)
            return self.out(F.gelu(a)).mean(dim=1)  # (2, 5): pooled over the tokens

    flame.manual_seed(0)
    net = Net()
    x = flame.randn(2, 3, 3, 3)
    labels = flame.tensor([1, 3])
    target = flame.randn(2, 5)

    def loss_of():
        logits = net(x)
        return F.cross_entropy(logits, labels) + 0.5 * F.mse_loss(logits, target)

    params = list(net.parameters())
    adamw, lion = optim.AdamW(params, lr=1e-2), optim.Lion(params, lr=1e-3)
    ema = optim.EMA(params, decay=0.9)
    losses = []
    for opt in (adamw, lion):
        loss = loss_of()
        grads = loss.backward()
        optim.clip_grad_norm_(grads, 1.0)
        opt.step(grads)
        ema.update()
        losses.append(float(loss))

    nn.inject_lora(net, ["out"], rank=2, alpha=2)
    for p in nn.lora_parameters(net):
        nn.init.normal_(p, 0.0, 0.1)
    lora_opt = optim.AdamW(nn.lora_parameters(net), lr=1e-2)
    lora_opt.step(loss_of().backward())
    nn.merge_lora(net)
    merged = net.out.merged
    nn.unmerge_lora(net)

    scaler = amp.DynamicLossScaler(init_scale=2.0 ** 8)
    with amp.autocast(flame.float16):
        loss = loss_of()
    grads = scaler.scale(loss).backward()
    scaler.unscale_(grads)
    scaler.step(lora_opt, grads)
    scaler.update()

    path = pathlib.Path(tmp_dir) / "weights.safetensors"
    io.save_safetensors({"w": net.out.weight, "b": net.out.bias, "x": x.to(flame.float16)}, path)
    loaded = io.load_safetensors(path)
    net.load_state_dict(net.state_dict())
    return dict(losses=losses, merged=merged, unmerged=not net.out.merged, scale=scaler.get_scale(),
                skipped=scaler.last_step_skipped(), loaded=sorted(loaded), bias=loaded["b"].numpy().tolist(),
                adamw_state=len(adamw.state_dict()["state"]))
