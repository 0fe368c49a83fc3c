"""vlm_assets: vision-language and language model training as a graph of Dagster assets."""

import os

# Set before anything imports mlflow or transformers (both read some of these at import), in every process
# of the platform and inherited by those it starts; a user's own setting wins. No usage telemetry; no
# progress bars: transformers draws one for each model it loads or saves, MLflow one for each artifact
# download (log_model validating its input example), and in a step or a worker's relayed output they are
# lines of carriage returns in the Dagster log.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
