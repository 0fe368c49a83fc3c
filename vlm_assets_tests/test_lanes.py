"""scripts/test.sh's two lanes: the `beside` lane holds the waiting modules and every user of the k8s
testbed (whose control plane listens on fixed ports: one process may start it), last; the main lane none
of them. bench/bench_speed.py reads the lanes' selections from pyproject.toml."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import bench_speed  # noqa: E402

from vlm_assets_tests.conftest import BESIDE  # noqa: E402

# One interpreter collects every selection: the second collection finds the test modules imported.
_COLLECT = """
import json, sys, pytest
class Ids:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]
lanes = []
for marks in sys.argv[1:]:
    ids = Ids()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", marks], plugins=[ids])
    if code != 0:
        sys.exit(f"collecting -m {marks!r} exited {code}")
    lanes.append(ids.ids)
print(json.dumps(lanes))
"""


def _collected(*marks: str) -> list[list[str]]:
    """Each selection's test ids, in the order its lane runs them."""
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT, *marks], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_beside_lane_holds_the_waiting_modules_and_the_testbeds_users_last():
    main, beside = bench_speed.lanes(REPO)
    assert main == ["-m", "not gpu and not beside"] and beside == ["-m", "not gpu and beside"]
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert all(f'-m "{lane[1]}"' in test_sh for lane in (main, beside)), "scripts/test.sh runs other lanes"
    ids, in_main = _collected(beside[1], main[1])
    modules = list(dict.fromkeys(i.split("::")[0].removeprefix("vlm_assets_tests/") for i in ids))
    testbed = ["defs/test_gpt_assets.py", "defs/test_run_termination.py", "k8s/test_k8s_launcher.py"]
    assert set(modules) == {m for m in modules if m.startswith(BESIDE)} | set(testbed), modules
    assert all(any(m.startswith(prefix) for m in modules) for prefix in BESIDE), modules
    assert sorted(modules[-len(testbed) :]) == testbed, modules  # the testbed's users last
    assert [i for i in ids if i.endswith("[k8s]")], ids  # run_termination's k8s half came with its module
    assert in_main and not [i for i in in_main if i.split("::")[0].removeprefix("vlm_assets_tests/") in testbed]
    assert not [i for i in in_main if i.endswith("[k8s]")], in_main
