"""``torch.compile`` of the GPT against eager, in bf16 autocast on the GPU, over a few training steps on
real tokens (at random init both losses sit at about ln V, which any two models share). The CPU path
compiles nothing: the model's tests are in vlm_assets_tests/models/test_gpt.py. Imports no dagster."""

import pytest
import torch

pytestmark = [pytest.mark.gpu]

STEPS = 8


def train(compiled: bool, ids: torch.Tensor) -> tuple[list[float], torch.dtype]:
    from vlm_assets.models.gpt import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", block_size=ids.shape[1])[0]).cuda()
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, loss = run(ids, labels=ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, logits.dtype


def test_torch_compile_trains_like_eager_in_bf16_on_real_tokens(offline_data):
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files

    tokenizer = load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))
    text = "\n\n".join(list(paragraphs_of_files(str(offline_data / "shakespeare" / "*.txt")))[:500])
    ids = torch.tensor(tokenizer(text)["input_ids"][: 8 * 128], device="cuda").view(8, 128)
    eager, eager_dtype = train(False, ids)
    compiled, compiled_dtype = train(True, ids)
    assert eager[-1] < eager[0] - 1.0, eager  # the steps learn: the comparison is past random init
    assert compiled == pytest.approx(eager, rel=2e-2), (compiled, eager)  # bf16's tolerance, step by step
    assert compiled_dtype == eager_dtype == torch.bfloat16  # the compiled graph ran under autocast
