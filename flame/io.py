"""safetensors files through the ``safetensors`` package, and LoRA adapter files.

Loading opens the file with ``safe_open`` (which checks the whole header -- dtypes, shapes,
offsets, and that the data covers them: a truncated file is an error before anything is read),
then reads one tensor at a time into host memory and moves it to flame's device (never two copies
of a whole file), or into host memory given for it (``to_host``: a streamed block's weights, which
never go to the device whole). Saving serialises the tensors' host copies with ``safetensors.torch.save`` and
writes the bytes through ``atomic_write``: a temporary file in the target directory, fsynced and
renamed over the target. Errors name the file.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as serialize

from . import runtime
from .kernels import elementwise as KE
from .ops.elementwise import to
from .tensor import Tensor

# the format's dtype names of the dtypes flame holds
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
# float8 tensors (ComfyUI's t5xxl_fp8_e4m3fn, fp8 checkpoints) are read too: decoded to float32 on
# the host on load (``_float8_values``), then cast like any other tensor
FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _float8_values(exponent_bits: int) -> np.ndarray:
    """The 256 values of a float8 format (1 sign bit, ``exponent_bits``, the rest mantissa) by bit
    pattern, float32: E4M3 "fn" (bias 7, no infinity, S.1111.111 NaN) or E5M2 (bias 15, IEEE
    infinities and NaNs); subnormals where the exponent field is 0."""
    mantissa_bits = 7 - exponent_bits
    bias = 2 ** (exponent_bits - 1) - 1
    code = np.arange(256)
    sign = np.where(code >> 7, -1.0, 1.0)
    e = (code >> mantissa_bits) & (2 ** exponent_bits - 1)
    m = (code & (2 ** mantissa_bits - 1)) / 2 ** mantissa_bits
    values = sign * np.where(e == 0, m * 2.0 ** (1 - bias), (1 + m) * 2.0 ** (e - bias))
    top = e == 2 ** exponent_bits - 1
    if exponent_bits == 4:  # E4M3fn: the top exponent holds numbers, all mantissa bits set is NaN
        values[top & (m == 1 - 2.0 ** -mantissa_bits)] = np.nan
    else:
        values[top] = np.where(m[top] == 0, sign[top] * np.inf, np.nan)
    return values.astype(np.float32)


_FLOAT8_VALUES = {torch.float8_e4m3fn: _float8_values(4), torch.float8_e5m2: _float8_values(5)}


def _buffer(value, name):
    if isinstance(value, Tensor):
        return value._data
    if isinstance(value, torch.Tensor):
        return value.detach()
    raise TypeError(f"save_safetensors: {name!r} is a {type(value).__name__}, not a tensor")


def _host_copy(buf):
    """``buf``'s values as a contiguous host tensor (a dense copy by flame's copy kernel first if
    needed)."""
    if buf.device.type == runtime.device.type and not buf.is_contiguous():
        dense = runtime.empty(tuple(buf.shape), buf.dtype)
        KE.copy_(dense, buf)
        buf = dense
    elif not buf.is_contiguous():  # a host tensor while flame runs on the GPU: a host-side copy, no math
        buf = buf.contiguous()
    return buf.cpu() if buf.device.type != "cpu" else buf  # host transfer


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write ``tensors`` ({name: flame or torch tensor}) to ``path`` in the safetensors format,
    atomically. ``metadata``: {str: str}, stored under ``__metadata__``."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_safetensors: expected a dict of tensors, got {type(tensors).__name__}")
    if metadata:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise TypeError(f"save_safetensors: metadata keys and values must be str, bad entries: {bad[:5]}")
    host = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"save_safetensors: invalid tensor name {name!r}")
        host[name] = _host_copy(_buffer(value, name))
    try:
        data = serialize(host, metadata=dict(metadata) if metadata else None)
    except (SafetensorError, ValueError, TypeError) as e:
        raise TypeError(f"save_safetensors: {path}: {e}") from None
    atomic_write(path, lambda f: f.write(data))


def fsync_dir(path) -> None:
    """Make a folder's entries (files renamed into it) durable: fsync the folder itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write) -> None:
    """Create or replace ``path`` atomically: ``write(f)`` fills a temporary file (binary) in the
    same folder, which is fsynced and renamed over ``path``; on any error it is removed. The file
    gets the permissions ``open()`` would give it (mkstemp's are owner-only)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def open_safetensors(path, framework: str = "pt"):
    """``safe_open(path)`` (a context manager over the file's header and memory map), with the
    package's errors for a damaged file as a ValueError naming it."""
    try:
        return safe_open(os.fspath(path), framework=framework, device="cpu")
    except SafetensorError as e:
        what = "truncated or damaged" if "not fully covered" in str(e) else "damaged or not a safetensors file"
        raise ValueError(f"{path}: {what} (safetensors: {e})") from None


def to_device(host, dtype=None):
    """A host tensor read from a file as a flame Tensor on flame's device; ``dtype``: floating-point
    tensors cast to it (a copy kernel). float8 tensors are decoded to float32 first, on the host
    (a table lookup of their bytes)."""
    if host.dtype in _FLOAT8_VALUES:
        host = torch.from_numpy(_FLOAT8_VALUES[host.dtype][host.view(torch.uint8).numpy()])
    buf = host.to(runtime.device) if runtime.device.type != "cpu" else host  # host transfer
    if dtype is not None and buf.dtype.is_floating_point and buf.dtype != dtype:
        cast = runtime.empty(tuple(buf.shape), dtype)
        KE.copy_(cast, buf)
        buf = cast
    return Tensor(buf)


def read_tensor(f, name, path, op):
    """Tensor ``name`` of the file ``path`` opened as ``f`` (``open_safetensors``), in host memory as
    stored; a TypeError (naming ``op``) when its dtype is not one flame reads."""
    _spec(f, name, path, op)
    return f.get_tensor(name)


# integer dtypes by element size: a host tensor's elements as NumPy sees them, bits unchanged
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host_array(buf) -> np.ndarray:
    return buf.view(_INTS[buf.element_size()]).numpy()


def copy_to_host(dst, src) -> None:
    """Copy ``src`` into ``dst``, host memory of the same shape and dtype (a streamed block's weights):
    from the device a host transfer (``src`` laid out as ``dst``); from host memory (a tensor read from
    a file, any strides) a NumPy copy of the elements' bits (torch's copy between host tensors counts
    as compute by flame's rule; on the interpreter every buffer is host memory)."""
    if src.device.type == "cpu":
        np.copyto(_host_array(dst), _host_array(src))
    else:
        dst.copy_(src)  # host transfer


def to_host(dst, src) -> None:
    """``src``, a tensor read from a file (host memory), into ``dst``, host memory of its shape: copied
    on the host (``copy_to_host``) when the dtypes agree; else cast as ``to_device`` casts (a copy
    kernel on the device, float8 decoded on the host first) into ``dst``'s layout and copied back:
    only this tensor passes through the device."""
    if src.dtype == dst.dtype:
        copy_to_host(dst, src)
        return
    cast = runtime.empty_strided(tuple(dst.shape), dst.stride(), dst.dtype)
    KE.copy_(cast, to_device(src)._data)
    copy_to_host(dst, cast)


def _spec(f, name, path, op):
    """(shape, torch dtype) of tensor ``name`` of an open file, from its header."""
    part = f.get_slice(name)
    kind = part.get_dtype()
    if kind not in DTYPES and kind not in FLOAT8:
        raise TypeError(f"{op}: {path}: {name!r} has unsupported dtype {kind}")
    return tuple(part.get_shape()), DTYPES.get(kind, FLOAT8.get(kind))


def read_metadata(path) -> dict:
    """The ``__metadata__`` dict of a safetensors file (empty if none)."""
    with open_safetensors(path) as f:
        return dict(f.metadata() or {})


def stored_shapes(path) -> dict:
    """{name: shape} of every tensor in the safetensors file ``path`` (its header only)."""
    with open_safetensors(path) as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)


def data_offsets(path) -> dict:
    """{name: byte offset in the file} of each tensor's data, for memory maps of single rows (the
    ``safetensors`` package reads whole tensors and slices, copying each; a memory-mapped row is a
    view). Only for a file that ``open_safetensors`` accepted: its header is trusted here (8 bytes
    of little-endian length, the JSON header, then the data, offsets counted from its start)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def load_safetensors(path, device=None, dtype=None, keys=None) -> dict:
    """{name: flame Tensor} from a safetensors file. ``keys``: only these names (a KeyError names
    any that are absent); ``dtype``: cast floating-point tensors to it (a copy kernel)."""
    runtime.resolve_device(device)
    with open_safetensors(path) as f:
        stored = list(f.keys())
        names = stored if keys is None else list(keys)
        missing = [k for k in names if k not in stored]
        if missing:
            raise KeyError(f"load_safetensors: {path} has no tensor(s) {missing[:5]}")
        for name in names:
            _spec(f, name, path, "load_safetensors")
        return {name: to_device(f.get_tensor(name), dtype) for name in names}


# ---- LoRA files ---------------------------------------------------------------------------------

METADATA_KEY = "lora_adapter_metadata"


def save_lora(model, path, format: str = "peft", prefix: str = "unet", dtype=None,  # noqa: A002
              metadata: dict | None = None) -> None:
    """Save ``model``'s adapters. PEFT files carry rank and alpha in the ``lora_adapter_metadata``
    JSON (diffusers' layout: keys prefixed by ``prefix``, e.g. "unet.r", "unet.lora_alpha", plus
    rank/alpha patterns for layers that differ); kohya files carry a ``.alpha`` tensor per layer.
    ``model``: a module, or {prefix: module} for one file of several models' adapters, each under
    its prefix (SDXL's "unet", "text_encoder", "text_encoder_2": what diffusers'
    ``StableDiffusionXLPipeline.load_lora_weights`` reads; kohya's ``lora_unet_``, ``lora_te1_``,
    ``lora_te2_``), ``prefix`` then unused. ``dtype``: the weights' dtype in the file (default: as
    trained, fp32; ``.alpha`` stays fp32); ``metadata``: more {str: str} entries for the file's
    metadata (e.g. training settings)."""
    from .nn.lora import lora_modules, lora_state_dict, peft_config
    parts = model if isinstance(model, dict) else {prefix: model}
    sd, cfg = {}, {}
    for p, m in parts.items():
        if not lora_modules(m):
            raise ValueError("save_lora: the model has no LoRA layers (inject_lora first)" if len(parts) == 1 else
                             f"save_lora: the model of prefix {p!r} has no LoRA layers (inject_lora first)")
        sd.update(lora_state_dict(m, format=format, prefix=p))
        if format == "peft":
            cfg.update({f"{p}.{k}" if p else k: v for k, v in peft_config(m).items()})
    if dtype is not None:
        sd = {k: v if k.endswith(".alpha") else to(v, dtype) for k, v in sd.items()}
    meta = {**(metadata or {}), "format": "pt"}
    if format == "peft":
        meta[METADATA_KEY] = json.dumps(cfg, indent=2, sort_keys=True)
    save_safetensors(sd, path, metadata=meta)


def _peft_alpha(meta, prefix, path):
    raw = meta.get(METADATA_KEY)
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"load_lora: {path}: its {METADATA_KEY} metadata is not JSON ({e})") from None
    if prefix and any(k.startswith(prefix + ".") for k in cfg):
        cfg = {k[len(prefix) + 1:]: v for k, v in cfg.items() if k.startswith(prefix + ".")}
    if "lora_alpha" not in cfg:
        return None
    return cfg["lora_alpha"], dict(cfg.get("alpha_pattern") or {})


def load_lora(model, path, prefix: str = "unet", inject: bool = True, strict: bool = False):
    """Load a LoRA file in either format (detected from its key names) into ``model``; layers
    without an adapter get one injected (``inject``). All or nothing: the file's header (every
    tensor within the file's size) and every adapter against the model
    (``flame.nn.lora.plan_lora_load``: layers, shapes, dtypes, ranks; with ``strict`` also that
    every adapter the model has gets weights and every key is a LoRA weight) are checked before
    the first weight is written; then the weights are read one tensor at a time into their
    adapters. Keys of a pipeline's other models (``flame.nn.lora.component_keys``: a file of
    SDXL's UNet and text encoders) are left out. Returns the loaded module paths.

    ``model`` may be {prefix: module} (as ``save_lora`` takes it): each model takes the keys under
    its prefix, the first also those under none; a model the file holds no keys for is left as it
    is (with ``strict``, every model gets keys); every model is checked before any is written.
    Returns {prefix: loaded module paths} then."""
    from .nn.lora import apply_lora_load, component_keys, detect_format, peft_target_name, plan_lora_load
    parts = model if isinstance(model, dict) else {prefix: model}
    with open_safetensors(path) as f:
        meta = f.metadata() or {}
        keys = list(f.keys())
        try:
            fmt = detect_format(keys)
        except ValueError as e:
            raise ValueError(f"load_lora: {path}: {e}") from None

        def read(k):
            return to_device(f.get_tensor(k))._data

        plans = []
        for i, (p, m) in enumerate(parts.items()):
            mine = component_keys(keys, p, bare=i == 0) if p else keys
            if not mine:
                if len(parts) == 1 or strict:
                    raise ValueError(f"load_lora: {path} holds no adapters for the model of prefix {p!r}, only for "
                                     f"other models of a pipeline, e.g. {keys[:2]}")
                continue
            specs = {name: _spec(f, name, path, "load_lora") for name in mine}
            alpha = None
            found = _peft_alpha(meta, p, path) if fmt == "peft" else None
            if found is not None:  # by the file's module names (without the prefix), as its metadata has them
                default, pattern = found
                names = {k[:-len(".lora_A.weight")] for k in specs if k.endswith(".lora_A.weight")}
                for lead in (f"{p}." if p else None, "base_model.model."):
                    names = {n[len(lead):] if lead and n.startswith(lead) else n for n in names}
                alpha = {n: float(pattern.get(n, pattern.get(peft_target_name(n), default))) for n in names}
            plans.append((p, m, plan_lora_load(m, specs, lambda k: f.get_tensor(k).item(),  # a host value
                                               alpha=alpha, prefix=p, inject=inject, strict=strict, read=read)))
        if not plans:
            raise ValueError(f"load_lora: {path} holds no adapters for {', '.join(map(repr, parts))}, e.g. {keys[:2]}")
        loaded = {p: apply_lora_load(m, steps, read) for p, m, steps in plans}
    return loaded if isinstance(model, dict) else loaded[prefix]
