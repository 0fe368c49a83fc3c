"""GPT training throughput: the seed's model, ours eager and compiled, and ours through the platform's
trainer, at one shape in one run.

    python bench/bench_gpt.py                                   # CPU: tiny shape, fp32
    python bench/bench_gpt.py --preset 124M --batch 16 --seq 1024 --compile --trainer   # a GPU, bf16

Seed = what the seed pipeline trained: ``nn.MultiheadAttention`` with an explicit (seq x seq) causal
mask, an unpadded 50257-row head, and a loss on sliced/shifted logits. Ours = SDPA with ``is_causal``
(flash / memory-efficient kernels on GPU), the head padded to a multiple of 64, shifted labels. Same
weight shapes, AdamW, the same batch of real Shakespeare tokens; a step = forward + backward + AdamW,
each step timed alone after warm-up, the median reported. ``--trainer``: the same shape through
``vlm_assets.train.gpt_pretrain`` launched by the local launcher on one device, as ``gpt_checkpoint``
runs it; its steady-state speed is the median interval between the per-step timestamps of its
``history.json``, its overhead is against the bare loop of the same compile setting. MFU: 6N + 12 L H Q T
FLOPs per token (PaLM, appendix B) against the GPU's dense bf16 peak, chosen from its name.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files  # noqa: E402
from vlm_assets.models.gpt import GPT, IGNORE_INDEX, MLP, preset  # noqa: E402
from vlm_assets.paths import offline_data_dir  # noqa: E402


class SeedBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=config.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class SeedGPT(GPT):
    """The same GPT with the seed's attention block and head."""

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, pad_vocab_to=1))
        self.blocks = nn.ModuleList(SeedBlock(self.config) for _ in range(config.n_layer))

    def forward(self, input_ids, labels, return_logits=True):  # the seed's head always builds the logits
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )
        return logits, loss


def shakespeare() -> list[str]:
    return list(paragraphs_of_files(str(offline_data_dir() / "shakespeare" / "*.txt")))


def real_batch(batch: int, seq: int, device) -> torch.Tensor:
    tokenizer = load_gpt2_tokenizer(str(offline_data_dir() / "gpt2-tokenizer"))
    ids = tokenizer("\n\n".join(shakespeare()[:4000]))["input_ids"][: batch * seq]
    return torch.tensor(ids, device=device).view(batch, seq)


def bare_loop(model, batch, steps, warmup, bf16) -> dict:
    """Median step time of the bare training loop (each step synchronised), and the peak memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=batch.is_cuda)
    cuda = batch.is_cuda
    times = []
    for i in range(warmup + steps):
        if cuda and i == warmup:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(batch, batch, return_logits=False)  # as the trainer's steps
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return {
        "tokens_per_s": batch.numel() / statistics.median(times),
        "step_s_spread": [min(times), max(times)],
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss": float(loss),
    }


def through_trainer(args, work: Path) -> dict:
    """The same shape trained by ``vlm_assets.train.gpt_pretrain`` through the local launcher."""
    from vlm_assets.data.token_shards import write_token_shards
    from vlm_assets.launch import run_local
    from vlm_assets.train.gpt_config import PretrainConfig
    from vlm_assets.train.run_config import RunPaths, write_run_file

    docs = shakespeare()
    write_token_shards(
        work / "shards",
        load_gpt2_tokenizer(str(offline_data_dir() / "gpt2-tokenizer")),
        "gpt2",
        docs * (1 + args.batch * args.trainer_steps * args.seq // 1_000_000),
        docs[:200],
        max_length=args.seq,
        max_train_samples=args.batch * args.trainer_steps,
        max_val_samples=max(args.batch, 8),  # the trainer's export check reads 8
        size_limit="64mb",
    )
    train = PretrainConfig(
        model={"preset": args.preset, "n_layer": args.n_layer, "n_embd": args.n_embd},
        optimizer={"global_batch_size": args.batch, "max_steps": args.trainer_steps, "warmup_steps": 2},
        data={"val_check_interval": args.trainer_steps, "val_batches": 1},
        checkpoint={"every": args.trainer_steps},
        parallelism={"nproc_per_node": 1, "micro_batch_size": args.batch, "compile": args.compile},
        log_every=10,
    )
    paths = RunPaths(
        inputs={"token_shards": str(work / "shards")},
        out_dir=str(work / "out"),
        cache_dir=str(work / "cache"),
        checkpoint_store={"kind": "local", "root": str(work / "store")},
        checkpoint_prefix="checkpoints",
    )
    write_run_file(work / "run.json", train, paths)
    launched = time.time()
    run_local(train.launch_spec("vlm_assets.train.gpt_pretrain", ("--config", str(work / "run.json")), name="bench"))
    history = json.loads((work / "out" / "history.json").read_text())["train"]
    stamps = [step["time"] for step in history]
    skip = max(3, len(stamps) // 5)  # warm-up (and compiling) steps
    intervals = [b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False)]
    return {
        "tokens_per_s": args.batch * args.seq / statistics.median(intervals),
        "launch_to_first_step_s": stamps[0] - launched,
        "run_s": time.time() - launched,
        "timed_steps": len(intervals),
        "loss": history[-1]["loss"],
    }


def flops_per_token(config, seq: int) -> float:
    params = 12 * config.n_layer * config.n_embd**2 + config.padded_vocab_size * config.n_embd
    return 6 * params + 12 * config.n_layer * config.n_embd * seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--n-layer", type=int, help="the preset's depth instead (a rehearsal's size)")
    parser.add_argument("--n-embd", type=int, help="the preset's width instead")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each bare loop")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also torch.compile(ours), the trainer too")
    parser.add_argument("--trainer", action="store_true", help="also through the platform's trainer and launcher")
    parser.add_argument("--trainer-steps", type=int, default=30)
    parser.add_argument("--no-seed", action="store_true", help="skip the seed's model (it is the baseline)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    peak = results_file.peak_bf16_tflops(where) if cuda else None
    shape = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v}
    config, _ = preset(args.preset, block_size=args.seq, **shape)
    batch = real_batch(args.batch, args.seq, device)
    precision = "bf16 autocast" if cuda else "fp32"
    print(f"GPT {args.preset} {shape or ''} batch {args.batch} x {args.seq}, {where}, {precision}, peak {peak} TFLOP/s")
    print("| model | tokens/s | vs seed | MFU | peak memory |\n|---|---:|---:|---:|---:|", flush=True)
    variants = [] if args.no_seed else [("seed: MHA + explicit mask", SeedGPT)]
    variants.append(("ours: SDPA + padded head", GPT))
    if args.compile:
        variants.append(("ours + torch.compile", lambda c: torch.compile(GPT(c))))
    rates: dict[str, float] = {}

    def row(label: str, figures: dict) -> None:
        rate = figures["tokens_per_s"]
        rates[label] = rate
        base = rates.get("seed: MHA + explicit mask")
        mfu = rate * flops_per_token(config, args.seq) / (peak * 1e12) if peak else None
        memory = figures.get("peak_memory_bytes")
        results_file.emit(
            {"part": "gpt", "model": label, "device": where, "precision": precision, "batch": args.batch,
             "seq": args.seq, "preset": args.preset, **shape, **figures,
             "vs_seed": rate / base if base else None, "mfu": mfu, "peak_tflops": peak}
        )  # fmt: skip
        print(
            f"| {label} | {rate:,.0f} | {f'{rate / base:.2f}x' if base else '-'} | "
            f"{f'{mfu:.1%}' if mfu else 'n/a'} | {f'{memory / 2**30:.1f} GiB' if memory else '-'} |",
            flush=True,
        )

    for label, build in variants:
        torch.manual_seed(0)
        model = build(config).to(device)
        row(label, bare_loop(model, batch, args.steps, args.warmup, bf16=cuda))
        del model
        if cuda:
            torch.cuda.empty_cache()
    if args.trainer:
        bare = rates["ours + torch.compile" if args.compile else "ours: SDPA + padded head"]
        with tempfile.TemporaryDirectory() as tmp:
            figures = through_trainer(args, Path(tmp))
        figures["overhead_vs_bare"] = 1 - figures["tokens_per_s"] / bare
        row(f"ours through the trainer{' (compiled)' if args.compile else ''}", figures)
        print(
            f"\ntrainer: {figures['overhead_vs_bare']:+.1%} slower than the bare loop at steady state "
            f"({figures['timed_steps']} step intervals); {figures['launch_to_first_step_s']:.1f} s from launch to "
            f"the first step's end, {figures['run_s']:.1f} s in all"
        )


if __name__ == "__main__":
    main()
