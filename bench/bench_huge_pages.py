"""torch's CPU tensors on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``) against 4 KiB pages: the first
touch of a fresh tensor the size of the demo GPT's logits, and that GPT's loss on it, each in a fresh process.

    python bench/bench_huge_pages.py                  # 5 fresh processes per setting, alternating
    python bench/bench_huge_pages.py --repeat 9 --write
    python bench/bench_huge_pages.py --main-job 2 --kernels avx2 --write   # and 2 demo main_jobs each, alternating

A fresh process is what each trainer, check and evaluation of the graph is: its large tensors are new memory.
The tensor is the size of the logits of the GPT export check's batch (8 x 256 tokens over GPT-2's 50,257); the
loss is a linear head and a cross entropy over such logits, as the GPT's last layer computes them.
Each row's figures are medians over the processes of that setting; both settings alternate in one run.
With ``--main-job N`` it also runs the demo's ``main_job`` N times per setting on fresh homes (the job and
its training workers all with the setting), alternating, and reports each step's median.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import bench_speed
import results_file

TOKENS, VOCAB, WIDTH = 8 * 256, 50_257, 64
CHILD = f"""
import json, time, torch
torch.manual_seed(0)
x, w = torch.randn({TOKENS}, {WIDTH}), torch.randn({VOCAB}, {WIDTH})
y = torch.randint(0, {VOCAB}, ({TOKENS},))
t = time.perf_counter(); torch.empty({TOKENS} * {VOCAB}).fill_(1.0); fill = time.perf_counter() - t
t = time.perf_counter(); torch.nn.functional.cross_entropy(x @ w.T, y); loss = time.perf_counter() - t
t = time.perf_counter(); torch.nn.functional.cross_entropy(x @ w.T, y); again = time.perf_counter() - t
print(json.dumps({{"fill": fill, "loss": loss, "loss_again": again}}))
"""


def page_reporting_order() -> str:
    """The kernel's free page reporting order (free blocks of 2^order pages go back to the hypervisor), if any."""
    path = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    try:
        return path.read_text().strip()
    except OSError:
        return "none"


def one(thp: str) -> dict:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": thp, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per setting")
    parser.add_argument("--main-job", type=int, default=0, metavar="N", help="demo main_jobs per setting")
    parser.add_argument("--kernels", default="native", choices=sorted(results_file.KERNELS), help="for --main-job")
    parser.add_argument("--write", action="store_true", help="write bench/results/huge-pages_<machine>_<date>.*")
    args = parser.parse_args()
    if args.repeat < 1 or args.main_job < 0:
        parser.error("--repeat must be at least 1 and --main-job at least 0")
    head = results_file.header("bench/bench_huge_pages.py " + " ".join(sys.argv[1:]))  # the code as it began
    runs: dict[str, list[dict]] = {"1": [], "0": []}
    for _ in range(args.repeat):
        for thp in runs:
            runs[thp].append(one(thp))
    medians = {thp: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for thp, rows in runs.items()}
    thp_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    names = {
        "fill": "first touch of the tensor",
        "loss": "head + cross entropy, first",
        "loss_again": "the same, again",
    }
    lines = [
        f"{TOKENS} tokens x {VOCAB} vocabulary = {TOKENS * VOCAB * 4 / 2**20:.0f} MiB per fresh tensor, one thread; "
        f"medians over {args.repeat} fresh processes per setting, alternating. Kernel free page reporting order: "
        f"{page_reporting_order()} (kernel THP setting: {thp_mode}).",
        "",
        "| seconds | huge pages (THP_MEM_ALLOC_ENABLE=1) | 4 KiB pages (=0) | huge / 4 KiB |",
        "|---|---:|---:|---:|",
        *(
            f"| {names[k]} | {medians['1'][k]:.3f} | {medians['0'][k]:.3f} | {medians['1'][k] / medians['0'][k]:.2f} |"
            for k in names
        ),
    ]
    jobs: dict[str, list[dict]] = {"1": [], "0": []}
    for i in range(args.main_job):
        for thp in jobs if i % 2 == 0 else reversed(jobs):
            print(f"== main_job, THP_MEM_ALLOC_ENABLE={thp} ({i + 1} of {args.main_job})", flush=True)
            kernels = results_file.KERNELS[args.kernels]
            jobs[thp].append(bench_speed.main_job(bench_speed.REPO, kernels, huge_pages=thp == "1"))
    if args.main_job:
        steps = sorted(jobs["1"][0]["steps"], key=lambda s: -jobs["1"][0]["steps"][s])
        job_median = {thp: statistics.median(r["seconds"] for r in rows) for thp, rows in jobs.items()}

        def step_median(thp: str, step: str) -> float:
            return statistics.median(r["steps"].get(step, float("nan")) for r in jobs[thp])

        lines += [
            "",
            f"The demo's `main_job` on fresh homes, {args.kernels} kernels, {args.main_job} per setting, alternating "
            "(each run's seconds in the json):",
            "",
            "| seconds, median | huge pages | 4 KiB pages | huge / 4 KiB |",
            "|---|---:|---:|---:|",
            f"| main_job | {job_median['1']:.0f} | {job_median['0']:.0f} | {job_median['1'] / job_median['0']:.2f} |",
            *(
                f"| {step} | {step_median('1', step):.1f} | {step_median('0', step):.1f} | "
                f"{step_median('1', step) / step_median('0', step):.2f} |"
                for step in steps
                if step_median("0", step) >= 1
            ),
        ]
    print("\n".join(lines))
    if args.write:
        print(
            results_file.write(
                "huge-pages", head, "\n".join(lines), {"runs": runs, "medians": medians, "main_jobs": jobs}
            )
        )


if __name__ == "__main__":
    main()
