"""The job that materializes the whole graph, its schedule, and the run config of each profile."""

import dagster as dg
import pydantic

from vlm_assets.defs.platform.environment import profile
from vlm_assets.paths import offline_data_dir


def profile_run_config(name: str) -> dict:
    """Asset configs per profile. ``seed`` = the asset defaults (official CIFAR-10, wikitext-103, gpt2
    from the hub); ``demo`` = the real offline data of ``scripts/fetch-offline-data.sh`` at small scale."""
    if name == "seed":
        return {}
    data = offline_data_dir()
    return {
        "ops": {
            "occlusion_manifests": {"config": {
                "source": "fashion_mnist", "source_uri": str(data / "fashion-mnist"),
                "num_train": 2000, "num_validation": 500,
            }},
            "token_shards": {"config": {
                "source": "text_files", "text_glob": str(data / "shakespeare" / "*.txt"),
                "tokenizer": str(data / "gpt2-tokenizer"), "max_length": 128,
            }},
            # Two nodes of one process each (two torchrun agents on loopback), as a cluster would run it.
            "gpt_checkpoint": {"config": {
                "preset": "tiny", "strategy": "ddp", "num_nodes": 2, "nproc_per_node": 1,
                "micro_batch_size": 4, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "max_steps": 40,
                "val_check_interval": 20, "val_batches": 8, "checkpoint_every": 20, "log_every": 10,
            }},
            # A tiny Qwen2.5-VL that first learns the clean task (no hub here), then the adapter at 56 px
            # on 2 processes.
            "occlusion_adapter": {"config": {
                "backbone": "tiny-clean", "clean_backbone_steps": 400, "image_size": 56, "epochs": 3, "lr": 5e-3,
                "micro_batch_size": 8, "global_batch_size": 16, "nproc_per_node": 2, "num_train": 480,
            }},
            "eval_report": {"config": {"num_samples": 200, "batch_size": 50, "num_cards": 24}},
            # Check settings are the checks' own config: changing one re-runs the check, not the asset.
            "eval_report_adapter_accuracy_meets_threshold": {"config": {"min_accuracy": 0.3}},
        }
    }


def validated(run_config: dict) -> dict:
    """Every op config of ``run_config`` checked against its config model at definitions load, so a
    value that cannot be honoured fails here naming the op and the field, not hours into a run."""
    from vlm_assets.defs.data.occlusion_assets import OcclusionManifestsConfig
    from vlm_assets.defs.data.token_assets import TokenShardsConfig
    from vlm_assets.defs.models.adapter_assets import OcclusionAdapterConfig
    from vlm_assets.defs.models.eval_assets import AccuracyCheckConfig, EvalReportConfig
    from vlm_assets.defs.models.gpt_assets import GPTCheckpointConfig
    from vlm_assets.train.run_config import describe_validation_error

    models = {"occlusion_manifests": OcclusionManifestsConfig, "token_shards": TokenShardsConfig,
              "gpt_checkpoint": GPTCheckpointConfig, "occlusion_adapter": OcclusionAdapterConfig,
              "eval_report": EvalReportConfig, "eval_report_adapter_accuracy_meets_threshold": AccuracyCheckConfig}
    for op, entry in run_config.get("ops", {}).items():
        try:
            models[op].model_validate(entry.get("config", {}))
        except pydantic.ValidationError as err:
            raise ValueError(describe_validation_error(err, f"main_job config of {op}")) from None
    return run_config


@dg.definitions
def jobs() -> dg.Definitions:
    main_job = dg.define_asset_job(
        "main_job",
        selection=dg.AssetSelection.all(),
        config=validated(profile_run_config(profile())),
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
