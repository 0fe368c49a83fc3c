"""A real Kubernetes control plane on loopback for the k8s launcher's tests (``testbed/README.md``).

The session builds the API server, scheduler and controller manager from Debian's source package
when they are not cached (``testbed/build.sh``, 5-7 minutes once), starts them with two nodes run by
the stand-in kubelet (pods run as local processes), and gives each test its own namespace, checked
empty when the test ends.
"""

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from vlm_assets_tests.waiting import BOUND_S, wait_until

TESTBED = Path(__file__).parent / "testbed"
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Testbed:
    run_dir: Path
    kubeconfig: Path

    def api(self, kubeconfig: Path | None = None):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))


def build_lock() -> Path:
    """The lock scripts/test.sh holds while it builds the binaries in the background."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    lock = cache / "k8s-testbed" / "build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    return lock


def start_testbed(run_dir: Path, env: dict[str, str] | None = None) -> Testbed:
    """Build the binaries when they are not cached (after a build in progress, if any), then start the
    control plane in ``run_dir`` (``env``: more for its scripts and kubelet, ``FAKE_KUBELET_ENV_*`` say).
    ``RuntimeError`` with the scripts' output when either fails; what started is stopped then."""
    import fcntl

    with open(build_lock(), "w") as lock:
        # A build in progress (scripts/test.sh starts one beside the install) ends first; it is bounded
        # there (40 min), and so is the wait here (under the 20-minute test limit), naming its log.
        deadline = time.monotonic() + 18 * 60
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the k8s testbed build is still running after 18 min: see {build_lock().with_suffix('.log')}"
                    ) from None
                time.sleep(1)
        build = subprocess.run([str(TESTBED / "build.sh")], capture_output=True, text=True, timeout=40 * 60)
    if build.returncode != 0:
        out = f"{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
        raise RuntimeError(f"building the k8s testbed failed (exit {build.returncode}):\n{out}")
    env = {**os.environ, "TESTBED_PYTHON": sys.executable, "FAKE_KUBELET_CWD": str(REPO), **(env or {})}
    start = subprocess.run(
        [str(TESTBED / "start.sh"), str(run_dir)], env=env, capture_output=True, text=True, timeout=BOUND_S
    )  # start.sh bounds each of its waits (150 s) and names what did not come up
    if start.returncode != 0:
        stop_testbed(run_dir)
        raise RuntimeError(f"starting the k8s testbed failed:\n{start.stdout[-3000:]}\n{start.stderr[-3000:]}")
    return Testbed(run_dir, run_dir / "pki" / "kubeconfig")


def stop_testbed(run_dir: Path) -> None:
    subprocess.run([str(TESTBED / "stop.sh"), str(run_dir)])


@pytest.fixture(scope="session")
def k8s_testbed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("k8s-testbed")
    try:
        testbed = start_testbed(run_dir)
    except RuntimeError as error:
        pytest.fail(str(error))
    try:
        yield testbed
    finally:
        stop_testbed(run_dir)


def wait_for_default_service_account(core, namespace: str, timeout: float = BOUND_S) -> None:
    """Pods are admitted only once the namespace's ``default`` ServiceAccount and its token exist."""
    wait_until(
        lambda: any(s.metadata.name.startswith("default-token") for s in core.list_namespaced_secret(namespace).items),
        f"namespace {namespace}'s default ServiceAccount token",
        timeout=timeout,
        every=0.2,
    )


def launcher_objects(core, batch, namespace: str) -> list[str]:
    return (
        [f"pod/{p.metadata.name}" for p in core.list_namespaced_pod(namespace).items]
        + [f"service/{s.metadata.name}" for s in core.list_namespaced_service(namespace).items]
        + [f"job/{j.metadata.name}" for j in batch.list_namespaced_job(namespace).items]
    )


@pytest.fixture
def namespace(k8s_testbed):
    """A fresh namespace; the test fails if it leaves any pod, Service or Job behind."""
    from kubernetes import client

    api = k8s_testbed.api()
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for_default_service_account(core, name)
    yield name
    left = launcher_objects(core, batch, name)
    core.delete_namespace(name)
    assert not left, f"left behind in {name}: {left}"
