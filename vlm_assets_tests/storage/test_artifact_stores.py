import json
import threading
import time

import pytest

from vlm_assets.storage import ArtifactNotFoundError, CorruptArtifactError, LocalArtifactStore, S3ArtifactStore
from vlm_assets.storage.lease import LeaseHeldError, LeaseLostError, holder_record
from vlm_assets_tests.waiting import BOUND_S


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "store")
    monkeypatch.setenv("VLM_ASSETS_HOME", str(tmp_path / "home"))  # S3 builds stage under it, not ./var
    client, bucket = request.getfixturevalue("s3_bucket")
    return S3ArtifactStore(client, bucket, prefix="team/vlm", cache_dir=tmp_path / "s3cache")


def _fill(staging):
    (staging / "sub").mkdir()
    (staging / "a.txt").write_text("alpha")
    (staging / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)


def test_round_trip_with_checksums(store, tmp_path):
    with store.staging_dir("asset/k1") as staging:
        _fill(staging)
        ref = store.commit("asset/k1", staging, metadata={"rows": 3})
    assert store.exists("asset/k1") and ref.metadata == {"rows": 3}
    manifest = store.verify("asset/k1")
    assert set(manifest.files) == {"a.txt", "sub/b.bin"} and manifest.num_bytes == 5 + 25600
    local = store.local_path("asset/k1")
    assert (local / "a.txt").read_text() == "alpha"
    assert (local / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 100
    assert store.ref("asset/k1").data_version == ref.data_version
    if isinstance(store, S3ArtifactStore):
        assert ref.uri.startswith(f"s3://{store.bucket}/team/vlm/asset/k1")


def test_same_content_same_data_version(store):
    versions = []
    for key in ("asset/x", "asset/y"):
        with store.staging_dir(key) as staging:
            _fill(staging)
            versions.append(store.commit(key, staging, {}).data_version)
    assert versions[0] == versions[1]


def test_failure_mid_write_leaves_nothing_visible(store):
    with pytest.raises(RuntimeError, match="writer died"), store.staging_dir("asset/k2") as staging:
        _fill(staging)
        raise RuntimeError("writer died")
    assert not store.exists("asset/k2")
    with pytest.raises(ArtifactNotFoundError):
        store.read_manifest("asset/k2")


def test_failure_during_publish_leaves_nothing_visible(store, monkeypatch):
    """The upload itself dies after some files: the key stays empty, no stray objects remain."""
    if isinstance(store, S3ArtifactStore):
        real_upload, calls = store.client.upload_file, []

        def flaky_upload(*args, **kwargs):
            calls.append(args)
            if len(calls) == 2:
                raise ConnectionError("network dropped")
            return real_upload(*args, **kwargs)

        monkeypatch.setattr(store.client, "upload_file", flaky_upload)
    else:
        monkeypatch.setattr(
            "vlm_assets.storage.artifact_store.os.rename",
            lambda *a: (_ for _ in ()).throw(ConnectionError("network dropped")),
        )
    with pytest.raises(ConnectionError), store.staging_dir("asset/k3") as staging:
        _fill(staging)
        store.commit("asset/k3", staging, {})
    assert not store.exists("asset/k3")
    if isinstance(store, S3ArtifactStore):
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="team/vlm/asset/k3")
        assert listed.get("KeyCount", 0) == 0
    else:
        assert not (store.root / "asset" / "k3").exists()


def test_corrupted_file_is_detected(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    with store.staging_dir("asset/k4") as staging:
        _fill(staging)
        store.commit("asset/k4", staging, {})
    (store.root / "asset" / "k4" / "a.txt").write_text("tampered")
    with pytest.raises(CorruptArtifactError, match=r"a.txt: content does not match the manifest of 'asset/k4'"):
        store.verify("asset/k4")


def test_empty_artifact_and_escaping_keys_are_refused(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    with store.staging_dir("asset/k5") as staging, pytest.raises(ValueError, match="empty artifact"):
        store.commit("asset/k5", staging, {})
    with pytest.raises(ValueError, match="escapes the store root"):
        store.uri("../outside")


def test_concurrent_commits_of_one_key_first_wins_never_half_replaced(store):
    """Six writers commit different content under one key at once: exactly one commit is visible,
    every writer gets that one's ref, and every read sees a complete, verified artifact."""
    refs, errors, seen, torn = [], [], [], []
    start = threading.Barrier(7)

    def writer(i):
        try:
            with store.staging_dir("asset/race") as staging:
                (staging / "payload.bin").write_bytes(bytes([i]) * 200_000)
                (staging / "who.txt").write_text(str(i))
                start.wait()
                refs.append(store.commit("asset/race", staging, {"writer": i}))
        except BaseException as err:  # surfaced below
            errors.append(err)

    def reader():
        start.wait()
        try:
            while len(seen) < 50:
                finished = writers_done.is_set()  # read once more after the last commit, then stop
                if store.exists("asset/race"):
                    root = store.local_path("asset/race")
                    seen.append((root / "who.txt").read_text())
                    if (root / "payload.bin").read_bytes() != bytes([int(seen[-1])]) * 200_000:
                        torn.append(seen[-1])
                if finished:
                    return
        except BaseException as err:  # surfaced below, in the test's own thread
            errors.append(err)

    writers_done = threading.Event()
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    watcher = threading.Thread(target=reader)
    for t in [*writers, watcher]:
        t.start()
    for t in writers:
        t.join()
    writers_done.set()
    watcher.join()
    assert not errors and not torn, (errors, torn)
    winner = store.read_manifest("asset/race").metadata["writer"]
    assert {r.metadata["writer"] for r in refs} == {winner} and len({r.uri for r in refs}) == 1
    assert seen and set(seen) == {str(winner)}  # the reader did read the artifact, only ever the winner's
    store.verify("asset/race")
    if isinstance(store, S3ArtifactStore):  # the losers' uploads were removed
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="team/vlm/asset/race/")
        assert len(listed["Contents"]) == 3  # manifest + the winner's two files


def test_quick_verify_reads_sizes_not_content(store):
    with store.staging_dir("asset/q") as staging:
        _fill(staging)
        store.commit("asset/q", staging, {})
    assert store.quick_verify("asset/q") == []
    manifest = store.read_manifest("asset/q")
    if isinstance(store, S3ArtifactStore):
        prefix = f"team/vlm/asset/q/{manifest.location}"
        store.client.put_object(Bucket=store.bucket, Key=f"{prefix}/a.txt", Body=b"alph")
        store.client.delete_object(Bucket=store.bucket, Key=f"{prefix}/sub/b.bin")
    else:
        (store.root / "asset" / "q" / "a.txt").write_text("alph")
        (store.root / "asset" / "q" / "sub" / "b.bin").unlink()
    assert store.quick_verify("asset/q") == [
        "a.txt: 4 bytes, the manifest says 5",
        "sub/b.bin: listed in the manifest but missing",
    ]


def test_lease_one_holder_named_renewed_released(store):
    # S3's Last-Modified has one-second resolution: a ttl of a few seconds (the resource asks >= 5)
    first = store.lease("asset/k", holder_record("run-a"), ttl_s=3)
    assert first.try_acquire() is None
    time.sleep(5)  # well past the ttl: the holder's renewals keep it live
    busy = store.lease("asset/k", holder_record("run-b"), ttl_s=3).try_acquire()
    assert busy is not None and busy.holder["run_id"] == "run-a"
    assert busy.describe().startswith("run run-a on ") and " since " in busy.describe()
    first.ensure_held()
    first.release()
    second = store.lease("asset/k", holder_record("run-b"), ttl_s=3)
    assert second.try_acquire() is None
    second.release()


@pytest.mark.slow  # waits out a holder's work, twice
def test_a_busy_lease_fails_naming_its_holder_or_waits_until_the_work_is_done_or_released(store):
    first = store.lease("asset/w", holder_record("run-a"), ttl_s=8)
    assert first.try_acquire() is None
    second, logs = store.lease("asset/w", holder_record("run-b"), ttl_s=8), []
    with pytest.raises(LeaseHeldError, match=r"asset/w is being built by another attempt: run run-a on .* expires 8 s"):
        second.acquire_or_wait(lambda: False, fail_at_once=True, timeout_s=60, log=logs.append)
    with pytest.raises(LeaseHeldError, match=r"another attempt \(waited 3 s\): run run-a"):  # polls every 2 s
        second.acquire_or_wait(lambda: False, fail_at_once=False, timeout_s=3, log=logs.append)
    assert len(logs) == 1 and logs[0].startswith("asset/w is being built by run run-a on ")
    assert logs[0].endswith(": waiting for it")  # said once, not at every poll
    done = threading.Event()
    threading.Timer(0.5, done.set).start()  # the holder commits the work: the waiter uses it, never takes the lease
    assert second.acquire_or_wait(done.is_set, fail_at_once=False, timeout_s=60, log=logs.append) is False
    threading.Timer(0.5, first.release).start()  # the holder gives up without the work: the waiter takes over
    assert second.acquire_or_wait(lambda: False, fail_at_once=False, timeout_s=60, log=logs.append) is True
    assert store.lease_read("asset/w").holder["run_id"] == "run-b"
    second.release()


def test_stale_lease_of_a_dead_holder_expires_and_only_one_takes_it_over(store):
    dead = holder_record("run-dead")
    assert store.lease_create("asset/s", json.dumps(dead).encode()) is not None  # never renewed
    assert store.lease("asset/s", holder_record("run-x"), ttl_s=2).try_acquire().holder["run_id"] == "run-dead"
    time.sleep(3.5)
    results, logs = [], []
    contenders = [store.lease("asset/s", holder_record(f"run-{i}"), ttl_s=2, log=logs.append) for i in range(4)]
    threads = [threading.Thread(target=lambda c=c: results.append(c.try_acquire())) for c in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is None for r in results) == 1, results  # exactly one new holder
    assert any("expired" in line and "run-dead" in line for line in logs)
    for c in contenders:
        c.release()


def test_a_lease_taken_over_while_held_forbids_the_commit(store):
    lease = store.lease("asset/l", holder_record("run-slow"), ttl_s=3)  # renewed every second
    assert lease.try_acquire() is None
    state = store.lease_read("asset/l")
    store.lease_remove("asset/l", state.token)  # as an expiry takeover by another attempt would
    assert store.lease_create("asset/l", json.dumps(holder_record("run-other")).encode())
    lease.ttl_s = 0.3  # renew often from the next renewal on
    deadline = time.time() + BOUND_S
    while not lease.lost and time.time() < deadline:
        time.sleep(0.1)
    with pytest.raises(LeaseLostError, match="no longer held"):
        lease.ensure_held()
    lease.release()
    assert store.lease_read("asset/l").holder["run_id"] == "run-other"


def test_a_lease_whose_holder_process_is_gone_expires_at_once(store):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {**holder_record("run-gone"), "pid": int(gone.stdout)}  # this host, a process that exited
    store.lease_create("asset/g", json.dumps(holder).encode())
    logs = []
    lease = store.lease("asset/g", holder_record("run-next"), ttl_s=3600, log=logs.append)
    assert lease.try_acquire() is None  # no ttl to wait for
    assert lease.taken_over.holder["run_id"] == "run-gone" and "its process is gone" in logs[0]
    assert [s.holder["run_id"] for s in store.list_leases()] == ["run-next"]
    lease.release()
    assert store.list_leases() == []
