"""Cross-entropy of a linear head, computed over row chunks so that the (tokens x vocabulary) logits never exist.

On a CPU the logits of a 50k vocabulary are the step's largest tensors: allocating, faulting in and
passing over them several times (log-softmax forward, its backward, the head's two gradient matmuls)
costs more than the head's arithmetic. Here only the rows whose target counts reach the head; each chunk
of them gets its logits, exponentiated once in their own buffer, which give the log-sum-exp and, when a
gradient is wanted, the chunk's gradients of the hidden states and the head's weight (the softmax's
division and the one-hot target are applied to those small products); the buffer is then reused. The
loss and gradients are those of ``F.cross_entropy(F.linear(hidden, weight, bias), targets,
ignore_index=...)`` (mean over the rows whose target is not ``ignore_index``). Liger-Kernel's and Cut
Cross-Entropy's fused versions are Triton kernels (GPU only) and torch has none, hence this one for the
CPU path.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # logits per chunk (64 MiB in float32): large matmuls, a buffer that is reused


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Return the mean cross-entropy of ``hidden @ weight.T + bias`` (N, V) against ``targets`` (N,), in float32.

    Rows whose target is ``ignore_index`` count for nothing; with none left the loss is NaN, as torch's is.
    Gradients flow to ``hidden`` and ``weight`` (``bias`` is taken as a constant, e.g. a padding mask).
    """
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1] or weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"expected hidden (N, D), weight (V, D) and targets (N,), got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)} and {tuple(targets.shape)}"
        )
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, rows)
    with torch.no_grad():
        return _loss_and_grads(hidden, weight, bias, targets, ignore_index, rows)[0]


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    want_logits: bool,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Return (logits or None, mean cross-entropy) of the linear head ``weight``/``bias`` over ``hidden`` (N, D).

    Without ``want_logits`` on a CPU the loss comes from ``linear_cross_entropy`` and the logits are None;
    otherwise the logits are ``project(hidden)`` (default ``F.linear(hidden, weight, bias)``; a head module
    passes itself) and the loss their ``F.cross_entropy`` in float32.
    """
    # On a GPU the logits fit and cuBLAS with the fused cross-entropy kernel beat a loop of chunks; under
    # DeepSpeed ZeRO-3 (``ds_id``) the weight is whole only inside the head module's own forward.
    if not want_logits and hidden.device.type == "cpu" and not hasattr(weight, "ds_id"):
        return None, linear_cross_entropy(hidden, weight, bias, targets, ignore_index)
    logits = project(hidden) if project is not None else F.linear(hidden, weight, bias)
    return logits, F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


def _loss_and_grads(hidden, weight, bias, targets, ignore_index, rows, grads=(False, False)):
    """Return (mean loss, d loss / d hidden, d loss / d weight); each gradient is None unless ``grads`` asks for it."""
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.float(), weight.float()
        b = None if bias is None else bias.float()
        valid = targets != ignore_index
        count = valid.sum()
        # An ignored row adds nothing to the loss and has a zero gradient: only the others reach the head.
        kept = None if bool(valid.all()) else valid.nonzero()[:, 0]
        if kept is not None:
            h, targets = h[kept], targets[kept]
        total = h.new_zeros(())
        grad_h = torch.empty_like(h) if grads[0] else None
        grad_w = torch.zeros_like(w) if grads[1] else None
        for start in range(0, h.shape[0], rows):
            hc, tc = h[start : start + rows], targets[start : start + rows]
            logits = hc @ w.T if b is None else torch.addmm(b, hc, w.T)
            picked = logits.gather(1, tc[:, None])[:, 0]
            # log-sum-exp and softmax from one exp pass in the logits' buffer (torch.logsumexp would
            # allocate a second buffer of the chunk's size and exponentiate it again)
            top = logits.amax(dim=1)
            exps = logits.sub_(top[:, None]).exp_()
            sums = exps.sum(dim=1)
            total += (sums.log() + top - picked).sum()
            # d loss / d logits = softmax - one-hot = exps / sums - one-hot: the division and the one-hot
            # are applied to the (rows x dim) products, not to the (rows x vocabulary) buffer
            scale = sums.reciprocal()[:, None]
            if grad_h is not None:
                chunk = grad_h[start : start + rows]
                torch.matmul(exps, w, out=chunk).mul_(scale).sub_(w[tc])
            if grad_w is not None:
                grad_w.addmm_(exps.T, hc * scale).index_add_(0, tc, hc, alpha=-1.0)
        loss = total / count  # NaN when every target is ignored, as F.cross_entropy's mean
        if grad_h is not None and kept is not None:
            grad_h = hidden.new_zeros(hidden.shape, dtype=torch.float32).index_copy_(0, kept, grad_h)
        for grad in (grad_h, grad_w):
            if grad is not None:
                grad.div_(count)
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss with its input gradients computed in the forward pass, chunk by chunk, and scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, rows):
        grads = tuple(ctx.needs_input_grad[:2])  # a frozen head (LoRA) wants no weight gradient
        loss, grad_h, grad_w = _loss_and_grads(hidden, weight, bias, targets, ignore_index, rows, grads)
        ctx.save_for_backward(
            None if grad_h is None else grad_h.to(hidden.dtype), None if grad_w is None else grad_w.to(weight.dtype)
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        scaled = [None if g is None else g * grad_loss for g in ctx.saved_tensors]
        return *scaled, None, None, None, None
