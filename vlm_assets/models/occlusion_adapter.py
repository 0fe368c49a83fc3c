"""The occlusion adapter (pure torch): a small residual Conv2d network in front of a frozen VLM.

The seed's architecture and its 10,532 parameters. Input: the occluded RGB image and the binary
occlusion mask (1 inside the box). One step: ``pixels + tanh(gate) * residual``, where the residual comes
from Conv2d 4->32 3x3, GELU, Conv2d 32->32 3x3, GELU, Conv2d 32->3 1x1, Tanh, and ``gate`` is a learnable
scalar starting at 0.10, so training starts close to the identity.

``steps`` applies that same step several times (weight-tied, no new parameters). One step sees 5x5 pixels
(two 3x3 convolutions), so it can change a box only within 2 pixels of its edge and must fill the rest of
the box with one learned constant; ``k`` steps reach ``2k`` pixels in, so the adapter can carry the
surrounding image into the box as an inpainting does. The seed's is ``steps=1``.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn

NUM_PARAMETERS = 10_532


class OcclusionAdapter(nn.Module):
    """A small convolutional network restoring occluded pixels for the backbone, scaled by a learned gate."""

    def __init__(self, hidden: int = 32, gate_init: float = 0.10, steps: int = 1):
        super().__init__()
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.steps = steps
        self.net = nn.Sequential(
            nn.Conv2d(4, hidden, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(hidden, 3, 1),
            nn.Tanh(),
        )
        # Shape (1,), not a 0-d scalar: DeepSpeed broadcasts parameters as byte views, which 0-d tensors refuse.
        self.gate = nn.Parameter(torch.full((1,), float(gate_init)))

    def forward(self, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Restore ``pixels`` (B, 3, H, W) in [0, 1] under ``mask`` (B, 1, H, W); return (B, 3, H, W)."""
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be (batch, 3, height, width), got {tuple(pixels.shape)}")
        if mask.shape != (pixels.shape[0], 1, *pixels.shape[2:]):
            raise ValueError(
                f"mask must be (batch, 1, height, width) = {(pixels.shape[0], 1, *pixels.shape[2:])}, "
                f"got {tuple(mask.shape)}"
            )
        mask = mask.to(pixels.dtype)
        for _ in range(self.steps):
            pixels = pixels + torch.tanh(self.gate) * self.net(torch.cat([pixels, mask], dim=1))
        return pixels


def load_adapter(weights: str | Path, info_file: str | Path) -> tuple[OcclusionAdapter, dict]:
    """Load a trained adapter in eval mode from ``adapter.safetensors`` and its ``backbone.json``; return both.

    The ``backbone.json`` record also names the backbone, its prompt and image size, and the adapter's ``steps``.
    """
    from safetensors.torch import load_file

    info = json.loads(Path(info_file).read_text())
    adapter = OcclusionAdapter(steps=info.get("adapter_steps", 1))
    adapter.load_state_dict(load_file(str(weights)))
    return adapter.eval(), info


def load_trained(weights: str | Path, info_file: str | Path):
    """Return (frozen backbone, adapter, its ``backbone.json`` record).

    That is ``load_adapter`` and the backbone it was trained against, as the evaluation and the registered
    predictor both load them.
    """
    from vlm_assets.models.frozen_vlm import load_backbone

    adapter, info = load_adapter(weights, info_file)
    return load_backbone(info["backbone"], max_length=info["max_length"]), adapter, info


def weights_scan(root: Path) -> dict:
    """Which adapter weights hold non-finite values, the gate and the parameter count (at build time)."""
    from safetensors.torch import load_file

    weights = load_file(str(root / "adapter.safetensors"))
    return {
        "non_finite": [name for name, t in weights.items() if not torch.isfinite(t).all()],
        "gate": float(weights["gate"]),
        "num_parameters": sum(t.numel() for t in weights.values()),
    }
