"""A transformers ``Cache`` that stores K/V as kvq packed blocks: :class:`KVQCache`, built from a
model config, one :class:`KVQLayer` per quantized layer.

Where each concern lives:

- :mod:`kvq_core.integrations.hf.layer`: :class:`KVQLayer`, one layer's storage (packed blocks + exact window)
  and its ``update``;
- :mod:`kvq_core.integrations.hf.flush`: the flush policies (``flush="block"`` / ``"sliding"``, ``stride``,
  ``chunks``, ``residual``): when exact tokens are packed, which blocks join, how a crop cuts, in
  plain integers;
- :mod:`kvq_core.integrations.hf.view`: what a step hands the model (``attention="dequant"`` or ``"codes"``);
- :mod:`kvq_core.integrations.hf.window`: what a sliding-window layer drops;
- :mod:`kvq_core.integrations.hf.decoded`, :mod:`kvq_core.integrations.hf.batch`, :mod:`kvq_core.integrations.hf.accounting`: the
  decoded-history copy, batch and beam operations, byte and bit accounting.

This module keeps the cache itself: building the layers from the config and the method's
parameters, and making each step (the layer updates of one forward) all or nothing.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer, get_layer_types_and_kwargs

from kvq_core.errors import InputError
from kvq_core.integrations.hf.accounting import KVQMemoryWarning, dynamic_cache_nbytes, memory_report
from kvq_core.integrations.hf.flush import FLUSH_MODES, default_stride
from kvq_core.integrations.hf.layer import ATTENTION_MODES, CHUNK_MODES, WINDOW_BITS, KVQLayer, mla_dims, separable, to_torch
from kvq_core.integrations.hf.view import CodesContext
from kvq_core.plan import layer_codecs
from kvq_core.registry import make_spec

__all__ = [  # the names this module has always offered, wherever they now live
    "ATTENTION_MODES", "CHUNK_MODES", "FLUSH_MODES", "QUANTIZED_TYPES", "SLIDING_MODES", "WINDOW_BITS", "CodesContext",
    "KVQCache", "KVQLayer", "KVQMemoryWarning", "dynamic_cache_nbytes", "mla_dims", "separable", "to_torch",
]


def _head_dim(config: Any) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else int(config.hidden_size // config.num_attention_heads)


#: Layer types whose K/V kvq stores (the others keep their transformers layer, exact).
QUANTIZED_TYPES = ("full_attention", "sliding_attention")
SLIDING_MODES = ("quantize", "exact")


#: attention implementations a cache may switch to "kvq": both compute plain softmax attention, and the
#: "kvq" function hands every step without packed blocks (the prefill) to sdpa.
SWITCHABLE_ATTENTION = (None, "sdpa", "eager")


def codes_blocker(config: Any) -> str | None:
    """Why a model cannot attend from the codes whatever its attention implementation (the "kvq"
    function computes plain softmax attention), or None."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"its attention soft-caps logits (attn_logit_softcapping={config.attn_logit_softcapping})"
    if getattr(config, "model_type", None) in SINK_MODELS:
        return f"its attention ({config.model_type}) has learned sinks"
    if getattr(config, "output_attentions", False):
        return "output_attentions=True asks for attention weights"
    return None


#: model types whose attention adds learned sink logits (the "kvq" function refuses them)
SINK_MODELS = ("gpt_oss",)


def arrange_attention(attention: str, config: Any) -> None:
    """Make the model attend from the codes where ``attention`` asks for it: "auto" and "codes" switch
    a config whose attention implementation is sdpa, eager or unset to "kvq" (the model's attention
    modules read it at every call, so the cache saves its memory with no ``attn_implementation``
    at load time). "auto" leaves any other model in dequant mode; "codes" refuses it."""
    if attention == "dequant":
        return
    impl = getattr(config, "_attn_implementation", None)
    blocker = codes_blocker(config)
    if impl in SWITCHABLE_ATTENTION and blocker is None:
        config._attn_implementation = "kvq"
    elif attention == "codes" and impl != "kvq":
        why = blocker or f"its attention implementation is {impl!r}"
        raise InputError(
            f"attention='codes' needs the model to attend with kvq's 'kvq' function (the one that reads the codes), "
            f"but this model cannot switch to it: {why}. Pass attention='auto' or attention='dequant' (a decoded "
            "copy of the history, about as large as a DynamicCache)"
        )


def uncoded_reason(layer: KVQLayer) -> str | None:
    """Why a sliding-window layer can never hold codes (its exact window covers every token it
    keeps), or None. A sliding flush packs all but the last ``residual - 1`` tokens and a block
    flush waits for ``residual`` exact tokens, while the layer keeps only ``sliding_window``."""
    w = layer.sliding_window
    if w is None or (layer.residual < w if layer.flush == "sliding" else layer.residual <= w):
        return None
    return f"residual={layer.residual} with flush={layer.flush!r} covers its sliding_window={w}"


def _resolve_layers(spec_layers: Iterable[int] | None, n: int, what: str) -> set[int]:
    out = set()
    for i in spec_layers or ():
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise InputError(f"{what}: layer {i!r} is not an index into {n} layers")
        out.add(int(i) % n)
    return out


def _resolve_params(params: Mapping[Any, Mapping[str, Any]] | None, n: int, what: str) -> dict[int, dict[str, Any]]:
    """``{layer: overrides}`` with each layer an index into ``n`` layers (negative ones from the end;
    the digits of a JSON key, e.g. a plan's ``"3"``, are accepted)."""
    out = {}
    for key, over in (params or {}).items():
        i = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        out[next(iter(_resolve_layers([i], n, what)))] = dict(over)
    return out


def _layer_types_and_kwargs(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """Each layer's type and its cache layer's keyword arguments, on any transformers 5.x: recent
    releases return one dict per layer, earlier ones (5.17 among them) one dict for all layers."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, Mapping):
        return list(layer_types), [dict(layer_kwargs) for _ in layer_types]
    return list(layer_types), list(layer_kwargs)


class KVQCache(Cache):
    """A transformers ``Cache`` storing K/V with a kvq method, built from a model config.

    ``KVQCache(config, method="oscar", backend="auto", residual=None, bits=2)``

    Args:
        config: the model's ``PretrainedConfig`` (its text config is used). Full-attention and
            sliding-window layers are quantized; other layer types (chunked, linear attention, ...)
            keep their transformers layer in full precision. Every layer kept exact is listed in
            :meth:`memory_report` (``exact_layers``) and named once in a warning. Multi-head latent
            attention (DeepseekV3) caches the latent and the rope part with the method's codec
            (two specs of their widths); the model expands them after the cache, so those layers
            attend by decoding (``attention="codes"`` is refused).
        method: a registered kvq method name (``kvq_core.list_methods()``).
        backend: a kvq backend name, or "auto" (picks torch when available for the device).
        residual: tokens kept in full precision (:mod:`kvq_core.integrations.hf.flush`); default is the method spec's
            ``default_residual`` (OScaR/KIVI 128, OCTOPUS 32).
        flush: "block" or "sliding" (:mod:`kvq_core.integrations.hf.flush`); default is the spec's ``default_flush``
            ("sliding" for OCTOPUS, TurboQuant and PolarQuant, "block" otherwise), "block" when
            either layout shares statistics across tokens.
        stride: tokens a sliding flush encodes at once (:mod:`kvq_core.integrations.hf.flush`): 1 encodes one token per
            step; S > 1 encodes every S steps, holding up to S - 1 tokens twice (and, attending from codes,
            the block encoded ahead decoded while it is read). Attention is the same either way. Default:
            :func:`~kvq_core.integrations.hf.flush.default_stride` (8 for a sliding flush with an exact window,
            else 1).
        chunks: "exact" or "decode": how a multi-token step of a sliding layer attends
            (:mod:`kvq_core.integrations.hf.flush`); settable later through the ``chunks`` property (e.g. after a prefill).
        sliding_layers: "quantize" (default) stores sliding-window layers (Mistral, Gemma 2/3
            local layers, ...) in kvq codes too: tokens leave at the window edge as in transformers'
            sliding layers, and the method's exact recent window stays exact; "exact" keeps them as
            transformers layers in full precision.
        fp_layers: layers kept entirely in full precision (``DynamicLayer``), e.g. ``(0, -1)``.
        fp_key_layers: layers whose keys are stored as float16 (method "fp16") and values quantized.
        value_method, value_params: a different codec for values; by default values use
            ``method`` and ``method_params`` updated with ``value_params`` (e.g. ``{"bits": 2}``
            with ``bits=3`` gives 3-bit keys and 2-bit values).
        layer_params: ``{layer: {param: value}}`` overrides for keys and values of one layer.
        value_layer_params: ``{layer: {param: value}}`` overrides for the values of one layer,
            applied last (per-layer, per-K/V bit widths: ``layer_params={3: {"bits": 3}},
            value_layer_params={3: {"bits": 2}}``). Either may name a ``"method"``: that layer's
            keys and values (values) then use that codec with those parameters only
            (:func:`kvq_core.plan.layer_codecs`), e.g. ``value_layer_params={3: {"method":
            "octopus", "bits": 2}}``.
        attention: "auto" (default): attend from the codes, switching the model's attention
            implementation to "kvq" when it is sdpa, eager or unset (:func:`arrange_attention`); a model
            that cannot attend from codes (soft-capped logits, sinks, another attention kernel) runs in
            dequant mode. "codes": the same, refused where impossible. "dequant": the model's own attention
            over a decoded float copy of the history, about as large as a ``DynamicCache`` (opt-in).
        cache_decoded: keep decoded history per layer in dequant mode (exact, faster, not smaller).
        **method_params: the method's spec parameters (e.g. ``bits=2``); ``head_dim`` comes from
            the config.
    """

    def __init__(
        self,
        config: Any,
        method: str = "oscar",
        backend: str = "auto",
        *,
        residual: int | None = None,
        flush: str | None = None,
        stride: int | None = None,
        chunks: str = "exact",
        fp_layers: Iterable[int] = (),
        fp_key_layers: Iterable[int] = (),
        value_method: str | None = None,
        value_params: Mapping[str, Any] | None = None,
        layer_params: Mapping[int, Mapping[str, Any]] | None = None,
        value_layer_params: Mapping[int, Mapping[str, Any]] | None = None,
        attention: str = "auto",
        cache_decoded: bool = True,
        sliding_layers: str = "quantize",
        **method_params: Any,
    ) -> None:
        from kvq_core.integrations.hf.attention import register

        register()  # so attn_implementation="kvq" works whenever a KVQCache exists
        if sliding_layers not in SLIDING_MODES:
            raise InputError(f"sliding_layers={sliding_layers!r}; expected one of {SLIDING_MODES}")
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text_config
        self.method, self.backend = method, backend
        mla = mla_dims(text_config)
        if mla is not None and attention == "codes":
            raise InputError(
                f"attention='codes' is not possible for multi-head latent attention ({text_config.model_type}): the "
                "model expands the cached latent into K/V after the cache; use attention='dequant' or 'auto'"
            )
        if mla is None:
            arrange_attention(attention, text_config)
        head_dim, value_dim = mla if mla is not None else (_head_dim(text_config),) * 2
        layer_types, layer_kwargs = _layer_types_and_kwargs(text_config)
        n = len(layer_types)
        self.fp_layers = _resolve_layers(fp_layers, n, "fp_layers")
        self.fp_key_layers = _resolve_layers(fp_key_layers, n, "fp_key_layers")
        layer_params = _resolve_params(layer_params, n, "layer_params")
        value_layer_params = _resolve_params(value_layer_params, n, "value_layer_params")
        self.method_params = dict(method_params)
        layers: list[Any] = []
        self.exact_layers: dict[int, str] = {}  # layer -> why its K/V stay in full precision
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            quantize = kind in QUANTIZED_TYPES and not (kind == "sliding_attention" and sliding_layers == "exact")
            if not quantize or i in self.fp_layers:
                layers.append(DynamicLayer() if kind == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
                if kind not in ("dummy",):
                    self.exact_layers[i] = "fp_layers" if i in self.fp_layers else (
                        "sliding_layers='exact'" if kind == "sliding_attention" else f"layer type {kind!r}")
                continue
            km, kp, vm, vp = layer_codecs(method, method_params, value_method, value_params, layer_params.get(i, {}),
                                          value_layer_params.get(i, {}))
            fp_keys = i in self.fp_key_layers
            key_spec = make_spec("fp16", head_dim=head_dim) if fp_keys else make_spec(km, **{**kp, "head_dim": head_dim})
            value_spec = make_spec(vm, **{**vp, "head_dim": value_dim})
            base = value_spec if fp_keys else key_spec
            r = residual if residual is not None else type(base).default_residual
            f = flush
            if f is None:
                f = type(base).default_flush if separable(key_spec, value_spec) else "block"
            window = kwargs.get("sliding_window") if kind == "sliding_attention" else None
            s = stride if stride is not None else default_stride(f, r, window)
            layers.append(
                KVQLayer(
                    key_spec, value_spec, layer_idx=i, backend=backend, residual=r, flush=f, stride=s, chunks=chunks,
                    attention="dequant" if mla is not None else attention, cache_decoded=cache_decoded,
                    config=text_config, sliding_window=window,
                    rollback=self._rollback,
                )
            )
        super().__init__(layers=layers)
        self.mla = mla is not None
        unchosen = {i: why for i, why in self.exact_layers.items() if why != "fp_layers"}
        if unchosen:
            listed = ", ".join(f"{i} ({why})" for i, why in sorted(unchosen.items()))
            warnings.warn(f"KVQCache({method!r}): {len(unchosen)} of {n} layers keep full-precision K/V: {listed}; "
                          "see memory_report()['exact_layers']", stacklevel=2)
        #: layers that can never hold codes (a residual covering their sliding window) -> why
        self.uncoded_layers = {layer.layer_idx: why for layer in self.kvq_layers if (why := uncoded_reason(layer))}
        if self.uncoded_layers:
            listed = ", ".join(f"{i} ({why})" for i, why in sorted(self.uncoded_layers.items()))
            shortest = min(layer.sliding_window for layer in self.kvq_layers if layer.layer_idx in self.uncoded_layers)
            warnings.warn(
                f"KVQCache({method!r}): {len(self.uncoded_layers)} of {n} layers quantize nothing once decoding: every "
                f"token they still attend to stays in the exact window: {listed}. Pass a residual below the window (e.g. residual={shortest // 2}) "
                "to store them in codes, or sliding_layers='exact' to keep them exact on purpose; see "
                "memory_report()['uncoded_layers']", KVQMemoryWarning, stacklevel=2)
        self._warned_copy = False  # the decoded-copy warning is given once per cache
        # layer states at the start of this step, kept until the next step starts (layer 0), so an
        # error of the attention function on the last layer's output still rolls the step back
        self._step: dict[int, dict[str, Any]] | None = None

    @classmethod
    def from_plan(cls, config: Any, path: Any, *, backend: str = "auto", attention: str = "auto",
                  **options: Any) -> KVQCache:
        """The cache a ``kvq tune`` plan file describes (:mod:`kvq_core.plan`), for ``config``'s model.

        Refused (:class:`~kvq_core.errors.PlanError`, with the reason) when the plan was tuned for a
        model with another layer count or head shapes, or is of a newer format. ``options`` (e.g.
        ``cache_decoded=False``) are passed to the constructor beside the plan's arguments. The cache
        encodes one token per step (``stride=1``) unless ``options`` name a stride, so it stores exactly
        the plan's ``bits_per_element``: a larger stride also holds up to ``stride - 1`` tokens as codes
        ahead of need, which the plan's budget does not count.
        """
        from kvq_core.plan import load_plan, check_model

        plan = load_plan(path)
        check_model(plan, config, where=f"plan {path}")
        return cls(config, backend=backend, attention=attention, **{"stride": 1, **plan["cache"], **options})

    def __repr__(self) -> str:
        return f"KVQCache(method={self.method!r}, backend={self.backend!r}, params={self.method_params}, layers={len(self.layers)})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``Cache.update``, with one step (the layer updates of one forward, layer 0 first)
        all or nothing: when a layer rejects its input (or fails otherwise), the layers already
        updated in this step are put back before the error propagates; so does an error of the
        "kvq" attention function on a layer's output (codes mode, :meth:`_rollback`). Retrying
        the step then gives what a fault-free run gives."""
        if layer_idx == 0 or self._step is None:
            self._step = {}
        self._step[layer_idx] = _snapshot(self.layers[layer_idx])
        try:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except Exception:
            self._rollback()
            raise
        self._warn_decoded_copy(self.layers[layer_idx])
        return out

    def _rollback(self) -> None:
        """Put back every layer updated in the current step (none when no step is open)."""
        step, self._step = self._step, None
        for i, state in (step or {}).items():
            _restore(self.layers[i], state)

    def _warn_decoded_copy(self, layer: Any) -> None:
        """Warn once when a layer starts holding a decoded copy of its history, saying why and the fix."""
        if self._warned_copy or not isinstance(layer, KVQLayer) or not layer.history_copy_bytes():
            return
        self._warned_copy = True
        if not layer.codes_mode:
            blocker = codes_blocker(self.config)
            why = ("attention='dequant' was asked for" if layer.attention == "dequant" else
                   f"the model attends with {getattr(self.config, '_attn_implementation', None)!r}, not 'kvq'"
                   + (f" ({blocker})" if blocker else ""))
            fix = ("Build the cache with the default attention='auto' on a model that attends with sdpa or eager (it "
                   "then attends from the codes), or pass cache_decoded=False to decode every step instead (slower, "
                   "no copy); cache.drop_decoded() frees it now")
            what = "hands the model decoded K/V (dequant mode)"
        else:
            why = "a sliding window starts inside a token-group block, whose visible tokens are handed over decoded"
            fix = "Pass cache_decoded=False, or sliding_layers='exact', or a per-token method (e.g. octopus)"
            what = f"(sliding_window={layer.sliding_window}) reads some tokens decoded"
        warnings.warn(
            f"KVQCache({self.method!r}): layer {layer.layer_idx} {what} and keeps a decoded float copy of its packed "
            f"history, about as large as a DynamicCache of those tokens, because {why}; memory_report() counts it in "
            f"decoded_bytes and total_bytes. {fix}.", KVQMemoryWarning, stacklevel=3)

    @property
    def chunks(self) -> str:
        """How multi-token steps of sliding layers attend: "exact" or "decode" (:mod:`kvq_core.integrations.hf.flush`)."""
        modes = {layer.chunks for layer in self.kvq_layers}
        return modes.pop() if len(modes) == 1 else "exact"

    @chunks.setter
    def chunks(self, mode: str) -> None:
        if mode not in CHUNK_MODES:
            raise InputError(f"chunks={mode!r}; expected one of {CHUNK_MODES}")
        for layer in self.kvq_layers:
            layer.chunks = mode

    @property
    def kvq_layers(self) -> list[KVQLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVQLayer)]

    def drop_decoded(self) -> None:
        for layer in self.kvq_layers:
            layer.drop_decoded()

    def crop(self, tokens_to_remove: int) -> None:
        """As ``Cache.crop``, but checks every layer first so a refused crop changes nothing."""
        for layer in self.kvq_layers:
            layer.check_crop(tokens_to_remove)
        self._step = None  # a crop ends the step: nothing before it can be rolled back
        super().crop(tokens_to_remove)

    # -- accounting ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Every byte the cache holds now: packed blocks, exact windows, full-precision layers and
        decoded copies (``memory_report()["total_bytes"]``; ``"stored_bytes"`` leaves the copies out)."""
        return self.memory_report()["total_bytes"]

    def memory_report(self) -> dict[str, Any]:
        """Byte and bit accounting, per kind of storage; every byte the cache holds is counted.

        ``total_bytes`` = ``stored_bytes`` (``packed_bytes`` + ``window_bytes`` + ``fp_layer_bytes``)
        + ``decoded_bytes``: decoded float copies, above all the history a dequant-mode layer keeps
        (about a DynamicCache's worth; attend from codes, ``attn_implementation="kvq"``, or pass
        ``cache_decoded=False`` to hold none). ``bits_per_element`` is every held bit over K/V
        elements at the last attention step, exact tokens (windows, full-precision layers) counted
        at 16 bits as a float16 model stores them; ``stored_bits_per_element`` leaves the decoded
        copies out (the codec's own rate). ``exact_layers`` maps each layer kept entirely in full
        precision to why (``fp_layers``, ``sliding_layers='exact'``, or a layer type kvq does not
        store); their bytes are ``fp_layer_bytes``. ``uncoded_layers`` maps each sliding-window
        layer whose residual covers its window (it stores no codes) to why. ``dynamic_cache_bytes``
        is what a ``DynamicCache`` holding the same tokens in the model's dtype would hold.
        """
        return {**memory_report(self.layers, self.exact_layers), "uncoded_layers": dict(self.uncoded_layers)}

    def bits_per_element(self) -> float:
        """Held bits per K/V element at the last attention step (exact tokens at 16 bits, decoded
        copies included; ``memory_report()["stored_bits_per_element"]`` without them)."""
        return self.memory_report()["bits_per_element"]


def _snapshot(layer: Any) -> dict[str, Any]:
    """A layer's state before an update, for :func:`_restore`. transformers' layers rebind their
    tensors on update, so attribute references suffice; a plain ``DynamicLayer`` (append-only)
    keeps its history's length instead, so the step holds no second copy of it."""
    if isinstance(layer, KVQLayer):
        return layer.snapshot()
    state = dict(vars(layer))
    if type(layer) is DynamicLayer:
        for name in ("keys", "values"):
            if isinstance(state.get(name), torch.Tensor) and state[name].dim() == 4:
                state[name] = state[name].shape[-2]
    return state


def _restore(layer: Any, state: dict[str, Any]) -> None:
    """Undo the updates since :func:`_snapshot`."""
    if isinstance(layer, KVQLayer):
        layer.restore(state)
        return
    state = dict(state)
    for name in ("keys", "values"):
        if isinstance(state.get(name), int):
            state[name] = getattr(layer, name)[:, :, : state[name]]
    vars(layer).update(state)
