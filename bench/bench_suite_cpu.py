"""Where the CPU test suite's time goes on this machine: each test's wall seconds and the cores it kept
busy, the idle core-seconds, and the floor (the suite's busy core-seconds over the cores: the shortest
it could take here with its CPU work unchanged and no core ever idle).

    python bench/bench_suite_cpu.py [--kernels avx2] [--write] [-- PYTEST ARGS]

Busy time is machine-wide (``/proc/stat``), because a test's work is mostly in the processes it starts
(workers, servers, daemons); run it with nothing else running. The suite runs in one pytest process with
this file as a plugin (``-p bench_suite_cpu``), which appends one JSON line per test to the file named
by ``BENCH_SUITE_CPU_OUT``. Every Python process of the suite also logs its own CPU seconds at exit
(``process_log/sitecustomize.py``), which says what kind of process the busy time went to: trainers,
run workers, servers, the tests' own process.

``--beside ARGS`` asks whether two selections finish sooner at once, in two pytest processes, than in
turn: each runs alone, then both together; the report gives each one's wall seconds both ways and the
machine's busy core-seconds.
"""

import argparse
import collections
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def busy_seconds() -> float:
    """Core-seconds all cores spent busy since boot (the ``cpu`` line of ``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except FileNotFoundError:
        raise RuntimeError("bench_suite_cpu.py reads /proc/stat: it runs on Linux only") from None
    # user nice system idle iowait irq softirq steal (guest time is counted in user and nice already)
    user, nice, system, _idle, _iowait, irq, softirq, _steal = ticks[:8]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One JSON line per test (setup, call and teardown together): its id, wall seconds, busy core-seconds."""
    out = os.environ.get("BENCH_SUITE_CPU_OUT")
    busy0 = busy_seconds()
    started = time.monotonic()
    yield
    busy1 = busy_seconds()
    if out:
        row = {"test": item.nodeid, "wall_s": time.monotonic() - started}
        row["busy_core_s"] = busy1 - busy0
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def summarize(rows: list[dict], cores: int) -> dict:
    """The suite's totals and floor, and per module: wall seconds, busy cores on average, idle core-seconds."""
    if not rows:
        raise ValueError("no test ran: nothing to summarize")
    wall = sum(r["wall_s"] for r in rows)
    busy = sum(r["busy_core_s"] for r in rows)
    modules: dict[str, dict] = collections.defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "busy_core_s": 0.0})
    for r in rows:
        m = modules[r["test"].split("::")[0]]
        m["tests"] += 1
        m["wall_s"] += r["wall_s"]
        m["busy_core_s"] += r["busy_core_s"]
    for m in modules.values():
        m["idle_core_s"] = cores * m["wall_s"] - m["busy_core_s"]
    return {
        "tests": len(rows),
        "cores": cores,
        "wall_s": wall,
        "busy_core_s": busy,
        "busy_cores": busy / wall,
        "idle_core_s": cores * wall - busy,
        "floor_s": busy / cores,
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1]["wall_s"])),
    }


# What a process is, from its arguments: the first pattern that matches its first known argument names its kind; a
# dagster command is told apart by its subcommand (``dagster api execute_run``, ``dagster dev``).
KINDS = [
    (re.compile(r"vlm_assets\.train\.(\w+)"), "trainer {}"),
    (re.compile(r"torch/distributed/run\.py$|(?:^|/)torchrun$|vlm_assets/launch/lifeline\.py$()"), "torchrun agent{}"),
    (re.compile(r"(?:^|/)dagster/_daemon/__main__\.py$()"), "dagster-daemon{}"),
    (re.compile(r"(?:^|/)(dagster[-_]daemon|dagster[-_]webserver)(?:/__main__\.py)?$"), "{}"),
    (re.compile(r"(?:^|/)(dagster|dg)(?:/__main__\.py)?$"), "{}"),
    (re.compile(r"(?:^|/)pytest(?:/__main__\.py)?$()"), "pytest (the tests' own process){}"),
    (re.compile(r"(?:^|/)(mlflow|moto_server|uvicorn|gunicorn)(?:/__main__\.py)?$"), "server {}"),
    (re.compile(r"(?:^|/)(\w+)/__main__\.py$"), "python -m {}"),
    (re.compile(r"(?:^|/)(\w+\.py)$"), "script {}"),
]


def kind(argv: list[str]) -> str:
    """The kind of a process from its first arguments, e.g. ``trainer gpt_pretrain``, ``dagster api execute_run``."""
    for i, arg in enumerate(argv):  # the first argument a rule knows: a torchrun agent's args name its trainer
        for pattern, name in KINDS:
            if m := pattern.search(arg):
                label = name.format(m.group(1) or "")
                if label in ("dagster", "dg"):
                    label = " ".join([label, *[a for a in argv[i + 1 : i + 3] if not a.startswith("-")]])
                return label
    return "python -c" if argv[:1] == ["-c"] else f"python {Path(argv[0]).name if argv else ''}".strip()


def by_kind(processes: list[dict]) -> list[dict]:
    """Processes grouped by ``kind``, the most CPU first: how many, their CPU seconds in all and on average.

    A child that multiprocessing spawned carries its parent's arguments: it is its parent's kind plus
    ": a multiprocessing child" (``dagster api grpc: a multiprocessing child`` is a run worker)."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for p in processes:
        child = ": a multiprocessing child" if p.get("multiprocessing_child") else ""
        groups[kind(p["argv"]) + child].append(p["cpu_s"])
    rows = [{"kind": k, "processes": len(v), "cpu_s": sum(v), "mean_cpu_s": sum(v) / len(v)} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def kinds_markdown(kinds: list[dict], busy_core_s: float) -> list[str]:
    """Lines of a table of ``by_kind``'s rows, each kind's share of ``busy_core_s``, and what no line logged.

    ``busy_core_s`` is the machine's busy time over the whole pytest process (``SuiteRun.busy_core_s``):
    a process's CPU at exit includes what it did outside any test (collection, session fixtures).
    """
    lines = [
        "The busy core-seconds of the whole pytest run by the kind of Python process they went to (each"
        " process's own CPU at exit):",
        "",
    ]
    lines += [
        "| process kind | processes | CPU (s) | CPU per process (s) | of the run's busy core-s |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in kinds:
        share = k["cpu_s"] / busy_core_s
        lines.append(f"| {k['kind']} | {k['processes']} | {k['cpu_s']:.0f} | {k['mean_cpu_s']:.1f} | {share:.0%} |")
    rest = busy_core_s - sum(k["cpu_s"] for k in kinds)
    lines.append(
        f"| not logged (killed by a signal; not Python: Postgres, k8s; the kernel) | - | {rest:.0f} | - "
        f"| {rest / busy_core_s:.0%} |"
    )
    return lines


def markdown(summary: dict, rows: list[dict], top: int, processes: list[dict], run_busy_core_s: float) -> str:
    """The report: the suite's totals, each module, the ``top`` idlest tests, the busy time by process kind."""
    s = summary
    lines = [
        "| suite | |",
        "|---|---:|",
        f"| tests | {s['tests']} |",
        f"| wall (s, setup + call + teardown of every test) | {s['wall_s']:.0f} |",
        f"| busy core-seconds | {s['busy_core_s']:.0f} |",
        f"| busy cores on average, of {s['cores']} | {s['busy_cores']:.2f} |",
        f"| idle core-seconds | {s['idle_core_s']:.0f} |",
        f"| floor: busy core-seconds / cores (s) | {s['floor_s']:.0f} ({s['floor_s'] / s['wall_s']:.2f} of the wall) |",
        "",
        "| module | tests | wall (s) | busy cores | idle core-s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in s["modules"].items():
        lines.append(
            f"| {name} | {m['tests']} | {m['wall_s']:.0f} | {m['busy_core_s'] / m['wall_s']:.2f} "
            f"| {m['idle_core_s']:.0f} |"
        )
    lines += ["", f"The {top} tests that left the most core-seconds idle:", ""]
    lines += ["| test | wall (s) | busy cores | idle core-s |", "|---|---:|---:|---:|"]
    idle = lambda r: s["cores"] * r["wall_s"] - r["busy_core_s"]  # noqa: E731
    for r in sorted(rows, key=idle, reverse=True)[:top]:
        lines.append(f"| `{r['test']}` | {r['wall_s']:.1f} | {r['busy_core_s'] / r['wall_s']:.2f} | {idle(r):.0f} |")
    if processes:
        lines += ["", *kinds_markdown(by_kind(processes), run_busy_core_s)]
    return "\n".join(lines) + "\n"


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of ``path``; none when it was never written."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class SuiteRun(NamedTuple):
    """One pytest run under ``run_suite``."""

    proc: subprocess.CompletedProcess
    tests: list[dict]  # the plugin's row per test
    processes: list[dict]  # the line each Python process of the run wrote at its exit (``process_log``)
    busy_core_s: float  # the machine's busy core-seconds from pytest's start to its exit


def _suite_command(tmp: Path, kernels: dict, pytest_args: list[str], pythonpath: list[str | None]):
    """The command and environment of a pytest run with this file as its plugin, and the files its tests
    (``tmp/tests.jsonl``) and its Python processes (``tmp/processes.jsonl``) write their lines to."""
    out, log = tmp / "tests.jsonl", tmp / "processes.jsonl"
    env = {**os.environ, **kernels, "CUDA_VISIBLE_DEVICES": "", "BENCH_SUITE_CPU_OUT": str(out)}
    env["BENCH_PROCESS_LOG"] = str(log)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "process_log"), *pythonpath]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "bench_suite_cpu", "-p", "no:cacheprovider"]
    return [*command, *pytest_args], env, out, log


def run_suite(cwd: Path, kernels: dict, pytest_args: list[str], pythonpath: list[str | None]) -> SuiteRun:
    """Run pytest in ``cwd`` with this file as its plugin and log every Python process it starts.

    ``pythonpath`` lists PYTHONPATH's entries in order (``None`` entries left out); it must reach this file.
    """
    with tempfile.TemporaryDirectory() as tmp:
        command, env, out, log = _suite_command(Path(tmp), kernels, pytest_args, pythonpath)
        busy0 = busy_seconds()
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        busy = busy_seconds() - busy0
        return SuiteRun(proc, read_lines(out), read_lines(log), busy)


class Lane(NamedTuple):
    """One selection of ``run_at_once``: its run, and the wall seconds from the common start to its end."""

    run: SuiteRun
    wall_s: float


def run_at_once(
    cwd: Path, kernels: dict, selections: list[list[str]], pythonpath: list[str | None]
) -> tuple[list[Lane], float]:
    """Run each selection of pytest arguments in a pytest process of its own, all started together.

    Returns a ``Lane`` per selection and the machine's busy core-seconds until the last one ended (each
    lane's ``run.busy_core_s`` is that same machine-wide figure: the lanes' shares cannot be told apart).
    """
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        started, busy0, lanes = time.monotonic(), busy_seconds(), []
        for i, args in enumerate(selections):
            (folder := Path(tmp) / str(i)).mkdir()
            command, env, out, log = _suite_command(folder, kernels, args, pythonpath)
            output = files.enter_context(open(folder / "output", "w+"))
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
            lanes.append((proc, output, out, log))
        ended: dict[int, float] = {}
        while len(ended) < len(lanes):
            for i, (proc, *_) in enumerate(lanes):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic() - started
            time.sleep(0.2)
        busy = busy_seconds() - busy0
        result = []
        for i, (proc, output, out, log) in enumerate(lanes):
            output.seek(0)
            completed = subprocess.CompletedProcess(proc.args, proc.returncode, output.read(), "")
            result.append(Lane(SuiteRun(completed, read_lines(out), read_lines(log), busy), ended[i]))
        return result, busy


def at_once_markdown(
    selections: list[list[str]], alone: list[tuple[float, float]], lanes: list[Lane], busy: float
) -> str:
    """The report of ``--beside``: each selection's wall seconds alone and at once, the sum in turn against
    the longest at once, and the busy core-seconds both ways. ``alone``: (wall, busy core-s) per selection."""
    lines = [
        "| selection | pytest arguments | alone: wall (s) | at once: wall (s) | at once / alone |",
        "|---|---|---:|---:|---:|",
    ]
    for i, (args, (wall, _), lane) in enumerate(zip(selections, alone, lanes)):
        lines.append(f"| {i + 1} | `{shlex.join(args)}` | {wall:.0f} | {lane.wall_s:.0f} | {lane.wall_s / wall:.2f} |")
    in_turn, at_once = sum(w for w, _ in alone), max(lane.wall_s for lane in lanes)
    lines += [
        "",
        "| | in turn | at once | at once / in turn |",
        "|---|---:|---:|---:|",
        f"| wall (s): the sum alone, the longest at once | {in_turn:.0f} | {at_once:.0f} | {at_once / in_turn:.2f} |",
        f"| busy core-seconds | {sum(b for _, b in alone):.0f} | {busy:.0f} | {busy / sum(b for _, b in alone):.2f} |",
    ]
    return "\n".join(lines) + "\n"


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The last line pytest printed: its summary of passes and failures."""
    return (proc.stdout.strip().splitlines() or [""])[-1]


def save_output(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """Write a run's whole output to a new temporary file and return its path.

    A failed suite's tracebacks come long before the output's tail.
    """
    fd, log = tempfile.mkstemp(prefix=prefix, suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return log


def _failed(proc: subprocess.CompletedProcess) -> None:
    """Exit naming the failed run and a file with its whole output."""
    log = save_output(proc, "bench_suite_cpu-")
    print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
    sys.exit(
        f"the suite failed ({last_line(proc)}): its times would describe another suite; pytest's whole output: {log}"
    )


def main() -> None:
    sys.path.insert(0, str(HERE))
    import results_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="native", choices=sorted(results_file.KERNELS))
    parser.add_argument("--top", type=int, default=15, help="how many tests to list by idle core-seconds")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/suite-cpu_<machine>_<date>.* (suite-at-once_... with --beside)",
    )
    parser.add_argument(
        "--beside", metavar="ARGS", help="pytest arguments of a second selection: both alone, then both at once"
    )
    parser.add_argument("pytest_args", nargs="*", help="after `--`: arguments for pytest (default: the CPU suite)")
    args = parser.parse_args()
    pythonpath = [str(HERE), os.environ.get("PYTHONPATH")]
    kernels = results_file.KERNELS[args.kernels]
    named = " ".join(f"{k}={v}" for k, v in kernels.items()) or "no kernel override"
    selection = args.pytest_args or ["-m", "not gpu"]
    if args.beside:
        selections, alone = [selection, shlex.split(args.beside)], []
        for pytest_args in selections:
            started = time.monotonic()
            run = run_suite(REPO, kernels, pytest_args, pythonpath)
            if run.proc.returncode != 0:
                _failed(run.proc)
            alone.append((time.monotonic() - started, run.busy_core_s))
        lanes, busy = run_at_once(REPO, kernels, selections, pythonpath)
        for lane in lanes:
            if lane.run.proc.returncode != 0:
                _failed(lane.run.proc)
        text = f"The suite's processes: {named}.\n\n" + at_once_markdown(selections, alone, lanes, busy)
        what = "suite-at-once"
        data = {"selections": selections, "alone": alone, "at_once": [lane.wall_s for lane in lanes], "busy": busy}
    else:
        proc, rows, processes, run_busy = run_suite(REPO, kernels, selection, pythonpath)
        if proc.returncode != 0:
            _failed(proc)
        summary = summarize(rows, os.cpu_count() or 1)
        text = f"The suite's processes: {named}.\n\n" + markdown(summary, rows, args.top, processes, run_busy)
        text += f"\nThe suite's last line: {last_line(proc)}\n"
        what = "suite-cpu"
        data = {"summary": summary, "tests": rows, "processes": by_kind(processes)}
    print(text)
    if args.write:
        head = results_file.header(" ".join(["bench/bench_suite_cpu.py", *sys.argv[1:]]))
        print(f"wrote {results_file.write(what, head, text, data)}")


if __name__ == "__main__":
    main()
