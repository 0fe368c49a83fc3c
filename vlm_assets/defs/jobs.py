"""The job that materializes the whole graph, its schedule, and one job per trainer. The active
profile is in the config defaults (``vlm_assets.defs.platform.profiles``), so no job needs run config
of its own."""

import dagster as dg

from vlm_assets.defs.platform.environment import schedule_cron, schedule_job


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
    # A trainer and the data it reads, e.g. `dagster job execute -j gpt_job`; a model it builds on
    # (`backbone_asset: visualchat_model`, `decoder_asset: gpt_checkpoint`) is read from its latest materialization.
    # Dagster's default executor: multiprocess unless the run config says
    # `execution: {config: {in_process: {}}}`.
    trainer_jobs = [
        dg.define_asset_job(
            f"{name}_job",
            selection=dg.AssetSelection.assets(asset, data),
            description=f"Materializes {asset} and the data it trains on.",
        )
        for name, asset, data in (
            ("gpt", "gpt_checkpoint", "token_shards"),
            ("adapter", "occlusion_adapter", "occlusion_manifests"),
            ("visualchat", "visualchat_model", "occlusion_manifests"),
        )
    ]
    jobs = {job.name: job for job in (main_job, *trainer_jobs)}
    main_schedule = dg.ScheduleDefinition(
        name="main_schedule",
        job=jobs[schedule_job(list(jobs))],
        cron_schedule=schedule_cron(),
        default_status=dg.DefaultScheduleStatus.STOPPED,
    )
    return dg.Definitions(jobs=list(jobs.values()), schedules=[main_schedule])
