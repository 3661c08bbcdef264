"""Sample images during training (the config's ``sample:`` section), for SDXL and Flux.

At setup the prompts are encoded once by the family's text encoders, which then leave GPU memory
(T5-XXL's ~9.5 GB included: they come and go before the model being trained loads; SDXL's text
encoders trained with ``lora.text_encoder`` stay and encode the prompts at each sampling); the VAE stays
(about 170 MB in bf16). At a sampling step the model being trained (its adapters live, in eval
mode, cast to the model's dtype once for all prompts: ``amp.ParameterCasts``) runs the sampler's
loop for each prompt in turn, eagerly: the training step's CUDA graph is left as it is, and the
extra memory is one no-grad forward (batch 2 with classifier-free guidance) and one VAE decode.
flame's random generator is restored afterwards, so sampling does not change the training run.

Images go to ``output.dir/samples/step-N/NN.png`` with their settings in the PNG metadata.
"""
from __future__ import annotations

import contextlib
import pathlib

from ..amp import ParameterCasts
from ..models.sdxl_text import SDXLTextEncoders
from ..models.vae import AutoencoderKL
from ..nn.lora import lora_parameters
from ..pipeline import flux, sdxl
from ..pipeline.images import save_png
from ..pipeline.stages import read_prompt_file


class TrainingSamples:
    """A run's encoded sample prompts and VAE, and ``render(model, step, folder)``.

    ``conditioning``: one encoded prompt per prompt, or ``encode(prompt)`` making it at each
    sampling (from text encoders being trained); ``make_image(model, vae, cond, width, height)``
    -> the (H, W, 3) uint8 image of one; ``settings``: what the PNGs record besides prompt, seed,
    size, model and step."""

    def __init__(self, sample_cfg, prompts, conditioning, vae, make_image, settings: dict, width, height, source,
                 encode=None):
        self.cfg, self.prompts, self.conditioning, self.vae = sample_cfg, prompts, conditioning, vae
        self.encode = encode
        self.make_image, self.settings = make_image, settings
        self.width, self.height = width, height
        self.source = pathlib.Path(source).name

    def render(self, model, step: int, folder) -> list:
        """One image per prompt from ``model`` into ``folder/step-{step}/``; returns the paths."""
        s = self.cfg
        out = pathlib.Path(folder) / f"step-{step}"
        out.mkdir(parents=True, exist_ok=True)
        was_training = model.training
        model.eval()
        paths = []
        try:  # the adapters do not change while sampling: cast once for every model call, not once per call and layer
            with ParameterCasts(lora_parameters(model), model.dtype):
                for k, prompt in enumerate(self.prompts):
                    cond = self.conditioning[k] if self.encode is None else self.encode(prompt)
                    image = self.make_image(model, self.vae, cond, self.width, self.height)
                    settings = {"prompt": prompt, "negative_prompt": s.negative_prompt or "", **self.settings,
                                "seed": s.seed, "size": f"{self.width}x{self.height}", "model": self.source,
                                "step": step}
                    paths.append(str(save_png(image, out / f"{k:02d}.png", settings)))
        finally:
            model.train(was_training)
        return paths

    def render_in_run(self, model, step: int, folder, averaged=None, text_encoders=None) -> list:
        """``render`` during a training run: with ``averaged`` (the run's ``optim.EMA``, for
        ``sample.use_ema``) applied to the weights meanwhile, and ``text_encoders`` (a
        ``TextEncoderLoRA`` being trained) out of training mode meanwhile."""
        try:
            with averaged.applied() if averaged is not None else contextlib.nullcontext():
                if text_encoders is not None:
                    text_encoders.train(False)
                return self.render(model, step, folder)
        finally:
            if text_encoders is not None:
                text_encoders.train(True)


def _prompts(s) -> list:
    return read_prompt_file(s.prompts) if isinstance(s.prompts, str) else list(s.prompts)


def sdxl_samples(sample_cfg, source, dtype, default_size: int, text_encoders=None) -> TrainingSamples:
    """SDXL's: both CLIP encoders and the VAE of ``source`` (a pipeline folder or checkpoint file);
    ``text_encoders``: those being trained (``lora.text_encoder``), which encode the prompts at each
    sampling instead."""
    s = sample_cfg
    prompts = _prompts(s)
    scheduler_config, force_zeros = sdxl.pipeline_settings(source)

    def encode(prompt, encoders=text_encoders):
        return sdxl.encode_prompts(encoders, [prompt], s.negative_prompt, force_zeros, s.max_tokens)

    conditioning = None
    if text_encoders is None:
        encoders = SDXLTextEncoders.from_pretrained(source, dtype=dtype, tokenizer_path=s.tokenizers)
        conditioning = [encode(p, encoders) for p in prompts]
        del encoders  # the text encoders leave GPU memory here
    vae = AutoencoderKL.from_pretrained(source, dtype=dtype)
    steps, cfg, sampler = s.steps or 25, 5.0 if s.cfg is None else s.cfg, s.sampler or "euler"

    def make_image(unet, vae, cond, width, height):
        return sdxl.generate(unet, vae, cond, scheduler_config, steps=steps, cfg=cfg, width=width, height=height,
                             seed=s.seed, sampler=sampler, cuda_graph=False)[0]

    return TrainingSamples(s, prompts, conditioning, vae, make_image, {"steps": steps, "sampler": sampler, "cfg": cfg},
                           s.width or default_size, s.height or default_size, source,
                           encode=None if text_encoders is None else encode)


def flux_samples(sample_cfg, source, dtype, transformer_config) -> TrainingSamples:
    """Flux's: CLIP-L, T5 and the VAE of ``source`` (a Flux pipeline folder); dev or schnell
    defaults from ``transformer_config`` (the model being trained); images of the VAE's sample
    size (1024) unless the config says otherwise."""
    s = sample_cfg
    prompts = _prompts(s)
    sources = flux.component_sources(source)
    kind = flux.variant(transformer_config)
    encoders = flux.load_text_encoders(sources, dtype)
    length = s.max_sequence_length or flux.MAX_SEQUENCE_LENGTH[kind]
    conditioning = [flux.encode_prompts(encoders, [p], s.negative_prompt, length) for p in prompts]
    del encoders  # T5 leaves GPU memory here
    vae = flux.load_vae(sources["vae"], dtype)
    scheduler_config = flux.scheduler_settings(sources["base"], kind)
    steps, sampler = s.steps or flux.DEFAULT_STEPS[kind], s.sampler or "flow_euler"
    cfg = 1.0 if s.cfg is None else s.cfg
    guidance = s.guidance if kind == "dev" else None

    def make_image(transformer, vae, cond, width, height):
        return flux.generate(transformer, vae, cond, scheduler_config, steps=steps, guidance=s.guidance,
                             true_cfg=cfg, width=width, height=height, seed=s.seed, sampler=sampler,
                             cuda_graph=False)[0]

    return TrainingSamples(s, prompts, conditioning, vae, make_image,
                           {"steps": steps, "sampler": sampler, "cfg": cfg, "guidance": guidance},
                           s.width or vae.config.sample_size, s.height or vae.config.sample_size, source)

