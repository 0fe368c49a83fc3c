"""A full disk said as such (no dagster imports).

A write that runs out of space fails in ways that do not say so: Python's own writes raise ``OSError``
errno 28 without the path, and ``torch.save`` onto a path (DeepSpeed's checkpoints) raises
``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...``, with no errno at all
(nor does ``shutil.copytree``'s ``Error``).
``space_checked`` turns either into a ``DiskFullError`` that names what was being written, where, and
the file system's free and total space; the retry rule reads it as ``disk_full``
(``vlm_assets.launch.retry``). ``staged_write`` adds removing a staging directory whose write failed;
``private_download`` fetches a file that other processes may be fetching into the same place.
"""

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
# torch's writer keeps no errno: its error counts as a full disk when the file system has less than
# this left right after it (the failed write's partial file is still there, holding what was free).
NEARLY_FULL_BYTES = 1 << 20


class DiskFullError(OSError):
    """A write ran out of space (or quota) on a local file system."""


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    path = _existing(path)
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_and_total_bytes(path: Path) -> tuple[int, int]:
    """Bytes this process may still write on ``path``'s file system, and its size."""
    stat = os.statvfs(_existing(path))
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def out_of_space(err: BaseException, path: Path) -> bool:
    """Return whether ``err``, raised writing under ``path``, means the file system is full."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno in OUT_OF_SPACE
    # torch's RuntimeError, or shutil.copytree's Error (an OSError that collects its files' errors)
    return isinstance(err, (OSError, RuntimeError)) and free_and_total_bytes(path)[0] < NEARLY_FULL_BYTES


@contextlib.contextmanager
def space_checked(path: Path, what: str) -> Iterator[None]:
    """Run a write of ``what`` under ``path``; raise ``DiskFullError`` if it runs out of space.

    The error names ``what``, ``path`` and the file system; any other error passes through unchanged.
    """
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, RuntimeError) as err:
        if not out_of_space(err, Path(path)):
            raise
        free, total = free_and_total_bytes(Path(path))
        quota = isinstance(err, OSError) and err.errno == errno.EDQUOT
        raise DiskFullError(
            errno.EDQUOT if quota else errno.ENOSPC,
            f"{'disk quota exceeded' if quota else 'no space left on device'} writing {what} to {path}: "
            f"{_mib(free)} free of {_mib(total)} on the file system mounted at {_mount_point(Path(path))} "
            f"({type(err).__name__}: {str(err).strip()[:200]})",
        ) from err


@contextlib.contextmanager
def staged_write(directory: Path, what: str) -> Iterator[None]:
    """Run a write of ``what`` into the staging directory ``directory``; remove the directory if it fails.

    Nothing partial stays behind, and a full disk says so (``space_checked``).
    """
    try:
        with space_checked(directory, what):
            yield
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


@contextlib.contextmanager
def private_download(target: Path) -> Iterator[Path]:
    """Yield a fresh path of this process's own beside ``target``; when the block ends, move it onto ``target``.

    Processes that share a directory (the local launcher's nodes) may fetch one file at once: each
    writes in a directory of its own, and a reader sees the whole file or none. boto3 cannot be left to
    it: it names its temporary file from the global ``random`` module, which every rank seeds alike, so
    ranks sharing a directory would write one temporary file and all but one rename would fail. The
    yielded path does not exist (downloaders such as mosaicml-streaming's skip a path that does). A
    failed download leaves nothing; a block that wrote nothing raises ``FileNotFoundError`` naming it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        yield private / target.name
        if not (private / target.name).exists():
            raise FileNotFoundError(f"downloading {target} wrote nothing")
        os.replace(private / target.name, target)
    finally:
        shutil.rmtree(private, ignore_errors=True)
