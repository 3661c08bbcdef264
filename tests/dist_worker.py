"""One process of a data-parallel training test (tests/test_distributed.py), started N times with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or by torchrun.

    python tests/dist_worker.py CONFIG.yaml OUT_DIR [--cli] [--kill RANK:STEP] [--interrupt RANK:STEP] [overrides]

Trains the stand-in UNet (tests/standin.py) with the config, directly or through flame's CLI
(``--cli``; the CLI's UNet is replaced by the stand-in), and writes what this rank ended with to
OUT_DIR/rank-R.npz: its LoRA weights (train.mode full: every weight, gathered at train.shard
parameters), the losses it read and the exit status it returns.
``--kill R:S``: rank R ends itself with SIGKILL right after step S (a lost process);
``--interrupt R:S``: rank R sends itself SIGINT after step S (Ctrl-C reaching one process).
"""
import contextlib
import os
import pathlib
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import flame  # noqa: E402 - first: it picks the backend
from flame import distributed  # noqa: E402
from flame.train import cli, trainer  # noqa: E402
from flame.train.config import load_config  # noqa: E402
from flame.train.families import sdxl  # noqa: E402
from tests.standin import StandInUNet  # noqa: E402


def _rank_step(spec):
    rank, step = spec.split(":")
    return int(rank), int(step)


def main(argv):
    config, out = argv[0], pathlib.Path(argv[1])
    rest = argv[2:]
    use_cli = "--cli" in rest
    hooks = {}
    for flag, sig in (("--kill", signal.SIGKILL), ("--interrupt", signal.SIGINT)):
        if flag in rest:
            i = rest.index(flag)
            hooks[_rank_step(rest[i + 1])] = sig
            del rest[i:i + 2]
    overrides = [a for a in rest if a != "--cli"]
    rank = int(os.environ.get("RANK", "0"))
    ran = {}

    real_step, real_init = trainer.Trainer.train_step, trainer.Trainer.__init__

    def train_step(self):
        real_step(self)
        sig = hooks.get((rank, self.step))
        if sig is not None:
            os.kill(os.getpid(), sig)

    def init(self, cfg, model=None, **kw):
        ran["trainer"] = self
        real_init(self, cfg, model=model, **kw)

    trainer.Trainer.train_step, trainer.Trainer.__init__ = train_step, init
    if use_cli:
        sdxl.SDXLFamily.build = lambda self, path, config, dtype: StandInUNet(sdxl.unet_config(config))
        status = cli.main([config, "--no-progress", *overrides])
    else:
        cfg = load_config(config, overrides)
        flame.manual_seed(cfg.train.seed)
        try:
            trainer.Trainer(cfg, model=StandInUNet(), progress=False).train()
            status = 0
        except trainer.TrainingStopped as e:
            status = 128 + e.signum if e.signum else 1
        except trainer.TrainingError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
    t = ran.get("trainer")
    if t is not None and hasattr(t, "model"):
        full = t.cfg.train.mode != "lora"
        shards = getattr(getattr(t, "trained", None), "shards", None) if t.cfg.train.shard == "parameters" else None
        with shards.gathered(t.model) if shards is not None else contextlib.nullcontext():
            weights = {k: v.clone().to(flame.float32).numpy() for k, v in t.model.state_dict().items()
                       if full or "lora" in k}
        losses = np.array([t.run.losses[s] for s in sorted(t.run.losses)], dtype=np.float64)
        np.savez(out / f"rank-{rank}.npz", status=status, losses=losses, steps=np.array(sorted(t.run.losses)),
                 **{f"w/{k}": v for k, v in weights.items()})
    if use_cli:  # torchrun stops every process once one ends with a failure: leave together
        distributed.barrier()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
