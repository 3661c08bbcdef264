"""Aspect-ratio buckets: image sizes in multiples of 64 px with about the same pixel area.

SDXL trainers (kohya's sd-scripts, diffusers' examples, SimpleTuner) resize each image to the
bucket whose aspect ratio is closest to its own, scaling it to cover the bucket and cropping the
overflow, so every batch has one shape and little of any image is lost. The crop offset and the
original size go to the model as the SDXL size/crop conditioning (``time_ids``).
"""
from __future__ import annotations

import math

# pixels a bucket side must be a multiple of, per model family: SDXL's latents are 1/8 of the image and
# its UNet halves them three times (64); Flux's are 1/8 and its transformer takes 2x2 patches (16)
BUCKET_UNIT = {"sdxl": 64, "flux": 16}


def make_buckets(area: int = 1024 * 1024, step: int = 64, min_side: int = 512, max_side: int = 2048) -> list:
    """(width, height) pairs, both multiples of ``step`` within [min_side, max_side]: the square of
    side floor(sqrt(area)) (rounded down to ``step``) and, for every width, the largest height whose
    area is at most ``area`` (kohya's rule); sorted by aspect ratio."""
    for name, v in (("area", area), ("step", step), ("min_side", min_side), ("max_side", max_side)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"make_buckets: {name} must be a positive int, got {v!r}")
    if min_side % step or max_side % step or min_side > max_side:
        raise ValueError(f"make_buckets: need min_side <= max_side, both multiples of step={step} "
                         f"(got {min_side}, {max_side})")
    side = math.isqrt(area) // step * step
    out = {(side, side)} if min_side <= side <= max_side else set()
    for w in range(min_side, max_side + 1, step):
        h = min(max_side, area // w // step * step)
        if h >= min_side:
            out.update({(w, h), (h, w)})
    if not out:
        raise ValueError(f"make_buckets: no bucket of area <= {area} with sides in [{min_side}, {max_side}]")
    return sorted(out, key=lambda wh: (wh[0] / wh[1], wh[0]))


def nearest_bucket(width: int, height: int, buckets) -> tuple:
    """The bucket whose aspect ratio is closest to width/height (in log ratio; ties: larger area)."""
    if width < 1 or height < 1:
        raise ValueError(f"nearest_bucket: image size must be positive, got {width}x{height}")
    r = math.log(width / height)
    return min(buckets, key=lambda wh: (abs(math.log(wh[0] / wh[1]) - r), -wh[0] * wh[1]))


def fit_to_bucket(width: int, height: int, bucket, rng=None) -> tuple:
    """How to bring an image to ``bucket`` (bw, bh): scale to cover it, then crop.

    Returns ``(resized_w, resized_h, crop_left, crop_top)``; the crop is centred, or drawn from
    ``rng`` (a NumPy ``Generator``) when one is given.
    """
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if rng is None:
        return rw, rh, (rw - bw) // 2, (rh - bh) // 2
    return rw, rh, int(rng.integers(0, rw - bw + 1)), int(rng.integers(0, rh - bh + 1))
