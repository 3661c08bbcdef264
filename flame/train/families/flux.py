"""Flux.1: the transformer a run trains (dev, schnell, or the tiny test model), trained with rectified
flow on cached 16-channel latents, T5 states and the pooled CLIP-L vector.

The cache's latents (B, 16, h, w) are packed into 2x2 patches for the transformer (h/2 * w/2 image
tokens) and its prediction unpacked again; the image and text position ids (RoPE) and the guidance
input of dev models are built once per latent size, outside the captured step.
"""
from __future__ import annotations

import dataclasses
import os

from ...data import write_synthetic_cache
from ...models import flux_keys
from ...models.flux import (
    LORA_PRESETS,
    FluxConfig,
    FluxTransformer2DModel,
    latent_image_ids,
    pack_latents,
    text_ids,
    unpack_latents,
)
from ...ops.creation import full
from ...ops.shape import cat
from ..memory import ActivationProfile
from ..objectives import FlowObjective
from .base import Family, config_from

CONFIG_NAMES = ("tiny", "flux-dev", "flux-schnell")
BLOCKS = ("double", "single", "other")


def flux_config(spec) -> FluxConfig:
    """``"tiny"`` (FluxConfig.tiny()), ``"flux-dev"``, ``"flux-schnell"`` (no guidance input), a
    ``FluxConfig``, a diffusers transformer ``config.json`` (or a folder holding one, directly
    or in ``transformer/``), or a single ``.safetensors`` file (the config its tensor shapes give)."""
    named = {"tiny": FluxConfig.tiny, "flux-dev": FluxConfig, "flux-schnell": lambda: FluxConfig(guidance_embeds=False)}
    if isinstance(spec, str) and spec.endswith(".safetensors") and os.path.isfile(spec):
        return FluxTransformer2DModel.pretrained_config(spec)  # a single file's, from its tensor shapes
    return config_from(spec, named, FluxConfig, "transformer", "Flux transformer")


class FluxFamily(Family):
    """Flux.1's ``Family``."""

    name = "flux"
    config_names = CONFIG_NAMES
    lora_prefix = "transformer"
    blocks = BLOCKS
    full_precision_layers = (r"re:(img_in|txt_in|time_in|vector_in|guidance_in|final_layer)(\..*)?",)
    base_model_version = "flux1"
    architecture = "Flux.1-dev/lora"
    diffusers_class = "FluxTransformer2DModel"
    diffusers_subfolder = "transformer"
    activation_profile = ActivationProfile(
        tokens=4096 + 512, per_block=0.454, rest=2.19,
        measured="H200, scripts/bench_flux.py --batch 1 --resolution 1024 --weight-dtype fp8_e4m3 --checkpointing on "
                 "--checkpoint-blocks 0/20/38/57: peaks 40.16/30.89/23.07/14.29 GiB, LoRA rank 16 on attn-mlp")

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self._guidance = cfg.diffusion.guidance if cfg is not None else 1.0  # the dev models' guidance input
        self._conditioning = {}  # (B, h, w, text tokens) -> (img_ids, txt_ids, guidance)

    def model_config(self, spec):
        return flux_config(spec)

    def build(self, path, config, dtype, **placement):
        if path:
            if not os.path.exists(path):
                raise FileNotFoundError(f"model.path {path!r} does not exist")
            single_file = os.path.isfile(path)
            return FluxTransformer2DModel.from_pretrained(path, dtype=dtype,
                                                          config=flux_config(config) if single_file else None,
                                                          **placement)
        return FluxTransformer2DModel(flux_config(config), dtype=dtype)

    def layer_names(self, mcfg, kind: str) -> list:
        return FluxTransformer2DModel.layer_names(mcfg, kind)

    def parameter_names(self, mcfg) -> list:
        return list(FluxTransformer2DModel.parameter_shapes(mcfg))

    def diffusers_tensors(self, model, name: str, value) -> list:
        """The rows of BFL parameter ``name`` under diffusers' names (``flux_keys.diffusers_pieces``):
        a fused q/k/v (and a single block's MLP input) split into its projections, views of
        ``value``; the final modulation's two halves joined in diffusers' order, a copy."""
        module = name.rpartition(".")[0]
        pieces = flux_keys.diffusers_pieces(name, tuple(value.shape), getattr(model.get_submodule(module), "parts",
                                                                                None))
        rows, at = {}, 0
        for key, start, stop in pieces:
            rows.setdefault(key, []).append((start, value.narrow(0, at, stop - start)))
            at += stop - start
        return [(key, blocks[0][1] if len(blocks) == 1 else cat([b for _, b in sorted(blocks, key=lambda s: s[0])]))
                for key, blocks in rows.items()]

    def lora_targets(self, targets):
        """``lora.targets`` with Flux's presets (``attn``, ``attn-mlp``, ``all-linear``) expanded."""
        names = [targets] if isinstance(targets, str) else list(targets)
        out = []
        for t in names:
            out.extend(LORA_PRESETS.get(t, (t,)))
        return out

    def tokens(self, latent_size, text_len: int) -> int:
        """The 2x2 patches of the latent and the T5 tokens: one sequence through every block."""
        return latent_size[0] // 2 * (latent_size[1] // 2) + text_len

    def cache_dims(self, mcfg) -> dict:
        return {"latent_channels": mcfg.in_channels // 4, "text_dim": mcfg.joint_attention_dim,
                "pooled_dim": mcfg.pooled_projection_dim}

    def _full_size(self, mcfg) -> bool:
        return mcfg.joint_attention_dim == FluxConfig.joint_attention_dim

    def write_synthetic_cache(self, path, num_samples, mcfg, latent_sizes, **kwargs):
        """A synthetic cache of the model's dims: T5's 512 tokens (256 for schnell, 8 for the tiny
        model), latents of 1024² and a 7:9 bucket (8x8 for the tiny model) unless given."""
        full_size = self._full_size(mcfg)
        text_len = (512 if mcfg.guidance_embeds else 256) if full_size else 8
        if latent_sizes is None:
            latent_sizes = [(128, 128), (112, 144)] if full_size else [(8, 8)]
        dims = self.cache_dims(mcfg)
        return write_synthetic_cache(path, num_samples, dims["latent_channels"], text_len, dims["text_dim"],
                                     dims["pooled_dim"], latent_sizes, **kwargs)

    def kernel_list(self, mcfg) -> str | None:
        """Flux.1's list (recorded on dev's architecture; schnell runs the same kernels)."""
        return "flux" if dataclasses.replace(mcfg, guidance_embeds=True) == FluxConfig() else None

    def block_of(self, name: str) -> str:
        head = name.split(".", 1)[0]
        return {"double_blocks": "double", "single_blocks": "single"}.get(head, "other")

    def objective(self, cfg, log):
        return FlowObjective(cfg.diffusion)

    def conditioning(self, batch, latent_shape, text_len) -> tuple:
        """(image ids, text ids, guidance: ``diffusion.guidance`` per sample, which ``predict`` drops
        for a model without a guidance input) for latents of ``latent_shape`` and ``text_len`` text
        tokens: made once per shape (host-to-device copies stay out of the captured step)."""
        B, _, h, w = latent_shape
        key = (B, h, w, text_len)
        if key not in self._conditioning:
            guidance = full((B,), float(self._guidance))
            self._conditioning[key] = (latent_image_ids(h, w), text_ids(text_len), guidance)
        return self._conditioning[key]

    def predict(self, model, noisy, levels, embeds, pooled, img_ids, txt_ids, guidance):
        h, w = noisy.shape[-2:]
        if not model.config.guidance_embeds:
            guidance = None
        out = model(hidden_states=pack_latents(noisy), encoder_hidden_states=embeds, pooled_projections=pooled,
                    timestep=levels, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance)
        return unpack_latents(out, h, w)

    def make_samples(self, sample_cfg, source, dtype, mcfg):
        from ..samples import flux_samples
        return flux_samples(sample_cfg, source, dtype, transformer_config=mcfg)
