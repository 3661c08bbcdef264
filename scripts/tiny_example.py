"""Write a tiny SDXL example to train on without downloading anything: a random tiny SDXL pipeline
folder in diffusers' layout (the test suite's: 2-level UNet, 2-layer CLIP encoders, letter
tokenizers, an 8x VAE of 8 channels) and a kohya-style folder of captioned 64x64 images.

    python scripts/tiny_example.py out/tiny_example
    python scripts/train_lora.py configs/sdxl_lora_tiny_images.yaml   # reads out/tiny_example

The trainer then does what it does with a real checkpoint and a folder of photos: it encodes the
images and captions into a latent cache under the output folder, trains the LoRA from it, and on a
second run encodes only the images that changed. Needs the interop extra (diffusers, transformers),
which writes the random model."""
import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipeline the tests build

CAPTIONS = ["a red cat", "the cat in a box", "a blue cat", "the cat asleep"]  # the tiny tokenizer knows letters


def write_images(folder: pathlib.Path, repeats: int = 2, size: int = 64) -> pathlib.Path:
    """One kohya subfolder ``{repeats}_cat`` of ``len(CAPTIONS)`` striped images with .txt captions."""
    from PIL import Image
    subfolder = folder / f"{repeats}_cat"
    subfolder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    for i, caption in enumerate(CAPTIONS):
        stripes = (np.sin((x * np.cos(i) + y * np.sin(i)) / (3 + i)) + 1) * 0.5
        colour = rng.uniform(0.2, 1.0, 3)
        pixels = (stripes[..., None] * colour * 255).astype(np.uint8)
        Image.fromarray(pixels).save(subfolder / f"{i:02d}.png")
        (subfolder / f"{i:02d}.txt").write_text(caption)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path, nargs="?", default=ROOT / "out" / "tiny_example",
                        help="where to write model/ and images/ (default: out/tiny_example, "
                             "which configs/sdxl_lora_tiny_images.yaml reads)")
    args = parser.parse_args(argv)
    try:
        from tiny_sdxl import write_tiny_pipeline
    except ImportError as e:
        print(f"error: the tiny model is written by diffusers and transformers ({e}); "
              'pip install -e ".[interop]"', file=sys.stderr)
        return 2
    model = write_tiny_pipeline(args.folder / "model", vae_levels=4)  # SDXL's 8x: 64 px images, 8x8 latents
    images = write_images(args.folder / "images")
    print(f"wrote a tiny random SDXL pipeline to {model} and {len(CAPTIONS)} captioned images to {images}")
    print(f"train: flame-train-lora configs/sdxl_lora_tiny_images.yaml model.path={model} data.images={images}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
