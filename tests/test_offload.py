"""Streamed blocks (flame.models.offload): frozen block weights in host memory, copied into device
slots ahead of each block, forward and backward. Outputs and LoRA gradients equal the resident
run's (bitwise on the CPU, where the slots are reused exactly as on a GPU, so a block run on
another block's weights would show), with and without gradient checkpointing, two steps in a row,
under the CUDA-graph rules; the schedule (which block sits in which slot when each block runs);
the planner's choice and byte counts; bad input. GPU tests: the same on CUDA streams, in a
captured graph, and the copies overlapping compute."""
import dataclasses
import gc
import itertools
import json
import math
import time
import types

import pytest
import torch

import flame
from flame import nn
from flame.checkpoint import segment
from flame.graphs import CapturedStep
from flame.models import FluxConfig, FluxTransformer2DModel, SDXLUNet, offload, placement
from flame.models import flux as FX
from flame.models.blocks import Checkpointed
from flame.nn import functional as F
from flame.nn.lora import inject_lora, lora_parameters
from flame.ops.quant import Fp8Weight

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

# ---- models -----------------------------------------------------------------------------------------


def _randomize_adapters(model, seed):
    """LoRA A and B random (B starts at zero: A would get no gradient); returns the adapters."""
    params = lora_parameters(model)
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p._data.copy_((0.1 * torch.randn(p.shape, generator=g)).to(p._data.device, p.dtype))
    return params


_MODULATION_LORA = FX.LORA_PRESETS["attn"] + [r"re:double_blocks\.\d+\.img_mod\.lin",
                                              r"re:single_blocks\.\d+\.modulation\.lin"]


def _flux(double=2, single=2, dtype=None, full_width=False, targets=_MODULATION_LORA, seed=0):
    """A Flux transformer of ``double`` + ``single`` blocks, tiny or (``full_width``) Flux.1's, frozen, with
    LoRA adapters on ``targets`` (default: attention and the blocks' modulation Linears, whose input,
    the conditioning vector, needs no gradient); returns it and its adapters."""
    cfg = FluxConfig() if full_width else FluxConfig.tiny()
    cfg = dataclasses.replace(cfg, num_layers=double, num_single_layers=single)
    flame.manual_seed(seed)
    model = FluxTransformer2DModel(cfg, dtype=dtype)
    model.requires_grad_(False)
    inject_lora(model, targets, rank=2 if not full_width else 16)
    params = _randomize_adapters(model, seed + 1)
    return model, params


def _flux_inputs(model, h=4, w=4, n_txt=3, seed=2):
    cfg, dtype = model.config, model.dtype
    flame.manual_seed(seed)
    return (flame.randn(1, (h // 2) * (w // 2), cfg.in_channels, dtype=dtype),
            flame.randn(1, n_txt, cfg.joint_attention_dim, dtype=dtype),
            flame.randn(1, cfg.pooled_projection_dim, dtype=dtype), flame.full((1,), 0.4),
            FX.latent_image_ids(h, w), FX.text_ids(n_txt), flame.full((1,), 3.5))


def _step_fn(model, params):
    """A training step's forward and backward: (output, [gradient of each adapter])."""
    def step(*inputs):
        out = model(*inputs)
        grads = (out.float() * out.float()).mean().backward()
        return out, [grads[p] for p in params]
    return step


def _result(res):
    out, grads = res
    return out.to_torch().clone(), [g.to_torch().clone() for g in grads]


def _assert_same(got, want, exact=True):
    """Bitwise, or (a GPU) within 1e-3 of each tensor's norm: a block run on other weights is far off."""
    pairs = [(got[0], want[0])] + list(zip(got[1], want[1]))
    for g, w in pairs:
        if exact:
            assert torch.equal(g, w), (g - w).abs().max()
        else:
            err = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
            assert err < 1e-3, err
    assert any(float(g.abs().max()) > 0 for g in got[1])


class _Block(Checkpointed):
    """A cheap block of Linears: ``x + fc2(silu(fc1(x))) * mod(cond)``."""

    def __init__(self, width):
        super().__init__()
        self.mod, self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, cond):
        return x + self.fc2(F.silu(self.fc1(x))) * self.mod(cond)


class _Stack(nn.Module):
    def __init__(self, n, width=8):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(width) for _ in range(n)])
        self.out = nn.Linear(width, width)

    def forward(self, x, cond):
        for block in self.blocks:
            x = block(x, cond)
        return self.out(x)


def _stack(n=6, seed=0):
    flame.manual_seed(seed)
    model = _Stack(n)
    model.requires_grad_(False)
    inject_lora(model, ["fc1", "fc2", "mod"], rank=2)
    return model, _randomize_adapters(model, seed + 1), (flame.randn(3, 8), flame.randn(3, 8))


def _events(log, kind):
    return [(name, slot) for event, name, slot, _ in log if event == kind]


def _check_slots_hold_the_running_block(log):
    for event, name, slot, owners in log:
        if event in ("forward", "backward") and slot is not None:
            assert owners[slot] == name, (event, name, owners)


@pytest.fixture(scope="module")
def flux_reference():
    """The resident run of the tiny Flux model: (model, adapters, inputs, (output, gradients))."""
    model, params = _flux()
    inputs = _flux_inputs(model)
    return model, params, inputs, _result(_step_fn(model, params)(*inputs))


# ---- the segment a streamed block runs as -------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
def test_segment_keeps_or_recomputes_and_calls_on_backward_first(recompute):
    lin = nn.Linear(6, 6)
    w = flame.randn(6, requires_grad=True)  # a closed-over leaf
    x = flame.randn(2, 6, requires_grad=True)
    calls = []

    def fn(h, *, gain):
        calls.append("fn")
        return lin(h) * w * gain, h  # the second output is the input itself

    def grads(a, h):
        g = ((a * a).sum() + (h * 3.0).sum()).backward()
        return [g[t] for t in (x, w, lin.weight, lin.bias)]

    want = grads(*fn(x, gain=2.0))
    calls.clear()
    got = grads(*segment(fn, (x,), {"gain": 2.0}, recompute=recompute, on_backward=lambda: calls.append("backward")))
    assert calls == (["fn", "backward", "fn"] if recompute else ["fn", "backward"])
    for g, r in zip(got, want):
        assert torch.equal(g.to_torch(), r.to_torch())
    with flame.no_grad():
        assert not segment(fn, (x,), {"gain": 1.0}, recompute=recompute)[0].requires_grad


# ---- equality with the resident run -------------------------------------------------------------------

def test_streamed_flux_equals_resident_two_steps_under_the_graph_rules(flux_reference):
    model, params, inputs, want = flux_reference
    before = {n: p.to_torch().clone() for n, p in model.named_parameters()}
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all"), log=True)
    step = CapturedStep(_step_fn(model, params))  # on the CPU: the second call runs under the graph rules
    for _ in range(2):
        _assert_same(_result(step(*inputs)), want)
    log = streamer.log
    _check_slots_hold_the_running_block(log)
    order = ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    assert [n for n, _ in _events(log, "forward")] == order * 2
    assert [n for n, _ in _events(log, "backward")] == order[::-1] * 2
    # per step: 4 copies forward (the first two at once, then one ahead), 2 backward (the last two
    # blocks of the forward are still in their slots); each copy before the block it is for
    first = log[:len(log) // 2]
    assert [e[:3] for e in first if e[0] != "forward"][:4] == [
        ("copy", "double_blocks.0", 0), ("copy", "double_blocks.1", 1), ("copy", "single_blocks.0", 0),
        ("copy", "single_blocks.1", 1)]
    assert streamer.copies == 12
    assert [e[:3] for e in first if e[0] != "forward"][4:] == [
        ("backward", "single_blocks.1", 1), ("backward", "single_blocks.0", 0), ("copy", "double_blocks.1", 1),
        ("backward", "double_blocks.1", 1), ("copy", "double_blocks.0", 0), ("backward", "double_blocks.0", 0)]
    streamer.restore()
    assert all(torch.equal(p.to_torch(), before[n]) for n, p in model.named_parameters())
    assert all(b.streamer is None for _, b in offload.streamable_blocks(model))


@pytest.mark.extended  # each alone: test_streamed_flux_equals_resident_*, test_flux.py's checkpointing parity
def test_checkpointed_and_partly_streamed_flux_equals_resident(flux_reference):
    model, params, inputs, want = flux_reference
    model.enable_gradient_checkpointing()
    try:
        plan = offload.plan_offload(model, count=2)
        assert plan.streamed == ("double_blocks.1", "single_blocks.1")  # spread over the four
        streamer = offload.BlockStreamer(model, plan, log=True)
        step = _step_fn(model, params)
        for _ in range(2):
            _assert_same(_result(step(*inputs)), want)
        with flame.no_grad():  # a sample's forward: nothing recorded, the same schedule
            out = model(*inputs)
        assert torch.equal(out.to_torch(), want[0])
        log = streamer.log
        _check_slots_hold_the_running_block(log)
        # the resident double block prefetches the next streamed block before it runs
        assert [e[:3] for e in log[:4]] == [("forward", "double_blocks.0", None), ("copy", "double_blocks.1", 0),
                                            ("copy", "single_blocks.1", 1), ("forward", "double_blocks.1", 0)]
        assert streamer.copies == 2 * 2 + 2  # two steps (nothing copied backward), one sample
        streamer.restore()
    finally:
        model.enable_gradient_checkpointing(False)


@pytest.mark.extended  # the schedule: the Flux tests (bitwise); SDXL's block order: the host-load test below
def test_streamed_sdxl_unet_equals_resident_with_skip_connections():
    from tiny_sdxl import UNET  # imports test_clip_text, which needs transformers
    flame.manual_seed(0)
    model = SDXLUNet(UNET)
    model.requires_grad_(False)
    inject_lora(model, "attn", rank=2)
    params = _randomize_adapters(model, 1)
    inputs = (flame.randn(1, 4, 4, 4), flame.full((1,), 500.0), flame.randn(1, 3, 32), flame.randn(1, 16),
              flame.randn(1, 6))
    step = _step_fn(model, params)
    want = _result(step(*inputs))
    names = [n for n, _ in offload.streamable_blocks(model)]
    assert names[:3] == ["down_blocks.0.resnets.0", "down_blocks.1.resnets.0",
                         "down_blocks.1.attentions.0.transformer_blocks.0"]  # as the forward runs them
    assert names[3:6] == ["mid_block.resnets.0", "mid_block.attentions.0.transformer_blocks.0",
                          "mid_block.resnets.1"]
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count=len(names) - 2, slots=3), log=True)
    # the gradients of tensors used three or more times are summed in another order (segments)
    got = _result(step(*inputs))
    for g, w in [(got[0], want[0])] + list(zip(got[1], want[1])):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    _check_slots_hold_the_running_block(streamer.log)
    assert {slot for _, slot in _events(streamer.log, "copy")} == {0, 1, 2}


@pytest.mark.parametrize("slots", [1, 2, pytest.param(3, marks=pytest.mark.extended)])  # 3 slots: test_sharding's ring
def test_stack_schedule_with_one_two_three_slots(slots):
    model, params, inputs = _stack(n=4)
    step = _step_fn(model, params)
    want = _result(step(*inputs))
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all", slots=slots), log=True)
    for _ in range(2):
        _assert_same(_result(step(*inputs)), want)
    log = streamer.log
    _check_slots_hold_the_running_block(log)
    # forward: every block copied once; backward: all but the last `slots` of the forward
    assert streamer.copies == 2 * (4 + 4 - slots)
    if slots > 1:  # each block's copy is issued no later than when the block before it starts
        forwards = [i for i, e in enumerate(log) if e[0] == "forward"]
        for a, b in itertools.pairwise(forwards):
            name = log[b][1]
            if name == "blocks.0":  # a step's first block: nothing runs before it
                continue
            copied = max(i for i, e in enumerate(log[:b]) if e[:2] == ("copy", name))
            assert copied < a or all(e[0] == "copy" for e in log[a + 1:copied]), (name, log[a:b])


def test_outputs_that_need_no_gradient_record_nothing_and_copy_nothing_backward():
    model, params, inputs = _stack()
    for p in params:
        p.requires_grad_(False)
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all"), log=True)
    out = model(*inputs)
    assert not out.requires_grad and streamer.copies == 6


# ---- the planner --------------------------------------------------------------------------------------

def _bytes(tensors):
    return sum(t._data.numel() * t._data.element_size() for t in tensors)


def test_plan_counts_bytes_and_spreads_the_streamed_blocks():
    model, _ = _flux(double=3, single=5)
    total = _bytes(list(model.parameters()))
    frozen = {n: _bytes([p for p in b.parameters() if not p.requires_grad]) for n, b in
              offload.streamable_blocks(model)}
    plan = offload.plan_offload(model, count=3)
    assert plan.streamed == ("double_blocks.1", "single_blocks.1", "single_blocks.3")
    assert plan.model_bytes == total and plan.streamed_bytes == sum(frozen[n] for n in plan.streamed)
    assert plan.resident_bytes == total - plan.streamed_bytes
    assert frozen["double_blocks.1"] <= plan.slot_bytes < frozen["double_blocks.1"] + 256 * 40  # aligned
    assert plan.device_bytes == plan.resident_bytes + 2 * plan.slot_bytes
    assert "3 of 8 blocks streamed" in plan.summary()
    assert offload.plan_offload(model, count=0).device_bytes == total
    # a budget: the fewest blocks that fit, and what the streamer then holds
    budget = offload.plan_offload(model, count=5).device_bytes
    chosen = offload.plan_offload(model, budget_bytes=budget)
    assert chosen.device_bytes <= budget and len(chosen.streamed) <= 5
    assert all(offload.plan_offload(model, count=n).device_bytes > budget for n in range(len(chosen.streamed)))
    streamer = offload.BlockStreamer(model, chosen)
    slots = [s.numel() for s in streamer._slots]
    assert slots == [chosen.slot_bytes] * 2
    host = sum(r.host.numel() for r in streamer._streamed)
    assert chosen.streamed_bytes <= host <= chosen.streamed_bytes + 256 * 200
    streamer.restore()


def test_bad_input_is_refused_with_clear_errors():
    model, _, inputs = _stack()
    with pytest.raises(ValueError, match="count 7 is more than the 6 blocks"):
        offload.plan_offload(model, count=7)
    with pytest.raises(ValueError, match="exactly one of count"):
        offload.plan_offload(model)
    with pytest.raises(ValueError, match="exactly one of count"):
        offload.plan_offload(model, count=1, budget_bytes=10)
    with pytest.raises(TypeError, match="count must be an int or 'all'"):
        offload.plan_offload(model, count=True)
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        offload.plan_offload(model, count=1, slots=0)
    with pytest.raises(ValueError, match=r"need at least .* more than the budget"):
        offload.plan_offload(model, budget_bytes=100)
    with pytest.raises(ValueError, match=r"no block 'blocks\.9'"):
        offload.plan_offload(model, count=1, blocks=["blocks.9"])
    with pytest.raises(TypeError, match="only blocks"):
        offload.plan_offload(model, count=1, blocks=["out"])
    with pytest.raises(ValueError, match="named twice"):
        offload.plan_offload(model, count=1, blocks=["blocks.0", "blocks.0"])
    with pytest.raises(TypeError, match="OffloadPlan"):
        offload.BlockStreamer(model, 2)
    # a base weight left trainable: streamed weights are frozen copies
    model.blocks[3].fc1.bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'blocks.3' has trainable base parameters \(fc1.bias\)"):
        offload.plan_offload(model, count="all")
    model.blocks[3].fc1.bias.requires_grad_(False)
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all"))
    with pytest.raises(RuntimeError, match="scheduled by another streamer"):
        offload.BlockStreamer(model, offload.plan_offload(model, count="all"))
    # unfreezing or replacing a streamed weight afterwards is caught when its block runs
    model.blocks[2].fc2.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"blocks.2.fc2.weight, a streamed frozen weight, requires grad now"):
        model(*inputs)
    model.blocks[2].fc2.weight.requires_grad_(False)
    model.to(flame.float64)
    with pytest.raises(RuntimeError, match="was given other memory"):
        model(*inputs)
    streamer.restore()


def test_a_tensor_shared_outside_its_block_is_refused():
    model, _, _ = _stack()
    model.out.weight = model.blocks[5].mod.weight
    with pytest.raises(ValueError, match=r"blocks\.5\.mod\.weight is also out\.weight"):
        offload.BlockStreamer(model, offload.plan_offload(model, count="all"))


# ---- on a GPU ----------------------------------------------------------------------------------------

# Flux.1's width, 4096 image and 512 text tokens, LoRA rank 16 on attention and MLP: the shapes of
# scripts/bench_offload.py, whose kernels configs/kernels' Flux list compiles ahead.
_FULL = {"dtype": flame.bfloat16, "full_width": True, "targets": FX.LORA_PRESETS["attn-mlp"]}


@pytest.mark.gpu
def test_gpu_streams_and_captured_graph_equal_the_resident_run():
    model, params = _flux(2, 2, **_FULL)
    inputs = _flux_inputs(model, h=128, w=128, n_txt=512)
    eager = _step_fn(model, params)
    want = _result(eager(*inputs))
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all"))
    _assert_same(_result(eager(*inputs)), want, exact=False)
    step = CapturedStep(eager)
    for i in range(4):  # eager, captured, replayed twice; an eager sample between the replays
        _assert_same(_result(step(*inputs)), want, exact=False)
        if i == 2:
            with flame.no_grad():
                model(*inputs)
    assert step.num_graphs == (0 if flame.is_interpreter() else 1)
    model.enable_gradient_checkpointing()
    step = CapturedStep(eager)
    for _ in range(3):
        _assert_same(_result(step(*inputs)), want, exact=False)
    streamer.restore()


def _time(fn, *args, repeat=5):
    for _ in range(3):  # a CapturedStep: eager, captured, replayed
        fn(*args)
    flame.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    flame.synchronize()
    return (time.perf_counter() - start) / repeat


@pytest.mark.gpu
def test_gpu_copies_overlap_compute():
    """Three double and three single blocks, all streamed: the step takes clearly less than the
    resident step plus its copies alone."""
    model, params = _flux(3, 3, **_FULL)
    inputs = _flux_inputs(model, h=128, w=128, n_txt=512)
    resident = _time(CapturedStep(_step_fn(model, params)), *inputs)
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all"))
    streamed = _time(CapturedStep(_step_fn(model, params)), *inputs)
    blocks = streamer._streamed
    step_copies = blocks + blocks[:-2][::-1]  # forward, then the backward's

    def copies():
        for rec in step_copies:
            streamer._slots[rec.slot][:rec.nbytes].copy_(rec.host, non_blocking=True)
    copy = _time(copies)
    print(f"resident {resident * 1e3:.1f} ms, streamed {streamed * 1e3:.1f} ms, copies alone {copy * 1e3:.1f} ms")
    assert streamed < resident + copy - 0.3 * min(resident, copy)
    streamer.restore()


# ---- loading straight into host memory (flame.models.placement) ------------------------------------------

# the embedders and the final layer stay unquantised (Flux's dtype is img_in's), as in tests/test_quant.py
_FLUX_FP8_SKIP = [r"re:(img_in|txt_in|time_in|vector_in|guidance_in|final_layer)(\..*)?"]


def _write_flux(path, layout, cfg, seed=0, dtype=None):
    """The weights of ``FluxTransformer2DModel(cfg, dtype)`` made under ``seed`` (those ``_flux`` builds)
    as a diffusers folder (separate q, k, v: stacked on load) or a BFL single file; returns what to load."""
    flame.manual_seed(seed)
    base = FluxTransformer2DModel(cfg, dtype)
    tensors = dict(base.diffusers_state_dict() if layout == "diffusers" else base.state_dict())
    if layout == "bfl":
        flame.io.save_safetensors(tensors, path / "flux1.safetensors")
        return path / "flux1.safetensors"
    (path / "transformer").mkdir()
    flame.io.save_safetensors(tensors, path / "transformer" / "diffusion_pytorch_model.safetensors")
    (path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel",
                                                                   **cfg.to_diffusers()}))
    return path


def _host_bytes(p):
    """A parameter's bytes copied to the host (a streamed block's live there, a resident one's on the device)."""
    return placement.bytes_of(p._data).to("cpu", copy=True)


def _host_memory(block):
    """A block's parameters lie in one packed host buffer (pinned on a GPU); the buffer's address."""
    params = list(block.named_parameters())
    packed = placement.packed_on_host(params)
    assert packed is not None and all(p.device.type == "cpu" for _, p in params)
    if not flame.is_interpreter():
        assert packed[0].is_pinned()
    return packed[0].data_ptr()


def _adopted(streamer, host_ptrs):
    """The streamer copies from the loader's buffers: no second host copy."""
    assert {r.name: r.host.data_ptr() for r in streamer._streamed} == host_ptrs


@pytest.mark.parametrize("layout,count", [("diffusers", "all"), ("bfl", 2)])
def test_flux_loaded_with_host_blocks_equals_the_resident_run(flux_reference, tmp_path, layout, count):
    _, _, inputs, want = flux_reference
    cfg = FluxConfig.tiny()
    path = _write_flux(tmp_path, layout, cfg)
    plan = offload.plan_offload_from_config(cfg, count=count)
    model = FluxTransformer2DModel.from_pretrained(path, config=cfg if layout == "bfl" else None,
                                                   host_blocks=plan.streamed)
    host = {name: _host_memory(model.get_submodule(name)) for name in plan.streamed}
    streamed = tuple(f"{name}." for name in plan.streamed)
    assert all(p.device == flame.device for n, p in model.named_parameters() if not n.startswith(streamed))
    model.requires_grad_(False)
    assert offload.plan_offload(model, count=count) == plan  # the plan made before the weights existed
    inject_lora(model, _MODULATION_LORA, rank=2)
    params = _randomize_adapters(model, 1)
    streamer = offload.BlockStreamer(model, plan)
    _adopted(streamer, host)
    _assert_same(_result(_step_fn(model, params)(*inputs)), want)
    streamer.restore()


def test_flux_fp8_on_load_streams_like_quantize_linears_after_a_normal_load(tmp_path):
    """load (host blocks, fp8) -> inject LoRA -> stream equals load -> quantize_linears_ -> inject LoRA,
    resident: codes and scales bitwise (q, k, v quantised one row block at a time as they arrive)."""
    cfg = dataclasses.replace(FluxConfig.tiny(), num_layers=1, num_single_layers=1)
    path = _write_flux(tmp_path, "diffusers", cfg)
    ref = FluxTransformer2DModel.from_pretrained(path)
    ref.requires_grad_(False)
    nn.quantize_linears_(ref, skip=_FLUX_FP8_SKIP)
    fp8 = {"weight_dtype": "fp8_e4m3", "fp8_skip": _FLUX_FP8_SKIP}
    plan = offload.plan_offload_from_config(cfg, count=1, **fp8)
    assert plan == offload.plan_offload(ref, count=1) and plan.streamed == ("single_blocks.0",)
    model = FluxTransformer2DModel.from_pretrained(path, host_blocks=plan.streamed, **fp8)
    host = {name: _host_memory(model.get_submodule(name)) for name in plan.streamed}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert type(p) is type(r) and torch.equal(_host_bytes(p), _host_bytes(r)), name
        if isinstance(r, Fp8Weight):
            assert torch.equal(p.scale, r.scale) and p.scale.device == flame.device, name
    assert isinstance(model.single_blocks[0].linear1.weight, Fp8Weight)
    assert not isinstance(model.img_in.weight, Fp8Weight)
    model.requires_grad_(False)
    runs = []
    for m in (ref, model):
        inject_lora(m, _MODULATION_LORA, rank=2)
        runs.append(_randomize_adapters(m, 1))
    streamer = offload.BlockStreamer(model, plan)
    _adopted(streamer, host)
    assert streamer.plan.slot_bytes < plan.streamed_bytes + 256 * 20  # codes: a byte per weight
    inputs = _flux_inputs(ref)
    want = _result(_step_fn(ref, runs[0])(*inputs))
    _assert_same(_result(_step_fn(model, runs[1])(*inputs)), want)
    streamer.restore()


def _write_sdxl_unet(path, cfg, dtype):
    """A diffusers ``unet/`` folder of ``cfg`` with seeded random weights in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    (path / "unet").mkdir()
    flame.io.save_safetensors({k: (0.1 * torch.randn(s, generator=g)).to(dtype)
                               for k, s in SDXLUNet.parameter_shapes(cfg).items()},
                              path / "unet" / "diffusion_pytorch_model.safetensors")
    (path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel",
                                                            **cfg.to_diffusers()}))
    return path


@pytest.mark.extended  # the same loading path: the Flux host-block tests below and above
def test_sdxl_unet_loaded_with_host_blocks_equals_the_normally_loaded_unet(tmp_path):
    """fp16 weights loaded in fp32: the host blocks' tensors cast on the device and copied back, the
    convolutions' channels-last layout kept in host memory; the same weights, and the streamed
    forward of the LoRA'd UNet (gradients: the Flux tests) equals the resident one bitwise."""
    from tiny_sdxl import UNET  # imports test_clip_text, which needs transformers
    path = _write_sdxl_unet(tmp_path, UNET, flame.float16)
    names = [n for n, _ in offload.streamable_blocks(SDXLUNet.skeleton(UNET))]
    plan = offload.plan_offload_from_config(UNET, count=len(names) - 2, slots=3)
    inputs = (flame.randn(1, 4, 4, 4), flame.full((1,), 500.0), flame.randn(1, 3, 32), flame.randn(1, 16),
              flame.randn(1, 6))
    models, outputs = [], []
    for host_blocks in ((), plan.streamed):
        model = SDXLUNet.from_pretrained(path, host_blocks=host_blocks)
        models.append({n: _host_bytes(p) for n, p in model.named_parameters()})
        host = {name: _host_memory(model.get_submodule(name)) for name in host_blocks}
        conv = model.get_submodule(plan.streamed[0]).conv1.weight
        assert conv.stride() == (conv.shape[1] * 9, 1, conv.shape[1] * 3, conv.shape[1])  # channels-last
        model.requires_grad_(False)
        inject_lora(model, "attn", rank=2)
        _randomize_adapters(model, 1)
        if host_blocks:
            _adopted(offload.BlockStreamer(model, plan), host)
        with flame.no_grad():
            outputs.append(model(*inputs).to_torch())
    assert models[0].keys() == models[1].keys() and all(torch.equal(v, models[1][k]) for k, v in models[0].items())
    assert torch.equal(*outputs)


@pytest.mark.parametrize("family", ["flux", "sdxl"])
def test_plan_from_config_equals_the_plan_of_the_built_model(family):
    if family == "flux":
        cfg, cls, skip = dataclasses.replace(FluxConfig.tiny(), num_layers=3, num_single_layers=5), \
            FluxTransformer2DModel, _FLUX_FP8_SKIP
    else:
        from tiny_sdxl import UNET
        cfg, cls, skip = UNET, SDXLUNet, [r"re:.*time_emb_proj"]
    model = cls(cfg)
    model.requires_grad_(False)
    half = offload.plan_offload(model, count=len(offload.streamable_blocks(model)) // 2).device_bytes
    for fp8 in ({}, {"weight_dtype": "fp8_e4m3", "fp8_skip": skip}):
        if fp8:
            nn.quantize_linears_(model, skip=skip)
        for how in ({"count": 3}, {"count": "all", "slots": 1}, {"budget_bytes": half}):
            assert offload.plan_offload_from_config(cfg, **how, **fp8) == offload.plan_offload(model, **how), how
    assert offload.plan_offload_from_config(cfg, flame.float16, count="all").model_bytes * 2 == \
        offload.plan_offload_from_config(cfg, count="all").model_bytes


def test_loading_with_host_blocks_refuses_bad_input(tmp_path):
    cfg = FluxConfig.tiny()
    path = _write_flux(tmp_path, "bfl", cfg)
    who = "FluxTransformer2DModel.from_pretrained"
    with pytest.raises(ValueError, match=rf"{who}: the model has no block 'double_blocks\.7'"):
        FluxTransformer2DModel.from_pretrained(path, config=cfg, host_blocks=["double_blocks.7"])
    with pytest.raises(TypeError, match=r"'img_in' is a Linear; only blocks"):
        FluxTransformer2DModel.from_pretrained(path, config=cfg, host_blocks=["img_in"])
    with pytest.raises(ValueError, match=r"weight_dtype must be None \(the model's dtype\) or one of \['fp8_e4m3'\]"):
        FluxTransformer2DModel.from_pretrained(path, config=cfg, weight_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match=r"need at least .* with 4 of 4 blocks streamed.* more than the budget"):
        offload.plan_offload_from_config(cfg, budget_bytes=10_000)
    with pytest.raises(TypeError, match="config must be a FluxConfig or an SDXLUNetConfig, got dict"):
        offload.plan_offload_from_config(cfg.to_diffusers(), count=1)
    with pytest.raises(ValueError, match=r"build the model with device='meta' to place its weights \(img_in.weight"):
        placement.place(FluxTransformer2DModel(cfg), ["double_blocks.0"])
    meta = FluxTransformer2DModel(cfg, device="meta")  # planned or placed, not run: no memory, no init
    assert all(p._data.is_meta for p in meta.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [None, "fp8_e4m3"])
def test_gpu_loading_with_host_blocks_keeps_the_streamed_weights_off_the_device(tmp_path, weight_dtype):
    """Flux.1's width, 2 double and 4 single blocks in bf16, all streamed: loading holds the resident
    weights and one stored tensor on the device (a normal load: all the weights), the first step what
    the normally loaded streamed model holds (resident weights, slots, activations); same results."""
    cfg = dataclasses.replace(FluxConfig(), num_layers=2, num_single_layers=4)
    path = _write_flux(tmp_path, "bfl", cfg, dtype=flame.bfloat16)
    fp8 = {"weight_dtype": weight_dtype, "fp8_skip": _FLUX_FP8_SKIP} if weight_dtype else {}
    plan = offload.plan_offload_from_config(cfg, flame.bfloat16, count="all", **fp8)
    # in flight while loading: one stored bf16 tensor on the device (and its fp8 codes, when quantised)
    in_flight = 3 * max(math.prod(s) for s in FluxTransformer2DModel.parameter_shapes(cfg).values())
    inputs = _flux_inputs(types.SimpleNamespace(config=cfg, dtype=flame.bfloat16), h=64, w=64, n_txt=128)

    def run(host_blocks):
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = FluxTransformer2DModel.from_pretrained(path, flame.bfloat16, cfg, host_blocks=host_blocks, **fp8)
        loading = torch.cuda.max_memory_allocated() - base
        host = {name: _host_memory(model.get_submodule(name)) for name in host_blocks}
        model.requires_grad_(False)
        inject_lora(model, FX.LORA_PRESETS["attn-mlp"], rank=16)
        params = _randomize_adapters(model, 1)
        streamer = offload.BlockStreamer(model, plan)
        if host_blocks:
            _adopted(streamer, host)
        torch.cuda.reset_peak_memory_stats()
        result = _result(_step_fn(model, params)(*inputs))
        return loading, torch.cuda.max_memory_allocated() - base, result

    host_load, host_step, got = run(plan.streamed)
    normal_load, normal_step, want = run(())
    print(f"{plan.summary()}; load peak {host_load / 2**20:.0f} MiB (normal load {normal_load / 2**20:.0f} MiB), "
          f"step peak {host_step / 2**20:.0f} MiB (normally loaded {normal_step / 2**20:.0f} MiB)")
    _assert_same(got, want, exact=False)
    margin = 64 << 20
    assert host_load <= plan.resident_bytes + in_flight + margin
    assert normal_load >= plan.model_bytes
    assert host_step <= normal_step + margin


@pytest.mark.gpu
def test_gpu_weights_in_host_memory_are_streamed_or_refused(tmp_path):
    """quantize_linears_ and a plan that leaves a host block resident refuse them (kernels cannot read them)."""
    cfg = FluxConfig.tiny()
    path = _write_flux(tmp_path, "bfl", cfg)
    model = FluxTransformer2DModel.from_pretrained(path, config=cfg, host_blocks=["double_blocks.0", "single_blocks.0"])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"layer 'double_blocks.0.img_mod.lin' has its weight in host memory"):
        nn.quantize_linears_(model)
    assert not any(isinstance(p, Fp8Weight) for p in model.parameters())
    plan = offload.plan_offload(model, blocks=["double_blocks.0"], count=1)
    with pytest.raises(ValueError, match=r"single_blocks.0.linear1.weight is in host memory .* plan does not stream"):
        offload.BlockStreamer(model, plan)
