"""The ``numba.cuda`` kernels of the numba backend, for CUDA input: OScaR/KIVI integer codes
(``intcodes``) and OCTOPUS (``octopus``), on shared per-block helpers (``common``) and a NumPy 2.5
shim for numba-cuda (``compat``). Each kernel class's CUDA twin lives here
(:mod:`kvq_numba.route` builds it on the first CUDA input): importing a module of this package
imports numba.cuda, importing the package itself does not.

(The package is named ``gpu``: numba-cuda's import redirector matches any module name containing
"numba.cuda", so ``kvq_numba.cuda`` would recurse in its finder.)
"""
