"""Data preparation: image sources, occlusion manifests, token shards (no dagster imports)."""
