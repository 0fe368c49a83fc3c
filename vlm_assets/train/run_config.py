"""What every trainer's config shares: sections, identity vs run fields, validated JSON round trip,
topology and gradient accumulation, and the run file the launcher hands to every process.

A trainer has exactly one config model (``PretrainConfig``, ``AdapterTrainConfig``,
``VisualChatTrainConfig``), composed of sections as torchtitan's job config is: ``model``,
``optimizer`` (the objective and its schedule, the global batch), ``data``, ``checkpoint`` and
``parallelism`` (topology, strategy, the per-process batch, memory-for-time switches), plus the run's
``seed``, ``log_every`` and ``timeout_s``. The asset's Dagster config is that model's twin mixed into
``dg.Config`` (``vlm_assets.defs.platform.training``) and the torchrun entry point reads the same model
back from the run file. Fields, in a section or not, are of three kinds:

- **identity** (the default): they shape the artifact, so they enter the cache key and the key of the
  training checkpoints;
- **run** fields (declared with ``run_field``): they only say how to run it (time limit, topology,
  logging and checkpoint cadence, retention). Changing one never changes the key, so a rerun with a
  longer timeout or more nodes resumes from the last checkpoint of the same key;
- **step** fields (declared with ``step_field``, on the asset's config only): what the asset's own step
  reads and no worker does (its checks' thresholds, the pods' resources, which upstream asset to read).
  Outside the key and left out of the run file.
"""

import json
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlm_assets.launch.spec import LaunchSpec

_RUN = {"identity": False}
_STEP = {"identity": False, "step": True}
C = TypeVar("C", bound="RunConfig")


def run_field(default: Any, description: str, **constraints: Any) -> Any:
    """A field that says how to run, not what is produced: outside the cache key, recorded in metadata."""
    return Field(default=default, description=description, json_schema_extra=_RUN, **constraints)


def step_field(description: str, **default: Any) -> Any:
    """Declare a field only the asset's own step reads (a checks section, the pod resources, an upstream choice).

    It is outside the cache key (an upstream it reads enters the key by its data version), and left out of the
    run file the trainer's processes read.
    """
    return Field(description=description, json_schema_extra=_STEP, **default)


def overlay(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return a config dict with ``override`` laid over ``base`` section by section.

    The fields a section of ``override`` gives replace the base's (a dict-valued field such as ``chat_datasets``
    whole); the section's other fields stay.
    """
    sections = {
        k: {**base[k], **v} for k, v in override.items() if isinstance(v, dict) and isinstance(base.get(k), dict)
    }
    return {**base, **override, **sections}


def describe_validation_error(err: ValidationError, where: str, section: tuple[str, ...] = ()) -> str:
    """Describe ``err`` for users rather than developers: ``<where>: field <a.b>: <message>``, one line per problem.

    ``section``: where in a larger config the model that raised ``err`` sits.
    """
    lines = []
    for e in err.errors():
        message, loc = e["msg"].removeprefix("Value error, "), (*section, *e["loc"])
        lines.append(f"{where}: field {'.'.join(map(str, loc))}: {message}" if loc else f"{where}: {message}")
    return "\n".join(lines)


class Settings(BaseModel):
    """A validated settings model whose fields are identity fields unless declared with ``run_field`` or ``step_field``.

    A field whose type is itself ``Settings`` is a section, its fields judged one by one.
    """

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def sections(cls) -> dict[str, type["Settings"]]:
        """Field name -> section type, for the fields that are sections."""
        return {
            name: field.annotation
            for name, field in cls.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, Settings)
        }

    @classmethod
    def _fields_of(cls, kinds: tuple[dict, ...]) -> dict[str, Any]:
        """A pydantic ``include``/``exclude`` of the fields of these kinds, sections walked."""
        picked: dict[str, Any] = {}
        sections = cls.sections()
        for name, field in cls.model_fields.items():
            if field.json_schema_extra in kinds:
                picked[name] = True
            elif name in sections and (inner := sections[name]._fields_of(kinds)):
                picked[name] = inner
        return picked

    @classmethod
    def step_fields(cls) -> set[str]:
        """Return the names of the fields declared with ``step_field``."""
        return set(cls._fields_of((_STEP,)))

    def identity(self) -> dict[str, Any]:
        """The fields that shape the artifact: what the cache key hashes."""
        return self.model_dump(mode="json", exclude=self._fields_of((_RUN, _STEP)))

    def run_settings(self) -> dict[str, Any]:
        """The fields that only say how to run: recorded in metadata, never in the key."""
        return self.model_dump(mode="json", include=self._fields_of((_RUN, _STEP)))


class Parallelism(Settings):
    """How the work is split over processes and what each holds.

    The topology and the per-process batch are run fields (a rerun on more nodes resumes the same key); each trainer
    adds its strategy.
    """

    num_nodes: int = run_field(1, "Nodes (local launcher: torchrun agents on 127.0.0.1).", ge=1)
    nproc_per_node: int = run_field(1, "Processes (devices) per node.", ge=1)
    micro_batch_size: int = run_field(8, "Samples per process per forward/backward (memory, not the math).", ge=1)


class Optimizer(Settings):
    """The objective's optimization: the global batch here, the rate and schedule in each trainer's."""

    global_batch_size: int = Field(
        default=256, ge=1, description="Samples per optimizer step over all processes (accumulation fills the gap)."
    )


ModelT = TypeVar("ModelT", bound=Settings)
OptimizerT = TypeVar("OptimizerT", bound=Optimizer)
DataT = TypeVar("DataT", bound=Settings)
CheckpointT = TypeVar("CheckpointT", bound=Settings)
ParallelismT = TypeVar("ParallelismT", bound=Parallelism)


class RunConfig(Settings, Generic[ModelT, OptimizerT, DataT, CheckpointT, ParallelismT]):
    """The base of the trainers' configs: the five sections and the fields every trainer has.

    Each section is a trainer's own settings model
    (``class PretrainConfig(RunConfig[GPTModel, GPTOptimizer, GPTData, GPTCheckpoint, GPTParallelism])``).
    A section left out of the input takes its defaults.
    """

    model: ModelT = Field(description="What the model is made of.")
    optimizer: OptimizerT = Field(description="The optimizer, its schedule and the global batch.")
    data: DataT = Field(description="What the trainer reads, and how much of it.")
    checkpoint: CheckpointT = Field(description="When checkpoints are committed, what is kept, what a failure leaves.")
    parallelism: ParallelismT = Field(
        description="How the work is split: topology, strategy, per-process batch, memory for time."
    )
    seed: int = Field(default=0, description="Seeds the initialisation of what trains and the data order.")
    log_every: int = run_field(10, "Report metrics (Pipes, MLflow) every this many steps.", ge=1)
    timeout_s: int = run_field(24 * 3600, "The whole training job's time limit; raise it and rerun to resume.", ge=1)

    @model_validator(mode="before")
    @classmethod
    def _sections_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {**{name: {} for name in cls.sections() if name not in data}, **data}
        return data

    @model_validator(mode="after")
    def _batch_fits_the_world(self) -> Self:
        self.accumulation(self.parallelism.num_nodes * self.parallelism.nproc_per_node)
        return self

    def launch_spec(
        self, module: str, args: tuple[str, ...], name: str, resources: dict[str, str] | None = None
    ) -> LaunchSpec:
        """Return the distributed job that trains this config: its topology and time limit, and per-node ``resources``.

        The ``resources`` are what the launcher asks of a cluster; they are not the trainer's: never in its config.
        """
        return LaunchSpec(
            module,
            args,
            num_nodes=self.parallelism.num_nodes,
            nproc_per_node=self.parallelism.nproc_per_node,
            timeout_s=self.timeout_s,
            name=name,
            resources=resources or {},
        )

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that ``global_batch_size`` samples make one step."""
        micro, total = self.parallelism.micro_batch_size, self.optimizer.global_batch_size
        if total % (micro * world_size):
            raise ValueError(
                f"optimizer.global_batch_size {total} is not a multiple of parallelism.micro_batch_size "
                f"{micro} x world size {world_size} = {micro * world_size}"
            )
        return total // (micro * world_size)


class RunPaths(BaseModel):
    """Where one launched run reads and writes: resolved by the asset at launch, never part of the key."""

    model_config = ConfigDict(extra="forbid")

    inputs: dict[str, str] = Field(description="Upstream locations by name (local path or s3:// URI).")
    out_dir: str = Field(description="Rank 0 writes the final artifact files here.")
    cache_dir: str = Field(description="Per-run local scratch (streaming cache, staging); never shared by two runs.")
    checkpoint_store: dict[str, Any] = Field(description="vlm_assets.storage spec of the checkpoint store.")
    checkpoint_prefix: str = Field(description="Checkpoints live under <prefix>/step-<N>; a relaunch resumes there.")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="Rank 0 logs metrics to this run when both are set."
    )
    mlflow_run_id: str | None = None

    def input(self, name: str) -> str:
        """Return the location of the upstream input ``name``; raise ``ValueError`` if it is missing."""
        if name not in self.inputs:
            raise ValueError(f"run paths: input {name!r} missing (have {sorted(self.inputs)})")
        return self.inputs[name]


def write_run_file(path: Path, config: RunConfig, paths: RunPaths) -> None:
    """The JSON every process of a launch reads: ``{"config": ..., "paths": ...}``."""
    path.write_text(
        json.dumps(
            {
                "config": config.model_dump(mode="json", exclude=config.step_fields()),
                "paths": paths.model_dump(mode="json"),
            },
            indent=1,
        )
    )


def read_run_file(path: Path, config_type: type[C]) -> tuple[C, RunPaths]:
    """Parse and validate a run file; errors name the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or set(data) != {"config", "paths"}:
        raise ValueError(f"{path}: expected an object with the keys 'config' and 'paths'")
    try:
        # Only the fields this trainer's model declares: a Dagster subclass may carry none beyond them.
        return config_type.model_validate(data["config"]), RunPaths.model_validate(data["paths"])
    except ValidationError as err:
        raise ValueError(describe_validation_error(err, str(path))) from None
