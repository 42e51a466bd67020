"""Helpers for tests and benchmarks: real multi-process runs with a hard timeout."""
from atorch.testing.launcher import DistributedRunError, run_distributed

__all__ = ["run_distributed", "DistributedRunError"]
