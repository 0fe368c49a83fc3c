"""Artifact stores: directories that become visible only once complete (no dagster imports). The S3
store imports botocore, which only a machine that uses S3 needs (the GPU machine has none)."""

from vlm_assets.storage.artifact_store import (
    ArtifactManifest,
    ArtifactNotFoundError,
    ArtifactRef,
    ArtifactStore,
    CorruptArtifactError,
    LocalArtifactStore,
)
from vlm_assets.storage.spec import store_from_spec

__all__ = [
    "ArtifactManifest",
    "ArtifactNotFoundError",
    "ArtifactRef",
    "ArtifactStore",
    "CorruptArtifactError",
    "LocalArtifactStore",
    "S3ArtifactStore",
    "store_from_spec",
]


def __getattr__(name: str):
    if name == "S3ArtifactStore":
        from vlm_assets.storage.s3_store import S3ArtifactStore

        return S3ArtifactStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
