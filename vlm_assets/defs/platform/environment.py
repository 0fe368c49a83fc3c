"""The one place that chooses resources and the run profile from the environment.

``VLM_ASSETS_STORE``    ``local`` (default: ``$VLM_ASSETS_HOME/artifacts``) or ``s3``
                        (``VLM_ASSETS_S3_BUCKET``, ``VLM_ASSETS_S3_PREFIX``, ``AWS_ENDPOINT_URL``, AWS credentials)
``MLFLOW_TRACKING_URI`` default ``sqlite:///$VLM_ASSETS_HOME/mlflow.db`` with artifacts in ``$VLM_ASSETS_HOME/mlruns``
``VLM_ASSETS_LAUNCHER`` ``local`` (default: torchrun processes on this machine, loopback rendezvous) or
                        ``k8s`` (pods in a cluster; ``VLM_ASSETS_K8S_CONFIG``: a YAML file of the launcher's
                        settings, ``vlm_assets.launch.k8s.PodSettings``; kubeconfig: ``KUBECONFIG`` or in-cluster)
``VLM_ASSETS_PROFILE``  ``demo`` (default: offline real data, tiny models, CPU), ``seed`` (full scale), or a
                        YAML file of one's own (the shape of ``vlm_assets/profiles/demo.yaml``)
``VLM_ASSETS_ON_BUSY``  ``wait`` (default) or ``fail``: a key another live attempt is building
``VLM_ASSETS_LEASE_TTL_S`` seconds without renewal after which a builder's lease expires (default 120)
``VLM_ASSETS_SCHEDULE_CRON`` cron of ``main_schedule`` (default ``0 3 * * *``)
``VLM_ASSETS_SCHEDULE_JOB``  the job ``main_schedule`` runs (default ``main_job``; e.g. ``gpt_job``)
``VLM_ASSETS_CHUNKS_PER_RUN`` partitions of ``token_chunks`` one backfill run builds (default 1)
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import get_args

import dagster as dg

from vlm_assets.defs.platform.launcher import K8sTorchrunLauncher, LocalTorchrunLauncher, TrainingLauncher
from vlm_assets.defs.platform.storage import (
    ArtifactStoreResource,
    LocalArtifactStoreResource,
    S3ArtifactStoreResource,
    artifact_io_manager,
)
from vlm_assets.defs.platform.tracking import MlflowTrackingResource
from vlm_assets.paths import cache_dir, home_dir

PROFILES = ("demo", "seed")


def profile(env: Mapping[str, str] = os.environ) -> str:
    """Return the active profile named by ``VLM_ASSETS_PROFILE`` (default ``demo``): a known profile or a YAML file."""
    name = env.get("VLM_ASSETS_PROFILE", "demo")
    if name not in PROFILES and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
        raise ValueError(f"VLM_ASSETS_PROFILE={name!r}: expected one of {PROFILES}, or an existing .yaml file")
    return name


def schedule_cron(env: Mapping[str, str] = os.environ) -> str:
    """Return the schedule's cron string from ``VLM_ASSETS_SCHEDULE_CRON`` (default daily at 03:00), validated."""
    # Checked here with Dagster's own parser (not public API): Dagster rejects a bad cron only when
    # it builds the schedule, in an error that does not name the variable it came from.
    from dagster._utils.schedules import is_valid_cron_string

    cron = env.get("VLM_ASSETS_SCHEDULE_CRON", "0 3 * * *")
    if not is_valid_cron_string(cron):
        raise ValueError(f"VLM_ASSETS_SCHEDULE_CRON={cron!r} is not a cron schedule (e.g. '0 3 * * *')")
    return cron


def schedule_job(jobs: list[str], env: Mapping[str, str] = os.environ) -> str:
    """Return the scheduled job's name from ``VLM_ASSETS_SCHEDULE_JOB`` (default ``main_job``), one of ``jobs``."""
    name = env.get("VLM_ASSETS_SCHEDULE_JOB", "main_job")
    if name not in jobs:
        raise ValueError(f"VLM_ASSETS_SCHEDULE_JOB={name!r}: expected one of {sorted(jobs)}")
    return name


def chunks_per_run(env: Mapping[str, str] = os.environ) -> int:
    """The partitions of ``token_chunks`` one backfill run builds (``VLM_ASSETS_CHUNKS_PER_RUN``)."""
    value = env.get("VLM_ASSETS_CHUNKS_PER_RUN", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"VLM_ASSETS_CHUNKS_PER_RUN={value!r}: expected a whole number of at least 1")
    return int(value)


def lease_settings(env: Mapping[str, str] = os.environ) -> dict:
    """The stores' ``on_busy`` (``VLM_ASSETS_ON_BUSY``) and ``lease_ttl_s`` (``VLM_ASSETS_LEASE_TTL_S``), validated."""
    # Checked against the resource's own fields, whose errors name the field, not the variable.
    fields = ArtifactStoreResource.model_fields
    choices = get_args(fields["on_busy"].annotation)
    least = next(m.ge for m in fields["lease_ttl_s"].metadata if getattr(m, "ge", None) is not None)
    on_busy = env.get("VLM_ASSETS_ON_BUSY", fields["on_busy"].default)
    if on_busy not in choices:
        raise ValueError(f"VLM_ASSETS_ON_BUSY={on_busy!r}: expected one of {choices}")
    ttl = env.get("VLM_ASSETS_LEASE_TTL_S", str(fields["lease_ttl_s"].default))
    try:
        seconds = float(ttl)
    except ValueError:
        seconds = float("nan")
    if not seconds >= least:
        raise ValueError(f"VLM_ASSETS_LEASE_TTL_S={ttl!r}: expected seconds, at least {least}")
    return {"on_busy": on_busy, "lease_ttl_s": seconds}


def resources_for(env: Mapping[str, str] = os.environ) -> dict[str, dg.ConfigurableResource | dg.IOManagerDefinition]:
    """Build the resources ``env`` configures: ``artifact_store`` (and ``io_manager`` on it), ``mlflow``, ``launcher``.

    ``VLM_ASSETS_STORE`` picks a local or S3 store; ``MLFLOW_TRACKING_URI`` the tracking store (default a SQLite
    file under the home directory).
    """
    home = home_dir()
    leases = lease_settings(env)
    store_kind = env.get("VLM_ASSETS_STORE", "local")
    if store_kind == "local":
        store = LocalArtifactStoreResource(root=str(home / "artifacts"), **leases)
    elif store_kind == "s3":
        if not env.get("VLM_ASSETS_S3_BUCKET"):
            raise ValueError("VLM_ASSETS_STORE=s3 needs VLM_ASSETS_S3_BUCKET")
        store = S3ArtifactStoreResource(
            **leases,
            bucket=env["VLM_ASSETS_S3_BUCKET"],
            prefix=env.get("VLM_ASSETS_S3_PREFIX", "vlm_assets"),
            cache_dir=str(cache_dir() / "s3"),
            endpoint_url=env.get("AWS_ENDPOINT_URL"),
            region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
            aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
        )
    else:
        raise ValueError(f"VLM_ASSETS_STORE={store_kind!r}: expected 'local' or 's3'")
    tracking_uri = env.get("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    # A tracking server decides where artifacts go (the team configuration proxies them to S3); a
    # local store keeps them beside it.
    server = tracking_uri.startswith(("http://", "https://", "databricks"))
    tracking = MlflowTrackingResource(
        tracking_uri=tracking_uri,
        experiment_name=env.get("MLFLOW_EXPERIMENT_NAME", "vlm_assets"),
        artifact_location=env.get("VLM_ASSETS_MLFLOW_ARTIFACTS") or (None if server else (home / "mlruns").as_uri()),
    )
    return {
        "artifact_store": store,
        "io_manager": artifact_io_manager,
        "mlflow": tracking,
        "launcher": launcher_for(env),
    }


def launcher_for(env: Mapping[str, str] = os.environ) -> TrainingLauncher:
    """Build the training launcher ``VLM_ASSETS_LAUNCHER`` names: local torchrun, or k8s.

    For k8s, ``VLM_ASSETS_K8S_CONFIG`` may name a YAML file of launcher settings.
    """
    kind = env.get("VLM_ASSETS_LAUNCHER", "local")
    if kind == "local":
        return LocalTorchrunLauncher()
    if kind != "k8s":
        raise ValueError(f"VLM_ASSETS_LAUNCHER={kind!r}: expected 'local' or 'k8s'")
    path = env.get("VLM_ASSETS_K8S_CONFIG")
    if not path:
        return K8sTorchrunLauncher()
    import pydantic
    import yaml

    from vlm_assets.train.run_config import describe_validation_error

    try:
        settings = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"VLM_ASSETS_K8S_CONFIG={path}: {err}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"VLM_ASSETS_K8S_CONFIG={path}: expected a mapping of launcher settings")
    try:
        return K8sTorchrunLauncher(**settings)
    except pydantic.ValidationError as err:
        raise ValueError(describe_validation_error(err, path)) from None


@dg.definitions
def resources() -> dg.Definitions:
    """Return the resources of the definitions, chosen from the environment.

    On a persistent instance (``DAGSTER_HOME`` set) it also checks the training pool and reaps dead runs.
    """
    import logging

    from vlm_assets.defs.platform.launcher import check_training_pool
    from vlm_assets.defs.platform.reaper import reap_on_load

    chosen = resources_for()
    if os.environ.get("DAGSTER_HOME"):  # a persistent instance: check its pool, mend its dead runs
        with dg.DagsterInstance.get() as instance:
            check_training_pool(instance)
            reap_on_load(instance, chosen["artifact_store"], logging.getLogger("vlm_assets").warning)
    return dg.Definitions(resources=chosen)
