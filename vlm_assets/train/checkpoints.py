"""Checkpoints committed through the artifact store (local or S3), and finding the one to resume from.

Lightning's ``ModelCheckpoint`` (``StepCheckpoint``) decides when: every ``every`` optimizer steps
and at the end. The trainer writes one consolidated checkpoint (model, optimizer, LR scheduler,
loop progress, callback state, and the data module's streaming position), and Lightning hands it
to its ``CheckpointIO`` plugin on global rank 0: ``StoreCheckpointIO`` commits it atomically as
``<prefix>/step-<N>`` and keeps the newest ``keep_last``. On start every rank takes the newest
checkpoint whose files still match their checksums: a truncated or damaged one is reported and
skipped for the previous complete one.
"""

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vlm_assets.storage import ArtifactStore, CorruptArtifactError
from vlm_assets.storage.disk import staged_write

CHECKPOINT_FILE = "checkpoint.ckpt"
CHECKPOINT_NAME = "step-{step:08d}"  # ModelCheckpoint's file name: StoreCheckpointIO commits it as <prefix>/step-<N>


def step_key(prefix: str, step: int) -> str:
    """Return the store key of the checkpoint of ``step`` under ``prefix``."""
    return f"{prefix.strip('/')}/step-{step:08d}"


def latest_checkpoint(
    store: ArtifactStore, prefix: str, log: Callable[[str], None], cache_dir: Path | None = None
) -> tuple[str, Path] | None:
    """(key, local checkpoint file) of the newest complete, uncorrupted checkpoint; None if there is none."""
    for key in reversed(store.list_complete(prefix)):
        try:
            store.verify(key, cache_dir)
        except CorruptArtifactError as err:
            log(f"skipping damaged checkpoint {key}: {err}")
            continue
        return key, store.local_path(key, cache_dir) / CHECKPOINT_FILE
    return None


class StoreCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with the artifact store behind it.

    ``path`` is a local staging file (``.../step-<N>.ckpt``, named by ``StepCheckpoint``): the checkpoint is
    written there, committed as ``<prefix>/step-<N>`` and the staging copy removed; then all but the newest
    ``keep_last`` are deleted from the store. The rotation is here and not ModelCheckpoint's ``save_top_k`` because
    that bookkeeping is keyed by local paths, which change with every attempt's scratch directory:
    after a relaunch it would forget the checkpoints of the attempt it resumes; the store's listing
    is the truth across attempts.
    """

    def __init__(self, store: ArtifactStore, prefix: str, *, keep_last: int, log: Callable[[str], None]):
        super().__init__()
        self.store, self.prefix, self.keep_last, self.report = store, prefix, keep_last, log

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write the checkpoint into a staging folder beside ``path``, then commit it."""
        local = Path(path).with_suffix("")  # .../step-<N>/checkpoint.ckpt: the layout of a committed one
        step = checkpoint["global_step"]
        with staged_write(local, f"checkpoint step {step}"):
            super().save_checkpoint(checkpoint, local / CHECKPOINT_FILE, storage_options)
        self.commit(local, step, checkpoint["epoch"])

    def commit(self, local: Path, step: int, epoch: int) -> None:
        """Commit the staged checkpoint as ``<prefix>/step-<N>`` and remove the staging copy.

        A damaged checkpoint under that key is dropped first; all but the newest ``keep_last`` are deleted after.
        """
        key = step_key(self.prefix, step)
        self._drop_if_damaged(key)
        ref = self.store.commit(key, local, metadata={"step": step, "epoch": epoch})
        shutil.rmtree(local, ignore_errors=True)
        for old in self.store.list_complete(self.prefix)[: -self.keep_last]:
            self.store.delete(old)
        self.report(f"checkpoint step {step} committed: {ref.uri}")

    def remove_checkpoint(self, path) -> None:
        """Delete from the store the checkpoint that ``path`` names by its step."""
        if match := re.fullmatch(r"step-(\d+)(\.ckpt)?", Path(path).name):
            self.store.delete(step_key(self.prefix, int(match.group(1))))

    def _drop_if_damaged(self, key: str) -> None:
        """A commit never replaces a complete artifact (the first commit of a key wins), so a damaged
        checkpoint this resumed run is about to write again is removed first. An intact one stays:
        it holds the same step of the same deterministic run."""
        if not self.store.exists(key):
            return
        try:
            self.store.verify(key)
        except CorruptArtifactError as err:
            self.report(f"replacing damaged checkpoint {key}: {err}")
            self.store.delete(key)


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every`` optimizer steps and at the end of training, into ``staging``.

    ``StoreCheckpointIO`` commits each one. Two things ModelCheckpoint does not do by itself, added here:

    - a step that also validates is saved *after* its validation. ModelCheckpoint saves in
      ``on_train_batch_end``, before that step's validation, and Lightning resumes such a
      checkpoint past the validation point without running it: a resumed run would miss it;
    - a resumed run does not save again the step it resumed at (ModelCheckpoint's memory of the
      last saved step is not part of its checkpointed state).
    """

    def __init__(self, staging: Path, *, every: int, val_every: int | None = None):
        super().__init__(
            dirpath=staging,
            filename=CHECKPOINT_NAME,
            auto_insert_metric_name=False,
            every_n_train_steps=every,
            save_top_k=-1,
            enable_version_counter=False,
        )
        self.every, self.val_every = every, val_every

    def _validates(self, step: int) -> bool:
        return self.val_every is not None and step % self.val_every == 0

    def on_train_start(self, trainer, pl_module) -> None:
        """Take the step training starts at as saved already."""
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Save as ``ModelCheckpoint`` does, except on a step that also validates."""
        if not self._validates(trainer.global_step):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        """Save a step that validates, after its validation."""
        step = trainer.global_step
        if not self._should_skip_saving_checkpoint(trainer) and step % self.every == 0 and self._validates(step):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        """Save the last step, unless it was saved already."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


class StepSeed(Callback):
    """A callback reseeding torch's generators (CPU and every GPU) before each micro-batch.

    The seed comes from (seed, rank, optimizer step, micro-batch of that step), so that dropout draws the same masks
    in a run resumed from a checkpoint as in the run never stopped, with no random state to save. Lightning's
    checkpoints carry no generator state (and each new epoch's loader draws from the global stream too), so a
    resumed run would otherwise restart the stream at the seed.
    """

    def __init__(self, seed: int):
        self.seed, self.step, self.micro = seed, -1, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Reseed torch from (seed, rank, optimizer step, micro-batch) before the micro-batch."""
        if trainer.global_step != self.step:
            self.step, self.micro = trainer.global_step, 0
        entropy = [self.seed % 2**32, trainer.global_rank, self.step, self.micro]
        torch.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]))
        self.micro += 1
