"""Atomic, content-checked artifact directories.

An artifact is a directory of files under a key such as ``occlusion_manifests/3f2a...``. Writers
fill a local staging directory; ``commit`` then publishes the files and, last, a ``_COMPLETE.json``
manifest holding every file's size and sha256 plus free-form metadata. Readers only ever trust a key
whose manifest exists, so a writer that dies half-way leaves nothing visible: the key stays empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST_NAME = "_COMPLETE.json"
_CHUNK = 1 << 20


class ArtifactNotFoundError(FileNotFoundError):
    """No complete artifact exists under the key."""


class CorruptArtifactError(ValueError):
    """An artifact's files do not match the checksums in its manifest."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ArtifactManifest:
    """What ``_COMPLETE.json`` records: files (relative path -> size, sha256) and metadata."""

    key: str
    files: dict[str, dict[str, Any]]
    metadata: dict[str, Any]

    @property
    def digest(self) -> str:
        """Content hash of the whole artifact: the data version Dagster sees."""
        lines = (f"{p}:{f['sha256']}" for p, f in sorted(self.files.items()))
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]

    @property
    def num_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArtifactManifest:
        return cls(**json.loads(text))

    @classmethod
    def of_directory(cls, key: str, root: Path, metadata: dict[str, Any]) -> ArtifactManifest:
        files = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if rel == MANIFEST_NAME:
                raise ValueError(f"{root}: '{MANIFEST_NAME}' is reserved for the store")
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if not files:
            raise ValueError(f"refusing to commit an empty artifact under '{key}'")
        return cls(key=key, files=files, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    """A small, picklable pointer to a committed artifact: what assets hand downstream."""

    key: str
    uri: str
    data_version: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class ArtifactStore(ABC):
    """A place for artifact directories: local filesystem or any S3-compatible object store."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """Where the artifact's files live (a path or ``s3://`` URI)."""

    @abstractmethod
    def read_manifest(self, key: str) -> ArtifactManifest:
        """The committed manifest; ``ArtifactNotFoundError`` if the key is not complete."""

    @abstractmethod
    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> None:
        """Make ``staging``'s files visible under ``key``; the manifest goes last."""

    @abstractmethod
    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        """A local directory with the artifact's verified files (downloaded if remote)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the artifact (manifest first, so it is never half-visible)."""

    def verify(self, key: str, cache_dir: Path | None = None) -> ArtifactManifest:
        """Re-hash every file against the manifest; ``CorruptArtifactError`` names the first bad one."""
        manifest = self.read_manifest(key)
        verify_files(self.local_path(key, cache_dir), manifest)
        return manifest

    @abstractmethod
    def list_complete(self, prefix: str) -> list[str]:
        """Keys of the complete artifacts directly under ``prefix`` (e.g. a run's checkpoints), sorted."""

    def exists(self, key: str) -> bool:
        try:
            self.read_manifest(key)
        except ArtifactNotFoundError:
            return False
        return True

    def ref(self, key: str) -> ArtifactRef:
        manifest = self.read_manifest(key)
        return ArtifactRef(key, self.uri(key), manifest.digest, manifest.metadata)

    def commit(self, key: str, staging: Path, metadata: dict[str, Any]) -> ArtifactRef:
        """Publish a finished staging directory under ``key`` atomically."""
        manifest = ArtifactManifest.of_directory(key, staging, metadata)
        self._publish(key, staging, manifest)
        return ArtifactRef(key, self.uri(key), manifest.digest, manifest.metadata)

    @contextlib.contextmanager
    def staging_dir(self, key: str) -> Iterator[Path]:
        """A scratch directory for building ``key``; removed on exit, whatever happens."""
        tmp = Path(tempfile.mkdtemp(prefix=f"{key.replace('/', '-')}-", dir=self._staging_root()))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _staging_root(self) -> str | None:
        return None


class LocalArtifactStore(ArtifactStore):
    """Artifacts under a local directory; publishing is one atomic ``rename`` of the directory."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise ValueError(f"artifact key '{key}' escapes the store root {self.root}")
        return path

    def _staging_root(self) -> str:
        staging = self.root / ".staging"
        staging.mkdir(exist_ok=True)
        return str(staging)

    def uri(self, key: str) -> str:
        return str(self._dir(key))

    def read_manifest(self, key: str) -> ArtifactManifest:
        path = self._dir(key) / MANIFEST_NAME
        try:
            return ArtifactManifest.from_json(path.read_text())
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"no complete artifact at {path.parent}") from None

    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> None:
        target = self._dir(key)
        staging_root = Path(self._staging_root())
        if staging.parent != staging_root:  # not from staging_dir(): copy onto this filesystem first
            copy = Path(tempfile.mkdtemp(dir=staging_root))
            shutil.copytree(staging, copy, dirs_exist_ok=True)
            staging = copy
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # an incomplete leftover of a crash, or a re-commit of the same key
            shutil.rmtree(target)
        # One rename publishes the files and the manifest together.
        os.replace(staging, target)

    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        self.read_manifest(key)
        return self._dir(key)

    def list_complete(self, prefix: str) -> list[str]:
        base = self._dir(prefix)
        return sorted(f"{prefix.strip('/')}/{p.parent.name}" for p in base.glob(f"*/{MANIFEST_NAME}"))

    def delete(self, key: str) -> None:
        target = self._dir(key)
        (target / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)


def verify_files(root: Path, manifest: ArtifactManifest) -> None:
    for rel, expected in manifest.files.items():
        path = root / rel
        if not path.is_file():
            raise CorruptArtifactError(f"{path}: listed in the manifest of '{manifest.key}' but missing")
        if path.stat().st_size != expected["size"] or sha256_file(path) != expected["sha256"]:
            raise CorruptArtifactError(f"{path}: content does not match the manifest of '{manifest.key}'")

