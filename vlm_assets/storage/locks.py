"""Exclusive advisory locks between the processes of one host, on a file every user can lock."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block.

    The kernel releases it when the descriptor closes, so a killed holder frees it at once.
    """
    fd = _open_readable(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_readable(path: Path) -> int:
    """A read-only descriptor of ``path``, created readable by all: every user's processes lock it."""
    try:  # without O_CREAT first: fs.protected_regular refuses it on another user's file in /dev/shm
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        with contextlib.suppress(PermissionError):  # created meanwhile by another user
            os.fchmod(fd, 0o644)  # readable by all whatever the umask
        return fd
