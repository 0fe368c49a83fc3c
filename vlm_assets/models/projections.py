"""Projections from vision-encoder features to the decoder's embedding width (DeepSpeed-VisualChat's
``vis_proj``): ``linear`` (Linear + LayerNorm), ``mlp`` (2-layer GELU MLP, LLaVA-1.5's) and
``perceiver`` (learned queries cross-attending to the features, which carry 2-D sin-cos positions; a
fixed number of output tokens whatever the encoder's grid)."""

import math

import torch
import torch.nn as nn

from vlm_assets.models.visualchat_spec import ProjectionKind


def sincos_2d(height: int, width: int, dim: int) -> torch.Tensor:
    """Return (height x width, dim) fixed 2-D sin-cos position embeddings (MAE's).

    Half the channels encode the row, half the column.
    """
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    rows, cols = torch.meshgrid(
        torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64), indexing="ij"
    )
    parts = []
    for grid in (rows.flatten(), cols.flatten()):
        angles = grid[:, None] * omega[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


class PerceiverProjection(nn.Module):
    """A projection in which learned queries attend to the encoder's tokens (with 2-D positions)."""

    def __init__(self, in_dim: int, out_dim: int, num_tokens_in: int, num_queries: int, num_heads: int):
        super().__init__()
        side = math.isqrt(num_tokens_in)
        if side * side != num_tokens_in:
            raise ValueError(f"perceiver projection needs a square token grid, got {num_tokens_in} tokens")
        self.queries = nn.Parameter(torch.randn(num_queries, out_dim) * 0.02)
        self.kv = nn.Linear(in_dim, out_dim)
        self.register_buffer("positions", sincos_2d(side, side, out_dim), persistent=False)
        self.attention = nn.MultiheadAttention(out_dim, num_heads, batch_first=True)
        self.norm = nn.LayerNorm(out_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Return ``num_queries`` tokens per image from the encoder's ``features``."""
        values = self.kv(features)
        keys = values + self.positions.to(values.dtype)
        queries = self.queries.to(values.dtype).expand(features.shape[0], -1, -1)
        out, _ = self.attention(queries, keys, values, need_weights=False)
        return self.norm(out)


def build_projection(
    kind: ProjectionKind, in_dim: int, out_dim: int, *, num_tokens_in: int, num_queries: int, num_heads: int = 8
) -> nn.Module:
    """Build the projection of this kind from encoder features to decoder embeddings: linear, MLP or perceiver."""
    if kind == "linear":
        return nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))
    if kind == "mlp":
        return nn.Sequential(nn.Linear(in_dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))
    if kind == "perceiver":
        heads = math.gcd(num_heads, out_dim)
        return PerceiverProjection(in_dim, out_dim, num_tokens_in, num_queries, heads)
    raise ValueError(f"unknown projection {kind!r}: expected linear, mlp or perceiver")


def tokens_out(kind: ProjectionKind, num_tokens_in: int, num_queries: int) -> int:
    """Image tokens each image becomes in the decoder's sequence."""
    return num_queries if kind == "perceiver" else num_tokens_in
