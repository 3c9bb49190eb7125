"""The engine's C kernels beside their loaders (same stem): sampling (temperature-only rows)."""
