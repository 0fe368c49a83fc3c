"""The one place that chooses resources and the run profile from the environment.

``VLM_ASSETS_STORE``    ``local`` (default: ``$VLM_ASSETS_HOME/artifacts``) or ``s3``
                        (``VLM_ASSETS_S3_BUCKET``, ``VLM_ASSETS_S3_PREFIX``, ``AWS_ENDPOINT_URL``, AWS credentials)
``MLFLOW_TRACKING_URI`` default ``sqlite:///$VLM_ASSETS_HOME/mlflow.db`` with artifacts in ``$VLM_ASSETS_HOME/mlruns``
``VLM_ASSETS_LAUNCHER`` ``local`` (default: torchrun processes on this machine, loopback rendezvous)
``VLM_ASSETS_PROFILE``  ``demo`` (default: offline real data, tiny models, CPU) or ``seed`` (full scale)
``VLM_ASSETS_ON_BUSY``  ``wait`` (default) or ``fail``: a key another live attempt is building
``VLM_ASSETS_LEASE_TTL_S`` seconds without renewal after which a builder's lease expires (default 120)
"""

import os
from collections.abc import Mapping

import dagster as dg

from vlm_assets.defs.platform.launcher import LocalTorchrunLauncher
from vlm_assets.defs.platform.storage import LocalArtifactStoreResource, S3ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource
from vlm_assets.paths import cache_dir, home_dir

PROFILES = ("demo", "seed")


def profile(env: Mapping[str, str] = os.environ) -> str:
    name = env.get("VLM_ASSETS_PROFILE", "demo")
    if name not in PROFILES:
        raise ValueError(f"VLM_ASSETS_PROFILE={name!r}: expected one of {PROFILES}")
    return name


def resources_for(env: Mapping[str, str] = os.environ) -> dict[str, dg.ConfigurableResource]:
    home = home_dir()
    leases = {"on_busy": env.get("VLM_ASSETS_ON_BUSY", "wait"),
              "lease_ttl_s": float(env.get("VLM_ASSETS_LEASE_TTL_S", "120"))}
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
    tracking = MlflowTrackingResource(
        tracking_uri=env.get("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}"),
        experiment_name=env.get("MLFLOW_EXPERIMENT_NAME", "vlm_assets"),
        artifact_location=env.get("VLM_ASSETS_MLFLOW_ARTIFACTS", (home / "mlruns").as_uri()),
    )
    launcher_kind = env.get("VLM_ASSETS_LAUNCHER", "local")
    if launcher_kind != "local":
        raise ValueError(f"VLM_ASSETS_LAUNCHER={launcher_kind!r}: this version has the 'local' launcher only "
                         "(see deploy/README.md for the Kubernetes design)")
    return {"artifact_store": store, "mlflow": tracking, "launcher": LocalTorchrunLauncher()}


@dg.definitions
def resources() -> dg.Definitions:
    import logging

    from vlm_assets.defs.platform.launcher import check_training_pool
    from vlm_assets.defs.platform.reaper import reap_on_load

    chosen = resources_for()
    if os.environ.get("DAGSTER_HOME"):  # a persistent instance: check its pool, mend its dead runs
        with dg.DagsterInstance.get() as instance:
            check_training_pool(instance)
            reap_on_load(instance, chosen["artifact_store"], logging.getLogger("vlm_assets").warning)
    return dg.Definitions(resources=chosen)
