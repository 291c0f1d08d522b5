"""How kvq's Numba CPU kernels use threads: a fork-safe threading layer where one is installed,
one thread for small calls, and a clear error in a forked child that cannot run them.

- **Layer.** Numba picks TBB, then OpenMP, then its workqueue. TBB is fork-safe and thread-safe
  and, on a loaded machine, its idle workers sleep instead of spinning (a 1-token attend with 2
  threads while other processes loaded the 2-core machine: TBB 20 us, GNU OpenMP 0.6-2.9 ms).
  pip's ``tbb`` wheel (in kvq's ``numba`` extra) puts ``libtbb.so.12`` in ``<prefix>/lib``,
  which the loader does not search, so :func:`prefer_tbb` loads it first; then Numba finds it.
  Without TBB Numba uses GNU OpenMP, which is not fork-safe.
- **Small calls** run on the calling thread: the kernel classes estimate a call's work and
  :func:`run` it with this thread's Numba thread count at 1 below :data:`PARALLEL_MIN_WORK`
  (restored after). Done from Python, not inside the kernels: ``numba.set_num_threads`` in an
  ``@njit`` function makes it uncacheable (a ctypes global), so every process would recompile it.
- **fork().** Under GNU OpenMP, a child forked after a parallel kernel ran is killed by Numba's
  OpenMP layer at its next parallel kernel; :func:`run` raises
  ``BackendUnavailableError`` naming the fixes instead. TBB and the workqueue layer work in the
  child.

``NUMBA_THREADING_LAYER`` set by the user is always respected (``tbb``/``safe`` get the preload too).
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

from kvq_core.errors import BackendUnavailableError

#: Work (about 0.3-0.5 ns of one core per unit: a multiply-add of attention; an encoded element
#: weighs 16-64, a decoded one 8) below which a call runs on one thread: such a call takes ~0.2 ms
#: or less on one core, which a second thread cannot save when waking it costs 10-50 us on a quiet
#: machine and milliseconds on a loaded one. Measured single-threaded (AVX2, 3 KV heads x 64):
#: OScaR INT2 attend 0.17-0.5 ns per multiply-add, encode 3-6 ns per element, decode 2-4.5;
#: OCTOPUS b=3 attend 0.4-0.8 ns, encode 20 ns per element.
PARALLEL_MIN_WORK = 1 << 19
#: work weights of an encoded element (integer codes, OCTOPUS triplets) and a decoded one
ENCODE_WEIGHT, OCTOPUS_ENCODE_WEIGHT, DECODE_WEIGHT = 16, 64, 8

#: why the Numba CPU kernels cannot run in this (forked) process, or None
_fork_error: str | None = None
#: (get, set) of this thread's Numba thread count, bound on first use
_count: tuple[Callable[[], int], Callable[[int], Any]] | None = None
#: whether :func:`watch_forks` registered its fork hook
_watching = False


def prefer_tbb() -> None:
    """Make TBB from pip's ``tbb`` wheel loadable before Numba chooses its threading layer (Linux;
    nothing when the user chose omp or workqueue, when TBB is not installed, or once Numba started)."""
    if os.environ.get("NUMBA_THREADING_LAYER", "default").lower() in ("omp", "workqueue") \
            or not sys.platform.startswith("linux"):
        return
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and getattr(parallel, "_is_initialized", False):
        return
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:  # a broken install: Numba falls back to its next layer
                continue
            return


def layer() -> str | None:
    """The threading layer Numba started with, or None before its first parallel kernel."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is None or not getattr(parallel, "_is_initialized", False):
        return None
    return getattr(parallel, "_threading_layer", None)


def _after_fork_in_child() -> None:
    global _fork_error
    if layer() == "omp":
        _fork_error = (
            "numba's threading layer here is GNU OpenMP, which cannot run in a process forked after it "
            "started (Numba would kill this process); fixes: pip install tbb (kvq's numba extra: Numba then "
            "uses its fork-safe TBB layer), or set NUMBA_THREADING_LAYER=workqueue before importing kvq "
            "(fork-safe, but one kernel at a time per process), or start workers with "
            "multiprocessing.get_context('spawn') or 'forkserver'")


def _thread_count() -> tuple[Callable[[], int], Callable[[int], Any]]:
    """Numba's own C entry points for this thread's count (0.2 us a call, against ~1.5 us for the
    checked ``numba.get_num_threads``/``set_num_threads``), once its threads are started."""
    global _count
    if _count is None:
        import numba
        from numba.np.ufunc import parallel

        numba.get_num_threads()  # starts the threading layer
        get, put = getattr(parallel, "_get_num_threads", None), getattr(parallel, "_set_num_threads", None)
        _count = (get, put) if get is not None and put is not None else (numba.get_num_threads, numba.set_num_threads)
    return _count


def count() -> int:
    """This thread's Numba thread count (the fast entry point of :func:`_thread_count`)."""
    return int((_count or _thread_count())[0]())


def run(work: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: a CPU kernel call with about ``work`` units (:data:`PARALLEL_MIN_WORK`),
    on this thread alone when small. Raises in a forked child that cannot run the kernels."""
    if _fork_error is not None:
        raise BackendUnavailableError(_fork_error)
    if work >= PARALLEL_MIN_WORK:
        return fn(*args)
    get, put = _count or _thread_count()
    threads = get()
    if threads <= 1:
        return fn(*args)
    put(1)
    try:
        return fn(*args)
    finally:
        put(threads)


def watch_forks() -> None:
    """Once per process: a child forked after Numba's threads started learns whether it can run the kernels
    (:func:`run` raises there with the fixes, instead of Numba killing the process)."""
    global _watching
    if not _watching and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _watching = True
