"""token_chunks (one partition per source file, memoized per chunk) and token_shards merging them, in
process on real text: the merged dataset holds exactly the documents of an unpartitioned build of the
same files; a changed chunk rebuilds alone; bad input names its file, line or key and leaves nothing
for the GPT to read. The backfill through the team services is test_team_services'."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import zstd

from vlm_assets.data.token_chunks import list_chunks, merge_summary
from vlm_assets.data.token_shards import paragraphs_of_files
from vlm_assets.data.token_stream import token_dataset
from vlm_assets.data.tokens import IGNORE_INDEX
from vlm_assets.defs.data.token_assets import CHUNKS, token_chunks, token_shards
from vlm_assets_tests.conftest import TOKEN_SHARD_CHECKS_PASS, checks_of

WORKS = [
    "sonnets_gut.txt",
    "rape_of_lucrece_gut.txt",
    "lovers_complaint_gut.txt",
    "passionate_pilgrim_gut.txt",
    "phoenix_and_the_turtle_gut.txt",
]


def chunk_config(offline_data: Path, source: Path) -> dict:
    config = {
        "source_dir": str(source),
        "tokenizer": str(offline_data / "gpt2-tokenizer"),
        "max_length": 128,
        "val_fraction": 0.1,
    }
    return {"ops": {"token_chunks": {"config": config}}}


def shards_config(offline_data: Path, **config) -> dict:
    base = {"tokenizer": str(offline_data / "gpt2-tokenizer"), "max_length": 128, "val_fraction": 0.1}
    return {"ops": {"token_shards": {"config": {**base, **config}}}}


def build_partition(embedded, key: str, run_config: dict, raise_on_error=True):
    return dg.materialize(
        [token_chunks],
        partition_key=key,
        resources=embedded.resources,
        run_config=run_config,
        instance=embedded.instance,
        raise_on_error=raise_on_error,
    )


def meta(result, asset: str) -> dict:
    materialization = result.asset_materializations_for_node(asset)[0]
    return {k: getattr(v, "value", v) for k, v in materialization.metadata.items()}


def failure(result) -> str:
    return "\n".join(e.step_failure_data.error.message for e in result.all_events if e.is_step_failure)


def committed(embedded, asset: str) -> list[Path]:
    """What the local store holds under an asset's name: every entry, complete or not."""
    return sorted((embedded.store.root / asset).glob("*")) if (embedded.store.root / asset).exists() else []


def documents(uri: str, split: str) -> list[int]:
    """Token counts of the documents in a split, in sample order: real tokens (labels not ignored)
    split at EOS."""
    dataset = token_dataset(uri, split, batch_size=1)
    flat = []
    for i in range(dataset.num_samples):
        sample = dataset[i]
        flat.append(sample["input_ids"][sample["labels"] != IGNORE_INDEX])
    tokens = np.concatenate(flat)
    eos = np.flatnonzero(tokens == 50256)
    assert len(eos) and eos[-1] == len(tokens) - 1, "every document ends with EOS"
    return np.diff(np.concatenate([[-1], eos])).tolist()


@pytest.fixture
def source(tmp_path, offline_data) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for name in WORKS:
        shutil.copy(offline_data / "shakespeare" / name, root / name)
    return root


@pytest.mark.slow
def test_merged_chunks_equal_an_unpartitioned_build_and_a_changed_chunk_rebuilds_alone(embedded, offline_data, source):
    keys = list_chunks(source, "*.txt")
    assert keys == sorted(WORKS)
    embedded.instance.add_dynamic_partitions(CHUNKS.name, keys)
    # three partitions in one run (a backfill's range, VLM_ASSETS_CHUNKS_PER_RUN=3), the others one a run
    ranged = dg.materialize(
        [token_chunks],
        tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[2]},
        resources=embedded.resources,
        run_config=chunk_config(offline_data, source),
        instance=embedded.instance,
    )
    events = ranged.asset_materializations_for_node("token_chunks")
    assert sorted(e.partition for e in events) == keys[:3]
    assert events[0].metadata["cache"].value == dict.fromkeys(keys[:3], "miss")
    for key in keys[3:]:
        assert meta(build_partition(embedded, key, chunk_config(offline_data, source)), "token_chunks")["cache"] == {
            key: "miss"
        }
    merged = dg.materialize(
        [token_shards],
        resources=embedded.resources,
        run_config=shards_config(offline_data, source="chunks"),
        instance=embedded.instance,
    )
    whole = dg.materialize(
        [token_shards],
        resources=embedded.resources,
        run_config=shards_config(offline_data, source="text_files", text_glob=str(source / "*.txt")),
        instance=embedded.instance,
    )
    merged_meta, whole_meta = meta(merged, "token_shards"), meta(whole, "token_shards")
    assert merged_meta["partitions"] == len(WORKS) and whole_meta["partitions"] == 1
    assert checks_of(merged, "token_shards") == TOKEN_SHARD_CHECKS_PASS
    merged_uri, whole_uri = (
        embedded.store.ref(merged_meta["cache_key"]).uri,
        embedded.store.ref(whole_meta["cache_key"]).uri,
    )
    summary = json.loads((Path(merged_uri) / "tokens.json").read_text())
    assert len(summary["streams"]["train"]) == len(WORKS)
    for split in ("train", "val"):
        merged_docs, whole_docs = documents(merged_uri, split), documents(whole_uri, split)
        assert merged_docs == whole_docs and len(merged_docs) > 10, (split, len(merged_docs), len(whole_docs))
        # each chunk pads its own last block: the merged split has at most one block per chunk more
        blocks = merged_meta[f"{split}_num_samples"] - whole_meta[f"{split}_num_samples"]
        assert 0 <= blocks < len(WORKS), (split, blocks)
    paragraphs = sum(1 for _ in paragraphs_of_files(str(source / "*.txt")))  # the unpartitioned reader
    assert sum(len(documents(merged_uri, s)) for s in ("train", "val")) == paragraphs

    # One chunk rewritten: its partition rebuilds, every other one is a cache hit, the merge is new.
    (source / keys[1]).write_text((source / keys[1]).read_text() + "\n\nA new stanza, for the test.\n")
    caches = {
        key: meta(build_partition(embedded, key, chunk_config(offline_data, source)), "token_chunks")["cache"][key]
        for key in keys
    }
    assert caches == {key: "miss" if key == keys[1] else "hit" for key in keys}
    again = dg.materialize(
        [token_shards],
        resources=embedded.resources,
        run_config=shards_config(offline_data, source="chunks"),
        instance=embedded.instance,
    )
    assert (
        meta(again, "token_shards")["cache"] == "miss"
        and meta(again, "token_shards")["cache_key"] != merged_meta["cache_key"]
    )


@pytest.mark.slow
def test_bad_chunks_fail_alone_naming_the_file_line_or_key_and_nothing_is_merged(embedded, offline_data, tmp_path):
    source = tmp_path / "jsonl"
    source.mkdir()
    pages = sorted((offline_data / "python-docs").rglob("*.rst.txt"))[:30]
    rows = [json.dumps({"text": page.read_text(), "path": page.name}) for page in pages]
    (source / "a.jsonl.zst").write_bytes(zstd.compress("\n".join(rows[:15]).encode()))
    (source / "b.jsonl.zst").write_bytes(zstd.compress("\n".join([*rows[15:17], "{not json", *rows[17:]]).encode()))
    (source / "c.jsonl").write_text("\n".join([rows[0], json.dumps({"content": "no text column"})]) + "\n")
    (source / "d.jsonl.zst").write_bytes(b"not zstd at all")
    assert list_chunks(source, "*.jsonl*") == ["a.jsonl.zst", "b.jsonl.zst", "c.jsonl", "d.jsonl.zst"]
    embedded.instance.add_dynamic_partitions(CHUNKS.name, [*list_chunks(source, "*.jsonl*"), "gone.jsonl.zst"])
    config = chunk_config(offline_data, source)

    # a good and a bad chunk in one run (a backfill's range): the good one is built and materialized
    ranged = dg.materialize(
        [token_chunks],
        tags={"dagster/asset_partition_range_start": "a.jsonl.zst", "dagster/asset_partition_range_end": "b.jsonl.zst"},
        resources=embedded.resources,
        run_config=config,
        instance=embedded.instance,
        raise_on_error=False,
    )
    assert not ranged.success
    assert f"1 of 2 chunks failed: b.jsonl.zst: ValueError: {source / 'b.jsonl.zst'}:3: not valid JSON" in failure(
        ranged
    )
    (good,) = ranged.asset_materializations_for_node("token_chunks")
    assert good.partition == "a.jsonl.zst" and good.metadata["tokens"].value["a.jsonl.zst"]["train"] > 10_000
    expected = {
        "b.jsonl.zst": f"{source / 'b.jsonl.zst'}:3: not valid JSON",
        "c.jsonl": f"{source / 'c.jsonl'}:2: no text column 'text' (has ['content'])",
        "d.jsonl.zst": f"{source / 'd.jsonl.zst'}: not a valid zstd file",
        "gone.jsonl.zst": "partition key 'gone.jsonl.zst' names no chunk",
    }
    for key, message in expected.items():
        result = build_partition(embedded, key, config, raise_on_error=False)
        assert not result.success and message in failure(result), failure(result)
        retried = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        assert not retried, f"{key}: bad input is not retried"
    assert sorted(embedded.instance.get_materialized_partitions(dg.AssetKey("token_chunks"))) == ["a.jsonl.zst"]
    assert len(committed(embedded, "token_chunks")) == 1  # nothing half-written under a failed chunk's key

    merged = dg.materialize(
        [token_shards],
        resources=embedded.resources,
        run_config=shards_config(offline_data, source="chunks"),
        instance=embedded.instance,
        raise_on_error=False,
    )
    assert (
        "token_chunks: 4 of 5 partitions are not materialized (b.jsonl.zst, c.jsonl, d.jsonl.zst, gone.jsonl.zst)"
        in failure(merged)
    )
    assert committed(embedded, "token_shards") == []


SENSOR = """
import json, dagster as dg
from vlm_assets.defs.data.token_assets import token_chunk_sensor
instance = dg.DagsterInstance.ephemeral()
first = token_chunk_sensor(dg.build_sensor_context(instance=instance))
(request,) = first.dynamic_partitions_requests
instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
again = token_chunk_sensor(dg.build_sensor_context(instance=instance))
print(json.dumps({"name": request.partitions_def_name, "keys": request.partition_keys, "again": again.skip_message}))
"""


@pytest.mark.slow
def test_the_sensor_adds_each_new_file_of_the_profiles_source_once():
    # profiles are read when the config classes are made: the demo profile's in a process of its own
    proc = subprocess.run(
        [sys.executable, "-c", SENSOR],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLM_ASSETS_PROFILE": "demo"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["name"] == "token_chunks" and len(said["keys"]) == 42 and "hamlet_gut.txt" in said["keys"]
    assert said["again"].startswith("no new file under ")


def test_a_source_without_chunks_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"chunk source '{tmp_path}' has no file matching"):
        list_chunks(tmp_path, "**/*.jsonl.zst")
    with pytest.raises(ValueError, match="is not a directory"):
        list_chunks(tmp_path / "nope", "*")


def chunk_summary(train: int, val: int, max_length: int = 128) -> dict:
    splits = {
        name: {"num_samples": n, "num_shards": min(n, 1), "num_tokens": n * max_length, "num_padding": 3 * min(n, 1)}
        for name, n in (("train", train), ("val", val))
    }
    shared = {"tokenizer": "gpt2", "vocab_size": 50257, "eos_token_id": 50256, "columns": {}}
    return {**shared, "max_length": max_length, "splits": splits}


def test_a_merge_lists_only_the_chunks_holding_a_split_and_refuses_chunks_that_disagree():
    merged = merge_summary({"b": ("s3://x/b", chunk_summary(5, 0)), "a": ("s3://x/a/", chunk_summary(4, 2))})
    assert merged["streams"] == {"train": ["s3://x/a/train", "s3://x/b/train"], "val": ["s3://x/a/val"]}
    assert merged["splits"]["train"] == {"num_samples": 9, "num_shards": 2, "num_tokens": 9 * 128, "num_padding": 6}
    assert merged["partitions"] == 2
    with pytest.raises(ValueError, match="no chunk holds a val sample"):
        merge_summary({"a": ("x/a", chunk_summary(4, 0)), "b": ("x/b", chunk_summary(5, 0))})
    with pytest.raises(ValueError, match="chunk 'b' differs from 'a' in max_length"):
        merge_summary({"a": ("x/a", chunk_summary(4, 1)), "b": ("x/b", chunk_summary(5, 1, max_length=64))})
    configs = {"a": {"seed": 0, "val_fraction": 0.1}, "b": {"seed": 1, "val_fraction": 0.1}}
    with pytest.raises(ValueError, match="chunk 'b' differs from 'a' in seed"):
        merge_summary({"a": ("x/a", chunk_summary(4, 1)), "b": ("x/b", chunk_summary(5, 1))}, configs)
