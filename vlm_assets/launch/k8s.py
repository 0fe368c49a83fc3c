"""The Kubernetes backend: one pod per node behind a headless Service, c10d rendezvous at pod 0.

For a ``LaunchSpec`` of N nodes x P processes it creates, in the training namespace:

- a headless Service ``<launch>`` (``clusterIP: None``, ``publishNotReadyAddresses``), which gives
  every pod a stable DNS name ``<launch>-<i>.<launch>.<namespace>.svc.<cluster domain>``;
- pods ``<launch>-0`` .. ``<launch>-<N-1>`` (``hostname``/``subdomain`` set, ``restartPolicy: Never``),
  each running ``torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d`` with the rendezvous
  endpoint at pod 0's DNS name; pod 0 hosts the rendezvous store (``is_host``). Torch ranks the
  nodes of a c10d rendezvous by their address, so pod names with the index as suffix (zero-padded)
  make node rank = pod index on a cluster. (On the loopback testbed every pod is 127.0.0.1 and the
  order falls back to pids: rank 0's Pipes messages are read from whichever pod holds it.)

or, with ``mode="indexed_job"`` (clusters >= 1.24), one ``batch/v1`` Job with ``completionMode:
Indexed`` in place of the pods (same pod template, node index from the completion index).

Then it streams every pod's log (reconnecting from the last timestamp seen, so a dropped
connection during an hours-long job loses nothing), and supervises: a pod that fails, is evicted or
deleted, or stays Pending past ``pending_timeout_s`` fails the whole launch (``LaunchFailed`` with the
pod, its exit code or the scheduler's reason, and its last lines). However the launch ends, every
object it created is deleted before it returns, and it waits until they are gone. Pods also carry
``activeDeadlineSeconds`` (the job's timeout plus a margin), so the cluster itself ends them should
the launching process die without cleaning up; ``delete_orphans`` removes those of dead runs.

Kubernetes API only: no dagster here (``vlm_assets.defs.platform.launcher`` is the Dagster side).
"""

from __future__ import annotations

import collections
import datetime as dt
import math
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlm_assets.launch.lifeline import worker_entry
from vlm_assets.launch.local import _TAIL_LINES, LaunchFailed, _worker_exit_code
from vlm_assets.launch.retry import KILLED_EXIT_CODES
from vlm_assets.launch.spec import QUANTITY, LaunchSpec

MANAGED_BY = "vlm-assets"
LAUNCH_LABEL = "vlm-assets/launch"
INDEX_ENV = "VLM_ASSETS_NODE_INDEX"
CONTAINER = "trainer"
_DELETE_WAIT_S = 60.0
# Environment variable names that look like credentials: refused in ``env`` / ``forward_env``.
_SECRET_NAME = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|PRIVATE|CREDENTIAL)", re.I)
# What a launch needs in its namespace; checked with SelfSubjectAccessReviews before it creates anything.
REQUIRED_ACCESS = (
    *(("", "pods", verb) for verb in ("create", "get", "list", "watch", "delete")),
    ("", "pods/log", "get"),
    *(("", "services", verb) for verb in ("create", "get", "list", "delete")),
)
REQUIRED_JOB_ACCESS = tuple(("batch", "jobs", verb) for verb in ("create", "get", "list", "watch", "delete"))


class PodSettings(BaseModel):
    """Where and how the pods of a launch run: the cluster side of the ``k8s`` launcher's config.

    The per-asset side (GPUs, CPU, memory, GPU type) comes with each ``LaunchSpec``."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="vlm-training", description="The training namespace (the Role's).")
    kubeconfig: str | None = Field(
        default=None,
        description=("Path of a kubeconfig; unset: in-cluster auth when running in a pod, else ~/.kube/config."),
    )
    kube_context: str | None = Field(default=None, description="Context of the kubeconfig; unset: its current one.")
    mode: Literal["pods", "indexed_job"] = Field(
        default="pods",
        description=(
            "'pods': a headless Service and one pod per node (any cluster version); 'indexed_job': one "
            "Indexed Job (completionMode: Indexed, clusters >= 1.24)."
        ),
    )
    image: str = Field(default="vlm-assets:cpu", description="The trainer image (deploy/Dockerfile).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names for a private registry.")
    service_account: str | None = Field(
        default=None,
        description=("Service account of the training pods (their token is not mounted: trainers need no API access)."),
    )
    python: str = Field(default="python", description="The Python interpreter in the image.")
    env: dict[str, str] = Field(
        default_factory=lambda: {"OMP_NUM_THREADS": "1"},
        description="Literal, non-secret environment of every training process (see LocalTorchrunLauncher.env).",
    )
    forward_env: list[str] = Field(
        default_factory=lambda: [
            "VLM_ASSETS_HOME",
            "VLM_ASSETS_CACHE",
            "VLM_ASSETS_STORE",
            "VLM_ASSETS_S3_BUCKET",
            "VLM_ASSETS_S3_PREFIX",
            "AWS_ENDPOINT_URL",
            "AWS_DEFAULT_REGION",
            "S3_ENDPOINT_URL",
            "MLFLOW_TRACKING_URI",
            "MLFLOW_DISABLE_TELEMETRY",
            "HF_HUB_OFFLINE",
        ],
        description="Non-secret variables copied from the launching process' environment when set.",
    )
    env_from_secrets: list[str] = Field(
        default_factory=list,
        description=(
            "Secrets whose keys become environment variables (envFrom): S3 and MLflow credentials go here, "
            "never into the pod spec."
        ),
    )
    gpu_node_label: str = Field(
        default="nvidia.com/gpu.product",
        description=("Node label that a spec's gpu_type selects (GPU feature discovery's label)."),
    )
    gpu_tolerations: list[dict[str, str]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations added to pods that request GPUs.",
    )
    shm_size: str = Field(default="8Gi", description="Size limit of /dev/shm (a memory-backed emptyDir).")
    shared_volume_claim: str | None = Field(
        default=None,
        description=(
            "A ReadWriteMany PersistentVolumeClaim mounted at shared_mount_path in every training pod: it must "
            "also hold $VLM_ASSETS_HOME of the Dagster run pod (run files and the staging directory)."
        ),
    )
    shared_mount_path: str = "/var/lib/vlm_assets"
    run_as_user: int = Field(default=1000, ge=1, description="Non-root user of the training containers.")
    rendezvous_port: int = Field(default=29400, ge=1, le=65535)
    rendezvous_host: str | None = Field(
        default=None,
        description=(
            "Tests only: the rendezvous address in place of pod 0's DNS name (which does not resolve on the "
            "loopback testbed)."
        ),
    )
    cluster_domain: str = "cluster.local"
    log_read_timeout_s: int = Field(
        default=300,
        ge=1,
        description=(
            "A pod log connection silent this long is reopened from the last line seen (no loss, no repeats)."
        ),
    )
    pending_timeout_s: int = Field(
        default=600,
        ge=1,
        description=(
            "A pod still Pending (unschedulable, image not pulled) after this fails the launch with the reason."
        ),
    )

    @field_validator("env", "forward_env")
    @classmethod
    def _no_credentials(cls, value):
        names = value if isinstance(value, list) else list(value)
        if bad := [n for n in names if _SECRET_NAME.search(n)]:
            raise ValueError(
                f"{bad} look like credentials: put them in a Secret named in env_from_secrets, never in the pod spec"
            )
        return value

    @field_validator("shm_size")
    @classmethod
    def _quantity(cls, value: str) -> str:
        if not re.match(QUANTITY, value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. '8Gi', '500m')")
        return value


def dns_label(text: str, limit: int = 63) -> str:
    """``text`` as a DNS-1123 label: lowercase alphanumerics and '-', at most ``limit`` characters."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return label or "x"


def label_value(text: str) -> str:
    """``text`` as a label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:63])


class Launch:
    """The objects of one launch: names, labels and manifests (``render``), nothing sent yet."""

    def __init__(
        self,
        spec: LaunchSpec,
        settings: PodSettings,
        labels: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        launch_id: str | None = None,
    ):
        self.spec, self.settings = spec, settings
        self.id = launch_id or uuid.uuid4().hex[:8]
        self.name = f"{dns_label(spec.name, 40)}-{self.id}"
        self.labels = {
            "app.kubernetes.io/name": "vlm-assets",
            "app.kubernetes.io/managed-by": MANAGED_BY,
            LAUNCH_LABEL: self.name,
            **{k: label_value(v) for k, v in (labels or {}).items()},
        }
        self.env = dict(env or {})
        self.width = len(str(spec.num_nodes - 1))

    def pod_name(self, index: int) -> str:
        """Return the name of node ``index``'s pod."""
        return f"{self.name}-{index:0{self.width}d}"

    def rendezvous_host(self) -> str:
        """Return the host name of the c10d rendezvous: the configured one, else pod 0's DNS name under the Service."""
        if self.settings.rendezvous_host:
            return self.settings.rendezvous_host
        pod0 = f"{self.name}-0" if self.settings.mode == "indexed_job" else self.pod_name(0)
        return f"{pod0}.{self.name}.{self.settings.namespace}.svc.{self.settings.cluster_domain}"

    def command(self, is_host: bool | None) -> list[str]:
        """Return the ``torchrun`` command line a node's container runs.

        ``is_host`` marks the rendezvous host (node 0) when known; None (an Indexed Job's one template) leaves it out.
        """
        spec, s = self.spec, self.settings
        host = "" if is_host is None else f",is_host={'true' if is_host else 'false'}"
        return [
            s.python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={spec.num_nodes}",
            f"--nproc-per-node={spec.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rendezvous_host()}:{s.rendezvous_port}",
            f"--rdzv-id={self.name}",
            f"--rdzv-conf=join_timeout={spec.rendezvous_timeout_s}{host}",
            "--max-restarts=0",  # a failed job is retried by the orchestrator, from the last checkpoint
            *worker_entry(spec.module),
            *spec.args,
        ]

    def _container_env(self, index: int | None) -> list[dict[str, Any]]:
        values = {**self.settings.env, **self.env, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        env = [{"name": k, "value": v} for k, v in values.items()]
        if index is None:  # an Indexed Job: the index from the pod's annotation
            env.append(
                {
                    "name": INDEX_ENV,
                    "valueFrom": {
                        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                    },
                }
            )
        else:
            env.append({"name": INDEX_ENV, "value": str(index)})
        return env

    def _resources(self) -> dict[str, Any]:
        requests = {k: v for k, v in self.spec.resources.items() if k != "gpu_type"}
        # Requests = limits: a training node gets exactly what it asked for (Guaranteed QoS when
        # CPU and memory are both given); GPUs can only be given as limits anyway.
        return {"requests": dict(requests), "limits": dict(requests)} if requests else {}

    def pod_spec(self, index: int | None) -> dict[str, Any]:
        """Return the pod spec of node ``index`` (None: the Indexed Job's pod template)."""
        s, spec = self.settings, self.spec
        gpus = int(spec.resources.get("nvidia.com/gpu", "0"))
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
        volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.shm_size}}]
        if s.shared_volume_claim:
            mounts.append({"name": "shared", "mountPath": s.shared_mount_path})
            volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": s.shared_volume_claim}})
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": s.image,
            "imagePullPolicy": s.image_pull_policy,
            "command": self.command(None if index is None else index == 0),
            "env": self._container_env(index),
            "ports": [{"name": "rendezvous", "containerPort": s.rendezvous_port}],
            "volumeMounts": mounts,
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
        if s.env_from_secrets:
            container["envFrom"] = [{"secretRef": {"name": name}} for name in s.env_from_secrets]
        if resources := self._resources():
            container["resources"] = resources
        pod: dict[str, Any] = {
            "restartPolicy": "Never",
            "subdomain": self.name,
            "automountServiceAccountToken": False,
            # The cluster ends the pods by itself should nobody be left to delete them.
            "activeDeadlineSeconds": spec.timeout_s + 300,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": s.run_as_user,
                "runAsGroup": s.run_as_user,
                "fsGroup": s.run_as_user,
            },
            "containers": [container],
            "volumes": volumes,
        }
        if index is not None:
            pod["hostname"] = self.pod_name(index)
        if s.service_account:
            pod["serviceAccountName"] = s.service_account
        if s.image_pull_secrets:
            pod["imagePullSecrets"] = [{"name": name} for name in s.image_pull_secrets]
        if gpu_type := spec.resources.get("gpu_type"):
            pod["nodeSelector"] = {s.gpu_node_label: gpu_type}
        if gpus:
            pod["tolerations"] = [dict(t) for t in s.gpu_tolerations]
        return pod

    def service(self) -> dict[str, Any]:
        """Return the manifest of the headless Service the nodes rendezvous through."""
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.name, "namespace": self.settings.namespace, "labels": self.labels},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {LAUNCH_LABEL: self.name},
                "ports": [
                    {
                        "name": "rendezvous",
                        "port": self.settings.rendezvous_port,
                        "targetPort": self.settings.rendezvous_port,
                    }
                ],
            },
        }

    def pods(self) -> list[dict[str, Any]]:
        """Return the manifests of one pod per node."""
        return [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": self.pod_name(i),
                    "namespace": self.settings.namespace,
                    "labels": {**self.labels, "vlm-assets/node-index": str(i)},
                },
                "spec": self.pod_spec(i),
            }
            for i in range(self.spec.num_nodes)
        ]

    def indexed_job(self) -> dict[str, Any]:
        """Return the manifest of one Indexed Job with a pod per node."""
        n = self.spec.num_nodes
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": self.name, "namespace": self.settings.namespace, "labels": self.labels},
            "spec": {
                "completionMode": "Indexed",
                "completions": n,
                "parallelism": n,
                "backoffLimit": 0,
                "activeDeadlineSeconds": self.spec.timeout_s + 300,
                "ttlSecondsAfterFinished": 600,
                "template": {"metadata": {"labels": self.labels}, "spec": self.pod_spec(None)},
            },
        }

    def render(self) -> list[dict[str, Any]]:
        """Every manifest of this launch, in creation order."""
        workload = [self.indexed_job()] if self.settings.mode == "indexed_job" else self.pods()
        return [self.service(), *workload]


def api_client(settings: PodSettings):
    """A kubernetes ApiClient: the given kubeconfig, in-cluster auth inside a pod, else ~/.kube/config."""
    import os

    from kubernetes import client, config

    if settings.kubeconfig:
        return config.new_client_from_config(config_file=settings.kubeconfig, context=settings.kube_context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(context=settings.kube_context)


def check_access(api, settings: PodSettings) -> None:
    """Refuse to start (``PermissionError`` listing what is missing) unless this identity may do all a launch needs.

    The check is in the namespace: a launch that could create pods but not read their logs would train blind, and
    one that could not delete them would leave them behind.
    """
    from kubernetes import client

    auth = client.AuthorizationV1Api(api)
    needed = REQUIRED_ACCESS + (REQUIRED_JOB_ACCESS if settings.mode == "indexed_job" else ())
    missing = []
    for group, resource, verb in needed:
        plural, _, sub = resource.partition("/")
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    namespace=settings.namespace, group=group, resource=plural, subresource=sub or None, verb=verb
                )
            )
        )
        if not auth.create_self_subject_access_review(review).status.allowed:
            missing.append(f"{verb} {resource}")
    if missing:
        raise PermissionError(
            f"the Kubernetes identity of the launcher may not {', '.join(missing)} in namespace "
            f"{settings.namespace!r}: bind it to the launcher Role (deploy/k8s/rbac.yaml)"
        )


class _Pods:
    """The launch's pods as last listed, by node index."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.by_index: dict[int, Any] = {}

    def update(self, items: Iterable[Any]) -> None:
        self.by_index = {}
        for pod in items:
            labels = pod.metadata.labels or {}
            index = labels.get("vlm-assets/node-index") or (pod.metadata.annotations or {}).get(
                "batch.kubernetes.io/job-completion-index"
            )
            if index is not None:
                self.by_index[int(index)] = pod


def run_k8s(
    spec: LaunchSpec,
    settings: PodSettings,
    on_line: Callable[[int, str], None],
    env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    api=None,
    poll_s: float = 1.0,
    canceled: Callable[[], bool] | None = None,
) -> None:
    """Run ``spec`` as pods; return when every node succeeded; raise ``LaunchFailed`` otherwise.

    ``on_line(node, line)`` gets every pod's non-blank log line as it comes. Deletes what it created.
    """
    from kubernetes import client

    api = api or api_client(settings)
    check_access(api, settings)
    launch = Launch(spec, settings, labels=labels, env=env)
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(spec.num_nodes)]
    stop = threading.Event()
    try:
        for manifest in launch.render():
            kind = manifest["kind"]
            if kind == "Service":
                core.create_namespaced_service(settings.namespace, manifest)
            elif kind == "Pod":
                core.create_namespaced_pod(settings.namespace, manifest)
            else:
                batch.create_namespaced_job(settings.namespace, manifest)
        on_line(
            0,
            f"[launcher] {spec.name}: {spec.num_nodes} pod(s) x {spec.nproc_per_node} process(es) in "
            f"namespace {settings.namespace}, rendezvous {launch.rendezvous_host()}:{settings.rendezvous_port}",
        )
        _supervise(launch, core, lines, tails, on_line, stop, poll_s, canceled)
    finally:
        stop.set()
        delete_launch(core, batch, settings.namespace, launch.name)


def _supervise(launch: Launch, core, lines, tails, on_line, stop, poll_s, canceled) -> None:
    spec, settings = launch.spec, launch.settings
    started = time.monotonic()
    deadline = started + spec.timeout_s
    pods = _Pods(launch)
    streaming: dict[int, threading.Thread] = {}
    seen: set[int] = set()

    def drain(timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                node, line = lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return
            if line is not None:
                tails[node].append(line)
                if line.strip():  # a progress bar's carriage returns leave blank lines: noise in the Dagster log
                    on_line(node, line)

    while True:
        pods.update(core.list_namespaced_pod(settings.namespace, label_selector=f"{LAUNCH_LABEL}={launch.name}").items)
        for index, pod in pods.by_index.items():
            seen.add(index)
            if index not in streaming and pod.status.phase in ("Running", "Succeeded", "Failed"):
                streaming[index] = threading.Thread(
                    target=_stream_log,
                    args=(core, settings.namespace, pod.metadata.name, index, lines, stop, settings.log_read_timeout_s),
                    daemon=True,
                )
                streaming[index].start()
        drain(poll_s)
        failure = _failure(launch, pods, seen, started)
        if failure is not None:
            index, reason, exit_code, cause = failure
            stop_wait = time.monotonic() + 5  # the failing pod's last lines
            if (thread := streaming.get(index)) is not None:
                thread.join(timeout=max(0.0, stop_wait - time.monotonic()))
            drain(0.5)
            raise LaunchFailed(index, exit_code, _worker_exit_code(tails[index]), list(tails[index]), reason, cause)
        phases = [p.status.phase for p in pods.by_index.values()]
        if len(phases) == spec.num_nodes and all(p == "Succeeded" for p in phases):
            for thread in streaming.values():
                thread.join(timeout=30)
            drain(0.2)
            return
        if time.monotonic() > deadline:
            drain(0.5)
            raise LaunchFailed(
                0, None, None, list(tails[0]), f"{spec.name} ran past its {spec.timeout_s} s timeout", "timeout"
            )
        if canceled is not None and canceled():  # run_k8s deletes the pods on the way out
            drain(0.5)
            raise LaunchFailed(0, None, None, list(tails[0]), f"{spec.name}: its run was canceled", "canceled")


def _failure(
    launch: Launch, pods: _Pods, seen: set[int], started: float
) -> tuple[int, str, int | None, str | None] | None:
    """``(node, reason, exit code, cause)`` of the first pod that makes the launch fail, if any: the
    cause as ``retry.RULES`` names it when the pod's status tells it, else None (the exit codes and
    last lines tell).

    Of several pods whose containers failed, the one that ended first: its peers' workers fail after it,
    when a collective meets its absence. The API's times have one-second resolution, so within a second a
    container killed (SIGKILL or SIGTERM, as by the OOM killer) is taken for the cause before the others.
    """
    settings = launch.settings
    failed = []  # (finished_at, not killed, node, reason, exit code) of each pod whose container failed
    for index in range(launch.spec.num_nodes):
        pod = pods.by_index.get(index)
        name = launch.pod_name(index) if settings.mode == "pods" else f"{launch.name} index {index}"
        if pod is None:
            if index in seen:
                return index, f"pod {name} was deleted (by someone else, or its node was lost)", None, "evicted"
            continue
        name = pod.metadata.name
        status = pod.status
        if pod.metadata.deletion_timestamp is not None:
            return (
                index,
                f"pod {name} is being deleted (by someone else, or its node was drained or lost)",
                None,
                "evicted",
            )
        if status.phase == "Failed":
            terminated = _terminated(pod)
            code = terminated.exit_code if terminated is not None else None
            if status.reason:  # Evicted, DeadlineExceeded, NodeLost...
                cause = "timeout" if status.reason == "DeadlineExceeded" else "evicted"
                return index, f"pod {name} failed: {status.reason}: {status.message or ''}".rstrip(": "), code, cause
            why = f" ({terminated.reason})" if terminated is not None and terminated.reason else ""
            finished = terminated.finished_at if terminated is not None else None
            ended = finished.timestamp() if finished is not None else math.inf
            reason = f"pod {name} failed: container exit code {code}{why}"
            failed.append((ended, code not in KILLED_EXIT_CODES, index, reason, code))
            continue
        if status.phase == "Pending" and time.monotonic() - started > settings.pending_timeout_s:
            return (
                index,
                f"pod {name} still Pending after {settings.pending_timeout_s} s: {_pending_reason(pod)}",
                None,
                "unschedulable",
            )
    if failed:
        _, _, index, reason, code = min(failed)
        return index, reason, code, None
    return None


def _terminated(pod):
    for cs in pod.status.container_statuses or []:
        if cs.state is not None and cs.state.terminated is not None:
            return cs.state.terminated
    return None


def _pending_reason(pod) -> str:
    """The scheduler's reason (``0/2 nodes are available: 2 Insufficient nvidia.com/gpu.``) or the
    container's waiting reason (``ImagePullBackOff``)."""
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return f"{cond.reason}: {cond.message}"
    for cs in pod.status.container_statuses or []:
        if cs.state is not None and cs.state.waiting is not None:
            return f"{cs.state.waiting.reason}: {cs.state.waiting.message or ''}"
    return "not scheduled yet (no reason given by the scheduler)"


def _stream_log(
    core, namespace: str, pod: str, node: int, lines: queue.Queue, stop: threading.Event, read_timeout_s: float
) -> None:
    """Follow one pod's log until its container ends, reconnecting after a dropped connection from
    the last timestamp seen (lines at or before it are skipped: no loss, no duplicates)."""
    from kubernetes.client.exceptions import ApiException

    last: dt.datetime | None = None
    try:
        while not stop.is_set():
            kwargs: dict[str, Any] = {}
            if last is not None:
                kwargs["since_seconds"] = max(1, int((dt.datetime.now(dt.UTC) - last).total_seconds()) + 2)
            try:
                # _preload_content=False: kubernetes<37 decodes the log as a str of the bytes' repr.
                resp = core.read_namespaced_pod_log(
                    pod,
                    namespace,
                    container=CONTAINER,
                    follow=True,
                    timestamps=True,
                    _preload_content=False,
                    _request_timeout=(10, read_timeout_s),
                    **kwargs,
                )
                buffer = b""
                for chunk in resp.stream(4096):
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n")
                    for raw in complete:
                        last = _emit(raw, last, node, lines)
                if buffer:
                    last = _emit(buffer, last, node, lines)
                resp.release_conn()
            except ApiException as err:
                if err.status in (400, 404):  # not started yet, or gone
                    if err.status == 404:
                        return
                    time.sleep(0.5)
                    continue
                raise
            except Exception:  # a dropped connection: reconnect from the last timestamp
                time.sleep(1)
                continue
            pod_obj = _read_pod(core, namespace, pod)
            if pod_obj is None or pod_obj.status.phase in ("Succeeded", "Failed"):
                return
    finally:
        lines.put((node, None))


def _read_pod(core, namespace, name):
    from kubernetes.client.exceptions import ApiException

    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _emit(raw: bytes, last: dt.datetime | None, node: int, lines: queue.Queue) -> dt.datetime | None:
    text = raw.decode("utf-8", "replace").rstrip("\r")
    stamp, _, line = text.partition(" ")
    try:
        when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        lines.put((node, text))
        return last
    if last is not None and when <= last:
        return last  # seen before the reconnect
    lines.put((node, line))
    return when


def delete_launch(core, batch, namespace: str, name: str, wait_s: float = _DELETE_WAIT_S) -> None:
    """Delete a launch's Job, pods and Service, and wait until no pod of it is left."""
    delete_selected(core, batch, namespace, f"{LAUNCH_LABEL}={name}", wait_s)


def delete_selected(core, batch, namespace: str, selector: str, wait_s: float = _DELETE_WAIT_S) -> list[str]:
    """Delete every launcher object matching ``selector``; wait until their pods are gone. Returns the names."""
    from kubernetes.client.exceptions import ApiException

    deleted: list[str] = []

    def quietly(call, *args, **kwargs):
        try:
            call(*args, **kwargs)
        except ApiException as err:
            if err.status != 404:
                raise

    for job in batch.list_namespaced_job(namespace, label_selector=selector).items:
        quietly(batch.delete_namespaced_job, job.metadata.name, namespace, propagation_policy="Background")
        deleted.append(f"job/{job.metadata.name}")
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        quietly(core.delete_namespaced_pod, pod.metadata.name, namespace, grace_period_seconds=10)
        deleted.append(f"pod/{pod.metadata.name}")
    for svc in core.list_namespaced_service(namespace, label_selector=selector).items:
        quietly(core.delete_namespaced_service, svc.metadata.name, namespace)
        deleted.append(f"service/{svc.metadata.name}")
    end = time.monotonic() + wait_s
    while core.list_namespaced_pod(namespace, label_selector=selector).items:
        if time.monotonic() > end:
            raise TimeoutError(f"pods matching {selector} in {namespace} still there after {wait_s:.0f} s")
        time.sleep(0.5)
    return deleted


def delete_orphans(
    core, batch, namespace: str, run_is_live: Callable[[str], bool], step: tuple[str, str] | None = None
) -> list[str]:
    """Delete the launcher objects of Dagster runs that are no longer live; return their names.

    Such objects were left by a step process killed before it could clean up. With ``step`` (run id, step name) it
    also deletes those of an earlier attempt of that step (Dagster runs one attempt of a step at a time, so any
    there are a killed attempt's, whose pods would train on beside the new ones). Run at every launch's start.
    Objects without a run label are kept.
    """
    selector = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    runs = set()
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        runs.add((pod.metadata.labels or {}).get("dagster/run-id"))
    for svc in core.list_namespaced_service(namespace, label_selector=selector).items:
        runs.add((svc.metadata.labels or {}).get("dagster/run-id"))
    deleted: list[str] = []
    for run_id in sorted(r for r in runs if r):
        if not run_is_live(run_id):
            deleted += delete_selected(core, batch, namespace, f"{selector},dagster/run-id={run_id}")
    if step is not None:
        deleted += delete_selected(
            core, batch, namespace, f"{selector},dagster/run-id={step[0]},dagster/step={step[1]}"
        )
    return deleted
