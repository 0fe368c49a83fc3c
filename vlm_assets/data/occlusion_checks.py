"""Data-quality checks on an occlusion manifest artifact (pure; wrapped as Dagster asset checks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlm_assets.data.occlusion import SPLITS, BoxBounds, ManifestImages, read_manifest


@dataclasses.dataclass
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    warning: bool = False  # a failure to report, not to block on


def _rows(root: Path) -> dict[str, list[dict[str, Any]]]:
    return {split: read_manifest(root / f"{split}.jsonl") for split in SPLITS}


def boxes_within_bounds(root: Path, bounds: dict[str, BoxBounds]) -> CheckOutcome:
    worst = {}
    failures = []
    for split, rows in _rows(root).items():
        b = bounds[split]
        boxes = np.asarray([r["box"] for r in rows], np.float64)
        sizes = np.asarray([[r["width"], r["height"]] for r in rows], np.float64)
        fractions = (boxes[:, 2:] - boxes[:, :2]) / sizes
        worst[f"{split}_fraction_min"] = float(fractions.min())
        worst[f"{split}_fraction_max"] = float(fractions.max())
        bad = np.flatnonzero(((fractions < b.min_fraction - 1e-9) | (fractions > b.max_fraction + 1e-9)).any(axis=1))
        if len(bad):
            failures.append(f"{split}: {len(bad)} boxes outside [{b.min_fraction}, {b.max_fraction}], "
                            f"first {rows[bad[0]]['id']} {rows[bad[0]]['box']}")
    return CheckOutcome(not failures, "; ".join(failures) or "every box side is within its split's bounds", worst)


def classes_balanced(root: Path, tolerance: float, balanced: dict[str, bool]) -> CheckOutcome:
    """Every class present in every split (a failure); in splits where ``balanced`` says a balanced
    subset was asked for, each class's share within ``tolerance`` of 1/num_classes (a failure),
    elsewhere an imbalance is reported as a warning."""
    num_classes = len(json.loads((root / "dataset.json").read_text())["class_names"])
    failures, warnings, meta = [], [], {}
    for split, rows in _rows(root).items():
        counts = np.bincount([r["label_index"] for r in rows], minlength=num_classes)
        expected = len(rows) / num_classes
        meta[f"{split}_class_counts"] = counts.tolist()
        if (missing := np.flatnonzero(counts == 0)).size:
            failures.append(f"{split}: classes {missing.tolist()} have no images")
        elif (np.abs(counts - expected) > tolerance * expected).any():
            message = f"{split}: class counts {counts.tolist()} deviate more than {tolerance:.0%} from {expected:.1f}"
            (failures if balanced[split] else warnings).append(
                message if balanced[split] else message + " (the source's own distribution; no balanced subset asked for)")
    problems = failures or warnings
    return CheckOutcome(not problems, "; ".join(problems) or f"all {num_classes} classes present and balanced", meta,
                        warning=not failures and bool(warnings))


def counts_match(root: Path, expected: dict[str, int | None]) -> CheckOutcome:
    summary = json.loads((root / "dataset.json").read_text())
    failures, meta = [], {}
    for split, rows in _rows(root).items():
        meta[f"num_{split}"] = len(rows)
        want = expected[split]
        if want is not None and len(rows) != want:
            failures.append(f"{split}: {len(rows)} rows, config asks for {want}")
        if len(rows) != summary["splits"][split]["num_images"]:
            failures.append(f"{split}: {len(rows)} rows, dataset.json says {summary['splits'][split]['num_images']}")
    return CheckOutcome(not failures, "; ".join(failures) or "row counts match the config", meta)


def images_readable(root: Path) -> CheckOutcome:
    images = ManifestImages(root)
    checked = 0
    for split, rows in _rows(root).items():
        for line_no, row in enumerate(rows, 1):
            try:
                pixels = images.get(row, where=f"{split}.jsonl:{line_no}")
                if pixels.dtype != np.uint8:
                    raise ValueError(f"{split}.jsonl:{line_no}: image dtype {pixels.dtype}, expected uint8")
            except (OSError, ValueError) as err:
                return CheckOutcome(False, str(err), {"num_checked": checked})
            checked += 1
    return CheckOutcome(True, f"all {checked} referenced images are readable", {"num_checked": checked})
