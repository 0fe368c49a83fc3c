"""The local backend: one ``torchrun`` per node, every node on 127.0.0.1, c10d rendezvous.

``num_nodes=2, nproc_per_node=1`` really is two torchrun agents, each with its own worker, meeting
at a rendezvous endpoint on loopback, exactly as two machines would; the agents are forked from one
process that imports the trainer for all of them (``lifeline --agents``). Worker output is streamed line
by line (prefixed with the node) to a callback. If any node fails, every other node is stopped, and
the whole process tree (a worker may run in a session of its own, so killing the agent's process
group is not enough) is collected first, signalled with SIGTERM, then SIGKILL: no orphans.
If the calling process itself dies, the kernel ends the agents and workers (``lifeline``).
"""

import collections
import contextlib
import dataclasses
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from vlm_assets.launch.retry import Rule, rule_for
from vlm_assets.launch.spec import SHARED_HOST_ENV, LaunchSpec

# Lines kept per node for the failure: torchrun's own traceback and summary alone are about 40 on a
# 2-process node, and a trainer's BAD_INPUT line comes just before them.
_TAIL_LINES = 100
_GRACE_S = 15.0
_PEERS_S = 3.0
CANCEL_POLL_S = 2.0  # how often a launch asks whether its run was canceled
_LIFELINE = "vlm_assets.launch.lifeline"


@dataclasses.dataclass
class LaunchFailed(RuntimeError):
    """A node exited non-zero, or the job ran past its timeout."""

    node: int
    # The torchrun agent's exit code (None: stopped by the timeout); of a node never forked (``_ForkedNode``),
    # the code its starter ended with.
    exit_code: int | None
    worker_exit_code: int | None  # the failing worker's own code when torchrun reports it (-9 = SIGKILL)
    tail: list[str]
    reason: str
    # What the launcher saw itself ("timeout", "unschedulable", "evicted": ``retry.RULES``); None: the
    # exit codes and the last lines tell.
    cause: str | None = None

    @property
    def rule(self) -> Rule:
        """The retry rule this failure falls under (``retry.rule_for``)."""
        return rule_for(
            cause=self.cause, exit_code=self.exit_code, worker_exit_code=self.worker_exit_code, tail=self.tail
        )

    @property
    def retryable(self) -> bool:
        """Whether the orchestrator should retry this failure."""
        return self.rule.retry

    def __str__(self) -> str:
        worker = f", worker exit code {self.worker_exit_code}" if self.worker_exit_code is not None else ""
        # The workers' own last lines (a traceback), which torchrun prefixes with their rank, rather than
        # the agent's traceback and failure summary printed after them (the exit code is in line one).
        workers = [line for line in self.tail if line.startswith("[rank")]
        last = "\n".join((workers or self.tail)[-15:])
        head = f"{self.reason}: node {self.node} exit code {self.exit_code}{worker}"
        return f"{head}. Last lines of node {self.node}:\n{last}"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(spec: LaunchSpec, endpoint: str, run_id: str, log_dir: str) -> list[str]:
    """torchrun's arguments for one node of ``spec``, meeting at ``endpoint``, its workers' error files
    under ``log_dir``."""
    return [
        f"--nnodes={spec.num_nodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        # is_host=false: the rendezvous store is the launcher's (run_local), not an agent's.
        f"--rdzv-conf=join_timeout={spec.rendezvous_timeout_s},is_host=false",
        "--max-restarts=0",  # a failed job is retried by the orchestrator, from the last checkpoint
        f"--log-dir={log_dir}",
        "-m",
        spec.module,
        *spec.args,
    ]


def run_local(
    spec: LaunchSpec,
    on_line: Callable[[str], None] = print,
    env: Mapping[str, str] | None = None,
    canceled: Callable[[], bool] | None = None,
) -> None:
    """Run ``spec`` to completion on this machine.

    Raise ``LaunchFailed`` if any node fails, it times out, or ``canceled()`` (asked every ``CANCEL_POLL_S``)
    says its run was canceled.
    """
    from torch.distributed import TCPStore

    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    # The c10d rendezvous store lives in this process, which outlives every agent. Hosted by the
    # first agent (torchrun's default), it can exit while the others still shut the rendezvous
    # down, and each of them then logs a connection error with a C++ stack trace.
    rendezvous_store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex[:12]
    # Imported here, not at the top: `python -m vlm_assets.launch.lifeline` imports this package
    # first, and runpy warns when the module it is about to run as __main__ was imported already.
    from vlm_assets.launch.lifeline import PARENT_ENV, forking_agent

    full_env = {**os.environ, **(env or {}), **spec.env, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
    if spec.num_nodes > 1:
        full_env[SHARED_HOST_ENV] = "1"  # every "node" is on this host: see vlm_assets._streaming
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(spec.num_nodes)]
    starter: subprocess.Popen | None = None
    nodes: list = []
    # torchrun's default is a directory of its own under the temp dir that it never removes, one per launch.
    log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    args = torchrun_args(spec, endpoint, run_id, log_dir)
    try:
        if spec.num_nodes == 1:
            proc = subprocess.Popen(
                forking_agent(args),
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
            nodes.append(proc)
            threading.Thread(target=_pump, args=(0, proc.stdout, lines), daemon=True).start()
        else:
            starter, nodes = _start_forked_nodes(spec, args, full_env, lines)
        shape = f"{spec.num_nodes} node(s) x {spec.nproc_per_node} process(es)"
        on_line(f"[launcher] {spec.name}: {shape}, rendezvous {endpoint}")
        _supervise(spec, nodes, lines, tails, on_line, canceled)
    finally:
        stop_process_trees([p for p in nodes if p.poll() is None])
        if starter is not None:
            if starter.poll() is None:
                stop_process_trees([starter])
            starter.wait()
        for proc in nodes:
            if proc.stdout:
                proc.stdout.close()
        del rendezvous_store  # only now that no agent is left to use it
        shutil.rmtree(log_dir, ignore_errors=True)


class _ForkedNode:
    """A node's torchrun agent forked by ``lifeline --agents``: the ``subprocess.Popen`` calls the launcher
    makes (``pid``, ``poll``, ``wait``), from the PID and exit code that process reports."""

    def __init__(self, stdout) -> None:
        self.stdout = stdout
        self.pid: int | None = None
        self.returncode: int | None = None
        self._ended = threading.Event()

    @staticmethod
    def follow(nodes: list["_ForkedNode"], starter: subprocess.Popen, status: int) -> None:
        """Read the starter's reports until it ends; a node it did not report ended went with it."""
        from vlm_assets.launch.lifeline import parse_report

        with os.fdopen(status) as reports:
            for line in reports:
                node, what, value = parse_report(line)
                if what == "pid":
                    nodes[node].pid = value
                else:
                    nodes[node].returncode = value
                    nodes[node]._ended.set()
        code = starter.wait()
        for node in nodes:
            if node.returncode is None:
                # A forked agent the starter did not see end died with it, by its parent-death signal; a node never
                # forked failed as the starter did.
                node.returncode = -signal.SIGKILL if node.pid is not None or not code else code
                node._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("lifeline --agents", timeout)
        assert self.returncode is not None
        return self.returncode


def _start_forked_nodes(spec, args, env, lines) -> tuple[subprocess.Popen, list[_ForkedNode]]:
    """Start the nodes as agents forked from one process that imports the trainer once (``lifeline --agents``),
    each node's output on a pipe of its own; return that process and the nodes."""
    from vlm_assets.launch.lifeline import forking_agents  # imported here: see run_local

    pipes = [os.pipe() for _ in range(spec.num_nodes)]
    status_read, status_write = os.pipe()
    writes = [w for _, w in pipes]
    try:
        starter = subprocess.Popen(
            forking_agents(writes, status_write, args),
            env=env,
            stdout=writes[0],
            stderr=subprocess.STDOUT,
            pass_fds=(*writes, status_write),
            start_new_session=True,
        )
    finally:
        for fd in (*writes, status_write):
            os.close(fd)
    try:
        nodes = [_ForkedNode(os.fdopen(r, buffering=1, errors="replace")) for r, _ in pipes]
        for node, handle in enumerate(nodes):
            threading.Thread(target=_pump, args=(node, handle.stdout, lines), daemon=True).start()
        threading.Thread(target=_ForkedNode.follow, args=(nodes, starter, status_read), daemon=True).start()
    except BaseException:
        stop_process_trees([starter])
        raise
    return starter, nodes


def _pump(node: int, stdout, lines: queue.Queue) -> None:
    for line in stdout:
        lines.put((node, line.rstrip("\n")))
    lines.put((node, None))


def _supervise(spec, nodes, lines, tails, on_line, canceled) -> None:
    deadline = time.monotonic() + spec.timeout_s
    next_ask = time.monotonic() + CANCEL_POLL_S
    open_streams = len(nodes)
    while True:
        try:
            node, line = lines.get(timeout=0.2)
            if line is None:
                open_streams -= 1
            else:
                _relay(node, line, tails, on_line)
        except queue.Empty:
            pass
        codes = [p.poll() for p in nodes]
        if any(code not in (None, 0) for code in codes):
            # A node that dies takes its peers' collectives down with it: give them a moment to end too,
            # then report the root cause, not a peer's "Connection closed by peer" (retry.py).
            grace = time.monotonic() + _PEERS_S
            while time.monotonic() < grace and any(p.poll() is None for p in nodes):
                time.sleep(0.1)
            codes = [p.poll() for p in nodes]  # before this launcher stops the rest
            stop_process_trees([p for p in nodes if p.poll() is None])
            _drain(lines, tails, on_line)
            failures = [
                LaunchFailed(i, code, _worker_exit_code(tails[i]), list(tails[i]), f"{spec.name} failed")
                for i, code in enumerate(codes)
                if code not in (None, 0)
            ]
            raise min(failures, key=lambda f: f.rule.cause == "collective")
        if all(code == 0 for code in codes) and open_streams == 0:
            return
        if time.monotonic() > deadline:
            stop_process_trees(nodes)
            _drain(lines, tails, on_line)
            raise LaunchFailed(
                0, None, None, list(tails[0]), f"{spec.name} ran past its {spec.timeout_s} s timeout", "timeout"
            )
        if canceled is not None and time.monotonic() > next_ask:
            next_ask = time.monotonic() + CANCEL_POLL_S
            if canceled():
                stop_process_trees(nodes)
                _drain(lines, tails, on_line)
                raise LaunchFailed(0, None, None, list(tails[0]), f"{spec.name}: its run was canceled", "canceled")


def _drain(lines, tails, on_line) -> None:
    while True:
        try:
            node, line = lines.get(timeout=0.5)
        except queue.Empty:
            return
        if line is not None:
            _relay(node, line, tails, on_line)


def _relay(node: int, line: str, tails, on_line) -> None:
    """Keep ``line`` in its node's tail; pass it on unless it is blank (a progress bar's carriage returns leave
    empty lines, which read as noise in the Dagster log)."""
    tails[node].append(line)
    if line.strip():
        on_line(f"[node {node}] {line}")


def _worker_exit_code(tail) -> int | None:
    """torchrun's failure summary names the worker's exit code (``exitcode  : -9``)."""
    for line in reversed(tail):
        if match := re.search(r"exitcode\s*:\s*(-?\d+)", line):
            return int(match.group(1))
    return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children[int(fields[1])].append(int(stat.parent.name))
    return children


def training_processes(module: str, marker: str) -> dict[str, list[int]]:
    """Return the PIDs of live torchrun agents (``agent``), training workers (``worker``) and the processes that
    forked a launch's agents (``starter``, ``lifeline --agents``) of ``module``.

    Only processes whose command line holds ``marker`` (a run's scratch path, say) count; they are read from
    Linux ``/proc``. A forked process keeps its parent's command line: which role each has, its ancestors tell.
    """
    found: dict[str, list[int]] = {"agent": [], "worker": [], "starter": []}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        text = _cmdline(cmdline)
        if text is None or module not in text or marker not in text:
            continue
        pid = int(cmdline.parent.name)
        # A pod's agent is torchrun's own CLI (launch.k8s). A local one is lifeline's, started by the launcher,
        # or forked from a starter, one per node.
        forked = _forks_above(pid, text)
        if f"{_LIFELINE} --agents" in text:
            role = ("starter", "agent", "worker")[min(forked, 2)]
        elif "torch.distributed.run" in text or f"{_LIFELINE} --agent" in text:
            role = "worker" if forked else "agent"
        else:
            role = "worker"
        found[role].append(pid)
    return found


def _forks_above(pid: int, cmdline: str) -> int:
    """How many of ``pid``'s closest ancestors in a row have the command line ``cmdline`` too."""
    count = 0
    while (fields := _live_stat(pid)) is not None and _cmdline(Path(f"/proc/{fields[1]}/cmdline")) == cmdline:
        count, pid = count + 1, int(fields[1])
    return count


def _cmdline(path: Path) -> str | None:
    try:
        return b" ".join(path.read_bytes().split(b"\0")).decode(errors="replace")
    except OSError:
        return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux ``/proc``)."""
    children, tree, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def stop_process_trees(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process of every tree (torchrun forwards it to its workers), SIGKILL what is left."""
    procs = [proc for proc in procs if proc.pid is not None]  # a node not forked yet (``_ForkedNode``)
    pids = [pid for proc in procs for pid in process_tree(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        deadline = time.monotonic() + (_GRACE_S if sig == signal.SIGTERM else 5.0)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        pids = [pid for pid in pids if alive(pid)]
        if not pids:
            return


def _live_stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat`` of a live process; None when there is no such process
    or it is a zombie (dead, only not yet reaped by its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return _live_stat(pid) is not None


def started_at(pid: int) -> float | None:
    """Wall-clock start time of a live, non-zombie process on this host; None if there is none."""
    if (fields := _live_stat(pid)) is None:
        return None
    boot = next(
        float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
    )
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start, in clock ticks
