"""Model definitions (pure torch; no dagster imports)."""
