"""Streaming token shards back for training: ``StreamingDataset`` + ``DataLoader`` helpers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from vlm_assets._streaming import Stream, StreamingDataset, streaming_dataset
from vlm_assets.storage.disk import private_download


def collate_tokens(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack samples into int64 tensors; copies, since streaming hands out read-only arrays."""
    return {
        key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in ("input_ids", "labels")
    }


def token_dataset(
    uri: str, split: str, *, cache_dir: str | Path | None = None, batch_size: int, shuffle: bool = False, seed: int = 0
) -> StreamingDataset:
    """A ``StreamingDataset`` over a split of a ``token_shards`` artifact (a local directory or ``s3://``).

    A merged artifact (``tokens.json`` lists ``streams``: the splits of its chunks) is read as one
    dataset of those streams. With a ``cache_dir`` the shards are copied or downloaded into
    ``cache_dir/<split>`` (a stream's into ``cache_dir/<split>/<its index>``): give every concurrent
    run its own (streaming keys its shared memory on the local path, so two runs reading one path at
    once collide). Without one, local shards are read in place (single reader). Streaming partitions
    samples across ranks itself (``WORLD_SIZE``/``RANK`` from torchrun), so a distributed sampler must
    not be added on top.
    """
    if uri.startswith("s3://") and cache_dir is None:
        raise ValueError("token_dataset: a cache_dir is required to stream from s3://")
    streams = _streams(uri, split, cache_dir)
    for remote in streams:
        if not remote.startswith("s3://") and not (Path(remote) / "index.json").is_file():
            raise FileNotFoundError(f"{remote}: no MDS index.json (not a token shard split)")
    if cache_dir is None:  # read the local shards in place
        places = [(None, remote) for remote in streams]
    elif len(streams) == 1:  # copy (local) or download (s3) into this run's own directory
        places = [(streams[0], str(Path(cache_dir) / split))]
    else:
        places = [(remote, str(Path(cache_dir) / split / f"{i:06d}")) for i, remote in enumerate(streams)]
    if len(places) == 1:
        ((remote, local),) = places
        return streaming_dataset(
            remote=remote, local=local, split=None, shuffle=shuffle, shuffle_seed=seed, batch_size=batch_size
        )
    return streaming_dataset(
        streams=[Stream(remote=remote, local=local) for remote, local in places],
        shuffle=shuffle,
        shuffle_seed=seed,
        batch_size=batch_size,
    )


def _streams(uri: str, split: str, cache_dir: str | Path | None) -> list[str]:
    """The split's directories: the chunks' a merged artifact lists, else ``<uri>/<split>``."""
    summary = token_summary(uri, cache_dir)
    listed = summary.get("streams", {}).get(split) if summary is not None else None
    return list(listed) if listed else [f"{uri.rstrip('/')}/{split}"]


def token_summary(uri: str, cache_dir: str | Path | None) -> dict | None:
    """The artifact's ``tokens.json`` (downloaded into ``cache_dir`` from S3), or None if it has none."""
    if not uri.startswith("s3://"):
        path = Path(uri) / "tokens.json"
        return json.loads(path.read_text()) if path.is_file() else None
    assert cache_dir is not None
    path = Path(cache_dir) / "tokens.json"
    if not path.is_file():
        _download_summary(uri, path)
    return json.loads(path.read_text())


@dataclasses.dataclass
class TokenLoaders:
    """The train and val loaders over a ``token_shards`` artifact, with its sample length and vocabulary size."""

    train: DataLoader
    val: DataLoader
    max_length: int
    vocab_size: int


def build_token_dataloaders(
    uri: str, local_dir: str | Path, *, batch_size: int, num_workers: int = 0, seed: int = 0
) -> TokenLoaders:
    """Train (shuffled) and val loaders over a ``token_shards`` artifact; ``local_dir`` is per run."""
    summary = token_summary(uri, local_dir)
    if summary is None:
        raise FileNotFoundError(f"{uri}: no tokens.json (not a token_shards artifact)")
    loaders = {
        split: DataLoader(
            token_dataset(
                uri, split, cache_dir=local_dir, batch_size=batch_size, shuffle=(split == "train"), seed=seed
            ),
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_tokens,
        )
        for split in ("train", "val")
    }
    return TokenLoaders(loaders["train"], loaders["val"], summary["max_length"], summary["vocab_size"])


def _download_summary(uri: str, target: Path) -> None:
    from streaming.base.storage import CloudDownloader

    with private_download(target) as tmp:
        CloudDownloader.direct_download(f"{uri.rstrip('/')}/tokens.json", str(tmp), timeout=60)


def reference_batch(uri: str, num_samples: int, cache_dir: str | Path) -> dict[str, torch.Tensor]:
    """Return the first ``num_samples`` validation samples, by index, as one batch.

    It is the same on every rank and process: the batch on which the trainer and the asset check compare losses.
    """
    dataset = token_dataset(uri, "val", cache_dir=cache_dir, batch_size=num_samples)
    if dataset.num_samples < num_samples:
        raise ValueError(f"{uri}: the val split has {dataset.num_samples} samples, fewer than {num_samples}")
    return collate_tokens([dataset[i] for i in range(num_samples)])
