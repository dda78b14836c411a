"""Causal and non-causal linear attention with RoPE after the feature map (Eq. 19).

naive.py: the O(N^2) definitions; chunk.py: the torch backend; stable.py: its log-space path;
cpp.py (stable_cpu.cpp): that path's C++ kernel for CPUs; fused.py: the Triton kernels;
recurrent.py: one-token decoding; backends.py: which backend runs a call."""
