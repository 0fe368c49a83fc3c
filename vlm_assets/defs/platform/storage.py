"""Artifact store resources: one interface, a local-filesystem and an S3 implementation."""

from abc import ABC, abstractmethod
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from vlm_assets.storage import ArtifactRef, ArtifactStore, LocalArtifactStore, S3ArtifactStore


class ArtifactStoreResource(dg.ConfigurableResource, ABC):
    """A resource naming where assets commit their artifacts, and how a busy key is handled.

    Artifacts are committed atomically (see ``vlm_assets.storage``); ``on_busy`` and the lease settings say how a
    second materialization of a key that another live attempt is building behaves (store leases).
    """

    on_busy: Literal["wait", "fail"] = Field(
        default="wait",
        description="A key another live attempt is building: wait for it (then reuse its "
        "artifact or take over) or fail at once naming the holder.",
    )
    lease_ttl_s: float = Field(
        default=120.0,
        ge=5,
        description="A builder that has not renewed its lease for this long is "
        "dead: its lease expires and the next attempt takes over.",
    )
    busy_wait_timeout_s: float = Field(
        default=86_400.0, gt=0, description="on_busy=wait: give up (failing, naming the holder) after this long."
    )

    @abstractmethod
    def get_store(self) -> ArtifactStore:
        """Return the ``ArtifactStore`` this resource configures."""

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """Return the store as a JSON-able dict for worker processes (``vlm_assets.storage.spec``)."""


class LocalArtifactStoreResource(ArtifactStoreResource):
    """An artifact store resource on the local filesystem."""

    root: str = Field(description="Directory holding all artifacts (embedded default: var/artifacts).")

    def get_store(self) -> ArtifactStore:
        """Return a ``LocalArtifactStore`` at ``root``."""
        return LocalArtifactStore(self.root)

    def spec(self) -> dict[str, Any]:
        """Return the store as a JSON-able dict: its kind and resolved root."""
        return {"kind": "local", "root": str(LocalArtifactStore(self.root).root)}


class S3ArtifactStoreResource(ArtifactStoreResource):
    """Any S3-compatible store: set ``endpoint_url`` for MinIO, Ceph, R2, a local test server...

    The client settings are fields here rather than a nested ``dagster_aws.s3.S3Resource``: Dagster
    imports every installed component library whenever it loads a defs folder, and dagster-aws's
    (which pull in Dagster's test utilities) doubled every code-location load here (3.4 s -> 1.7 s
    without it), for one ``boto3.client`` call."""

    bucket: str = Field(description="Bucket holding the artifacts.")
    prefix: str = Field(default="vlm_assets", description="Key prefix under the bucket.")
    cache_dir: str = Field(description="Local directory for verified copies read back by assets.")
    endpoint_url: str | None = Field(default=None, description="S3 endpoint; empty for AWS itself.")
    region_name: str = Field(default="us-east-1", description="S3 region.")
    aws_access_key_id: str | None = Field(default=None, description="Access key (dg.EnvVar); empty: boto3's chain.")
    aws_secret_access_key: str | None = Field(default=None, description="Secret key (dg.EnvVar); empty: boto3's chain.")

    def get_client(self):
        """Return a boto3 S3 client for this resource's endpoint, region and credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url or None,
            region_name=self.region_name,
            aws_access_key_id=self.aws_access_key_id or None,
            aws_secret_access_key=self.aws_secret_access_key or None,
        )

    def get_store(self) -> ArtifactStore:
        """Return an ``S3ArtifactStore`` on ``bucket``/``prefix`` with its local ``cache_dir``."""
        return S3ArtifactStore(self.get_client(), self.bucket, self.prefix, cache_dir=self.cache_dir)

    def spec(self) -> dict[str, Any]:
        """Return the store as a JSON-able dict: bucket, prefix, cache directory, endpoint and region."""
        return {
            "kind": "s3",
            "bucket": self.bucket,
            "prefix": self.prefix,
            "cache_dir": self.cache_dir,
            "endpoint_url": self.endpoint_url,
            "region_name": self.region_name,
        }


def read_artifact(
    instance: dg.DagsterInstance, run: dg.DagsterRun, store: ArtifactStore, asset: dg.AssetKey, reader: str
) -> ArtifactRef:
    """Return the artifact ``reader`` reads from ``asset``: that of ``asset``'s materialization in ``run``,
    else in the run ``run`` re-executes (and so on up), else of its latest.

    This run's first: another run may have materialized ``asset`` with another config meanwhile. Raises
    ``ValueError`` when there is none in ``store``."""
    event = None
    while run is not None and event is None:
        in_run = [
            entry
            for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
            if entry.dagster_event.asset_key == asset
        ]
        event = in_run[-1] if in_run else None
        run = instance.get_run_by_id(run.parent_run_id) if run.parent_run_id else None
    event = event or instance.get_latest_materialization_event(asset)
    key = event.asset_materialization.metadata.get("cache_key") if event is not None else None
    if key is None or not store.exists(key.value):
        name = asset.to_user_string()
        raise ValueError(
            f"{reader} reads {name}, which has no materialized artifact in this store: "
            f"materialize {name} first (main_job does)"
        )
    return store.ref(key.value)


class ArtifactIOManager(dg.IOManager):
    """Pass an artifact between steps as its key: a step reads what its upstream materialized in its run.

    The upstream step has committed the artifact to the store and recorded its key in its materialization
    (``cache_key``), so there is nothing to write; an input is read back by ``read_artifact``. Dagster's
    filesystem IO manager keeps one pickle per asset, shared by every run: a step would read the artifact
    of another run that materialized its upstream meanwhile (another corpus, another model)."""

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        """Write nothing: the artifact is in the store, its key in the materialization."""
        if obj is not None and not isinstance(obj, ArtifactRef):
            raise TypeError(
                f"{context.asset_key.to_user_string()} returned a {type(obj).__name__}: assets here return "
                "their artifact (memoized_asset) or a MaterializeResult"
            )

    def load_input(self, context: dg.InputContext) -> ArtifactRef:
        """Return the upstream's artifact of this run (``read_artifact``)."""
        step = context.step_context
        reader = step.step.key
        if context.has_asset_partitions:  # read_artifact knows no partitions: such an edge needs a ``resolve``
            raise dg.Failure(
                f"{reader} reads the partitioned {context.asset_key.to_user_string()} as an input: declare it "
                "in deps and read its partitions with memoized_asset's resolve",
                allow_retries=False,
            )
        try:
            return read_artifact(
                context.instance,
                step.dagster_run,
                context.resources.artifact_store.get_store(),
                context.asset_key,
                reader,
            )
        except ValueError as err:  # a missing upstream: materializing it is the fix, not retrying
            raise dg.Failure(description=str(err), allow_retries=False) from None


# By resource key, not as a nested resource: a run that swaps in another ``artifact_store`` reads from that one.
artifact_io_manager = dg.IOManagerDefinition(
    resource_fn=lambda _: ArtifactIOManager(),
    required_resource_keys={"artifact_store"},
    description="Passes artifacts between steps by key: a step reads its upstream's artifact of its own run.",
)
