"""The data assets through Dagster: memoization, MLflow, checks, bad input, S3."""

import json
import os

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from vlm_assets.data.download import md5_file
from vlm_assets.defs.data.occlusion_assets import occlusion_manifests
from vlm_assets.defs.data.token_assets import token_shards
from vlm_assets_tests.conftest import (
    CIFAR10_CLASSES,
    TOKEN_SHARD_CHECKS_PASS,
    checks_of,
    real_cifar_images,
    serve_directory,
    write_cifar_tarball,
)

OCCLUSION = [occlusion_manifests]  # each asset's checks run in its own step
TOKENS = [token_shards]


def fmnist_config(offline_data, **overrides):
    config = {
        "source": "fashion_mnist",
        "source_uri": str(offline_data / "fashion-mnist"),
        "num_train": 200,
        "num_validation": 50,
        **overrides,
    }
    return {"ops": {"occlusion_manifests": {"config": config}}}


def tokens_config(offline_data, **overrides):
    config = {
        "source": "text_files",
        "text_glob": str(offline_data / "shakespeare" / "*.txt"),
        "tokenizer": str(offline_data / "gpt2-tokenizer"),
        "max_length": 128,
        "max_train_samples": 400,
        "max_val_samples": 40,
        **overrides,
    }
    return {"ops": {"token_shards": {"config": config}}}


def materialization(result, asset="occlusion_manifests"):
    return result.asset_materializations_for_node(asset)[0]


def failure_message(result):
    """The failed step's message; bad input fails at once (one failure event, no retries)."""
    failures = result.get_step_failure_events()
    assert len(failures) == 1 and not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    return failures[0].step_failure_data.user_failure_data.description


def test_manifests_memoized_and_tracked(embedded, offline_data, mlflow_uri):
    first = embedded.materialize(OCCLUSION, fmnist_config(offline_data))
    meta = materialization(first).metadata
    assert meta["cache"].value == "miss" and meta["num_train"].value == 200
    assert meta["preview"].value.startswith("![first training images with their boxes](data:image/png;base64,")
    assert checks_of(first, "occlusion_manifests") == {
        "boxes_within_configured_bounds": True,
        "counts_match_config": True,
        "every_class_present_and_balanced": True,
        "every_image_readable": True,
    }

    run = MlflowClient(mlflow_uri).get_run(meta["mlflow_run_id"].value)
    assert run.info.status == "FINISHED"
    assert run.data.params["num_train"] == "200" and run.data.params["train_box_min"] == "0.22"
    assert run.data.metrics["num_validation"] == 50
    assert run.data.tags["dagster.run_id"] == first.run_id
    assert [a.path for a in MlflowClient(mlflow_uri).list_artifacts(run.info.run_id)] == ["preview.png"]

    second = embedded.materialize(OCCLUSION, fmnist_config(offline_data))
    meta2 = materialization(second).metadata
    assert meta2["cache"].value == "hit"
    assert meta2["cache_key"].value == meta["cache_key"].value
    assert meta2["mlflow_run_id"].value == meta["mlflow_run_id"].value  # links the run that built it
    assert materialization(second).tags["dagster/data_version"] == materialization(first).tags["dagster/data_version"]

    changed = embedded.materialize(OCCLUSION, fmnist_config(offline_data, seed=8))
    assert materialization(changed).metadata["cache"].value == "miss"
    assert materialization(changed).metadata["cache_key"].value != meta["cache_key"].value

    bumped = occlusion_manifests.map_asset_specs(lambda spec: spec.replace_attributes(code_version="bumped-in-test"))
    recomputed = embedded.materialize([bumped], fmnist_config(offline_data))
    assert materialization(recomputed).metadata["cache"].value == "miss"
    # same inputs, new code: a new key, but identical content keeps the data version
    assert materialization(recomputed).metadata["cache_key"].value != meta["cache_key"].value
    assert (
        materialization(recomputed).tags["dagster/data_version"] == materialization(first).tags["dagster/data_version"]
    )


def test_cifar_tarball_over_http_and_a_failing_balance_check(embedded, offline_data, tmp_path):
    images, labels = real_cifar_images(offline_data)
    served = tmp_path / "served"
    served.mkdir()
    tarball = write_cifar_tarball(served / "cifar-10-python.tar.gz", images, labels)
    with serve_directory(served) as (url, requests):
        config = {"source": "cifar10", "source_uri": f"{url}/cifar-10-python.tar.gz", "source_md5": md5_file(tarball)}
        result = embedded.materialize(
            OCCLUSION, {"ops": {"occlusion_manifests": {"config": config}}}, raise_on_error=False
        )
    assert requests == ["/cifar-10-python.tar.gz"]
    assert materialization(result).metadata["dataset"].value == "CIFAR-10"
    passed = checks_of(result, "occlusion_manifests")
    # the 20 real images hold no bird (2) and no deer (4): the balance check must fail, the rest pass
    assert passed == {
        "boxes_within_configured_bounds": True,
        "counts_match_config": True,
        "every_class_present_and_balanced": False,
        "every_image_readable": True,
    }
    failed = next(e for e in result.get_asset_check_evaluations() if not e.passed)
    assert "classes [2, 4] have no images" in failed.description


def test_train_only_image_folder_is_split_and_its_natural_imbalance_only_warns(embedded, offline_data, tmp_path):
    import dagster as dg
    from PIL import Image

    images, labels = real_cifar_images(offline_data)
    for copy in range(2):  # two files per real image: every class can give one to validation
        for i, (img, label) in enumerate(zip(images, labels)):
            folder = tmp_path / "folder" / "train" / CIFAR10_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / f"{copy}-{i:02d}.png")
    config = {"source": "image_folder", "source_uri": str(tmp_path / "folder"), "validation_fraction": 0.25}
    result = embedded.materialize(OCCLUSION, {"ops": {"occlusion_manifests": {"config": config}}})
    counts = np.bincount(labels)
    counts = 2 * counts[counts > 0]
    held = np.maximum(1, np.round(0.25 * counts)).astype(int)
    meta = materialization(result).metadata
    assert meta["num_validation"].value == held.sum() and meta["num_train"].value == counts.sum() - held.sum()
    logs = [e.user_message for e in embedded.instance.all_logs(result.run_id)]
    assert any(f"holding out {held.sum()} of {counts.sum()} train images" in m for m in logs)
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    balance = evaluations.pop("every_class_present_and_balanced")
    # All images were asked for (no num_train / num_validation): the source's own histogram is
    # reported and its imbalance is a warning, not a blocking failure.
    assert not balance.passed and balance.severity == dg.AssetCheckSeverity.WARN
    assert "no balanced subset asked for" in balance.description
    assert {name: e.passed for name, e in evaluations.items()} == {
        "boxes_within_configured_bounds": True,
        "counts_match_config": True,
        "every_image_readable": True,
    }


def test_checks_guard_a_cached_artifact_that_was_damaged(embedded, offline_data):
    first = embedded.materialize(OCCLUSION, fmnist_config(offline_data))
    root = embedded.store.local_path(materialization(first).metadata["cache_key"].value)
    manifest = root / "train.jsonl"
    rows = manifest.read_text().splitlines()
    bad = json.loads(rows[0])
    bad["box"] = [0, 0, 27, 27]  # a box far above the 42 % bound
    manifest.write_text("\n".join([json.dumps(bad), *rows[2:]]) + "\n")  # and one row fewer
    (root / "images" / "validation.npy").unlink()
    second = embedded.materialize(OCCLUSION, fmnist_config(offline_data), raise_on_error=False)
    assert materialization(second).metadata["cache"].value == "hit"
    # two rows fewer keeps every class within the 10 % balance tolerance: that check still passes
    assert checks_of(second, "occlusion_manifests") == {
        "boxes_within_configured_bounds": False,
        "counts_match_config": False,
        "every_class_present_and_balanced": True,
        "every_image_readable": False,
    }
    # the cheap size check on the hit found the damage, so the checks read the content again
    sources = {e.metadata["scan"].value for e in second.get_asset_check_evaluations()}
    assert sources == {
        "full scan (images/validation.npy: listed in the manifest but missing; "
        f"train.jsonl: {manifest.stat().st_size} bytes, the manifest says "
        f"{embedded.store.read_manifest(materialization(first).metadata['cache_key'].value).files['train.jsonl']['size']})"
    }


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"train_box_min": 0.5, "train_box_max": 0.4},
            "config of OcclusionManifestsConfig: train_box_min/train_box_max: box fractions must satisfy",
        ),
        (
            {"num_train": 0},
            "config of OcclusionManifestsConfig: field num_train: Input should be greater than or equal to 1",
        ),
        ({"num_train": 70000}, "num_train=70000 exceeds the 60000 images"),
        ({"source_uri": "/nonexistent/fmnist"}, "/nonexistent/fmnist: no such file or directory"),
    ],
)
def test_bad_manifest_config_fails_clearly_and_leaves_no_artifact(embedded, offline_data, overrides, message):
    result = embedded.materialize(OCCLUSION, fmnist_config(offline_data, **overrides), raise_on_error=False)
    assert not result.success
    assert message in failure_message(result)
    assert not list((embedded.tmp_path / "artifacts").glob("occlusion_manifests/*"))


def test_truncated_tarball_fails_naming_it_and_marks_the_mlflow_run_failed(
    embedded, offline_data, tmp_path, mlflow_uri
):
    images, labels = real_cifar_images(offline_data)
    tarball = write_cifar_tarball(tmp_path / "c.tar.gz", images, labels)
    tarball.write_bytes(tarball.read_bytes()[:3000])
    config = {"ops": {"occlusion_manifests": {"config": {"source": "cifar10", "source_uri": str(tarball)}}}}
    result = embedded.materialize(OCCLUSION, config, raise_on_error=False)
    assert "c.tar.gz: corrupt or truncated CIFAR-10 tarball" in failure_message(result)
    assert not list((embedded.tmp_path / "artifacts").glob("occlusion_manifests/*"))
    runs = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("vlm_assets").experiment_id],
        filter_string=f"tags.`dagster.run_id` = '{result.run_id}'",
    )
    assert [r.info.status for r in runs] == ["FAILED"]


def test_token_shards_asset_and_checks(embedded, offline_data):
    result = embedded.materialize(TOKENS, tokens_config(offline_data))
    meta = materialization(result, "token_shards").metadata
    assert meta["train_num_samples"].value == 400 and meta["val_num_tokens"].value == 40 * 128
    assert checks_of(result, "token_shards") == TOKEN_SHARD_CHECKS_PASS
    again = embedded.materialize(TOKENS, tokens_config(offline_data))
    assert materialization(again, "token_shards").metadata["cache"].value == "hit"
    # built: the checks judged the scan the build recorded; hit: the same scan after a size check
    for run in (result, again):
        assert {e.metadata["scan"].value for e in run.get_asset_check_evaluations()} == {
            "recorded when built (file sizes verified)"
        }
    assert checks_of(again, "token_shards") == checks_of(result, "token_shards")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"text_glob": "/nonexistent/*.txt"}, "text corpus '/nonexistent/*.txt' matches no files"),
        ({"tokenizer": "/nonexistent/tokenizer"}, "tokenizer '/nonexistent/tokenizer' cannot be loaded"),
        (
            {"max_length": 1},
            "config of TokenShardsConfig: field max_length: Input should be greater than or equal to 2",
        ),
        ({"max_length": 10_000_000}, "too short for one block"),
    ],
)
def test_bad_token_input_fails_clearly_and_leaves_no_artifact(embedded, offline_data, overrides, message):
    result = embedded.materialize(TOKENS, tokens_config(offline_data, **overrides), raise_on_error=False)
    assert message in failure_message(result)
    assert not list((embedded.tmp_path / "artifacts").glob("token_shards/*"))


def test_token_shards_on_s3_stream_back(embedded, offline_data, s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    from vlm_assets.data.token_stream import build_token_dataloaders
    from vlm_assets.defs.platform.storage import S3ArtifactStoreResource

    _, bucket = s3_bucket
    store = S3ArtifactStoreResource(
        bucket=bucket, prefix="vlm", cache_dir=str(tmp_path / "s3cache"), endpoint_url=s3_endpoint
    )
    result = embedded.materialize(TOKENS, tokens_config(offline_data), artifact_store=store)
    assert checks_of(result, "token_shards") == TOKEN_SHARD_CHECKS_PASS
    ref = result.output_for_node("token_shards")
    assert ref.uri.startswith(f"s3://{bucket}/vlm/token_shards/")

    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)  # mosaicml-streaming's knob for non-AWS endpoints
    loaders = build_token_dataloaders(ref.uri, tmp_path / "stream-cache", batch_size=16)
    streamed = np.concatenate([b["input_ids"].numpy() for b in loaders.val])
    local = build_token_dataloaders(str(store.get_store().local_path(ref.key)), tmp_path / "unused", batch_size=16)
    assert np.array_equal(streamed, np.concatenate([b["input_ids"].numpy() for b in local.val]))
    assert streamed.shape == (40, 128)


@pytest.mark.slow  # loads the definitions in processes of their own
def test_the_demo_profiles_counts_hold_only_for_its_own_source(offline_data, tmp_path):
    """Under the demo profile (2,000 + 1,000 Fashion-MNIST images), a user who points occlusion_manifests at
    their own folder gets all of its images, not "num_train=2000 exceeds" a count they never set; the
    profile's own source keeps its counts, and a count the user gives is theirs. In a fresh process:
    the profile is applied when the definitions load."""
    import subprocess
    import sys

    from PIL import Image

    images, labels = real_cifar_images(offline_data)
    for copy in range(2):
        for i, (img, label) in enumerate(zip(images, labels)):
            folder = tmp_path / "folder" / "train" / CIFAR10_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / f"{copy}-{i:02d}.png")
    code = f"""
import json, dagster as dg
from vlm_assets.defs.data.occlusion_assets import OcclusionManifestsConfig, occlusion_manifests
from vlm_assets.defs.platform.storage import LocalArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource

folder = {{"source": "image_folder", "source_uri": {str(tmp_path / "folder")!r}, "validation_fraction": 0.25}}
configs = {{
    "profile": OcclusionManifestsConfig(),
    "profile_source_again": OcclusionManifestsConfig(source_uri=OcclusionManifestsConfig().source_uri),
    "folder": OcclusionManifestsConfig(**folder),
    "folder_with_a_count": OcclusionManifestsConfig(**folder, num_train=30),
}}
with dg.instance_for_test() as instance:
    result = dg.materialize(
        [occlusion_manifests],
        resources={{
            "artifact_store": LocalArtifactStoreResource(root={str(tmp_path / "store")!r}),
            "mlflow": MlflowTrackingResource(
                tracking_uri="sqlite:///{tmp_path / "mlflow.db"}", artifact_location={(tmp_path / "mlruns").as_uri()!r}
            ),
        }},
        run_config={{"ops": {{"occlusion_manifests": {{"config": folder}}}}}},  # as the UI or a YAML gives it
        instance=instance,
    )
meta = result.asset_materializations_for_node("occlusion_manifests")[0].metadata
print(json.dumps({{
    **{{k: [c.num_train, c.num_validation] for k, c in configs.items()}},
    "materialized": [meta["num_train"].value, meta["num_validation"].value],
}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "VLM_ASSETS_PROFILE": "demo", "VLM_ASSETS_HOME": str(tmp_path / "home")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["profile"] == counts["profile_source_again"] == [2000, 1000]
    assert counts["folder"] == [None, None]
    assert counts["folder_with_a_count"] == [30, None]
    assert sum(counts["materialized"]) == 2 * len(labels)  # every image of the folder
