"""Training launchers as Dagster resources: the asset builds a ``LaunchSpec``, the launcher runs it.

Only the launcher knows where processes run. ``LocalTorchrunLauncher`` (the embedded default) starts
one torchrun per node on 127.0.0.1; a Kubernetes launcher (one pod per node, a headless Service as the
rendezvous endpoint) implements the same ``launch`` beside it, and no asset changes. Either way the
workers get the Dagster Pipes bootstrap environment and global rank 0 reports logs, metrics and the
final materialization metadata through it.
"""

import contextlib
import multiprocessing
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from vlm_assets.launch import LaunchFailed, LaunchSpec, run_local
from vlm_assets.launch.lifeline import die_with_parent

# The Dagster concurrency pool of every training step: its limit (dagster.yaml
# ``concurrency.pools.default_limit``, or ``dagster instance concurrency set vlm_training N``) is how
# many training steps may hold the machine's (or the cluster quota's) GPUs at once across all runs,
# so a schedule tick and a UI launch queue instead of oversubscribing them.
TRAINING_POOL = "vlm_training"


def check_training_pool(instance: dg.DagsterInstance) -> None:
    """A limit below 1 on the training pool would queue every training step forever: refused when
    the definitions load, naming the setting."""
    limit = instance.event_log_storage.get_concurrency_info(TRAINING_POOL).limit
    if limit is not None and limit < 1:
        raise ValueError(
            f"Dagster pool '{TRAINING_POOL}' has limit {limit} (dagster.yaml concurrency.pools.default_limit, or "
            f"`dagster instance concurrency set {TRAINING_POOL} N`): every training step would wait forever. "
            "Set it to the number of training jobs the GPUs hold at once (at least 1).")


@contextlib.contextmanager
def _without(category: type[Warning]) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category)
        yield


class TrainingLauncher(dg.ConfigurableResource, ABC):
    @abstractmethod
    def launch(self, context: dg.AssetExecutionContext, spec: LaunchSpec,
               extras: dict[str, Any] | None = None) -> list[dg.MaterializeResult]:
        """Run ``spec`` to completion and return what rank 0 reported through Pipes. Raises a
        retryable ``dg.Failure`` naming the failing node, its exit code and last lines."""


class LocalTorchrunLauncher(TrainingLauncher):
    """One ``torchrun`` per node on this machine, c10d rendezvous on loopback; gloo on CPU, NCCL on GPUs."""

    env: dict[str, str] = Field(
        default_factory=lambda: {"OMP_NUM_THREADS": "1"},
        description="Extra environment for every worker (OMP_NUM_THREADS=1 stops CPU workers oversubscribing cores).",
    )

    def launch(self, context: dg.AssetExecutionContext, spec: LaunchSpec,
               extras: dict[str, Any] | None = None) -> list[dg.MaterializeResult]:
        if multiprocessing.parent_process() is not None:
            # The step runs in a child of the run's orchestrator (Dagster's multiprocess executor),
            # which nothing ends when the orchestrator is SIGKILLed: the kernel ends it then, and its
            # death ends the agents and workers (``vlm_assets.launch.lifeline``).
            die_with_parent()
        # Dagster's own session code calls its preview `expected_writer_count`: the warning is about
        # Dagster's internals, not this launch, and would read as trouble in every run log.
        with _without(dg.PreviewWarning), dg.open_pipes_session(
            context=context, extras=extras or {},
            context_injector=dg.PipesTempFileContextInjector(), message_reader=dg.PipesTempFileMessageReader(),
        ) as session:
            try:
                run_local(spec, on_line=context.log.info, env={**self.env, **session.get_bootstrap_env_vars()})
            except LaunchFailed as err:
                timed_out = err.exit_code is None
                raise dg.Failure(
                    # A retry under the same time limit would spend it again: the user raises
                    # timeout_s (a run field, outside the cache key) and the rerun resumes instead.
                    description=str(err) + ("\nRaise timeout_s and rerun: training resumes from the last "
                                            "committed checkpoint of the same key." if timed_out else ""),
                    allow_retries=not timed_out,
                    metadata={"node": err.node, "exit_code": err.exit_code if err.exit_code is not None else "timeout",
                              "worker_exit_code": err.worker_exit_code if err.worker_exit_code is not None else "n/a",
                              "last_lines": dg.MetadataValue.md("```\n" + "\n".join(err.tail[-20:]) + "\n```")},
                ) from err
        return [r for r in session.get_results() if isinstance(r, dg.MaterializeResult)]
