"""One factory for the three training assets (``gpt_checkpoint``, ``occlusion_adapter``,
``visualchat_model``). What a training asset writes is only what differs: which trainer module it
launches, what it reads (``inputs``: its upstream artifacts resolved to paths, bad input refused before
any process starts) and what it reports (``finish``: the numbers, plots and scan of what rank 0
wrote). ``memoized_asset`` (``memo``) writes the cache key, computed once, the memoized build under a
lease and the checks in the asset's own step; this module adds the launch through the
``TrainingLauncher`` with the trainer's Pipes report, the training pool and one retry policy, so the
body a reader sees is inputs -> launch -> materialization, as in Dagster's Pipes examples.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import dagster as dg
import pydantic
from pydantic import Field

from vlm_assets.defs.platform.checks import Check
from vlm_assets.defs.platform.launcher import TRAINING_POOL, TrainingLauncher
from vlm_assets.defs.platform.memo import AssetConfig, Built, Step, memoized_asset
from vlm_assets.launch.spec import QUANTITY
from vlm_assets.train.run_config import RunConfig, Settings, step_field

# Dagster's retry of a training step (the one layer that retries: docs/reliability.md). A retry
# resumes from the newest intact checkpoint of the same key.
TRAINING_RETRY = dg.RetryPolicy(max_retries=2, delay=2)


class PodResources(dg.Config):
    """What each node of a training job asks of a cluster: the k8s launcher's pod resources.

    The local launcher ignores them. Only the launcher reads them: never in the run file, never in the key.
    """

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
    """Return a trainer's config as Dagster config: the same fields, constraints and defaults.

    Each section is a ``dg.Config`` twin of the engine's section (Dagster nests only ``Config`` classes in its
    schema, and the engine may not import dagster). Every call makes its own twins, so a profile's defaults
    patched into one asset's sections stay that asset's.
    """

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


class TrainingConfig(AssetConfig):
    """Mixed into a training asset's config after its trainer's config: the pods' resources, apart."""

    resources: PodResources = step_field(
        "What each node's pod asks of the cluster (k8s launcher only).", default_factory=PodResources
    )


def training_asset(
    name: str,
    *,
    config_type: type,
    trainer: str,
    source: str,
    inputs: Callable[[Step], dict[str, str]],
    finish: Callable[[Step, dict[str, Any]], Built],
    checks: Sequence[Check],
    kinds: set[str],
    description: str,
    on_failure: Callable[[Step, dg.Failure], dict[str, Any]] | None = None,
) -> dg.AssetsDefinition:
    """Define a training asset named ``name``: a ``memoized_asset`` reading ``source``, in the training pool.

    It launches ``trainer`` (a module run by ``entry_point`` on every process) on ``inputs(step)``, and commits
    what ``finish(step, values)`` reports; ``values`` is the trainer's Pipes report. ``on_failure`` may turn a
    failed launch into values (or raise).
    """

    def build(step: Step) -> Built:
        step = dataclasses.replace(step, inputs=inputs(step))
        try:
            values = launch_trainer(step, trainer)
        except dg.Failure as failure:
            if on_failure is None:
                raise
            values = on_failure(step, failure)
        return finish(step, values)

    return memoized_asset(
        name,
        config_type=config_type,
        build=build,
        description=description,
        ins=(source,),
        checks=checks,
        retry_policy=TRAINING_RETRY,
        interrupt_when_canceled=False,  # the launch asks itself, and stops its workers or pods in order
        kinds=kinds,
        group_name="models",
        pool=TRAINING_POOL,
        resources=("launcher",),
    )


def launch_trainer(step: Step, module: str) -> dict[str, Any]:
    """Launch ``module`` for a training asset's step; return the trainer's one Pipes report as plain values.

    The run file (the config + ``RunPaths``: the resolved inputs, the staging folder as the output, checkpoints
    under ``checkpoints/<key>`` in the artifact store, the asset's MLflow run) is written in a scratch folder, and
    ``module`` is launched on the config's topology by the ``launcher`` resource.
    """
    from vlm_assets.paths import runs_dir
    from vlm_assets.storage.scratch import held_dir
    from vlm_assets.train.run_config import RunPaths, write_run_file

    context, config = step.context, step.config
    launcher: TrainingLauncher = context.resources.launcher
    name = context.asset_key.to_user_string()
    launcher.delete_leftovers(context)  # before the sweep of dead scratch below: nothing writes it back
    with held_dir(runs_dir(), prefix=f"{name}-") as work:  # removed even if this process is killed
        paths = RunPaths(
            inputs=step.inputs,
            out_dir=str(step.staging),
            cache_dir=str(work),
            checkpoint_store=context.resources.artifact_store.spec(),
            checkpoint_prefix=f"checkpoints/{step.key}",
            mlflow_tracking_uri=context.resources.mlflow.tracking_uri,
            mlflow_run_id=step.run.run_id,
        )
        write_run_file(work / "run.json", config, paths)
        spec = config.launch_spec(module, ("--config", str(work / "run.json")), name, config.resources.requests())
        reports = launcher.launch(context, spec)
    if len(reports) != 1:
        raise RuntimeError(f"the trainer reported {len(reports)} materializations through Pipes, expected 1")
    return {k: getattr(v, "value", v) for k, v in (reports[0].metadata or {}).items()}


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a trainer's report: its metrics for MLflow and the asset's metadata."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def last_try(step: Step) -> bool:
    """Whether this attempt of the training step is its last under ``TRAINING_RETRY``."""
    return step.context.retry_number >= TRAINING_RETRY.max_retries
