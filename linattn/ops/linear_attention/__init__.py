"""Causal and non-causal linear attention with RoPE after the feature map (Eq. 19).

naive.py: the O(N^2) definition; chunk.py: the torch backend; fused.py: the Triton kernels;
recurrent.py: one-token decoding; backends.py: which backend runs a call."""
