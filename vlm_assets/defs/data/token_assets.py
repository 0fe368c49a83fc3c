"""``token_shards``: a GPT-2-tokenized corpus packed into fixed-length blocks as MDS shards, and its checks;
``token_chunks``: a large corpus tokenized one source file per partition, by backfills, for ``token_shards``
to merge."""

import hashlib
import inspect
import json
import warnings
from collections.abc import Iterator
from typing import Any, Literal, Self

import dagster as dg
from pydantic import Field, model_validator

from vlm_assets.defs.platform.checks import Judged
from vlm_assets.defs.platform.environment import chunks_per_run
from vlm_assets.defs.platform.memo import (
    BUILD_RETRY,
    AssetConfig,
    Built,
    Step,
    artifact_key,
    bad_input_fails_fast,
    memoized_asset,
    memoized_partition,
)
from vlm_assets.storage import ArtifactNotFoundError, ArtifactRef, ArtifactStore
from vlm_assets.train.run_config import run_field

# One partition per source file, added as files are found (``token_chunk_sensor``, or by hand).
CHUNKS = dg.DynamicPartitionsDefinition(name="token_chunks")


class TokenShardsConfig(AssetConfig):
    """Config of the ``token_shards`` asset."""

    profile_key = "token_shards"

    source: Literal["hf", "text_files", "chunks"] = Field(
        default="hf",
        description="A Hugging Face dataset (hf_* fields), local text files (text_glob), or every partition "
        "of token_chunks, merged (their tokenizer and block length).",
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
    """Build the ``token_shards`` artifact: tokenize the configured corpus, or merge the ``token_chunks`` partitions."""
    from vlm_assets.data import token_checks
    from vlm_assets.data.token_shards import (
        hf_documents,
        load_gpt2_tokenizer,
        paragraphs_of_files,
        split_documents,
        write_token_shards,
    )

    config = step.config
    if config.source == "chunks":
        return merge_chunks(step)
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
        metrics=split_metrics(summary),
        metadata={"vocab_size": summary["vocab_size"], "max_length": summary["max_length"], "partitions": 1},
    )


def split_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A ``tokens.json`` summary's per-split counts as flat metrics (``train_num_samples``, ...)."""
    return {f"{split}_{k}": v for split, stats in summary["splits"].items() for k, v in stats.items()}


def merge_chunks(step: Step) -> Built:
    """Build ``token_shards`` from every ``token_chunks`` partition, copying no shard.

    One ``tokens.json`` lists the chunks' splits as streams, beside the tokenizer; the checks judge the
    chunks' recorded scans, combined."""
    from vlm_assets.data.token_chunks import merge_scans, merge_summary
    from vlm_assets.data.token_shards import load_gpt2_tokenizer

    chunks = {
        name[len("token_chunks[") : -1]: ref for name, ref in step.upstream.items() if name.startswith("token_chunks[")
    }
    summary = merge_summary(
        {k: (ref.uri, ref.metadata["metadata"]["tokens"]) for k, ref in chunks.items()},
        {k: ref.metadata["config"] for k, ref in chunks.items()},
    )
    load_gpt2_tokenizer(summary["tokenizer"]).save_pretrained(step.staging / "tokenizer")
    (step.staging / "tokens.json").write_text(json.dumps(summary, indent=1))
    step.context.log.info(f"merged {len(chunks)} token_chunks partitions: {summary['splits']}")
    return Built(
        scan=merge_scans([chunks[k].metadata["scan"] for k in sorted(chunks)], summary),
        metrics=split_metrics(summary),
        metadata={k: summary[k] for k in ("vocab_size", "max_length", "partitions")},
    )


def chunk_artifacts(context: dg.AssetExecutionContext, config: Any, store: ArtifactStore) -> dict[str, ArtifactRef]:
    """Return the artifact of every ``token_chunks`` partition as ``token_chunks[<key>]`` (``source: chunks``).

    Each is its partition's latest materialization's; a partition without one fails the step, naming it."""
    if config.source != "chunks":
        return {}
    keys = context.instance.get_dynamic_partitions(CHUNKS.name)
    if not keys:
        raise ValueError(
            "token_shards reads token_chunks, which has no partitions: add the source's files "
            "(token_chunk_sensor, or the UI's partitions tab) and backfill token_chunks first"
        )
    wanted, found, cursor = set(keys), {}, None
    while len(found) < len(wanted):
        page = context.instance.fetch_materializations(dg.AssetKey("token_chunks"), limit=1000, cursor=cursor)
        for record in page.records:
            partition = record.partition_key
            if partition in wanted and partition not in found:
                artifacts = record.asset_materialization.metadata.get("artifacts")
                if artifacts is None or partition not in artifacts.value:
                    raise ValueError(
                        f"token_chunks partition '{partition}': its latest materialization (run "
                        f"{record.run_id}) names no artifact: materialize the partition again"
                    )
                found[partition] = artifacts.value[partition]
        if not page.has_more:
            break
        cursor = page.cursor
    missing = [k for k in keys if k not in found]
    if missing:
        raise ValueError(
            f"token_chunks: {len(missing)} of {len(keys)} partitions are not materialized "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): backfill them first"
        )
    refs = {}
    for key in keys:
        try:
            refs[f"token_chunks[{key}]"] = store.ref(found[key])
        except ArtifactNotFoundError:
            raise ValueError(
                f"token_chunks partition '{key}': its artifact {found[key]} is not in this store"
            ) from None
    return refs


token_shards = memoized_asset(
    "token_shards",
    description="""A text corpus tokenized with GPT-2 BPE, documents joined with EOS into blocks of
    ``max_length`` tokens (the last one padded, its padding labelled -100), written as MosaicML MDS
    shards (``train/``, ``val/``; columns ``input_ids`` and ``labels`` as int32) plus the tokenizer; or,
    with ``source: chunks``, every ``token_chunks`` partition listed as one dataset. Stream it back
    with ``vlm_assets.data.token_stream.build_token_dataloaders``.""",
    config_type=TokenShardsConfig,
    build=build_shards,
    code_version="2",
    checks=(token_ids_within_vocab, token_counts_match_summary, every_shard_readable),
    kinds={"python", "mosaicml"},
    group_name="data",
    deps=[dg.AssetDep("token_chunks", partition_mapping=dg.AllPartitionMapping())],
    resolve=chunk_artifacts,
)


class TokenChunksConfig(AssetConfig):
    """Config of the ``token_chunks`` asset."""

    profile_key = "token_chunks"

    source_dir: str | None = run_field(
        None, "The corpus's directory: each file under it matching `pattern` is a partition, keyed by its path in it."
    )
    pattern: str = run_field("**/*.jsonl.zst", "Glob of the chunk files under source_dir (token_chunk_sensor).")
    text_column: str = Field(default="text", description="JSON lines: the field holding a document's text.")
    tokenizer: str = Field(
        default="gpt2", description="GPT-2 BPE: hub id or local directory (vocab.json + merges.txt)."
    )
    max_length: int = Field(default=1024, ge=2, description="Tokens per block; documents are joined with EOS.")
    val_fraction: float = Field(
        default=0.0005, gt=0, lt=1, description="Share of documents held out for val (a stable hash of each)."
    )
    seed: int = Field(default=0, description="Salts the hash that splits documents into train and val.")
    shard_size_limit: str = Field(default="64mb", description="MDS shard size limit (bytes or '64mb').")

    def check_values(self) -> None:
        """Refuse a config without ``source_dir``."""
        if self.source_dir is None:
            raise ValueError("token_chunks: config field source_dir is not set (the corpus's directory)")


def build_chunk(context: dg.AssetExecutionContext, config: TokenChunksConfig, path, staging) -> Built:
    """Build one ``token_chunks`` partition: tokenize the source file at ``path`` into ``staging``."""
    from vlm_assets.data import token_checks
    from vlm_assets.data.token_chunks import chunk_documents
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, split_documents, write_token_shards

    train, val = split_documents(chunk_documents(path, config.text_column), config.val_fraction, config.seed)
    summary = write_token_shards(
        staging,
        load_gpt2_tokenizer(config.tokenizer),
        config.tokenizer,
        train,
        val,
        max_length=config.max_length,
        max_train_samples=None,
        max_val_samples=None,
        size_limit=config.shard_size_limit,
        log=context.log.info,
        chunk=True,
    )
    return Built(scan=token_checks.scan(staging), metrics=split_metrics(summary), metadata={"tokens": summary})


def _token_chunks(
    context: dg.AssetExecutionContext, config: TokenChunksConfig
) -> Iterator[dg.MaterializeResult | dg.AssetMaterialization]:
    """Build or reuse each partition of the run (memoized per chunk); a bad chunk fails alone."""
    from vlm_assets.data.token_chunks import chunk_path, content_version

    built: dict[str, tuple[ArtifactRef, str]] = {}
    bad: dict[str, str] = {}
    for partition in context.partition_keys:
        try:
            with bad_input_fails_fast():
                config.check_values()
                path = chunk_path(config.source_dir, partition)
                chunk = {"chunk": partition, "content_sha256": content_version(path)}
            key = artifact_key(context, config, {}, chunk)
            built[partition] = memoized_partition(
                context, config, key, lambda staging, run, path=path: build_chunk(context, config, path, staging)
            )
        except dg.Failure as err:  # bad input: not retried, and no reason to fail the run's other chunks
            if err.allow_retries or len(context.partition_keys) == 1:
                raise
            bad[partition] = err.description or str(err)
    if bad:
        # A step's result covers every partition of its run; the good ones are reported one by one
        # instead, so that only the bad chunks are left unmaterialized (and a retry rebuilds only them).
        for partition, (ref, cache) in built.items():
            yield dg.AssetMaterialization(
                asset_key=context.asset_key, partition=partition, metadata=_chunk_metadata({partition: (ref, cache)})
            )
        raise dg.Failure(
            f"{len(bad)} of {len(context.partition_keys)} chunks failed: "
            + "; ".join(f"{key}: {why}" for key, why in bad.items()),
            allow_retries=False,
        )
    versions = "".join(ref.data_version for ref, _ in built.values())
    yield dg.MaterializeResult(
        metadata=_chunk_metadata(built),
        # one result for every partition of the run; each partition's own version is in the store
        data_version=dg.DataVersion(hashlib.sha256(versions.encode()).hexdigest()[:32]),
    )


def _chunk_metadata(built: dict[str, tuple[ArtifactRef, str]]) -> dict[str, Any]:
    """What a run of ``token_chunks`` records: per partition its artifact, cache outcome and token counts
    (``chunk_artifacts`` reads ``artifacts``), and the run's sums."""
    splits = {k: ref.metadata["metadata"]["tokens"]["splits"] for k, (ref, _) in built.items()}
    tokens = {
        k: {s: v[s]["num_tokens"] - v[s].get("num_padding", 0) for s in ("train", "val")} for k, v in splits.items()
    }
    return {
        "artifacts": dg.MetadataValue.json({k: ref.key for k, (ref, _) in built.items()}),
        "cache": dg.MetadataValue.json({k: cache for k, (_, cache) in built.items()}),
        "tokens": dg.MetadataValue.json(tokens),
        **{f"run_{s}_tokens": sum(t[s] for t in tokens.values()) for s in ("train", "val")},
    }


with warnings.catch_warnings():
    # backfill_policy is marked beta; its warning at every load of the definitions would read as trouble
    warnings.simplefilter("ignore", dg.BetaWarning)
    token_chunks = dg.asset(
        name="token_chunks",
        partitions_def=CHUNKS,
        # a backfill runs this many partitions in one run (one pod on Kubernetes): a 60,000-file corpus
        # is 60,000 / N runs, each paying a run's start once
        backfill_policy=dg.BackfillPolicy.multi_run(chunks_per_run()),
        code_version="1",
        retry_policy=BUILD_RETRY,
        required_resource_keys={"artifact_store", "mlflow"},
        kinds={"python", "mosaicml"},
        group_name="data",
        description=inspect.cleandoc(
            """One file of a large corpus (a partition, keyed by its path under ``source_dir``)
        tokenized as ``token_shards`` tokenizes a corpus, into MDS shards under a key of its own: its code
        version, identity config and the file's SHA-256, so a changed or failed chunk rebuilds alone. Built
        by backfills (``VLM_ASSETS_CHUNKS_PER_RUN`` partitions a run); ``token_shards`` with ``source:
        chunks`` merges every partition into the one dataset the GPT trains on."""
        ),
    )(_token_chunks)


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED)
def token_chunk_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
    """Add a ``token_chunks`` partition for every file of the configured source not yet one."""
    from vlm_assets.data.token_chunks import list_chunks

    config = TokenChunksConfig()
    if config.source_dir is None:
        return dg.SkipReason("token_chunks.source_dir is not set in the profile")
    try:
        found = list_chunks(config.source_dir, config.pattern)
    except ValueError as err:  # an empty or unmounted source: said on every tick, not an error each time
        return dg.SkipReason(str(err))
    known = set(context.instance.get_dynamic_partitions(CHUNKS.name))
    new = [key for key in found if key not in known and not _refused_key(key)]
    for key in found:
        if _refused_key(key):
            context.log.warning(f"{config.source_dir}/{key}: Dagster refuses this partition key; rename the file")
    if not new:
        return dg.SkipReason(f"no new file under {config.source_dir}")
    return dg.SensorResult(dynamic_partitions_requests=[CHUNKS.build_add_request(new)])


def _refused_key(key: str) -> bool:
    # Dagster's rule for partition keys (its INVALID_PARTITION_SUBSTRINGS, not public API): it refuses a
    # request holding one such key as a whole, so one odd file name would stop every new partition.
    return any(part in key for part in ("...", "\a", "\b", "\f", "\n", "\r", "\t", "\v", "\0"))
