"""Data checks: seconds per run of all of an asset's checks, cache hit vs build, against artifact size.

    python bench/bench_checks.py

For token shards of 10^5, 10^6, 10^7 tokens (real Shakespeare, GPT-2 BPE, blocks of 1024) and
occlusion manifests of 10^3, 10^4, 5x10^4 Fashion-MNIST images, committed to a local store as the
assets commit them (scan recorded in the manifest), it times:

- seed: every check re-reads the artifact (3 token checks / 4 manifest checks, each a full scan);
- build: the one shared scan the asset runs when it builds, then every check judging it;
- cache hit: what each check does on a hit: read the manifest, ``quick_verify`` (a stat per file),
  judge the recorded scan. It must stay flat as the artifact grows.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from vlm_assets.data import occlusion_checks, token_checks
from vlm_assets.data.image_sources import ImageSource, ImageSplit, load_fashion_mnist
from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests
from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files, write_token_shards
from vlm_assets.paths import offline_data_dir
from vlm_assets.storage import LocalArtifactStore

BOUNDS = {"train": BoxBounds(0.22, 0.42), "validation": BoxBounds(0.28, 0.45)}


def judge_tokens(scanned):
    return [
        token_checks.ids_within_vocab(scanned),
        token_checks.counts_match(scanned),
        token_checks.shards_readable(scanned),
    ]


def judge_images(scanned):
    return [
        occlusion_checks.boxes_within_bounds(scanned),
        occlusion_checks.counts_match(scanned, {"train": None, "validation": None}),
        occlusion_checks.classes_balanced(scanned, 0.1, {"train": True, "validation": True}),
        occlusion_checks.images_readable(scanned),
    ]


def timed(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def hit_path(store, key, judge, checks):
    """What the checks run on a cache hit (``vlm_assets.defs.platform.checks.artifact_scan``), per check."""
    for _ in range(checks):
        ref = store.ref(key)
        assert store.quick_verify(key) == []
        judge(ref.metadata["scan"])


def measure(store, key, root_scan, judge, checks):
    root = store.local_path(key)
    seed = timed(lambda: [root_scan(root) for _ in range(checks)], repeats=1)
    build = timed(lambda: judge(root_scan(root)), repeats=1)
    hit = timed(lambda: hit_path(store, key, judge, checks), repeats=5)
    return seed, build, hit


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    data = offline_data_dir()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalArtifactStore(Path(tmp) / "store")
        tokenizer = load_gpt2_tokenizer(str(data / "gpt2-tokenizer"))
        docs = list(paragraphs_of_files(str(data / "shakespeare" / "*.txt")))
        for tokens in (10**5, 10**6, 10**7):
            corpus = docs * (1 + tokens // 1_400_000)
            key = f"token_shards/{tokens}"
            with store.staging_dir(key) as staging:
                write_token_shards(
                    staging,
                    tokenizer,
                    "gpt2",
                    corpus,
                    docs[:2000],
                    max_length=1024,
                    max_train_samples=tokens // 1024,
                    max_val_samples=8,
                    size_limit="64mb",
                )
                store.commit(key, staging, {"scan": token_checks.scan(staging)})
            mb = store.read_manifest(key).num_bytes / 1e6
            rows.append(
                ("token_shards", f"{tokens:.0e} tokens", mb, *measure(store, key, token_checks.scan, judge_tokens, 3))
            )
        source = load_fashion_mnist(data / "fashion-mnist")
        for images in (10**3, 10**4, 5 * 10**4):
            train = ImageSplit(
                source.train.images[:images], source.train.labels[:images], source.train.origins[:images]
            )
            sized = ImageSource(source.name, source.class_names, train, source.eval)
            key = f"occlusion_manifests/{images}"
            with store.staging_dir(key) as staging:
                write_occlusion_manifests(
                    sized,
                    staging,
                    num_train=None,
                    num_validation=1000,
                    train_box=BOUNDS["train"],
                    validation_box=BOUNDS["validation"],
                    seed=0,
                )
                store.commit(key, staging, {"scan": occlusion_checks.scan(staging, BOUNDS)})
            mb = store.read_manifest(key).num_bytes / 1e6
            scan = lambda root: occlusion_checks.scan(root, BOUNDS)  # noqa: E731
            rows.append(
                ("occlusion_manifests", f"{images:,} + 1,000 images", mb, *measure(store, key, scan, judge_images, 4))
            )
    print("\nData checks: seconds for all of an asset's checks (local store, this machine)\n")
    print("| asset | size | MB | seed: each check re-reads | build: one shared scan | cache hit | hit vs seed |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for asset, size, mb, seed, build, hit in rows:
        print(f"| {asset} | {size} | {mb:.1f} | {seed:.3f} | {build:.3f} | {hit * 1000:.1f} ms | {seed / hit:,.0f}x |")


if __name__ == "__main__":
    main()
