"""This checkout against an earlier commit, side by side on this machine: the first `main_job` on a fresh
embedded default (wall time and each step's) and, with ``--suite``, the whole CPU test suite, once per
kernel set (``native``; ``avx2`` makes an AVX-512 CPU use its AVX2 kernels, as the slowest machines of
this kind do). Ratios are new / old in the same run. Each suite runs in the lanes its commit's
scripts/test.sh runs at once, with ``bench_suite_cpu.py`` as a plugin; the machine's busy core-seconds and
floor over the whole run say whether a change cut work or only idle time.

    python bench/bench_speed.py --baseline REV                    # main_job, native kernels
    python bench/bench_speed.py --baseline REV --kernels native avx2 --suite --write
    python bench/bench_speed.py --baseline REV --kernels avx2 --repeat 3 --write   # main_job's spread
    python bench/bench_speed.py --baseline REV --kernels avx2 --suite --repeat 0 --write   # the suites only

The earlier commit is checked out into a temporary git worktree and runs on this checkout's virtual
environment (its code first on PYTHONPATH), so only the code differs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_demo
import bench_suite_cpu
import results_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-speed-")) / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True, capture_output=True)
    return path


def main_job(code: Path, kernels: dict, huge_pages: bool | None = None) -> dict:
    """A fresh home's first main_job run of ``code``: wall seconds and each step's, and the gates' figures."""
    with tempfile.TemporaryDirectory(prefix="bench-speed-home-") as tmp:
        home = Path(tmp)
        env = {**bench_demo.fresh_home(home), **kernels}
        seconds, log = bench_demo.execute(env, None, code, huge_pages)
        report = bench_demo.newest(home, "eval_report") / "eval.json"
        chat = bench_demo.newest(home, "visualchat_model") / "eval.json"
        r, c = json.loads(report.read_text()), json.loads(chat.read_text())
    return {
        "seconds": seconds,
        "steps": bench_demo.step_seconds(log),
        "gain_ci95_low": r["adapter_gain_ci95"][0],
        "vqa_ci95_low": c["vqa"]["template"]["ci95"][0],
    }


def capability(kernels: dict) -> str:
    """The CPU kernels torch picks in a process with ``kernels``' environment (the header's are this process's)."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    proc = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **kernels}, capture_output=True, text=True)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def lanes(code: Path) -> list[list[str]]:
    """The pytest selections that ``code``'s scripts/test.sh runs at once: the main lane and the tests marked
    `beside` where its pyproject.toml declares that marker, else the one selection."""
    if '"beside:' in (code / "pyproject.toml").read_text():
        return [["-m", "not gpu and not beside"], ["-m", "not gpu and beside"]]
    return [["-m", "not gpu"]]


def suite(code: Path, kernels: dict) -> dict:
    """Wall seconds of the CPU suite of ``code`` (its own tests, this environment, in its lanes), its closing
    lines, and the machine's busy core-seconds and floor from start to end (this checkout's plugin in both runs)."""
    selections = [[*lane, "-rfE"] for lane in lanes(code)]
    pythonpath = [str(code), str(HERE)]
    started = time.perf_counter()
    runs = [lane.run for lane in bench_suite_cpu.run_at_once(code, kernels, selections, pythonpath)[0]]
    seconds = time.perf_counter() - started
    summary, failures, returncode = [], [], 0
    for run in runs:
        summary.append(last := bench_suite_cpu.last_line(run.proc))
        # -rfE's short summary: one line per failed or erroring test, with the first line of its error
        failures += [line for line in run.proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        if run.proc.returncode != 0:
            returncode = returncode or run.proc.returncode
            log = bench_suite_cpu.save_output(run.proc, "bench_speed-suite-")
            print(f"the suite of {code} failed ({last}); pytest's whole output: {log}", file=sys.stderr)
    busy = runs[0].busy_core_s  # machine-wide: the same figure for lanes that ran at once
    return {
        "seconds": seconds,
        "returncode": returncode,
        "summary": " / ".join(summary),
        "lanes": [" ".join(s) for s in selections],
        "failures": failures,
        "busy_core_s": busy,
        "floor_s": busy / (os.cpu_count() or 1),
        "tests": [row for run in runs for row in run.tests],
        "processes": bench_suite_cpu.by_kind([p for run in runs for p in run.processes]),
    }


def busiest(old: list[dict], new: list[dict], top: int = 12) -> list[str]:
    """A table of this checkout's ``top`` tests by busy core-seconds, each beside the same test's in the old run."""
    before = {r["test"]: r for r in old}
    lines = [
        f"This checkout's {top} tests with the most busy core-seconds (the old run's where it has the test;"
        " the machine's, so a test's figure includes what a lane beside it used):",
        "",
    ]
    lines += ["| test | busy core-s, old | busy core-s, new | wall (s), new |", "|---|---:|---:|---:|"]
    for r in sorted(new, key=lambda r: -r["busy_core_s"])[:top]:
        was = f"{before[r['test']]['busy_core_s']:.0f}" if r["test"] in before else "-"
        lines.append(f"| `{r['test']}` | {was} | {r['busy_core_s']:.0f} | {r['wall_s']:.0f} |")
    return [*lines, ""]


def report(results: dict, ran: dict) -> str:
    """The markdown of ``main``'s measurements: per kernel set, old against new with their ratios.

    How many times ``main_job`` ran and whether the suites ran are read from the measurements themselves.
    """
    lines = []
    for kernel, by_code in results.items():
        (old_name, old), (new_name, new) = by_code.items()
        repeat, with_suite = len(new["main_job_seconds"]), "suite" in new
        env = " ".join(f"{k}={v}" for k, v in results_file.KERNELS[kernel].items()) or "no override"
        lines += [f"## {kernel} kernels", "", f"Both runs' processes: {env}; torch ran its {ran[kernel]} kernels.", ""]
        runs = old["main_job_seconds"], new["main_job_seconds"]
        if repeat > 1:
            each = " ".join(f"{b / a:.2f}" for a, b in zip(*runs, strict=True))
            lines += [
                f"main_job ran {repeat} times per commit, old and new in turn (each a fresh home's first run):"
                f" its row is the median; the steps and the gates are each commit's first run. Each pair's new /"
                f" old: {each}; each run (s), old: {', '.join(f'{x:.0f}' for x in runs[0])}; new:"
                f" {', '.join(f'{x:.0f}' for x in runs[1])}.",
                "",
            ]
        lines += [f"| | {old_name} | {new_name} | new / old |", "|---|---:|---:|---:|"]
        pairs = []
        if repeat:
            pairs.append(("main_job, first run (s)", statistics.median(runs[0]), statistics.median(runs[1])))
            for step in dict.fromkeys([*old["main_job"]["steps"], *new["main_job"]["steps"]]):
                pairs.append((f"  {step} (s)", old["main_job"]["steps"].get(step), new["main_job"]["steps"].get(step)))
        if with_suite:
            pairs.append(("test suite (s)", old["suite"]["seconds"], new["suite"]["seconds"]))
            pairs.append(("  busy core-seconds", old["suite"]["busy_core_s"], new["suite"]["busy_core_s"]))
            pairs.append(("  floor: busy core-seconds / cores (s)", old["suite"]["floor_s"], new["suite"]["floor_s"]))
        for label, a, b in pairs:
            ratio = f"{b / a:.2f}" if a and b else "-"
            lines.append(f"| {label} | {a or 0:.1f} | {b or 0:.1f} | {ratio} |")
        gates = (("gain's 95 % lower bound", "gain_ci95_low"), ("VQA 95 % lower bound", "vqa_ci95_low"))
        for label, key in gates if repeat else ():
            lines.append(
                f"| {label} | {100 * old['main_job'][key]:+.1f} pts | {100 * new['main_job'][key]:+.1f} pts | |"
            )
        if with_suite:
            lines.append(f"| suite's last line | {old['suite']['summary']} | {new['suite']['summary']} | |")
        lines.append("")
        if with_suite:
            for name, run in ((old_name, old), (new_name, new)):
                if run["suite"].get("failures"):
                    lines += [f"{name}'s failed tests:", "", *(f"- `{f}`" for f in run["suite"]["failures"]), ""]
            if new["suite"]["tests"]:
                lines += busiest(old["suite"]["tests"], new["suite"]["tests"])
            for name, run in ((old_name, old), (new_name, new)):
                if run["suite"]["processes"]:  # a suite that crashed early may have logged none
                    kinds = bench_suite_cpu.kinds_markdown(run["suite"]["processes"], run["suite"]["busy_core_s"])
                    lines += [f"{name}:", "", *kinds, ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--kernels", nargs="+", default=["native"], choices=sorted(results_file.KERNELS))
    parser.add_argument("--suite", action="store_true", help="also time the whole CPU test suite of both")
    parser.add_argument(
        "--repeat", type=int, default=1, help="main_job runs per commit, old and new in turn (0: the suites only)"
    )
    parser.add_argument("--write", action="store_true", help="write bench/results/speed_<machine>_<date>.{md,json}")
    args = parser.parse_args()
    if args.repeat < 0 or (args.repeat == 0 and not args.suite):
        parser.error(f"--repeat: at least 1 run per commit, or 0 with --suite; not {args.repeat}")
    avx512 = any(v.startswith("avx512") for v in results_file.cpu()["vector_extensions"])
    if "avx2" in args.kernels and not avx512:
        print("this CPU has no AVX-512: its native kernels are the AVX2 ones; measuring `native` only")
        args.kernels = sorted(set(args.kernels) - {"avx2"} | {"native"})
    # The header names the code as it was when the runs began: a commit made during them ran nowhere.
    head = results_file.header(" ".join(["bench/bench_speed.py", *sys.argv[1:]]))
    baseline = worktree(args.baseline)
    rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=REPO, capture_output=True, text=True)
    codes = {f"baseline {rev.stdout.strip()[:10]}": baseline, "this checkout": REPO}
    results: dict = {}
    ran = {kernel: capability(results_file.KERNELS[kernel]) for kernel in args.kernels}
    try:
        for kernel in args.kernels:
            by_code = results.setdefault(kernel, {name: {"main_job_seconds": []} for name in codes})
            # old and new in turn, so that a slow spell of a shared machine falls on both
            for i in range(args.repeat):
                for name, code in codes.items():
                    print(f"== {kernel} kernels, {name}: main_job ({i + 1} of {args.repeat})", flush=True)
                    run = main_job(code, results_file.KERNELS[kernel])
                    by_code[name].setdefault("main_job", run)
                    by_code[name]["main_job_seconds"].append(run["seconds"])
            if args.suite:
                for name, code in codes.items():
                    print(f"== {kernel} kernels, {name}: suite", flush=True)
                    by_code[name]["suite"] = suite(code, results_file.KERNELS[kernel])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, capture_output=True)

    markdown = report(results, ran)
    print(markdown)
    if args.write:
        data = {"baseline": rev.stdout.strip(), "kernels_ran": ran, "results": results}
        print(f"wrote {results_file.write('speed', head, markdown, data)}")


if __name__ == "__main__":
    main()
