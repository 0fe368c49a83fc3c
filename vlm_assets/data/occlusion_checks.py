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
    """The verdict of one data check: passed or not, a description, metadata, and whether a failure only warns."""

    passed: bool
    description: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    warning: bool = False  # a failure to report, not to block on


def scan(root: Path, bounds: dict[str, BoxBounds]) -> dict[str, Any]:
    """Read the whole artifact once (manifests once, every image decoded once); return what every check needs, as JSON.

    It is committed in the artifact's manifest when built, so checks on a cache hit need not read the images again.
    ``bounds`` are the asset config's (identity), so box outcomes can be judged here; the balance tolerance is the
    check's own setting and is judged later.
    """
    summary = json.loads((root / "dataset.json").read_text())
    images = ManifestImages(root)
    result: dict[str, Any] = {
        "num_classes": len(summary["class_names"]),
        "splits": {},
        "images": {"num_checked": 0, "error": None},
    }
    for split in SPLITS:
        rows = read_manifest(root / f"{split}.jsonl")
        b = bounds[split]
        boxes = np.asarray([r["box"] for r in rows], np.float64).reshape(-1, 4)
        sizes = np.asarray([[r["width"], r["height"]] for r in rows], np.float64).reshape(-1, 2)
        fractions = (boxes[:, 2:] - boxes[:, :2]) / sizes
        bad = np.flatnonzero(((fractions < b.min_fraction - 1e-9) | (fractions > b.max_fraction + 1e-9)).any(axis=1))
        result["splits"][split] = {
            "num_rows": len(rows),
            "summary_num_images": summary["splits"][split]["num_images"],
            "class_counts": np.bincount([r["label_index"] for r in rows], minlength=result["num_classes"]).tolist(),
            "bounds": [b.min_fraction, b.max_fraction],
            "fraction_min": float(fractions.min()) if len(rows) else None,
            "fraction_max": float(fractions.max()) if len(rows) else None,
            "num_outside": len(bad),
            "first_outside": [rows[bad[0]]["id"], rows[bad[0]]["box"]] if len(bad) else None,
        }
        for line_no, row in enumerate(rows, 1):
            if result["images"]["error"]:
                break
            try:
                pixels = images.get(row, where=f"{split}.jsonl:{line_no}")
                if pixels.dtype != np.uint8:
                    raise ValueError(f"{split}.jsonl:{line_no}: image dtype {pixels.dtype}, expected uint8")
                result["images"]["num_checked"] += 1
            except (OSError, ValueError) as err:
                result["images"]["error"] = str(err)
    return result


def boxes_within_bounds(scanned: dict[str, Any]) -> CheckOutcome:
    """Check that every box side is within its split's bounds; report the extreme fractions."""
    worst, failures = {}, []
    for split, s in scanned["splits"].items():
        worst[f"{split}_fraction_min"], worst[f"{split}_fraction_max"] = s["fraction_min"], s["fraction_max"]
        if s["num_outside"]:
            (lo, hi), (row_id, box) = s["bounds"], s["first_outside"]
            failures.append(f"{split}: {s['num_outside']} boxes outside [{lo}, {hi}], first {row_id} {box}")
    return CheckOutcome(not failures, "; ".join(failures) or "every box side is within its split's bounds", worst)


def classes_balanced(scanned: dict[str, Any], tolerance: float, balanced: dict[str, bool]) -> CheckOutcome:
    """Check that every class is present in every split, and balanced where asked.

    A missing class is a failure. In splits where ``balanced`` says a balanced subset was asked for, each class's
    share must be within ``tolerance`` of 1/num_classes (a failure); elsewhere an imbalance is reported as a warning.
    """
    num_classes = scanned["num_classes"]
    failures, warnings, meta = [], [], {}
    for split, s in scanned["splits"].items():
        counts = np.asarray(s["class_counts"])
        expected = s["num_rows"] / num_classes
        meta[f"{split}_class_counts"] = counts.tolist()
        if (missing := np.flatnonzero(counts == 0)).size:
            failures.append(f"{split}: classes {missing.tolist()} have no images")
        elif (np.abs(counts - expected) > tolerance * expected).any():
            message = f"{split}: class counts {counts.tolist()} deviate more than {tolerance:.0%} from {expected:.1f}"
            (failures if balanced[split] else warnings).append(
                message
                if balanced[split]
                else message + " (the source's own distribution; no balanced subset asked for)"
            )
    problems = failures or warnings
    return CheckOutcome(
        not problems,
        "; ".join(problems) or f"all {num_classes} classes present and balanced",
        meta,
        warning=not failures and bool(warnings),
    )


def counts_match(scanned: dict[str, Any], expected: dict[str, int | None]) -> CheckOutcome:
    """Check that each split's row count matches the config and ``dataset.json``."""
    failures, meta = [], {}
    for split, s in scanned["splits"].items():
        meta[f"num_{split}"] = s["num_rows"]
        want = expected[split]
        if want is not None and s["num_rows"] != want:
            failures.append(f"{split}: {s['num_rows']} rows, config asks for {want}")
        if s["num_rows"] != s["summary_num_images"]:
            failures.append(f"{split}: {s['num_rows']} rows, dataset.json says {s['summary_num_images']}")
    return CheckOutcome(not failures, "; ".join(failures) or "row counts match the config", meta)


def images_readable(scanned: dict[str, Any]) -> CheckOutcome:
    """Check that every referenced image was readable in the scan."""
    images = scanned["images"]
    if images["error"]:
        return CheckOutcome(False, images["error"], {"num_checked": images["num_checked"]})
    return CheckOutcome(
        True, f"all {images['num_checked']} referenced images are readable", {"num_checked": images["num_checked"]}
    )
