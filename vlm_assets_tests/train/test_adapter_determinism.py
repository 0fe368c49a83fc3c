"""Reproducible numbers: the adapter trainer run twice on the same inputs (one process, gloo, a tiny
Qwen2.5-VL saved and loaded through from_pretrained, real Fashion-MNIST manifests) gives the same loss
curve, the same weights and the same evaluation; another seed gives another curve."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vlm_assets.data.image_sources import load_fashion_mnist
from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests
from vlm_assets.data.occlusion_dataset import OcclusionSamples, class_names
from vlm_assets.evaluate.occlusion_eval import evaluate
from vlm_assets.models.frozen_vlm import load_backbone
from vlm_assets.models.occlusion_adapter import OcclusionAdapter
from vlm_assets.models.tiny_qwen import build_tiny_qwen
from vlm_assets.train.adapter_config import AdapterTrainConfig
from vlm_assets.train.adapter_train import train
from vlm_assets.train.entry import TrainerRun
from vlm_assets.train.reporting import Reporter
from vlm_assets.train.run_config import RunPaths
from vlm_assets_tests.conftest import free_port


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, offline_data):
    root = tmp_path_factory.mktemp("determinism")
    manifests = root / "manifests"
    write_occlusion_manifests(
        load_fashion_mnist(offline_data / "fashion-mnist"),
        manifests,
        num_train=64,
        num_validation=32,
        train_box=BoxBounds(0.22, 0.42),
        validation_box=BoxBounds(0.28, 0.45),
        seed=3,
    )
    prompt = json.loads((manifests / "dataset.json").read_text())["prompt"]
    backbone = build_tiny_qwen(root / "backbone", [prompt] + class_names(manifests) * 20)
    return root, manifests, backbone


def _run(inputs, name: str, seed: int, monkeypatch) -> tuple[list[dict], dict, dict]:
    root, manifests, backbone = inputs
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # one process: Lightning's DDP on gloo
    config = AdapterTrainConfig(
        model={"backbone": str(backbone)},
        optimizer={"epochs": 2, "lr": 5e-3, "global_batch_size": 16},
        data={"image_size": 56, "num_train": 64, "num_validation": 32},
        parallelism={"strategy": "ddp", "micro_batch_size": 8},
        seed=seed,
        log_every=4,
    )
    out = root / name
    paths = RunPaths(
        inputs={"occlusion_manifests": str(manifests), "backbone": str(backbone)},
        out_dir=str(out),
        cache_dir=str(root / f"{name}-cache"),
        checkpoint_store={"kind": "local", "root": str(root / f"{name}-store")},
        checkpoint_prefix=f"checkpoints/{name}",
    )
    with Reporter.open(0, None, None) as reporter:
        train(TrainerRun(config, paths, reporter, rank=0, world=1))
    weights = load_file(str(out / "adapter.safetensors"))
    adapter = OcclusionAdapter()
    adapter.load_state_dict(weights)
    result = evaluate(
        load_backbone(str(backbone)),
        adapter,
        OcclusionSamples(manifests, "validation", 56, None),
        class_names(manifests),
        batch_size=16,
    )
    return json.loads((out / "history.json").read_text())["epochs"], weights, result.predictions


@pytest.mark.slow
def test_the_same_run_twice_gives_the_same_curve_weights_and_answers(inputs, monkeypatch):
    first = _run(inputs, "a", 7, monkeypatch)
    second = _run(inputs, "b", 7, monkeypatch)
    other = _run(inputs, "c", 8, monkeypatch)
    assert first[0] == second[0]  # every logged number of every epoch, bit for bit
    assert all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    assert first[2] == second[2]
    assert [e["train/loss"] for e in other[0]] != [e["train/loss"] for e in first[0]]
