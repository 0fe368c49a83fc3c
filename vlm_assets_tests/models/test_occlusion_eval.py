"""Exact vs lenient match, accuracies, gain and the confusion matrix on hand-made predictions."""

import numpy as np
import pytest

from vlm_assets.evaluate.occlusion_eval import EvalResult, exact_match, lenient_match

NAMES = ["T-shirt/top", "Trouser", "Ankle boot"]


@pytest.mark.parametrize(
    "prediction, label, exact, lenient",
    [
        ("Trouser", "Trouser", True, True),
        (" trouser.\n", "Trouser", True, True),
        ("It is a trouser", "Trouser", False, True),
        ("Ankle boot", "Ankle boot", True, True),
        ("boot", "Ankle boot", False, False),
        ("T-shirt/top", "T-shirt/top", True, True),
        ("", "Trouser", False, False),
    ],
)
def test_exact_and_lenient_match(prediction, label, exact, lenient):
    assert exact_match(prediction, label) is exact
    assert lenient_match(prediction, label) is lenient


def test_accuracies_gain_and_confusion():
    result = EvalResult(
        NAMES,
        [0, 1, 2, 2],
        {
            "adapter": ["T-shirt/top", "Trouser", "Ankle boot", "a nice Ankle boot"],
            "identity": ["Trouser", "Trouser", "sandal", "Ankle boot"],
            "clean": ["T-shirt/top", "Trouser", "Ankle boot", "Ankle boot"],
        },
    )
    summary = result.summary()
    assert summary["accuracy_adapter"] == 0.75 and summary["lenient_accuracy_adapter"] == 1.0
    assert summary["accuracy_identity"] == 0.5 and summary["adapter_gain"] == 0.25
    assert summary["accuracy_clean"] == 1.0 and summary["num_samples"] == 4
    np.testing.assert_array_equal(result.confusion("identity"), [[0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1]])
    assert result.per_class("adapter") == [1.0, 1.0, 0.5]
