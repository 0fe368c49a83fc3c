"""scripts/test.sh's two lanes: the `beside` lane holds the waiting modules' tests but no user of the k8s
testbed (whose control plane listens on fixed ports: one process may start it), and the lanes' selections,
as bench/bench_speed.py reads them from pyproject.toml, split the CPU suite between them."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_speed  # noqa: E402

from vlm_assets_tests.conftest import BESIDE  # noqa: E402


def _collected(marks: str) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marks]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_beside_lane_holds_the_waiting_modules_but_not_the_testbeds_users():
    main, beside = bench_speed.lanes(REPO)
    assert main == ["-m", "not gpu and not beside"] and beside == ["-m", "not gpu and beside"]
    ids = _collected(beside[1])
    modules = {i.split("::")[0].removeprefix("vlm_assets_tests/") for i in ids}
    # every module of BESIDE has tests there, and nothing else does
    assert {prefix for prefix in BESIDE if any(m.startswith(prefix) for m in modules)} == set(BESIDE), modules
    assert all(m.startswith(BESIDE) for m in modules), modules
    # run_termination's `dev` fixture is parametrized local / k8s: only the local half runs beside
    termination = [i for i in ids if "test_run_termination.py" in i]
    assert termination and all(i.endswith("[local]") for i in termination), termination
    assert not [i for i in ids if "k8s" in i.split("::")[-1]], ids
