#!/usr/bin/env bash
# The GPU kit, in parts that fit the lent GPU machine's calls (scripts/gpu_kit.py says how):
#   scripts/gpu-check.sh --plan      # anywhere, no GPU: each device call's parts and budgets, the carry, its size
#   scripts/gpu-check.sh --fetch     # here (PyPI reachable): py3.12 wheels + offline data into .gpu-carry/
#   scripts/gpu-check.sh --call N    # on the GPU machine (carry .gpu-carry): the carry installed, call N's parts
#   scripts/gpu-check.sh             # every part in order
# Figures and logs go to $OUT (default var/gpu-check/), one text file per part. Exits 1 when a part
# fails, overruns its budget, or a gpu test is skipped.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="python3"
if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; fi
case " $* " in
  *" --plan "*|*" --fetch "*) ;;
  *) "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
       || { echo "gpu-check: no CUDA device visible to torch (--plan needs none)" >&2; exit 2; }
     nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true ;;
esac
exec "$python" "$repo/scripts/gpu_kit.py" "$@"
