"""Image generation with flame's SDXL models: ``SDXLPipeline`` (and its stages ``encode_prompts``,
``denoise``, ``decode``, ``generate``), PNG output with generation metadata, and the ``flame-sample``
command."""
from .images import parameters_text, save_grid, save_png
from .sdxl import (
                   Conditioning,
                   SDXLPipeline,
                   decode,
                   denoise,
                   encode_prompts,
                   generate,
                   parse_lora,
                   pipeline_settings,
                   read_prompt_file,
                   time_ids_for,
)
