"""Benchmarks, load tests and the reference baseline: ``python -m benchmarks --help``."""
