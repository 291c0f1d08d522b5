"""``kvq tune``: search per-layer, per-K/V cache choices under a true-bits budget, write a plan.

Given a model, calibration text and a budget in true bits per K/V element at a context length
(everything stored counted, :mod:`kvq_core.plan`), the search picks for every layer's keys and
values one option (a parameter set of the method, e.g. ``bits=2``, or with OScaR a group size,
``bits=2,value_group=32``; or another method with its own parameters, ``method=octopus,bits=2``;
keys, and with ``--exact keys values`` values too, may stay exact: both, an exact layer) and one
exact recent window for the cache, to minimise the KL divergence of the next-token distribution
to the full-precision model. The protocol is ``kvq eval ppl``'s: a ``context - score`` token
prefix prefilled exactly into the cache, then ``score`` tokens teacher-forced in the cache's flush
blocks, each query seeing what decoding token by token sees; KL(fp || cache) per scored token,
averaged over ``--windows`` windows of the calibration text.

Search:

1. **sensitivity, by the Fisher quadratic form**: per calibration window, the gradients of the
   summed log-probability of ``--samples`` continuations drawn from the fp model, with respect to
   every layer's exact prefix keys and values (one forward and ``--samples`` backward passes). The
   KL a slot's quantization error δ causes is predicted as ``½ E[(g·δ)²]`` per scored token (KL is
   second order in a small perturbation; the Fisher information is the expectation of ``g gᵀ``),
   with δ the codec's actual error on that layer's calibration keys (values), zero on the last W
   prefix tokens (the exact window). One table covers every layer, K/V, option, seed and window;
   it is cached on disk (``--cache-file``), so other budgets reuse it.
2. **allocation**: a multiple-choice knapsack (dynamic programming over the bits, rounded up to
   1/64 bit, so the plan never exceeds the budget), per window W of ``--residuals``; the W with the
   least predicted total KL (summed over the slots) wins.
3. **verification**: the chosen plan's real cache is run on the calibration windows; that measured
   KL is the plan's ``calibration_kl`` (``predicted_kl`` beside it). ``--check N`` also measures
   the real KL of the N most sensitive chosen slots alone, against their prediction.
4. **refinement** (``--refine N``, measured): each chosen quantized slot's real KL alone (the
   cache quantizing only it) divides its prediction, every option of that slot is rescaled by
   that ratio, the knapsack re-allocates, and the new plan's measured KL replaces the old one's
   only if lower; up to N rounds, stopping at the first that does not lower it. The plan is thus
   chosen by measured KL among the candidates, at one measured run per quantized slot per round.

Limits (measured on SmolLM2-135M at 2048 tokens): the prediction is far below the real
KL. With ``--residuals 0 16 32 64`` the search chose W = 0 at a 2.5-bit budget, predicted 0.016
nats/token and measured 0.94; single slots were measured 4-20 times above their prediction
(``--check``). The gradients see only the exact *prefix* perturbed, while a decoding query also
reads its own recent tokens quantized once they leave the window, and the slots' damage adds up
super-linearly (``--refine`` corrects each slot's scale, not the interaction). ``calibration_kl``
(measured) is the number to trust; keep W at the window the method needs (the default 32).

``--fit-seeds N`` is the calibrated ingredient: per layer, K/V and option, the rotation sign seed
(of N) whose error on the calibration K/V has the least predicted KL is chosen and stored in the
plan (4 bytes per quantized slot, counted in its bits).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvq_core.errors import InputError
from kvq_core.plan import PLAN_FORMAT, PLAN_VERSION, cache_bits, model_identity, slot_bits, write_plan

DEFAULT_METHOD = "turboquant"
DEFAULT_PARAMS = "norm_correction=true"
DEFAULT_OPTIONS = ("bits=1", "bits=2", "bits=3", "bits=4")
KINDS = ("keys", "values")
SEED_BYTES = 4  # a fitted rotation seed, stored per quantized slot
UNITS_PER_BIT = 64  # the knapsack's bit grid (costs rounded up)

Option = dict[str, Any]  # a method parameter set; None stands for exact (16-bit) keys or values


def parse_params(text: str) -> Option:
    """``k=v,k=v`` -> dict (ints, floats and true/false parsed)."""
    from kvq_core.tools.eval.caches import _value

    out: Option = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise InputError(f"option {text!r}: {item!r} is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        out[k] = _value(v)
    return out


def option_codec(method: str, base: Option, opt: Option) -> tuple[str, Option]:
    """``(method, parameters)`` of a slot option: one naming ``method=`` is that codec with its own
    parameters only; any other is ``method`` with ``base`` updated by it."""
    if "method" in opt:
        return opt["method"], {k: v for k, v in opt.items() if k != "method"}
    return method, {**base, **opt}


def has_seed(method: str) -> bool:
    """Whether ``method`` draws a rotation from a ``seed`` (what ``--fit-seeds`` fits)."""
    from kvq_core.registry import make_spec

    return "seed" in make_spec(method).to_dict()


def slot_cost(method: str, base: Option, opt: Option | None, kind: str, model: Mapping[str, Any], context: int,
              residual: int, seed_bits: float) -> float:
    """True bits per element of one slot stored with ``opt`` (None: exact), a fitted seed's
    ``seed_bits`` included where the option's method has a seed."""
    if opt is None:
        return slot_bits(method, None, kind, model, context, residual)
    m, params = option_codec(method, base, opt)
    return slot_bits(m, params, kind, model, context, residual) + (seed_bits if has_seed(m) else 0.0)


def option_key(opt: Option | None) -> str:
    """A stable text name of an option ("exact" for None)."""
    return "exact" if opt is None else ",".join(f"{k}={opt[k]}" for k in sorted(opt))


# ------------------------------------------------------------------------------------------------
# allocation: a multiple-choice knapsack over the slots
# ------------------------------------------------------------------------------------------------
def allocate(slots: Sequence[Sequence[tuple[float, float]]], budget: float) -> tuple[list[int], float]:
    """Pick one ``(bits, kl)`` choice per slot minimising the summed KL with the mean bits at most
    ``budget``: ``(choice index per slot, summed KL)``. Bits are rounded up to 1/64 so the exact
    mean of the choices never exceeds the budget. InputError when even the cheapest choices do."""
    n = len(slots)
    cheapest = sum(min(b for b, _ in s) for s in slots) / n
    cap = int(math.floor(budget * n * UNITS_PER_BIT + 1e-9))
    units = [[int(math.ceil(b * UNITS_PER_BIT - 1e-9)) for b, _ in s] for s in slots]
    if sum(min(u) for u in units) > cap:
        raise InputError(f"budget {budget:g} bits/element is below the cheapest plan of these options, "
                         f"{cheapest:.4f} bits/element")
    dp = np.full(cap + 1, np.inf)
    dp[0] = 0.0
    picks = []
    for s, u in zip(slots, units):
        new = np.full(cap + 1, np.inf)
        arg = np.full(cap + 1, -1, dtype=np.int16)
        for j, ((_, kl), c) in enumerate(zip(s, u)):
            if c > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c:] = dp[:cap + 1 - c] + kl
            better = cand < new
            new[better], arg[better] = cand[better], j
        dp = new
        picks.append(arg)
    at = int(np.argmin(dp))
    total = float(dp[at])
    choice = []
    for s, u, arg in zip(reversed(slots), reversed(units), reversed(picks)):
        j = int(arg[at])
        choice.append(j)
        at -= u[j]
    return choice[::-1], total


# ------------------------------------------------------------------------------------------------
# calibration: windows, the fp reference, trial caches
# ------------------------------------------------------------------------------------------------
class Calibration:
    """The calibration windows of one model: each window's exact prefill, the fp next-token
    log-probabilities of its scored tokens, and KL of a trial cache against them."""

    def __init__(self, model: Any, ids: Any, context: int, score: int, windows: int, backend: str = "auto",
                 progress: bool = False) -> None:
        from kvq_core.integrations.hf.cache_arg import cache_kwargs
        import torch
        from tqdm.auto import tqdm
        from transformers import DynamicCache

        from kvq_core.tools.eval.caches import CacheConfig
        from kvq_core.tools.eval.ppl import score_window

        if score < 1 or score >= context:
            raise InputError(f"score={score}; expected 1 <= score < context ({context})")
        length = context + 1
        total = ids.shape[1] // length
        if total < 1:
            raise InputError(f"the calibration text has {ids.shape[1]} tokens; a window needs {length} (context + 1)")
        count = min(windows, total)
        self.starts = sorted({(i * total) // count * length for i in range(count)})
        self.model, self.context, self.score, self.prefix, self.backend = model, context, score, context - score, backend
        self.fp_cfg = CacheConfig("fp", "fp")
        self.trial_cfg = CacheConfig("trial", "plan")
        self.windows = []
        for s in tqdm(self.starts, desc="tune: calibration windows (fp prefill and reference)", disable=not progress):
            w = ids[:, s:s + length]
            shared = DynamicCache(config=model.config)
            with torch.no_grad():
                model(w[:, :self.prefix], **cache_kwargs(model, shared), use_cache=True)
            _, ref = score_window(model, w, self.fp_cfg, self.prefix, score, backend=backend, shared=shared, chunk=None,
                                  keep_logprobs=True)
            self.windows.append((w, shared, ref))
        self._score_window = score_window

    def kl(self, make_cache: Callable[[], Any]) -> float:
        """Mean KL(fp || cache) per scored token over the windows, a fresh ``make_cache()`` each
        (trial caches run in dequant mode: their decoded-copy warning is expected and silenced)."""
        import warnings

        from kvq_core.integrations.hf import KVQMemoryWarning

        total = tokens = 0.0
        for w, shared, ref in self.windows:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KVQMemoryWarning)
                run, _ = self._score_window(self.model, w, self.trial_cfg, self.prefix, self.score, backend=self.backend,
                                            shared=shared, chunk=None, reference=ref, cache=make_cache())
            total += run["kl"]
            tokens += run["tokens"]
        return total / tokens

    def kv(self, layer: int, kind: str) -> Any:
        """The exact prefix keys (values) of ``layer`` in every window, joined along tokens."""
        import torch

        t = [(sh.layers[layer].keys if kind == "keys" else sh.layers[layer].values) for _, sh, _ in self.windows]
        return torch.cat(t, dim=2)


    def gradients(self, window: int, samples: int, seed: int = 0) -> list[dict[str, list[Any]]]:
        """Per sampled continuation: the gradient of its summed log-probability with respect to every
        layer's exact prefix keys and values (``{"keys": [per layer], "values": [...]}``), the scored
        tokens run in one chunk over the exact prefix, each next token drawn from the fp model."""
        from kvq_core.integrations.hf.cache_arg import cache_kwargs
        import torch
        from transformers import DynamicCache

        w, shared, _ = self.windows[window]
        frozen = [p for p in self.model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            cache = DynamicCache(config=self.model.config)
            leaves = []
            for i, layer in enumerate(shared.layers):
                k, v = layer.keys.detach().clone().requires_grad_(True), layer.values.detach().clone().requires_grad_(True)
                leaves.append((k, v))
                cache.update(k, v, i)
            with torch.enable_grad():
                logits = self.model(w[:, self.prefix:self.prefix + self.score], **cache_kwargs(self.model, cache), use_cache=True).logits
                logp = torch.log_softmax(logits[0].float(), dim=-1)
                gen = torch.Generator().manual_seed(seed + 7919 * window)
                out = []
                for m in range(samples):
                    y = torch.multinomial(logp.detach().exp(), 1, generator=gen)
                    flat = [t for kv in leaves for t in kv]
                    grads = torch.autograd.grad(logp.gather(1, y).sum(), flat, retain_graph=m < samples - 1)
                    out.append({"keys": [g.detach().numpy() for g in grads[0::2]],
                                "values": [g.detach().numpy() for g in grads[1::2]]})
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return out


def quantization_error(method: str, params: Option, kind: str, x: np.ndarray, layer: int) -> np.ndarray:
    """``decode(encode(x)) - x`` for ``x`` (``[1, kv_heads, tokens, dim]``, NumPy) stored as ``kind``."""
    import kvq_core

    q = kvq_core.get_quantizer(method, "numpy", layer=layer, **{**params, "head_dim": int(x.shape[-1])})
    return q.fake_quant(x, kind) - x


def fisher_kl(grads: Sequence[np.ndarray], delta: np.ndarray, packed: int, score: int) -> float:
    """Predicted KL per scored token of the error ``delta`` on the first ``packed`` prefix tokens:
    ``½ E[(g·δ)²] / score``, the Fisher quadratic form sampled with the gradients ``grads``."""
    d = delta[:, :, :packed].astype(np.float64)
    return 0.5 * float(np.mean([float((g[:, :, :packed] * d).sum()) ** 2 for g in grads])) / score


# ------------------------------------------------------------------------------------------------
# the search
# ------------------------------------------------------------------------------------------------
class TableCache:
    """Predicted KLs on disk, keyed by everything they depend on (see :func:`tune`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, dict[str, float]] = {}
        if path is not None and path.is_file():
            self.data = json.loads(path.read_text(encoding="utf-8"))

    def get(self, key: str) -> dict[str, float] | None:
        return self.data.get(key)

    def put(self, key: str, table: dict[str, float]) -> None:
        self.data[key] = table
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data), encoding="utf-8")
            tmp.replace(self.path)


def trial_kwargs(method: str, base: Option, n_layers: int, layer: int, kind: str, opt: Option, residual: int,
                 flush: str) -> dict[str, Any]:
    """KVQCache arguments quantizing only ``layer``'s keys or values with ``opt`` (all else exact)."""
    others = [i for i in range(n_layers) if i != layer]
    m, params = option_codec(method, base, opt)
    kw: dict[str, Any] = {"residual": residual, "flush": flush, "fp_layers": others, "method": m, **params}
    return {**kw, "value_method": "fp16"} if kind == "keys" else {**kw, "fp_key_layers": [layer]}


def plan_cache(method: str, base: Option, residual: int, choice: Mapping[tuple[int, str], Option | None],
               n_layers: int) -> dict[str, Any]:
    """The plan's KVQCache arguments for per-slot ``choice`` ({(layer, kind): option or None=exact})."""
    fp_layers = [i for i in range(n_layers) if choice[(i, "keys")] is None and choice[(i, "values")] is None]
    fp_keys = [i for i in range(n_layers) if choice[(i, "keys")] is None and i not in fp_layers]
    values: dict[str, Option] = {}
    for i in range(n_layers):
        k, v = choice[(i, "keys")], choice[(i, "values")]
        if v is None and i not in fp_layers:
            values[str(i)] = {"method": "fp16"}  # exact values beside quantized keys
        elif v is not None and i not in fp_layers:
            # a layer whose keys name another method gives its values that method too, unless named
            named = "method" in v or (k is not None and "method" in k)
            m, params = option_codec(method, base, v)
            values[str(i)] = {"method": m, **params} if named else dict(v)
    return {
        "method": method, **base, "residual": residual, "fp_layers": fp_layers, "fp_key_layers": fp_keys,
        "layer_params": {str(i): dict(choice[(i, "keys")]) for i in range(n_layers) if choice[(i, "keys")] is not None},
        "value_layer_params": values,
    }


def sensitivity_table(cal: Calibration, method: str, base: Option, options: Sequence[Option], residuals: Sequence[int],
                      seeds: Sequence[int | None], samples: int, progress: bool) -> dict[str, float]:
    """``{"W|layer|kind|option|seed": predicted KL per token}`` for every slot, option, seed and window."""
    from tqdm.auto import tqdm

    n = len(cal.windows[0][1].layers)
    table: dict[str, float] = {}
    bar = tqdm(total=len(cal.windows) * (samples + n * len(KINDS) * len(options) * len(seeds)), desc="tune: sensitivity",
               disable=not progress)
    for wi, (_, shared, _) in enumerate(cal.windows):
        bar.set_postfix_str(f"window {wi}: gradients")
        grads = cal.gradients(wi, samples)
        bar.update(samples)
        for i in range(n):
            for k in KINDS:
                x = (shared.layers[i].keys if k == "keys" else shared.layers[i].values).detach().numpy()
                gs = [g[k][i] for g in grads]
                for o in options:
                    m, params = option_codec(method, base, o)
                    seeded, delta = has_seed(m), None
                    for s in seeds:
                        bar.set_postfix_str(f"window {wi}: layer {i} {k} {option_key(o)}")
                        if delta is None or seeded:  # an option without a seed has one error for every seed
                            delta = quantization_error(m, {**params, **({} if s is None else {"seed": s})}, k, x, i)
                        for r in residuals:
                            key = f"{r}|{i}|{k}|{option_key(o)}|{s}"
                            kl = fisher_kl(gs, delta, max(cal.prefix - r, 0), cal.score)
                            table[key] = table.get(key, 0.0) + kl / len(cal.windows)
                        bar.update(1)
    bar.close()
    return table


def tune(model: Any, ids: Any, *, budget: float, **kwargs: Any) -> dict[str, Any]:
    """Search a plan for ``model`` on calibration token ids ``ids`` (``[1, N]``) at ``budget`` true
    bits per element (the arguments of :func:`tune_plans`); returns the plan."""
    return tune_plans(model, ids, budgets=[budget], **kwargs)[0]


def tune_plans(model: Any, ids: Any, *, budgets: Sequence[float], context: int = 2048, method: str = DEFAULT_METHOD,
               base: Option | None = None, options: Sequence[Option] = (), residuals: Sequence[int] = (32,),
               exact: Sequence[str] = ("keys",), score: int = 64, windows: int = 2, samples: int = 2, fit_seeds: int = 0,
               unfitted: bool = False, check: int = 0, refine: int = 2, backend: str = "auto",
               cache_file: Path | None = None, model_name: str | None = None, text_name: str = "",
               progress: bool = True) -> list[dict[str, Any]]:
    """Plans for ``model`` on calibration token ids ``ids`` (``[1, N]``), one per budget in ``budgets``
    (true bits per element at ``context`` tokens) and, with ``fit_seeds`` and ``unfitted``, one
    without the fitted seeds beside each (the comparison); one calibration and one sensitivity
    table serve them all (see the module docstring)."""
    from kvq_core.registry import make_spec

    t0 = time.perf_counter()
    base = dict(base or {})
    options = [dict(o) for o in (options or [parse_params(o) for o in DEFAULT_OPTIONS])]
    for o in options:
        m, params = option_codec(method, base, o)
        make_spec(m, **params)  # a bad option fails now, not after the calibration
    if fit_seeds and not any(has_seed(option_codec(method, base, o)[0]) for o in options):
        raise InputError(f"fit_seeds={fit_seeds}: no option's method ({method!r} or a named one) has a rotation seed to fit")
    ident = model_identity(model.config, model_name)
    flush = type(make_spec(method)).default_flush
    # the budget error comes before any work: the cheapest plan of these options (a fitted seed's
    # bytes are part of a quantized slot's cost)
    seed_bits = 8 * SEED_BYTES / (ident["kv_heads"] * context * ident["head_dim"]) if fit_seeds else 0.0
    cheapest, at = min((sum(min(slot_cost(method, base, o, k, ident, context, r, seed_bits) for o in options)
                            for k in KINDS) / len(KINDS), r) for r in residuals)
    budget = min(budgets)
    if budget < cheapest - 1e-12:
        raise InputError(f"budget {budget:g} bits/element at {context} tokens is below the cheapest plan of these "
                         f"options, {cheapest:.4f} bits/element (the cheapest option in every slot, residual={at}); "
                         f"pass a budget >= {math.ceil(cheapest * 1e4) / 1e4:.4f}")
    cal = Calibration(model, ids, context, score, windows, backend, progress)
    plain: list[int | None] = [None]  # every method's default seed
    seeds = sorted(set(range(fit_seeds)) | (set(plain) if unfitted or not fit_seeds else set()), key=str)
    setup = json.dumps({"model": ident, "text": text_name, "starts": cal.starts, "context": context, "score": score,
                        "method": method, "base": base, "samples": samples}, sort_keys=True)
    store = TableCache(cache_file)
    key = hashlib.sha256(setup.encode()).hexdigest()[:16]
    table = store.get(key) or {}
    need = [(r, o, s) for r in residuals for o in options for s in seeds
            if f"{r}|0|keys|{option_key(o)}|{s}" not in table]
    cached = not need
    if need:  # one pass computes every missing window, option and seed (the gradients are the dear part)
        table.update(sensitivity_table(cal, method, base, sorted({option_key(o): o for _, o, _ in need}.values(), key=option_key),
                                       sorted({r for r, _, _ in need}), sorted({s for _, _, s in need}, key=str), samples,
                                       progress))
        store.put(key, table)
    t_table = time.perf_counter() - t0
    plans = []
    for fitted in ([True, False] if fit_seeds and unfitted else [bool(fit_seeds)]):
        for b in budgets:
            plans.append(_plan(model, cal, table, b, fitted, list(range(fit_seeds)) if fitted else plain, ident=ident,
                               context=context, method=method, base=base, options=options, residuals=residuals,
                               exact=exact, samples=samples, fit_seeds=fit_seeds if fitted else 0,
                               check=check, refine=refine, backend=backend, flush=flush, cached=cached, t_table=t_table,
                               text_name=text_name, progress=progress))
    return plans


def _plan(model: Any, cal: Calibration, table: Mapping[str, float], budget: float, fitted: bool,
          seeds: Sequence[int | None], *, ident: Mapping[str, Any], context: int, method: str, base: Option,
          options: Sequence[Option], residuals: Sequence[int], exact: Sequence[str], samples: int, fit_seeds: int,
          check: int, refine: int, backend: str, flush: str, cached: bool, t_table: float, text_name: str,
          progress: bool) -> dict[str, Any]:
    """One plan from the sensitivity ``table``: the allocation at ``budget``, verified on ``cal``;
    with ``refine`` rounds, re-allocated on measured single-slot KLs while the measured KL falls."""
    from tqdm.auto import tqdm

    from kvq_core.integrations.hf import KVQCache

    t_start = time.perf_counter()
    n = ident["layers"]
    seed_bits = 8 * SEED_BYTES / (ident["kv_heads"] * context * ident["head_dim"]) if fitted else 0.0

    def best_seed(r: int, i: int, k: str, o: Option, scale: Mapping[tuple[int, str], float]) -> tuple[float, int | None]:
        return min((table[f"{r}|{i}|{k}|{option_key(o)}|{s}"] * scale.get((i, k), 1.0), s) for s in seeds)

    def allocation(scale: Mapping[tuple[int, str], float]) -> tuple[int, float, list[int], list[Any]]:
        """The knapsack over the (scaled) predictions, at the residual of least predicted total."""
        best_plan = None
        for r in residuals:
            slots, labels = [], []
            for i in range(n):
                for k in KINDS:
                    choices = [(o, *best_seed(r, i, k, o, scale)) for o in options]
                    if k in exact:  # the slot may stay exact (16 bits); keys and values both: an exact layer
                        choices.append((None, 0.0, None))
                    # a fitted seed's bytes are part of the slot's cost
                    slots.append([(slot_cost(method, base, o, k, ident, context, r, seed_bits), kl) for o, kl, _ in choices])
                    labels.append((i, k, choices))
            try:
                pick, total = allocate(slots, budget)
            except InputError:
                continue  # this window is too dear for the budget; another may fit
            if best_plan is None or total < best_plan[1]:
                best_plan = (r, total, pick, labels)
        if best_plan is None:
            raise InputError(f"budget {budget:g} bits/element fits no residual of {list(residuals)}")
        return best_plan

    def chosen(r: int, pick: list[int], labels: list[Any]) -> dict[tuple[int, str], Option | None]:
        out: dict[tuple[int, str], Option | None] = {}
        for (i, k, choices), j in zip(labels, pick):
            o, _, s = choices[j]
            if o is not None and fitted and has_seed(option_codec(method, base, o)[0]):
                o = {**o, "seed": int(s)}
            out[(i, k)] = o
        return out

    def measure(cache: Mapping[str, Any]) -> float:
        return cal.kl(lambda: KVQCache(model.config, backend=backend, attention="dequant", **cache))

    scale: dict[tuple[int, str], float] = {}
    r, total, pick, labels = allocation(scale)
    choice = chosen(r, pick, labels)
    cache = plan_cache(method, base, r, choice, n)
    t1 = time.perf_counter()
    if progress:
        print(f"kvq tune: budget {budget:g}{' (fitted seeds)' if fitted else ''}: verifying the plan's KL", file=sys.stderr)
    kl = measure(cache)
    rounds = []
    for _ in range(refine):  # measured KL of each chosen slot alone rescales its predictions; re-allocate
        quantized = [(i, k, choices[j]) for (i, k, choices), j in zip(labels, pick) if choices[j][0] is not None]
        for i, k, (o, _, s) in tqdm(quantized, desc="tune: refine", disable=not progress):
            real = measure(trial_kwargs(method, base, n, i, k, choice[(i, k)], r, flush))
            scale[(i, k)] = max(real, 1e-9) / max(table[f"{r}|{i}|{k}|{option_key(o)}|{s}"], 1e-12)
        r2, total2, pick2, labels2 = allocation(scale)
        choice2 = chosen(r2, pick2, labels2)
        cache2 = plan_cache(method, base, r2, choice2, n)
        kl2 = kl if cache2 == cache else measure(cache2)
        rounds.append({"calibration_kl": kl2, "changed_slots": sum(choice2[x] != choice[x] for x in choice)})
        if kl2 >= kl:
            break
        r, total, pick, labels, choice, cache, kl = r2, total2, pick2, labels2, choice2, cache2, kl2
    slot_info = [{"layer": i, "kind": k, "option": option_key(choice[(i, k)]), "predicted_kl": choices[j][1]}
                 for (i, k, choices), j in zip(labels, pick)]
    extra = SEED_BYTES * sum(o is not None and "seed" in o for o in choice.values()) if fitted else 0
    bits = cache_bits(cache, ident, context, extra)
    checks = []
    if check:  # the proxy against the real KL of single slots: the most sensitive at the plan's choice
        ranked = sorted(zip(labels, pick), key=lambda lp: -lp[0][2][lp[1]][1])[:check]
        for (i, k, choices), j in tqdm(ranked, desc="tune: check", disable=not progress):
            o, pred, s = choices[j]
            if o is None:
                continue
            opt = choice[(i, k)]
            real = measure(trial_kwargs(method, base, n, i, k, opt, r, flush))
            checks.append({"layer": i, "kind": k, "option": option_key(opt), "predicted_kl": pred, "measured_kl": real})
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION, "model": ident, "context": context, "budget": budget,
        "bits_per_element": bits, "extra_bytes": extra, "calibration_kl": kl, "predicted_kl": total,
        "calibration": {"text": text_name, "windows": len(cal.starts), "window_starts": cal.starts,
                        "prefix": cal.prefix, "score": cal.score},
        "calibrated": {"fit_seeds": fit_seeds, "what": "per-slot rotation seed of the least predicted KL (the "
                       "calibration gradients and K/V)" if fit_seeds else "none"},
        "search": {"method": method, "base": base, "options": [option_key(o) for o in options],
                   "residuals": list(residuals), "exact": list(exact), "samples": samples,
                   "table_cached": cached, "table_seconds": round(t_table, 1),
                   "seconds": round(t_table + time.perf_counter() - t_start, 1),
                   "verify_seconds": round(time.perf_counter() - t1, 1),
                   "checks": checks, "refine": rounds},
        "slots": slot_info,
        "cache": cache,
    }


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq tune", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--budget", type=float, nargs="+", required=True,
                   help="true bits per K/V element at --context, everything stored; several budgets make one plan each")
    p.add_argument("--context", type=int, default=2048, help="context length the budget holds at (default 2048)")
    p.add_argument("--out", required=True,
                   help="plan JSON to write; with several budgets or --also-unfitted a template naming {budget} (and "
                        "{fit}: 'fitted' or 'plain')")
    p.add_argument("--model", help="a .gguf file, a checkpoint directory or a hub name (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--text-file", help="calibration text (default: shared/data/wikitext2-test.txt)")
    p.add_argument("--text-part", choices=("all", "calibration", "evaluation"), default="calibration",
                   help="which part of the text to calibrate on (default calibration: the first part, cut at the "
                        "article heading after the middle; evaluate on --text-part evaluation)")
    p.add_argument("--method", default=DEFAULT_METHOD, help=f"kvq method (default {DEFAULT_METHOD})")
    p.add_argument("--params", default=DEFAULT_PARAMS, help=f"method parameters of every slot (default {DEFAULT_PARAMS})")
    p.add_argument("--options", nargs="+", default=list(DEFAULT_OPTIONS), metavar="K=V[,K=V]",
                   help=f"per-slot parameter sets to choose from (default {' '.join(DEFAULT_OPTIONS)}); one naming "
                        "method= is that codec with its own parameters (e.g. method=octopus,bits=2), --params "
                        "apply to --method's options only")
    p.add_argument("--residuals", nargs="+", type=int, default=[32], help="exact windows to try (default 32)")
    p.add_argument("--exact", nargs="*", choices=KINDS, default=["keys"],
                   help="which slots may stay exact at 16 bits (default keys; 'keys values' lets whole layers stay exact, "
                        "an empty list none)")
    p.add_argument("--fit-seeds", type=int, default=0, metavar="N",
                   help="calibrated rotation: per slot the sign seed (of N) of least predicted KL (default off)")
    p.add_argument("--also-unfitted", action="store_true",
                   help="with --fit-seeds, also write each plan without the fitted seeds (the comparison)")
    p.add_argument("--score", type=int, default=64, help="scored tokens per calibration window (default 64)")
    p.add_argument("--windows", type=int, default=2, help="calibration windows (default 2)")
    p.add_argument("--samples", type=int, default=2, help="sampled continuations per window for the gradients (default 2)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="also measure the real KL of the N most sensitive chosen slots alone (default 0)")
    p.add_argument("--refine", type=int, default=2, metavar="N",
                   help="rounds of measured refinement: the real KL of every chosen slot alone rescales its predictions, "
                        "the knapsack re-allocates, and the new plan is kept while its measured KL falls (default 2; 0: "
                        "the Fisher allocation as it is)")
    p.add_argument("--cache-file", default=None,
                   help="sensitivity table cache (default: tune-<model>.json in kvq's cache directory; 'none': no cache)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """``kvq tune``: run the search and write the plan."""
    args = build_parser().parse_args(argv)
    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import cache_dir, load_text, text_part

    text, source = text_part(*load_text(args.text_file, None), args.text_part)
    model, tok, info = load_model(args.model, attn_implementation="kvq", threads=args.threads)
    ids = tok(text, return_tensors="pt").input_ids
    cache_file = None if args.cache_file == "none" else Path(args.cache_file or cache_dir() / f"tune-{info['name']}.json")
    several = len(args.budget) > 1 or (args.fit_seeds and args.also_unfitted)
    if several and "{budget}" not in args.out:
        raise InputError(f"--out {args.out}: several plans need a template naming {{budget}} (and {{fit}})")
    if args.fit_seeds and args.also_unfitted and "{fit}" not in args.out:
        raise InputError(f"--out {args.out}: --also-unfitted needs a template naming {{fit}}")
    plans = tune_plans(model, ids, budgets=args.budget, context=args.context, method=args.method,
                       base=parse_params(args.params), options=[parse_params(o) for o in args.options],
                       residuals=args.residuals, exact=args.exact, score=args.score,
                       windows=args.windows, samples=args.samples, fit_seeds=args.fit_seeds, unfitted=args.also_unfitted,
                       check=args.check, refine=args.refine, backend=args.backend, cache_file=cache_file,
                       model_name=info["name"],
                       text_name=source, progress=not args.quiet)
    for plan in plans:
        plan["calibration"]["load_average"] = os.getloadavg()
        out = args.out.format(budget=f"{plan['budget']:g}", fit="fitted" if plan["calibrated"]["fit_seeds"] else "plain")
        write_plan(plan, out)
        print(f"kvq tune: {out}: {plan['bits_per_element']:.4f} true bits/element at {args.context} tokens "
              f"(budget {plan['budget']:g}), calibration KL {plan['calibration_kl']:.4f} nats/token "
              f"(predicted {plan['predicted_kl']:.4f}), residual {plan['cache']['residual']}, "
              f"{plan['search']['seconds']:.0f} s")
    return 0
