"""Shared test setup (keep small). Inductor's on-disk cache persists across runs, so compiled
tests pay the ~30 s cold compile once per machine, not per run."""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvq-inductor"))
