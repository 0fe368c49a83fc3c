"""Load every definition the way `dagster dev -w workspace.yaml` does, and pin what it contains."""

import dagster as dg

from vlm_assets.defs.jobs import profile_run_config
from vlm_assets.defs.platform.environment import profile, resources_for


def test_definitions_snapshot():
    from vlm_assets.definitions import defs

    definitions = defs()
    graph = definitions.resolve_asset_graph()
    assert sorted(k.to_user_string() for k in definitions.resolve_all_asset_keys()) == [
        "eval_report", "gpt_checkpoint", "occlusion_adapter", "occlusion_manifests", "registered_adapter", "token_shards"]
    assert sorted(c.name for c in graph.asset_check_keys) == [
        "adapter_accuracy_meets_threshold", "adapter_gain_non_negative", "adapter_training_complete",
        "adapter_weights_finite",
        "boxes_within_configured_bounds", "counts_match_config", "every_class_present_and_balanced",
        "every_image_readable", "every_shard_readable", "export_reproduces_val_loss", "token_counts_match_summary",
        "token_ids_within_vocab", "val_loss_beats_uniform"]
    assert all(spec.blocking for checks in definitions.asset_checks for spec in checks.check_specs)
    job = definitions.resolve_job_def("main_job")
    assert {n.name for n in job.nodes} >= {"occlusion_manifests", "token_shards", "gpt_checkpoint"}
    assert graph.get(dg.AssetKey("gpt_checkpoint")).parent_keys == {dg.AssetKey("token_shards")}
    assert graph.get(dg.AssetKey("registered_adapter")).parent_keys == {dg.AssetKey("eval_report"),
                                                                      dg.AssetKey("occlusion_adapter")}
    assert definitions.resolve_schedule_def("main_schedule").cron_schedule == "0 3 * * *"
    assert set(definitions.resources) >= {"artifact_store", "mlflow", "launcher"}


def test_environment_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path))
    local = resources_for({})
    assert local["artifact_store"].root == str(tmp_path / "artifacts")
    assert local["mlflow"].tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    s3 = resources_for({"VLM_ASSETS_STORE": "s3", "VLM_ASSETS_S3_BUCKET": "b", "AWS_ENDPOINT_URL": "http://x:9000"})
    assert s3["artifact_store"].bucket == "b" and s3["artifact_store"].s3.endpoint_url == "http://x:9000"
    for bad, message in (({"VLM_ASSETS_STORE": "gcs"}, "expected 'local' or 's3'"),
                         ({"VLM_ASSETS_STORE": "s3"}, "needs VLM_ASSETS_S3_BUCKET"),
                         ({"VLM_ASSETS_LAUNCHER": "slurm"}, "'local' launcher only")):
        try:
            resources_for(bad)
        except ValueError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"{bad} accepted")
    assert profile({"VLM_ASSETS_PROFILE": "seed"}) == "seed" and profile({}) == "demo"


def test_demo_profile_config_is_valid_for_the_job():
    from vlm_assets.definitions import defs

    job = defs().resolve_job_def("main_job")
    for name in ("demo", "seed"):
        dg.validate_run_config(job, profile_run_config(name))  # raises on a config the job rejects
