"""MLflow tracking as a Dagster resource: a thin ``ConfigurableResource`` over ``MlflowClient``."""

import base64
import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from vlm_assets.storage.locks import host_lock


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


@contextlib.contextmanager
def _sqlite_migration_lock(tracking_uri: str) -> Iterator[None]:
    """MLflow migrates a fresh sqlite store on first use; parallel steps doing so at once corrupt it."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with host_lock(db.with_name(db.name + ".lock")):
        yield


class TrackedRun:
    """One MLflow run: what assets log their params, metrics and figures to."""

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log ``params``, flattened, as this run's parameters (each value cut to 6000 characters)."""
        from mlflow.entities import Param

        flat = flatten(params)
        self.client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in flat.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log ``metrics`` on this run at ``step``, all stamped with the current time."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        """Log the file at ``path`` as an artifact of this run, under ``artifact_path`` if given."""
        self.client.log_artifact(self.run_id, path, artifact_path)

    def log_image(self, path: Path, alt: str) -> str:
        """Log the PNG file at ``path`` as an artifact of this run; return it as an inline Markdown image.

        The Markdown goes to ``Built.markdown``: the Dagster UI shows it beside the asset.
        """
        self.log_artifact(str(path))
        return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"


class MlflowTrackingResource(dg.ConfigurableResource):
    """MLflow tracking server or local store. The embedded default is ``sqlite:///var/mlflow.db``."""

    tracking_uri: str = Field(description="MLflow tracking URI: sqlite:///path.db, http(s)://server, ...")
    experiment_name: str = Field(default="vlm_assets", description="Experiment every run is logged under.")
    artifact_location: str | None = Field(
        default=None,
        description="Where a new experiment stores artifacts (a path or s3:// URI); server default if unset.",
    )
    _client: Any = PrivateAttr(default=None)

    def client(self):
        """Return this resource's ``MlflowClient``, created on first use.

        Creating it creates or migrates the tracking store, under a lock for a SQLite store.
        """
        if self._client is None:
            from mlflow.tracking import MlflowClient

            with _sqlite_migration_lock(self.tracking_uri):
                client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
                client.search_experiments(max_results=1)  # creates/migrates the store now, under the lock
            self._client = client
        return self._client

    @contextlib.contextmanager
    def registry_errors(self) -> Iterator[None]:
        """Fail the step naming the tracking URI when the tracking server or registry cannot be reached.

        The failure is retryable: the next attempt asks the registry again and registers at most once.
        """
        from mlflow.exceptions import MlflowException
        from requests.exceptions import RequestException

        try:
            yield
        except (MlflowException, RequestException, OSError) as err:
            raise dg.Failure(
                description=f"MLflow at {self.tracking_uri} could not be reached or refused the "
                f"request: {type(err).__name__}: {str(err)[:500]}"
            ) from err

    def experiment_id(self) -> str:
        """Return the id of the experiment ``experiment_name``, creating it if missing."""
        from mlflow.exceptions import MlflowException

        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(self.experiment_name, artifact_location=self.artifact_location)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            # another run created it after this one looked (two first runs at once)
            return client.get_experiment_by_name(self.experiment_name).experiment_id

    @contextlib.contextmanager
    def start_run(self, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[TrackedRun]:
        """Start an MLflow run for the block; end it FINISHED, FAILED if the block raises, KILLED if interrupted.

        Interrupted means SIGTERM, SIGINT or the Dagster run terminated. A process killed outright cannot end its
        run: the next attempt at the key does (``end_orphaned_runs``).
        """
        client = self.client()
        run = client.create_run(self.experiment_id(), run_name=run_name, tags=dict(tags or {}))
        tracked = TrackedRun(client, run.info.run_id)
        try:
            yield tracked
        except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError):
            client.set_terminated(run.info.run_id, status="KILLED")
            raise
        except BaseException:
            client.set_terminated(run.info.run_id, status="FAILED")
            raise
        client.set_terminated(run.info.run_id, status="FINISHED")

    def end_orphaned_runs(self, *, cache_key: str | None = None, dagster_run_id: str | None = None) -> list[str]:
        """End as KILLED the runs of ``cache_key`` (or of a Dagster run) still RUNNING; return their ids.

        Their process died without ending them. Called by the holder of the key's lease (so none of them is
        alive), or once the Dagster run is marked failed (``vlm_assets.defs.platform.reaper``).
        """
        if (cache_key is None) == (dagster_run_id is None):
            raise ValueError("end_orphaned_runs: give exactly one of cache_key and dagster_run_id")
        tag, value = ("vlm_assets.cache_key", cache_key) if cache_key else ("dagster.run_id", dagster_run_id)
        client = self.client()
        runs = client.search_runs(
            [self.experiment_id()], filter_string=(f"tags.`{tag}` = '{value}' and attributes.status = 'RUNNING'")
        )
        for run in runs:
            client.set_terminated(run.info.run_id, status="KILLED")
        return [run.info.run_id for run in runs]
