"""ZeRO sharding (flame.sharding) on gloo: 2 and 4 processes of tests/shard_worker.py train a tiny
two-layer model at each stage and are compared with the unsharded run of one process.

The reference takes, per step, the ranks' rows of the global batch as micro-batches (one per rank,
weighted 1/N, in rank order) and runs AdamW on the parameters themselves. Equality:
- 2 ranks: bit for bit at every stage (each rank's gradient is the micro-batch's, the sum of two
  is the same in either order, and AdamW is elementwise: a flat slice updates as the tensors do);
- 4 ranks, and clipping: within fp32 rounding (gloo's sum of four and the global norm's partial
  sums run in another order than the reference's).
The ``gradients`` and ``parameters`` stages reduce-scatter from the backward (``overlap``, the
default) in these runs, and once without it; the backward's reduce-scatters are counted. The
``parameters`` stage runs its steps through ``CapturedStep`` (the graph rules from the second call:
the blocks' gathers into the ring of slots inside the step). Uneven micro-batches (ranks weighed by
their rows, one rank without rows) with accumulation, through ``CapturedStep``, at the ``gradients``
and ``parameters`` stages, and a parameter without a gradient are 2-rank jobs of the same run.
Resume: 2-rank checkpoints continue on 4 ranks (``gradients`` and ``parameters``), a 4-rank one on 1
rank (this process). The ring's schedule (which block is in which slot, gathers one block ahead) is
checked in this process, on one rank.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch_usage

import flame
from flame import distributed, sharding
from flame.io import load_safetensors
from flame.ops.loss import mse_loss
from flame.optim import Adafactor, clip_grad_norm_
from tests import shard_worker as W

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_NORM = 0.05  # below the reference's gradient norm at step 3: the clip bites
CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # fp32 rounding after a few AdamW steps of lr 1e-2
UNEVEN = [3, 1]  # the global rows of each step's micro-batches: on 2 ranks 1 + 2, then none + 1


def _launch(out, phases, timeout=300):
    """tests/shard_worker.py's phases ({"world": N, "jobs": [...]}, N forked ranks each); their rank
    files, by phase and rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "shard_worker.py"), str(out), json.dumps(phases)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [[dict(np.load(out / f"phase-{i}" / f"rank-{r}.npz")) for r in range(phase["world"])]
            for i, phase in enumerate(phases)]


def _weights(rank_file, job):
    prefix = f"{job}/w/"
    return {k[len(prefix):]: v for k, v in rank_file.items() if k.startswith(prefix)}


def _snapshot(model):
    return {name: p.numpy() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    """The unsharded run at 2 micro-batches: weights after steps 2 and 3, and step 3 again with
    clipping at MAX_NORM (weights and the norm), from the same state after step 2."""
    model = W.build_model()
    opt = W.make_optimizer(list(model.parameters()))
    bucket = distributed.GradientBucket(list(model.parameters()))

    def step(n, max_norm=None):
        for part in range(2):
            x, y = W.batch(n, part, 2)
            loss = mse_loss(W.forward(model, x), y)
            bucket.pack(loss.backward(), loss, 0.5, accumulate=part > 0)
        norm = clip_grad_norm_(bucket.grads, max_norm).item() if max_norm is not None else None
        opt.step(bucket.grads)
        return norm

    out = {}
    for n in (1, 2):
        step(n)
    out[2] = _snapshot(model)
    saved = opt.state_dict()
    step(3)
    out[3] = _snapshot(model)
    model.load_state_dict({k: flame.tensor(v) for k, v in out[2].items()})
    opt.load_state_dict(saved)
    out["norm"] = step(3, MAX_NORM)
    assert out["norm"] > MAX_NORM  # the clip bites
    out["clipped"] = _snapshot(model)
    return out


@pytest.fixture(scope="module")
def uneven_reference():
    """The unsharded run of 3 steps of ``UNEVEN`` micro-batches (each weighed 1/2)."""
    model = W.build_model()
    opt = W.make_optimizer(list(model.parameters()))
    bucket = distributed.GradientBucket(list(model.parameters()))
    for n in (1, 2, 3):
        for micro, rows in enumerate(UNEVEN):
            x, y = W.batch(n, 0, 1, rows, micro)
            loss = mse_loss(W.forward(model, x), y)
            bucket.pack(loss.backward(), loss, 1 / len(UNEVEN), accumulate=micro > 0)
        opt.step(bucket.grads)
    return _snapshot(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each stage for steps 1-3 on 2 ranks (checkpoints after step 2, and after step 1 at the
    ``parameters`` stage; the reduce-scatter emulated there; a step with NaN gradients on rank 1),
    then on 4 ranks (a checkpoint after step 2; the ``parameters`` stage resumed from the 2 ranks'
    step 1), and the 2-rank checkpoints resumed on 4 ranks: AdamW's with other units and clipping,
    AdamW8bit's after step 1."""
    if not flame.is_interpreter():  # one GPU per rank: the NCCL test below (torchrun) runs the stages there
        pytest.skip("ranks forked on gloo run on the interpreter (a CUDA context cannot be forked)")
    root = tmp_path_factory.mktemp("shards")
    ck = root / "ck"
    jobs = [{"name": "optimizer", "stage": "optimizer", "steps": [1, 3]},
            {"name": "gradients", "stage": "gradients", "steps": [1, 3], "bucket": 8192},  # a unit per tensor
            {"name": "parameters", "stage": "parameters", "steps": [1, 3], "units": "layers", "graph": True}]
    saves = {"gradients": {"2": str(ck / "g2")}, "parameters": {"1": str(ck / "p1"), "2": str(ck / "p2")}}
    resumed_on_four = {"parameters": {"steps": [2, 3], "resume": str(ck / "p1")}}
    two, four = _launch(root / "ranks", [
        {"world": 2, "jobs": [dict(job, save=saves.get(job["name"], {}), emulate=job["stage"] == "parameters")
                              for job in jobs] + [
            {"name": "gradients_plain", "stage": "gradients", "steps": [1, 3], "bucket": 8192, "overlap": False}] + [
            {"name": f"uneven_{stage}", "stage": stage, "steps": [1, 3], "units": "layers", "sizes": UNEVEN,
             "graph": True} for stage in ("gradients", "parameters")] + [
            {"name": "missing", "stage": "gradients", "steps": [1, 2], "units": "layers", "missing": True},
            {"name": "nan", "stage": "gradients", "steps": [1, 1], "nan": True},
            {"name": "bf16_reduce", "stage": "gradients", "steps": [1, 3], "units": "layers", "bf16_reduce": True},
            {"name": "8bit", "stage": "gradients", "steps": [1, 2], "units": "layers", "8bit": True,
             "save": {"1": str(ck / "a2")}}]},
        {"world": 4, "jobs": [dict(job, save={"2": str(ck / "p4")} if job["stage"] == "parameters" else {},
                                   **resumed_on_four.get(job["name"], {})) for job in jobs] + [
            {"name": "resumed", "stage": "gradients", "steps": [3, 3], "units": "layers", "resume": str(ck / "g2"),
             "max_norm": MAX_NORM, "overlap": False},
            {"name": "8bit", "stage": "gradients", "steps": [2, 2], "units": "layers", "8bit": True,
             "resume": str(ck / "a2")}]}])
    return {"two": two, "four": four, "ck": ck}


def test_every_stage_gives_the_unsharded_weights_on_two_ranks_bit_for_bit_and_on_four_within_rounding(runs,
                                                                                                     reference):
    for world, key in ((2, "two"), (4, "four")):
        for job in sharding.STAGES + (("gradients_plain",) if world == 2 else ()):
            for rank_file in runs[key]:
                got = _weights(rank_file, job)
                assert got.keys() == reference[3].keys()
                for name, want in reference[3].items():
                    if world == 2:
                        np.testing.assert_array_equal(got[name], want, err_msg=f"{job} {name}")
                    else:
                        np.testing.assert_allclose(got[name], want, **CLOSE, err_msg=f"{job} {name}")


def test_the_backward_launches_every_units_reduce_scatter_from_the_second_step_on(runs):
    """The first backward of a process decides the order (its units are launched by pack); from then
    on each backward issues every unit's reduce-scatter itself (4 units of one tensor, 2 of one
    layer); without overlap none. On 4 ranks the ``parameters`` stage resumes at step 2."""
    for key in ("two", "four"):
        for rank_file in runs[key]:
            np.testing.assert_array_equal(rank_file["gradients/launched"], [0, 4, 4])
            np.testing.assert_array_equal(rank_file["parameters/launched"], [0, 2, 2] if key == "two" else [0, 2])
    for rank_file in runs["two"]:
        np.testing.assert_array_equal(rank_file["gradients_plain/launched"], [0, 0, 0])


def test_uneven_micro_batches_and_a_rank_without_rows_accumulate_the_unsharded_gradients(runs, uneven_reference):
    """Per step, 3 rows over 2 ranks (1 and 2: the ranks weigh their gradients 1/6 and 2/6 before
    the reduction), then 1 row (at the ``gradients`` stage rank 0 packs None and launches zeros
    while rank 1's backward launches its units; at the ``parameters`` stage, whose forward gathers
    with the other rank, rank 0 runs row 0 weighed 0), accumulated; the step through CapturedStep
    (its rules from the 2nd call)."""
    for stage in ("gradients", "parameters"):
        for r, rank_file in enumerate(runs["two"]):
            without_rows = r == 0 and stage == "gradients"
            np.testing.assert_array_equal(rank_file[f"uneven_{stage}/launched"],
                                          [0, 2, 2] if without_rows else [0, 2, 2, 2, 2, 2])
            got = _weights(rank_file, f"uneven_{stage}")
            for name, want in uneven_reference.items():
                np.testing.assert_allclose(got[name], want, **CLOSE, err_msg=f"{stage} {name}")


def test_a_parameter_without_a_gradient_is_named_by_pack_with_overlap(runs):
    """The second step leaves '1.bias' out of the loss: its unit never launches, nor do the units
    after it in the order, and pack names it on every rank."""
    for rank_file in runs["two"]:
        assert str(rank_file["missing/error"]) == ("ShardedOptimizer.pack: no gradient for '1.bias': every rank must "
                                                   "produce a gradient for every trained parameter")


def test_gradients_reduced_in_bf16_train_close_to_fp32(runs, reference):
    """reduce_dtype bf16: each rank's gradients and their sum rounded to bf16, the update in fp32 from
    there. After 3 AdamW steps the weights are close to the exact run's on average; where the ranks'
    gradients nearly cancel the rounded sum may change sign, and Adam's normalised step then goes the
    other way (at most 2 lr per step apart)."""
    for rank_file in runs["two"]:
        got = _weights(rank_file, "bf16_reduce")
        for name, want in reference[3].items():
            diff = np.abs(got[name] - want)
            assert diff.mean() <= 0.05 * W.LR and diff.max() <= 3 * 2 * W.LR, (name, diff.mean(), diff.max())


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(runs):
    start = _snapshot(W.build_model())
    for rank_file in runs["two"]:
        for name, want in start.items():
            np.testing.assert_array_equal(_weights(rank_file, "nan")[name], want)


def test_a_two_rank_checkpoint_continues_on_four_ranks_with_other_units_and_a_global_clip(runs, reference):
    for rank_file in runs["four"]:
        np.testing.assert_allclose(rank_file["resumed/norms"], [reference["norm"]], rtol=1e-5)
        got = _weights(rank_file, "resumed")
        for name, want in reference["clipped"].items():
            np.testing.assert_allclose(got[name], want, **CLOSE, err_msg=name)


def test_adamw8bit_blocks_are_resliced_from_two_ranks_to_four(runs):
    """Its 8-bit moments and their per-block maxima continue on 4 ranks as on 2, within fp32
    rounding (lost maxima would move the weights by about the learning rate, 1e-2)."""
    straight = _weights(runs["two"][0], "8bit")
    for rank_file in runs["four"]:
        for name, want in straight.items():
            np.testing.assert_allclose(_weights(rank_file, "8bit")[name], want, **CLOSE, err_msg=name)


def _unit_bytes(sizes, world, align=256):
    """The fp32 bytes of a unit of tensors of ``sizes`` elements as ShardedOptimizer lays it out: each
    at a 64-element boundary, padded to ``world`` chunks of a multiple of ``align``."""
    def round_up(n, m):
        return (n + m - 1) // m * m

    numel = 0
    for n in sizes[:-1]:
        numel = round_up(numel + n, 64)
    numel += sizes[-1]
    return world * round_up((numel + world - 1) // world, align) * 4


def test_parameters_stage_memory_per_rank_is_within_a_share_and_15_percent_plus_two_blocks(runs, reference):
    """Per rank: the master and AdamW's moments of its chunks, within (1/N + 15%) of the unsharded
    weights and moments, and the ring of 2 slots, each one layer's units: two blocks' weights whatever
    the depth (a two-layer model's whole; SDXL's UNet's two largest blocks, about 100 MB each in bf16,
    against the 36 GB of its unsharded bf16 weights, fp32 master and moments)."""
    params = sum(v.nbytes for v in reference[2].values())
    unsharded = 3 * params  # fp32 weights and AdamW's two moments
    for world, key in ((2, "two"), (4, "four")):
        ring = 2 * max(_unit_bytes([reference[2][f"{layer}.weight"].size, reference[2][f"{layer}.bias"].size], world)
                       for layer in ("0", "1"))
        for rank_file in runs[key]:
            held, master, state, _ = rank_file["parameters/memory"]
            assert held == ring  # nothing else whole
            assert state == 2 * master  # state for this rank's chunks only
            assert master + state <= (1 / world + 0.15) * unsharded, (world, master, state, unsharded)


def test_a_four_rank_checkpoint_continues_in_one_process_and_exports_the_weights(runs, reference, tmp_path):
    """In this process, under the dynamic check of the rule that flame/ runs no PyTorch compute."""
    with torch_usage.AtenRecorder() as rec:
        model = W.build_model()
        shards = sharding.ShardedOptimizer(model.named_parameters(), "parameters", W.make_optimizer, units=[model[1]])
        shards.load(runs["ck"] / "p4")  # saved with one unit per layer
        x, y = W.batch(3, 0, 1)
        shards.pack(mse_loss(W.forward(model, x, shards.run), y).backward())
        shards.step()
        got = W.weights(model, shards)
        sharding.export(runs["ck"] / "p2", tmp_path / "model.safetensors")  # the bit-exact 2-rank run, after step 2
    assert not rec.violations(), "\n".join(map(str, rec.violations()))
    sizes = [[p.numel() for p in layer.parameters()] for layer in model]
    assert shards.memory()["parameters"] == _unit_bytes(sizes[0], 1) + _unit_bytes(sizes[1], 1)  # a bucket, a slot
    index = sharding.read_index(runs["ck"] / "p4")
    assert index["world_size"] == 4 and index["step"] == 2 and len(index["units"]) == 2
    for name, want in reference[3].items():
        np.testing.assert_allclose(got[name], want, **CLOSE, err_msg=name)
    exported = load_safetensors(tmp_path / "model.safetensors")
    assert exported.keys() == reference[2].keys()
    for name, want in reference[2].items():
        assert exported[name].dtype == flame.float32
        np.testing.assert_array_equal(exported[name].numpy(), want)


def test_bad_input_is_refused_with_a_clear_error(runs, tmp_path):
    model = W.build_model()
    with pytest.raises(ValueError, match=r"unknown stage 'zero4'; one of optimizer, gradients, parameters"):
        sharding.ShardedOptimizer(model.named_parameters(), "zero4", W.make_optimizer)
    with pytest.raises(NotImplementedError, match="Adafactor cannot run on flat slices"):
        sharding.ShardedOptimizer(model.named_parameters(), "optimizer",
                                  lambda ps: Adafactor(ps, lr=1e-3, relative_step=False))
    folder = tmp_path / "ck"
    shutil.copytree(runs["ck"] / "p2", folder)
    index = json.loads((folder / sharding.INDEX).read_text())
    (folder / sharding.INDEX).write_text(json.dumps(dict(index, world_size=3)))
    shards = sharding.ShardedOptimizer(model.named_parameters(), "gradients", W.make_optimizer)
    with pytest.raises(ValueError, match=r"says world size 3 but lists 2 shard files"):
        shards.load(folder)
    index["units"][0]["params"][0]["shape"] = [64, 128]
    (folder / sharding.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'0.weight' has shape \[64, 128\] in the checkpoint, \[128, 64\] here"):
        shards.load(folder)
    os.remove(folder / sharding.MARKER)
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        shards.load(folder)


def test_one_process_bf16_weights_state_dict_and_a_found_inf_flag():
    """bf16 parameters follow their fp32 master (cast by a kernel); a set found_inf skips the step
    and stays set; state_dict/load_state_dict round-trip."""
    model = W.build_model().to(dtype=flame.bfloat16)
    shards = sharding.ShardedOptimizer(model.named_parameters(), "gradients", W.make_optimizer)
    assert not shards.overlap  # one rank: nothing to reduce-scatter
    grads = flame.GradientMap()
    for p in model.parameters():
        grads[p] = flame.ones(*p.shape)
    shards.pack(grads)
    found = flame.tensor(np.array([1], dtype=np.int32))
    before = _snapshot(model)
    shards.step(found_inf=found)
    assert found.numpy().tolist() == [1]
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.to(flame.float32).numpy(), before[name].astype(np.float32))
    shards.step()
    state = shards.state_dict()
    master = state["master"].numpy()
    for _, p, off in shards.units[0].members:
        want = flame.tensor(master[off:off + p.numel()]).to(flame.bfloat16).reshape(*p.shape)
        np.testing.assert_array_equal(p.to(flame.float32).numpy(), want.to(flame.float32).numpy())
    shards.step()  # moves on; loading the state goes back
    shards.load_state_dict(state)
    np.testing.assert_array_equal(shards.state_dict()["master"].numpy(), master)


# The ring's schedule of one pass over four blocks: (event, block, slot, the block each slot holds after it).
RING_SCHEDULES = {
    2: [("gather", 0, 0, (0, None)), ("forward", 0, 0, (0, None)), ("gather", 1, 1, (0, 1)),
        ("forward", 1, 1, (0, 1)), ("gather", 2, 0, (2, 1)), ("forward", 2, 0, (2, 1)), ("gather", 3, 1, (2, 3)),
        ("forward", 3, 1, (2, 3)),
        ("backward", 3, 1, (2, 3)), ("backward", 2, 0, (2, 3)), ("gather", 1, 1, (2, 1)), ("backward", 1, 1, (2, 1)),
        ("gather", 0, 0, (0, 1)), ("backward", 0, 0, (0, 1))],
    3: [("gather", 0, 0, (0, None, None)), ("forward", 0, 0, (0, None, None)), ("gather", 1, 1, (0, 1, None)),
        ("gather", 2, 2, (0, 1, 2)), ("forward", 1, 1, (0, 1, 2)), ("gather", 3, 0, (3, 1, 2)),
        ("forward", 2, 2, (3, 1, 2)), ("forward", 3, 0, (3, 1, 2)),
        ("backward", 3, 0, (3, 1, 2)), ("backward", 2, 2, (3, 1, 2)), ("gather", 0, 0, (0, 1, 2)),
        ("backward", 1, 1, (0, 1, 2)), ("backward", 0, 0, (0, 1, 2))]}


@pytest.mark.parametrize("slots,dtype", [(2, flame.float32), (3, flame.bfloat16)])
def test_the_ring_gathers_each_block_ahead_into_its_slot_and_trains_the_weights_of_whole_ones(slots, dtype):
    """One rank, four layers, each an entry of units: layer k lives in slot k mod slots for good (its
    parameters never move: a CUDA graph reads them where the capture saw them). A pass gathers the
    next blocks whose slots are free as a block starts (one ahead with 2 slots, two with 3), forward
    and then in reverse, where the backward finds a slot holding another block. Through CapturedStep
    (the graph rules from its second call), two steps of two micro-batches give bit for bit the
    weights of the ``gradients`` stage, which keeps them whole (fp32: the unsharded run's; bf16 weights
    cast from the fp32 master into the slots; a block run on another's weights would differ)."""
    dims = (16,) * 5
    model = W.build_model(dims).to(dtype=dtype)
    shards = sharding.ShardedOptimizer(model.named_parameters(), "parameters", W.make_optimizer, units=list(model),
                                       slots=slots, log=True)
    where = [layer.weight._data.data_ptr() for layer in model]
    assert [where.index(w) for w in where] == [k % slots for k in range(4)]  # block k in slot k mod slots
    reference = W.build_model(dims).to(dtype=dtype)
    whole = sharding.ShardedOptimizer(reference.named_parameters(), "gradients", W.make_optimizer)

    def loss_and_grads(x, y):
        grads = mse_loss(W.forward(model, x, shards.run), y).backward()
        shards.join()
        return grads

    step = flame.graphs.CapturedStep(loss_and_grads)
    rng = np.random.RandomState(0)
    for call in range(4):
        x, y = (flame.tensor(rng.randn(3, 16).astype(np.float32)) for _ in range(2))
        shards.log.clear()
        shards.pack(step(x, y), weight=0.5, accumulate=call % 2 > 0)
        whole.pack(mse_loss(W.forward(reference, x), y).backward(), weight=0.5, accumulate=call % 2 > 0)
        # a GPU replays the graph captured at the second call: the schedule runs without Python, unlogged
        assert shards.log == (RING_SCHEDULES[slots] if call < 2 or flame.is_interpreter() else [])
        if call % 2:
            shards.step()
            whole.step()
    assert [layer.weight._data.data_ptr() for layer in model] == where
    assert shards.memory()["parameters"] == slots * _unit_bytes([16 * 16, 16], 1) * dtype.itemsize // 4
    with shards.gathered(model):
        got = {name: p.to(flame.float32).numpy() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        np.testing.assert_array_equal(got[name], p.to(flame.float32).numpy(), err_msg=name)
    with pytest.raises(ValueError, match=r"Sequential's parameters lie in 2 entries of units"):
        shards.run(model[:2], x)


@pytest.mark.gpu
@pytest.mark.skipif(not flame.is_interpreter() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_every_stage_on_two_gpus_over_nccl_gives_the_unsharded_weights(reference, uneven_reference, tmp_path):
    """The 2-rank runs on NCCL, one process per GPU under torchrun (the CUDA context cannot be forked):
    each stage (with overlap: the reduce-scatters on a communication stream; ``parameters``: the
    blocks' gathers into the ring there too), ``gradients`` without overlap, ``gradients`` and
    ``parameters`` with the forward and backward in a CUDA graph (captured at step 2, replayed at 3; bit
    for bit the eager runs),
    ``parameters`` in a CUDA graph with accumulation over uneven micro-batches, and bf16 weights at the
    ``parameters`` stage in a CUDA graph (cast from the master on the communication stream), each
    against the ``gradients`` stage's eager run of the same batches, bit for bit. The uneven runs
    against the unsharded one within TF32 rounding: fp32 GEMMs run in TF32 on the GPU, and the weight
    gradient sums 3 rows in one product there against 1 + 2 on the ranks (AdamW amplifies the ~1e-3
    relative difference where a gradient is near zero: at most ~1% of one lr 1e-2 step measured)."""
    layers = {"steps": [1, 3], "units": "layers"}
    jobs = [{"name": stage, "stage": stage, **layers} for stage in sharding.STAGES] + [
        {"name": "plain", "stage": "gradients", **layers, "overlap": False},
        {"name": "graph", "stage": "gradients", **layers, "graph": True},
        {"name": "parameters_graph", "stage": "parameters", **layers, "graph": True}]
    pairs = [("uneven", {"sizes": UNEVEN}), ("bf16", {"bf16": True})]
    others = [dict(name=f"{pair}_{stage}", stage=stage, **layers, **extra, graph=stage == "parameters")
              for pair, extra in pairs for stage in ("gradients", "parameters")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "shard_worker.py"), str(tmp_path),
                           json.dumps([{"world": 2, "jobs": jobs + others}])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [dict(np.load(tmp_path / "phase-0" / f"rank-{r}.npz")) for r in range(2)]
    for job in [j["name"] for j in jobs + others]:
        for name in reference[3]:
            np.testing.assert_array_equal(_weights(ranks[1], job)[name], _weights(ranks[0], job)[name])
    for name, want in reference[3].items():
        for job in [j["name"] for j in jobs]:
            np.testing.assert_allclose(_weights(ranks[0], job)[name], want, **CLOSE, err_msg=f"{job} {name}")
        np.testing.assert_allclose(_weights(ranks[0], "uneven_gradients")[name], uneven_reference[name],
                                   rtol=1e-3, atol=5e-4, err_msg=name)
        for pair, _ in pairs:
            np.testing.assert_array_equal(_weights(ranks[0], f"{pair}_parameters")[name],
                                          _weights(ranks[0], f"{pair}_gradients")[name], err_msg=f"{pair} {name}")
        for captured, eager in [("graph", "gradients"), ("parameters_graph", "parameters")]:
            np.testing.assert_array_equal(_weights(ranks[0], captured)[name], _weights(ranks[0], eager)[name],
                                          err_msg=f"{captured} {name}")
