"""The one retry rule: what ended a launch -> whether running it again can help.

Exactly one layer retries a training job: the asset's Dagster ``RetryPolicy`` (2 retries), each
attempt resuming from the last committed checkpoint of its key. The layers under it are set so that
they cannot double up: torchrun runs with ``--max-restarts=0`` (``launch.local``, ``launch.k8s``), and
a Kubernetes pod has ``restartPolicy: Never`` and a Job ``backoffLimit: 0`` (``launch.k8s``). Every
launcher reports a failure as a ``LaunchFailed`` and ``rule_for`` reads it the same way, from what the
launcher saw itself (``cause``: the time limit, a pod that never scheduled, an evicted or deleted pod)
or else from the exit codes and the last lines. docs/reliability.md tabulates the rules.
"""

import dataclasses
import re

from vlm_assets.launch.spec import BAD_INPUT_EXIT


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a launch that failed for one cause is handled: its cause, whether it is retried, and how it is recognised."""

    cause: str
    retry: bool
    seen_as: str  # how a launcher recognises it (docs/reliability.md's table is these rows)


RULES = {
    rule.cause: rule
    for rule in (
        Rule("bad_input", False, f"a worker exits {BAD_INPUT_EXIT} (EX_DATAERR) after its `bad input:` line"),
        Rule("timeout", False, "the job runs past `timeout_s`, or a pod past its `activeDeadlineSeconds`"),
        Rule(
            "unschedulable",
            False,
            "a pod stays Pending past `pending_timeout_s`: no node can hold the request, or the image cannot be pulled",
        ),
        Rule("killed", True, "a worker or agent ends by SIGKILL or SIGTERM (exit -9/-15, or 137/143 from a shell)"),
        Rule("evicted", True, "a pod is evicted, deleted by someone else, or its node is lost"),
        Rule("rendezvous", True, "torchrun's rendezvous times out or closes (a node never came, or left)"),
        Rule(
            "collective", True, "a gloo/NCCL collective times out or a peer's connection closes (a node died under it)"
        ),
        Rule(
            "unreachable",
            True,
            "the artifact store or the tracking server is unreachable or answers 5xx past its client's own retries",
        ),
        Rule(
            "disk_full",
            True,
            "a write runs out of space or quota (`DiskFullError` naming the disk, or errno 28): its partial "
            "checkpoint is removed, and a retry resumes from the last committed one",
        ),
        Rule("canceled", False, "its run is terminated (the UI's Terminate): the launch stops its workers or pods"),
        Rule("error", False, "any other non-zero exit: a config or code error (exit 1 with a traceback, 2, ...)"),
    )
}

# Exit codes of a process ended by SIGKILL or SIGTERM: negative from Python's view, 128 + N from a shell's.
KILLED_EXIT_CODES = {-9, -15, 128 + 9, 128 + 15}
# The last lines name the error: torchrun's own, the storage clients', the collective backends'. A broken
# collective comes last: it is what a rank's peers see when that rank fails for any of the other causes,
# and on a node of several processes their tracebacks sit beside the failing rank's own.
_PATTERNS = (
    ("disk_full", re.compile(r"DiskFullError|No space left on device|Disk quota exceeded", re.I)),
    ("rendezvous", re.compile(r"Rendezvous(Timeout|Closed|Connection)Error|rendezvous .*(timed out|closed)", re.I)),
    (
        "unreachable",
        re.compile(
            r"EndpointConnectionError|ConnectTimeoutError|ConnectionClosedError|ReadTimeoutError|Max retries exceeded|"
            r"ServiceUnavailable|SlowDown|"
            r"\(InternalError\)|status code 50[0-9]|50[234] Server Error"
        ),
    ),
    (
        "collective",
        re.compile(
            r"DistNetworkError|DistBackendError|Connection closed by peer|Connection reset by peer|"
            r"gloo.*(Timed out|timeout)|NCCL (error|timeout)|Watchdog caught collective operation timeout",
            re.I,
        ),
    ),
)


def rule_for(*, cause: str | None, exit_code: int | None, worker_exit_code: int | None, tail: list[str]) -> Rule:
    """Return the rule of one failed launch.

    ``cause`` is what the launcher saw itself (one of ``RULES``) or None; a worker's exit code comes first, then
    the agent's, then the last lines.
    """
    if cause is not None:
        return RULES[cause]
    if worker_exit_code == BAD_INPUT_EXIT:
        return RULES["bad_input"]
    if worker_exit_code in KILLED_EXIT_CODES or exit_code in KILLED_EXIT_CODES:
        return RULES["killed"]
    text = "\n".join(tail)
    for name, pattern in _PATTERNS:
        if pattern.search(text):
            return RULES[name]
    return RULES["error"]
