"""The one retry rule (``vlm_assets.launch.retry``) read off real failures: torchrun processes whose
rank fails each way while its peer waits in a gloo collective, torchrun's own rendezvous timeout, a
real S3 client facing a closed port, a real traceback. And docs/reliability.md's table is the rule's table."""

import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from vlm_assets.launch import LaunchFailed, LaunchSpec, run_local
from vlm_assets.launch.retry import RULES, rule_for
from vlm_assets_tests.conftest import free_port

WORKER = "vlm_assets_tests.launch.allreduce_worker"
ENV = {"OMP_NUM_THREADS": "1"}
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, cause, retry", [("sigkill", "killed", True), ("exit3", "error", False), ("bad-input", "bad_input", False)]
)
def test_the_failing_rank_is_the_cause_not_its_peers_broken_collective(how, cause, retry):
    """Rank 1 fails; rank 0 then waits on it in a barrier, which fails too ("Connection closed by
    peer"): the launch names node 1 and reads its cause, and only a kill is retried."""
    lines = []
    spec = LaunchSpec(WORKER, ("--fail-rank", "1", "--fail-how", how), num_nodes=2, nproc_per_node=1, env=ENV)
    with pytest.raises(LaunchFailed) as failure:
        run_local(spec, on_line=lines.append)
    err = failure.value
    assert (err.node, err.rule.cause, err.retryable) == (1, cause, retry), "\n".join(lines[-40:])


@pytest.mark.slow
def test_a_node_that_never_joins_is_a_retryable_rendezvous_failure(tmp_path):
    """torchrun's own rendezvous timeout: one node of two started, a 3 s join timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf=join_timeout=3"]
    command += ["--max-restarts=0", f"--log-dir={tmp_path}", "-m", WORKER]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**ENV, "PATH": "/usr/bin"})
    assert proc.returncode != 0
    tail = (proc.stdout + proc.stderr).splitlines()
    rule = rule_for(cause=None, exit_code=proc.returncode, worker_exit_code=None, tail=tail)
    assert (rule.cause, rule.retry) == ("rendezvous", True), "\n".join(tail[-30:])


def test_an_unreachable_store_is_retryable_and_a_code_error_is_not():
    import boto3
    import botocore.config

    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    with pytest.raises(Exception) as raised:
        client.list_buckets()
    tail = "".join(traceback.format_exception(raised.value)).splitlines()
    assert rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=tail).cause == "unreachable", tail
    # One node of two processes: the peer's broken barrier follows the failing rank's traceback.
    peer = [
        "[rank1]: Traceback (most recent call last):",
        *(f'[rank1]:   File "/x/module_{i}.py", line {i}, in step' for i in range(40)),
        "[rank1]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed "
        "by peer [127.0.0.1]:29500",
    ]
    assert rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=tail + peer).cause == "unreachable"
    assert rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=peer).cause == "collective"

    try:
        {"lr": 1e-3}["learning_rate"]
    except KeyError as err:
        tail = "".join(traceback.format_exception(err)).splitlines()
    assert rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=tail).cause == "error"
    assert rule_for(cause=None, exit_code=1, worker_exit_code=-9, tail=tail).cause == "killed"  # the kill wins
    assert rule_for(cause="evicted", exit_code=1, worker_exit_code=3, tail=tail).cause == "evicted"  # what k8s saw


def test_the_documented_table_is_the_rule():
    docs = (REPO / "docs" / "reliability.md").read_text()
    for rule in RULES.values():
        assert f"| `{rule.cause}` | {rule.seen_as} | {'retry' if rule.retry else 'fail'} |" in docs, rule.cause
