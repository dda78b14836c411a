"""Causal and non-causal linear attention with RoPE after the feature map (Eq. 19), in the layout of
flash-linear-attention: one file per algorithm, kernels beside them, one call shape, one table.

Algorithms (torch): naive.py, the O(N^2) references; chunk.py, the chunked algorithms for plain
features and for log-features; recurrent.py, one-token decoding.
Kernels: cpp.py (stable_cpu.cpp), the causal log-space pass in C++ for CPUs; chunk_parallel.py and
log_chunk_parallel.py (shared helpers in triton_common.py), the Triton kernels for plain and for
log-features.
Shared: common.py (checks, dtypes, the guarded division), stable.py (the log-space numerics: scales
and margins), backends.py (what hardware is here).
dispatch.py: the table (numerics, backend, causal) -> implementation, and "auto"'s choice."""
