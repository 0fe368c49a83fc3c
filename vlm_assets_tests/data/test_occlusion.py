import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_assets.data.image_sources import load_fashion_mnist
from vlm_assets.data.occlusion import BoxBounds, read_manifest, sample_boxes, write_occlusion_manifests
from vlm_assets.data.occlusion_dataset import OcclusionDataset

TRAIN, EVAL = BoxBounds(0.22, 0.42), BoxBounds(0.28, 0.45)


@pytest.fixture(scope="module")
def fmnist(offline_data):
    return load_fashion_mnist(offline_data / "fashion-mnist")


def _write(source, out, seed=7, num_train=300, num_validation=100):
    return write_occlusion_manifests(
        source, out, num_train=num_train, num_validation=num_validation, train_box=TRAIN, validation_box=EVAL, seed=seed
    )


def test_same_seed_gives_byte_identical_artifacts(fmnist, tmp_path):
    _write(fmnist, tmp_path / "a")
    _write(fmnist, tmp_path / "b")
    _write(fmnist, tmp_path / "c", seed=8)
    for name in ("train.jsonl", "validation.jsonl", "images/train.npy", "images/validation.npy", "dataset.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()


def test_manifest_rows_are_balanced_and_complete(fmnist, tmp_path):
    summary = _write(fmnist, tmp_path)
    rows = read_manifest(tmp_path / "train.jsonl")
    assert len(rows) == 300 and summary["splits"]["train"]["class_counts"] == [30] * 10
    row = rows[0]
    assert row["prompt"].startswith(
        "The image may be partially occluded. Answer with exactly one Fashion-MNIST class label: T-shirt/top, Trouser,"
    )
    assert row["label"] == fmnist.class_names[row["label_index"]]
    src = int(row["origin"].split("#")[1])
    np.testing.assert_array_equal(np.load(tmp_path / row["image"])[row["index"]], fmnist.train.images[src])


@settings(max_examples=200, deadline=None)
@given(
    side_w=st.integers(8, 600),
    side_h=st.integers(8, 600),
    low=st.floats(0.05, 0.9),
    span=st.floats(0, 0.09),
    seed=st.integers(0, 2**32 - 1),
)
def test_boxes_stay_within_bounds_and_image(side_w, side_h, low, span, seed):
    bounds = BoxBounds(low, low + span)

    def admits_a_box(side: int) -> bool:  # by trying every whole side, beside pixel_range's ceil and floor
        return any(low * side - 1e-9 <= k <= (low + span) * side + 1e-9 for k in range(1, side + 1))

    try:
        boxes = sample_boxes(np.random.default_rng(seed), 64, side_w, side_h, bounds)
    except ValueError as err:  # a side too small to hold any box between the bounds
        assert "admits no box" in str(err)
        assert not (admits_a_box(side_w) and admits_a_box(side_h)), (side_w, side_h)
        return
    assert admits_a_box(side_w) and admits_a_box(side_h)
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= side_w).all() and (boxes[:, 3] <= side_h).all()
    assert ((w / side_w >= bounds.min_fraction - 1e-9) & (w / side_w <= bounds.max_fraction + 1e-9)).all()
    assert ((h / side_h >= bounds.min_fraction - 1e-9) & (h / side_h <= bounds.max_fraction + 1e-9)).all()


def test_box_sides_cover_the_configured_range(fmnist, tmp_path):
    rows = read_manifest(_write(fmnist, tmp_path, num_train=2000) and tmp_path / "train.jsonl")
    fractions = np.asarray([(r["box"][2] - r["box"][0]) / r["width"] for r in rows])
    # 28 px sides admit 7..11 px boxes for 22-42 %: every one of them is drawn
    assert set(np.rint(fractions * 28).astype(int)) == {7, 8, 9, 10, 11}


@pytest.mark.parametrize("low,high", [(0.0, 0.3), (0.5, 0.4), (0.3, 1.0), (-0.1, 0.2)])
def test_invalid_bounds_are_rejected(low, high):
    with pytest.raises(ValueError, match="0 < min <= max < 1"):
        BoxBounds(low, high)


def test_loader_returns_occluded_clean_mask_label(fmnist, tmp_path):
    _write(fmnist, tmp_path)
    ds = OcclusionDataset(tmp_path, "validation", image_size=56)
    occluded, clean, mask, label = ds[3]
    row = ds.rows[3]
    assert occluded.shape == clean.shape == (3, 56, 56) and mask.shape == (1, 56, 56)
    assert label == row["label_index"]
    x0, y0, x1, y1 = (v * 2 for v in row["box"])  # 28 -> 56 scales the box by 2 exactly
    assert mask[0, y0:y1, x0:x1].eq(1).all() and mask.sum() == (x1 - x0) * (y1 - y0)
    assert occluded[:, y0:y1, x0:x1].eq(0).all()
    outside = mask.expand(3, -1, -1) == 0
    assert occluded[outside].equal(clean[outside])


def test_manifest_errors_name_file_line_and_field(fmnist, tmp_path):
    _write(fmnist, tmp_path)
    path = tmp_path / "train.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[4])
    row["box"] = [20, 20, 40, 25]
    lines[4] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:5: field 'box' \[20, 20, 40, 25\] lies outside the 28x28 image"):
        read_manifest(path)
    del row["label_index"]
    row["box"] = [1, 1, 5, 5]
    lines[4] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:5: field 'label_index' must be a int"):
        read_manifest(path)


def test_missing_image_is_named(fmnist, tmp_path):
    _write(fmnist, tmp_path)
    (tmp_path / "images" / "validation.npy").unlink()
    ds = OcclusionDataset(tmp_path, "validation", image_size=28)
    with pytest.raises(FileNotFoundError, match=r"validation.jsonl:1: image file .*validation.npy does not exist"):
        ds[0]
