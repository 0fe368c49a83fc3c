"""VisualChat's GPU path, the twin of test_visualchat_train (ZeRO-2 and ZeRO-3 on gloo, 2 processes,
fp32): DeepSpeed ZeRO-2 and ZeRO-3 in bf16 on NCCL over every visible GPU train, merge, export, reload
and answer. Imports no dagster or MLflow: the engines alone (``scripts/gpu-check.sh``)."""

import pytest

from vlm_assets_tests.gpu.conftest import GPUS

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("stage", [2, 3])
def test_visualchat_deepspeed_bf16(stage, visualchat_inputs, tmp_path):
    """The CPU twins: test_visualchat_train (ZeRO-2 and ZeRO-3 on gloo, 2 processes, fp32)."""
    from vlm_assets_tests.train import test_visualchat_train as visualchat_cpu

    config = visualchat_cpu.config(
        visualchat_inputs,
        parallelism={
            "zero_stage": stage,
            "nproc_per_node": GPUS,
            "micro_batch_size": 4 // GPUS if 4 % GPUS == 0 else 1,
        },
        optimizer={"global_batch_size": 4 if 4 % GPUS == 0 else GPUS},
    )
    result = visualchat_cpu.train(visualchat_inputs, tmp_path, config)
    visualchat_cpu.check_trained_and_exported(
        result, tmp_path / "out", visualchat_inputs, backend="nccl", param_dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def visualchat_inputs(tmp_path_factory, offline_data):
    from vlm_assets_tests.train.test_visualchat_train import make_inputs

    return make_inputs(tmp_path_factory.mktemp("visualchat"), offline_data)
