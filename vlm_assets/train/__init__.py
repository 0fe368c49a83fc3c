"""Training entry points and their Lightning parts (no dagster imports: they run inside torchrun workers)."""
