"""GPT model shapes: the config dataclass and the named presets (no torch: configs import this)."""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a ``GPT``: vocabulary, context length, depth, heads, width, dropout bias and vocabulary padding."""

    vocab_size: int = 50257  # GPT-2 BPE
    block_size: int = 1024  # longest sequence (position embeddings)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    pad_vocab_to: int = 64  # embedding rows rounded up to a multiple of this

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head) < 1:
            raise ValueError(f"vocab_size, block_size, n_layer and n_head must be positive: {self}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary size rounded up to a multiple of ``pad_vocab_to``: the embedding table's rows."""
        return math.ceil(self.vocab_size / self.pad_vocab_to) * self.pad_vocab_to


# name: (n_embd, n_layer, n_head, learning rate). 1.5B/30B/65B are the seed pipeline's shapes and lrs.
PRESETS: dict[str, tuple[int, int, int, float]] = {
    "tiny": (64, 2, 2, 1e-3),
    "124M": (768, 12, 12, 6e-4),
    "350M": (1024, 24, 16, 3e-4),
    "1.5B": (2048, 24, 16, 6e-4),
    "30B": (6656, 48, 52, 1.6e-4),
    "65B": (8192, 80, 64, 1.5e-4),
}


def preset(name: str, **overrides) -> tuple[GPTConfig, float]:
    """The config and learning rate of a named preset, with field overrides (e.g. ``block_size=256``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {list(PRESETS)}")
    n_embd, n_layer, n_head, lr = PRESETS[name]
    return GPTConfig(**{"n_embd": n_embd, "n_layer": n_layer, "n_head": n_head, **overrides}), lr
