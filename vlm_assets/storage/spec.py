"""A store as a small JSON-able dict, so worker processes (local or in pods) can open the same store.

Credentials never go into the spec: S3 workers read the standard ``AWS_*`` environment variables.
"""

from typing import Any

from vlm_assets.storage.artifact_store import ArtifactStore, LocalArtifactStore


def store_from_spec(spec: dict[str, Any]) -> ArtifactStore:
    """Build the artifact store a spec dict describes (``ArtifactStoreResource.spec``): local or S3."""
    kind = spec.get("kind")
    if kind == "local":
        return LocalArtifactStore(spec["root"])
    if kind == "s3":
        import boto3

        from vlm_assets.storage.s3_store import S3ArtifactStore

        client = boto3.client("s3", endpoint_url=spec.get("endpoint_url"), region_name=spec.get("region_name"))
        return S3ArtifactStore(client, spec["bucket"], spec.get("prefix", ""), cache_dir=spec.get("cache_dir"))
    raise ValueError(f"store spec: unknown kind {kind!r} (expected 'local' or 's3')")
