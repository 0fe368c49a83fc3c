"""GPT training throughput: this model against the seed-style model at the same shape, one run.

    python bench/bench_gpt.py                     # CPU: tiny and 124M shapes
    python bench/bench_gpt.py --presets 124M 1.5B --batch 8 --seq 1024 --compile   # on a GPU (bf16)

Seed-style = what the seed pipeline trained: ``nn.MultiheadAttention`` with an explicit (seq x seq)
causal mask, an unpadded 50257-row head, and a loss on sliced/shifted logits. Ours = SDPA with
``is_causal`` (flash / memory-efficient kernels on GPU), the head padded to a multiple of 64 with the
padding masked inside the matmul, and shifted labels instead of shifted logits. Same weights shapes,
same optimizer (AdamW), same batch of real Shakespeare tokens. A step = forward + backward + AdamW.
On a GPU it also reports model FLOPs utilisation (6N + 12 L H Q T FLOPs per token, PaLM appendix B)
against the bf16 dense peak given by ``--peak-tflops``.
"""

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files
from vlm_assets.models.gpt import GPT, IGNORE_INDEX, MLP, preset
from vlm_assets.paths import offline_data_dir


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

    def forward(self, input_ids, labels):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )
        return logits, loss


def real_batch(batch: int, seq: int, device) -> torch.Tensor:
    data = offline_data_dir()
    tokenizer = load_gpt2_tokenizer(str(data / "gpt2-tokenizer"))
    text = "\n\n".join(list(paragraphs_of_files(str(data / "shakespeare" / "*.txt")))[:4000])
    ids = tokenizer(text)["input_ids"][: batch * seq]
    return torch.tensor(ids, device=device).view(batch, seq)


def tokens_per_s(model, batch, steps, warmup, bf16) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=batch.is_cuda)
    sync = torch.cuda.synchronize if batch.is_cuda else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            started = time.perf_counter()
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(batch, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return steps * batch.numel() / (time.perf_counter() - started)


def flops_per_token(config, seq: int) -> float:
    params = 12 * config.n_layer * config.n_embd**2 + config.padded_vocab_size * config.n_embd
    return 6 * params + 12 * config.n_layer * config.n_embd * seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "124M"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch = real_batch(args.batch, args.seq, device)
    rows = []
    for name in args.presets:
        config, _ = preset(name, block_size=args.seq)
        variants = [("seed: MHA + explicit mask", SeedGPT), ("ours: SDPA + padded head", GPT)]
        if args.compile:
            variants.append(("ours + torch.compile", lambda c: torch.compile(GPT(c))))
        baseline = None
        for label, build in variants:
            torch.manual_seed(0)
            model = build(config).to(device)
            rate = tokens_per_s(model, batch, args.steps, args.warmup, bf16=cuda)
            baseline = baseline or rate
            mfu = rate * flops_per_token(config, args.seq) / (args.peak_tflops * 1e12) if cuda else math.nan
            rows.append({"preset": name, "model": label, "tokens_per_s": rate, "speedup": rate / baseline, "mfu": mfu})
            del model
            if cuda:
                torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"\nGPT training step (fwd+bwd+AdamW), batch {args.batch} x {args.seq} real tokens, {where}, "
        f"{'bf16 autocast' if cuda else 'fp32'}\n"
    )
    print("| preset | model | tokens/s | speed-up | MFU |\n|---|---|---:|---:|---:|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if not math.isnan(r["mfu"]) else "n/a (CPU)"
        print(f"| {r['preset']} | {r['model']} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x | {mfu} |")
    print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
