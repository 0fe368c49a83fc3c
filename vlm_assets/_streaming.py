"""The one shim needed to import mosaicml-streaming without torchvision.

``streaming`` 0.13 imports ``streaming.vision`` (torchvision datasets) from its package ``__init__``,
and torchvision has no CPU build here (see ../shared/STACK.md). We never use its vision datasets, so an
empty placeholder module is registered before the first ``import streaming``. Import streaming only
through this module.
"""

import sys
import types

if "streaming.vision" not in sys.modules:
    sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")

import streaming  # noqa: E402
from streaming import LocalDataset, MDSWriter, StreamingDataset  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

__all__ = ["LocalDataset", "MDSWriter", "StreamingDataset", "clean_stale_shared_memory", "streaming"]
