"""The one config of GPT pretraining: the ``gpt_checkpoint`` asset's config and the torchrun entry
point's (``--config run.json``). Its defaults are the seed's (124M, FSDP2, 2,000 steps of 256 sequences)."""

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from vlm_assets.models.gpt_presets import PRESETS
from vlm_assets.train.run_config import Optimizer, Parallelism, RunConfig, Settings, run_field


class GPTModel(Settings):
    """The GPT trainer's model section: a preset's shape, its width and depth overridable, and dropout."""

    preset: str = Field(default="124M", description=f"Model shape and default lr: one of {list(PRESETS)}.")
    n_embd: int | None = Field(
        default=None, ge=1, description="Width instead of the preset's (its heads kept): a preset's shape at test size."
    )
    n_layer: int | None = Field(default=None, ge=1, description="Depth instead of the preset's.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout in embeddings, attention and MLP.")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}; choose one of {list(PRESETS)}")
        return value

    @model_validator(mode="after")
    def _width_fits_the_heads(self) -> Self:
        heads = PRESETS[self.preset][2]
        if self.n_embd is not None and self.n_embd % heads:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of preset {self.preset}'s {heads} heads")
        return self

    def shape(self) -> dict[str, int]:
        """The preset's shape overrides this config gives (``models.gpt_presets.preset``'s keyword arguments)."""
        return {k: v for k, v in (("n_embd", self.n_embd), ("n_layer", self.n_layer)) if v is not None}


class GPTOptimizer(Optimizer):
    """The GPT trainer's optimizer section: global batch and warmup-cosine learning-rate schedule."""

    global_batch_size: int = Field(default=256, ge=1, description="Sequences per optimizer step over all processes.")
    lr: float | None = Field(default=None, gt=0, description="Peak learning rate; unset = the preset's.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Cosine decays to lr x this.")
    warmup_steps: int = Field(default=100, ge=0, description="Linear warmup from 0, in optimizer steps.")
    max_steps: int = Field(default=2000, ge=1, description="Optimizer steps.")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay, only on >= 2-D parameters.")
    grad_clip: float = Field(default=1.0, ge=0, description="Max global gradient norm; 0 disables.")

    @model_validator(mode="after")
    def _warmup_fits(self) -> Self:
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds max_steps {self.max_steps}")
        return self


class GPTData(Settings):
    """The GPT trainer's data section: validation cadence and loader workers."""

    val_check_interval: int = Field(default=200, ge=1, description="Validate every this many steps (and at the end).")
    val_batches: int = Field(default=20, ge=1, description="Micro-batches per validation.")
    num_workers: int = run_field(0, "DataLoader workers per process.", ge=0)


class GPTCheckpoint(Settings):
    """The GPT trainer's checkpoint section: cadence and how many to keep."""

    every: int = run_field(200, "Commit a checkpoint every this many steps (and at the end).", ge=1)
    keep_last: int = run_field(2, "Complete checkpoints kept in the store.", ge=1)


class GPTParallelism(Parallelism):
    """The GPT trainer's parallelism section: DDP or FSDP2, and the per-process batch."""

    strategy: Literal["ddp", "fsdp2"] = Field(
        default="fsdp2", description="DDP, or FSDP2 (fully_shard per block, then the root)."
    )
    micro_batch_size: int = run_field(
        8,
        "Sequences per process per forward/backward (memory, not the math: accumulation keeps the global batch).",
        ge=1,
    )
    activation_checkpointing: bool = run_field(
        False, "Recompute each block's activations in backward (memory for time)."
    )
    compile: bool = run_field(False, "torch.compile each block (a GPU's fused kernels; minutes of compiling on a CPU).")


class PretrainConfig(RunConfig[GPTModel, GPTOptimizer, GPTData, GPTCheckpoint, GPTParallelism]):
    """GPT pretraining (nanoGPT's recipe): the seed's defaults."""

    seed: int = Field(default=1337, description="Seeds init and data order.")
