"""Benchmarks behind `specjax bench` (never timed unit tests)."""
