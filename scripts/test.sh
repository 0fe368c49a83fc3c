#!/usr/bin/env bash
# Install everything (if needed), fetch the offline real data, and run the whole test suite on CPU.
#   scripts/test.sh [pytest args]
# GPU-only tests carry the `gpu` marker and are deselected unless a CUDA device is present.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The k8s tests' control plane is compiled from Debian's kubernetes source package when it is not
# cached (5-6 minutes of both cores, once; vlm_assets_tests/k8s/testbed/README.md): started now, beside
# the install and the tests, at the lowest CPU priority, so that it takes only the CPU they leave idle.
# The k8s tests run last in their lane (conftest.py); their fixture waits on the same lock and finds the
# binaries built.
testbed_lock="${XDG_CACHE_HOME:-$HOME/.cache}/k8s-testbed/build.lock"
mkdir -p "$(dirname "$testbed_lock")"
(flock "$testbed_lock" nice -n 19 timeout 60m "$repo/vlm_assets_tests/k8s/testbed/build.sh" \
   > "${testbed_lock%.lock}.log" 2>&1 || true) &
VLM_ASSETS_OP_BUILD=background source "$repo/scripts/bootstrap.sh"
cd "$repo"
# Likewise the GPU kit rehearsal's environment (scripts/gpu-like-env.sh: minutes of downloads and installs
# on a fresh machine, once): its test runs late in the suite and waits on the script's own lock.
(nice -n 19 "$repo/scripts/gpu-like-env.sh" > "$VLM_ASSETS_CACHE/gpu-like-env.log" 2>&1 || true) &
# Lint, format and the layer contracts (pyproject.toml) first: a seconds-long failure, not an hour's.
layers="$(lint-imports --no-logo --no-cache 2>&1)" || { echo "$layers" >&2; echo "a layer contract is broken (pyproject.toml)" >&2; exit 1; }
ruff check --quiet . && ruff format --check --quiet . \
  || { echo "lint failed: 'ruff check --fix . && ruff format .' fixes most of it" >&2; exit 1; }
# VLM_TEST_DEADLINE (epoch seconds, .ci/run sets it): no test starts after it (pytest-timeout's
# session timeout); each test is limited to 20 minutes (pyproject.toml).
deadline=()
if [ -n "${VLM_TEST_DEADLINE:-}" ]; then deadline=(--session-timeout "$(( VLM_TEST_DEADLINE - $(date +%s) ))"); fi
# The CPU tests run with every GPU hidden, on the paths CI runs (gloo, fp32, their tolerances), also on
# a CUDA machine; there the gpu-marked twins run after them, and a skip among those fails.
# The tests that mostly wait (the `beside` marker, conftest.py) run in a second pytest process beside the
# rest, its report printed after theirs. Arguments that select tests (a path, -m, -k) run one process.
status=0
cpu_pytest=(env CUDA_VISIBLE_DEVICES="" python -m pytest "${deadline[@]}" -p no:cacheprovider)
lanes=1
for arg in "$@"; do case "$arg" in -m|-k|-m*|-k*|[!-]*) lanes=0 ;; esac; done
if [ "$lanes" = 1 ]; then
  beside_log="$(mktemp --tmpdir vlm-tests-beside.XXXXXX)"
  # a background job ignores the terminal's Ctrl-C: the lane ends with this script, however it ends
  trap '[ -z "${beside:-}" ] || kill "$beside" 2>/dev/null || true' EXIT
  "${cpu_pytest[@]}" -m "not gpu and beside" "$@" > "$beside_log" 2>&1 &
  beside=$!
  "${cpu_pytest[@]}" -m "not gpu and not beside" "$@" || status=$?
  beside_status=0
  wait "$beside" || beside_status=$?
  echo "=== the tests run beside (-m beside, vlm_assets_tests/conftest.py's BESIDE) ==="
  cat "$beside_log" && rm -f "$beside_log"
  [ "$beside_status" = 0 ] || status=$beside_status
else
  "${cpu_pytest[@]}" -m "not gpu" "$@" || status=$?
fi
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  VLM_TESTS_FAIL_ON_SKIP=1 python -m pytest -m gpu -p no:cacheprovider "$@" || status=$?
fi
exit "$status"
