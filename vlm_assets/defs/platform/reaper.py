"""Dead runs made to tell the truth: a run whose step was killed outright is marked failed and gives
back its training-pool slot.

A SIGKILLed step runs no code, so its Dagster run stays STARTED and keeps the concurrency slot of the
`vlm_training` pool; with the pool's limit reached, every later training step would wait for that
slot forever. Runs launched by the daemon or the UI are caught by Dagster's run monitoring
(dagster.yaml; ``vlm_assets.defs.platform.run_launcher`` tells it whether a run's worker is alive).
A run started by `dagster job execute` has no launcher to ask; the store's leases see it: a run that
held a lease whose holder stopped renewing it (or whose process on this host is gone) is dead.
``reap_dead_runs`` marks such runs failed and frees their slots. It runs when the code location
loads (each `dagster job execute` / `dagster asset materialize`, and `dagster dev`'s start) and
every minute in the daemon (the `dead_run_reaper` sensor). The next attempt at the key then takes
the lease over, ends the dead attempt's MLflow runs as KILLED and resumes from its last checkpoint
(``vlm_assets.defs.platform.memo``). However a run is marked failed, ``killed_run_tracking`` ends
its MLflow runs left RUNNING as KILLED.
"""

from collections.abc import Callable

import dagster as dg

from vlm_assets.defs.platform.launcher import TrainingLauncher
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource
from vlm_assets.storage import ArtifactStore
from vlm_assets.storage.lease import LeaseState


def fail_dead_run(instance: dg.DagsterInstance, dead: LeaseState, by: str, log: Callable[[str], None]) -> bool:
    """Mark failed the Dagster run that held the expired lease ``dead`` and free its pool slots.

    Only a run still marked in progress is touched; return True when it was.
    """
    run_id = dead.holder.get("run_id")
    run = instance.get_run_by_id(run_id) if run_id else None
    if run is None or run.is_finished:
        return False
    message = (
        f"its step building {dead.holder.get('key')} died without ending the run "
        f"({dead.describe()}; marked failed by {by})"
    )
    instance.report_run_failed(run, message=message)
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)
    log(f"run {run_id}: {message}")
    return True


def reap_dead_runs(
    instance: dg.DagsterInstance, store: ArtifactStore, ttl_s: float, log: Callable[[str], None]
) -> list[str]:
    """Fail the Dagster runs whose store lease has expired past ``ttl_s``; return their run ids."""
    return [
        lease.holder["run_id"]
        for lease in store.list_leases()
        if lease.expired(ttl_s) and fail_dead_run(instance, lease, "vlm_assets' dead-run reaper", log)
    ]


def reap_on_load(
    instance: dg.DagsterInstance, store_resource: ArtifactStoreResource, log: Callable[[str], None]
) -> None:
    """Reap dead runs at code location load, on a persistent instance (DAGSTER_HOME); never fail the load."""
    try:
        # Outside a run its EnvVar fields (S3 credentials) are resolved only by initializing it.
        store_resource = store_resource.process_config_and_initialize()
        reap_dead_runs(instance, store_resource.get_store(), store_resource.lease_ttl_s, log)
    except Exception as err:  # a store that cannot be read now must not block loading
        log(f"dead-run reaper skipped: {type(err).__name__}: {err}")


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def dead_run_reaper(context: dg.SensorEvaluationContext, artifact_store: ArtifactStoreResource):
    """Mark failed the runs whose training or build step was killed outright, and free their pool slots."""
    reaped = reap_dead_runs(
        context.instance, artifact_store.get_store(), artifact_store.lease_ttl_s, context.log.warning
    )
    return dg.SkipReason(f"reaped {len(reaped)} dead run(s)" if reaped else "no dead runs")


@dg.run_failure_sensor(default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=15)
def killed_run_tracking(
    context: dg.RunFailureSensorContext, mlflow: MlflowTrackingResource, launcher: TrainingLauncher
):
    """End KILLED a failed run's MLflow runs still RUNNING, and delete the training pods it left (k8s launcher).

    Such MLflow runs were left by a process killed outright (a step that fails normally ends its own run FAILED).
    """
    run_id = context.dagster_run.run_id
    if killed := mlflow.end_orphaned_runs(dagster_run_id=run_id):
        context.log.warning(f"ended MLflow run(s) {', '.join(killed)} of run {run_id} as KILLED")
    if deleted := launcher.delete_run_objects(run_id):
        context.log.warning(f"deleted what run {run_id} left in the cluster: {', '.join(deleted)}")
