"""vlm_assets: vision-language and language model training as a graph of Dagster assets."""
