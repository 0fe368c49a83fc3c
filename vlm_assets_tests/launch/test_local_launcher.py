"""The local torchrun backend with real processes: rendezvous, log streaming, failure, no orphans."""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vlm_assets.launch import LaunchFailed, LaunchSpec, local, run_local
from vlm_assets.launch.local import alive
from vlm_assets_tests.conftest import default_signals, launcher_clock_jumps
from vlm_assets_tests.waiting import BOUND_S

WORKER = "vlm_assets_tests.launch.allreduce_worker"
ENV = {"OMP_NUM_THREADS": "1"}


def _pids(lines):
    return [int(line.split(" pid ")[1].split()[0]) for line in lines if " pid " in line]


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The temp dir of this process and of the launches it makes (their ``TMPDIR``), empty."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    return temp


def _left_in(temp: Path) -> list[str]:
    """What a launch left in its temp dir, but torch's per-user compile cache, which is meant to stay."""
    return [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
def test_two_nodes_of_one_process_rendezvous_on_loopback(temp_dir):
    lines = []
    run_local(LaunchSpec(WORKER, num_nodes=2, nproc_per_node=1, env=ENV, timeout_s=120), on_line=lines.append)
    assert _left_in(temp_dir) == []  # torchrun's log dir and its workers' error files went with the launch
    ranks = sorted(line.split("rank ")[1].split()[0] for line in lines if " sum " in line)
    assert ranks == ["0/2", "1/2"]
    assert all(line.endswith("sum 1") for line in lines if " sum " in line)  # 0 + 1: they really met
    assert {line.split("]")[0] for line in lines if " sum " in line} == {"[node 0", "[node 1"}


@pytest.mark.slow
def test_a_failing_node_stops_every_node_and_is_reported(temp_dir):
    lines = []
    spec = LaunchSpec(WORKER, ("--fail-rank", "1", "--hang"), num_nodes=2, nproc_per_node=1, env=ENV, timeout_s=120)
    with pytest.raises(LaunchFailed) as failure:
        run_local(spec, on_line=lines.append)
    err = failure.value
    assert err.exit_code not in (None, 0)
    assert err.worker_exit_code == 3
    assert any("rank 1 failing on purpose" in line for line in err.tail)
    pids = _pids(lines)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids), "a worker outlived the launch"
    assert _left_in(temp_dir) == []


@pytest.mark.slow
def test_the_job_timeout_stops_a_hanging_job(monkeypatch):
    lines = []
    # The launcher's clock jumps past the deadline once both workers have reported: the timeout is
    # proven against started, hanging workers however long they took to start on this machine.
    launcher_clock_jumps(monkeypatch, when=lambda: len(_pids(lines)) >= 2)
    spec = LaunchSpec(WORKER, ("--hang",), num_nodes=1, nproc_per_node=2, env=ENV, timeout_s=600)
    with pytest.raises(LaunchFailed, match="past its 600 s timeout"):
        run_local(spec, on_line=lines.append)
    pids = _pids(lines)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_canceled_run_stops_its_job_and_is_not_retried():
    lines = []
    spec = LaunchSpec(WORKER, ("--hang",), num_nodes=1, nproc_per_node=2, env=ENV, timeout_s=600)
    with pytest.raises(LaunchFailed, match="canceled") as failed:
        run_local(spec, on_line=lines.append, canceled=lambda: len(_pids(lines)) == 2)
    assert failed.value.rule.cause == "canceled" and not failed.value.rule.retry
    pids = _pids(lines)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="module"):
        LaunchSpec("not a module; rm -rf /")
    with pytest.raises(ValueError, match="num_nodes"):
        LaunchSpec(WORKER, num_nodes=0)


STEP = """
import sys
from pathlib import Path
from vlm_assets.launch import LaunchSpec, run_local
spec = LaunchSpec("vlm_assets_tests.launch.allreduce_worker", ("--hang",), num_nodes=2, nproc_per_node=2,
                  env={"OMP_NUM_THREADS": "1"}, timeout_s=600)
run_local(spec, on_line=lambda line: (sys.stdout.write(line + "\\n"), sys.stdout.flush()))
"""


@pytest.mark.slow
def test_sigkill_of_the_launching_process_ends_every_agent_and_worker():
    """No ``finally:`` runs on SIGKILL: the kernel's parent-death signals end the agents, then the workers."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vlm_assets.launch.local import process_tree

    step = subprocess.Popen([sys.executable, "-c", STEP], stdout=subprocess.PIPE, text=True)
    seen = []
    for line in step.stdout:
        seen.append(line)
        if len(_pids(seen)) == 4:  # both nodes' workers are up and in their hang
            break
    tree = [pid for pid in process_tree(step.pid) if pid != step.pid]
    workers = _pids(seen)
    assert set(workers) <= set(tree) and len(tree) >= 6  # 2 agents + 4 workers (+ torch helpers)
    os.kill(step.pid, signal.SIGKILL)
    step.wait()
    deadline = time.monotonic() + BOUND_S
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree if alive(pid)], "an agent or worker outlived its step"


def test_a_stopped_process_is_ended_by_the_sigterm_not_left_for_the_sigkill():
    # The child's SIGTERM starts at its default: a blocked or ignored one would be inherited from this process.
    # It is stopped once it sleeps, not while it starts up, where a page fault on a busy disk can hold it
    # past the grace with the SIGTERM still pending.
    command = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"]
    proc = subprocess.Popen(command, preexec_fn=default_signals, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "sleeping\n"
    os.kill(proc.pid, signal.SIGSTOP)
    local.stop_process_trees([proc])
    proc.stdout.close()
    assert proc.returncode == -signal.SIGTERM


def test_a_lifeline_module_runs_its_exit_handlers_then_skips_the_last_collections(tmp_path):
    """A worker's exit handlers run; then its objects are frozen, so the interpreter's last collections
    pass over them (the finalizer of an object in a reference cycle does not run). An exception still
    ends it with its traceback and status 1."""
    # Automatic collections off: an allocation-triggered one (printing a traceback) could collect the
    # cycle before the exit handlers; only the interpreter's last collections may, which the freeze skips.
    (tmp_path / "worker_at_exit.py").write_text(
        "import atexit, gc, sys\n"
        "gc.disable()\n"
        "class Cycle:\n"
        "    def __del__(self):\n"
        "        print('collected at exit')\n"
        "cycle = Cycle()\n"
        "cycle.me = cycle\n"
        "del cycle\n"
        "atexit.register(print, 'exit handler ran')\n"
        "if sys.argv[1:] == ['fail']:\n"
        "    raise RuntimeError('the worker failed')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    plain = subprocess.run(
        [sys.executable, "-m", "worker_at_exit"], env=env, capture_output=True, text=True, timeout=BOUND_S
    )
    assert plain.stdout == "exit handler ran\ncollected at exit\n"  # what the freeze leaves out
    command = [sys.executable, "-m", "vlm_assets.launch.lifeline", "--module", "worker_at_exit"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert (done.returncode, done.stdout) == (0, "exit handler ran\n"), done.stderr
    failed = subprocess.run([*command, "fail"], env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert failed.returncode == 1 and "RuntimeError: the worker failed" in failed.stderr
    assert failed.stdout == "exit handler ran\n"


PROBE = """
import atexit, os, sys
import probe_imports
from vlm_assets.launch.local import training_processes
if __name__ == "__main__":
    roles = training_processes("forked_probe", sys.argv[1])
    where = {os.getppid(): "the agent", os.getpid(): "the worker"}.get(probe_imports.PID)
    print(f"imported by {where}; worker {os.getpid() in roles['worker']}, agent {os.getppid() in roles['agent']}")
    atexit.register(print, "exit handler ran", flush=True)
    sys.exit(int(sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_workers_share_the_agents_imports_and_end_as_a_fresh_process_would(tmp_path, fresh):
    """Forked from the agent, a worker finds its module's imports done by the agent, runs its exit handlers
    and ends with its own exit code; with VLM_ASSETS_FRESH_WORKERS=1 (what a GPU build of torch does) each
    worker imports them itself. Both ways, ``training_processes`` tells the worker from its agent."""
    (tmp_path / "probe_imports.py").write_text("import os\nPID = os.getpid()\n")
    (tmp_path / "forked_probe.py").write_text(PROBE)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    if fresh:
        env["VLM_ASSETS_FRESH_WORKERS"] = "1"
    lines = []
    run_local(LaunchSpec("forked_probe", (str(tmp_path), "0"), env=env, timeout_s=120), on_line=lines.append)
    importer = "the worker" if fresh else "the agent"
    assert [line.split("] ", 1)[1] for line in lines if line.startswith("[node")] == [
        f"imported by {importer}; worker True, agent True",
        "exit handler ran",
    ], "\n".join(lines)
    with pytest.raises(LaunchFailed) as failed:
        run_local(LaunchSpec("forked_probe", (str(tmp_path), "4"), env=env, timeout_s=120), on_line=lines.append)
    assert failed.value.worker_exit_code == 4 and "exit handler ran" in failed.value.tail


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


PROBE_NODES = """
import atexit, os, sys
import probe_imports
from vlm_assets.launch.local import training_processes
def _parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
if __name__ == "__main__":
    roles = training_processes("forked_probe", sys.argv[1])
    agent = os.getppid()
    where = {_parent(agent): "the agents' parent", agent: "the agent", os.getpid(): "the worker"}.get(probe_imports.PID)
    print(f"imported by {where}; worker {os.getpid() in roles['worker']}, agent {agent in roles['agent']}, "
          f"agents' parent a starter {_parent(agent) in roles['starter']}")
    atexit.register(print, "exit handler ran", flush=True)
"""


@pytest.mark.slow
def test_two_nodes_agents_are_forked_from_one_import_and_each_node_is_told_apart(tmp_path):
    """The nodes' agents are forked from the process that imported the trainer for both; each node's output
    stays its own, and ``training_processes`` tells that process, the agents and the workers apart."""
    (tmp_path / "probe_imports.py").write_text("import os\nPID = os.getpid()\n")
    (tmp_path / "forked_probe.py").write_text(PROBE_NODES)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    lines = []
    spec = LaunchSpec("forked_probe", (str(tmp_path),), num_nodes=2, env=env, timeout_s=120)
    run_local(spec, on_line=lines.append)
    for node in (0, 1):
        assert [line.split("] ", 1)[1] for line in lines if line.startswith(f"[node {node}]")] == [
            "imported by the agents' parent; worker True, agent True, agents' parent a starter True",
            "exit handler ran",
        ], "\n".join(lines)


@pytest.mark.slow
def test_a_killed_agent_of_two_forked_nodes_fails_its_node_with_exit_minus_9():
    lines = []
    spec = LaunchSpec(WORKER, ("--hang",), num_nodes=2, nproc_per_node=1, env=ENV, timeout_s=600)

    def kill_node_1s_agent() -> bool:
        """Asked as ``canceled`` (every ``CANCEL_POLL_S``): SIGKILL node 1's agent once both workers are up."""
        workers = [line for line in lines if " pid " in line and line.startswith("[node 1]")]
        if workers and len(_pids(lines)) == 2 and not killed:
            killed.append(_parent(_pids(workers)[0]))
            os.kill(killed[0], signal.SIGKILL)
        return False

    killed = []

    with pytest.raises(LaunchFailed) as failed:
        run_local(spec, on_line=lines.append, canceled=kill_node_1s_agent)
    assert (failed.value.node, failed.value.exit_code) == (1, -signal.SIGKILL), str(failed.value)
    assert failed.value.rule.retry
    assert not any(alive(pid) for pid in _pids(lines)), "a worker outlived its killed agent"
