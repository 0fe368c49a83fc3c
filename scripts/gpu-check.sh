#!/usr/bin/env bash
# The GPU kit in one command, on a CUDA machine (about 20-25 minutes on one H100):
#   1. the gpu-marked tests: GPT FSDP2 bf16 and DDP on NCCL through the asset, the adapter's DeepSpeed
#      ZeRO-2 + bf16 (needs the `gpu` extra), torch.compile against eager (test_gpu_paths), and
#      VisualChat's ZeRO-2 and ZeRO-3 + bf16 (test_gpu_visualchat: engines only, no dagster or MLflow);
#   2. bench/bench_gpt.py at 124M and 1.5B (bf16, seq 1024, torch.compile, MFU);
#   3. bench/bench_adapter.py --qwen3b (Qwen2.5-VL-3B shapes, random weights: no hub needed);
#   4. bench/bench_visualchat.py --gpu (CLIP ViT-L/14 + a LLaMA-7B shape, random weights, ZeRO-2/3, MFU).
# Each part has its own time budget (GPU_CHECK_BUDGET_S, default 1500 s in all); the figures go to
# $OUT (default var/gpu-check/) as text tables.
#   scripts/gpu-check.sh
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
[ -d .venv ] && source .venv/bin/activate
out="${OUT:-$repo/var/gpu-check}"
mkdir -p "$out"
budget="${GPU_CHECK_BUDGET_S:-1500}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu-check: no CUDA device visible to torch" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
run() {  # run NAME SECONDS CMD...: one part under its share of the budget, output kept
  local name=$1 seconds=$2; shift 2
  echo "== $name (<= ${seconds}s)"
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "gpu-check: $name failed (exit $rc)" >&2; status=1; }
}
run tests $((budget * 25 / 100)) python -m pytest -m gpu -q -p no:cacheprovider vlm_assets_tests/gpu
run bench_gpt $((budget * 15 / 100)) python bench/bench_gpt.py --presets 124M 1.5B --batch 8 --seq 1024 --compile
run bench_adapter $((budget * 10 / 100)) python bench/bench_adapter.py --qwen3b --image-size 224
# The 7B shape is built, loaded and exported (merged, in fp32 on the CPU) once per ZeRO stage: minutes
# each, more than the 20 training steps. One H100 did not finish ZeRO-2's within 390 s (2026-11-23).
run bench_visualchat $((budget * 50 / 100)) python bench/bench_visualchat.py --gpu --steps 20
exit $status
