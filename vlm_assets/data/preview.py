"""A contact sheet of occluded training images: what people look at instead of reading the JSONL."""

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlm_assets.data.occlusion import ManifestImages, read_manifest


def occlusion_preview(root: Path, split: str = "train", columns: int = 8, rows: int = 4, tile: int = 64) -> Image.Image:
    """The first ``columns * rows`` images of a split with their black boxes (outlined), ``tile`` px each."""
    records = read_manifest(root / f"{split}.jsonl")[: columns * rows]
    images = ManifestImages(root)
    sheet = Image.new("RGB", (columns * tile, rows * tile), "white")
    for i, row in enumerate(records):
        pixels = np.array(images.get(row))
        x0, y0, x1, y1 = row["box"]
        pixels[y0:y1, x0:x1] = 0
        img = Image.fromarray(pixels.squeeze(-1) if pixels.shape[-1] == 1 else pixels).convert("RGB")
        img = img.resize((tile, tile), Image.Resampling.NEAREST)
        sx, sy = tile / row["width"], tile / row["height"]
        # Outline the (black) box in red: on dark backgrounds a black box alone is invisible.
        ImageDraw.Draw(img).rectangle([x0 * sx, y0 * sy, x1 * sx - 1, y1 * sy - 1], outline=(255, 40, 40))
        sheet.paste(img, ((i % columns) * tile, (i // columns) * tile))
    return sheet
