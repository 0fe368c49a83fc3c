"""Where a bench's figures go: ``bench/results/<what>_<machine>_<yyyymmdd>.{md,json}`` with a header
naming the commit, date, CPU model and vector extensions, the kernels torch ran, cores, GPU and library
versions. Written once by the command that measured them; never edited afterwards."""

import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LIBRARIES = ("torch", "transformers", "lightning", "deepspeed", "peft", "dagster", "mlflow", "numpy")
# The environment that makes torch, oneDNN and MKL use their AVX2 kernels on an AVX-512 CPU: a fast
# machine then computes as the slowest machines of this kind do (clock and cache still differ).
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


# Dense bf16 peak of one GPU (TFLOP/s), by its name: the MFU denominator. None for anything else.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0))


def peak_bf16_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of the GPU named ``device_name`` (H100 SXM and H200: 989, H100 PCIe: 756)."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if device_name and key in device_name), None)


def emit(row: dict) -> None:
    """A measured row, appended at once to ``$BENCH_ROWS`` (JSON lines) when set: a bench killed at its
    time limit (scripts/gpu-check.sh) leaves the rows it had."""
    if path := os.environ.get("BENCH_ROWS"):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def cpu() -> dict:
    """CPU model, its vector extensions (AVX2, AVX-512 subsets) and cores, from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.M).group(1).strip()
        flags = set(re.search(r"^flags\s*:\s*(.+)$", text, re.M).group(1).split())
    except (OSError, AttributeError):
        pass
    vector = sorted(f for f in flags if f == "avx2" or f.startswith("avx512") or f == "amx_bf16")
    return {"model": model, "vector_extensions": vector, "cores": os.cpu_count()}


def machine_name() -> str:
    """A short slug for file names: the CPU family and its widest vector extension (``epyc-avx2``)."""
    info = cpu()
    words = re.findall(r"[a-z]+", info["model"].lower())
    family = next(
        (w for w in words if w in ("epyc", "xeon", "ryzen", "core", "graviton")), words[0] if words else "cpu"
    )
    widest = (
        "avx512"
        if any(v.startswith("avx512") for v in info["vector_extensions"])
        else ("avx2" if "avx2" in info["vector_extensions"] else "novec")
    )
    gpu = gpu_name()
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") if gpu else f"{family}-{widest}"


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].split(",")[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def commit(repo: Path = REPO, untracked: bool = False) -> str:
    """The checkout's commit, with ``+dirty`` when a tracked file differs from it (``untracked``: or a file
    git does not ignore is untracked)."""
    mode = "--untracked-files=normal" if untracked else "--untracked-files=no"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", mode], cwd=repo, capture_output=True)
    except OSError:  # no git on this machine
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty.stdout.strip() else "")


def header(command: str) -> dict:
    """Everything a figure depends on besides the code: machine, kernels, versions, and how it was made."""
    versions = {}
    for name in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    try:
        import torch

        kernels = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        kernels = None
    return {
        "command": command,
        "commit": commit(),
        "torch_cpu_capability": kernels,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu(),
        "kernels_env": {k: os.environ[k] for k in KERNELS["avx2"] if k in os.environ},
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "versions": versions,
    }


def write(what: str, head: dict, markdown: str, data: dict) -> Path:
    """``bench/results/<what>_<machine>_<yyyymmdd>.md`` (header table + ``markdown``) and its ``.json``;
    a second run on the same day and machine gets a ``-2`` suffix rather than overwriting."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{what}_{machine_name()}_{datetime.datetime.now(datetime.UTC):%Y%m%d}"  # the header's date is UTC too
    n, name = 1, stem
    while (RESULTS / f"{name}.md").exists():
        n += 1
        name = f"{stem}-{n}"
    c = head["cpu"]
    rows = [
        ("command", f"`{head['command']}`"),
        ("commit", head["commit"]),
        ("date", head["date"]),
        ("CPU", f"{c['model']}, {c['cores']} cores"),
        ("vector extensions", ", ".join(c["vector_extensions"]) or "none"),
        ("kernels torch ran", head.get("torch_cpu_capability") or "unknown"),
        ("kernel override", ", ".join(f"{k}={v}" for k, v in head["kernels_env"].items()) or "none (native)"),
        ("GPU", head["gpu"] or "none"),
        ("Python", head["python"]),
        ("libraries", ", ".join(f"{k} {v}" for k, v in head["versions"].items())),
    ]
    text = f"# {what} on {machine_name()}\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    (RESULTS / f"{name}.md").write_text(text + "\n" + markdown.rstrip() + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({"header": head, **data}, indent=1) + "\n")
    return RESULTS / f"{name}.md"
