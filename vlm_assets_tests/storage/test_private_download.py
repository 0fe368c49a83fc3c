"""``private_download`` against moto's S3 server on loopback: two processes seeded alike (two ranks
after ``seed_everything``) download one object into one place at the same moment and both succeed, the
file whole, no temporary file left; and mosaicml-streaming's downloader, which skips a path that
exists, still fetches through it (a token_shards artifact's ``tokens.json``)."""

import json
import multiprocessing
import random
from pathlib import Path

import pytest

from vlm_assets.storage.disk import private_download

ROUNDS = 4


def _download(endpoint: str, bucket: str, key: str, target: str, barrier) -> None:
    import boto3

    random.seed(0)  # as every rank is: boto3's temporary names are drawn from this generator
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(ROUNDS):
        barrier.wait(timeout=120)
        with private_download(Path(target)) as tmp:
            client.download_file(bucket, key, str(tmp))


def race(endpoint: str, bucket: str, key: str, target: Path) -> list[int | None]:
    """Run two downloading processes in step; return their exit codes (None: still running, killed)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    processes = [
        context.Process(target=_download, args=(endpoint, bucket, key, str(target), barrier)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes


def test_two_ranks_download_one_object_into_one_place(s3_bucket, s3_endpoint, tmp_path):
    client, bucket = s3_bucket
    payload = random.Random(1).randbytes(24 << 20)  # long enough to write that the two downloads overlap
    client.put_object(Bucket=bucket, Key="shards/tokens.json", Body=payload)
    target = tmp_path / "cache" / "tokens.json"

    assert race(s3_endpoint, bucket, "shards/tokens.json", target) == [0, 0]
    assert target.read_bytes() == payload
    assert [p.name for p in target.parent.iterdir()] == ["tokens.json"]


def test_streaming_fetches_a_token_summary_through_it(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    from vlm_assets.data.token_stream import token_summary

    client, bucket = s3_bucket
    summary = {"max_length": 64, "vocab_size": 50257}
    client.put_object(Bucket=bucket, Key="tokens/tokens.json", Body=json.dumps(summary).encode())
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)  # streaming's name for a non-AWS endpoint
    assert token_summary(f"s3://{bucket}/tokens", tmp_path / "cache") == summary
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tokens.json"]


def test_a_failed_download_leaves_nothing_and_the_whole_file_stands(tmp_path):
    target = tmp_path / "tokens.json"
    with pytest.raises(ConnectionError), private_download(target) as tmp:
        tmp.write_bytes(b"half")
        raise ConnectionError("the server went away")
    assert list(tmp_path.iterdir()) == []

    target.write_text("{}")
    with pytest.raises(ConnectionError), private_download(target) as tmp:
        tmp.write_bytes(b"half")
        raise ConnectionError("the server went away")
    with pytest.raises(FileNotFoundError, match="wrote nothing"), private_download(target):
        pass
    assert target.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["tokens.json"]
