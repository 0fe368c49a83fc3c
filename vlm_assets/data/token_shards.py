"""Token shards: a corpus tokenized with GPT-2 BPE, joined with EOS into fixed-length blocks, as MDS.

Artifact layout::

    tokens.json                 tokenizer, vocab size, EOS id, block length, sample/token counts
    tokenizer/                  the tokenizer itself (``from_pretrained``-loadable)
    train/ index.json shard.*.mds
    val/   index.json shard.*.mds

Each sample has ``input_ids`` and ``labels`` (``ndarray:int32``, ``max_length`` tokens; labels equal
the inputs, the model shifts them). Documents are tokenized in batches with tiktoken
running the tokenizer's own GPT-2 ranks (ids identical to the HF tokenizer; ``_tiktoken_encoding``),
one forked process per core (``encoded_batches``), and packed through one running buffer, so no
document is lost between blocks; only the last block is padded (EOS, its padded labels ``-100``, which
the loss ignores), so every document of the corpus is in the shards, whole.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vlm_assets._streaming import MDSWriter
from vlm_assets.data.tokens import IGNORE_INDEX
from vlm_assets.progress import report_progress

COLUMNS = {"input_ids": "ndarray:int32", "labels": "ndarray:int32"}
_TOKENIZE_BATCH = 2048


def load_gpt2_tokenizer(name_or_path: str):
    """GPT-2 BPE from a hub id (``gpt2``) or a local directory with ``vocab.json`` + ``merges.txt``."""
    from transformers import GPT2Tokenizer

    try:
        tokenizer = GPT2Tokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"tokenizer '{name_or_path}' cannot be loaded: {err}") from err
    if tokenizer.eos_token_id is None or len(tokenizer) == 0:
        raise ValueError(f"tokenizer '{name_or_path}' loaded without a vocabulary or EOS token")
    tokenizer.model_max_length = 1 << 30  # we chunk ourselves; silence the 1024-token warning
    return tokenizer


def _byte_decoder() -> dict[int, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` as a ``str.translate`` table: stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return dict(zip([*printable, *range(256, 256 + len(others))], [*printable, *others]))


def gpt2_batch_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """Return a batch encoder giving the HF GPT-2 tokenizer's ids.

    It goes through tiktoken when it can (``_tiktoken_encoding``), else the HF fast tokenizer (batched).
    """
    return _batch_encoder(tokenizer, _tiktoken_encoding(tokenizer))


def _batch_encoder(tokenizer, encoding) -> Callable[[list[str]], list[list[int]]]:
    if encoding is None:
        return lambda docs: tokenizer(docs, add_special_tokens=False)["input_ids"]
    # Like the HF tokenizer, a special token's text inside a document becomes that token. A plain
    # loop: tiktoken's ``encode_batch`` thread pool measured 4x slower than this on 2 cores.
    return lambda docs: [encoding.encode(doc, allowed_special="all") for doc in docs]


def _tiktoken_encoding(tokenizer):
    """tiktoken running the tokenizer's own GPT-2 ranks, or None when it cannot give the same ids.

    tiktoken's BPE applies merges in the order of the token ids; that equals the tokenizer's merge
    order for GPT-2 (merge i makes token 256 + i), which is checked here on the tokenizer's own merges.
    The ranks are converted here from the loaded tokenizer: tiktoken's own loader for these files
    (``data_gym_to_mergeable_bpe_ranks``) caches them in /tmp keyed by path alone, so an edited file
    at the same path would be read stale.
    """
    try:
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's regex, possessive (faster)
    except ImportError:
        return None
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab, merges = tokenizer.get_vocab(), model.get("merges") or []
    merged_ids = [vocab.get("".join(m) if isinstance(m, list) else m.replace(" ", "", 1)) for m in merges]
    if model.get("type") != "BPE" or None in merged_ids or merged_ids != sorted(merged_ids):
        return None
    decoder = _byte_decoder()
    special = {t: vocab[t] for t in tokenizer.all_special_tokens if t in vocab}
    try:
        ranks = {tok.translate(decoder).encode("latin-1"): i for tok, i in vocab.items() if tok not in special}
    except UnicodeEncodeError:  # a character outside the byte alphabet: not byte-level BPE
        return None
    return tiktoken.Encoding(f"hf-{len(vocab)}", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)


# The encoder of the worker processes of ``encoded_batches``: set before they are forked, inherited.
_WORKER_ENCODER: tuple[Callable[[list[str]], list[list[int]]], int] | None = None


def _worker_signals() -> None:
    """A worker ends quietly if it is sent SIGTERM, not through the handler it inherited from its parent
    (Dagster's raises an interrupt and prints it); Ctrl-C is the parent's to handle. A parent killed
    outright leaves them EOF on the task queue."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_flat(docs: list[str]) -> np.ndarray:
    """``doc EOS doc EOS ...`` of one batch as int32 (runs in a worker: arrays pickle cheaply, lists do not)."""
    assert _WORKER_ENCODER is not None
    encode, eos = _WORKER_ENCODER
    return np.array(list(itertools.chain.from_iterable(ids + [eos] for ids in encode(docs))), np.int32)


def encoded_batches(tokenizer, documents: Iterable[str], workers: int | None = None) -> Iterator[np.ndarray]:
    """Token ids of ``documents``, each followed by EOS, one int32 array per batch of documents, in order.

    tiktoken encodes one document at a time under the GIL's control (threads measured 1.2x on 2
    cores), so batches go to ``workers`` forked processes (default: one per core), at most two
    batches each in flight so a large corpus is never read ahead whole.
    """
    global _WORKER_ENCODER
    encoding = _tiktoken_encoding(tokenizer)
    workers = (os.cpu_count() or 1) if workers is None else workers
    docs = iter(documents)
    batches = iter(lambda: list(itertools.islice(docs, _TOKENIZE_BATCH)), [])
    _WORKER_ENCODER = (_batch_encoder(tokenizer, encoding), tokenizer.eos_token_id)
    if encoding is None or workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(_encode_flat, batches)  # the HF tokenizer's batches are already parallel
        return
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_signals)
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_flat, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        # close + join (the few batches in flight finish), not the context manager's terminate: a worker
        # SIGTERMed while it holds the result queue's lock leaves that lock taken, and terminate then
        # waits for it for ever (CPython's Pool; it hung a CI run once, when max_samples ended a read).
        pool.close()
        pool.join()


def paragraphs_of_files(pattern: str) -> Iterator[str]:
    """Documents of local text files: paragraphs (separated by blank lines), files in sorted order."""
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"text corpus '{pattern}' matches no files")
    found = False
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from err
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                found = True
                yield paragraph.strip()
    if not found:
        raise ValueError(f"text corpus '{pattern}': {len(files)} file(s), all empty")


def hf_documents(dataset: str, config: str | None, split: str, column: str) -> Iterator[str]:
    """Non-empty rows of a Hugging Face dataset split (wikitext: one paragraph or heading per row)."""
    import datasets

    try:
        rows = datasets.load_dataset(dataset, config, split=split, streaming=True)
    except Exception as err:  # datasets raises many types (hub, network, config): name the source
        raise ValueError(f"dataset '{dataset}' ({config}, split '{split}') cannot be loaded: {err}") from err
    for i, row in enumerate(rows):
        if column not in row:
            raise ValueError(f"dataset '{dataset}' row {i} has no column '{column}' (columns: {sorted(row)})")
        if row[column].strip():
            yield row[column]


def is_val(document: str, val_fraction: float, seed: int) -> bool:
    """Whether ``document`` is held out for validation.

    A stable hash of its text, keyed by ``seed``, falls below ``val_fraction``: a document's split is the
    same wherever and with whatever else it is read (a chunk of a corpus splits alone)."""
    digest = hashlib.blake2b(document.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") < val_fraction * (1 << 64)


def split_documents(documents: Iterable[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """The documents as (train, val), each document's split decided by ``is_val``."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train: list[str] = []
    val: list[str] = []
    for doc in documents:
        (val if is_val(doc, val_fraction, seed) else train).append(doc)
    return train, val


def pack_blocks(
    tokenizer, documents: Iterable[str], max_length: int, max_samples: int | None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(input_ids, labels)`` int32 blocks of ``max_length`` tokens of ``doc EOS doc EOS ...``.

    The last, partial block is padded with EOS whose labels are ``IGNORE_INDEX``."""
    buffer = np.empty(0, np.int32)
    emitted = 0
    for flat in encoded_batches(tokenizer, documents):
        buffer = np.concatenate([buffer, flat])
        num_blocks = len(buffer) // max_length
        for i in range(num_blocks):
            if max_samples is not None and emitted >= max_samples:
                return
            emitted += 1
            block = buffer[i * max_length : (i + 1) * max_length]
            yield block, block
        buffer = buffer[num_blocks * max_length :]
    if len(buffer) and (max_samples is None or emitted < max_samples):
        padding = max_length - len(buffer)
        ids = np.concatenate([buffer, np.full(padding, tokenizer.eos_token_id, np.int32)])
        yield ids, np.concatenate([buffer, np.full(padding, IGNORE_INDEX, np.int32)])


def write_split(
    out_dir: Path,
    blocks: Iterable[tuple[np.ndarray, np.ndarray]],
    size_limit: int | str,
    desc: str,
    log: Callable[[str], None] | None = None,
    allow_empty: bool = False,
) -> dict[str, int]:
    """Write ``(input_ids, labels)`` blocks as one MDS split; return its sample, shard and padding counts.

    Fewer tokens than one block is an error unless ``allow_empty`` (a chunk of a larger corpus)."""
    num_samples = full = padding = 0
    with MDSWriter(out=str(out_dir), columns=COLUMNS, size_limit=size_limit) as writer:
        for ids, labels in report_progress(blocks, desc, log, unit="blocks"):
            writer.write({"input_ids": ids, "labels": labels})
            num_samples += 1
            full += int(labels[-1] != IGNORE_INDEX)
            padding += int((labels == IGNORE_INDEX).sum())
    if full == 0 and not allow_empty:
        raise ValueError(f"{desc}: the corpus is too short for one block of the requested length")
    num_shards = len(json.loads((out_dir / "index.json").read_text())["shards"])
    return {"num_samples": num_samples, "num_shards": num_shards, "num_padding": padding}


def write_token_shards(
    out_dir: Path,
    tokenizer,
    tokenizer_name: str,
    train_docs: Iterable[str],
    val_docs: Iterable[str],
    *,
    max_length: int,
    max_train_samples: int | None,
    max_val_samples: int | None,
    size_limit: int | str,
    log: Callable[[str], None] | None = None,
    chunk: bool = False,
) -> dict[str, Any]:
    """Tokenize, pack and write both splits into ``out_dir``; return the ``tokens.json`` summary.

    ``chunk``: one chunk of a larger corpus (``vlm_assets.data.token_chunks``): a split without documents is
    written empty, not refused, and the tokenizer is left to the merge.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    summary: dict[str, Any] = {
        "tokenizer": tokenizer_name,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "max_length": max_length,
        "columns": COLUMNS,
        "splits": {},
    }
    for split, docs, limit in (("train", train_docs, max_train_samples), ("val", val_docs, max_val_samples)):
        stats = write_split(
            out_dir / split,
            pack_blocks(tokenizer, docs, max_length, limit),
            size_limit,
            desc=f"{split} shards",
            log=log,
            allow_empty=chunk,
        )
        summary["splits"][split] = {**stats, "num_tokens": stats["num_samples"] * max_length}
    if not chunk:
        tokenizer.save_pretrained(out_dir / "tokenizer")
    (out_dir / "tokens.json").write_text(json.dumps(summary, indent=1))
    return summary
