"""Artifacts in any S3-compatible object store (AWS S3, MinIO, Ceph, R2...).

A commit uploads its files under ``s3://<bucket>/<prefix>/<key>/<digest>/`` (content-addressed) and
then puts the ``_COMPLETE.json`` manifest at ``<key>/_COMPLETE.json`` with ``If-None-Match: *``: that
manifest is the pointer readers follow to the files (its ``location``). S3 PUTs of single objects are
atomic and the conditional PUT lets exactly one commit of a key win, so a reader never sees a
half-written or half-replaced artifact; a losing commit removes its own files (unless they are the
winner's, same digest). A failed upload deletes what it had put.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from vlm_assets.storage.artifact_store import (
    MANIFEST_NAME,
    ArtifactManifest,
    ArtifactNotFoundError,
    ArtifactStore,
    verify_files,
)
from vlm_assets.storage.lease import LeaseState


def _precondition_failed(err: ClientError) -> bool:
    return err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict", "412")


class S3ArtifactStore(ArtifactStore):
    """An artifact store in an S3-compatible bucket, under ``prefix``."""

    def __init__(self, client: Any, bucket: str, prefix: str = "", cache_dir: str | os.PathLike[str] | None = None):
        """``client`` is a boto3 S3 client (with ``endpoint_url`` for non-AWS stores). ``cache_dir`` holds
        verified local copies for readers."""
        if not bucket:
            raise ValueError("S3ArtifactStore: 'bucket' must be set")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "vlm_assets-s3-cache")

    def _staging_root(self) -> str:
        """Builds are staged under ``$VLM_ASSETS_HOME/staging``, not the system temp dir: on a cluster
        that directory is the volume the run pod shares with the training pods (whose rank 0 writes
        the artifact's files into it) before the upload."""
        from vlm_assets.paths import home_dir

        root = home_dir() / "staging"
        root.mkdir(parents=True, exist_ok=True)
        return str(root)

    def _object_key(self, key: str, rel: str = "") -> str:
        parts = [p for p in (self.prefix, key.strip("/"), rel) if p]
        return "/".join(parts)

    def uri(self, key: str, location: str = "") -> str:
        """Return the artifact's ``s3://`` URI (below ``location`` when given)."""
        return f"s3://{self.bucket}/{self._object_key(key, location)}"

    def _file_key(self, key: str, manifest: ArtifactManifest, rel: str) -> str:
        return self._object_key(key, f"{manifest.location}/{rel}" if manifest.location else rel)

    def read_manifest(self, key: str) -> ArtifactManifest:
        """Read the committed manifest object; raise ``ArtifactNotFoundError`` if absent."""
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key, MANIFEST_NAME))
        except self.client.exceptions.NoSuchKey:
            raise ArtifactNotFoundError(f"no complete artifact at {self.uri(key)}") from None
        return ArtifactManifest.from_json(obj["Body"].read().decode())

    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> ArtifactManifest:
        manifest = dataclasses.replace(manifest, location=manifest.digest)
        uploaded = []
        try:
            for rel in manifest.files:
                object_key = self._file_key(key, manifest, rel)
                self.client.upload_file(str(staging / rel), self.bucket, object_key)
                uploaded.append(object_key)
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._object_key(key, MANIFEST_NAME),
                Body=manifest.to_json().encode(),
                ContentType="application/json",
                IfNoneMatch="*",
            )
            return manifest
        except ClientError as err:
            if not _precondition_failed(err):
                self._delete_objects(uploaded)
                raise
            winner = self.read_manifest(key)  # another commit of this key came first: it stays
            if winner.location != manifest.location:
                self._delete_objects(uploaded)
            return winner
        except BaseException:
            self._delete_objects(uploaded)
            raise

    def _delete_objects(self, object_keys: list[str]) -> None:
        for object_key in object_keys:
            self.client.delete_object(Bucket=self.bucket, Key=object_key)

    def _listed_sizes(self, key: str, manifest: ArtifactManifest) -> dict[str, int]:
        base = self._object_key(key, manifest.location) + "/"
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                sizes[obj["Key"][len(base) :]] = obj["Size"]
        return {rel: sizes[rel] for rel in manifest.files if rel in sizes}

    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        """Return a local copy of the artifact under the cache directory, downloading and verifying it if needed.

        The copy sits under its digest; a download is verified against the manifest before it is moved into place.
        """
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
                self.client.download_file(self.bucket, self._file_key(key, manifest, rel), str(tmp / rel))
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
        """Return the keys of the complete artifacts directly under ``prefix``, sorted."""
        base = self._object_key(prefix) + "/"
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(base) :]
                if rest.count("/") == 1 and rest.endswith("/" + MANIFEST_NAME):
                    keys.append(f"{prefix.strip('/')}/{rest.split('/')[0]}")
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Delete the artifact's manifest object first, then every object under its key."""
        self.client.delete_object(Bucket=self.bucket, Key=self._object_key(key, MANIFEST_NAME))
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._object_key(key) + "/"):
            for obj in page.get("Contents", []):
                self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])

    # Leases: S3 conditional writes (If-None-Match to create, If-Match on the ETag to renew/remove).
    def _lease_key(self, key: str) -> str:
        return self._object_key(".leases", key.strip("/").replace("/", "__") + ".json")

    def list_leases(self) -> list[LeaseState]:
        """Return the state of every lease object under ``.leases``."""
        prefix, states = self._object_key(".leases") + "/", []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"][len(prefix) :].removesuffix(".json").replace("__", "/")
                if (state := self.lease_read(key)) is not None:
                    states.append(state)
        return states

    def lease_create(self, key: str, body: bytes) -> str | None:
        """Put the key's lease object only if absent; return its ETag, or None if one exists."""
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self._lease_key(key), Body=body, IfNoneMatch="*")[
                "ETag"
            ]
        except ClientError as err:
            if _precondition_failed(err):
                return None
            raise

    def lease_read(self, key: str) -> LeaseState | None:
        """Return the key's lease state (its age from the object's last modification); None if absent."""
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._lease_key(key))
        except self.client.exceptions.NoSuchKey:
            return None
        age = (dt.datetime.now(dt.UTC) - obj["LastModified"]).total_seconds()
        return LeaseState(json.loads(obj["Body"].read()), max(0.0, age), obj["ETag"])

    def lease_renew(self, key: str, token: str) -> str | None:
        """Rewrite the key's lease object if ``token`` still matches its ETag; return the new ETag, else None."""
        state = self.lease_read(key)
        if state is None or state.token != token:
            return None
        try:
            return self.client.put_object(
                Bucket=self.bucket, Key=self._lease_key(key), Body=json.dumps(state.holder).encode(), IfMatch=token
            )["ETag"]
        except ClientError as err:
            if _precondition_failed(err) or err.response.get("Error", {}).get("Code") == "NoSuchKey":
                return None
            raise

    def lease_remove(self, key: str, token: str) -> None:
        """Delete the key's lease object if ``token`` still matches its ETag."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._lease_key(key), IfMatch=token)
        except ClientError as err:
            if not _precondition_failed(err) and err.response.get("Error", {}).get("Code") != "NoSuchKey":
                raise
