"""Trainer configuration: a YAML file plus ``section.key=value`` overrides, checked against a schema.

Every option, its default and what it means are in ``SCHEMA`` below (and in
``configs/sdxl_lora.yaml``). ``load_config(path, overrides)`` reads the file, applies the overrides
(values parsed as YAML: ``train.lr=2e-4``, ``lora.targets=[to_q,to_v]``, ``model.path=null``), fills
in the defaults and validates everything at once: unknown keys (with the nearest known name),
wrong types and out-of-range values are all reported in one ``ConfigError``.
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import yaml

from ..data import BUCKET_UNIT, CacheSettings, DatasetError
from ..data.images import caption_extension
from ..diffusion import TIMESTEP_DISTRIBUTIONS, WEIGHTING_SCHEMES
from ..diffusion.losses import HUBER_SCHEDULES, LOSS_TYPES
from ..diffusion.samplers import FLOW_SAMPLERS, SAMPLERS
from ..models.sdxl_unet import CHECKPOINT_SCOPES
from ..nn.lora import target_pattern_error
from ..optim.lr_scheduler import SCHEDULE_NAMES
from . import families
from .errors import ConfigError
from .outputs import TRACKERS

REQUIRED = object()


@dataclass(frozen=True)
class Opt:
    default: object
    kind: str  # int, float, bool, str, path, filename, choice, names (a list of choices), targets, sizes, prompts
    help: str
    choices: tuple = ()
    low: float | None = None  # inclusive lower bound for numbers
    high: float | None = None  # exclusive upper bound
    nullable: bool = False


SCHEMA = {
    "model": {
        "path": Opt(None, "path", "diffusers unet/ or pipeline folder, or one .safetensors file (diffusers or "
                                  "LDM/SGM names); null: random init from model.config", nullable=True),
        "config": Opt("sdxl", "str", "architecture: tiny, sdxl (SDXL), tiny, flux-dev, flux-schnell (Flux.1), or a "
                                     "diffusers UNet / Flux transformer config.json (used for random init and for "
                                     "single-file checkpoints; a Flux checkpoint left at the default brings its "
                                     "own, from config.json or its tensor shapes)"),
        "family": Opt("auto", "choice", "model family: sdxl (DDPM noise prediction) or flux (rectified flow); auto: "
                                        "from model.path (its model_index.json, config.json or tensor names), else "
                                        "from model.config (tiny is SDXL's unless family is flux)",
                      choices=("auto", "sdxl", "flux")),
        "weight_dtype": Opt(None, "choice", "storage of the frozen model's Linear weights: null (train.precision's "
                                            "dtype) or fp8_e4m3 (e4m3 codes with one fp32 scale per output channel: "
                                            "half of bf16's memory, read inside the GEMMs forward and backward; LoRA, "
                                            "norms, biases and the embedders keep their dtypes)",
                            choices=("fp8_e4m3",), nullable=True),
        "fp8_gemm": Opt("auto", "choice", "with fp8 weights: auto (weight-only fp8: the activations stay in "
                                          "train.precision's dtype) or w8a8 (each fp8 Linear's input is rounded "
                                          "to e4m3 per token in the forward and the product runs on the fp8 tensor "
                                          "cores: Hopper GPUs, 1.6-1.7x the bf16 GEMM's speed, about 10x the "
                                          "output rounding of weight-only fp8; elsewhere emulated, slower; the "
                                          "backward stays weight-only)", choices=("auto", "w8a8")),
    },
    "data": {
        "images": Opt(None, "path", "folder of images (searched recursively) with captions in .txt files (see "
                                    "data.caption_extension) or metadata.jsonl; kohya's subfolders N_name train N "
                                    "times per epoch. The run encodes them into a latent cache (data.cache_dir, else "
                                    "output.dir/cache) with the text encoders and VAE of sample.model or model.path, "
                                    "and later runs re-encode only new or changed images; or set data.cache_dir or "
                                    "data.datasets", nullable=True),
        "cache_dir": Opt(None, "path", "latent cache folder (scripts/prepare_cache.py), or where data.images is "
                                       "cached; or set data.datasets", nullable=True),
        "datasets": Opt(None, "datasets", "several datasets in one run: a list of {images (a folder, as data.images) "
                                          "or cache_dir (a latent cache; with images: where it is cached, else "
                                          "output.dir/cache/NAME), repeats (null: 1, or kohya's folder counts; a "
                                          "number replaces them), loss_weight (1.0), is_reg (false: a regularization "
                                          "set, weighted by data.prior_loss_weight), caption_extension and resolution "
                                          "(null: data's)}; instead of data.images / data.cache_dir", nullable=True),
        "resolution": Opt(1024, "int", "data.images: aspect buckets hold about resolution^2 pixels (a multiple of "
                                       "data.bucket_step)", low=64),
        "bucket_min_side": Opt(None, "int", "data.images: smallest bucket side in pixels; null: resolution / 2",
                               low=1, nullable=True),
        "bucket_max_side": Opt(None, "int", "data.images: largest bucket side in pixels; null: 2 * resolution", low=1,
                               nullable=True),
        "bucket_step": Opt(None, "int", "data.images: bucket sides are multiples of this many pixels; null: 64 for "
                                        "SDXL, 16 for Flux", low=1, nullable=True),
        "random_crop": Opt(False, "bool", "data.images: crop each image to its bucket at a random offset (drawn once, "
                                          "when it is cached) instead of the centre"),
        "caption_extension": Opt(".txt", "str", "data.images: caption files beside the images (cat.png -> cat.txt; "
                                                "kohya's .caption)"),
        "require_captions": Opt(False, "bool", "data.images: an image without a caption is an error (otherwise a "
                                               "warning, and it trains on the empty caption)"),
        "bad_images": Opt("skip", "choice", "data.images: images that Pillow cannot read are skipped with a warning, "
                                            "or an error", choices=("skip", "error")),
        "val_fraction": Opt(0.05, "float", "data.images: share of each image folder held out for the validation loss "
                                           "when output.validate_every is set (at least one image of two or more)",
                            low=0.0, high=1.0),
        "prior_loss_weight": Opt(1.0, "float", "loss weight of the regularization datasets (is_reg; kohya's "
                                               "--prior_loss_weight)", low=0.0),
        "batch_size": Opt(1, "int", "samples per micro-batch and process (all from one aspect bucket; under "
                                    "torchrun each of the N processes takes this many of a global batch of N times "
                                    "as many)", low=1),
        "drop_last": Opt(False, "bool", "drop each bucket's last partial batch (fixed batch shapes)"),
        "flip": Opt(False, "bool", "flip augmentation: each sample trains on its mirrored image half of the epochs "
                                   "(the cache must hold them: prepare_cache.py --flip; kohya's --flip_aug)"),
        "caption_variants": Opt(False, "bool", "train each sample with one of the cache's caption variants per "
                                               "epoch (prepare_cache.py --caption-variants K, e.g. shuffled tags)"),
        "caption_dropout": Opt(0.0, "float", "probability that a sample trains on the empty caption's embedding "
                                             "(stored in the cache by prepare_cache.py) instead of its own", low=0.0,
                               high=1.0),
        "synthetic_samples": Opt(0, "int", "if > 0 and cache_dir holds no cache, write a synthetic cache of this "
                                           "many samples first (demos, tests)", low=0),
        "synthetic_latent_sizes": Opt(None, "sizes", "latent (h, w) buckets of that synthetic cache, e.g. "
                                                     "[[8, 8], [8, 12]] (default: the model's sample size)",
                                      nullable=True),
    },
    "lora": {
        "rank": Opt(16, "int", "adapter rank", low=1),
        "alpha": Opt(None, "float", "scale numerator (scale = alpha / rank); null: alpha = rank", low=0.0,
                     nullable=True),
        "targets": Opt("attn", "targets", "attn (560 SDXL layers), attn-mlp (722), or a list of module-name "
                                          "suffixes / regular expressions"),
        "init": Opt("kaiming", "choice", "A's init (B starts at zero)", choices=("kaiming", "gaussian")),
        "dropout": Opt(0.0, "float", "dropout on the adapter input", low=0.0, high=1.0),
        "dora": Opt(False, "bool", "DoRA (PEFT's use_dora; LyCORIS's dora_wd): each adapted layer, Linear or Conv2d "
                                   "(lora.conv_targets), also trains a magnitude per output channel"),
        "format": Opt("peft", "choice", "LoRA file format: peft (diffusers) or kohya", choices=("peft", "kohya")),
        "init_from": Opt(None, "path", "start from this LoRA file (PEFT or kohya; its layers must be among the "
                                       "targets, with lora.rank) instead of a fresh init", nullable=True),
        "conv_targets": Opt(None, "targets", "LoCon: Conv2d layers that get adapters too: locon (the resnets' "
                                             "convolutions and the down/upsamplers', as kohya's LoCon), resnets, or "
                                             "module-name suffixes / regular expressions; null: none",
                            nullable=True),
        "conv_rank": Opt(None, "int", "rank of the conv adapters (kohya's conv_dim); null: lora.rank", low=1,
                         nullable=True),
        "conv_alpha": Opt(None, "float", "alpha of the conv adapters; null: conv_rank", low=0.0, nullable=True),
        "lr_down": Opt(1.0, "float", "learning-rate multiplier of the adapters in the UNet's down blocks (0: frozen)",
                       low=0.0),
        "lr_mid": Opt(1.0, "float", "learning-rate multiplier of the adapters in the mid block", low=0.0),
        "lr_up": Opt(1.0, "float", "learning-rate multiplier of the adapters in the up blocks", low=0.0),
        "plus_ratio": Opt(1.0, "float", "LoRA+: B's learning rate is this times A's (16 in the LoRA+ paper; 1: "
                                        "plain LoRA)", low=0.0),
        "text_encoder": Opt(False, "bool", "SDXL: train adapters on both text encoders too (CLIP-L and OpenCLIP "
                                           "bigG of model.path, a pipeline folder, or a single file with "
                                           "sample.tokenizers): each step encodes its captions (the cache's) "
                                           "instead of reading their cached embeddings; the LoRA file holds them "
                                           "as diffusers' text_encoder. / text_encoder_2. (kohya: lora_te1_ / "
                                           "lora_te2_)"),
        "text_encoder_lr": Opt(None, "float", "lora.text_encoder: learning rate of the text encoders' adapters "
                                              "(kohya's --text_encoder_lr, often below the UNet's); null: train.lr",
                               low=0.0, nullable=True),
        "text_encoder_targets": Opt("attn-mlp", "targets", "lora.text_encoder: the encoders' layers: attn-mlp (each "
                                                           "layer's q/k/v/out projections and fc1/fc2, as kohya), "
                                                           "attn, or module-name suffixes / regular expressions "
                                                           "(names look like text_model.encoder.layers.0.mlp.fc1)"),
        "text_encoder_rank": Opt(None, "int", "lora.text_encoder: rank of the text encoders' adapters; null: "
                                              "lora.rank", low=1, nullable=True),
        "text_encoder_alpha": Opt(None, "float", "lora.text_encoder: alpha of the text encoders' adapters; null: "
                                                 "lora.alpha (null there: the rank)", low=0.0, nullable=True),
    },
    "train": {
        "mode": Opt("lora", "mode", "what trains: lora (adapters on lora.targets, the lora section's settings), "
                                    "full (every weight of the UNet / transformer: a full fine-tune), or a list of "
                                    "regular expressions over the model's parameter names: the weights one of them "
                                    "matches (re.search) train, the rest stay frozen (e.g. [attn1, attn2]; SDXL's "
                                    "names are diffusers', Flux's BFL's: double_blocks.0.img_attn.qkv.weight)",
                    choices=("lora", "full")),
        "shard": Opt("none", "choice", "train.mode full under torchrun, ZeRO-style: optimizer (each of the N "
                                       "processes keeps 1/N of the fp32 master weights and optimizer state), "
                                       "gradients (also 1/N of the fp32 gradients, reduce-scattered per block), "
                                       "parameters (also the weights themselves, gathered block by block for the "
                                       "forward and again for the backward; 2 or more processes); none: every "
                                       "process keeps everything",
                     choices=("none", "optimizer", "gradients", "parameters")),
        "shard_reduce_dtype": Opt("fp32", "choice", "train.shard gradients or parameters: the dtype the gradients "
                                                    "are reduce-scattered in: fp32, or bf16 (half the traffic between "
                                                    "the GPUs; each process's gradients and their sum rounded to bf16 "
                                                    "before the fp32 update, as FSDP's reduce_dtype)",
                                  choices=("fp32", "bf16")),
        "shard_overlap": Opt(True, "bool", "train.shard gradients or parameters: reduce-scatter each block's "
                                           "gradients from inside the backward as soon as they are complete "
                                           "(overlapping the rest of it), or all after the backward (false)"),
        "master_weights": Opt("fp32", "choice", "train.mode full with bf16/fp16 weights: fp32 (an fp32 copy of the "
                                                "trained weights that the optimizer updates, cast to train.precision "
                                                "after each step: 4 bytes per weight) or bf16_stochastic (the bf16 "
                                                "weights updated directly, each update rounded stochastically: no "
                                                "copy; train.shard none)", choices=("fp32", "bf16_stochastic")),
        "steps": Opt(None, "int", "optimizer steps (or set train.epochs)", low=1, nullable=True),
        "epochs": Opt(None, "int", "passes over the training split (or set train.steps)", low=1, nullable=True),
        "lr": Opt(1e-4, "float", "peak learning rate", low=0.0),
        "lr_scheduler": Opt("constant", "choice", "learning-rate schedule (diffusers' names)",
                            choices=SCHEDULE_NAMES),
        "lr_num_cycles": Opt(1, "int", "cosine_with_restarts: cosine cycles (each restarting at the peak lr)", low=1),
        "lr_power": Opt(1.0, "float", "polynomial: the decay's power (1: linear to 1e-7)", low=0.0),
        "warmup_steps": Opt(0, "int", "linear warm-up steps", low=0),
        "grad_accum": Opt(1, "int", "micro-batches per optimizer step", low=1),
        "precision": Opt("bf16", "choice", "compute dtype of the model and the dtype of its weights (fp16 adds the "
                                           "dynamic loss scaler; LoRA weights are always fp32)",
                         choices=("bf16", "fp16", "fp32")),
        "gradient_checkpointing": Opt(False, "bool", "recompute activations in the backward instead of keeping them "
                                                     "(train.checkpoint_scope says which)"),
        "checkpoint_scope": Opt("blocks", "choice", "gradient_checkpointing's scope: blocks (each resnet and "
                                                    "transformer block: the least memory, a second forward) or "
                                                    "feed_forward (each transformer block's GEGLU projection: the "
                                                    "largest activation, for one GEMM per block)",
                                choices=CHECKPOINT_SCOPES),
        "checkpoint_blocks": Opt(None, "int", "gradient_checkpointing: how many of the scope's blocks recompute, "
                                              "spread over the model (each saves its activations for a second "
                                              "forward of it); null: all", low=0, nullable=True),
        "offload": Opt("none", "choice", "blocks: the frozen weights of some transformer blocks (Flux) or resnet "
                                         "and transformer blocks (SDXL) live in pinned host memory and are copied "
                                         "to the GPU one block ahead of use, forward and backward (train."
                                         "offload_blocks or offload_budget_gb say how many); none: all on the GPU",
                       choices=("none", "blocks")),
        "offload_blocks": Opt(None, "int", "offload: blocks: how many blocks stream, spread over the model; null: "
                                           "all, or as many as train.offload_budget_gb needs", low=1, nullable=True),
        "offload_budget_gb": Opt(None, "float", "offload: blocks: the GiB the frozen weights may take on the GPU "
                                                "(resident ones and the two copy slots); the fewest blocks that fit "
                                                "stream. Activations and optimizer state come on top",
                                 low=0.0, nullable=True),
        "memory_budget_gb": Opt(None, "float", "GiB the run may take on the GPU (the card's free memory): the "
                                               "trainer picks fp8 base weights (unless model.weight_dtype is set), "
                                               "how many blocks to checkpoint and to stream, in that order, says "
                                               "what it chose, and refuses when nothing fits; null: as configured",
                                low=0.0, nullable=True),
        "max_grad_norm": Opt(1.0, "float", "clip the trained gradients' global norm; 0 or null: no clipping",
                             low=0.0, nullable=True),
        "seed": Opt(0, "int", "seed of model init, LoRA init, noise, timesteps and data order"),
        "optimizer": Opt("adamw", "choice", "adamw; adamw8bit (bitsandbytes' 8-bit moments: a quarter of the state "
                                            "memory); lion (Chen et al. 2023: a learning rate 3-10x lower and a weight "
                                            "decay as many times higher); prodigy (estimates its own step size: "
                                            "train.lr 1.0); adafactor (factored second moments, with train.lr); "
                                            "sgd (with train.sgd_momentum)",
                         choices=("adamw", "adamw8bit", "lion", "prodigy", "adafactor", "sgd")),
        "weight_decay": Opt(1e-2, "float", "decoupled weight decay", low=0.0),
        "adam_beta1": Opt(0.9, "float", "AdamW / AdamW8bit / Prodigy beta1", low=0.0, high=1.0),
        "adam_beta2": Opt(0.999, "float", "AdamW / AdamW8bit / Prodigy beta2", low=0.0, high=1.0),
        "adam_eps": Opt(1e-8, "float", "AdamW / AdamW8bit / Prodigy epsilon", low=0.0),
        "prodigy_d0": Opt(1e-6, "float", "Prodigy: the initial step-size estimate", low=0.0),
        "prodigy_d_coef": Opt(1.0, "float", "Prodigy: multiplier of the estimate (0.5-2 work; its main knob)",
                              low=0.0),
        "prodigy_growth_rate": Opt(None, "float", "Prodigy: largest factor the estimate grows by per step (e.g. "
                                                  "1.02, a warm-up); null: unbounded", low=1.0, nullable=True),
        "prodigy_bias_correction": Opt(False, "bool", "Prodigy: Adam's bias correction of the step"),
        "prodigy_safeguard_warmup": Opt(False, "bool", "Prodigy: leave the lr out of the estimate's denominator "
                                                       "(steadier with a warm-up)"),
        "lion_beta1": Opt(0.9, "float", "Lion: weight of the momentum in the update's sign", low=0.0, high=1.0),
        "lion_beta2": Opt(0.99, "float", "Lion: decay of the momentum", low=0.0, high=1.0),
        "sgd_momentum": Opt(0.9, "float", "SGD: momentum (0: plain SGD)", low=0.0, high=1.0),
        "cuda_graph": Opt(True, "bool", "replay each bucket's forward+backward from a CUDA graph (GPU only; "
                                        "off when lora.dropout > 0, whose masks must change every step)"),
        "compile_ahead": Opt("auto", "str", "compile kernels in parallel processes while the model loads: auto "
                                            "(configs/kernels' list for this GPU and Triton when the model is SDXL's "
                                            "or Flux.1's architecture, plus the kernels earlier runs on this "
                                            "machine recorded), off, or a file recorded with FLAME_RECORD_KERNELS "
                                            "(GPU only)"),
    },
    "diffusion": {
        "prediction_type": Opt("epsilon", "choice", "what the UNet predicts (SDXL base: epsilon; Flux always "
                                                    "predicts the flow's velocity, noise - latents)",
                               choices=("epsilon", "v_prediction")),
        "noise_offset": Opt(0.0, "float", "noise += offset * randn(B, C, 1, 1); 0: off", low=0.0),
        "min_snr_gamma": Opt(None, "float", "min-SNR-gamma loss weighting (5 is usual); null: off", low=0.0,
                             nullable=True),
        "timestep_min": Opt(0, "int", "timesteps are drawn uniformly from [timestep_min, timestep_max)", low=0),
        "timestep_max": Opt(1000, "int", "exclusive upper bound of the timesteps", low=1, high=1001),
        "timestep_sampling": Opt("uniform", "choice", "how timesteps are drawn in [timestep_min, timestep_max): "
                                                      "uniform, or logit_normal (sigmoid of a normal, as SD3)",
                                 choices=TIMESTEP_DISTRIBUTIONS),
        "logit_mean": Opt(0.0, "float", "logit_normal: mean of the normal"),
        "logit_std": Opt(1.0, "float", "logit_normal: standard deviation of the normal", low=0.0),
        "timestep_shift": Opt(1.0, "float", "shift the drawn fraction u to shift*u / (1 + (shift-1)*u): above 1 "
                                            "trains more on high noise, below 1 on detail", low=1e-6),
        "resolution_shift": Opt(False, "bool", "Flux: shift each batch's noise levels by e^mu, mu linear in its "
                                               "image tokens from 0.5 (256 tokens) to 1.15 (4096: 1024x1024), as "
                                               "Flux samples (kohya's --timestep_sampling flux_shift); replaces "
                                               "timestep_shift"),
        "weighting_scheme": Opt("none", "choice", "Flux: SD3's per-sample loss weighting of the noise level s: none, "
                                                  "sigma_sqrt (1/s^2) or cosmap", choices=WEIGHTING_SCHEMES),
        "guidance": Opt(1.0, "float", "Flux.1-dev: the distilled-guidance input while training (1.0, as kohya's "
                                      "--guidance_scale; schnell has none)", low=0.0),
        "zero_terminal_snr": Opt(False, "bool", "rescale the noise schedule so the last timestep is pure noise (Lin "
                                                "et al. 2023; needs v_prediction; on by itself when the model's "
                                                "scheduler config says rescale_betas_zero_snr)"),
        "input_perturbation": Opt(0.0, "float", "noise the input with noise + gamma * randn while the target keeps "
                                                "the noise (kohya's --ip_noise_gamma); 0: off", low=0.0),
        "debiased_estimation": Opt(False, "bool", "weight each sample by 1/sqrt(snr) (v-prediction: 1/(snr+1)), snr "
                                                  "capped at 1000, as kohya's --debiased_estimation_loss (combines "
                                                  "with min_snr_gamma)"),
        "loss_type": Opt("l2", "choice", "l2 (MSE), l1, huber (pseudo-Huber) or smooth_l1, as kohya's --loss_type",
                         choices=LOSS_TYPES),
        "huber_c": Opt(0.1, "float", "huber / smooth_l1: the threshold c (kohya's --huber_c)", low=0.0),
        "huber_schedule": Opt("snr", "choice", "huber / smooth_l1: c per timestep: constant, exponential or snr "
                                               "(kohya's --huber_schedule)", choices=HUBER_SCHEDULES),
        "huber_scale": Opt(1.0, "float", "huber / smooth_l1: scale of c in the constant and exponential schedules",
                           low=0.0),
    },
    "output": {
        "dir": Opt(REQUIRED, "path", "run folder: LoRA (or model) file, checkpoints/, metrics.jsonl, config.yaml"),
        "name": Opt(None, "filename", "name of the run's file in output.dir (.safetensors is added); null: lora, "
                                      "or model with train.mode full", nullable=True),
        "save_every": Opt(500, "int", "checkpoint every N steps (0: only at the end)", low=0),
        "keep_last": Opt(3, "int", "checkpoints kept (older ones are deleted)", low=1),
        "log_every": Opt(10, "int", "read the loss, update the bar and metrics.jsonl every N steps", low=1),
        "validate_every": Opt(0, "int", "validation loss on the held-out split every N steps (and at step 0); "
                                        "0: off", low=0),
        "val_batch_size": Opt(None, "int", "validation batch size (default data.batch_size)", low=1, nullable=True),
        "overwrite": Opt(False, "bool", "a run that does not resume may replace the checkpoints and metrics of an "
                                        "earlier run in output.dir (otherwise that is an error)"),
        "save_dtype": Opt("fp32", "choice", "dtype of the weights in the final file (fp16/bf16 halve its size; "
                                            "checkpoints keep the trained weights' own)",
                          choices=("fp32", "fp16", "bf16")),
        "report_to": Opt(["jsonl"], "names", "trackers: jsonl (output.dir/metrics.jsonl, always written), tensorboard "
                                             "(output.dir/tensorboard/), wandb (WANDB_MODE=offline works without "
                                             "network)", choices=TRACKERS),
    },
    "ema": {
        "decay": Opt(None, "float", "keep an exponential moving average of the trained weights with this decay "
                                    "(0.999 is usual; diffusers' warm-up min(decay, (1+n)/(10+n))), saved as "
                                    "NAME_ema.safetensors and in checkpoints; null: off", low=0.0, high=1.0,
                     nullable=True),
        "every": Opt(1, "int", "update the average every N optimizer steps", low=1),
    },
    "sample": {
        "prompts": Opt(None, "prompts", "images to make while training: a list of prompts, or a text file with one "
                                        "per line; null: none", nullable=True),
        "negative_prompt": Opt(None, "str", "negative prompt for every sample; null: SDXL zero embeddings (SDXL's "
                                            "default), Flux none (used by true CFG, sample.cfg above 1)",
                               nullable=True),
        "every_n_steps": Opt(0, "int", "sample every N steps (always at the end of the run); 0: only at the end",
                             low=0),
        "at_start": Opt(False, "bool", "also sample before the first step"),
        "seed": Opt(0, "int", "seed of every sample's noise (the same for each sampling, to compare steps)"),
        "steps": Opt(None, "int", "sampler steps; null: SDXL 25, Flux.1-dev 28, Flux.1-schnell 4", low=1,
                     nullable=True),
        "cfg": Opt(None, "float", "classifier-free guidance scale; null: SDXL 5, Flux 1 (none; above 1 with a "
                                  "negative prompt: diffusers' true_cfg_scale)", low=0.0, nullable=True),
        "guidance": Opt(3.5, "float", "Flux.1-dev's distilled guidance (a model input)", low=0.0),
        "sampler": Opt(None, "choice", "sampling method; null: euler for SDXL, flow_euler for Flux (which takes "
                                       f"{', '.join(FLOW_SAMPLERS)})", choices=SAMPLERS + FLOW_SAMPLERS,
                       nullable=True),
        "width": Opt(None, "int", "image width in pixels (multiple of 8, Flux 16); null: the model's sample size",
                     low=8, nullable=True),
        "height": Opt(None, "int", "image height in pixels (multiple of 8, Flux 16); null: the model's sample size",
                      low=8, nullable=True),
        "max_tokens": Opt(75, "choice", "SDXL: caption tokens per prompt (75, 150 or 225)", choices=(75, 150, 225)),
        "max_sequence_length": Opt(None, "int", "Flux: T5 tokens per prompt; null: dev 512, schnell 256", low=1,
                                   high=513, nullable=True),
        "model": Opt(None, "path", "pipeline folder (or SDXL single-file checkpoint) holding the text encoders and "
                                   "VAE; null: model.path", nullable=True),
        "tokenizers": Opt(None, "path", "pipeline folder with tokenizer/ and tokenizer_2/ (for an SDXL single-file "
                                        "checkpoint)", nullable=True),
        "use_ema": Opt(False, "bool", "sample with the moving average of the weights (needs ema.decay)"),
    },
    "distributed": {
        "timeout": Opt(600.0, "float", "torchrun runs: seconds a process waits for the others (at a collective) "
                                       "before the run stops with an error; a process that ended is noticed within "
                                       "seconds", low=1.0),
    },
    "resume": Opt(None, "str", "null, 'latest' (the newest complete checkpoint in output.dir, if any) or a "
                               "checkpoint folder", nullable=True),
}


DATASET = {  # one entry of data.datasets
    "cache_dir": Opt(None, "path", "latent cache folder; with images: where they are cached", nullable=True),
    "images": Opt(None, "path", "folder of images (as data.images), cached in cache_dir or output.dir/cache/NAME",
                  nullable=True),
    "repeats": Opt(None, "int", "times each of its images is trained per epoch; null: 1, or the N of kohya's N_name "
                                "folders (a number replaces those)", low=1, nullable=True),
    "loss_weight": Opt(1.0, "float", "factor of its samples' loss", low=0.0),
    "is_reg": Opt(False, "bool", "a regularization (prior) set: its loss also times data.prior_loss_weight"),
    "caption_extension": Opt(None, "str", "images: caption files; null: data.caption_extension", nullable=True),
    "resolution": Opt(None, "int", "images: bucket area about resolution^2; null: data.resolution", low=64,
                      nullable=True),
}
_IMAGE_KEYS = ("images", "caption_extension", "resolution")  # the keys an entry of images alone has

# diffusers' and kohya's names for options, pointed to in "unknown option" messages
ALIASES = {
    "learning_rate": "train.lr", "max_train_steps": "train.steps", "num_train_epochs": "train.epochs",
    "max_train_epochs": "train.epochs", "gradient_accumulation_steps": "train.grad_accum",
    "mixed_precision": "train.precision", "lr_warmup_steps": "train.warmup_steps",
    "train_batch_size": "data.batch_size", "network_dim": "lora.rank", "network_alpha": "lora.alpha",
    "snr_gamma": "diffusion.min_snr_gamma", "min_snr_gamma": "diffusion.min_snr_gamma", "output_dir": "output.dir",
    "checkpointing_steps": "output.save_every", "save_every_n_steps": "output.save_every",
    "pretrained_model_name_or_path": "model.path", "resume_from_checkpoint": "resume",
    "sample_prompts": "sample.prompts", "sample_every_n_steps": "sample.every_n_steps",
    "validation_prompt": "sample.prompts", "sample_sampler": "sample.sampler",
    "save_precision": "output.save_dtype", "log_with": "output.report_to",
    "lr_scheduler_num_cycles": "train.lr_num_cycles", "lr_scheduler_power": "train.lr_power",
    "loss_type": "diffusion.loss_type", "huber_c": "diffusion.huber_c", "huber_schedule": "diffusion.huber_schedule",
    "huber_scale": "diffusion.huber_scale", "debiased_estimation_loss": "diffusion.debiased_estimation",
    "ip_noise_gamma": "diffusion.input_perturbation", "loraplus_lr_ratio": "lora.plus_ratio",
    "loraplus_unet_lr_ratio": "lora.plus_ratio", "down_lr_weight": "lora.lr_down", "mid_lr_weight": "lora.lr_mid",
    "up_lr_weight": "lora.lr_up", "ema_decay": "ema.decay", "use_ema": "ema.decay",
    "dataset_repeats": "data.datasets", "num_repeats": "data.datasets", "prior_loss_weight": "data.prior_loss_weight",
    "caption_dropout_rate": "data.caption_dropout", "caption_dropout_probability": "data.caption_dropout",
    "conv_dim": "lora.conv_rank", "flip_aug": "data.flip", "optimizer_type": "train.optimizer",
    "use_dora": "lora.dora", "dora_wd": "lora.dora",
    "zero_terminal_snr": "diffusion.zero_terminal_snr", "train_data_dir": "data.images",
    "reg_data_dir": "data.datasets", "min_bucket_reso": "data.bucket_min_side",
    "max_bucket_reso": "data.bucket_max_side", "bucket_reso_steps": "data.bucket_step",
    "train_text_encoder": "lora.text_encoder", "text_encoder_lr": "lora.text_encoder_lr",
    "timestep_sampling": "diffusion.timestep_sampling", "logit_mean": "diffusion.logit_mean",
    "logit_std": "diffusion.logit_std", "discrete_flow_shift": "diffusion.timestep_shift",
    "fp8_base": "model.weight_dtype", "blocks_to_swap": "train.offload_blocks",
    "full_bf16": "train.master_weights", "zero_stage": "train.shard", "sharding_strategy": "train.shard",
}


def _known(schema=SCHEMA, prefix=""):
    for k, v in schema.items():
        if isinstance(v, dict):
            yield from _known(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def _check_value(name, opt: Opt, value, errors):
    """The value converted to the option's kind, or None with a message appended to ``errors``."""
    if value is REQUIRED:
        errors.append(f"{name}: required (no default)")
        return None
    if value is None:
        if not opt.nullable:
            errors.append(f"{name}: must not be null")
        return None
    kind = opt.kind
    try:
        if kind == "bool":
            value = _BOOL_WORDS.get(value.lower(), value) if isinstance(value, str) else value
            if not isinstance(value, bool):
                raise TypeError("expected true or false")
        elif kind == "int":
            if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float)
                                                                        and value.is_integer())):
                raise TypeError("expected an integer")
            value = int(value)
        elif kind == "float":
            if isinstance(value, bool):
                raise TypeError("expected a number")
            try:
                value = float(value)  # also "1e-4", which YAML reads as a string
            except ValueError:
                raise TypeError("expected a number") from None
            if not math.isfinite(value):
                raise ValueError("expected a finite number")
        elif kind == "choice":
            if isinstance(value, bool) or value not in opt.choices:
                raise ValueError(f"expected one of {', '.join(str(c) for c in opt.choices)}")
        elif kind in ("str", "path"):
            if not isinstance(value, str) or not value:
                raise TypeError("expected a non-empty string")
            if kind == "path":
                value = os.path.expanduser(value)
        elif kind == "names":
            names = [value] if isinstance(value, str) else value
            if not (isinstance(names, (list, tuple)) and all(isinstance(v, str) for v in names)):
                raise TypeError(f"expected a list of names from {', '.join(opt.choices)}")
            bad = [v for v in names if v not in opt.choices]
            if bad:
                raise ValueError(f"unknown {', '.join(map(repr, bad))}; choose from {', '.join(opt.choices)}")
            value = list(dict.fromkeys(names))
        elif kind == "prompts":
            if isinstance(value, str) and value:
                value = os.path.expanduser(value)
            elif not (isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value)):
                raise TypeError("expected a list of prompts or the path of a text file with one per line")
            else:
                value = list(value)
        elif kind == "targets":
            patterns = [value] if isinstance(value, str) else value
            if not (isinstance(patterns, (list, tuple)) and patterns and all(isinstance(v, str) and v
                                                                             for v in patterns)):
                raise TypeError("expected attn, attn-mlp or a non-empty list of module-name patterns")
            bad = [f"{p!r} ({e})" for p, e in ((p, target_pattern_error(p)) for p in patterns) if e]
            if bad:
                raise ValueError("not a valid regular expression: " + ", ".join(bad))
            value = value if isinstance(value, str) else list(value)
        elif kind == "mode":
            value = _check_mode(value, opt.choices)
        elif kind == "filename":
            if not isinstance(value, str) or not value.strip():
                raise TypeError("expected a non-empty string")
            if value.endswith(".safetensors"):
                value = value[:-len(".safetensors")]
            if os.sep in value or "/" in value or value in (".", "..") or not value:
                raise ValueError("expected a file name without a folder part (the file goes to output.dir)")
        elif kind == "datasets":
            value = _check_datasets(name, value, errors)
        elif kind == "sizes":
            ok = isinstance(value, (list, tuple)) and value and all(
                isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(v, int) and v > 0 for v in s)
                for s in value)
            if not ok:
                raise TypeError("expected a list of [h, w] pairs of positive integers")
            value = [list(s) for s in value]
    except (TypeError, ValueError) as e:
        errors.append(f"{name}: {e}, got {value!r}")
        return None
    if kind in ("int", "float"):
        if opt.low is not None and value < opt.low:
            errors.append(f"{name}: must be >= {opt.low}, got {value!r}")
        elif opt.high is not None and value >= opt.high:
            errors.append(f"{name}: must be < {opt.high}, got {value!r}")
    return value


def _check_mode(value, choices):
    """``train.mode``: one of ``choices``, or a non-empty list of regular expressions that compile."""
    if isinstance(value, str):
        if value not in choices:
            raise ValueError(f"expected {', '.join(choices)} or a list of regular expressions over the model's "
                             "parameter names")
        return value
    if not (isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value)):
        raise TypeError(f"expected {', '.join(choices)} or a non-empty list of regular expressions")
    bad = []
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            bad.append(f"{pattern!r} ({e})")
    if bad:
        raise ValueError("not a valid regular expression: " + ", ".join(bad))
    return list(value)


def _check_datasets(name, value, errors):
    """``data.datasets``: a non-empty list of entries of ``DATASET``'s keys, each checked."""
    if not (isinstance(value, (list, tuple)) and value and all(isinstance(e, dict) for e in value)):
        raise TypeError("expected a list of {images or cache_dir, repeats, loss_weight, is_reg} entries")
    out = []
    for i, entry in enumerate(value):
        unknown = sorted(set(entry) - set(DATASET))
        if unknown:
            errors.append(f"{name}[{i}]: unknown key(s) {', '.join(unknown)}; an entry has {', '.join(DATASET)}")
        out.append({key: _check_value(f"{name}[{i}].{key}", opt, entry.get(key, opt.default), errors)
                    for key, opt in DATASET.items()})
    return out


def _unknown(name, errors):
    """Report an unknown option, with the known one it most likely means: an alias from diffusers or
    kohya, the same key in the nearest section (``trian.steps``: ``train.steps``), the nearest key of
    its own section, or the same key in another section (``lr``: ``train.lr``)."""
    known = list(_known())
    section, _, leaf = name.rpartition(".")
    guess = ALIASES.get(leaf)
    if guess is None and section and section not in SCHEMA:
        near = difflib.get_close_matches(section, [k for k, v in SCHEMA.items() if isinstance(v, dict)], n=1)
        if near and leaf in SCHEMA[near[0]]:
            guess = f"{near[0]}.{leaf}"
    if guess is None:
        same_section = [k for k in known if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(name, same_section or known, n=1, cutoff=0.6)
        guess = close[0] if close else next((k for k in known if k.rpartition(".")[2] == leaf), None)
    if guess is None and not section:
        close = difflib.get_close_matches(name, list(SCHEMA), n=1)
        guess = close[0] if close else None
    errors.append(f"{name}: unknown option" + (f" (did you mean {guess}?)" if guess else ""))


def _merge(schema, raw, prefix, errors):
    out = {}
    if not isinstance(raw, dict):
        errors.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping of options, got {raw!r}")
        raw = {}
    for k, v in raw.items():
        if k in schema:
            continue
        if isinstance(v, dict) and v:  # an unknown section: name each of its keys
            for sub in v:
                _unknown(f"{prefix}{k}.{sub}", errors)
        else:
            _unknown(f"{prefix}{k}", errors)
    for k, opt in schema.items():
        name = f"{prefix}{k}"
        if isinstance(opt, dict):
            out[k] = _merge(opt, raw.get(k) or {}, f"{name}.", errors)
        else:
            out[k] = _check_value(name, opt, raw.get(k, opt.default), errors)
    return out


def _cross_checks(c, errors):
    t, d = c["train"], c["diffusion"]
    if t["offload"] == "none":
        errors.extend(f"train.{k}: set train.offload: blocks to stream blocks, got {t[k]}"
                      for k in ("offload_blocks", "offload_budget_gb") if t[k] is not None)
    elif t["offload_blocks"] is not None and t["offload_budget_gb"] is not None:
        errors.append("train.offload_blocks / train.offload_budget_gb: set at most one of them")
    if t["memory_budget_gb"] is not None:
        chosen = {"offload": "none", "offload_blocks": None, "offload_budget_gb": None, "checkpoint_blocks": None,
                  "checkpoint_scope": "blocks"}
        errors.extend(f"train.{k}: train.memory_budget_gb chooses it; leave it at {v if v is not None else 'null'} "
                      f"(got {t[k]})" for k, v in chosen.items() if t[k] != v)
    m = c["model"]
    if m["fp8_gemm"] == "w8a8" and m["weight_dtype"] is None and c["train"]["memory_budget_gb"] is None:
        errors.append("model.fp8_gemm w8a8: needs fp8 weights (model.weight_dtype: fp8_e4m3, or a "
                      "train.memory_budget_gb that picks them)")
    if c["model"]["weight_dtype"] is not None and c["lora"]["dora"]:
        errors.append(f"model.weight_dtype {c['model']['weight_dtype']}: DoRA needs the base weights' norms in full "
                      "precision; set lora.dora: false or model.weight_dtype: null")
    if (t["steps"] is None) == (t["epochs"] is None):
        errors.append("train.steps / train.epochs: set exactly one of them (the other null)")
    if d["timestep_min"] is not None and d["timestep_max"] is not None and d["timestep_min"] >= d["timestep_max"]:
        errors.append(f"diffusion.timestep_min ({d['timestep_min']}) must be below diffusion.timestep_max "
                      f"({d['timestep_max']})")
    if c["model"]["path"] is not None and not os.path.exists(c["model"]["path"]):
        errors.append(f"model.path: {c['model']['path']} does not exist")
    _family_checks(c, errors)
    _data_checks(c, errors)
    _text_encoder_checks(c, errors)
    _trained_checks(c, errors)
    if t["compile_ahead"] not in ("auto", "off") and not os.path.isfile(t["compile_ahead"]):
        errors.append(f"train.compile_ahead: expected auto, off or a recorded kernel list, got "
                      f"{t['compile_ahead']!r} (no such file)")
    if c["lora"]["init_from"] is not None and not os.path.isfile(c["lora"]["init_from"]):
        errors.append(f"lora.init_from: {c['lora']['init_from']} is not a file")
    lora = c["lora"]
    if c["train"]["optimizer"] == "prodigy" and (lora["plus_ratio"] != 1 or any(
            lora[k] not in (0.0, 1.0) for k in ("lr_down", "lr_mid", "lr_up"))):
        errors.append("train.optimizer: prodigy estimates one step size for all adapters, so lora.plus_ratio must be "
                      "1 and lora.lr_down/lr_mid/lr_up 1 or 0 (frozen)")
    if d["zero_terminal_snr"] and d["prediction_type"] != "v_prediction":
        errors.append("diffusion.zero_terminal_snr: the last timestep is pure noise, where only v_prediction has a "
                      "target to learn: set diffusion.prediction_type=v_prediction")
    if d["loss_type"] in ("huber", "smooth_l1") and not d["huber_c"] > 0:
        errors.append(f"diffusion.huber_c: {d['loss_type']} needs a positive threshold, got {d['huber_c']}")
    for tracker in c["output"]["report_to"]:
        if tracker != "jsonl" and importlib.util.find_spec(tracker) is None:
            errors.append(f"output.report_to: {tracker} is not installed (pip install {tracker}), or drop it")
    smp = c["sample"]
    if smp["prompts"] is not None:
        if isinstance(smp["prompts"], str) and not os.path.isfile(smp["prompts"]):
            errors.append(f"sample.prompts: {smp['prompts']} is not a file (give a list of prompts or a text file)")
        source = smp["model"] or c["model"]["path"]
        if source is None:
            errors.append("sample.prompts: sampling needs the text encoders and VAE: set model.path to a "
                          "pipeline folder (or SDXL checkpoint file), or sample.model")
        elif not os.path.exists(source):
            errors.append(f"sample.model: {source} does not exist")
        for side in ("width", "height"):
            if smp[side] is not None and smp[side] % 8:
                errors.append(f"sample.{side}: must be a multiple of 8, got {smp[side]}")
    if smp["use_ema"] and c["ema"]["decay"] is None:
        errors.append("sample.use_ema: no moving average is kept: set ema.decay (e.g. 0.999)")
    if t["lr_scheduler"] == "constant" and t["warmup_steps"]:
        errors.append("train.warmup_steps needs a schedule with warm-up (constant_with_warmup, linear, cosine)")


def _inside(path, folder) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _data_checks(c, errors):
    """Where the data comes from (a cache, image folders, several datasets), the image folders and
    their buckets (after ``_family_checks``, for the family's bucket unit)."""
    data, family = c["data"], c["model"]["family"]
    if data["datasets"] is not None:
        for other in ("cache_dir", "images"):
            if data[other] is not None:
                errors.append(f"data.{other} / data.datasets: set exactly one of them (the other null; an entry of "
                              "data.datasets takes images or cache_dir)")
    elif data["cache_dir"] is None and data["images"] is None:
        errors.append("data.images / data.cache_dir / data.datasets: set one: data.images (a folder of images), "
                      "data.cache_dir (a latent cache) or data.datasets")
    if data["synthetic_samples"] and (data["cache_dir"] is None or data["images"] is not None):
        errors.append("data.synthetic_samples: writes data.cache_dir, which is not set" if data["cache_dir"] is None
                      else "data.synthetic_samples: a synthetic cache instead of data.images' images: set one of them")
    folders = []  # (option, folder, resolution, its option)
    if data["images"] is not None:
        folders.append(("data.images", data["images"], data["resolution"], "data.resolution"))
    for i, entry in enumerate(data["datasets"] or []):
        name = f"data.datasets[{i}]"
        if entry["images"] is not None:
            folders.append((f"{name}.images", entry["images"], entry["resolution"] or data["resolution"],
                            f"{name}.resolution" if entry["resolution"] else "data.resolution"))
            continue
        if entry["cache_dir"] is None:
            errors.append(f"{name}: set images (a folder of images) or cache_dir (a latent cache)")
        given = [k for k in _IMAGE_KEYS if entry[k] is not None]
        if given:
            errors.append(f"{name}: {', '.join(given)} apply to an entry with images")
        entry["repeats"] = entry["repeats"] or 1
        for key in _IMAGE_KEYS:  # an entry of a cache keeps the keys it always had
            del entry[key]
    try:
        data["caption_extension"] = caption_extension(data["caption_extension"])
        for entry in data["datasets"] or []:
            if entry.get("caption_extension") is not None:
                entry["caption_extension"] = caption_extension(entry["caption_extension"])
    except DatasetError as e:
        errors.append(f"data.caption_extension: {e}")
    unit = BUCKET_UNIT.get(family)  # None: model.path does not exist (reported), the family is unknown
    step = data["bucket_step"] or unit
    if unit and step % unit:
        errors.append(f"data.bucket_step: {family} bucket sides are multiples of {unit} pixels, got {step}")
    for option, folder, resolution, res_option in folders:
        if not os.path.isdir(folder):
            errors.append(f"{option}: {folder} {'is not a folder' if os.path.exists(folder) else 'does not exist'}")
            continue
        for where, path in (("output.dir", c["output"]["dir"]), ("data.cache_dir", data["cache_dir"])):
            if path is not None and _inside(path, folder):
                errors.append(f"{where}: {path} is inside {option} {folder}, whose images it would mix with the "
                              "run's files: put it elsewhere")
        if unit is None:
            continue
        if resolution % step:
            errors.append(f"{res_option}: must be a multiple of the bucket step, {step} pixels, got {resolution}")
            continue
        try:
            CacheSettings(resolution=resolution, min_side=data["bucket_min_side"], max_side=data["bucket_max_side"],
                          bucket_step=step).buckets()
        except DatasetError as e:
            errors.append(f"data.bucket_min_side / data.bucket_max_side: {e}")
    if folders:
        if c["sample"]["model"] is None and c["model"]["path"] is None:
            errors.append(f"{folders[0][0]}: encoding images needs the text encoders and VAE: set model.path to a "
                          "pipeline folder (or an SDXL single-file checkpoint), or sample.model")
        if data["caption_variants"]:
            errors.append("data.caption_variants: caches of image folders hold one caption per image; build one "
                          "with scripts/prepare_cache.py --caption-variants K and train on it (data.cache_dir)")


_TEXT_ENCODER_OPTIONS = ("text_encoder_lr", "text_encoder_targets", "text_encoder_rank", "text_encoder_alpha")


def _text_encoder_checks(c, errors):
    """``lora.text_encoder``: SDXL's, with the text encoders at hand and a caption per sample; its
    options only with it."""
    lora, t = c["lora"], c["train"]
    if not lora["text_encoder"]:
        given = [f"lora.{k}" for k in _TEXT_ENCODER_OPTIONS if lora[k] != SCHEMA["lora"][k].default]
        if given:
            errors.append(f"{', '.join(given)}: set for the text encoders' adapters, which lora.text_encoder=true "
                          "trains: set it, or remove them")
        return
    if c["model"]["family"] == "flux":
        errors.append("lora.text_encoder: Flux.1 keeps its text encoders (T5-XXL and CLIP-L) frozen; flame trains "
                      "text-encoder adapters for SDXL only: remove it")
        return
    if c["model"]["path"] is None:
        errors.append("lora.text_encoder: training the text encoders needs them: set model.path to an SDXL pipeline "
                      "folder (or a single-file checkpoint, with sample.tokenizers)")
    if c["data"]["caption_variants"]:
        errors.append("data.caption_variants: the cache keeps the variants' embeddings, not their text, and "
                      "lora.text_encoder encodes each sample's caption in the step: set data.caption_variants=false")
    if t["optimizer"] == "prodigy" and lora["text_encoder_lr"] not in (None, 0.0, t["lr"]):
        errors.append("lora.text_encoder_lr: prodigy estimates one step size for all adapters: leave it null (or 0: "
                      "frozen)")


_FULL_REFUSES = {  # option: (its value when off, why train.mode full cannot have it)
    ("model", "weight_dtype"): (None, "stores the frozen Linear weights in fp8, and train.mode full trains them"),
    ("train", "offload"): ("none", "streams frozen weights from host memory, and train.mode full trains them"),
    ("train", "memory_budget_gb"): (None, "plans a LoRA run's memory (its estimate has no optimizer state for the "
                                          "model's weights): set the memory options yourself"),
}
_NOT_ELEMENTWISE = {"adafactor": "factors each weight's second moments over its rows and columns",
                    "prodigy": "estimates one step size over all weights"}


def _trained_checks(c, errors):
    """``train.mode`` and the options of what it trains: the lora section with LoRA only, the
    sharding and master-weight options with a full (or partial) fine-tune only, and the
    combinations a full fine-tune cannot run."""
    t, lora = c["train"], c["lora"]
    full = t["mode"] != "lora"
    if c["output"]["name"] is None:
        c["output"]["name"] = "model" if full else "lora"
    if not full:
        errors.extend(f"train.{k}: {v} applies to train.mode full (or a list of expressions); LoRA adapters are fp32 "
                      "and small enough for every process to hold: remove it"
                      for k in ("shard", "master_weights", "shard_reduce_dtype", "shard_overlap")
                      if (v := t[k]) != SCHEMA["train"][k].default)
        return
    if t["shard_reduce_dtype"] != "fp32" and t["shard"] not in ("gradients", "parameters"):
        errors.append(f"train.shard_reduce_dtype: {t['shard_reduce_dtype']} is the dtype train.shard gradients or "
                      f"parameters reduce-scatters in; train.shard is {t['shard']}: remove it")
    given = [f"lora.{k}" for k, opt in SCHEMA["lora"].items() if lora[k] != opt.default]
    if given:
        errors.append(f"{', '.join(given)}: set for LoRA adapters, which train.mode lora trains; train.mode "
                      f"{t['mode']} trains the model's weights themselves: remove them")
    for (section, key), (off, why) in _FULL_REFUSES.items():
        if c[section][key] != off:
            errors.append(f"{section}.{key}: {c[section][key]!r} {why}; train.mode {t['mode']} cannot have it")
    stochastic = t["master_weights"] == "bf16_stochastic"
    if stochastic and t["precision"] != "bf16":
        errors.append(f"train.master_weights: bf16_stochastic rounds updates to bf16 weights, and train.precision "
                      f"is {t['precision']}: set train.precision bf16 (or train.master_weights fp32)")
    if stochastic and t["shard"] != "none":
        errors.append(f"train.master_weights: bf16_stochastic updates every process's whole bf16 weights; "
                      f"train.shard {t['shard']} shards fp32 master weights: set one of them back (fp32 or none)")
    why = _NOT_ELEMENTWISE.get(t["optimizer"])
    if why and t["shard"] != "none":
        errors.append(f"train.optimizer: {t['optimizer']} {why}, so it cannot update a shard of them: with "
                      f"train.shard {t['shard']} use adamw, adamw8bit, lion or sgd")
    elif why and not stochastic and t["precision"] != "fp32":
        errors.append(f"train.optimizer: {t['optimizer']} {why}; fp32 master weights are updated as flat shards, "
                      "which it cannot do: set train.master_weights bf16_stochastic (it updates the bf16 weights "
                      "themselves), or use adamw, adamw8bit, lion or sgd")
    if c["ema"]["decay"] is not None and t["shard"] != "none":
        errors.append(f"ema.decay: the moving average is an fp32 copy of every trained weight on each process; "
                      f"train.shard {t['shard']} shares them out: remove it (or set train.shard none)")
    if c["sample"]["prompts"] is not None and t["shard"] == "parameters":
        errors.append("sample.prompts: samples are made by one process, and with train.shard parameters no process "
                      "holds the weights whole: remove them (or shard optimizer or gradients)")


_DDPM_ONLY = {"min_snr_gamma": None, "debiased_estimation": False, "zero_terminal_snr": False, "timestep_min": 0,
              "timestep_max": 1000}
_FLOW_ONLY = {"resolution_shift": False, "weighting_scheme": "none"}
_SDXL_SAMPLES = {"max_tokens": 75, "tokenizers": None}  # sample options of one family, at their defaults
_FLUX_SAMPLES = {"max_sequence_length": None, "guidance": 3.5}


def _family_checks(c, errors):
    """Resolve ``model.family`` (auto: from the checkpoint or config name) and refuse the options
    the other family's objective alone has."""
    m, d, lora, smp = c["model"], c["diffusion"], c["lora"], c["sample"]
    if m["path"] is not None and not os.path.exists(m["path"]):
        return  # reported above
    family = m["family"] if m["family"] != "auto" else families.detect(m["path"], m["config"])
    m["family"] = family
    if family == "flux" and m["path"] is not None and m["config"] == SCHEMA["model"]["config"].default:
        m["config"] = m["path"]  # not set for this family: the checkpoint's own (config.json or tensor shapes)
    names = families.FAMILIES[family].config_names
    if m["config"] not in names and not os.path.exists(m["config"]):
        errors.append(f"model.config: a {family} model's config is {', '.join(names)} or a diffusers config.json "
                      f"(or a folder holding one), got {m['config']!r} (no such file)")
    if family == "flux":
        wrong = [f"diffusion.{k}={d[k]!r}" for k, v in _DDPM_ONLY.items() if d[k] != v]
        if d["prediction_type"] != "epsilon":
            wrong.append(f"diffusion.prediction_type={d['prediction_type']!r}")
        if d["loss_type"] in ("huber", "smooth_l1") and d["huber_schedule"] != "constant":
            wrong.append(f"diffusion.huber_schedule={d['huber_schedule']!r} (use constant)")
        wrong += [f"lora.{k}={lora[k]!r}" for k in ("lr_down", "lr_mid", "lr_up") if lora[k] != 1.0]
        wrong += [f"sample.{k}={smp[k]!r}" for k, v in _SDXL_SAMPLES.items() if smp[k] != v]
        if smp["sampler"] is not None and smp["sampler"] not in FLOW_SAMPLERS:
            wrong.append(f"sample.sampler={smp['sampler']!r} (Flux: {', '.join(FLOW_SAMPLERS)})")
        if wrong:
            errors.append(f"model.family flux trains a rectified flow, where these DDPM/UNet options have no "
                          f"meaning: {', '.join(wrong)}; remove them")
        if smp["prompts"] is not None:
            errors.extend(f"sample.{side}: Flux images are multiples of 16 pixels, got {smp[side]}"
                          for side in ("width", "height") if smp[side] is not None and smp[side] % 16)
            source = smp["model"] or m["path"]
            if source is not None and os.path.isfile(source):
                errors.append(f"sample.model: Flux samples need the text encoders, tokenizers and VAE of a Flux "
                              f"pipeline folder, and {source} is a single file: set sample.model to a Flux "
                              "pipeline folder")
    else:
        wrong = [f"diffusion.{k}={d[k]!r}" for k, v in _FLOW_ONLY.items() if d[k] != v]
        wrong += [f"sample.{k}={smp[k]!r}" for k, v in _FLUX_SAMPLES.items() if smp[k] != v]
        if smp["sampler"] in FLOW_SAMPLERS:
            wrong.append(f"sample.sampler={smp['sampler']!r}")
        if wrong:
            errors.append(f"model.family {family}: {', '.join(wrong)} apply to rectified-flow models (Flux) only")


class _Loader(yaml.SafeLoader):
    """YAML as users of this config mean it: only true and false are booleans (YAML 1.2), so the
    words on, off, yes and no stay strings (``train.compile_ahead: off``); options of kind bool
    read them as booleans (``_BOOL_WORDS``)."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def _read_yaml(text_or_file):
    return yaml.load(text_or_file, Loader=_Loader)


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``section.key=value`` override (value parsed as YAML) to the raw config dict."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected section.key=value, e.g. train.lr=2e-4")
    try:
        value = _read_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({e})") from None
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = nxt
    node[parts[-1]] = value


def build_config(raw: dict | None, overrides=()) -> SimpleNamespace:
    """Validate ``raw`` (a dict as read from YAML) with ``overrides`` applied; raises ConfigError."""
    raw = copy.deepcopy(raw) if raw is not None else {}
    for item in overrides:
        apply_override(raw, item)
    errors = []
    merged = _merge(SCHEMA, raw, "", errors)
    if not errors:
        _cross_checks(merged, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return _namespace(merged)


def load_config(path, overrides=()) -> SimpleNamespace:
    """Read the YAML file ``path``, apply ``overrides`` and validate (see ``build_config``)."""
    try:
        with open(path) as f:
            raw = _read_yaml(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    return build_config(raw if raw is not None else {}, overrides)


def _namespace(d):
    return SimpleNamespace(**{k: _namespace(v) if isinstance(v, dict) else v for k, v in d.items()})


def to_dict(cfg) -> dict:
    """The plain-dict form of a config namespace (for YAML/JSON)."""
    return {k: to_dict(v) if isinstance(v, SimpleNamespace) else v for k, v in vars(cfg).items()}
