#!/usr/bin/env bash
# A virtual environment that holds what the lent GPU machine holds and nothing else of the project's
# stack (no Dagster, MLflow, pydantic or the project's pins), plus the GPU kit's carry fetched for this
# Python and installed offline by the kit itself: the GPU kit's CPU rehearsal runs in it, so that a
# missing wheel, a version drift or a dagster import in the engines fails here, not on the GPU.
#   scripts/gpu-like-env.sh [DIR]     # prints DIR (default $VLM_ASSETS_CACHE/gpu-like-env); idempotent
# Only DIR goes to stdout (callers read it); pip's and the fetch's output go to stderr.
# DIR/venv is the environment, DIR/carry the carry (wheels for this Python + the offline data).
# torch is this machine's CPU build: no CPU wheel of the GPU machine's own torch is reachable here.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-${VLM_ASSETS_CACHE:-$HOME/.cache/vlm_assets}/gpu-like-env}"
python3="${PYTHON3:-python3}"
# One build at a time: scripts/test.sh starts one in the background, and the rehearsal's test waits for it.
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
stack="$("$python3" "$repo/scripts/gpu_kit.py" --stack)"
stamp="$dir/.ready-$( (echo "$stack"; "$python3" "$repo/scripts/gpu_kit.py" --carried; cat "$0") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  "$python3" -m venv "$dir/venv"
  pip=("$dir/venv/bin/python" -m pip -q --disable-pip-version-check)
  "${pip[@]}" install torch==2.13.0 2>&1 | grep -v "is ignored" >&2 || true  # pip finds the local CPU wheel
  "$dir/venv/bin/python" -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$dir/torch-pin.txt"
  # shellcheck disable=SC2086  # one requirement per word
  "${pip[@]}" install -c "$dir/torch-pin.txt" $stack 2>&1 | grep -v "is ignored" >&2 || true
  # what the GPU machine lacks, even where a package of its stack pulled it in here (typer: pydantic)
  # shellcheck disable=SC2046
  "${pip[@]}" uninstall -y $("$python3" "$repo/scripts/gpu_kit.py" --carried) 2>&1 | grep -v "not installed" >&2 || true
  "$dir/venv/bin/python" -c "import torch, transformers, lightning, peft" \
    || { echo "gpu-like-env: the GPU machine's stack did not install (pip's output above)" >&2; exit 1; }
  # the carry, as --fetch makes it for the GPU machine, but for this Python; fetched with the project's
  # venv (its pins decide the versions, as for the real carry)
  py="$("$dir/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  "${PROJECT_PYTHON:-$repo/.venv/bin/python}" "$repo/scripts/gpu_kit.py" --fetch --python "$py" --carry "$dir/carry" >&2
  touch "$stamp"
fi
echo "$dir"
