"""What every trainer's config shares: identity vs run fields, validated JSON round trip, topology and
gradient accumulation, and the run file the launcher hands to every process.

A trainer has exactly one config model (``PretrainConfig``, ``AdapterTrainConfig``): the asset's
Dagster config is that model mixed into ``dg.Config`` and the torchrun entry point reads the same
model back from the run file. Fields are of two kinds:

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
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlm_assets.launch.spec import LaunchSpec

_RUN = {"identity": False}
_SECTION = {"identity": False, "section": True}
C = TypeVar("C", bound="RunConfig")


def run_field(default: Any, description: str, **constraints: Any) -> Any:
    """A field that says how to run, not what is produced: outside the cache key, recorded in metadata."""
    return Field(default=default, description=description, json_schema_extra=_RUN, **constraints)


def step_field(description: str, **default: Any) -> Any:
    """A field only the asset's own step reads (a checks section, the pod resources, an upstream choice):
    outside the cache key (an upstream it reads enters the key by its data version), and left out of
    the run file the trainer's processes read."""
    return Field(description=description, json_schema_extra=_SECTION, **default)


def describe_validation_error(err: ValidationError, where: str) -> str:
    """``<where>: field <a.b>: <message>`` lines, one per problem, for users rather than developers."""
    lines = []
    for e in err.errors():
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: field {'.'.join(map(str, e['loc']))}: {message}" if e["loc"] else f"{where}: {message}")
    return "\n".join(lines)


class Settings(BaseModel):
    """A validated settings model whose fields are identity fields unless declared with ``run_field``."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def run_field_names(cls) -> set[str]:
        return {name for name, field in cls.model_fields.items() if field.json_schema_extra in (_RUN, _SECTION)}

    @classmethod
    def section_names(cls) -> set[str]:
        return {name for name, field in cls.model_fields.items() if field.json_schema_extra == _SECTION}

    def identity(self) -> dict[str, Any]:
        """The fields that shape the artifact: what the cache key hashes."""
        return self.model_dump(mode="json", exclude=self.run_field_names())

    def run_settings(self) -> dict[str, Any]:
        """The fields that only say how to run: recorded in metadata, never in the key."""
        return self.model_dump(mode="json", include=self.run_field_names())


class RunConfig(Settings):
    """Base of the trainers' configs: batch sizes, topology, the job's time limit."""

    micro_batch_size: int = run_field(8, "Samples per process per forward/backward (memory, not the math).", ge=1)
    global_batch_size: int = Field(
        default=256,
        ge=1,
        description=("Samples per optimizer step over all processes (gradient accumulation fills the gap)."),
    )
    num_nodes: int = run_field(1, "Nodes (local launcher: torchrun agents on 127.0.0.1).", ge=1)
    nproc_per_node: int = run_field(1, "Processes (devices) per node.", ge=1)
    timeout_s: int = run_field(24 * 3600, "The whole training job's time limit; raise it and rerun to resume.", ge=1)

    @model_validator(mode="after")
    def _batch_fits_the_world(self) -> Self:
        self.accumulation(self.num_nodes * self.nproc_per_node)
        return self

    def launch_spec(
        self, module: str, args: tuple[str, ...], name: str, resources: dict[str, str] | None = None
    ) -> LaunchSpec:
        """The distributed job that trains this config: its topology and time limit, and the per-node
        ``resources`` the launcher asks of a cluster (they are not the trainer's: never in its config)."""
        return LaunchSpec(
            module,
            args,
            num_nodes=self.num_nodes,
            nproc_per_node=self.nproc_per_node,
            timeout_s=self.timeout_s,
            name=name,
            resources=resources or {},
        )

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that ``global_batch_size`` samples make one step."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} x world size {world_size} = {per_step}"
            )
        return self.global_batch_size // per_step


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
        if name not in self.inputs:
            raise ValueError(f"run paths: input {name!r} missing (have {sorted(self.inputs)})")
        return self.inputs[name]


def write_run_file(path: Path, config: RunConfig, paths: RunPaths) -> None:
    """The JSON every process of a launch reads: ``{"config": ..., "paths": ...}``."""
    path.write_text(
        json.dumps(
            {
                "config": config.model_dump(mode="json", exclude=config.section_names()),
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
