"""What every trainer's config shares: identity vs run fields, validated JSON round trip, topology and
gradient accumulation, and the run file the launcher hands to every process.

A trainer has exactly one config model (``PretrainConfig``, ``AdapterTrainConfig``): the asset's
Dagster config is that model mixed into ``dg.Config`` and the torchrun entry point reads the same
model back from the run file. Fields are of two kinds:

- **identity** (the default): they shape the artifact, so they enter the cache key and the key of the
  training checkpoints;
- **run** fields (declared with ``run_field``): they only say how to run it (time limit, topology,
  logging and checkpoint cadence, retention). Changing one never changes the key, so a rerun with a
  longer timeout or more nodes resumes from the last checkpoint of the same key.
"""

import json
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlm_assets.launch.spec import QUANTITY, LaunchSpec

_RUN = {"identity": False}
_SECTION = {"identity": False, "section": True}
C = TypeVar("C", bound="RunConfig")


def run_field(default: Any, description: str, **constraints: Any) -> Any:
    """A field that says how to run, not what is produced: outside the cache key, recorded in metadata."""
    return Field(default=default, description=description, json_schema_extra=_RUN, **constraints)


def run_section(factory: Any, description: str) -> Any:
    """A nested model of run fields that only the asset's own step reads (e.g. its checks' thresholds):
    outside the cache key, and left out of the run file the trainer's processes read."""
    return Field(default_factory=factory, description=description, json_schema_extra=_SECTION)


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

    micro_batch_size: int = Field(default=8, ge=1, description="Samples per process per forward/backward.")
    global_batch_size: int = Field(
        default=256,
        ge=1,
        description=("Samples per optimizer step over all processes (gradient accumulation fills the gap)."),
    )
    num_nodes: int = run_field(1, "Nodes (local launcher: torchrun agents on 127.0.0.1).", ge=1)
    nproc_per_node: int = run_field(1, "Processes (devices) per node.", ge=1)
    timeout_s: int = run_field(24 * 3600, "The whole training job's time limit; raise it and rerun to resume.", ge=1)
    # What each node asks of a cluster (the k8s launcher's pod resources; the local launcher ignores them).
    gpus_per_node: int = run_field(0, "GPUs each node's pod requests (nvidia.com/gpu); 0: a CPU pod.", ge=0)
    gpu_type: str | None = run_field(
        None,
        "GPU product the pods must land on (a node selector on the launcher's "
        "gpu_node_label, e.g. 'NVIDIA-H100-80GB-HBM3').",
    )
    cpu_per_node: str | None = run_field(
        None, "CPU each node's pod requests and is limited to ('8', '500m').", pattern=QUANTITY
    )
    memory_per_node: str | None = run_field(
        None, "Memory each node's pod requests and is limited to ('64Gi').", pattern=QUANTITY
    )

    @model_validator(mode="after")
    def _batch_fits_the_world(self) -> Self:
        self.accumulation(self.num_nodes * self.nproc_per_node)
        return self

    def launch_spec(self, module: str, args: tuple[str, ...], name: str) -> LaunchSpec:
        """The distributed job that trains this config: topology, time limit and per-node resources."""
        resources = {
            "nvidia.com/gpu": str(self.gpus_per_node) if self.gpus_per_node else None,
            "cpu": self.cpu_per_node,
            "memory": self.memory_per_node,
            "gpu_type": self.gpu_type,
        }
        return LaunchSpec(
            module,
            args,
            num_nodes=self.num_nodes,
            nproc_per_node=self.nproc_per_node,
            timeout_s=self.timeout_s,
            name=name,
            resources={k: v for k, v in resources.items() if v is not None},
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
