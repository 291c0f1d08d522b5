"""transformers integration: KVQCache and the "kvq" attention function on a tiny llama GGUF.

The model is written in the test with the gguf package (tests/tiny_gguf.py) and loaded through
transformers' GGUF path, so nothing is downloaded.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import load_tiny_llama  # noqa: E402

import kvq_core  # noqa: E402
from kvq_core.errors import InputError, KVQError, SpecError  # noqa: E402
from kvq_core.integrations.hf import KVQCache, KVQLayer, cache_kwargs, dynamic_cache_nbytes, merge_attention, register  # noqa: E402
from kvq_core.integrations.hf.flush import default_stride  # noqa: E402

from transformers import DynamicCache  # noqa: E402

transformers.logging.set_verbosity_error()
register()

# 2 layers, hidden 64, 4 query heads / 2 KV heads (GQA); head_dim 16 and 32 variants
SHAPES = {16: dict(head_dim=16), 32: dict(head_dim=32, seed=1, name="tiny-hd32.gguf")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for hd, kw in SHAPES.items():
        out[hd] = load_tiny_llama(tmp_path_factory.mktemp(f"gguf{hd}"), **kw)
    return out


@pytest.fixture(scope="module")
def model(models):
    return models[16]


def _ids(n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


def _attn(model, name):
    model.set_attn_implementation(name)
    return model


def _gen(model, ids, cache, n=12, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache), **kw)


def _methods():
    return [r.name for r in kvq_core.list_methods() if r.available]


# -- loading ----------------------------------------------------------------------------------
def test_tiny_gguf_loads_as_llama(models):
    for hd, m in models.items():
        cfg = m.config
        assert cfg.model_type == "llama" and cfg.head_dim == hd
        assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2 and cfg.num_hidden_layers == 2
        assert m.dtype == torch.float32


# -- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_fp16_method_equals_dynamic_cache(model, backend):
    _attn(model, "sdpa")
    ids = _ids(40)
    ref = _gen(model, ids, DynamicCache(config=model.config), n=20)
    exact = _gen(model, ids, KVQCache(model.config, "fp16", backend, storage="float32", residual=8), n=20)
    assert torch.equal(exact, ref)
    half = _gen(model, ids, KVQCache(model.config, "fp16", backend), n=20)  # float16 storage, default residual 0
    assert torch.equal(half, ref)


def test_fp16_equals_dynamic_with_past_key_values_kwarg(model):
    _attn(model, "sdpa")
    ids = _ids(24, seed=3)
    ref = _gen(model, ids, DynamicCache(config=model.config), n=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=10, do_sample=False,
                                 past_key_values=KVQCache(model.config, "fp16", storage="float32", residual=8))
    assert torch.equal(out, ref)


def test_cache_kwargs_names_the_keyword_this_transformers_takes(model):
    """A forward call through ``cache_kwargs`` fills the cache handed in (a keyword the model does
    not take would be swallowed by its ``**kwargs``, leaving the cache empty); the keyword is the
    one the model class declares, and a model that declares neither is refused by name."""
    from kvq_core.integrations.hf.cache_arg import cache_keyword

    _attn(model, "sdpa")
    cache = KVQCache(model.config, "oscar", bits=2, residual=8)
    with torch.no_grad():
        model(_ids(21), **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 21

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert cache_keyword(New) == "cache" and cache_keyword(Old) == "past_key_values"
    with pytest.raises(TypeError, match="Neither.forward takes its cache by none of cache, past_key_values"):
        cache_keyword(Neither)


def test_layer_kwargs_of_either_transformers_shape_give_every_layer(model, monkeypatch):
    """transformers before 5.19 returns one kwargs dict for all layers, later ones a list per layer:
    KVQCache builds one layer per layer type from either (the dict once zipped to no layers)."""
    from kvq_core.integrations.hf import cache as cache_mod

    n = model.config.num_hidden_layers
    monkeypatch.setattr(cache_mod, "get_layer_types_and_kwargs", lambda config: (["full_attention"] * n, {}))
    shared = KVQCache(model.config, "oscar", bits=2)
    monkeypatch.setattr(cache_mod, "get_layer_types_and_kwargs", lambda config: (["full_attention"] * n, [{}] * n))
    per_layer = KVQCache(model.config, "oscar", bits=2)
    assert len(shared.layers) == len(per_layer.layers) == n
    assert [type(x) for x in shared.layers] == [type(x) for x in per_layer.layers] == [KVQLayer] * n


def test_beam_search_reorders_packed_blocks(model):
    _attn(model, "sdpa")
    ids = _ids(200, batch=2, seed=5)  # long enough that later flushes stay apart (JOIN_RATIO)
    ref = _gen(model, ids, DynamicCache(config=model.config), n=10, num_beams=3)
    cache = KVQCache(model.config, "fp16", storage="float32", residual=4)
    out = _gen(model, ids, cache, n=10, num_beams=3)
    assert torch.equal(out, ref)
    assert len(cache.layers[0].blocks) >= 2
    # a quantized cache runs beam search too
    out = _gen(model, ids, KVQCache(model.config, "oscar", bits=2, residual=4), n=6, num_beams=2)
    assert out.shape == (2, 206)


# -- every method -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", _methods())
def test_generation_runs_with_every_method(models, method):
    for hd in (16, 32):
        try:
            cache = KVQCache(models[hd].config, method, residual=8)
        except SpecError:
            continue
        m = _attn(models[hd], "sdpa")
        ids = _ids(21, seed=hd)
        out = _gen(m, ids, cache, n=8)
        assert out.shape == (1, 29)
        assert cache.get_seq_length() == 28  # the last generated token is never fed back
        layer = cache.layers[0]
        assert isinstance(layer, KVQLayer)
        # block flush: whole multiples of 8 packed; sliding: all but the last 7 (the spec decides), and up to
        # stride - 1 more encoded ahead of need (the default stride, flush.default_stride)
        packed = 24 if layer.flush == "block" else 21
        assert layer.stride == default_stride(layer.flush, 8, None)
        assert packed <= layer.packed_length <= packed + layer.stride - 1 and layer.window_length == 28 - packed
        assert layer.flush == type(layer.key_spec).default_flush
        report = cache.memory_report()
        assert report["packed_bytes"] > 0 and math.isfinite(report["bits_per_element"])
        return
    pytest.skip(f"{method} supports neither head_dim 16 nor 32")


# -- bookkeeping ----------------------------------------------------------------------------------
def test_length_bookkeeping_across_prefill_decode_and_flush(model):
    _attn(model, "sdpa")
    cache = KVQCache(model.config, "oscar", bits=2, residual=8)
    layer = cache.layers[1]
    with torch.no_grad():
        model(_ids(37), **cache_kwargs(model, cache))
        assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (37, 32, 5)
        assert cache.get_mask_sizes(1, 0) == (38, 0)
        for step in range(1, 4):  # window 6, 7 -> kept; 8 -> attended, then flushed
            model(_ids(1, seed=step), **cache_kwargs(model, cache))
        assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (40, 40, 0)
        assert layer.block_tokens == [40]  # the flush of 8 joined the block of 32 (32 <= JOIN_RATIO * 8)
        model(_ids(1, seed=9), **cache_kwargs(model, cache))
        assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (41, 40, 1)
        model(_ids(20, seed=10), **cache_kwargs(model, cache))  # a chunk: window 21 -> 16 packed, 5 kept
        assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (61, 56, 5)
    cache.reset()
    assert cache.get_seq_length() == 0 and layer.blocks == [] and not layer.is_initialized
    with torch.no_grad():
        model(_ids(9), **cache_kwargs(model, cache))
    assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (9, 8, 1)


def test_rejected_flush_leaves_the_layer_unchanged(model):
    """A block that cannot be stored (float16 scales overflow) raises before any state changes."""
    cache = KVQCache(model.config, "kivi", bits=2, group=4, residual=4, attention="dequant")  # updates read by no attention
    layer = cache.layers[0]
    kv = torch.randn(1, model.config.num_key_value_heads, 6, layer.key_spec.head_dim)
    layer.update(kv, kv)
    before = (layer.cumulative_length, layer.packed_length, layer.window_length, list(layer.block_tokens))
    window = layer.keys.clone()
    with pytest.raises(KVQError, match="stores 'scale' as float16, which overflows"):
        layer.update(kv[:, :, :2] * 1e6, kv[:, :, :2])
    assert (layer.cumulative_length, layer.packed_length, layer.window_length, list(layer.block_tokens)) == before
    assert torch.equal(layer.keys, window)
    layer.update(kv[:, :, :2], kv[:, :, :2])  # and it goes on as if the bad step never came
    assert (layer.cumulative_length, layer.packed_length, layer.window_length) == (8, 8, 0)


def test_a_rejected_step_leaves_every_layer_unchanged(model):
    """The last layer rejects its block: the layers before it, which had taken the step
    (a full-precision layer and packed flushes), are put back; the next step runs as if the
    rejected one never came."""
    _attn(model, "sdpa")
    cache, ref = (KVQCache(model.config, "oscar", bits=2, residual=8, fp_layers=(0,)) for _ in range(2))

    def reject(k):
        raise InputError("rejected for the test")

    with torch.no_grad():
        for c in (cache, ref):
            model(_ids(13), **cache_kwargs(model, c))
        last = cache.layers[-1]
        last.kq.encode_keys = reject  # 5 window tokens + 3 new = 8: every layer flushes a block
        with pytest.raises(KVQError, match="rejected for the test"):
            model(_ids(3, seed=5), **cache_kwargs(model, cache))
        del last.kq.encode_keys
        for a, b in zip(cache.layers, ref.layers):
            assert a.get_seq_length() == b.get_seq_length() == 13
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert getattr(a, "block_tokens", None) == getattr(b, "block_tokens", None)
        got = model(_ids(3, seed=5), **cache_kwargs(model, cache)).logits
        want = model(_ids(3, seed=5), **cache_kwargs(model, ref)).logits
    assert torch.equal(got, want)


def test_default_residual_comes_from_the_spec(model):
    for method in ("oscar", "octopus", "fp16"):
        cache = KVQCache(model.config, method)
        spec_cls = kvq_core.registry.method_info(method).spec_cls
        assert cache.layers[0].residual == spec_cls.default_residual


def test_crop_inside_a_block_only_for_per_token_layouts(model):
    _attn(model, "sdpa")
    ids = _ids(20, seed=11)
    cache = KVQCache(model.config, "oscar", bits=4, residual=8)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))  # 16 packed (one block of token groups) + 4 exact
        cache.crop(-2)
        assert cache.get_seq_length() == 18 and cache.layers[0].window_length == 2
        with pytest.raises(KVQError, match="inside a packed block"):
            cache.crop(-5)
        assert cache.get_seq_length() == 18  # a refused crop changes nothing
        cache.crop(-18)
        assert cache.get_seq_length() == 0
        # a per-token layout keeps a block's leading tokens: cropping into the block, then
        # continuing, equals a fresh cache of the kept prefix
        cache = KVQCache(model.config, "fp16", storage="float32", residual=8)
        model(ids, **cache_kwargs(model, cache))
        cache.crop(-7)  # 4 from the window, 3 from the packed block
        layer = cache.layers[0]
        assert (cache.get_seq_length(), layer.packed_length, layer.window_length) == (13, 13, 0)
        ref = DynamicCache(config=model.config)
        model(ids[:, :13], **cache_kwargs(model, ref))
        a = model(ids[:, 13:19], **cache_kwargs(model, cache)).logits
        b = model(ids[:, 13:19], **cache_kwargs(model, ref)).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_fp_layers_and_split_key_value_codecs(model):
    _attn(model, "sdpa")
    cache = KVQCache(model.config, "oscar", bits=3, fp_layers=(-1,), value_params={"bits": 2}, residual=8,
                     attention="dequant")
    assert type(cache.layers[1]) is transformers.cache_utils.DynamicLayer
    layer = cache.layers[0]
    assert layer.key_spec.bits == 3 and layer.value_spec.bits == 2 and not layer.same_spec
    with torch.no_grad():
        model(_ids(33), **cache_kwargs(model, cache))
        model(_ids(1), **cache_kwargs(model, cache))  # attends over 32 packed + 2 exact tokens
    report = cache.memory_report()
    assert report["fp_layer_bytes"] == dynamic_cache_nbytes(cache) - layer.window_bytes()
    assert 3.0 < report["stored_bits_per_element"] < 16.0 < report["bits_per_element"]  # + the decoded copy (dequant)
    keys_fp = KVQCache(model.config, "oscar", bits=2, fp_key_layers=(0,))
    assert keys_fp.layers[0].key_spec.method == "fp16" and keys_fp.layers[0].value_spec.method == "oscar"


def test_memory_accounting(model):
    _attn(model, "sdpa")
    ids = _ids(64, seed=2)
    ref = DynamicCache(config=model.config)
    cache = KVQCache(model.config, "oscar", bits=2, residual=16, attention="dequant")
    with torch.no_grad():
        model(ids, **cache_kwargs(model, ref))
        model(ids, **cache_kwargs(model, cache))
        model(_ids(1), **cache_kwargs(model, cache))  # dequant-mode attention decodes the packed history once
    report = cache.memory_report()
    assert report["dynamic_cache_bytes"] == dynamic_cache_nbytes(ref) * 65 // 64
    assert report["stored_bytes"] == report["packed_bytes"] + report["window_bytes"] < dynamic_cache_nbytes(ref) / 3
    # dequant mode keeps a decoded copy of the 64 packed tokens (float32, K and V): counted, not hidden
    assert report["decoded_bytes"] == 64 * 2 * 2 * 16 * 4 * cache.config.num_hidden_layers
    assert cache.nbytes() == report["total_bytes"] == report["stored_bytes"] + report["decoded_bytes"]
    assert report["bits_per_element"] == pytest.approx(
        report["stored_bits_per_element"] + 8 * report["decoded_bytes"] / (65 * 2 * 2 * 16 * cache.config.num_hidden_layers))
    cache.drop_decoded()
    assert cache.memory_report()["decoded_bytes"] == 0
    assert cache.nbytes() == cache.memory_report()["stored_bytes"]


def test_a_decoded_copy_warns_once_with_why_and_the_fix(model):
    """The memory saving lost in dequant mode is said: one warning per cache, naming why and the
    fix; the default attention on an sdpa model attends from the codes and warns nothing."""
    from kvq_core.integrations.hf import KVQMemoryWarning

    _attn(model, "sdpa")
    cache = KVQCache(model.config, "oscar", bits=2, residual=16, attention="dequant")
    with pytest.warns(KVQMemoryWarning) as got:
        with torch.no_grad():
            model(_ids(40), **cache_kwargs(model, cache))
            for _ in range(3):
                model(_ids(1), **cache_kwargs(model, cache))
    assert len(got) == 1
    message = str(got[0].message)
    assert "decoded float copy" in message and "attention='dequant' was asked for" in message
    assert "attention='auto'" in message and "cache_decoded=False" in message
    assert model.config._attn_implementation == "sdpa"  # dequant leaves the model's attention alone
    cache = KVQCache(model.config, "oscar", bits=2, residual=16)  # the default: the cache arranges attention from codes
    assert model.config._attn_implementation == "kvq"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(_ids(40), **cache_kwargs(model, cache))
            model(_ids(1), **cache_kwargs(model, cache))
    assert cache.memory_report()["total_bytes"] == cache.memory_report()["stored_bytes"]
    assert cache.memory_report()["decoded_bytes"] == 0 and cache.memory_report()["packed_bytes"] > 0
    _attn(model, "sdpa")


def test_head_dim_is_checked_against_the_method(models):
    with pytest.raises(SpecError):
        KVQCache(models[16].config, "oscar", bits=9)


# -- attention from codes -----------------------------------------------------------------------
def test_merge_attention_is_exact():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=g) for _ in range(3))
    full = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    parts = []
    for sl in (slice(0, 1), slice(1, 3)):
        logits = q @ k[:, :, sl].transpose(-1, -2)
        parts.append((torch.softmax(logits, -1) @ v[:, :, sl], torch.logsumexp(logits, -1)))
    assert torch.allclose(merge_attention(parts), full, atol=1e-6)


@pytest.mark.parametrize("method,params", [("fp16", {"storage": "float32"}), ("oscar", {"bits": 2}), ("octopus", {"bits": 3})])
def test_codes_attention_matches_dequant_attention(model, method, params):
    ids = _ids(50, seed=4)
    logits = {}
    for attn, mode in (("sdpa", "dequant"), ("kvq", "codes"), ("kvq", "dequant")):
        _attn(model, attn)
        cache = KVQCache(model.config, method, residual=16, attention=mode, **params)
        with torch.no_grad():
            outs = [model(ids[:, :35], **cache_kwargs(model, cache)).logits, model(ids[:, 35:36], **cache_kwargs(model, cache)).logits,
                    model(ids[:, 36:50], **cache_kwargs(model, cache)).logits]
        logits[attn, mode] = torch.cat(outs, dim=1)
        if mode == "codes":  # no decoded history; at most a block a sliding stride encoded ahead, decoded
            layers = cache.layers
            ahead = sum(2 * (l.stride - 1) * l.keys.shape[1] * l.keys.shape[3] * 4 for l in layers)
            assert layers[0].codes_mode and all(l.history_copy_bytes() == 0 for l in layers)
            assert cache.memory_report()["decoded_bytes"] <= ahead
    _attn(model, "sdpa")
    assert torch.allclose(logits["kvq", "codes"], logits["kvq", "dequant"], atol=2e-4, rtol=1e-4)
    assert torch.allclose(logits["kvq", "codes"], logits["sdpa", "dequant"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method,params", [("octopus", {"bits": 3}), ("turboquant", {"bits": 2})])
def test_sliding_chunks_equal_token_by_token_decoding(model, method, params):
    """With chunks="decode" and the kvq attention function a chunked forward of a sliding-flush
    cache gives every query exactly its `residual` most recent tokens exact, as decoding one
    token at a time does; under sdpa a chunk sees more exact tokens, so its logits differ."""
    ids = _ids(40, seed=6)
    out = {}
    for attn, mode, steps in (("sdpa", "dequant", [1] * 40), ("kvq", "dequant", [17, 1, 12, 10]),
                              ("kvq", "codes", [17, 1, 12, 10]), ("sdpa", "dequant", [17, 1, 12, 10])):
        _attn(model, attn)
        cache = KVQCache(model.config, method, residual=6, attention=mode, chunks="decode", **params)
        assert cache.layers[0].flush == "sliding" and cache.chunks == "decode"
        pos, parts = 0, []
        with torch.no_grad():
            for n in steps:
                parts.append(model(ids[:, pos:pos + n], **cache_kwargs(model, cache)).logits)
                pos += n
        out[attn, mode, len(steps)] = torch.cat(parts, dim=1)
        layer = cache.layers[0]
        assert 35 <= layer.packed_length <= 35 + layer.stride - 1 and layer.window_length == 5
        assert layer.block_tokens == sorted(layer.block_tokens, reverse=True)  # joined as they come
        if mode == "codes":  # tokens encoded ahead are decoded from their own blocks: no copy of the history
            assert all(x.history_copy_bytes() == 0 for x in cache.kvq_layers), layer.stride
    _attn(model, "sdpa")
    decode = out["sdpa", "dequant", 40]
    assert torch.allclose(out["kvq", "dequant", 4], decode, atol=2e-4, rtol=1e-4)
    assert torch.allclose(out["kvq", "codes", 4], decode, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(out["sdpa", "dequant", 4], decode, atol=1e-2)


@pytest.mark.parametrize("stride", [3, 8])
def test_sliding_stride_changes_nothing_attention_sees(model, stride):
    """A stride encodes tokens ahead of need; they are read exact until they leave the window,
    so logits equal stride 1's, decoding token by token (sdpa; kvq from codes) and in
    decode-view chunks, and the cache holds at most stride - 1 tokens twice."""
    ids = _ids(40, seed=12)
    out = {}
    for attn, mode, steps, s in (("sdpa", "dequant", [1] * 40, 1), ("sdpa", "dequant", [1] * 40, stride),
                                 ("kvq", "codes", [1] * 40, stride), ("kvq", "dequant", [17, 1, 12, 10], stride),
                                 ("kvq", "codes", [17, 1, 12, 10], stride)):
        _attn(model, attn)
        cache = KVQCache(model.config, "octopus", bits=3, residual=6, stride=s, attention=mode, chunks="decode")
        pos, parts = 0, []
        with torch.no_grad():
            for n in steps:
                parts.append(model(ids[:, pos:pos + n], **cache_kwargs(model, cache)).logits)
                pos += n
                layer = cache.layers[0]
                ahead = layer.packed_length - (layer.cumulative_length - layer.window_length)
                assert 0 <= ahead <= s - 1 and layer.window_length == min(5, pos)
        out[attn, mode, len(steps), s] = torch.cat(parts, dim=1)
    _attn(model, "sdpa")
    ref = out["sdpa", "dequant", 40, 1]
    for key, logits in out.items():
        assert torch.allclose(logits, ref, atol=2e-4, rtol=1e-4), key
    # cropping drops the codes of cut tokens too, those encoded ahead included
    cache = KVQCache(model.config, "octopus", bits=3, residual=6, stride=stride)
    with torch.no_grad():
        for t in range(30):
            model(ids[:, t:t + 1], **cache_kwargs(model, cache))
        layer = cache.layers[0]
        assert layer.window_length == 5 and layer.packed_length > 25  # tokens 25..29 exact, some also packed
        cache.crop(-4)
        assert (layer.cumulative_length, layer.window_length, layer.packed_length) == (26, 1, 26)
        assert layer.decoded_history()[0].shape[-2] == 26
        out = model(ids[:, 26:30], **cache_kwargs(model, cache)).logits
    assert out.shape[1] == 4 and cache.get_seq_length() == 30


def test_codes_mode_decodes_a_block_encoded_ahead_once(model, monkeypatch):
    """Codes mode reads the tokens a stride encoded ahead decoded until the window passes them:
    each such block is decoded once (kept, and reported in decoded_bytes), not at every step."""
    from kvq_core.integrations.hf.layer import KVQLayer

    counts = {"decode": 0, "commit": 0}
    decode_pair, commit = KVQLayer.decode_pair, KVQLayer._commit

    def counting_decode(self, pk, pv):
        counts["decode"] += self.layer_idx == 0
        return decode_pair(self, pk, pv)

    def counting_commit(self, pk, pv, m):
        counts["commit"] += self.layer_idx == 0
        return commit(self, pk, pv, m)

    monkeypatch.setattr(KVQLayer, "decode_pair", counting_decode)
    monkeypatch.setattr(KVQLayer, "_commit", counting_commit)
    _attn(model, "kvq")
    ids = _ids(40, seed=13)
    cache = KVQCache(model.config, "octopus", bits=3, residual=6, stride=8, attention="codes")
    held = []
    with torch.no_grad():
        for t in range(40):
            model(ids[:, t:t + 1], **cache_kwargs(model, cache))
            held.append(cache.memory_report()["decoded_bytes"])
    _attn(model, "sdpa")
    assert counts["commit"] >= 4 and 0 < counts["decode"] <= counts["commit"]
    assert max(held) > 0  # the decoded block is reported, not hidden
    cache.drop_decoded()
    assert cache.memory_report()["decoded_bytes"] == 0


def test_cache_stride_defaults_per_layer(model):
    """Without a stride, sliding layers with an exact window encode 8 tokens at once; other layers one flush at a
    time; an explicit stride wins."""
    assert {layer.stride for layer in KVQCache(model.config, "octopus", bits=3).layers} == {8}
    assert {layer.stride for layer in KVQCache(model.config, "octopus", bits=3, residual=0).layers} == {1}
    assert {layer.stride for layer in KVQCache(model.config, "turboquant", bits=3).layers} == {1}  # residual 0
    assert {layer.stride for layer in KVQCache(model.config, "oscar", bits=2).layers} == {1}  # block flush
    assert {layer.stride for layer in KVQCache(model.config, "octopus", bits=3, stride=1).layers} == {1}
    assert {layer.stride for layer in KVQCache(model.config, "octopus", bits=3, stride=3).layers} == {3}


def test_flush_and_chunk_modes_are_checked(model):
    with pytest.raises(InputError, match="flush='sliding' needs per-token layouts"):
        KVQCache(model.config, "oscar", bits=2, flush="sliding")
    with pytest.raises(InputError, match="flush='window'"):
        KVQCache(model.config, "octopus", bits=2, flush="window")
    with pytest.raises(InputError, match="stride=2 applies to flush='sliding'"):
        KVQCache(model.config, "oscar", bits=2, stride=2)
    with pytest.raises(InputError, match="stride=0"):
        KVQCache(model.config, "octopus", bits=2, stride=0)
    cache = KVQCache(model.config, "octopus", bits=2)
    with pytest.raises(InputError, match="chunks='fast'"):
        cache.chunks = "fast"
    assert cache.chunks == "exact" and cache.layers[0].flush == "sliding"
    # OScaR's values are per token (its keys are not): OCTOPUS keys with them slide
    mixed = KVQCache(model.config, "octopus", bits=2, value_method="oscar", value_params={"bits": 2})
    assert mixed.layers[0].flush == "sliding"
    assert KVQCache(model.config, "oscar", bits=2, value_method="octopus").layers[0].flush == "block"


def test_sliding_decode_keeps_few_blocks(model):
    _attn(model, "sdpa")
    cache = KVQCache(model.config, "octopus", bits=2, residual=4)
    with torch.no_grad():
        model(_ids(50), **cache_kwargs(model, cache))
        for step in range(40):
            model(_ids(1, seed=step), **cache_kwargs(model, cache))
    layer = cache.layers[0]
    assert (layer.packed_length, layer.window_length) == (87, 3)
    assert sum(layer.block_tokens) == 87 and len(layer.blocks) <= 1 + math.ceil(math.log2(40)) + 1
    assert layer.decoded_history()[0].shape[-2] == 87


def test_codes_attention_generation_equals_dynamic_cache(model):
    _attn(model, "sdpa")
    ids = _ids(30, seed=8)
    ref = _gen(model, ids, DynamicCache(config=model.config), n=16)
    _attn(model, "kvq")
    try:
        out = _gen(model, ids, KVQCache(model.config, "fp16", storage="float32", residual=8), n=16)
        out_fp = _gen(model, ids, KVQCache(model.config, "oscar", bits=4, fp_layers=(0,), residual=8), n=4)
    finally:
        _attn(model, "sdpa")
    assert torch.equal(out, ref)
    assert out_fp.shape == (1, 34)


def test_codes_mode_where_the_model_cannot_attend_from_codes_is_caught(model):
    """attention='codes' switches an sdpa or eager model to kvq's function, and is refused, with the
    reason, where the model cannot attend from codes (there 'auto' falls back to dequant); a model
    switched away after the cache was built is caught at the next step."""
    for impl in ("sdpa", "eager"):
        _attn(model, impl)
        KVQCache(model.config, "oscar", bits=2, residual=8, attention="codes")
        assert model.config._attn_implementation == "kvq"
    _attn(model, "eager")
    model.config.output_attentions = True
    try:
        with pytest.raises(InputError, match=r"attention='codes' needs .*'kvq'.*output_attentions=True.*'dequant'"):
            KVQCache(model.config, "oscar", bits=2, residual=8, attention="codes")  # caught when the cache is built
        cache = KVQCache(model.config, "oscar", bits=2, residual=8)
        assert model.config._attn_implementation == "eager" and not cache.kvq_layers[0].codes_mode
    finally:
        model.config.output_attentions = False
    _attn(model, "kvq")
    cache = KVQCache(model.config, "oscar", bits=2, residual=8, attention="codes")
    _attn(model, "sdpa")  # switched after the cache was built: caught at the next step
    with torch.no_grad():
        model(_ids(10), **cache_kwargs(model, cache))
        with pytest.raises(KVQError, match="never consumed"):
            model(_ids(1), **cache_kwargs(model, cache))


# -- evaluation helpers ---------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "kvq"])
def test_shared_prefill_equals_real_prefill(model, attn):
    from kvq_core.tools.eval.caches import build_cache, parse_config, populate

    _attn(model, attn)
    ids = _ids(48, seed=6)
    for text in ("oscar:bits=2,residual=8", "octopus:bits=2,residual=8", "fp"):
        cfg = parse_config(text)
        real, shared_cache, dyn = build_cache(cfg, model.config), build_cache(cfg, model.config), DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :40], **cache_kwargs(model, real))
            model(ids[:, :40], **cache_kwargs(model, dyn))
            populate(shared_cache, dyn)
            a = model(ids[:, 40:], **cache_kwargs(model, real)).logits
            b = model(ids[:, 40:], **cache_kwargs(model, shared_cache)).logits
        if attn == "sdpa":
            assert torch.equal(a, b), text
        else:  # the real prefill attends with the kvq function, the shared one with sdpa: float rounding
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), text
    _attn(model, "sdpa")


def test_eval_config_parsing_and_chunks(model):
    from kvq_core.tools.eval.caches import build_cache, parse_config, stored
    from kvq_core.tools.eval.ppl import chunk_plan, token_elements, window_starts

    cfg = parse_config("oscar:bits=3,v.bits=2,residual=16,fp_layers=0;-1,label=mine")
    assert (cfg.label, cfg.kind, cfg.params, cfg.value_params) == ("mine", "kvq", {"bits": 3}, {"bits": 2})
    assert cfg.options == {"residual": 16, "fp_layers": [0, -1]} and cfg.nominal_bits == "K3/V2"
    assert parse_config("oscar:bits=2,token_scaling=false").params == {"bits": 2, "token_scaling": False}
    assert parse_config("polarquant:level_bits=3;2;2,label=p").params == {"level_bits": [3, 2, 2]}
    assert parse_config("quanto:nbits=2").label == "hf-quanto-int2"
    cache = build_cache(parse_config("octopus:bits=2,residual=32"), model.config)
    assert chunk_plan(parse_config("octopus:bits=2,residual=32"), cache, 1536, 100, None) == [32, 32, 32, 4]
    assert chunk_plan(parse_config("fp"), None, 100, 200, None) == [28, 128, 44]
    assert chunk_plan(parse_config("fp"), None, 100, 50, 20) == [20, 20, 10]
    assert window_starts(10_000, 1000, 4, 3, tuning=False) == [4, 6, 8]
    assert window_starts(10_000, 1000, 4, 3, tuning=True) == [0, 1, 2]
    with torch.no_grad():
        model(_ids(40), **cache_kwargs(model, cache))
    s = stored(cache, token_elements(model.config))
    assert s["elements"] == 2 * 40 * token_elements(model.config)


def test_niah_answer_check():
    from kvq_core.tools.eval.niah import answer_ok

    assert answer_ok(" 71432. Remember", "71432")
    assert not answer_ok(" 7143", "71432") and not answer_ok(" none", "71432")


def test_ppl_kl_against_the_fp_reference(model):
    from kvq_core.tools.eval.caches import parse_config
    from kvq_core.tools.eval.ppl import score_window

    ids = _ids(49, seed=8)
    fp = parse_config("fp")
    run, ref = score_window(model, ids, fp, 32, 16, backend="auto", shared=None, chunk=None, keep_logprobs=True)
    assert run["kl"] is None and ref.shape == (16, model.config.vocab_size)
    assert math.isclose(run["nll"], -ref.gather(1, ids[0, 33:49, None]).sum().item(), rel_tol=1e-6)
    same, _ = score_window(model, ids, fp, 32, 16, backend="auto", shared=None, chunk=8, reference=ref)
    assert abs(same["kl"]) < 1e-6 and math.isclose(same["nll"], run["nll"], rel_tol=1e-5)
    coarse, none = score_window(model, ids, parse_config("oscar:bits=2,residual=8"), 32, 16, backend="auto",
                                shared=None, chunk=None, reference=ref)
    fine, _ = score_window(model, ids, parse_config("oscar:bits=4,residual=8"), 32, 16, backend="auto",
                           shared=None, chunk=None, reference=ref)
    assert none is None and coarse["kl"] > fine["kl"] > 0


def test_ppl_sliding_chunks_score_as_token_by_token_decoding(model):
    """A sliding cache scored in chunks through the kvq attention function gives the NLL of
    scoring it one token per step (what sdpa falls back to), and less exact context than a
    plain chunked forward would give."""
    from kvq_core.tools.eval.caches import build_cache, parse_config
    from kvq_core.tools.eval.ppl import chunk_plan, score_window

    ids = _ids(61, seed=9)
    cfg = parse_config("octopus:bits=2,residual=6")
    runs = {}
    try:
        for attn in ("kvq", "sdpa"):
            _attn(model, attn)
            runs[attn], _ = score_window(model, ids, cfg, 20, 40, backend="auto", shared=None, chunk=None)
        assert chunk_plan(cfg, build_cache(cfg, model.config), 20, 40, None, decode_view=False) == [1] * 40
        assert chunk_plan(cfg, build_cache(cfg, model.config), 20, 40, None) == [4, 6, 6, 6, 6, 6, 6]
        _attn(model, "sdpa")
        plain, _ = score_window(model, ids, cfg, 20, 40, backend="auto", shared=None, chunk=20)
    finally:
        _attn(model, "sdpa")
    assert math.isclose(runs["kvq"]["nll"], runs["sdpa"]["nll"], rel_tol=1e-5)
    assert not math.isclose(runs["kvq"]["nll"], plain["nll"], rel_tol=1e-3)


def test_seed_expansion_and_group_summary():
    from kvq_core.tools.eval.caches import expand_seeds, parse_config
    from kvq_core.tools.eval.ppl import summarize, summarize_groups

    cfgs = [parse_config(t) for t in ("fp", "octopus:bits=3", "oscar:bits=2", "turboquant:bits=3,seed=5",
                                      "turboquant:bits=3,value_method=octopus,v.bits=2,label=tq")]
    out = expand_seeds(cfgs, [0, 1])
    assert [c.label for c in out] == ["fp", "octopus-3@seed0", "octopus-3@seed1", "oscar-2", "turboquant-3[seed=5]",
                                      "tq@seed0", "tq@seed1"]
    assert out[2].params == {"bits": 3, "seed": 1} and out[2].value_params == {} and out[2].group == "octopus-3"
    assert out[6].value_params == {"bits": 2, "seed": 1}  # a different value codec gets the seed too
    assert expand_seeds(cfgs, None) == cfgs
    runs = [{"label": lab, "window": w, "nll": nll, "tokens": 100, "kl": kl, "bits_per_element": 4.0, "score_s": 1.0,
             "cache_bytes": 1, "dynamic_bytes": 2}
            for lab, w, nll, kl in [("fp", 0, 200.0, None), ("octopus-3@seed0", 0, 202.0, 1.0),
                                    ("octopus-3@seed1", 0, 204.0, 3.0)]]
    rows = summarize(runs, out, "fp")
    groups = summarize_groups(rows)
    assert len(groups) == 1 and groups[0]["group"] == "octopus-3" and groups[0]["seeds"] == 2
    d0, d1 = 100 * (math.exp(0.02) - 1), 100 * (math.exp(0.04) - 1)
    assert groups[0]["deltas"] == pytest.approx([d0, d1])
    assert groups[0]["delta_mean"] == pytest.approx((d0 + d1) / 2)
    assert groups[0]["delta_sd"] == pytest.approx(abs(d1 - d0) / math.sqrt(2))
    assert groups[0]["kl_mean"] == pytest.approx(0.02)


def _byte_tokenizer(corpus):
    """A real byte-level BPE tokenizer (``tokenizers``), trained in memory: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.mark.parametrize("form", ["repeat", "single"])
def test_niah_multikey_prompt(form):
    import random
    import re

    from kvq_core.tools.eval.niah import INTRO, PromptBuilder

    hay = " ".join(f"Sentence {i} of the haystack talks about nothing in particular." for i in range(400))
    tok = _byte_tokenizer(hay)
    builder = PromptBuilder(tok, "wikitext", hay)
    for depth in (0.0, 0.5, 1.0):
        prefix, question, answer = builder.build("multikey", 2000, depth, random.Random(depth), 3, 100, form)
        assert len(prefix) + len(question) == 2000
        text, q = tok.decode(prefix), tok.decode(question)
        word = re.search(r"magic number for (\w+)\?", q).group(1)
        found = re.findall(r"The special magic number for (\w+) is (\d+)\.", text)
        assert len(found) == 3 and len({w for w, _ in found}) == 3 and (word, answer) in found
        assert text.count(answer) == (2 if form == "repeat" else 1)
        if form == "repeat":
            assert f"{answer} is the special magic number for {word}." in text
        body = text[text.index(INTRO.strip()) + len(INTRO.strip()):]  # the haystack with its needles
        at = body.index(f"The special magic number for {word} is {answer}") / len(body)
        assert abs(at - depth) < 0.1, (depth, at)
    with pytest.raises(ValueError, match="needle form"):
        builder.build("multikey", 600, 0.5, random.Random(0), 3, 100, "triple")


def test_niah_comparison_with_fp():
    from kvq_core.tools.eval.report import mcnemar_p, niah_vs_fp

    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(2, 0) == 0.5 and mcnemar_p(5, 0) == pytest.approx(0.0625)
    assert mcnemar_p(3, 1) == mcnemar_p(1, 3) == pytest.approx(0.625)
    runs = []
    for trial, (fp_ok, q_ok, q_reply) in enumerate([(True, True, " 12345."), (True, False, " 99999"),
                                                    (False, True, " 12345"), (False, False, " 11111")]):
        runs.append({"label": "fp", "task": "passkey", "context": 1024, "depth": 0.5, "trial": trial,
                     "correct": fp_ok, "reply": " 12345" if fp_ok else " 11111"})
        runs.append({"label": "q", "task": "passkey", "context": 1024, "depth": 0.5, "trial": trial,
                     "correct": q_ok, "reply": q_reply})
    data = {"configs": [{"label": "fp"}, {"label": "q"}], "protocol": {"tasks": ["passkey", "multikey"]}, "runs": runs}
    (row,) = niah_vs_fp(data)
    assert (row["n"], row["lost"], row["gained"], row["recall"], row["fp_recall"]) == (4, 1, 1, 0.5, 0.5)
    assert row["same_answer"] == 0.5 and row["p"] == 1.0



def test_eval_reports_are_written(tmp_path):
    import json

    pytest.importorskip("matplotlib")
    from kvq_core.tools.eval.caches import expand_seeds, parse_config
    from kvq_core.tools.eval.ppl import summarize, summarize_groups
    from kvq_core.tools.eval.report import write_niah_report, write_ppl_report

    cfgs = expand_seeds([parse_config("fp"), parse_config("octopus:bits=3")], [0, 1])
    runs = [{"label": c.label, "window": 8, "nll": 100.0 + i, "tokens": 50, "kl": None if i == 0 else 0.5 * i,
             "bits_per_element": 16.0 if i == 0 else 4.2, "score_s": 1.0, "cache_bytes": 10, "dynamic_bytes": 20}
            for i, c in enumerate(cfgs)]
    ppl = {"kind": "ppl", "model": {"name": "tiny"}, "text": "t.txt", "text_tokens": 1000,
           "protocol": {"prefix": 32, "score": 50, "chunk": "flush block", "attn": "sdpa", "windows": [8],
                        "tuning": False, "backend": "auto", "seeds": [0, 1]}, "runs": runs,
           "summary": summarize(runs, cfgs, "fp")}
    ppl["groups"] = summarize_groups(ppl["summary"])
    for name, data in (("eval_ppl.json", ppl), ("eval_ppl_seeds.json", ppl)):
        (tmp_path / name).write_text(json.dumps(data))
        write_ppl_report(data, tmp_path / name)
    md = (tmp_path / "eval_ppl_seeds.md").read_text()
    assert "octopus-3@seed1" in md and "## Across rotation seeds" in md and "| octopus-3 | 3 | 4.20 | 2 |" in md
    assert (tmp_path / "eval_ppl_seeds.png").stat().st_size > 10_000
    niah_runs = [{"label": lab, "task": "passkey", "context": 1024, "depth": d, "trial": 0, "answer": "12345",
                  "reply": " 12345" if ok else " 1", "correct": ok, "seconds": 0.1}
                 for lab, d, ok in [("fp", 0.0, True), ("fp", 1.0, True), ("octopus-3", 0.0, True), ("octopus-3", 1.0, False)]]
    niah = {"kind": "niah", "model": {"name": "tiny"}, "configs": [{"label": "fp", "bits": 16}, {"label": "octopus-3", "bits": 3}],
            "protocol": {"tasks": ["passkey"], "contexts": [1024], "depths": [0.0, 1.0], "trials": 1, "haystack": "t.txt",
                         "answer_tokens": 8}, "runs": niah_runs}
    (tmp_path / "eval_niah.json").write_text(json.dumps(niah))
    write_niah_report(niah, tmp_path / "eval_niah.json")
    assert "| octopus-3 | passkey | 2 | 0.50 (1.00) | 1 / 0 | 0.50 | 1.00 |" in (tmp_path / "eval_niah.md").read_text()
    summary = (tmp_path / "eval_summary.md").read_text()
    assert "Rotation codecs over sign seeds [0, 1]" in summary and "| octopus-3 | 3 | 4.20 | 2 |" in summary
    assert "| KL vs fp (10⁻³) |" in summary and "| octopus-3@seed0 | 3 | 4.20 | " in summary and "| +2.0% | 10.0 |" in summary


def test_block_flush_joins_token_group_blocks(model):
    """OScaR keys keep statistics per 32-token group; 32-token flushes still join (whole groups),
    so the layer holds O(log n) blocks, and the joined history decodes as the blocks did."""
    _attn(model, "sdpa")
    cache = KVQCache(model.config, "oscar", bits=2, residual=32)
    with torch.no_grad():
        model(_ids(70), **cache_kwargs(model, cache))  # 64 tokens packed by the prefill flush
        hist = cache.layers[0].decoded_history()[0].clone()
        for step in range(200):
            model(_ids(1, seed=step), **cache_kwargs(model, cache))
    layer = cache.layers[0]
    assert (layer.packed_length, sum(layer.block_tokens)) == (256, 256)
    assert layer.block_tokens == sorted(layer.block_tokens, reverse=True)
    assert len(layer.blocks) <= 1 + math.ceil(math.log2(256 // 32))
    layer.drop_decoded()
    assert torch.equal(layer.decoded_history()[0][:, :, :64], hist)  # re-decoded from the joined codes
