"""Dagster entry point: every asset, check, job, schedule and resource under ``vlm_assets/defs``."""

import atexit
import gc
from pathlib import Path

import dagster as dg

from vlm_assets.defs.platform.profiles import check_profile_claimed

# A Dagster process that loaded these definitions (the CLI, a run worker, the code server) ends
# holding torch, transformers and MLflow: the interpreter's last garbage collections would walk all of
# their objects (1-3 s of a core), for memory the exit frees anyway and for the finalizers of objects
# left in reference cycles, which nothing here relies on; Python has no switch to skip them. Frozen
# objects are left out of them; exit handlers registered later run before this one.
atexit.register(gc.freeze)


@dg.definitions
def defs() -> dg.Definitions:
    """Load the definitions of every module under ``vlm_assets``, then check that each profile key is claimed."""
    loaded = dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    check_profile_claimed()  # every config class is imported by now
    return loaded
