import pytest

from vlm_assets.storage import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    LocalArtifactStore,
    S3ArtifactStore,
)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "store")
    client, bucket = request.getfixturevalue("s3_bucket")
    return S3ArtifactStore(client, bucket, prefix="team/vlm", cache_dir=tmp_path / "s3cache")


def _fill(staging):
    (staging / "sub").mkdir()
    (staging / "a.txt").write_text("alpha")
    (staging / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)


def test_round_trip_with_checksums(store, tmp_path):
    with store.staging_dir("asset/k1") as staging:
        _fill(staging)
        ref = store.commit("asset/k1", staging, metadata={"rows": 3})
    assert store.exists("asset/k1") and ref.metadata == {"rows": 3}
    manifest = store.verify("asset/k1")
    assert set(manifest.files) == {"a.txt", "sub/b.bin"} and manifest.num_bytes == 5 + 25600
    local = store.local_path("asset/k1")
    assert (local / "a.txt").read_text() == "alpha"
    assert (local / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 100
    assert store.ref("asset/k1").data_version == ref.data_version
    if isinstance(store, S3ArtifactStore):
        assert ref.uri.startswith(f"s3://{store.bucket}/team/vlm/asset/k1")


def test_same_content_same_data_version(store):
    versions = []
    for key in ("asset/x", "asset/y"):
        with store.staging_dir(key) as staging:
            _fill(staging)
            versions.append(store.commit(key, staging, {}).data_version)
    assert versions[0] == versions[1]


def test_failure_mid_write_leaves_nothing_visible(store):
    with pytest.raises(RuntimeError, match="writer died"):
        with store.staging_dir("asset/k2") as staging:
            _fill(staging)
            raise RuntimeError("writer died")
    assert not store.exists("asset/k2")
    with pytest.raises(ArtifactNotFoundError):
        store.read_manifest("asset/k2")


def test_failure_during_publish_leaves_nothing_visible(store, monkeypatch):
    """The upload itself dies after some files: the key stays empty, no stray objects remain."""
    if isinstance(store, S3ArtifactStore):
        real_upload, calls = store.client.upload_file, []

        def flaky_upload(*args, **kwargs):
            calls.append(args)
            if len(calls) == 2:
                raise ConnectionError("network dropped")
            return real_upload(*args, **kwargs)

        monkeypatch.setattr(store.client, "upload_file", flaky_upload)
    else:
        monkeypatch.setattr("vlm_assets.storage.artifact_store.os.replace",
                            lambda *a: (_ for _ in ()).throw(ConnectionError("network dropped")))
    with pytest.raises(ConnectionError):
        with store.staging_dir("asset/k3") as staging:
            _fill(staging)
            store.commit("asset/k3", staging, {})
    assert not store.exists("asset/k3")
    if isinstance(store, S3ArtifactStore):
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="team/vlm/asset/k3")
        assert listed.get("KeyCount", 0) == 0
    else:
        assert not (store.root / "asset" / "k3").exists()


def test_corrupted_file_is_detected(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    with store.staging_dir("asset/k4") as staging:
        _fill(staging)
        store.commit("asset/k4", staging, {})
    (store.root / "asset" / "k4" / "a.txt").write_text("tampered")
    with pytest.raises(CorruptArtifactError, match=r"a.txt: content does not match the manifest of 'asset/k4'"):
        store.verify("asset/k4")


def test_empty_artifact_and_escaping_keys_are_refused(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    with store.staging_dir("asset/k5") as staging, pytest.raises(ValueError, match="empty artifact"):
        store.commit("asset/k5", staging, {})
    with pytest.raises(ValueError, match="escapes the store root"):
        store.uri("../outside")
