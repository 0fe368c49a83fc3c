"""Greedy-decoding evaluation of a frozen VLM on occluded images, with and without the adapter.

Three conditions on the same images: ``adapter`` (occluded -> adapter -> backbone), ``identity``
(occluded -> backbone) and ``clean`` (the un-occluded image -> backbone, the ceiling). Two scores:
strict exact match (normalized prediction == normalized label) and the seed's lenient match (the label
appears among the predicted words).
"""

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from vlm_assets.models.frozen_vlm import FrozenVLM, normalize_answer
from vlm_assets.models.occlusion_adapter import OcclusionAdapter
from vlm_assets.progress import report_progress

CONDITIONS = ("adapter", "identity", "clean")


def exact_match(prediction: str, label: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(label)


def lenient_match(prediction: str, label: str) -> bool:
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(label).split()
    n = len(wanted)
    return any(predicted[i:i + n] == wanted for i in range(len(predicted) - n + 1)) if n else False


@dataclasses.dataclass
class EvalResult:
    class_names: list[str]
    labels: list[int]
    predictions: dict[str, list[str]]  # condition -> decoded answers

    def accuracy(self, condition: str, lenient: bool = False) -> float:
        match = lenient_match if lenient else exact_match
        hits = [match(p, self.class_names[y]) for p, y in zip(self.predictions[condition], self.labels)]
        return float(np.mean(hits)) if hits else 0.0

    def predicted_index(self, condition: str) -> list[int]:
        """Class index of each prediction; ``len(class_names)`` for an answer that is no class."""
        lookup = {normalize_answer(name): i for i, name in enumerate(self.class_names)}
        return [lookup.get(normalize_answer(p), len(self.class_names)) for p in self.predictions[condition]]

    def confusion(self, condition: str) -> np.ndarray:
        """(classes) x (classes + 1 "other") counts: rows true, columns predicted."""
        matrix = np.zeros((len(self.class_names), len(self.class_names) + 1), dtype=np.int64)
        for y, p in zip(self.labels, self.predicted_index(condition)):
            matrix[y, p] += 1
        return matrix

    def per_class(self, condition: str) -> list[float]:
        matrix = self.confusion(condition)
        return [float(matrix[c, c] / matrix[c].sum()) if matrix[c].sum() else float("nan") for c in range(len(self.class_names))]

    def summary(self) -> dict[str, float]:
        out = {}
        for condition in CONDITIONS:
            out[f"accuracy_{condition}"] = self.accuracy(condition)
            out[f"lenient_accuracy_{condition}"] = self.accuracy(condition, lenient=True)
        out["adapter_gain"] = out["accuracy_adapter"] - out["accuracy_identity"]
        out["num_samples"] = len(self.labels)
        return out


@torch.no_grad()
def evaluate(backbone: FrozenVLM, adapter: OcclusionAdapter, dataset, class_names: list[str], *,
             count: int | None = None, batch_size: int = 16, max_new_tokens: int = 8,
             log: Callable[[str], None] | None = None) -> EvalResult:
    """``dataset`` yields dicts with occluded, clean, mask, label_index, prompt (``OcclusionSamples``)."""
    total = len(dataset) if count is None else min(count, len(dataset))
    adapter.eval()
    labels, predictions = [], {c: [] for c in CONDITIONS}
    starts = range(0, total, batch_size)
    for start in report_progress(starts, "eval", log, total=total, unit="images",
                                 size=lambda s: min(batch_size, total - s)):
        items = [dataset[i] for i in range(start, min(start + batch_size, total))]
        occluded = torch.stack([it["occluded"] for it in items])
        mask = torch.stack([it["mask"] for it in items])
        prompts = [it["prompt"] for it in items]
        inputs = {"adapter": adapter(occluded, mask), "identity": occluded,
                  "clean": torch.stack([it["clean"] for it in items])}
        for condition, pixels in inputs.items():
            predictions[condition].extend(backbone.generate(pixels, prompts, max_new_tokens=max_new_tokens))
        labels.extend(int(it["label_index"]) for it in items)
    return EvalResult(class_names, labels, predictions)
