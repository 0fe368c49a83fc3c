"""Run monitoring with ``LocalRunLauncher``: a real run whose worker process is SIGKILLed is seen dead
by the launcher's health check, and Dagster's own run-monitoring step marks it failed with the reason."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._daemon.monitoring.run_monitoring import monitor_started_run

from vlm_assets.defs.platform.run_launcher import LocalRunLauncher
from vlm_assets_tests.waiting import BOUND_S

REPO = Path(__file__).resolve().parents[2]
WORKER = textwrap.dedent("""
    import time
    import dagster as dg

    @dg.op
    def train_forever():
        time.sleep(3600)

    @dg.job
    def hangs():
        train_forever()

    with dg.DagsterInstance.get() as instance:
        hangs.execute_in_process(instance=instance)
""")


def test_run_monitoring_fails_a_run_whose_worker_was_killed(tmp_path):
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env={**os.environ, "DAGSTER_HOME": str(home)})
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert isinstance(instance.run_launcher, LocalRunLauncher) and instance.run_monitoring_enabled
            deadline = time.monotonic() + BOUND_S
            while not (runs := instance.get_runs()) or runs[0].status != dg.DagsterRunStatus.STARTED:
                assert time.monotonic() < deadline and worker.poll() is None, "the run never started"
                time.sleep(0.2)
            run = runs[0]
            # Not launched through a code server here: nothing to judge, never reported as a failure.
            health = instance.run_launcher.check_run_worker_health(run)
            assert health.status.value == "RUNNING" and "not checked" in health.msg
            # As DefaultRunLauncher records it when a local code server starts the worker.
            instance.add_run_tags(run.run_id, {GRPC_INFO_TAG: json.dumps({"host": "localhost", "port": 4266})})
            run = instance.get_run_by_id(run.run_id)
            health = instance.run_launcher.check_run_worker_health(run)
            assert health.status.value == "RUNNING" and f"pid {worker.pid} is alive" in health.msg

            worker.send_signal(signal.SIGKILL)
            worker.wait()
            health = instance.run_launcher.check_run_worker_health(run)
            assert health.status.value == "FAILED" and f"run worker pid {worker.pid}" in health.msg
            # Dagster's run-monitoring step (what the daemon runs every poll_interval_seconds).
            monitor_started_run(instance, None, instance.get_run_record_by_id(run.run_id), logging.getLogger("test"))
            run = instance.get_run_by_id(run.run_id)
            assert run.status == dg.DagsterRunStatus.FAILURE
            failure = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
            assert "killed without ending the run" in failure[0].event_log_entry.dagster_event.message
    finally:
        if worker.poll() is None:
            worker.kill()
