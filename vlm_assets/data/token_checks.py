"""Data-quality checks on a token shard artifact (pure; wrapped as Dagster asset checks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlm_assets.data.occlusion_checks import CheckOutcome

SPLITS = ("train", "val")


@dataclasses.dataclass
class SplitScan:
    """What a scan of one token split found: sample and token counts, id range, sample lengths, and an error."""

    num_samples: int = 0
    num_tokens: int = 0
    min_id: int = int(np.iinfo(np.int64).max)
    max_id: int = -1
    lengths: set[int] = dataclasses.field(default_factory=set)
    error: str | None = None


def scan_split(split_dir: Path) -> SplitScan:
    """Decode every sample of every shard of one split; the first unreadable shard ends the scan."""
    # Imported here: streaming pulls in torch (seconds), and judging a recorded scan needs neither.
    from streaming.base.format import reader_from_json

    from vlm_assets._streaming import streaming  # noqa: F401  (registers the vision shim first)

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


def scan(root: Path) -> dict[str, Any]:
    """Read the whole artifact once; return what every token check needs, as JSON.

    It is committed in the artifact's manifest when built, so checks on a cache hit need not read the shards again.
    """
    summary = json.loads((root / "tokens.json").read_text())
    splits = {}
    for split in SPLITS:
        result = scan_split(root / split)
        splits[split] = {
            **dataclasses.asdict(result),
            "lengths": sorted(result.lengths),
            "reported": summary["splits"][split],
        }
        if not result.error:
            splits[split]["num_shards"] = len(json.loads((root / split / "index.json").read_text())["shards"])
    return {"vocab_size": summary["vocab_size"], "max_length": summary["max_length"], "splits": splits}


def ids_within_vocab(scanned: dict[str, Any]) -> CheckOutcome:
    """Check that every split's token ids lie within ``[0, vocab_size)``."""
    vocab = scanned["vocab_size"]
    failures, meta = [], {"vocab_size": vocab}
    for split, s in scanned["splits"].items():
        if s["error"]:
            failures.append(s["error"])
            continue
        meta[f"{split}_max_id"] = s["max_id"]
        if s["min_id"] < 0 or s["max_id"] >= vocab:
            failures.append(f"{split}: token ids span [{s['min_id']}, {s['max_id']}], outside [0, {vocab})")
    return CheckOutcome(not failures, "; ".join(failures) or f"all token ids are within [0, {vocab})", meta)


def counts_match(scanned: dict[str, Any]) -> CheckOutcome:
    """Check that each split's sample and token counts match what ``tokens.json`` reports."""
    failures, meta = [], {}
    for split, s in scanned["splits"].items():
        if s["error"]:
            failures.append(s["error"])
            continue
        reported = s["reported"]
        meta[f"{split}_num_samples"], meta[f"{split}_num_tokens"] = s["num_samples"], s["num_tokens"]
        if (s["num_samples"], s["num_tokens"]) != (reported["num_samples"], reported["num_tokens"]):
            failures.append(
                f"{split}: shards hold {s['num_samples']} samples / {s['num_tokens']} tokens, "
                f"tokens.json reports {reported['num_samples']} / {reported['num_tokens']}"
            )
        if s["lengths"] != [scanned["max_length"]]:
            failures.append(f"{split}: sample lengths {s['lengths']}, expected {scanned['max_length']}")
    return CheckOutcome(not failures, "; ".join(failures) or "sample and token counts match tokens.json", meta)


def shards_readable(scanned: dict[str, Any]) -> CheckOutcome:
    """Check that every shard of every split decodes."""
    failures, meta = [], {}
    for split, s in scanned["splits"].items():
        if s["error"]:
            failures.append(s["error"])
        else:
            meta[f"{split}_num_shards"] = s["num_shards"]
    return CheckOutcome(not failures, "; ".join(failures) or "every shard decodes", meta)
