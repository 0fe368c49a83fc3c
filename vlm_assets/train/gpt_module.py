"""Lightning parts of GPT pretraining: the module (loss, optimizer, schedule, clipping) and the
streaming data module (per-rank shards, resumable position)."""

import math

import lightning as L
import torch
from torch.utils.data import DataLoader

from vlm_assets.data.token_stream import collate_tokens, token_dataset
from vlm_assets.models.gpt import GPT, GPTConfig
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.parallelize import apply_activation_checkpointing, apply_fsdp2
from vlm_assets.train.reporting import MAX_LOG_PPL_LOSS


def perplexity(loss: torch.Tensor) -> torch.Tensor:
    """Return the perplexity of a mean loss, the loss clamped to ``MAX_LOG_PPL_LOSS`` first."""
    return torch.exp(loss.detach().float().clamp(max=MAX_LOG_PPL_LOSS))


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings (>= 2-D) only, never on biases or LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class GPTPretrainModule(L.LightningModule):
    """The Lightning module that pretrains the ``GPT`` decoder."""

    def __init__(self, model_config: GPTConfig, config: PretrainConfig, lr: float):
        super().__init__()
        self.model_config = model_config
        self.config = config
        self.lr = lr
        self.model: GPT | None = None
        self.step_losses: list[float] = []  # train loss of each micro-batch of the current optimizer step

    def configure_model(self) -> None:
        """Build the model once, with activation checkpointing, per-block compilation and FSDP2 as configured."""
        if self.model is not None:  # called again by trainer.validate after fit
            return
        self.model = GPT(self.model_config)
        if self.config.parallelism.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if self.config.parallelism.compile:
            # per block, before sharding (torchtitan's order): one graph serves every block, and
            # Module.compile keeps the parameter names the checkpoints and the export use
            for block in self.model.blocks:
                block.compile()
        if self.config.parallelism.strategy == "fsdp2":
            apply_fsdp2(self.model, self.device_mesh["data_parallel"], bf16=self.trainer.precision == "bf16-mixed")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, return_logits: bool = True):
        """Return the model's logits (None unless ``return_logits``) and loss (None without ``labels``)."""
        return self.model(input_ids, labels, return_logits=return_logits)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Return a micro-batch's loss, kept for the optimizer step's mean."""
        _, loss = self(batch["input_ids"], batch["labels"], return_logits=False)
        self.step_losses.append(loss.detach().float().item())  # logged per optimizer step: TrainingHistory
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Log a validation batch's loss, averaged over ranks."""
        _, loss = self(batch["input_ids"], batch["labels"], return_logits=False)
        self.log("val/loss", loss, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        """Log the validation perplexity."""
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/perplexity", perplexity(loss), sync_dist=True)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the gradients to the configured norm (of the full gradient, DDP or FSDP2) and log it."""
        # Gradient clipping, one code path for both strategies. Under DDP the gradients are already
        # all-reduced, so the local norm is the global one. Under FSDP2 the gradients are DTensor
        # shards: torch.nn.utils.clip_grad_norm_ computes each shard's norm and all-reduces them
        # through DTensor, so the clipping uses the norm of the *full* gradient (what torchtitan does;
        # Lightning's own norm clipping is refused for sharded strategies for this reason).
        if self.config.optimizer.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.optimizer.grad_clip, foreach=True
            )
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.log("train/grad_norm", norm)

    def configure_optimizers(self):
        """Return AdamW with a per-step warmup-cosine learning-rate schedule."""
        fused = self.device.type == "cuda"
        optimizer = torch.optim.AdamW(
            param_groups(self.model, self.config.optimizer.weight_decay),
            lr=self.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=fused,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step,
                warmup=self.config.optimizer.warmup_steps,
                total=self.config.optimizer.max_steps,
                min_ratio=self.config.optimizer.min_lr_ratio,
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TokenDataModule(L.LightningDataModule):
    """``token_shards`` through ``StreamingDataset``, its train position part of every checkpoint.

    Streaming partitions samples over ranks itself (Lightning's distributed sampler is switched off by the
    trainer). The position is the number of samples consumed this epoch, counted on batches the model
    actually received (not those Lightning prefetched), in streaming's own resume format.

    Counted here, not by streaming's ``StreamingDataLoader.state_dict``: that one counts the batches
    the loader has yielded, and Lightning's fit loop fetches one batch ahead (to know the last one), so
    a checkpoint would resume one batch past what the model consumed.
    """

    def __init__(self, config: PretrainConfig, shards_uri: str, cache_dir: str):
        super().__init__()
        self.config, self.shards_uri, self.cache_dir = config, shards_uri, cache_dir
        self.train_data = None
        self.val_data = None
        self._epoch: int | None = None
        self._consumed = 0  # global samples handed to the model in the current epoch of this process

    def setup(self, stage: str) -> None:
        """Open the train (shuffled) and val streaming datasets, once."""
        cache = f"{self.cache_dir}/shards"
        if self.train_data is None:
            self.train_data = token_dataset(
                self.shards_uri,
                "train",
                cache_dir=cache,
                batch_size=self.config.parallelism.micro_batch_size,
                shuffle=True,
                seed=self.config.seed,
            )
            self.val_data = token_dataset(
                self.shards_uri, "val", cache_dir=cache, batch_size=self.config.parallelism.micro_batch_size
            )

    def _loader(self, data, **kwargs) -> DataLoader:
        batch, workers = self.config.parallelism.micro_batch_size, self.config.data.num_workers
        return DataLoader(data, batch_size=batch, collate_fn=collate_tokens, num_workers=workers, **kwargs)

    def train_dataloader(self) -> DataLoader:
        """Return the train loader, dropping the last partial batch."""
        return self._loader(self.train_data, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Return the val loader."""
        return self._loader(self.val_data)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Count the samples of a training batch as consumed this epoch; return the batch."""
        if self.trainer.training:
            if self.trainer.current_epoch != self._epoch:
                self._epoch, self._consumed = self.trainer.current_epoch, 0
            self._consumed += batch["input_ids"].shape[0] * self.trainer.world_size
        return batch

    def state_dict(self) -> dict:
        """Return the stream's resume state at the samples consumed this epoch (empty before training)."""
        if self._epoch is None:
            return {}
        return {"stream": self.train_data.state_dict(self._consumed, from_beginning=False)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream's position, picked up at its next iteration."""
        # Lightning restores after setup() and before the train loader is first iterated: streaming
        # picks the position up at its next __iter__.
        if "stream" in state:
            self.train_data.load_state_dict(state["stream"])
