#!/usr/bin/env bash
# Create .venv and install the whole stack (idempotent; re-installs only when the pins changed).
# Recipe and reasons: ../shared/STACK.md. Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.installed-$(cat "$repo/pyproject.toml" "$repo/constraints.txt" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "== installing into $venv (about 2-3 minutes on a fresh machine)"
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
  "${pip[@]}" install --upgrade pip 2>&1 | grep -v "is ignored" || true
  # torch first, with pip: pip here finds a local CPU wheel of exactly this version (uv would prefer
  # PyPI's CUDA build of the same version: the installed one is pinned for it below).
  "${pip[@]}" install torch==2.13.0 2>&1 | grep -v "is ignored" || true
  "$venv/bin/python" -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$venv/torch-pin.txt"
  # uv installs the same pins as pip, faster (a clean home, beside the k8s testbed build: 2 min 25 s
  # in all against 4 min 14 s with pip alone). It does not read pip's configuration, so it gets pip's
  # indexes, find-links and constraints from `pip config list`. Should uv fail, pip installs the rest.
  mapfile -t pip_conf < <("${pip[@]}" config list 2>/dev/null | "$venv/bin/python" -c '
import sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for item in value.strip("\x27\"").split() if flag else ():
        if (flag, item) not in seen:
            seen.add((flag, item))
            print(flag, item, sep="\n")')
  uv=("$venv/bin/uv" pip install -q --python "$venv/bin/python" --compile-bytecode --system-certs --index-strategy unsafe-best-match
      "${pip_conf[@]}" -c "$repo/constraints.txt" -c "$venv/torch-pin.txt")
  if "${pip[@]}" install uv==0.13.9 2>&1 | grep -v "is ignored"; [ -x "$venv/bin/uv" ] \
     && "${uv[@]}" -e "$repo[dev]" && "${uv[@]}" --no-deps mosaicml-streaming; then
    echo "   (installed with uv)"
  else
    echo "   (uv did not install the stack: pip installs it)"
    "${pip[@]}" install -c "$repo/constraints.txt" -e "$repo[dev]" 2>&1 | grep -v "is ignored" || true
    # mosaicml-streaming declares torchvision (no CPU build); its real needs are in pyproject.toml.
    "${pip[@]}" install --no-deps -c "$repo/constraints.txt" mosaicml-streaming 2>&1 | grep -v "is ignored" || true
  fi
  "$venv/bin/python" -c "import torch, dagster, mlflow, transformers, vlm_assets._streaming, moto" \
    || { echo "install failed: see the pip output above" >&2; exit 1; }
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
export VLM_ASSETS_CACHE="${VLM_ASSETS_CACHE:-$HOME/.cache/vlm_assets}"
PYTHON="$venv/bin/python" "$repo/scripts/fetch-offline-data.sh"
# Compiled torch extensions, one folder per virtual environment: their build commands name its include
# paths, so two checkouts sharing one folder would recompile each other's op (20-40 s) at every switch.
export MLFLOW_DISABLE_TELEMETRY=true MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" \
  TORCH_EXTENSIONS_DIR="$VLM_ASSETS_CACHE/torch_extensions/$(printf %s "$venv" | cksum | cut -d' ' -f1)"
# DeepSpeed (imported by transformers and peft when installed) warns at every import when it probes
# for an accelerator and finds none: on a machine without NVIDIA's driver, name the CPU.
command -v nvidia-smi >/dev/null || export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# DeepSpeed on CPU compiles its shared-memory collectives op at the first `deepspeed.initialize`
# (about 40 s on 2 cores): compile it once here, into the cache above, not inside a training step.
# scripts/test.sh sets VLM_ASSETS_OP_BUILD=background: its first DeepSpeed test comes minutes later, and
# a DeepSpeed process that needs the op meanwhile waits on torch's build lock, then loads it.
if [ "${DS_ACCELERATOR:-}" = cpu ] && ! ls "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
  build_op=("$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()")
  if [ "${VLM_ASSETS_OP_BUILD:-}" = background ]; then
    echo "== compiling DeepSpeed's CPU shared-memory op in the background (once, about 40 s)"
    ("${build_op[@]}" >/dev/null 2>&1 &)
  else
    echo "== compiling DeepSpeed's CPU shared-memory op (once, about 40 s)"
    "${build_op[@]}" >/dev/null 2>&1 \
      || echo "(DeepSpeed's shared-memory op did not compile here: the first DeepSpeed training tries again and says why)"
  fi
fi
