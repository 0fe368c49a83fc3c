"""bench/bench_suite_cpu.py: its pytest plugin times each test and counts the cores it kept busy, and its
summary's floor and idle core-seconds follow from those."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_suite_cpu  # noqa: E402

TESTS = """
import time

def test_sleeps():
    time.sleep(0.5)

def test_spins():
    end = time.process_time() + 1.0
    while time.process_time() < end:
        pass
"""


def test_the_plugin_writes_each_tests_wall_time_and_busy_core_seconds(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "tests.jsonl"
    env = {**os.environ, "BENCH_SUITE_CPU_OUT": str(out), "PYTHONPATH": str(REPO / "bench")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "bench_suite_cpu", "-p", "no:cacheprovider"]
    proc = subprocess.run([*command, "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["test"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_sample.py::test_sleeps", "test_sample.py::test_spins"}
    assert rows["test_sample.py::test_sleeps"]["wall_s"] >= 0.5
    # a second of this process's own CPU time, whatever else the machine did meanwhile
    assert rows["test_sample.py::test_spins"]["busy_core_s"] >= 0.9


def test_the_floor_packs_the_busy_core_seconds_onto_every_core():
    rows = [
        {"test": "a.py::x", "wall_s": 10.0, "busy_core_s": 20.0},  # both cores busy
        {"test": "b.py::y", "wall_s": 6.0, "busy_core_s": 0.0},  # waited on something
        {"test": "b.py::z", "wall_s": 4.0, "busy_core_s": 4.0},  # one core busy
    ]
    s = bench_suite_cpu.summarize(rows, cores=2)
    assert (s["wall_s"], s["busy_core_s"], s["floor_s"], s["idle_core_s"]) == (20.0, 24.0, 12.0, 16.0)
    assert s["busy_cores"] == pytest.approx(1.2)
    assert list(s["modules"]) == ["a.py", "b.py"]
    assert s["modules"]["b.py"] == {"tests": 2, "wall_s": 10.0, "busy_core_s": 4.0, "idle_core_s": 16.0}
    with pytest.raises(ValueError, match="no test ran"):
        bench_suite_cpu.summarize([], cores=2)
