"""Qwen2-VL / Qwen2.5-VL image patches: dense (B, C, H, W) pixels <-> the packed (num_patches, patch_dim)
tensor the vision tower takes, in torch (differentiable, so an adapter in front of it can be trained).

The layout is ``Qwen2VLImageProcessor``'s: each image is repeated ``temporal_patch`` times along time,
cut into ``patch`` x ``patch`` squares, and the squares are ordered so that each ``merge`` x ``merge``
group (merged into one LLM token later) is contiguous; a row holds (channel, time, y, x) flattened.
``packed_to_dense`` inverts ``dense_to_packed`` exactly (it reads time step 0; all steps are equal
for an image).
"""

import torch

PATCH, TEMPORAL_PATCH, MERGE = 14, 2, 2


def _check(height: int, width: int, patch: int, merge: int) -> None:
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"image size {height}x{width} must be a multiple of patch x merge = {patch * merge}")


def dense_to_packed(
    pixels: torch.Tensor, patch: int = PATCH, temporal_patch: int = TEMPORAL_PATCH, merge: int = MERGE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, H, W) normalized pixels -> (B * h * w, C * temporal_patch * patch**2) and grid_thw (B, 3)."""
    batch, channels, height, width = pixels.shape
    _check(height, width, patch, merge)
    grid_h, grid_w = height // patch, width // patch
    frames = pixels.unsqueeze(1).expand(batch, temporal_patch, channels, height, width)
    x = frames.reshape(batch, temporal_patch, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    packed = x.reshape(batch * grid_h * grid_w, channels * temporal_patch * patch * patch)
    grid = torch.tensor([[1, grid_h, grid_w]] * batch, dtype=torch.long, device=pixels.device)
    return packed, grid


def packed_to_dense(
    packed: torch.Tensor,
    grid_thw: torch.Tensor,
    channels: int = 3,
    patch: int = PATCH,
    temporal_patch: int = TEMPORAL_PATCH,
    merge: int = MERGE,
) -> list[torch.Tensor]:
    """The inverse: one (C, H, W) tensor per image (images may differ in size)."""
    images, start = [], 0
    for t, grid_h, grid_w in grid_thw.tolist():
        if t != 1:
            raise ValueError(f"grid_thw {t, grid_h, grid_w}: images have one temporal patch, videos are not supported")
        count = grid_h * grid_w
        rows = packed[start : start + count]
        if rows.shape != (count, channels * temporal_patch * patch * patch):
            raise ValueError(f"packed rows {tuple(rows.shape)} do not match grid {t, grid_h, grid_w}")
        x = rows.reshape(grid_h // merge, grid_w // merge, merge, merge, channels, temporal_patch, patch, patch)
        x = x[:, :, :, :, :, 0]  # time step 0 (all equal for an image)
        x = x.permute(4, 0, 2, 5, 1, 3, 6)  # C, gh/m, m, p, gw/m, m, p
        images.append(x.reshape(channels, grid_h * patch, grid_w * patch))
        start += count
    if start != packed.shape[0]:
        raise ValueError(f"packed has {packed.shape[0]} rows, grid_thw accounts for {start}")
    return images
