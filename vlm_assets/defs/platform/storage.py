"""Artifact store resources: one interface, a local-filesystem and an S3 implementation."""

from abc import ABC, abstractmethod
from typing import Any, Literal

import dagster as dg
from pydantic import Field
from dagster_aws.s3 import S3Resource

from vlm_assets.storage import ArtifactStore, LocalArtifactStore, S3ArtifactStore


class ArtifactStoreResource(dg.ConfigurableResource, ABC):
    """Where assets commit their artifacts (atomically; see ``vlm_assets.storage``), and how a second
    materialization of a key that another live attempt is building behaves (store leases)."""

    on_busy: Literal["wait", "fail"] = Field(
        default="wait", description="A key another live attempt is building: wait for it (then reuse its "
                                    "artifact or take over) or fail at once naming the holder.")
    lease_ttl_s: float = Field(
        default=120.0, ge=5, description="A builder that has not renewed its lease for this long is "
                                         "dead: its lease expires and the next attempt takes over.")
    busy_wait_timeout_s: float = Field(
        default=86_400.0, gt=0, description="on_busy=wait: give up (failing, naming the holder) after this long.")

    @abstractmethod
    def get_store(self) -> ArtifactStore: ...

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """The store as a JSON-able dict for worker processes (``vlm_assets.storage.spec``)."""


class LocalArtifactStoreResource(ArtifactStoreResource):
    root: str = Field(description="Directory holding all artifacts (embedded default: var/artifacts).")

    def get_store(self) -> ArtifactStore:
        return LocalArtifactStore(self.root)

    def spec(self) -> dict[str, Any]:
        return {"kind": "local", "root": str(LocalArtifactStore(self.root).root)}


class S3ArtifactStoreResource(ArtifactStoreResource):
    """Any S3-compatible store: set ``s3.endpoint_url`` for MinIO, Ceph, R2, a local test server..."""

    bucket: str = Field(description="Bucket holding the artifacts.")
    prefix: str = Field(default="vlm_assets", description="Key prefix under the bucket.")
    cache_dir: str = Field(description="Local directory for verified copies read back by assets.")
    s3: S3Resource = Field(description="dagster-aws S3 client settings (endpoint_url, region, credentials).")

    def get_store(self) -> ArtifactStore:
        return S3ArtifactStore(self.s3.get_client(), self.bucket, self.prefix, cache_dir=self.cache_dir)

    def spec(self) -> dict[str, Any]:
        return {"kind": "s3", "bucket": self.bucket, "prefix": self.prefix, "cache_dir": self.cache_dir,
                "endpoint_url": self.s3.endpoint_url, "region_name": self.s3.region_name}
