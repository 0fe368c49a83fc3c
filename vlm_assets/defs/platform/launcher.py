"""Training launchers as Dagster resources: the asset builds a ``LaunchSpec``, the launcher runs it.

Only the launcher knows where processes run. ``LocalTorchrunLauncher`` (the embedded default) starts
one torchrun per node on 127.0.0.1; a Kubernetes launcher (one pod per node, a headless Service as the
rendezvous endpoint) implements the same ``launch`` beside it, and no asset changes. Either way the
workers get the Dagster Pipes bootstrap environment and global rank 0 reports logs, metrics and the
final materialization metadata through it.
"""

import contextlib
import multiprocessing
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from vlm_assets.defs.platform.pipes_reader import WholeLineTempFileMessageReader
from vlm_assets.launch import LaunchFailed, LaunchSpec, run_local
from vlm_assets.launch.k8s import PodSettings
from vlm_assets.launch.lifeline import die_with_parent
from vlm_assets.launch.spec import BAD_INPUT

# The Dagster concurrency pool of every training step: its limit (dagster.yaml
# ``concurrency.pools.default_limit``, or ``dagster instance concurrency set vlm_training N``) is how
# many training steps may hold the machine's (or the cluster quota's) GPUs at once across all runs,
# so a schedule tick and a UI launch queue instead of oversubscribing them.
TRAINING_POOL = "vlm_training"


def check_training_pool(instance: dg.DagsterInstance) -> None:
    """Refuse, when the definitions load, a training pool limit below 1, naming the setting.

    Such a limit would queue every training step forever.
    """
    limit = instance.event_log_storage.get_concurrency_info(TRAINING_POOL).limit
    if limit is not None and limit < 1:
        raise ValueError(
            f"Dagster pool '{TRAINING_POOL}' has limit {limit} (dagster.yaml concurrency.pools.default_limit, or "
            f"`dagster instance concurrency set {TRAINING_POOL} N`): every training step would wait forever. "
            "Set it to the number of training jobs the GPUs hold at once (at least 1)."
        )


@contextlib.contextmanager
def _without(category: type[Warning]) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category)
        yield


@contextlib.contextmanager
def _as_step_failure() -> Iterator[None]:
    """A ``LaunchFailed`` as a ``dg.Failure`` naming the node, its exit code, the retry rule's cause
    and the last lines; Dagster's RetryPolicy retries it only where that rule says a retry can help
    (``vlm_assets.launch.retry``). Input the trainer refused comes first, in its own words."""
    try:
        yield
    except LaunchFailed as err:
        rule = err.rule
        if rule.cause == "canceled":  # what Dagster's own interrupt raises: the run ends CANCELED
            raise dg.DagsterExecutionInterruptedError(str(err)) from err
        refused = dict.fromkeys(
            line[line.index(BAD_INPUT) + len(BAD_INPUT) :] for line in err.tail if BAD_INPUT in line
        )
        raise dg.Failure(
            # A retry under the same time limit would spend it again: the user raises timeout_s (a
            # run field, outside the cache key) and the rerun resumes instead.
            description="".join(f"{line}\n" for line in refused)
            + str(err)
            + f"\n({rule.cause}: {'retried' if rule.retry else 'not retried'}; {rule.seen_as})"
            + (
                "\nRaise timeout_s and rerun: training resumes from the last committed checkpoint of the same key."
                if rule.cause == "timeout"
                else ""
            ),
            allow_retries=rule.retry,
            metadata={
                "node": err.node,
                "exit_code": err.exit_code if err.exit_code is not None else "none",
                "worker_exit_code": err.worker_exit_code if err.worker_exit_code is not None else "n/a",
                "reason": err.reason,
                "cause": rule.cause,
                "retried": rule.retry,
                "last_lines": dg.MetadataValue.md("```\n" + "\n".join(err.tail[-20:]) + "\n```"),
            },
        ) from err


class TrainingLauncher(dg.ConfigurableResource, ABC):
    """A resource that runs a training ``LaunchSpec`` on its nodes and returns rank 0's Pipes reports."""

    @abstractmethod
    def launch(
        self, context: dg.AssetExecutionContext, spec: LaunchSpec, extras: dict[str, Any] | None = None
    ) -> list[dg.MaterializeResult]:
        """Run ``spec`` to completion and return what rank 0 reported through Pipes.

        Raises a retryable ``dg.Failure`` naming the failing node, its exit code and last lines.
        """

    def delete_run_objects(self, run_id: str) -> list[str]:
        """Delete what the launches of a failed Dagster run left running elsewhere; return their names.

        Local processes need nothing: they die with the step (``vlm_assets.launch.lifeline``).
        """
        return []

    def delete_leftovers(self, context: dg.AssetExecutionContext) -> None:
        """Delete what killed attempts left running elsewhere, before a launch's scratch is made.

        Left alone, these would go on writing (checkpoints, and their launch folder back after it was swept).
        Local processes need nothing (they died with their step).
        """


class LocalTorchrunLauncher(TrainingLauncher):
    """One ``torchrun`` per node on this machine, c10d rendezvous on loopback; gloo on CPU, NCCL on GPUs."""

    env: dict[str, str] = Field(
        default_factory=lambda: {"OMP_NUM_THREADS": "1"},
        description=(
            "Extra environment for every worker. OMP_NUM_THREADS=1 stops CPU workers oversubscribing cores "
            "(huge pages for torch's CPU tensors: docs/performance.md, 'Where the time goes')."
        ),
    )

    def launch(
        self, context: dg.AssetExecutionContext, spec: LaunchSpec, extras: dict[str, Any] | None = None
    ) -> list[dg.MaterializeResult]:
        """Run ``spec`` as local ``torchrun`` processes; return rank 0's Pipes reports."""
        with _pipes_session(
            context, extras, dg.PipesTempFileContextInjector(), WholeLineTempFileMessageReader()
        ) as session:
            run_local(
                spec,
                on_line=context.log.info,
                env={**self.env, **session.get_bootstrap_env_vars()},
                canceled=lambda: run_canceled(context),
            )
        return _reports(session)


@contextlib.contextmanager
def _pipes_session(context: dg.AssetExecutionContext, extras: dict[str, Any] | None, injector, reader) -> Iterator[Any]:
    """A launch's Pipes session: the step dies with its orchestrator and a ``LaunchFailed`` becomes the
    step's failure. Dagster's own session code calls its preview ``expected_writer_count``: that warning
    is about Dagster's internals, not this launch, and would read as trouble in every run log."""
    _die_with_orchestrator()
    with (
        _without(dg.PreviewWarning),
        dg.open_pipes_session(
            context=context, extras=extras or {}, context_injector=injector, message_reader=reader
        ) as session,
        _as_step_failure(),
    ):
        yield session


def _reports(session: Any) -> list[dg.MaterializeResult]:
    """What rank 0 reported, once its session has closed (every message read)."""
    return [r for r in session.get_results() if isinstance(r, dg.MaterializeResult)]


def _die_with_orchestrator() -> None:
    """A step running in a child of the run's orchestrator (Dagster's multiprocess executor) is ended
    by nothing when the orchestrator is SIGKILLed: the kernel ends it then (``vlm_assets.launch.lifeline``),
    and with it the local agents and workers; a step that lived on would keep following its pods."""
    if multiprocessing.parent_process() is not None:
        die_with_parent()


def run_canceled(context: dg.AssetExecutionContext) -> bool:
    """Return whether the step's run is being terminated.

    Dagster's multiprocess executor interrupts its step processes when a run is terminated; its in-process
    executor (every job's default) does not reach a step that is waiting on its workers, and the run would end
    only after training: the launch asks, and stops with Dagster's own interrupt. Dagster retries an interrupted
    step under its RetryPolicy (in process, nothing stops the retry), so a memoized step asks first too (``memo``).
    """
    run = context.instance.get_run_by_id(context.run.run_id)
    return run is not None and run.status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)


def _run_is_live(instance: dg.DagsterInstance, run_id: str) -> bool:
    run = instance.get_run_by_id(run_id)
    return run is not None and not run.is_finished


class K8sTorchrunLauncher(TrainingLauncher, PodSettings):
    """A launcher running one pod per node behind a headless Service (or one Indexed Job) in the training namespace.

    torchrun's c10d rendezvous is at pod 0 (``vlm_assets.launch.k8s``). Global rank 0 reports through Pipes on
    its stderr; its messages are read from the pod logs that are streamed anyway, and every pod's lines reach the
    step log prefixed by node. The config fields are ``PodSettings``'.
    """

    def settings(self) -> PodSettings:
        """Return this launcher's ``PodSettings`` fields as a ``PodSettings``."""
        return PodSettings.model_validate(self.model_dump(include=set(PodSettings.model_fields)))

    def delete_run_objects(self, run_id: str) -> list[str]:
        """Delete the pods, Services and Jobs of a failed run; return their names.

        Its step was killed before it could delete them.
        """
        from kubernetes import client

        from vlm_assets.launch.k8s import MANAGED_BY, api_client, delete_selected

        api = api_client(self.settings())
        return delete_selected(
            client.CoreV1Api(api),
            client.BatchV1Api(api),
            self.namespace,
            f"app.kubernetes.io/managed-by={MANAGED_BY},dagster/run-id={run_id}",
        )

    def delete_leftovers(self, context: dg.AssetExecutionContext) -> None:
        """Delete the pods that killed attempts left behind.

        These are the pods of runs whose step was killed before it could delete them (Dagster marks such runs
        failed: run monitoring, the dead-run reaper, or the lease's next holder), and those of an earlier attempt
        of this step of this run (a step process killed under the RetryPolicy).
        """
        from kubernetes import client

        from vlm_assets.launch.k8s import api_client, delete_orphans

        api = api_client(self.settings())
        if orphans := delete_orphans(
            client.CoreV1Api(api),
            client.BatchV1Api(api),
            self.namespace,
            lambda run_id: _run_is_live(context.instance, run_id),
            step=(context.run.run_id, context.op_execution_context.node_handle.name),
        ):
            context.log.warning(
                f"deleted what killed attempts left in namespace {self.namespace}: {', '.join(orphans)}"
            )

    def launch(
        self, context: dg.AssetExecutionContext, spec: LaunchSpec, extras: dict[str, Any] | None = None
    ) -> list[dg.MaterializeResult]:
        """Run ``spec`` as one pod per node; return rank 0's Pipes reports, read from the pod logs."""
        from vlm_assets.launch.k8s import api_client, run_k8s

        settings = self.settings()
        api = api_client(settings)
        reader = _pod_log_reader()

        def on_line(node: int, line: str) -> None:
            if not reader.consume(line):
                context.log.info(f"[node {node}] {line}")

        labels = {
            "dagster/run-id": context.run.run_id,
            "dagster/asset": context.asset_key.to_user_string(),
            "dagster/step": context.op_execution_context.node_handle.name,
        }
        forwarded = {name: os.environ[name] for name in settings.forward_env if name in os.environ}
        # a step killed with its orchestrator leaves pods: the run failure sensor deletes them
        with _pipes_session(context, extras, dg.PipesEnvContextInjector(), reader) as session:
            run_k8s(
                spec,
                settings,
                on_line,
                env={**forwarded, **session.get_bootstrap_env_vars()},
                labels=labels,
                api=api,
                canceled=lambda: run_canceled(context),
            )
        return _reports(session)


def _pod_log_reader():
    """A reader of rank 0's Pipes messages out of the pod logs. Built on first use: a module-level
    subclass would import dagster-k8s and the kubernetes client at every code-location load (Dagster
    imports every module under defs/), for the local launcher too."""
    import json

    from dagster_k8s.pipes import PipesK8sPodLogsMessageReader
    from dagster_pipes import PIPES_PROTOCOL_VERSION_FIELD

    class PodLogMessageReader(PipesK8sPodLogsMessageReader):
        """dagster-k8s's reader (its ``read_messages`` tells rank 0 to write messages on stderr), fed the
        lines of every pod: its own ``consume_pod_logs`` follows one pod and forwards the other lines to
        stdout, while a multi-node launch follows all pods and puts their lines in the step log."""

        def consume(self, line: str) -> bool:
            """Handle ``line`` if it is a Pipes message; False for any other log line."""
            if PIPES_PROTOCOL_VERSION_FIELD not in line:
                return False
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                return False
            if not isinstance(message, dict) or PIPES_PROTOCOL_VERSION_FIELD not in message or self._handler is None:
                return False
            self._handler.handle_message(message)
            return True

    return PodLogMessageReader()
