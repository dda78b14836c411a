"""Causal and non-causal linear attention with RoPE after the feature map (Eq. 19).

naive.py: the O(N^2) definitions; chunk.py: the torch backend; stable.py: its log-space path;
cpp.py (stable_cpu.cpp): that path's C++ kernel for CPUs; chunk_parallel.py and
log_chunk_parallel.py (helpers in triton_common.py): the Triton kernels, from plain and log-features;
recurrent.py: one-token decoding; backends.py: which backend runs a call."""
