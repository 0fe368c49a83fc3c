"""Artifact stores: directories that become visible only once complete (no dagster imports)."""

from vlm_assets.storage.artifact_store import (
    ArtifactManifest,
    ArtifactNotFoundError,
    ArtifactRef,
    ArtifactStore,
    CorruptArtifactError,
    LocalArtifactStore,
)
from vlm_assets.storage.s3_store import S3ArtifactStore
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
