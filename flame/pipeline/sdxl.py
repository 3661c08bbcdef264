"""SDXL text-to-image on flame: prompts -> both text encoders -> a sampler's loop over the UNet with
classifier-free guidance -> the VAE decoder -> images.

The stages are functions of the models they need, so the trainer can sample with the UNet it is
training (adapters live), prompts encoded once, and the VAE alone:

- ``encode_prompts(text_encoders, prompts, negative_prompt, ...)`` -> ``Conditioning``;
- ``denoise(unet, conditioning, noise, sampler, cfg, time_ids, ...)`` -> latents;
- ``decode(vae, latents)`` -> uint8 images (H, W, 3) (``flame.pipeline.stages``, shared with Flux).

``SDXLPipeline`` holds the three models of one checkpoint and runs them in turn.

Classifier-free guidance runs the unconditional and conditional rows as one UNet batch, as
diffusers does: ``eps = eps_uncond + cfg * (eps_cond - eps_uncond)``. With no negative prompt the
unconditional embeddings are zeros when the checkpoint says so (SDXL base's
``force_zeros_for_empty_prompt``), else the embeddings of "". Micro-conditioning: the time ids are
(original size, crop top-left, target size), by default (height, width, 0, 0, height, width).

Reproducibility: image k of a call starts from noise drawn by flame's generator seeded with
``seed + k`` (so an image can be regenerated alone from the seed in its metadata); the ancestral
sampler's per-step noise is drawn after seeding with ``seed``, so ``euler_a`` images repeat for the
same seed and batch size. The caller's generator state is restored afterwards.

The UNet call of each step can run as a CUDA graph (``cuda_graph=True``): captured on its second
call, replayed from the third, every step's inputs copied into the graph's buffers. ``SDXLPipeline``
keeps its UNet's ``CapturedStep`` across calls (``predict``), so a graph is captured once per batch
and image size, not once per image.
"""
from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

from .. import runtime
from ..autograd import no_grad
from ..diffusion.samplers import SDXL_BASE_SCHEDULER_CONFIG, make_sampler
from ..graphs import CapturedStep
from ..models.sdxl_text import SDXLTextEncoders, prompt_list
from ..models.sdxl_unet import SDXLUNet
from ..models.vae import AutoencoderKL
from ..ops.creation import get_rng_state, manual_seed, set_rng_state, tensor, zeros_like
from ..ops.elementwise import to
from ..ops.shape import cat
from ..tensor import Tensor, bfloat16, float32
from .stages import add_lora, check_image_size, decode, guide, initial_noise, sampler_loop


class Conditioning(NamedTuple):
    """Text conditioning of B images: (B, L, text dim) embeddings and (B, pooled dim) pooled ones,
    for the prompts and for the unconditional (negative) branch."""
    embeds: Tensor
    pooled: Tensor
    negative_embeds: Tensor
    negative_pooled: Tensor

    def __len__(self):
        return self.embeds.shape[0]


@no_grad()
def encode_prompts(text_encoders: SDXLTextEncoders, prompts, negative_prompt=None, force_zeros_for_empty_prompt=True,
                   max_tokens: int = 75) -> Conditioning:
    """Both encoders' conditioning of ``prompts``; ``negative_prompt`` (one string for all, or one
    per prompt; None: zeros when ``force_zeros_for_empty_prompt``, else "")."""
    prompts = prompt_list(prompts, "prompts")
    embeds, pooled = text_encoders.encode(prompts, max_tokens=max_tokens)
    if negative_prompt is None and force_zeros_for_empty_prompt:
        return Conditioning(embeds, pooled, zeros_like(embeds), zeros_like(pooled))
    negatives = prompt_list(negative_prompt if negative_prompt is not None else "", "negative_prompt")
    if len(negatives) == 1:
        negatives = negatives * len(prompts)
    if len(negatives) != len(prompts):
        raise ValueError(f"negative_prompt: {len(negatives)} given for {len(prompts)} prompts (give one, or one "
                         "per prompt)")
    neg_embeds, neg_pooled = text_encoders.encode(negatives, max_tokens=max_tokens)
    return Conditioning(embeds, pooled, neg_embeds, neg_pooled)


def time_ids_for(height, width, batch, original_size=None, crop_top_left=(0, 0)):
    """(batch, 6) float32 SDXL micro-conditioning: original (h, w), crop (top, left), target (h, w)."""
    orig = tuple(original_size) if original_size is not None else (height, width)
    row = [*orig, *crop_top_left, height, width]
    return tensor([row] * batch, dtype=float32)


@no_grad()
def denoise(unet: SDXLUNet, cond: Conditioning, noise, sampler, cfg: float, time_ids, cuda_graph: bool = True,
            progress=None, predict=None):
    """The sampler's loop from ``noise`` (B, C, h, w) over ``unet``; returns float32 latents.
    ``sampler``: from ``flame.diffusion.samplers.make_sampler``; ``time_ids`` (B, 6);
    ``progress``: called with no argument after each step; ``predict``: what each step calls
    instead of ``unet`` (same arguments), e.g. a ``CapturedStep`` of it kept across calls (None:
    one made for this call when ``cuda_graph``)."""
    B = noise.shape[0]
    if len(cond) != B or time_ids.shape[0] != B:
        raise ValueError(f"denoise: {B} noise rows but {len(cond)} conditioning rows and {time_ids.shape[0]} time ids")
    guided = cfg > 1.0  # as diffusers: guidance only above 1
    if guided:  # one batch: unconditional rows first, as diffusers
        context = cat([cond.negative_embeds, cond.embeds], 0)
        pooled = cat([cond.negative_pooled, cond.pooled], 0)
        ids = cat([time_ids, time_ids], 0)
    else:
        context, pooled, ids = cond.embeds, cond.pooled, time_ids
    if predict is None:
        predict = CapturedStep(unet.__call__, enabled=cuda_graph)

    def guided_output(x_in, t):
        out = to(predict(cat([x_in, x_in], 0) if guided else x_in, t, context, pooled, ids), float32)
        return guide(out, B, cfg) if guided else out

    return sampler_loop(sampler, noise, guided_output, 2 * B if guided else B, progress)


def pipeline_settings(path) -> tuple:
    """(scheduler config, force_zeros_for_empty_prompt) of a pipeline folder (scheduler/ and
    model_index.json); SDXL base's for a single file or where they are absent."""
    p = pathlib.Path(path)
    scheduler, force_zeros = dict(SDXL_BASE_SCHEDULER_CONFIG), True
    if p.is_dir():
        if (p / "scheduler" / "scheduler_config.json").is_file():
            scheduler = json.loads((p / "scheduler" / "scheduler_config.json").read_text())
        if (p / "model_index.json").is_file():
            force_zeros = json.loads((p / "model_index.json").read_text()).get("force_zeros_for_empty_prompt", True)
    return scheduler, bool(force_zeros)


class SDXLPipeline:
    """The UNet, both text encoders (with their tokenizers) and the VAE of one SDXL checkpoint."""

    def __init__(self, unet: SDXLUNet, text_encoders: SDXLTextEncoders, vae: AutoencoderKL,
                 scheduler_config: dict | None = None, force_zeros_for_empty_prompt: bool = True, source: str = ""):
        self.unet, self.text_encoders, self.vae = unet, text_encoders, vae
        self.scheduler_config = dict(scheduler_config or SDXL_BASE_SCHEDULER_CONFIG)
        self.force_zeros_for_empty_prompt = bool(force_zeros_for_empty_prompt)
        self.source = str(source)
        self.loras = []
        self.predict = CapturedStep(unet.__call__)  # its graphs outlive a call: captured once per shape

    @classmethod
    def from_pretrained(cls, path, dtype=None, vae_dtype=None, tokenizer_path=None) -> SDXLPipeline:
        """A diffusers SDXL pipeline folder (unet/, vae/, text_encoder/, text_encoder_2/, tokenizer/,
        tokenizer_2/, scheduler/, model_index.json) or one single-file SDXL checkpoint (its
        tokenizers from ``tokenizer_path``, a pipeline folder). ``dtype``: UNet and text encoders
        (default bf16 on a GPU, fp32 on the interpreter); ``vae_dtype`` defaults to ``dtype``."""
        p = pathlib.Path(path)
        if not p.exists():
            raise FileNotFoundError(f"SDXL checkpoint {str(path)!r} does not exist")
        dtype = dtype if dtype is not None else (float32 if runtime.is_interpreter() else bfloat16)
        scheduler, force_zeros = pipeline_settings(p)
        text = SDXLTextEncoders.from_pretrained(p, dtype=dtype, tokenizer_path=tokenizer_path)
        vae = AutoencoderKL.from_pretrained(p, dtype=vae_dtype if vae_dtype is not None else dtype)
        unet = SDXLUNet.from_pretrained(p, dtype=dtype)
        return cls(unet, text, vae, scheduler, force_zeros, source=str(p))

    def load_lora(self, path, strength: float = 1.0) -> list:
        """Add a LoRA file (PEFT or kohya) into the UNet's and the text encoders' weights at
        ``strength`` (their adapters under diffusers' ``unet.``, ``text_encoder.``, ``text_encoder_2.``
        or kohya's ``lora_unet_``, ``lora_te1_``, ``lora_te2_``; the parts the file has); returns the
        layers it changed (the encoders' prefixed). Files load one after another, each folded in
        before the next."""
        parts = {"unet": self.unet, "text_encoder": self.text_encoders.text_encoder,
                 "text_encoder_2": self.text_encoders.text_encoder_2}
        names = add_lora(parts, path, strength, "SDXL UNet or its text encoders", "unet")
        self.loras.append((pathlib.Path(path).name, float(strength)))
        return names

    def __call__(self, prompts, negative_prompt=None, steps: int = 30, cfg: float = 5.0, width: int = 1024,
                 height: int = 1024, seed: int = 0, sampler: str = "euler", max_tokens: int = 75,
                 cuda_graph: bool = True, progress=None) -> list:
        """Images ((H, W, 3) uint8 arrays), one per prompt; ``progress`` called after each step."""
        prompts = prompt_list(prompts, "prompts")
        cond = encode_prompts(self.text_encoders, prompts, negative_prompt, self.force_zeros_for_empty_prompt,
                              max_tokens)
        return generate(self.unet, self.vae, cond, self.scheduler_config, steps=steps, cfg=cfg, width=width,
                        height=height, seed=seed, sampler=sampler, cuda_graph=cuda_graph, progress=progress,
                        predict=self.predict if cuda_graph else None)


def generate(unet, vae, cond: Conditioning, scheduler_config: dict, steps=30, cfg=5.0, width=1024, height=1024,
             seed=0, sampler="euler", cuda_graph=True, progress=None, predict=None) -> list:
    """Images for prompts already encoded (``cond``): noise from ``seed``, the sampler's loop, the
    VAE decode. flame's generator state is the same afterwards."""
    vae_factor = vae.config.downsample_factor  # 8 in SDXL
    check_image_size(width, height, vae_factor * 2 ** (len(unet.config.block_out_channels) - 1))
    rng = get_rng_state()
    try:
        latent_shape = (unet.config.in_channels, height // vae_factor, width // vae_factor)
        noise = initial_noise(len(cond), latent_shape, seed)
        manual_seed(seed)
        chosen = make_sampler(sampler, steps, scheduler_config)
        ids = time_ids_for(height, width, len(cond))
        latents = denoise(unet, cond, noise, chosen, cfg, ids, cuda_graph=cuda_graph, progress=progress,
                          predict=predict)
        return decode(vae, latents)
    finally:
        set_rng_state(rng)

