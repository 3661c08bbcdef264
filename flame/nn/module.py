"""``Module`` and ``Parameter``, with PyTorch's registration rules and state-dict names.

Assigning a ``Parameter`` to a module attribute registers it as a parameter, assigning a
``Module`` registers a child; ``register_buffer`` adds non-trainable state. Names are the dotted
attribute paths PyTorch uses, so a diffusers/PyTorch ``state_dict`` loads by name.
"""
from __future__ import annotations

import operator
from collections import OrderedDict

import torch

from .. import runtime
from ..kernels import elementwise as KE
from ..tensor import FLOAT_DTYPES, Tensor, check_dtype


class Parameter(Tensor):
    """A leaf Tensor that a ``Module`` registers as a parameter (``requires_grad=True`` by default).

    ``Parameter(t)`` shares ``t``'s memory (a flame Tensor, or a torch tensor on flame's device).
    """

    __slots__ = ()

    def __init__(self, data=None, requires_grad: bool = True):
        if data is None:
            data = runtime.empty((0,), runtime.get_default_dtype())
        elif isinstance(data, Tensor):
            if data._node is not None:
                raise RuntimeError("Parameter: data must be a leaf tensor (use detach())")
            data = data._data
        elif isinstance(data, torch.Tensor):
            if data.device != runtime.device:
                raise RuntimeError(f"Parameter: tensor is on {data.device} but flame runs on {runtime.device}")
            data = data.detach()
        else:
            raise TypeError(f"Parameter: expected a flame Tensor, got {type(data).__name__}")
        super().__init__(data, requires_grad=requires_grad and data.dtype.is_floating_point)

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


def _as_buffer(value, what):
    """A torch buffer on flame's device from a flame or torch tensor (torch tensors are moved: host transfer)."""
    if isinstance(value, Tensor):
        return value._data
    if isinstance(value, torch.Tensor):
        return value.detach().to(runtime.device) if value.device.type != runtime.device.type else value.detach()
    raise TypeError(f"{what} must be a tensor, got {type(value).__name__}")


def _cast(buf, dtype):
    # keep the memory layout (a channels-last conv weight stays channels-last)
    out = runtime.empty_dense_like(buf, dtype)
    KE.copy_(out, buf)
    return out


_MISSING = object()  # a name none of a module's stores has (their values may be None)


class Members(OrderedDict):
    """A module's store of parameters, buffers or children that keeps each entry in the module's
    instance dict too (``mirror``), however it is written (``Module`` assignment, ``register_*``,
    ``store[name] = value``, ``del``, ``pop``, ``clear``): an attribute read of a member is then
    a plain instance-dict hit, not a failed lookup, an AttributeError formatted and dropped and a
    ``Module.__getattr__`` call (~6K instructions; the forward of a model reads thousands a step).
    A copy (``.copy()``, ``dict(...)``) mirrors nothing, and neither does a pickled or deep-copied
    store until its module's ``__setstate__`` binds it."""

    _mirror = None  # the module's __dict__, or None (the class's)

    def __init__(self, mirror=None):
        super().__init__()
        self._mirror = mirror

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        if self._mirror is not None:
            self._mirror[name] = value

    def __delitem__(self, name):
        super().__delitem__(name)
        if self._mirror is not None:
            self._mirror.pop(name, None)

    def pop(self, name, *default):  # OrderedDict's pop and popitem do not call __delitem__
        if name not in self:
            return super().pop(name, *default)
        value = super().pop(name)
        if self._mirror is not None:
            self._mirror.pop(name, None)
        return value

    def popitem(self, last=True):
        name, value = super().popitem(last)
        if self._mirror is not None:
            self._mirror.pop(name, None)
        return name, value

    def clear(self):
        if self._mirror is not None:
            for name in self:
                self._mirror.pop(name, None)
        super().clear()

    def __reduce__(self):  # the entries, not the mirror: a deep copy's store must not fill the original's dict
        return type(self), (), None, None, iter(super().items())


class Module:
    """Base class for flame's layers (PyTorch's ``nn.Module`` semantics, without hooks). Its
    parameters, buffers and children live in ``_parameters``, ``_buffers`` and ``_modules``
    (``Members``, which keep them in the instance dict as well, for fast attribute reads)."""

    def __init__(self):
        d = self.__dict__
        object.__setattr__(self, "_parameters", Members(d))
        object.__setattr__(self, "_buffers", Members(d))
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", Members(d))
        object.__setattr__(self, "training", True)

    def __setstate__(self, state):
        """Unpickling or ``copy.deepcopy``: the module's new stores mirror into its instance dict (a
        shallow ``copy.copy`` shares the original's stores, which keep mirroring into the original)."""
        self.__dict__.update(state)
        for name in ("_parameters", "_buffers", "_modules"):
            store = self.__dict__.get(name)
            if isinstance(store, Members) and store._mirror is None:
                store._mirror = self.__dict__

    # ---- attribute registration ---------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign attributes before Module.__init__() call")
        params, modules, buffers = self._parameters, self._modules, self._buffers
        if isinstance(value, Parameter):
            self._discard(name)
            params[name] = value
        elif isinstance(value, Module):
            self._discard(name)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                "(flame.nn.Parameter or None expected)")
            params[name] = None
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module '{name}' "
                                "(flame.nn.Module or None expected)")
            modules[name] = None
        elif name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' (Tensor or None expected)")
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _discard(self, name):
        self.__dict__.pop(name, None)
        for d in (self._parameters, self._modules, self._buffers):
            d.pop(name, None)

    def __getattr__(self, name):
        # a member the instance dict lacks: in a store that is not a module's Members (or not mirrored)
        d = self.__dict__
        if "_modules" in d:  # Module.__init__ has run
            value = d["_parameters"].get(name, _MISSING)
            if value is _MISSING:
                value = d["_modules"].get(name, _MISSING)
                if value is _MISSING:
                    value = d["_buffers"].get(name, _MISSING)
            if value is not _MISSING:
                return value
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for store in (self._parameters, self._buffers, self._modules):
            if name in store:
                del store[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' as parameter '{name}' "
                            "(flame.nn.Parameter or None expected)")
        if "." in name or not name:
            raise KeyError(f"parameter name must be a non-empty string without '.', got {name!r}")
        self._discard(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' as buffer '{name}' (Tensor or None expected)")
        if "." in name or not name:
            raise KeyError(f"buffer name must be a non-empty string without '.', got {name!r}")
        self._discard(name)
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._discard(name)
        self._modules[name] = module

    register_module = add_module

    # ---- traversal ----------------------------------------------------------------------------
    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        if memo is None:
            memo = set()
        if remove_duplicate and id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is None:
                continue
            yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self):
        for _, m in self.named_children():
            yield m

    def _named_members(self, store, prefix, recurse, remove_duplicate=True):
        seen = set()
        mods = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for mod_prefix, m in mods:
            for name, t in getattr(m, store).items():
                if t is None or (remove_duplicate and t.id in seen):
                    continue
                seen.add(t.id)
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        yield from self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        mod = self
        for part in target.split(".") if target else []:
            if part not in mod._modules or mod._modules[part] is None:
                raise AttributeError(f"{type(mod).__name__} has no submodule {part!r} (looking up {target!r})")
            mod = mod._modules[part]
        return mod

    def apply(self, fn):
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ---- modes ----------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    # ---- dtype ----------------------------------------------------------------------------------
    def to(self, *args, dtype=None, device=None) -> Module:
        """Cast floating-point parameters and buffers to ``dtype`` in place (the Parameter objects,
        and so their ids and optimizer references, stay the same); ``device`` may only name
        flame's device."""
        dtype = runtime.to_args(args, dtype, device)
        if dtype is None:
            return self
        check_dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"Module.to only accepts floating point dtypes, got {dtype}")
        for m in self.modules():
            for store in (m._parameters, m._buffers):
                for t in store.values():
                    if t is not None and t.dtype.is_floating_point and t.dtype != dtype:
                        t._data = _cast(t._data, dtype)
        return self

    def float(self):
        return self.to(torch.float32)

    def half(self):
        return self.to(torch.float16)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def double(self):
        return self.to(torch.float64)

    # ---- state dict -----------------------------------------------------------------------------
    def state_dict(self, prefix: str = "", keep_vars: bool = False) -> OrderedDict:
        """Parameters and persistent buffers by dotted name (the module's own tensors, not copies)."""
        out = OrderedDict()
        for mod_prefix, m in self.named_modules(prefix=prefix.rstrip(".")):
            for name, p in m._parameters.items():
                if p is not None:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = p
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = b
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy values (flame or torch tensors) into this module's parameters and buffers, casting to
        their dtypes. Shape mismatches always raise; with ``strict`` missing and unexpected keys
        raise too. Returns ``(missing_keys, unexpected_keys)``."""
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        for k, target in own.items():
            if k not in state_dict:
                continue
            value = state_dict[k]
            shape = tuple(value.shape) if isinstance(value, (Tensor, torch.Tensor)) else None
            if shape is None:
                errors.append(f"value for '{k}' is a {type(value).__name__}, not a tensor")
            elif shape != tuple(target.shape):
                errors.append(f"size mismatch for {k}: copying a param with shape {shape} from checkpoint, "
                              f"the shape in current model is {tuple(target.shape)}")
        if strict:
            if unexpected:
                errors.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
            if missing:
                errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors))
        for k, target in own.items():
            if k in state_dict:
                src = _as_buffer(state_dict[k], f"state_dict[{k!r}]")
                if src.data_ptr() != target._data.data_ptr():
                    KE.copy_(target._data, src)
        return missing, unexpected

    # ---- calling --------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"Module [{type(self).__name__}] is missing the required \"forward\" function")

    # ``module(...)`` is ``module.forward(...)``, looked up at each call (a forward set on the instance or
    # the class later is the one that runs). A property read through C (attrgetter) gives the bound forward,
    # which the call then runs with the caller's arguments: no Python frame of its own, no repacking of
    # *args and **kwargs (a method ``__call__`` cost ~1.9K instructions a module call).
    __call__ = property(operator.attrgetter("forward"))

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = []
        extra = self.extra_repr()
        if extra:
            lines = extra.split("\n")
        for name, m in self._modules.items():
            child = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {child}")
        main = type(self).__name__ + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._parameters) | set(self._buffers) | set(self._modules))
