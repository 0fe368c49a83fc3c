"""The one shim needed to import mosaicml-streaming without torchvision.

``streaming`` 0.13 imports ``streaming.vision`` (torchvision datasets) from its package ``__init__``,
and torchvision has no CPU build here (see ../shared/STACK.md). We never use its vision datasets, so an
empty placeholder module is registered before the first ``import streaming``. Import streaming only
through this module.
"""

import os
import sys
import tempfile
import traceback
import types
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from pathlib import Path
from time import sleep

import torch.distributed

if "streaming.vision" not in sys.modules:
    sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")

import streaming  # noqa: E402
from streaming import LocalDataset, MDSWriter, Stream, StreamingDataset  # noqa: E402
from streaming.base.dataset import TICK, _ShardState  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402
from streaming.base.world import World  # noqa: E402

__all__ = [
    "LocalDataset",
    "MDSWriter",
    "Stream",
    "StreamingDataset",
    "clean_stale_shared_memory",
    "registration_lock_path",
    "streaming",
    "streaming_dataset",
]

from vlm_assets.launch.spec import SHARED_HOST_ENV  # noqa: E402
from vlm_assets.storage.disk import space_checked  # noqa: E402
from vlm_assets.storage.locks import host_lock  # noqa: E402


class _Dataset(StreamingDataset):
    """``StreamingDataset`` whose shard downloads' errors end the iteration with that error.

    Streaming downloads ahead in two threads per epoch and re-raises a thread's error in the future's
    done callback, where ``concurrent.futures`` only logs it; its sample loop then stops as though the
    rank's partition were exhausted, and a thread that failed never reports its exit, which the epoch's
    end and the next epoch's start wait for, forever. Streaming has no hook into its threads but that
    callback, so their bodies, the sample loop and the shard download are wrapped here: a failed thread
    keeps its error and reports its exit, and the first error is raised (a full disk as
    ``DiskFullError``, naming the shard cache, also when the reading thread downloads the shard itself)
    where the sample loop stops, at the next sample, or at the next epoch's start when the consumer had
    stopped reading early (a validation's ``limit_val_batches``).
    """

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        with space_checked(Path(self.streams[self.stream_per_shard[shard_id]].local), "token shards"):
            try:
                super().prepare_shard(shard_id, blocking)
            except BaseException as error:
                # A download that failed leaves the shard PREPARING in the workers' shared state, and a
                # peer waiting for it would wait forever: give it back (only when this call was its
                # downloader), so that the peer downloads it itself, or fails alike.
                downloading = Stream.prepare_shard.__code__
                if any(frame.f_code is downloading for frame, _ in traceback.walk_tb(error.__traceback__)):
                    with self._cache_filelock:
                        if self._shard_states[shard_id] == _ShardState.PREPARING:
                            self._shard_states[shard_id] = _ShardState.REMOTE
                raise

    def _keep(self, error: BaseException) -> None:
        if getattr(self, "_thread_error", None) is None:  # a second thread's error is a consequence
            self._thread_error = (error, error.__traceback__)
        self._event.set()  # as streaming does: its other threads stop

    def _prepare_thread(self, it) -> None:
        self._run_thread(super()._prepare_thread, it)

    def _ready_thread(self, it) -> None:
        self._run_thread(self._wait_for_shards, it)

    def _wait_for_shards(self, it) -> None:
        """Streaming's ready loop, which also prepares a shard that went back to REMOTE while it waited.

        Written out because streaming's loop checks for REMOTE once, before it waits for LOCAL: a peer's
        failed download (given back by ``prepare_shard``) would leave it waiting forever.
        """
        while not (it.should_exit() or it.ready_index == it.total or self._event.is_set()):
            if self.predownload is not None and self.predownload < it.ready_index - it.yield_index:
                sleep(TICK)
                continue
            sample_id = it.sample_ids[it.ready_index]
            if sample_id != -1:
                shard_id, _ = self.spanner[sample_id]
                while self._shard_states[shard_id] != _ShardState.LOCAL:
                    if self._event.is_set():
                        break
                    if self._shard_states[shard_id] == _ShardState.REMOTE:
                        self.prepare_shard(shard_id, False)
                    else:
                        sleep(TICK)
            it.ready_index += 1
        it.on_exit()

    def _run_thread(self, body, it) -> None:
        try:
            body(it)
        except BaseException as error:
            self._keep(error)
            it.on_exit()
            raise

    def on_exception(self, future: Future) -> None:
        """Nothing: each thread keeps its own error (``_run_thread``); streaming's would re-raise it into
        ``concurrent.futures``' log."""

    def _raise_thread_error(self) -> None:
        if getattr(self, "_thread_error", None) is not None:
            error, tb = self._thread_error
            raise error.with_traceback(tb)  # the thread's frames, not those of each earlier raise

    def get_item(self, sample_id: int, retry: int = 7):
        try:
            return super().get_item(sample_id, retry)
        except RuntimeError:  # streaming's "Background thread failed" says nothing of what failed
            self._raise_thread_error()
            raise

    def _each_sample_id(self, it):
        yield from super()._each_sample_id(it)
        self._raise_thread_error()  # before the epoch's end waits for the threads

    def __iter__(self):
        if hasattr(self, "_iterator"):  # streaming's start waits for them too, then raises a bare error
            self._iterator.exit()  # the last epoch's threads, failed ones included, report their exit
        self._raise_thread_error()
        yield from super().__iter__()
        self._raise_thread_error()


def streaming_dataset(**kwargs) -> StreamingDataset:
    """``StreamingDataset(**kwargs)``, registered on its host while no other dataset registers there.

    Streaming coordinates through POSIX shared memory, one set of segments per host and dataset, under a
    prefix that each rank finds free by scanning ``/dev/shm``, and that the host's local leader then
    creates. Two jobs that register at once on one host find the same prefix, and the later leader dies
    with ``FileExistsError``: so the leader holds a host-wide lock (``registration_lock_path``) from
    before any of its ranks scans until its segments exist.

    When several torchrun nodes run on one machine (the local launcher's ``num_nodes > 1``, which sets
    ``VLM_ASSETS_NODES_SHARE_HOST=1``), their local leaders would create the same segments and collide.
    So while the dataset detects its world (only in ``__init__``), it is shown the truth: one host with
    ``WORLD_SIZE`` ranks. Samples are still partitioned over all ranks.
    """
    with _world_of_this_host(), _registration():
        return _Dataset(**kwargs)


def registration_lock_path() -> Path:
    """The file whose lock one dataset's registration on this host holds (beside the segments)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "vlm_assets_streaming_registration.lock"


@contextmanager
def _registration():
    """Hold this host's registration lock (its local leader does) around one dataset's ``__init__``.

    The other ranks wait at a barrier until their leader holds it, so none of them scans before.
    Streaming has no hook between its scan and its creation, hence a lock around the whole of it.
    """
    with ExitStack() as held:
        if World.detect().is_local_leader:
            held.enter_context(host_lock(registration_lock_path()))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        yield


@contextmanager
def _world_of_this_host():
    """Show ranks of nodes that share this host (``VLM_ASSETS_NODES_SHARE_HOST=1``) one node."""
    if os.environ.get(SHARED_HOST_ENV) != "1":
        yield
        return
    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ["LOCAL_RANK"] = os.environ.get("RANK", "0")
    os.environ["LOCAL_WORLD_SIZE"] = os.environ.get("WORLD_SIZE", "1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
