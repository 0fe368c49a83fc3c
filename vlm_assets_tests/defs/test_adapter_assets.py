"""occlusion_manifests -> occlusion_adapter -> eval_report -> registered_adapter on CPU, with a tiny
Qwen2.5-VL (built from a config, saved and loaded through from_pretrained) that first learned the
clean Fashion-MNIST task and is then frozen; the adapter trains at 2 processes through the launcher."""

import atexit
import functools
import json
import re
import shutil
import tempfile
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from vlm_assets.defs.data.occlusion_assets import occlusion_manifests
from vlm_assets.defs.models.adapter_assets import occlusion_adapter
from vlm_assets.defs.models.eval_assets import eval_report, registered_adapter
from vlm_assets.train.run_config import overlay
from vlm_assets_tests.conftest import (
    ADAPTER_AND_EVAL_CHECKS_PASS,
    IsolatedEnv,
    checks_of,
    kill_mid_training_and_relaunch,
    training_workers,
)

pytestmark = pytest.mark.slow

EPOCHS = 6
SIZE = 28  # the images' own size
NUM_VALIDATION = 1000
GRAPH = [occlusion_manifests, occlusion_adapter, eval_report, registered_adapter]  # checks: in the assets' steps
TRAINING = GRAPH[:2]
TRAINING_OPS = tuple(a.key.to_user_string() for a in TRAINING)


def training_config(config: dict) -> dict:
    """``config`` cut to the training assets' ops (the runs that train and stop there: no evaluation)."""
    return {"ops": {k: v for k, v in config["ops"].items() if k in TRAINING_OPS}}


# The demo's recipe (reconstruction alone: the backbone is not loaded to train) at the images' own
# 28 px, on every train row, in front of a backbone taught the clean task for 800 steps. 1,000
# validation rows: the gain's interval clears 0 with a wide margin on AVX2 and on AVX-512 kernels.
ADAPTER = {
    "model": {"adapter_steps": 6},
    "optimizer": {
        "global_batch_size": 16,
        "lr": 1e-2,
        "epochs": EPOCHS,
        "reconstruction_warmup_epochs": EPOCHS,
        "reconstruction_loss_weight": 1.0,
        "reconstruction_outside_box": True,
    },
    "data": {"image_size": SIZE},
    "parallelism": {"nproc_per_node": 2, "micro_batch_size": 8},
    "log_every": 10,
}


def manifests_config(offline_data) -> dict:
    return {
        "source": "fashion_mnist",
        "source_uri": str(offline_data / "fashion-mnist"),
        "num_train": 1000,
        "num_validation": NUM_VALIDATION,
    }


@functools.cache
def clean_backbone(offline_data: Path) -> str:
    """The frozen backbone of these tests, built once per session: a tiny Qwen2.5-VL taught the clean
    task for 800 steps on the train split of the manifests the graph builds from the same config (built
    here by the occlusion_manifests asset itself, in a store of their own)."""
    from vlm_assets_tests.clean_backbone import teach_clean_task

    root = Path(tempfile.mkdtemp(prefix="clean-backbone-"))
    atexit.register(shutil.rmtree, root, True)
    env = IsolatedEnv(root, [occlusion_manifests])
    built = env.materialize({"ops": {"occlusion_manifests": {"config": manifests_config(offline_data)}}})
    manifests = env.store.local_path(meta(built, "occlusion_manifests")["cache_key"])
    return str(teach_clean_task(manifests, root, image_size=ADAPTER["data"]["image_size"], steps=800))


def adapter_config(offline_data) -> dict:
    return overlay(ADAPTER, {"model": {"backbone": clean_backbone(offline_data)}})


def run_config(offline_data, adapter=None, report=None, min_accuracy=0.3):
    return {
        "ops": {
            "occlusion_manifests": {"config": manifests_config(offline_data)},
            "occlusion_adapter": {"config": overlay(adapter_config(offline_data), adapter or {})},
            "eval_report": {
                "config": {
                    "num_samples": NUM_VALIDATION,
                    "batch_size": 50,
                    "num_cards": 12,
                    "checks": {"min_accuracy": min_accuracy},
                    **(report or {}),
                }
            },
        }
    }


def Env(root: Path) -> IsolatedEnv:
    return IsolatedEnv(root, GRAPH)


def meta(result, asset):
    materializations = result.asset_materializations_for_node(asset)
    return {k: getattr(v, "value", v) for k, v in materializations[0].metadata.items()} if materializations else None


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, offline_data):
    env = Env(tmp_path_factory.mktemp("adapter"))
    result = env.materialize(run_config(offline_data))
    return env, result


def test_adapter_helps_the_frozen_backbone_and_is_registered(pipeline):
    env, result = pipeline
    assert result.success
    checks = checks_of(result, "occlusion_adapter", "eval_report")
    assert checks == ADAPTER_AND_EVAL_CHECKS_PASS
    report = meta(result, "eval_report")
    # The backbone knows the clean task; occlusion costs accuracy; the adapter wins part of it back,
    # beyond the evaluation's noise (the gate's own criterion).
    assert report["accuracy_clean"] > report["accuracy_identity"]
    assert report["adapter_gain"] >= 0.03 and report["adapter_gain_ci95_low"] > 0, report
    print(
        {k: report[k] for k in ("accuracy_clean", "accuracy_identity", "accuracy_adapter", "lenient_accuracy_adapter")}
    )
    adapter = meta(result, "occlusion_adapter")
    assert adapter["epochs"] == EPOCHS and np.isfinite(adapter["gate"])


def test_checkpoints_hold_only_the_adapter(pipeline):
    env, result = pipeline
    key = meta(result, "occlusion_adapter")["cache_key"]
    checkpoints = env.store.list_complete(f"checkpoints/{key}")
    assert checkpoints, "no recovery checkpoint was committed"
    ckpt = torch.load(env.store.local_path(checkpoints[-1]) / "checkpoint.ckpt", weights_only=False)
    assert sorted(ckpt["state_dict"]) == ["adapter.gate"] + sorted(
        f"adapter.net.{i}.{p}" for i in (0, 2, 4) for p in ("bias", "weight")
    )
    assert (env.store.local_path(checkpoints[-1]) / "checkpoint.ckpt").stat().st_size < 1_000_000
    assert len(ckpt["callbacks"]["EpochHistory"]["epochs"]) == EPOCHS
    assert any(name.startswith("ModelCheckpoint") for name in ckpt["callbacks"])


def test_lightning_logged_the_metrics_into_the_assets_mlflow_run(pipeline):
    env, result = pipeline
    run_id = meta(result, "occlusion_adapter")["mlflow_run_id"]
    client = mlflow.MlflowClient(env.uri)
    history = json.loads((Path(meta(result, "occlusion_adapter")["uri"]) / "history.json").read_text())["epochs"]
    # Each epoch's train mean and validation, at the step that ended the epoch.
    epochs = client.get_metric_history(run_id, "train_epoch/loss")
    assert [(m.step, m.value) for m in epochs] == [(row["step"], pytest.approx(row["train/loss"])) for row in history]
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [row["step"] for row in history]
    assert len(client.get_metric_history(run_id, "train/loss")) >= 3  # every log_every steps
    assert client.get_run(run_id).info.status == "FINISHED"


def test_html_report_shows_the_cards(pipeline):
    env, result = pipeline
    html = (Path(meta(result, "eval_report")["uri"]) / "report.html").read_text()
    assert html.count("class='card'") == 12
    assert len(re.findall(r"src='data:image/png;base64,", html)) == 36  # occluded, adapter output, clean
    assert "Adapter gain" in html and "Per class" in html and "<h2>Training</h2>" in html


def test_champion_loads_and_predicts(pipeline, offline_data):
    env, result = pipeline
    mlflow.set_tracking_uri(env.uri)
    model = mlflow.pyfunc.load_model("models:/occlusion_adapter@champion")
    from vlm_assets.data.image_sources import load_fashion_mnist
    from vlm_assets.models.adapter_pyfunc import png_b64

    source = load_fashion_mnist(offline_data / "fashion-mnist")
    images = source.eval.images[-4:]  # test-set images the manifests did not use
    frame = pd.DataFrame({"image": [png_b64(img) for img in images], "box": [[8, 8, 18, 18]] * 4})
    predictions = model.predict(frame)
    assert len(predictions) == 4 and all(p in source.class_names for p in predictions), predictions


def test_rerun_is_all_cache_hits(pipeline, offline_data):
    env, _ = pipeline
    again = env.materialize(run_config(offline_data))
    for asset in ("occlusion_manifests", "occlusion_adapter", "eval_report"):
        assert meta(again, asset)["cache"] == "hit", asset
    assert meta(again, "registered_adapter")["registry"] == "already current"


def test_registry_is_the_truth_alias_mended_and_no_second_version(pipeline, offline_data):
    env, first = pipeline
    client = mlflow.MlflowClient(env.uri)
    versions = client.search_model_versions("name = 'occlusion_adapter'")
    champion = client.get_model_version_by_alias("occlusion_adapter", "champion")
    assert champion.tags["weights_sha256"] == meta(first, "registered_adapter")["weights_sha256"]
    client.delete_registered_model_alias("occlusion_adapter", "champion")  # moved away by hand
    again = env.materialize(run_config(offline_data))
    assert meta(again, "registered_adapter")["registry"] == "alias moved"
    assert client.get_model_version_by_alias("occlusion_adapter", "champion").version == champion.version
    assert len(client.search_model_versions("name = 'occlusion_adapter'")) == len(versions)

    # A registry that was reset (here: a new MLflow store beside the same artifacts): everything else
    # is a cache hit, and the adapter is registered again there.
    fresh = IsolatedEnv(env.root, GRAPH, f"sqlite:///{env.root / 'fresh-mlflow.db'}")
    reset = fresh.materialize(run_config(offline_data))
    assert (
        meta(reset, "occlusion_adapter")["cache"] == "hit"
        and meta(reset, "registered_adapter")["registry"] == "registered"
    )
    assert (
        str(mlflow.MlflowClient(fresh.uri).get_model_version_by_alias("occlusion_adapter", "champion").version) == "1"
    )


def test_registered_model_predicts_what_eval_report_predicted(pipeline):
    """Train/serve parity: the registry's model, fed the validation rows as PNG + box, gives exactly the
    answers eval_report gave for the same rows (one preprocessing for both)."""
    from vlm_assets.data.occlusion import ManifestImages, read_manifest
    from vlm_assets.models.adapter_pyfunc import png_b64

    env, first = pipeline
    manifests = env.store.local_path(meta(first, "occlusion_manifests")["cache_key"])
    evaluated = [
        json.loads(line)
        for line in (Path(meta(first, "eval_report")["uri"]) / "predictions.jsonl").read_text().splitlines()
    ]
    rows = read_manifest(manifests / "validation.jsonl")[: len(evaluated)]
    images = ManifestImages(manifests)
    frame = pd.DataFrame({"image": [png_b64(images.get(r)) for r in rows], "box": [r["box"] for r in rows]})
    mlflow.set_tracking_uri(env.uri)
    info = mlflow.models.get_model_info("models:/occlusion_adapter@champion")
    assert info.signature.inputs.input_names() == ["image", "box"] and info.signature.outputs.input_names() == ["label"]
    served = mlflow.pyfunc.load_model("models:/occlusion_adapter@champion").predict(frame)
    assert len(served) == len(evaluated) == NUM_VALIDATION
    assert served == [e["adapter"].strip() for e in evaluated]


def test_the_champion_served_over_http_answers_as_eval_report_did(pipeline, tmp_path):
    """`mlflow models serve -m models:/occlusion_adapter@champion --env-manager local`: a JSON request
    of base64 PNGs and boxes gets eval_report's answers for those rows; a malformed one gets a 400
    naming the row and field."""
    from vlm_assets.data.occlusion import ManifestImages, read_manifest
    from vlm_assets.models.adapter_pyfunc import png_b64
    from vlm_assets_tests.conftest import mlflow_serve

    env, first = pipeline
    manifests = env.store.local_path(meta(first, "occlusion_manifests")["cache_key"])
    evaluated = [
        json.loads(line)
        for line in (Path(meta(first, "eval_report")["uri"]) / "predictions.jsonl").read_text().splitlines()
    ][:16]
    rows = read_manifest(manifests / "validation.jsonl")[: len(evaluated)]
    images = ManifestImages(manifests)
    records = [{"image": png_b64(images.get(r)), "box": r["box"]} for r in rows]
    with mlflow_serve("models:/occlusion_adapter@champion", env.uri, tmp_path / "serve.log") as post:
        status, body = post({"dataframe_records": records})
        assert status == 200, body
        assert body["predictions"] == [e["adapter"].strip() for e in evaluated]
        status, body = post({"dataframe_records": [{"image": "not base64!", "box": [1, 1, 5, 5]}]})
        assert status == 400 and "row 0: field 'image': not base64" in body["message"], body
        status, body = post({"dataframe_records": [{**records[0], "box": [0, 0, 99, 5]}]})
        assert (
            status == 400 and "row 0: field 'box': box [0, 0, 99, 5] is not inside the 28x28 image" in body["message"]
        )
        status, body = post({"dataframe_records": [{"image": records[0]["image"]}]})
        assert status == 400 and "box" in body["message"], body  # MLflow's own schema check


def test_unreachable_registry_fails_naming_the_uri(pipeline, monkeypatch):
    import dagster as dg

    from vlm_assets.defs.models.eval_assets import RegisteredAdapterConfig
    from vlm_assets.defs.platform.tracking import MlflowTrackingResource
    from vlm_assets_tests.conftest import free_port

    env, first = pipeline
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://127.0.0.1:{free_port()}"
    (key,) = env.store.list_complete("occlusion_adapter")
    with pytest.raises(dg.Failure, match=f"MLflow at {uri} could not be reached"):
        registered_adapter(
            dg.build_asset_context(),
            config=RegisteredAdapterConfig(),
            occlusion_adapter=env.store.ref(key),
            artifact_store=env.resources["artifact_store"],
            mlflow=MlflowTrackingResource(tracking_uri=uri),
        )


def test_raised_threshold_reruns_the_check_only_and_blocks_registration(pipeline, offline_data):
    env, _ = pipeline
    client = mlflow.MlflowClient(env.uri)
    before = client.get_model_version_by_alias("occlusion_adapter", "champion").version
    result = env.materialize(run_config(offline_data, min_accuracy=1.0), raise_on_error=False)
    checks = checks_of(result, "eval_report")
    assert checks["adapter_accuracy_meets_threshold"] is False
    # The threshold is the check's own config: nothing was trained or evaluated again.
    assert meta(result, "occlusion_adapter")["cache"] == "hit" and meta(result, "eval_report")["cache"] == "hit"
    assert meta(result, "registered_adapter") is None  # never ran
    assert client.get_model_version_by_alias("occlusion_adapter", "champion").version == before


def _workers(marker: str) -> list[int]:
    return training_workers("vlm_assets.train.adapter_train", marker)


def test_sigkill_of_dagster_then_of_a_worker_each_resume_the_same_losses(pipeline, offline_data, tmp_path):
    """`dagster job execute -j adapter_job` under the multiprocess executor, its orchestrator SIGKILLed
    while the adapter trains on 2 processes, after its first recovery checkpoint: the step's process,
    its agent and both workers end, nothing is committed after it; the relaunch marks the dead run
    failed and its MLflow run KILLED and resumes from that checkpoint. In the relaunch a worker is
    SIGKILLed after its first checkpoint: the step's retry resumes from that one, and the run ends on
    the uninterrupted losses, epoch by epoch."""
    env, first = pipeline
    config = training_config(run_config(offline_data))
    run = kill_mid_training_and_relaunch(
        tmp_path,
        "adapter_job",
        config,
        "occlusion_adapter",
        checkpoints_before_kill=1,
        executor="multiprocess",
        kill_a_worker_of="vlm_assets.train.adapter_train",
    )
    # one MLflow run per attempt: the killed orchestrator's, the attempt whose worker died, the retry's
    assert run.mlflow_statuses("occlusion_adapter") == ["FAILED", "FINISHED", "KILLED"]

    adapter = run.materialization("occlusion_adapter")
    # the first kill came after epoch 1 or 2, the worker's after the relaunch's next checkpoint
    assert 2 <= adapter["resumed_from_epoch"] < EPOCHS and adapter["epochs"] == EPOCHS
    resumed = json.loads((Path(adapter["uri"]) / "history.json").read_text())["epochs"]
    uninterrupted = json.loads((Path(meta(first, "occlusion_adapter")["uri"]) / "history.json").read_text())["epochs"]
    assert [e["epoch"] for e in resumed] == list(range(EPOCHS))  # the epochs before each kill are in the checkpoint
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["val/loss"] == pytest.approx(b["val/loss"], abs=1e-4)


def test_bad_input_fails_at_once_naming_the_row_or_field(pipeline, offline_data, tmp_path):
    env, first = pipeline
    missing = tmp_path / "nope"
    result = env.materialize(
        run_config(offline_data, adapter={"model": {"backbone": str(missing)}}), raise_on_error=False
    )
    assert f"config field model.backbone: directory {missing} does not exist" in _failure(result)

    result = env.materialize(run_config(offline_data, adapter={"data": {"max_length": 20}}), raise_on_error=False)
    assert re.search(r"train\.jsonl:1: prompt \+ answer is \d+ tokens .* longer than max_length 20", _failure(result))


def _failure(result) -> str:
    failures = result.get_step_failure_events()
    assert len(failures) == 1 and not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    return failures[0].step_failure_data.user_failure_data.description


def test_bad_manifest_rows_are_named(pipeline, tmp_path):
    import shutil

    from vlm_assets.data.occlusion_dataset import OcclusionSamples

    env, first = pipeline
    root = tmp_path / "m"
    shutil.copytree(env.store.local_path(meta(first, "occlusion_manifests")["cache_key"]), root)
    lines = (root / "train.jsonl").read_text().splitlines()
    row = json.loads(lines[2])
    row["index"] = 10**6  # an image that is not there
    (root / "train.jsonl").write_text("\n".join(lines[:2] + [json.dumps(row)] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:3: field 'index' 1000000 is outside"):
        OcclusionSamples(root, "train", 56, None).check_images()
    row = json.loads(lines[4])
    row["box"] = [0, 0, 40, 10]  # wider than the 28 px image
    (root / "validation.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"validation\.jsonl:1: field 'box' \[0, 0, 40, 10\] lies outside"):
        OcclusionSamples(root, "validation", 56, None)
    (root / "images" / "train.npy").unlink()
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl:1: image file .*train\.npy does not exist"):
        OcclusionSamples(root, "train", 56, None).check_images()


def test_training_changes_only_the_adapter(pipeline, offline_data, tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader

    from vlm_assets.data.occlusion_dataset import OcclusionSamples, collate
    from vlm_assets.train.adapter_config import AdapterTrainConfig
    from vlm_assets.train.adapter_module import AdapterModule

    env, first = pipeline
    manifests = env.store.local_path(meta(first, "occlusion_manifests")["cache_key"])
    module = AdapterModule(
        AdapterTrainConfig(data={"image_size": SIZE}, optimizer={"lr": 5e-3}), clean_backbone(offline_data)
    )
    module.configure_model()
    backbone_before = {k: v.clone() for k, v in module.backbone.state_dict().items()}
    adapter_before = {k: v.clone() for k, v in module.adapter.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(OcclusionSamples(manifests, "train", SIZE, 24), batch_size=8, collate_fn=collate))
    assert all(torch.equal(v, backbone_before[k]) for k, v in module.backbone.state_dict().items())
    assert not module.backbone.model.training  # kept in eval mode while the adapter trained
    assert not module.backbone.model.model.language_model.layers[0].training
    assert all(not p.requires_grad for p in module.backbone.parameters())
    assert any(not torch.equal(v, adapter_before[k]) for k, v in module.adapter.state_dict().items())


def test_training_that_fails_for_good_materializes_a_partial_that_blocks(pipeline, offline_data):
    import os
    import signal
    import threading

    env, _ = pipeline
    done = threading.Event()
    kills = []

    def kill_every_attempt_after_a_checkpoint():
        while not done.is_set():
            new = set(env.root.glob("artifacts/checkpoints/occlusion_adapter/*")) - before
            if any(d.glob("step-*/_COMPLETE.json") for d in new):
                for pid in _workers(str(env.root)):
                    if pid not in kills:
                        kills.append(pid)
                        os.kill(pid, signal.SIGKILL)
            done.wait(0.05)

    # A new cache key (epochs=4, 64 rows an epoch) whose checkpoints do not exist yet: the first attempt
    # dies after its first epoch, each retry as soon as its workers exist.
    before = set(env.root.glob("artifacts/checkpoints/occlusion_adapter/*"))
    killer = threading.Thread(target=kill_every_attempt_after_a_checkpoint)
    killer.start()
    try:
        result = env.materialize(
            run_config(
                offline_data,
                adapter={
                    "optimizer": {"epochs": 4, "reconstruction_warmup_epochs": 4},
                    "data": {"num_train": 64, "num_validation": 64},
                    "checkpoint": {"materialize_partial_on_failure": True},
                },
            ),
            raise_on_error=False,
        )
    finally:
        done.set()
        killer.join()
    assert len([e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]) == 2
    adapter = meta(result, "occlusion_adapter")
    assert adapter["partial"] is True and adapter["epochs"] < 4
    checks = checks_of(result, "occlusion_adapter")
    assert checks["adapter_training_complete"] is False
    assert meta(result, "eval_report") is None and meta(result, "registered_adapter") is None
    assert set(env.root.glob("artifacts/checkpoints/occlusion_adapter/*")) - before
