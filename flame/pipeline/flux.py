"""Flux.1 text-to-image on flame: prompts -> CLIP-L and T5 -> a flow-matching sampler's loop over the
transformer -> the VAE decoder -> images, as diffusers' ``FluxPipeline`` computes them.

The stages are functions of the models they need, so that a caller can encode the prompts, free
the text encoders (T5-XXL is ~9.5 GB in bf16) and only then load the transformer, and so that the
trainer can sample with the transformer it is training:

- ``encode_prompts(text_encoders, prompts, negative_prompt, max_sequence_length)`` -> ``FluxConditioning``;
- ``denoise(transformer, conditioning, noise, sampler, guidance, true_cfg, ...)`` -> latents;
- ``decode(vae, latents)`` -> uint8 images (H, W, 3) (``flame.pipeline.stages``).

``FluxPipeline`` holds the three models of one checkpoint and runs them in turn.

Guidance: Flux.1-dev is guidance-distilled: the guidance scale (default 3.5) is an input of the
transformer (``guidance_embeds``), one model call per step; schnell has no guidance input.
``true_cfg`` > 1 with a negative prompt adds classifier-free guidance as diffusers' ``true_cfg_scale``:
the negative and positive rows run as one batch and ``v = v_neg + true_cfg (v_pos - v_neg)``.

Latents: noise (B, 16, H/8, W/8) in float32 (image k seeded with ``seed + k``), packed into 2x2
patches (``flame.models.flux.pack_latents``) for the loop, which runs in float32 (the sampler's
update in fp32 kernels); the model's timestep is the sampler's divided by 1000, as FluxPipeline
passes it. Width and height must be multiples of 16 (the VAE's 8 times the 2x2 patches).

The transformer call of each step can run as a CUDA graph (``cuda_graph=True``), captured once per
batch and image size and kept by ``FluxPipeline`` across calls.
"""
from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

from .. import runtime
from ..autograd import no_grad
from ..diffusion.samplers import FLOW_SAMPLERS, FLUX_SCHEDULER_CONFIG, make_sampler
from ..graphs import CapturedStep
from ..models.flux import FluxTransformer2DModel, latent_image_ids, pack_latents, text_ids, unpack_latents
from ..models.flux_text import MAX_SEQUENCE_LENGTH, FluxTextEncoders
from ..models.sdxl_text import prompt_list
from ..models.vae import AutoencoderKL
from ..ops.creation import full, get_rng_state, manual_seed, set_rng_state
from ..ops.elementwise import mul, to
from ..ops.shape import cat
from ..tensor import Tensor, bfloat16, float32
from .stages import add_lora, check_image_size, decode, guide, initial_noise, sampler_loop

# diffusers' scheduler of FLUX.1-schnell (FLUX.1-dev's is FLUX_SCHEDULER_CONFIG): no shift
FLUX_SCHNELL_SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                                 "shift": 1.0, "use_dynamic_shifting": False}
DEFAULT_STEPS = {"dev": 28, "schnell": 4}
DEFAULT_GUIDANCE = 3.5  # FluxPipeline's guidance_scale


class FluxConditioning(NamedTuple):
    """Text conditioning of B images: T5 states (B, L, text dim) and pooled CLIP-L (B, pooled dim),
    and the negative prompt's (None without one)."""
    embeds: Tensor
    pooled: Tensor
    negative_embeds: Tensor | None = None
    negative_pooled: Tensor | None = None

    def __len__(self):
        return self.embeds.shape[0]


def variant(model) -> str:
    """"dev" for a transformer (or its ``FluxConfig``) with a guidance input, else "schnell"."""
    return "dev" if getattr(model, "config", model).guidance_embeds else "schnell"


@no_grad()
def encode_prompts(text_encoders: FluxTextEncoders, prompts, negative_prompt=None,
                   max_sequence_length: int = 512) -> FluxConditioning:
    """Both encoders' conditioning of ``prompts`` and, when given, of ``negative_prompt`` (one string
    for all, or one per prompt), which only true CFG reads."""
    prompts = prompt_list(prompts, "prompts")
    embeds, pooled = text_encoders.encode(prompts, max_sequence_length)
    if negative_prompt is None:
        return FluxConditioning(embeds, pooled)
    negatives = prompt_list(negative_prompt, "negative_prompt")
    if len(negatives) == 1:
        negatives = negatives * len(prompts)
    if len(negatives) != len(prompts):
        raise ValueError(f"negative_prompt: {len(negatives)} given for {len(prompts)} prompts (give one, or one "
                         "per prompt)")
    return FluxConditioning(embeds, pooled, *text_encoders.encode(negatives, max_sequence_length))


@no_grad()
def denoise(transformer: FluxTransformer2DModel, cond: FluxConditioning, noise, sampler,
            guidance: float = DEFAULT_GUIDANCE, true_cfg: float = 1.0, cuda_graph: bool = True, progress=None,
            predict=None):
    """The sampler's loop from ``noise`` (B, C, h, w) over ``transformer``; returns float32 latents
    (B, C, h, w). ``sampler``: a flow-matching one from ``flame.diffusion.samplers.make_sampler``
    (its ``image_seq_len`` is h/2 * w/2); ``guidance``: the dev models' guidance input (ignored by
    schnell); ``true_cfg``: classifier-free guidance scale, used above 1 when ``cond`` has a
    negative prompt; ``predict``: what each step calls instead of ``transformer`` (same arguments),
    e.g. a ``CapturedStep`` of it kept across calls (None: one made for this call when ``cuda_graph``)."""
    if getattr(sampler, "prediction_type", None) != "flow":
        raise ValueError(f"denoise: Flux samples with a flow-matching sampler ({', '.join(FLOW_SAMPLERS)}), got "
                         f"{getattr(sampler, 'name', type(sampler).__name__)!r}")
    B, _, h, w = noise.shape
    if len(cond) != B:
        raise ValueError(f"denoise: {B} noise rows but {len(cond)} conditioning rows")
    guided = true_cfg > 1.0 and cond.negative_embeds is not None
    if guided:  # one batch: negative rows first
        context, pooled = cat([cond.negative_embeds, cond.embeds], 0), cat([cond.negative_pooled, cond.pooled], 0)
    else:
        context, pooled = cond.embeds, cond.pooled
    rows = 2 * B if guided else B
    img_ids, txt_ids = latent_image_ids(h, w), text_ids(context.shape[1])
    scale = full((rows,), float(guidance)) if transformer.config.guidance_embeds else None
    if predict is None:
        predict = CapturedStep(transformer.__call__, enabled=cuda_graph)

    def velocity(x, t):
        out = predict(cat([x, x], 0) if guided else x, context, pooled, mul(t, 1e-3), img_ids, txt_ids, scale)
        out = to(out, float32)
        return guide(out, B, true_cfg) if guided else out

    return unpack_latents(sampler_loop(sampler, pack_latents(noise), velocity, rows, progress), h, w)


def generate(transformer, vae, cond: FluxConditioning, scheduler_config: dict, steps=28,
             guidance=DEFAULT_GUIDANCE, true_cfg=1.0, width=1024, height=1024, seed=0, sampler="flow_euler",
             cuda_graph=True, progress=None, predict=None) -> list:
    """Images for prompts already encoded (``cond``): noise from ``seed``, the sampler's loop (its
    resolution-dependent shift from the image's tokens), the VAE decode. flame's generator state is
    the same afterwards."""
    vae_factor = vae.config.downsample_factor
    check_image_size(width, height, 2 * vae_factor)
    if sampler not in FLOW_SAMPLERS:
        raise ValueError(f"sampler: Flux samples with {', '.join(FLOW_SAMPLERS)}, got {sampler!r}")
    rng = get_rng_state()
    try:
        h, w = height // vae_factor, width // vae_factor
        noise = initial_noise(len(cond), (transformer.config.in_channels // 4, h, w), seed)
        manual_seed(seed)
        chosen = make_sampler(sampler, steps, scheduler_config, image_seq_len=(h // 2) * (w // 2))
        latents = denoise(transformer, cond, noise, chosen, guidance, true_cfg, cuda_graph=cuda_graph,
                          progress=progress, predict=predict)
        return decode(vae, latents)
    finally:
        set_rng_state(rng)


def scheduler_settings(path, transformer_variant: str) -> dict:
    """The scheduler config of a pipeline folder (``scheduler/scheduler_config.json``), else the
    default of the variant ("dev": dynamic shift, "schnell": none)."""
    p = pathlib.Path(path) / "scheduler" / "scheduler_config.json" if path is not None else None
    if p is not None and p.is_file():
        return json.loads(p.read_text())
    return dict(FLUX_SCHEDULER_CONFIG if transformer_variant == "dev" else FLUX_SCHNELL_SCHEDULER_CONFIG)


def component_sources(path, base=None, text_encoder=None, text_encoder_2=None, vae=None) -> dict:
    """Where each part of a Flux pipeline comes from: ``path`` (a pipeline folder, or the
    transformer's single file), ``base`` (a pipeline folder for the tokenizers, the scheduler config
    and every component not given; default ``path`` when it is a folder) and the single files
    people download (``clip_l.safetensors``, ``t5xxl_fp16.safetensors``, ``ae.safetensors``).
    FileNotFoundError when a part has no source."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Flux checkpoint {str(path)!r} does not exist")
    base = pathlib.Path(base) if base is not None else (p if p.is_dir() else None)
    out = {"transformer": p, "base": base, "text_encoder": text_encoder or base, "text_encoder_2": text_encoder_2
           or base, "vae": vae or base}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise FileNotFoundError(f"{path} is a single file, which holds the transformer only: give a Flux pipeline "
                                f"folder for the tokenizers and the rest (--base), or the files of "
                                f"{', '.join(m for m in missing if m != 'base')}")
    for name, v in out.items():
        if not pathlib.Path(v).exists():
            raise FileNotFoundError(f"Flux {name}: {v} does not exist")
    return out


def transformer_config(sources: dict):
    """The transformer's ``FluxConfig``: a folder's config.json; for a single file the config.json of
    ``base``'s ``transformer/`` when there is one (the model the file belongs to), else the config
    read from the file's tensor shapes."""
    single, base = pathlib.Path(sources["transformer"]), sources["base"]
    if single.is_file() and base is not None and (pathlib.Path(base) / "transformer" / "config.json").is_file():
        return FluxTransformer2DModel.pretrained_config(pathlib.Path(base) / "transformer")
    return FluxTransformer2DModel.pretrained_config(single)


def load_transformer(sources: dict, dtype=None) -> FluxTransformer2DModel:
    """The transformer of ``component_sources``' answer, of ``transformer_config``."""
    single = pathlib.Path(sources["transformer"]).is_file()
    return FluxTransformer2DModel.from_pretrained(sources["transformer"], dtype=dtype,
                                                  config=transformer_config(sources) if single else None)


def load_text_encoders(sources: dict, dtype=None) -> FluxTextEncoders:
    """``FluxTextEncoders`` of ``component_sources``' answer."""
    return FluxTextEncoders.from_pretrained(None, dtype=dtype, tokenizer_path=sources["base"],
                                            text_encoder=sources["text_encoder"],
                                            text_encoder_2=sources["text_encoder_2"])


def load_vae(source, dtype=None) -> AutoencoderKL:
    """The Flux VAE of a pipeline folder, a ``vae/`` folder or ``ae.safetensors`` (BFL's names)."""
    return AutoencoderKL.from_pretrained(source, dtype=dtype)


def default_dtype(dtype):
    """``dtype``, or bf16 on a GPU and fp32 on the interpreter."""
    return dtype if dtype is not None else (float32 if runtime.is_interpreter() else bfloat16)


class FluxPipeline:
    """The transformer, both text encoders (with their tokenizers) and the VAE of one Flux.1 model."""

    def __init__(self, transformer: FluxTransformer2DModel, text_encoders: FluxTextEncoders, vae: AutoencoderKL,
                 scheduler_config: dict | None = None, source: str = ""):
        self.transformer, self.text_encoders, self.vae = transformer, text_encoders, vae
        self.variant = variant(transformer)
        self.scheduler_config = dict(scheduler_config or scheduler_settings(None, self.variant))
        self.source = str(source)
        self.loras = []
        self.predict = CapturedStep(transformer.__call__)  # its graphs outlive a call: captured once per shape

    @classmethod
    def from_pretrained(cls, path, dtype=None, vae_dtype=None, base=None, text_encoder=None, text_encoder_2=None,
                        vae=None) -> FluxPipeline:
        """A diffusers Flux pipeline folder (transformer/, vae/, text_encoder/, text_encoder_2/,
        tokenizer/, tokenizer_2/, scheduler/), or the transformer's single file with the other parts
        from ``base`` and/or their own files (``component_sources``). ``dtype``: transformer and text
        encoders (default bf16 on a GPU, fp32 on the interpreter); ``vae_dtype`` defaults to ``dtype``."""
        sources = component_sources(path, base, text_encoder, text_encoder_2, vae)
        dtype = default_dtype(dtype)
        text = load_text_encoders(sources, dtype)
        autoencoder = load_vae(sources["vae"], vae_dtype if vae_dtype is not None else dtype)
        transformer = load_transformer(sources, dtype)
        return cls(transformer, text, autoencoder, scheduler_settings(sources["base"], variant(transformer)),
                   source=str(path))

    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: 512 for dev, 256 for schnell (FluxPipeline's defaults)."""
        return MAX_SEQUENCE_LENGTH[self.variant]

    def load_lora(self, path, strength: float = 1.0) -> list:
        """Add a LoRA file (PEFT/diffusers or kohya) into the transformer's weights at ``strength``;
        returns the layers it changed. Files load one after another, each folded in before the next."""
        names = add_lora(self.transformer, path, strength, "Flux transformer", "transformer")
        self.loras.append((pathlib.Path(path).name, float(strength)))
        return names

    def __call__(self, prompts, negative_prompt=None, steps: int | None = None, guidance: float = DEFAULT_GUIDANCE,
                 true_cfg: float = 1.0, width: int = 1024, height: int = 1024, seed: int = 0,
                 sampler: str = "flow_euler", max_sequence_length: int | None = None, cuda_graph: bool = True,
                 progress=None) -> list:
        """Images ((H, W, 3) uint8 arrays), one per prompt; ``steps`` defaults to 28 for dev and 4 for
        schnell; ``progress`` is called after each step."""
        cond = encode_prompts(self.text_encoders, prompts, negative_prompt,
                              max_sequence_length or self.max_sequence_length)
        return generate(self.transformer, self.vae, cond, self.scheduler_config,
                        steps=steps or DEFAULT_STEPS[self.variant], guidance=guidance, true_cfg=true_cfg, width=width,
                        height=height, seed=seed, sampler=sampler, cuda_graph=cuda_graph, progress=progress,
                        predict=self.predict if cuda_graph else None)
