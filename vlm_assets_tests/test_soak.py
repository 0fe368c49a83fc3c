"""CI's short seeded soak (bench/soak.py --ci): one uninterrupted reference run of each of gpt_checkpoint
and visualchat_model, then one faulted run of each from seed 2112454's schedule; each asset's two runs in
turn, beside the other asset's, each asset's behind S3 and MLflow fault proxies of its own. Each fault
fires as the S3 proxy answers a checkpoint's commit, so every run of this test does the same work.

gpt_checkpoint: the S3 server fails the 5 writes after step 12's commit (the next checkpoint's first
request, past boto3's 3 tries: the retry rule's `unreachable`; the retry's first request then succeeds on
its third try), then the run's scratch disk (a tmpfs) is kept full after step 18 until the attempt whose
next write fails has ended (`disk_full`: step 24's validation shard download, or its checkpoint): the
RetryPolicy's 2 retries, no relaunch.
visualchat_model: the step process (a child of the run worker: Dagster's multiprocess executor) is
SIGKILLed after step 8 (the run worker sees it crash; the RetryPolicy's retry takes over its lease and
ends its MLflow run KILLED), then the run worker itself after step 16: nothing of that attempt can clean
up, so the relaunch must take its lease over, end its MLflow run KILLED, mark its Dagster run failed,
remove its scratch and resume from the last checkpoint.
The soak exits non-zero on any broken invariant; here its report must also show the faults fired."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_assets_tests.waiting import BOUND_S

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_seeded_soak_loses_nothing(tmp_path, offline_data):
    command = [sys.executable, str(REPO / "bench" / "soak.py"), "--runs", "2", "--seed", "2112454", "--ci"]
    command += ["--assets", "gpt_checkpoint", "visualchat_model", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "VLM_ASSETS_HOME"))}
    try:  # below pytest's own 1200 s limit, so that a soak past it still shows its output
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1100)
    except subprocess.TimeoutExpired as past:  # its output is bytes, whatever text= said
        output = b"".join(x or b"" for x in (past.stdout, past.stderr)).decode(errors="replace")
        pytest.fail(f"the soak ran past 1100 s:\n{output[-6000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "soak.json").read_text())["runs"]
    gpt_reference, chat_reference, gpt, chat = runs
    for reference in (gpt_reference, chat_reference):
        # a retry here is a failure nothing injected: its causes and errors say what it was
        assert not reference["faults"] and reference["retries"] == 0, reference
    assert (gpt["asset"], chat["asset"]) == ("gpt_checkpoint", "visualchat_model")
    for run in (gpt, chat):
        assert all(f["fired_at"] is not None and not f["note"] for f in run["faults"]), run

    assert [(f["kind"], f["fired_at"], f["size"]) for f in gpt["faults"]] == [("s3-500", 12, 5), ("disk-full", 18, 0)]
    assert gpt["retries"] == 2 and gpt["relaunches"] == 0, gpt
    # each failed attempt read by the retry rule: the outage, then the full disk
    assert gpt["causes"] == ["unreachable", "disk_full"], gpt["causes"]
    assert gpt["loss"] == pytest.approx(gpt_reference["loss"], abs=1e-5)
    assert gpt["resumed_from_step"] >= 18 and gpt["key"] == gpt_reference["key"]

    assert [(f["kind"], f["fired_at"]) for f in chat["faults"]] == [("step", 8), ("run-worker", 16)]
    # the crashed step process, as the run worker reports it; then the killed run worker, seen by the soak
    assert chat["causes"] == ["step:ChildProcessCrashException", "run-worker:killed"], chat["causes"]
    assert chat["retries"] == 2 and chat["relaunches"] == 1, chat
    assert chat["loss"] == pytest.approx(chat_reference["loss"], abs=1e-5)  # the held-out loss of the merged model
    assert chat["resumed_from_step"] >= 16 and chat["key"] == chat_reference["key"]
    assert chat["mlflow_statuses"].count("KILLED") == 2 and "RUNNING" not in chat["mlflow_statuses"], chat
    for name, asset in (("run0", "gpt_checkpoint"), ("run1", "visualchat_model")):
        assert re.search(rf"\| {name} \| {asset} \| .* \| yes \|", proc.stdout), proc.stdout


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", REPO / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lost_work_is_judged_by_the_faults_that_ended_an_attempt():
    """The soak's own check, on the runs that found it wrong. Seed 226, run 2: an agent killed after step
    6, then MLflow down for 39 s after step 18, which the client's retries rode out: the one retry rightly
    resumed from step 6. Seed 20, run 3 (VisualChat): the S3 server dropped 6 writes after step 8 (two
    attempts failed `unreachable` and resumed from 8), then MLflow was down after step 16, ridden out by
    the last attempt: a fault ends an attempt only when a failure came after it."""
    soak = _soak_module()

    def fault(kind, step, at, size=0, victims=()):
        return soak.Fault(kind, step, size, victims=victims, fired_at=step, fired_time=at)

    agent, mlflow_down = fault("agent", 6, at=1.0), fault("mlflow-down", 18, at=3.0, size=39)
    assert soak.work_lost([agent, mlflow_down], [2.0], 1, 6.0) == []
    # the same outage past the client's retries: an attempt failed after it, so the resume must be from >= 18
    assert soak.work_lost([agent, mlflow_down], [2.0, 4.0], 2, 6.0) == [
        "resumed from step 6.0, but step 18 was committed before the last fault"
    ]
    drop, mlflow_down = fault("s3-drop", 8, at=1.0, size=6), fault("mlflow-down", 16, at=4.0, size=26)
    assert soak.work_lost([drop, mlflow_down], [2.0, 3.0], 2, 8.0) == []
    worker = fault("worker", 12, at=1.0)
    assert soak.work_lost([worker], [2.0], 1, 6.0) == [
        "resumed from step 6.0, but step 12 was committed before the last fault"
    ]
    assert soak.work_lost([worker], [], 0, None) == ["1 kill(s) ending 1 attempt(s) but 0 retries"]
    assert soak.work_lost([fault("disk-full", 12, at=1.0)], [2.0], 1, 12.0) == []
    # (the k8s soak: a pod evicted, then the step killed 0.2 s later, before the launcher had seen the
    # eviction): two kills of one launch (the same workers alive) end one attempt
    evict, step = fault("pod-evict", 6, at=1.0, victims=(41, 42)), fault("step", 12, at=1.2, victims=(41, 42))
    assert soak.work_lost([evict, step], [2.0], 1, 24.0) == []
    step.victims = (51, 52)  # the retry's workers: a second attempt ended
    assert soak.work_lost([evict, step], [2.0], 1, 24.0) == ["2 kill(s) ending 2 attempt(s) but 1 retries"]


FULL_DISK = """
import os, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import soak
disk = Path(sys.argv[2])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "soak-test", str(disk)], check=True)
free = lambda: os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
staged = disk / "step-4"
staged.write_bytes(os.urandom((3 << 20) + 4096))  # being uploaded; its odd page makes a short write
ballast = soak.fill(disk)
print(free(), ballast.stat().st_size)
staged.unlink()  # its upload done: its staging goes
print(free())
soak.fill(disk)  # the watcher's next tick
print(free())
"""


def test_the_full_disk_stays_full_until_its_fault_ends(tmp_path):
    """The soak's disk-full fault, on a small tmpfs: the ballast takes every byte without failing on a
    short write (a buffered file raised ENOSPC again on close, which killed the fault schedule with the
    disk left full: a VisualChat run never recovered), and takes back what a finished upload's staging
    frees (else the next checkpoint fits again and the fault does nothing)."""
    soak = _soak_module()
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        [*soak.UNSHARE, sys.executable, "-c", FULL_DISK, str(REPO / "bench"), str(disk)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert proc.returncode == 0, proc.stderr
    (full, size), (freed,), (refilled,) = [map(int, line.split()) for line in proc.stdout.splitlines()]
    assert full == 0 and size >= 4 << 20  # full, with the 3 MiB staged beside the ballast
    assert freed >= 3 << 20
    assert refilled == 0


def test_the_watcher_reports_a_partial_file_and_an_unreadable_manifest_not_a_deleted_key(tmp_path):
    from vlm_assets.storage import LocalArtifactStore

    soak = _soak_module()
    store = LocalArtifactStore(str(tmp_path / "store"))
    for key in ("a/intact", "a/partial", "a/unreadable", "a/deleted"):
        with store.staging_dir(key) as staging:
            (staging / "weights.bin").write_bytes(b"x" * 1000)
            store.commit(key, staging, {})
    (store.local_path("a/partial") / "weights.bin").write_bytes(b"x" * 10)
    manifest = store.local_path("a/unreadable") / "_COMPLETE.json"
    manifest.write_text(manifest.read_text()[:40])  # cut mid-write
    store.delete("a/deleted")
    assert soak.torn_problems(store, "a/intact") == []
    assert soak.torn_problems(store, "a/partial") == ["weights.bin: 10 bytes, the manifest says 1000"]
    assert soak.torn_problems(store, "a/unreadable")[0].startswith("unreadable manifest: ")
    assert soak.torn_problems(store, "a/deleted") == []


def test_a_listing_that_lacks_a_manifests_file_or_holds_another_size_disagrees_with_it(tmp_path):
    """The watcher's check between reads of a commit: one listing of the key against the manifest it read."""
    import dataclasses

    from vlm_assets.storage.artifact_store import ArtifactManifest

    soak = _soak_module()
    (tmp_path / "shards").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x" * 1000)
    (tmp_path / "shards" / "0.bin").write_bytes(b"y" * 10)
    manifest = ArtifactManifest.of_directory("ckpt/step-6", tmp_path, {})
    at = dataclasses.replace(manifest, location=manifest.digest)  # where an S3 commit puts the files
    listing = {"weights.bin": 1000, "shards/0.bin": 10}
    assert soak.listed_problems(manifest, listing) == []
    gone = ["shards/0.bin: listed in the manifest but missing"]
    assert soak.listed_problems(manifest, {"weights.bin": 1000}) == gone  # gone while the manifest is listed
    assert soak.listed_problems(manifest, {**listing, "weights.bin": 999}) == [
        "weights.bin: 999 bytes, the manifest says 1000"
    ]
    assert soak.listed_problems(at, {f"{at.location}/{rel}": size for rel, size in listing.items()}) == []
    # the files below another location than the manifest's
    assert soak.listed_problems(at, listing) == [
        f"{rel}: listed in the manifest but missing" for rel in sorted(listing)
    ]
    assert soak.listed_problems(at, {"weights.bin": 1000, f"{at.location}/shards/0.bin": 10}) == [
        "weights.bin: listed in the manifest but missing"
    ]


def test_a_commit_is_read_once_then_checked_against_each_polls_listing(tmp_path):
    """The watcher's check of one committed checkpoint at each poll, on a real local store: its manifest
    read once; the store asked again only when a listing disagrees; an unreadable manifest reported once;
    a key deleted meanwhile left alone."""
    from vlm_assets.storage import LocalArtifactStore

    soak = _soak_module()
    store = LocalArtifactStore(str(tmp_path / "store"))
    roots = {}
    for key in ("c/step-6", "c/step-12", "c/step-18"):
        with store.staging_dir(key) as staging:
            (staging / "weights.bin").write_bytes(b"x" * 1000)
            store.commit(key, staging, {})
        roots[key] = store.local_path(key)
    reads = []
    read_manifest = store.read_manifest
    store.read_manifest = lambda key: reads.append(key) or read_manifest(key)

    def listing(key: str, etag: str = "e1") -> dict[str, dict]:
        files = (p for p in roots[key].rglob("*") if p.is_file())
        return {p.relative_to(roots[key]).as_posix(): {"Size": p.stat().st_size, "ETag": etag} for p in files}

    manifests = {}
    assert soak.commit_problems(store, manifests, "c/step-6", listing("c/step-6")) == []
    assert soak.commit_problems(store, manifests, "c/step-6", listing("c/step-6")) == []
    assert reads == ["c/step-6"]
    (roots["c/step-6"] / "weights.bin").write_bytes(b"x" * 10)
    torn = soak.commit_problems(store, manifests, "c/step-6", listing("c/step-6"))
    assert torn == ["weights.bin: 10 bytes, the manifest says 1000"]
    assert len(reads) > 1 and set(reads) == {"c/step-6"}  # the store asked, once the listing disagreed

    manifest = roots["c/step-12"] / "_COMPLETE.json"
    manifest.write_text(manifest.read_text()[:40])  # cut mid-write
    unreadable = soak.commit_problems(store, manifests, "c/step-12", listing("c/step-12"))
    assert len(unreadable) == 1 and unreadable[0].startswith("unreadable manifest: ")
    assert soak.commit_problems(store, manifests, "c/step-12", listing("c/step-12")) == []

    before = listing("c/step-18")
    store.delete("c/step-18")
    assert soak.commit_problems(store, manifests, "c/step-18", before) == []
    assert not [commit for commit in manifests if commit[0] == "c/step-18"]  # not cached: read if listed again


def test_a_fault_that_never_fired_or_a_soak_cut_short_is_a_failure():
    soak = _soak_module()
    fired = soak.Fault("s3-500", 6, 8, fired_at=6, fired_time=1.0)
    never = soak.Fault("disk-full", 18)
    assert soak.unfired([fired, never]) == ["fault disk-full after step 18 never fired"]
    ok, broken = {"problems": []}, {"problems": ["fault disk-full after step 18 never fired"]}
    assert soak.exit_status([ok], unfinished=0) == 0
    assert soak.exit_status([ok, broken], unfinished=0) == 1
    assert soak.exit_status([ok], unfinished=2) == 2


def test_the_s3_proxy_fires_a_fault_between_a_commits_write_and_its_answer(tmp_path, s3_bucket, monkeypatch):
    """The soak's S3 proxy runs ``on_commit`` between a checkpoint commit's write and its answer.

    In front of a real S3 server: the hook sees the manifest stored while the committer is still waiting;
    5 failed writes then cost exactly one commit (boto3's standard retry mode tries a request 3 times) and
    the next commit's first request lands on its third try; a commit that is no checkpoint fires nothing."""
    import threading

    import boto3
    from boto3.exceptions import S3UploadFailedError

    from vlm_assets.storage import S3ArtifactStore

    soak = _soak_module()
    direct, bucket = s3_bucket
    proxy = soak.FaultProxy(int(direct.meta.endpoint_url.rsplit(":", 1)[1]))
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{proxy.port}", region_name="us-east-1")
    store = S3ArtifactStore(client, bucket, prefix="soak", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path / "home"))  # the store stages below it
    fired, answered = [], threading.Event()

    def on_commit(path: str, step: int) -> None:
        stored = direct.head_object(Bucket=bucket, Key=f"soak/checkpoints/a/h/step-{step:08d}/_COMPLETE.json")
        # the committer has not returned: it is waiting for this answer
        fired.append((path.split("/", 2)[2], step, stored["ContentLength"] > 0, answered.wait(0.5)))
        if step == 6:
            proxy.arm("s3-500", 5)

    def commit(key: str) -> None:
        answered.clear()
        with store.staging_dir(key) as staging:
            (staging / "weights.bin").write_bytes(b"x" * 1000)
            store.commit(key, staging, {})
        answered.set()

    proxy.on_commit = on_commit
    try:
        commit("checkpoints/a/h/step-00000006")
        with pytest.raises(S3UploadFailedError, match="InternalError"):
            commit("checkpoints/a/h/step-00000012")
        assert (proxy.injected, proxy.left) == (3, 2)  # one request's 3 tries
        commit("checkpoints/a/h/step-00000012")
        commit("tokens/h")  # not a checkpoint: no hook
    finally:
        proxy.server.shutdown()
        proxy.server.server_close()
    assert fired == [
        ("soak/checkpoints/a/h/step-00000006/_COMPLETE.json", 6, True, False),
        ("soak/checkpoints/a/h/step-00000012/_COMPLETE.json", 12, True, False),
    ]
    assert (proxy.injected, proxy.left) == (5, 0)
