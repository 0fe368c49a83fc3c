"""The one config of occlusion-adapter training: the ``occlusion_adapter`` asset's config and the
torchrun entry point's (``--config run.json``). Its defaults are the seed's."""

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from vlm_assets.train.run_config import Optimizer, Parallelism, RunConfig, Settings, run_field


class AdapterModel(Settings):
    """The adapter trainer's model section: the frozen backbone and the adapter's steps."""

    backbone: str = Field(
        default="Qwen/Qwen2.5-VL-3B-Instruct",
        description=(
            "Frozen VLM: a Qwen2.5-VL hub id or directory, or a VisualChat model directory (the asset's "
            "backbone_asset reads one of the graph's models instead)."
        ),
    )
    adapter_steps: int = Field(
        default=1,
        ge=1,
        le=32,
        description=(
            "Times the adapter's one residual step is applied (weight-tied; 10,532 parameters either way): each "
            "reaches 2 more pixels into the box. The seed's is 1."
        ),
    )


class AdapterOptimizer(Optimizer):
    """The adapter trainer's optimizer section: batch, epochs, AdamW and the reconstruction loss."""

    global_batch_size: int = Field(default=16, ge=1, description="Samples per optimizer step over all processes.")
    epochs: int = Field(default=8, ge=1, description="Training epochs.")
    lr: float = Field(default=2e-4, gt=0, description="AdamW learning rate (betas 0.9, 0.95).")
    weight_decay: float = Field(default=1e-2, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Gradient norm clip (0 disables).")
    reconstruction_loss_weight: float = Field(
        default=0.35, ge=0, description="Weight of the masked L1 to the clean image inside the box."
    )
    reconstruction_outside_box: bool = Field(
        default=False,
        description=(
            "Add the L1 to the input outside the box (its own mean, same weight): the adapter learns to leave the "
            "visible image alone, and only the box is left for it to change."
        ),
    )
    reconstruction_warmup_epochs: int = Field(
        default=0,
        ge=0,
        description=(
            "Epochs of reconstruction only (no backbone, seconds each) before the LM loss joins: the adapter first "
            "learns to inpaint, so the LM loss fine-tunes an inpainting instead of shutting a random residual off. "
            "Equal to epochs: the reconstruction alone (the backbone then only evaluates)."
        ),
    )

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> Self:
        if self.reconstruction_warmup_epochs > self.epochs:
            raise ValueError(
                f"reconstruction_warmup_epochs ({self.reconstruction_warmup_epochs}) must be at most "
                f"epochs ({self.epochs})"
            )
        if self.reconstruction_warmup_epochs == self.epochs and self.reconstruction_loss_weight == 0:
            raise ValueError(
                "reconstruction_warmup_epochs equal to epochs trains on the reconstruction alone, "
                "but reconstruction_loss_weight is 0: nothing would train the adapter"
            )
        return self


class AdapterData(Settings):
    """The adapter trainer's data section: image size, prompt length and the rows used."""

    image_size: int = Field(
        default=224, ge=28, description="Square input size (multiple of 28: Qwen patch 14 x merge 2)."
    )
    max_length: int = Field(default=512, ge=8, description="Longest prompt + answer in tokens.")
    num_train: int | None = Field(default=None, ge=1, description="Use the first N training rows (unset = all).")
    num_validation: int | None = Field(default=None, ge=1, description="Use the first N validation rows (unset = all).")

    @field_validator("image_size")
    @classmethod
    def _patch_multiple(cls, value: int) -> int:
        if value % 28:
            raise ValueError(f"image_size {value} must be a multiple of 28 (Qwen patch 14 x merge 2)")
        return value


class AdapterCheckpoint(Settings):
    """The adapter trainer's checkpoint section."""

    materialize_partial_on_failure: bool = run_field(
        False,
        (
            "If training fails on the last retry, materialize the last recovery checkpoint flagged partial "
            "(its blocking check fails, so nothing downstream uses it) instead of failing the step."
        ),
    )


class AdapterParallelism(Parallelism):
    """The adapter trainer's parallelism section: the strategy and the per-process batch."""

    strategy: Literal["auto", "ddp", "deepspeed"] = Field(
        default="auto", description="auto = DeepSpeed ZeRO-2 on GPUs, DDP (gloo) on CPU."
    )
    micro_batch_size: int = run_field(
        1,
        "Samples per process per forward/backward (the seed's per-device batch; accumulation keeps the global batch).",
        ge=1,
    )
    gradient_checkpointing: bool = run_field(False, "Recompute backbone activations in backward (memory for time).")

    def resolved_strategy(self, cuda: bool) -> Literal["ddp", "deepspeed"]:
        """The strategy that runs: ``auto`` is DeepSpeed ZeRO-2 on GPUs, DDP on CPU."""
        if self.strategy == "auto":
            return "deepspeed" if cuda else "ddp"
        return self.strategy


class AdapterTrainConfig(RunConfig[AdapterModel, AdapterOptimizer, AdapterData, AdapterCheckpoint, AdapterParallelism]):
    """Occlusion-adapter training in front of a frozen backbone: the seed's defaults."""

    seed: int = Field(default=7, description="Seeds init and data order.")
