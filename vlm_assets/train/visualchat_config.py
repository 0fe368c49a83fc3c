"""The one config of VisualChat training: the model's fields (``VisualChatModelConfig``) plus how to
train it. The torchrun entry point reads it from the run file (``--config run.json``)."""

from typing import Literal

from pydantic import Field, field_validator

from vlm_assets.models.visualchat_spec import VisualChatModelConfig
from vlm_assets.train.run_config import Optimizer, Parallelism, RunConfig, Settings, run_field

MODULES = ("encoder", "projection", "decoder", "lora")


class VisualChatModelSection(VisualChatModelConfig, Settings):
    """The model section: the model's parts, LoRA on them, and which of them train.

    The parts are ``VisualChatModelConfig``: what the saved model is rebuilt from.
    """

    lora_r: int = Field(default=8, ge=1, description="LoRA rank on the decoder's linear layers.")
    lora_alpha: int = Field(default=16, ge=1, description="LoRA scale numerator (scale = alpha / r).")
    lora_dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="LoRA dropout (its masks are seeded per step: a resumed run draws the same ones).",
    )
    lora_encoder: bool = Field(default=False, description="Also put LoRA on the vision encoder's linear layers.")
    freeze_modules: list[str] = Field(
        default=["encoder", "decoder"],
        description=("Modules whose weights stay fixed: encoder, projection, decoder (its base weights), lora."),
    )

    # A list of strings checked here, not of a Literal: Dagster's config types have no Literal lists.
    @field_validator("freeze_modules")
    @classmethod
    def _modules(cls, value: list[str]) -> list[str]:
        if unknown := sorted(set(value) - set(MODULES)):
            raise ValueError(f"unknown module(s) {unknown}: choose from {', '.join(MODULES)}")
        return value

    def trained_modules(self) -> list[str]:
        """Return the modules that train: those not in ``freeze_modules``."""
        return [m for m in MODULES if m not in self.freeze_modules]


class VisualChatOptimizer(Optimizer):
    """The VisualChat trainer's optimizer section: global batch, AdamW and its warm-up."""

    global_batch_size: int = Field(default=8, ge=1, description="Rows per optimizer step over all processes.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate (linear warmup, then constant).")
    warmup_steps: int = Field(default=10, ge=0, description="Linear learning-rate warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Gradient norm clip (0 disables).")
    max_steps: int = Field(default=200, ge=1, description="Optimizer steps.")


class VisualChatData(Settings):
    """The VisualChat trainer's data section: the samples blended in, the held-out share and packing."""

    chat_datasets: dict[str, int | None] = Field(
        default={},
        description=(
            "Chat datasets (OpenAI messages JSONL, LLaVA JSON, Hugging Face Parquet or datasets folder; "
            "docs/data-formats.md) -> how many samples of each to blend in (null: all; more: repeated)."
        ),
    )
    chat_format: Literal["auto", "openai", "llava", "hf"] = Field(
        default="auto", description="Format of the chat datasets: auto (told by their content) or one for all."
    )
    image_folder: str | None = Field(
        default=None,
        description=(
            "Folder that relative image paths of the chat datasets are in (default: each file's folder; for LLaVA "
            "then its images/ subfolder)."
        ),
    )
    vqa_count: int | None = Field(
        default=None,
        ge=0,
        description=("Clean manifest images as VQA (the manifest's prompt -> class) to blend in (null: all)."),
    )
    pair_count: int = Field(
        default=0,
        ge=0,
        description=("Two-image, two-round conversations made from the manifests ('Which of these is a ...?')."),
    )
    phrasing_count: int = Field(
        default=0,
        ge=0,
        description=(
            "Clean manifest images asked in other words ('What is shown?', 'Which item is this?', ...) -> class, so "
            "the model answers a user's own phrasing, not only the manifest's prompt."
        ),
    )
    eval_fraction: float = Field(default=0.1, ge=0, lt=1, description="Share of the blended records held out.")
    packing: bool = Field(
        default=False,
        description=("Pack samples first-fit into rows of pack_tokens (attention kept per sample, positions restart)."),
    )
    pack_tokens: int = Field(default=1024, ge=16, description="Tokens per packed row.")
    eval_images: int = Field(
        default=100,
        ge=0,
        description=(
            "Held-out validation images of the manifests on which the merged model's VQA exact match is measured "
            "(0: none)."
        ),
    )

    def read_chat_datasets(self, paths: list[str], max_images: int) -> list[list]:
        """The records of each chat dataset (``ChatRecord`` lists); ``ChatDataError`` names every bad one."""
        from vlm_assets.data.chat_formats import read_chat_dataset

        return [
            read_chat_dataset(p, max_images=max_images, format=self.chat_format, image_folder=self.image_folder)
            for p in paths
        ]


class VisualChatCheckpoint(Settings):
    """The VisualChat trainer's checkpoint section."""

    every: int = run_field(50, "Commit a checkpoint every this many optimizer steps (and at the end).", ge=1)


class VisualChatParallelism(Parallelism):
    """The VisualChat trainer's parallelism section: DeepSpeed ZeRO stage and per-process batch."""

    zero_stage: int = Field(
        default=2, description="DeepSpeed ZeRO stage: 2 (optimizer + gradients sharded) or 3 (parameters too)."
    )
    micro_batch_size: int = run_field(
        2, "Rows per process per forward/backward (a row is one sample, or several when packing).", ge=1
    )
    gradient_checkpointing: bool = run_field(False, "Recompute the decoder's activations in backward.")
    cache_image_features: bool = run_field(
        False,
        (
            "Encode each image of the run once before the first step, the processes sharing the work, and keep "
            "the features (frozen encoder only; memory: images x tokens x width floats per process)."
        ),
    )

    @field_validator("zero_stage")
    @classmethod
    def _stage(cls, value: int) -> int:
        if value not in (2, 3):
            raise ValueError(f"zero_stage {value} is not supported: VisualChat trains with ZeRO stage 2 or 3")
        return value


class VisualChatTrainConfig(
    RunConfig[VisualChatModelSection, VisualChatOptimizer, VisualChatData, VisualChatCheckpoint, VisualChatParallelism]
):
    """VisualChat training (DeepSpeed-VisualChat's recipe: LoRA under ZeRO): the seed's defaults."""
