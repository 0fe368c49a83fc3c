"""A full disk during a checkpoint write or a shard download, on a real small tmpfs (mounted in a private
mount namespace by `unshare`, so nothing outside the test sees it): the error names what was written,
where, and the file system; nothing partial is left behind; the retry rule reads it as `disk_full` from
the traceback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlm_assets.launch.retry import rule_for
from vlm_assets_tests.waiting import BOUND_S

REPO = Path(__file__).resolve().parents[2]


def on_small_disks(probe: str, size: str, disks: list[Path], *args, timeout: float = BOUND_S) -> dict:
    """Run the Python ``probe`` with a tmpfs of ``size`` mounted on each of ``disks`` (created here) in a
    private mount namespace, its arguments the disks then ``args``; return the JSON its last line prints."""
    mounts = ""
    for disk in disks:
        disk.mkdir()
        mounts += f'mount -t tmpfs -o size={size} vlm-full "{disk}" && '
    script = f'{mounts}exec "{sys.executable}" -c "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, probe, *disks, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = textwrap.dedent(
    """
    import json, sys, traceback
    from pathlib import Path
    import torch
    from vlm_assets.storage import LocalArtifactStore
    from vlm_assets.storage.disk import DiskFullError, space_checked
    from vlm_assets.train.checkpoints import StoreCheckpointIO

    small, big = Path(sys.argv[1]), Path(sys.argv[2])
    weights = {"w": torch.randn(1 << 20)}  # 4 MiB: more than the whole file system
    out = {}

    # 1. Lightning's checkpoint IO (GPT, the adapter): Python's write raises errno 28, without a path.
    store = LocalArtifactStore(big / "store")
    io = StoreCheckpointIO(store, "ckpt", keep_last=2, log=print)
    try:
        io.save_checkpoint({"state_dict": weights, "global_step": 20, "epoch": 0}, small / "step-00000020.ckpt")
    except DiskFullError as err:
        out["lightning"] = str(err)
        out["lightning_tail"] = traceback.format_exc().splitlines()
    out["left_on_small"] = sorted(p.name for p in small.iterdir())
    out["committed"] = store.list_complete("ckpt")

    # 2. torch.save onto a path (DeepSpeed's checkpoints): a RuntimeError with no errno at all.
    try:
        with space_checked(small / "ds", "checkpoint step 30"):
            (small / "ds").mkdir()
            torch.save(weights, small / "ds" / "model_states.pt")
    except DiskFullError as err:
        out["torch"] = str(err)
        out["torch_cause"] = type(err.__cause__).__name__
    for leftover in small.rglob("*"):
        leftover.unlink() if leftover.is_file() else None

    # 3. A local store on the full disk, committing a directory built elsewhere (copied, then renamed).
    (big / "built").mkdir()
    torch.save(weights, big / "built" / "weights.pt")
    small_store = LocalArtifactStore(small / "store")
    try:
        small_store.commit("model/abc", big / "built", metadata={})
    except DiskFullError as err:
        out["store"] = str(err)
    out["store_staging"] = sorted(p.name for p in (small / "store" / ".staging").iterdir())
    out["store_complete"] = small_store.exists("model/abc")
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # fills a small file system of its own
def test_a_full_disk_names_the_write_and_the_disk_and_leaves_nothing_partial(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    big.mkdir()
    out = on_small_disks(PROBE, "1m", [small], big, timeout=300)

    mount = f"on the file system mounted at {small} "
    assert out["lightning"].startswith(f"[Errno 28] no space left on device writing checkpoint step 20 to {small}")
    assert mount in out["lightning"] and "free of 1.0 MiB" in out["lightning"], out["lightning"]
    assert out["left_on_small"] == [] and out["committed"] == []  # the partial staging directory is gone
    rule = rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=out["lightning_tail"])
    assert (rule.cause, rule.retry) == ("disk_full", True)

    assert out["torch_cause"] == "RuntimeError", out
    assert out["torch"].startswith(f"[Errno 28] no space left on device writing checkpoint step 30 to {small}/ds")
    assert mount in out["torch"], out["torch"]

    assert "writing artifact model/abc" in out["store"] and mount in out["store"], out["store"]
    assert out["store_staging"] == [] and out["store_complete"] is False


def test_an_error_that_is_not_about_space_passes_through(tmp_path):
    from vlm_assets.storage.disk import space_checked

    # tmp_path's disk has room: a RuntimeError there is not about space
    with pytest.raises(RuntimeError, match="not a disk problem"), space_checked(tmp_path, "checkpoint step 1"):
        raise RuntimeError("not a disk problem")
    with pytest.raises(PermissionError), space_checked(tmp_path, "checkpoint step 1"):
        raise PermissionError(13, "Permission denied")


SHARD_PROBE = textwrap.dedent(
    """
    import faulthandler, json, sys, traceback
    from vlm_assets._streaming import streaming_dataset
    from vlm_assets.data.token_stream import build_token_dataloaders
    from vlm_assets.storage.disk import DiskFullError
    from vlm_assets_tests.waiting import BOUND_S, wait_until

    faulthandler.dump_traceback_later(BOUND_S / 2, exit=True)  # a hang shows where, before the test's bound
    read_on, stopped_early, random_access, two_workers, one_shard, artifact, one_shard_artifact = sys.argv[1:8]
    out = {}

    def epoch(samples, case):
        try:
            for _ in samples:
                out[case] = out.get(case, 0) + 1
        except DiskFullError as err:
            out[f"{case}_error"] = str(err)
            out[f"{case}_tail"] = traceback.format_exc().splitlines()

    # 1. read on while the download threads fill the disk: the epoch must not end as though the
    # partition were exhausted (a rank that stops early leaves its peers waiting), nor hang at its end
    epoch(build_token_dataloaders(artifact, read_on, batch_size=1).train, "read_on")

    # 2. one sample taken and the epoch left (a validation's limit_val_batches) while the download
    # threads, unbounded here, fill the disk (it may fill before the first sample): the next epoch must
    # start with the error, not wait forever for the failed thread to report its exit
    shards = streaming_dataset(
        remote=f"{artifact}/train", local=f"{stopped_early}/train", batch_size=1, predownload=1 << 20
    )
    try:
        next(iter(shards))
    except DiskFullError:
        pass
    wait_until(lambda: getattr(shards, "_thread_error", None), "the download threads to fail")
    epoch(shards, "next_epoch")

    # 3. random access: the reading thread downloads each shard itself
    shards = streaming_dataset(remote=f"{artifact}/train", local=f"{random_access}/train", batch_size=1)
    epoch((shards[i] for i in range(0, shards.num_samples, 37)), "random_access")

    # 4. two DataLoader workers sharing the cache: the loader raises a worker's error
    epoch(build_token_dataloaders(artifact, two_workers, batch_size=1, num_workers=2).train, "two_workers")

    # 5. two workers that need the same one shard: the one whose download fails must not leave the
    # other waiting for it forever; that one downloads the shard itself, and fails alike
    epoch(build_token_dataloaders(one_shard_artifact, one_shard, batch_size=1, num_workers=2).train, "one_shard")
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # fills small file systems of its own
def test_a_full_disk_during_a_shard_download_fails_the_epoch_as_disk_full(offline_data, tmp_path):
    """Streaming downloads shards in background threads: their error must end the iteration as
    ``DiskFullError``, not end the epoch early as though the partition were exhausted, nor hang the
    epoch's end or the next epoch's start; a shard the reading thread downloads itself names it alike."""
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files, write_token_shards

    tokenizer = load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(offline_data / "shakespeare" / "*.txt")))[:3000]
    summary = write_token_shards(
        tmp_path / "art", tokenizer, "gpt2", docs, docs[:50], max_length=64,
        max_train_samples=None, max_val_samples=50, size_limit=1 << 16,
    )  # fmt: skip
    train = summary["splits"]["train"]
    assert train["num_shards"] >= 8  # ~64 KiB each, several times what a 256 KiB cache can hold
    one_shard = write_token_shards(
        tmp_path / "one", tokenizer, "gpt2", docs, docs[:50], max_length=64,
        max_train_samples=None, max_val_samples=50, size_limit=1 << 24,
    )["splits"]["train"]  # fmt: skip
    assert one_shard["num_shards"] == 1 and one_shard["num_samples"] == train["num_samples"]
    cases = ("read_on", "next_epoch", "random_access", "two_workers", "one_shard")
    caches = [tmp_path / case.replace("_", "-") for case in cases]
    out = on_small_disks(SHARD_PROBE, "256k", caches, tmp_path / "art", tmp_path / "one")
    for case, cache in zip(cases, caches, strict=True):
        assert f"{case}_error" in out, f"{case}: the epoch ended after {out.get(case)} samples, no error"
        assert out.get(case, 0) < train["num_samples"]
        error, expected = out[f"{case}_error"], f"no space left on device writing token shards to {cache}/train"
        # a worker's error reaches the loader as its message (after the worker's name), without its errno
        assert (
            (expected in error) if case in ("two_workers", "one_shard") else error.startswith(f"[Errno 28] {expected}")
        ), error
        rule = rule_for(cause=None, exit_code=1, worker_exit_code=1, tail=out[f"{case}_tail"])
        assert (rule.cause, rule.retry) == ("disk_full", True)
