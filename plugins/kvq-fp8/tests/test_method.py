"""fp8 as a kvq user meets it: listed with its distribution, reachable through get_quantizer,
accurate to the format's precision, and usable in KVQCache and the perplexity evaluation."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import kvq_core
from kvq_core.errors import SpecError
from kvq_fp8.formats import FORMATS


def test_kvq_list_names_the_distribution_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "kvq_core.tools.cli", "list", "--json"], capture_output=True, text=True,
                         check=True).stdout
    listing = json.loads(out)
    method = next(m for m in listing["methods"] if m["name"] == "fp8")
    assert method["available"] and method["origin"] == "plugin fp8 (kvq-fp8 0.1.0)"
    assert "numpy" in method["detail"]
    plugin = next(p for p in listing["plugins"] if p["name"] == "fp8")
    assert plugin["available"] and "kernels numpy/fp8" in plugin["detail"]
    numpy_backend = next(b for b in listing["backends"] if b["name"] == "numpy")
    assert "fp8" in numpy_backend["detail"]


@pytest.mark.parametrize(("fmt", "mantissa_bits"), [("e4m3", 3), ("e5m2", 2)])
@pytest.mark.parametrize("scale", ["token", "head"])
def test_error_is_within_half_an_ulp_of_the_format(fmt: str, mantissa_bits: int, scale: str) -> None:
    q = kvq_core.get_quantizer("fp8", format=fmt, scale=scale, head_dim=64)
    assert q.backend == "numpy"  # NumPy input: the reference
    k = np.random.default_rng(0).standard_normal((2, 2, 50, 64)).astype(np.float32)
    pk = q.encode_keys(k)
    err = np.abs(q.decode_keys(pk) - k)
    # normal range: |error| <= 2**-(m+1) relative; subnormals: half the smallest step, times the scale
    amax = np.abs(k).max(axis=-1 if scale == "token" else (-2, -1), keepdims=True)
    f = FORMATS[fmt]
    tiny = amax / f.max * f.magnitudes[1] / 2
    assert np.all(err <= np.maximum(np.abs(k) * 2.0 ** -(mantissa_bits + 1), tiny) * (1 + 1e-6))
    assert np.all(np.abs(q.decode_keys(pk)).max(axis=-1) <= amax.max(axis=-1) * (1 + 1e-6))
    expected_bits = 8 + (32 / 64 if scale == "token" else 32 / (50 * 64))
    assert math.isclose(pk.bits_per_element(), expected_bits)


def test_bad_parameters_are_typed_errors() -> None:
    with pytest.raises(SpecError, match="format"):
        kvq_core.get_quantizer("fp8", format="e3m4")
    with pytest.raises(SpecError, match="scale"):
        kvq_core.get_quantizer("fp8", scale="channel")


def test_blocks_travel_between_backends() -> None:
    torch = pytest.importorskip("torch")
    qn = kvq_core.get_quantizer("fp8", backend="numpy", head_dim=64)
    qt = kvq_core.get_quantizer("fp8", backend="torch", head_dim=64)
    k = np.random.default_rng(1).standard_normal((1, 2, 9, 64)).astype(np.float32)
    pt = qt.encode_keys(torch.from_numpy(k))
    pn = qn.encode_keys(k)
    np.testing.assert_array_equal(pt.fields["codes"].numpy(), pn.fields["codes"])
    np.testing.assert_array_equal(qn.decode_keys(kvq_core.PackedKV.from_dict(pt.to_dict())), qn.decode_keys(pn))


# -- transformers: a tiny random llama (no download) ------------------------------------------
@pytest.fixture(scope="module")
def model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def _decode_logits(model, cache, ids, prefix: int):
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch

    with torch.no_grad():
        model(ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
        return torch.cat([model(ids[:, t:t + 1], **cache_kwargs(model, cache), use_cache=True).logits
                          for t in range(prefix, ids.shape[1])], dim=1)


def test_kvq_cache_decodes_close_to_the_full_precision_cache(model) -> None:
    import torch
    from transformers import DynamicCache

    from kvq_core.integrations.hf import KVQCache

    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = _decode_logits(model, DynamicCache(config=model.config), ids, 24)
    errors = {}
    for fmt in ("e4m3", "e5m2"):
        for scale in ("token", "head"):
            cache = KVQCache(model.config, "fp8", format=fmt, scale=scale)
            out = _decode_logits(model, cache, ids, 24)
            layer = cache.kvq_layers[0]
            assert layer.residual == 0 and layer.flush == ("sliding" if scale == "token" else "block")
            assert layer.blocks  # the K/V really live in packed fp8 blocks
            errors[fmt, scale] = float((out - ref).abs().max() / ref.abs().max())
    assert all(0 < e < 0.05 for e in errors.values()), errors
    assert errors["e5m2", "token"] > errors["e4m3", "token"]  # one mantissa bit less


def test_perplexity_evaluation_scores_fp8_like_a_builtin(model) -> None:
    import torch

    from kvq_core.tools.eval.caches import parse_config
    from kvq_core.tools.eval.ppl import score_window

    ids = torch.randint(0, 128, (1, 49), generator=torch.Generator().manual_seed(8))
    fp, ref = score_window(model, ids, parse_config("fp"), 32, 16, backend="auto", shared=None, chunk=None,
                           keep_logprobs=True)
    runs = {text: score_window(model, ids, parse_config(text), 32, 16, backend="auto", shared=None, chunk=None,
                               reference=ref)[0]
            for text in ("fp8:format=e4m3", "fp8:format=e5m2,scale=head")}
    for text, run in runs.items():
        assert 0 < run["kl"] < 0.05, (text, run["kl"])
        assert math.isclose(run["nll"], fp["nll"], rel_tol=0.02)
    assert math.isclose(runs["fp8:format=e4m3"]["bits_per_element"], 8 + 32 / 16, rel_tol=1e-6)
