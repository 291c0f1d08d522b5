"""NumPy reference kernels of QJL (the codec is described in :mod:`kvq_core.methods.qjl`).

The sign sketch itself is :mod:`kvq_numpy.sketch` (shared with TurboQuant_prod). Arrays are [batch, kv_heads, rows, ...]; each kv head has its own sketch S (kv_heads, m, d).
"""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.methods.qjl import QJLSpec
from kvq_numpy.attention import by_kv_head, from_kv_head, softmax_over_logits
from kvq_numpy.intcodes import IntCodesKernels
from kvq_numpy.sketch import encode_signs, qjl_reconstruct, qjl_scores, sketch

Fields = dict[str, np.ndarray]


class QJLKernels:
    """Keys: signs of S k and ||k||, scored by the QJL estimator; values: KIVI's per-token INT codec."""

    def __init__(self, spec: QJLSpec) -> None:
        self.spec = spec
        self.values = IntCodesKernels(spec.value_codec)

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> Fields:
        k = np.asarray(k, dtype=np.float32)
        return {"qjl": encode_signs(k, ctx.consts["sketch"]), "norm": np.linalg.norm(k, axis=-1)}

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        """The unbiased-in-expectation reconstruction sqrt(pi/2)/m ||k|| S^T h: <q, k_hat> is the score."""
        return qjl_reconstruct(fields["qjl"], fields["norm"], ctx.consts["sketch"])

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> Fields:
        return self.values.encode_values(v, ctx)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        return self.values.decode_values(fields, ctx)

    def attend(
        self, q: np.ndarray, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sketch the query once, score every key by the estimator, softmax over decoded values."""
        s = ctx.consts["sketch"]
        q_sketch = sketch(by_kv_head(np.asarray(q, np.float64), ctx.shape[1]), s)
        logits = qjl_scores(q_sketch, kfields["qjl"], kfields["norm"])
        out, lse = softmax_over_logits(logits, self.decode_values(vfields, ctx), scale)
        return from_kv_head(out, q.shape), from_kv_head(lse, q.shape)
