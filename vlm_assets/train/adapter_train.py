"""Occlusion-adapter training entry point: one process per device, started by torchrun or the launcher.

    torchrun --nnodes=1 --nproc-per-node=2 -m vlm_assets.train.adapter_train --config run.json

``run.json`` holds an ``AdapterTrainConfig`` and the launch's ``RunPaths`` (inputs ``occlusion_manifests``
and ``backbone``, a resolved directory or hub id). The backbone is frozen; only the 10,532 adapter parameters
are trained (DeepSpeed ZeRO-2 with frozen parameters excluded on GPUs, DDP with gloo on CPU). After
every validation epoch a recovery checkpoint (adapter, optimizer, loop state, metrics history) is
committed to the artifact store; a relaunch resumes from the newest intact one. Rank 0 writes
``adapter.safetensors`` and ``history.json`` into ``out_dir`` and reports through Pipes.
"""

import functools
import json
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from vlm_assets.data.occlusion_dataset import OcclusionSamples, collate
from vlm_assets.storage import ArtifactStore
from vlm_assets.train.adapter_config import AdapterTrainConfig
from vlm_assets.train.adapter_module import AdapterModule
from vlm_assets.train.checkpoints import CHECKPOINT_NAME, StoreCheckpointIO, latest_checkpoint
from vlm_assets.train.entry import TrainerRun, backend, entry_point
from vlm_assets.train.reporting import Reporter

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
# The frozen backbone is kept in eval mode on purpose (no dropout, fixed statistics): Lightning's
# warning about modules in eval mode at the start of training is about exactly that.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class EpochHistory(L.Callback):
    """A callback keeping per-epoch rows for ``history.json``, the materialization and the loggers.

    The loggers get them as ``train_epoch/<name>``. A row holds the means of the train values the module logged
    this epoch, and the validation metrics. Lightning logs the module's own values. Saved in every checkpoint, so a
    resumed run's history covers the whole run. (Lightning's ``on_epoch=True`` would log the train means only at
    the end of the training epoch, after this epoch's validation has been logged, one step earlier on the x-axis.)
    """

    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self.epochs: list[dict[str, float]] = []
        self.resumed_from_epoch: int | None = None
        self._sums: dict[str, float] = {}
        self._count = 0

    def on_train_start(self, trainer, pl_module) -> None:
        """Note the epoch a resumed run starts after, and log it."""
        if trainer.global_step:  # restored: the history came back with the checkpoint
            self.resumed_from_epoch = len(self.epochs)
            self.reporter.log(f"resumed after {len(self.epochs)} epoch(s) (step {trainer.global_step})")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        """Reset the sums of this epoch's train values."""
        self._sums, self._count = {}, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Add the batch's train values to the epoch's sums; log the optimizer step."""
        for k, v in trainer.callback_metrics.items():
            if k.startswith("train/"):
                self._sums[k] = self._sums.get(k, 0.0) + float(v)
        self._count += 1
        pl_module.log("step", float(trainer.global_step))  # the loggers' x-axis: the optimizer step

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Append the epoch's row (train means over every rank, validation metrics) and log it."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        # The mean over every rank's batches (a collective: every rank is here).
        means = {
            k: float(
                trainer.strategy.reduce(
                    torch.tensor(v / max(self._count, 1), device=pl_module.device), reduce_op="mean"
                )
            )
            for k, v in sorted(self._sums.items())
        }
        self.epochs.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                **means,
                **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
            }
        )
        # Equal on every rank already (Lightning asks epoch-level values to be synced); "step":
        # validation runs before Lightning counts the step.
        pl_module.log_dict(
            {
                **{k.replace("train/", "train_epoch/", 1): v for k, v in means.items()},
                "step": float(trainer.global_step),
            },
            sync_dist=True,
        )

    def state_dict(self) -> dict:
        """Return the history for a checkpoint."""
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        """Restore the history from a checkpoint."""
        self.epochs = state["epochs"]


def build_trainer(run: TrainerRun[AdapterTrainConfig], callbacks, checkpoint_io: StoreCheckpointIO) -> L.Trainer:
    """Return the adapter's Lightning trainer: DeepSpeed ZeRO-2 or DDP, checkpoints through ``checkpoint_io``."""
    config, cuda = run.config, torch.cuda.is_available()
    if config.parallelism.resolved_strategy(cuda) == "deepspeed":
        # Imported only here: DeepSpeed's import is about 3 s of a core, on the launch's critical path, and a
        # CPU launch trains with DDP.
        from vlm_assets.train.deepspeed_store import deepspeed_strategy

        strategy = deepspeed_strategy(checkpoint_io, stage=2, exclude_frozen_parameters=True)
    else:
        strategy = DDPStrategy(process_group_backend=backend(), checkpoint_io=checkpoint_io)
    return run.trainer(
        strategy,
        callbacks,
        max_epochs=config.optimizer.epochs,
        accumulate_grad_batches=config.accumulation(run.world),
        gradient_clip_val=config.optimizer.grad_clip or None,
    )


def train(run: TrainerRun[AdapterTrainConfig]) -> None:
    """Train the occlusion adapter on one process of the launch, then save and report it (the trainer's ``train``)."""
    config, paths, reporter = run.config, run.paths, run.reporter
    L.seed_everything(config.seed, workers=True, verbose=False)
    root = Path(paths.input("occlusion_manifests"))
    backbone = paths.input("backbone")
    train_data = OcclusionSamples(root, "train", config.data.image_size, config.data.num_train)
    val_data = OcclusionSamples(root, "validation", config.data.image_size, config.data.num_validation)
    resume = run.latest_checkpoint()
    history = EpochHistory(reporter)
    # After every validation, i.e. every epoch (the validation loop runs at each epoch's end).
    checkpoints = ModelCheckpoint(
        dirpath=run.cache / "staging",
        filename=CHECKPOINT_NAME,
        auto_insert_metric_name=False,
        every_n_epochs=1,
        save_on_train_epoch_end=False,
        save_top_k=-1,
        enable_version_counter=False,
    )
    trainer = build_trainer(run, [history, checkpoints], run.checkpoint_io(keep_last=2))
    module = AdapterModule(config, backbone)
    loader = functools.partial(DataLoader, batch_size=config.parallelism.micro_batch_size, collate_fn=collate)
    reporter.log(
        f"adapter on frozen {backbone}: {len(train_data)} train / {len(val_data)} val samples, "
        + (f"resuming from {resume[0]}" if resume else "starting from scratch")
    )
    run.fit(
        trainer, module, resume, train_dataloaders=loader(train_data, shuffle=True), val_dataloaders=loader(val_data)
    )
    if run.rank == 0:
        out = run.out
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in module.adapter.state_dict().items()},
            str(out / "adapter.safetensors"),
        )
        (out / "history.json").write_text(
            json.dumps({"epochs": history.epochs, "resumed_from_epoch": history.resumed_from_epoch})
        )
        last = history.epochs[-1]
        run.report(
            trainer,
            {
                **{k.replace("/", "_"): v for k, v in last.items()},
                "gate": float(module.adapter.gate.detach()),
                "epochs": config.optimizer.epochs,
                "strategy": config.parallelism.resolved_strategy(torch.cuda.is_available()),
                "resumed_from_epoch": -1 if history.resumed_from_epoch is None else history.resumed_from_epoch,
            },
        )
    trainer.strategy.barrier("adapter written")


def partial_from_checkpoint(store: ArtifactStore, prefix: str, staging: Path) -> dict:
    """The adapter weights and history of the newest intact recovery checkpoint, written like a result."""
    found = latest_checkpoint(store, prefix, lambda message: None)
    if found is None:
        raise RuntimeError(f"training failed before its first recovery checkpoint under {prefix}")
    checkpoint = torch.load(found[1], map_location="cpu", weights_only=False)
    weights = {k.removeprefix("adapter."): v.contiguous() for k, v in checkpoint["state_dict"].items()}
    save_file(weights, str(staging / "adapter.safetensors"))
    epochs = checkpoint["callbacks"]["EpochHistory"]["epochs"]
    (staging / "history.json").write_text(json.dumps({"epochs": epochs, "resumed_from_epoch": None, "partial": True}))
    return {
        "epochs": len(epochs),
        "gate": float(weights["gate"]),
        "resumed_from_epoch": -1,
        **{k.replace("/", "_"): v for k, v in epochs[-1].items() if isinstance(v, float)},
    }


main = entry_point(AdapterTrainConfig, train)

if __name__ == "__main__":
    main()
