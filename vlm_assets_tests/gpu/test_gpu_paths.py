"""The GPU paths, each the twin of a CPU test that CI runs: FSDP2 bf16 and DDP on NCCL through the
asset and the launcher, and the adapter's DeepSpeed ZeRO-2 + bf16: they need the whole stack (Dagster,
MLflow). The engine-level twins (``test_gpu_visualchat``, ``test_gpu_compile``) import neither, and are
what ``scripts/gpu-check.sh`` runs on a lent GPU machine.

Run with ``scripts/gpu-check.sh`` (or ``pytest -m gpu``) on a CUDA machine; ``scripts/test.sh``
deselects them where no CUDA device is present (they are then not run, and not counted as passed).
"""

import pytest

from vlm_assets_tests.conftest import ADAPTER_AND_EVAL_CHECKS_PASS, GPT_CHECKS_PASS
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
            parallelism={
                "strategy": strategy,
                "num_nodes": 1,
                "nproc_per_node": GPUS,
                "micro_batch_size": 8 // GPUS if 8 % GPUS == 0 else 1,
            },
            optimizer={"global_batch_size": 8},
            checkpoint={"every": 15},
        )
    )
    meta, checks = gpt_cpu.outcome(result)
    assert meta["strategy"] == strategy and meta["steps"] == gpt_cpu.MAX_STEPS and meta["world_size"] == GPUS
    assert checks == GPT_CHECKS_PASS
    assert meta["val_loss"] < gpt_cpu.UNIFORM - 2.5
    # read from Lightning's trainer and torch.distributed by the trainer (the CPU twins: 32-true, gloo)
    assert (meta["precision"], meta["backend"]) == ("bf16-mixed", "nccl")


def test_adapter_deepspeed_zero2_bf16(tmp_path, offline_data):
    """The CPU twin: test_adapter_assets (DDP on gloo, 2 processes). ``strategy: auto`` is ZeRO-2 on GPUs."""
    env = adapter_cpu.Env(tmp_path)
    config = adapter_cpu.run_config(
        offline_data,
        adapter={"parallelism": {"nproc_per_node": GPUS, "strategy": "auto", "micro_batch_size": 16 // GPUS}},
    )
    result = env.materialize(config)
    assert result.success
    checks = adapter_cpu.checks_of(result, "occlusion_adapter", "eval_report")
    assert checks == ADAPTER_AND_EVAL_CHECKS_PASS
    trained = adapter_cpu.meta(result, "occlusion_adapter")
    assert (trained["strategy"], trained["precision"], trained["backend"]) == ("deepspeed", "bf16-mixed", "nccl")
