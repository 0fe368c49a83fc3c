"""Occlusion-adapter training: samples/s and peak memory, the seed's settings against ours, one run.

    python bench/bench_adapter.py                       # CPU: tiny Qwen2.5-VL backbone, 56 px
    python bench/bench_adapter.py --qwen3b --image-size 224    # GPU: Qwen2.5-VL-3B shapes, random bf16 weights

A step is one optimizer step over ``--global-batch`` samples (frozen backbone, adapter trained):
seed = per-device batch 1 with 16 accumulation micro-steps, gradient checkpointing on; ours = the
whole batch in one micro-step, no activation recomputation (the adapter is tiny and the backbone is
frozen, so activations for one batch fit). Each setting runs in its own process so peak memory
(CUDA max allocated, or the process's peak RSS on CPU) is its own.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

SETTINGS = {"seed (batch 1 x 16 accumulation, grad ckpt)": (1, True), "ours (batch 16, no grad ckpt)": (16, False)}


def one(backbone_dir: str, micro: int, checkpointing: bool, global_batch: int, image_size: int, steps: int) -> dict:
    from vlm_assets.models.frozen_vlm import QwenVLBackbone
    from vlm_assets.models.occlusion_adapter import OcclusionAdapter
    from vlm_assets.train.adapter_module import masked_l1

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backbone = QwenVLBackbone(
        backbone_dir, dtype=torch.bfloat16 if cuda else torch.float32, gradient_checkpointing=checkpointing
    ).to(device)
    adapter = OcclusionAdapter().to(device)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=1e-2)
    pixels = torch.rand(micro, 3, image_size, image_size, device=device)
    mask = torch.zeros(micro, 1, image_size, image_size, device=device)
    mask[:, :, image_size // 4 : image_size // 2, image_size // 4 : image_size // 2] = 1
    prompts, answers = ["Answer with exactly one class label."] * micro, ["Ankle boot"] * micro
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(micro_steps: int = global_batch // micro):
        for _ in range(micro_steps):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                restored = adapter(pixels * (1 - mask), mask)
                loss = backbone.loss(restored, prompts, answers) + 0.35 * masked_l1(restored, pixels, mask)
            (loss / micro_steps).backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1)  # warm-up: one micro-step compiles and allocates what every later one reuses
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"samples_per_s": steps * global_batch / seconds, "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen3b", action="store_true", help="Qwen2.5-VL-3B shapes, random weights")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("BACKBONE", "MICRO", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        backbone, micro, ckpt = args.one
        print(json.dumps(one(backbone, int(micro), ckpt == "1", args.global_batch, args.image_size, args.steps)))
        return

    from vlm_assets.models.tiny_qwen import QWEN25_VL_3B_TEXT, QWEN25_VL_3B_VISION, build_tiny_qwen

    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if cuda else "CPU"
    shape = "Qwen2.5-VL-3B shapes, random weights" if args.qwen3b else "tiny Qwen2.5-VL"
    print(f"Adapter training, {shape}, {args.image_size} px, global batch {args.global_batch}, {where}")
    print("| setting | samples/s | vs seed | peak memory |\n|---|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = (
            {"text_overrides": QWEN25_VL_3B_TEXT, "vision_overrides": QWEN25_VL_3B_VISION} if args.qwen3b else {}
        )
        backbone = build_tiny_qwen(
            Path(tmp) / "backbone",
            ["Answer with exactly one class label. Ankle boot"] * 20,
            **overrides,
            **({"device": "cuda", "dtype": "bfloat16"} if cuda else {}),
        )
        base = None
        for name, (micro, ckpt) in SETTINGS.items():
            command = [sys.executable, __file__, "--one", str(backbone), str(micro), "1" if ckpt else "0"]
            command += ["--image-size", str(args.image_size), "--global-batch", str(args.global_batch)]
            # stderr to this process's: a failing setting's traceback reaches the log
            out = subprocess.run([*command, "--steps", str(args.steps)], stdout=subprocess.PIPE, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            speed, mib = r["samples_per_s"], r["peak_bytes"] / 2**20
            base = base or speed
            results_file.emit(
                {"part": "adapter", "setting": name, "device": where, "shape": shape, "image_size": args.image_size,
                 "global_batch": args.global_batch, **r, "vs_seed": speed / base}
            )  # fmt: skip
            print(f"| {name} | {speed:.1f} | {speed / base:.2f}x | {mib:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
