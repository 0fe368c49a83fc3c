"""Teach a tiny VLM backbone the clean task: all weights trained on un-occluded images.

The adapter tests' frozen backbone when no pretrained VLM can be downloaded (a test fixture, not a step
of the graph: the demo's backbone is the graph's own ``visualchat_model``). Afterwards it is frozen, and
the occlusion adapter must recover its accuracy on occluded images. One process; a few hundred steps of
a tiny model on CPU.
"""

import json
import shutil
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from vlm_assets.data.occlusion_dataset import OcclusionDataset
from vlm_assets.models.frozen_vlm import QwenVLBackbone
from vlm_assets.models.tiny_qwen import build_tiny_qwen


def teach_clean_task(manifests: Path, out_dir: Path, *, image_size: int, steps: int) -> Path:
    """A tiny Qwen2.5-VL built from a config (its vocabulary: the manifests' prompt and class names),
    trained ``steps`` steps on the clean images of ``manifests``; saved under ``out_dir / "model"``."""
    prompt = json.loads((manifests / "train.jsonl").read_text().splitlines()[0])["prompt"]
    names = json.loads((manifests / "dataset.json").read_text())["class_names"]
    tiny = build_tiny_qwen(out_dir / "init", [prompt] + names * 20)
    model = train_clean_backbone(tiny, manifests, out_dir / "model", image_size=image_size, steps=steps)
    shutil.rmtree(tiny)
    return model


def train_clean_backbone(
    backbone_dir: Path,
    manifests: Path,
    out_dir: Path,
    *,
    image_size: int = 56,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
) -> Path:
    torch.manual_seed(seed)
    backbone = QwenVLBackbone(str(backbone_dir))
    backbone.model.requires_grad_(True)
    backbone.model.train()
    data = OcclusionDataset(manifests, "train", image_size)
    prompts = {row["label_index"]: (row["prompt"], row["label"]) for row in data.rows}
    loader = DataLoader(
        data, batch_size=batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
    )
    optimizer = torch.optim.AdamW(backbone.model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    step = 0
    while step < steps:
        for _, clean, _, labels in loader:
            texts = [prompts[int(i)] for i in labels]
            loss = backbone.loss(clean, [p for p, _ in texts], [a for _, a in texts])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step >= steps:
                break
    out_dir.mkdir(parents=True, exist_ok=True)
    backbone.model.save_pretrained(out_dir)
    backbone.tokenizer.save_pretrained(out_dir)
    for name in ("preprocessor_config.json",):
        (out_dir / name).write_bytes((backbone_dir / name).read_bytes())
    return out_dir
