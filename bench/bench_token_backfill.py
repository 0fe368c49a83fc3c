"""token_chunks as a backfill runs it: tokens/s of one run against two at once, the fixed cost of a run
and of a partition, and from those the wall time of a SlimPajama-sized corpus on N pods.

    python bench/bench_token_backfill.py [--write] [--pods 1,16,64,256] [--corpus-tokens 627e9]
                                         [--corpus-files 59166]

Each run is a real one: ``dagster job execute -j token_chunks_job`` with a backfill's partition-range
tags, in its own process on a fresh embedded instance (process start, definitions load, the run, the chunk's lease, its
MLflow run, the commit), as a backfill's run worker does. Corpus: Python 3.11's documentation (497
pages, 11 MB, the offline data), one page a document, as zstd JSON-lines chunks: three of the docs
three times over (33 MB, about SlimPajama's average chunk of 10.6 M tokens) and four of one short
page. Measured: a short chunk alone and two short chunks in one run (a backfill's range: the
difference is what a partition adds to a run, the rest of a run is its fixed cost), one big chunk
alone, then two big chunks at once. A first run of a short chunk pays the one-time costs (a fresh
MLflow store's migration, cold file caches) before anything is timed. The projection assumes pods
the size of this machine, each tokenizing at the measured in-step rate; the corpus defaults are
SlimPajama-627B's train split (627 B tokens in 59,166 ``.jsonl.zst`` chunks).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

from vlm_assets.paths import offline_data_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_LENGTH = 1024


def corpus(root: Path) -> dict[str, int]:
    """Write three chunks the size of a SlimPajama one (the docs three times over, about 10 M tokens)
    and four of one short page; return key -> text bytes."""
    pages = sorted((offline_data_dir() / "python-docs").rglob("*.rst.txt"))
    texts = [page.read_text() for page in pages]
    root.mkdir(parents=True)
    sizes = {}
    groups = {f"big-{i}.jsonl.zst": texts[i:] + texts + texts + texts[:i] for i in range(3)}
    for name in ("warm-up", "tiny-1", "tiny-2", "tiny-3"):
        groups[f"{name}.jsonl.zst"] = [min(texts, key=len)]
    for key, group in groups.items():
        lines = "\n".join(json.dumps({"text": text}) for text in group)
        (root / key).write_bytes(zstd.compress(lines.encode()))
        sizes[key] = sum(len(t.encode()) for t in group)
    return sizes


class Instance:
    """A fresh embedded default (Dagster instance, store, MLflow) in ``root``; runs in processes of their own."""

    def __init__(self, root: Path, source: Path):
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(root / "dagster"),
            "VLM_ASSETS_HOME": str(root / "home"),
            "VLM_ASSETS_CHUNKS_PER_RUN": "1",
        }
        (root / "dagster").mkdir(parents=True)
        (root / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        self.config_file = root / "run-config.json"
        config = {
            "ops": {
                "token_chunks": {
                    "config": {
                        "source_dir": str(source),
                        "tokenizer": str(offline_data_dir() / "gpt2-tokenizer"),
                        "max_length": MAX_LENGTH,
                    }
                }
            }
        }
        self.config_file.write_text(json.dumps(config))

    def add_partitions(self, keys: list[str]) -> None:
        code = (
            "import sys, dagster as dg\ndg.DagsterInstance.get().add_dynamic_partitions('token_chunks', sys.argv[1:])\n"
        )
        subprocess.run([sys.executable, "-c", code, *keys], env=self.env, check=True)

    def run(self, first: str, last: str | None = None) -> dict:
        """Materialize the partitions ``first`` to ``last`` (a backfill's range) in one run of a process
        of its own: wall seconds, the step's seconds, tokens."""
        tags = {
            "dagster/asset_partition_range_start": first,
            "dagster/asset_partition_range_end": last or first,
            "bench/run": f"{first}..{last or first}",  # finds this run among concurrent ones
        }
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "dagster", "job", "execute", "-m", "vlm_assets.definitions", "-j"]
            + ["token_chunks_job", "-c", str(self.config_file), "--tags", json.dumps(tags)],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"run of {first}..{last} failed:\n{proc.stderr[-3000:]}")
        return {"partitions": [first, last] if last else [first], "wall_s": wall, **self.step(tags["bench/run"])}

    def step(self, tag: str) -> dict:
        """The step time and tokens of the run tagged ``tag``."""
        code = """
import json, sys, dagster as dg
instance = dg.DagsterInstance.get()
(run,) = instance.get_runs(filters=dg.RunsFilter(tags={"bench/run": sys.argv[1]}))
stats = instance.get_run_step_stats(run.run_id)[0]
record = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records[0]
meta = record.event_log_entry.dagster_event.materialization.metadata
tokens = meta["run_train_tokens"].value + meta["run_val_tokens"].value
print(json.dumps({"step_s": stats.end_time - stats.start_time, "tokens": tokens}))
"""
        out = subprocess.run(
            [sys.executable, "-c", code, tag], env=self.env, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])


def hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.1f} min"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write bench/results/token-backfill_<machine>_<date>.*")
    parser.add_argument("--pods", default="1,16,64,256", help="pod counts of the projection")
    parser.add_argument("--corpus-tokens", type=float, default=627e9, help="the corpus's GPT-2 tokens")
    parser.add_argument("--corpus-files", type=int, default=59166, help="the corpus's chunk files")
    args = parser.parse_args()
    pods = [int(p) for p in args.pods.split(",")]

    with tempfile.TemporaryDirectory(prefix="bench-backfill-") as tmp:
        source = Path(tmp) / "corpus"
        sizes = corpus(source)
        instance = Instance(Path(tmp), source)
        instance.add_partitions(list(sizes))  # a range is in the order partitions were added
        instance.run("warm-up.jsonl.zst")  # a fresh MLflow store's migration, cold caches: once
        tiny = instance.run("tiny-1.jsonl.zst")
        tiny_pair = instance.run("tiny-2.jsonl.zst", "tiny-3.jsonl.zst")
        alone = instance.run("big-0.jsonl.zst")
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pair = list(pool.map(instance.run, ["big-1.jsonl.zst", "big-2.jsonl.zst"]))
        pair_wall = time.perf_counter() - started

    one_rate = alone["tokens"] / alone["wall_s"]
    two_rate = sum(r["tokens"] for r in pair) / pair_wall
    per_partition = tiny_pair["step_s"] - tiny["step_s"]  # what one more partition in a run adds
    per_run = tiny["wall_s"] - per_partition  # the rest of a one-partition run: process, imports, set-up
    step_rate = alone["tokens"] / (alone["step_s"] - tiny["step_s"])  # tokenizing, the step's own costs aside
    bytes_per_token = sizes["big-0.jsonl.zst"] / alone["tokens"]
    tokens_per_file = args.corpus_tokens / args.corpus_files

    lines = [
        "## One run against two at once (this machine)",
        "",
        "| runs at once | tokens | wall s | tokens/s | vs 1 run |",
        "|---:|---:|---:|---:|---:|",
        f"| 1 | {alone['tokens']:,} | {alone['wall_s']:.1f} | {one_rate:,.0f} | 1.00 |",
        f"| 2 | {sum(r['tokens'] for r in pair):,} | {pair_wall:.1f} | {two_rate:,.0f} | {two_rate / one_rate:.2f} |",
        "",
        f"Two runs at once moved {two_rate / one_rate:.2f}x the tokens of one: much of a run is its fixed cost",
        "(process start, imports: one core), which the other run's tokenizing overlaps, while the tokenizing",
        "itself takes every core. So on one machine two runs is about the limit; on a cluster each run is a",
        "pod with cores of its own, and the rate scales with the pods.",
        "",
        "## Fixed costs",
        "",
        "| cost | seconds |",
        "|---|---:|",
        f"| a run of one short chunk, wall | {tiny['wall_s']:.1f} |",
        f"| its step (first imports of tokenizer and streaming, lease, MLflow run, commit) | {tiny['step_s']:.1f} |",
        f"| a run of two short chunks, its step | {tiny_pair['step_s']:.1f} |",
        f"| **per partition**: what one more partition adds to a run (lease, MLflow, commit) | {per_partition:.1f} |",
        f"| **per run**: the rest (process start, definitions load, imports, run set-up and end) | {per_run:.1f} |",
        "",
        f"Tokenizing within a step (big chunk: its step less the short chunk's): {step_rate:,.0f} tokens/s.",
        "",
        f"Text: {bytes_per_token:.2f} bytes per GPT-2 token (the docs).",
        "",
        f"## Projection: {args.corpus_tokens:,.0f} tokens in {args.corpus_files:,} chunks",
        "",
        f"A chunk holds {tokens_per_file:,.0f} tokens on average. On N pods of this machine's size, with K",
        "partitions a run, wall = (files x per-partition + files / K x per-run + tokens / step rate) / N:",
        "",
        "| pods N | K = 1 | K = 16 |",
        "|---:|---:|---:|",
    ]
    projection = {}
    for n in pods:
        row = []
        for k in (1, 16):
            seconds = (
                args.corpus_files * per_partition + args.corpus_files / k * per_run + args.corpus_tokens / step_rate
            ) / n
            projection[f"{n}x{k}"] = seconds
            row.append(hours(seconds))
        lines.append(f"| {n} | {row[0]} | {row[1]} |")
    # Fixed cost per partition at K partitions a run, and the tokenizing time it is 5 % of.
    smallest = {k: (per_partition + per_run / k) / 0.05 * step_rate for k in (1, 16)}
    lines += [
        "",
        f"Arithmetic, N = 1, K = 1: {args.corpus_files:,} x {per_partition:.1f} s + {args.corpus_files:,} x "
        f"{per_run:.1f} s + {args.corpus_tokens:,.0f} / {step_rate:,.0f} tokens/s = "
        f"{hours(projection['1x1'])}.",
        "",
        "## Smallest sensible partition",
        "",
        "The fixed cost a partition carries is per-partition + per-run / K. For it to be at most 5 % of",
        "the partition's tokenizing, a partition holds at least 20 x that x the step rate in tokens:",
        "",
        "| K | fixed s per partition | smallest partition, tokens | of text | SlimPajama chunks |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, tokens in smallest.items():
        lines.append(
            f"| {k} | {per_partition + per_run / k:.2f} | {tokens:,.0f} | {tokens * bytes_per_token / 1e6:,.0f} MB "
            f"| {tokens / tokens_per_file:.1f} |"
        )
    markdown = "\n".join(lines)
    print(markdown)
    data = {
        "one_run": alone,
        "two_runs": {"runs": pair, "wall_s": pair_wall},
        "tiny": tiny,
        "tiny_pair": tiny_pair,
        "tokens_per_s": {"one_run": one_rate, "two_runs": two_rate, "ratio": two_rate / one_rate, "step": step_rate},
        "fixed_s": {"per_run": per_run, "per_partition": per_partition},
        "bytes_per_token": bytes_per_token,
        "corpus": {"tokens": args.corpus_tokens, "files": args.corpus_files},
        "projection_s": projection,
        "smallest_partition_tokens": {str(k): v for k, v in smallest.items()},
    }
    if args.write:
        command = "python bench/bench_token_backfill.py " + " ".join(sys.argv[1:])
        path = results_file.write("token-backfill", results_file.header(command.strip()), markdown, data)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
