"""What the ``kvq`` command runs: benchmarks, evaluations, ``kvq tune``, ``kvq warmup``, the demo
and the CLI itself, with their helpers (results folder, progress bars, synthetic data, metrics).
Tools sit on top: they use the library and the integrations; nothing below imports them."""
