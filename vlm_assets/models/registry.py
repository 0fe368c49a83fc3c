"""The MLflow Model Registry as the source of truth for what is registered (no dagster imports).

A model version is identified by the sha256 of its weights, stored as the version tag
``weights_sha256``. ``register_once`` asks the registry, not any local cache, whether these weights
are already a version and whether the alias points at it; it registers and/or moves the alias only
when needed, so the same weights never make a second version, even when a retry follows a
registration that died half-way, and a registry that was reset or an alias moved by hand is mended.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHTS_TAG = "weights_sha256"

# What a registered pyfunc imports when it is loaded to serve (its code and vlm_assets' own modules).
SERVING_PACKAGES = ("vlm-assets", "mlflow", "torch", "transformers", "numpy", "pandas", "pillow")


def serving_requirements() -> list[str]:
    """The pinned pip requirements of a registered pyfunc, from this environment's installed versions.

    Written out, not left to MLflow's inference: inference loads the model in a subprocess to see
    what it imports (10 s a model on the 2-core machine, twice in the demo) and then lists
    scikit-learn and scipy, which the models never import, while leaving torch to vlm-assets'
    metadata."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in SERVING_PACKAGES]


def log_pyfunc(run_id: str, tracking_uri: str, code: Path, signature, example, artifacts: dict[str, str]):
    """Log a pyfunc with MLflow's models-from-code into the run ``run_id``; return its ``ModelInfo``.

    ``code`` is the model's file: nothing pickled. The model is logged with its signature (the contract ``predict``
    is held to), an input example and the pinned serving requirements.
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=str(code),
            signature=signature,
            input_example=example,
            pip_requirements=serving_requirements(),
            artifacts=artifacts,
        )


@dataclasses.dataclass(frozen=True)
class Registration:
    """The outcome of ``register_once``: the model's name, version and alias, and what was done."""

    name: str
    version: str
    alias: str
    action: str  # "registered" | "alias moved" | "already current"


def combined_sha256(files: dict[str, dict], under: str = "") -> str:
    """One sha256 for the files of a manifest (path -> {"sha256": ...}) whose path starts with ``under``."""
    import hashlib

    lines = "".join(f"{path}:{f['sha256']}\n" for path, f in sorted(files.items()) if path.startswith(under))
    return hashlib.sha256(lines.encode()).hexdigest()


def register_once(
    client, name: str, alias: str, weights_sha256: str, log_model: Callable[[], Any], description: str
) -> Registration:
    """Make ``name@alias`` point at the version holding these weights, registering one only if none does.

    ``log_model`` logs the model and returns its ``mlflow.models.model.ModelInfo``; it is called only when no
    version with these weights exists.
    """
    from mlflow.exceptions import MlflowException

    existing = client.search_model_versions(f"name = '{name}' and tags.{WEIGHTS_TAG} = '{weights_sha256}'")
    action = "already current"
    if existing:
        version = str(min(int(v.version) for v in existing))
    else:
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description=description)
        logged = log_model()
        # The tag is set in the same call that creates the version: there is no moment at which a
        # version with these weights exists untagged, so a retry never registers them twice. The
        # model id and run go with the source: a tracking server refuses a `models:/m-...` source
        # without the id of the logged model it names (a local store lets it pass).
        version = str(
            client.create_model_version(
                name,
                logged.model_uri,
                run_id=logged.run_id,
                model_id=logged.model_id,
                tags={WEIGHTS_TAG: weights_sha256},
                description=description,
            ).version
        )
        action = "registered"
    try:
        current = str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        current = None
    if current != version:
        client.set_registered_model_alias(name, alias, version)
        action = "registered" if action == "registered" else "alias moved"
    return Registration(name, version, alias, action)
