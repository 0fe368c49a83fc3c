#!/usr/bin/env bash
# Install everything and materialize the whole graph once on the embedded default:
# artifacts in var/artifacts, Dagster's sqlite instance in var/dagster, MLflow in var/mlflow.db.
#   scripts/demo.sh                     # demo profile: offline real data, tiny models, CPU
#   VLM_ASSETS_PROFILE=seed scripts/demo.sh   # seed scale (needs the hubs and GPUs)
# Run it again: unchanged assets are cache hits.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
cd "$repo"
export VLM_ASSETS_HOME="${VLM_ASSETS_HOME:-$repo/var}"
export DAGSTER_HOME="${DAGSTER_HOME:-$VLM_ASSETS_HOME/dagster}"
mkdir -p "$DAGSTER_HOME"
[ -f "$DAGSTER_HOME/dagster.yaml" ] || cp "$repo/dagster.yaml" "$DAGSTER_HOME/dagster.yaml"
dg launch --job main_job "$@"
