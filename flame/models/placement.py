"""Where a model's weights live before it runs: built without storage, stored as fp8 codes, or packed
in host memory for streaming (issue 49: a Flux.1 LoRA run on a 12-16 GB card, whose bf16 transformer
alone is 23.8 GB, must never hold the streamed blocks' weights on the device).

A model built with ``device="meta"`` (``nn.layers.empty_parameter``) has its parameters' shapes,
strides and dtypes and no memory. ``place(model, host_blocks, weight_dtype, fp8_skip)`` then decides
where each weight will be:

- with ``weight_dtype="fp8_e4m3"``, the weights of the Linear layers that ``nn.quantize_linears_``
  would convert (``nn.quant.fp8_layers``) become ``Fp8Parameter``s (float8_e4m3fn codes, one fp32
  scale per output channel), still without memory;
- the parameters of each block named in ``host_blocks`` (a ``blocks.Checkpointed``) get one host
  buffer per block (``host_buffer``: pinned on a GPU, NumPy memory on the interpreter), packed as
  ``offload.BlockStreamer`` packs a block (``layout``: 256-byte-aligned offsets); an fp8 weight's
  scales go to the device, where they stay while its codes stream.

``checkpoints.load_into`` then reads each stored tensor into its place; a parameter still without
memory takes device memory as it loads. ``offload.plan_offload_from_config`` plans on such a model
before any weight exists, and ``BlockStreamer`` takes a block whose frozen tensors fill one host
buffer exactly (``packed_on_host``) as its source as it is, with no second host copy.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import nn, runtime
from ..nn.quant import Fp8Parameter, fp8_layers
from ..ops.quant import FORMATS, Fp8Weight
from ..tensor import Tensor
from .blocks import Checkpointed

ALIGN = 256  # bytes: where each packed tensor starts (TMA wants 16)


def nbytes(buf) -> int:
    return buf.numel() * buf.element_size()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bytes_of(buf):
    """A dense buffer's memory as a 1-D uint8 view (no copy)."""
    return buf.as_strided((buf.numel(),), (1,)).view(torch.uint8)


def layout(sizes) -> tuple:
    """(the offset of each of tensors of ``sizes`` bytes in a packed buffer, the buffer's size):
    ``ALIGN``-aligned, in order."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = aligned(end + n)
    return offsets, end


def host_buffer(size: int):
    """``size`` bytes of host memory: pinned on a GPU (copies from it run on a side stream); NumPy
    memory on the interpreter (there the "device" is the CPU, and copies from NumPy memory are host
    transfers by flame's rule)."""
    if runtime.is_interpreter():
        return torch.from_numpy(np.empty(size, np.uint8))
    return torch.empty((size,), dtype=torch.uint8, pin_memory=True)


def _view(buf, offset, like):
    """The bytes of ``buf`` from ``offset`` as a tensor of ``like``'s shape, strides and dtype."""
    return buf[offset:offset + nbytes(like)].view(like.dtype).as_strided(like.shape, like.stride())


def resolve_blocks(model, names, who) -> list:
    """The ``Checkpointed`` blocks of ``model`` named ``names`` (distinct, none inside another)."""
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: a block is named twice in {list(names)}")
    blocks = []
    for name in names:
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{who}: the model has no block {name!r}") from None
        if not isinstance(m, Checkpointed):
            raise TypeError(f"{who}: {name!r} is a {type(m).__name__}; only blocks (flame.models.blocks.Checkpointed: "
                            "Flux double/single blocks, SDXL resnets and transformer blocks) can be streamed")
        blocks.append(m)
    for a in names:
        for b in names:
            if b.startswith(f"{a}."):
                raise ValueError(f"{who}: block {b!r} lies inside block {a!r}; give blocks that do not nest")
    return blocks


def place(model: nn.Module, host_blocks=(), weight_dtype=None, fp8_skip=(), who: str = "place") -> set:
    """Decide where the weights of ``model`` (built with ``device="meta"``) go, as the module docstring
    says: fp8 weights (``weight_dtype`` "fp8_e4m3", all Linear layers but those matching ``fp8_skip``)
    and the parameters of ``host_blocks`` in host memory. Returns the names of the parameters placed in
    host memory (``checkpoints.load_into``'s ``host``). Raises ValueError for an unknown weight dtype
    or block name (``who`` names the caller), or a parameter that has memory already."""
    if weight_dtype is not None and weight_dtype not in FORMATS:
        raise ValueError(f"{who}: weight_dtype must be None (the model's dtype) or one of {list(FORMATS)}, "
                         f"got {weight_dtype!r}")
    blocks = resolve_blocks(model, list(host_blocks), who)
    allocated = [name for name, p in model.named_parameters() if not p._data.is_meta]
    if allocated:
        raise ValueError(f"{who}: build the model with device='meta' to place its weights ({allocated[0]} has memory)")
    if weight_dtype is not None:
        for _, m in fp8_layers(model, fp8_skip):
            out = m.weight.shape[0]
            codes = Tensor(torch.empty(m.weight.shape, dtype=FORMATS[weight_dtype], device="meta"))
            m.weight = Fp8Parameter(codes, torch.empty((out,), dtype=torch.float32, device="meta"))
    on_host = set()
    for name, block in zip(host_blocks, blocks):
        params = list(block.named_parameters())
        offsets, size = layout(nbytes(p._data) for _, p in params)
        buf = host_buffer(size)
        for (pname, p), offset in zip(params, offsets):
            p._data = _view(buf, offset, p._data)
            if isinstance(p, Fp8Weight):
                p.scale = runtime.empty(tuple(p.scale.shape), p.scale.dtype)
            on_host.add(f"{name}.{pname}")
    return on_host


def packed_on_host(tensors):
    """(the host buffer, each tensor's offset in it) when the buffers of ``tensors`` ((name, Tensor)
    pairs) are the whole of one host memory buffer, each at an ``ALIGN``-aligned offset right after
    the one before (as ``place`` packs a block); None otherwise (on a GPU, device memory is never
    such a buffer)."""
    bufs = [t._data for _, t in tensors]
    storage = bufs[0].untyped_storage()
    base = storage.data_ptr()
    if bufs[0].device.type != "cpu" or any(b.untyped_storage().data_ptr() != base for b in bufs):
        return None
    offsets = [b.data_ptr() - base for b in bufs]
    end = 0
    for offset, n in sorted(zip(offsets, map(nbytes, bufs))):
        if offset != end:
            return None
        end = aligned(offset + n)
    if end != storage.nbytes():
        return None
    whole = bufs[0].as_strided((end // bufs[0].element_size(),), (1,), 0).view(torch.uint8)
    return whole, offsets
