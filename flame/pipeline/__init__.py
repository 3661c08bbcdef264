"""Image generation with flame's models: ``SDXLPipeline`` and ``FluxPipeline`` (and their stages),
PNG output with generation metadata, and the ``flame-sample`` command."""
from .images import parameters_text, save_grid, save_png
from .sdxl import (
                   Conditioning,
                   SDXLPipeline,
                   denoise,
                   encode_prompts,
                   generate,
                   pipeline_settings,
                   time_ids_for,
)
from .stages import decode, initial_noise, parse_lora, read_prompt_file
