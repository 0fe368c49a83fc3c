"""What a VisualChat model is made of, without torch: the config classes import this (the code
location loads without torch; the model code in ``visualchat.py`` builds from it)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EncoderKind = Literal["clip", "qwen2_5_vl", "efficientnet_lite0"]
ProjectionKind = Literal["linear", "mlp", "perceiver"]


class VisualChatModelConfig(BaseModel):
    """What the model is made of. The trainer's config (``VisualChatTrainConfig``) inherits these fields:
    one definition from the asset to the torchrun entry point."""

    model_config = ConfigDict(extra="forbid")

    encoder_kind: EncoderKind = Field(
        default="clip",
        description=("Vision encoder family: clip | qwen2_5_vl | efficientnet_lite0 (offline, pretrained)."),
    )
    encoder: str | None = Field(
        default="openai/clip-vit-large-patch14",
        description=(
            "clip / qwen2_5_vl: hub id or directory (e.g. openai/clip-vit-large-patch14); efficientnet_lite0: "
            "unset (the packaged ImageNet weights) or a weights file."
        ),
    )
    projection: ProjectionKind = Field(default="mlp", description="linear | mlp | perceiver.")
    num_queries: int = Field(default=32, ge=1, description="perceiver only: image tokens per image.")
    decoder: str = Field(
        default="meta-llama/Llama-2-7b-hf",
        description="Causal LM: hub id or directory (the asset's decoder_asset reads the graph's own GPT instead).",
    )
    mmca: bool = Field(default=False, description="Multi-modal causal attention instead of plain causal.")
    max_images: int = Field(default=8, ge=1, description="Most images in one sample.")
    max_length: int = Field(default=4096, ge=16, description="Most tokens in one sample, image tokens included.")
