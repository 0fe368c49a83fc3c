"""Checkpoints committed through the artifact store (local or S3), and finding the one to resume from.

Every ``every`` optimizer steps (and at the end) the trainer writes one consolidated Lightning
checkpoint (model, optimizer, LR scheduler, loop progress, callback state, and the data module's
streaming position) and rank 0 commits it atomically as ``<prefix>/step-<N>``; only the newest
``keep_last`` are kept. On start every rank takes the newest checkpoint whose files still match their
checksums: a truncated or damaged one is reported and skipped for the previous complete one.
"""

import shutil
from collections.abc import Callable
from pathlib import Path

import lightning as L

from vlm_assets.storage import ArtifactStore, CorruptArtifactError

CHECKPOINT_FILE = "checkpoint.ckpt"


def step_key(prefix: str, step: int) -> str:
    return f"{prefix.strip('/')}/step-{step:08d}"


def latest_checkpoint(store: ArtifactStore, prefix: str, log: Callable[[str], None],
                      cache_dir: Path | None = None) -> tuple[str, Path] | None:
    """(key, local checkpoint file) of the newest complete, uncorrupted checkpoint; None if there is none."""
    for key in reversed(store.list_complete(prefix)):
        try:
            store.verify(key, cache_dir)
        except CorruptArtifactError as err:
            log(f"skipping damaged checkpoint {key}: {err}")
            continue
        return key, store.local_path(key, cache_dir) / CHECKPOINT_FILE
    return None


class StoreCheckpoint(L.Callback):
    def __init__(self, store: ArtifactStore, prefix: str, *, every: int, keep_last: int, val_every: int,
                 staging: Path, log: Callable[[str], None]):
        self.store, self.prefix, self.every, self.keep_last = store, prefix, every, keep_last
        self.val_every = val_every
        self.staging, self.report = staging, log
        self._last_saved = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_saved = trainer.global_step  # a resumed run does not re-save the step it resumed at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step only moves on the micro-batch that stepped the optimizer, so this never saves
        # in the middle of a gradient accumulation. A step that validates is saved after validation,
        # so the checkpoint's history holds that validation too.
        step = trainer.global_step
        if step != self._last_saved and step % self.every == 0 and step % self.val_every != 0:
            self.save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if trainer.state.fn == "fit" and step != self._last_saved and step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_saved:
            self.save(trainer)

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

    def save(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        local = self.staging / f"step-{step:08d}"
        # Collective; rank 0 writes one consolidated file. Full state (optimizer, loops, callbacks,
        # streaming position), so not weights-only.
        trainer.save_checkpoint(local / CHECKPOINT_FILE, weights_only=False)
        if trainer.is_global_zero:
            key = step_key(self.prefix, step)
            self._drop_if_damaged(key)
            ref = self.store.commit(key, local, metadata={"step": step, "epoch": trainer.current_epoch})
            shutil.rmtree(local, ignore_errors=True)
            for old in self.store.list_complete(self.prefix)[: -self.keep_last]:
                self.store.delete(old)
            self.report(f"checkpoint step {step} committed: {ref.uri}")
        trainer.strategy.barrier("checkpoint committed")
        self._last_saved = step
