"""A run's checkpoints and resuming from one, on ``checkpoints.py``'s atomic folders.

``Checkpoints`` is output.dir/checkpoints: the checkpoint to resume from (``find``: ``resume``'s
path or the latest complete one, its trainer_state.json read, its settings checked against this
run's: ``RESUME_FIXED`` may not change, other changes are warned about), a fresh start's refusal to
mix with an earlier run (``check_fresh_start``), writing one (``write``) and the ``TrainingError``
of any failed write of the run (``write_error``). What a checkpoint holds besides the trained
weights is split and joined here: the optimizer's tensors and step counts
(``optimizer_tensors``, ``restore_optimizer``), the lr schedule (``restore_schedule``), the moving
average (``restore_ema``) and the loader's position (``resume_loader``); ``Trainer.save`` and
``Trainer.load`` put them together.
"""
from __future__ import annotations

import errno
import json
import os
import shutil

from .. import distributed
from ..io import load_safetensors
from .checkpoints import checkpoint_path, latest_checkpoint, list_checkpoints, prune_checkpoints, save_checkpoint
from .config import ConfigError, to_dict
from .stops import TrainingError

# settings a resumed run must share with its checkpoint: what trains, the adapters' shapes, the master
# weights and the data order the loader's saved position counts in (any other change is allowed, with a
# warning; train.shard may change between its stages, a checkpoint's shards being re-sliced)
RESUME_FIXED = ("model.family", "train.mode", "train.master_weights", "lora.rank", "lora.targets",
                "lora.conv_targets", "lora.conv_rank", "lora.dora",
                "lora.text_encoder", "lora.text_encoder_targets", "lora.text_encoder_rank",
                "data.batch_size", "data.drop_last", "data.datasets", "train.seed", "train.optimizer")


class Checkpoints:
    """The checkpoints under ``root`` (output.dir/checkpoints), the newest ``keep_last`` kept;
    ``log``: where warnings go."""

    def __init__(self, root, keep_last, log):
        self.root, self.keep_last, self.log = root, keep_last, log

    def path(self, step: int) -> str:
        return checkpoint_path(self.root, step)

    def find(self, cfg):
        """The checkpoint to resume from, as ``(path, trainer state)``, or None (a fresh start)."""
        spec = cfg.resume
        if not spec:
            return None
        if spec == "latest":
            path = latest_checkpoint(self.root)
            if path is None:
                self.log(f"no complete checkpoint in {self.root}: starting from step 0")
                return None
        else:
            path = spec
            if not os.path.isfile(os.path.join(path, "COMPLETE")):
                done = [p for _, p in list_checkpoints(self.root)]
                raise ConfigError(f"resume: {path} is not a complete checkpoint (no COMPLETE marker); complete "
                                  f"ones: {done or 'none'}")
        state_file = os.path.join(path, "trainer_state.json")
        try:
            with open(state_file) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"resume: cannot read {state_file} ({e}); resume from an earlier checkpoint "
                              f"({[p for _, p in list_checkpoints(self.root)]})") from None
        check_resumable(cfg, path, state.get("config", {}), self.log)
        return path, state

    def check_fresh_start(self, cfg, out_dir) -> None:
        old = list_checkpoints(self.root)
        if old and not cfg.output.overwrite:
            raise ConfigError(f"{out_dir} holds checkpoints of an earlier run (steps {[s for s, _ in old]}): "
                              "continue it with --resume (resume=latest), or pick another output.dir, or set "
                              "output.overwrite=true to replace it")

    def clear(self) -> None:
        """A run from step 0 does not mix with an earlier run's checkpoints (output.overwrite)."""
        if os.path.isdir(self.root):
            shutil.rmtree(self.root)

    def write(self, step: int, writers: dict, shards=None) -> str:
        """The checkpoint of ``step`` (``save_checkpoint``'s ``writers``), whole even when a peer is lost
        meanwhile; a failed write is a ``TrainingError``. ``shards``: a ``ShardedOptimizer`` whose
        ``save`` writes it instead, every rank its shard and rank 0 the ``writers`` (collective)."""
        try:
            with distributed.hold_exit():  # a peer lost meanwhile does not cut this checkpoint short
                if shards is None:
                    return save_checkpoint(self.root, step, writers, self.keep_last)
                folder = shards.save(self.path(step), writers)
                if distributed.world().is_main:
                    prune_checkpoints(self.root, self.keep_last)
                return folder
        except OSError as e:
            raise self.write_error(e, f"the checkpoint of step {step}", self.root) from e

    def _kept(self) -> str:
        kept = latest_checkpoint(self.root)
        return f"the newest complete checkpoint is {kept}" if kept else "no checkpoint was written yet"

    def write_error(self, e, what, where) -> TrainingError:
        """A ``TrainingError`` for an OSError while writing ``what`` to ``where``: what failed, what is
        kept, what to do."""
        cause = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            todo = (f"free space on the disk holding {where} (or lower output.keep_last), then continue with "
                    "--resume")
        else:
            todo = "fix that, then continue with --resume"
        return TrainingError(f"writing {what} to {where} failed: {cause}. Nothing half-written was kept; "
                             f"{self._kept()}. To go on: {todo}")

    def peer_lost(self, e) -> TrainingError:
        """The ``TrainingError`` of a lost process (``distributed.PeerLostError`` ``e``)."""
        kept = latest_checkpoint(self.root)
        return TrainingError(f"{e}. Nothing half-written was kept; "
                             + (f"the newest complete checkpoint is {kept}" if kept else "no checkpoint was written")
                             + ": continue with --resume once every process can run")


def check_resumable(cfg, path, saved: dict, log) -> None:
    """Settings that change tensor shapes or the data order are errors; other changes are warned about."""
    changed = {}
    for section, opts in to_dict(cfg).items():
        if section == "resume" or not isinstance(opts, dict):
            continue
        for key, value in opts.items():
            old = saved.get(section, {}).get(key, value)
            if old != value:
                changed[f"{section}.{key}"] = (old, value)
    fixed = [f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in RESUME_FIXED if k in changed]
    if fixed:
        raise ConfigError(f"resume: {path} was trained with other settings that cannot change within a run: "
                          f"{', '.join(fixed)}. Set them back, or start a new run in another output.dir")
    if changed:
        log("warning: resuming with different settings than the checkpoint: "
            + ", ".join(f"{k} {o!r} -> {n!r}" for k, (o, n) in changed.items()))


def resume_loader(loader, path, state: dict, world_size: int, batch_size: int, log) -> None:
    """The loader continues where the checkpoint's run stopped (at the same fraction of the epoch
    when that run had another number of processes, with a warning)."""
    saved = int(state.get("world_size", 1))
    if saved != world_size:
        was = f"{saved} process{'es' if saved > 1 else ''}"
        log(f"warning: {path} was trained by {was}, this run has {world_size}: the global batch changes from "
            f"{saved * batch_size} to {world_size * batch_size} samples, the data order goes on at the same point of "
            "the epoch in the new batches, and each process's random stream is derived anew from its rank; the steps "
            f"from here are not the ones {was} would take")
    try:
        loader.load_state_dict(state["loader"])  # the position resuming continues from
    except ValueError as e:
        raise ConfigError(f"resume: {path} does not fit the cache at {loader.cache.path}: {e}") from None


def optimizer_tensors(opt: dict) -> dict:
    """The tensors of the optimizer state dict ``opt``, as optimizer.safetensors holds them ("i.name")."""
    return {f"{i}.{k}": v for i, entry in opt["state"].items() for k, v in entry.items() if k != "step"}


def optimizer_state(opt: dict) -> dict:
    """The JSON part of the optimizer state dict ``opt``: its groups and each parameter's step count."""
    return {"param_groups": opt["param_groups"], "steps": {str(i): e["step"] for i, e in opt["state"].items()}}


def restore_optimizer(optimizer, path, state: dict) -> None:
    """The optimizer state of the checkpoint at ``path`` (``state``: its trainer_state.json) into ``optimizer``."""
    tensors = load_safetensors(os.path.join(path, "optimizer.safetensors"))
    opt = state["optimizer"]
    if len(opt["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError(f"resume: {path} holds {len(opt['param_groups'])} optimizer groups, this run makes "
                          f"{len(optimizer.param_groups)} (one per UNet part and adapter side since lora.lr_* "
                          "and lora.plus_ratio); resume it with the flame release that wrote it")
    entries = {int(i): {"step": s} for i, s in opt["steps"].items()}
    for key, value in tensors.items():
        i, name = key.split(".", 1)
        entries[int(i)][name] = value
    optimizer.load_state_dict({"state": entries, "param_groups": opt["param_groups"]})


def restore_schedule(scheduler, saved: dict) -> None:
    """The schedule is a closed form of the step: keep the saved step, take lr / warm-up / length from
    this config, and re-apply this step's lr to the optimizer."""
    current = scheduler.state_dict()
    keep = ("base_lrs", "num_warmup_steps", "num_training_steps")
    scheduler.load_state_dict({**saved, **{k: current[k] for k in keep}})
    scheduler.last_epoch -= 1
    scheduler.step()


def restore_ema(ema, path, state: dict, log) -> None:
    """The moving average of the checkpoint at ``path``, or (none saved) a warning that it starts anew."""
    ema_file = os.path.join(path, "ema.safetensors")
    if state.get("ema") and os.path.isfile(ema_file):
        shadow = load_safetensors(ema_file)
        ema.load_state_dict({"updates": state["ema"]["updates"],
                             "shadow": [shadow[str(i)] for i in range(len(shadow))]})
    else:
        log(f"ema.decay: {path} holds no moving average; it starts from the weights of step {state['step']}")
