"""Faults at random, nothing lost: a bounded, seeded fault-injection soak of ``gpt_checkpoint`` and
``visualchat_model``.

    python bench/soak.py --runs 6 --seed 1                 # CI size: 24 steps, a checkpoint every 6
    python bench/soak.py --runs 4 --seed 2 --demo          # the demo profile's GPT (40 steps, 256 tokens)
    python bench/soak.py --runs 6 --seed 3 --assets gpt_checkpoint visualchat_model   # in turn
    python bench/soak.py --runs 6 --seed 4 --launcher k8s  # pods on the loopback Kubernetes testbed
    python bench/soak.py --runs 2 --seed 2112454 --assets gpt_checkpoint visualchat_model --ci   # CI's

One uninterrupted reference run of each asset, then ``--runs`` materializations of the same configs
(the assets in turn; ``--ci``: each asset's runs in turn in a thread of their own, beside the other
assets', each asset's behind fault proxies of its own: CI's 2 cores are otherwise half idle while one
process starts at a time), each into a fresh prefix of a real S3 server (moto, on loopback) behind a
fault proxy, through the real launcher (local torchrun, or ``--launcher k8s``: pods through a real API
server, scheduler and controllers) and Dagster's RetryPolicy. Each attempt is a Dagster run of its own
process (the run worker), its steps in processes it spawns (the multiprocess executor):
``gpt_checkpoint`` (with its ``token_shards``) on 2 nodes of 1 process, DDP (24 steps, a checkpoint every
6); ``visualchat_model`` (with its ``occlusion_manifests``: 80 Fashion-MNIST images) with a tiny CLIP and
a tiny GPT-2 on 1 node of 2 processes, ZeRO-2 (24 steps, a checkpoint every 4; ``--demo``: 48 every 8).
Each run gets 1 or 2 faults from a schedule drawn from ``--seed``, each fired by the S3 fault proxy
when it answers the commit of a checkpoint at or past a drawn step (the commit stored, the trainer not
yet told: each fault fires at the same point of the training in every run): a SIGKILL of a training
worker, of a torchrun agent, of the step process or of the run worker; a pod deleted or evicted
(``--launcher k8s``); the S3 server answering 500 or dropping the connection for the next 1-8 writes (a
checkpoint's or the final commit's; boto3 tries each request 3 times, its standard retry mode, so a
longer outage reaches the retry rule); the run's scratch disk kept full until the attempt that meets it
has ended (its next checkpoint write or shard download fails: the retry rule's ``disk_full``); or the
MLflow server (a real one, on loopback behind the same kind of proxy) refusing every request for 5-60 s.
Each run's scratch (``runs/``, where checkpoints are staged) is a 256 MiB tmpfs: the soak runs itself in
a private mount namespace (``unshare``), so nothing outside it sees the mounts. A reader polls the store
all along.

More faults than the RetryPolicy's 2 retries fail the run, and a killed run worker cannot fail at all:
the soak then runs the same key again, as a user or the schedule would (a relaunch, counted as a retry).

Invariants checked after every run (any violation: exit 1): it ended with exactly one materialization
and one committed key; its loss (GPT's val loss, VisualChat's held-out loss of the merged model) equals
the reference's within 1e-5 (the resume tolerance of docs/reliability.md); every kill resumed from the last checkpoint
committed before it (lost work < one checkpoint interval); no training process, pod, lease, scratch
directory, Dagster run in progress or RUNNING MLflow run is left; the reader never saw a committed key
whose files disagree with its manifest, nor a manifest it could not read; every scheduled fault fired.
A soak cut short by ``--max-minutes`` exits 2. Prints one row per run (with its time lost: its seconds less its
reference's) and writes ``soak.json`` (faults, retries, causes, each failed step attempt's error,
resumed-from step, time, the final artifact's key and sha256 digest) into ``--out``.
"""

import argparse
import contextlib
import dataclasses
import functools
import http.client
import http.server
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = (
    "worker",
    "agent",
    "s3-500",
    "s3-drop",
    "disk-full",
    "mlflow-down",
    "step",
    "run-worker",
    "pod-delete",
    "pod-evict",
)
POD_KINDS = ("pod-delete", "pod-evict")  # the k8s launcher's only (--launcher k8s)
SCRATCH_MIB = 256  # each run's scratch tmpfs: room for a few tiny-GPT checkpoints being staged
IN_NAMESPACE = "VLM_SOAK_MOUNT_NAMESPACE"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # vlm_assets_tests: the tests' tiny VisualChat models


UNSHARE = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]


def in_private_mounts(argv: list[str]) -> int | None:
    """Run this soak again inside a private mount namespace (a user namespace mapping this user to
    root where it is not root already), where it may mount tmpfs scratch that nothing outside sees and
    that vanishes with it; its exit status. None when already inside."""
    if os.environ.get(IN_NAMESPACE):
        return None
    return subprocess.call([*UNSHARE, sys.executable, __file__, *argv], env={**os.environ, IN_NAMESPACE: "1"})


BALLAST = ".ballast"


def fill(directory: Path) -> Path:
    """Grow ``directory / BALLAST`` until it takes every free byte of that file system; return its path.

    Each call takes back the space a finished upload's staging freed, so the disk stays full."""
    ballast = directory / BALLAST
    # Unbuffered: a buffered file keeps the bytes of a short write and raises ENOSPC again on close,
    # outside the suppress below.
    with open(ballast, "ab", buffering=0) as f:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while f.write(chunk):
                pass
    return ballast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultProxy:
    """An HTTP proxy in front of a server (S3's, MLflow's) that fails the next N writes (not lease
    records) on demand: a 500 with S3's InternalError body, or a connection closed without an answer;
    or, while it is down (``down_for``), closes every connection unanswered, as a stopped server would.
    ``on_commit(path, step)``, when set, runs once a checkpoint's commit (the PUT of its manifest) is
    stored and before it is answered."""

    def __init__(self, upstream_port: int):
        from vlm_assets.storage.artifact_store import MANIFEST_NAME

        self.lock = threading.Lock()
        self.mode, self.left, self.injected, self.down_until = None, 0, 0, 0.0
        self.on_commit: Callable[[str, int], None] | None = None
        commit = re.compile(rf"/checkpoints/[^?]+/step-(\d+)/{re.escape(MANIFEST_NAME)}(?:\?|$)")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                write = self.command in ("PUT", "POST") and "/.leases/" not in self.path
                down = time.monotonic() < proxy.down_until
                if down or (write and proxy.take()):
                    if down or proxy.mode == "s3-drop":  # the connection closed without an answer
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    error = b"<Error><Code>InternalError</Code><Message>injected by bench/soak.py</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = upstream.getresponse()
                payload = response.read()
                on_commit = proxy.on_commit
                committed = commit.search(self.path) if self.command == "PUT" else None
                if on_commit and committed and response.status == 200:
                    on_commit(self.path, int(committed.group(1)))
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                upstream.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a killed client's: expected here
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down_for(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def arm(self, mode: str, count: int) -> None:
        with self.lock:
            self.mode, self.left = mode, count

    def take(self) -> bool:
        with self.lock:
            if self.left <= 0:
                return False
            self.left -= 1
            self.injected += 1
            return True


@dataclasses.dataclass(frozen=True)
class Target:
    """An asset the soak trains: its upstream, its trainer (whose processes it kills) and the metric
    compared with the uninterrupted run's."""

    asset: str
    upstream: str
    module: str
    metric: str


TARGETS = {
    "gpt_checkpoint": Target("gpt_checkpoint", "token_shards", "vlm_assets.train.gpt_pretrain", "val_loss"),
    "visualchat_model": Target(
        "visualchat_model", "occlusion_manifests", "vlm_assets.train.visualchat_train", "eval_loss"
    ),
}


@dataclasses.dataclass
class Fault:
    kind: str
    after_step: int  # fired when a checkpoint at or past this step is committed
    size: int = 0  # S3 faults: how many writes fail; mlflow-down: for how many seconds
    # the training workers alive when it fired: the launch it hit (disk-full: they must end before the
    # space comes back)
    victims: tuple[int, ...] = ()
    fired_at: int | None = None  # the step of the checkpoint whose commit fired it
    fired_time: float | None = None  # and when (wall clock)
    note: str = ""


def draw_schedule(rng: random.Random, steps: list[int], kinds: tuple[str, ...]) -> list[Fault]:
    """1 or 2 faults of ``kinds`` at increasing checkpoint steps; an S3 fault may wait for the last one
    (the final commit's writes come after it)."""
    count = rng.choice((1, 2))
    faults = []
    for i, step in enumerate(sorted(rng.sample(steps[:-1], count))):
        kind = rng.choice(kinds)
        if kind.startswith("s3") and i == count - 1 and rng.random() < 0.5:
            step = steps[-1]
        size = rng.randint(1, 8) if kind.startswith("s3") else rng.randint(5, 60) if kind == "mlflow-down" else 0
        faults.append(Fault(kind, step, size))
    return faults


def parse_fault(text: str) -> Fault:
    """``KIND@STEP`` or ``KIND@STEP:SIZE`` (``--faults``): one fault of a fixed schedule."""
    kind, _, rest = text.partition("@")
    step, _, size = rest.partition(":")
    if kind not in KINDS or not step.isdigit() or (size and not size.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND@STEP[:SIZE] with KIND one of {', '.join(KINDS)}")
    return Fault(kind, int(step), int(size or 0))


def failure_causes(events: list, asset: str = "gpt_checkpoint") -> list[str]:
    """The retry rule's cause of each failed step attempt in a Dagster run's events, in order.

    The launcher's failure ends with ``(<cause>: retried; ...)``; an error of the step process itself (the
    final commit's upload, say), which no launcher read, is ``step:<its exception class>``. A failure of a
    step other than ``asset`` (its upstream) is ``<that step>/<cause>``.
    """
    causes = []
    for step, error in failed_attempts(events):
        text = error.to_string() if error is not None else ""
        found = re.findall(r"\((\w+): (?:retried|not retried);", text)
        cause = found[-1] if found else f"step:{getattr(error, 'cls_name', None) or 'unknown'}"
        causes.append(cause if step == asset else f"{step}/{cause}")
    return causes


def failure_errors(events: list) -> list[str]:
    """``<step>: <the first 600 characters of its error>`` for each failed step attempt, in order.

    What a cause alone does not say; a killed run worker writes no event, so it has no entry here.
    """
    return [f"{step}: {error.message[:600] if error is not None else '?'}" for step, error in failed_attempts(events)]


def failed_attempts(events: list) -> list[tuple[str, Any]]:
    """(step key, its error or None) of each failed step attempt (retried or not) in a Dagster run's events."""
    return [
        (e.step_key, getattr(e.event_specific_data, "error", None))
        for e in events
        if e.step_key and e.event_type_value in ("STEP_UP_FOR_RETRY", "STEP_FAILURE")
    ]


KILLS = ("worker", "agent", "step", "run-worker", *POD_KINDS)


def work_lost(faults: list[Fault], failures: list[float], retries: int, resumed_from_step: float | None) -> list[str]:
    """Nothing committed before a fault that ended an attempt is trained again: the attempt that succeeded
    resumed from at least the checkpoint committed before the last fault that fired before the last
    failure (``failures``: when each failed attempt ended, wall clock), so lost work is under one
    checkpoint interval; a fault after the last failure (an outage the S3 or MLflow client rode out) ended
    nothing. Every launch a kill hit cost a retry."""
    fired = [f for f in faults if f.fired_at is not None and not f.note]
    last_failure = max(failures, default=None)
    ended = [f for f in fired if last_failure is not None and f.fired_time is not None and f.fired_time < last_failure]
    problems = []
    last = max((f.fired_at for f in ended), default=None)
    if last is not None and resumed_from_step is not None and resumed_from_step < last:
        problems.append(f"resumed from step {resumed_from_step}, but step {last} was committed before the last fault")
    # Two kills that hit one launch (the second fired before the first was noticed) end one attempt.
    kills = [f for f in fired if f.kind in KILLS]
    if retries < len(ended_attempts := {f.victims[0] if f.victims else id(f) for f in kills}):
        problems.append(f"{len(kills)} kill(s) ending {len(ended_attempts)} attempt(s) but {retries} retries")
    return problems


def processes(module: str, marker: str) -> dict[str, list[int]]:
    """Live torchrun agents, training workers and agents' starters of the trainer ``module`` whose command line has
    ``marker`` (``training_processes``)."""
    from vlm_assets.launch.local import training_processes

    return training_processes(module, marker)


def pod_process_groups(pod: str) -> list[int]:
    """The process groups the testbed's kubelet runs a pod's containers in (each its own session, with
    the pod's name as ``HOSTNAME``)."""
    groups = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            pid = int(environ.parent.name)
            if f"HOSTNAME={pod}".encode() in environ.read_bytes().split(b"\0") and os.getpgid(pid) == pid:
                groups.append(pid)
    return groups


def serve(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start a loopback server with ``env`` added to its environment, dying with the soak
    (``vlm_assets.launch.lifeline``)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "vlm_assets.launch.lifeline", "--exec", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )


def wait_serving(server: subprocess.Popen, port: int, what: str, log: Path) -> None:
    """Wait until ``server`` listens on ``port``."""
    deadline = time.monotonic() + 180
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start: {log}")
        time.sleep(0.2)


def torn_problems(reader, key: str) -> list[str]:
    """What a reader finds wrong with a committed key (sizes against its manifest, or a manifest it cannot
    read); nothing for a key deleted meanwhile (keep_last deletes the manifest first)."""
    from vlm_assets.storage import ArtifactNotFoundError

    try:
        problems = reader.quick_verify(key)
    except ArtifactNotFoundError:
        return []
    except Exception as err:  # an unreadable or partial manifest: what the watcher is for
        return [f"unreadable manifest: {type(err).__name__}: {err}"]
    return problems if problems and reader.exists(key) else []


def listed_problems(manifest, objects: dict[str, int]) -> list[str]:
    """What one listing of a committed key (each object's path below the key -> its size) shows wrong with
    the files of ``manifest``: one absent, or at another size."""
    base = f"{manifest.location}/" if manifest.location else ""
    return manifest.size_problems({path[len(base) :]: size for path, size in objects.items() if path.startswith(base)})


def commit_problems(reader, manifests: dict, key: str, objects: dict[str, dict]) -> list[str]:
    """What one poll finds wrong with the committed checkpoint ``key`` in ``objects``, its listing (each
    object's path below the key -> the S3 object, with its ``Size`` and ``ETag``).

    A commit's manifest is read once into ``manifests`` (key and manifest ETag -> the manifest); each
    poll compares its listing with it and asks the store, as any reader asks it (``torn_problems``), only
    when they disagree: the store's own check is a GET and a listing per key, at every poll most of the
    S3 server's work."""
    from vlm_assets.storage import ArtifactNotFoundError
    from vlm_assets.storage.artifact_store import MANIFEST_NAME

    commit = (key, objects[MANIFEST_NAME]["ETag"])
    if commit not in manifests:
        try:
            manifests[commit] = reader.read_manifest(key)
        except ArtifactNotFoundError:  # deleted meanwhile: not listed next time
            return []
        except Exception:  # reported once when the store's own check says what is wrong, else read again
            if problems := torn_problems(reader, key):
                manifests[commit] = None
            return problems
    manifest = manifests[commit]
    if manifest is None or not listed_problems(manifest, {rel: obj["Size"] for rel, obj in objects.items()}):
        return []
    return torn_problems(reader, key)


def unfired(faults: list[Fault]) -> list[str]:
    """A scheduled fault that never fired is a soak that did not test what it says."""
    return [f"fault {f.kind} after step {f.after_step} never fired" for f in faults if f.fired_at is None]


def exit_status(rows: list[dict], unfinished: int) -> int:
    """1 when a run broke an invariant, else 2 when --max-minutes left runs undone, else 0."""
    return 1 if any(row["problems"] for row in rows) else (2 if unfinished else 0)


class Soak:
    def __init__(self, args):
        self.args = args
        self.root = Path(args.out)
        self.root.mkdir(parents=True, exist_ok=True)
        os.environ.update(AWS_ACCESS_KEY_ID="soak", AWS_SECRET_ACCESS_KEY="soak", AWS_DEFAULT_REGION="us-east-1")
        self.moto_port, self.mlflow_port = free_port(), free_port()
        moto = ["-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)]
        mlflow = ["-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port), "--workers", "1"]
        mlflow += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        # MLflow's job runners (a runner and seven huey consumers, for GenAI jobs) off, as in
        # scripts/services.sh: the soak submits no job, and they would take CPU from the runs under test.
        jobs_off = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.servers = [serve(moto, self.root / "moto.log"), serve(mlflow, self.root / "mlflow.log", **jobs_off)]
        if "visualchat_model" in args.assets:
            _ = self.models  # built while the servers start
        wait_serving(self.servers[0], self.moto_port, "the S3 server (moto)", self.root / "moto.log")
        wait_serving(self.servers[1], self.mlflow_port, "the MLflow server", self.root / "mlflow.log")
        # Each asset's (S3, MLflow) fault proxies: one pair for all, or with --ci a pair each, so that a
        # fault fired for one asset's run fails no request of the other asset's run beside it.
        shared = None if args.ci else self.proxy_pair()
        self.proxies = {asset: shared or self.proxy_pair() for asset in dict.fromkeys(args.assets)}
        # The token shards are streamed by MosaicML streaming, which finds S3 from the environment (an
        # attempt's own, set in ``materialize``; the k8s launcher's pods get this process's).
        first = self.proxied(args.assets[0])
        os.environ.update(AWS_ENDPOINT_URL=first, S3_ENDPOINT_URL=first)
        self.direct = self.client(self.moto_port)
        self.direct.create_bucket(Bucket="soak")
        self.k8s = self.start_k8s() if args.launcher == "k8s" else None

    def proxy_pair(self) -> tuple[FaultProxy, FaultProxy]:
        return FaultProxy(self.moto_port), FaultProxy(self.mlflow_port)

    def proxied(self, asset: str) -> str:
        """The S3 endpoint of ``asset``'s runs: its fault proxy."""
        return f"http://127.0.0.1:{self.proxies[asset][0].port}"

    @property
    def injected(self) -> int:
        """S3 writes failed by the proxies."""
        return sum(s3.injected for s3, _ in set(self.proxies.values()))

    def start_k8s(self):
        """The k8s launcher's cluster: the loopback testbed (a real API server, scheduler and controllers;
        pods are local processes: ``vlm_assets_tests/k8s/testbed``; its ports are fixed, so not beside the
        k8s tests), started here, inside the soak's mount namespace, so that pods see the scratch tmpfs.
        The pods run in namespace ``soak``; the core API client."""
        from kubernetes import client

        from vlm_assets_tests.k8s.testbed_fixtures import start_testbed, wait_for_default_service_account

        # moto's keys, in every pod as a node's credentials would be (the launcher refuses keys in the pod
        # spec, and the testbed's kubelet does not mount a Secret's envFrom)
        keys = {f"FAKE_KUBELET_ENV_{k}": os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        try:
            self.testbed = start_testbed(self.root / "k8s", env=keys)
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        core = client.CoreV1Api(self.testbed.api())
        core.create_namespace({"metadata": {"name": "soak"}})
        wait_for_default_service_account(core, "soak")
        return core

    def k8s_objects(self) -> list[str]:
        from kubernetes import client

        from vlm_assets_tests.k8s.testbed_fixtures import launcher_objects

        return launcher_objects(self.k8s, client.BatchV1Api(self.k8s.api_client), "soak")

    def hit_pod(self, fault: Fault) -> None:
        """Delete one running pod of the launch (a user's ``kubectl delete``, a drained node), or evict it
        as a kubelet under node pressure does: its status written ``Failed``/``Evicted``, its containers
        killed (the testbed's kubelet evicts nothing itself)."""
        pods = [p for p in self.k8s.list_namespaced_pod("soak").items if p.status.phase == "Running"]
        if not pods:
            fault.note = "no pod running"
            return
        pod = random.Random(fault.after_step).choice(sorted(pods, key=lambda p: p.metadata.name)).metadata.name
        if fault.kind == "pod-delete":
            self.k8s.delete_namespaced_pod(pod, "soak")
            return
        status = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}
        self.k8s.patch_namespaced_pod_status(pod, "soak", {"status": status})
        for group in pod_process_groups(pod):  # and its containers killed, as the kubelet does
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)

    def launcher(self) -> dict:
        """The attempt's launcher: local torchrun, or pods through the testbed's API server."""
        if self.k8s is None:
            return {"kind": "local"}
        env = {"OMP_NUM_THREADS": "1", "VLM_ASSETS_NODES_SHARE_HOST": "1"}
        env.update({k: os.environ[k] for k in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "HOME") if k in os.environ})
        settings = {"namespace": "soak", "kubeconfig": str(self.testbed.kubeconfig), "python": sys.executable}
        # pod DNS names do not resolve on the testbed: the rendezvous is on loopback
        settings.update(rendezvous_host="127.0.0.1", pending_timeout_s=60, env=env)
        return {"kind": "k8s", **settings}

    @functools.cached_property
    def models(self) -> Path:
        """A tiny CLIP and a tiny GPT-2 (the tests' own, loaded through ``from_pretrained``): VisualChat's
        encoder and decoder."""
        from vlm_assets.paths import offline_data_dir
        from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder

        root = self.root / "models"
        tiny_clip(root / "clip")
        tiny_decoder(root / "gpt2", offline_data_dir(), arch="gpt2")
        return root

    @staticmethod
    def client(port: int):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")

    def close(self):
        if self.k8s is not None:
            from vlm_assets_tests.k8s.testbed_fixtures import stop_testbed

            stop_testbed(self.testbed.run_dir)
        for proxy in {proxy for pair in self.proxies.values() for proxy in pair}:
            proxy.server.shutdown()
        for server in self.servers:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:  # MLflow's server can outlast a SIGTERM with clients open
                server.kill()
                server.wait()

    def run_config(self, target: Target) -> dict:
        from vlm_assets.paths import offline_data_dir

        data = offline_data_dir()
        if target.asset == "visualchat_model":
            from vlm_assets_tests.models.visualchat_fixtures import tiny_model_section

            images = {"source": "fashion_mnist", "source_uri": str(data / "fashion-mnist")}
            images.update(num_train=60, num_validation=20)
            steps, every = (48, 8) if self.args.demo else (24, 4)
            chat = {
                "model": tiny_model_section(self.models / "clip", self.models / "gpt2"),
                "optimizer": {"global_batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "max_steps": steps},
                "data": {"pair_count": 8, "eval_images": 8},
                "checkpoint": {"every": every},
                "parallelism": {"nproc_per_node": 2, "num_nodes": 1, "micro_batch_size": 2},
                "seed": 0,
                "log_every": every,
                "timeout_s": 600,
                # the soak judges faults, not quality: the VQA gate's threshold is left to the tests and the demo
                "checks": {"min_exact_match": 0.0},
            }
            return {"ops": {"occlusion_manifests": {"config": images}, "visualchat_model": {"config": chat}}}
        tokens = {
            "source": "text_files",
            "text_glob": str(data / "shakespeare" / "*.txt"),
            "tokenizer": str(data / "gpt2-tokenizer"),
            "max_length": 256 if self.args.demo else 64,
            "max_val_samples": 64,
        }
        micro, steps, every = (4, 40, 10) if self.args.demo else (2, 24, 6)
        gpt = {
            "model": {"preset": "tiny"},
            "optimizer": {"global_batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "max_steps": steps},
            "data": {"val_check_interval": 2 * every, "val_batches": 4},
            "checkpoint": {"every": every, "keep_last": 2},
            "parallelism": {"strategy": "ddp", "num_nodes": 2, "nproc_per_node": 1, "micro_batch_size": micro},
            "seed": 0,
            "log_every": every,
        }
        return {"ops": {"token_shards": {"config": tokens}, "gpt_checkpoint": {"config": gpt}}}

    def checkpoint_steps(self, target: Target) -> list[int]:
        config = self.run_config(target)["ops"][target.asset]["config"]
        every, last = config["checkpoint"]["every"], config["optimizer"]["max_steps"]
        return list(range(every, last + 1, every))

    def materialize(self, name: str, target: Target, faults: list[Fault]) -> dict:
        import dagster as dg
        from mlflow import MlflowClient

        from vlm_assets.defs.platform.storage import S3ArtifactStoreResource
        from vlm_assets.storage.artifact_store import MANIFEST_NAME

        home = self.root / f"{name}-{target.asset}"
        scratch = home / "runs"  # VLM_ASSETS_HOME/runs: each launch's scratch, checkpoints staged there
        scratch.mkdir(parents=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={SCRATCH_MIB}m", "vlm-soak-scratch", str(scratch)]
        subprocess.run(mount, check=True)
        prefix = f"{name}-{target.asset}-{os.getpid()}"
        s3_proxy, mlflow_proxy = self.proxies[target.asset]
        mlflow_uri = f"http://127.0.0.1:{mlflow_proxy.port}"  # what the runs use; the checks go direct
        store = {
            "bucket": "soak",
            "prefix": prefix,
            "cache_dir": str(home / "s3-cache"),
            "endpoint_url": self.proxied(target.asset),
            "lease_ttl_s": 15,  # a killed step's lease: the relaunch waits this long to take it over
        }
        reader = S3ArtifactStoreResource(
            bucket="soak",
            prefix=prefix,
            cache_dir=str(home / "reader"),
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
        ).get_store()
        dagster_home = home / "dagster"  # each run's own instance: the killed attempts' runs stay in it
        dagster_home.mkdir()
        (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        spec = {
            "assets": [target.upstream, target.asset],
            "run_config": self.run_config(target),
            "store": store,
            "mlflow": {"tracking_uri": mlflow_uri, "artifact_location": (home / "mlruns").as_uri()},
            "launcher": self.launcher(),
        }
        (home / "attempt.json").write_text(json.dumps(spec))
        attempt: list[subprocess.Popen] = []  # the attempts (run workers): the last is live, for the kills
        config = self.run_config(target)["ops"][target.asset]["config"]
        every, last = config["checkpoint"]["every"], config["optimizer"]["max_steps"]
        stop = threading.Event()
        torn: list[str] = []
        checked: set[str] = set()
        pending, lock = list(faults), threading.Lock()
        full_disk: list[Fault] = []  # the disk-full faults whose attempts keep the one ballast file

        manifests: dict[tuple[str, str], Any] = {}  # (checkpoint key, its manifest's ETag) -> that manifest

        def check_checkpoints() -> None:
            """Check each committed checkpoint against its manifest in this poll's one listing."""
            listing, base = {}, f"{prefix}/checkpoints/{target.asset}/"
            for page in self.direct.get_paginator("list_objects_v2").paginate(Bucket="soak", Prefix=base):
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(prefix) + 1 :].split("/")
                    at = next((i for i, part in enumerate(parts) if part.startswith("step-")), None)
                    if at is not None:
                        listing.setdefault("/".join(parts[: at + 1]), {})["/".join(parts[at + 1 :])] = obj
            keys = sorted(key for key, objects in listing.items() if MANIFEST_NAME in objects)
            for key in keys:
                if problems := commit_problems(reader, manifests, key, listing[key]):
                    torn.append(f"{key}: {problems}")

        def fire_due(path: str, step: int) -> None:
            """Fire the pending faults that this run's commit of checkpoint ``step`` reaches.

            The S3 proxy's ``on_commit``: the trainer waits for the commit's answer meanwhile. A commit of
            another prefix (a straggler of an earlier run) fires nothing."""
            if f"/{prefix}/checkpoints/{target.asset}/" not in path:
                return
            try:
                with lock:
                    while pending and step >= pending[0].after_step:
                        fire(pending.pop(0), step)
            except Exception as error:  # a broken soak must not pass for a platform that never recovers
                torn.append(f"the soak's fault schedule failed: {error!r}")

        def fire(fault: Fault, step: int) -> None:
            """Inject ``fault`` now, at the commit of checkpoint ``step``; a note says why it could not."""
            fault.fired_at, fault.fired_time = step, time.time()
            fault.victims = tuple(sorted(processes(target.module, str(home))["worker"]))
            if fault.kind.startswith("s3"):
                s3_proxy.arm(fault.kind, fault.size)
            elif fault.kind == "mlflow-down":
                mlflow_proxy.down_for(fault.size)
            elif fault.kind == "run-worker":
                if attempt and attempt[-1].poll() is None:
                    attempt[-1].send_signal(signal.SIGKILL)
                else:
                    fault.note = "no attempt running"
            elif fault.kind == "step":
                if attempt and (spawned := step_processes(attempt[-1].pid)):
                    os.kill(spawned[-1], signal.SIGKILL)
                else:
                    fault.note = "no step process running"
            elif fault.kind in POD_KINDS:
                self.hit_pod(fault)
            elif fault.kind == "disk-full":
                if fault.victims:
                    fill(scratch)
                    full_disk.append(fault)
                else:
                    fault.note = "no attempt running"
            else:
                pids = processes(target.module, str(home))[fault.kind]
                if pids:
                    os.kill(random.Random(fault.after_step).choice(pids), signal.SIGKILL)
                else:
                    fault.note = "no process left to kill"

        def poll():
            """Check the store as a reader would, and keep a full disk full, until the run ends."""
            from vlm_assets.launch.local import alive

            polls = 0
            while not stop.is_set():
                polls += 1
                with lock:
                    if full_disk and not any(alive(pid) for pid in full_disk[0].victims):
                        full_disk.pop(0)  # the attempt that met the full disk has ended
                        if not full_disk:  # a later disk-full fault's attempt keeps the shared file
                            (scratch / BALLAST).unlink(missing_ok=True)
                    elif full_disk:
                        fill(scratch)  # still full: space freed since (an uploaded checkpoint's staging) is taken
                # The assets' keys are committed once a run and checked once: every fifth poll looks for new ones
                # (a listing is a scan of the bucket for the S3 server); the checkpoints' listing is every poll's.
                for prefix_ in (target.asset, target.upstream) if polls % 5 == 1 else ():
                    for key in reader.list_complete(prefix_):
                        if key not in checked and (problems := torn_problems(reader, key)):
                            torn.append(f"{key}: {problems}")
                        checked.add(key)
                check_checkpoints()
                stop.wait(0.2)

        def watch():
            try:
                poll()
            except Exception as error:  # a broken soak must not pass for a platform that never recovers
                torn.append(f"the soak's watcher failed: {error!r}")
                with lock:  # nobody polls now: no fault fires, and the disk is not left full
                    pending.clear()
                    full_disk.clear()
                    (scratch / BALLAST).unlink(missing_ok=True)

        watcher = threading.Thread(target=watch, daemon=True)
        started = time.monotonic()
        s3_proxy.on_commit = fire_due
        watcher.start()
        try:
            # More faults than the RetryPolicy's 2 retries fail the run; the next run of the same key
            # (a user's, a schedule's) must then resume: the soak relaunches it, up to twice, and once
            # more for each attempt whose step process or run worker it killed.
            retries, relaunches, run_ids, events, causes, success = 0, 0, [], [], [], False
            failures: list[float] = []  # when each failed attempt ended
            limit = 2 + len([f for f in faults if f.kind in ("step", "run-worker")])
            with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
                while True:
                    known = {run.run_id for run in instance.get_runs()}
                    with open(home / "attempts.log", "a") as log:
                        command = [sys.executable, __file__, "--attempt", str(home / "attempt.json")]
                        env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "VLM_ASSETS_HOME": str(home)}
                        env.update(AWS_ENDPOINT_URL=store["endpoint_url"], S3_ENDPOINT_URL=store["endpoint_url"])
                        attempt.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
                    attempt[-1].wait()
                    new = [run for run in instance.get_runs() if run.run_id not in known]
                    for run in new:
                        entries = [e for e in instance.all_logs(run.run_id) if e.dagster_event]
                        run_events = [e.dagster_event for e in entries]
                        events += run_events
                        failures += [
                            e.timestamp
                            for e in entries
                            if e.dagster_event.step_key == target.asset
                            and e.dagster_event.event_type_value in ("STEP_UP_FOR_RETRY", "STEP_FAILURE")
                        ]
                        retries += len([e for e in run_events if e.event_type_value == "STEP_UP_FOR_RETRY"])
                        causes += failure_causes(run_events, target.asset)
                        success = run.status == dg.DagsterRunStatus.SUCCESS
                    run_ids += [run.run_id for run in new]
                    if success or relaunches == limit:
                        break
                    failures.append(time.time())  # the attempt's process has ended (a killed run worker writes nothing)
                    if attempt[-1].returncode == -signal.SIGKILL:
                        causes.append("run-worker:killed")
                    relaunches += 1
                    retries += 1  # the relaunch is a retry too
                left_running = [
                    f"{run.run_id[:8]} {run.status.value}" for run in instance.get_runs() if not run.is_finished
                ]
        finally:
            stop.set()
            watcher.join()
            with lock:  # a hook firing now ends first; none fires after
                pending.clear()
                s3_proxy.on_commit = None
            s3_proxy.arm(None, 0)
            mlflow_proxy.down_for(0)
            (scratch / BALLAST).unlink(missing_ok=True)
        seconds = time.monotonic() - started
        materializations = [
            e.event_specific_data.materialization
            for e in events
            if e.event_type_value == "ASSET_MATERIALIZATION" and e.asset_key.to_user_string() == target.asset
        ]
        meta = {k: getattr(v, "value", v) for k, v in materializations[0].metadata.items()} if materializations else {}

        problems = list(torn)
        problems += unfired(faults)
        if not success or len(materializations) != 1:
            failure = next((e for e in reversed(events) if e.event_type_value == "STEP_FAILURE"), None)
            problems.append(
                f"{len(materializations)} materializations; last failure: "
                f"{failure.step_failure_data.error.message[:400] if failure else '?'}"
            )
        if left_running:
            problems.append(f"Dagster runs left in progress: {left_running}")
        keys = reader.list_complete(target.asset)
        if len(keys) != 1:
            problems.append(f"{len(keys)} committed keys of {target.asset}, expected 1")
        for key in keys:
            with contextlib.suppress(Exception):
                reader.verify(key)  # every file re-hashed against the manifest
                continue
            problems.append(f"{key}: its files do not match its manifest")
        left = processes(target.module, str(home))
        if any(left.values()):
            problems.append(f"processes left: {left}")
        if self.k8s is not None and (objects := self.k8s_objects()):
            problems.append(f"k8s objects left: {objects}")
        if leases := reader.list_leases():
            problems.append(f"leases left: {[lease.describe() for lease in leases]}")
        if left := sorted(scratch.glob("*")):
            problems.append(f"scratch left: {[p.name for p in left]}")
        client = MlflowClient(f"http://127.0.0.1:{self.mlflow_port}")
        experiment = client.get_experiment_by_name("vlm_assets")
        statuses = []
        for run_id in run_ids if experiment else []:
            found = client.search_runs([experiment.experiment_id], filter_string=f"tags.`dagster.run_id` = '{run_id}'")
            statuses += [r.info.status for r in found]
        if "RUNNING" in statuses:
            problems.append(f"MLflow runs left RUNNING: {statuses}")
        problems += work_lost(faults, failures, retries, meta.get("resumed_from_step") if meta else None)
        return {
            "name": name,
            "asset": target.asset,
            "faults": [dataclasses.asdict(f) for f in faults],
            "retries": retries,
            "relaunches": relaunches,
            "causes": causes,
            "errors": failure_errors(events),
            "resumed_from_step": meta.get("resumed_from_step"),
            "metric": target.metric,
            "loss": meta.get(target.metric),
            "key": keys[0] if keys else None,
            "digest": reader.read_manifest(keys[0]).digest if len(keys) == 1 else None,  # sha256 of the files
            "checkpoint_every": every,
            "max_steps": last,
            "seconds": round(seconds, 1),
            "mlflow_statuses": sorted(statuses),
            "problems": problems,
        }


ATTEMPT = "VLM_SOAK_ATTEMPT"  # the attempt's spec (attempt.json), for soak_job in its step processes


def soak_job():
    """The attempt's job, rebuilt from ``$VLM_SOAK_ATTEMPT`` in the run worker and in each step process:
    the spec's assets with its resources, under Dagster's multiprocess executor with spawned step
    processes (``execution: {config: {multiprocess: {}}}`` of a job here), so that the run worker and the training step
    are processes apart: the ``run-worker`` fault kills the one, the ``step`` fault the other."""
    import dagster as dg

    from vlm_assets.defs.data.occlusion_assets import occlusion_manifests
    from vlm_assets.defs.data.token_assets import token_shards
    from vlm_assets.defs.models.gpt_assets import gpt_checkpoint
    from vlm_assets.defs.models.visualchat_assets import visualchat_model
    from vlm_assets.defs.platform.launcher import K8sTorchrunLauncher, LocalTorchrunLauncher
    from vlm_assets.defs.platform.storage import S3ArtifactStoreResource
    from vlm_assets.defs.platform.tracking import MlflowTrackingResource

    spec = json.loads(Path(os.environ[ATTEMPT]).read_text())
    launcher = dict(spec["launcher"])
    if launcher.pop("kind") == "k8s":  # a port of its own: a killed attempt's pods may hold the last one
        launcher = K8sTorchrunLauncher(**launcher, rendezvous_port=free_port())
    else:
        launcher = LocalTorchrunLauncher(**launcher)
    known = {a.key.to_user_string(): a for a in (occlusion_manifests, token_shards, gpt_checkpoint, visualchat_model)}
    resources = {
        "artifact_store": S3ArtifactStoreResource(**spec["store"]),
        "mlflow": MlflowTrackingResource(**spec["mlflow"]),
        "launcher": launcher,
    }
    executor = dg.multiprocess_executor.configured({"start_method": {"spawn": {}}})
    job = dg.define_asset_job("soak", selection=spec["assets"], executor_def=executor)
    defs = dg.Definitions(assets=[known[name] for name in spec["assets"]], resources=resources, jobs=[job])
    return defs.resolve_job_def("soak")


def run_attempt(spec_file: str) -> int:
    """One attempt of a soak run: a Dagster run of the spec's assets, this process its run worker, the
    steps in processes of their own; recorded in ``$DAGSTER_HOME``'s instance."""
    import dagster as dg

    os.environ[ATTEMPT] = str(Path(spec_file).resolve())
    spec = json.loads(Path(spec_file).read_text())
    with dg.DagsterInstance.get() as instance:
        result = dg.execute_job(
            dg.reconstructable(soak_job), instance, run_config=spec["run_config"], raise_on_error=False
        )
    return 0 if result.success else 1


def step_processes(worker: int) -> list[int]:
    """The step processes the run worker ``worker`` spawned (the multiprocess executor's children)."""
    from vlm_assets.launch.local import alive, process_tree

    found = []
    for pid in process_tree(worker)[1:]:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                found.append(pid)
    return found


def table(rows: list[dict]) -> str:
    lines = [
        "| run | asset | faults (kind@checkpoint step; xN: S3 writes failed; N s: MLflow down) "
        "| retries (relaunches) | resumed from | loss (val / held-out) | s (lost) | ok |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        faults = ", ".join(
            f"{f['kind']}@{f['fired_at']}"
            + (f" {f['size']} s" if f["kind"] == "mlflow-down" else f" x{f['size']}" if f["size"] else "")
            + (f" ({f['note']})" * bool(f["note"]))
            for f in row["faults"]
        )
        loss = f"{row['loss']:.6f}" if row["loss"] is not None else "-"
        ok = "yes" if not row["problems"] else "; ".join(row["problems"])[:300]
        resumed = int(row["resumed_from_step"]) if row["resumed_from_step"] not in (None, -1) else "-"
        seconds = f"{row['seconds']}" + (f" ({row['lost_s']:+})" if "lost_s" in row else "")
        lines.append(
            f"| {row['name']} | {row['asset']} | {faults or '-'} | {row['retries']} ({row['relaunches']}) "
            f"| {resumed} | {loss} | {seconds} | {ok} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--assets",
        nargs="+",
        choices=sorted(TARGETS),
        default=["gpt_checkpoint"],
        help="the assets trained, in turn (run i trains the (i mod len)-th)",
    )
    parser.add_argument("--demo", action="store_true", help="longer runs: the demo profile's GPT size (slower)")
    parser.add_argument("--max-minutes", type=float, default=30, help="start no run after this")
    parser.add_argument("--out", default=None, help="folder for soak.json and the runs (default: a temp dir)")
    parser.add_argument(
        "--faults",
        nargs="+",
        type=parse_fault,
        help="this schedule in every run instead of drawn ones: KIND@STEP[:SIZE] (SIZE: S3 writes failed, MLflow "
        "down seconds)",
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "k8s"),
        default="local",
        help="k8s: pods on the loopback Kubernetes testbed (started here; not beside the k8s tests: its ports are "
        "fixed), and the pod faults (deletion, eviction) among the drawn ones",
    )
    parser.add_argument(
        "--ci",
        action="store_true",
        help="CI's shape: each asset's runs (its reference, then its faulted runs) beside the other assets' "
        "(each asset with S3 and MLflow fault proxies of its own)",
    )
    parser.add_argument("--attempt", help=argparse.SUPPRESS)  # the soak's own: run one attempt (run_attempt)
    args = parser.parse_args(argv)
    if args.attempt:
        return run_attempt(args.attempt)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.launcher != "k8s" and any(f.kind in POD_KINDS for f in args.faults or ()):
        parser.error(f"--faults {', '.join(POD_KINDS)}: pods are the k8s launcher's (--launcher k8s)")
    if args.ci and args.launcher == "k8s":
        parser.error("--ci: the local launcher's (the k8s launcher's pods find S3 through one endpoint)")
    if (status := in_private_mounts(sys.argv[1:] if argv is None else argv)) is not None:
        return status
    args.out = args.out or tempfile.mkdtemp(prefix="vlm-soak-")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLM_ASSETS_PROFILE", "seed")  # run config gives every value: no profile defaults
    soak = Soak(args)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.max_minutes * 60
    targets = [TARGETS[name] for name in dict.fromkeys(args.assets)]
    kinds = KINDS if args.launcher == "k8s" else tuple(k for k in KINDS if k not in POD_KINDS)
    # drawn in run order, before any run: the same schedules whatever runs beside what
    schedules = [draw_schedule(rng, soak.checkpoint_steps(targets[i % len(targets)]), kinds) for i in range(args.runs)]
    if args.faults:
        schedules = [[dataclasses.replace(f) for f in args.faults] for _ in range(args.runs)]
    references, runs = {}, {}

    def reference(target: Target) -> None:
        references[target.asset] = soak.materialize("reference", target, [])

    def run(i: int) -> bool:
        """Run ``i``; False, and nothing run, once --max-minutes has passed."""
        if time.monotonic() > deadline:
            return False
        target = targets[i % len(targets)]
        row = soak.materialize(f"run{i}", target, schedules[i])
        row["lost_s"] = round(row["seconds"] - references[target.asset]["seconds"], 1)
        expected = references[target.asset]["loss"]
        if expected is not None and row["loss"] is not None and abs(row["loss"] - expected) > 1e-5:
            row["problems"].append(f"{target.metric} {row['loss']} != uninterrupted {expected}")
        runs[i] = row
        return True

    def lane(n: int) -> None:
        """The ``n``-th asset's runs, in turn: two runs of one key side by side would end each other's
        MLflow runs (the key's lease holder ends the key's RUNNING ones as orphans)."""
        reference(targets[n])
        for i in range(n, args.runs, len(targets)):
            if not run(i):
                return

    try:
        if args.ci:
            # imported here, once: two threads' first imports of one package can meet it half-initialized
            import dagster  # noqa: F401
            import mlflow  # noqa: F401

            from vlm_assets.defs.platform.storage import S3ArtifactStoreResource  # noqa: F401
            from vlm_assets.launch.local import training_processes  # noqa: F401

            errors = []

            def guarded(n: int) -> None:
                try:
                    lane(n)
                except BaseException as error:
                    errors.append(error)

            lanes = [threading.Thread(target=guarded, args=(n,), daemon=True) for n in range(len(targets))]
            for thread in lanes:
                thread.start()
            for thread in lanes:
                thread.join()
            if errors:
                raise errors[0]
        else:
            for target in targets:  # one uninterrupted run of each
                reference(target)
            for i in range(args.runs):
                if not run(i):
                    break
    finally:
        soak.close()
    unfinished = args.runs - len(runs)
    if unfinished:
        print(f"--max-minutes {args.max_minutes} reached: {len(runs)} of {args.runs} runs done", file=sys.stderr)
    rows = [references[t.asset] for t in targets if t.asset in references] + [runs[i] for i in sorted(runs)]
    (Path(args.out) / "soak.json").write_text(json.dumps({"seed": args.seed, "runs": rows}, indent=1))
    print(table(rows))
    print(f"S3 writes failed by the proxies: {soak.injected}; report: {Path(args.out) / 'soak.json'}")
    return exit_status(rows, unfinished)


if __name__ == "__main__":
    sys.exit(main())
