"""What every trainer's run config shares: JSON round trip (the launcher hands it to each process as a
file) and gradient accumulation derived from the global batch and the world size."""

import dataclasses
import json
from pathlib import Path
from typing import Self


class RunConfig:
    """Base of the trainers' config dataclasses; they define ``global_batch_size`` and ``micro_batch_size``."""

    global_batch_size: int
    micro_batch_size: int

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that ``global_batch_size`` samples make one step."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} x world size {world_size} = {per_step}"
            )
        return self.global_batch_size // per_step

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Self:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except TypeError as err:
            raise ValueError(f"{path}: {err}") from err
