"""Launching multi-process, multi-node training jobs (no dagster imports)."""

from vlm_assets.launch.local import LaunchFailed, run_local
from vlm_assets.launch.spec import LaunchSpec

__all__ = ["LaunchFailed", "LaunchSpec", "run_local"]
