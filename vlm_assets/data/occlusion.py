"""Occlusion manifests: one seeded black rectangle per image, JSONL manifests + packed images.

Artifact layout (a directory)::

    dataset.json            name, class names, split sizes, box bounds, seed
    train.jsonl             one row per image (see ``ManifestRow``)
    validation.jsonl
    images/train.npy        (N, H, W, C) uint8 clean images at source resolution
    images/validation.npy

Images are stored clean and at source resolution, packed in one ``.npy`` per split: no per-image
resize/PNG encode on write, one memory-mapped file on read. The box is applied (and the image resized)
by ``OcclusionDataset`` at whatever size training asks for; its pixel coordinates refer to the stored
image: ``[x0, y0, x1, y1]`` with ``x1``/``y1`` exclusive.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from vlm_assets.data.image_sources import ImageSource

SPLITS = ("train", "validation")
PROMPT_TEMPLATE = (
    "The image may be partially occluded. Answer with exactly one {dataset} class label: {labels}. "
    "What is the main object?"
)
_REQUIRED_FIELDS = {
    "id": str,
    "image": str,
    "index": int,
    "label": str,
    "label_index": int,
    "prompt": str,
    "box": list,
    "width": int,
    "height": int,
}


@dataclasses.dataclass(frozen=True)
class BoxBounds:
    """Box width and height are each a uniform fraction in [min_fraction, max_fraction] of the side."""

    min_fraction: float
    max_fraction: float

    def __post_init__(self):
        if not 0 < self.min_fraction <= self.max_fraction < 1:
            raise ValueError(
                f"box fractions must satisfy 0 < min <= max < 1, got min={self.min_fraction}, max={self.max_fraction}"
            )

    def pixel_range(self, side: int) -> tuple[int, int]:
        """Smallest and largest box side in pixels whose fraction of ``side`` stays within bounds."""
        low, high = math.ceil(self.min_fraction * side - 1e-9), math.floor(self.max_fraction * side + 1e-9)
        if low > high or low < 1:
            raise ValueError(
                f"an image side of {side} px admits no box between {self.min_fraction:.0%} "
                f"and {self.max_fraction:.0%} of it"
            )
        return low, high


def sample_boxes(rng: np.random.Generator, n: int, width: int, height: int, bounds: BoxBounds) -> np.ndarray:
    """(n, 4) int boxes ``[x0, y0, x1, y1]``; side fractions uniform in bounds, placement uniform."""
    boxes = np.empty((n, 4), np.int64)
    for axis, side in ((0, width), (1, height)):
        low, high = bounds.pixel_range(side)
        fraction = rng.uniform(bounds.min_fraction, bounds.max_fraction, n)
        length = np.clip(np.rint(fraction * side).astype(np.int64), low, high)
        start = rng.integers(0, side - length + 1)
        boxes[:, axis], boxes[:, axis + 2] = start, start + length
    return boxes


def balanced_subset(
    rng: np.random.Generator, labels: np.ndarray, num_classes: int, count: int | None, split: str
) -> np.ndarray:
    """Indices of ``count`` images, as equal per class as possible (seeded); all images if ``None``."""
    if count is None:
        return np.arange(len(labels))
    if count > len(labels):
        raise ValueError(f"num_{split}={count} exceeds the {len(labels)} images of the source's {split} split")
    quota = np.full(num_classes, count // num_classes)
    quota[: count % num_classes] += 1
    picked = []
    for cls in range(num_classes):
        members = np.flatnonzero(labels == cls)
        if len(members) < quota[cls]:
            raise ValueError(
                f"num_{split}={count} needs {quota[cls]} images of class {cls}, the source has {len(members)}"
            )
        picked.append(rng.permutation(members)[: quota[cls]])
    return np.sort(np.concatenate(picked))


def write_occlusion_manifests(
    source: ImageSource,
    out_dir: Path,
    *,
    num_train: int | None,
    num_validation: int | None,
    train_box: BoxBounds,
    validation_box: BoxBounds,
    seed: int,
) -> dict[str, Any]:
    """Write the artifact layout above into ``out_dir``; returns the ``dataset.json`` summary."""
    prompt = PROMPT_TEMPLATE.format(dataset=source.name, labels=", ".join(source.class_names))
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "name": source.name,
        "class_names": source.class_names,
        "prompt": prompt,
        "seed": seed,
        "box_bounds": {"train": dataclasses.asdict(train_box), "validation": dataclasses.asdict(validation_box)},
        "splits": {},
    }
    plan = (("train", source.train, num_train, train_box), ("validation", source.eval, num_validation, validation_box))
    for split_id, (split, data, count, bounds) in enumerate(plan):
        rng = np.random.default_rng([seed, split_id])
        index = balanced_subset(rng, data.labels, len(source.class_names), count, split)
        images = data.images[index]
        height, width = images.shape[1:3]
        boxes = sample_boxes(rng, len(index), width, height, bounds)
        image_ref = f"images/{split}.npy"
        np.save(out_dir / image_ref, np.ascontiguousarray(images))
        with open(out_dir / f"{split}.jsonl", "w") as f:
            for row, (src, box) in enumerate(zip(index, boxes.tolist())):
                label_index = int(data.labels[src])
                f.write(
                    json.dumps(
                        {
                            "id": f"{split}-{row:06d}",
                            "image": image_ref,
                            "index": row,
                            "label": source.class_names[label_index],
                            "label_index": label_index,
                            "prompt": prompt,
                            "box": box,
                            "width": int(width),
                            "height": int(height),
                            "origin": data.origins[src],
                        }
                    )
                    + "\n"
                )
        summary["splits"][split] = {
            "num_images": len(index),
            "width": int(width),
            "height": int(height),
            "channels": int(images.shape[3]),
            "class_counts": np.bincount(data.labels[index], minlength=len(source.class_names)).tolist(),
        }
    (out_dir / "dataset.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """Parse and validate a manifest; ``ValueError`` names the file, line and field at fault."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON: {err}") from err
            for field, kind in _REQUIRED_FIELDS.items():
                if not isinstance(row.get(field), kind):
                    raise ValueError(f"{where}: field '{field}' must be a {kind.__name__}, got {row.get(field)!r}")
            x0, y0, x1, y1 = _box(row, where)
            if not (0 <= x0 < x1 <= row["width"] and 0 <= y0 < y1 <= row["height"]):
                raise ValueError(
                    f"{where}: field 'box' {row['box']} lies outside the {row['width']}x{row['height']} image"
                )
            rows.append(row)
    return rows


def _box(row: dict[str, Any], where: str) -> tuple[int, int, int, int]:
    box = row["box"]
    if len(box) != 4 or not all(isinstance(v, int) for v in box):
        raise ValueError(f"{where}: field 'box' must be four integers [x0, y0, x1, y1], got {box!r}")
    return tuple(box)


class ManifestImages:
    """Memory-mapped access to the images a manifest references."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, row: dict[str, Any], where: str = "") -> np.ndarray:
        """Return the image a manifest row points at (its pack file and index), the pack memory-mapped once."""
        ref = row["image"]
        if ref not in self._arrays:
            path = self.root / ref
            if not path.is_file():
                raise FileNotFoundError(f"{where or row['id']}: image file {path} does not exist")
            try:
                self._arrays[ref] = np.load(path, mmap_mode="r")
            except ValueError as err:
                raise ValueError(f"{path}: unreadable image pack: {err}") from err
        array = self._arrays[ref]
        if not 0 <= row["index"] < len(array):
            raise ValueError(
                f"{where or row['id']}: field 'index' {row['index']} is outside {ref} ({len(array)} images)"
            )
        image = array[row["index"]]
        if image.shape[:2] != (row["height"], row["width"]):
            raise ValueError(
                f"{where or row['id']}: stored image is {image.shape[1]}x{image.shape[0]}, the row says "
                f"{row['width']}x{row['height']}"
            )
        return image
