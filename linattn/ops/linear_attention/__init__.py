"""Causal and non-causal linear attention with RoPE after the feature map (Eq. 19), in the layout of
flash-linear-attention: one module per (backend, algorithm), one call shape, one table.  The
algorithms are attention on plain features (phi >= 0) and on log-features (log phi, "logspace": the
numerics of stable.py); docs/backends.md tells the story.

References and decoding: naive.py, the O(N^2) references; recurrent.py, one-token decoding.
torch backend: torch_plain.py and torch_logspace.py, the chunked algorithms in torch ops (any device).
cpp backend: cpp_logspace.py (stable_cpu.cpp), the causal log-space pass in C++ (CPU).
fla backend: fla_kernels.py, Eq. 19 on flash-linear-attention's chunk kernels (causal, CUDA), with
factor_kernels.py's Triton kernels for fla's log-space inputs (one per direction).
Shared: common.py (checks, guards, dtypes, the guarded division), stable.py (the log-space numerics:
scales and margins), backends.py (what this machine offers).
dispatch.py: the table (numerics, backend, causal) -> implementation, "auto"'s choice, and
compute_linear_attention, which runs a call."""
