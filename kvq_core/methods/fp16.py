"""``fp16``: the identity codec (K/V stored as floats), used to prove integrations exact."""
from __future__ import annotations

import dataclasses

from kvq_core.layout import Layout, float_field, make_layout
from kvq_core.spec import MAX_HEAD_DIM, MethodSpec


@dataclasses.dataclass(frozen=True)
class Fp16Spec(MethodSpec):
    """Store K and V unquantized in ``storage`` ("float16" by default, or "float32")."""

    method = "fp16"
    summary = "identity codec: K/V stored as float16 (or float32); the exactness baseline"

    storage: str = "float16"

    def validate_head_dim(self) -> None:
        """Any head_dim: the identity codec has no block structure (e.g. 72 or 100 work)."""
        self._check_int("head_dim", 1, MAX_HEAD_DIM)

    def validate(self) -> None:
        super().validate()
        self._check_choice("storage", ("float16", "float32"))

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        return make_layout(float_field("data", (batch, kv_heads, tokens, self.head_dim), self.storage))

    value_layout = key_layout
