"""Cache identity and the run file: which fields enter the key, and the JSON round trip."""

import json

import pytest

from vlm_assets.memo import cache_key
from vlm_assets.train.adapter_config import AdapterTrainConfig
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.run_config import RunPaths, read_run_file, write_run_file


def key(config) -> str:
    return cache_key("gpt_checkpoint", "1", config.identity(), {"token_shards": "abc"})


@pytest.mark.parametrize(
    "run_change",
    [
        {"timeout_s": 7},
        {"num_nodes": 4},
        {"nproc_per_node": 8, "micro_batch_size": 4},
        {"log_every": 1},
        {"keep_last": 9},
        {"checkpoint_every": 5},
        {"activation_checkpointing": True},
        {"num_workers": 2},
    ],
)
def test_run_fields_leave_the_key_alone(run_change):
    assert key(PretrainConfig(**run_change)) == key(PretrainConfig())


@pytest.mark.parametrize(
    "content_change",
    [
        {"lr": 1e-3},
        {"max_steps": 1000},
        {"global_batch_size": 512},
        {"preset": "tiny"},
        {"seed": 1},
        {"strategy": "ddp"},
        {"dropout": 0.1},
    ],
)
def test_content_fields_give_a_new_key(content_change):
    assert key(PretrainConfig(**content_change)) != key(PretrainConfig())


def test_identity_and_run_fields_partition_the_config():
    for model in (PretrainConfig, AdapterTrainConfig):
        config = model()
        assert set(config.identity()) | set(config.run_settings()) == set(model.model_fields)
        assert not set(config.identity()) & set(config.run_settings())
    assert {
        "timeout_s",
        "num_nodes",
        "nproc_per_node",
        "gradient_checkpointing",
        "log_every",
        "materialize_partial_on_failure",
    } == set(AdapterTrainConfig().run_settings()) - {"micro_batch_size"}


def test_the_run_file_holds_the_trainers_config_and_the_launcher_alone_sees_the_pods(tmp_path):
    """The asset's step fields (checks, pod resources, the upstream choice) never reach the workers: the
    run file validates as the trainer's own config, and the resources go to the launch spec only."""
    import dagster as dg

    from vlm_assets.defs.models.visualchat_assets import VisualChatAssetConfig
    from vlm_assets.train.visualchat_config import VisualChatTrainConfig

    config = VisualChatAssetConfig(
        resources={"gpus_per_node": 8, "memory_per_node": "64Gi"}, decoder_asset="gpt_checkpoint"
    )
    paths = RunPaths(inputs={}, out_dir="o", cache_dir="c", checkpoint_store={}, checkpoint_prefix="p")
    write_run_file(tmp_path / "run.json", config, paths)
    written = json.loads((tmp_path / "run.json").read_text())["config"]
    assert not {"resources", "decoder_asset", "checks", "gpus_per_node"} & set(written)
    trainer, _ = read_run_file(tmp_path / "run.json", VisualChatTrainConfig)
    assert trainer.identity() == config.identity()
    spec = config.launch_spec("m", (), "visualchat_model", config.resources.requests())
    assert spec.resources == {"nvidia.com/gpu": "8", "memory": "64Gi"}
    assert {"resources", "decoder_asset"} <= set(config.run_settings())  # outside the cache key
    with pytest.raises(dg.Failure, match=r"field resources\.cpu_per_node: String should match pattern"):
        VisualChatAssetConfig(resources={"cpu_per_node": "lots"})


def test_run_file_round_trip_and_errors_name_the_file_and_field(tmp_path):
    config = PretrainConfig(
        preset="tiny", max_steps=30, warmup_steps=5, nproc_per_node=2, micro_batch_size=2, global_batch_size=8
    )
    paths = RunPaths(
        inputs={"token_shards": "/data"},
        out_dir="o",
        cache_dir="c",
        checkpoint_store={"kind": "local", "root": "r"},
        checkpoint_prefix="p",
    )
    write_run_file(tmp_path / "run.json", config, paths)
    assert read_run_file(tmp_path / "run.json", PretrainConfig) == (config, paths)

    data = json.loads((tmp_path / "run.json").read_text())
    data["config"]["max_steps"] = "many"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: field max_steps: Input should be a valid integer"):
        read_run_file(tmp_path / "bad.json", PretrainConfig)
    data["config"]["max_steps"], data["config"]["typo_field"] = 30, 1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: field typo_field: Extra inputs are not permitted"):
        read_run_file(tmp_path / "bad.json", PretrainConfig)
    with pytest.raises(ValueError, match="input 'backbone' missing"):
        paths.input("backbone")


def test_adapter_recipe_settings_are_checked_at_load():
    import pydantic

    from vlm_assets.train.adapter_config import AdapterTrainConfig

    ok = AdapterTrainConfig(
        epochs=10, reconstruction_warmup_epochs=10, reconstruction_outside_box=True, adapter_steps=6
    )
    assert ok.adapter_steps == 6
    with pytest.raises(
        pydantic.ValidationError, match=r"reconstruction_warmup_epochs \(11\) must be at most epochs \(10\)"
    ):
        AdapterTrainConfig(epochs=10, reconstruction_warmup_epochs=11)
    with pytest.raises(pydantic.ValidationError, match="reconstruction_loss_weight is 0"):
        AdapterTrainConfig(epochs=2, reconstruction_warmup_epochs=2, reconstruction_loss_weight=0)
    with pytest.raises(pydantic.ValidationError, match="adapter_steps"):
        AdapterTrainConfig(adapter_steps=0)
