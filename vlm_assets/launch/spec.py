"""What a training job needs, independent of where it runs (local torchrun processes or k8s pods)."""

import contextlib
import dataclasses
import re
import sys
from collections.abc import Iterator

# A Kubernetes resource quantity: "8", "500m", "64Gi".
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$"

# Set by a launcher whose "nodes" share one host (vlm_assets._streaming reads it).
SHARED_HOST_ENV = "VLM_ASSETS_NODES_SHARE_HOST"

# A worker's exit code when it refused its input (sysexits' EX_DATAERR), after printing one line that
# starts with BAD_INPUT and says why: torchrun's failure summary carries the code to the launcher,
# which puts that line first in the failure and makes no retry (it would fail the same way).
BAD_INPUT_EXIT = 65
BAD_INPUT = "bad input: "


class InputRefused(Exception):
    """A trainer's input it cannot use (a bad record, a sample too long): see ``exit_on_refused_input``."""


@contextlib.contextmanager
def exit_on_refused_input() -> Iterator[None]:
    """Turn ``InputRefused`` around a trainer's main into one ``BAD_INPUT`` line and exit code 65.

    Put it outside the Pipes context, so the line comes after what that context prints on its way out.
    """
    try:
        yield
    except InputRefused as err:
        print(f"{BAD_INPUT}{err}", file=sys.stderr, flush=True)
        raise SystemExit(BAD_INPUT_EXIT) from None


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One distributed job: ``python -m <module> <args>`` on every process of every node.

    A backend turns this into processes: the local backend runs one ``torchrun`` per node on
    127.0.0.1; a Kubernetes backend would run one pod per node behind a headless Service. Either
    way every process sees torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``.
    """

    module: str  # e.g. "vlm_assets.train.gpt_pretrain"
    args: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to every process' environment
    num_nodes: int = 1
    nproc_per_node: int = 1
    # Per node, Kubernetes-style ({"cpu": "4", "memory": "64Gi", "nvidia.com/gpu": "8"}) plus "gpu_type".
    resources: dict[str, str] = dataclasses.field(default_factory=dict)
    rendezvous_timeout_s: int = 120  # all nodes must have joined within this
    timeout_s: int = 3600  # the whole job, start to finish
    name: str = "train"  # shown in logs, pod names

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_][\w.]*", self.module):
            raise ValueError(f"LaunchSpec.module must be a dotted module name, got {self.module!r}")
        if self.num_nodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"LaunchSpec: num_nodes ({self.num_nodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1"
            )
        if self.rendezvous_timeout_s < 1 or self.timeout_s < 1:
            raise ValueError("LaunchSpec: timeouts must be positive seconds")

    @property
    def world_size(self) -> int:
        """The number of training processes: nodes times processes per node."""
        return self.num_nodes * self.nproc_per_node
