"""Tiny decoders and encoders for VisualChat tests, built from configs and saved with
``save_pretrained`` so they load through ``from_pretrained`` like hub checkpoints. The tokenizer is the
real GPT-2 BPE of the offline data."""

from pathlib import Path

import torch


def tiny_decoder(out_dir: Path, offline: Path, arch: str = "llama", seed: int = 0, init_std: float = 0.02) -> Path:
    """A 2-layer, 64-wide decoder; an ``init_std`` of about 0.2 makes its greedy answers depend on the image."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPT2Tokenizer,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(seed)
    tokenizer = GPT2Tokenizer.from_pretrained(offline / "gpt2-tokenizer")
    vocab = len(tokenizer)
    if arch in ("llama", "granite"):  # granite: a Llama whose logits are scaled after the projection
        shape = dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            initializer_range=init_std,
        )
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(**shape))
        else:
            model = GraniteForCausalLM(GraniteConfig(**shape, logits_scaling=4.0))
    else:
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=init_std)
        )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_clip(out_dir: Path, seed: int = 0) -> Path:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    CLIPVisionModel(
        CLIPVisionConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        )
    ).save_pretrained(out_dir)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out_dir)
    return out_dir


def tiny_model_section(clip: Path, decoder: Path, **fields) -> dict:
    """The ``model`` section of a VisualChat config on a tiny CLIP and a tiny decoder (an mlp projection,
    256 tokens a sample)."""
    return {
        "encoder_kind": "clip",
        "encoder": str(clip),
        "decoder": str(decoder),
        "projection": "mlp",
        "max_length": 256,
        **fields,
    }
