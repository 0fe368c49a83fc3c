"""Dagster's default run launcher with a run-worker health check, so that `run_monitoring`
(dagster.yaml) marks failed a run whose process was killed outright.

A SIGKILLed run worker (the OOM killer, a lost session, `kill -9`) runs no code: its run stays
STARTED and keeps its `vlm_training` pool slot. Dagster's run monitoring (in the daemon: `dagster
dev`, `dagster-daemon run`) asks the run launcher whether each STARTED run's worker is alive, but
``DefaultRunLauncher`` answers nothing (``supports_check_run_worker_health`` is False). This one
answers from the run's own event log: every Dagster event records the pid of the process that
emitted it, and the process that emitted ``RUN_START`` is the run's worker (``dagster api
execute_run`` under the webserver or daemon, or the `dagster job execute` process itself). It is
dead when no process with that pid is alive on this host, or the pid was reused by a process
started after the run. Only runs this launcher started through a code server on this host are
judged (the tag Dagster's launcher records names the server): a pid means nothing on another host.
The Kubernetes deployment's ``K8sRunLauncher`` has its own health check.

Runs started without a launcher (`dagster job execute`, no daemon) are marked failed by the next
code-location load instead, through their leases: ``vlm_assets.defs.platform.reaper``.
"""

import json
import socket
import time

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG

from vlm_assets.launch.local import started_at

_START_SLACK_S = 5.0  # the event is written after its process started; clocks round


def run_worker(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, timestamp) of the process that started the run, from its ``RUN_START`` event."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.RUN_START, limit=1).records
    if not records or records[0].event_log_entry.dagster_event is None:
        return None
    entry = records[0].event_log_entry
    pid = entry.dagster_event.pid
    return (pid, entry.timestamp) if pid is not None else None


def launched_on_this_host(run: dg.DagsterRun) -> bool:
    """Return whether the run's worker was started by a code server on this host.

    That is a local socket, or a loopback or own host name, in the gRPC info tag ``DefaultRunLauncher`` records.
    """
    info = json.loads(run.tags.get(GRPC_INFO_TAG) or "{}")
    if not info:
        return False
    return "socket" in info or info.get("host") in {
        "localhost",
        "127.0.0.1",
        "::1",
        socket.gethostname(),
        socket.getfqdn(),
    }


def worker_health(instance: dg.DagsterInstance, run: dg.DagsterRun) -> CheckRunHealthResult:
    """Judge whether the run's worker process is still alive; a worker not launched here is reported running.

    A recorded pid that is gone, or reused by a process started later, means the worker was killed.
    """
    if not launched_on_this_host(run):  # nothing to judge from here: not reported as a failure
        return CheckRunHealthResult(WorkerStatus.RUNNING, "not launched on this host; not checked")
    worker = run_worker(instance, run.run_id)
    if worker is None:  # not started yet, or an event without a pid: nothing to judge
        return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker recorded yet")
    pid, started = worker
    began = started_at(pid)
    if began is not None and began <= started + _START_SLACK_S:
        return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is alive")
    reason = "is gone" if began is None else f"was reused by a process started at {time.ctime(began)}"
    return CheckRunHealthResult(
        WorkerStatus.FAILED,
        f"run worker pid {pid} on {socket.gethostname()} (started the run at {time.ctime(started)}) {reason}: "
        "it was killed without ending the run",
        run_worker_id=str(pid),
    )


class LocalRunLauncher(DefaultRunLauncher):
    """``DefaultRunLauncher`` plus ``check_run_worker_health`` (see the module docstring)."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        """Whether this launcher checks run worker health: always."""
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        """Judge the run's worker process with ``worker_health``."""
        return worker_health(self._instance, run)
