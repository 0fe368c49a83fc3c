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

from vlm_assets.evaluate.stats import paired_gain, wilson_interval
from vlm_assets.models.frozen_vlm import FrozenVLM, normalize_answer
from vlm_assets.models.occlusion_adapter import OcclusionAdapter
from vlm_assets.progress import report_progress

CONDITIONS = ("adapter", "identity", "clean")


def exact_match(prediction: str, label: str) -> bool:
    """Return whether ``prediction`` equals ``label`` once both are normalized."""
    return normalize_answer(prediction) == normalize_answer(label)


def lenient_match(prediction: str, label: str) -> bool:
    """Return whether the normalized ``label`` appears as whole words in the normalized ``prediction``."""
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(label).split()
    n = len(wanted)
    return any(predicted[i : i + n] == wanted for i in range(len(predicted) - n + 1)) if n else False


@dataclasses.dataclass
class EvalResult:
    """The answers of an evaluation under each condition, with the true labels and class names."""

    class_names: list[str]
    labels: list[int]
    predictions: dict[str, list[str]]  # condition -> decoded answers

    def hits(self, condition: str, lenient: bool = False) -> list[bool]:
        """Return, per image, whether ``condition``'s answer matched the label."""
        match = lenient_match if lenient else exact_match
        return [match(p, self.class_names[y]) for p, y in zip(self.predictions[condition], self.labels)]

    def accuracy(self, condition: str, lenient: bool = False) -> float:
        """Return ``condition``'s exact (or lenient) accuracy; 0 without images."""
        hits = self.hits(condition, lenient)
        return float(np.mean(hits)) if hits else 0.0

    def predicted_index(self, condition: str) -> list[int]:
        """Return the class index of each prediction; ``len(class_names)`` for an answer that is no class."""
        lookup = {normalize_answer(name): i for i, name in enumerate(self.class_names)}
        return [lookup.get(normalize_answer(p), len(self.class_names)) for p in self.predictions[condition]]

    def confusion(self, condition: str) -> np.ndarray:
        """Return the (classes) x (classes + 1 "other") counts: rows true, columns predicted."""
        matrix = np.zeros((len(self.class_names), len(self.class_names) + 1), dtype=np.int64)
        for y, p in zip(self.labels, self.predicted_index(condition)):
            matrix[y, p] += 1
        return matrix

    def per_class(self, condition: str) -> list[float]:
        """Return ``condition``'s accuracy on each true class (NaN for a class with no images)."""
        matrix = self.confusion(condition)
        return [
            float(matrix[c, c] / matrix[c].sum()) if matrix[c].sum() else float("nan")
            for c in range(len(self.class_names))
        ]

    def summary(self) -> dict[str, float]:
        """Return the accuracies with their 95 % Wilson intervals, and the adapter's paired gain over the identity.

        The gain is measured on the same images: 95 % paired-bootstrap interval, exact McNemar p-value, wins and losses.
        """
        out: dict[str, float] = {"num_samples": len(self.labels), "chance": 1 / len(self.class_names)}
        for condition in CONDITIONS:
            hits = self.hits(condition)
            out[f"accuracy_{condition}"] = self.accuracy(condition)
            if hits:
                low, high = wilson_interval(sum(hits), len(hits))
                out[f"accuracy_{condition}_ci95_low"], out[f"accuracy_{condition}_ci95_high"] = low, high
            out[f"lenient_accuracy_{condition}"] = self.accuracy(condition, lenient=True)
        out["adapter_gain"] = out["accuracy_adapter"] - out["accuracy_identity"]
        if self.labels:
            gain = paired_gain(self.hits("adapter"), self.hits("identity"))
            out.update(
                adapter_gain_ci95_low=gain.ci95[0],
                adapter_gain_ci95_high=gain.ci95[1],
                adapter_gain_p_value=gain.p_value,
                adapter_wins=gain.wins,
                adapter_losses=gain.losses,
            )
        gap = out["accuracy_clean"] - out["accuracy_identity"]
        if gap > 0:  # the share of what the occlusion costs that the adapter gives back
            out["gap_recovered"] = out["adapter_gain"] / gap
        return out


@torch.no_grad()
def evaluate(
    backbone: FrozenVLM,
    adapter: OcclusionAdapter,
    dataset,
    class_names: list[str],
    *,
    count: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 8,
    log: Callable[[str], None] | None = None,
) -> EvalResult:
    """Return the greedy answers of ``backbone`` under each condition for the first ``count`` images of ``dataset``.

    ``dataset`` yields dicts with occluded, clean, mask, label_index, prompt (``OcclusionSamples``). A batch's
    three conditions are decoded together, one ``generate`` call of ``3 * batch_size`` rows: a row decodes as
    it would alone, and a decoding step's fixed cost is paid once a batch, not three times.
    """
    total = len(dataset) if count is None else min(count, len(dataset))
    adapter.eval()
    labels, predictions = [], {c: [] for c in CONDITIONS}
    starts = range(0, total, batch_size)
    for start in report_progress(
        starts, "eval", log, total=total, unit="images", size=lambda s: min(batch_size, total - s)
    ):
        items = [dataset[i] for i in range(start, min(start + batch_size, total))]
        occluded = torch.stack([it["occluded"] for it in items])
        mask = torch.stack([it["mask"] for it in items])
        prompts = [it["prompt"] for it in items]
        inputs = {
            "adapter": adapter(occluded, mask),
            "identity": occluded,
            "clean": torch.stack([it["clean"] for it in items]),
        }
        answers = backbone.generate(torch.cat(list(inputs.values())), prompts * len(inputs), max_new_tokens)
        for i, condition in enumerate(inputs):
            predictions[condition].extend(answers[i * len(items) : (i + 1) * len(items)])
        labels.extend(int(it["label_index"]) for it in items)
    return EvalResult(class_names, labels, predictions)
