"""Two real `dagster asset materialize` processes building one key at once, on the local store and on
a loopback S3 server: one builds, the other waits on its lease and reuses the artifact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_assets_tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
# Blocks of 4 tokens: ~15 s of building, so the second process starts while the first holds the lease.
CONFIG = json.dumps({"ops": {"token_shards": {"config": {"max_length": 4}}}})


def _launch(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster",
            "asset",
            "materialize",
            "-m",
            "vlm_assets.definitions",
            "--select",
            "token_shards",
            "--config-json",
            CONFIG,
        ],
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def _two_runs(tmp_path: Path, env: dict[str, str], lease_visible) -> tuple[str, str]:
    from mlflow import MlflowClient

    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments()  # create and migrate the db once
    first = _launch(env, tmp_path / "first.log")
    try:
        wait_until(lease_visible, "the first run's lease", every=0.2)
        second = _launch(env, tmp_path / "second.log")
        assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-4000:]
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-4000:]
    finally:
        first.kill()
    logs = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert "committed " in logs[0] and "cache hit" not in logs[0]
    assert "is being built by run " in logs[1] and ": waiting for it" in logs[1]
    assert "cache hit: " in logs[1] and "committed " not in logs[1]
    return logs


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "VLM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster"),
        "VLM_ASSETS_PROFILE": "demo",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        **extra,
    }
    return env


@pytest.mark.slow
def test_two_runs_of_one_key_on_the_local_store(tmp_path, offline_data):
    leases = tmp_path / "home" / "artifacts" / ".leases"
    _two_runs(tmp_path, _env(tmp_path), lambda: any(leases.glob("token_shards__*.json")))
    artifacts = list((tmp_path / "home" / "artifacts" / "token_shards").glob("*/_COMPLETE.json"))
    assert len(artifacts) == 1
    assert not list(leases.glob("*.json"))  # released
    assert not list((tmp_path / "home" / "artifacts" / ".staging").iterdir())


@pytest.mark.slow
def test_two_runs_of_one_key_on_s3(tmp_path, offline_data, s3_bucket, s3_endpoint):
    client, bucket = s3_bucket
    env = _env(
        tmp_path,
        VLM_ASSETS_STORE="s3",
        VLM_ASSETS_S3_BUCKET=bucket,
        VLM_ASSETS_S3_PREFIX="team",
        AWS_ENDPOINT_URL=s3_endpoint,
    )

    def keys(prefix):
        return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]

    _two_runs(tmp_path, env, lambda: bool(keys("team/.leases/token_shards__")))
    pointers = [k for k in keys("team/token_shards/") if k.endswith("_COMPLETE.json")]
    assert len(pointers) == 1 and not keys("team/.leases/")
    manifest = json.loads(client.get_object(Bucket=bucket, Key=pointers[0])["Body"].read())
    commit_dirs = {k.split("/")[3] for k in keys("team/token_shards/") if not k.endswith("_COMPLETE.json")}
    assert commit_dirs == {manifest["location"]}  # one content-addressed commit, nothing stray


def test_an_experiment_created_by_another_run_after_the_lookup_is_used(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from vlm_assets.defs.platform.tracking import MlflowTrackingResource

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = MlflowTrackingResource(tracking_uri=uri, artifact_location=(tmp_path / "mlruns").as_uri())
    other = MlflowTrackingResource(tracking_uri=uri, artifact_location=(tmp_path / "mlruns").as_uri())
    created = other.experiment_id()  # by another run, just after this run's lookup found nothing:
    lookup, calls = MlflowClient.get_experiment_by_name, []

    def lookup_made_before_the_other_run_created_it(client, name):
        calls.append(name)
        return None if len(calls) == 1 else lookup(client, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", lookup_made_before_the_other_run_created_it)
    assert tracking.experiment_id() == created
