"""A large corpus as chunks: one source file per partition, tokenized on its own, merged by reference.

A chunk is one file under a source directory, named by its path relative to that directory (the
partition key): ``.jsonl``, ``.jsonl.gz`` or ``.jsonl.zst`` (one JSON object a line, its text in one
column, as SlimPajama ships), or plain text (``.txt``: paragraphs are documents). Each chunk becomes a
token shard artifact of its own (``write_token_shards``); ``merge_summary`` joins them into one
``tokens.json`` that lists every chunk's split directories as streams, so nothing is copied and
``vlm_assets.data.token_stream`` reads them as one dataset.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from vlm_assets.data.token_checks import SPLITS

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TEXT_SUFFIXES = (".txt",)


def list_chunks(source_dir: str | Path, pattern: str) -> list[str]:
    """The chunk keys under ``source_dir`` matching ``pattern`` (a glob, ``**`` allowed), sorted."""
    root = Path(source_dir)
    if not root.is_dir():
        raise ValueError(f"chunk source '{root}' is not a directory")
    keys = sorted(
        path.relative_to(root).as_posix()
        for path in root.glob(pattern)
        if path.is_file() and path.name.endswith(JSONL_SUFFIXES + TEXT_SUFFIXES)
    )
    if not keys:
        raise ValueError(
            f"chunk source '{root}' has no file matching '{pattern}' "
            f"(a chunk ends in one of {', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)})"
        )
    return keys


def chunk_path(source_dir: str | Path, key: str) -> Path:
    """The file a chunk key names under ``source_dir``; a ``ValueError`` naming the key if there is none."""
    relative = PurePosixPath(key)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"partition key '{key}' is not a path inside the chunk source '{source_dir}'")
    path = Path(source_dir) / relative
    if not path.is_file():
        raise ValueError(f"partition key '{key}' names no chunk: {path} does not exist")
    if not path.name.endswith(JSONL_SUFFIXES + TEXT_SUFFIXES):
        raise ValueError(f"partition key '{key}': {path} is neither JSON lines nor text")
    return path


def content_version(path: Path) -> str:
    """The chunk's content version: the SHA-256 of its bytes (a rewritten chunk is a new version)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def chunk_documents(path: Path, text_column: str = "text") -> Iterator[str]:
    """The documents of one chunk, in file order; a ``ValueError`` names the file and line of bad input."""
    if path.name.endswith(TEXT_SUFFIXES):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from err
        yield from (p.strip() for p in text.split("\n\n") if p.strip())
        return
    for number, line in enumerate(_jsonl_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or text_column not in row:
            columns = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{number}: no text column '{text_column}' (has {columns})")
        if not isinstance(row[text_column], str):
            raise ValueError(f"{path}:{number}: column '{text_column}' is {type(row[text_column]).__name__}, not text")
        text = row[text_column]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate escaped in the JSON ("\ud800")
            raise ValueError(f"{path}:{number}: column '{text_column}' is not valid Unicode ({err.reason})") from None
        if text.strip():
            yield text


def _jsonl_lines(path: Path) -> Iterator[str]:
    raw = _decompressed(path)
    try:
        yield from io.StringIO(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 ({err.reason})") from None


def _decompressed(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.name.endswith(".zst"):
        # python-zstd (a dependency of mosaicml-streaming already) decompresses whole buffers only; a
        # chunk is sized to fit in memory, as SlimPajama's (tens of MB) are.
        import zstd

        try:
            return zstd.decompress(raw)
        except zstd.Error as err:
            raise ValueError(f"{path}: not a valid zstd file ({err})") from None
    if path.name.endswith(".gz"):
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: not a valid gzip file ({err})") from None
    return raw


def merge_summary(
    chunks: Mapping[str, tuple[str, Mapping[str, Any]]], configs: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """One ``tokens.json`` for the chunks ``{key: (artifact uri, its tokens.json)}``, in key order.

    The splits' counts are the chunks' sums; ``streams`` lists, per split, the directories of the
    chunks that hold samples of it. Every chunk must share the tokenizer, vocabulary and block length,
    and ``configs`` (each chunk's identity config, when given) must agree: a chunk split with another
    seed or fraction could hold in train a document another holds in val.
    """
    if not chunks:
        raise ValueError("no chunk to merge")
    keys = sorted(chunks)
    first = chunks[keys[0]][1]
    shared = ("tokenizer", "vocab_size", "eos_token_id", "max_length")
    for key in keys:
        summary = chunks[key][1]
        differing = [f for f in shared if summary.get(f) != first.get(f)]
        if configs is not None:
            differing += sorted(
                f for f in {*configs[key], *configs[keys[0]]} if configs[key].get(f) != configs[keys[0]].get(f)
            )
        if differing:
            raise ValueError(
                f"chunk '{key}' differs from '{keys[0]}' in {', '.join(dict.fromkeys(differing))}: "
                "rebuild the chunks with one config"
            )
    merged: dict[str, Any] = {f: first[f] for f in shared} | {"columns": first["columns"], "partitions": len(keys)}
    merged["splits"], merged["streams"] = {}, {}
    for split in SPLITS:
        holding = [k for k in keys if chunks[k][1]["splits"][split]["num_samples"] > 0]
        if not holding:
            raise ValueError(f"no chunk holds a {split} sample: the corpus is too small to merge")
        merged["streams"][split] = [f"{chunks[k][0].rstrip('/')}/{split}" for k in holding]
        merged["splits"][split] = {
            stat: sum(chunks[k][1]["splits"][split].get(stat, 0) for k in keys)
            for stat in ("num_samples", "num_shards", "num_tokens", "num_padding")
        }
    return merged


def merge_scans(scans: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> dict[str, Any]:
    """The token checks' scan of the merged dataset, from the chunks' own scans (no shard is read again)."""
    splits = {}
    for split in SPLITS:
        parts = [s["splits"][split] for s in scans]
        errors = [p["error"] for p in parts if p["error"]]
        splits[split] = {
            "num_samples": sum(p["num_samples"] for p in parts),
            "num_tokens": sum(p["num_tokens"] for p in parts),
            "min_id": min(p["min_id"] for p in parts),
            "max_id": max(p["max_id"] for p in parts),
            "lengths": sorted({n for p in parts for n in p["lengths"]}),
            "error": errors[0] if errors else None,
            "reported": summary["splits"][split],
            **({} if errors else {"num_shards": sum(p.get("num_shards", 0) for p in parts)}),
        }
    return {"vocab_size": summary["vocab_size"], "max_length": summary["max_length"], "splits": splits}
