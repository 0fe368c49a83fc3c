"""The job that materializes the whole graph and its schedule. The active profile is in the config
defaults (``vlm_assets.defs.platform.profiles``), so the job needs no run config of its own."""

import dagster as dg


@dg.definitions
def jobs() -> dg.Definitions:
    main_job = dg.define_asset_job(
        "main_job",
        selection=dg.AssetSelection.all(),
        description="Materializes the whole graph; unchanged assets are cache hits.",
        # Steps are either quick or launch their own worker processes: one process per step would
        # only add ~3 s of imports each on a small machine.
        executor_def=dg.in_process_executor,
    )
    main_schedule = dg.ScheduleDefinition(
        name="main_schedule", job=main_job, cron_schedule="0 3 * * *",
        default_status=dg.DefaultScheduleStatus.STOPPED,
    )
    return dg.Definitions(jobs=[main_job], schedules=[main_schedule])
