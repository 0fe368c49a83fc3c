"""The GPU paths, each the twin of a CPU test that CI runs: FSDP2 bf16 and DDP on NCCL through the
asset and the launcher, the adapter's DeepSpeed ZeRO-2 + bf16, and ``torch.compile`` of the GPT
(VisualChat's in ``test_gpu_visualchat``, which needs no dagster or MLflow).

Run with ``scripts/gpu-check.sh`` (or ``pytest -m gpu``) on a CUDA machine; ``scripts/test.sh``
deselects them where no CUDA device is present (they are then not run, and not counted as passed).
"""

import math

import pytest
import torch

from vlm_assets_tests.defs import test_adapter_assets as adapter_cpu
from vlm_assets_tests.defs import test_gpt_assets as gpt_cpu
from vlm_assets_tests.gpu.conftest import GPUS

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_gpt_on_nccl_in_bf16(strategy, tmp_path, offline_data, mlflow_uri):
    """The CPU twins: test_gpt_assets (DDP 2 nodes, FSDP2 2 processes on gloo)."""
    env = gpt_cpu.Env(tmp_path, mlflow_uri)
    result = env.materialize(
        gpt_cpu.run_config(
            offline_data,
            strategy=strategy,
            num_nodes=1,
            nproc_per_node=GPUS,
            micro_batch_size=8 // GPUS if 8 % GPUS == 0 else 1,
            global_batch_size=8,
            checkpoint_every=15,
        )
    )
    meta, checks = gpt_cpu.outcome(result)
    assert meta["strategy"] == strategy and meta["steps"] == gpt_cpu.MAX_STEPS and meta["world_size"] == GPUS
    assert checks == {"val_loss_beats_uniform": True, "export_reproduces_val_loss": True}
    assert meta["val_loss"] < gpt_cpu.UNIFORM - 2.5
    assert any("bf16" in m for m in env.log_messages), "the trainer did not run bf16-mixed"
    assert any("nccl" in m.lower() for m in env.log_messages), "the process group was not NCCL"


def test_adapter_deepspeed_zero2_bf16(tmp_path, offline_data):
    """The CPU twin: test_adapter_assets (DDP on gloo, 2 processes). ``strategy: auto`` is ZeRO-2 on GPUs."""
    pytest.importorskip("deepspeed", reason="install the gpu extra: pip install -e '.[gpu]'")
    env = adapter_cpu.Env(tmp_path)
    config = adapter_cpu.run_config(
        offline_data, adapter={"nproc_per_node": GPUS, "strategy": "auto", "micro_batch_size": 16 // GPUS}
    )
    result = env.materialize(config)
    assert result.success
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert all(checks.values()), checks
    assert any("deepspeed" in m.lower() for m in env.log_messages)


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
