"""Data-quality checks on a token shard artifact (pure; wrapped as Dagster asset checks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlm_assets._streaming import streaming  # noqa: F401  (registers the vision shim first)
from vlm_assets.data.occlusion_checks import CheckOutcome
from streaming.base.format import reader_from_json

SPLITS = ("train", "val")


@dataclasses.dataclass
class SplitScan:
    num_samples: int = 0
    num_tokens: int = 0
    min_id: int = np.iinfo(np.int64).max
    max_id: int = -1
    lengths: set[int] = dataclasses.field(default_factory=set)
    error: str | None = None


def scan_split(split_dir: Path) -> SplitScan:
    """Decode every sample of every shard of one split; the first unreadable shard ends the scan."""
    scan = SplitScan()
    try:
        index = json.loads((split_dir / "index.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        scan.error = f"{split_dir / 'index.json'}: unreadable MDS index: {err}"
        return scan
    for shard in index["shards"]:
        shard_file = split_dir / shard["raw_data"]["basename"]
        try:
            reader = reader_from_json(str(split_dir.parent), split_dir.name, shard)
            for i in range(reader.samples):
                ids = reader.get_item(i)["input_ids"]
                scan.num_samples += 1
                scan.num_tokens += int(ids.size)
                scan.lengths.add(int(ids.size))
                scan.min_id = min(scan.min_id, int(ids.min()))
                scan.max_id = max(scan.max_id, int(ids.max()))
        except Exception as err:  # a corrupt shard can fail in many ways inside the reader
            scan.error = f"{shard_file}: unreadable shard: {type(err).__name__}: {err}"
            return scan
    return scan


def _summary(root: Path) -> dict[str, Any]:
    return json.loads((root / "tokens.json").read_text())


def ids_within_vocab(root: Path) -> CheckOutcome:
    vocab = _summary(root)["vocab_size"]
    failures, meta = [], {"vocab_size": vocab}
    for split in SPLITS:
        scan = scan_split(root / split)
        if scan.error:
            failures.append(scan.error)
            continue
        meta[f"{split}_max_id"] = scan.max_id
        if scan.min_id < 0 or scan.max_id >= vocab:
            failures.append(f"{split}: token ids span [{scan.min_id}, {scan.max_id}], outside [0, {vocab})")
    return CheckOutcome(not failures, "; ".join(failures) or f"all token ids are within [0, {vocab})", meta)


def counts_match(root: Path) -> CheckOutcome:
    summary = _summary(root)
    failures, meta = [], {}
    for split in SPLITS:
        scan = scan_split(root / split)
        if scan.error:
            failures.append(scan.error)
            continue
        reported = summary["splits"][split]
        meta[f"{split}_num_samples"], meta[f"{split}_num_tokens"] = scan.num_samples, scan.num_tokens
        if (scan.num_samples, scan.num_tokens) != (reported["num_samples"], reported["num_tokens"]):
            failures.append(f"{split}: shards hold {scan.num_samples} samples / {scan.num_tokens} tokens, "
                            f"tokens.json reports {reported['num_samples']} / {reported['num_tokens']}")
        if scan.lengths != {summary["max_length"]}:
            failures.append(f"{split}: sample lengths {sorted(scan.lengths)}, expected {summary['max_length']}")
    return CheckOutcome(not failures, "; ".join(failures) or "sample and token counts match tokens.json", meta)


def shards_readable(root: Path) -> CheckOutcome:
    failures, meta = [], {}
    for split in SPLITS:
        index = root / split / "index.json"
        scan = scan_split(root / split)
        if scan.error:
            failures.append(scan.error)
        else:
            meta[f"{split}_num_shards"] = len(json.loads(index.read_text())["shards"])
    return CheckOutcome(not failures, "; ".join(failures) or "every shard decodes", meta)
