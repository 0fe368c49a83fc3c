"""Export the GPT as a Hugging Face ``GPT2LMHeadModel`` directory (config + safetensors + tokenizer).

The architecture is GPT-2's, so the export is loadable by anyone with ``transformers`` alone:
``GPT2LMHeadModel.from_pretrained(path)``; no code of this project is needed. HF's GPT-2 uses
``Conv1D`` (weights stored as (in, out)), hence the transposes; the padded vocabulary rows are dropped.
"""

import json
import shutil
from pathlib import Path

import torch

from vlm_assets.models.gpt import GPTConfig

_TRANSPOSED = {
    "attn.qkv.weight": "attn.c_attn.weight",
    "attn.proj.weight": "attn.c_proj.weight",
    "mlp.fc.weight": "mlp.c_fc.weight",
    "mlp.proj.weight": "mlp.c_proj.weight",
}
_SAME = {
    "attn.qkv.bias": "attn.c_attn.bias",
    "attn.proj.bias": "attn.c_proj.bias",
    "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.bias": "mlp.c_proj.bias",
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
}


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Rename a ``GPT`` state dict to Hugging Face ``GPT2LMHeadModel``'s, the padding rows dropped."""
    out = {
        "transformer.wte.weight": state["wte.weight"][: config.vocab_size],
        "transformer.wpe.weight": state["wpe.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": state["ln_f.bias"],
    }
    for i in range(config.n_layer):
        for ours, theirs in _TRANSPOSED.items():
            out[f"transformer.h.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"].t()
        for ours, theirs in _SAME.items():
            out[f"transformer.h.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def export_hf(state: dict[str, torch.Tensor], config: GPTConfig, out_dir: Path, tokenizer_dir: Path | None) -> Path:
    """Write ``out_dir`` as a ``GPT2LMHeadModel`` checkpoint (tied head, gelu_new = GELU tanh)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if not config.bias:
        raise ValueError("Hugging Face GPT-2 has biases everywhere: export needs a GPTConfig with bias=True")
    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(hf_config)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state, config), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF export mapping incomplete: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for path in tokenizer_dir.iterdir():
            if path.is_file() and not path.name.startswith("."):  # not a download cut short (private_download)
                shutil.copy2(path, out_dir / path.name)
    return out_dir


def hf_loss(export_dir: Path, batch: dict[str, torch.Tensor]) -> float:
    """Mean next-token loss of a Hugging Face export on a batch (fp32, eval mode)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


def export_scan(root: Path, shards_uri: str) -> dict[str, float]:
    """Return the export's loss on the trainer's fixed validation batch, beside the trainer's own.

    The export is loaded with ``transformers`` alone; the trainer's loss is in ``reference.json``. Computed once
    when built, recorded in the manifest.
    """
    from vlm_assets.data.token_stream import reference_batch
    from vlm_assets.paths import runs_dir
    from vlm_assets.storage.scratch import held_dir

    expected = json.loads((root / "reference.json").read_text())
    with held_dir(runs_dir()) as tmp:
        batch = reference_batch(shards_uri, expected["num_samples"], tmp)
        return {"export_loss": hf_loss(root / "hf", batch), "trainer_loss": expected["val_batch_loss"]}
