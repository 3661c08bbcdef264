"""Model checkpoint files: finding a component's weights, indexing them by the model's parameter
names, checking the index against the model, and loading it.

Every model (UNet, text encoders, VAE) loads the same way:

1. ``resolve_component(path, subfolder, stem)``: a diffusers pipeline folder (``path/subfolder``), the
   component folder itself, or one ``.safetensors`` file (config None). In a folder the weights are
   ``{stem}.safetensors``, the ``{stem}.fp16.safetensors`` variant, or either's sharded
   ``.safetensors.index.json``.
2. ``stored_tensors(files)``: {name in the file: (file, shape)} from the headers only (an fp8 file's
   ``scale_weight`` keys go with their weights, ``load_into`` reading them).
3. The model's own name map turns that into an index {parameter name: ``Source`` or ``Rows``}; a
   ``Source`` may take a row range of a stored tensor (a fused q/k/v projection), transpose it, or
   view it in another shape of the same size (a 1x1 conv weight read as a linear one); ``Rows``
   stacks several such blocks into one parameter (separately stored q, k, v into a fused one).
4. ``check_index(index, expected, what, where)`` raises one error listing every missing, unexpected
   and misshapen tensor before anything is read; ``load_into(model, index, dtype)`` then reads the
   tensors one at a time, each becoming the new Parameter (or, for a model placed by
   ``placement.place``, copied into host memory or quantised into fp8 codes).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import warnings
from typing import NamedTuple

import torch

from .. import io, runtime
from ..kernels import elementwise as KE
from ..kernels import quant as KQ
from ..nn import Parameter
from ..nn.init import skip_init
from ..ops.quant import FP8, Fp8Weight
from ..tensor import Tensor
from .placement import place


class Source(NamedTuple):
    """Where a parameter comes from: tensor ``key`` of ``file``, rows ``rows`` (start, stop) of its
    first dim when given, transposed (2-D) when ``transpose``, then viewed as ``shape``."""
    file: pathlib.Path
    key: str
    shape: tuple
    rows: tuple | None = None
    transpose: bool = False


class Rows(NamedTuple):
    """A parameter stacked from row blocks, the ``Source``s ``parts`` in order (a fused projection
    whose pieces are stored as separate tensors, or one tensor's row blocks reordered)."""
    parts: tuple

    @property
    def shape(self) -> tuple:
        """The stacked shape; blocks whose trailing dims differ cannot stack, and their shapes
        stand in for it (so ``check_index`` reports them)."""
        trailing = {tuple(p.shape[1:]) for p in self.parts}
        if len(trailing) != 1:
            return tuple(tuple(p.shape) for p in self.parts)
        return (sum(p.shape[0] for p in self.parts), *trailing.pop())


def sort_config(cls, config: dict, fixed: dict, ignored=()) -> tuple:
    """(kwargs for the dataclass ``cls``, [problems]) from a ``config.json`` dict: a key naming a
    field of ``cls`` goes to kwargs; a key of ``fixed`` must hold one of its allowed values (the
    architecture this model implements); keys starting with "_" and those in ``ignored`` change
    nothing; any other key is a problem."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs, problems = {}, []
    for k, v in config.items():
        if k.startswith("_") or k in ignored:
            continue
        if k in names:
            kwargs[k] = v
        elif k in fixed:
            if v not in fixed[k]:
                problems.append(f"{k}={v!r} (supported: {' or '.join(repr(x) for x in fixed[k])})")
        else:
            problems.append(f"unknown key {k!r}")
    return kwargs, problems


def resolve_component(path, subfolder: str, stem: str, what: str):
    """(config dict or None, [safetensors files]) for ``what`` (e.g. "SDXL VAE"): ``path`` is a
    pipeline folder holding ``subfolder/``, that folder itself, or one ``.safetensors`` file."""
    p = pathlib.Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{what}: {p} is not a .safetensors file (other formats are not supported: convert "
                             "them to safetensors)")
        return None, [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{what}: {str(path)!r} does not exist")
    if not (p / "config.json").is_file() and (p / subfolder / "config.json").is_file():
        p = p / subfolder
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what}: {p} has no config.json (expected a diffusers pipeline folder with "
                                f"{subfolder}/, the {subfolder}/ folder itself, or a .safetensors file)")
    try:
        config = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {p / 'config.json'} is not valid JSON ({e})") from None
    for variant in (stem, f"{stem}.fp16"):
        if (p / f"{variant}.safetensors").is_file():
            return config, [p / f"{variant}.safetensors"]
        index = p / f"{variant}.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return config, [p / s for s in shards]
    raise FileNotFoundError(f"{what}: {p} has no {stem}[.fp16].safetensors or its .index.json "
                            "(.bin weights are not supported: convert them to safetensors)")


SCALE_SUFFIXES = ("scale_weight", "scale_input")  # ComfyUI's fp8_scaled files, next to "<layer>.weight"
SCALED_FP8_MARK = "scaled_fp8"  # the empty tensor such a file carries to say so


def stored_tensors(files) -> dict:
    """{name: (file, shape)} of every tensor in the safetensors ``files`` (headers only), but an fp8
    file's companions of a weight (``fp8_scale_key``; ``<layer>.scale_input``, an activation scale
    flame does not use; the ``scaled_fp8`` mark), which ``load_into`` reads with the weight. A
    ``scale_weight`` must be one number or one per row of its weight: any other shape raises a
    ValueError naming it."""
    stored = {}
    for f in files:
        shapes = io.stored_shapes(f)
        for k, shape in shapes.items():
            layer, _, suffix = k.rpartition(".")
            weight = f"{layer}.weight"
            if k == SCALED_FP8_MARK or (suffix in SCALE_SUFFIXES and weight in shapes):
                if suffix == "scale_weight":
                    _check_scale_shape(shape, shapes[weight], k, f)
                continue
            if k in stored:
                raise ValueError(f"tensor {k!r} is in both {stored[k][0]} and {f}")
            stored[k] = (pathlib.Path(f), shape)
    return stored


def fp8_scale_key(key: str) -> str | None:
    """The name of the per-tensor (or per-row) scale that ComfyUI's and musubi-tuner's fp8_scaled
    files store next to the fp8 weight ``key`` (``<layer>.weight`` -> ``<layer>.scale_weight``: the
    weight is ``codes * scale_weight``); None for a key that is no weight."""
    layer, _, suffix = key.rpartition(".")
    return f"{layer}.scale_weight" if suffix == "weight" and layer else None


def _check_scale_shape(shape, weight_shape, key, path) -> None:
    rows = weight_shape[0] if len(weight_shape) >= 2 else None
    if math.prod(shape) == 1 or (rows is not None and tuple(shape) in ((rows,), (rows, 1))):
        return
    per_row = f" or one per output row ({rows},) or ({rows}, 1)" if rows is not None else ""
    raise ValueError(f"{path}: {key!r} has shape {tuple(shape)}, but the scale of the fp8 weight "
                     f"{tuple(weight_shape)} must be one number (shape () or (1,)){per_row} (block-wise scales are "
                     "not supported: dequantise the file first)")


def _listing(keys, limit=8):
    keys = list(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(f'"{k}"' for k in keys[:limit]) + more


def check_index(index: dict, expected: dict, what: str, where: str) -> None:
    """Raise RuntimeError naming the missing, unexpected and misshapen tensors of ``index``
    ({name: Source}) against ``expected`` ({name: shape})."""
    errors = []
    missing = [k for k in expected if k not in index]
    unexpected = [k for k in index if k not in expected]
    if missing:
        errors.append(f"Missing key(s) ({len(missing)}): {_listing(missing)}.")
    if unexpected:
        errors.append(f"Unexpected key(s) ({len(unexpected)}): {_listing(unexpected)}.")
    for k, src in index.items():
        if k in expected and tuple(src.shape) != tuple(expected[k]):
            errors.append(f"size mismatch for {k}: the checkpoint has shape {tuple(src.shape)}, the model "
                          f"{tuple(expected[k])}")
    if errors:
        raise RuntimeError(f"Error(s) loading the {what} from {where}:\n\t" + "\n\t".join(errors))


def _part(buf, src: Source):
    """``src``'s part of the stored tensor ``buf`` (a torch buffer): a view."""
    if src.rows is not None:
        buf = buf[src.rows[0]:src.rows[1]]
    if src.transpose:
        buf = buf.t()
    if tuple(buf.shape) != tuple(src.shape):
        buf = buf.view(src.shape)
    return buf


def _materialize(loaded, src: Source, like) -> Tensor:
    """``src``'s part of the stored tensor ``loaded`` (on the device), in the layout of the parameter
    buffer ``like``."""
    buf = _part(loaded, src)
    if buf.is_contiguous() and like.is_contiguous():
        return Tensor(buf)
    out = runtime.empty_strided(tuple(like.shape), like.stride(), loaded.dtype)
    KE.copy_(out, buf)
    return Tensor(out)


def _fp8_rows(weight: Fp8Weight, row: int, n: int) -> tuple:
    """(codes, scales) of rows ``row`` to ``row + n`` of the fp8 ``weight``; a device weight gets its
    memory with its first part."""
    if weight._data.is_meta:
        weight._data = runtime.empty(tuple(weight.shape), weight.dtype)
        weight.scale = runtime.empty(tuple(weight.scale.shape), weight.scale.dtype)
    return weight._data.narrow(0, row, n), weight.scale.narrow(0, row, n)


def _quantize_into(weight: Fp8Weight, row, part, on_host: bool) -> None:
    """Rows ``row`` on (0: all) of the fp8 ``weight`` from ``part`` (those rows' values on the device):
    codes and per-channel scales of each row, as ``quantize_fp8`` gives them (rows are quantised one
    by one, so parts stacked later equal the whole quantised at once). Codes ``on_host`` are made on
    the device and copied there."""
    codes, scale = _fp8_rows(weight, row, part.shape[0])
    if on_host:
        staged = runtime.empty(tuple(codes.shape), codes.dtype)
        KQ.quantize_rows_(staged, scale, part)
        io.copy_to_host(codes, staged)
    else:
        KQ.quantize_rows_(codes, scale, part)


def _copy_codes_into(weight: Fp8Weight, row, stored, codes_on_device, scales, src: Source, on_host: bool) -> None:
    """Rows ``row`` on of the fp8 ``weight`` from ``src``'s part of the float8_e4m3fn tensor ``stored``
    (host memory, as read; ``codes_on_device``: the same bytes on the device) and the stored tensor's
    per-row ``scales`` (on the device): the codes as they are, bit for bit, with their scales."""
    codes, scale = _fp8_rows(weight, row, src.shape[0])
    if on_host:
        io.copy_to_host(codes, _part(stored, src))
    else:
        KE.copy_(KQ.as_codes(codes), KQ.as_codes(_part(codes_on_device, src)))
    start = src.rows[0] if src.rows is not None else 0
    KE.copy_(scale, scales.narrow(0, start, src.shape[0]))


class _Fp8Stored:
    """A float8_e4m3fn tensor read from a file and its scale (``fp8_scale_key``: one number or one per
    row; 1 without one), moved to the device when first needed: its codes as bytes, its scales one
    per row (rows: the first dim of a weight of 2 or more dims, else one row), and ``values(dtype)``,
    the dequantised tensor (codes x scale, ``kernels.quant.dequantize_rows_``)."""

    def __init__(self, stored, scale):
        self.stored, self.scale_stored = stored, scale
        self.rows = stored.shape[0] if stored.ndim >= 2 else 1
        self._codes = self._scales = None

    def codes(self):
        if self._codes is None:
            self._codes = io.to_device(KQ.as_codes(self.stored))._data.view(FP8)
        return self._codes

    def scales(self):
        if self._scales is None:
            self._scales = runtime.empty((self.rows,), torch.float32)
            if self.scale_stored is None:
                KE.fill_(self._scales, 1.0)
            else:
                scale = io.to_device(self.scale_stored.reshape(-1), torch.float32)._data
                KE.copy_(self._scales, scale.expand(self.rows) if scale.numel() == 1 else scale)
        return self._scales

    def values(self, dtype):
        out = runtime.empty(tuple(self.stored.shape), dtype)
        KQ.dequantize_rows_(out.view(self.rows, -1), self.codes().view(self.rows, -1), self.scales())
        return out


def load_into(model, index: dict, dtype, host=frozenset()) -> None:
    """Give ``model`` (freshly built) the tensors of a checked ``index`` as its parameters, read one
    stored tensor at a time in ``dtype``: each loaded tensor becomes the new Parameter (no copy into
    the initial one, which is released) unless a row range, transpose or layout change makes it a
    copy. The blocks of a ``Rows`` entry are copied into their rows of the Parameter as their tensors
    arrive (they may lie in different files).

    A model built without memory and placed (``placement.place``): a Parameter still without memory
    takes device memory as above; ``host`` names those in host memory, into which each part is copied
    on the host (cast on the device and copied back when the file's dtype is not ``dtype``,
    ``io.to_host``); an ``Fp8Weight`` gets each part quantised on the device into its rows.

    A tensor stored as float8_e4m3fn (``flux1-dev-fp8``-style files: scale 1; ComfyUI's fp8_scaled
    files: times its ``scale_weight``): an ``Fp8Weight`` takes its codes as they are (no second
    rounding) and the scale for each of its rows; any other parameter gets it dequantised into
    ``dtype`` (a warning says how many tensors of which file were)."""
    by_file = {}
    for name, src in index.items():
        blocks, at = [(src, None)], 0
        if isinstance(src, Rows):
            blocks = []
            for block in src.parts:
                blocks.append((block, at))
                at += block.shape[0]
        for block, row in blocks:
            by_file.setdefault(block.file, {}).setdefault(block.key, []).append((name, block, row))
    for f, by_key in by_file.items():
        dequantised = 0
        with io.open_safetensors(f) as opened:
            keys = set(opened.keys())
            for key, targets in by_key.items():
                stored = io.read_tensor(opened, key, f, "load_into")
                scale_key = fp8_scale_key(key)
                scale = io.read_tensor(opened, scale_key, f, "load_into") if scale_key in keys else None
                if scale is not None and stored.dtype != FP8:
                    raise ValueError(f"load_into: {f}: {key!r} is stored as {stored.dtype}, not float8_e4m3fn, but "
                                     f"has a scale {scale_key!r}: only fp8 weights can be scaled")
                fp8 = _Fp8Stored(stored, scale) if stored.dtype == FP8 else None
                loaded = None  # on the device, in dtype: once a target needs it
                for name, src, row in targets:
                    path, _, attr = name.rpartition(".")
                    table = model.get_submodule(path)._parameters
                    param = table[attr]
                    if isinstance(param, Fp8Weight) and fp8 is not None and not src.transpose:
                        _copy_codes_into(param, row or 0, stored, None if name in host else fp8.codes(),
                                         fp8.scales(), src, name in host)
                        continue
                    if name in host and not isinstance(param, Fp8Weight) and fp8 is None:
                        dst = param._data if row is None else param._data.narrow(0, row, src.shape[0])
                        io.to_host(dst, _part(stored, src))
                        continue
                    if loaded is None:
                        loaded = io.to_device(stored, dtype)._data if fp8 is None else fp8.values(dtype)
                        dequantised += fp8 is not None
                    if isinstance(param, Fp8Weight):
                        _quantize_into(param, row or 0, _part(loaded, src), name in host)
                    elif name in host:  # dequantised on the device, copied to its host memory
                        dst = param._data if row is None else param._data.narrow(0, row, src.shape[0])
                        io.copy_to_host(dst, _materialize(loaded, src, dst)._data)
                    elif row is not None:  # one block of a stacked parameter
                        if param._data.is_meta:
                            table[attr] = param = Parameter(Tensor(runtime.empty_strided(
                                tuple(param.shape), param.stride(), param.dtype)))
                        KE.copy_(param._data.narrow(0, row, src.shape[0]), _part(loaded, src))
                    else:  # in place in the module's table: state_dict order stays the architecture's
                        table[attr] = Parameter(_materialize(loaded, src, param._data))
        if dequantised:
            warnings.warn(f"load_into: {dequantised} tensor(s) of {f} are stored as float8_e4m3fn: dequantised (codes "
                          f"x scale) into {str(dtype).removeprefix('torch.')}", stacklevel=3)


def component_config(cfg_dict, config, parse, who, path):
    """The config of a component: ``parse(cfg_dict)`` of its config.json, which a ``config`` given
    too must equal; ``config`` as given for a single file (no config.json: ``cfg_dict`` None)."""
    if cfg_dict is None:
        return config
    file_cfg = parse(cfg_dict)
    if config is not None and config != file_cfg:
        raise ValueError(f"{who}.from_pretrained: the config given differs from {path}'s config.json")
    return file_cfg


def load_pretrained(cls, path, dtype, config, *, subfolder: str, what: str, config_class, index,
                    stem: str = "diffusion_pytorch_model", parse=None, default=None, host_blocks=(),
                    weight_dtype=None, fp8_skip=()):
    """A diffusers or transformers component ``cls`` (``parameter_shapes(config)``, ``cls(config,
    dtype=...)``) from ``path`` (``resolve_component`` of ``subfolder`` and the weights' ``stem``):
    the config from its config.json (``parse``, default ``config_class.from_diffusers``; a ``config``
    given too must equal it) or, for a single file, ``config`` (when None ``default(files)``, else
    ``config_class()``); ``index(files, config)`` maps the file's names to the model's (and may
    check them in the file's own names first). Checked whole before the model is built without an
    init and loaded.

    ``host_blocks`` (block names, e.g. an ``offload.OffloadPlan``'s ``streamed``) and ``weight_dtype``
    ("fp8_e4m3": Linear weights but those matching ``fp8_skip`` stored as fp8, quantised as they load)
    need a ``cls`` that builds with ``device="meta"``: the model is built without memory and placed
    (``placement.place``) before loading, so the host blocks' weights never reach the device whole
    and no bf16 copy of an fp8 weight is ever complete there."""
    cfg_dict, files = resolve_component(path, subfolder, stem, what)
    if cfg_dict is None and config is None and default is not None:
        config = default(files)
    config = component_config(cfg_dict, config, parse or config_class.from_diffusers, cls.__name__, path)
    config = config if config is not None else config_class()
    found = index(files, config)
    check_index(found, cls.parameter_shapes(config), what, ", ".join(str(f) for f in files))
    if not host_blocks and weight_dtype is None:
        with skip_init():  # every parameter is loaded next
            model = cls(config, dtype=dtype)
        load_into(model, found, model.dtype)
        return model
    model = cls(config, dtype=dtype, device="meta")
    host = place(model, host_blocks, weight_dtype, fp8_skip, f"{cls.__name__}.from_pretrained")
    load_into(model, found, dtype or runtime.get_default_dtype(), host)
    return model
