"""A step reads the artifact its upstream materialized in its own run, whatever other runs materialize
meanwhile; a retry, that of the run it retries; a run without the upstream, the latest
(vlm_assets/defs/platform/storage.py's ``artifact_io_manager``), on a real instance: sqlite storage,
the definitions' resources, two runs at once."""

import json
import threading

import dagster as dg
import pytest

import vlm_assets.definitions  # noqa: F401  (what every Dagster process of the project loads first)
from vlm_assets.defs.platform.environment import resources_for
from vlm_assets.defs.platform.memo import AssetConfig, Built, memoized_asset
from vlm_assets.storage import ArtifactRef
from vlm_assets_tests.waiting import BOUND_S, wait_until


class CorpusConfig(AssetConfig):
    """A corpus of one number: another number, another artifact."""

    number: int = 1


def _write_number(step) -> Built:
    (step.staging / "number.json").write_text(json.dumps(step.config.number))
    return Built(metrics={}, metadata={"number": step.config.number})


corpus = memoized_asset("corpus", config_type=CorpusConfig, build=_write_number, description="A number, stored.")
reached, proceed, fail = threading.Event(), threading.Event(), threading.Event()


@dg.asset(deps=[corpus])
def gate() -> None:
    """Holds its run between ``corpus`` and ``trained`` until the test lets it go on."""
    reached.set()
    if fail.is_set():
        raise dg.Failure("the gate fails this time", allow_retries=False)
    if not proceed.wait(BOUND_S):
        raise TimeoutError("the test never let the gate open")


@dg.asset(deps=[gate], ins={"corpus": dg.AssetIn("corpus")})
def trained(corpus: ArtifactRef) -> dg.MaterializeResult:
    """Records which corpus it read."""
    return dg.MaterializeResult(metadata={"read": corpus.metadata["metadata"]["number"], "key": corpus.key})


def _config(number: int) -> dict:
    return {"ops": {"corpus": {"config": {"number": number}}}}


@pytest.fixture
def instance(tmp_path, monkeypatch):
    """A persistent instance (sqlite) under ``tmp_path``, with the store and MLflow of the definitions there."""
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    reached.clear(), proceed.clear(), fail.clear()
    return dg.DagsterInstance.from_config(str(tmp_path))


def test_a_step_reads_its_own_runs_upstream_while_another_run_materializes_it_anew(instance):
    resources = resources_for()

    first = []
    run = threading.Thread(
        target=lambda: first.append(
            dg.materialize(
                [corpus, gate, trained],
                instance=instance,
                resources=resources,
                run_config=_config(1),
                raise_on_error=False,
            )
        )
    )
    run.start()
    try:
        wait_until(lambda: reached.is_set() or not run.is_alive(), "the first run to reach its gate")
        assert reached.is_set(), f"the first run ended before its gate: {first}"
        # another run materializes the same asset with another config while the first is between its steps
        other = dg.materialize([corpus], instance=instance, resources=resources, run_config=_config(2))
        assert other.success
    finally:
        proceed.set()
        run.join(timeout=BOUND_S)
    assert not run.is_alive() and first[0].success
    built = first[0].asset_materializations_for_node("corpus")[0].metadata["cache_key"].value
    read = first[0].asset_materializations_for_node("trained")[0].metadata
    assert (read["read"].value, read["key"].value) == (1, built)


def graph() -> dg.JobDefinition:
    """The three assets as a job on the definitions' resources, in process (for ``dg.reconstructable``)."""
    return dg.Definitions(
        assets=[corpus, gate, trained],
        jobs=[dg.define_asset_job("graph", executor_def=dg.in_process_executor)],
        resources=resources_for(),
    ).resolve_job_def("graph")


def test_a_retry_from_failure_reads_the_upstream_of_the_run_it_retries(instance):
    proceed.set(), fail.set()
    job = dg.reconstructable(graph)
    with dg.execute_job(job, instance, run_config=_config(5), raise_on_error=False) as failed:
        assert not failed.success
    fail.clear()
    resources = resources_for()
    assert dg.materialize([corpus], instance=instance, resources=resources, run_config=_config(6)).success
    retry = dg.ReexecutionOptions.from_failure(failed.run_id, instance)
    with dg.execute_job(job, instance, run_config=_config(5), reexecution_options=retry) as retried:
        assert retried.success
        assert retried.asset_materializations_for_node("trained")[0].metadata["read"].value == 5


def test_a_run_of_the_downstream_alone_reads_the_latest_materialization(instance):
    resources = resources_for()
    for number in (3, 4):
        assert dg.materialize([corpus], instance=instance, resources=resources, run_config=_config(number)).success
    proceed.set()
    alone = dg.materialize(
        [corpus, gate, trained], selection=["gate", "trained"], instance=instance, resources=resources
    )
    assert alone.asset_materializations_for_node("trained")[0].metadata["read"].value == 4


def test_an_upstream_never_materialized_fails_naming_it(instance):
    proceed.set()
    with pytest.raises(dg.Failure, match="trained reads corpus, which has no materialized artifact"):
        dg.materialize([corpus, gate, trained], selection=["trained"], instance=instance, resources=resources_for())


pieces = dg.StaticPartitionsDefinition(["a", "b"])


@dg.asset(partitions_def=pieces)
def piece() -> dg.MaterializeResult:
    return dg.MaterializeResult()


@dg.asset(ins={"piece": dg.AssetIn("piece")})
def whole(piece: ArtifactRef) -> dg.MaterializeResult:
    return dg.MaterializeResult()


def test_a_partitioned_input_fails_naming_the_way_to_read_it(instance):
    with pytest.raises(dg.Failure, match="whole reads the partitioned piece as an input: declare it in deps"):
        dg.materialize([piece, whole], selection=["whole"], instance=instance, resources=resources_for())
