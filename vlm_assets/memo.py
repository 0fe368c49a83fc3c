"""Cache keys for memoized assets (pure; the Dagster side lives in ``defs/platform/memo.py``).

A key is a hash of everything that determines an artifact's content: the asset's name and code
version, its resolved config, and the data versions of its upstream artifacts. Same inputs, same key;
change any of them and the key (so the artifact) is new.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def cache_key(
    asset_name: str,
    code_version: str,
    config: Mapping[str, Any],
    upstream_data_versions: Mapping[str, str] | None = None,
) -> str:
    """Return the cache key of an asset's artifact: a hash of name, code version, config and upstream data versions."""
    payload = {
        "asset": asset_name,
        "code_version": code_version,
        "config": dict(config),
        "upstream": dict(sorted((upstream_data_versions or {}).items())),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
