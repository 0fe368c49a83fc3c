import gzip
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_assets.data.download import fetch, md5_file
from vlm_assets.data.image_sources import load_cifar10_tarball, load_fashion_mnist, load_image_folder, read_idx
from vlm_assets_tests.conftest import CIFAR10_CLASSES, real_cifar_images, serve_directory, write_cifar_tarball


@pytest.fixture
def cifar_tarball(tmp_path, offline_data) -> Path:
    images, labels = real_cifar_images(offline_data)
    return write_cifar_tarball(
        tmp_path / "served" / "cifar-10-python.tar.gz", *_mkdir(tmp_path / "served", images, labels)
    )


def _mkdir(path, *rest):
    path.mkdir(parents=True, exist_ok=True)
    return rest


def test_fashion_mnist_real_files(offline_data):
    source = load_fashion_mnist(offline_data / "fashion-mnist")
    assert source.train.images.shape == (60000, 28, 28, 1)
    assert source.eval.images.shape == (10000, 28, 28, 1)
    assert np.bincount(source.train.labels).tolist() == [6000] * 10
    assert source.class_names[0] == "T-shirt/top" and source.class_names[9] == "Ankle boot"
    assert source.train.origins[5] == "train-images-idx3-ubyte.gz#5"


def test_cifar_tarball_downloaded_once_over_http_and_checksum_verified(cifar_tarball, tmp_path, offline_data):
    md5 = md5_file(cifar_tarball)
    with serve_directory(cifar_tarball.parent) as (url, requests):
        first = fetch(f"{url}/cifar-10-python.tar.gz", tmp_path / "cache", md5=md5)
        second = fetch(f"{url}/cifar-10-python.tar.gz", tmp_path / "cache", md5=md5)
    assert first == second and len(requests) == 1  # cached: the second call made no request
    source = load_cifar10_tarball(first)
    images, labels = real_cifar_images(offline_data)
    assert source.class_names == CIFAR10_CLASSES
    np.testing.assert_array_equal(source.train.images[:20], images)
    np.testing.assert_array_equal(source.train.labels[:20], labels)
    assert len(source.train.images) == 100 and len(source.eval.images) == 20


def test_download_with_wrong_checksum_names_url_and_caches_nothing(cifar_tarball, tmp_path):
    wrong = r"cifar-10-python.tar.gz: downloaded file has md5 .* expected 0+"
    with serve_directory(cifar_tarball.parent) as (url, _), pytest.raises(ValueError, match=wrong):
        fetch(f"{url}/cifar-10-python.tar.gz", tmp_path / "cache", md5="0" * 32)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_truncated_cifar_tarball_names_the_file(cifar_tarball, tmp_path):
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(cifar_tarball.read_bytes()[: cifar_tarball.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated.tar.gz: corrupt or truncated CIFAR-10 tarball"):
        load_cifar10_tarball(truncated)


def test_tarball_missing_members_is_named(tmp_path):
    import tarfile

    path = tmp_path / "other.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(__file__, arcname="something.py")
    with pytest.raises(ValueError, match=r"other.tar.gz: not a CIFAR-10 python tarball, missing member\(s\)"):
        load_cifar10_tarball(path)


@pytest.mark.slow  # reads the whole Fashion-MNIST idx files
def test_truncated_idx_file_names_the_file(offline_data, tmp_path):
    raw = gzip.decompress((offline_data / "fashion-mnist" / "t10k-images-idx3-ubyte.gz").read_bytes())
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz: truncated idx file"):
        read_idx(bad)
    bad.write_bytes(gzip.compress(raw)[:5000])  # a cut gzip stream
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz: corrupt or truncated gzip"):
        read_idx(bad)


def _image_folder(root: Path, offline: Path, sizes=None) -> Path:
    images, labels = real_cifar_images(offline)
    for split in ("train", "test"):
        for i, (img, label) in enumerate(zip(images, labels)):
            folder = root / split / CIFAR10_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            pil = Image.fromarray(img)
            if sizes and i in sizes:
                pil = pil.resize(sizes[i])
            pil.save(folder / f"{i:02d}.png")
    return root


def test_image_folder_classes_come_from_folders(tmp_path, offline_data):
    source = load_image_folder(_image_folder(tmp_path / "imgs", offline_data))
    assert source.class_names == sorted({CIFAR10_CLASSES[i] for i in real_cifar_images(offline_data)[1]})
    assert source.train.images.shape == (20, 32, 32, 3)


def test_image_folder_unknown_layout_and_bad_files(tmp_path, offline_data):
    flat = tmp_path / "flat"
    (flat / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"flat: unknown class folder layout.*found \['cat'\]"):
        load_image_folder(flat)
    root = _image_folder(tmp_path / "mixed", offline_data, sizes={5: (40, 40)})
    with pytest.raises(ValueError, match=r"05.png: size 40x40 differs from 32x32.*resize_to"):
        load_image_folder(root)
    assert load_image_folder(root, resize_to=24).train.images.shape == (20, 24, 24, 3)
    broken = next((root / "train").rglob("*.png"))
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=rf"{broken.name}: unreadable image"):
        load_image_folder(root, resize_to=24)


def test_stratified_split_is_seeded_and_keeps_every_class():
    from vlm_assets.data.image_sources import stratified_split

    labels = np.repeat(np.arange(3), [10, 4, 2])
    keep, held = stratified_split(labels, 0.25, seed=3)
    assert np.bincount(labels[held]).tolist() == [2, 1, 1] and len(keep) + len(held) == len(labels)
    assert not set(keep) & set(held)
    assert np.array_equal(stratified_split(labels, 0.25, seed=3)[1], held)
    with pytest.raises(ValueError, match="class 0 has 1 image"):
        stratified_split(np.array([0, 1, 1]), 0.5, seed=0)
