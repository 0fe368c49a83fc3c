"""Dagster entry point: every asset, check, job, schedule and resource under ``vlm_assets/defs``."""

from pathlib import Path

import dagster as dg

from vlm_assets.defs.platform.pool_wait import sleep_while_waiting_for_pool_slots
from vlm_assets.defs.platform.profiles import check_profile_claimed
from vlm_assets.launch.lifeline import freeze_at_exit

# A Dagster process that loaded these definitions (the CLI, a run worker, the code server) ends holding
# torch, transformers and MLflow.
freeze_at_exit()
sleep_while_waiting_for_pool_slots()


@dg.definitions
def defs() -> dg.Definitions:
    """Load the definitions of every module under ``vlm_assets``, then check that each profile key is claimed."""
    loaded = dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    check_profile_claimed()  # every config class is imported by now
    return loaded
