"""``token_shards``: a GPT-2-tokenized corpus packed into fixed-length blocks as MDS shards, and its checks."""

from typing import Literal, Self

import dagster as dg
from pydantic import Field, model_validator

from vlm_assets.defs.platform.checks import Judged
from vlm_assets.defs.platform.memo import AssetConfig, Built, Step, memoized_asset


class TokenShardsConfig(AssetConfig):
    profile_key = "token_shards"

    source: Literal["hf", "text_files"] = Field(
        default="hf", description="A Hugging Face dataset (hf_* fields) or local text files (text_glob)."
    )
    hf_dataset: str = Field(default="wikitext", description="Hugging Face dataset id.")
    hf_config: str | None = Field(default="wikitext-103-raw-v1", description="Dataset config name.")
    hf_train_split: str = Field(default="train", description="Split read for training shards.")
    hf_val_split: str = Field(default="validation", description="Split read for validation shards.")
    text_column: str = Field(default="text", description="Column holding the text.")
    text_glob: str | None = Field(
        default=None, description="text_files: glob of UTF-8 files (** allowed); paragraphs are documents."
    )
    val_fraction: float = Field(
        default=0.05, gt=0, lt=1, description="text_files: share of documents held out for val (seeded)."
    )
    tokenizer: str = Field(
        default="gpt2", description="GPT-2 BPE: hub id or local directory (vocab.json + merges.txt)."
    )
    max_length: int = Field(default=1024, ge=2, description="Tokens per block (sample); documents are joined with EOS.")
    max_train_samples: int | None = Field(default=None, ge=1, description="Cap on train blocks; unset = all.")
    max_val_samples: int | None = Field(default=None, ge=1, description="Cap on val blocks; unset = all.")
    shard_size_limit: str = Field(default="64mb", description="MDS shard size limit (bytes or '64mb').")
    seed: int = Field(default=0, description="Seeds the text_files train/val split.")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.source == "text_files" and not self.text_glob:
            raise ValueError("text_glob is required when source is 'text_files'")
        return self


def token_ids_within_vocab(judged: Judged) -> dg.AssetCheckResult:
    """Every token id of every sample is in [0, vocab_size)."""
    from vlm_assets.data import token_checks

    return judged.outcome(token_checks.scan, token_checks.ids_within_vocab)


def token_counts_match_summary(judged: Judged) -> dg.AssetCheckResult:
    """Sample and token counts (and block lengths) in the shards equal what tokens.json reports."""
    from vlm_assets.data import token_checks

    return judged.outcome(token_checks.scan, token_checks.counts_match)


def every_shard_readable(judged: Judged) -> dg.AssetCheckResult:
    """Every MDS shard of both splits opens and every sample decodes."""
    from vlm_assets.data import token_checks

    return judged.outcome(token_checks.scan, token_checks.shards_readable)


def build_shards(step: Step) -> Built:
    from vlm_assets.data import token_checks
    from vlm_assets.data.token_shards import (
        hf_documents,
        load_gpt2_tokenizer,
        paragraphs_of_files,
        split_documents,
        write_token_shards,
    )

    config = step.config
    if config.source == "text_files":
        train_docs, val_docs = split_documents(paragraphs_of_files(config.text_glob), config.val_fraction, config.seed)
    else:
        train_docs = hf_documents(config.hf_dataset, config.hf_config, config.hf_train_split, config.text_column)
        val_docs = hf_documents(config.hf_dataset, config.hf_config, config.hf_val_split, config.text_column)
    summary = write_token_shards(
        step.staging,
        load_gpt2_tokenizer(config.tokenizer),
        config.tokenizer,
        train_docs,
        val_docs,
        max_length=config.max_length,
        max_train_samples=config.max_train_samples,
        max_val_samples=config.max_val_samples,
        size_limit=config.shard_size_limit,
        log=step.context.log.info,
    )
    return Built(
        scan=token_checks.scan(step.staging),
        metrics={f"{split}_{k}": v for split, stats in summary["splits"].items() for k, v in stats.items()},
        metadata={"vocab_size": summary["vocab_size"], "max_length": summary["max_length"]},
    )


token_shards = memoized_asset(
    "token_shards",
    description="""A text corpus tokenized with GPT-2 BPE, documents joined with EOS into blocks of
    ``max_length`` tokens (no padding), written as MosaicML MDS shards (``train/``, ``val/``; columns
    ``input_ids`` and ``labels`` as int32) plus the tokenizer. Stream it back with
    ``vlm_assets.data.token_stream.build_token_dataloaders``.""",
    config_type=TokenShardsConfig,
    build=build_shards,
    checks=(token_ids_within_vocab, token_counts_match_summary, every_shard_readable),
    kinds={"python", "mosaicml"},
    group_name="data",
)
