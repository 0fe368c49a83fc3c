"""Memoized rerun of the whole main job: wall time of the second `dagster job execute` vs the first.

    python bench/bench_memo.py

Both runs use a fresh embedded default in a temp dir (demo profile); the first builds every asset,
the second finds every artifact complete in the store and reports cache hits.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(env) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dagster", "job", "execute", "-m", "vlm_assets.definitions", "-j", "main_job"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - t, proc.stdout + proc.stderr


def step_seconds(log: str, step: str) -> str:
    for line in log.splitlines():
        if f'Finished execution of step "{step}" in' in line:
            return line.rsplit(" in ", 1)[1].rstrip(".")
    return "?"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "VLM_ASSETS_HOME": f"{tmp}/home",
            "DAGSTER_HOME": f"{tmp}/dagster",
            "VLM_ASSETS_PROFILE": "demo",
        }
        env.pop("MLFLOW_TRACKING_URI", None)
        Path(f"{tmp}/dagster").mkdir()
        Path(f"{tmp}/dagster/dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
        first, log1 = run(env)
        second, log2 = run(env)
    print("\nMain job (demo profile), `dagster job execute`, fresh embedded default\n")
    print("| run | wall s | occlusion_manifests step | token_shards step | cache hits |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, log in (("first (builds)", first, log1), ("second (memoized)", second, log2)):
        print(
            f"| {name} | {wall:.1f} | {step_seconds(log, 'occlusion_manifests')} | "
            f"{step_seconds(log, 'token_shards')} | {log.count('cache hit:')} |"
        )
    print(f"\nsecond / first = {second / first:.2f}")


if __name__ == "__main__":
    main()
