"""Torch dispatch: one set of ``kvq::`` ops serving every ``torch_ops`` backend.

- :mod:`~kvq_core.torch_ops.ops` - every ``kvq::`` op schema and fake kernel, and nothing else;
  the schemas carry the backend name, so torch, torch-compiled, triton and numba coexist on one
  device and the Quantizer, not device registration, chooses which runs;
- :mod:`~kvq_core.torch_ops.run` - the op bodies: get the backend's kernel class from the registry
  (the only kernel table; ``BackendInfo.torch_ops`` marks a backend served here), build it once
  per spec and call it; paged ops fall back to the ``torch`` backend's;
- :mod:`~kvq_core.torch_ops.torch_kernels` - what a kernel receives (:class:`TorchContext`), the
  op's spec (``spec_from_json``) and the per-device constant cache (the base class kernels
  subclass is ``kvq_torch.common.TorchMethod``);
- :mod:`~kvq_core.torch_ops.calls` - :class:`OpKernels`, a ``torch_ops`` backend's ``MethodKernels``
  that call the ops;
- :mod:`~kvq_core.torch_ops.arrays` - the torch array adapter.

Everything but ``calls`` needs torch at import; ``import kvq_core`` never imports this package
(a Quantizer on a ``torch_ops`` backend imports ``calls``).
"""
