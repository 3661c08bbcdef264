"""``Family``: what the trainer asks of a model family (the SDXL UNet, the Flux transformer)."""
from __future__ import annotations

import json
import os

import torch

from ..errors import ConfigError


def config_from(spec, named: dict, config_class, subfolder: str, what: str):
    """``spec`` as a model config: a ``config_class`` instance (itself), a name in ``named`` (its
    factory's config), or the path of a diffusers ``config.json`` (or of a folder holding one,
    directly or in ``subfolder``), read by ``config_class.from_diffusers``."""
    if isinstance(spec, config_class):
        return spec
    if isinstance(spec, str) and spec in named:
        return named[spec]()
    path = os.fspath(spec)
    for candidate in (path, os.path.join(path, "config.json"), os.path.join(path, subfolder, "config.json")):
        if os.path.isfile(candidate):
            with open(candidate) as f:
                return config_class.from_diffusers(json.load(f))
    raise ValueError(f"model config must be one of {tuple(named)} or a diffusers {what} config.json (or a folder "
                     f"holding one), got {spec!r}")


class Family:
    """One model family's side of a training run; ``cfg`` is the run's config (None for questions
    that need none, such as layer names). Class attributes: ``name``, ``config_names`` (what
    ``model.config`` may name), ``lora_prefix`` (the PEFT/diffusers key prefix of its LoRA files),
    ``blocks`` (the parts ``block_of`` returns), kohya's ``base_model_version`` and modelspec's
    ``architecture``, and ``full_precision_layers`` (``inject_lora`` targets whose weights stay in
    ``train.precision`` when ``model.weight_dtype`` is fp8: the small input embedders and the output
    layer, where e4m3's 3 mantissa bits would cost the most and save the least), and
    ``activation_profile`` (``memory.ActivationProfile``: what ``train.memory_budget_gb`` plans
    with; its ``tokens`` counted as ``tokens`` counts them), and ``diffusers_class`` /
    ``diffusers_subfolder``: the diffusers model of its checkpoints and its pipeline folder (a full
    fine-tune's file holds its state dict)."""

    name = ""
    config_names: tuple = ()
    lora_prefix = ""
    blocks: tuple = ("other",)
    base_model_version = ""
    architecture = ""
    full_precision_layers: tuple = ()
    activation_profile = None
    diffusers_class = ""
    diffusers_subfolder = ""

    def tokens(self, latent_size, text_len: int) -> int:
        """The tokens one sample of latent ``latent_size`` (h, w) and ``text_len`` text tokens puts
        through the model, as its activation memory grows: the latent's pixels by default."""
        return latent_size[0] * latent_size[1]

    def __init__(self, cfg=None):
        self.cfg = cfg

    # ---- the model, before and after its weights exist
    def model_config(self, spec):
        """The model config of ``model.config`` (a config name, a config object, or a diffusers
        config.json / a folder holding one). Raises ValueError or OSError."""
        raise NotImplementedError

    def build(self, path, config, dtype, **placement):
        """The model: loaded from ``path`` (a folder or one file) or randomly initialised from ``config``.
        ``placement``, for loading: ``from_pretrained``'s ``host_blocks`` (an ``offload.OffloadPlan``'s
        ``streamed``: their weights read straight into pinned host memory), ``weight_dtype`` and
        ``fp8_skip`` (fp8 weights quantised as they load)."""
        raise NotImplementedError

    def layer_names(self, mcfg, kind: str) -> list:
        """The dotted names of the ``kind`` ("Linear" or "Conv2d") layers of a model of ``mcfg``."""
        raise NotImplementedError

    def parameter_names(self, mcfg) -> list:
        """The parameter names of a model of ``mcfg``, in ``state_dict`` order, without allocating."""
        raise NotImplementedError

    def diffusers_tensors(self, model, name: str, value) -> list:
        """``[(key, tensor)]``: the model's parameter ``name``, holding ``value`` (its own or another,
        such as an fp32 master copy), under diffusers' state-dict names: as it is by default."""
        return [(name, value)]

    def lora_targets(self, targets):
        """``lora.targets`` as ``flame.nn.inject_lora`` takes them (a family's own presets expanded)."""
        return targets

    # ---- data
    def cache_dims(self, mcfg) -> dict:
        """The cache fields the model reads: ``latent_channels``, ``text_dim``, ``pooled_dim``."""
        raise NotImplementedError

    def write_synthetic_cache(self, path, num_samples, mcfg, latent_sizes, **kwargs):
        raise NotImplementedError

    # ---- the step
    def objective(self, cfg, log):
        """The ``flame.train.objectives`` object the run trains with."""
        raise NotImplementedError

    def conditioning(self, batch, latent_shape, text_len) -> tuple:
        """The step's tensors besides latents, noise, noise levels, text states and pooled vector;
        made outside the captured step."""
        raise NotImplementedError

    def predict(self, model, noisy, levels, embeds, pooled, *conditioning):
        """The model's prediction for ``noisy`` latents (B, C, h, w), in the latents' layout."""
        raise NotImplementedError

    def block_of(self, name: str) -> str:
        """The part of the model (one of ``blocks``) that the layer ``name`` belongs to."""
        return "other"

    def lr_scales(self, lora_cfg) -> dict:
        """Learning-rate multiplier of each part in ``blocks``."""
        return dict.fromkeys(self.blocks, 1.0)

    def kernel_list(self, mcfg) -> str | None:
        """The name of configs/kernels/' compile-ahead list recorded for this architecture ("" for
        SDXL's, "flux"), or None when none was (``precompile.manifest_name``'s ``model``)."""
        return None

    def training_samples(self, sample_cfg, source, dtype, mcfg, text_encoders=None):
        """The ``sample`` section's prompts encoded, ready to render images while training
        (``make_samples``); a source that cannot be loaded is a ConfigError naming it.
        ``text_encoders``: the ones being trained (SDXL's ``lora.text_encoder``), which then encode
        the prompts at each sampling."""
        try:
            if text_encoders is not None:
                return self.make_samples(sample_cfg, source, dtype, mcfg, text_encoders=text_encoders)
            return self.make_samples(sample_cfg, source, dtype, mcfg)
        except torch.cuda.OutOfMemoryError:
            raise
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"sample: cannot load the text encoders and VAE from {source}: {e}") from None

    def make_samples(self, sample_cfg, source, dtype, mcfg):
        """A ``flame.train.samples.TrainingSamples`` of the model's family."""
        raise NotImplementedError
