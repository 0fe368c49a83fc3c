"""What a training process reports, and to whom: global rank 0 talks to Dagster through Pipes (when
launched by Dagster) and to MLflow (when given a run); every other rank stays quiet. Run by hand with
plain ``torchrun``, the same reports go to stdout."""

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L


class Reporter:
    def __init__(self, rank: int, pipes=None, mlflow=None, run_id: str | None = None):
        self.rank, self.pipes, self.mlflow, self.run_id = rank, pipes, mlflow, run_id

    @classmethod
    @contextlib.contextmanager
    def open(cls, rank: int, tracking_uri: str | None, run_id: str | None) -> Iterator["Reporter"]:
        if rank != 0:
            yield cls(rank)
            return
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        client = None
        if tracking_uri and run_id:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri)
        with contextlib.ExitStack() as stack:
            pipes = stack.enter_context(open_dagster_pipes()) if PipesEnvVarParamsLoader().is_dagster_pipes_process() else None
            yield cls(rank, pipes, client, run_id)

    def log(self, message: str) -> None:
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.log.info(message)
        else:
            print(message, flush=True)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.rank != 0:
            return
        if self.mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.mlflow.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])
        self.log(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in values.items()))

    def materialization(self, metadata: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata)
        else:
            print(json.dumps({"materialization": metadata}), flush=True)


class TrainingHistory(L.Callback):
    """Per-step train loss and learning rate, per-validation val loss, reported every ``every`` steps.
    Its state is saved in every checkpoint, so a resumed run's history covers the whole run."""

    def __init__(self, reporter: Reporter, every: int, max_steps: int, tokens_per_step: int):
        self.reporter, self.every, self.max_steps, self.tokens_per_step = reporter, every, max_steps, tokens_per_step
        self.train: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []
        self.resumed_from_step: int | None = None
        self._started = 0.0
        self._start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._started, self._start_step = time.perf_counter(), trainer.global_step
        if trainer.global_step:
            self.resumed_from_step = trainer.global_step
            self.reporter.log(f"resumed at step {trainer.global_step} (epoch {trainer.current_epoch})")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not pl_module.step_losses or (self.train and self.train[-1]["step"] >= step) or step == self._start_step:
            return  # still accumulating this optimizer step
        loss = sum(pl_module.step_losses) / len(pl_module.step_losses)
        pl_module.step_losses.clear()
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.train.append({"step": step, "loss": loss, "lr": lr})
        if step % self.every == 0 or step == self.max_steps:
            self.reporter.metrics({"train/loss": loss, "train/lr": lr, "train/tokens_per_s": self.tokens_per_s(step)}, step)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        loss = float(trainer.callback_metrics["val/loss"])
        if self.val and self.val[-1]["step"] == trainer.global_step:
            return
        self.val.append({"step": trainer.global_step, "loss": loss})
        self.reporter.metrics({"val/loss": loss}, trainer.global_step)

    def tokens_per_s(self, step: int) -> float:
        """Training tokens per second of this process' run (a resumed run counts from its restart)."""
        elapsed = time.perf_counter() - self._started
        return (step - self._start_step) * self.tokens_per_step / max(elapsed, 1e-9)

    def state_dict(self) -> dict:
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state: dict) -> None:
        self.train, self.val = state["train"], state["val"]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"train": self.train, "val": self.val, "resumed_from_step": self.resumed_from_step}))
