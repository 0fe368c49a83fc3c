"""What a training process reports, and to whom. Metrics go through Lightning's loggers: MLflow's
(``MLFlowLogger``, attached to the asset's MLflow run) and a small Pipes logger (one Dagster log line
per report); logs and the final materialization metadata go through Dagster Pipes. Global rank 0
reports; every other rank stays quiet. Run by hand with plain ``torchrun``, the same reports go to
stdout."""

import contextlib
import json
import logging
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import Logger, MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only


def quiet_lightning() -> None:
    """Keep Lightning's start-up banner and its warnings about its own internals out of the Dagster log.

    The banner tells the accelerator, TPU, distributed set-up and a logging-service tip, on every launch: the
    launcher already says how it runs.
    """
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Lightning 2.6 calls a torch.utils._pytree API that torch deprecated: nothing of ours.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    # ... and its all_gather a torch.distributed.nn API that torch deprecated.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")


def process_group_backend() -> str:
    """Return the backend of this process's default group ("nccl", "gloo"), or "none" without one (a single process).

    It is read from torch.distributed, so that metadata and tests say what really ran.
    """
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"


MAX_LOG_PPL_LOSS = 20.0  # perplexity = exp(min(loss, 20)): finite in the first steps


class Reporter:
    """Where a training process reports: on rank 0, Dagster Pipes when launched by Dagster, stdout otherwise."""

    def __init__(self, rank: int, pipes=None, tracking_uri: str | None = None, run_id: str | None = None):
        self.rank, self.pipes, self.tracking_uri, self.run_id = rank, pipes, tracking_uri, run_id

    @classmethod
    @contextlib.contextmanager
    def open(cls, rank: int, tracking_uri: str | None, run_id: str | None) -> Iterator["Reporter"]:
        """Yield this rank's reporter; rank 0 opens Dagster Pipes for it when launched by Dagster."""
        if rank != 0:
            yield cls(rank, None, tracking_uri, run_id)
            return
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        with contextlib.ExitStack() as stack:
            pipes = (
                stack.enter_context(open_dagster_pipes())
                if PipesEnvVarParamsLoader().is_dagster_pipes_process()
                else None
            )
            yield cls(rank, pipes, tracking_uri, run_id)

    def loggers(self) -> list[Logger]:
        """Return Lightning loggers for the trainer: Pipes on every rank, MLflow's on rank 0 only.

        Lightning logs on rank 0 alone; on another rank the MLflow logger would only cost its import and client
        (about 2 s of CPU in each process).
        """
        loggers: list[Logger] = [PipesLogger(self)]
        if self.rank == 0 and self.tracking_uri and self.run_id:
            loggers.append(StepRunMLFlowLogger(tracking_uri=self.tracking_uri, run_id=self.run_id))
        return loggers

    def log(self, message: str) -> None:
        """Log ``message`` from rank 0 (to Pipes, else stdout); other ranks say nothing."""
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.log.info(message)
        else:
            print(message, flush=True)

    def materialization(self, metadata: dict[str, Any]) -> None:
        """Report the asset's materialization with ``metadata`` from rank 0 (to Pipes, else stdout as JSON)."""
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata)
        else:
            print(json.dumps({"materialization": metadata}), flush=True)


class PipesLogger(Logger):
    """A Lightning logger writing each report as one line, ``step N: name=value ...``, to the Dagster run log.

    The line goes through Pipes when launched by Dagster, to stdout otherwise.
    """

    def __init__(self, reporter: Reporter):
        super().__init__()
        self.reporter = reporter

    @property
    def name(self) -> str:
        """The logger's name: ``dagster``."""
        return "dagster"

    @property
    def version(self) -> str:
        """The logger's version: ``pipes``."""
        return "pipes"

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """Log nothing: the asset's MLflow run holds the config as params."""
        pass  # the asset's MLflow run holds the config as params; the Dagster log shows it at launch

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log ``metrics`` (but the epoch) at ``step`` as one line."""
        shown = {k: v for k, v in sorted(metrics.items()) if k != "epoch"}
        if shown:
            self.reporter.log(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))


class StepRunMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` on the asset's MLflow run, which the Dagster step opened and ends itself."""

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Leave the MLflow run open: the Dagster step ends it."""
        # MLFlowLogger.finalize ends the run when fit returns: before the step has exported and
        # committed the model, and as FINISHED even when the step fails after training.


class TrainingHistory(L.Callback):
    """A callback keeping per-step train loss, learning rate and end time, and per-validation val loss.

    End times are epoch seconds (steady-state speed from timestamps); the history is kept for ``history.json`` and
    the loss plot; the step's metrics are logged through the trainer's loggers, which report them
    every ``log_every_n_steps``. Its state is saved in every checkpoint, so a resumed run's history
    covers the whole run. ``tokens_per_step`` None: the steps' sizes vary, no tokens/s is logged.
    """

    def __init__(self, reporter: Reporter, max_steps: int, tokens_per_step: int | None):
        self.reporter, self.max_steps, self.tokens_per_step = reporter, max_steps, tokens_per_step
        self.train: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []
        self.resumed_from_step: int | None = None
        self._started = 0.0
        self._start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        """Start the clock at the first step of this process, and log a resume."""
        self._started, self._start_step = time.perf_counter(), trainer.global_step
        if trainer.global_step:
            self.reporter.log(f"resumed at step {trainer.global_step} (epoch {trainer.current_epoch})")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Record and log an optimizer step's mean loss and learning rate once all its micro-batches ran."""
        step = trainer.global_step
        if not pl_module.step_losses or (self.train and self.train[-1]["step"] >= step) or step == self._start_step:
            return  # still accumulating this optimizer step
        # The optimizer step's loss is the mean over its micro-batches: a value logged in
        # training_step would be reported as the last micro-batch's alone.
        loss = sum(pl_module.step_losses) / len(pl_module.step_losses)
        pl_module.step_losses.clear()
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.train.append({"step": step, "loss": loss, "lr": lr, "time": time.time()})
        # ThroughputMonitor would report tokens/s only once its 100-batch window fills; "step" sets
        # the loggers' x-axis to the optimizer step (Lightning's default is one less here).
        metrics = {"train/loss": loss, "train/perplexity": math.exp(min(loss, MAX_LOG_PPL_LOSS)), "train/lr": lr}
        if self.tokens_per_step is not None:
            metrics["train/tokens_per_s"] = self.tokens_per_s(step)
        pl_module.log_dict({**metrics, "step": float(step)})

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Record the validation loss at the current step, once per step."""
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        # "step": validation runs before Lightning counts the step; the same on every rank (synced
        # only because Lightning asks epoch-level values to be).
        pl_module.log("step", float(trainer.global_step), sync_dist=True)
        loss = float(trainer.callback_metrics["val/loss"])
        if self.val and self.val[-1]["step"] == trainer.global_step:
            return
        self.val.append({"step": trainer.global_step, "loss": loss})

    def tokens_per_s(self, step: int) -> float:
        """Training tokens per second of this process' run (a resumed run counts from its restart)."""
        elapsed = time.perf_counter() - self._started
        return (step - self._start_step) * self.tokens_per_step / max(elapsed, 1e-9)

    def state_dict(self) -> dict:
        """Return the history for a checkpoint."""
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state: dict) -> None:
        """Restore the history from a checkpoint, whose step is the history's last.

        That step is the resumed step, also when the checkpoint is the final one (Lightning then starts no training,
        and no ``on_train_start``).
        """
        self.train, self.val = state["train"], state["val"]
        self.resumed_from_step = self.train[-1]["step"] if self.train else 0

    def save(self, path: Path) -> None:
        """Write the history and the step it resumed from as JSON to ``path``."""
        path.write_text(json.dumps({"train": self.train, "val": self.val, "resumed_from_step": self.resumed_from_step}))
