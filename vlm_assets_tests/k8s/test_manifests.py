"""Every manifest the project writes or renders passes ``kubernetes-validate --strict`` for the
Kubernetes versions it targets (the testbed's 1.20 API server drops fields it does not know, so it
cannot be the judge of a 1.28 manifest), and the shipped launcher settings load."""

import pytest
import yaml

from vlm_assets.launch import LaunchSpec
from vlm_assets.launch.k8s import Launch, PodSettings
from vlm_assets_tests.k8s.testbed_fixtures import REPO

VERSIONS = ("1.28.0", "1.31.0")


def rendered(mode: str) -> list[dict]:
    spec = LaunchSpec(
        "vlm_assets.train.gpt_pretrain",
        ("--config", "/var/lib/vlm_assets/runs/x/run.json"),
        num_nodes=4,
        nproc_per_node=8,
        timeout_s=86400,
        name="gpt_checkpoint",
        resources={"nvidia.com/gpu": "8", "cpu": "96", "memory": "1Ti", "gpu_type": "NVIDIA-H100-80GB-HBM3"},
    )
    settings = PodSettings(**{**yaml.safe_load((REPO / "deploy" / "k8s" / "launcher.yaml").read_text()), "mode": mode})
    labels = {
        "dagster/run-id": "0b6d3c1e-1f55-4b8e-9d7a-2a3b4c5d6e7f",
        "dagster/asset": "gpt_checkpoint",
        "dagster/step": "gpt_checkpoint",
    }
    return Launch(spec, settings, labels=labels, env={"DAGSTER_PIPES_CONTEXT": "eJwLz0jNyclXKM8vyklRBAAeKQSp"}).render()


def shipped() -> list[dict]:
    return [
        doc
        for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
        if path.name != "launcher.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("source", ["pods", "indexed_job", "deploy"])
def test_manifests_pass_strict_validation(source, version):
    import kubernetes_validate

    manifests = shipped() if source == "deploy" else rendered(source)
    expected = {
        "pods": ["Service"] + ["Pod"] * 4,
        "indexed_job": ["Service", "Job"],
        "deploy": ["Namespace", "ServiceAccount", "Role", "RoleBinding"],  # deploy/k8s/rbac.yaml
    }
    assert [m["kind"] for m in manifests] == expected[source]
    for manifest in manifests:
        kubernetes_validate.validate(manifest, version, strict=True)  # raises ValidationError naming the field


def test_strict_validation_catches_a_misspelt_field():
    """The check above can fail: a field the schema does not know is an error under --strict."""
    import kubernetes_validate

    pod = rendered("pods")[1]
    pod["spec"]["containers"][0]["resource"] = pod["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VERSIONS[0], strict=True)


def test_the_shipped_launcher_settings_load(monkeypatch):
    from vlm_assets.defs.platform.environment import launcher_for

    launcher = launcher_for(
        {"VLM_ASSETS_LAUNCHER": "k8s", "VLM_ASSETS_K8S_CONFIG": str(REPO / "deploy" / "k8s" / "launcher.yaml")}
    )
    assert launcher.settings().namespace == "vlm-training" and launcher.settings().env_from_secrets


def test_the_indexed_job_takes_the_node_index_from_the_completion_index():
    job = rendered("indexed_job")[1]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 4
    container = job["spec"]["template"]["spec"]["containers"][0]
    index = next(e for e in container["env"] if e["name"] == "VLM_ASSETS_NODE_INDEX")
    assert "job-completion-index" in index["valueFrom"]["fieldRef"]["fieldPath"]
    assert any(
        arg.startswith("--rdzv-endpoint=gpt-checkpoint-") and "-0.gpt-checkpoint-" in arg
        for arg in container["command"]
    )


def test_the_helm_values_run_a_backfill_as_pods_six_at_most_and_retry_a_dead_one():
    """deploy/helm/values.yaml as the chart writes it into the instance (its run coordinator and run
    retries templates), loaded by Dagster itself: every run is a pod of K8sRunLauncher, a backfill's
    runs hold at most 6 of the queue's 8 slots, a run whose pod died is retried when its tags ask and
    a step's own failure is not, and the code location's partitions-per-run setting parses."""
    import dagster as dg

    from vlm_assets.defs.platform.environment import chunks_per_run

    values = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    daemon = values["dagsterDaemon"]
    queued, retries = daemon["runCoordinator"]["config"]["queuedRunCoordinator"], daemon["runRetries"]
    overrides = {
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {
                "max_concurrent_runs": queued["maxConcurrentRuns"],
                "tag_concurrency_limits": queued["tagConcurrencyLimits"],
            },
        },
        "run_retries": {
            "enabled": retries["enabled"],
            "max_retries": retries["maxRetries"],
            "retry_on_asset_or_op_failure": retries["retryOnAssetOrOpFailure"],
        },
    }
    with dg.instance_for_test(overrides=overrides) as instance:
        queue = instance.get_concurrency_config().run_queue_config
        assert queue.max_concurrent_runs == 8
        assert [(limit["key"], limit["limit"]) for limit in queue.tag_concurrency_limits] == [("dagster/backfill", 6)]
        assert instance.run_retries_enabled and not instance.run_retries_retry_on_asset_or_op_failure
    deployment = values["dagster-user-deployments"]["deployments"][0]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    assert chunks_per_run(env) == 16
