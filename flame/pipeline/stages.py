"""The stages every text-to-image pipeline shares, whatever the model family: the initial noise of
a seed, the sampler's loop, the VAE decode to uint8 images, and the inputs of a command line
(prompt files, ``FILE:STRENGTH`` LoRA specs).

Reproducibility: image k of a call starts from noise drawn by flame's generator seeded with
``seed + k``, so an image can be regenerated alone from the seed in its metadata.
"""
from __future__ import annotations

import pathlib

import numpy as np

from ..autograd import no_grad
from ..io import load_lora
from ..models.vae import AutoencoderKL
from ..nn.lora import fold_lora
from ..ops.creation import manual_seed, randn, tensor
from ..ops.elementwise import add, clamp, mul, sub, to
from ..ops.shape import cat
from ..tensor import float32


def initial_noise(batch, latent_shape, seed):
    """(batch, *latent_shape) float32 noise, image k drawn after seeding flame's generator with seed + k."""
    parts = []
    for k in range(batch):
        manual_seed(seed + k)
        parts.append(randn(1, *latent_shape, dtype=float32))
    return parts[0] if batch == 1 else cat(parts, 0)


@no_grad()
def sampler_loop(sampler, noise, predict, rows: int, progress=None):
    """The sampler's loop from ``noise``: ``predict(x, t)`` is the model's (guided) output for the
    latents ``x`` (the sampler's scaled input) at the timesteps ``t`` (``rows`` copies of the step's
    timestep, float32 on the device); ``progress`` is called after each step. Returns the latents."""
    x = sampler.prepare_latents(noise)
    steps = np.asarray(sampler.timesteps, dtype=np.float32)
    all_t = tensor(np.repeat(steps[:, None], rows, axis=1))  # (steps, rows): one host copy, not one per step
    for i in range(len(steps)):
        x = sampler.step(predict(sampler.scale_model_input(x, i), all_t[i]), i, x)
        if progress is not None:
            progress()
    return x


def guide(out, batch: int, scale: float):
    """Classifier-free guidance of a model output over 2 ``batch`` rows, the unconditional rows
    first: ``uncond + scale (cond - uncond)`` (B rows)."""
    uncond, cond = out.narrow(0, 0, batch), out.narrow(0, batch, batch)
    return add(uncond, mul(sub(cond, uncond), float(scale)))


@no_grad()
def decode(vae: AutoencoderKL, latents, tile: bool | None = None) -> list:
    """Scaled latents -> [(H, W, 3) uint8 arrays]. ``tile``: decode in blended tiles (None: when
    the image has at least 4x the area of the VAE's sample size, 2048x2048 for SDXL and Flux,
    where an untiled decode's activations take several GB)."""
    if tile is None:
        pixels = latents.shape[2] * latents.shape[3] * vae.config.downsample_factor ** 2
        tile = pixels >= 4 * vae.config.sample_size ** 2
    images = vae.decode_latents(to(latents, vae.dtype), tile=tile)
    pixels = clamp(mul(add(to(images, float32), 1.0), 127.5), 0.0, 255.0).numpy()  # host transfer
    return [np.rint(p).astype(np.uint8).transpose(1, 2, 0) for p in pixels]


def check_image_size(width, height, factor: int) -> None:
    """ValueError unless ``width`` and ``height`` are positive multiples of ``factor`` pixels."""
    if width % factor or height % factor or width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive multiples of {factor}, got {width}x{height}")


def add_lora(model, path, strength: float, what: str, prefix: str) -> list:
    """Add a LoRA file (PEFT/diffusers keys under ``prefix``, e.g. "unet" or "transformer", or kohya)
    into ``model``'s weights at ``strength``; returns the layers it changed. ``model`` may be
    {prefix: model} for a pipeline's models (SDXL's UNet and text encoders): each takes the file's
    adapters under its prefix (``flame.io.load_lora``), the names returned of models after the first
    prefixed. The file is checked whole first: a LoRA for another model raises ValueError naming
    ``what`` and changes nothing."""
    try:
        loaded = load_lora(model, path, prefix=prefix, inject=True)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a LoRA for this {what}: {e.args[0] if e.args else e}") from None
    if not isinstance(model, dict):
        fold_lora(model, strength)
        return loaded
    first = next(iter(model))
    for p in loaded:
        fold_lora(model[p], strength)
    return [n if p == first else f"{p}.{n}" for p, names in loaded.items() for n in names]


def read_prompt_file(path) -> list:
    """One prompt per line of ``path``; empty lines and lines starting with # are skipped."""
    lines = [line.strip() for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def parse_lora(spec: str):
    """``FILE`` or ``FILE:STRENGTH`` -> (path, strength)."""
    path, sep, strength = spec.rpartition(":")
    if sep:
        try:
            return pathlib.Path(path), float(strength)
        except ValueError:
            pass
    return pathlib.Path(spec), 1.0
