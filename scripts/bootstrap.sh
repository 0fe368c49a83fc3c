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
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TORCH_EXTENSIONS_DIR="$VLM_ASSETS_CACHE/torch_extensions"
# DeepSpeed (imported by transformers and peft when installed) warns at every import when it probes
# for an accelerator and finds none: on a machine without NVIDIA's driver, name the CPU.
command -v nvidia-smi >/dev/null || export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
