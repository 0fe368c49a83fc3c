"""Training-side reader of occlusion manifests: (occluded image, clean image, mask, label)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from vlm_assets.data.occlusion import ManifestImages, read_manifest


def decode_png(data: bytes) -> np.ndarray:
    """PNG (or any Pillow-readable) bytes -> (H, W, 3) uint8 RGB."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def preprocess(
    image: np.ndarray, box: Sequence[int], image_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preprocess an image for training, evaluation and serving alike; return ``(occluded, clean, mask)``.

    The input is (H, W, C) uint8 + a box in image pixels; the outputs are at ``image_size`` x ``image_size``.
    The clean image is resized first (bilinear, antialiased), the mask nearest, and the box is blacked
    out after resizing, so its edges stay sharp (occluding first and resizing would blur them).
    ``clean`` and ``occluded`` are (3, S, S) in [0, 1] (grey is repeated to RGB), ``mask`` (1, S, S).
    """
    clean = torch.from_numpy(np.array(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    if clean.shape[0] == 1:
        clean = clean.expand(3, -1, -1)
    height, width = clean.shape[1:]
    x0, y0, x1, y1 = (int(v) for v in box)
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise ValueError(f"box {[x0, y0, x1, y1]} is not inside the {width}x{height} image")
    mask = torch.zeros(1, height, width)
    mask[:, y0:y1, x0:x1] = 1.0
    size = (image_size, image_size)
    if (height, width) != size:
        clean = F.interpolate(clean[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        clean = clean.clamp_(0.0, 1.0)
        mask = F.interpolate(mask[None], size=size, mode="nearest")[0]
    return clean * (1.0 - mask), clean, mask


class OcclusionDataset(Dataset):
    """Rows of ``<root>/<split>.jsonl`` as ``(occluded, clean, mask, label_index)`` through ``preprocess``."""

    def __init__(self, root: str | Path, split: str, image_size: int):
        if image_size < 1:
            raise ValueError(f"image_size must be positive, got {image_size}")
        self.root = Path(root)
        self.manifest = self.root / f"{split}.jsonl"
        if not self.manifest.is_file():
            raise FileNotFoundError(f"{self.manifest}: no manifest for split '{split}'")
        self.rows = read_manifest(self.manifest)
        self.images = ManifestImages(self.root)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        row = self.rows[i]
        occluded, clean, mask = preprocess(
            self.images.get(row, where=f"{self.manifest}:{i + 1}"), row["box"], self.image_size
        )
        return occluded, clean, mask, row["label_index"]


class OcclusionSamples(Dataset):
    """Manifest rows as dicts: occluded/clean pixels, mask, label index, prompt and answer text."""

    def __init__(self, root: Path, split: str, image_size: int, limit: int | None):
        self.images = OcclusionDataset(root, split, image_size)
        self.count = len(self.images) if limit is None else min(limit, len(self.images))

    def __len__(self) -> int:
        return self.count

    def check_images(self) -> None:
        """Open every row's image (memory-mapped, no decoding).

        A missing file or an index outside its pack raises here, naming the manifest line, instead of mid-epoch in a
        worker.
        """
        for i in range(self.count):
            self.images.images.get(self.images.rows[i], where=f"{self.images.manifest}:{i + 1}")

    def __getitem__(self, i: int) -> dict:
        occluded, clean, mask, label_index = self.images[i]
        row = self.images.rows[i]
        return {
            "occluded": occluded,
            "clean": clean,
            "mask": mask,
            "label_index": label_index,
            "prompt": row["prompt"],
            "answer": row["label"],
        }


def collate(samples: list[dict]) -> dict:
    """Stack samples into a batch: the image tensors stacked, the labels a tensor, prompts and answers lists."""
    out = {k: torch.stack([s[k] for s in samples]) for k in ("occluded", "clean", "mask")}
    out["label_index"] = torch.tensor([s["label_index"] for s in samples])
    out["prompt"] = [s["prompt"] for s in samples]
    out["answer"] = [s["answer"] for s in samples]
    return out


def class_names(manifests_dir: Path) -> list[str]:
    """Return the class names recorded in ``dataset.json`` under ``manifests_dir``."""
    return json.loads((Path(manifests_dir) / "dataset.json").read_text())["class_names"]
