"""kvq's PyTorch backends: ``"torch"`` (eager, ``kvq::`` custom ops) and ``"torch-compiled"``
(the same kernels compiled by inductor). Both registered by :mod:`kvq_torch.plugin`.

Layout of this package (the bitsandbytes shape: schemas + fakes in one file, a pure-PyTorch
default implementation, device kernels registered on the same ops):

- :mod:`kvq_torch.ops` - every ``kvq::`` op schema and fake kernel (``kvq::encode``,
  ``kvq::decode``, ``kvq::attend``), generic over methods through the spec's JSON string;
- :mod:`kvq_torch.common` - shared helpers mirroring the NumPy reference (bit packing,
  FWHT, the asymmetric group quantizer, codebook lookup, softmax attention with GQA) and the
  :class:`~kvq_torch.common.TorchMethod` base class;
- ``kvq_torch/<method>.py`` - one :class:`TorchMethod` subclass per method;
- :mod:`kvq_torch.plugin` - the ``KERNELS`` table and the backend registration;
- :mod:`kvq_torch.arrays` - the array adapter (NumPy in, tensors kept on their device).

Adding a method (e.g. ``octopus``):

1. ``kvq_torch/octopus.py``: ``class OctopusTorch(TorchMethod)`` with ``encode_keys``,
   ``decode_keys``, ``encode_values``, ``decode_values`` and ``attend`` on torch tensors.
   Port the NumPy reference (``kvq_numpy/octopus.py``) op for op in float32 with the helpers of
   :mod:`kvq_torch.common` (``pack_codes``/``unpack_codes``, ``fwht``, ``codebook_quantize``
   = ``np.searchsorted(side="right")``, ``l2_norm``/``tree_sum``/``sqrt32``, ``softmax_attend``). The
   constants arrive as tensors in ``ctx.consts`` (same names as the core's ``spec.constants``).
   No NumPy, no ``.item()``/Python branches on tensor values, return fresh tensors with the
   layout's exact dtypes and shapes.
2. ``kvq_torch/plugin.py``: add ``"octopus": OctopusTorch`` to ``KERNELS``.

Nothing else: the ops, fakes, the compiled backend and the conformance suite
(``kvq_core.testing.check_method("torch", "octopus")``) pick it up from the table.

Design notes:

- **Op schemas** (:mod:`kvq_torch.ops`): three generic ops, the method named by the spec's JSON
  string; the fake kernels derive output shapes from ``spec.key_layout``/``value_layout``, so a
  symbolic token count flows through. Constants are *not* op arguments: the implementation
  fetches them (cached per device) from the core with :func:`kvq_torch.common.consts_for`,
  which keeps NumPy out of traced code and constant tensors out of exported graphs.
- **Backends**: ``"torch"`` calls the ops (opaque nodes under a user's ``torch.compile`` /
  ``torch.export``); ``"torch-compiled"`` compiles the same kernel methods with inductor
  (``fullgraph=True``; only token dims dynamic, batch/heads/head_dim/spec static; inputs cast
  to float32 first; one graph per spec, kernel, batch and kv_heads). Its codes are
  bit-identical to ``"torch"`` (tests/test_torch_ops.py), because float32 decisions use
  order-fixed arithmetic (:func:`~kvq_torch.common.tree_sum`, :func:`~kvq_torch.common.sqrt32`;
  eager CPU ``torch.sqrt`` is not correctly rounded, inductor's is).
- **Export**: a token ``Dim`` works; for layouts with one stats row per token group (OScaR and
  KIVI keys) give it ``min`` above one group (torch 2.13 specialises a derived size that could
  be 1 and reports a constraint violation otherwise).
- **Attend**: OScaR under the compiled backend scores from the packed bytes (per-group affine
  identity, no float K/V); elsewhere attend decodes and uses matmuls. ``kvq::materialize`` is a
  layout barrier that lets a compiled kernel fix the memory order of a small operand.
"""
