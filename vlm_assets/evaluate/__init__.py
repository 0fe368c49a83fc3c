"""Evaluation code (no dagster imports)."""
