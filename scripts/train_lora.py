#!/usr/bin/env python3
"""Train an SDXL LoRA from a YAML config: ``flame-train-lora`` without installing flame.

    python scripts/train_sdxl_lora.py configs/sdxl_lora_tiny.yaml            # synthetic demo, runs on a CPU
    python scripts/train_sdxl_lora.py configs/sdxl_lora.yaml model.path=/models/sdxl data.cache_dir=cache/mine
    python scripts/train_sdxl_lora.py configs/sdxl_lora.yaml ... --resume     # continue from the last checkpoint

Options and exit codes: ``python scripts/train_sdxl_lora.py --help``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flame.train.cli import main  # imports flame, which picks the backend before triton

if __name__ == "__main__":
    sys.exit(main())
