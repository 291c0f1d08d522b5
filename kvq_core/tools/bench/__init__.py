"""Benchmarks reachable from the CLI (``kvq bench fidelity``, ``kvq bench speed``)."""
