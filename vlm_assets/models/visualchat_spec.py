"""What a VisualChat model is made of, without torch: the config classes import this (the code
location loads without torch; the model code in ``visualchat.py`` builds from it)."""

import dataclasses
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EncoderKind = Literal["clip", "qwen2_5_vl", "efficientnet_lite0"]
ProjectionKind = Literal["linear", "mlp", "perceiver"]


EFFICIENTNET_STRIDE = 32  # EfficientNet-Lite0's feature map: a token per 32 x 32 pixels


def check_efficientnet_image_size(size: int) -> None:
    """Raise ValueError unless ``size`` is a positive multiple of EfficientNet-Lite0's stride."""
    if size < EFFICIENTNET_STRIDE or size % EFFICIENTNET_STRIDE:
        raise ValueError(
            f"encoder_image_size {size} must be a positive multiple of {EFFICIENTNET_STRIDE} (the feature map's stride)"
        )


def check_image_size_kind(kind: str, size: int | None) -> None:
    """Raise ValueError when an input size is given for an encoder kind that takes its checkpoint's own."""
    if size is not None and kind != "efficientnet_lite0":
        raise ValueError(f"encoder_image_size is for the efficientnet_lite0 encoder only, not {kind}")


class VisualChatModelConfig(BaseModel):
    """What the model is made of.

    The trainer's config (``VisualChatTrainConfig``) inherits these fields: one definition from the asset to the
    torchrun entry point.
    """

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
    encoder_image_size: int | None = Field(
        default=None,
        description=(
            "efficientnet_lite0 only: its input size, a multiple of 32 (default 224); a token per 32 x 32 "
            "pixels, so 128 gives 16 image tokens instead of 49."
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

    @field_validator("encoder_image_size")
    @classmethod
    def _image_size(cls, value: int | None) -> int | None:
        if value is not None:
            check_efficientnet_image_size(value)
        return value

    @model_validator(mode="after")
    def _image_size_kind(self) -> "VisualChatModelConfig":
        check_image_size_kind(self.encoder_kind, self.encoder_image_size)
        return self


SPEC_FILE = "visualchat.json"


@dataclasses.dataclass(frozen=True)
class VisualChatSpec:
    """What a saved VisualChat model records in ``visualchat.json``: how to rebuild it and feed it."""

    encoder_kind: str
    projection: str
    num_queries: int
    encoder_dim: int  # the encoder's feature width
    decoder_dim: int  # the decoder's embedding width
    encoder_tokens: int  # feature tokens per image out of the encoder
    num_image_tokens: int  # ``<image>`` positions per image in the decoder's input
    image_token: str
    image_token_id: int
    mmca: bool
    max_images: int
    max_length: int
    preprocessing: dict  # the encoder's own (its mean, std and input size)

    @classmethod
    def read(cls, directory: str | Path) -> "VisualChatSpec":
        """Read the spec of the model saved in ``directory``.

        Raise FileNotFoundError when it holds none, ValueError naming the file and the fields when it is not a spec.
        """
        path = Path(directory) / SPEC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: not a VisualChat model directory (no {SPEC_FILE})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != fields:
            got = set(data) if isinstance(data, dict) else set()
            raise ValueError(f"{path}: missing {sorted(fields - got)}, unknown {sorted(got - fields)}")
        return cls(**data)

    def write(self, directory: str | Path) -> Path:
        """Write the spec into ``directory``; return its path."""
        path = Path(directory) / SPEC_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        return path
