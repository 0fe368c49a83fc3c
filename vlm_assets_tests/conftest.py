"""Shared fixtures: real offline data, an isolated embedded default, a loopback S3 server."""

import contextlib
import dataclasses
import functools
import http.server
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_assets_tests.waiting import BOUND_S

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# scripts/test.sh runs two pytest processes at once on the same cores, each with its own torch work and
# training processes: an OpenMP thread (torch's and MKL's, libgomp) that spins while it waits for its next
# parallel region, libgomp's default, burns CPU the other lane's processes need. PASSIVE makes it sleep;
# libgomp reads it when torch first loads, so it is set before any test imports torch, for every child.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# In-process tests give their config over the seed defaults (the config classes' own); the demo
# profile's defaults are tested by loading the code location in a subprocess and by `main_job`.
os.environ["VLM_ASSETS_PROFILE"] = "seed"


def pytest_sessionfinish(session, exitstatus):
    """VLM_TESTS_FAIL_ON_SKIP=1 (scripts/gpu-check.sh, scripts/test.sh's gpu pass): a skipped test fails
    the run, so that a kit that could not run a test never reads as green."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("VLM_TESTS_FAIL_ON_SKIP") == "1" and skipped and session.exitstatus == 0:
        reporter.write_line(f"VLM_TESTS_FAIL_ON_SKIP: {len(skipped)} test(s) skipped, which fails this run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Modules (paths under vlm_assets_tests/) whose tests mostly wait, on daemon ticks, servers, leases and
# installs, rather than compute, or use under one core (the VisualChat trainer's tests: small runs whose
# time is mostly process start-up and the gloo rendezvous). scripts/test.sh runs them (the `beside`
# marker) in a second pytest process beside the rest, whose training fills the cores they leave idle
# (bench/bench_speed.py --suite measures the suite in its lanes, and each module's busy cores). The
# modules that use the k8s testbed join them, last: its control plane listens on fixed ports, so only one
# process may start it, and their tests wait on pods much of the time.
BESIDE = (
    "team/",
    "defs/test_run_termination.py",
    "defs/test_concurrent_runs.py",
    "defs/test_pool_wait.py",
    "storage/test_artifact_stores.py",
    "test_gpu_kit.py",
    "train/test_visualchat_train.py",
)


def _module(item, here: Path) -> str:
    """The item's file as a path under ``here``; empty for a file outside it."""
    return item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""


@pytest.hookimpl(tryfirst=True)  # the markers it adds must be there when `-m` deselects
def pytest_collection_modifyitems(items):
    """Mark the testbed's users `k8s`, and `beside` the tests of BESIDE's modules and of every module that
    uses the testbed. Those modules run last, each whole (its module fixtures are built once): on a fresh
    machine scripts/test.sh builds the testbed (minutes of Go, at the lowest CPU priority) beside the
    other tests, and the control plane, once started, runs until the session ends."""
    for item in items:
        if "k8s_testbed" in item.fixturenames:
            item.add_marker(pytest.mark.k8s)
    k8s = {item.path for item in items if item.get_closest_marker("k8s")}
    here = Path(__file__).parent
    for item in items:
        if item.path in k8s or _module(item, here).startswith(BESIDE):
            item.add_marker(pytest.mark.beside)
    items.sort(key=lambda item: item.path in k8s)


@pytest.fixture(scope="session")
def offline_data() -> Path:
    """The real data of ../shared/OFFLINE-DATA.md, fetched by scripts/fetch-offline-data.sh."""
    from vlm_assets.paths import offline_data_dir

    root = offline_data_dir()
    if not (root / ".complete").is_file():
        pytest.fail(f"offline data missing in {root}: run scripts/fetch-offline-data.sh (scripts/test.sh does)")
    return root


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One sqlite MLflow store for the session (a fresh store takes seconds to migrate)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def embedded(tmp_path, monkeypatch, mlflow_uri):
    """An isolated embedded default: VLM_ASSETS_HOME, DAGSTER_HOME and artifact store under tmp_path."""
    import dagster as dg

    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    resources = IsolatedEnv(tmp_path, [], mlflow_uri).resources
    with dg.instance_for_test() as instance:
        yield Embedded(resources, instance, tmp_path)


class Embedded:
    def __init__(self, resources, instance, tmp_path):
        self.resources = resources
        self.instance = instance
        self.tmp_path = tmp_path

    @property
    def store(self):
        return self.resources["artifact_store"].get_store()

    def materialize(self, assets, run_config=None, raise_on_error=True, **resources):
        import dagster as dg

        return dg.materialize(
            assets,
            resources={**self.resources, **resources},
            run_config=run_config or {},
            instance=self.instance,
            raise_on_error=raise_on_error,
        )


def default_signals() -> None:
    """``preexec_fn`` of a process a test stops with SIGTERM: SIGINT and SIGTERM at their defaults and
    unblocked. An ignored or blocked signal stays so across exec, and this process's SIGINT may be ignored
    (a suite started in the background by a shell, or left so by library code run in-process: Lightning
    ignores it after an interrupt). `dagster dev` maps SIGTERM to its SIGINT handler, so it would then
    never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """moto's standalone S3 server as a separate process on loopback: real HTTP, real boto3 client."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + BOUND_S  # a cold, loaded machine imports moto's ~100 service modules slowly
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        proc.wait()
        pytest.fail(f"moto server did not start (exit {proc.returncode}); its log:\n{log.read_text()[-3000:]}")
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    yield url
    proc.terminate()
    proc.wait(timeout=BOUND_S)


@pytest.fixture
def s3_bucket(s3_endpoint):
    import uuid

    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return client, name


@contextlib.contextmanager
def serve_directory(directory: Path):
    """A loopback HTTP server for one directory; yields its base URL and a list of requested paths."""
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def mlflow_serve(model_uri: str, tracking_uri: str, log: Path):
    """`mlflow models serve -m MODEL_URI --env-manager local` on loopback, as a user starts it; yields
    ``post(payload) -> (status, body)`` once /ping answers."""
    import requests

    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local"]
    with open(log, "w") as out:
        server = subprocess.Popen(
            [*command, "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            assert server.poll() is None, f"mlflow models serve exited {server.returncode}:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/ping", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"mlflow models serve did not answer /ping:\n{log.read_text()[-3000:]}"
            time.sleep(1)

        def post(payload: dict) -> tuple[int, dict]:
            response = requests.post(f"{url}/invocations", json=payload, timeout=300)
            return response.status_code, response.json()

        yield post
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)  # a grace before SIGKILL, not a limit that fails the test
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def real_cifar_images(offline: Path) -> tuple[np.ndarray, np.ndarray]:
    """The 20 real CIFAR-10 test images (32x32 RGB) and their labels."""
    files = sorted((offline / "cifar10-samples").glob("cifar10_*.png"))
    images = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    labels = np.asarray([int(f.stem.split("_")[2]) for f in files])
    return images, labels


def write_cifar_tarball(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """The official cifar-10-python.tar.gz layout: five train batches, a test batch, batches.meta.

    Batches are built from the real images (cycled) so every class appears in train and test.
    """

    def batch(idx):
        data = images[idx].transpose(0, 3, 1, 2).reshape(len(idx), -1)
        return {b"data": data, b"labels": labels[idx].tolist(), b"batch_label": b"x", b"filenames": []}

    n = len(images)
    members = {f"data_batch_{i}": batch(np.arange(n)) for i in range(1, 6)}
    members["test_batch"] = batch(np.arange(n)[::-1])
    members["batches.meta"] = {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_cases_per_batch": n}
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            blob = pickle.dumps(payload)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


class IsolatedEnv:
    """An embedded default of its own (store, VLM_ASSETS_HOME, MLflow, a fresh Dagster instance per
    run) for module-scoped fixtures that train once and are read by several tests."""

    def __init__(self, root: Path, graph: list, mlflow_uri: str | None = None):
        from vlm_assets.defs.platform.launcher import LocalTorchrunLauncher
        from vlm_assets.defs.platform.storage import LocalArtifactStoreResource, artifact_io_manager
        from vlm_assets.defs.platform.tracking import MlflowTrackingResource

        self.root, self.graph = root, graph
        self.uri = mlflow_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.resources = {
            "artifact_store": LocalArtifactStoreResource(root=str(root / "artifacts")),
            "io_manager": artifact_io_manager,
            "mlflow": MlflowTrackingResource(tracking_uri=self.uri, artifact_location=(root / "mlruns").as_uri()),
            "launcher": LocalTorchrunLauncher(),
        }
        self.log_messages: list[str] = []
        self.seconds: float | None = None  # a fixture's own measure of its run, where it keeps one

    @property
    def store(self):
        return self.resources["artifact_store"].get_store()

    def materialize(self, run_config, raise_on_error=True):
        import dagster as dg

        with pytest.MonkeyPatch.context() as mp, dg.instance_for_test() as instance:
            mp.setenv("VLM_ASSETS_HOME", str(self.root / "home"))
            result = dg.materialize(
                self.graph,
                resources=self.resources,
                run_config=run_config,
                instance=instance,
                raise_on_error=raise_on_error,
            )
            self.log_messages = [entry.user_message for entry in instance.all_logs(result.run_id)]
            return result


# Every check of an asset passing, as ``checks_of`` reports it.
TOKEN_SHARD_CHECKS_PASS = {
    "token_ids_within_vocab": True,
    "token_counts_match_summary": True,
    "every_shard_readable": True,
}
GPT_CHECKS_PASS = {"val_loss_beats_uniform": True, "export_reproduces_val_loss": True}
ADAPTER_AND_EVAL_CHECKS_PASS = {
    "adapter_training_complete": True,
    "adapter_weights_finite": True,
    "adapter_accuracy_meets_threshold": True,
    "adapter_gain_significant": True,
}


def checks_of(result, *assets: str) -> dict[str, bool]:
    """Check name -> passed, for the checks of ``assets`` in a run's result (each asset's checks run
    in its own step, so a run of a trainer also judges the data it was given)."""
    return {
        e.check_name: e.passed for e in result.get_asset_check_evaluations() if e.asset_key.to_user_string() in assets
    }


def training_workers(module: str, marker: str) -> list[int]:
    """PIDs of live training workers of ``module`` (not torchrun agents) whose command line has ``marker``."""
    from vlm_assets.launch.local import training_processes

    return training_processes(module, marker)["worker"]


def launcher_clock_jumps(patch, when) -> None:
    """Make the local launcher's clock run an hour ahead while ``when()`` holds, so that its timeout fires
    at that point however long this machine took to reach it. ``patch``: a pytest ``MonkeyPatch``."""
    import types

    from vlm_assets.launch import local

    def monotonic() -> float:
        return time.monotonic() + (3600.0 if when() else 0.0)

    patch.setattr(local, "time", types.SimpleNamespace(monotonic=monotonic, sleep=time.sleep))


@dataclasses.dataclass
class KilledAndRelaunched:
    at_kill: list[str]  # checkpoint keys committed when the step was killed
    relaunch_log: str
    instance: object  # the DagsterInstance both runs used
    mlflow_uri: str
    worker_killed_at: str | None = None  # the relaunch's checkpoint after which one of its workers was killed

    def materialization(self, asset: str) -> dict:
        import dagster as dg

        event = self.instance.get_latest_materialization_event(dg.AssetKey(asset))
        return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}

    def mlflow_statuses(self, asset: str) -> list[str]:
        from mlflow import MlflowClient

        client = MlflowClient(self.mlflow_uri)
        runs = client.search_runs(
            [client.get_experiment_by_name("vlm_assets").experiment_id],
            filter_string=f"tags.`dagster.asset` = '{asset}'",
        )
        return sorted(r.info.status for r in runs)


def kill_mid_training_and_relaunch(
    tmp_path: Path,
    job: str,
    run_config: dict,
    asset: str,
    checkpoints_before_kill: int,
    executor: str,
    kill_a_worker_of: str | None = None,
) -> KilledAndRelaunched:
    """`dagster job execute -j <job>` SIGKILLed once ``checkpoints_before_kill`` checkpoints of
    ``asset`` are committed, as an OOM killer or a lost session would; asserts that no step process,
    agent or worker outlives it and that nothing is committed after it; then relaunches the same
    command to completion. ``executor``: ``in_process`` (the step runs in the killed process) or
    ``multiprocess`` (the step runs in a child of the killed orchestrator). ``kill_a_worker_of``: a
    trainer module; one of its workers in the relaunch is SIGKILLed once the relaunch has committed a
    checkpoint of its own, so that the step's retry has to resume from that one; asserts that the
    relaunch retried its step once, for that worker's exit -9, and that no worker outlived it."""
    import json

    from mlflow import MlflowClient

    from vlm_assets.launch.local import alive, process_tree, training_processes

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text((repo / "dagster.yaml").read_text())
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(mlflow_uri).search_experiments()  # create the store before two processes use it
    env = {
        **os.environ,
        "VLM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster"),
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "VLM_ASSETS_LEASE_TTL_S": "5",
    }
    config = tmp_path / "run_config.yaml"  # JSON is YAML
    config.write_text(json.dumps({**run_config, "execution": {"config": {executor: {}}}}))
    command = [
        sys.executable,
        "-m",
        "dagster",
        "job",
        "execute",
        "-m",
        "vlm_assets.definitions",
        "-j",
        job,
        "-c",
        str(config),
    ]
    checkpoints = tmp_path / "home" / "artifacts" / "checkpoints" / asset

    def committed():
        return sorted(p.parent.name for p in checkpoints.glob("*/step-*/_COMPLETE.json"))

    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + BOUND_S
        while len(committed()) < checkpoints_before_kill and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the run ended before it could be killed"
        assert len(committed()) >= checkpoints_before_kill, f"{checkpoints_before_kill} checkpoint(s) not committed"
        tree = process_tree(first.pid)
        first.kill()
        first.wait()
    at_kill = committed()
    deadline = time.monotonic() + BOUND_S
    while [pid for pid in tree[1:] if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree[1:] if alive(pid)], "a torchrun agent or worker outlived the killed step"
    assert len(tree) >= 5  # the step, 2 agents or 1 agent with 2 workers, and more
    # Nothing is left that could commit: the killed tree is gone, and so is any process on this test's
    # files started after the tree was read.
    assert not any(training_processes("", str(tmp_path)).values()), "a process on this test's files outlived the kill"
    assert committed() == at_kill, "a checkpoint was committed after the kill"

    killed = {}

    def kill_a_worker():
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline and second.poll() is None:
            fresh = [key for key in committed() if key not in at_kill]
            if fresh and (pids := training_workers(kill_a_worker_of, str(tmp_path))):
                killed["at"] = fresh[-1]
                os.kill(max(pids), signal.SIGKILL)
                return
            time.sleep(0.05)

    second = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Thread(target=kill_a_worker)
    if kill_a_worker_of:
        killer.start()
    try:
        out = second.communicate(timeout=BOUND_S)[0]
    except subprocess.TimeoutExpired:
        second.kill()
        raise
    if kill_a_worker_of:
        killer.join()
        assert killed, "no worker of the relaunch was killed"
    assert second.returncode == 0, out[-6000:]
    # The load reaped the dead run (freeing its training-pool slot); the step took its lease over.
    assert "marked failed by vlm_assets' dead-run reaper" in out
    assert "its process is gone): taking it over" in out and "KILLED: their process died" in out
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(tmp_path / "dagster"))
    assert sorted(run.status.value for run in instance.get_runs()) == ["FAILURE", "SUCCESS"]
    if kill_a_worker_of:
        assert not training_workers(kill_a_worker_of, str(tmp_path)), "a worker outlived the relaunch"
        (relaunch,) = [run for run in instance.get_runs() if run.status.value == "SUCCESS"]
        retries = [
            entry.dagster_event
            for entry in instance.all_logs(relaunch.run_id)
            if entry.dagster_event and entry.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"
        ]
        assert len(retries) == 1 and "worker exit code -9" in str(retries[0].event_specific_data.error)
    return KilledAndRelaunched(at_kill, out, instance, mlflow_uri, killed.get("at"))


# The loopback Kubernetes control plane (session) and a namespace per test, checked empty after it.
from vlm_assets_tests.k8s.testbed_fixtures import k8s_testbed, namespace  # noqa: E402, F401
