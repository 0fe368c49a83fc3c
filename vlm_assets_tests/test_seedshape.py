"""The seed profile's paths at tiny size (marker ``seedshape``; scripts/test.sh runs them): each asset is
materialized from the definitions loaded under ``VLM_ASSETS_PROFILE=seed`` (the config classes' own
defaults, conftest.py) with only sizes and the locations of data and weights overridden, so the code a
seed run takes on GPUs (docs/assets.md, profiles) has run on CPU before anyone rents one.

Seed row -> what runs here instead:
- CIFAR-10 from its official URL, md5-checked -> the same URL's path on a loopback mirror
  (``VLM_ASSETS_DOWNLOAD_MIRROR``): the official md5 refuses the served tarball (20 real CIFAR-10 images),
  its own md5 accepts it;
- wikitext-103 from the hub, ``gpt2`` tokenizer -> the hub repository's layout on disk (``configs`` in
  README.md, a parquet file per split), read by the same streaming ``datasets.load_dataset`` call; GPT-2
  BPE from the offline cache;
- GPT ``124M``, FSDP2 -> the 124M preset's 12 layers and 12 heads at width 48, FSDP2 over 2 processes
  (gloo, fp32);
- the adapter on Qwen2.5-VL-3B under ZeRO-2 -> a tiny Qwen2.5-VL saved with ``save_pretrained``,
  DeepSpeed ZeRO-2 over 2 processes (gloo);
- VisualChat CLIP ViT-L/14 + Llama-2-7B with LoRA -> a tiny CLIP vision tower and a tiny Llama, ZeRO-2
  over 2 processes;
- ``eval_report`` on every validation image and both registrations, in the MLflow registry (sqlite).

The seed's thresholds and strategies hold except where a CPU cannot honour them, each named where it is
set (and in docs/assets.md): the GPT's ``checks.min_val_loss_gain`` 0 (two steps of a tiny width); the
adapter's ``parallelism.strategy: deepspeed`` (the seed's ``auto`` picks DDP without a GPU); the
registrations' gates (``eval_report.checks`` 0 and -100 %, ``visualchat_model.checks.min_exact_match``
0) after the seed's own gates were shown to refuse the tiny models.
"""

import json
from pathlib import Path

import pytest

from vlm_assets.data.download import md5_file
from vlm_assets.data.image_sources import CIFAR10_MD5, CIFAR10_URL
from vlm_assets_tests.conftest import (
    TOKEN_SHARD_CHECKS_PASS,
    IsolatedEnv,
    checks_of,
    real_cifar_images,
    serve_directory,
    write_cifar_tarball,
)

pytestmark = [pytest.mark.seedshape, pytest.mark.slow]


def seed_assets(*names: str) -> list:
    """The named assets of the code location, loaded under the seed profile."""
    import os

    from vlm_assets.definitions import defs

    assert os.environ["VLM_ASSETS_PROFILE"] == "seed"  # conftest.py, before any definitions load
    assets = {key.to_user_string(): a for a in defs().assets for key in a.keys}
    return [assets[n] for n in names]


def meta(result, asset: str) -> dict:
    (materialization,) = result.asset_materializations_for_node(asset)
    return {k: getattr(v, "value", v) for k, v in materialization.metadata.items()}


def wikitext_layout(root: Path, offline_data: Path) -> Path:
    """Real text (Shakespeare) laid out as the hub's ``wikitext`` repository is: the config's folder with a
    parquet file per split, declared in README.md's ``configs``, so that ``source: hf`` reads it through
    the seed's own call, ``datasets.load_dataset(hf_dataset, "wikitext-103-raw-v1", streaming=True)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = []
    for path in sorted((offline_data / "shakespeare").glob("*.txt"))[:4]:
        lines += [line + "\n" for line in path.read_text().splitlines()]
    folder = root / "wikitext-103-raw-v1"
    folder.mkdir(parents=True)
    cut = len(lines) * 9 // 10
    for split, rows in (("train", lines[:cut]), ("validation", lines[cut:])):
        pq.write_table(pa.table({"text": rows}), folder / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-103-raw-v1\n  data_files:\n"
        "  - split: train\n    path: wikitext-103-raw-v1/train-*\n"
        "  - split: validation\n    path: wikitext-103-raw-v1/validation-*\n---\n"
    )
    return root


@pytest.fixture(scope="module")
def seed_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("seedshape")  # one store: the GPT reads the shards the tokens test built


@pytest.fixture(scope="module")
def tokens_config(tmp_path_factory, offline_data) -> dict:
    wikitext = wikitext_layout(tmp_path_factory.mktemp("wikitext"), offline_data)
    return {
        "hf_dataset": str(wikitext),
        "tokenizer": str(offline_data / "gpt2-tokenizer"),
        "max_train_samples": 24,
        "max_val_samples": 8,  # the export check's fixed batch
    }


def test_cifar10_from_the_official_url_path_with_its_md5(tmp_path, offline_data, monkeypatch):
    images, labels = real_cifar_images(offline_data)
    path = CIFAR10_URL.split("://", 1)[1].split("/", 1)[1]  # ~kriz/cifar-10-python.tar.gz
    (tmp_path / "mirror" / path).parent.mkdir(parents=True)
    tarball = write_cifar_tarball(tmp_path / "mirror" / path, images, labels)
    env = IsolatedEnv(tmp_path / "env", seed_assets("occlusion_manifests"))
    sizes = {}  # the seed's own: every image of both splits
    with serve_directory(tmp_path / "mirror") as (url, requests):
        monkeypatch.setenv("VLM_ASSETS_DOWNLOAD_MIRROR", url)
        refused = env.materialize({"ops": {"occlusion_manifests": {"config": sizes}}}, raise_on_error=False)
        served = {**sizes, "source_md5": md5_file(tarball)}
        result = env.materialize({"ops": {"occlusion_manifests": {"config": served}}}, raise_on_error=False)
    assert requests == [f"/{path}", f"/{path}"]  # the official URL's path, on the mirror; refused, not cached
    (failure,) = refused.get_step_failure_events()
    message = failure.step_failure_data.user_failure_data.description
    assert f"{url}/{path}: downloaded file has md5 {md5_file(tarball)}, expected {CIFAR10_MD5}" in message
    manifests = meta(result, "occlusion_manifests")
    assert manifests["dataset"] == "CIFAR-10" and (manifests["num_train"], manifests["num_validation"]) == (100, 20)
    # The 20 real images hold no bird and no deer: the seed's blocking balance check says so, and only it fails.
    checks = checks_of(result, "occlusion_manifests")
    assert [name for name, passed in checks.items() if not passed] == ["every_class_present_and_balanced"]


def test_token_shards_from_a_hub_layout_dataset_through_datasets(seed_root, tokens_config):
    env = IsolatedEnv(seed_root, seed_assets("token_shards"))
    result = env.materialize({"ops": {"token_shards": {"config": tokens_config}}})
    tokens = meta(result, "token_shards")
    assert tokens["max_length"] == 1024 and tokens["vocab_size"] == 50257  # the seed's blocks, GPT-2 BPE
    assert tokens["train_num_samples"] == 24 and tokens["val_num_samples"] == 8
    assert checks_of(result, "token_shards") == TOKEN_SHARD_CHECKS_PASS


def test_gpt_124m_shape_at_tiny_width_under_fsdp2(seed_root, tokens_config):
    gpt = {
        "model": {"n_embd": 48},  # 124M's 12 layers and 12 heads, 4 dimensions per head
        "optimizer": {"global_batch_size": 2, "max_steps": 2, "warmup_steps": 1},
        "data": {"val_check_interval": 2, "val_batches": 1},
        "checkpoint": {"every": 2},
        "parallelism": {"nproc_per_node": 2, "micro_batch_size": 1},
        "checks": {"min_val_loss_gain": 0.0},
    }
    config = {"ops": {"token_shards": {"config": tokens_config}, "gpt_checkpoint": {"config": gpt}}}
    result = IsolatedEnv(seed_root, seed_assets("token_shards", "gpt_checkpoint")).materialize(config)
    checkpoint = meta(result, "gpt_checkpoint")
    assert checkpoint["world_size"] == 2 and checkpoint["steps"] == 2
    hf = json.loads((Path(checkpoint["uri"]) / "hf" / "config.json").read_text())
    assert (hf["n_layer"], hf["n_head"], hf["n_embd"], hf["n_positions"]) == (12, 12, 48, 1024)
    assert (checkpoint["strategy"], checkpoint["precision"], checkpoint["backend"]) == ("fsdp2", "32-true", "gloo")


def fashion_mnist(offline_data: Path, num_train: int, num_validation: int) -> dict:
    """The manifests the model twins train on: a location override (the seed's CIFAR-10 needs the hub)."""
    return {
        "source": "fashion_mnist",
        "source_uri": str(offline_data / "fashion-mnist"),
        "num_train": num_train,
        "num_validation": num_validation,
    }


def champion(env: IsolatedEnv, name: str) -> str | None:
    """The registry version ``name@champion`` points at, or None."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient(env.uri).get_model_version_by_alias(name, "champion").version)
    except MlflowException:
        return None


def test_adapter_on_a_qwen2_5_vl_directory_under_deepspeed_zero2_evaluated_and_registered(tmp_path, offline_data):
    from vlm_assets.data.occlusion_dataset import class_names
    from vlm_assets.models.tiny_qwen import build_tiny_qwen

    manifests = {"occlusion_manifests": {"config": fashion_mnist(offline_data, 20, 10)}}
    built = IsolatedEnv(tmp_path / "env", seed_assets("occlusion_manifests")).materialize({"ops": manifests})
    root = Path(meta(built, "occlusion_manifests")["uri"])
    prompt = json.loads((root / "dataset.json").read_text())["prompt"]
    backbone = build_tiny_qwen(tmp_path / "qwen", [prompt] + class_names(root) * 20)  # the 3B's place
    adapter = {
        "model": {"backbone": str(backbone)},
        "optimizer": {"epochs": 1, "global_batch_size": 4},
        "data": {"num_train": 8, "num_validation": 4},
        "parallelism": {"strategy": "deepspeed", "nproc_per_node": 2},  # the seed's "auto" on GPUs; DDP on CPU
    }
    graph = seed_assets("occlusion_manifests", "occlusion_adapter", "eval_report", "registered_adapter")
    env = IsolatedEnv(tmp_path / "env", graph)
    ops = {**manifests, "occlusion_adapter": {"config": adapter}}
    result = env.materialize({"ops": ops}, raise_on_error=False)
    trained = meta(result, "occlusion_adapter")
    assert trained["epochs"] == 1 and trained["world_size"] == 2
    assert (trained["strategy"], trained["precision"], trained["backend"]) == ("deepspeed", "32-true", "gloo")
    assert checks_of(result, "occlusion_adapter") == {"adapter_training_complete": True, "adapter_weights_finite": True}
    # The seed's eval on every validation image, with the seed's gates: one epoch of a random tiny Qwen
    # names no class with a 95 % lower bound of 50 %, so the blocking check refuses it and nothing registers.
    report = meta(result, "eval_report")
    assert report["num_samples"] == 10 and Path(report["uri"], "report.html").is_file()
    assert checks_of(result, "eval_report")["adapter_accuracy_meets_threshold"] is False
    assert (
        not result.asset_materializations_for_node("registered_adapter") and champion(env, "occlusion_adapter") is None
    )
    # Override (a CPU's tiny model cannot honour the seed's thresholds): gates at 0 and -100 %, so the
    # seed's registration runs: the eval is a cache hit judged again, the adapter registered as champion.
    gates = {"eval_report": {"config": {"checks": {"min_accuracy": 0.0, "min_gain": -1.0}}}}
    registered = env.materialize({"ops": {**ops, **gates}})
    assert meta(registered, "eval_report")["cache"] == "hit"
    assert meta(registered, "registered_adapter")["registry"] == "registered"
    assert champion(env, "occlusion_adapter") == "1"


def test_visualchat_with_a_clip_encoder_and_a_llama_decoder_gated_and_registered(tmp_path, offline_data):
    from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder

    env = IsolatedEnv(tmp_path / "env", seed_assets("occlusion_manifests", "visualchat_model", "registered_visualchat"))
    visualchat = {
        "model": {
            "encoder": str(tiny_clip(tmp_path / "clip")),  # openai/clip-vit-large-patch14's place
            "decoder": str(tiny_decoder(tmp_path / "llama", offline_data, arch="llama")),  # Llama-2-7B's
        },
        "optimizer": {"global_batch_size": 2, "max_steps": 2, "warmup_steps": 1},
        "data": {"vqa_count": 16, "eval_images": 8},
        "checkpoint": {"every": 2},
        "parallelism": {"nproc_per_node": 2, "micro_batch_size": 1},
    }
    config = {
        "occlusion_manifests": {"config": fashion_mnist(offline_data, 20, 10)},
        "visualchat_model": {"config": visualchat},
    }
    result = env.materialize({"ops": config}, raise_on_error=False)
    model = meta(result, "visualchat_model")
    spec = json.loads((Path(model["uri"]) / "model" / "visualchat.json").read_text())
    assert (spec["encoder_kind"], spec["projection"]) == ("clip", "mlp")
    assert json.loads((Path(model["uri"]) / "model" / "decoder" / "config.json").read_text())["model_type"] == "llama"
    assert model["steps"] == 2 and model["merge_max_abs_diff"] < 1e-4
    checks = checks_of(result, "visualchat_model")
    # Two steps teach a random tiny Llama to lower its loss, not to name the class: the seed's own VQA
    # threshold (0.5 on the Wilson lower bound) refuses it, and the blocking check stops the run there.
    assert checks == {
        "eval_loss_beats_untrained": True,
        "vqa_exact_match_meets_threshold": False,
        "merged_equals_unmerged": True,
    }
    (failed,) = [e for e in result.get_asset_check_evaluations() if not e.passed]
    assert "vs threshold 50.0%" in failed.description, failed.description
    assert not result.asset_materializations_for_node("registered_visualchat") and champion(env, "visualchat") is None
    # Override (a CPU's tiny model cannot honour the seed's threshold): min_exact_match 0, so the seed's
    # registration runs on the same model (a cache hit, judged again) and points the champion at it.
    config["visualchat_model"]["config"]["checks"] = {"min_exact_match": 0.0}
    registered = env.materialize({"ops": config})
    assert meta(registered, "visualchat_model")["cache"] == "hit"
    assert meta(registered, "registered_visualchat")["registry"] == "registered"
    assert champion(env, "visualchat") == "1"
