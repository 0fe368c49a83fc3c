"""bench/bench_suite_cpu.py: its pytest plugin times each test and counts the cores it kept busy, its
summary's floor and idle core-seconds follow from those, and every Python process of the run logs its own
CPU time under the test that started it."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_suite_cpu  # noqa: E402

TESTS = """
import multiprocessing
import subprocess
import sys
import time

def test_sleeps():
    time.sleep(0.5)

def test_spins():
    end = time.process_time() + 1.0
    while time.process_time() < end:
        pass

def test_starts_a_trainer_like_child():
    spin = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin, "vlm_assets.train.gpt_pretrain", "--config"], check=True)

def spin_a_little():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass

def test_spawns_a_child():  # as a code server starts a run worker
    child = multiprocessing.get_context("spawn").Process(target=spin_a_little)
    child.start()
    child.join()
    assert child.exitcode == 0
"""


def test_the_plugin_writes_each_tests_wall_time_and_busy_core_seconds_and_each_process_its_cpu(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    proc, rows, processes, run_busy = bench_suite_cpu.run_suite(tmp_path, {}, ["test_sample.py"], [str(REPO / "bench")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["test"]: r for r in rows}
    assert set(rows) == {
        f"test_sample.py::{t}"
        for t in ("test_sleeps", "test_spins", "test_starts_a_trainer_like_child", "test_spawns_a_child")
    }
    assert rows["test_sample.py::test_sleeps"]["wall_s"] >= 0.5
    # a second of this process's own CPU time, whatever else the machine did meanwhile
    assert rows["test_sample.py::test_spins"]["busy_core_s"] >= 0.9

    # the child logged its own half second under the test that started it; pytest its own second and more
    (runner,) = [p for p in processes if not p["test"]]
    assert runner["cpu_s"] >= 1.0 and "multiprocessing_child" not in runner  # test_spins ran in it
    (child,) = [p for p in processes if p["test"] == "test_sample.py::test_starts_a_trainer_like_child"]
    assert 0.5 <= child["cpu_s"] < 1.0
    # multiprocessing gave the spawned child pytest's arguments: the log says it is a child
    (spawned,) = [p for p in processes if p.get("multiprocessing_child")]
    assert spawned["test"] == "test_sample.py::test_spawns_a_child" and spawned["argv"] == runner["argv"]
    assert 0.3 <= spawned["cpu_s"] < 3.0  # its spin, and its start-up: the test module imported again
    kinds = {k["kind"]: k for k in bench_suite_cpu.by_kind(processes)}
    assert set(kinds) - {"python -c"} == {  # (multiprocessing's resource tracker, when it logged before the end)
        "trainer gpt_pretrain",
        "pytest (the tests' own process)",
        "pytest (the tests' own process): a multiprocessing child",
    }
    assert kinds["trainer gpt_pretrain"]["processes"] == 1
    # the run's busy time spans every process's whole life (pytest's collection and start-up included)
    assert run_busy >= sum(p["cpu_s"] for p in processes) - 0.1
    assert run_busy > sum(r["busy_core_s"] for r in rows.values())


def test_two_selections_run_at_once_each_in_its_own_pytest_and_the_report_compares_them_with_in_turn(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    selections = [["test_sample.py::test_sleeps"], ["test_sample.py::test_spins"]]
    lanes, busy = bench_suite_cpu.run_at_once(tmp_path, {}, selections, [str(REPO / "bench")])
    assert [lane.run.proc.returncode for lane in lanes] == [0, 0], [lane.run.proc.stdout[-2000:] for lane in lanes]
    assert [[r["test"] for r in lane.run.tests] for lane in lanes] == [
        [f"test_sample.py::{t}"] for t in ("test_sleeps", "test_spins")
    ]
    # each lane's wall spans its pytest's start-up and its test; the spin's second of CPU is in the busy time
    assert all(lane.wall_s > lane.run.tests[0]["wall_s"] for lane in lanes) and lanes[0].wall_s >= 0.5
    assert busy >= 1.0 and all(lane.run.busy_core_s == busy for lane in lanes)
    # the report, from known figures: alone 4 s and 6 s (3 and 5 busy core-s), at once 5 s and 9 s (12)
    timed = [lane._replace(wall_s=wall) for lane, wall in zip(lanes, (5.0, 9.0))]
    report = bench_suite_cpu.at_once_markdown(selections, [(4.0, 3.0), (6.0, 5.0)], timed, 12.0)
    assert "| 1 | `test_sample.py::test_sleeps` | 4 | 5 | 1.25 |" in report
    assert "| wall (s): the sum alone, the longest at once | 10 | 9 | 0.90 |" in report
    assert "| busy core-seconds | 8 | 12 | 1.50 |" in report


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


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/v/lib/python3.11/site-packages/torch/distributed/run.py", "--nnodes=2"], "torchrun agent"),
        (["/v/bin/torchrun", "--nnodes=2", "-m", "vlm_assets.train.gpt_pretrain"], "torchrun agent"),
        (["/w/vlm_assets/launch/lifeline.py", "--agent", "--nnodes=2", "--nproc-per-node=1"], "torchrun agent"),
        (["vlm_assets.train.visualchat_train", "--config", "run.json"], "trainer visualchat_train"),
        (["/v/site-packages/dagster/__main__.py", "api", "execute_run", "{}"], "dagster api execute_run"),
        (["/v/bin/dagster", "dev", "-w", "workspace.yaml"], "dagster dev"),
        (["/v/bin/dagster-daemon", "run"], "dagster-daemon"),
        (["/v/site-packages/dagster/_daemon/__main__.py", "run"], "dagster-daemon"),
        (["/v/bin/dg", "launch", "--job", "main_job"], "dg launch"),
        (["/v/bin/mlflow", "server"], "server mlflow"),
        (["/w/bench/soak.py", "--runs", "2"], "script soak.py"),
        (["/v/site-packages/pip/__main__.py", "install"], "python -m pip"),
        (["-c"], "python -c"),
        (["/opt/tool"], "python tool"),
    ],
)
def test_a_process_kind_is_named_from_its_arguments(argv, expected):
    assert bench_suite_cpu.kind(argv) == expected


def test_the_kinds_table_leaves_the_unlogged_busy_time_on_a_row_of_its_own():
    kinds = bench_suite_cpu.by_kind(
        [
            {"argv": ["vlm_assets.train.gpt_pretrain"], "cpu_s": 9.0},
            {"argv": ["vlm_assets.train.gpt_pretrain"], "cpu_s": 11.0},
            {"argv": ["-c"], "cpu_s": 5.0},
        ]
    )
    assert [(k["kind"], k["processes"], k["cpu_s"], k["mean_cpu_s"]) for k in kinds] == [
        ("trainer gpt_pretrain", 2, 20.0, 10.0),
        ("python -c", 1, 5.0, 5.0),
    ]
    table = bench_suite_cpu.kinds_markdown(kinds, busy_core_s=50.0)
    assert "| trainer gpt_pretrain | 2 | 20 | 10.0 | 40% |" in table
    assert table[-1].startswith("| not logged") and table[-1].endswith("| 25 | - | 50% |")
