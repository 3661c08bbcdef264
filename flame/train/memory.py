"""``train.memory_budget_gb``: the memory settings of a run chosen to fit a card (issue 49).

A LoRA step's device memory is the frozen weights (``plan_offload``'s device bytes: resident
weights plus the copy slots of streamed blocks), the adapters with their gradients and optimizer
state, and the activations. The activations of each block the forward keeps for the backward are
what gradient checkpointing trades for a second forward of the block; ``blocks.spread`` picks the
checkpointed blocks evenly, so each one saves about the average block's share. A family's
``ActivationProfile`` holds that share and the rest, measured on a GPU at a reference size;
activations scale with the tokens of a batch (flash attention keeps nothing quadratic).

The planner takes the first setting that fits, in the order of what each costs per GiB saved:
1. the run as configured;
2. fp8 base weights (``model.weight_dtype: fp8_e4m3``, unless the config sets a weight dtype):
   half the Linear weights' bytes for a few percent of step time;
3. checkpointing the fewest blocks that fit (``train.checkpoint_blocks``), each one about 0.7% of
   Flux.1's step for 0.45 GiB at 1024²;
4. every block checkpointed and the fewest blocks streamed from host memory that fit
   (``train.offload: blocks``): on the H200 as dear per GiB as checkpointing, and on a consumer
   card's PCIe link (a quarter to half of the H200's 55 GB/s) dearer, so it comes last.
When nothing fits, a ``ConfigError`` names the least memory a run can take.

The estimate fills at most ``USABLE`` of the budget: the caching allocator holds more than the
live tensors (with its expandable segments on, ``runtime.use_expandable_segments``, which a budget
turns on; without them, blocks stranded in half-used segments took Flux.1's 21.6 GiB of tensors to
27.3 GiB held). It leaves out the CUDA context and other processes (a card's free memory after them is
the budget to give), the text encoders when ``lora.text_encoder`` trains them, and the allocator's
fragmentation; ``scripts/bench_flux.py``/``bench_sdxl.py --memory-cap`` measure a setting's peak.
"""
from __future__ import annotations

import dataclasses
import math

from ..models.offload import model_without_memory, plan_offload
from ..nn.lora import matching_layers
from .errors import ConfigError

GIB = 2**30
# the share of the budget the estimate may fill: PyTorch's caching allocator holds more than the live
# tensors (blocks rounded up, cached free blocks, the CUDA graphs' pool): 1-4% with its expandable segments,
# which the trainer turns on (Flux.1 at 24 and 16 GiB, H200), and the estimate errs by up to 0.2 GiB
USABLE = 0.9
ADAPTER_BYTES_PER_PARAMETER = 18  # fp32 weight, gradient and AdamW's two moments; the bf16 copy a step casts


@dataclasses.dataclass(frozen=True)
class ActivationProfile:
    """A family's activation memory for one LoRA step of one sample at ``tokens`` tokens (its
    ``Family.tokens`` of the reference size): ``per_block`` GiB kept by an average checkpointable
    block that is not checkpointed, ``rest`` GiB with every block checkpointed (block inputs, one
    block's recomputation, embeddings, loss and workspace); ``measured``: where the numbers come
    from."""

    tokens: int
    per_block: float
    rest: float
    measured: str

    def bytes(self, tokens: int, blocks: int, checkpointed: int) -> int:
        """Activation bytes of a batch of ``tokens`` tokens with ``checkpointed`` of ``blocks``
        blocks checkpointed."""
        return int(tokens / self.tokens * (self.rest + (blocks - checkpointed) * self.per_block) * GIB)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``plan_memory`` chose: ``weight_dtype`` (None: the compute dtype), ``checkpoint_blocks``
    (0: checkpointing off), ``offload_blocks`` (0: none streamed), of ``blocks`` checkpointable and
    streamable blocks, and the estimate in bytes, by part."""

    budget: int
    weight_dtype: str | None
    checkpoint_blocks: int
    offload_blocks: int
    blocks: int
    weights: int
    adapters: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.activations

    def summary(self) -> str:
        """One line for the trainer's log."""
        chose = [f"weights {self.weight_dtype or 'as train.precision'}",
                 f"{self.checkpoint_blocks} of {self.blocks} blocks checkpointed",
                 f"{self.offload_blocks} streamed from host memory"]
        return (f"train.memory_budget_gb {_size(self.budget)}: {', '.join(chose)}; estimated {_size(self.total)} "
                f"(weights {_size(self.weights)}, adapters and optimizer {_size(self.adapters)}, activations "
                f"{_size(self.activations)})")


def _size(n) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def adapter_bytes(model, targets, rank: int) -> int:
    """Device bytes of rank-``rank`` adapters on ``model``'s layers that ``targets`` match (their
    weights' shapes only: ``model`` may be without memory), with gradients and optimizer state."""
    names = [n for n, m in model.named_modules() if getattr(m, "weight", None) is not None
             and len(m.weight.shape) >= 2]
    params = 0
    for name in matching_layers(names, targets):
        out, *rest = model.get_submodule(name).weight.shape
        params += rank * (out + math.prod(rest))
    return params * ADAPTER_BYTES_PER_PARAMETER


def _estimate(budget_bytes, profile, tokens, weight_dtype, adapters, checkpointed, offload) -> MemoryPlan:
    """The ``MemoryPlan`` of ``checkpointed`` blocks and the ``offload.OffloadPlan`` ``offload``."""
    blocks = len(offload.blocks)
    return MemoryPlan(budget_bytes, weight_dtype, checkpointed, len(offload.streamed), blocks, offload.device_bytes,
                      adapters, profile.bytes(tokens, blocks, checkpointed))


def plan_memory(budget_bytes: int, *, profile: ActivationProfile, config, dtype, tokens: int, targets, rank: int,
                weight_dtype: str | None, allow_fp8: bool, fp8_skip=()) -> MemoryPlan:
    """The cheapest memory settings (module doc) of a LoRA run on the model of ``config`` in
    ``dtype`` whose batches hold ``tokens`` tokens (the largest bucket's), within
    ``budget_bytes``. ``weight_dtype``: the configured one (fixed), or None (``allow_fp8``: the
    planner may choose fp8). ConfigError when nothing fits."""
    chosen = weight_dtype if weight_dtype is not None or not allow_fp8 else "fp8_e4m3"
    for wd in dict.fromkeys((weight_dtype, chosen)):  # as configured, then fp8 weights
        model = model_without_memory(config, dtype, wd, fp8_skip if wd else (), "train.memory_budget_gb")
        adapters = adapter_bytes(model, targets, rank)
        resident = plan_offload(model, count=0)
        blocks = len(resident.blocks)
        for checkpointed in range(blocks + 1) if wd == chosen else (0,):  # checkpointing with the final dtype
            plan = _estimate(budget_bytes, profile, tokens, wd, adapters, checkpointed, resident)
            if plan.total <= USABLE * budget_bytes:
                return plan
    # the loop ended on the final dtype with every block checkpointed: stream the fewest blocks that fit
    room = USABLE * budget_bytes - plan.adapters - plan.activations
    try:
        streamed = plan_offload(model, budget_bytes=room) if room > 0 else None
    except ValueError:
        streamed = None
    if streamed is not None:
        return _estimate(budget_bytes, profile, tokens, chosen, adapters, blocks, streamed)
    floor = _estimate(budget_bytes, profile, tokens, chosen, adapters, blocks, plan_offload(model, count="all"))
    raise ConfigError(f"train.memory_budget_gb: {_size(budget_bytes)} is too little: the least this run can take "
                      f"is about {_size(floor.total / USABLE)}: weights {floor.weight_dtype or 'as train.precision'}, "
                      f"every block checkpointed and streamed, estimated {_size(floor.total)} (weights "
                      f"{_size(floor.weights)}, adapters and optimizer {_size(floor.adapters)}, activations "
                      f"{_size(floor.activations)}) and the allocator's {1 - USABLE:.0%}; lower data.batch_size or the "
                      f"resolution, or raise the budget")
