"""Streamed blocks (flame.models.offload): frozen block weights in host memory, copied into device
slots ahead of each block, forward and backward. Outputs and LoRA gradients equal the resident
run's (bitwise on the CPU, where the slots are reused exactly as on a GPU, so a block run on
another block's weights would show), with and without gradient checkpointing, two steps in a row,
under the CUDA-graph rules; the schedule (which block sits in which slot when each block runs);
the planner's choice and byte counts; bad input. GPU tests: the same on CUDA streams, in a
captured graph, and the copies overlapping compute."""
import dataclasses
import itertools
import time

import pytest
import torch

import flame
from flame import nn
from flame.checkpoint import segment
from flame.graphs import CapturedStep
from flame.models import FluxConfig, FluxTransformer2DModel, SDXLUNet, offload
from flame.models import flux as FX
from flame.models.blocks import Checkpointed
from flame.nn import functional as F
from flame.nn.lora import inject_lora, lora_parameters

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


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_stack_schedule_with_one_two_three_slots(slots):
    model, params, inputs = _stack()
    step = _step_fn(model, params)
    want = _result(step(*inputs))
    streamer = offload.BlockStreamer(model, offload.plan_offload(model, count="all", slots=slots), log=True)
    for _ in range(2):
        _assert_same(_result(step(*inputs)), want)
    log = streamer.log
    _check_slots_hold_the_running_block(log)
    # forward: every block copied once; backward: all but the last `slots` of the forward
    assert streamer.copies == 2 * (6 + 6 - slots)
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
