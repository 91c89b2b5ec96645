"""Held-out benchmarks, the evaluation runner, base-policy prompt selection."""
