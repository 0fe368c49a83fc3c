"""Token-level constants and helpers shared by the data pipelines and the models (a leaf module)."""

import torch

IGNORE_INDEX = -100  # label positions the loss skips (``torch.nn.functional.cross_entropy``'s default)


def positions_from_segments(segments: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 where a new segment starts (padding continues its run)."""
    t = segments.shape[1]
    index = torch.arange(t, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start
