"""Kernels that compile on first use, compiled ahead: the warm-up that compiles a spec's kernels, and
the choice that keeps a first ``generate`` from waiting for it.

A backend whose kernels compile into a disk cache on first use (numba: minutes for a fused decode
kernel on a small CPU) says so with a :class:`~kvq_core.contract.CompileCache`. Where ``backend="auto"``
would pick it for a spec whose kernels are not compiled yet, :func:`select_backend` starts a
background process that compiles them (:func:`warm`, at the lowest CPU priority) and picks the next
backend (on the CPU: torch, which compiles nothing ahead) for now; a cache created after the
background compile has finished gets the compiled backend, loading its kernels from disk in well
under a second. Codes are the same layout on every backend, so nothing else changes.
``KVQ_COMPILE=foreground`` turns this off: the first call compiles (what ``kvq warmup`` does up front).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvq_core import registry
from kvq_core.api import get_quantizer
from kvq_core.contract import CompileCache, resolve
from kvq_core.errors import BackendUnavailableError
from kvq_core.spec import MethodSpec

#: the environment variable that chooses ``background`` (default) or ``foreground`` compiles
ENV = "KVQ_COMPILE"
#: KV heads and query heads of the warm-up's arrays (SmolLM2-135M's; kernels compile per type, not per count)
KV_HEADS, Q_HEADS = 3, 9

_started: dict[str, int] = {}
_lock = threading.Lock()


def warm(spec: MethodSpec, backend: str, kv_heads: int = KV_HEADS, q_heads: int = Q_HEADS,
         say: Callable[[str], Any] = lambda _: None, every: bool = True) -> float:
    """Encode (a block and one token), decode and attend a small block of ``spec`` on ``backend`` with
    an exact window in one call where the backend fuses the two (what a ``KVQCache`` decode step
    calls), so every kernel a cache runs during ``generate`` is compiled; ``every``: also the plain
    attend a fused backend runs only for masked steps (padded batches); returns the seconds it took."""
    t0 = time.perf_counter()
    q = get_quantizer(spec, backend)
    rng = np.random.default_rng(0)
    d, g = spec.head_dim, max(1, q_heads // kv_heads)
    kv = rng.standard_normal((1, kv_heads, 40, d)).astype(np.float32)
    query = rng.standard_normal((1, kv_heads * g, 1, d)).astype(np.float32)
    label = f"{spec.describe()} on {q.backend}:"
    say(f"{label} encode ...")
    pk, pv = q.encode_keys(kv), q.encode_values(kv)
    q.encode_keys(kv[:, :, :1]), q.encode_values(kv[:, :, :1])  # a decode step's token: small calls may run other kernels
    say(f"{label} decode ...")
    q.decode_keys(pk), q.decode_values(pv)
    fused = q.fuses_window(query)
    if fused:  # what a KVQCache decode step calls: the blocks and the exact window at once
        say(f"{label} attend_window ...")
        q.attend_window(query, [(pk, pv)], kv[:, :, :4], kv[:, :, :4])
    if every or not fused:
        say(f"{label} attend ...")
        q.attend(query, pk, pv)
    return time.perf_counter() - t0


def compile_cache(backend: str) -> CompileCache | None:
    """The backend's :class:`~kvq_core.contract.CompileCache`, or None where nothing compiles ahead."""
    ref = registry.backend_info(backend).compiled
    if ref is None:
        return None
    obj = resolve(ref)
    return obj() if isinstance(obj, type) else obj


def mark_warm(spec: MethodSpec, backend: str) -> None:
    """After :func:`warm` on the CPU: record that ``spec``'s kernels on ``backend`` are compiled."""
    cache = compile_cache(backend)
    if cache is not None:
        cache.mark_ready(spec)


def select_backend(spec: MethodSpec, device: str | None, kv_heads: int = KV_HEADS, q_heads: int = Q_HEADS) -> str:
    """``backend="auto"`` for a cache whose first call should not wait for a compiler: the registry's
    choice where its kernels are compiled (or compile on no disk), else the next choice while the
    first compiles in a background process; the first choice too where no other backend serves the
    spec or ``KVQ_COMPILE=foreground``."""
    chosen = registry.select_backend(spec, device)
    cache = compile_cache(chosen)
    if cache is None or os.environ.get(ENV, "background") == "foreground":
        return chosen
    register(cache.directory())  # a compile running now, or started below, rests while this process computes
    if cache.ready(spec, device):
        return chosen
    try:
        fallback = registry.select_backend(spec, device, exclude=(chosen,))
    except BackendUnavailableError:
        return chosen
    other = compile_cache(fallback)
    if other is not None and not other.ready(spec, device):
        return chosen
    start(spec, chosen, cache.directory(), kv_heads, q_heads, fallback)
    return fallback


def _key(spec: MethodSpec, backend: str) -> str:
    return f"{spec.method}-{backend}-{hashlib.sha256(spec.to_json().encode()).hexdigest()[:16]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def start(spec: MethodSpec, backend: str, directory: Path, kv_heads: int, q_heads: int, meanwhile: str) -> int | None:
    """Start (once per process, and not while another process compiles the same) a background
    ``python -m kvq_core.compile_ahead watch ...`` that compiles ``spec`` on ``backend`` in a child of its
    own while the processes using the backend are idle (:func:`watch`, :func:`register`) and marks it
    compiled; says so on stderr. Returns the watcher's process id, or None where one was already running."""
    key = _key(spec, backend)
    with _lock:
        if key in _started:
            return None
        lock, log = directory / f"{key}.lock", directory / f"{key}.log"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            pid = int(lock.read_text() or 0) if lock.is_file() else 0
        except (OSError, ValueError):
            pid = 0
        if pid and _alive(pid):  # another process's compile (which rests while this one computes: register)
            _started[key] = pid
            return None
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvq_core.compile_ahead", "watch", str(directory / USERS), str(lock),
                                     backend, spec.to_json(), str(kv_heads), str(q_heads)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        lock.write_text(str(proc.pid))
        _started[key] = proc.pid
    print(f"kvq: {backend}'s kernels for {spec.describe()} are not compiled on this machine yet; {meanwhile} serves "
          f"this cache, and {backend} compiles them in the background whenever this process is idle or after it exits "
          f"(pid {proc.pid}, log {log}); caches made after that use {backend}. `kvq warmup` compiles up front; "
          "KVQ_COMPILE=foreground compiles on the first call.", file=sys.stderr, flush=True)
    return proc.pid


def _cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far (Linux ``/proc``); None when it is gone or unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


#: how often the watcher looks at the user's process (s), and the CPU share of one core above which it counts as busy
POLL_S, BUSY = 0.1, 0.1


#: the file, in a compile cache's directory, that lists the processes a background compile rests for
USERS = "compile.users"
_registered: set[Path] = set()


def register(directory: Path) -> None:
    """List this process (once) among those the background compiles in ``directory`` rest for: every
    process that picks a backend through :func:`select_backend` there, so a compile started by one
    process does not slow another one's torch threads."""
    with _lock:
        if directory in _registered:
            return
        users = directory / USERS
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if users.is_file() and users.stat().st_size > 4096:  # keep it short: the live ones only
                users.write_text("".join(f"{pid}\n" for pid in _pids(users) if _alive(pid)))
            with open(users, "a") as f:
                f.write(f"{os.getpid()}\n")
        except OSError:
            return
        _registered.add(directory)


def _pids(users: Path) -> list[int]:
    """The process ids listed in ``users``, one a line (none when it cannot be read)."""
    try:
        return [int(x) for x in users.read_text().split()]
    except (OSError, ValueError):
        return []


def watch(users: Path, compiler: subprocess.Popen) -> int:
    """Let ``compiler`` run only while every process listed in ``users`` (:func:`register`) is idle (each used under :data:`BUSY` of a core over the last
    :data:`POLL_S`) or gone: stopped (SIGSTOP) while one computes, continued (SIGCONT) when all rest. A
    multi-threaded torch process slows down many times over when another process holds a core, even at the
    lowest priority: its threads meet at a barrier after every op. Without ``/proc``, the compiler just runs.
    Returns the compiler's exit status."""
    import signal

    last: dict[int, float | None] = {}
    stopped = False
    while compiler.poll() is None:
        time.sleep(POLL_S)
        busy = False
        for pid in _pids(users):
            now = _cpu_seconds(pid)
            before = last.get(pid)
            busy |= now is not None and before is not None and now - before > BUSY * POLL_S
            last[pid] = now
        if busy != stopped:
            compiler.send_signal(signal.SIGSTOP if busy else signal.SIGCONT)
            stopped = busy
    return compiler.returncode


def _yield_cpu() -> None:
    """Run on idle CPU time only: Linux's SCHED_IDLE, else the lowest nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        if hasattr(os, "nice"):
            os.nice(19)


def main(argv: list[str] | None = None) -> int:
    """The background processes. ``watch USERS LOCK BACKEND SPEC_JSON KV_HEADS Q_HEADS``: run the compile
    below while the processes listed in ``USERS`` are idle (:func:`watch`), then drop the lock. ``compile BACKEND SPEC_JSON KV_HEADS
    Q_HEADS``: :func:`warm` at idle priority and mark the spec compiled."""
    mode, *args = argv if argv is not None else sys.argv[1:]
    if mode == "watch":
        import signal

        users, lock, rest = Path(args[0]), Path(args[1]), args[2:]
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the compiler goes too, never left stopped
        compiler = subprocess.Popen([sys.executable, "-m", "kvq_core.compile_ahead", "compile", *rest])
        try:
            return watch(users, compiler)
        finally:
            if compiler.poll() is None:
                compiler.kill()
            lock.unlink(missing_ok=True)
    backend, spec_json, kv_heads, q_heads = args
    _yield_cpu()
    spec = registry.spec_from_dict(json.loads(spec_json))
    seconds = warm(spec, backend, int(kv_heads), int(q_heads), say=lambda m: print(m, flush=True))
    mark_warm(spec, backend)
    print(f"{spec.describe()} on {backend}: compiled in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
