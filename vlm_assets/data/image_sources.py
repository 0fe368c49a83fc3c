"""10-class image sources, decoded to uint8 arrays: CIFAR-10 tarball, Fashion-MNIST idx, image folders.

Every loader returns an ``ImageSource`` with the class names the source itself carries, a train and
an eval split, and for each image an ``origin`` string (file + record) that error messages and
manifests use to point back at the source. Bad input raises ``ValueError`` naming the file/record.
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclasses.dataclass
class ImageSplit:
    """The images of one split, their class labels and where each came from in the source."""

    images: np.ndarray  # (N, H, W, C) uint8, C = 1 (grey) or 3 (RGB)
    labels: np.ndarray  # (N,) int64 class indices
    origins: list[str]  # per image: "<file>#<record>" in the source

    def __post_init__(self):
        assert len(self.images) == len(self.labels) == len(self.origins)


@dataclasses.dataclass
class ImageSource:
    """A labelled image source: its name, class names, and its train and eval splits."""

    name: str
    class_names: list[str]
    train: ImageSplit
    eval: ImageSplit


# --- CIFAR-10 (python tarball) -------------------------------------------------------------------

_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_EVAL = ["test_batch"]


def load_cifar10_tarball(path: Path) -> ImageSource:
    """Read ``cifar-10-python.tar.gz`` (the official layout: ``cifar-10-batches-py/<batch>`` pickles)."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            missing = [b for b in ["batches.meta", *_CIFAR_TRAIN, *_CIFAR_EVAL] if b not in members]
            if missing:
                raise ValueError(f"{path}: not a CIFAR-10 python tarball, missing member(s) {missing}")

            def unpickle(name: str) -> dict:
                try:
                    return pickle.load(tar.extractfile(members[name]), encoding="bytes")
                except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
                    raise ValueError(f"{path}: member '{members[name].name}' is corrupt: {err}") from err

            meta = unpickle("batches.meta")
            class_names = [n.decode() for n in meta[b"label_names"]]
            splits = []
            for batches in (_CIFAR_TRAIN, _CIFAR_EVAL):
                images, labels, origins = [], [], []
                for name in batches:
                    batch = unpickle(name)
                    data = np.asarray(batch[b"data"], dtype=np.uint8)
                    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(batch[b"labels"]):
                        raise ValueError(
                            f"{path}: member '{members[name].name}' has data of shape {data.shape}, "
                            f"expected (N, 3072) with one label per row"
                        )
                    images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
                    labels.extend(batch[b"labels"])
                    origins.extend(f"{members[name].name}#{i}" for i in range(len(data)))
                splits.append(ImageSplit(np.concatenate(images), np.asarray(labels, np.int64), origins))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise ValueError(f"{path}: corrupt or truncated CIFAR-10 tarball: {err}") from err
    source = ImageSource("CIFAR-10", class_names, *splits)
    _check_labels(source, str(path))
    return source


# --- Fashion-MNIST (idx files) -------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: Path) -> np.ndarray:
    """Parse an (optionally gzipped) idx file; truncated or malformed files raise ``ValueError``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path) as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"{path}: corrupt or truncated gzip: {err}") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file of unsigned bytes (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        raise ValueError(f"{path}: truncated idx file, {len(raw)} bytes for shape {shape} (expected {expected})")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def load_fashion_mnist(directory: Path) -> ImageSource:
    """Read ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` from a directory."""
    splits = []
    for prefix in ("train", "t10k"):
        image_file = _first_existing(directory, f"{prefix}-images-idx3-ubyte")
        label_file = _first_existing(directory, f"{prefix}-labels-idx1-ubyte")
        images, labels = read_idx(image_file), read_idx(label_file)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{image_file}: {images.shape} images do not match {labels.shape} labels in {label_file}")
        origins = [f"{image_file.name}#{i}" for i in range(len(images))]
        splits.append(ImageSplit(images[..., None], labels.astype(np.int64), origins))
    source = ImageSource("Fashion-MNIST", list(FASHION_MNIST_CLASSES), *splits)
    _check_labels(source, str(directory))
    return source


def fashion_mnist_files() -> list[str]:
    """Return the file names of the Fashion-MNIST idx files (train and test images and labels)."""
    return [f"{p}-{k}-ubyte.gz" for p in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]


def _first_existing(directory: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory}: neither {stem}.gz nor {stem} exists")


# --- Image folders -------------------------------------------------------------------------------

_TRAIN_DIRS = ("train",)
_EVAL_DIRS = ("test", "eval", "validation", "val")


def load_image_folder(
    root: Path,
    resize_to: int | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> ImageSource:
    """Read ``root/train/<class>/*`` and ``root/{test,eval,validation,val}/<class>/*``.

    Class names are the sub-folder names of ``train`` (sorted). All images must share one size unless
    ``resize_to`` is set (then each is resized to a square of that side). Grey and RGBA become RGB.
    With only ``train/``, a seeded, per-class ``validation_fraction`` of it becomes the eval split
    (said through ``log``).
    """
    train_dir = _pick_dir(root, _TRAIN_DIRS)
    class_names = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
    if not class_names:
        raise ValueError(f"{train_dir}: unknown class folder layout, expected one sub-folder per class")
    if not any((root / name).is_dir() for name in _EVAL_DIRS):
        train = _read_split(train_dir, class_names, resize_to)
        keep, held = stratified_split(train.labels, validation_fraction, seed)
        log(
            f"{root}: no {'/'.join(_EVAL_DIRS)} folder; holding out {len(held)} of {len(train.labels)} train images "
            f"({validation_fraction:.0%} per class, seed {seed}) as the validation split"
        )
        return ImageSource(root.name, class_names, _take(train, keep), _take(train, held))
    eval_dir = _pick_dir(root, _EVAL_DIRS)
    eval_classes = sorted(d.name for d in eval_dir.iterdir() if d.is_dir())
    if eval_classes != class_names:
        raise ValueError(f"{eval_dir}: class folders {eval_classes} differ from {train_dir}'s {class_names}")
    splits = [_read_split(d, class_names, resize_to) for d in (train_dir, eval_dir)]
    size = {s.images.shape[1:] for s in splits}
    if len(size) > 1:
        raise ValueError(f"{root}: train and eval images differ in size {sorted(size)}; set resize_to")
    return ImageSource(root.name, class_names, *splits)


def load_source(
    kind: str,
    uri: str | None,
    downloads: Path,
    *,
    md5: str | None = None,
    resize_to: int | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> ImageSource:
    """Load the images of ``kind`` at ``uri``, downloaded into ``downloads`` once.

    ``kind``: ``cifar10`` (the python tarball, its md5 checked), ``fashion_mnist`` (the idx files) or
    ``image_folder``. ``uri``: a URL or a local path; unset, the official one.
    """
    from vlm_assets.data.download import fetch

    if kind == "cifar10":
        uri = uri or CIFAR10_URL
        return load_cifar10_tarball(
            fetch(uri, downloads, md5=md5 or (CIFAR10_MD5 if uri == CIFAR10_URL else None), log=log)
        )
    if kind == "fashion_mnist":
        uri = uri or FASHION_MNIST_URL
        if uri.startswith(("http://", "https://")):
            files = [fetch(uri.rstrip("/") + "/" + name, downloads, log=log) for name in fashion_mnist_files()]
            return load_fashion_mnist(files[0].parent)
        return load_fashion_mnist(fetch(uri, downloads))
    if uri is None:
        raise ValueError("an image_folder source needs its folder (source_uri)")
    return load_image_folder(
        fetch(uri, downloads), resize_to=resize_to, validation_fraction=validation_fraction, seed=seed, log=log
    )


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held-out) sorted indices: ``round(fraction x n_c)`` of each class held out, at least one."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    held = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        if len(members) < 2:
            raise ValueError(f"class {int(cls)} has {len(members)} image(s): too few to hold one out for validation")
        count = min(max(1, round(fraction * len(members))), len(members) - 1)
        held.append(rng.permutation(members)[:count])
    held_out = np.sort(np.concatenate(held))
    return np.setdiff1d(np.arange(len(labels)), held_out), held_out


def _take(split: ImageSplit, index: np.ndarray) -> ImageSplit:
    return ImageSplit(split.images[index], split.labels[index], [split.origins[i] for i in index])


def _pick_dir(root: Path, names: tuple[str, ...]) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    for name in names:
        if (root / name).is_dir():
            return root / name
    found = sorted(p.name for p in root.iterdir())
    raise ValueError(
        f"{root}: unknown class folder layout, expected a sub-folder named one of {list(names)} "
        f"holding one folder per class; found {found}"
    )


def _read_split(split_dir: Path, class_names: list[str], resize_to: int | None) -> ImageSplit:
    images, labels, origins = [], [], []
    shape = None
    for index, name in enumerate(class_names):
        files = sorted(p for p in (split_dir / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"{split_dir / name}: class folder holds no images ({sorted(IMAGE_SUFFIXES)})")
        for file in files:
            try:
                with Image.open(file) as img:
                    img = img.convert("RGB")
                    if resize_to:
                        img = img.resize((resize_to, resize_to), Image.Resampling.BICUBIC)
                    array = np.asarray(img, np.uint8)
            except (UnidentifiedImageError, OSError) as err:
                raise ValueError(f"{file}: unreadable image: {err}") from err
            if shape is None:
                shape = array.shape
            elif array.shape != shape:
                raise ValueError(
                    f"{file}: size {array.shape[1]}x{array.shape[0]} differs from "
                    f"{shape[1]}x{shape[0]} of the first image; set resize_to"
                )
            images.append(array)
            labels.append(index)
            origins.append(str(file.relative_to(split_dir.parent)))
    return ImageSplit(np.stack(images), np.asarray(labels, np.int64), origins)


def _check_labels(source: ImageSource, where: str) -> None:
    for split_name, split in (("train", source.train), ("eval", source.eval)):
        bad = np.flatnonzero((split.labels < 0) | (split.labels >= len(source.class_names)))
        if len(bad):
            raise ValueError(
                f"{where}: record {split.origins[bad[0]]} of the {split_name} split has label "
                f"{split.labels[bad[0]]}, outside 0..{len(source.class_names) - 1}"
            )
