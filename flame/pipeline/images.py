"""Writing generated images: PNGs (Pillow) carrying their generation parameters, and grids.

Each PNG holds two text chunks: ``parameters``, the prompt and settings in the layout most image
tools read (prompt, then ``Negative prompt: ...``, then ``Steps: 30, Sampler: euler, ...``), and
``flame``, the same settings as JSON.
"""
from __future__ import annotations

import json
import math
import pathlib

from ..io import atomic_write

_LABELS = (("steps", "Steps"), ("sampler", "Sampler"), ("cfg", "CFG scale"), ("guidance", "Guidance"), ("seed", "Seed"),
           ("size", "Size"), ("model", "Model"), ("loras", "LoRAs"), ("step", "Training step"))


def parameters_text(settings: dict) -> str:
    """The ``parameters`` chunk for ``settings`` (prompt, negative_prompt, steps, sampler, cfg,
    guidance, seed, size, model, loras; missing ones are left out)."""
    lines = [settings.get("prompt", "")]
    if settings.get("negative_prompt"):
        lines.append(f"Negative prompt: {settings['negative_prompt']}")
    fields = [f"{label}: {settings[key]}" for key, label in _LABELS if settings.get(key) not in (None, "", [])]
    lines.append(", ".join(fields))
    return "\n".join(lines)


def save_png(image, path, settings: dict) -> pathlib.Path:
    """Write ``image`` ((H, W, 3) uint8 array) to ``path`` as a PNG with ``settings`` in its text
    chunks; written to a temporary file and renamed, so no half-written PNG is left behind."""
    from PIL import Image, PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", parameters_text(settings))
    info.add_text("flame", json.dumps(settings, sort_keys=True))
    path = pathlib.Path(path)
    atomic_write(path, lambda f: Image.fromarray(image).save(f, format="PNG", pnginfo=info))
    return path


def save_grid(images: list, path, columns: int | None = None) -> pathlib.Path:
    """The images (equal sizes) side by side in ``columns`` columns (default about square), one PNG."""
    from PIL import Image
    cols = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    h, w = images[0].shape[:2]
    sheet = Image.new("RGB", (cols * w, rows * h))
    for k, im in enumerate(images):
        r, c = divmod(k, cols)
        sheet.paste(Image.fromarray(im), (c * w, r * h))
    path = pathlib.Path(path)
    atomic_write(path, lambda f: sheet.save(f, format="PNG"))
    return path
