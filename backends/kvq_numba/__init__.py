"""kvq's Numba backend: ``@njit`` CPU kernels for NumPy / CPU-tensor input, ``numba.cuda`` kernels
for CUDA input (device arrays, CUDA tensors), proven equal to the NumPy reference by the
conformance suite. Importing it never needs a GPU: CUDA is looked up when a CUDA input arrives."""
