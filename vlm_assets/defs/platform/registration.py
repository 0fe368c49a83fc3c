"""One factory for the registered-model assets (``registered_adapter``, ``registered_visualchat``): an
upstream artifact logged as an MLflow pyfunc (models-from-code) into the Model Registry, with an alias
pointed at its version. The registry, not a local cache, decides: a version is found by the sha256 of
the model's files, so the same model never makes a second version, and a reset registry or an alias
moved by hand is mended on the next run."""

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg

from vlm_assets.defs.platform.memo import BUILD_RETRY
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource
from vlm_assets.storage import ArtifactRef


def registered_model_asset(
    name: str,
    *,
    source: str,
    config_type: type,
    weights_sha256: Callable[[Mapping[str, dict[str, Any]]], str],
    pyfunc: str,
    card: str,
    description: str,
    code_version: str = "1",
    deps: list[Any] | None = None,
) -> dg.AssetsDefinition:
    """Define an asset named ``name`` that registers ``source``'s artifact as ``config.model_name``.

    ``config.alias`` is pointed at the registered version. ``weights_sha256(files of the manifest)`` identifies
    the model; the module ``pyfunc``'s ``log_model(MLflow run id, artifact dir, tracking uri)`` logs the model
    into a new MLflow run (imported then: a cache hit never loads MLflow's pyfunc or torch), only when no version
    of that name carries the sha256 yet. ``card`` is the registered model's description.
    """

    @dg.asset(
        name=name,
        description=inspect.cleandoc(description),
        code_version=code_version,
        kinds={"mlflow"},
        group_name="models",
        deps=deps,
        retry_policy=BUILD_RETRY,
        ins={source: dg.AssetIn(source)},
    )
    def _registered_model(
        context: dg.AssetExecutionContext,
        config: config_type,  # type: ignore[valid-type]  # Dagster reads the config schema from this annotation
        artifact_store: ArtifactStoreResource,
        mlflow: MlflowTrackingResource,
        **read: ArtifactRef,  # the one input, named after its asset (``ins``)
    ) -> dg.MaterializeResult:
        from vlm_assets.models.registry import register_once

        store, ref = artifact_store.get_store(), read[source]
        sha256 = weights_sha256(store.read_manifest(ref.key).files)

        def logged():  # only when the registry has no such version: the artifact is read (or downloaded) here
            tags = {"dagster.run_id": context.run.run_id, "dagster.asset": name}
            with mlflow.start_run(run_name=name, tags=tags) as run:
                module = importlib.import_module(pyfunc)
                return module.log_model(run.run_id, store.local_path(ref.key), mlflow.tracking_uri)

        with mlflow.registry_errors():
            entry = register_once(mlflow.client(), config.model_name, config.alias, sha256, logged, card)
        context.log.info(f"{entry.name}@{entry.alias} -> v{entry.version} ({entry.action})")
        return dg.MaterializeResult(
            metadata={
                "model": f"models:/{entry.name}@{entry.alias}",
                "model_version": entry.version,
                "registry": entry.action,
                "weights_sha256": sha256,
                "registry_uri": mlflow.tracking_uri,
            }
        )

    return _registered_model
