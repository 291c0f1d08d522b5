"""The keyword a transformers model takes its cache by: ``cache`` in recent transformers 5.x,
``past_key_values`` in earlier 5.x (5.17, the GPU machine's, among them).

A keyword the model does not take is swallowed by its forward's ``**kwargs``: the model then
builds a ``DynamicCache`` of its own and the cache handed in is silently never used. kvq's own
calls of ``forward`` and ``generate`` pass the cache through :func:`cache_kwargs`, so they work
on either."""
from __future__ import annotations

import functools
import inspect
from typing import Any

NAMES = ("cache", "past_key_values")  # the current name first


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """``"cache"`` or ``"past_key_values"``: the one ``model_class.forward`` declares."""
    params = inspect.signature(model_class.forward).parameters
    for name in NAMES:
        if name in params:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes its cache by none of {', '.join(NAMES)}: "
                    "kvq needs a transformers model that takes a Cache object")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)`` and ``model.generate(...)`` on this transformers."""
    return {cache_keyword(type(model)): cache}
