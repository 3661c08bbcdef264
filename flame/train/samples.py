"""Sample images during training (the config's ``sample:`` section).

At setup the prompts are encoded once by both text encoders, which then leave GPU memory; the VAE
stays (about 170 MB in bf16). At a sampling step the UNet being trained (its adapters live, in eval
mode, cast to the UNet's dtype once for all prompts: ``amp.ParameterCasts``) runs the sampler's loop
for each prompt in turn, eagerly: the training step's CUDA graph is left as it is, and the extra
memory is one no-grad forward of batch 2 and one VAE decode. flame's random generator is restored
afterwards, so sampling does not change the training run.

Images go to ``output.dir/samples/step-N/NN.png`` with their settings in the PNG metadata.
"""
from __future__ import annotations

import pathlib

from ..amp import ParameterCasts
from ..models.sdxl_text import SDXLTextEncoders
from ..models.vae import AutoencoderKL
from ..nn.lora import lora_parameters
from ..pipeline import save_png
from ..pipeline.sdxl import encode_prompts, generate, pipeline_settings, read_prompt_file


class TrainingSamples:
    """The encoded prompts and the VAE of a run's ``sample`` config, and ``render(unet, step)``."""

    def __init__(self, sample_cfg, source, dtype, default_size: int):
        s = sample_cfg
        self.cfg = s
        self.prompts = read_prompt_file(s.prompts) if isinstance(s.prompts, str) else list(s.prompts)
        self.width = s.width or default_size
        self.height = s.height or default_size
        self.scheduler_config, force_zeros = pipeline_settings(source)
        encoders = SDXLTextEncoders.from_pretrained(source, dtype=dtype, tokenizer_path=s.tokenizers)
        self.conditioning = [encode_prompts(encoders, [p], s.negative_prompt, force_zeros, s.max_tokens)
                             for p in self.prompts]
        del encoders  # the text encoders leave GPU memory here
        self.vae = AutoencoderKL.from_pretrained(source, dtype=dtype)
        self.source = pathlib.Path(source).name

    def render(self, unet, step: int, folder) -> list:
        """One image per prompt from ``unet`` into ``folder/step-{step}/``; returns the paths."""
        s = self.cfg
        out = pathlib.Path(folder) / f"step-{step}"
        out.mkdir(parents=True, exist_ok=True)
        was_training = unet.training
        unet.eval()
        paths = []
        try:  # the adapters do not change while sampling: cast once for every UNet call, not once per call and layer
            with ParameterCasts(lora_parameters(unet), unet.dtype):
                for k, (prompt, cond) in enumerate(zip(self.prompts, self.conditioning)):
                    image, = generate(unet, self.vae, cond, self.scheduler_config, steps=s.steps, cfg=s.cfg,
                                      width=self.width, height=self.height, seed=s.seed, sampler=s.sampler,
                                      cuda_graph=False)
                    settings = {"prompt": prompt, "negative_prompt": s.negative_prompt or "", "steps": s.steps,
                                "sampler": s.sampler, "cfg": s.cfg, "seed": s.seed,
                                "size": f"{self.width}x{self.height}", "model": self.source, "step": step}
                    paths.append(str(save_png(image, out / f"{k:02d}.png", settings)))
        finally:
            unet.train(was_training)
        return paths

