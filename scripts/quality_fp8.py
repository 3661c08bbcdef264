#!/usr/bin/env python3
"""fp8 base weights against full precision: one LoRA run twice, the frozen model's Linear weights in
``train.precision`` and then in fp8 (``model.weight_dtype: fp8_e4m3``), same seed, data and steps; the
validation losses side by side (issue 49's target: the fp8 run within 1% of the other).

    python scripts/quality_fp8.py configs/flux_lora_tiny.yaml --steps 40        # tiny, on a CPU: minutes
    python scripts/quality_fp8.py configs/sdxl_lora_tiny.yaml --steps 40 data.synthetic_latent_sizes=[[4,4]]
    python scripts/quality_fp8.py configs/flux_lora.yaml --steps 200 model.path=... data.cache_dir=...   # a GPU

Any ``section.key=value`` after the config overrides it (as ``flame-train-lora``'s). Each run writes
into its own folder under ``--out``; the cache is shared (built once by the first run when the config
asks for a synthetic one).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: F401  (first: imports flame, which selects the backend)

from flame.train import Trainer
from flame.train.config import load_config

TOLERANCE = 0.01  # the target: the fp8 run's validation loss within 1% of full precision's


def run(config, overrides, out, steps, weight_dtype):
    """The validation loss after ``steps`` steps of ``config`` with the frozen weights in ``weight_dtype``
    (None: ``train.precision``)."""
    settings = [*overrides, f"output.dir={out}", f"train.steps={steps}", "train.epochs=null",
                f"output.validate_every={steps}", "output.save_every=0", "output.overwrite=true",
                f"model.weight_dtype={weight_dtype or 'null'}"]
    result = Trainer(load_config(config, settings), progress=False, log=lambda *a: None).train()
    if steps not in result["val_losses"]:
        raise SystemExit(f"{config}: no validation loss at step {steps}: the cache needs a validation split "
                         "(data.val_samples, or a synthetic cache)")
    return result["val_losses"][steps], result["losses"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a training config (YAML)")
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--out", type=Path, help="folder of the two runs (default: a temporary one)")
    args, overrides = p.parse_known_args(argv)
    if any(not o.count("=") for o in overrides):
        p.error(f"overrides are section.key=value, got {' '.join(overrides)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="flame-fp8-quality-"))
    cache = [o for o in overrides if o.startswith("data.cache_dir=")] or [f"data.cache_dir={out / 'cache'}"]
    overrides = [o for o in overrides if not o.startswith("data.cache_dir=")] + cache
    rows = {wd: run(args.config, overrides, out / (wd or "full"), args.steps, wd) for wd in (None, "fp8_e4m3")}
    (full, full_losses), (fp8, fp8_losses) = rows[None], rows["fp8_e4m3"]
    rel = fp8 / full - 1
    print(f"{args.config}, {args.steps} steps: validation loss full precision {full:.5f}, fp8 base {fp8:.5f} "
          f"({rel:+.2%}); training losses' mean {sum(full_losses) / len(full_losses):.5f} / "
          f"{sum(fp8_losses) / len(fp8_losses):.5f}; within {TOLERANCE:.0%}: "
          f"{'yes' if abs(rel) <= TOLERANCE else 'no'}")
    return 0 if abs(rel) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
