#!/usr/bin/env bash
# The GPU kit (scripts/gpu_kit.py says what each part measures and why it fits one device call):
#   scripts/gpu-check.sh --plan        # anywhere: the parts, their limits, the carry and its size
#   scripts/gpu-check.sh --fetch       # here (PyPI reachable): py3.12 wheels + offline data into .gpu-carry/
#   scripts/gpu-check.sh --stamp       # here, after the last commit: the carry names the tree's commit
#   scripts/gpu-check.sh               # on the GPU machine (carry .gpu-carry): every part, <= 8 minutes
#   scripts/gpu-check.sh --only PART   # one part again (after the smoke test)
#   (the GPU machine's copy of the tree has no .git, or a stale one: the stamp holds the commit and each
#   file's digest, and the results name that commit only if no file has changed since)
#   scripts/gpu-check.sh --rehearse    # on a CPU: the same parts at tiny sizes (CI: scripts/gpu-like-env.sh)
# Figures go to $OUT (default var/gpu-check/): results.json and results.md after each part, a log per
# part (each line with its seconds into the part). The interpreter: $GPU_CHECK_PYTHON, else the
# machine's python3 when it has torch (the GPU machine's), else the project's .venv. Exits 1 when a
# part fails or overruns its limit.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${GPU_CHECK_PYTHON:-python3}"
if [ -z "${GPU_CHECK_PYTHON:-}" ] && ! python3 -c "import torch" 2>/dev/null && [ -x "$repo/.venv/bin/python" ]; then
  python="$repo/.venv/bin/python"
fi
case " $* " in
  *" --plan "*|*" --fetch "*|*" --stamp "*|*" --rehearse "*|*" --help "*|*" -h "*) ;;
  *) "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
       || { echo "gpu-check: no CUDA device visible to $python's torch (--plan, --fetch, --stamp and --rehearse need none)" >&2; exit 2; }
     nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true ;;
esac
exec "$python" "$repo/scripts/gpu_kit.py" "$@"
