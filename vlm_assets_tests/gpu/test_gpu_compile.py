"""``torch.compile`` of the GPT against eager, in bf16 autocast on the GPU (the CPU path compiles
nothing: tests of the model in vlm_assets_tests/models/test_gpt.py). Imports no dagster or MLflow."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu]


def test_torch_compile_matches_eager():
    from vlm_assets.models.gpt import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny")[0]).cuda()
    ids = torch.randint(0, 50257, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(ids, labels=ids)
        compiled = torch.compile(model)(ids, labels=ids)
    eager_loss, compiled_loss = eager[1], compiled[1]
    assert math.isfinite(compiled_loss.item())
    assert compiled_loss.item() == pytest.approx(eager_loss.item(), rel=2e-2)
    compiled_loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
