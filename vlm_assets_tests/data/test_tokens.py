import json

import numpy as np
import pytest
import torch

from vlm_assets.data import token_checks
from vlm_assets.data.token_shards import (
    gpt2_batch_encoder,
    load_gpt2_tokenizer,
    pack_blocks,
    paragraphs_of_files,
    split_documents,
    write_token_shards,
)
from vlm_assets.data.token_stream import build_token_dataloaders


@pytest.fixture(scope="module")
def tokenizer(offline_data):
    return load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))


@pytest.fixture(scope="module")
def shakespeare(offline_data):
    return str(offline_data / "shakespeare" / "*.txt")


def test_tokenizer_is_real_gpt2_bpe(tokenizer):
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_fast_encoder_gives_the_hf_ids_on_the_whole_shakespeare_corpus(tokenizer, shakespeare):
    docs = list(paragraphs_of_files(shakespeare))
    docs += ["  spaces\t\tand tabs\n\n", "naïve café — 東京 🙂", "<|endoftext|> is text here", "it's we'll 1234"]
    fast = gpt2_batch_encoder(tokenizer)
    assert fast.__module__ != __name__ and "hf_batch" not in fast.__qualname__  # tiktoken, not the fallback
    assert fast(docs) == tokenizer(docs, add_special_tokens=False)["input_ids"]
    assert sum(map(len, fast(docs[:-4]))) > 1_400_000  # 38,920 paragraphs, ~1.49M tokens


def test_blocks_are_documents_joined_with_eos(tokenizer):
    docs = ["To be, or not to be", "that is the question", "Whether 'tis nobler"]
    expected = []
    for d in docs:
        expected += tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]
    blocks = list(pack_blocks(tokenizer, docs, max_length=4, max_samples=None))
    assert all(b.dtype == np.int32 and len(b) == 4 for b in blocks)
    assert np.concatenate(blocks).tolist() == expected[: len(blocks) * 4]
    assert len(blocks) == len(expected) // 4
    assert len(list(pack_blocks(tokenizer, docs, max_length=4, max_samples=2))) == 2


def test_streaming_reads_back_exactly_the_tokens_written(tokenizer, shakespeare, tmp_path):
    train, val = split_documents(paragraphs_of_files(shakespeare), 0.05, seed=0)
    train = train[:3000]
    summary = write_token_shards(
        tmp_path / "art",
        tokenizer,
        "gpt2",
        train,
        val,
        max_length=64,
        max_train_samples=None,
        max_val_samples=50,
        size_limit=1 << 16,
    )
    assert summary["splits"]["train"]["num_shards"] > 1  # the size limit really splits shards
    assert summary["splits"]["val"]["num_samples"] == 50
    expected = np.stack(list(pack_blocks(tokenizer, train, 64, None)))
    loaders = build_token_dataloaders(str(tmp_path / "art"), tmp_path / "cache", batch_size=8)
    assert loaders.max_length == 64 and loaders.vocab_size == 50257
    seen = []
    for batch in loaders.train:
        assert batch["input_ids"].dtype == torch.int64
        assert torch.equal(batch["input_ids"], batch["labels"])
        batch["input_ids"][0, 0] = -1  # collate copied: the arrays are writable and not streaming's
        seen.append(batch["labels"].numpy())
    seen = np.concatenate(seen)
    # shuffled for training: the same multiset of blocks, every token exactly once
    assert len(seen) == len(expected)
    assert sorted(map(bytes, seen.astype(np.int32))) == sorted(map(bytes, expected))
    assert sum(len(b["input_ids"]) for b in loaders.val) == 50


def test_val_split_is_seeded(shakespeare):
    a = split_documents(paragraphs_of_files(shakespeare), 0.05, seed=1)
    b = split_documents(paragraphs_of_files(shakespeare), 0.05, seed=1)
    assert a == b and 0.03 < len(a[1]) / (len(a[0]) + len(a[1])) < 0.07


def test_empty_corpus_and_bad_tokenizer_are_named(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match=r"text corpus '.*\*.txt': 1 file\(s\), all empty"):
        list(paragraphs_of_files(str(tmp_path / "*.txt")))
    with pytest.raises(ValueError, match=r"text corpus '.*nothing/\*.md' matches no files"):
        list(paragraphs_of_files(str(tmp_path / "nothing" / "*.md")))
    with pytest.raises(ValueError, match=r"tokenizer '.*no-such-tokenizer' cannot be loaded"):
        load_gpt2_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_checks_catch_bad_shards(tokenizer, shakespeare, tmp_path):
    train, val = split_documents(paragraphs_of_files(shakespeare), 0.05, seed=0)
    root = tmp_path / "art"
    write_token_shards(
        root,
        tokenizer,
        "gpt2",
        train[:500],
        val,
        max_length=32,
        max_train_samples=None,
        max_val_samples=20,
        size_limit=1 << 14,
    )
    scanned = token_checks.scan(root)
    assert json.loads(json.dumps(scanned)) == scanned  # committed in the manifest as JSON
    assert token_checks.ids_within_vocab(scanned).passed
    assert token_checks.counts_match(scanned).passed and token_checks.shards_readable(scanned).passed

    summary = json.loads((root / "tokens.json").read_text())
    summary["vocab_size"] = 1000  # claims a vocabulary the shards exceed
    summary["splits"]["val"]["num_samples"] += 1
    (root / "tokens.json").write_text(json.dumps(summary))
    outcome = token_checks.ids_within_vocab(token_checks.scan(root))
    assert not outcome.passed and "outside [0, 1000)" in outcome.description
    outcome = token_checks.counts_match(token_checks.scan(root))
    assert not outcome.passed and "val: shards hold 20 samples" in outcome.description

    shard = sorted((root / "train").glob("shard.*.mds"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    outcome = token_checks.shards_readable(token_checks.scan(root))
    assert not outcome.passed and f"{shard.name}: unreadable shard" in outcome.description
