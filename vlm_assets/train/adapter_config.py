"""Everything one occlusion-adapter training run needs (the launcher passes it to every process as JSON)."""

import dataclasses
from typing import Any

from vlm_assets.train.run_config import RunConfig

STRATEGIES = ("auto", "ddp", "deepspeed")


@dataclasses.dataclass
class AdapterTrainConfig(RunConfig):
    manifests_dir: str  # an occlusion_manifests artifact (local directory)
    backbone: str  # Qwen2.5-VL hub id or local directory; frozen
    out_dir: str  # rank 0 writes adapter.safetensors, history.json here
    cache_dir: str  # per-run scratch
    checkpoint_store: dict[str, Any]  # vlm_assets.storage.spec: recovery checkpoints go here
    checkpoint_prefix: str  # <prefix>/step-<N>; a relaunch resumes from the newest intact one
    epochs: int = 8
    lr: float = 2e-4
    weight_decay: float = 1e-2
    global_batch_size: int = 16  # samples per optimizer step over all processes
    micro_batch_size: int = 1  # samples per process per forward/backward (the seed's per-device batch)
    grad_clip: float = 1.0
    image_size: int = 224
    max_length: int = 512
    gradient_checkpointing: bool = False  # recompute backbone activations in backward (memory for time)
    reconstruction_loss_weight: float = 0.35  # x mean |adapter(x) - clean| inside the occluded box
    seed: int = 7
    strategy: str = "auto"  # auto = deepspeed (ZeRO-2) on GPUs, ddp on CPU
    num_train: int | None = None  # first N training rows (None = all)
    num_validation: int | None = None
    log_every: int = 10
    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {STRATEGIES}")
        for name in ("epochs", "global_batch_size", "micro_batch_size", "max_length", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % 28:
            raise ValueError(f"image_size {self.image_size} must be a multiple of 28 (Qwen patch 14 x merge 2)")
        if self.reconstruction_loss_weight < 0 or self.lr <= 0:
            raise ValueError("lr must be > 0 and reconstruction_loss_weight >= 0")
