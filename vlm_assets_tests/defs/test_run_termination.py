"""Runs under `dagster dev` (webserver + daemon, the repo's dagster.yaml) on loopback, launched through
the webserver's GraphQL API while GPT trains on 2 nodes: one terminated from the UI (its GraphQL
terminate), one whose run worker is SIGKILLed (caught by run monitoring). Both with the local
launcher (torchrun processes) and with the k8s launcher (pods through the loopback control plane)."""

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from vlm_assets_tests.conftest import default_signals, free_port, training_workers
from vlm_assets_tests.defs.test_gpt_assets import run_config
from vlm_assets_tests.waiting import wait_until

# `dagster dev` stops its webserver, daemon and code server in seconds; a slower machine has 10x that.
STOP_S = 120

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } ... on InvalidSubsetError { message } } }"""
TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId) {
  __typename ... on TerminateRunFailure { message } ... on PythonError { message } } }"""
STATUS = """query($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""


def _graphql(url: str, query: str, **variables):
    response = requests.post(f"{url}/graphql", json={"query": query, "variables": variables}, timeout=120)
    response.raise_for_status()
    body = response.json()
    assert "errors" not in body, body
    return body["data"]


@dataclasses.dataclass
class Dev:
    url: str
    home: Path
    dagster_home: Path
    mlflow_uri: str
    run_config: dict
    launcher: str
    pods: object  # () -> names of the pods in the training namespace (k8s launcher)

    def launch(self, executor: str = "multiprocess") -> str:
        params = {
            "selector": {
                "repositoryLocationName": "vlm_assets",
                "repositoryName": "__repository__",
                "jobName": "__ASSET_JOB",
                "assetSelection": [{"path": ["token_shards"]}, {"path": ["gpt_checkpoint"]}],
            },
            "runConfigData": {**self.run_config, "execution": {"config": {executor: {}}}},
        }
        launched = _graphql(self.url, LAUNCH, params=params)["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return launched["run"]["runId"]

    def status(self, run_id: str) -> str:
        return _graphql(self.url, STATUS, runId=run_id)["runOrError"]["status"]

    def wait_for_training(self, checkpoints: int) -> list[int]:
        """Worker pids, once ``checkpoints`` more checkpoints than now are committed while they train."""
        folder = self.home / "artifacts" / "checkpoints" / "gpt_checkpoint"
        target = len(list(folder.glob("*/step-*/_COMPLETE.json"))) + checkpoints
        return wait_until(
            lambda: (
                len(list(folder.glob("*/step-*/_COMPLETE.json"))) >= target
                and training_workers("vlm_assets.train.gpt_pretrain", str(self.home))
            ),
            "training with a committed checkpoint",
        )

    def mlflow_statuses(self, run_id: str) -> list[str]:
        """Statuses of the MLflow runs of gpt_checkpoint in the Dagster run ``run_id``."""
        client = MlflowClient(self.mlflow_uri)
        runs = client.search_runs(
            [client.get_experiment_by_name("vlm_assets").experiment_id],
            filter_string=(f"tags.`dagster.asset` = 'gpt_checkpoint' and tags.`dagster.run_id` = '{run_id}'"),
        )
        return [r.info.status for r in runs]


@pytest.fixture(scope="module", params=["local", pytest.param("k8s", marks=pytest.mark.k8s)])
def dev(request, tmp_path_factory, offline_data):
    tmp_path = tmp_path_factory.mktemp("dev")
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(mlflow_uri).search_experiments()
    env = {
        **os.environ,
        "VLM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster"),
        "MLFLOW_TRACKING_URI": mlflow_uri,
    }
    pods, namespace = (lambda: []), None
    if request.param == "k8s":
        from kubernetes import client

        from vlm_assets_tests.defs.test_gpt_assets import k8s_launcher_env
        from vlm_assets_tests.k8s.testbed_fixtures import wait_for_default_service_account

        testbed = request.getfixturevalue("k8s_testbed")
        core = client.CoreV1Api(testbed.api())
        namespace = f"dev-{os.getpid()}"
        core.create_namespace({"metadata": {"name": namespace}})
        wait_for_default_service_account(core, namespace)
        env.update(k8s_launcher_env(tmp_path, testbed, namespace))
        pods = lambda: [p.metadata.name for p in core.list_namespaced_pod(namespace).items]  # noqa: E731
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "dev.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_signals,
        )
    try:

        def up():
            try:
                return requests.get(f"{url}/server_info", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(up, "the webserver")
        yield Dev(
            url,
            tmp_path / "home",
            tmp_path / "dagster",
            mlflow_uri,
            run_config(offline_data, optimizer={"max_steps": 400}),
            request.param,
            pods,
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=STOP_S)
            stuck = None
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            stuck = (tmp_path / "dev.log").read_text()[-2000:]
        if namespace:
            left = pods()
            core.delete_namespace(namespace)
            assert not left, f"pods left in {namespace}: {left}"
        assert stuck is None, f"`dagster dev` did not stop within {STOP_S} s of SIGTERM; its log ends:\n{stuck}"


def test_a_run_terminated_through_graphql_is_canceled_and_leaves_nothing_running(dev):
    # Dagster's multiprocess executor interrupts the step process; its in-process executor (every job's
    # default here) cannot reach a step that waits on its workers, and the launch itself asks whether its
    # run is being canceled (defs/platform/launcher.py). One of each, to keep the suite's time.
    run_id = dev.launch(executor="in_process" if dev.launcher == "local" else "multiprocess")
    dev.wait_for_training(checkpoints=1)
    assert _graphql(dev.url, TERMINATE, runId=run_id)["terminateRun"]["__typename"] == "TerminateRunSuccess"
    status = wait_until(lambda: (s := dev.status(run_id)) in ("CANCELED", "FAILURE", "SUCCESS") and s, "the run to end")
    assert status == "CANCELED"
    wait_until(lambda: not training_workers("vlm_assets.train.gpt_pretrain", str(dev.home)), "the workers to exit")
    assert not dev.pods()  # the step deleted its pods (and waited until they were gone) before it ended
    assert dev.mlflow_statuses(run_id) == ["KILLED"]
    assert not list((dev.home / "artifacts" / ".leases").glob("*.json"))  # released


def test_a_sigkilled_run_worker_ends_its_workers_and_the_run_fails(dev):
    """The run worker (`dagster api execute_run`, the orchestrator of the multiprocess executor) is
    SIGKILLed: its step process, agents and workers end by their parent-death signals; the run is
    marked failed (by the code server that started the worker, or else by run monitoring:
    ``test_run_monitoring``) and the run failure sensor ends its MLflow run KILLED. Pods do not die
    with a process: with the k8s launcher the same sensor deletes the run's pods and Service."""
    import dagster as dg

    from vlm_assets.defs.platform.run_launcher import run_worker
    from vlm_assets.launch.local import alive, process_tree

    run_id = dev.launch()
    workers = dev.wait_for_training(checkpoints=1)
    with dg.DagsterInstance.from_config(str(dev.dagster_home)) as instance:
        pid, _ = run_worker(instance, run_id)
    children = process_tree(pid)[1:]  # the step process, and with the local launcher its agent and workers
    assert children, f"the run worker {pid} has no step process"
    os.kill(pid, signal.SIGKILL)
    if dev.launcher == "k8s":
        wait_until(lambda: not dev.pods(), "the sensor to delete the dead run's pods")
    wait_until(lambda: not any(alive(w) for w in workers), "the workers to die with the run worker (or their pods)")
    wait_until(lambda: not any(alive(c) for c in children), "the run worker's step process and its children to end")
    status = wait_until(lambda: (s := dev.status(run_id)) != "STARTED" and s, "the run to be marked ended")
    assert status == "FAILURE"
    # The step's MLflow run, which no code of the killed step could end, is ended by the sensor.
    wait_until(lambda: dev.mlflow_statuses(run_id) == ["KILLED"], "the MLflow run to be ended KILLED")
    with dg.DagsterInstance.from_config(str(dev.dagster_home)) as instance:
        reports = instance.get_records_for_run(
            run_id,
            of_type={
                dg.DagsterEventType.STEP_FAILURE,
                dg.DagsterEventType.STEP_UP_FOR_RETRY,
                dg.DagsterEventType.STEP_SUCCESS,
            },
        ).records
        reports = [r for r in reports if r.event_log_entry.step_key == "gpt_checkpoint"]
    # The step process died with the run worker: a step that lived on would report its launch
    # failing once its pods were deleted (and end the MLflow run FAILED over the sensor's KILLED).
    assert not reports, [r.event_log_entry.dagster_event.event_type_value for r in reports]
