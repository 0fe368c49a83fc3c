"""Everything one GPT pretraining run needs, as one JSON-able dataclass (the launcher passes it as a file)."""

import dataclasses
from typing import Any

from vlm_assets.models.gpt import PRESETS
from vlm_assets.train.run_config import RunConfig

STRATEGIES = ("ddp", "fsdp2")


@dataclasses.dataclass
class PretrainConfig(RunConfig):
    shards_uri: str  # a token_shards artifact: local directory or s3:// URI
    out_dir: str  # rank 0 writes the consolidated checkpoint + Hugging Face export here
    cache_dir: str  # per-run local directory (streaming shard cache, staging); never shared by two runs
    checkpoint_store: dict[str, Any]  # vlm_assets.storage.spec of the store checkpoints are committed to
    checkpoint_prefix: str  # checkpoints of this run live under <prefix>/step-<N>; resume looks here
    preset: str = "124M"  # model shape and default learning rate (vlm_assets.models.gpt.PRESETS)
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # GPTConfig fields, e.g. {"dropout": 0.1}
    micro_batch_size: int = 8  # sequences per process per forward/backward
    global_batch_size: int = 256  # sequences per optimizer step over all processes (gradient accumulation fills the gap)
    lr: float | None = None  # peak learning rate; None = the preset's
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    warmup_steps: int = 100  # linear warmup from 0, in optimizer steps
    max_steps: int = 1000  # optimizer steps
    weight_decay: float = 0.1  # AdamW, only on >= 2-D parameters (not biases, LayerNorm)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables
    strategy: str = "ddp"  # "ddp" or "fsdp2"
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    val_check_interval: int = 100  # validate every this many optimizer steps (and at the end)
    val_batches: int = 20  # micro-batches per validation
    checkpoint_every: int = 100  # commit a checkpoint every this many optimizer steps (and at the end)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted after a newer one is committed
    log_every: int = 10  # report metrics (Pipes, MLflow) every this many optimizer steps
    seed: int = 1337
    num_workers: int = 0  # DataLoader workers per process
    mlflow_tracking_uri: str | None = None  # rank 0 logs metrics to this run when both are set
    mlflow_run_id: str | None = None

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset: unknown {self.preset!r}; choose one of {list(PRESETS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {STRATEGIES}")
        for name in ("micro_batch_size", "global_batch_size", "max_steps", "val_check_interval", "val_batches",
                     "checkpoint_every", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps, grad_clip and weight_decay must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
