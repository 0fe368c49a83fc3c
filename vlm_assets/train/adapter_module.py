"""Lightning part of adapter training: the frozen backbone with the trainable adapter in front (the
data is ``vlm_assets.data.occlusion_dataset.OcclusionSamples``). Only adapter parameters are optimized
and checkpointed."""

import lightning as L
import torch

from vlm_assets.models.frozen_vlm import FrozenVLM, load_backbone
from vlm_assets.models.occlusion_adapter import OcclusionAdapter
from vlm_assets.train.adapter_config import AdapterTrainConfig

ADAPTER_PREFIX = "adapter."


def masked_l1(restored: torch.Tensor, clean: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean absolute error over the pixels where ``mask`` is 1 (all 3 channels) only."""
    return ((restored - clean).abs() * mask).sum() / (mask.sum() * restored.shape[1]).clamp(min=1.0)


class AdapterModule(L.LightningModule):
    """The Lightning module that trains an ``OcclusionAdapter`` in front of a frozen backbone."""

    def __init__(self, config: AdapterTrainConfig, backbone: str):
        super().__init__()
        self.config, self.backbone_path = config, backbone
        self.adapter = OcclusionAdapter(steps=config.model.adapter_steps)
        self.backbone: FrozenVLM | None = None
        self.strict_loading = False  # checkpoints hold the adapter only

    def configure_model(self) -> None:
        """Load the frozen backbone once, unless the reconstruction warm-up spans every epoch."""
        # Reconstruction alone (warm-up spans every epoch) never runs the backbone: do not load it.
        if self.backbone is None and self.config.optimizer.reconstruction_warmup_epochs < self.config.optimizer.epochs:
            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
            self.backbone = load_backbone(
                self.backbone_path,
                max_length=self.config.data.max_length,
                dtype=dtype,
                gradient_checkpointing=self.config.parallelism.gradient_checkpointing,
            )

    def losses(self, batch: dict, with_lm: bool = True) -> dict[str, torch.Tensor]:
        """Return the batch's losses: weighted reconstruction, plus the backbone's answer loss with ``with_lm``."""
        restored = self.adapter(batch["occluded"], batch["mask"])
        rec = masked_l1(restored, batch["clean"], batch["mask"])
        if self.config.optimizer.reconstruction_outside_box:  # outside the box the clean image is the input
            rec = rec + masked_l1(restored, batch["clean"], 1.0 - batch["mask"])
        out = {"loss": self.config.optimizer.reconstruction_loss_weight * rec, "reconstruction_loss": rec}
        if with_lm:
            out["lm_loss"] = self.backbone.loss(restored, batch["prompt"], batch["answer"])
            out["loss"] = out["loss"] + out["lm_loss"]
        return out

    def with_lm(self) -> bool:
        """Return whether the backbone's loss is used: False during the reconstruction warm-up.

        The backbone is not run at all then (the adapter alone takes milliseconds), in training and validation.
        """
        return self.current_epoch >= self.config.optimizer.reconstruction_warmup_epochs

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Return the batch's loss, logging each loss and the gate."""
        losses = self.losses(batch, with_lm=self.with_lm())
        self.log_dict({f"train/{k}": v.detach() for k, v in losses.items()}, batch_size=len(batch["prompt"]))
        self.log("train/gate", self.adapter.gate.detach().squeeze())
        return losses["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Log the batch's losses, averaged over ranks."""
        losses = self.losses(batch, with_lm=self.with_lm())
        self.log_dict({f"val/{k}": v for k, v in losses.items()}, sync_dist=True, batch_size=len(batch["prompt"]))

    def configure_optimizers(self):
        """Return AdamW over the adapter's parameters."""
        return torch.optim.AdamW(
            self.adapter.parameters(),
            lr=self.config.optimizer.lr,
            betas=(0.9, 0.95),
            weight_decay=self.config.optimizer.weight_decay,
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep only the adapter's weights in the checkpoint, never the backbone's."""
        # Never the backbone: a checkpoint is the adapter (kilobytes) plus optimizer and loop state.
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith(ADAPTER_PREFIX)}

    def train(self, mode: bool = True):
        """Set training mode but keep the backbone in eval mode; return self."""
        super().train(mode)
        if self.backbone is not None:
            self.backbone.train(False)
        return self
