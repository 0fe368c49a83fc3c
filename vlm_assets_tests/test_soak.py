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
