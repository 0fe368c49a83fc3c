"""Scratch that outlives no one (``vlm_assets.storage.scratch``): a process SIGKILLed while it holds a
scratch directory runs no cleanup of its own, and the next directory made beside it removes it; a
live holder's directory is never touched. Found by bench/soak.py's step kills, which left each killed
step's launch folder in ``runs/`` (and its commit's staging directory) for good."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from vlm_assets.storage.scratch import held_dir, sweep
from vlm_assets_tests.waiting import BOUND_S

HOLD = """
import sys, time
from vlm_assets.storage.scratch import held_dir
with held_dir(sys.argv[1], prefix="step-") as d:
    (d / "checkpoint.part").write_bytes(b"x" * 1000)
    print(d, flush=True)
    time.sleep(600)
"""


def hold(parent: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(parent)], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_holders_directory_is_removed_by_the_next_one_and_a_live_ones_is_kept(tmp_path):
    killed, killed_dir = hold(tmp_path)
    alive, alive_dir = hold(tmp_path)
    try:
        assert killed_dir.is_dir() and alive_dir.is_dir()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (killed_dir / "checkpoint.part").is_file()  # nothing of the killed process cleaned up
        with held_dir(tmp_path, prefix="next-") as mine:
            assert not killed_dir.exists() and not Path(f"{killed_dir}.held").exists()
            assert (alive_dir / "checkpoint.part").is_file()  # its holder lives
            assert sweep(tmp_path) == []  # neither the live one's nor this one's
        assert not mine.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [alive_dir.name, f"{alive_dir.name}.held"]
        )
    finally:
        alive.kill()
        alive.wait()
    deadline = time.monotonic() + BOUND_S
    while Path(f"{alive_dir}.held").exists() and not sweep(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []


def test_a_published_staging_directory_holds_no_lock_file(tmp_path):
    """The lock sits beside the directory: renaming the directory whole (a local store's commit) takes
    only its own files."""
    with held_dir(tmp_path / "staging") as staging:
        (staging / "weights.bin").write_bytes(b"w")
        published = tmp_path / "published"
        staging.rename(published)
        assert sorted(p.name for p in published.iterdir()) == ["weights.bin"]
    assert list((tmp_path / "staging").iterdir()) == []
