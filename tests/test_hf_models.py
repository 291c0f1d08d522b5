"""The model matrix: every popular decoder family through KVQCache.

Per family (tests/tiny_models.py): the fp16 codec with float32 storage equals DynamicCache
under greedy decoding of a left-padded batch and under beam search, with sdpa and with the
"kvq" attention function; and every registered codec runs *and quantizes* every layer (packed
bytes in each, sliding-window layers included, nothing kept exact) under both attention paths.
Models are tiny and torch runs one thread, so the whole matrix takes seconds per family.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_version import skip_unless_cache_keyword  # noqa: E402
from tiny_models import SLIDING_WINDOW, build, configs  # noqa: E402

import kvq_core  # noqa: E402
from kvq_core.errors import InputError  # noqa: E402
from kvq_core.integrations.hf import KVQCache, KVQMemoryWarning, cache_kwargs  # noqa: E402

from transformers import DynamicCache  # noqa: E402

transformers.logging.set_verbosity_error()
FAMILIES = list(configs())
ATTN = ("sdpa", "kvq")  # the model's own attention over decoded K/V (dequant), or attention from the codes
PROMPT = 20  # > SLIDING_WINDOW, so sliding layers drop tokens
NEW = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on 2 shared cores: one thread is several times faster than the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, name, attn):
    if name not in models:
        models[name] = build(name)
    m = models[name]
    m.set_attn_implementation(attn)
    return m


def _mode(attn):
    """The cache's attention for a model set to ``attn``: its own (sdpa) over decoded K/V, or kvq's from the
    codes where the model allows it (MLA attends by decoding)."""
    return "dequant" if attn == "sdpa" else "auto"


def _batch(n=PROMPT, batch=2, pad=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1:, :pad] = 0  # left padding on every row but the first
    ids[mask == 0] = 0
    return ids, mask


def _gen(model, ids, mask, cache, **kw):
    kw.setdefault("max_new_tokens", NEW)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, **cache_kwargs(model, cache), pad_token_id=0, **kw)


def _kinds(config):
    return getattr(config, "layer_types", None) or ["?"] * config.num_hidden_layers


def test_matrix_covers_the_issue_families():
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt_neox", "olmo2", "granite",
            "deepseek_v3"} <= set(FAMILIES)
    dims = {n: KVQCache(c, "fp16").kvq_layers[0].key_spec.head_dim for n, c in configs().items()}
    assert dims["phi3"] == 96 and dims["gpt_neox"] == 80 and dims["deepseek_v3"] == 32  # the MLA latent


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_equals_dynamic_cache(models, family, attn):
    """Left-padded batch, then beam search: token for token what DynamicCache generates."""
    model = _model(models, family, attn)
    ids, mask = _batch()
    ref = _gen(model, ids, mask, DynamicCache(config=model.config))
    cache = KVQCache(model.config, "fp16", storage="float32", residual=4, attention=_mode(attn))
    assert torch.equal(_gen(model, ids, mask, cache), ref)
    assert cache.memory_report()["packed_bytes"] > 0 and not cache.exact_layers
    ids, mask = _batch(batch=1, seed=1)
    ref = _gen(model, ids, mask, DynamicCache(config=model.config), num_beams=2)
    out = _gen(model, ids, mask, KVQCache(model.config, "fp16", storage="float32", residual=4, attention=_mode(attn)),
               num_beams=2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_codec_quantizes_every_layer(models, family, attn):
    model = _model(models, family, attn)
    ids, mask = _batch(batch=1)
    n_layers = model.config.num_hidden_layers
    for method in [r.name for r in kvq_core.list_methods() if r.available and r.name != "fp16"]:
        cache = KVQCache(model.config, method, residual=2, attention=_mode(attn))
        out = _gen(model, ids, mask, cache)
        assert out.shape == (1, PROMPT + NEW), method
        layers = cache.kvq_layers
        assert len(layers) == n_layers and not cache.exact_layers, method
        assert all(layer.packed_bytes > 0 for layer in layers), (method, [layer.packed_bytes for layer in layers])
        for layer, kind in zip(layers, _kinds(cache.config)):
            if kind == "sliding_attention":  # tokens left at the window edge
                assert layer.sliding_window == SLIDING_WINDOW and layer.evicted == PROMPT + NEW - SLIDING_WINDOW \
                    or not kvq_core.tokens.token_separable(layer.key_spec, "keys"), (method, layer.evicted)
        report = cache.memory_report()
        assert report["stored_bits_per_element"] < 16 and report["fp_layer_bytes"] == 0, method


def test_sliding_layers_can_stay_exact_and_say_so(models):
    model = _model(models, "gemma3", "sdpa")
    ids, mask = _batch(batch=1)
    with pytest.warns(UserWarning, match=r"1 of 2 layers keep full-precision K/V: 0 \(sliding_layers='exact'\)"):
        cache = KVQCache(model.config, "octopus", residual=2, sliding_layers="exact")
    _gen(model, ids, mask, cache)
    report = cache.memory_report()
    assert report["exact_layers"] == {0: "sliding_layers='exact'"}
    assert report["fp_layer_bytes"] > 0 and report["packed_bytes"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # quantizing every layer warns about nothing
        KVQCache(model.config, "octopus", residual=8)
    with pytest.raises(InputError, match="sliding_layers"):
        KVQCache(model.config, "octopus", sliding_layers="fp")


def test_a_residual_covering_the_sliding_window_warns_and_is_reported(models):
    """A sliding-window layer whose exact window covers every token it keeps stores no codes
    (e.g. OScaR/KIVI's residual 128 over Mistral's window): said once when the cache is
    built, with the fix, and listed in memory_report()['uncoded_layers']."""
    model = _model(models, "mistral", "kvq")
    ids, mask = _batch(n=10, batch=1)  # a prompt shorter than the residual: decoding alone fills the window
    for method, residual, flush in (("oscar", None, "block"), ("kivi", SLIDING_WINDOW + 1, "block"),
                                    ("octopus", SLIDING_WINDOW, "sliding")):
        r = 128 if residual is None else residual
        with pytest.warns(KVQMemoryWarning, match=rf"2 of 2 layers quantize nothing.*residual={r} with flush='{flush}' "
                                                  rf"covers its sliding_window={SLIDING_WINDOW}.*residual={SLIDING_WINDOW // 2}"):
            cache = KVQCache(model.config, method, residual=residual)
        _gen(model, ids, mask, cache, max_new_tokens=3 * SLIDING_WINDOW)
        report = cache.memory_report()
        assert report["packed_bytes"] == 0 and set(report["uncoded_layers"]) == {0, 1}, method
    for method, residual in (("octopus", SLIDING_WINDOW - 1), ("kivi", SLIDING_WINDOW)):  # one token short: codes
        with warnings.catch_warnings():
            warnings.simplefilter("error", KVQMemoryWarning)
            cache = KVQCache(model.config, method, residual=residual)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KVQMemoryWarning)  # KIVI's straddling token group is read decoded
            _gen(model, ids, mask, cache, max_new_tokens=3 * SLIDING_WINDOW)
        assert cache.memory_report()["uncoded_layers"] == {} and all(layer.packed_bytes for layer in cache.kvq_layers)


def test_mistral_sliding_window_compresses_with_the_default_config():
    """MistralConfig's default sliding_window (4096) makes every layer a sliding layer: kvq stores
    them all (nothing exact, no warning) and they evict at the window edge."""
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = KVQCache(config, "turboquant")
    assert [layer.sliding_window for layer in cache.kvq_layers] == [config.sliding_window] * 2
    assert all(layer.is_sliding for layer in cache.kvq_layers)


def test_mla_refuses_codes_attention_and_names_mla():
    config = configs()["deepseek_v3"]
    with pytest.raises(InputError, match="multi-head latent attention.*attention='dequant'"):
        KVQCache(config, "octopus", attention="codes")
    cache = KVQCache(config, "octopus")
    layer = cache.kvq_layers[0]
    assert (layer.key_spec.head_dim, layer.value_spec.head_dim, layer.attention) == (32, 16, "dequant")


def test_importing_kvq_core_hf_registers_the_attention_function():
    import importlib

    import kvq_core.integrations.hf
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for mapping in (AttentionInterface._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        mapping.pop("kvq", None)
    importlib.reload(kvq_core.integrations.hf)  # what a first `import kvq_core.integrations.hf` runs
    assert "kvq" in AttentionInterface._global_mapping and "kvq" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.parametrize("method", ["oscar", "kivi", "octopus", "turboquant"])
def test_sliding_layers_codes_attention_equals_dequant(models, method):
    """On all-sliding Mistral, attention from codes (kvq) and over decoded K/V (sdpa) see the same
    tokens: token-group codecs (OScaR, KIVI) whose blocks straddle the window edge included."""
    ids, mask = _batch(n=30, batch=1)
    logits = {}
    for attn, mode in (("kvq", "codes"), ("sdpa", "dequant")):
        model = _model(models, "mistral", attn)
        cache = KVQCache(model.config, method, residual=4, attention=mode)
        with torch.no_grad():
            steps = [model(ids[:, :24], **cache_kwargs(model, cache)).logits[:, -1]]
            for i in range(24, 30):
                steps.append(model(ids[:, i:i + 1], **cache_kwargs(model, cache)).logits[:, -1])
        logits[attn] = torch.stack(steps)
        assert all(layer.cumulative_length > layer.sliding_window and layer.packed_bytes for layer in cache.kvq_layers)
    torch.testing.assert_close(logits["kvq"], logits["sdpa"], rtol=1e-4, atol=1e-4)


def test_readme_transformers_snippet_runs():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## transformers integration", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    skip_unless_cache_keyword(snippet)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    report = scope["cache"].memory_report()  # the obvious call saves the memory: nothing decoded is kept
    assert report["packed_bytes"] > 0 and report["decoded_bytes"] == 0
    assert report["total_bytes"] < report["dynamic_cache_bytes"] / 2
