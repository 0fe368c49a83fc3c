"""A memoized build whose run is terminated is interrupted in its step, as Dagster's multiprocess
executor interrupts a step process, also under the in-process executor (the location's default),
which by itself acts only between steps: nothing is committed, the lease is released and the MLflow
run ends KILLED."""

import time
from pathlib import Path

import dagster as dg
from mlflow import MlflowClient

from vlm_assets.defs.jobs import in_process_unless_configured
from vlm_assets.defs.platform.memo import AssetConfig, Built, materialize_memoized
from vlm_assets.defs.platform.storage import ArtifactStoreResource, LocalArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource, TrackedRun


class SlowConfig(AssetConfig):
    seconds: float = 60.0


def test_a_build_whose_run_is_canceled_is_interrupted_and_commits_nothing(tmp_path):
    finished = tmp_path / "finished"
    ticks: list[float] = []

    @dg.asset
    def slow(
        context: dg.AssetExecutionContext,
        config: SlowConfig,
        artifact_store: ArtifactStoreResource,
        mlflow: MlflowTrackingResource,
    ):
        def build(staging: Path, run: TrackedRun) -> Built:
            # The UI's Terminate: the run is marked CANCELING, and nothing else reaches this process.
            context.instance.report_run_canceling(context.instance.get_run_by_id(context.run.run_id))
            deadline = time.monotonic() + config.seconds
            while time.monotonic() < deadline:
                ticks.append(time.monotonic())
                (staging / "part").write_text(str(len(ticks)))
                time.sleep(0.05)
            finished.write_text("the build ran to its end")
            return Built(metrics={})

        yield from materialize_memoized(context, artifact_store, mlflow, config, build)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = LocalArtifactStoreResource(root=str(tmp_path / "store"))
    job = dg.define_asset_job("slow_job", selection=[slow], executor_def=in_process_unless_configured)
    defs = dg.Definitions(
        assets=[slow],
        jobs=[job],
        resources={
            "artifact_store": store,
            "mlflow": MlflowTrackingResource(tracking_uri=uri, artifact_location=(tmp_path / "mlruns").as_uri()),
        },
    )
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("slow_job").execute_in_process(instance=instance, raise_on_error=False)
        failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    assert not finished.exists()
    assert ticks and ticks[-1] - ticks[0] < 15  # interrupted within a few polls, not after 60 s
    assert "DagsterExecutionInterruptedError" in failure.step_failure_data.error.cls_name
    root = Path(store.root)
    assert not [p for p in root.rglob("*") if p.is_file() and ".leases" not in p.parts], "something was written"
    assert not list(root.glob(".leases/*.json"))  # released
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("vlm_assets").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
