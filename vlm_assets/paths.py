"""Where the embedded default keeps things, read from the environment when asked (never at import).

``VLM_ASSETS_HOME``  artifacts, MLflow store, Dagster home, training scratch (``runs/``) (default ``./var``)
``VLM_ASSETS_CACHE`` downloads and offline data (default ``~/.cache/vlm_assets``)
"""

import os
from pathlib import Path


def home_dir() -> Path:
    """Return the project's home directory, ``$VLM_ASSETS_HOME`` (default ``var``), resolved."""
    return Path(os.environ.get("VLM_ASSETS_HOME", "var")).expanduser().resolve()


def cache_dir() -> Path:
    """Return the cache directory, ``$VLM_ASSETS_CACHE`` (default ``~/.cache/vlm_assets``), resolved."""
    return Path(os.environ.get("VLM_ASSETS_CACHE", "~/.cache/vlm_assets")).expanduser().resolve()


def offline_data_dir() -> Path:
    """Filled by ``scripts/fetch-offline-data.sh``."""
    return cache_dir() / "offline-data"


def runs_dir() -> Path:
    """Per-run training scratch (configs, streaming caches): ``$VLM_ASSETS_HOME/runs``."""
    path = home_dir() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_local(name_or_path: str, what: str, *, directory: bool = True) -> None:
    """Require a model reference that names a local path (absolute, ``./``, ``~``), not a hub id, to exist.

    Raise ``FileNotFoundError`` naming ``what`` and the path otherwise.
    """
    if name_or_path.startswith(("/", ".", "~")):
        path = Path(name_or_path).expanduser()
        if not (path.is_dir() if directory else path.exists()):
            raise FileNotFoundError(f"{what}: {'directory ' if directory else ''}{name_or_path} does not exist")
