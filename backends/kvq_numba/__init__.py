"""kvq's Numba backend: ``@njit`` CPU kernels for NumPy / CPU-tensor input, ``numba.cuda`` kernels
for CUDA input (device arrays, CUDA tensors), proven equal to the NumPy reference by the
conformance suite. Importing it never needs a GPU: CUDA is looked up when a CUDA input arrives.

What lives where:

- :mod:`kvq_numba.cpu` — the CPU kernels (``@njit`` functions of arrays);
  :mod:`kvq_numba.gpu` — the CUDA kernels and each kernel class's CUDA twin.
- The kernel classes the registry names (:mod:`~kvq_numba.intcodes`: OScaR, KIVI;
  :mod:`~kvq_numba.octopus`; :mod:`~kvq_numba.turboquant`) hold a method's host side and call
  :mod:`kvq_numba.cpu`; :mod:`~kvq_numba.route` is the one place that sends a call's CUDA input
  to the twin instead. :mod:`~kvq_numba.paged` and :mod:`~kvq_numba.paged_write` serve the
  ``kvq::`` paged ops on the CPU kernels.
- Shared by both targets or by the backend as a whole: :mod:`~kvq_numba.rules` (scalar coding
  rules compiled for either), :mod:`~kvq_numba.arrays` (host/CUDA array handling),
  :mod:`~kvq_numba.threads` (CPU thread policy), :mod:`~kvq_numba.compile_notice` (the first-compile
  line), :mod:`~kvq_numba.cache_stamp` (the disk cache dropped when the sources change),
  :mod:`~kvq_numba.plugin` (registration and ``supports``).

Importing it has no side effects: what the kernels need before they first run happens when a kernel class
is constructed (:mod:`~kvq_numba.startup`).
"""
