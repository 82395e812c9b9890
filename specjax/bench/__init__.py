"""Benchmarks behind `specjax bench` and `specjax serve-bench` (`loadbench.py`: the serving rules
under offered load); never timed unit tests."""
