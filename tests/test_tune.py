"""``kvq tune`` and its plans on a tiny random-weight Llama: the plan round trip, ``KVQCache.from_plan``
against the explicit cache, the refusals (another model, a newer format), the budget error, the
budget held in true bits as the real cache stores them, and the allocation's preference."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tqdm")

from kvq_core.errors import InputError, PlanError  # noqa: E402
from kvq_core.integrations.hf import cache_kwargs  # noqa: E402
from kvq_core.plan import PLAN_VERSION, cache_bits, load_plan, slot_bits, write_plan  # noqa: E402
from kvq_core.tools.tune import KINDS, TableCache, allocate, tune  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models  # noqa: E402

CONTEXT, SCORE = 64, 8
OPTIONS = [{"bits": 2}, {"bits": 3}]


@pytest.fixture(scope="module")
def model():
    from kvq_core.integrations.hf import register

    register()
    return tiny_models.build("llama", attn="kvq")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 128, (1, 2 * (CONTEXT + 1)), generator=torch.Generator().manual_seed(3))


def _tune(model, ids, budget, tmp_path, **kw):
    return tune(model, ids, budget=budget, context=CONTEXT, score=SCORE, windows=1, options=OPTIONS,
                residuals=kw.pop("residuals", [0]), exact=kw.pop("exact", ()), refine=kw.pop("refine", 0),
                cache_file=tmp_path / "table.json", progress=False, text_name="random ids", **kw)


def _cheapest(model_ident, residual=0):
    return sum(min(slot_bits("turboquant", o, k, model_ident, CONTEXT, residual) for o in OPTIONS) for k in KINDS) / 2


@pytest.fixture(scope="module")
def planned(model, ids, tmp_path_factory):
    """One plan at a budget between all-2-bit and all-3-bit, written to a file."""
    tmp = tmp_path_factory.mktemp("plan")
    plan = _tune(model, ids, 4.5, tmp, residuals=[0, 8])
    path = tmp / "plan.json"
    write_plan(plan, path)
    return plan, path, tmp


def test_plan_round_trip_records_what_it_was_tuned_for(planned, model) -> None:
    plan, path, _ = planned
    assert load_plan(path) == json.loads(json.dumps(plan))
    cfg = model.config
    assert plan["model"]["layers"] == cfg.num_hidden_layers and plan["model"]["kv_heads"] == cfg.num_key_value_heads
    assert plan["context"] == CONTEXT and plan["version"] == PLAN_VERSION and plan["calibration"]["text"] == "random ids"
    assert plan["calibration_kl"] >= 0 and plan["bits_per_element"] <= plan["budget"]


def test_from_plan_equals_the_explicit_cache(planned, model, ids) -> None:
    from kvq_core.integrations.hf import KVQCache

    plan, path, _ = planned
    a, b = KVQCache.from_plan(model.config, path), KVQCache(model.config, **plan["cache"])
    assert [(x.key_spec, x.value_spec, x.residual, x.flush) for x in a.kvq_layers] == \
           [(x.key_spec, x.value_spec, x.residual, x.flush) for x in b.kvq_layers]
    out = []
    with torch.no_grad():
        for c in (a, b):
            model(ids[:, :40], **cache_kwargs(model, c), use_cache=True)
            out.append(model(ids[:, 40:41], **cache_kwargs(model, c), use_cache=True).logits)
    assert torch.equal(*out)


def test_plan_bits_are_what_the_cache_stores(planned, model, ids) -> None:
    """The plan's true bits at its context equal the stored bits of its cache holding that many tokens."""
    from kvq_core.tools.eval.caches import CacheConfig, steady_bits
    from kvq_core.tools.eval.ppl import token_elements
    from kvq_core.integrations.hf import KVQCache

    plan, path, _ = planned
    cache = KVQCache.from_plan(model.config, path)
    with torch.no_grad():
        model(ids[:, :CONTEXT], **cache_kwargs(model, cache), use_cache=True)
    stored = steady_bits(cache, CacheConfig("plan", "plan"), CONTEXT, token_elements(model.config))
    assert plan["bits_per_element"] == pytest.approx(stored, rel=1e-9)
    assert cache_bits(plan["cache"], plan["model"], CONTEXT) == pytest.approx(stored, rel=1e-9)


def test_a_plan_with_an_exact_window_is_built_to_store_its_bits(planned, model, ids) -> None:
    """With an exact window and a sliding flush a cache's default stride (8) holds up to 7 tokens as codes ahead of
    need, which a plan's bits do not count: from_plan builds at stride 1, so its cache stores the plan's bits."""
    from kvq_core.tools.eval.caches import CacheConfig, steady_bits
    from kvq_core.tools.eval.ppl import token_elements
    from kvq_core.integrations.hf import KVQCache

    plan, _, tmp = planned
    args = {**plan["cache"], "residual": 8}
    path = tmp / "window.json"
    write_plan({**plan, "cache": args}, path)
    caches = KVQCache.from_plan(model.config, path), KVQCache(model.config, **args)
    stored = []
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :CONTEXT], **cache_kwargs(model, cache), use_cache=True)
            stored.append(steady_bits(cache, CacheConfig("plan", "plan"), CONTEXT, token_elements(model.config)))
    assert caches[0].kvq_layers and {layer.stride for layer in caches[0].kvq_layers} == {1}
    assert {layer.stride for layer in caches[1].kvq_layers} == {8} and {layer.flush for layer in caches[1].kvq_layers} == {"sliding"}
    assert stored[0] == pytest.approx(cache_bits(args, plan["model"], CONTEXT), rel=1e-9)
    assert stored[1] > stored[0] * 1.01  # 7 tokens held twice in 56 packed per layer


def test_a_plan_for_another_model_or_a_newer_format_is_refused(planned, tmp_path) -> None:
    import transformers as tf

    from kvq_core.integrations.hf import KVQCache

    plan, path, _ = planned
    deeper = tf.LlamaConfig(**{**tiny_models.SMALL, **tiny_models.COMMON, "num_hidden_layers": 3})
    with pytest.raises(PlanError, match=r"another model.*layers 2 \(the model has 3\)"):
        KVQCache.from_plan(deeper, path)
    wider = tf.LlamaConfig(**{**tiny_models.SMALL, **tiny_models.COMMON, "num_key_value_heads": 4})
    with pytest.raises(PlanError, match=r"kv_heads 2 \(the model has 4\)"):
        KVQCache.from_plan(wider, path)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**plan, "version": PLAN_VERSION + 1}))
    with pytest.raises(PlanError, match=f"version {PLAN_VERSION + 1} is newer than this kvq reads"):
        KVQCache.from_plan(deeper, newer)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something"}))
    with pytest.raises(PlanError, match="expected 'kvq-plan'"):
        load_plan(other)


def test_a_budget_below_the_cheapest_plan_names_the_minimum(model, ids, tmp_path) -> None:
    from kvq_core.plan import model_identity

    least = _cheapest(model_identity(model.config))
    with pytest.raises(InputError, match="below the cheapest plan") as err:
        _tune(model, ids, least - 0.1, tmp_path)
    named = float(re.search(r"cheapest plan of these options, ([0-9.]+)", str(err.value)).group(1))
    assert named == pytest.approx(least, abs=1e-4)
    assert not (tmp_path / "table.json").exists()  # refused before any calibration work


def test_the_search_holds_the_budget_and_upgrades_the_most_sensitive_slot(planned, model, ids) -> None:
    """With room for exactly one 2 -> 3 bit upgrade, the plan upgrades the slot whose predicted
    KL drops most (the table the search cached), and stays within the budget."""
    from kvq_core.plan import model_identity

    _, _, tmp = planned
    ident = model_identity(model.config)
    step = (slot_bits("turboquant", {"bits": 3}, "keys", ident, CONTEXT, 0)
            - slot_bits("turboquant", {"bits": 2}, "keys", ident, CONTEXT, 0)) / (2 * ident["layers"])
    budget = _cheapest(ident) + 1.5 * step
    plan = _tune(model, ids, budget, tmp)
    assert plan["search"]["table_cached"]  # the planned fixture's table covers this search
    assert plan["bits_per_element"] <= budget
    (table,) = TableCache(tmp / "table.json").data.values()
    gain = {(i, k): table[f"0|{i}|{k}|bits=2|None"] - table[f"0|{i}|{k}|bits=3|None"]
            for i in range(ident["layers"]) for k in KINDS}
    upgraded = [(s["layer"], s["kind"]) for s in plan["slots"] if s["option"].startswith("bits=3")]
    assert upgraded == [max(gain, key=gain.get)]


def test_allocate_spends_bits_where_they_buy_the_most() -> None:
    # slot 0 loses 1.0 at 2 bits and 0.1 at 3; slot 1 loses 0.2 and 0.1: one upgrade goes to slot 0
    slots = [[(2.0, 1.0), (3.0, 0.1)], [(2.0, 0.2), (3.0, 0.1)]]
    assert allocate(slots, 2.5) == ([1, 0], pytest.approx(0.3))
    assert allocate(slots, 3.0)[0] == [1, 1]
    assert allocate(slots, 2.0)[0] == [0, 0]
    with pytest.raises(InputError, match="below the cheapest plan of these options, 2.0000"):
        allocate(slots, 1.9)


def test_value_layer_params_set_one_layers_value_codec(model) -> None:
    from kvq_core.integrations.hf import KVQCache

    cache = KVQCache(model.config, "turboquant", bits=2, layer_params={1: {"bits": 3}}, value_layer_params={1: {"bits": 4}})
    (a, b) = cache.kvq_layers
    assert (a.key_spec.bits, a.value_spec.bits, b.key_spec.bits, b.value_spec.bits) == (2, 2, 3, 4)
    with pytest.raises(InputError, match="value_layer_params: layer 5"):
        KVQCache(model.config, "turboquant", value_layer_params={5: {"bits": 3}})


def test_an_eval_config_names_a_plan(planned) -> None:
    from kvq_core.tools.eval.caches import parse_config

    _, path, _ = planned
    cfg = parse_config(f"plan:path={path},label=tuned")
    assert (cfg.kind, cfg.label, cfg.params) == ("plan", "tuned", {"path": str(path)})
    with pytest.raises(ValueError, match="path=FILE"):
        parse_config("plan:bits=2")


def test_a_layer_may_name_another_method_for_its_keys_or_values(model) -> None:
    from kvq_core.integrations.hf import KVQCache

    cache = KVQCache(model.config, "turboquant", bits=2, norm_correction=True,
                     layer_params={1: {"method": "octopus", "bits": 3}},
                     value_layer_params={0: {"method": "oscar", "bits": 2, "value_group": 16}})
    (a, b) = cache.kvq_layers
    assert (a.key_spec.method, a.key_spec.bits, a.key_spec.norm_correction) == ("turboquant", 2, True)
    assert (a.value_spec.method, a.value_spec.value_group) == ("oscar", 16)
    # a layer naming another method takes only its own parameters, for keys and values
    assert (b.key_spec.method, b.key_spec.bits, b.value_spec.method, b.value_spec.bits) == ("octopus", 3, "octopus", 3)


def test_options_may_name_another_method_and_the_plan_holds_the_budget(model, ids, tmp_path) -> None:
    """A search over TurboQuant bits and OCTOPUS b=2 (another method, its own parameters): every
    slot gets one of them, the plan's cache builds each slot's codec, and its true bits are what
    that cache stores."""
    from kvq_core.tools.eval.caches import CacheConfig, steady_bits
    from kvq_core.tools.eval.ppl import token_elements
    from kvq_core.integrations.hf import KVQCache

    # at these tiny dims OCTOPUS b=2 costs 5.02 bits per element and TurboQuant b=4 5.52: 5.3 mixes them
    options = [{"bits": 4}, {"method": "octopus", "bits": 2}]
    plan = tune(model, ids, budget=5.3, context=CONTEXT, score=SCORE, windows=1, options=options, residuals=[0],
                exact=(), fit_seeds=2, base={"norm_correction": True}, cache_file=None, progress=False)
    chosen = {s["option"].rsplit(",seed=", 1)[0] for s in plan["slots"]}
    assert chosen == {"bits=4", "bits=2,method=octopus"}
    cache = KVQCache(model.config, **plan["cache"])
    by_slot = {(s["layer"], s["kind"]): s["option"] for s in plan["slots"]}
    for layer in cache.kvq_layers:
        for kind, spec in (("keys", layer.key_spec), ("values", layer.value_spec)):
            named = "method=octopus" in by_slot[(layer.layer_idx, kind)]
            assert spec.method == ("octopus" if named else "turboquant")
            assert named or spec.norm_correction  # the base parameters reach the base method's slots only
    with torch.no_grad():
        model(ids[:, :CONTEXT], **cache_kwargs(model, cache), use_cache=True)
    stored = steady_bits(cache, CacheConfig("plan", "plan"), CONTEXT, token_elements(model.config))
    assert cache_bits(plan["cache"], plan["model"], CONTEXT) == pytest.approx(stored, rel=1e-9)
    assert plan["bits_per_element"] == pytest.approx(cache_bits(plan["cache"], plan["model"], CONTEXT, plan["extra_bytes"]))
    assert plan["extra_bytes"] == 4 * sum("seed=" in o for o in by_slot.values()) and plan["bits_per_element"] <= 5.3


def test_refinement_keeps_a_plan_only_when_its_measured_kl_falls(planned, model, ids) -> None:
    """``refine``: every chosen slot's KL measured alone rescales its predictions and the knapsack
    re-allocates; the plan returned is never worse, by measured calibration KL, than the first."""
    _, _, tmp = planned
    first = _tune(model, ids, 4.5, tmp, residuals=[0, 8])
    refined = _tune(model, ids, 4.5, tmp, residuals=[0, 8], refine=2)
    rounds = refined["search"]["refine"]
    assert 1 <= len(rounds) <= 2 and all(r["calibration_kl"] >= 0 for r in rounds)
    assert refined["calibration_kl"] <= first["calibration_kl"]
    assert refined["calibration_kl"] == min([first["calibration_kl"]] + [r["calibration_kl"] for r in rounds])
    assert refined["bits_per_element"] <= 4.5


def test_slots_may_stay_exact_and_a_layer_exact_in_both_is_an_exact_layer(model, ids, tmp_path) -> None:
    """With keys and values allowed to stay exact, a budget of 16 bits keeps everything exact (every layer in
    ``fp_layers``); just below it, the cheapest quantized slot is the one given up, and an exact
    value slot beside quantized keys is stored by the fp16 codec, its bits counted as 16."""
    from kvq_core.integrations.hf import KVQCache
    from kvq_core.plan import model_identity

    full = _tune(model, ids, 16.0, tmp_path, exact=KINDS)
    assert full["cache"]["fp_layers"] == list(range(model.config.num_hidden_layers))
    assert full["bits_per_element"] == pytest.approx(16.0) and full["calibration_kl"] == pytest.approx(0.0, abs=1e-6)
    ident = model_identity(model.config)
    step = (16.0 - slot_bits("turboquant", {"bits": 3}, "values", ident, CONTEXT, 0)) / (2 * ident["layers"])
    one = _tune(model, ids, 16.0 - step, tmp_path, exact=KINDS)
    quantized = [(s["layer"], s["kind"]) for s in one["slots"] if s["option"] != "exact"]
    assert len(quantized) == 1 and one["bits_per_element"] <= 16.0 - step + 1e-9
    layer, kind = quantized[0]
    cache = KVQCache(model.config, **one["cache"])
    (quant,) = [x for x in cache.kvq_layers if x.layer_idx == layer]
    assert (quant.key_spec.method, quant.value_spec.method) == (("turboquant", "fp16") if kind == "keys" else ("fp16", "turboquant"))
