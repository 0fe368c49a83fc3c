"""The GPU paths, each the twin of a CPU test that CI runs: FSDP2 bf16 and DDP on NCCL through the
asset and the launcher, the adapter's DeepSpeed ZeRO-2 + bf16, VisualChat's DeepSpeed ZeRO-2 and ZeRO-3 +
bf16, and ``torch.compile`` of the GPT.

Run with ``scripts/gpu-check.sh`` (or ``pytest -m gpu``) on a CUDA machine; ``scripts/test.sh``
deselects them where no CUDA device is present (they are then not run, and not counted as passed).
"""

import math

import pytest
import torch

from vlm_assets_tests.defs import test_adapter_assets as adapter_cpu
from vlm_assets_tests.defs import test_gpt_assets as gpt_cpu

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPUS = torch.cuda.device_count()


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without CUDA: select it only on a GPU machine (-m gpu)")


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_gpt_on_nccl_in_bf16(strategy, tmp_path, offline_data, mlflow_uri):
    """The CPU twins: test_gpt_assets (DDP 2 nodes, FSDP2 2 processes on gloo)."""
    env = gpt_cpu.Env(tmp_path, mlflow_uri)
    result = env.materialize(gpt_cpu.run_config(offline_data, strategy=strategy, num_nodes=1, nproc_per_node=GPUS,
                                                micro_batch_size=8 // GPUS if 8 % GPUS == 0 else 1,
                                                global_batch_size=8, checkpoint_every=15))
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
    config = adapter_cpu.run_config(offline_data, adapter={"nproc_per_node": GPUS, "strategy": "auto",
                                                           "micro_batch_size": 16 // GPUS})
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


@pytest.mark.parametrize("stage", [2, 3])
def test_visualchat_deepspeed_bf16(stage, visualchat_inputs, tmp_path):
    """The CPU twins: test_visualchat_train (ZeRO-2 and ZeRO-3 on gloo, 2 processes, fp32)."""
    from vlm_assets_tests.train import test_visualchat_train as visualchat_cpu

    config = visualchat_cpu.config(visualchat_inputs, zero_stage=stage, nproc_per_node=GPUS, micro_batch_size=4 // GPUS
                                   if 4 % GPUS == 0 else 1, global_batch_size=4 if 4 % GPUS == 0 else GPUS)
    result = visualchat_cpu.train(visualchat_inputs, tmp_path, config)
    visualchat_cpu.check_trained_and_exported(result, tmp_path / "out", visualchat_inputs)


@pytest.fixture(scope="module")
def visualchat_inputs(tmp_path_factory, offline_data):
    from vlm_assets_tests.train.test_visualchat_train import make_inputs

    return make_inputs(tmp_path_factory.mktemp("visualchat"), offline_data)
