"""Images of ViT examples with one latent's activation drawn over its patches.

Each example is shown as the model saw it: the original image from the run's dataset link,
passed through the model's own image processor (resize, crop) and un-normalised; below it
the same image with patches tinted red in proportion to the latent's activation (relative
to the latent's strongest activation) and the strongest patch outlined.

Examples are found by index in the dataset the way capture enumerated them: an image
folder is every image file below the root in sorted path order; a dataset saved with
``datasets.save_to_disk`` is indexed in its own order.

Example:
    >>> images = open_images("/data/imagenet/val", n_examples=50000)  # doctest: +SKIP
    >>> tile = render_example(images.load(12), heat, view=ModelView.load(ckpt))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from ..capture.data import image_files
from ..errors import ConfigError, StoreNotFoundError
from .text import font

log = logging.getLogger(__name__)

HEAT_RGB = (255, 40, 0)
PEAK_RGB = (255, 230, 0)
CAPTION_HEIGHT = 18


class ImageDataset:
    """Index -> PIL image, in capture's order."""

    def __init__(
        self, root: Path, files: list[Path] | None, hf: Any = None, column: str | None = None
    ) -> None:
        self.root, self.files, self.hf, self.column = root, files, hf, column

    def __len__(self) -> int:
        return len(self.files) if self.files is not None else len(self.hf)

    def describe(self, index: int) -> str:
        """Short name of example ``index`` (its path below the root, or its row)."""
        if self.files is not None:
            return str(self.files[index].relative_to(self.root))
        return f"row {index}"

    def load(self, index: int) -> Image.Image:
        if self.files is not None:
            with Image.open(self.files[index]) as image:
                return image.convert("RGB")
        return self.hf[index][self.column].convert("RGB")


def open_images(root: str | Path, n_examples: int) -> ImageDataset:
    """The dataset at ``root`` (image folder or saved HF dataset), checked to hold at least
    the ``n_examples`` the shards describe."""
    root = Path(root)
    if not root.exists():
        raise StoreNotFoundError(f"dataset {root} does not exist")
    if (root / "dataset_dict.json").exists():
        raise ConfigError(
            f"{root} is a DatasetDict with several splits; point the run's dataset link at "
            f"the captured split's directory (e.g. {root}/train)"
        )
    if (root / "dataset_info.json").exists():
        from ..errors import require

        datasets = require("datasets", "datasets")
        ds = datasets.load_from_disk(str(root))
        column = next((c for c in ("image", "img") if c in ds.column_names), None)
        if column is None:
            raise ConfigError(f"{root} has no image column (columns: {ds.column_names})")
        dataset = ImageDataset(root, None, ds, column)
    elif root.is_dir():
        dataset = ImageDataset(root, image_files(root))
    else:
        raise ConfigError(f"{root} is not an image folder or a saved Hugging Face dataset")
    if len(dataset) < n_examples:
        raise ConfigError(
            f"dataset {root} holds {len(dataset)} images but the shards hold {n_examples} "
            "examples: the dataset link points at a different dataset"
        )
    return dataset


@dataclass
class ModelView:
    """Turns an image into what the model saw (its processor, un-normalised)."""

    processor: Any = None

    @classmethod
    def load(cls, ckpt: str) -> ModelView:
        """The image processor saved with ``ckpt``; without one, a centre square crop."""
        from transformers import AutoImageProcessor

        from ..capture.models import quiet_transformers

        try:
            with quiet_transformers():
                return cls(AutoImageProcessor.from_pretrained(ckpt))
        except (OSError, ValueError) as err:
            log.warning("no image processor for %s (%s); showing centre crops", ckpt, err)
            return cls(None)

    def __call__(self, image: Image.Image) -> Image.Image:
        if self.processor is None:
            side = min(image.size)
            left, top = (image.width - side) // 2, (image.height - side) // 2
            return image.crop((left, top, left + side, top + side))
        pixels = self.processor(images=image, return_tensors="np")["pixel_values"][0]
        mean = np.asarray(getattr(self.processor, "image_mean", None) or 0.0).reshape(-1, 1, 1)
        std = np.asarray(getattr(self.processor, "image_std", None) or 1.0).reshape(-1, 1, 1)
        scale = 1.0 / float(getattr(self.processor, "rescale_factor", 1 / 255))
        rgb = (pixels * std + mean) * scale
        return Image.fromarray(np.clip(rgb, 0, 255).round().astype(np.uint8).transpose(1, 2, 0))


def patch_grid(n_patches: int) -> int:
    """Side of the square patch grid (an error for a non-square count)."""
    side = math.isqrt(n_patches)
    if side * side != n_patches:
        raise ConfigError(f"{n_patches} patches do not form a square grid; cannot place them")
    return side


def render_example(
    image: Image.Image, heat: np.ndarray, *, scale_max: float, size: int, caption: str
) -> Image.Image:
    """``image`` at ``size`` x ``size``, below it the same with ``heat`` (one value per
    patch, row-major) tinted over it and the peak patch outlined, then ``caption``."""
    side = patch_grid(len(heat))
    base = image.resize((size, size), Image.Resampling.BICUBIC).convert("RGBA")
    overlay = Image.new("RGBA", base.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(overlay)
    step = size / side
    peak = int(np.argmax(heat))
    for p, value in enumerate(heat):
        if value <= 0:
            continue
        r, c = divmod(p, side)
        box = (
            round(c * step),
            round(r * step),
            round((c + 1) * step) - 1,
            round((r + 1) * step) - 1,
        )
        alpha = int(200 * min(1.0, float(value) / scale_max))
        draw.rectangle(box, fill=(*HEAT_RGB, alpha))
    if heat[peak] > 0:
        r, c = divmod(peak, side)
        box = (
            round(c * step),
            round(r * step),
            round((c + 1) * step) - 1,
            round((r + 1) * step) - 1,
        )
        draw.rectangle(box, outline=(*PEAK_RGB, 255), width=2)
    tile = Image.new("RGB", (size, 2 * size + 2 + CAPTION_HEIGHT), "white")
    tile.paste(base.convert("RGB"), (0, 0))
    tile.paste(Image.alpha_composite(base, overlay).convert("RGB"), (0, size + 2))
    ImageDraw.Draw(tile).text((3, 2 * size + 4), caption, fill="black", font=font(12))
    return tile


def tile_row(tiles: list[Image.Image], gap: int = 4) -> Image.Image:
    """Tiles side by side on a white background."""
    width = sum(t.width for t in tiles) + gap * (len(tiles) - 1)
    height = max(t.height for t in tiles)
    out = Image.new("RGB", (max(width, 1), height), "white")
    x = 0
    for t in tiles:
        out.paste(t, (x, 0))
        x += t.width + gap
    return out
