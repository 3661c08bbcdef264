"""safetensors files, read and written by flame itself, and LoRA adapter files.

The format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(padded with spaces to a multiple of 8), then the raw little-endian tensor bytes, offsets counted
from the end of the header. Loading checks the whole header first (dtypes, shapes, offsets, and
that no tensor ends past the end of the file: a truncated file is an error before anything is
read), then reads one tensor at a time into host memory and moves it to flame's device (never two
copies of a whole file); saving writes a temporary file in the target directory, fsyncs it and
renames it over the target (atomic).
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile

import numpy as np
import torch

from . import runtime
from .kernels import elementwise as KE
from .ops.elementwise import to
from .tensor import Tensor

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {v: k for k, v in _CODES.items()}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100_000_000


def _buffer(value, name):
    if isinstance(value, Tensor):
        return value._data
    if isinstance(value, torch.Tensor):
        return value.detach()
    raise TypeError(f"save_safetensors: {name!r} is a {type(value).__name__}, not a tensor")


def _host_bytes(buf):
    """The tensor's bytes in row-major order (a contiguous copy by flame's copy kernel if needed)."""
    if buf.device.type == runtime.device.type and not buf.is_contiguous():
        dense = runtime.empty(tuple(buf.shape), buf.dtype)
        KE.copy_(dense, buf)
        buf = dense
    elif not buf.is_contiguous():  # a host tensor while flame runs on the GPU: a host-side copy, no math
        buf = buf.contiguous()
    host = buf.cpu() if buf.device.type != "cpu" else buf  # host transfer
    if host.numel() == 0:
        return b""
    return host.reshape(-1).view(torch.uint8).numpy().tobytes()


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write ``tensors`` ({name: flame or torch tensor}) to ``path`` in the safetensors format,
    atomically. ``metadata``: {str: str}, stored under ``__metadata__``."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_safetensors: expected a dict of tensors, got {type(tensors).__name__}")
    header = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise TypeError(f"save_safetensors: metadata keys and values must be str, bad entries: {bad[:5]}")
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    # largest alignment first, then by name (as the safetensors package orders them)
    items = sorted(((k, _buffer(v, k)) for k, v in tensors.items()),
                   key=lambda kv: (-kv[1].element_size(), kv[0]))
    for name, buf in items:
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"save_safetensors: invalid tensor name {name!r}")
        if buf.dtype not in _CODES:
            raise TypeError(f"save_safetensors: {name!r} has unsupported dtype {buf.dtype}")
        data = _host_bytes(buf)
        header[name] = {"dtype": _CODES[buf.dtype], "shape": list(buf.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in blobs:
            f.write(data)

    atomic_write(path, write)


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


def _read_header(f, path):
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise ValueError(f"{path}: not a safetensors file (header length {n})")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file (bad JSON header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__})")
    return header, 8 + n


def _index(header, base, size, path, names) -> dict:
    """{name: (dtype code, shape, begin, end)} of the tensors ``names`` of a safetensors ``header``
    whose data starts at byte ``base`` of the ``size``-byte file ``path``, every entry checked: a
    known dtype, a shape of non-negative integers, offsets spanning exactly its bytes, inside the file."""
    index, needs = {}, base
    for name in names:
        info = header[name]
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: not a safetensors file (header entry {name!r} is {info!r})") from None
        if code not in _DTYPES:
            raise TypeError(f"load_safetensors: {path}: {name!r} has unsupported dtype {code}")
        if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
            raise ValueError(f"{path}: not a safetensors file (header entry {name!r} is {info!r})")
        n = math.prod(shape)
        if end - begin != n * _SIZES[code]:
            raise ValueError(f"load_safetensors: {path}: {name!r}: {end - begin} bytes for shape {shape} of {code}")
        index[name] = (code, shape, begin, end)
        needs = max(needs, base + end)
    if size < needs:
        raise ValueError(f"{path} is truncated ({size} bytes, its header needs {needs})")
    return index


def _read_tensor(f, base, entry, dtype=None):
    """The tensor at ``entry`` (an ``_index`` value) of the open file ``f``, on flame's device;
    ``dtype``: floating-point tensors cast to it (a copy kernel)."""
    code, shape, begin, end = entry
    if end == begin:
        return Tensor(runtime.empty(shape, dtype if dtype is not None and _DTYPES[code].is_floating_point
                                    else _DTYPES[code]))
    raw = np.empty(end - begin, dtype=np.uint8)
    f.seek(base + begin)
    if f.readinto(raw) != raw.size:  # the file shrank since its size was checked
        raise ValueError(f"{f.name} is truncated (tensor at bytes {base + begin}..{base + end})")
    host = torch.from_numpy(raw).view(_DTYPES[code]).reshape(shape)
    buf = host.to(runtime.device) if runtime.device.type != "cpu" else host  # host transfer
    if dtype is not None and buf.dtype.is_floating_point and buf.dtype != dtype:
        cast = runtime.empty(shape, dtype)
        KE.copy_(cast, buf)
        buf = cast
    return Tensor(buf)


def read_metadata(path) -> dict:
    """The ``__metadata__`` dict of a safetensors file (empty if none)."""
    with open(path, "rb") as f:
        header, _ = _read_header(f, path)
    return dict(header.get("__metadata__") or {})


def load_safetensors(path, device=None, dtype=None, keys=None) -> dict:
    """{name: flame Tensor} from a safetensors file. ``keys``: only these names (a KeyError names
    any that are absent); ``dtype``: cast floating-point tensors to it (a copy kernel)."""
    runtime.resolve_device(device)
    with open(path, "rb") as f:
        header, base = _read_header(f, path)
        header.pop("__metadata__", None)
        names = list(header) if keys is None else list(keys)
        missing = [k for k in names if k not in header]
        if missing:
            raise KeyError(f"load_safetensors: {path} has no tensor(s) {missing[:5]}")
        index = _index(header, base, os.fstat(f.fileno()).st_size, path, names)
        return {name: _read_tensor(f, base, index[name], dtype) for name in names}


# ---- LoRA files ---------------------------------------------------------------------------------

METADATA_KEY = "lora_adapter_metadata"


def save_lora(model, path, format: str = "peft", prefix: str = "unet", dtype=None,  # noqa: A002
              metadata: dict | None = None) -> None:
    """Save ``model``'s adapters. PEFT files carry rank and alpha in the ``lora_adapter_metadata``
    JSON (diffusers' layout: keys prefixed by ``prefix``, e.g. "unet.r", "unet.lora_alpha", plus
    rank/alpha patterns for layers that differ); kohya files carry a ``.alpha`` tensor per layer.
    ``dtype``: the weights' dtype in the file (default: as trained, fp32; ``.alpha`` stays fp32);
    ``metadata``: more {str: str} entries for the file's metadata (e.g. training settings)."""
    from .nn.lora import lora_modules, lora_state_dict
    mods = lora_modules(model)
    if not mods:
        raise ValueError("save_lora: the model has no LoRA layers (inject_lora first)")
    sd = lora_state_dict(model, format=format, prefix=prefix)
    if dtype is not None:
        sd = {k: v if k.endswith(".alpha") else to(v, dtype) for k, v in sd.items()}
    meta = {**(metadata or {}), "format": "pt"}
    if format == "peft":
        r0, a0 = mods[0][1].rank, mods[0][1].alpha
        cfg = {"r": r0, "lora_alpha": a0, "target_modules": sorted({n for n, _ in mods}),
               "rank_pattern": {n: m.rank for n, m in mods if m.rank != r0},
               "alpha_pattern": {n: m.alpha for n, m in mods if m.alpha != a0},
               "init_lora_weights": True, "use_dora": any(m.dora for _, m in mods), "lora_bias": False}
        if prefix:
            cfg = {f"{prefix}.{k}": v for k, v in cfg.items()}
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


def load_lora(model, path, prefix: str = "unet", inject: bool = True, strict: bool = False) -> list:
    """Load a LoRA file in either format (detected from its key names) into ``model``; layers
    without an adapter get one injected (``inject``). All or nothing: the file's header (every
    tensor within the file's size) and every adapter against the model
    (``flame.nn.lora.plan_lora_load``: layers, shapes, dtypes, ranks; with ``strict`` also that
    every adapter the model has gets weights and every key is a LoRA weight) are checked before
    the first weight is written; then the weights are read one tensor at a time into their
    adapters. Returns the loaded module paths."""
    from .nn.lora import apply_lora_load, detect_format, plan_lora_load
    with open(path, "rb") as f:
        header, base = _read_header(f, path)
        meta = header.pop("__metadata__", None) or {}
        index = _index(header, base, os.fstat(f.fileno()).st_size, path, list(header))
        specs = {name: (shape, _DTYPES[code]) for name, (code, shape, _, _) in index.items()}
        try:
            fmt = detect_format(specs)
        except ValueError as e:
            raise ValueError(f"load_lora: {path}: {e}") from None
        alpha = None
        found = _peft_alpha(meta, prefix, path) if fmt == "peft" else None
        if found is not None:
            default, pattern = found
            alpha = {n: float(pattern.get(n, default)) for n, _ in model.named_modules()}
        steps = plan_lora_load(model, specs, lambda k: _read_tensor(f, base, index[k]).item(),  # host transfer
                               alpha=alpha, prefix=prefix, inject=inject, strict=strict)
        return apply_lora_load(model, steps, lambda k: _read_tensor(f, base, index[k])._data)
