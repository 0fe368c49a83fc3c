"""A tiny Qwen2.5-VL built from a config, with a locally trained BPE tokenizer and the real
``Qwen2VLImageProcessor``, saved with ``save_pretrained`` so it loads exactly like a hub checkpoint.

No hub is reachable here: tests, the demo profile and CPU benchmarks use this; the same loading path
(``QwenVLBackbone(path)``) serves ``Qwen/Qwen2.5-VL-3B-Instruct``.
"""

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE tokenizer of ``vocab_size`` on ``texts``; return it as a ``Qwen2Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(list(texts), trainer)
    return Qwen2Tokenizer(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        extra_special_tokens=SPECIAL_TOKENS[1:],
    )


# The text and vision shapes of Qwen/Qwen2.5-VL-3B-Instruct (its config.json), for benchmarks with
# random weights where nothing can be downloaded.
QWEN25_VL_3B_TEXT = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=151936,
    rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
)
QWEN25_VL_3B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)


def build_tiny_qwen(
    out_dir: Path,
    texts: Iterable[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised tiny ``Qwen2_5_VLForConditionalGeneration``, tokenizer and image processor.

    ``text_overrides``/``vision_overrides`` replace config fields (e.g. the 3B shapes above); the weights are
    initialised on ``device`` and saved in ``dtype`` (a 3B shape: on a GPU, in bf16).
    """
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = train_tokenizer(texts)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // 2
    config = Qwen2_5_VLConfig(
        text_config={
            **dict(
                vocab_size=len(tokenizer),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
                },
                bos_token_id=None,  # Qwen's default id is past this vocabulary
                eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
            ),
            **(text_overrides or {}),
        },
        vision_config={
            **dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=hidden,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=56,
                fullatt_block_indexes=[1],
            ),
            **(vision_overrides or {}),
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=448 * 448).save_pretrained(out_dir)
    return out_dir
