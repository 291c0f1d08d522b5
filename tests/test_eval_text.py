"""WikiText-2 for ``kvq eval``: found locally, else loaded once through ``datasets`` and cached;
offline, the error names the file or flag to pass. No test touches the network: ``datasets``
is made unimportable or replaced by a fake module in ``sys.modules``."""
from __future__ import annotations

import hashlib
import socket
import sys
import time
import types
from pathlib import Path

import pytest

from kvq_core.tools import cli
from kvq_core.tools.eval import text

SHARED = next((p / "shared" / "data" / text.DEFAULT_FILE for p in Path(__file__).resolve().parents
               if (p / "shared" / "data" / text.DEFAULT_FILE).is_file()), None)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A pip-installed layout: no shared/data above the working directory or the package, an
    empty kvq cache, no $KVQ_EVAL_TEXT."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(text, "__file__", str(tmp_path / "site-packages" / "kvq_core" / "eval" / "text.py"))
    monkeypatch.setenv(text.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(text.ENV, raising=False)
    return tmp_path


def fake_datasets(rows: list[str] | None = None, error: Exception | None = None) -> types.ModuleType:
    """A stand-in ``datasets`` module whose load_dataset returns ``{"text": rows}`` or raises."""
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if error is not None:
            raise error
        return {"text": rows}

    mod = types.ModuleType("datasets")
    mod.load_dataset = load_dataset
    mod.calls = calls
    return mod


@pytest.mark.skipif(SHARED is None, reason="no shared/data/wikitext2-test.txt beside this checkout")
def test_the_repo_copy_is_found_and_is_the_documented_file() -> None:
    assert text.default_text_path() == SHARED
    body, source = text.load_text()
    assert source == str(SHARED) and len(body.encode("utf-8")) == 1_296_370
    assert hashlib.sha256(body.encode("utf-8")).hexdigest() == text.WIKITEXT_SHA256


def test_env_and_text_file_win(elsewhere, monkeypatch) -> None:
    f = elsewhere / "mine.txt"
    f.write_text("hello", encoding="utf-8")
    monkeypatch.setenv(text.ENV, str(f))
    assert text.load_text() == ("hello", str(f))
    monkeypatch.delenv(text.ENV)
    assert text.load_text(str(f)) == ("hello", str(f))
    with pytest.raises(FileNotFoundError, match="--text-file nope.txt: no such file"):
        text.load_text("nope.txt")


def test_without_datasets_the_error_names_the_flag(elsewhere, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert text.default_text_path() is None
    with pytest.raises(FileNotFoundError) as err:
        text.load_text()
    msg = str(err.value)
    assert "datasets package is not installed" in msg and "--text-file PATH" in msg and "$KVQ_EVAL_TEXT" in msg
    assert str(elsewhere / "cache") in msg


def test_offline_the_error_says_so_and_names_the_flag(elsewhere, monkeypatch) -> None:
    fake = fake_datasets(error=ConnectionError("Couldn't reach the hub (offline mode is enabled)"))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"offline mode is on .* --text-file PATH"):
        text.load_text()
    assert fake.calls == [text.WIKITEXT]
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(text, "hub_unreachable", lambda: None)  # the probe passed; datasets then failed
    with pytest.raises(FileNotFoundError, match=r"ConnectionError: Couldn't reach the hub.*--text-file PATH"):
        text.load_text()


def _closed_port() -> int:
    """A local TCP port nothing listens on (connecting is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable_hub(monkeypatch) -> str:
    """``$HF_ENDPOINT`` at a closed local port (no traffic leaves the machine), no proxy, online mode."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    for var in (*text.PROXY_VARS, *text.OFFLINE_VARS):
        monkeypatch.delenv(var, raising=False)
    return endpoint


def test_an_unreachable_hub_fails_at_once_before_datasets_retries(elsewhere, unreachable_hub, monkeypatch) -> None:
    fake = fake_datasets(rows=["never read"])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert "cannot reach 127.0.0.1" in text.hub_unreachable()
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"hub is unreachable: cannot reach 127\.0\.0\.1.*--text-file PATH"):
        text.load_text()
    assert time.perf_counter() - t0 < 2 and fake.calls == []  # datasets was never asked


def test_kvq_eval_without_a_text_file_fails_within_seconds(elsewhere, unreachable_hub, monkeypatch, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows=["never read"]))
    t0 = time.perf_counter()
    for command in (["eval", "ppl"], ["eval", "niah"]):
        assert cli.main([*command, "--out", str(elsewhere / "out.json")]) == 2
        assert "--text-file PATH" in capsys.readouterr().err
    assert time.perf_counter() - t0 < 10


def test_download_joins_rows_like_the_repo_copy_and_caches_it(elsewhere, monkeypatch, capsys) -> None:
    rows = ["", " = Robert Boulter = \n", "", " Robert Boulter is an English actor .\n"]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows))
    monkeypatch.setattr(text, "hub_unreachable", lambda: None)
    body, source = text.load_text()
    assert body == "\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English actor .\n"
    cached = elsewhere / "cache" / text.DEFAULT_FILE
    assert source == str(cached) and cached.read_text(encoding="utf-8") == body
    err = capsys.readouterr().err
    assert "through datasets" in err and "warning" in err and f"cached WikiText-2 at {cached}" in err
    # the next run needs neither datasets nor the network
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert text.load_text() == (body, str(cached))


def test_cli_prints_the_message_not_a_traceback(monkeypatch, capsys) -> None:
    def main(argv):
        raise FileNotFoundError("no text; pass --text-file PATH")

    monkeypatch.setitem(sys.modules, "fake_eval", types.SimpleNamespace(main=main))
    monkeypatch.setitem(cli.FORWARDED, ("eval", "ppl"), "fake_eval")
    assert cli.main(["eval", "ppl"]) == 2
    assert capsys.readouterr().err == "kvq: error: no text; pass --text-file PATH\n"
