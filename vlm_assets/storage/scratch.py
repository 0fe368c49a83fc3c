"""Scratch directories that outlive no one (no dagster imports).

A step process that is SIGKILLed (an OOM kill, a drained node, a lost session) runs no ``finally:``,
so the scratch it made (a launch's run folder, a commit's staging directory, a download) would stay
on disk for good; ``bench/soak.py``'s step kills found exactly that. Each directory made here is
held by its maker through an ``flock`` on a lock file beside it (``<dir>.held``), which the kernel
drops when that process dies, however it dies; the next directory made in the same parent first
removes those whose lock nobody holds. ``tempfile.TemporaryDirectory`` cleans up only when its own
code runs, so it cannot do this. The lock sits beside the directory, not in it, because a staging
directory is published by renaming it whole.
"""

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SUFFIX = ".held"


def sweep(parent: Path) -> list[Path]:
    """Remove the directories in ``parent`` made by ``held_dir`` whose maker is gone; those removed."""
    removed = []
    for lock in sorted(parent.glob(f"*{SUFFIX}")):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:  # its maker finished meanwhile, or it is another user's
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its maker is alive
                continue
            directory = lock.with_name(lock.name[: -len(SUFFIX)])
            shutil.rmtree(directory, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def held_dir(parent: Path | str | None = None, prefix: str | None = None) -> Iterator[Path]:
    """Yield a new directory in ``parent`` (the system's temp folder by default), removed on exit whatever happens.

    The next ``held_dir`` of the same parent removes it if this process dies before that. The directories of dead
    makers in ``parent`` are removed first.
    """
    parent = Path(parent or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent)
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    lock = directory.with_name(directory.name + SUFFIX)
    # Locked before it gets the name a sweeper looks for, so no sweeper can take it for a dead one's.
    pending = directory.with_name(directory.name + ".pending")
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)  # not inherited by children
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(pending, lock)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        pending.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        os.close(fd)
