"""kvq's PyTorch backends: ``"torch"`` (eager) and ``"torch-compiled"`` (the same kernels compiled
by inductor), both served through the ``kvq::`` ops of :mod:`kvq_core.torch_ops` and registered by
:mod:`kvq_torch.plugin`.

Layout of this package:

- :mod:`kvq_torch.common` - shared helpers mirroring the NumPy reference (bit packing, FWHT, the
  asymmetric group quantizer, codebook lookup, softmax attention with GQA) and the
  :class:`~kvq_torch.common.TorchMethod` base class;
- ``kvq_torch/<method>.py`` - one :class:`TorchMethod` subclass per method;
- :mod:`kvq_torch.compiled` - the inductor wrapper behind ``"torch-compiled"``;
- :mod:`kvq_torch.plugin` - the ``KERNELS`` table (lazy ``"module:Class"`` references) and the
  registration: one ``BackendInfo`` per backend, both ``torch_ops``, ``torch-compiled`` with
  ``adapt=compiled``.

Adding a method (e.g. ``octopus``):

1. ``kvq_torch/octopus.py``: ``class OctopusTorch(TorchMethod)`` with ``encode_keys``,
   ``decode_keys``, ``encode_values``, ``decode_values`` and ``attend`` on torch tensors.
   Port the NumPy reference (``kvq_numpy/octopus.py``) op for op in float32 with the helpers of
   :mod:`kvq_torch.common` (``pack_codes``/``unpack_codes``, ``fwht``, ``codebook_quantize``
   = ``np.searchsorted(side="right")``, ``tree_sum``/``sqrt32``, ``softmax_attend``). The
   constants arrive as tensors in ``ctx.consts`` (same names as the core's ``spec.constants``).
   No NumPy, no ``.item()``/Python branches on tensor values, return fresh tensors with the
   layout's exact dtypes and shapes.
2. ``kvq_torch/plugin.py``: add ``"octopus": "kvq_torch.octopus:OctopusTorch"`` to ``KERNELS``.

Nothing else: the ops, fakes, the compiled backend and the conformance suite
(``kvq_core.testing.check_method("torch", "octopus")``) pick it up from the table.

Design notes:

- **Constants** are not op arguments: they are a pure function of (spec, layer, kv_heads), all
  of which the op receives; the op body fetches them (cached per device) with
  :func:`kvq_core.torch_ops.torch_kernels.consts_for`, which keeps NumPy out of traced code and
  constant tensors out of exported graphs.
- **torch-compiled**: only token dims dynamic, batch/heads/head_dim/spec static; inputs cast
  to float32 first; one graph per spec, kernel, batch and kv_heads. Its codes are
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
