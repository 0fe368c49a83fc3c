"""Memoized materialization: skip an asset whose artifact for the same inputs is already complete.

Dagster re-runs every asset of a job. Here each asset computes a cache key from its code version, the
identity fields of its config (not the run fields: timeouts, topology, cadence, retention; see
``vlm_assets.train.run_config``) and its upstream data versions (``vlm_assets.memo.cache_key``); if the artifact store
holds a complete artifact under ``<asset>/<key>``, that artifact is returned at once with
``cache: hit`` and the same data version. Otherwise the asset builds it in a staging directory inside
an MLflow run and commits it atomically: a failure leaves the key empty and the run FAILED.

Only one live attempt builds a key: the builder holds a lease on it in the store (renewed while it
works, expiring ``lease_ttl_s`` after its holder died). A second materialization of the key (a
schedule tick and a UI launch) waits and then reuses the artifact, or fails at once naming the holder
(``on_busy`` of the artifact store resource).
"""

import _thread
import contextlib
import dataclasses
import enum
import inspect
import threading
import time
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic

from vlm_assets.defs.platform.checks import Check, Judged, check_specs, judge
from vlm_assets.defs.platform.launcher import run_canceled
from vlm_assets.defs.platform.profiles import ProfileDefaults
from vlm_assets.defs.platform.reaper import fail_dead_run
from vlm_assets.defs.platform.storage import ArtifactStoreResource, read_artifact
from vlm_assets.defs.platform.tracking import MlflowTrackingResource, TrackedRun
from vlm_assets.launch.local import CANCEL_POLL_S
from vlm_assets.memo import cache_key
from vlm_assets.storage import ArtifactRef, ArtifactStore
from vlm_assets.storage.lease import Lease, LeaseHeldError, holder_record
from vlm_assets.train.run_config import Settings, describe_validation_error

# Dagster's retry of a build that is not a training (a download, a registry call); errors the user
# caused fail without retries (``bad_input_fails_fast``).
BUILD_RETRY = dg.RetryPolicy(max_retries=2, delay=5)


class AssetConfig(ProfileDefaults, Settings, dg.Config):
    """An asset's config: identity fields (the cache key) and run fields (``run_field``: metadata only).

    Constraints live on the fields and in pydantic validators; a value that cannot be honoured fails
    the step at once, naming the field, without retries (Dagster would otherwise retry a config
    error under the asset's RetryPolicy: it cannot get better)."""

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except pydantic.ValidationError as err:
            raise dg.Failure(
                description=describe_validation_error(err, f"config of {type(self).__name__}"), allow_retries=False
            ) from None

    def check_values(self) -> None:
        """Check the values that need the outside world (files, directories); override per asset."""


@contextlib.contextmanager
def bad_input_fails_fast() -> Iterator[None]:
    """Fail the step without retries on errors a user caused (bad config, corrupt or missing input).

    Retrying cannot fix them. Anything else propagates and the asset's RetryPolicy applies.
    """
    try:
        yield
    except (ValueError, FileNotFoundError) as err:
        raise dg.Failure(description=f"{type(err).__name__}: {err}", allow_retries=False) from err


@dataclasses.dataclass
class Built:
    """What an asset's build step reports.

    It holds numbers for MLflow and Dagster, extra Dagster metadata, markdown (tables, inlined images) for the
    Dagster UI, and the content scan its checks judge (committed in the manifest: see
    ``vlm_assets.defs.platform.checks``).
    """

    metrics: dict[str, float]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    markdown: dict[str, str] = dataclasses.field(default_factory=dict)
    scan: dict[str, Any] | None = None


def artifact_key(
    context: dg.AssetExecutionContext,
    config: dg.Config,
    upstream: Mapping[str, ArtifactRef],
    identity: Mapping[str, Any] | None = None,
) -> str:
    """Return this asset's artifact key: its name, then a cache key of its code version, config and upstream.

    The upstream part is the data versions of the ``upstream`` artifacts (``vlm_assets.memo.cache_key``);
    ``identity`` adds fields to the config's identity (a partition's key and content version).
    """
    name = context.asset_key.to_user_string()
    code_version = context.assets_def.code_versions_by_key[context.asset_key] or ""
    versions = {k: ref.data_version for k, ref in upstream.items()}
    return f"{name}/{cache_key(name, code_version, {**config.identity(), **(identity or {})}, versions)}"


class UpstreamAsset(enum.Enum):
    """The type of a config field that may name an asset of this graph to read; its members are asset names.

    Example: ``decoder_asset: DecoderAsset | None``. ``memoized_asset`` makes each member a ``deps`` edge and reads
    the named asset's artifact when the field is set, so the choice is declared once, by the config.
    """


def upstream_choices(config_type: type) -> dict[str, type[UpstreamAsset]]:
    """Return the config's fields typed ``<UpstreamAsset> | None``: field name -> its enum."""
    return {
        name: arg
        for name, field in config_type.model_fields.items()
        for arg in typing.get_args(field.annotation)
        if isinstance(arg, type) and issubclass(arg, UpstreamAsset)
    }


@dataclasses.dataclass(frozen=True)
class Step:
    """One build of a memoized asset, as its build function sees it.

    It holds the artifact's ``key``, the empty ``staging`` folder it fills and the MLflow ``run`` it logs to.
    """

    context: dg.AssetExecutionContext
    config: Any
    store: ArtifactStore
    upstream: dict[str, ArtifactRef]
    key: str
    staging: Path
    run: TrackedRun
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # what a training asset's ``inputs`` resolved

    def local(self, upstream: str) -> Path:
        """An upstream artifact's directory on local disk (downloaded once if the store is remote)."""
        return self.store.local_path(self.upstream[upstream].key)


def memoized_asset(
    name: str,
    *,
    config_type: type,
    build: Callable[[Step], Built],
    description: str,
    ins: Sequence[str] = (),
    checks: Sequence[Check] = (),
    code_version: str = "1",
    retry_policy: dg.RetryPolicy = BUILD_RETRY,
    interrupt_when_canceled: bool = True,
    resources: Sequence[str] = (),
    deps: Sequence[dg.AssetDep] = (),
    resolve: Callable[[dg.AssetExecutionContext, Any, ArtifactStore], dict[str, ArtifactRef]] | None = None,
    **asset_args: Any,
) -> dg.AssetsDefinition:
    """Define an asset named ``name`` whose body is ``build(step)``, memoized (``materialize_memoized``).

    It reads the artifacts of ``ins`` (inputs named after their assets) and of the asset an ``UpstreamAsset``
    field of its config names, when set (each member a ``deps`` edge, so an asset that does not read it neither
    waits for it nor rebuilds when it changes); ``checks`` run in its step; ``build`` finds the ``resources`` it
    names (beside the artifact store and MLflow) on its context. ``deps``: edges read through
    ``resolve(context, config, store)``, which returns more upstream artifacts by name (all the partitions of a
    partitioned asset). ``asset_args`` go to ``dg.asset``.
    """
    choices = upstream_choices(config_type)

    @dg.asset(
        name=name,
        description=inspect.cleandoc(description),
        code_version=code_version,
        retry_policy=retry_policy,
        ins={source: dg.AssetIn(source) for source in ins},
        deps=[*deps, *(member.value for choice in choices.values() for member in choice)] or None,
        check_specs=check_specs(name, checks),
        # by key: Dagster takes an asset's resources as typed parameters or by key, not both, and one
        # function serves every asset here, whatever resources its build needs
        required_resource_keys={"artifact_store", "mlflow", *resources},
        **asset_args,
    )
    def _memoized_asset(
        context: dg.AssetExecutionContext,
        config: config_type,  # type: ignore[valid-type]  # Dagster reads the config schema from this annotation
        **read: ArtifactRef,  # the inputs, named after their assets (``ins``)
    ) -> Iterator[dg.Output[ArtifactRef] | dg.AssetCheckResult]:
        artifact_store, mlflow = context.resources.artifact_store, context.resources.mlflow
        store, upstream = artifact_store.get_store(), dict(read)
        with bad_input_fails_fast():
            for field in choices:
                if (picked := getattr(config, field)) is not None:
                    upstream[picked.value] = read_artifact(
                        context.instance, context.run, store, dg.AssetKey(picked.value), name
                    )
            if resolve is not None:
                upstream.update(resolve(context, config, store))
        key = artifact_key(context, config, upstream)
        yield from materialize_memoized(
            context,
            artifact_store,
            mlflow,
            config,
            lambda staging, run: build(Step(context, config, store, upstream, key, staging, run)),
            upstream,
            checks=checks,
            key=key,
            store=store,
            interrupt_when_canceled=interrupt_when_canceled,
        )

    return _memoized_asset


def materialize_memoized(
    context: dg.AssetExecutionContext,
    artifact_store: ArtifactStoreResource,
    mlflow: MlflowTrackingResource,
    config: AssetConfig,
    build: Callable[[Path, TrackedRun], Built],
    upstream: Mapping[str, ArtifactRef] | None = None,
    *,
    checks: Sequence[Check] = (),
    key: str | None = None,
    store: ArtifactStore | None = None,
    interrupt_when_canceled: bool = True,
) -> Iterator[Any]:
    """Yield the step's events: the artifact (a cache hit, or built and committed), then ``checks`` on it.

    The checks are judged with the config's ``checks`` section (declare them with ``check_specs``). ``key`` and
    ``store``: the artifact's key (``artifact_key``) and the resource's store when the caller has them already.
    ``interrupt_when_canceled``: interrupt the build when its run is terminated (off for a launch, which asks
    itself and stops its workers or pods in order).
    """
    step = _Memoized(
        context, artifact_store, store or artifact_store.get_store(), mlflow, config, build, upstream or {}
    )
    with _interrupted_when_canceled(context) if interrupt_when_canceled else contextlib.nullcontext():
        output = step.output(key)
    yield from judge(output, checks, Judged(output.value, getattr(config, "checks", None), step.store, step.upstream))


def memoized_partition(
    context: dg.AssetExecutionContext, config: AssetConfig, key: str, build: Callable[[Path, TrackedRun], Built]
) -> tuple[ArtifactRef, str]:
    """Build or reuse one partition's artifact under ``key``; return it and ``"hit"`` or ``"miss"``.

    Memoized as a whole asset is: a cache hit, or built under the key's lease in an MLflow run."""
    artifact_store, mlflow = context.resources.artifact_store, context.resources.mlflow
    step = _Memoized(context, artifact_store, artifact_store.get_store(), mlflow, config, build, {})
    with _interrupted_when_canceled(context):
        output = step.output(key)
    return output.value, getattr(output.metadata["cache"], "value", output.metadata["cache"])


@dataclasses.dataclass
class _Memoized:
    """One memoized step: a cache hit, or the build under the key's lease inside an MLflow run."""

    context: dg.AssetExecutionContext
    resource: ArtifactStoreResource
    store: ArtifactStore  # the resource's
    mlflow: MlflowTrackingResource
    config: AssetConfig
    build: Callable[[Path, TrackedRun], Built]
    upstream: Mapping[str, ArtifactRef]

    def output(self, key: str | None) -> dg.Output[ArtifactRef]:
        context = self.context
        if run_canceled(context):  # a retry of a step its run's cancellation interrupted: stop before any work
            raise dg.DagsterExecutionInterruptedError(f"run {context.run.run_id} is being canceled")
        with bad_input_fails_fast():
            self.config.check_values()
            key, started = key or artifact_key(context, self.config, self.upstream), time.perf_counter()
            with self._lease(key) as lease:
                if lease is None or self.store.exists(key):
                    ref = self.store.ref(key)
                    context.log.info(f"cache hit: {ref.uri} (data version {ref.data_version})")
                    return self._output(ref, "hit", started)
                return self._output(self._build(lease, key), "miss", started)

    @contextlib.contextmanager
    def _lease(self, key: str) -> Iterator[Lease | None]:
        """The lease on building ``key``, or None when the artifact is complete (already, or built by the
        attempt we waited for)."""
        context, resource, store = self.context, self.resource, self.store
        if store.exists(key):
            yield None
            return
        holder = holder_record(context.run.run_id, asset=context.asset_key.to_user_string())
        lease = store.lease(key, holder, resource.lease_ttl_s, log=context.log.warning)
        try:
            taken = lease.acquire_or_wait(
                lambda: store.exists(key),
                fail_at_once=resource.on_busy == "fail",
                timeout_s=resource.busy_wait_timeout_s,
                log=context.log.info,
            )
        except LeaseHeldError as err:
            raise dg.Failure(str(err), allow_retries=False) from None
        if not taken:
            yield None
            return
        try:
            yield lease
        finally:
            lease.release()

    def _build(self, lease: Lease, key: str) -> ArtifactRef:
        context, config, name = self.context, self.config, self.context.asset_key.to_user_string()
        self._close_dead_attempts(lease, key)
        tags = {"dagster.run_id": context.run.run_id, "dagster.asset": name, "vlm_assets.cache_key": key}
        with self.mlflow.start_run(run_name=name, tags=tags) as run:
            run.log_params(config.model_dump(mode="json"))
            with self.store.staging_dir(key) as staging:
                built = self.build(staging, run)
                run.log_metrics(built.metrics)
                lease.ensure_held()
                ref = self.store.commit(
                    key,
                    staging,
                    metadata={
                        "metrics": built.metrics,
                        "metadata": built.metadata,
                        "markdown": built.markdown,
                        "config": config.identity(),
                        "mlflow_run_id": run.run_id,
                        "upstream": {k: r.data_version for k, r in self.upstream.items()},
                        **({"scan": built.scan} if built.scan is not None else {}),
                    },
                )
        context.log.info(f"committed {ref.uri} (data version {ref.data_version})")
        return ref

    def _close_dead_attempts(self, lease: Lease, key: str) -> None:
        """Make the records of an attempt that died (its process killed: no code of it ran to say so)
        tell the truth: its MLflow runs end KILLED, and its Dagster run, if this lease replaced its
        expired one and it is still marked in progress, is marked failed."""
        context = self.context
        if killed := self.mlflow.end_orphaned_runs(cache_key=key):
            context.log.warning(f"ended MLflow run(s) {', '.join(killed)} of {key} as KILLED: their process died")
        dead = lease.taken_over
        if dead is not None and dead.holder.get("run_id") != context.run.run_id:
            fail_dead_run(
                context.instance, dead, f"run {context.run.run_id}, which took its lease over", context.log.warning
            )

    def _output(self, ref: ArtifactRef, cache: str, started: float) -> dg.Output[ArtifactRef]:
        metadata: dict[str, Any] = {
            "cache": cache,
            "cache_key": ref.key,
            "uri": dg.MetadataValue.path(ref.uri),
            "mlflow_run_id": ref.metadata["mlflow_run_id"],
            "seconds": round(time.perf_counter() - started, 3),
            **({"run_settings": dg.MetadataValue.json(run)} if (run := self.config.run_settings()) else {}),
            **ref.metadata["metrics"],
            **ref.metadata["metadata"],
            **{k: dg.MetadataValue.md(v) for k, v in ref.metadata["markdown"].items()},
        }
        with warnings.catch_warnings():
            # data_version is how Dagster learns a cache hit changed nothing; it is marked beta, and its
            # warning on every materialization would read as trouble in the run log.
            warnings.simplefilter("ignore", dg.BetaWarning)
            return dg.Output(ref, data_version=dg.DataVersion(ref.data_version), metadata=metadata)


@contextlib.contextmanager
def _interrupted_when_canceled(context: dg.AssetExecutionContext, poll_s: float = CANCEL_POLL_S) -> Iterator[None]:
    """Interrupt the block as Dagster interrupts a step (SIGINT, raised in it as
    ``DagsterExecutionInterruptedError``) once its run is being canceled. Dagster's multiprocess
    executor does that to its step processes; its in-process executor (this location's default) only
    checks between steps, so a long build would run to its end after Terminate."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    done, lock = threading.Event(), threading.Lock()

    def watch() -> None:
        while not done.wait(poll_s):
            if run_canceled(context):
                with lock:
                    if not done.is_set():
                        _thread.interrupt_main()
                return

    watcher = threading.Thread(target=watch, name="interrupt-when-canceled", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
        watcher.join()
