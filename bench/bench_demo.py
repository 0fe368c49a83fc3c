"""The demo's quality and time, as bench/results/demo_* record them: `main_job` on a fresh embedded default, its
memoized rerun, and the two models trained again with other seeds.

    python bench/bench_demo.py                   # training seeds 7 (the demo's), 8 and 9, fresh temp home
    python bench/bench_demo.py --seeds 7 --home /tmp/demo-home
    python bench/bench_demo.py --write           # also bench/results/demo_<machine>_<date>.{md,json}
    python bench/bench_demo.py --seeds 7 --baseline REV --write   # and an earlier commit's time beside it

A training seed is the seed of both trained models of the demo: `visualchat_model` (blend, split, data
order, LoRA and projection init) and `occlusion_adapter` (init, data order); the data (manifests, token
shards) and the GPT stay the same (cache hits after the first run). For each seed it prints the eval
report (1,000 validation images: clean, occluded without the adapter, with it, each with its 95 % Wilson
interval), the adapter's paired gain with its 95 % paired-bootstrap interval and exact McNemar p-value,
the share of the occlusion gap recovered, and the VisualChat VQA exact match (asked the template's
prompt and held-out phrasings, with intervals), then the job times. The first seed's run is the README's
first command (`scripts/demo.sh` runs the same job after installing).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
DEMO_SEED = 7  # the demo's own run, the profile's defaults: the adapter's seed 7 (VisualChat's 0)


def execute(env: dict, config: Path | None, code: Path = REPO, huge_pages: bool | None = None) -> tuple[float, str]:
    """Wall seconds and log of one `dagster job execute -j main_job` of the checkout ``code``.

    ``huge_pages`` sets THP_MEM_ALLOC_ENABLE for the job and its workers; None runs it as the checkout's own
    scripts do (on only where its bootstrap exports it).
    """
    command = [sys.executable, "-m", "dagster", "job", "execute", "-m", "vlm_assets.definitions", "-j", "main_job"]
    env = {**env, "PYTHONPATH": str(code)}
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if huge_pages is None:
        huge_pages = "export THP_MEM_ALLOC_ENABLE" in (code / "scripts" / "bootstrap.sh").read_text()
    if huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    started = time.perf_counter()
    proc = subprocess.run(
        command + (["-c", str(config)] if config else []), cwd=code, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"main_job failed ({proc.returncode}) after {seconds:.0f} s:\n{(proc.stdout + proc.stderr)[-5000:]}")
    return seconds, proc.stdout + proc.stderr


def step_seconds(log: str) -> dict[str, float]:
    """Each step's own time, as Dagster logged it ("Finished execution of step X in 2m20s" / "6.26s" / "659ms")."""
    times = {}
    for step, minutes, seconds, millis in re.findall(
        r'Finished execution of step "(\w+)" in (?:(\d+)m)?(?:([\d.]+)s)?(?:([\d.]+)ms)?\.', log
    ):
        times[step] = 60 * float(minutes or 0) + float(seconds or 0) + float(millis or 0) / 1000
    return times


def fresh_home(home: Path) -> dict:
    """The environment of a main_job on the embedded default under ``home`` (demo profile)."""
    (home / "dagster").mkdir(parents=True, exist_ok=True)
    (home / "dagster" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    env = {
        **os.environ,
        "VLM_ASSETS_HOME": str(home),
        "DAGSTER_HOME": str(home / "dagster"),
        "VLM_ASSETS_PROFILE": "demo",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def newest(home: Path, asset: str) -> Path:
    """The artifact directory of ``asset`` committed last."""
    done = sorted((home / "artifacts" / asset).glob("*/_COMPLETE.json"), key=lambda p: p.stat().st_mtime)
    return done[-1].parent


def pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def interval(low: float, high: float, signed: bool = False) -> str:
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"[{fmt.format(100 * low)}, {fmt.format(100 * high)}]"


# The demo's gates (eval_assets.py and the demo profile): the gain's 95 % interval above min_gain, the
# VQA exact match's Wilson lower bound at least min_exact_match.
MIN_GAIN, MIN_EXACT_MATCH = 0.0, 0.3


def quality_markdown(rows: list[tuple[int, dict, dict]]) -> str:
    """The eval report's and VisualChat's figures per training seed, with intervals and the gates' margins."""
    lines = [
        "| training seed | images | clean | occluded, identity | occluded, adapter | gain [95% CI] | McNemar p "
        "| gain gate margin |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seed, r, _ in rows:
        low, high = r["adapter_gain_ci95"]
        lines.append(
            f"| {seed} | {r['num_samples']} | {pct(r['accuracy_clean'])} {interval(*r['accuracy_clean_ci95'])} "
            f"| {pct(r['accuracy_identity'])} {interval(*r['accuracy_identity_ci95'])} "
            f"| {pct(r['accuracy_adapter'])} {interval(*r['accuracy_adapter_ci95'])} "
            f"| {100 * r['adapter_gain']:+.1f} pts {interval(low, high, signed=True)} "
            f"| {r['adapter_gain_p_value']:.2g} | {100 * (low - MIN_GAIN):+.1f} pts |"
        )
    lines += [
        "",
        "| training seed | VisualChat VQA asked | images | exact match [95% CI] | chance | VQA gate margin |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for seed, _, chat in rows:
        for name, result in chat["vqa"].items():
            lines.append(
                f"| {seed} | {name.replace('_', ' ')} | {result['num_images']} | {pct(result['exact_match'])} "
                f"{interval(*result['ci95'])} | {pct(chat['chance'])} "
                f"| {100 * (result['ci95'][0] - MIN_EXACT_MATCH):+.1f} pts |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9], help="adapter training seeds")
    parser.add_argument("--home", type=Path, default=None, help="VLM_ASSETS_HOME (default: a fresh temp dir)")
    parser.add_argument("--write", action="store_true", help="write bench/results/demo_<machine>_<date>.{md,json}")
    parser.add_argument(
        "--baseline", help="first time an earlier commit's first main_job on this machine (bench_speed.py's way)"
    )
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="bench-demo-"))
    env = fresh_home(home)

    rows, times, steps = [], {}, {}
    if args.baseline:
        import bench_speed

        code = bench_speed.worktree(args.baseline)
        try:
            old = bench_speed.main_job(code, {})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(code)], cwd=REPO, capture_output=True)
        name = f"main_job of {args.baseline} (first run, fresh home)"
        times[name], steps[name] = old["seconds"], old["steps"]
    fresh = not (home / "artifacts").exists()  # a home an earlier bench filled: data and GPT are cache hits
    for n, seed in enumerate(args.seeds):
        config = None
        if seed != DEMO_SEED:
            config = home / f"seed-{seed}.yaml"
            runs = {"visualchat_model": {"config": {"seed": seed}}, "occlusion_adapter": {"config": {"seed": seed}}}
            config.write_text(json.dumps({"ops": runs}))
        name = f"main_job, training seed {seed}" + (
            " (first run, fresh home)" if n == 0 and fresh else " (data and GPT cached)"
        )
        times[name], log = execute(env, config)
        if args.baseline and n == 0 and fresh:
            times[f"{name} / baseline's"] = times[name] / times[f"main_job of {args.baseline} (first run, fresh home)"]
        steps[name] = step_seconds(log)
        if n == 0:
            times["main_job rerun (every asset a cache hit)"], _ = execute(env, None)
        report = json.loads((newest(home, "eval_report") / "eval.json").read_text())
        chat = json.loads((newest(home, "visualchat_model") / "eval.json").read_text())
        rows.append((seed, report, chat))

    step_names = list(dict.fromkeys(step for run in steps.values() for step in run))
    markdown = "\n".join(
        [
            "Accuracies on the validation images with 95 % Wilson intervals; the adapter's gain is paired (the"
            " same images) with its 95 % paired-bootstrap interval. A gate's margin is its interval's lower"
            f" bound minus the threshold (gain > {MIN_GAIN:.0%}, VQA >= {MIN_EXACT_MATCH:.0%}).",
            "",
            quality_markdown(rows),
            "",
            "| run | seconds (a ratio where named) |",
            "|---|---:|",
            *(f"| {name} | {seconds:.{2 if '/' in name else 1}f} |" for name, seconds in times.items()),
            "",
            "| step (s) | " + " | ".join(steps) + " |",
            "|---|" + "---:|" * len(steps),
            *(
                f"| {step} | " + " | ".join(f"{run.get(step, float('nan')):.1f}" for run in steps.values()) + " |"
                for step in step_names
            ),
        ]
    )
    print(f"\nhome {home}\n\n{markdown}")
    if args.write:
        data = {"seeds": [{"seed": s, "eval_report": r, "visualchat": c} for s, r, c in rows], "times": times}
        if args.baseline:  # the commit it named, which a later HEAD~5 no longer does
            rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=REPO, capture_output=True, text=True)
            data["baseline"] = rev.stdout.strip()
        path = results_file.write(
            "demo",
            results_file.header(" ".join(["bench/bench_demo.py", *sys.argv[1:]])),
            markdown,
            {**data, "steps": steps},
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
