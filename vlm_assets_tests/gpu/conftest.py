"""What every gpu-marked test shares: the visible GPU count, and a clear failure where there is none."""

import pytest
import torch

GPUS = torch.cuda.device_count()


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without CUDA: select it only on a GPU machine (-m gpu)")
