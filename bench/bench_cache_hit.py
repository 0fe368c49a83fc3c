"""What a user waits for: `dagster asset materialize --select occlusion_manifests`, first build and cache hit.

    python bench/bench_cache_hit.py [--runs 3] [--executor default multiprocess]

The command a user types, on every image of Fashion-MNIST as its official idx files hold them (60,000
train + 10,000 test: ``num_train`` / ``num_validation`` unset), in a fresh Dagster home and artifact
store, under the location's default executor (the step in the run's process) and under Dagster's
multiprocess one (a process per step: ``execution: {config: {multiprocess: {}}}``). Each run: the
first build, then the same command again (a cache hit). Beside the command's wall time, the step's
own time (its ``seconds`` metadata), so the table shows what the command adds around the work.
Every check runs in the asset's step (``check_specs``), not as a step process of its own.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"ops": {"occlusion_manifests": {"config": {"num_train": None, "num_validation": None}}}}


def materialize(env: dict[str, str], executor: str) -> tuple[float, float, int]:
    """Wall seconds of the command, the step's own seconds, and how many checks passed."""
    config = {**CONFIG, "execution": {"config": {executor: {}}}} if executor != "default" else CONFIG
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "vlm_assets.definitions"]
        + ["--select", "occlusion_manifests", "--config-json", json.dumps(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"dagster asset materialize failed:\n{log[-4000:]}")
    passed = len(re.findall(r"Asset check '\w+' on 'occlusion_manifests' passed", log))
    value, unit = re.findall(r'Finished execution of step "occlusion_manifests" in ([\d.]+)(m?s)', log)[-1]
    return wall, float(value) / (1000 if unit == "ms" else 1), passed


def fresh_home(home: Path) -> dict[str, str]:
    (home / "dagster").mkdir()
    (home / "dagster" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    env = {**os.environ, "VLM_ASSETS_HOME": str(home / "home"), "DAGSTER_HOME": str(home / "dagster")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return {**env, "VLM_ASSETS_PROFILE": "demo"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--executor", nargs="+", default=["default", "multiprocess"], choices=["default", "multiprocess"]
    )
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float, int]]] = {
        f"{what} ({executor})": [] for executor in args.executor for what in ("first build", "cache hit")
    }
    for run in range(args.runs):
        for executor in args.executor:
            with tempfile.TemporaryDirectory() as tmp:  # a fresh Dagster home and store each
                env = fresh_home(Path(tmp))
                rows[f"first build ({executor})"].append(materialize(env, executor))
                rows[f"cache hit ({executor})"].append(materialize(env, executor))
        print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} s" for k, v in rows.items()), flush=True)
    print(f"\n`dagster asset materialize --select occlusion_manifests`, 70,000 Fashion-MNIST images, {args.runs} runs")
    print("\n| command | wall s (median) | min-max | the step's own s | around the step | checks passed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in rows.items():
        walls, steps = [v[0] for v in values], [v[1] for v in values]
        wall, step = statistics.median(walls), statistics.median(steps)
        print(
            f"| {name} | {wall:.1f} | {min(walls):.1f}-{max(walls):.1f} | {step:.2f} | {wall - step:.1f} "
            f"| {min(v[2] for v in values)} of 4 |"
        )


if __name__ == "__main__":
    main()
