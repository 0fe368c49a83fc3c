"""The trainers' one entry point, written once for the three (``gpt_pretrain``, ``adapter_train``,
``visualchat_train``): the ``--config`` argument and its run file, this process's rank and world, the
Pipes reporter, refused input as exit 65, checkpoint discovery and commit through the artifact store,
Lightning's trainer on the launch's topology, and the process group's teardown. A trainer module
writes its model, data and loss, and ``main = entry_point(ItsConfig, train)``; ``train(run)`` gets a
``TrainerRun``.
"""

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from vlm_assets.launch.spec import exit_on_refused_input
from vlm_assets.storage import ArtifactStore, store_from_spec
from vlm_assets.train.checkpoints import StoreCheckpointIO, latest_checkpoint
from vlm_assets.train.reporting import Reporter, process_group_backend, quiet_lightning
from vlm_assets.train.run_config import C, RunPaths, read_run_file


def backend() -> str:
    """The collective backend for this machine: NCCL with a GPU, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclasses.dataclass
class TrainerRun(Generic[C]):
    """One process of a launched training run: what the run file says, and where this rank works."""

    config: C
    paths: RunPaths
    reporter: Reporter
    rank: int = dataclasses.field(default_factory=lambda: int(os.environ.get("RANK", 0)))
    world: int = dataclasses.field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", 1)))

    @functools.cached_property
    def store(self) -> ArtifactStore:
        """The artifact store the checkpoints are committed to and resumed from."""
        return store_from_spec(self.paths.checkpoint_store)

    @property
    def cache(self) -> Path:
        """This rank's scratch (downloaded checkpoints, staging), inside the run's own."""
        return Path(self.paths.cache_dir) / f"rank{self.rank}"

    @property
    def out(self) -> Path:
        """Where rank 0 writes the artifact's files (created)."""
        out = Path(self.paths.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return out

    def latest_checkpoint(self) -> tuple[str, Path] | None:
        """Return (key, local file) of the newest intact checkpoint of this run's key, or None."""
        return latest_checkpoint(
            self.store, self.paths.checkpoint_prefix, self.reporter.log, cache_dir=self.cache / "checkpoints"
        )

    def checkpoint_io(self, keep_last: int) -> StoreCheckpointIO:
        """Return a checkpoint IO committing each checkpoint to the store under ``<prefix>/step-<N>``.

        It keeps the newest ``keep_last``.
        """
        return StoreCheckpointIO(self.store, self.paths.checkpoint_prefix, keep_last=keep_last, log=self.reporter.log)

    def trainer(self, strategy: Any, callbacks: list[L.Callback], **settings: Any) -> L.Trainer:
        """Return Lightning's ``Trainer`` on the launch's topology (nodes x local processes).

        It runs bf16-mixed on a GPU and fp32 on CPU, logs to the reporter's loggers, and has no progress bars or
        summaries.
        """
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        cuda = torch.cuda.is_available()
        return L.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=local_world,
            num_nodes=self.world // local_world,
            strategy=strategy,
            precision="bf16-mixed" if cuda else "32-true",
            num_sanity_val_steps=0,
            logger=self.reporter.loggers(),
            log_every_n_steps=self.config.log_every,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            **settings,
        )

    def fit(self, trainer: L.Trainer, module: L.LightningModule, resume: tuple[str, Path] | None, **data: Any) -> None:
        """Run ``trainer.fit``, resumed from ``resume`` when given.

        ``resume`` is our own full checkpoint, its sha256 verified against the manifest, hence ``weights_only=False``.
        """
        trainer.fit(module, ckpt_path=str(resume[1]) if resume else None, weights_only=False, **data)

    def report(self, trainer: L.Trainer, metrics: dict[str, Any]) -> None:
        """Send rank 0's one Pipes report, the asset's materialization.

        It carries ``metrics`` and how the run ran (its processes, precision and process-group backend, read from
        what ran).
        """
        how = {"world_size": trainer.world_size, "precision": trainer.precision, "backend": process_group_backend()}
        self.reporter.materialization({**metrics, **how})


def entry_point(config_type: type[C], train: Callable[[TrainerRun[C]], None]) -> Callable[[list[str] | None], None]:
    """Return a trainer module's ``main`` for ``config_type`` and ``train``.

    ``main`` reads the run file named by ``--config`` as ``config_type``, runs ``train`` with this process's
    ``TrainerRun``, turns ``InputRefused`` into exit 65 (never retried) and destroys the process group on the way
    out, whatever ended the run.
    """

    def main(argv: list[str] | None = None) -> None:
        parser = argparse.ArgumentParser(description=f"{train.__module__}: run one process of a launched training")
        parser.add_argument("--config", type=Path, required=True, help=f"a run file: {config_type.__name__} + RunPaths")
        config, paths = read_run_file(parser.parse_args(argv).config, config_type)
        quiet_lightning()
        rank = int(os.environ.get("RANK", 0))
        # Lightning reads the rank from the environment once, at its import; a worker forked from its agent
        # (vlm_assets.launch.lifeline) imported it before torchrun set RANK.
        rank_zero_only.rank = rank
        with exit_on_refused_input(), Reporter.open(rank, paths.mlflow_tracking_uri, paths.mlflow_run_id) as reporter:
            try:
                train(TrainerRun(config, paths, reporter, rank))
            finally:
                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()

    return main
