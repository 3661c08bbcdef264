"""The LoRA trainer (SDXL, Flux.1): config (``load_config``), run (``Trainer``, ``train``), checkpoints and CLI."""
from .checkpoints import latest_checkpoint, list_checkpoints, save_checkpoint
from .config import SCHEMA, ConfigError, build_config, load_config, to_dict
from .families.sdxl import build_unet, unet_config
from .trainer import PRECISIONS, Trainer, TrainingStopped, train
