"""Two datasets that register at once on one host take distinct shared-memory prefixes."""

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

from vlm_assets_tests.waiting import BOUND_S, wait_until

JOB = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    from vlm_assets._streaming import streaming_dataset
    import streaming.base.shared.prefix as prefix

    def say(line):  # one write per line: the ranks share torchrun's stdout
        os.write(1, (line + "\\n").encode())

    scan = prefix._check_and_find_retrying

    def reported_scan(*args, **kwargs):
        say(f"scanned {os.environ['RANK']}")
        return scan(*args, **kwargs)

    prefix._check_and_find_retrying = reported_scan
    dist.init_process_group("gloo")
    shards = streaming_dataset(remote=sys.argv[1], local=sys.argv[2], batch_size=1)
    say(f"prefix {dist.get_rank()} {shards._shm_prefix_int}")
    dist.barrier()  # no rank's segments go before every rank has opened them
    dist.destroy_process_group()
    """
)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False


def _waits_for(lock: Path, ancestor: int) -> bool:
    """Whether a process below ``ancestor`` waits for the flock on ``lock`` (``/proc/locks``)."""
    inode = os.stat(lock).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()  # "7: -> FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
        if fields[1] == "->" and fields[6].endswith(f":{inode}") and _descends_from(int(fields[5]), ancestor):
            return True
    return False


def test_a_dataset_registers_after_one_that_registers_meanwhile_on_its_host(offline_data, tmp_path):
    """Streaming's ranks scan /dev/shm for a free prefix, then their local leader creates it: a job whose
    ranks scanned while another job's leader registered would create that job's prefix, and die of
    ``FileExistsError``. Here the test registers in the other job's place, holding the host's lock: the
    job's ranks must not scan until it is released, then take a prefix of their own."""
    from vlm_assets._streaming import registration_lock_path, streaming  # streaming only through it
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, paragraphs_of_files, write_token_shards

    tokenizer = load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(offline_data / "shakespeare" / "*.txt")))[:200]
    write_token_shards(
        tmp_path / "art", tokenizer, "gpt2", docs, docs[:20], max_length=64,
        max_train_samples=None, max_val_samples=20, size_limit=1 << 16,
    )  # fmt: skip
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "out"
    lock = registration_lock_path()
    with ExitStack() as stack:
        holding = stack.enter_context(ExitStack())  # closed early: the lock's release
        held = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
        holding.callback(os.close, held)
        fcntl.flock(held, fcntl.LOCK_EX)
        with out.open("w") as sink:
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 str(tmp_path / "job.py"), str(tmp_path / "art" / "train"), str(tmp_path / "cache")],
                stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )  # fmt: skip
        stack.callback(lambda: job.poll() is None and os.killpg(job.pid, signal.SIGKILL))  # its workers too
        wait_until(
            lambda: "scanned" in out.read_text() or _waits_for(lock, job.pid) or job.poll() is not None,
            "the job's leader to wait for the registration lock",
        )
        assert job.poll() is None, out.read_text()
        assert "scanned" not in out.read_text(), f"a rank scanned while the lock was held:\n{out.read_text()}"

        theirs, their_segment = streaming.base.shared.prefix.get_shm_prefix(
            [str(tmp_path / "their-cache")], [None], streaming.base.world.World.detect()
        )
        stack.callback(their_segment.cleanup)
        holding.close()
        assert job.wait(timeout=BOUND_S) == 0, out.read_text()
    prefixes = {line.split()[2] for line in out.read_text().splitlines() if line.startswith("prefix ")}
    assert len(prefixes) == 1 and out.read_text().count("prefix ") == 2, out.read_text()
    assert prefixes != {str(theirs)}, out.read_text()
