"""The GPU kit: every GPU figure from one command on a lent GPU machine, rehearsed on CPU in CI.

    scripts/gpu-check.sh --plan            # anywhere: the parts, their limits, the carry and its size
    scripts/gpu-check.sh --fetch           # here (PyPI reachable): the carry, into .gpu-carry/
    scripts/gpu-check.sh --stamp           # here, after the last commit: the carry names the tree's commit
    scripts/gpu-check.sh                   # on the GPU machine (carry .gpu-carry): every part, <= 8 min
    scripts/gpu-check.sh --only gpt        # one part again
    scripts/gpu-check.sh --rehearse        # on a CPU: the same parts at tiny sizes (gloo, fp32)

A lent GPU machine (the device tool) has Python 3.12 with torch, transformers 5.17, Lightning, peft and
accelerate, no network, 15 minutes of device time per session counting its start, and runs one command
of at most 10 minutes. So the whole kit is one call of at most ``RUN_LIMIT_S`` (8 minutes), leaving
time for the machine's start, the transfers and one ``--only`` rerun. What the machine lacks travels in
the carry (git-ignored, the call's ``carry`` argument): py3.12 wheels (DeepSpeed built here without its
ops, which it JIT-builds with the machine's nvcc), and the real data the parts read. After each part the
kit appends its figures to ``$OUT/results.json`` and ``$OUT/results.md``: a part killed at its limit
leaves the others' figures and the rows it had.

Standard library only until a part runs: ``--plan`` and ``--fetch`` run anywhere, ``--stamp``
in a git checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".gpu-carry"
TREE_STAMP = "tree.json"  # in the carry: the commit the working tree is (stamp_tree)
CARRY_LIMIT = 40 * 2**20  # the carry with the working tree; the device tool's own limit is 64 MiB
RUN_LIMIT_S = 480  # the whole kit: + 1-2 min machine start + transfers + one --only rerun <= 15 min
PYTHON = "3.12"  # the GPU machine's
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# The GPU machine's own packages (the device tool's KINDS.md): the rehearsal's environment holds these
# and nothing else of the project's stack (scripts/gpu-like-env.sh). torch is this machine's CPU build
# (no CPU wheel of the GPU machine's 2.11 is reachable here).
GPU_MACHINE_STACK = (
    "transformers==5.17.0", "lightning==2.6.6", "pytorch-lightning==2.6.6", "peft", "accelerate==1.15.0",
    "safetensors==0.8.0", "tokenizers==0.23.2", "huggingface-hub==1.33.0", "numpy", "pillow", "psutil",
    "pytest", "pytest-timeout", "msgpack", "ninja", "einops", "py-cpuinfo", "xxhash", "nvidia-ml-py",
)  # fmt: skip
# What the engines need beyond that stack: module -> the wheels that provide it (with what they need).
CARRIED = {
    "pydantic": ("pydantic", "pydantic-core", "annotated-types", "typing-inspection"),  # the run configs
    "deepspeed": ("deepspeed", "hjson"),  # VisualChat's ZeRO (an sdist: built here without its ops)
    "dagster_pipes": ("dagster-pipes",),  # the trainers' reporter
    "torchdata": ("torchdata",),  # VisualChat's resumable loader
    "streaming": ("mosaicml-streaming", "brotli", "python-snappy", "cramjam", "zstd", "catalogue"),  # token shards
}
SDISTS = ("deepspeed",)
DATA = ("gpt2-tokenizer", "shakespeare", "cifar10-samples", "fashion-mnist")  # offline-data/ folders
FASHION_MNIST_SUBSET = {"train": 2000, "t10k": 500}  # real images enough for every part, 30 MB -> 1 MB


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    limit_s: int
    gpu: tuple[str, ...]  # its command on the GPU machine ("@pytest": python -m pytest)
    rehearse: tuple[str, ...]  # the same at tiny sizes on CPU
    what: str


PREPARE_S = 40  # the carry installed into a target folder (a machine given back starts bare)
# A rehearsal runs tiny sizes on a 2-core CPU, which takes longer than the GPU's real sizes in places
# (two gloo processes, a model export): its limits catch a hang, not a slow GPU.
REHEARSAL_SLACK = 2
GPU_TESTS = (  # ZeRO-2 only: ZeRO-3's twin would not fit the part's limit
    "vlm_assets_tests/gpu/test_gpu_visualchat.py::test_visualchat_deepspeed_bf16[2]",
    "vlm_assets_tests/gpu/test_gpu_compile.py",
)
# Each part's limit is its slowest run seen on an H200 (bench/results/gpu-kit_*) plus about a fifth: a
# part's time moves by 10-20 % between lent machines of one kind (set-up, compilation).
PARTS = (
    Part(
        "smoke", 30, ("scripts/gpu_kit.py", "--smoke"), ("scripts/gpu_kit.py", "--smoke"),
        "imports through the project's shims, a tiny model of each kind built and saved, one bf16 matmul",
    ),
    Part(
        "gpt", 165,
        ("bench/bench_gpt.py", "--preset", "124M", "--batch", "16", "--seq", "1024", "--steps", "10",
         "--compile", "--trainer", "--trainer-steps", "20"),
        ("bench/bench_gpt.py", "--preset", "tiny", "--n-layer", "1", "--batch", "2", "--seq", "64", "--steps", "3",
         "--warmup", "1", "--trainer", "--trainer-steps", "10"),
        "GPT-2 124M, bf16, seq 1024: seed model, ours eager and compiled, ours through the trainer (compiled)",
    ),
    Part(
        "visualchat", 55,
        ("bench/bench_visualchat.py", "--zero2", "--micro-batch", "8", "--steps", "8", "--warmup", "2"),
        ("bench/bench_visualchat.py", "--zero2", "--rehearse", "--steps", "3", "--warmup", "1"),
        "CLIP ViT-L/14 + a 1.1B Llama shape, LoRA, DeepSpeed ZeRO-2 on 1 GPU, 8 rows packed to 1024: tokens/s, MFU",
    ),
    Part(
        "adapter", 100, ("bench/bench_adapter.py", "--qwen3b", "--image-size", "224", "--steps", "1"),
        ("bench/bench_adapter.py", "--steps", "1"),
        "the occlusion adapter on a Qwen2.5-VL-3B shape (bf16 on the GPU): samples/s against the seed's settings",
    ),
    Part(
        "tests", 90, ("@pytest", "-m", "gpu", *GPU_TESTS),
        ("@pytest", "-m", "not gpu", "vlm_assets_tests/train/test_visualchat_train.py::"
         "test_zero2_two_processes_train_merge_export_and_answer", "vlm_assets_tests/models/test_gpt.py"),
        "the gpu-marked engine tests (VisualChat ZeRO-2 bf16 on NCCL, torch.compile against eager); "
        "rehearsed by their CPU twins",
    ),
)  # fmt: skip


def check_plan(parts=PARTS) -> list[str]:
    """The time rule, as messages (empty when the plan keeps it)."""
    total = PREPARE_S + sum(p.limit_s for p in parts)
    names = [p.name for p in parts]
    problems = [f"the parts' limits add up to {total} s, over {RUN_LIMIT_S} s"] if total > RUN_LIMIT_S else []
    if names[:1] != ["smoke"] or parts[0].limit_s > 30:
        problems.append("the kit must begin with a smoke test of at most 30 s")
    return problems + [f"two parts are named {n!r}" for n in set(names) if names.count(n) > 1]


def carry_files(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def sent_files() -> list[str]:
    """What the device tool sends beside the carry: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    ).stdout
    return [name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def tree_size() -> int:
    """Bytes of the files the device tool copies from this checkout (``sent_files``)."""
    return sum((REPO / name).stat().st_size for name in sent_files())


def carry_problems(root: Path) -> list[str]:
    """What is missing from the carry at ``root`` (its manifest lists every file it must hold)."""
    manifest = root / "carry.json"
    if not manifest.is_file():
        return [f"{root}: no carry (scripts/gpu-check.sh --fetch)"]
    listed = json.loads(manifest.read_text())["files"]
    return [f"{root / name}: missing or changed" for name, size in listed.items() if _size(root / name) != size]


def stamp_tree(root: Path) -> dict:
    """Write ``root/tree.json``: the checkout's commit and a digest of each file the device tool sends.

    The GPU machine gets the working tree (tracked files and untracked ones git does not ignore) without
    ``.git``, or with a stale one: the stamp, carried, lets the kit there name the commit it runs
    (``+dirty`` where the tree was not that commit when stamped) and notice a tree that has moved on since
    (``tree_commit``).
    """
    if not (REPO / ".git").exists():
        raise SystemExit(f"gpu-check: {REPO} is not a git checkout: nothing to stamp the carry with")
    files = {name: _digest(REPO / name) for name in sent_files()}
    stamp = {"commit": _results_file().commit(REPO, untracked=True), "files": files}
    root.mkdir(parents=True, exist_ok=True)
    (root / TREE_STAMP).write_text(json.dumps(stamp, indent=0) + "\n")
    return stamp


def tree_commit(root: Path) -> str:
    """The commit the working tree is: the carry's stamp where every file matches it, else git's answer.

    The stamp comes first: the GPU machine's copy of the tree may hold a ``.git`` of an older commit than
    the one its files are. A stamp the tree has moved on from (a carry reused after new commits) yields
    to git in a checkout, and says which files differ where there is no git.
    """
    stamp = json.loads((root / TREE_STAMP).read_text()) if (root / TREE_STAMP).is_file() else None
    changed = [name for name, digest in stamp["files"].items() if _digest(REPO / name) != digest] if stamp else []
    if stamp and not changed:
        return stamp["commit"]
    if (REPO / ".git").exists():
        return _results_file().commit(REPO, untracked=True)
    if not stamp:
        return "unknown (no .git and no tree stamp in the carry: scripts/gpu-check.sh --stamp writes it)"
    return f"unknown: {len(changed)} file(s) differ from {stamp['commit']} ({', '.join(changed[:3])})"


def _results_file():
    """The benches' header module (bench/results_file.py, stdlib only)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import results_file

    return results_file


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def plan(root: Path = CARRY) -> dict:
    files = carry_files(root) if root.is_dir() else []
    carried, tree = sum(size for _, size in files), tree_size()
    problems = check_plan()
    if carried + tree > CARRY_LIMIT:
        problems.append(f"{root} + the working tree: {(carried + tree) / 2**20:.1f} MiB, over 40 MiB")
    return {
        "run_limit_s": RUN_LIMIT_S,
        "prepare_s": PREPARE_S,
        "parts": [dataclasses.asdict(p) for p in PARTS],
        "total_s": PREPARE_S + sum(p.limit_s for p in PARTS),
        "carry": {
            "path": str(root),
            "fetched": bool(files),
            "complete": bool(files) and not carry_problems(root),
            "modules": {module: list(wheels) for module, wheels in CARRIED.items()},
            "data": list(DATA),
            "bytes": carried,
            "tree_bytes": tree,
            "limit_bytes": CARRY_LIMIT,
        },
        "problems": problems,
    }


def print_plan(p: dict) -> None:
    print(f"one device call, at most {p['run_limit_s']} s (parts run in this order, each under a hard limit):")
    print(f"  {'prepare':<11} {p['prepare_s']:>4} s  install the carry (into a temporary target folder)")
    for part in p["parts"]:
        print(f"  {part['name']:<11} {part['limit_s']:>4} s  {part['what']}")
    print(f"  {'in all':<11} {p['total_s']:>4} s")
    carry = p["carry"]
    print(f"carry ({carry['path']}, the device call's `carry` argument), py{PYTHON} wheels for:")
    for module, wheels in carry["modules"].items():
        print(f"  {module:<14} {' '.join(wheels)}")
    print(f"  offline data: {' '.join(carry['data'])} (Fashion-MNIST: the first {FASHION_MNIST_SUBSET} images)")
    state = "complete" if carry["complete"] else ("INCOMPLETE" if carry["fetched"] else "not fetched yet (--fetch)")
    carried, tree = carry["bytes"] / 2**20, carry["tree_bytes"] / 2**20
    print(f"  {state}: {carried:.1f} MiB carried + {tree:.1f} MiB of working tree = {carried + tree:.1f} MiB (<= 40)")
    for problem in p["problems"]:
        print(f"PLAN BROKEN: {problem}", file=sys.stderr)


# -- the carry -----------------------------------------------------------------------------------------
def pinned(name: str) -> str:
    """name==version as this machine's project install has it (the versions CI tests)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def fetch(root: Path = CARRY, python: str = PYTHON) -> None:
    """Download the carry's wheels for ``python`` and copy the offline data, all or nothing."""
    sys.path.insert(0, str(REPO))
    from vlm_assets.paths import offline_data_dir

    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gpu-carry-", dir=root.parent))
    try:
        wheels = staging / "wheels"
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
        binary = [*pip, "--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
        binary += [arg for platform_tag in PLATFORMS for arg in ("--platform", platform_tag)]
        for name in (w for wheels_of in CARRIED.values() for w in wheels_of if w not in SDISTS):
            # this machine's version, or the newest wheel for that Python where it has none
            if subprocess.run([*binary, pinned(name)], capture_output=True).returncode != 0:
                subprocess.run([*binary, name], check=True)
        for name in SDISTS:  # built here, ops left to the GPU machine's JIT: a pure-Python wheel
            env = {**os.environ, "DS_BUILD_OPS": "0"}
            build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
            subprocess.run([*build, pinned(name)], check=True, env=env, capture_output=True)
        data = offline_data_dir()
        for name in DATA:
            if not (data / name).is_dir():
                raise SystemExit(f"{data / name} is missing: run scripts/fetch-offline-data.sh first")
            if name == "fashion-mnist":
                _fashion_mnist_subset(data / name, staging / "offline-data" / name)
            else:
                shutil.copytree(data / name, staging / "offline-data" / name)
        (staging / "offline-data" / ".complete").touch()
        files = {name: size for name, size in carry_files(staging)}
        (staging / "carry.json").write_text(json.dumps({"python": python, "files": files}, indent=1))
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)  # all or nothing: a failed fetch leaves the previous carry as it was
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fashion_mnist_subset(source: Path, target: Path) -> None:
    """The first images of each split, as idx files of the same format."""
    target.mkdir(parents=True)
    for split, count in FASHION_MNIST_SUBSET.items():
        for kind in ("images-idx3", "labels-idx1"):
            raw = gzip.decompress((source / f"{split}-{kind}-ubyte.gz").read_bytes())
            ndim = raw[3]
            shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
            item = 1
            for dim in shape[1:]:
                item *= dim
            header = raw[:4] + count.to_bytes(4, "big") + raw[8 : 4 + 4 * ndim]
            body = raw[4 + 4 * ndim : 4 + 4 * ndim + count * item]
            (target / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + body, mtime=0))


def prepare(root: Path, rehearse: bool) -> Path | None:
    """Install the carry's wheels into a target folder (the machine's own packages untouched) and
    return it, for PYTHONPATH; None when everything it provides is already importable. DeepSpeed's
    JIT-built ops go into the same folder: a build never mixes with another environment's, and a
    rehearsal builds the CPU shared-memory op here, not inside a part's limit."""
    if all(importlib.util.find_spec(module) for module in CARRIED):
        return None
    wheels = root / "wheels"
    if not wheels.is_dir():
        return None  # the smoke test names what is missing
    digest = hashlib.sha256(json.dumps(carry_files(wheels)).encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"gpu-carry-{digest}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(target / "torch_extensions")
    if not (target / ".installed").is_file():
        shutil.rmtree(target, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--disable-pip-version-check", "--target", str(target)]
        subprocess.run([*pip, *sorted(str(p) for p in wheels.glob("*.whl"))], check=True)
        (target / ".installed").touch()
    if rehearse and not list((target / "torch_extensions").glob("deepspeed_shm_comm/*.so")):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)]), "DS_ACCELERATOR": "cpu"}
        build = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
        subprocess.run([sys.executable, "-c", build], env=env, capture_output=True)  # a failure: the part says why
    return target


# -- the smoke test ------------------------------------------------------------------------------------
def smoke() -> int:
    """Seconds-long: every package the parts import, through the project's own shims, and a tiny model
    of each kind built, saved and loaded again; on a GPU one bf16 matrix product."""
    missing = []
    shims = {"streaming": "vlm_assets._streaming"}  # streaming imports torchvision unless shimmed
    sys.path.insert(0, str(REPO))
    for module in ("torch", "transformers", "lightning", "peft", "safetensors", "tokenizers", "PIL", *CARRIED):
        try:
            importlib.import_module(shims.get(module, module))
        except ImportError as err:
            wheels = CARRIED.get(module)
            missing.append(f"{module} ({err})" + (f": carry {' '.join(wheels)}" if wheels else ""))
    if missing:
        print("smoke: missing packages: " + "; ".join(missing), file=sys.stderr)
        print("smoke: fetch the carry here (scripts/gpu-check.sh --fetch) and carry .gpu-carry", file=sys.stderr)
        return 3
    import torch

    from vlm_assets.models.gpt import GPT, preset
    from vlm_assets.models.gpt_export import export_hf
    from vlm_assets.models.tiny_qwen import build_tiny_qwen
    from vlm_assets.models.visualchat import VisualChatModel, VisualChatModelConfig
    from vlm_assets.paths import offline_data_dir

    data = offline_data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = preset("tiny", n_layer=1)[0]
        model = GPT(config)
        export_hf(model.state_dict(), config, tmp / "gpt", data / "gpt2-tokenizer")
        build_tiny_qwen(tmp / "qwen", ["a tiny backbone"] * 4)
        _tiny_visualchat_parts(tmp, data)
        chat = VisualChatModel.build(
            VisualChatModelConfig(encoder_kind="clip", encoder=str(tmp / "clip"), decoder=str(tmp / "gpt"))
        )
        VisualChatModel.from_pretrained(chat.save_pretrained(tmp / "visualchat"))
    if torch.cuda.is_available():
        a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        assert (a @ a).dtype == torch.bfloat16
        print(f"smoke: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, bf16 matmul ran")
    print("smoke: imports, GPT / Qwen2.5-VL / VisualChat built, saved and loaded")
    return 0


def _tiny_visualchat_parts(root: Path, data: Path) -> None:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(
        CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         patch_size=8, image_size=32)
    ).save_pretrained(root / "clip")  # fmt: skip
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")


# -- running the parts ---------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "lightning", "peft", "accelerate", "deepspeed", "numpy", "pydantic"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def run_part(part: Part, out: Path, rehearse: bool, site: Path | None, carry: Path = CARRY) -> dict:
    """Run one part under its limit; its rows (``$BENCH_ROWS``) and log land in ``out``."""
    rows_file = out / "rows" / f"{part.name}.jsonl"
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.unlink(missing_ok=True)
    paths = [str(REPO), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "BENCH_ROWS": str(rows_file)}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "4")})
    if (carry / "offline-data" / ".complete").is_file():
        env["VLM_ASSETS_CACHE"] = str(carry)  # offline-data/ inside the carry
    if rehearse:
        env.update({"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})
    command = list(part.rehearse if rehearse else part.gpu)
    if command[0] == "@pytest":
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *command[1:]]
        env["VLM_TESTS_FAIL_ON_SKIP"] = "1"  # skipped is not passed (vlm_assets_tests/conftest.py)
    else:
        command = [sys.executable, *command]
    started = time.monotonic()
    with open(out / f"{part.name}.log", "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        overran = threading.Event()

        def overrun():  # the part's whole process group: a torchrun agent and its workers too
            overran.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        limit = part.limit_s * (REHEARSAL_SLACK if rehearse else 1)
        timer = threading.Timer(limit, overrun)
        timer.start()
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(f"[{time.monotonic() - started:6.1f} s] {line}")  # where a part's time went
            code = proc.wait()
        finally:
            timer.cancel()
    rows = []
    for line in rows_file.read_text().splitlines() if rows_file.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a part killed mid-line loses that line only
            rows.append(json.loads(line))
    status = f"over its {limit} s limit" if overran.is_set() else ("ok" if code == 0 else f"exit {code}")
    return {"part": part.name, "status": status, "seconds": round(time.monotonic() - started, 1), "rows": rows}


def record(out: Path, header: dict, result: dict) -> None:
    """Append one part's outcome to ``results.json`` and ``results.md`` (rewritten whole each time)."""
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"header": header, "parts": []}
    results["parts"] = [p for p in results["parts"] if p["part"] != result["part"]] + [result]
    path.write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# GPU kit results ({'CPU rehearsal' if header['rehearse'] else header['device']})", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()] + [""]
    for part in results["parts"]:
        lines += [f"## {part['part']}: {part['status']} ({part['seconds']} s)", ""]
        if part["rows"]:
            keys = list(dict.fromkeys(k for row in part["rows"] for k in row if k not in ("part", "device")))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in part["rows"]]
            lines.append("")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="print the parts, their limits and the carry; no GPU")
    parser.add_argument("--stamp", action="store_true", help="stamp the carry with the tree's commit (before a call)")
    parser.add_argument("--json", action="store_true", help="with --plan: as JSON")
    parser.add_argument("--fetch", action="store_true", help="download the carry (needs PyPI)")
    parser.add_argument("--python", default=PYTHON, help=f"with --fetch: the Python the wheels are for ({PYTHON})")
    parser.add_argument("--carry", type=Path, default=CARRY, help="the carry's folder (.gpu-carry)")
    parser.add_argument("--only", help="run this part alone (after the smoke test)")
    parser.add_argument("--rehearse", action="store_true", help="the same parts at tiny sizes on CPU")
    parser.add_argument("--stack", action="store_true", help="print the GPU machine's own packages (pip requirements)")
    parser.add_argument("--carried", action="store_true", help="print the carry's wheels (package names)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.stack:
        print(" ".join(GPU_MACHINE_STACK))
        return 0
    if args.carried:
        print(" ".join(wheel for wheels in CARRIED.values() for wheel in wheels))
        return 0
    if args.stamp:
        print(f"gpu-check: {args.carry / TREE_STAMP}: {stamp_tree(args.carry)['commit']}")
        return 0
    if args.plan:
        p = plan(args.carry)
        print(json.dumps(p, indent=1)) if args.json else print_plan(p)
        return 1 if p["problems"] else 0
    if args.fetch:
        fetch(args.carry, args.python)
        if (REPO / ".git").exists():
            stamp_tree(args.carry)
        print_plan(p := plan(args.carry))
        return 1 if p["problems"] or not p["carry"]["complete"] else 0
    names = [p.name for p in PARTS]
    if args.only and args.only not in names:
        parser.error(f"--only {args.only}: no such part; the parts are {', '.join(names)}")
    parts = [p for p in PARTS if args.only in (None, p.name) or p.name == "smoke"]
    started = time.monotonic()
    out = Path(os.environ.get("OUT") or REPO / "var" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {sys.executable} (Python {platform.python_version()}), results in {out}", flush=True)
    problems = carry_problems(args.carry)
    for problem in problems:
        print(f"gpu-check: carry: {problem}", flush=True)
    site = prepare(args.carry, args.rehearse) if not problems else None
    if site:
        sys.path.insert(0, str(site))  # the carried packages' versions in the header
    import torch  # the machine's own

    device = "CPU" if args.rehearse or not torch.cuda.is_available() else torch.cuda.get_device_name()
    cpu = _results_file().cpu()
    header = {
        "commit": tree_commit(args.carry),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "cpu": f"{cpu['model']} ({', '.join(cpu['vector_extensions']) or 'no AVX2'}), {cpu['cores']} cores",
        "driver": _driver(),
        "python": f"{sys.executable} ({platform.python_version()})",
        "rehearse": args.rehearse,
        **versions(),
    }
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in header.items()), flush=True)
    deadline = started + RUN_LIMIT_S * (REHEARSAL_SLACK if args.rehearse else 1)
    failed = []
    for part in parts:
        if time.monotonic() + 5 > deadline:
            failed.append(f"{part.name} (not started: the kit's {RUN_LIMIT_S} s are spent)")
            continue
        print(f"== {part.name} (<= {part.limit_s} s): {part.what}", flush=True)
        result = run_part(part, out, args.rehearse, site, args.carry)
        record(out, header, result)
        if result["status"] != "ok":
            failed.append(f"{part.name} ({result['status']})")
            if part.name == "smoke" and result["status"] == "exit 3":
                break  # packages missing: the parts would fail the same way, slower
    print(f"gpu-check: results in {out / 'results.md'}", flush=True)
    if failed:
        print(f"gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _driver() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip() or None
    return None


if __name__ == "__main__":
    sys.exit(main())
