"""Data-parallel training (flame.distributed): the pieces in one process -- rows of a global random
draw, per-rank random streams, the split loader, the gradient bucket's pack kernel -- and whole runs
of 2 processes on gloo (the interpreter) or NCCL (2 GPUs): the same LoRA as one process at the global
batch, exact resume after a killed process, a lost process named, Ctrl-C through torchrun and the CLI."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import flame
from flame import distributed
from flame.data import BucketBatchLoader, LatentCache, part_bounds, write_synthetic_cache
from flame.diffusion import sample_noise, sample_timesteps
from flame.io import load_safetensors
from flame.models import SDXLUNetConfig
from flame.ops.creation import draw, set_rng_substream
from flame.train import Trainer, build_config, list_checkpoints
from tests.standin import DIMS, StandInUNet

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
TWO_DEVICES = flame.is_interpreter() or torch.cuda.device_count() >= 2
needs_two = pytest.mark.skipif(not TWO_DEVICES, reason="needs 2 GPUs (or the interpreter)")


# ---- one process ----------------------------------------------------------------------------------

def test_rows_of_a_global_draw_are_the_same_numbers_however_split():
    flame.manual_seed(7)
    whole = flame.randn(6, 3, 2, 2).numpy()
    t_whole = sample_timesteps(6, 10, 900).numpy()
    after_whole = flame.get_rng_state()
    for bounds in ([(0, 2), (2, 4), (4, 6)], [(0, 5), (5, 6)], [(0, 0), (0, 6)]):
        flame.manual_seed(7)
        parts, t_parts = [], []
        for i, (a, b) in enumerate(bounds):
            set_rng_substream(i)  # the rows draw ignores the substream
            state = flame.get_rng_state()
            parts.append(flame.randn(b - a, 3, 2, 2, rows=(a, 6)).numpy())
            t_parts.append(sample_timesteps(b - a, 10, 900, rows=(a, 6)).numpy())
            if i + 1 < len(bounds):
                flame.set_rng_state(state)  # every rank starts its draw from the same state
        set_rng_substream(0)
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        np.testing.assert_array_equal(np.concatenate(t_parts), t_whole)
        assert flame.get_rng_state() == after_whole  # advanced by the whole draw
    with pytest.raises(ValueError, match=r"rows=\(5, 6\) does not hold the 2 rows"):
        flame.randn(2, 3, rows=(5, 6))
    with pytest.raises(TypeError, match="rows must be"):
        flame.rand(2, rows=5)


def test_substreams_differ_but_advance_alike():
    flame.manual_seed(3)
    a = flame.rand(64).numpy()
    state = flame.get_rng_state()
    flame.manual_seed(3)
    set_rng_substream(1)
    try:
        b = flame.rand(64).numpy()
        assert flame.get_rng_state() == state
        noise = sample_noise((2, 4, 3, 3), 0.1, rows=(0, 2)).numpy()
    finally:
        set_rng_substream(0)
    assert not np.allclose(a, b)
    flame.manual_seed(3)
    flame.rand(64)
    np.testing.assert_array_equal(sample_noise((2, 4, 3, 3), 0.1).numpy(), noise)
    key, offset = draw(5)
    assert offset == state["offset"] + 2 * 4 * 9 + 2 * 4 and key == 3  # after the noise and its offset
    with pytest.raises(ValueError, match="non-negative int"):
        set_rng_substream(-1)


def test_the_split_loader_walks_the_plan_of_the_global_batch(tmp_path):
    write_synthetic_cache(tmp_path, 22, 4, 6, 16, 8, latent_sizes=[(4, 4), (4, 6)], val_samples=0, seed=1)
    cache = LatentCache(tmp_path)
    whole = BucketBatchLoader(cache, 6, seed=5)
    halves = [BucketBatchLoader(cache, 3, seed=5, parts=2) for _ in range(2)]
    assert whole.plan(1) == halves[0].plan(1) and len(whole) == len(halves[1])
    for _ in range(len(whole) + 2):  # into the next epoch
        ids = whole.next_indices()
        assert halves[0].next_indices() == ids == halves[1].next_indices()
    assert [part_bounds(5, 2, r) for r in range(2)] == [(0, 2), (2, 5)]
    assert [part_bounds(1, 3, r) for r in range(3)] == [(0, 0), (0, 0), (0, 1)]
    # a state saved by 2 processes continues at the same point of the epoch in a 1-process loader
    state = halves[0].state_dict()
    single = BucketBatchLoader(cache, 3, seed=5)
    single.load_state_dict(state)
    assert single.epoch == state["epoch"]
    assert single.position == state["position"] * len(single) // len(halves[0])
    with pytest.raises(ValueError, match="no batch of 24"):
        BucketBatchLoader(cache, 12, parts=2, drop_last=True)


def test_gradient_bucket_packs_weighted_gradients_loss_and_flag():
    params = [flame.nn.Parameter(flame.randn(3, 5)), flame.nn.Parameter(flame.randn(7)),
              flame.nn.Parameter(flame.randn(2, 2))]
    bucket = distributed.GradientBucket(params)
    assert bucket.nbytes == (16 + 8 + 4 + 2) * 4  # segments padded to 4 elements

    def grads_of(scale):
        g = flame.GradientMap()
        for p in params:
            g[p] = flame.randn(*p.shape) * scale
        return g

    g1, g2 = grads_of(1.0), grads_of(2.0)
    g2[params[1]] = g2[params[1]].to(flame.bfloat16)  # a second source dtype: its own launch
    l1, l2 = flame.tensor(0.5), flame.tensor(1.5)
    bucket.pack(g1, l1, 0.25, accumulate=False)
    bucket.pack(g2, l2, 0.75, accumulate=True, stop=True)
    for p in params:
        want = 0.25 * g1[p].numpy() + 0.75 * g2[p].to(flame.float32).numpy()
        np.testing.assert_allclose(bucket.grads[p].numpy(), want, rtol=1e-6, atol=1e-6)
    assert bucket.loss.item() == pytest.approx(0.25 * 0.5 + 0.75 * 1.5)
    bucket.all_reduce()  # one process: nothing to sum
    assert not bucket.stop_requested()  # read a step late
    bucket.pack(None, None, 0.0, accumulate=False)  # a rank without samples
    bucket.all_reduce()
    assert bucket.stop_requested()  # the flag of the previous all-reduce
    assert all(not bucket.grads[p].numpy().any() for p in params) and bucket.loss.item() == 0
    missing = flame.GradientMap()
    missing[params[0]] = flame.randn(3, 5)
    with pytest.raises(RuntimeError, match=r"no gradient for a parameter of shape \(7,\)"):
        bucket.pack(missing, l1, 1.0, accumulate=False)


def test_one_process_is_a_world_of_one_and_a_partial_environment_is_refused(monkeypatch):
    assert distributed.init().size == 1 and distributed.world().is_main
    distributed.barrier()
    distributed.check_same([flame.ones(3)], "weights")
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, MASTER_ADDR.* unset: start the processes with torchrun"):
        distributed.init()


def test_a_process_that_ended_is_seen_as_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert distributed._process_gone(proc.pid)  # reaped now: no such process
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.5)  # it has ended, not yet waited for: a zombie
    assert distributed._process_gone(zombie.pid)
    zombie.wait()
    assert not distributed._process_gone(os.getpid())


# ---- two processes --------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_file(path, cache, out, **sections):
    import yaml
    raw = {"model": {"config": "tiny"}, "data": {"cache_dir": str(cache), "batch_size": 2},
           "lora": {"rank": 4, "targets": "attn"},
           "train": {"steps": 4, "lr": 3e-3, "precision": "fp32", "max_grad_norm": 1.0, "seed": 3},
           "diffusion": {"min_snr_gamma": 5.0},
           "output": {"dir": str(out), "save_every": 2, "log_every": 1, "keep_last": 5, "validate_every": 2}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw))
    return path


def _env(**launcher):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **launcher)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _rank_env(rank, world, port):
    return _env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _launch(config, out, *args, world=2, timeout=600):
    """Start ``world`` workers as torchrun would; return [(exit status, stderr, seconds)] by rank."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd = [sys.executable, str(WORKER), str(config), str(out), *args]
    procs = [subprocess.Popen(cmd, env=_rank_env(r, world, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    started, results = time.monotonic(), []
    try:
        for p in procs:  # rank 0 first: a rank that died stays a zombie (not reaped) while rank 0 runs
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
            results.append((p.returncode, err, time.monotonic() - started))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _rank_file(out, rank):
    return np.load(out / f"rank-{rank}.npz")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "cache"
    write_synthetic_cache(path, 20, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 4)], val_samples=6, concepts=4, seed=2)
    return path


@pytest.fixture(scope="module")
def two_ranks(tiny_cache, tmp_path_factory):
    """A 4-step run of 2 processes at batch 2 each, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("two")
    config = _config_file(root / "config.yaml", tiny_cache, root / "run")
    results = _launch(config, root / "ranks")
    assert [r[0] for r in results] == [0, 0], results
    return root, config, [_rank_file(root / "ranks", r) for r in range(2)]


@needs_two
def test_two_processes_train_the_lora_of_one_process_at_the_global_batch(two_ranks, tiny_cache, tmp_path):
    root, _, ranks = two_ranks
    for key in ranks[0].files:  # the ranks hold the very same weights
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])
    cfg = build_config({"model": {"config": "tiny"}, "data": {"cache_dir": str(tiny_cache), "batch_size": 4},
                        "lora": {"rank": 4, "targets": "attn"},
                        "train": {"steps": 4, "lr": 3e-3, "precision": "fp32", "max_grad_norm": 1.0, "seed": 3},
                        "diffusion": {"min_snr_gamma": 5.0},
                        "output": {"dir": str(tmp_path / "one"), "save_every": 2, "log_every": 1,
                                   "validate_every": 2}})
    flame.manual_seed(3)
    one = Trainer(cfg, model=StandInUNet(), progress=False, log=lambda *a: None).train()
    np.testing.assert_allclose(ranks[0]["losses"], one["losses"], rtol=1e-5)
    assert one["val_losses"].keys() == {0, 2, 4}
    metrics = [line for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert len(metrics) == 3  # written once (rank 0), not once per rank
    mine, theirs = load_safetensors(one["lora"]), load_safetensors(root / "run" / "lora.safetensors")
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_allclose(theirs[k].numpy(), mine[k].numpy(), rtol=1e-5, atol=1e-6)


@needs_two
@pytest.mark.extended
def test_a_killed_process_is_named_and_the_run_resumes_exactly(two_ranks, tmp_path):
    _, config, ranks = two_ranks
    out = tmp_path / "run"
    quick = (f"output.dir={out}", "output.validate_every=0")  # validation is covered above
    results = _launch(config, tmp_path / "killed", *quick, "--kill", "1:3")
    status, err, seconds = results[0]
    assert status == 1 and results[1][0] == -signal.SIGKILL
    assert "rank 1 (process" in err and "ended" in err and "--resume" in err, err
    assert "Traceback" not in err and seconds < 300
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [2]
    resumed = _launch(config, tmp_path / "resumed", *quick, "resume=latest")
    assert [r[0] for r in resumed] == [0, 0], resumed
    after = _rank_file(tmp_path / "resumed", 0)
    np.testing.assert_array_equal(after["steps"], [3, 4])
    np.testing.assert_array_equal(after["losses"], ranks[0]["losses"][2:])  # the uninterrupted curve, exactly
    for key in after.files:
        if key.startswith("w/"):
            np.testing.assert_array_equal(after[key], ranks[0][key])


@pytest.mark.extended  # signals: test_train.py; two processes: the tests above
@needs_two
def test_ctrl_c_on_one_process_under_torchrun_stops_both_at_one_step_with_one_checkpoint(tiny_cache, tmp_path):
    cache = tmp_path / "cache_tiny"
    tiny = SDXLUNetConfig.tiny()
    write_synthetic_cache(cache, 12, tiny.in_channels, 6, tiny.cross_attention_dim, tiny.pooled_dim,
                          latent_sizes=[(4, 4)], val_samples=0, seed=4)
    config = _config_file(tmp_path / "config.yaml", cache, tmp_path / "run", train={"steps": 8},
                          output={"save_every": 0, "validate_every": 0})
    (tmp_path / "ranks").mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(config), str(tmp_path / "ranks"), "--cli", "--interrupt", "0:2"],
                          env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    assert "SIGINT: the 2 processes finish the step they agree on" in proc.stderr, proc.stderr
    assert "interrupted at step" in proc.stdout + proc.stderr
    done = [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert len(done) == 1 and 2 < done[0] < 8  # one checkpoint, of the step both processes stopped after
    statuses = [int(_rank_file(tmp_path / "ranks", r)["status"]) for r in range(2)]
    steps = [int(_rank_file(tmp_path / "ranks", r)["steps"][-1]) for r in range(2)]
    assert statuses == [130, 143] and steps == [done[0]] * 2


@needs_two
def test_resuming_with_another_number_of_processes_warns_and_goes_on(two_ranks, tmp_path):
    import shutil
    root, config, _ = two_ranks
    shutil.copytree(root / "run", tmp_path / "run")
    cfg = build_config({**__import__("yaml").safe_load(config.read_text()), "resume": "latest"},
                       [f"output.dir={tmp_path / 'run'}", "train.steps=6", "output.validate_every=0"])
    lines = []
    flame.manual_seed(3)
    result = Trainer(cfg, model=StandInUNet(), progress=False, log=lines.append).train()
    text = "\n".join(map(str, lines))
    assert "was trained by 2 processes, this run has 1: the global batch changes from 4 to 2 samples" in text
    assert "resumed from" in text and result["step"] == 6
