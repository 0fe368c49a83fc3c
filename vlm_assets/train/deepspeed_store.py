"""Lightning's ``DeepSpeedStrategy`` with checkpoints committed to the artifact store, on GPUs and on CPU
(gloo): the adapter's ZeRO-2 and VisualChat's ZeRO-2/3 train through it."""

import argparse
import contextlib
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from vlm_assets.storage.disk import staged_write
from vlm_assets.train.checkpoints import CHECKPOINT_FILE, StoreCheckpointIO

# DeepSpeed imports its Muon optimizer at its first ZeRO optimizer check, about 1 s of a core; imported
# with this module, it is paid once per node by the agent that forks the workers (launch.lifeline).
with contextlib.suppress(ImportError):
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


def deepspeed_strategy(checkpoint_io: StoreCheckpointIO, **settings: Any) -> DeepSpeedStrategy:
    """The strategy for this machine: ``settings`` are ``DeepSpeedStrategy``'s (``stage``, ...)."""
    strategy = StoreDeepSpeedStrategy if torch.cuda.is_available() else CPUStoreDeepSpeedStrategy
    return strategy(checkpoint_io, **settings)


class StoreDeepSpeedStrategy(DeepSpeedStrategy):
    """A DeepSpeed strategy committing its checkpoints to the artifact store.

    DeepSpeed writes its checkpoints itself (a directory every rank writes its shards into), never through a
    ``CheckpointIO``: the directory is committed the same way once all ranks have written it. Multi-node runs need
    the staging directory on a shared volume.
    """

    def __init__(self, checkpoint_io: StoreCheckpointIO, **kwargs):
        super().__init__(**kwargs)
        self.committer = checkpoint_io

    def _init_deepspeed_distributed(self) -> None:
        """Initialise DeepSpeed's process group; on one rank, mute torch's warning on DeepSpeed's own barriers."""
        super()._init_deepspeed_distributed()
        if self.world_size == 1:
            # DeepSpeed binds no device to a single rank's NCCL group (deepspeedai/DeepSpeed#8248), and its
            # save_checkpoint calls dist.barrier() without device_ids: torch then warns that it uses the
            # current device, which Lightning has set to this rank's. With one rank there is no other
            # device a barrier could pick, so the filter is process-wide (torch attributes the warning to
            # its own c10d_logger, not to the caller, so a module filter cannot scope it to DeepSpeed).
            warnings.filterwarnings("ignore", "barrier\\(\\): using the device under current context", UserWarning)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Write the checkpoint's shards from every rank into one staging folder; rank 0 then commits it."""
        local = Path(self.broadcast(str(Path(filepath).with_suffix(""))))
        with staged_write(local, f"checkpoint step {checkpoint['global_step']}"):
            super().save_checkpoint(checkpoint, local / CHECKPOINT_FILE, storage_options)
        self.barrier("deepspeed checkpoint written")
        if self.is_global_zero:
            self.committer.commit(local, checkpoint["global_step"], checkpoint["epoch"])


class CPUStoreDeepSpeedStrategy(StoreDeepSpeedStrategy):
    """The same strategy on CPU (DS_ACCELERATOR=cpu, gloo), as CI runs the GPU path.

    Lightning refuses any accelerator but CUDA in its set-up (a check, and GPU indices per rank), while DeepSpeed
    itself runs ZeRO on CPU: these three steps do what Lightning's do, minus the CUDA parts.
    """

    def setup_environment(self) -> None:
        """Set up the device and the process group as DDP does, without Lightning's CUDA check."""
        DDPStrategy.setup_environment(self)  # the device, then setup_distributed below

    def setup_distributed(self) -> None:
        """Reset the seed, set the world ranks and initialise DeepSpeed's process group."""
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        engine, optimizer, _, _ = deepspeed.initialize(  # Lightning passes the device's index: None on CPU
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, optimizer
