"""Training-side reader of occlusion manifests: (occluded image, clean image, mask, label)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from vlm_assets.data.occlusion import ManifestImages, read_manifest


class OcclusionDataset(Dataset):
    """Rows of ``<root>/<split>.jsonl`` as float tensors at ``image_size`` x ``image_size``.

    Each item is ``(occluded, clean, mask, label_index)``: ``clean`` and ``occluded`` are (3, S, S) in
    [0, 1] (grey sources are repeated to RGB), ``mask`` is (1, S, S) with 1 inside the box, and
    ``occluded = clean * (1 - mask)``. Resizing is bilinear for pixels, nearest for the mask.
    """

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
        image = self.images.get(row, where=f"{self.manifest}:{i + 1}")
        clean = torch.from_numpy(np.array(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        if clean.shape[0] == 1:
            clean = clean.expand(3, -1, -1)
        x0, y0, x1, y1 = row["box"]
        mask = torch.zeros(1, *clean.shape[1:])
        mask[:, y0:y1, x0:x1] = 1.0
        size = (self.image_size, self.image_size)
        if clean.shape[1:] != size:
            clean = F.interpolate(clean[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]
            clean = clean.clamp_(0.0, 1.0)
            mask = F.interpolate(mask[None], size=size, mode="nearest")[0]
        return clean * (1.0 - mask), clean, mask, row["label_index"]
