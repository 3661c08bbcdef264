"""ZeRO sharding (flame.sharding) on gloo: 2 and 4 processes of tests/shard_worker.py train a tiny
two-layer model at each stage and are compared with the unsharded run of one process.

The reference takes, per step, the ranks' rows of the global batch as micro-batches (one per rank,
weighted 1/N, in rank order) and runs AdamW on the parameters themselves. Equality:
- 2 ranks: bit for bit at every stage (each rank's gradient is the micro-batch's, the sum of two
  is the same in either order, and AdamW is elementwise: a flat slice updates as the tensors do);
- 4 ranks, and clipping: within fp32 rounding (gloo's sum of four and the global norm's partial
  sums run in another order than the reference's).
The ``gradients`` and ``parameters`` stages reduce-scatter from the backward (``overlap``, the
default) in these runs, and once without it; the backward's reduce-scatters are counted. Uneven
micro-batches (ranks weighed by their rows, one rank without rows) with accumulation, through
``CapturedStep``, and a parameter without a gradient are 2-rank jobs of the same run.
Resume: a 2-rank checkpoint continues on 4 ranks, a 4-rank one on 1 rank (this process).
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
    """Each stage for steps 1-3 on 2 ranks (checkpoints after step 2; the reduce-scatter emulated at
    the ``parameters`` stage; a step with NaN gradients on rank 1), then on 4 ranks (a checkpoint
    after step 2), and the 2-rank checkpoints resumed on 4 ranks: AdamW's with other units and
    clipping, AdamW8bit's after step 1."""
    root = tmp_path_factory.mktemp("shards")
    ck = root / "ck"
    jobs = [{"name": "optimizer", "stage": "optimizer", "steps": [1, 3]},
            {"name": "gradients", "stage": "gradients", "steps": [1, 3], "bucket": 8192},  # a unit per tensor
            {"name": "parameters", "stage": "parameters", "steps": [1, 3], "units": "layers"}]
    saves = {"gradients": {"2": str(ck / "g2")}, "parameters": {"2": str(ck / "p2")}}
    two, four = _launch(root / "ranks", [
        {"world": 2, "jobs": [dict(job, save=saves.get(job["name"], {}), emulate=job["stage"] == "parameters")
                              for job in jobs] + [
            {"name": "gradients_plain", "stage": "gradients", "steps": [1, 3], "bucket": 8192, "overlap": False},
            {"name": "uneven", "stage": "gradients", "steps": [1, 3], "units": "layers", "sizes": UNEVEN,
             "graph": True},
            {"name": "missing", "stage": "gradients", "steps": [1, 2], "units": "layers", "missing": True},
            {"name": "nan", "stage": "gradients", "steps": [1, 1], "nan": True},
            {"name": "bf16_reduce", "stage": "gradients", "steps": [1, 3], "units": "layers", "bf16_reduce": True},
            {"name": "8bit", "stage": "gradients", "steps": [1, 2], "units": "layers", "8bit": True,
             "save": {"1": str(ck / "a2")}}]},
        {"world": 4, "jobs": [dict(job, save={"2": str(ck / "p4")} if job["stage"] == "parameters" else {})
                              for job in jobs] + [
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
    """The first backward decides the order (its units are launched by pack); from then on each
    backward issues every unit's reduce-scatter itself (4 units of one tensor, 2 of one layer);
    without overlap none."""
    for key in ("two", "four"):
        for rank_file in runs[key]:
            np.testing.assert_array_equal(rank_file["gradients/launched"], [0, 4, 4])
            np.testing.assert_array_equal(rank_file["parameters/launched"], [0, 2, 2])
    for rank_file in runs["two"]:
        np.testing.assert_array_equal(rank_file["gradients_plain/launched"], [0, 0, 0])


def test_uneven_micro_batches_and_a_rank_without_rows_accumulate_the_unsharded_gradients(runs, uneven_reference):
    """Per step, 3 rows over 2 ranks (1 and 2: the ranks weigh their gradients 1/6 and 2/6 before
    the reduction), then 1 row (rank 0 packs None and launches zeros while rank 1's backward
    launches its units), accumulated; the step through CapturedStep (its rules from the 2nd call)."""
    for r, rank_file in enumerate(runs["two"]):
        np.testing.assert_array_equal(rank_file["uneven/launched"], [0, 2, 2] if r == 0 else [0, 2, 2, 2, 2, 2])
        got = _weights(rank_file, "uneven")
        for name, want in uneven_reference.items():
            np.testing.assert_allclose(got[name], want, **CLOSE, err_msg=name)


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


def test_parameters_stage_memory_per_rank_is_within_a_share_and_15_percent(runs, reference):
    params = sum(v.nbytes for v in reference[2].values())
    unsharded = 3 * params  # fp32 weights and AdamW's two moments
    for world, key in ((2, "two"), (4, "four")):
        for rank_file in runs[key]:
            held, master, state, _ = rank_file["parameters/memory"]
            assert held == 0  # released between uses
            assert state == 2 * master  # state for this rank's chunks only
            assert held + master + state <= (1 / world + 0.15) * unsharded, (world, master, state, unsharded)


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
    assert shards.memory()["parameters"] == 0
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


@pytest.mark.gpu
@pytest.mark.skipif(not flame.is_interpreter() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_every_stage_on_two_gpus_over_nccl_gives_the_unsharded_weights(reference, tmp_path):
    """The 2-rank runs on NCCL, one process per GPU under torchrun (the CUDA context cannot be forked):
    each stage (with overlap: the reduce-scatters on a communication stream), ``gradients`` without
    overlap and with the forward and backward in a CUDA graph (captured at step 2, replayed at 3)."""
    jobs = [{"name": stage, "stage": stage, "steps": [1, 3], "units": "layers"} for stage in sharding.STAGES] + [
        {"name": "plain", "stage": "gradients", "steps": [1, 3], "units": "layers", "overlap": False},
        {"name": "graph", "stage": "gradients", "steps": [1, 3], "units": "layers", "graph": True}]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "shard_worker.py"), str(tmp_path), json.dumps([{"world": 2,
                                                                                                "jobs": jobs}])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [dict(np.load(tmp_path / "phase-0" / f"rank-{r}.npz")) for r in range(2)]
    for job in [j["name"] for j in jobs]:
        for name, want in reference[3].items():
            np.testing.assert_array_equal(_weights(ranks[1], job)[name], _weights(ranks[0], job)[name])
            np.testing.assert_allclose(_weights(ranks[0], job)[name], want, **CLOSE, err_msg=f"{job} {name}")
