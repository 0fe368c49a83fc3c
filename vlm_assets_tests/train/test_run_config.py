"""Cache identity and the run file: which fields enter the key, and the JSON round trip."""

import json

import pytest

from vlm_assets.memo import cache_key
from vlm_assets.train.adapter_config import AdapterTrainConfig
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.run_config import RunPaths, read_run_file, write_run_file
from vlm_assets.train.visualchat_config import VisualChatTrainConfig


def key(config) -> str:
    return cache_key("gpt_checkpoint", "1", config.identity(), {"token_shards": "abc"})


@pytest.mark.parametrize(
    "run_change",
    [
        {"timeout_s": 7},
        {"parallelism": {"num_nodes": 4}},
        {"parallelism": {"nproc_per_node": 8, "micro_batch_size": 4}},
        {"log_every": 1},
        {"checkpoint": {"keep_last": 9}},
        {"checkpoint": {"every": 5}},
        {"parallelism": {"activation_checkpointing": True}},
        {"data": {"num_workers": 2}},
    ],
)
def test_run_fields_leave_the_key_alone(run_change):
    assert key(PretrainConfig(**run_change)) == key(PretrainConfig())


@pytest.mark.parametrize(
    "content_change",
    [
        {"optimizer": {"lr": 1e-3}},
        {"optimizer": {"max_steps": 1000}},
        {"optimizer": {"global_batch_size": 512}},
        {"model": {"preset": "tiny"}},
        {"seed": 1},
        {"parallelism": {"strategy": "ddp"}},
        {"model": {"dropout": 0.1}},
        {"data": {"val_batches": 4}},
    ],
)
def test_content_fields_give_a_new_key(content_change):
    assert key(PretrainConfig(**content_change)) != key(PretrainConfig())


def leaves(settings: dict, prefix: str = "") -> set[str]:
    """Dotted paths of a dumped config's values, sections walked."""
    return {
        path
        for name, value in settings.items()
        for path in (leaves(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}"})
    }


def test_every_trainer_config_is_the_same_five_sections_and_each_field_is_identity_or_run():
    for model in (PretrainConfig, AdapterTrainConfig, VisualChatTrainConfig):
        assert set(model.sections()) == {"model", "optimizer", "data", "checkpoint", "parallelism"}
        config = model()
        identity, run = leaves(config.identity()), leaves(config.run_settings())
        assert identity | run == leaves(config.model_dump(mode="json")) and not identity & run
    assert leaves(AdapterTrainConfig().run_settings()) == {
        "timeout_s",
        "log_every",
        "parallelism.num_nodes",
        "parallelism.nproc_per_node",
        "parallelism.micro_batch_size",
        "parallelism.gradient_checkpointing",
        "checkpoint.materialize_partial_on_failure",
    }


def test_a_sections_run_config_nests_in_dagster_and_validates_back_as_the_trainers():
    """The asset's config is the trainer's, section by section, as Dagster config: run config nests
    (``optimizer: {lr: ...}``), the other fields of a section keep the defaults, and what the step
    receives dumps to a config the trainer's own model reads with the same identity."""
    import dagster as dg

    from vlm_assets.defs.models.gpt_assets import GPTCheckpointConfig

    seen = {}

    @dg.asset
    def probe(config: GPTCheckpointConfig) -> None:
        seen["config"] = config

    run_config = {"ops": {"probe": {"config": {"optimizer": {"lr": 0.5}, "parallelism": {"strategy": "ddp"}}}}}
    assert dg.materialize([probe], run_config=run_config).success
    config = seen["config"]
    assert config.optimizer.lr == 0.5 and config.optimizer.max_steps == PretrainConfig().optimizer.max_steps
    assert config.parallelism.strategy == "ddp" and isinstance(config.optimizer, dg.Config)
    trainer = PretrainConfig.model_validate(config.model_dump(exclude=config.step_fields()))
    assert trainer.identity() == config.identity()


def test_the_run_file_holds_the_trainers_config_and_the_launcher_alone_sees_the_pods(tmp_path):
    """The asset's step fields (checks, pod resources, the upstream choice) never reach the workers: the
    run file validates as the trainer's own config, and the resources go to the launch spec only."""
    import dagster as dg

    from vlm_assets.defs.models.visualchat_assets import VisualChatAssetConfig

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
        model={"preset": "tiny"},
        optimizer={"max_steps": 30, "warmup_steps": 5, "global_batch_size": 8},
        parallelism={"nproc_per_node": 2, "micro_batch_size": 2},
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
    data["config"]["optimizer"]["max_steps"] = "many"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: field optimizer\.max_steps: Input should be a valid integer"):
        read_run_file(tmp_path / "bad.json", PretrainConfig)
    data["config"]["optimizer"]["max_steps"], data["config"]["data"]["typo_field"] = 30, 1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: field data\.typo_field: Extra inputs are not permitted"):
        read_run_file(tmp_path / "bad.json", PretrainConfig)
    with pytest.raises(ValueError, match="input 'backbone' missing"):
        paths.input("backbone")


def test_adapter_recipe_settings_are_checked_at_load():
    import pydantic

    from vlm_assets.train.adapter_config import AdapterTrainConfig

    ok = AdapterTrainConfig(
        model={"adapter_steps": 6},
        optimizer={"epochs": 10, "reconstruction_warmup_epochs": 10, "reconstruction_outside_box": True},
    )
    assert ok.model.adapter_steps == 6
    with pytest.raises(
        pydantic.ValidationError, match=r"reconstruction_warmup_epochs \(11\) must be at most epochs \(10\)"
    ):
        AdapterTrainConfig(optimizer={"epochs": 10, "reconstruction_warmup_epochs": 11})
    with pytest.raises(pydantic.ValidationError, match="reconstruction_loss_weight is 0"):
        AdapterTrainConfig(optimizer={"epochs": 2, "reconstruction_warmup_epochs": 2, "reconstruction_loss_weight": 0})
    with pytest.raises(pydantic.ValidationError, match=r"model\.adapter_steps"):
        AdapterTrainConfig(model={"adapter_steps": 0})
