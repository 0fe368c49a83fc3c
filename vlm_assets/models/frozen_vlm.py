"""A frozen vision-language backbone behind a small interface: images + prompts -> loss / answers.

Images arrive as dense (B, 3, H, W) pixels in [0, 1] (an adapter's output) and stay in torch, so
gradients reach the adapter. Two backbones, chosen by ``load_backbone``:

- ``QwenVLBackbone`` wraps ``Qwen2_5_VLForConditionalGeneration`` (hub id or local directory): pixels
  normalized with the image processor's mean/std and packed into Qwen's patch rows;
- ``VisualChatBackbone`` wraps a merged VisualChat model (a directory with ``visualchat.json``, the
  ``visualchat_model`` asset's ``model/``): pixels resized to its encoder's input size, the prompt asked
  as a one-image user turn of its chat template.
"""

import re
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn as nn

from vlm_assets.data.tokens import IGNORE_INDEX
from vlm_assets.models.hf_compat import set_activation_checkpointing
from vlm_assets.models.qwen_patches import MERGE, PATCH, dense_to_packed
from vlm_assets.paths import require_local


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and extra spaces removed: what exact match compares."""
    return " ".join(re.sub(r"[^\w\s-]", " ", text.lower()).split())


class FrozenVLM(nn.Module, ABC):
    """A frozen vision-language model the occlusion adapter trains against: answer loss and greedy answers."""

    @abstractmethod
    def loss(self, pixels: torch.Tensor, prompts: list[str], answers: list[str]) -> torch.Tensor:
        """Return the mean cross-entropy of the answer tokens only (prompt and image tokens masked)."""

    @abstractmethod
    def generate(self, pixels: torch.Tensor, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
        """Return greedy answers, decoded."""


class QwenVLBackbone(FrozenVLM):
    """A frozen Qwen2.5-VL model as the adapter's backbone."""

    def __init__(
        self,
        name_or_path: str,
        *,
        max_length: int = 512,
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

        require_local(name_or_path, "backbone")
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation="sdpa"
        )
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        processor = Qwen2VLImageProcessor.from_pretrained(name_or_path)
        self.register_buffer("mean", torch.tensor(processor.image_mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(processor.image_std).view(1, 3, 1, 1), persistent=False)
        self.max_length = max_length
        self.gradient_checkpointing = gradient_checkpointing
        self.model.requires_grad_(False)
        if gradient_checkpointing:
            # transformers recomputes activations only in train mode; the frozen backbone may run in it
            # only if that changes nothing numerically, i.e. it has no dropout.
            dropouts = {k: v for k, v in self.model.config.text_config.to_dict().items() if "dropout" in k and v}
            if dropouts:
                raise ValueError(f"gradient_checkpointing needs a backbone without dropout, this one has {dropouts}")
            set_activation_checkpointing(self.model)
        self.model.train(gradient_checkpointing)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )

    def train(self, mode: bool = True):
        """Set training mode but keep the model frozen (train mode only for gradient checkpointing); return self."""
        super().train(mode)
        # Frozen: eval mode even while the adapter trains (train mode only to let transformers
        # recompute activations, allowed above only for a backbone without dropout).
        self.model.train(self.gradient_checkpointing)
        return self

    def _pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        normalized = (pixels - self.mean) / self.std
        packed, grid = dense_to_packed(normalized.to(self.model.dtype))
        tokens_per_image = int(grid[0, 1] * grid[0, 2]) // (MERGE * MERGE)
        return packed, grid, tokens_per_image

    def _prefix(self, prompt: str, image_tokens: int) -> list[int]:
        return qwen_prompt_ids(self.tokenizer, prompt, image_tokens)

    def _batch(self, pixels, prompts, answers=None, left_pad=False):
        if pixels.shape[0] != len(prompts) or (answers is not None and len(answers) != len(prompts)):
            raise ValueError(f"{pixels.shape[0]} images, {len(prompts)} prompts, {len(answers or prompts)} answers")
        packed, grid, image_tokens = self._pixels(pixels)
        rows, labels = [], []
        for i, prompt in enumerate(prompts):
            prefix = self._prefix(prompt, image_tokens)
            target = (
                []
                if answers is None
                else self.tokenizer(f"{answers[i]}<|im_end|>", add_special_tokens=False)["input_ids"]
            )
            if len(prefix) + len(target) > self.max_length:
                raise ValueError(
                    f"sample {i}: prompt + answer is {len(prefix) + len(target)} tokens "
                    f"({image_tokens} image tokens), longer than max_length {self.max_length}"
                )
            rows.append(prefix + target)
            labels.append([IGNORE_INDEX] * len(prefix) + target)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        lab = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, (row, label) in enumerate(zip(rows, labels)):
            span = slice(width - len(row), width) if left_pad else slice(0, len(row))
            ids[i, span], mask[i, span], lab[i, span] = torch.tensor(row), 1, torch.tensor(label)
        device = pixels.device
        return ids.to(device), mask.to(device), lab.to(device), packed, grid

    def loss(self, pixels, prompts, answers):
        """Return the mean cross-entropy of the answer tokens only (prompt and image tokens masked)."""
        ids, mask, labels, packed, grid = self._batch(pixels, prompts, answers)
        return self.model(
            input_ids=ids, attention_mask=mask, pixel_values=packed, image_grid_thw=grid, labels=labels
        ).loss

    @torch.no_grad()
    def generate(self, pixels, prompts, max_new_tokens=8):
        """Return greedy answers, decoded."""
        ids, mask, _, packed, grid = self._batch(pixels, prompts, left_pad=True)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=packed,
            image_grid_thw=grid,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        return self.tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


class VisualChatBackbone(FrozenVLM):
    """A frozen VisualChat model as the adapter's backbone."""

    def __init__(
        self,
        directory: str,
        *,
        max_length: int = 512,
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        from vlm_assets.models.vision_encoders import EfficientNetLite0Encoder
        from vlm_assets.models.visualchat import VisualChatModel

        if gradient_checkpointing:
            # The recomputed forward runs in the adapter trainer's backward, outside the attention
            # layout that the forward holds (visualchat_attention): it would attend differently.
            raise ValueError("gradient_checkpointing is not supported with a VisualChat backbone")
        self.model = VisualChatModel.from_pretrained(directory).eval()
        if isinstance(self.model.encoder, EfficientNetLite0Encoder):  # frozen and never saved from here
            self.model.encoder.fold_batchnorm()  # in float32: the folded scales before any rounding
        self.model.to(dtype).requires_grad_(False)
        self.max_length, self.dtype = max_length, dtype
        self.tokenizer = self.model.tokenizer

    def train(self, mode: bool = True):
        """Set training mode but keep the model in eval mode; return self."""
        super().train(mode)
        self.model.eval()  # frozen: eval mode even while the adapter trains
        return self

    def _pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.model.encoder.image_size
        if pixels.shape[-2:] != (size, size):  # bicubic, as the trainer's images are resized (PIL)
            pixels = nn.functional.interpolate(pixels, size=(size, size), mode="bicubic", align_corners=False).clamp(
                0, 1
            )
        return pixels.to(self.dtype)

    def loss(self, pixels, prompts, answers):
        """Return the mean cross-entropy of the answer tokens only, each sample one image and one turn."""
        from vlm_assets.data import visualchat_data as vd

        if pixels.shape[0] != len(prompts) or len(answers) != len(prompts):
            raise ValueError(f"{pixels.shape[0]} images, {len(prompts)} prompts, {len(answers)} answers")
        samples = [
            vd.render(
                vd.ChatRecord(one_image_turn(p, a), [], f"sample {i}"),
                self.tokenizer,
                self.model.image_token_id,
                self.model.num_image_tokens,
                self.max_length,
            )
            for i, (p, a) in enumerate(zip(prompts, answers))
        ]
        batch = vd.collate([[s] for s in samples], self.tokenizer.pad_token_id, self.model.encoder.image_size)
        device = pixels.device
        return self.model(
            input_ids=batch["input_ids"].to(device),
            pixels=self._pixels(pixels),
            labels=batch["labels"].to(device),
            segments=batch["segments"].to(device),
            position_ids=batch["position_ids"].to(device),
        ).loss

    @torch.no_grad()
    def generate(self, pixels, prompts, max_new_tokens=8):
        """Return greedy answers, decoded, each prompt one turn about its image."""
        turns = [one_image_turn(prompt, None) for prompt in prompts]
        return self.model.replies(turns, self._pixels(pixels), max_new_tokens)


def one_image_turn(prompt: str, answer: str | None) -> list[dict]:
    """A question about one image (the pixels given beside it), and its answer when known."""
    messages = [{"role": "user", "content": [{"type": "image", "image": ""}, {"type": "text", "text": prompt}]}]
    return messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def is_visualchat(name_or_path: str) -> bool:
    """Return whether ``name_or_path`` is a directory holding a VisualChat model (``visualchat.json``)."""
    return (Path(name_or_path).expanduser() / "visualchat.json").is_file()


def load_backbone(name_or_path: str, **settings) -> FrozenVLM:
    """The frozen backbone at ``name_or_path``: a VisualChat model directory or a Qwen2.5-VL."""
    return (VisualChatBackbone if is_visualchat(name_or_path) else QwenVLBackbone)(name_or_path, **settings)


def qwen_prompt_ids(tokenizer, prompt: str, image_tokens: int) -> list[int]:
    """The user turn (image placeholders + prompt) and the assistant header, in Qwen's chat format."""
    text = (
        f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * image_tokens}<|vision_end|>{prompt}"
        f"<|im_end|>\n<|im_start|>assistant\n"
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_prompt_lengths(backbone: str, rows: list[dict], image_size: int, max_length: int, where: str) -> None:
    """Before any training: every row's prompt + answer fits ``max_length`` (tokenizer only, no weights)."""
    from transformers import AutoTokenizer

    first_line = {}
    for line, row in enumerate(rows, 1):
        first_line.setdefault((row["prompt"], row["label"]), line)
    if is_visualchat(backbone):
        _check_visualchat_lengths(Path(backbone).expanduser(), first_line, max_length, where)
        return
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    image_tokens = (image_size // PATCH) ** 2 // (MERGE * MERGE)
    for (prompt, label), line in first_line.items():  # prompts repeat: tokenize each distinct pair once
        count = len(qwen_prompt_ids(tokenizer, prompt, image_tokens)) + len(
            tokenizer(f"{label}<|im_end|>", add_special_tokens=False)["input_ids"]
        )
        if count > max_length:
            raise ValueError(
                f"{where}:{line}: prompt + answer is {count} tokens ({image_tokens} image tokens), "
                f"longer than max_length {max_length}"
            )


def _check_visualchat_lengths(directory: Path, first_line: dict, max_length: int, where: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from vlm_assets.data import visualchat_data as vd
    from vlm_assets.models.visualchat import decoder_positions
    from vlm_assets.models.visualchat_spec import VisualChatSpec

    spec = VisualChatSpec.read(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory / "decoder")
    positions = decoder_positions(AutoConfig.from_pretrained(directory / "decoder"))
    limit = min(max_length, positions or max_length)
    for (prompt, label), line in first_line.items():
        try:
            vd.render(
                vd.ChatRecord(one_image_turn(prompt, label), [], f"{where}:{line}"),
                tokenizer,
                spec.image_token_id,
                spec.num_image_tokens,
                limit,
            )
        except ValueError as err:
            raise ValueError(
                f"{err}" + (f" (the decoder has {positions} positions)" if limit < max_length else "")
            ) from None
