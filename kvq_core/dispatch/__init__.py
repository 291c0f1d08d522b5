"""Torch dispatch: one set of ``kvq::`` ops serving every torch-tensor backend.

- :mod:`~kvq_core.dispatch.table` - the kernel table ``(backend, method) -> kernel class``, the
  only thing a backend adds (pure Python, no torch import);
- :mod:`~kvq_core.dispatch.ops` - every ``kvq::`` op schema and fake kernel, and nothing else;
  the schemas carry the backend name, so torch, torch-compiled, triton and numba coexist on one
  device and the Quantizer, not device registration, chooses which runs;
- :mod:`~kvq_core.dispatch.run` - the op bodies: look the kernel up in the table and call it;
- :mod:`~kvq_core.dispatch.torch_kernels` - what a table kernel receives and subclasses
  (:class:`TorchContext`, :class:`TorchMethod`) and the per-device constant cache;
- :mod:`~kvq_core.dispatch.calls` - :class:`OpKernels`, a backend's ``MethodKernels`` that call the ops;
- :mod:`~kvq_core.dispatch.arrays` - the torch array adapter.

Everything but ``table`` needs torch; ``kvq_core`` itself never imports this package.
"""
