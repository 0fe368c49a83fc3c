"""Processes that die with their parent, by the kernel's guarantee (Linux ``PR_SET_PDEATHSIG``).

The launcher starts each torchrun agent through this module, and each agent starts each worker
through it too::

    python -m vlm_assets.launch.lifeline --exec  -m torch.distributed.run ... \\
        -m vlm_assets.launch.lifeline --module <entry point> ...

so the chain is: the Dagster step process -> agent -> worker, each link holding a parent-death
signal (SIGKILL). However the step's process ends (SIGKILL from an OOM killer, a lost session, a
node drain; no Python ``finally:`` runs then), the kernel kills the agents at once, and their death
kills the workers. A worker killed mid-commit leaves nothing visible: store commits are atomic
(``vlm_assets.storage``). The launcher's own cleanup (``stop_process_trees``) still handles the
ordinary endings (failure, timeout, SIGTERM/SIGINT, a run terminated from the UI).

A ``--module`` process skips the interpreter's last garbage collections at its exit (``gc.freeze``);
its exit handlers run as usual.

The signal follows the *thread* that forked the child: the launcher starts agents from the step's
thread, which waits on them until they end, and torchrun starts workers from its main thread.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1
PARENT_ENV = "VLM_ASSETS_LIFELINE_PARENT"


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends.

    If the parent is gone already (it died before this call), end now. Does nothing off Linux.
    """
    if not sys.platform.startswith("linux"):
        return  # prctl is Linux-only; elsewhere the launcher's cleanup is all there is
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent or parent == 1:  # re-parented to init: the parent died before prctl
        os.kill(os.getpid(), sig)


def freeze_at_exit() -> None:
    """Freeze this process's objects out of its last garbage collections, once later exit handlers have run.

    A process holding torch, Lightning and transformers spends 1-3 s of a core in those collections, for
    memory the exit frees anyway and for the finalizers of objects left in reference cycles, which nothing
    this project runs relies on; Python has no switch to skip them, and frozen objects are left out.
    """
    atexit.register(gc.freeze)


def wrap_agent(torchrun_args: list[str]) -> list[str]:
    """The command that runs ``python -m torch.distributed.run <torchrun_args>`` as a lifeline'd agent."""
    return [sys.executable, "-m", __name__, "--exec", "-m", "torch.distributed.run", *torchrun_args]


def worker_entry(module: str) -> list[str]:
    """torchrun's ``-m <module>`` replaced by a lifeline'd worker running ``module``."""
    return ["-m", __name__, "--module", module]


def main(argv: list[str]) -> None:
    """Run ``--exec ARGV...`` or ``--module MODULE ARGS...`` so that it dies with its parent process.

    ``--exec`` replaces this process with Python running ``ARGV``; ``--module`` runs ``MODULE`` in this process.
    """
    if len(argv) < 2 or argv[0] not in ("--exec", "--module"):
        raise SystemExit("usage: python -m vlm_assets.launch.lifeline --exec ARGV... | --module MODULE ARGS...")
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(int(expected) if expected and argv[0] == "--exec" else None)
    if argv[0] == "--exec":
        # The agent's own children (the workers) must check against the agent, not the step.
        os.environ.pop(PARENT_ENV, None)
        os.execv(sys.executable, [sys.executable, *argv[1:]])  # the death signal survives execve
    module, sys.argv = argv[1], [argv[1], *argv[2:]]
    freeze_at_exit()  # registered before the module's own exit handlers, so it runs after them
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
