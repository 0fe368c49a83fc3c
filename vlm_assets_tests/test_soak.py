"""CI's short seeded soak (bench/soak.py): one uninterrupted reference run of gpt_checkpoint and one
run whose schedule (seed 349) makes the S3 server fail 7 checkpoint writes in a row (past boto3's own
retries: the retry rule's `unreachable`; how many attempts the outage spans depends on how the
client's parallel part uploads meet it) and then fills the run's scratch disk (a tmpfs) until the
attempt whose next checkpoint write fails has ended (`disk_full`). When that is more than the
RetryPolicy's 2 retries, the run fails and the soak's relaunch of the key must resume it.
The soak exits non-zero on any broken invariant; here its report must also show the faults fired."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_seeded_soak_loses_nothing(tmp_path, offline_data):
    command = [sys.executable, str(REPO / "bench" / "soak.py"), "--runs", "1", "--seed", "349", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "VLM_ASSETS_HOME"))}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "soak.json").read_text())["runs"]
    reference, faulted = runs
    assert not reference["faults"] and reference["retries"] == 0
    assert [(f["kind"], f["size"]) for f in faulted["faults"]] == [("s3-500", 7), ("disk-full", 0)]
    assert all(f["fired_at"] is not None and not f["note"] for f in faulted["faults"]), faulted
    assert faulted["retries"] >= 2 and faulted["relaunches"] in (0, 1), faulted
    # each failed attempt read by the retry rule: the outage, then the full disk (last, or before a relaunch)
    assert faulted["causes"][0] == "unreachable" and "disk_full" in faulted["causes"], faulted["causes"]
    assert set(faulted["causes"]) == {"unreachable", "disk_full"}, faulted["causes"]
    assert faulted["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert faulted["resumed_from_step"] >= 18 and faulted["key"] == reference["key"]
    row = r"\| run0 \| s3-500@12 x7, disk-full@18 \| [23] \([01]\) \| (18|24) \| [\d.]+ \| [\d.]+ \| yes \|"
    assert re.search(row, proc.stdout), proc.stdout


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", REPO / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lost_work_is_judged_by_the_faults_that_ended_an_attempt():
    """The soak's own check, on the run that found it wrong (seed 226, run 2): an agent killed after
    step 6, then MLflow down for 39 s after step 18, which the client's retries rode out. The one retry
    rightly resumed from step 6; an outage counts only when the retry rule read one."""
    soak = _soak_module()
    agent, mlflow_down = soak.Fault("agent", 6, fired_at=6), soak.Fault("mlflow-down", 18, 39, fired_at=18)
    assert soak.work_lost([agent, mlflow_down], ["killed"], 1, 6.0) == []
    # the same outage past the client's retries: its attempt failed, so the resume must be from >= 18
    assert soak.work_lost([agent, mlflow_down], ["killed", "unreachable"], 2, 6.0) == [
        "resumed from step 6.0, but step 18 was committed before the last fault"
    ]
    worker = soak.Fault("worker", 12, fired_at=12)
    assert soak.work_lost([worker], ["killed"], 1, 6.0) == [
        "resumed from step 6.0, but step 12 was committed before the last fault"
    ]
    assert soak.work_lost([worker], [], 0, None) == ["1 kill(s) but 0 retries"]
    assert soak.work_lost([soak.Fault("disk-full", 12, fired_at=12)], ["disk_full"], 1, 12.0) == []
