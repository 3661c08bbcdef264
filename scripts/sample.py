#!/usr/bin/env python3
"""SDXL images with flame: ``flame-sample`` without installing flame.

    python scripts/sample.py --model /models/stable-diffusion-xl-base-1.0 --prompt "a red fox in snow" \
        --lora out/my_lora.safetensors:0.8 --steps 30 --cfg 5 --seed 1 --out samples

Options: ``python scripts/sample.py --help``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flame.pipeline.cli import main  # imports flame, which picks the backend before triton

if __name__ == "__main__":
    sys.exit(main())
