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
from vlm_assets.data.tokens import IGNORE_INDEX


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
    assert len(expected) % 4 != 0  # so the last block is padded
    blocks = list(pack_blocks(tokenizer, docs, max_length=4, max_samples=None))
    ids, labels = np.concatenate([i for i, _ in blocks]), np.concatenate([lab for _, lab in blocks])
    assert all(i.dtype == lab.dtype == np.int32 and len(i) == len(lab) == 4 for i, lab in blocks)
    assert len(blocks) == -(-len(expected) // 4)
    # every token of every document, in order; the padding is EOS in the inputs and ignored in the labels
    assert ids[: len(expected)].tolist() == labels[: len(expected)].tolist() == expected
    assert set(ids[len(expected) :]) == {tokenizer.eos_token_id} and set(labels[len(expected) :]) == {IGNORE_INDEX}
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
    expected = np.stack([ids for ids, _ in pack_blocks(tokenizer, train, 64, None)])
    loaders = build_token_dataloaders(str(tmp_path / "art"), tmp_path / "cache", batch_size=8)
    assert loaders.max_length == 64 and loaders.vocab_size == 50257
    seen = []
    for batch in loaders.train:
        assert batch["input_ids"].dtype == torch.int64
        padded = batch["labels"] == IGNORE_INDEX  # the last block's tail only
        assert torch.equal(batch["input_ids"][~padded], batch["labels"][~padded])
        assert padded.sum() < 64 and (batch["input_ids"][padded] == tokenizer.eos_token_id).all()
        seen.append(batch["input_ids"].numpy().copy())
        batch["input_ids"][0, 0] = -1  # collate copied: the arrays are writable and not streaming's
    seen = np.concatenate(seen)
    # shuffled for training: the same multiset of blocks, every token exactly once
    assert len(seen) == len(expected)
    assert sorted(map(bytes, seen.astype(np.int32))) == sorted(map(bytes, expected))
    assert sum(len(b["input_ids"]) for b in loaders.val) == 50


def test_val_split_is_a_stable_hash_of_each_document(shakespeare):
    docs = list(paragraphs_of_files(shakespeare))
    train, val = split_documents(docs, 0.05, seed=1)
    assert 0.03 < len(val) / len(docs) < 0.07 and len(train) + len(val) == len(docs)
    # a document's split does not depend on what else is read with it (so chunks split alone) ...
    held_out = set(val)
    assert split_documents(docs[::3], 0.05, seed=1)[1] == [d for d in docs[::3] if d in held_out]
    # ... but on the seed
    assert split_documents(docs, 0.05, seed=2)[1] != val


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
