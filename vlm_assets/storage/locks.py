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
    fd = _open_lockable(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_lockable(path: Path) -> int:
    """A descriptor of ``path`` to lock: read-write where allowed (NFS takes an ``flock`` as a write lock),
    read-only on another user's file; created readable by all, so every user's processes lock it."""
    try:  # without O_CREAT first: fs.protected_regular refuses it on another user's file in /dev/shm
        return os.open(path, os.O_RDWR)
    except PermissionError:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:  # another user created it meanwhile
        return os.open(path, os.O_RDONLY)
    with contextlib.suppress(PermissionError):
        os.fchmod(fd, 0o644)  # readable by all whatever the umask
    return fd
