"""Token shards: tokens/s tokenized + written against per-document tokenization; tokens/s read back.

    python bench/bench_tokens.py

Corpus: the 42 Shakespeare works (5 MB) with the real GPT-2 BPE, once (x1) and four times (x4: the
fixed costs amortized, as at seed scale). Baseline: one ``tokenizer(doc)`` call per document (the
seed's ``map`` without batching), same packing and MDS writer; then the HF fast tokenizer batched
(the previous ``pack_blocks``), then ``pack_blocks`` as shipped (tiktoken with the tokenizer's GPT-2
ranks, same ids, batches encoded in one forked process per core). Each method's blocks are listed
first, then written, so the columns separate the two. Read: the train split through
``StreamingDataset`` + ``DataLoader`` (batch 32) with 0 and 2 workers.
"""

import argparse
import gc
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
            block = np.asarray(buffer[:MAX_LENGTH], np.int32)
            yield block, block  # (input_ids, labels), as pack_blocks yields them
            buffer = buffer[MAX_LENGTH:]


def hf_batched_blocks(tokenizer, docs, batch=512):
    buffer = []
    for i in range(0, len(docs), batch):
        for ids in tokenizer(docs[i : i + batch], add_special_tokens=False)["input_ids"]:
            buffer.extend(ids + [tokenizer.eos_token_id])
        while len(buffer) >= MAX_LENGTH:
            block = np.asarray(buffer[:MAX_LENGTH], np.int32)
            yield block, block  # (input_ids, labels), as pack_blocks yields them
            buffer = buffer[MAX_LENGTH:]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    data = offline_data_dir()
    tokenizer = load_gpt2_tokenizer(str(data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(data / "shakespeare" / "*.txt")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for copies in (1, 4):
            corpus = docs * copies
            for i, (name, blocks) in enumerate(
                (
                    ("per-document HF tokenize (seed)", per_document_blocks(tokenizer, corpus)),
                    ("batched HF fast tokenizer", hf_batched_blocks(tokenizer, corpus)),
                    (
                        "pack_blocks: tiktoken, GPT-2 ranks, 1 process per core",
                        pack_blocks(tokenizer, corpus, MAX_LENGTH, None),
                    ),
                )
            ):
                out = Path(tmp) / f"run{copies}-{i}"
                gc.collect()
                t = time.perf_counter()
                blocks = list(blocks)
                tokenize = time.perf_counter() - t
                stats = write_split(out / "train", iter(blocks), "64mb", desc=name)
                rows.append((copies, name, stats["num_samples"] * MAX_LENGTH, tokenize, time.perf_counter() - t))
                del blocks
        (out / "tokens.json").write_text(f'{{"max_length": {MAX_LENGTH}, "vocab_size": {len(tokenizer)}}}')
        (out / "val").symlink_to(out / "train")
        reads = []
        for workers in (0, 2):
            loaders = build_token_dataloaders(
                str(out), Path(tmp) / f"cache{workers}", batch_size=32, num_workers=workers
            )
            t = time.perf_counter()
            tokens = sum(batch["input_ids"].numel() for batch in loaders.train)
            reads.append((workers, tokens, time.perf_counter() - t))
            del loaders
    print(f"\nToken shards: {len(docs):,} Shakespeare paragraphs (x1, x4), GPT-2 BPE, blocks of {MAX_LENGTH}\n")
    print("| corpus | method | tokens | tokenize + pack s | speed-up | + MDS write, total s | tokens/s | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for copies, name, tokens, tokenize, total in rows:
        base = next(r for r in rows if r[0] == copies)
        print(
            f"| x{copies} | {name} | {tokens:,} | {tokenize:.2f} | {base[3] / tokenize:.1f}x | {total:.2f} "
            f"| {tokens / total / 1e6:.2f} M | {base[4] / total:.1f}x |"
        )
    print("\n| read back (StreamingDataset + DataLoader, batch 32) | tokens | seconds | tokens/s |")
    print("|---|---:|---:|---:|")
    for workers, tokens, seconds in reads:
        print(f"| num_workers={workers} | {tokens:,} | {seconds:.2f} | {tokens / seconds / 1e6:.1f} M |")


if __name__ == "__main__":
    main()
