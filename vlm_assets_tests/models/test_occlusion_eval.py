"""Exact vs lenient match, accuracies, gain and the confusion matrix on hand-made predictions; the
batched evaluation of real Fashion-MNIST images against each condition decoded alone."""

import numpy as np
import pytest
import torch

from vlm_assets.evaluate.occlusion_eval import EvalResult, evaluate, exact_match, lenient_match

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


def test_the_conditions_decoded_together_answer_as_each_decoded_alone(tmp_path, offline_data):
    from vlm_assets.data.image_sources import load_fashion_mnist
    from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests
    from vlm_assets.data.occlusion_dataset import OcclusionSamples, class_names
    from vlm_assets.models.frozen_vlm import load_backbone
    from vlm_assets.models.occlusion_adapter import OcclusionAdapter
    from vlm_assets.models.visualchat import VisualChatModel, VisualChatModelConfig
    from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder

    manifests = tmp_path / "manifests"
    images = load_fashion_mnist(offline_data / "fashion-mnist")
    boxes = {"train_box": BoxBounds(0.22, 0.42), "validation_box": BoxBounds(0.28, 0.45)}
    write_occlusion_manifests(images, manifests, num_train=8, num_validation=12, seed=3, **boxes)
    names = class_names(manifests)
    torch.manual_seed(0)
    VisualChatModel.build(  # as the demo's backbone; random weights whose answers depend on the image
        VisualChatModelConfig(
            encoder_kind="clip",
            encoder=str(tiny_clip(tmp_path / "clip")),
            projection="linear",
            decoder=str(tiny_decoder(tmp_path / "gpt2", offline_data, "gpt2", init_std=0.2)),
        )
    ).save_pretrained(tmp_path / "backbone")
    backbone = load_backbone(str(tmp_path / "backbone"))
    adapter = OcclusionAdapter(steps=2, gate_init=0.5).eval()
    data = OcclusionSamples(manifests, "validation", 56, None)

    result = evaluate(backbone, adapter, data, names, batch_size=5)  # batches of 5, 5 and 2

    alone = {"adapter": [], "identity": [], "clean": []}
    with torch.no_grad():
        for start in range(0, 12, 5):
            items = [data[i] for i in range(start, min(start + 5, 12))]
            occluded, mask = torch.stack([it["occluded"] for it in items]), torch.stack([it["mask"] for it in items])
            prompts = [it["prompt"] for it in items]
            for condition, pixels in (
                ("adapter", adapter(occluded, mask)),
                ("identity", occluded),
                ("clean", torch.stack([it["clean"] for it in items])),
            ):
                alone[condition] += backbone.generate(pixels, prompts, max_new_tokens=8)
    assert result.predictions == alone
    assert result.labels == [int(data[i]["label_index"]) for i in range(12)]
    assert len({tuple(answers) for answers in alone.values()}) == 3, alone  # the conditions answer differently
