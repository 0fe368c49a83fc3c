#!/usr/bin/env bash
# Install everything (if needed), fetch the offline real data, and run the whole test suite on CPU.
#   scripts/test.sh [pytest args]
# GPU-only tests carry the `gpu` marker and are deselected unless a CUDA device is present.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
cd "$repo"
marker=(-m "not gpu")
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then marker=(); fi
exec python -m pytest "${marker[@]}" -p no:cacheprovider "$@"
