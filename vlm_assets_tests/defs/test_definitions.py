"""Load every definition the way `dagster dev -w workspace.yaml` does, and pin what it contains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from vlm_assets.data.chat_formats import max_image_bytes
from vlm_assets.defs.platform.environment import (
    chunks_per_run,
    lease_settings,
    profile,
    resources_for,
    schedule_cron,
    schedule_job,
)
from vlm_assets.defs.platform.profiles import PROFILE_DIR, profile_defaults
from vlm_assets.paths import offline_data_dir
from vlm_assets.train.gpt_config import PretrainConfig


def test_definitions_snapshot():
    from vlm_assets.definitions import defs

    definitions = defs()
    graph = definitions.resolve_asset_graph()
    assert sorted(k.to_user_string() for k in definitions.resolve_all_asset_keys()) == [
        "eval_report",
        "gpt_checkpoint",
        "occlusion_adapter",
        "occlusion_manifests",
        "registered_adapter",
        "registered_visualchat",
        "token_chunks",
        "token_shards",
        "visualchat_model",
    ]
    assert sorted(c.name for c in graph.asset_check_keys) == [
        "adapter_accuracy_meets_threshold",
        "adapter_gain_significant",
        "adapter_training_complete",
        "adapter_weights_finite",
        "boxes_within_configured_bounds",
        "counts_match_config",
        "eval_loss_beats_untrained",
        "every_class_present_and_balanced",
        "every_image_readable",
        "every_shard_readable",
        "export_reproduces_val_loss",
        "merged_equals_unmerged",
        "token_counts_match_summary",
        "token_ids_within_vocab",
        "val_loss_beats_uniform",
        "vqa_exact_match_meets_threshold",
    ]
    # Every check is a blocking spec of its own asset's step: none runs in a step of its own.
    specs = [spec for asset in definitions.assets for spec in asset.check_specs]
    assert len(specs) == 16 and all(spec.blocking for spec in specs) and not definitions.asset_checks
    job = definitions.resolve_job_def("main_job")
    assert {n.name for n in job.nodes} >= {"occlusion_manifests", "token_shards", "gpt_checkpoint"}
    # the partitioned chunks are backfilled by a job of their own; token_shards merges all of them
    assert "token_chunks" not in {n.name for n in job.nodes}
    chunks_job = definitions.resolve_job_def("token_chunks_job")
    assert {n.name for n in chunks_job.nodes} == {"token_chunks"} and chunks_job.partitions_def.name == "token_chunks"
    assert graph.get(dg.AssetKey("token_shards")).parent_keys == {dg.AssetKey("token_chunks")}
    policy = graph.get(dg.AssetKey("token_chunks")).backfill_policy
    assert policy.max_partitions_per_run == chunks_per_run()  # the environment's, 1 unless it says
    assert graph.get(dg.AssetKey("gpt_checkpoint")).parent_keys == {dg.AssetKey("token_shards")}
    assert definitions.resolve_sensor_def("token_chunk_sensor").default_status == dg.DefaultSensorStatus.STOPPED
    assert graph.get(dg.AssetKey("registered_adapter")).parent_keys == {
        dg.AssetKey("eval_report"),
        dg.AssetKey("occlusion_adapter"),
    }
    # The lineage: token_shards -> gpt_checkpoint -> visualchat_model (its decoder) -> occlusion_adapter (its backbone).
    assert graph.get(dg.AssetKey("visualchat_model")).parent_keys == {
        dg.AssetKey("gpt_checkpoint"),
        dg.AssetKey("occlusion_manifests"),
    }
    assert graph.get(dg.AssetKey("occlusion_adapter")).parent_keys == {
        dg.AssetKey("visualchat_model"),
        dg.AssetKey("occlusion_manifests"),
    }
    assert graph.get(dg.AssetKey("registered_visualchat")).parent_keys == {dg.AssetKey("visualchat_model")}
    assert definitions.resolve_schedule_def("main_schedule").cron_schedule == "0 3 * * *"
    assert set(definitions.resources) >= {"artifact_store", "mlflow", "launcher"}


def test_environment_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path))
    local = resources_for({})
    assert local["artifact_store"].root == str(tmp_path / "artifacts")
    assert local["mlflow"].tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    s3 = resources_for({"VLM_ASSETS_STORE": "s3", "VLM_ASSETS_S3_BUCKET": "b", "AWS_ENDPOINT_URL": "http://x:9000"})
    assert s3["artifact_store"].bucket == "b" and s3["artifact_store"].endpoint_url == "http://x:9000"
    k8s = resources_for({"VLM_ASSETS_LAUNCHER": "k8s"})["launcher"]
    assert k8s.namespace == "vlm-training" and k8s.mode == "pods"
    (bad_yaml := tmp_path / "launcher.yaml").write_text("namespace: t\npending_timeout_s: 0\n")
    for bad, message in (
        ({"VLM_ASSETS_STORE": "gcs"}, "expected 'local' or 's3'"),
        ({"VLM_ASSETS_STORE": "s3"}, "needs VLM_ASSETS_S3_BUCKET"),
        ({"VLM_ASSETS_LAUNCHER": "slurm"}, "expected 'local' or 'k8s'"),
        (
            {"VLM_ASSETS_LAUNCHER": "k8s", "VLM_ASSETS_K8S_CONFIG": str(bad_yaml)},
            f"{bad_yaml}: field pending_timeout_s: Input should be greater than or equal to 1",
        ),
    ):
        try:
            resources_for(bad)
        except ValueError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"{bad} accepted")
    assert profile({"VLM_ASSETS_PROFILE": "seed"}) == "seed" and profile({}) == "demo"
    assert schedule_cron({}) == "0 3 * * *"
    assert schedule_cron({"VLM_ASSETS_SCHEDULE_CRON": "*/5 * * * *"}) == "*/5 * * * *"
    with pytest.raises(ValueError, match="VLM_ASSETS_SCHEDULE_CRON='every day'"):
        schedule_cron({"VLM_ASSETS_SCHEDULE_CRON": "every day"})
    jobs = ["main_job", "gpt_job"]
    assert schedule_job(jobs, {}) == "main_job"
    assert schedule_job(jobs, {"VLM_ASSETS_SCHEDULE_JOB": "gpt_job"}) == "gpt_job"
    with pytest.raises(ValueError, match="VLM_ASSETS_SCHEDULE_JOB='nightly_job': expected one of"):
        schedule_job(jobs, {"VLM_ASSETS_SCHEDULE_JOB": "nightly_job"})
    assert chunks_per_run({}) == 1 and chunks_per_run({"VLM_ASSETS_CHUNKS_PER_RUN": "16"}) == 16
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match=f"VLM_ASSETS_CHUNKS_PER_RUN='{bad}': expected a whole number"):
            chunks_per_run({"VLM_ASSETS_CHUNKS_PER_RUN": bad})
    assert lease_settings({}) == {"on_busy": "wait", "lease_ttl_s": 120.0}
    assert lease_settings({"VLM_ASSETS_ON_BUSY": "fail", "VLM_ASSETS_LEASE_TTL_S": "5"})["lease_ttl_s"] == 5.0
    for variable, bad in [("VLM_ASSETS_ON_BUSY", "skip"), *(("VLM_ASSETS_LEASE_TTL_S", v) for v in ("4", "nan", "2m"))]:
        with pytest.raises(ValueError, match=f"{variable}='{bad}': expected"):
            lease_settings({variable: bad})
    assert max_image_bytes({}) == 20 * 2**20 and max_image_bytes({"VLM_ASSETS_MAX_IMAGE_BYTES": "1024"}) == 1024
    for bad in ("0", "20MiB"):
        with pytest.raises(ValueError, match=f"VLM_ASSETS_MAX_IMAGE_BYTES='{bad}': expected a whole number"):
            max_image_bytes({"VLM_ASSETS_MAX_IMAGE_BYTES": bad})


def _defaults_in_a_fresh_process(profile_name: str) -> subprocess.CompletedProcess:
    code = """
import json, dagster as dg
from vlm_assets.definitions import defs
d = defs()
asset_job = d.resolve_implicit_global_asset_job_def()  # what the UI's Materialize buttons run
main = d.resolve_job_def("main_job")
def ops(job):
    return {k: v.get("config") for k, v in job.run_config_schema.config_type.fields["ops"].default_value.items()}
print(json.dumps({"main": ops(main), "ui": ops(asset_job)}))
"""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLM_ASSETS_PROFILE": profile_name},
    )


@pytest.mark.parametrize("name", ["demo", "seed"])
def test_ui_materialize_and_main_job_use_the_active_profile(name):
    proc = _defaults_in_a_fresh_process(name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    # the UI's job holds the partitioned token_chunks too, which main_job leaves to backfills
    assert "token_chunks" not in defaults["main"]
    assert defaults["ui"] == {**defaults["main"], "token_chunks": defaults["ui"]["token_chunks"]}
    ops = defaults["ui"]
    assert ops["token_shards"]["source"] == ("text_files" if name == "demo" else "hf")
    assert ops["occlusion_manifests"]["source"] == ("fashion_mnist" if name == "demo" else "cifar10")
    assert ops["gpt_checkpoint"]["parallelism"]["num_nodes"] == (2 if name == "demo" else 1)
    assert ops["eval_report"]["checks"]["min_accuracy"] == (0.3 if name == "demo" else 0.5)
    profiled = profile_defaults(name)
    assert name == "seed" or len(profiled) == 9
    for key, values in profiled.items():  # "<asset>" or "<asset>.checks"
        asset, _, section = key.partition(".")
        config = ops[asset][section] if section else ops[asset]
        for field, value in values.items():  # a config section's values: each of its fields
            for name, one in value.items() if field in PretrainConfig.sections() else [(None, value)]:
                assert (config[field][name] if name else config[field]) == one, (key, field, name)


def _own_profile(tmp_path: Path, old: str, new: str) -> str:
    """The demo profile with ``old`` replaced by ``new``, as a YAML file of one's own."""
    demo = (PROFILE_DIR / "demo.yaml").read_text()
    assert old in demo
    (tmp_path / "mine.yaml").write_text(demo.replace(old, new))
    return str(tmp_path / "mine.yaml")


def test_a_profile_of_ones_own_is_a_yaml_file_whose_values_become_the_defaults(tmp_path):
    mine = _own_profile(tmp_path, "max_length: 256\n\n#", "max_length: 128\n\n#")
    proc = _defaults_in_a_fresh_process(mine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])["main"]
    assert ops["token_shards"]["max_length"] == 128  # demo: 256
    assert ops["token_shards"]["tokenizer"] == str(offline_data_dir() / "gpt2-tokenizer")  # ${offline_data}
    assert ops["gpt_checkpoint"]["parallelism"]["num_nodes"] == 2  # the rest as the demo's


def test_a_profile_file_that_cannot_be_read_fails_naming_the_file_and_line(tmp_path):
    broken = _own_profile(tmp_path, "  num_train: 2000\n", "  num_train: [2000\n")
    line = Path(broken).read_text().splitlines().index("  num_train: [2000") + 1
    where = rf'mine.yaml is not valid YAML: while parsing .*\n  in ".*mine.yaml", line {line}, column 14'
    with pytest.raises(ValueError, match=where):
        profile_defaults(broken)
    typo = _own_profile(tmp_path, "${offline_data}/fashion-mnist", "${ofline_data}/fashion-mnist")
    with pytest.raises(ValueError, match=r"mine.yaml: \$\{ofline_data\} is neither \$\{offline_data\} nor"):
        profile_defaults(typo)
    (tmp_path / "latin1.yaml").write_bytes("token_shards: {text_glob: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.yaml is not UTF-8 text"):
        profile_defaults(str(tmp_path / "latin1.yaml"))
    (tmp_path / "list.yaml").write_text("- occlusion_manifests\n")
    with pytest.raises(ValueError, match="list.yaml: expected a mapping of asset name -> field values"):
        profile_defaults(str(tmp_path / "list.yaml"))
    with pytest.raises(ValueError, match="expected one of .*or an existing .yaml file"):
        profile({"VLM_ASSETS_PROFILE": str(tmp_path / "missing.yaml")})


def test_a_profile_value_a_field_rejects_fails_the_load_naming_it(tmp_path):
    mine = _own_profile(tmp_path, "lr: 3.0e-3, warmup_steps: 5", "lr: -1.0, warmup_steps: 5")
    proc = _defaults_in_a_fresh_process(mine)
    assert proc.returncode != 0
    assert (
        f"ValueError: profile {mine!r}: config of gpt_checkpoint (GPTCheckpointConfig): field optimizer.lr: "
        "Input should be greater than 0" in proc.stderr
    )


def test_a_profile_key_no_asset_claims_fails_the_load_naming_it(tmp_path):
    """Profiles are keyed by asset name: a misspelt (or renamed) asset fails the load, never dropped silently."""
    mine = _own_profile(tmp_path, "\neval_report:", "\ngpt_checkpont: {log_every: 5}\neval_report:")
    proc = _defaults_in_a_fresh_process(mine)
    assert proc.returncode != 0
    assert f"ValueError: profile {mine!r}: no asset config claims gpt_checkpont (claimed: eval_report," in proc.stderr


def test_training_steps_share_one_pool_sized_by_the_instance(tmp_path):
    from vlm_assets.definitions import defs
    from vlm_assets.defs.platform.launcher import TRAINING_POOL

    definitions = defs()
    pools = {
        k.to_user_string(): definitions.resolve_assets_def(k).op.pool for k in definitions.resolve_all_asset_keys()
    }
    assert {k for k, pool in pools.items() if pool == TRAINING_POOL} == {
        "gpt_checkpoint",
        "occlusion_adapter",
        "visualchat_model",
    }
    assert {pool for k, pool in pools.items() if pool != TRAINING_POOL} == {None}
    (tmp_path / "dagster.yaml").write_text((Path(__file__).resolve().parents[2] / "dagster.yaml").read_text())
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).limit == 1
    assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 2


def test_a_training_pool_of_size_0_fails_the_load_naming_the_setting(tmp_path, monkeypatch):
    from vlm_assets.definitions import defs

    config = (Path(__file__).resolve().parents[2] / "dagster.yaml").read_text()
    assert "default_limit: 1" in config
    (tmp_path / "dagster.yaml").write_text(config.replace("default_limit: 1", "default_limit: 0"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path / "home"))
    with pytest.raises(Exception) as failure:  # Dagster wraps it, naming environment.py
        defs()
    causes, err = [], failure.value
    while err is not None:
        causes.append(err)
        err = err.__cause__
    assert "environment.py (error)" in str(failure.value)
    assert any(
        isinstance(e, ValueError)
        and "pool 'vlm_training' has limit 0 (dagster.yaml concurrency.pools.default_limit" in str(e)
        for e in causes
    )


def test_a_decoder_or_backbone_of_the_users_own_is_read_instead_of_the_profiles_asset():
    """Under the demo profile VisualChat reads the graph's GPT (``decoder_asset``) and the adapter the
    graph's VisualChat (``backbone_asset``); a user who gives a ``decoder`` or ``backbone`` of their own
    gets it, not an edge they never chose (as with the manifests' counts and their own source). The
    profile's enum values are members, not strings: dumping a config warns of nothing (an error here)."""
    code = (
        "import json\n"
        "from vlm_assets.defs.models.adapter_assets import OcclusionAdapterConfig as A\n"
        "from vlm_assets.defs.models.visualchat_assets import VisualChatAssetConfig as V\n"
        "V().model_dump(mode='json'), A().run_settings()\n"
        "def name(x): return getattr(x, 'value', x)\n"
        "print(json.dumps([name(V().decoder_asset), name(V(model={'decoder': '/mine'}).decoder_asset),\n"
        "    name(A().backbone_asset), name(A(model={'backbone': '/mine'}).backbone_asset)]))"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLM_ASSETS_PROFILE": "demo"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["gpt_checkpoint", None, "visualchat_model", None]


def test_a_process_that_loaded_the_definitions_exits_with_its_objects_frozen_after_its_exit_handlers():
    probe = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen after the handlers:', gc.get_freeze_count() > 1000))\n"
        "import vlm_assets.definitions\n"
        "atexit.register(lambda: print('frozen before them:', gc.get_freeze_count() > 0))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "frozen before them: False\nfrozen after the handlers: True\n"
