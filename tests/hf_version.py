"""What the installed transformers takes, for tests that run documentation written for the newest."""
from __future__ import annotations

import pytest


def skip_unless_cache_keyword(code: str) -> None:
    """Skip when ``code`` passes ``cache=`` and this transformers takes the cache by another name
    (``past_key_values=`` before 5.24): the docs are written for the current keyword, and say so."""
    if "cache=" not in code:
        return
    import transformers
    from transformers import LlamaForCausalLM

    from kvq_core.integrations.hf.cache_arg import cache_keyword

    name = cache_keyword(LlamaForCausalLM)
    if name != "cache":
        pytest.skip(f"the example passes cache=; transformers {transformers.__version__} takes {name}= instead")
