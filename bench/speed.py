"""``python bench/speed.py [--quick]``: the same as ``kvq bench speed`` (kvq_core/tools/bench/speed.py)."""
from __future__ import annotations

import sys

from kvq_core.tools.bench.speed import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
