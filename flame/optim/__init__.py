"""Fused multi-tensor optimizers, learning-rate schedulers and gradient clipping."""
from . import lr_scheduler
from .clip import clip_grad_norm_
from .optimizers import SGD, Adam, AdamW, Optimizer
