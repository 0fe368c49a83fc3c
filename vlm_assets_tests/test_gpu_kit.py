"""The GPU kit's CPU side (scripts/gpu-check.sh, scripts/gpu_kit.py): its plan keeps the device tool's
limits, an oversized carry or budget is refused naming it, what it runs on the GPU machine imports no
Dagster or MLflow (they are not carried), and a skipped test fails a run that asks for it."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_assets_tests.waiting import BOUND_S

REPO = Path(__file__).resolve().parents[1]


def gpu_kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", REPO / "scripts" / "gpu_kit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_plan_runs_without_a_gpu_and_keeps_the_device_limits():
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check.sh"), "--plan", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["problems"] == []
    assert [c["call"] for c in plan["calls"]] == [1, 2, 3]
    assert all(c["budget_s"] <= 540 for c in plan["calls"]) and plan["total_budget_s"] <= 1200
    parts = [p for c in plan["calls"] for p in c["parts"]]
    assert [p["name"] for p in parts] == ["tests", "bench_gpt", "bench_adapter", "bench_visualchat"]
    for part in parts:  # every file a part names exists
        for arg in part["command"]:
            if arg.endswith(".py"):
                assert (REPO / arg).is_file(), arg
    assert "deepspeed" in plan["carry"]["sdists"] and "dagster-pipes" in plan["carry"]["wheels"]
    assert plan["carry"]["tree_bytes"] < 8 * 2**20  # the working tree leaves the carry its room


def test_an_oversized_carry_or_budget_is_refused_naming_it(tmp_path):
    kit = gpu_kit()
    (tmp_path / "wheels").mkdir()
    with open(tmp_path / "wheels" / "big.whl", "wb") as f:
        f.truncate(65 * 2**20)  # sparse: 65 MiB on paper
    problems = kit.plan(tmp_path)["problems"]
    assert len(problems) == 1 and "over the 64 MiB a call carries" in problems[0], problems
    slow = [kit.Part("tests", 1, 500, ("@pytest",), ""), kit.Part("bench", 2, 300, ("b.py",), "")]
    assert kit.check_plan(slow) == ["device call 1: 560 s of budgets, over the 540 s a call may take"]
    many = [kit.Part(f"p{i}", i, 400, ("b.py",), "") for i in range(1, 4)]
    assert kit.check_plan(many) == ["the kit's budgets add up to 1380 s, over 1200 s of device time"]


def test_what_the_kit_runs_imports_no_dagster_or_mlflow():
    """Dagster and MLflow are not carried: the engine-level gpu tests and the benches must not need them."""
    code = """
import sys, importlib.util
for name in ("dagster", "mlflow", "kubernetes", "boto3"):
    sys.modules[name] = None  # an import of any of them fails here
sys.path.insert(0, "bench")
import vlm_assets_tests.gpu.test_gpu_visualchat, vlm_assets_tests.gpu.test_gpu_compile
import vlm_assets_tests.train.test_visualchat_train
import bench_gpt, bench_adapter, bench_visualchat
import vlm_assets.train.visualchat_train, vlm_assets.train.adapter_train, vlm_assets.launch.local
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_part_past_its_budget_is_stopped_with_its_children(tmp_path):
    kit = gpu_kit()
    code = "import subprocess, time; print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)"
    started = time.monotonic()
    assert kit.run_part(kit.Part("hangs", 1, 2, ("-c", code), ""), tmp_path) == 124
    assert time.monotonic() - started < 30
    child = int((tmp_path / "hangs.txt").read_text().split()[0])

    def gone() -> bool:  # exited (a zombie until init reaps it), or reaped
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + BOUND_S
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the part's child {child} outlived it"


@pytest.mark.parametrize("fail_on_skip, expected", [("1", 1), ("", 0)])
def test_a_skip_fails_the_run_when_asked(tmp_path, fail_on_skip, expected):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('no deepspeed')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "vlm_assets_tests.conftest", "-p", "no:cacheprovider"]
        + ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_skips.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "VLM_TESTS_FAIL_ON_SKIP": fail_on_skip},
    )
    assert proc.returncode == expected, proc.stdout[-2000:]
    assert ("1 test(s) skipped, which fails this run" in proc.stdout) == (expected == 1)
