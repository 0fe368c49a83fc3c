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
  # torch first: pip here finds a local CPU wheel of exactly this version.
  "${pip[@]}" install torch==2.13.0 2>&1 | grep -v "is ignored" || true
  "${pip[@]}" install -c "$repo/constraints.txt" -e "$repo[dev]" 2>&1 | grep -v "is ignored" || true
  # mosaicml-streaming declares torchvision (no CPU build); its real needs are in pyproject.toml.
  "${pip[@]}" install --no-deps -c "$repo/constraints.txt" mosaicml-streaming 2>&1 | grep -v "is ignored" || true
  "$venv/bin/python" -c "import torch, dagster, mlflow, transformers, vlm_assets._streaming, moto" \
    || { echo "install failed: see the pip output above" >&2; exit 1; }
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
export VLM_ASSETS_CACHE="${VLM_ASSETS_CACHE:-$HOME/.cache/vlm_assets}"
PYTHON="$venv/bin/python" "$repo/scripts/fetch-offline-data.sh"
export MLFLOW_DISABLE_TELEMETRY=true MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TORCH_EXTENSIONS_DIR="$VLM_ASSETS_CACHE/torch_extensions"
# DeepSpeed (imported by transformers and peft when installed) warns at every import when it probes
# for an accelerator and finds none: on a machine without NVIDIA's driver, name the CPU.
command -v nvidia-smi >/dev/null || export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# DeepSpeed on CPU compiles its shared-memory collectives op at the first `deepspeed.initialize`
# (about 40 s on 2 cores): compile it once here, into the cache above, not inside a training step.
if [ "${DS_ACCELERATOR:-}" = cpu ] && ! ls "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
  echo "== compiling DeepSpeed's CPU shared-memory op (once, about 40 s)"
  "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
    || echo "(DeepSpeed's shared-memory op did not compile here: the first DeepSpeed training tries again and says why)"
fi
