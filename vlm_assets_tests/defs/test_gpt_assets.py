"""``gpt_checkpoint`` end to end on CPU: real Shakespeare token shards, the local torchrun launcher
(2 nodes x 1 process, and 1 node x 2 processes with FSDP2), Pipes, checkpoints, a SIGKILLed worker
and its resumed retry, a damaged checkpoint, and the Hugging Face export reloaded by transformers."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from vlm_assets.defs.data.token_assets import token_shards
from vlm_assets.defs.models.gpt_assets import gpt_checkpoint
from vlm_assets.launch import LaunchSpec, run_local
from vlm_assets.train.checkpoints import CHECKPOINT_FILE, latest_checkpoint
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.run_config import RunPaths, overlay, write_run_file
from vlm_assets_tests.conftest import (
    GPT_CHECKS_PASS,
    IsolatedEnv,
    checks_of,
    kill_mid_training_and_relaunch,
    launcher_clock_jumps,
    training_workers,
)
from vlm_assets_tests.waiting import BOUND_S

pytestmark = pytest.mark.slow

GRAPH = [token_shards, gpt_checkpoint]  # each asset's checks run in its own step
UNIFORM = math.log(50257)
MAX_STEPS = 30
# Two micro-batches of 2 per process and step (gradient accumulation 2 at world size 2).
GPT = {
    "model": {"preset": "tiny"},
    "optimizer": {"global_batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "max_steps": MAX_STEPS},
    "data": {"val_check_interval": 10, "val_batches": 4},
    "checkpoint": {"every": 6, "keep_last": 2},
    "parallelism": {"strategy": "ddp", "num_nodes": 2, "nproc_per_node": 1, "micro_batch_size": 2},
    "log_every": 5,
}


def run_config(offline_data, **gpt):
    tokens = {
        "source": "text_files",
        "text_glob": str(offline_data / "shakespeare" / "*.txt"),
        "tokenizer": str(offline_data / "gpt2-tokenizer"),
        "max_length": 64,
        "max_val_samples": 64,
    }
    return {"ops": {"token_shards": {"config": tokens}, "gpt_checkpoint": {"config": overlay(GPT, gpt)}}}


def Env(root: Path, mlflow_uri: str) -> IsolatedEnv:
    return IsolatedEnv(root, GRAPH, mlflow_uri)


def outcome(result):
    meta = result.asset_materializations_for_node("gpt_checkpoint")[0].metadata
    checks = checks_of(result, "gpt_checkpoint")
    return {k: getattr(v, "value", v) for k, v in meta.items()}, checks


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, offline_data, mlflow_uri):
    env = Env(tmp_path_factory.mktemp("gpt-ddp"), mlflow_uri)
    started = time.monotonic()
    result = env.materialize(run_config(offline_data))
    env.seconds = time.monotonic() - started  # this machine's time for the whole run, start-up included
    meta, checks = outcome(result)
    env.first_log_messages = env.log_messages
    history = json.loads((Path(meta["uri"]) / "history.json").read_text())
    return env, result, meta, checks, history


def test_two_nodes_ddp_trains_well_below_uniform(ddp_run, mlflow_uri):
    env, result, meta, checks, history = ddp_run
    assert result.success and meta["cache"] == "miss"
    assert checks == GPT_CHECKS_PASS
    assert meta["steps"] == MAX_STEPS and meta["world_size"] == 2 and meta["resumed_from_step"] == -1
    assert (meta["precision"], meta["backend"]) == ("32-true", "gloo")  # bf16-mixed and nccl in the GPU twin
    assert meta["val_loss"] < UNIFORM - 2.5, meta["val_loss"]
    assert meta["tokens_seen"] == MAX_STEPS * 8 * 64
    # The rate is over the training steps alone: the seconds it implies fit inside the whole run's wall
    # time (start-up, validation and export included) and are not a sliver of it (a unit slip would be).
    trained_s = meta["tokens_seen"] / meta["tokens_per_s"]
    assert 0.05 * env.seconds < trained_s < env.seconds, (trained_s, env.seconds)
    assert [p["step"] for p in history["train"]] == list(range(1, MAX_STEPS + 1))
    assert [p["step"] for p in history["val"]] == [10, 20, 30]
    root = Path(meta["uri"])
    assert (root / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (root / "hf").iterdir()}
    # Checkpoints in the store: the newest keep_last, the final step among them.
    steps = [k.rsplit("-", 1)[1] for k in env.store.list_complete(f"checkpoints/{meta['cache_key']}")]
    assert steps == ["00000024", "00000030"]
    # Lightning's MLFlowLogger logged the training curve into the asset's MLflow run (log_every 5),
    # at the optimizer step, validation included.
    client = MlflowClient(mlflow_uri)
    assert [m.step for m in client.get_metric_history(meta["mlflow_run_id"], "train/loss")] == [5, 10, 15, 20, 25, 30]
    assert {10, 20, 30} <= {m.step for m in client.get_metric_history(meta["mlflow_run_id"], "val/loss")}
    # ModelCheckpoint decided the cadence; its state is in the checkpoint.
    ckpt = torch.load(
        env.store.local_path(f"checkpoints/{meta['cache_key']}/step-00000030") / "checkpoint.ckpt", weights_only=False
    )
    assert any(name.startswith("StepCheckpoint") for name in ckpt["callbacks"])
    # The Pipes logger carried rank 0's metrics (the launcher tests cover every node's output, tagged).
    assert any(m.startswith("step 30: ") and " train/loss=" in m for m in env.first_log_messages)  # not stdout


def test_rerun_is_a_cache_hit(ddp_run, offline_data):
    env, _, meta, _, _ = ddp_run
    again, _ = outcome(env.materialize(run_config(offline_data)))
    assert again["cache"] == "hit" and again["cache_key"] == meta["cache_key"]


def test_one_node_two_processes_fsdp2(tmp_path, offline_data, mlflow_uri):
    env = Env(tmp_path, mlflow_uri)
    meta, checks = outcome(
        env.materialize(
            run_config(
                offline_data,
                parallelism={"strategy": "fsdp2", "num_nodes": 1, "nproc_per_node": 2},
                checkpoint={"every": 15},
            )
        )
    )
    assert meta["strategy"] == "fsdp2" and meta["steps"] == MAX_STEPS
    assert checks == GPT_CHECKS_PASS
    assert meta["val_loss"] < UNIFORM - 2.5


def _workers(marker: str) -> list[int]:
    return training_workers("vlm_assets.train.gpt_pretrain", marker)


def _signal_after_checkpoints(env, marker: str, count: int, sig: int):
    """Start a thread that waits for ``count`` committed checkpoints and live workers of ``marker``, then
    sends ``sig`` to them; returns it and a dict that gets the last committed ``step``."""
    seen = {}

    def watch():
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            committed = sorted(env.root.glob("artifacts/checkpoints/gpt_checkpoint/*/step-*/_COMPLETE.json"))
            if len(committed) >= count and (pids := _workers(marker)):
                seen["step"] = int(committed[-1].parent.name.split("-")[1])
                for pid in pids:
                    os.kill(pid, sig)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread, seen


def test_damaged_checkpoint_is_skipped_for_the_previous_one_by_plain_torchrun(ddp_run, tmp_path):
    env, _, meta, _, history = ddp_run
    prefix = f"checkpoints/{meta['cache_key']}"
    newest = env.store.local_path(f"{prefix}/step-00000030") / CHECKPOINT_FILE
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated

    skipped = []
    key, path = latest_checkpoint(env.store, prefix, skipped.append)
    assert key.endswith("step-00000024") and path.is_file() and "step-00000030" in skipped[0]

    # The trainer itself, without Dagster: resumes from step 24 and ends at the same loss.
    (shards_key,) = env.store.list_complete("token_shards")
    shards = env.store.local_path(shards_key)
    paths = RunPaths(
        inputs={"token_shards": str(shards)},
        out_dir=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "cache"),
        checkpoint_store=env.resources["artifact_store"].spec(),
        checkpoint_prefix=prefix,
    )
    write_run_file(tmp_path / "run.json", PretrainConfig(**GPT), paths)
    lines = []
    run_local(
        LaunchSpec(
            "vlm_assets.train.gpt_pretrain",
            ("--config", str(tmp_path / "run.json")),
            num_nodes=2,
            env={"OMP_NUM_THREADS": "1"},
            timeout_s=300,
        ),
        on_line=lines.append,
    )
    assert any("skipping damaged checkpoint" in line and "step-00000030" in line for line in lines)
    resumed = json.loads((tmp_path / "out" / "history.json").read_text())
    assert resumed["resumed_from_step"] == 24
    assert resumed["train"][-1]["loss"] == pytest.approx(history["train"][-1]["loss"], abs=1e-5)


def test_bad_config_fails_at_once_naming_the_field(tmp_path, offline_data, mlflow_uri):
    env = Env(tmp_path, mlflow_uri)
    result = env.materialize(run_config(offline_data, optimizer={"global_batch_size": 7}), raise_on_error=False)
    failure = result.get_step_failure_events()
    assert not result.success and len(failure) == 1
    assert (
        "optimizer.global_batch_size 7 is not a multiple of"
        in failure[0].step_failure_data.user_failure_data.description
    )


def test_threshold_change_reruns_the_check_not_the_training(ddp_run, offline_data):
    env, _, meta, _, _ = ddp_run
    config = run_config(offline_data)
    config["ops"]["gpt_checkpoint"]["config"]["checks"] = {"min_val_loss_gain": 10.0}
    result = env.materialize(config, raise_on_error=False)
    again, checks = outcome(result)
    assert again["cache"] == "hit" and again["cache_key"] == meta["cache_key"]
    assert checks["val_loss_beats_uniform"] is False  # 10 nats below ln V is out of reach


def test_a_timeout_then_a_longer_one_on_another_world_size_resumes_near_the_same_loss(
    ddp_run, tmp_path, offline_data, mlflow_uri, monkeypatch
):
    """The job is frozen (SIGSTOP) right after its first checkpoint, so the launcher's timeout fires at a
    known step; the rerun with a raised timeout_s on 1 node x 1 process (both run fields: the same key)
    resumes there: the consolidated checkpoint loads at the other world size, accumulation doubles,
    training ends at max_steps with its checks passing. The launcher's clock jumps past the first
    timeout once the job is frozen, so it fires at that step however fast this machine is. Not
    bit-exact across world sizes (docs/training.md): the bound on the final val loss is 5 %. A resume
    at the same world size is exact: the SIGKILL test's curve."""
    env = Env(tmp_path, mlflow_uri)
    freezer, frozen = _signal_after_checkpoints(env, str(tmp_path), 1, signal.SIGSTOP)
    with monkeypatch.context() as patch:
        launcher_clock_jumps(patch, when=lambda: bool(frozen))
        first = env.materialize(run_config(offline_data, timeout_s=300), raise_on_error=False)
    freezer.join()
    assert frozen, "the job was never frozen after a checkpoint"
    assert not first.success
    failures = first.get_step_failure_events()
    assert len(failures) == 1  # a timeout is not retried under the same limit
    assert "Raise timeout_s and rerun" in failures[0].step_failure_data.user_failure_data.description
    assert not _workers(str(tmp_path)), "a frozen worker outlived the timeout"

    one_process = {"num_nodes": 1, "nproc_per_node": 1}
    meta, checks = outcome(env.materialize(run_config(offline_data, timeout_s=600, parallelism=one_process)))
    assert meta["cache_key"] == ddp_run[2]["cache_key"] and meta["world_size"] == 1
    assert meta["resumed_from_step"] == frozen["step"] and meta["steps"] == MAX_STEPS
    assert checks == GPT_CHECKS_PASS
    assert meta["run_settings"]["timeout_s"] == 600
    resumed = json.loads((Path(meta["uri"]) / "history.json").read_text())
    assert [p["step"] for p in resumed["train"]] == list(range(1, MAX_STEPS + 1))
    assert resumed["val"][-1]["loss"] == pytest.approx(ddp_run[4]["val"][-1]["loss"], rel=0.05)


def test_sigkill_of_dagster_then_of_a_worker_each_resume_the_same_curve(ddp_run, tmp_path, offline_data):
    """`dagster job execute -j gpt_job` (in-process executor: the step runs in that process) SIGKILLed
    while GPT trains at 2 nodes x 1 process: no agent or worker survives, nothing is committed after
    it; the relaunch marks the dead run failed (Dagster) and KILLED (MLflow) and resumes from the last
    checkpoint. In the relaunch a worker is SIGKILLed after its first checkpoint: the attempt fails
    cleanly, the step's retry resumes from that checkpoint, and the run ends on the uninterrupted
    curve, step by step (gloo on CPU is deterministic; the tolerance only absorbs float summation
    order)."""
    run = kill_mid_training_and_relaunch(
        tmp_path,
        "gpt_job",
        run_config(offline_data),
        "gpt_checkpoint",
        checkpoints_before_kill=2,
        executor="in_process",
        kill_a_worker_of="vlm_assets.train.gpt_pretrain",
    )
    # one MLflow run per attempt: the killed process's, the attempt whose worker died, the retry's
    assert run.mlflow_statuses("gpt_checkpoint") == ["FAILED", "FINISHED", "KILLED"]

    meta = run.materialization("gpt_checkpoint")
    assert int(run.at_kill[-1].split("-")[1]) < meta["resumed_from_step"] == int(run.worker_killed_at.split("-")[1])
    assert meta["cache_key"] == ddp_run[2]["cache_key"] and meta["steps"] == MAX_STEPS
    assert meta["val_loss"] == pytest.approx(ddp_run[2]["val_loss"], abs=1e-5)
    resumed = json.loads((Path(meta["uri"]) / "history.json").read_text())
    uninterrupted = ddp_run[4]
    assert [p["step"] for p in resumed["train"]] == list(range(1, MAX_STEPS + 1))
    for a, b in zip(resumed["train"], uninterrupted["train"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["lr"] == pytest.approx(b["lr"])
    for a, b in zip(resumed["val"], uninterrupted["val"], strict=True):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def k8s_launcher_env(tmp_path: Path, k8s_testbed, namespace: str) -> dict[str, str]:
    """The environment that selects the k8s launcher, set up for the loopback testbed."""
    from vlm_assets.launch.local import free_port

    launcher = {
        "namespace": namespace,
        "kubeconfig": str(k8s_testbed.kubeconfig),
        "python": sys.executable,
        # pod DNS names do not resolve on the testbed: the rendezvous is on loopback
        "rendezvous_host": "127.0.0.1",
        "rendezvous_port": free_port(),
        "pending_timeout_s": 60,
        "env": {"OMP_NUM_THREADS": "1", "VLM_ASSETS_NODES_SHARE_HOST": "1"},
    }
    (tmp_path / "launcher.yaml").write_text(json.dumps(launcher))
    return {"VLM_ASSETS_LAUNCHER": "k8s", "VLM_ASSETS_K8S_CONFIG": str(tmp_path / "launcher.yaml")}


def _k8s_job(tmp_path: Path, k8s_testbed, namespace: str, offline_data, **gpt) -> tuple[list[str], dict, Path]:
    """`dagster job execute -j gpt_job` with VLM_ASSETS_LAUNCHER=k8s against the loopback control
    plane: the command, its environment, and where its checkpoints land."""
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text((repo / "dagster.yaml").read_text())
    env = {
        **os.environ,
        "VLM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "VLM_ASSETS_PROFILE": "seed",
        **k8s_launcher_env(tmp_path, k8s_testbed, namespace),
    }
    (tmp_path / "run_config.yaml").write_text(
        json.dumps({**run_config(offline_data, **gpt), "execution": {"config": {"in_process": {}}}})
    )
    command = [
        sys.executable,
        "-m",
        "dagster",
        "job",
        "execute",
        "-m",
        "vlm_assets.definitions",
        "-j",
        "gpt_job",
        "-c",
        str(tmp_path / "run_config.yaml"),
    ]
    return command, env, tmp_path / "home" / "artifacts" / "checkpoints" / "gpt_checkpoint"


def _pod_processes(node_index: int) -> list[int]:
    """PIDs of the torchrun agents the testbed's kubelet runs for pods of node ``node_index``."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = environ.read_bytes().split(b"\0")
            cmdline = (environ.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in cmdline and f"VLM_ASSETS_NODE_INDEX={node_index}".encode() in variables:
            pids.append(int(environ.parent.name))
    return pids


def test_k8s_launcher_trains_on_pods_and_a_killed_pod_is_retried_from_the_last_checkpoint(
    ddp_run, tmp_path, offline_data, k8s_testbed, namespace
):
    """gpt_job through the real API server at 2 pods x 1 process: pod 1 is killed after the first
    checkpoint; the step fails naming the pod and its exit code, every pod and the Service are
    deleted, Dagster's retry resumes from the last committed checkpoint, rank 0's Pipes metadata comes
    back, and the loss is the local launcher's. (The namespace fixture checks nothing is left.)"""
    import dagster as dg

    command, env, checkpoints = _k8s_job(tmp_path, k8s_testbed, namespace, offline_data)
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + BOUND_S
        while (
            not list(checkpoints.glob("*/step-*/_COMPLETE.json")) and job.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        at_kill = sorted(p.parent.name for p in checkpoints.glob("*/step-*/_COMPLETE.json"))
        pods = _pod_processes(1)
        assert at_kill and len(pods) == 1, (at_kill, pods, (tmp_path / "job.log").read_text()[-3000:])
        os.killpg(pods[0], signal.SIGKILL)  # the container's processes, as an OOM kill or a node failure
        assert job.wait(timeout=400) == 0, (tmp_path / "job.log").read_text()[-5000:]
    out = (tmp_path / "job.log").read_text()
    assert re.search(r"pod gpt-checkpoint-\w+-1 failed: container exit code -9", out), out[-5000:]
    assert "STEP_UP_FOR_RETRY" in out and "[node 1]" in out
    instance = dg.DagsterInstance.from_config(str(tmp_path / "dagster"))
    event = instance.get_latest_materialization_event(dg.AssetKey("gpt_checkpoint"))
    meta = {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}
    assert meta["resumed_from_step"] >= int(at_kill[-1].split("-")[1]) and meta["steps"] == MAX_STEPS
    assert meta["cache_key"] == ddp_run[2]["cache_key"] and meta["world_size"] == 2
    assert meta["val_loss"] == pytest.approx(ddp_run[2]["val_loss"], abs=1e-5)  # through Pipes, from rank 0


def test_k8s_launcher_more_gpus_than_a_node_has_fails_once_with_the_schedulers_reason(
    tmp_path, offline_data, mlflow_uri, k8s_testbed, namespace
):
    """resources.gpus_per_node (asset config) beyond every node's 8: the pods stay Pending; after the pending
    timeout the step fails with the scheduler's reason, without retries (a retry cannot fit either),
    and nothing is left in the namespace (the fixture checks)."""
    from vlm_assets.defs.platform.launcher import K8sTorchrunLauncher

    env = Env(tmp_path, mlflow_uri)
    env.resources["launcher"] = K8sTorchrunLauncher(
        namespace=namespace, kubeconfig=str(k8s_testbed.kubeconfig), python=sys.executable, pending_timeout_s=5
    )
    result = env.materialize(
        run_config(offline_data, resources={"gpus_per_node": 16, "gpu_type": "NVIDIA-H100-80GB-HBM3"}),
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = failure.step_failure_data.error.message + str(failure.step_failure_data.user_failure_data.metadata)
    assert "still Pending after 5 s" in message and "Unschedulable" in message, message
    assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
