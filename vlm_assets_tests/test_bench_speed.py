"""bench/bench_speed.py's report: old against new per kernel set, the median of repeated main_job runs, a
baseline suite that crashed before its first test still reported beside the new one, with its failures, and
the suites alone."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_speed  # noqa: E402


def _main_job(seconds: list[float], gpt: float, gain: float) -> dict:
    run = {"seconds": seconds[0], "steps": {"gpt_checkpoint": gpt}, "gain_ci95_low": gain, "vqa_ci95_low": 0.5}
    return {"main_job": run, "main_job_seconds": seconds}


def test_the_report_gives_medians_ratios_and_a_crashed_baseline_suite_its_own_lines():
    old = _main_job([500.0, 540.0, 520.0], gpt=80.0, gain=0.074)
    new = _main_job([260.0, 250.0, 280.0], gpt=60.0, gain=0.117)
    # the baseline's pytest died at collection: no test rows, no process lines, no busy figures
    old["suite"] = {"seconds": 12.0, "summary": "1 error in 11.00s", "busy_core_s": None, "floor_s": None}
    old["suite"] |= {"tests": [], "processes": [], "failures": ["ERROR a.py - ImportError"]}
    tests = [{"test": "a.py::t", "wall_s": 900.0, "busy_core_s": 1500.0}]
    processes = [{"kind": "trainer gpt_pretrain", "processes": 4, "cpu_s": 600.0, "mean_cpu_s": 150.0}]
    new["suite"] = {"seconds": 1000.0, "summary": "1 passed in 990.00s", "busy_core_s": 2000.0, "floor_s": 1000.0}
    new["suite"] |= {"tests": tests, "processes": processes}

    text = bench_speed.report({"avx2": {"baseline abc": old, "this checkout": new}}, {"avx2": "AVX2"})
    lines = text.splitlines()
    assert "| main_job, first run (s) | 520.0 | 260.0 | 0.50 |" in lines
    assert "Each pair's new / old: 0.52 0.46 0.54" in text
    assert "|   gpt_checkpoint (s) | 80.0 | 60.0 | 0.75 |" in lines
    assert "| test suite (s) | 12.0 | 1000.0 | 83.33 |" in lines
    assert "|   busy core-seconds | 0.0 | 2000.0 | - |" in lines  # no ratio against a figure that does not exist
    assert "| gain's 95 % lower bound | +7.4 pts | +11.7 pts | |" in lines
    # the new suite's kinds, each a share of the machine's busy time over the run, the time between tests included
    assert "| trainer gpt_pretrain | 4 | 600 | 150.0 | 30% |" in lines
    assert lines.count("baseline abc:") == 0 and lines.count("this checkout:") == 1
    # the failed suite's -rfE lines are listed; the passing one gets no such list
    assert "baseline abc's failed tests:" in lines and "- `ERROR a.py - ImportError`" in lines
    assert "this checkout's failed tests:" not in lines


def test_a_suites_only_report_has_no_main_job_rows_or_gates():
    def suite(seconds: float) -> dict:
        return {
            "seconds": seconds,
            "summary": "1 passed",
            "busy_core_s": 2 * seconds,
            "floor_s": seconds,
            "tests": [{"test": "a.py::t", "wall_s": seconds, "busy_core_s": 2 * seconds}],
            "processes": [],
        }

    old, new = {"main_job_seconds": [], "suite": suite(2000.0)}, {"main_job_seconds": [], "suite": suite(1000.0)}
    text = bench_speed.report({"avx2": {"baseline abc": old, "this checkout": new}}, {"avx2": "AVX2"})
    lines = text.splitlines()
    assert "| test suite (s) | 2000.0 | 1000.0 | 0.50 |" in lines
    assert "main_job" not in text and "lower bound" not in text
