"""Processes that die with their parent, by the kernel's guarantee (Linux ``PR_SET_PDEATHSIG``).

The launcher starts each torchrun agent through this module (one per node, or all of a launch's nodes
forked from one ``--agents`` process, below), and each agent starts each worker from a copy of itself::

    python -m vlm_assets.launch.lifeline --agent --nnodes=... -m <entry point> ...

so the chain is: the Dagster step process -> agent -> worker, each link holding a parent-death
signal (SIGKILL). However the step's process ends (SIGKILL from an OOM killer, a lost session, a
node drain; no Python ``finally:`` runs then), the kernel kills the agents at once, and their death
kills the workers. A worker killed mid-commit leaves nothing visible: store commits are atomic
(``vlm_assets.storage``). The launcher's own cleanup (``stop_process_trees``) still handles the
ordinary endings (failure, timeout, SIGTERM/SIGINT, a run terminated from the UI).

The agent imports the entry point once and forks its workers, which run it as ``__main__`` with its
imports done (a trainer's imports are 5-8 s of a core, paid once per node instead of once per
worker). Forked workers cannot use a CUDA runtime their parent touched, so under a GPU build of torch,
or with ``VLM_ASSETS_FRESH_WORKERS=1``, each worker is a fresh ``--module`` process instead, as a
Kubernetes pod's torchrun starts them (``launch.k8s``). A ``--module`` process skips the interpreter's
last garbage collections at its exit (``gc.freeze``); its exit handlers run as usual.

Several nodes on one host (``--agents``) start as one process that imports the entry point and forks
one agent per node, each writing to a pipe of its own, and reports each agent's PID and exit code on a
status pipe (``parse_report``): the chain is step process -> that process -> agent -> worker, and the
imports are paid once per launch, not once per node.

The signal follows the *thread* that forked the child: the launcher starts agents from the step's
thread, which waits on them until they end, and torchrun starts workers from its main thread.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1
PARENT_ENV = "VLM_ASSETS_LIFELINE_PARENT"
FRESH_WORKERS_ENV = "VLM_ASSETS_FRESH_WORKERS"
_MODULE = "vlm_assets.launch.lifeline"  # not __name__: that is "__main__" in an agent
_PEER_FIRST_S = 1.0  # ten of torchrun's 0.1 s monitor intervals


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


def forking_agent(torchrun_args: list[str]) -> list[str]:
    """The command that runs a lifeline'd torchrun agent whose workers are forked from it.

    ``torchrun_args`` are ``torch.distributed.run``'s, ending in ``-m MODULE ARGS...``.
    """
    return [sys.executable, "-m", _MODULE, "--agent", *torchrun_args]


def forking_agents(outputs: list[int], status: int, torchrun_args: list[str]) -> list[str]:
    """The command that forks one lifeline'd agent per descriptor of ``outputs`` (its stdout and stderr)
    from one import of the entry point, and reports on the descriptor ``status`` (``parse_report``)."""
    return [sys.executable, "-m", _MODULE, "--agents", ",".join(map(str, outputs)), str(status), *torchrun_args]


def parse_report(line: str) -> tuple[int, str, int]:
    """``(node, "pid" | "exit", value)`` from a line of ``--agents``' status pipe."""
    node, what, value = line.split()
    return int(node), what, int(value)


def worker_entry(module: str) -> list[str]:
    """torchrun's ``-m <module>`` replaced by a lifeline'd worker running ``module`` in a fresh process."""
    return ["-m", _MODULE, "--module", module]


def _prepared_agent(torchrun_args: list[str]):
    """Parse torchrun's arguments and import the entry point; return the function that runs the agent."""
    import importlib

    import torch
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    args = parse_args(torchrun_args)
    if not args.module:
        raise SystemExit(
            "usage: python -m vlm_assets.launch.lifeline --agent[s] ... TORCHRUN_ARGS... -m MODULE ARGS..."
        )
    if torch.version.cuda or torch.version.hip or os.environ.get(FRESH_WORKERS_ENV) == "1":
        args.training_script_args = ["--module", args.training_script, *args.training_script_args]
        args.training_script = _MODULE
        return lambda: record(run)(args)
    freeze_at_exit()  # the agent now holds everything its workers import
    with contextlib.suppress(Exception):  # each worker imports it again, and reports the error as its own
        importlib.import_module(args.training_script)

    def agent() -> None:
        # torchrun's CLI starts a module only as a fresh interpreter per worker; its function entry point
        # with the fork start method is what lets the workers share the agent's imports.
        config, _, _ = config_from_args(args)
        config.start_method = "fork"
        launch = elastic_launch(config, _worker)
        record(launch)(os.getpid(), args.training_script, *args.training_script_args)

    return agent


def _run_agents(outputs: list[int], status: int, torchrun_args: list[str]) -> None:
    """Fork one agent per descriptor of ``outputs`` after one import; report their PIDs and exit codes."""
    agent = _prepared_agent(torchrun_args)
    nodes: dict[int, int] = {}  # pid -> node

    def forward(sig: int, _frame) -> None:
        # The launcher's signal is for the agents, which forward it to their workers; ended by it first, this
        # process would kill them by their parent-death signal before they could. It also reaches an agent
        # forked after the launcher read the process tree.
        for pid in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    stops = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # held while forking: delivered once every agent can get it
    me = os.getpid()
    for node, fd in enumerate(outputs):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            die_with_parent(me)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            for other in {*outputs, status}:
                os.close(other)
            os._exit(_as_process(agent))
        nodes[pid] = node
        os.write(status, f"{node} pid {pid}\n".encode())
    for fd in outputs:
        os.close(fd)
    for sig in stops:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    while nodes:
        # Any child, so that the first agent to end is reported at once, whichever it is; a process the imports
        # had started would be reaped here too (this project's trainers start none at import).
        pid, code = os.wait()
        if pid in nodes:
            os.write(status, f"{nodes.pop(pid)} exit {os.waitstatus_to_exitcode(code)}\n".encode())


def _as_process(run) -> int:
    """Call ``run()`` as a forked child's whole life and return the exit code a fresh process would end with,
    once the exit handlers it would run have run (a forked child leaves by ``os._exit``, past them and past
    the interpreter's last collections, which ``freeze_at_exit`` saves a fresh process)."""
    code: int | None = 0
    try:
        run()
    except SystemExit as stop:
        code = stop.code
        if not isinstance(code, int | None):  # sys.exit("message"): printed, status 1
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes each line with the rank
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code or 0


def _worker(agent: int, module: str, *args: str) -> None:
    """Run ``module`` as ``__main__`` in this forked worker, ending as a fresh ``python -m`` process would."""
    import time

    die_with_parent(agent)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers, inherited by the fork
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # the agent's import: runpy runs ``__main__`` from a module not imported yet
    code = _as_process(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    if code:
        # The agent reports only the first worker it finds failed (torch.multiprocessing); a rank whose
        # peer was killed fails a moment after it, and waits so that the kill (exit -9) is what is reported.
        time.sleep(_PEER_FIRST_S)
        os._exit(code)


def main(argv: list[str]) -> None:
    """Run ``--agent TORCHRUN_ARGS...``, ``--agents OUTPUT_FDS STATUS_FD TORCHRUN_ARGS...``, ``--exec ARGV...``
    or ``--module MODULE ARGS...``, dying with the parent.

    ``--agent`` runs a torchrun agent (``forking_agent``), ``--agents`` one per node (``forking_agents``);
    ``--exec`` replaces this process with Python running ``ARGV``; ``--module`` runs ``MODULE`` in this process.
    """
    if (
        len(argv) < 2
        or argv[0] not in ("--agent", "--agents", "--exec", "--module")
        or (argv[0] == "--agents" and len(argv) < 4)
    ):
        raise SystemExit(
            "usage: python -m vlm_assets.launch.lifeline --agent TORCHRUN_ARGS... | "
            "--agents OUTPUT_FDS STATUS_FD TORCHRUN_ARGS... | --exec ARGV... | --module MODULE ARGS..."
        )
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(int(expected) if expected and argv[0] != "--module" else None)
    if argv[0] != "--module":
        # The agent's own children (the workers) must check against the agent, not the step.
        os.environ.pop(PARENT_ENV, None)
    if argv[0] == "--exec":
        os.execv(sys.executable, [sys.executable, *argv[1:]])  # the death signal survives execve
    if argv[0] == "--agent":
        _prepared_agent(argv[1:])()
        return
    if argv[0] == "--agents":
        _run_agents([int(fd) for fd in argv[1].split(",")], int(argv[2]), argv[3:])
        return
    module, sys.argv = argv[1], [argv[1], *argv[2:]]
    freeze_at_exit()  # registered before the module's own exit handlers, so it runs after them
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
