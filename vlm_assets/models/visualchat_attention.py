"""The decoder's attention inside VisualChat: packed samples kept apart, and multi-modal causal attention.

A batch row may hold several packed samples (segment ids 1, 2, ...; 0 = padding): a token attends
causally within its own segment only, and position ids restart per segment (the caller's). With
``mmca`` (DeepSpeed-VisualChat's multi-modal causal attention), image tokens attend to the image tokens
before them only; a text token attends to the image tokens and to the text tokens before it with two
softmaxes, each normalised over its own keys, and the two outputs summed (a text token with no image
before it has only the text part). Off, it is plain causal attention.

The function is registered with transformers' ``AttentionInterface`` as ``"visualchat"``, so any HF
causal LM runs it in place of its own. The layout (segments, image flags) reaches it through a
context variable set around the forward *and* backward of a step (``attention_layout``): transformers
4.57 forwards extra keyword arguments to the attention function for Llama but not for GPT-2, whose
export is one of our decoders, and gradient checkpointing recomputes the forward inside backward.
Without a layout it is transformers' own SDPA attention (plain causal, KV cache, padding masks).
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

ATTENTION = "visualchat"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per key position (B, K): segment id (0 = padding) and whether the token is an image token.

    Queries are the last Q key positions (Q = K in training; 1 per step when decoding with a cache).
    """

    segments: torch.Tensor
    image: torch.Tensor
    mmca: bool


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("visualchat_layout", default=None)


@contextlib.contextmanager
def attention_layout(layout: Layout | None) -> Iterator[None]:
    """Make ``layout`` the attention layout of the decoder's attention inside the block."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def allowed_keys(layout: Layout, num_queries: int) -> torch.Tensor:
    """Return the (B, Q, K) bool mask of the keys each query may attend to.

    Causal and within the query's own segment; padding queries see themselves only, so no row is empty.
    """
    segments = layout.segments
    k = segments.shape[1]
    key_pos = torch.arange(k, device=segments.device)
    query_pos = key_pos[k - num_queries :]
    causal = key_pos[None, :] <= query_pos[:, None]
    query_segments = segments[:, k - num_queries :]
    same = (query_segments[:, :, None] == segments[:, None, :]) & (query_segments[:, :, None] > 0)
    self_only = (query_segments[:, :, None] == 0) & (key_pos[None, None, :] == query_pos[None, :, None])
    return (same & causal[None]) | self_only


def visualchat_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` signature: q (B, H, Q, D), k/v (B, H_kv, K, D) -> ((B, Q, H, D), None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    layout = _LAYOUT.get()
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dropout = dropout if module.training else 0.0
    allowed = allowed_keys(layout, query.shape[2])[:, None]  # (B, 1, Q, K)
    if not layout.mmca:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    q = query.shape[2]
    key_image = layout.image[:, None, None, :]  # (B, 1, 1, K)
    query_image = layout.image[:, None, -q:, None]  # (B, 1, Q, 1)
    to_images = allowed & key_image
    to_text = allowed & ~key_image & ~query_image
    # The image part: every image query has itself; a text query with no image before it gets zero.
    image_out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=to_images | ~to_images.any(-1, keepdim=True), dropout_p=dropout, scale=scaling
    )
    image_out = image_out * to_images.any(-1, keepdim=True)
    # The text part: text queries only (an image query keeps a dummy row, then zeroed).
    text_rows = to_text.any(-1, keepdim=True)
    text_out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=to_text | ~text_rows, dropout_p=dropout, scale=scaling
    )
    out = image_out + text_out * text_rows
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="visualchat"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, visualchat_attention)
    # The masks transformers builds for the no-layout path (padding, KV cache) are SDPA's.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
