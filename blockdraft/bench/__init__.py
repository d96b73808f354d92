"""Benchmarks: methods side by side on the same prompts, in one process."""
