"""Benchmarks: each script prints its figures and the machine it ran on."""
