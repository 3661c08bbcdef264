"""The ranks of the sharded-training tests (tests/test_sharding.py), on gloo.

    python tests/shard_worker.py OUT_DIR PHASES_JSON

This process imports flame once, runs one step of each kind on its own (the interpreter's kernels
parsed and cached), then for each phase ``{"world": N, "jobs": [...]}`` forks N ranks with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): forked ranks
start at once, where N fresh interpreters would each take seconds to import torch, triton and flame.
Each rank runs the phase's jobs in order and writes what it ended with to
OUT_DIR/phase-P/rank-R.npz under each job's name: the weights (``<job>/w/<name>``), the global
gradient norms (``<job>/norms``) and the memory breakdown (``<job>/memory``: parameters, master,
optimizer, gradients bytes). A job trains the tiny model below from its seed with
``flame.sharding.ShardedOptimizer``: ``name``, ``stage``, ``steps`` (first and last, 1-based),
``units`` ("layers": one unit per layer, else buckets of ``bucket`` elements), ``max_norm``,
``save`` ({step: folder}), ``resume`` (a folder loaded before the first step), ``emulate``
(reduce-scatter through an all-reduce, as on a gloo without it), ``nan`` (rank 1's loss is NaN),
``8bit`` (AdamW8bit instead of AdamW), ``bf16_reduce`` (gradients reduce-scattered in bf16), ``bf16``
(the model's weights in bf16, cast from the fp32 master),
``overlap`` (default true: the reduce-scatters launched from the backward), ``sizes`` (each step's
micro-batches: their global row counts, split over the ranks as the trainer splits them, each rank
weighing its share; a rank without rows packs None, or at the ``parameters`` stage runs row 0 weighed
0), ``graph`` (forward and backward through ``flame.graphs.CapturedStep``, ending with
``ShardedOptimizer.join`` as the trainer's step does: at the ``parameters`` stage the blocks' gathers
into the ring of slots run inside it), ``missing`` (the last step leaves the last layer's bias out
of the loss: the job ends at the error ``pack`` raises, saved as ``<job>/error``);
``<job>/launched`` counts, per backward, the reduce-scatters (or their all-reduce stand-ins) issued
inside it. Exits with status 1 when a rank failed (its traceback on stderr). Started by torchrun
(GPUs, NCCL), each process is one rank of the one phase given.
"""
import contextlib
import itertools
import json
import multiprocessing
import os
import pathlib
import socket
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flame  # noqa: E402 - first: it picks the backend
from flame import distributed, nn, sharding  # noqa: E402
from flame.data import part_bounds  # noqa: E402
from flame.graphs import CapturedStep  # noqa: E402
from flame.nn.functional import linear  # noqa: E402
from flame.ops.loss import mse_loss  # noqa: E402
from flame.optim import AdamW, AdamW8bit  # noqa: E402

DIMS = (64, 128, 64)  # two Linear layers: few kernel launches (the interpreter's cost), big enough for the
# memory bound (each rank's chunks are padded to 256 elements per unit)
ROWS = 8  # the global batch, split evenly over the ranks (or micro-batches)
LR = 1e-2


def build_model(dims=DIMS):
    flame.manual_seed(5)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(dims)])


def make_optimizer(params):
    return AdamW(params, lr=LR, weight_decay=0.1)


def make_optimizer_8bit(params):
    return AdamW8bit(params, lr=LR, weight_decay=0.1, min_8bit_size=0)  # 8-bit moments at every world size


def forward(model, x, call=None):
    for layer in model:
        x = call(layer, x) if call is not None else layer(x)
    return x


def batch(step, part, parts, rows=ROWS, micro=0):
    """Rows ``part`` of ``parts`` of micro-batch ``micro`` of step ``step``'s global batch of ``rows``
    rows (inputs, targets)."""
    rng = np.random.RandomState(step + 1000 * micro)
    x, y = rng.randn(rows, DIMS[0]).astype(np.float32), rng.randn(rows, DIMS[-1]).astype(np.float32)
    start, stop = part_bounds(rows, parts, part)
    return flame.tensor(x[start:stop]), flame.tensor(y[start:stop])


def micro_batches(step, sizes, rank, world, stage):
    """This rank's ``(inputs, targets, weight)`` of each micro-batch of step ``step`` (global row
    counts ``sizes``), as the trainer splits them; ``(None, None, 0)`` for a rank without rows (at the
    ``parameters`` stage, whose forward gathers with the other ranks, row 0 weighed 0)."""
    for micro, rows in enumerate(sizes):
        x, y = batch(step, rank, world, rows, micro)
        count = x.shape[0]
        if count == 0 and stage == "parameters":
            x, y = batch(step, 0, rows, rows, micro)
        yield (x, y, count / (rows * len(sizes))) if x.shape[0] else (None, None, 0.0)


def sharded(model, job):
    units = list(model) if job.get("units") == "layers" else None
    factory = make_optimizer_8bit if job.get("8bit") else make_optimizer
    return sharding.ShardedOptimizer(model.named_parameters(), job["stage"], factory, units=units,
                                     bucket_numel=job.get("bucket", 1 << 23),
                                     reduce_dtype=torch.bfloat16 if job.get("bf16_reduce") else torch.float32,
                                     overlap=job.get("overlap", True))


def weights(model, shards):
    with shards.gathered(model):
        return {name: p.to(flame.float32).clone().numpy() for name, p in model.named_parameters()}


@contextlib.contextmanager
def counting_reductions():
    """The reduce-scatters (and all-reduces) flame issues inside the block, counted into the list it yields."""
    calls, plain = [], distributed._collective

    def counted(what, fn):
        if what in ("reduce-scatter", "all-reduce"):
            calls.append(what)
        return plain(what, fn)

    distributed._collective = counted
    try:
        yield calls
    finally:
        distributed._collective = plain


def run_job(job, world):
    sharding._native_reduce_scatter = False if job.get("emulate") else None
    model = build_model()
    if job.get("bf16"):
        model = model.to(dtype=flame.bfloat16)
    shards = sharded(model, job)
    if job.get("resume"):
        shards.load(job["resume"])
    first, last = job["steps"]
    norms, launched, out = [], [], {}

    def loss_and_grads(x, y, leave_out_bias=False):
        if leave_out_bias:  # the last layer without its bias: that parameter gets no gradient
            loss = mse_loss(linear(forward(model[:-1], x, shards.run), model[-1].weight), y)
        else:
            loss = mse_loss(forward(model, x, shards.run), y)
        if job.get("nan") and world.rank == 1:
            loss = loss * float("nan")
        with counting_reductions() as calls:
            grads = loss.backward()
        shards.join()
        launched.append(len(calls))
        return grads

    step_fn = CapturedStep(loss_and_grads) if job.get("graph") else loss_and_grads
    for step in range(first, last + 1):
        for micro, (x, y, weight) in enumerate(micro_batches(step, job.get("sizes", [ROWS]), world.rank, world.size,
                                                             job["stage"])):
            if x is None:
                shards.pack(None, accumulate=micro > 0)
                continue
            shards.weigh(weight)
            try:
                shards.pack(step_fn(x, y, job.get("missing", False) and step == last), weight=weight,
                            accumulate=micro > 0)
            except RuntimeError as e:
                if not job.get("missing"):
                    raise
                out["error"] = np.array(str(e))
                return out
        norm = shards.step(max_norm=job.get("max_norm"))
        if norm is not None:
            norms.append(norm.item())
        if str(step) in job.get("save", {}):
            shards.save(job["save"][str(step)])
    out.update({f"w/{k}": v for k, v in weights(model, shards).items()})
    out["norms"] = np.array(norms, dtype=np.float64)
    out["launched"] = np.array(launched)
    out["memory"] = np.array([shards.memory()[k] for k in ("parameters", "master", "optimizer", "gradients")])
    return out


def rank_main(out_dir, jobs):
    """This process as one rank (torchrun's environment): the jobs, then its rank file."""
    world = distributed.init(timeout=120)
    results = {}
    for job in jobs:
        for key, value in run_job(job, world).items():
            results[f"{job['name']}/{key}"] = value
    np.savez(out_dir / f"rank-{world.rank}.npz", **results)
    distributed.shutdown()


def forked_rank(out_dir, world_size, rank, port, jobs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank_main(out_dir, jobs)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv):
    out_dir, phases = pathlib.Path(argv[0]), json.loads(argv[1])
    if "WORLD_SIZE" in os.environ:  # started by torchrun (GPUs: a CUDA context cannot be forked): one phase
        (phase,) = phases
        (out_dir / "phase-0").mkdir(parents=True, exist_ok=True)
        rank_main(out_dir / "phase-0", phase["jobs"])
        return 0
    torch.set_num_threads(1)  # no intra-op thread pool for the forked ranks to inherit
    run_job({"name": "warm", "stage": "gradients", "steps": [1, 1], "max_norm": 1.0}, distributed.world())
    fork = multiprocessing.get_context("fork")
    for i, phase in enumerate(phases):
        folder = out_dir / f"phase-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        ranks = [fork.Process(target=forked_rank, args=(folder, phase["world"], r, port, phase["jobs"]))
                 for r in range(phase["world"])]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join()
        failed = [r for r, p in enumerate(ranks) if p.exitcode != 0]
        if failed:
            print(f"phase {i} ({phase['world']} ranks): rank(s) {failed} failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
