"""Occlusion manifests: images/s of this asset's writer against the seed's way, same source and count.

    python bench/bench_manifests.py [--num 5000]

Baseline (the seed's ``prepare_occlusion_dataset``): per image, draw the box, PIL-resize to 224x224,
save a PNG, append a JSON line. Ours: ``write_occlusion_manifests`` (source resolution, one packed
``.npy`` per split, box applied by the loader). Both start from the same decoded Fashion-MNIST images.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlm_assets.data.image_sources import ImageSource, ImageSplit, load_fashion_mnist
from vlm_assets.data.occlusion import BoxBounds, sample_boxes, write_occlusion_manifests
from vlm_assets.paths import offline_data_dir


def seed_baseline(split: ImageSplit, names: list[str], out: Path) -> None:
    rng = np.random.default_rng(7)
    boxes = sample_boxes(rng, len(split.images), split.images.shape[2], split.images.shape[1], BoxBounds(0.22, 0.42))
    (out / "images").mkdir(parents=True)
    with open(out / "train.jsonl", "w") as f:
        for i, (img, label, box) in enumerate(zip(split.images, split.labels, boxes.tolist())):
            pil = Image.fromarray(img.squeeze(-1)).convert("RGB")
            ImageDraw.Draw(pil).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=(0, 0, 0))
            pil = pil.resize((224, 224), Image.Resampling.BICUBIC)
            path = out / "images" / f"{i:06d}.png"
            pil.save(path)
            f.write(json.dumps({"image": str(path), "label": names[label], "box": box}) + "\n")


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num", type=int, default=5000)
    args = parser.parse_args()
    started = time.perf_counter()
    source = load_fashion_mnist(offline_data_dir() / "fashion-mnist")
    load_s = time.perf_counter() - started
    n = args.num
    train = ImageSplit(source.train.images[:n], source.train.labels[:n], source.train.origins[:n])
    small = ImageSource(
        source.name, source.class_names, train, ImageSplit(train.images[:10], train.labels[:10], train.origins[:10])
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        seed_baseline(train, source.class_names, Path(tmp) / "seed")
        rows.append(("seed: PIL resize 224 + PNG per image", time.perf_counter() - t, disk_bytes(Path(tmp) / "seed")))
        t = time.perf_counter()
        write_occlusion_manifests(
            small,
            Path(tmp) / "ours",
            num_train=None,
            num_validation=None,
            train_box=BoxBounds(0.22, 0.42),
            validation_box=BoxBounds(0.28, 0.45),
            seed=7,
        )
        rows.append(("vlm_assets: packed .npy at source res", time.perf_counter() - t, disk_bytes(Path(tmp) / "ours")))
    base = rows[0][1]
    print(f"\nOcclusion manifests, {n} Fashion-MNIST train images (source decode: {load_s:.2f} s, shared)\n")
    print("| writer | seconds | images/s | speed-up | bytes on disk |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, size in rows:
        print(f"| {name} | {seconds:.2f} | {n / seconds:,.0f} | {base / seconds:.1f}x | {size / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
