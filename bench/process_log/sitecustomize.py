"""Appends one JSON line per Python process at its exit (its arguments, CPU seconds, wall seconds and the
test that started it) to the file named by ``BENCH_PROCESS_LOG``; without it, does nothing.

``bench_suite_cpu.py`` puts this folder first on the suite's PYTHONPATH, so that every Python process the
suite starts (pytest, run workers, trainers, servers) imports it at start-up, in place of any other
``sitecustomize`` (a virtual environment has none). A process killed by a signal, and
any process not Python (Postgres, the k8s control plane), writes nothing: their CPU is the busy time no
line accounts for.
"""

import atexit
import json
import os
import sys
import time

_STARTED = time.monotonic()


def _write() -> None:
    row = {
        "argv": sys.argv[:4],
        "cpu_s": time.process_time(),  # this process's own user + system time
        "wall_s": time.monotonic() - _STARTED,
        # pytest names the running test in its environment, which the test's subprocesses inherit
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
    }
    # A child multiprocessing spawned (a code server's run worker, a multiprocess executor's step) carries
    # its parent's argv: spawn restores it. Only such a child has a parent_process.
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None and multiprocessing.parent_process() is not None:
        row["multiprocessing_child"] = True
    try:
        with open(os.environ["BENCH_PROCESS_LOG"], "a") as log:
            log.write(json.dumps(row) + "\n")  # one write of a short line: whole, beside other processes'
    except OSError:
        pass  # a process whose files are gone (a test's tmp dir removed under it) is not worth a traceback


if os.environ.get("BENCH_PROCESS_LOG"):
    atexit.register(_write)
