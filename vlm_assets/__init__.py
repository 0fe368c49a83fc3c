"""vlm_assets: vision-language and language model training as a graph of Dagster assets."""

import os

# Before anything imports mlflow: no usage telemetry from the platform (the library reads it at import).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
