"""Fused multi-tensor optimizers, learning-rate schedulers, gradient clipping and moving averages."""
from . import lr_scheduler
from .adafactor import Adafactor
from .clip import clip_grad_norm_
from .ema import EMA
from .optimizers import SGD, Adam, AdamW, AdamW8bit, Lion, Optimizer, Prodigy
