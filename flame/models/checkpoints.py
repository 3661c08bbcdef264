"""Model checkpoint files: finding a component's weights, indexing them by the model's parameter
names, checking the index against the model, and loading it.

Every model (UNet, text encoders, VAE) loads the same way:

1. ``resolve_component(path, subfolder, stem)``: a diffusers pipeline folder (``path/subfolder``), the
   component folder itself, or one ``.safetensors`` file (config None). In a folder the weights are
   ``{stem}.safetensors``, the ``{stem}.fp16.safetensors`` variant, or either's sharded
   ``.safetensors.index.json``.
2. ``stored_tensors(files)``: {name in the file: (file, shape)} from the headers only.
3. The model's own name map turns that into an index {parameter name: ``Source`` or ``Rows``}; a
   ``Source`` may take a row range of a stored tensor (a fused q/k/v projection), transpose it, or
   view it in another shape of the same size (a 1x1 conv weight read as a linear one); ``Rows``
   stacks several such blocks into one parameter (separately stored q, k, v into a fused one).
4. ``check_index(index, expected, what, where)`` raises one error listing every missing, unexpected
   and misshapen tensor before anything is read; ``load_into(model, index, dtype)`` then reads the
   tensors a chunk at a time, each becoming the new Parameter.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import NamedTuple

from .. import io, runtime
from ..kernels import elementwise as KE
from ..nn import Parameter
from ..nn.init import skip_init
from ..tensor import Tensor


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


def stored_tensors(files) -> dict:
    """{name: (file, shape)} of every tensor in the safetensors ``files`` (headers only)."""
    stored = {}
    for f in files:
        for k, shape in io.stored_shapes(f).items():
            if k in stored:
                raise ValueError(f"tensor {k!r} is in both {stored[k][0]} and {f}")
            stored[k] = (pathlib.Path(f), shape)
    return stored


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


def _part(loaded: Tensor, src: Source):
    """``src``'s part of the stored tensor ``loaded``: a view of its buffer."""
    buf = loaded._data
    if src.rows is not None:
        buf = buf[src.rows[0]:src.rows[1]]
    if src.transpose:
        buf = buf.t()
    if tuple(buf.shape) != tuple(src.shape):
        buf = buf.view(src.shape)
    return buf


def _materialize(loaded: Tensor, src: Source, like) -> Tensor:
    """``src``'s part of the stored tensor ``loaded``, in the layout of the parameter ``like``."""
    buf = _part(loaded, src)
    if buf.is_contiguous() and like.is_contiguous():
        return Tensor(buf)
    out = runtime.empty_strided(tuple(like.shape), like.stride(), loaded.dtype)
    KE.copy_(out, buf)
    return Tensor(out)


def load_into(model, index: dict, dtype, chunk_bytes: int = 1 << 28) -> None:
    """Give ``model`` (freshly built) the tensors of a checked ``index`` as its parameters, read in
    ``dtype`` about ``chunk_bytes`` at a time: each loaded tensor becomes the new Parameter (no
    copy into the initial one, which is released) unless a row range, transpose or layout change
    makes it a copy. The blocks of a ``Rows`` entry are copied into their rows of the initial
    Parameter as their tensors arrive (they may lie in different files)."""
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
        part, size = [], 0
        keys = list(by_key)
        for i, key in enumerate(keys):
            part.append(key)
            size += 4 * sum(math.prod(s.shape) for _, s, _ in by_key[key])
            if size < chunk_bytes and i < len(keys) - 1:
                continue
            tensors = io.load_safetensors(f, dtype=dtype, keys=part)
            for k in part:
                loaded = tensors.pop(k)
                for name, src, row in by_key[k]:
                    path, _, attr = name.rpartition(".")
                    table = model.get_submodule(path)._parameters
                    if row is not None:  # one block of a stacked parameter
                        KE.copy_(table[attr]._data.narrow(0, row, src.shape[0]), _part(loaded, src))
                        continue
                    # in place in the module's table: state_dict order stays the architecture's
                    table[attr] = Parameter(_materialize(loaded, src, table[attr]._data))
            part, size = [], 0


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
                    stem: str = "diffusion_pytorch_model", parse=None, default=None):
    """A diffusers or transformers component ``cls`` (``parameter_shapes(config)``, ``cls(config,
    dtype=...)``) from ``path`` (``resolve_component`` of ``subfolder`` and the weights' ``stem``):
    the config from its config.json (``parse``, default ``config_class.from_diffusers``; a ``config``
    given too must equal it) or, for a single file, ``config`` (when None ``default(files)``, else
    ``config_class()``); ``index(files, config)`` maps the file's names to the model's (and may
    check them in the file's own names first). Checked whole before the model is built without an
    init and loaded."""
    cfg_dict, files = resolve_component(path, subfolder, stem, what)
    if cfg_dict is None and config is None and default is not None:
        config = default(files)
    config = component_config(cfg_dict, config, parse or config_class.from_diffusers, cls.__name__, path)
    config = config if config is not None else config_class()
    found = index(files, config)
    check_index(found, cls.parameter_shapes(config), what, ", ".join(str(f) for f in files))
    with skip_init():  # every parameter is loaded next
        model = cls(config, dtype=dtype)
    load_into(model, found, model.dtype)
    return model
