"""The Numba CPU kernels (``@njit``, cached on disk) of the numba backend, for NumPy arrays and CPU
tensors: integer codes (``intquant``), OCTOPUS codes (``octopus_codes``), TurboQuant codes
(``turboquant_codes``), the Hadamard and OTS steps (``rotation``), the fused attends (``attend``,
``attend_planes``, ``attend_octopus``) with their register tiles and vectors (``tiles``, ``simd``) and
shared helpers (``common``), the split-KV job machinery of paged and windowed attention (``page_table``,
``window``) and the paged write (``page_writes``). Plain functions of arrays; the kernel classes of
:mod:`kvq_numba` call them.

"""
