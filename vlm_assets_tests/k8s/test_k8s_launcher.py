"""The k8s launch backend through a real API server, scheduler and controllers on loopback: pods meet
at the rendezvous, their logs come back by node, and every way a launch fails deletes all it made."""

import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from vlm_assets.launch import LaunchFailed, LaunchSpec
from vlm_assets.launch.k8s import Launch, PodSettings, run_k8s
from vlm_assets.launch.local import free_port
from vlm_assets_tests.k8s.testbed_fixtures import REPO
from vlm_assets_tests.waiting import wait_until

pytestmark = pytest.mark.slow

WORKER = "vlm_assets_tests.launch.allreduce_worker"
RBAC = REPO / "deploy" / "k8s" / "rbac.yaml"


def settings(namespace: str, kubeconfig: Path, **overrides) -> PodSettings:
    """The launcher as the tests run it: pods are local processes of the venv's python, so the
    rendezvous is on loopback (pod DNS names do not resolve on the testbed)."""
    return PodSettings(
        **{
            "namespace": namespace,
            "kubeconfig": str(kubeconfig),
            "python": sys.executable,
            "rendezvous_host": "127.0.0.1",
            "rendezvous_port": free_port(),
            "pending_timeout_s": 20,
            "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "VLM_ASSETS_NODES_SHARE_HOST": "1"},
            **overrides,
        }
    )


def collect():
    lines: list[tuple[int, str]] = []
    return lines, lambda node, line: lines.append((node, line))


def test_two_pods_rendezvous_and_their_logs_come_back_by_node(k8s_testbed, namespace):
    lines, on_line = collect()
    spec = LaunchSpec(WORKER, num_nodes=2, nproc_per_node=1, timeout_s=180, name="allreduce")
    run_k8s(spec, settings(namespace, k8s_testbed.kubeconfig), on_line, labels={"dagster/run-id": "r1"})
    sums = [(node, line) for node, line in lines if " sum " in line]
    assert sorted(line.split("rank ")[1].split()[0] for _, line in sums) == ["0/2", "1/2"]
    assert all(line.endswith("sum 1") for _, line in sums)  # 0 + 1: the two pods really met
    assert {node for node, _ in sums} == {0, 1}


def test_a_failing_pod_deletes_every_pod_and_names_itself(k8s_testbed, namespace):
    lines, on_line = collect()
    spec = LaunchSpec(
        WORKER, ("--fail-rank", "1", "--hang"), num_nodes=2, nproc_per_node=1, timeout_s=180, name="fails"
    )
    with pytest.raises(LaunchFailed) as failure:
        run_k8s(spec, settings(namespace, k8s_testbed.kubeconfig), on_line)
    err = failure.value
    assert err.exit_code not in (None, 0)
    assert (err.rule.cause, err.retryable) == ("error", False)  # exit 3, a code error: a retry fails the same way
    assert "fails-" in err.reason and "container exit code" in err.reason
    assert err.worker_exit_code == 3
    assert any("rank 1 failing on purpose" in line for line in err.tail)
    # (the namespace fixture checks that no pod or Service is left)


def test_an_evicted_pod_fails_the_launch_with_the_reason(k8s_testbed, namespace):
    from kubernetes import client

    api = k8s_testbed.api()
    core = client.CoreV1Api(api)
    spec = LaunchSpec(WORKER, ("--hang",), num_nodes=2, nproc_per_node=1, timeout_s=180, name="evicted")
    lines, on_line = collect()

    def evict_when_running():
        while not any(" sum " in line for _, line in lines):
            time.sleep(0.2)
        pod = next(
            p
            for p in core.list_namespaced_pod(namespace).items
            if p.metadata.labels.get("vlm-assets/node-index") == "1"
        )
        # What the kubelet writes when it evicts a pod under node pressure.
        core.patch_namespaced_pod_status(
            pod.metadata.name,
            namespace,
            {"status": {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}},
        )

    threading.Thread(target=evict_when_running, daemon=True).start()
    with pytest.raises(LaunchFailed, match="Evicted: The node was low on resource: memory") as failure:
        run_k8s(spec, settings(namespace, k8s_testbed.kubeconfig), on_line)
    assert failure.value.node == 1 and (failure.value.rule.cause, failure.value.retryable) == ("evicted", True)


def test_an_unschedulable_request_fails_after_the_pending_timeout_with_the_schedulers_reason(k8s_testbed, namespace):
    spec = LaunchSpec(
        WORKER, num_nodes=2, nproc_per_node=1, timeout_s=180, name="too-big", resources={"nvidia.com/gpu": "16"}
    )  # the testbed's nodes have 8 each
    started = time.monotonic()
    with pytest.raises(
        LaunchFailed, match=r"Pending after 5 s: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu"
    ) as failure:
        run_k8s(spec, settings(namespace, k8s_testbed.kubeconfig, pending_timeout_s=5), collect()[1])
    assert (failure.value.rule.cause, failure.value.retryable) == ("unschedulable", False)
    assert time.monotonic() - started < 60


def _service_account_kubeconfig(k8s_testbed, namespace: str, role: dict, tmp_path: Path) -> Path:
    """A kubeconfig of a ServiceAccount bound to ``role`` in ``namespace``, as the launcher runs in a cluster."""
    from kubernetes import client

    api = k8s_testbed.api()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "launcher"}})
    rbac.create_namespaced_role(namespace, {**role, "metadata": {**role["metadata"], "namespace": namespace}})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "launcher"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": "launcher", "namespace": namespace}],
        },
    )

    def token_secret():
        found = [
            s for s in core.list_namespaced_secret(namespace).items if s.metadata.name.startswith("launcher-token")
        ]
        return found[0] if found else None

    import base64

    secret = wait_until(token_secret, "the token Secret of the launcher ServiceAccount", every=0.2)
    token = base64.b64decode(secret.data["token"]).decode()
    admin = yaml.safe_load(k8s_testbed.kubeconfig.read_text())
    admin["users"] = [{"name": "launcher", "user": {"token": token}}]
    admin["contexts"] = [{"name": "launcher", "context": {"cluster": admin["clusters"][0]["name"], "user": "launcher"}}]
    admin["current-context"] = "launcher"
    path = tmp_path / "launcher.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return path


def shipped_role() -> dict:
    return next(doc for doc in yaml.safe_load_all(RBAC.read_text()) if doc["kind"] == "Role")


def test_the_shipped_role_is_all_the_launcher_needs(k8s_testbed, namespace, tmp_path):
    kubeconfig = _service_account_kubeconfig(k8s_testbed, namespace, shipped_role(), tmp_path)
    lines, on_line = collect()
    run_k8s(
        LaunchSpec(WORKER, num_nodes=2, nproc_per_node=1, timeout_s=180, name="rbac"),
        settings(namespace, kubeconfig),
        on_line,
    )
    assert sum(" sum 1" in line for _, line in lines) == 2


def test_a_role_without_pod_logs_is_refused_before_anything_is_created(k8s_testbed, namespace, tmp_path):
    role = shipped_role()
    rules = [{**rule, "resources": [r for r in rule["resources"] if r != "pods/log"]} for rule in role["rules"]]
    role = {**role, "rules": [rule for rule in rules if rule["resources"]]}
    kubeconfig = _service_account_kubeconfig(k8s_testbed, namespace, role, tmp_path)
    with pytest.raises(PermissionError, match=r"may not get pods/log in namespace"):
        run_k8s(
            LaunchSpec(WORKER, num_nodes=2, timeout_s=60, name="nolog"), settings(namespace, kubeconfig), collect()[1]
        )


def test_rendered_pods_carry_the_per_asset_and_cluster_settings():
    spec = LaunchSpec(
        "vlm_assets.train.gpt_pretrain",
        ("--config", "/x/run.json"),
        num_nodes=12,
        nproc_per_node=8,
        name="gpt_checkpoint",
        resources={"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi", "gpu_type": "NVIDIA-H100-80GB-HBM3"},
    )
    s = PodSettings(
        namespace="train",
        image="registry.example/vlm-assets:cuda",
        image_pull_secrets=["regcred"],
        service_account="trainer",
        env_from_secrets=["s3-credentials", "mlflow-credentials"],
    )
    launch = Launch(
        spec,
        s,
        labels={"dagster/run-id": "abc", "dagster/asset": "gpt_checkpoint", "dagster/step": "gpt_checkpoint"},
        launch_id="1234abcd",
    )
    service, *pods = launch.render()
    assert service["spec"]["clusterIP"] == "None" and len(pods) == 12
    assert [p["metadata"]["name"] for p in pods][:3] == [
        "gpt-checkpoint-1234abcd-00",
        "gpt-checkpoint-1234abcd-01",
        "gpt-checkpoint-1234abcd-02",
    ]
    pod = pods[3]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert container["envFrom"] == [
        {"secretRef": {"name": "s3-credentials"}},
        {"secretRef": {"name": "mlflow-credentials"}},
    ]
    assert not any("SECRET" in e["name"] or "PASSWORD" in e["name"] for e in container["env"])
    endpoint = "gpt-checkpoint-1234abcd-00.gpt-checkpoint-1234abcd.train.svc.cluster.local:29400"
    assert f"--rdzv-endpoint={endpoint}" in container["command"]
    assert "--rdzv-conf=join_timeout=120,is_host=false" in container["command"]
    assert "is_host=true" in pods[0]["spec"]["containers"][0]["command"][8]
    assert pods[3]["metadata"]["labels"]["dagster/run-id"] == "abc"
    with pytest.raises(ValueError, match="look like credentials"):
        PodSettings(env={"AWS_SECRET_ACCESS_KEY": "x"})


def test_a_dropped_log_connection_is_reopened_without_losing_or_repeating_lines(k8s_testbed, namespace):
    """Log reads time out after 1 s of silence while rank 0 prints a line every 1.5 s: every read
    drops, and every line must still arrive exactly once (what keeps an hours-long pod's messages)."""
    lines, on_line = collect()
    spec = LaunchSpec(WORKER, ("--ticks", "5"), num_nodes=2, nproc_per_node=1, timeout_s=180, name="ticks")
    run_k8s(spec, settings(namespace, k8s_testbed.kubeconfig, log_read_timeout_s=1), on_line)
    assert [line for _, line in lines if line.startswith("tick ")] == [f"tick {i}" for i in range(5)]


def test_objects_of_runs_that_are_not_live_are_deleted_at_the_next_start(k8s_testbed, namespace):
    """What a step killed outright left (nobody deleted its pods) goes at the next launch's start, and
    so do the pods of an earlier attempt of the launching step in its own live run (its step process
    killed under the RetryPolicy: bench/soak.py --launcher k8s found them training on beside the
    retry's, and left when it ended); the pods of other live steps stay."""
    from kubernetes import client

    from vlm_assets.launch.k8s import delete_orphans

    api = k8s_testbed.api()
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    for run_id, step in (("dead-run", "a"), ("live-run", "a"), ("live-run", "b")):
        launch = Launch(
            LaunchSpec(WORKER, ("--hang",), num_nodes=1, name=step),
            settings(namespace, k8s_testbed.kubeconfig),
            labels={"dagster/run-id": run_id, "dagster/step": step},
        )
        core.create_namespaced_service(namespace, launch.service())
        core.create_namespaced_pod(namespace, launch.pods()[0])
    deleted = delete_orphans(core, batch, namespace, run_is_live=lambda run_id: run_id == "live-run")
    assert sorted(name.split("/")[0] for name in deleted) == ["pod", "service"]
    left = core.list_namespaced_pod(namespace).items
    assert sorted(p.metadata.labels["dagster/run-id"] for p in left) == ["live-run", "live-run"]
    deleted = delete_orphans(core, batch, namespace, lambda run_id: True, step=("live-run", "b"))
    assert sorted(name.split("/")[0] for name in deleted) == ["pod", "service"]
    left = core.list_namespaced_pod(namespace).items
    assert [(p.metadata.labels["dagster/run-id"], p.metadata.labels["dagster/step"]) for p in left] == [
        ("live-run", "a")
    ]
    assert delete_orphans(core, batch, namespace, run_is_live=lambda run_id: False)
    assert not core.list_namespaced_pod(namespace).items


def test_of_pods_failed_within_a_second_the_one_killed_is_named():
    """Pod 1's worker is killed; pod 0's fails on the broken collective in the same second (the API's
    resolution). The launch names pod 1 whichever order the pods are listed in, and an earlier end
    wins over a signal."""
    import datetime as dt

    from kubernetes import client as k8s

    from vlm_assets.launch.k8s import _failure, _Pods

    launch = Launch(LaunchSpec("m", (), num_nodes=2, name="gpt_checkpoint"), PodSettings(namespace="t"), launch_id="ab")
    second = dt.datetime(2026, 11, 28, 15, 0, 0, tzinfo=dt.UTC)

    def failed(index: int, code: int, at: dt.datetime):
        ended = k8s.V1ContainerStateTerminated(exit_code=code, finished_at=at, reason="Error")
        status = k8s.V1PodStatus(
            phase="Failed",
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="trainer",
                    image="i",
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=k8s.V1ContainerState(terminated=ended),
                )
            ],
        )
        labels = {"vlm-assets/node-index": str(index)}
        return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=f"gpt-checkpoint-ab-{index}", labels=labels), status=status)

    pods = _Pods(launch)
    for listed in ([failed(0, 1, second), failed(1, -9, second)], [failed(1, -9, second), failed(0, 1, second)]):
        pods.update(listed)
        assert _failure(launch, pods, {0, 1}, time.monotonic()) == (
            1,
            "pod gpt-checkpoint-ab-1 failed: container exit code -9 (Error)",
            -9,
            None,
        )
    pods.update([failed(0, 1, second), failed(1, -9, second + dt.timedelta(seconds=1))])
    assert _failure(launch, pods, {0, 1}, time.monotonic())[0] == 0
