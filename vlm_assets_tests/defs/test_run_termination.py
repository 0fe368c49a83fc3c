"""A run terminated from the UI: `dagster dev` (webserver + daemon) on loopback, the run launched and
terminated through the webserver's GraphQL API while its GPT trains on 2 nodes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from vlm_assets_tests.conftest import free_port, training_workers
from vlm_assets_tests.defs.test_gpt_assets import run_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } ... on InvalidSubsetError { message } } }"""
TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId) {
  __typename ... on TerminateRunFailure { message } ... on PythonError { message } } }"""
STATUS = """query($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""


def _graphql(url: str, query: str, **variables):
    response = requests.post(f"{url}/graphql", json={"query": query, "variables": variables}, timeout=30)
    response.raise_for_status()
    body = response.json()
    assert "errors" not in body, body
    return body["data"]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_run_terminated_through_graphql_is_canceled_and_leaves_nothing_running(tmp_path, offline_data):
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(mlflow_uri).search_experiments()
    env = {**os.environ, "VLM_ASSETS_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(tmp_path / "dagster"),
           "MLFLOW_TRACKING_URI": mlflow_uri}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "dev.log", "w") as log:
        dev = subprocess.Popen([sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1",
                                "-p", str(port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        def up():
            try:
                return requests.get(f"{url}/server_info", timeout=2).ok
            except requests.RequestException:
                return False

        _wait(up, 120, "the webserver")
        params = {"selector": {"repositoryLocationName": "vlm_assets", "repositoryName": "__repository__",
                               "jobName": "__ASSET_JOB",
                               "assetSelection": [{"path": ["token_shards"]}, {"path": ["gpt_checkpoint"]}]},
                  "runConfigData": run_config(offline_data, max_steps=400)}
        launched = _graphql(url, LAUNCH, params=params)["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        marker = str(tmp_path / "home")
        checkpoints = tmp_path / "home" / "artifacts" / "checkpoints" / "gpt_checkpoint"
        _wait(lambda: list(checkpoints.glob("*/step-*/_COMPLETE.json")) and training_workers(
            "vlm_assets.train.gpt_pretrain", marker), 240, "training with a committed checkpoint")

        assert _graphql(url, TERMINATE, runId=run_id)["terminateRun"]["__typename"] == "TerminateRunSuccess"
        status = _wait(lambda: (s := _graphql(url, STATUS, runId=run_id)["runOrError"]["status"]) in (
            "CANCELED", "FAILURE", "SUCCESS") and s, 120, "the run to end")
        assert status == "CANCELED"
        _wait(lambda: not training_workers("vlm_assets.train.gpt_pretrain", marker), 15, "the workers to exit")
        client = MlflowClient(mlflow_uri)
        runs = client.search_runs([client.get_experiment_by_name("vlm_assets").experiment_id],
                                  filter_string="tags.`dagster.asset` = 'gpt_checkpoint'")
        assert [r.info.status for r in runs] == ["KILLED"]
        assert not list((tmp_path / "home" / "artifacts" / ".leases").glob("*.json"))  # released
    finally:
        os.killpg(dev.pid, 15)
        dev.wait(timeout=60)
