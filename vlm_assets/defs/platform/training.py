"""One factory for the three training assets (``gpt_checkpoint``, ``occlusion_adapter``,
``visualchat_model``). What a training asset writes is only what differs: which trainer module it
launches, what it reads (``inputs``: its upstream artifacts resolved to paths, bad input refused before
any process starts) and what it reports (``finish``: the numbers, plots and scan of what rank 0
wrote). The rest (the cache key, computed once; the memoized build under a lease; the launch through
the ``TrainingLauncher`` with the trainer's Pipes report; the checks in the asset's own step; the
training pool and one retry policy) is written here once, so the body a reader sees is inputs ->
launch -> materialization, as in Dagster's Pipes examples.
"""

import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic
from pydantic import Field

from vlm_assets.defs.platform.checks import Check, check_specs
from vlm_assets.defs.platform.launcher import TRAINING_POOL, TrainingLauncher, launch_trainer
from vlm_assets.defs.platform.memo import AssetConfig, Built, artifact_key, materialize_memoized, upstream_ref
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource, TrackedRun
from vlm_assets.launch.spec import QUANTITY
from vlm_assets.storage import ArtifactRef, ArtifactStore
from vlm_assets.train.run_config import RunConfig, Settings, step_field

# Dagster's retry of a training step (the one layer that retries: README "one retry rule"). A retry
# resumes from the newest intact checkpoint of the same key.
TRAINING_RETRY = dg.RetryPolicy(max_retries=2, delay=2)


class PodResources(dg.Config):
    """What each node of a training job asks of a cluster: the k8s launcher's pod resources (the local
    launcher ignores them). Only the launcher reads them: never in the run file, never in the key."""

    gpus_per_node: int = Field(
        default=0, ge=0, description="GPUs each node's pod requests (nvidia.com/gpu); 0: a CPU pod."
    )
    gpu_type: str | None = Field(
        default=None,
        description="GPU product the pods must land on (a node selector on the launcher's gpu_node_label, "
        "e.g. 'NVIDIA-H100-80GB-HBM3').",
    )
    cpu_per_node: str | None = Field(
        default=None, pattern=QUANTITY, description="CPU each node's pod requests and is limited to ('8', '500m')."
    )
    memory_per_node: str | None = Field(
        default=None, pattern=QUANTITY, description="Memory each node's pod requests and is limited to ('64Gi')."
    )

    def requests(self) -> dict[str, str]:
        """``LaunchSpec.resources``: Kubernetes resource names, plus ``gpu_type``."""
        asked = {
            "nvidia.com/gpu": str(self.gpus_per_node) if self.gpus_per_node else None,
            "cpu": self.cpu_per_node,
            "memory": self.memory_per_node,
            "gpu_type": self.gpu_type,
        }
        return {k: v for k, v in asked.items() if v is not None}


def dagster_config(config: type[RunConfig]) -> type:
    """A trainer's config as Dagster config: the same fields, constraints and defaults, each section a
    ``dg.Config`` twin of the engine's section (Dagster nests only ``Config`` classes in its schema, and
    the engine may not import dagster). Every call makes its own twins, so a profile's defaults patched
    into one asset's sections stay that asset's."""

    def twin(model: type[Settings]) -> type:
        sections = {
            name: (
                section := twin(section_type),
                Field(default_factory=section, description=model.model_fields[name].description),
            )
            for name, section_type in model.sections().items()
        }
        return pydantic.create_model(
            model.__name__, __base__=(model, dg.Config), __module__=model.__module__, **sections
        )

    return twin(config)


class UpstreamAsset(enum.Enum):
    """The type of a step field that may name a model of this graph to read (its members are asset names):
    ``decoder_asset: DecoderAsset | None``. ``training_asset`` makes each member a ``deps`` edge and reads
    the named asset's artifact when the field is set, so the choice is declared once, by the config."""


def upstream_choices(config_type: type) -> dict[str, type[UpstreamAsset]]:
    """The config's fields typed ``<UpstreamAsset> | None``: field name -> its enum."""
    return {
        name: arg
        for name, field in config_type.model_fields.items()
        for arg in typing.get_args(field.annotation)
        if isinstance(arg, type) and issubclass(arg, UpstreamAsset)
    }


class TrainingConfig(AssetConfig):
    """Mixed into a training asset's config after its trainer's config: the pods' resources, apart."""

    resources: PodResources = step_field(
        "What each node's pod asks of the cluster (k8s launcher only).", default_factory=PodResources
    )


@dataclasses.dataclass(frozen=True)
class Launch:
    """One build of a training asset, as its ``inputs`` and ``finish`` see it."""

    context: dg.AssetExecutionContext
    config: Any
    store: ArtifactStore
    upstream: dict[str, ArtifactRef]
    key: str
    staging: Path
    run: TrackedRun
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # what ``inputs`` resolved

    def local(self, upstream: str) -> Path:
        """An upstream artifact's directory on local disk (downloaded once if the store is remote)."""
        return self.store.local_path(self.upstream[upstream].key)

    @property
    def last_try(self) -> bool:
        return self.context.retry_number >= TRAINING_RETRY.max_retries


def training_asset(
    name: str,
    *,
    config_type: type,
    trainer: str,
    source: str,
    inputs: Callable[[Launch], dict[str, str]],
    finish: Callable[[Launch, dict[str, Any]], Built],
    checks: Sequence[Check],
    kinds: set[str],
    description: str,
    on_failure: Callable[[Launch, dg.Failure], dict[str, Any]] | None = None,
) -> dg.AssetsDefinition:
    """A training asset named ``name``: reads ``source``'s artifact (and the asset an ``UpstreamAsset`` field
    of its config names, when set: each a ``deps`` edge, so an asset that does not read it neither waits
    for it nor rebuilds when it changes), launches ``trainer`` (a module run by ``entry_point`` on every
    process) on ``inputs(launch)``, and commits what ``finish(launch, values)`` reports; ``values`` is
    the trainer's Pipes report. ``on_failure`` may turn a failed launch into values (or raise)."""
    choices = upstream_choices(config_type)

    @dg.asset(
        name=name,
        description=inspect.cleandoc(description),
        code_version="1",
        kinds=kinds,
        group_name="models",
        retry_policy=TRAINING_RETRY,
        pool=TRAINING_POOL,
        ins={source: dg.AssetIn(source)},
        deps=[member.value for choice in choices.values() for member in choice] or None,
        check_specs=check_specs(name, checks),
    )
    def _training_asset(
        context: dg.AssetExecutionContext,
        config: config_type,  # type: ignore[valid-type]  # Dagster reads the config schema from this annotation
        artifact_store: ArtifactStoreResource,
        mlflow: MlflowTrackingResource,
        launcher: TrainingLauncher,
        **read: ArtifactRef,  # the one input, named after its asset (``ins``)
    ) -> Iterator[dg.Output[ArtifactRef] | dg.AssetCheckResult]:
        store = artifact_store.get_store()
        upstream = {source: read[source]}
        for field in choices:
            if (picked := getattr(config, field)) is not None:
                upstream[picked.value] = upstream_ref(context, store, picked.value)
        key = artifact_key(context, config, upstream)

        def build(staging: Path, run: TrackedRun) -> Built:
            launch = Launch(context, config, store, upstream, key, staging, run)
            launch = dataclasses.replace(launch, inputs=inputs(launch))
            try:
                values = launch_trainer(
                    context,
                    launcher,
                    config,
                    trainer,
                    key=key,
                    inputs=launch.inputs,
                    staging=staging,
                    run=run,
                    artifact_store=artifact_store,
                    tracking_uri=mlflow.tracking_uri,
                )
            except dg.Failure as failure:
                if on_failure is None:
                    raise
                values = on_failure(launch, failure)
            return finish(launch, values)

        yield from materialize_memoized(
            context,
            artifact_store,
            mlflow,
            config,
            build,
            upstream,
            checks=checks,
            key=key,
            interrupt_when_canceled=False,
        )

    return _training_asset
