"""The occlusion adapter (pure torch): a small residual Conv2d network in front of a frozen VLM.

Exactly the seed's architecture. Input: the occluded RGB image and the binary occlusion mask
(1 inside the box). Output: ``pixels + tanh(gate) * residual``, where the residual comes from
Conv2d 4->32 3x3, GELU, Conv2d 32->32 3x3, GELU, Conv2d 32->3 1x1, Tanh, and ``gate`` is a learnable
scalar starting at 0.10, so training starts close to the identity. 10,532 parameters.
"""

import torch
import torch.nn as nn

NUM_PARAMETERS = 10_532


class OcclusionAdapter(nn.Module):
    def __init__(self, hidden: int = 32, gate_init: float = 0.10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, 3, 1), nn.Tanh(),
        )
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))

    def forward(self, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``pixels`` (B, 3, H, W) in [0, 1], ``mask`` (B, 1, H, W) -> restored pixels (B, 3, H, W)."""
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be (batch, 3, height, width), got {tuple(pixels.shape)}")
        if mask.shape != (pixels.shape[0], 1, *pixels.shape[2:]):
            raise ValueError(f"mask must be (batch, 1, height, width) = {(pixels.shape[0], 1, *pixels.shape[2:])}, "
                             f"got {tuple(mask.shape)}")
        residual = self.net(torch.cat([pixels, mask.to(pixels.dtype)], dim=1))
        return pixels + torch.tanh(self.gate) * residual
