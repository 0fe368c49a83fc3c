"""Artifacts in any S3-compatible object store (AWS S3, MinIO, Ceph, R2...).

Objects are uploaded under ``s3://<bucket>/<prefix>/<key>/`` and the ``_COMPLETE.json`` manifest is
put last: S3 PUTs of single objects are atomic, so readers that look for the manifest first never see
a half-written artifact. A failed upload deletes what it had put.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vlm_assets.storage.artifact_store import (
    MANIFEST_NAME,
    ArtifactManifest,
    ArtifactNotFoundError,
    ArtifactStore,
    verify_files,
)


class S3ArtifactStore(ArtifactStore):
    def __init__(self, client: Any, bucket: str, prefix: str = "", cache_dir: str | os.PathLike[str] | None = None):
        """``client`` is a boto3 S3 client (``dagster_aws.s3.S3Resource.get_client()`` builds one with
        ``endpoint_url`` for non-AWS stores). ``cache_dir`` holds verified local copies for readers."""
        if not bucket:
            raise ValueError("S3ArtifactStore: 'bucket' must be set")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "vlm_assets-s3-cache")

    def _object_key(self, key: str, rel: str = "") -> str:
        parts = [p for p in (self.prefix, key.strip("/"), rel) if p]
        return "/".join(parts)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object_key(key)}"

    def read_manifest(self, key: str) -> ArtifactManifest:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key, MANIFEST_NAME))
        except self.client.exceptions.NoSuchKey:
            raise ArtifactNotFoundError(f"no complete artifact at {self.uri(key)}") from None
        return ArtifactManifest.from_json(obj["Body"].read().decode())

    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> None:
        uploaded = []
        try:
            for rel in manifest.files:
                object_key = self._object_key(key, rel)
                self.client.upload_file(str(staging / rel), self.bucket, object_key)
                uploaded.append(object_key)
        except BaseException:
            for object_key in uploaded:
                self.client.delete_object(Bucket=self.bucket, Key=object_key)
            raise
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._object_key(key, MANIFEST_NAME),
            Body=manifest.to_json().encode(),
            ContentType="application/json",
        )

    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        manifest = self.read_manifest(key)
        root = Path(cache_dir or self.cache_dir)
        target = root / self.bucket / self._object_key(key) / manifest.digest
        if (target / MANIFEST_NAME).is_file():
            return target
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".download-"))
        try:
            for rel in manifest.files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(self.bucket, self._object_key(key, rel), str(tmp / rel))
            verify_files(tmp, manifest)
            (tmp / MANIFEST_NAME).write_text(manifest.to_json())
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, target)
            except OSError:  # another reader finished the same download first
                if not (target / MANIFEST_NAME).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def list_complete(self, prefix: str) -> list[str]:
        base = self._object_key(prefix) + "/"
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(base):]
                if rest.count("/") == 1 and rest.endswith("/" + MANIFEST_NAME):
                    keys.append(f"{prefix.strip('/')}/{rest.split('/')[0]}")
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._object_key(key, MANIFEST_NAME))
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._object_key(key) + "/"):
            for obj in page.get("Contents", []):
                self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])
