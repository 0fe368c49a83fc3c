"""A real distributed worker for launcher tests: gloo all-reduce of the ranks, then an optional failure.

torchrun --nnodes=2 --nproc-per-node=1 ... -m vlm_assets_tests.launch.allreduce_worker [--fail-rank R]
    [--fail-how exit3|sigkill|bad-input] [--hang]
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def say(line: str) -> None:
    # One write per line: ranks of a node share torchrun's stdout pipe, and print() writes the text and
    # the newline separately, so two ranks printing at once could interleave within a line.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-how", choices=("exit3", "sigkill", "bad-input"), default="exit3")
    parser.add_argument("--hang", action="store_true", help="the non-failing ranks block in a collective")
    parser.add_argument("--ticks", type=int, default=0, help="rank 0 then prints this many lines, 1.5 s apart")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    say(f"rank {rank}/{world} pid {os.getpid()} sum {int(total.item())}")
    if rank == args.fail_rank:
        say(f"rank {rank} failing on purpose")
        if args.fail_how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fail_how == "bad-input":  # what vlm_assets.launch.spec.exit_on_refused_input prints
            sys.stderr.write("bad input: row 3 of the test's input\n")
            sys.stderr.flush()
            os._exit(65)
        # os._exit, not sys.exit: interpreter shutdown with a live gloo group sometimes aborts in
        # gloo's destructor (exit -6 instead of 3), and the test asserts the code the worker chose.
        os._exit(3)
    for tick in range(args.ticks if rank == 0 else 0):
        time.sleep(1.5)
        say(f"tick {tick}")
    if args.hang:
        time.sleep(3600)  # stands in for a collective that never completes
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
