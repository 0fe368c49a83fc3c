"""Dagster entry point: every asset, check, job, schedule and resource under ``vlm_assets/defs``."""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
