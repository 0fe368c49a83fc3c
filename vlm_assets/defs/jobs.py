"""The job that materializes the whole graph, its schedule, and one job per trainer. The active
profile is in the config defaults (``vlm_assets.defs.platform.profiles``), so no job needs run config
of its own."""

import dagster as dg

from vlm_assets.defs.platform.environment import schedule_cron, schedule_job

_default = dg.multi_or_in_process_executor
# Dagster's default executor with the other default: a job's steps run in its run's process unless the run
# config says `execution: {config: {multiprocess: {}}}`. Steps are either quick or launch their own worker
# processes, and a process per step would add ~2 s of imports to each (a cache hit of one asset: 5.3 s
# -> 3.0 s, bench/bench_cache_hit.py). A launch asks whether its run is canceled, so Terminate still
# stops a training step (`run_canceled`). Dagster's executor takes no default to override, hence the copy.
in_process_unless_configured = dg.ExecutorDefinition(
    name="in_process_unless_configured",
    config_schema=dg.Field(_default.config_schema.as_field().config_type, default_value={"in_process": {}}),
    executor_creation_fn=_default.executor_creation_fn,
    requirements=_default.get_requirements,
    description="Dagster's multi_or_in_process_executor, in process unless the run config picks multiprocess.",
)


@dg.definitions
def jobs() -> dg.Definitions:
    """Return the jobs (the whole graph, ``token_chunks``, one per trainer) and the main schedule."""
    # token_chunks is partitioned (one run per partition or batch of them, by backfill): a job's assets
    # share one partitions definition, so it has its own job and the graph's job leaves it out.
    main_job = dg.define_asset_job(
        "main_job",
        selection=dg.AssetSelection.all() - dg.AssetSelection.assets("token_chunks"),
        description="Materializes the whole graph but token_chunks (backfilled); unchanged assets are cache hits.",
    )
    token_chunks_job = dg.define_asset_job(
        "token_chunks_job",
        selection=dg.AssetSelection.assets("token_chunks"),
        description="token_chunks, one partition a run: `dagster job backfill -j token_chunks_job --all`.",
    )
    # A trainer and the data it reads, e.g. `dagster job execute -j gpt_job`; a model it builds on
    # (`backbone_asset: visualchat_model`, `decoder_asset: gpt_checkpoint`) is read from its latest materialization.
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
    jobs = {job.name: job for job in (main_job, token_chunks_job, *trainer_jobs)}
    main_schedule = dg.ScheduleDefinition(
        name="main_schedule",
        job=jobs[schedule_job(list(jobs))],
        cron_schedule=schedule_cron(),
        default_status=dg.DefaultScheduleStatus.STOPPED,
    )
    return dg.Definitions(jobs=list(jobs.values()), schedules=[main_schedule], executor=in_process_unless_configured)
