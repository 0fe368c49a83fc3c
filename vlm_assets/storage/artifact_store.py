"""Atomic, content-checked artifact directories.

An artifact is a directory of files under a key such as ``occlusion_manifests/3f2a...``. Writers
fill a local staging directory; ``commit`` then publishes the files and, last, a ``_COMPLETE.json``
manifest holding every file's size and sha256 plus free-form metadata. Readers only ever trust a key
whose manifest exists, so a writer that dies half-way leaves nothing visible: the key stays empty.

A complete artifact is never replaced: if two writers commit the same key, the first commit wins and
the second gets the first one's ref (same key = same identity = equivalent content). Leases
(``lease``) keep a second writer from building at all while the first is alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vlm_assets.storage.disk import staged_write
from vlm_assets.storage.lease import Lease, LeaseState
from vlm_assets.storage.locks import host_lock
from vlm_assets.storage.scratch import held_dir

MANIFEST_NAME = "_COMPLETE.json"
_CHUNK = 1 << 20


class ArtifactNotFoundError(FileNotFoundError):
    """No complete artifact exists under the key."""


class CorruptArtifactError(ValueError):
    """An artifact's files do not match the checksums in its manifest."""


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 digest of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ArtifactManifest:
    """What ``_COMPLETE.json`` records: files (relative path -> size, sha256) and metadata.

    ``location``: where the files live below the key ("" = directly; S3 commits use the digest).
    """

    key: str
    files: dict[str, dict[str, Any]]
    metadata: dict[str, Any]
    location: str = ""

    @property
    def digest(self) -> str:
        """The content hash of the whole artifact: the data version Dagster sees."""
        lines = (f"{p}:{f['sha256']}" for p, f in sorted(self.files.items()))
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]

    @property
    def num_bytes(self) -> int:
        """The total size of the artifact's files in bytes."""
        return sum(f["size"] for f in self.files.values())

    def size_problems(self, sizes: dict[str, int]) -> list[str]:
        """The listed files absent from ``sizes`` (path relative to the artifact -> size) or at another size."""
        problems = []
        for rel, expected in self.files.items():
            if rel not in sizes:
                problems.append(f"{rel}: listed in the manifest but missing")
            elif sizes[rel] != expected["size"]:
                problems.append(f"{rel}: {sizes[rel]} bytes, the manifest says {expected['size']}")
        return problems

    def to_json(self) -> str:
        """Return the manifest as JSON text, keys sorted."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArtifactManifest:
        """Parse a manifest from its JSON text."""
        return cls(**json.loads(text))

    @classmethod
    def of_directory(cls, key: str, root: Path, metadata: dict[str, Any]) -> ArtifactManifest:
        """Build the manifest of the files under ``root`` (size and sha256 of each) for ``key``.

        Raises ``ValueError`` if ``root`` is empty or holds a file named like the manifest.
        """
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
    def uri(self, key: str, location: str = "") -> str:
        """Return where the artifact's files live (a path or ``s3://`` URI)."""

    @abstractmethod
    def read_manifest(self, key: str) -> ArtifactManifest:
        """Return the committed manifest; raise ``ArtifactNotFoundError`` if the key is not complete."""

    @abstractmethod
    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> ArtifactManifest:
        """Make ``staging``'s files visible under ``key``, the manifest last, unless a complete
        artifact is already there; returns the manifest that is committed under ``key`` now."""

    @abstractmethod
    def _listed_sizes(self, key: str, manifest: ArtifactManifest) -> dict[str, int]:
        """Sizes of the files the manifest lists, as present in the store (absent files left out)."""

    @abstractmethod
    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        """Return a local directory with the artifact's verified files (downloaded if remote)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the artifact (manifest first, so it is never half-visible)."""

    def quick_verify(self, key: str) -> list[str]:
        """List the problems found without reading any content; empty when intact as far as sizes tell.

        Each listed file must be present with its recorded size (one stat or one listing, whatever the artifact's size).
        ``verify`` re-hashes everything.
        """
        manifest = self.read_manifest(key)
        return manifest.size_problems(self._listed_sizes(key, manifest))

    def lease(self, key: str, holder: dict[str, Any], ttl_s: float, log: Callable[[str], None] | None = None) -> Lease:
        """Return a lease on building ``key`` (see ``vlm_assets.storage.lease``)."""
        return Lease(self, key, holder, ttl_s, log)

    @abstractmethod
    def list_leases(self) -> list[LeaseState]:
        """Return every lease record in the store (its ``holder["key"]`` names the key)."""

    @abstractmethod
    def lease_create(self, key: str, body: bytes) -> str | None:
        """Create the lease record if absent; return its token, or None if one exists."""

    @abstractmethod
    def lease_read(self, key: str) -> LeaseState | None:
        """Return the lease record, its age and token; None if absent."""

    @abstractmethod
    def lease_renew(self, key: str, token: str) -> str | None:
        """Mark the lease fresh if ``token`` still holds it; return the new token, else None."""

    @abstractmethod
    def lease_remove(self, key: str, token: str) -> None:
        """Remove the lease if ``token`` still holds it."""

    def verify(self, key: str, cache_dir: Path | None = None) -> ArtifactManifest:
        """Re-hash every file against the manifest; ``CorruptArtifactError`` names the first bad one."""
        manifest = self.read_manifest(key)
        verify_files(self.local_path(key, cache_dir), manifest)
        return manifest

    @abstractmethod
    def list_complete(self, prefix: str) -> list[str]:
        """Return the keys of the complete artifacts directly under ``prefix`` (e.g. a run's checkpoints), sorted."""

    def exists(self, key: str) -> bool:
        """Return whether a complete artifact is committed under ``key``."""
        try:
            self.read_manifest(key)
        except ArtifactNotFoundError:
            return False
        return True

    def ref(self, key: str) -> ArtifactRef:
        """Return an ``ArtifactRef`` to the artifact committed under ``key``."""
        manifest = self.read_manifest(key)
        return ArtifactRef(key, self.uri(key, manifest.location), manifest.digest, manifest.metadata)

    def commit(self, key: str, staging: Path, metadata: dict[str, Any]) -> ArtifactRef:
        """Publish a finished staging directory under ``key`` atomically; return a ref to what is committed."""
        manifest = self._publish(key, staging, ArtifactManifest.of_directory(key, staging, metadata))
        return ArtifactRef(key, self.uri(key, manifest.location), manifest.digest, manifest.metadata)

    @contextlib.contextmanager
    def staging_dir(self, key: str) -> Iterator[Path]:
        """Yield a scratch directory for building ``key``, removed on exit whatever happens.

        ``held_dir`` removes it also when this process is killed.
        """
        with held_dir(self._staging_root(), prefix=f"{key.replace('/', '-')}-") as tmp:
            yield tmp

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

    def uri(self, key: str, location: str = "") -> str:
        """Return the artifact's directory under the store root."""
        return str(self._dir(key))

    def read_manifest(self, key: str) -> ArtifactManifest:
        """Read the manifest committed in the key's directory; raise ``ArtifactNotFoundError`` if absent."""
        path = self._dir(key) / MANIFEST_NAME
        try:
            return ArtifactManifest.from_json(path.read_text())
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"no complete artifact at {path.parent}") from None

    def _publish(self, key: str, staging: Path, manifest: ArtifactManifest) -> ArtifactManifest:
        target = self._dir(key)
        staging_root = Path(self._staging_root())
        if staging.parent != staging_root:  # not from staging_dir(): copy onto this filesystem first
            copy = Path(tempfile.mkdtemp(dir=staging_root))
            with staged_write(copy, f"artifact {key}"):
                shutil.copytree(staging, copy, dirs_exist_ok=True)
            staging = copy
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        target.parent.mkdir(parents=True, exist_ok=True)
        with host_lock(self._lease_path(key).with_suffix(".publish")):  # one publisher of a key at a time
            with contextlib.suppress(ArtifactNotFoundError):
                return self.read_manifest(key)  # complete already: the first commit wins
            if target.exists():  # an incomplete leftover of a crash: move it aside (atomic), then drop it
                aside = staging_root / f"leftover-{uuid.uuid4().hex}"
                os.rename(target, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(staging, target)  # one rename publishes the files and the manifest together
        return manifest

    def _listed_sizes(self, key: str, manifest: ArtifactManifest) -> dict[str, int]:
        root, sizes = self._dir(key), {}
        for rel in manifest.files:
            with contextlib.suppress(FileNotFoundError):
                sizes[rel] = (root / rel).stat().st_size
        return sizes

    # Leases: O_EXCL creation, mtime as the renewal time; read-check-remove runs under an flock on a
    # guard file so that two attempts taking over one expired lease cannot both succeed. (flock alone
    # would be released by the kernel when the step process dies, while its orphaned workers may still
    # be training: the lease must outlive the process until it expires.)
    def _lease_path(self, key: str) -> Path:
        path = self.root / ".leases" / (key.strip("/").replace("/", "__") + ".json")
        path.parent.mkdir(exist_ok=True)
        return path

    @contextlib.contextmanager
    def _lease_guard(self, key: str) -> Iterator[Path]:
        path = self._lease_path(key)
        with host_lock(path.with_suffix(".guard")):
            yield path

    def list_leases(self) -> list[LeaseState]:
        """Return the state of every lease file under ``.leases``."""
        leases = (self.root / ".leases").glob("*.json")
        return [state for path in sorted(leases) if (state := self._lease_state(path)) is not None]

    def lease_create(self, key: str, body: bytes) -> str | None:
        """Create the key's lease file exclusively; return its ``attempt`` id, or None if one exists."""
        with self._lease_guard(key) as path:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "wb") as f:
                f.write(body)
        return json.loads(body)["attempt"]

    def _lease_state(self, path: Path) -> LeaseState | None:
        try:
            holder, mtime = json.loads(path.read_text()), path.stat().st_mtime
        except (FileNotFoundError, json.JSONDecodeError):  # absent, or a create not yet written
            return None
        return LeaseState(holder, max(0.0, time.time() - mtime), holder.get("attempt", ""))

    def lease_read(self, key: str) -> LeaseState | None:
        """Return the key's lease state; None if absent."""
        with self._lease_guard(key) as path:
            return self._lease_state(path)

    def lease_renew(self, key: str, token: str) -> str | None:
        """Touch the key's lease file if ``token`` still holds it; return ``token``, else None."""
        with self._lease_guard(key) as path:
            state = self._lease_state(path)
            if state is None or state.token != token:
                return None
            os.utime(path)
            return token

    def lease_remove(self, key: str, token: str) -> None:
        """Remove the key's lease file if ``token`` still holds it."""
        with self._lease_guard(key) as path:
            state = self._lease_state(path)
            if state is not None and state.token == token:
                path.unlink()

    def local_path(self, key: str, cache_dir: Path | None = None) -> Path:
        """Return the artifact's directory in the store, once its manifest is found."""
        self.read_manifest(key)
        return self._dir(key)

    def list_complete(self, prefix: str) -> list[str]:
        """Return the keys of the complete artifacts directly under ``prefix``, sorted."""
        base = self._dir(prefix)
        return sorted(f"{prefix.strip('/')}/{p.parent.name}" for p in base.glob(f"*/{MANIFEST_NAME}"))

    def delete(self, key: str) -> None:
        """Remove the artifact's directory, the manifest first."""
        target = self._dir(key)
        (target / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)


def verify_files(root: Path, manifest: ArtifactManifest) -> None:
    """Raise ``CorruptArtifactError`` naming the first file under ``root`` missing or differing from ``manifest``."""
    for rel, expected in manifest.files.items():
        path = root / rel
        if not path.is_file():
            raise CorruptArtifactError(f"{path}: listed in the manifest of '{manifest.key}' but missing")
        if path.stat().st_size != expected["size"] or sha256_file(path) != expected["sha256"]:
            raise CorruptArtifactError(f"{path}: content does not match the manifest of '{manifest.key}'")
