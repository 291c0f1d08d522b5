"""What the numba backend does before its kernels first run, once per process, and never on import
(importing :mod:`kvq_numba`, its plugin, or a kernel class's module, as the registry's listing does,
changes nothing): cached kernels of changed sources are deleted, not run (:mod:`kvq_numba.cache_stamp`),
first compiles are announced (:mod:`kvq_numba.compile_notice`), Numba's fork-safe TBB threading layer
is preferred and a forked child learns whether it can run the kernels (:mod:`kvq_numba.threads`).
The kernel classes call :func:`prepare` when constructed."""
from __future__ import annotations

from kvq_numba import cache_stamp, compile_notice, threads

_prepared = False


def prepare() -> None:
    """Everything above, the first time it is called (the stale-cache check once per cache directory)."""
    global _prepared
    cache_stamp.check()
    if not _prepared:
        compile_notice.install()
        threads.prefer_tbb()
        threads.watch_forks()
        _prepared = True
