"""GPT-2-style decoder (pure torch), the model of the ``gpt_checkpoint`` asset.

Token + learned position embeddings, pre-LayerNorm blocks, causal self-attention through
``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU, no materialized mask),
a 4x GELU(tanh) MLP, dropout, and an output head tied to the token embedding. The embedding table is
padded to a multiple of 64 rows for faster matmuls; the padding rows are sliced off the logits, so
they are never predicted.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm_assets.data.tokens import IGNORE_INDEX

# Shapes live apart from the model so configs can name presets without importing torch.
from vlm_assets.models.gpt_presets import PRESETS, GPTConfig, preset  # noqa: E402,F401
from vlm_assets.models.linear_cross_entropy import head_loss


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the attention output for ``x`` (batch, sequence, width), each position attending to earlier ones."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, width)))


class MLP(nn.Module):
    """The block's feed-forward layer: 4x width, GELU (tanh), dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the feed-forward output for ``x``."""
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention, then the MLP, each residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` after the block's attention and MLP residual updates."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder with an output head tied to its token embedding."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf 2017), as GPT-2
        # -inf on the padding rows, added inside the head's matmul (addmm): padding gets zero
        # probability with no extra pass over the (tokens x vocab) logits, and the logits stay
        # contiguous for the loss (slicing them instead costs a copy forward and a fill+copy backward).
        bias = torch.zeros(config.padded_vocab_size)
        bias[config.vocab_size :] = float("-inf")
        self.register_buffer("logit_bias", bias, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) so the residual stream's variance
        # does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Return the number of parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())  # the tied head is counted once

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, return_logits: bool = True):
        """Return the logits over the real vocabulary (padding rows sliced off), and the loss or None.

        With ``labels``, the loss is the mean next-token cross-entropy (labels shifted left by one here; ``-100``
        positions ignored). ``return_logits=False`` returns None for the logits: on a CPU the loss is then
        computed chunk by chunk without them (``head_loss``), the same loss and gradients.
        """
        seq = input_ids.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # Position t predicts token t+1: shift the labels, not the logits (which would copy them).
        targets = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
        vocab, bias = self.config.vocab_size, self.logit_bias.to(x.dtype)
        if targets is None:
            return (F.linear(x, self.lm_head.weight, bias)[..., :vocab] if return_logits else None), None
        logits, loss = head_loss(
            x.flatten(0, 1), self.lm_head.weight, bias, targets, return_logits, ignore_index=IGNORE_INDEX
        )
        return (logits.unflatten(0, x.shape[:2])[..., :vocab] if return_logits else None), loss
