"""A first generate does not wait for Numba (:mod:`kvq_core.compile_ahead`): a ``KVQCache`` whose
backend "auto" would be numba for a spec numba has not compiled on this machine serves from torch,
with a background process compiling numba's kernels; once they are marked compiled, caches get numba.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("numba")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from kvq_core import compile_ahead, registry  # noqa: E402
from kvq_core.integrations.hf import KVQCache  # noqa: E402
from kvq_numba import cache_stamp  # noqa: E402

SPEC = registry.make_spec("oscar", head_dim=64, bits=2)


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Marks looked up in an empty cache directory (this process's Numba keeps its own), background compiles on."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(compile_ahead.ENV, "background")
    monkeypatch.setattr(compile_ahead, "_started", {})
    monkeypatch.setattr(compile_ahead, "_registered", set())
    return tmp_path


def _stop(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the background process leads its own session
    except ProcessLookupError:
        pass


def _tiny_model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128)
    return AutoModelForCausalLM.from_config(config).eval(), torch.randint(0, 128, (1, 200))


def test_an_uncompiled_spec_serves_from_torch_while_numba_compiles_in_the_background(empty_cache: Path, capfd) -> None:
    model, ids = _tiny_model()
    cache = KVQCache(model.config, method="oscar", bits=2)
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        assert {layer.kq.backend for layer in cache.kvq_layers} == {"torch"}
        assert cache.memory_report()["decoded_bytes"] == 0  # still from the codes
        (pid,) = compile_ahead._started.values()
        lock = next(empty_cache.rglob("oscar-numba-*.lock"))
        assert int(lock.read_text()) == pid and compile_ahead._alive(pid)
        err = capfd.readouterr().err
        assert err.count("compiles them in the background") == 1 and f"pid {pid}" in err  # once, not per layer
    finally:
        for pid in compile_ahead._started.values():
            _stop(pid)


def test_a_marked_spec_and_foreground_compiles_get_numba(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert compile_ahead.select_backend(SPEC, "cpu") == "torch"
    for pid in compile_ahead._started.values():
        _stop(pid)
    monkeypatch.setenv(compile_ahead.ENV, "foreground")
    assert compile_ahead.select_backend(SPEC, "cpu") == "numba"
    monkeypatch.setenv(compile_ahead.ENV, "background")
    compile_ahead.mark_warm(SPEC, "numba")
    assert compile_ahead.select_backend(SPEC, "cpu") == "numba"
    assert compile_ahead.select_backend(SPEC.replace(bits=4), "cpu") == "torch"  # marks are per spec
    for pid in compile_ahead._started.values():
        _stop(pid)


def test_a_running_background_compile_is_not_started_twice(empty_cache: Path) -> None:
    compile_ahead.select_backend(SPEC, "cpu")
    (pid,) = compile_ahead._started.values()
    try:
        compile_ahead._started.clear()  # another process: sees the lock of a live compile
        assert compile_ahead.start(SPEC, "numba", cache_stamp.package_cache_dir(), 3, 9, "torch") is None
        assert compile_ahead._started == {compile_ahead._key(SPEC, "numba"): pid}
        # every process that picks a backend there is one the compile rests for, once each
        compile_ahead.select_backend(SPEC.replace(bits=4), "cpu")
        assert compile_ahead._pids(cache_stamp.package_cache_dir() / compile_ahead.USERS) == [os.getpid()]
    finally:
        for started in {pid, *compile_ahead._started.values()}:
            _stop(started)


def test_marks_are_dropped_with_the_kernels(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "k.py").write_text("x = 1\n")
    cache_stamp.drop_stale(pkg)
    mark = pkg / "__pycache__" / "oscar-abc.ready"
    mark.write_text("")
    assert cache_stamp.drop_stale(pkg) == 0 and mark.is_file()
    (pkg / "k.py").write_text("x = 2\n")
    assert cache_stamp.drop_stale(pkg) == 1 and not mark.exists()


@pytest.mark.slow
def test_the_background_process_compiles_and_marks_the_spec(tmp_path: Path) -> None:
    """The real watcher and compiler (this process waiting: idle), on this process's Numba cache (where ``kvq warmup
    oscar:bits=2`` ran in the fast tier: it loads in seconds)."""
    spec = SPEC
    cache = compile_ahead.compile_cache("numba")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    mark = cache._mark(spec)
    mark.unlink(missing_ok=True)
    lock = tmp_path / "x.lock"
    lock.write_text("1")
    try:
        t0 = time.perf_counter()
        users = tmp_path / "x.users"
        users.write_text(f"{os.getpid()}\n")
        out = subprocess.run([sys.executable, "-m", "kvq_core.compile_ahead", "watch", str(users), str(lock), "numba",
                              spec.to_json(), "3", "9"],
                             env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "attend_window ..." in out.stdout and "attend ..." in out.stdout and "compiled in" in out.stdout
        assert cache.ready(spec, "cpu") and not lock.exists(), time.perf_counter() - t0
    finally:
        mark.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the watcher reads /proc")
def test_the_compiler_runs_only_while_the_users_processes_are_idle(tmp_path: Path) -> None:
    """A busy user process stops the compiler (SIGSTOP), idle ones let it run, and it finishes."""
    import threading

    user = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.time()\nwhile time.time() - t < 1.5: pass\n"
                             "time.sleep(60)"])
    compiler = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.3: pass"])

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]

    users = tmp_path / "x.users"
    users.write_text(f"{os.getpid()}\n{user.pid}\n")  # this process waits (idle); the other computes, then rests
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(compile_ahead.watch(users, compiler)))
    watcher.start()
    try:
        time.sleep(0.8)  # the user's process is busy: the compiler is stopped
        assert state(compiler.pid) == "T"
        watcher.join(timeout=30)  # the user's process rests from 1.5 s on: the compiler continues and ends
        assert result == [0]
    finally:
        user.kill()
        compiler.kill()
