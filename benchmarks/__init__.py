"""Benchmarks and GPU checks of EntmaxKV (run on a GPU: python -m benchmarks.<name>)."""
