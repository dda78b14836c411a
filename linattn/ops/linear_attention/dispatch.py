"""Which implementation runs a linear-attention call: one table, keyed by (numerics, backend, causal).

* numerics: "plain" (features phi >= 0) or "log" (log-features, the numerics of stable.py);
* backend: "torch" (chunk.py's algorithms, any device), "triton" (chunk_parallel.py for plain
  features, log_chunk_parallel.py for log-features: CUDA, or CPU under TRITON_INTERPRET=1) or "cpp" (cpp.py's
  C++ kernel: CPU); `resolve` turns "auto" into one of them and says why one asked for cannot run;
  or "fla" (fla_chunk.py: flash-linear-attention's chunk kernels, CUDA; chosen by name only until it has
  been measured against "triton" on a GPU through the block);
* causal: the C++ kernel has a causal log-space pass only, fla's kernels causal passes only; elsewhere
  those backends run torch's.

Every entry takes one call shape and returns the output, or (output, LinearState) with return_state:

    implementation(phi_q, phi_k, v, *, causal, rotary, offset, rope_base, chunk_size, return_state)

A call without tokens takes torch's entry whatever the backend (`implementation`).  The naive
references (naive.py) and the recurrent step (recurrent.py) are not in the table: they are called
by name.  The Triton modules are imported when a call reaches them, since triton may be absent.
"""
from __future__ import annotations

import torch

from . import chunk, cpp, fla_chunk
from .backends import cpp_runs_here, cpp_unavailable, fla_installed, interpreting, triton_installed

BACKENDS = ("auto", "torch", "triton", "cpp", "fla")


def triton_linear_attention(phi_q, phi_k, v, *, chunk_size: int, **call):
    """chunk_parallel.py's kernels, which choose their own tiles (no chunk_size)."""
    from . import chunk_parallel   # here, not above: triton may be absent
    return chunk_parallel.linear_attention(phi_q, phi_k, v, **call)


def triton_log_linear_attention(b, a, v, *, chunk_size: int, **call):
    """log_chunk_parallel.py's kernels, which choose their own tiles (no chunk_size)."""
    from . import log_chunk_parallel   # here, not above: triton may be absent
    return log_chunk_parallel.log_linear_attention(b, a, v, **call)


IMPLEMENTATIONS = {   # (numerics, backend, causal): implementation
    ("plain", "torch", True): chunk.linear_attention,
    ("plain", "torch", False): chunk.linear_attention,
    ("plain", "triton", True): triton_linear_attention,
    ("plain", "triton", False): triton_linear_attention,
    ("plain", "cpp", True): chunk.linear_attention,          # the C++ kernel takes log-features only
    ("plain", "cpp", False): chunk.linear_attention,
    ("log", "torch", True): chunk.log_linear_attention,
    ("log", "torch", False): chunk.log_linear_attention,
    ("log", "triton", True): triton_log_linear_attention,
    ("log", "triton", False): triton_log_linear_attention,
    ("log", "cpp", True): cpp.log_linear_attention,
    ("log", "cpp", False): chunk.log_linear_attention,       # the C++ kernel is causal only
    ("plain", "fla", True): fla_chunk.linear_attention,
    ("plain", "fla", False): chunk.linear_attention,         # fla's kernels are causal only
    ("log", "fla", True): fla_chunk.log_linear_attention,
    ("log", "fla", False): chunk.log_linear_attention,
}


def numerics(log_space: bool) -> str:
    return "log" if log_space else "plain"


def has_own_kernel(log_space: bool, backend: str, causal: bool) -> bool:
    """Whether `backend` computes such calls in a kernel of its own rather than with torch's entry."""
    key = numerics(log_space)
    return IMPLEMENTATIONS[key, backend, causal] is not IMPLEMENTATIONS[key, "torch", causal]


def implementation(log_space: bool, backend: str, causal: bool, tokens: int):
    """The table's entry for a call of `tokens` tokens on a resolved backend.  Without tokens it is
    torch's (the kernels' loops want one; torch's gives the empty output and the state before any
    token)."""
    return IMPLEMENTATIONS[numerics(log_space), backend if tokens else "torch", causal]


def resolve(backend: str, device: torch.device, float64: bool = False, *, log_space: bool, causal: bool) -> str:
    """The backend that runs on `device` (for float64 inputs if `float64`: "auto" then takes torch
    rather than triton, whose kernels compute in float32), or a ValueError that says how to get the one
    asked for.  On CPU "auto" takes the C++ kernel where the table has one for the call (it is built
    then), else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda" and triton_installed() and not float64:
            return "triton"
        own_kernel = has_own_kernel(log_space, "cpp", causal)
        return "cpp" if device.type == "cpu" and own_kernel and cpp_runs_here() else "torch"
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"backend='cpp' runs on CPU tensors, got tensors on {device}; use backend='auto' "
                             "(triton on CUDA) or 'torch'")
        if (reason := cpp_unavailable()) is not None:
            raise ValueError(reason)
    if backend == "fla":
        if not fla_installed():
            raise ValueError("backend='fla' needs flash-linear-attention: pip install 'linattn[fla]' (CUDA only; "
                             "or use backend='auto')")
        if device.type != "cuda":
            raise ValueError(f"backend='fla' runs on CUDA tensors, got tensors on {device}; move them to a GPU "
                             "or use backend='auto'")
        if float64:
            raise ValueError("backend='fla' computes in float32 at most; for float64 use backend='torch'")
    if backend == "triton":
        if not triton_installed():
            raise ValueError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                             "(or use backend='torch')")
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors, got tensors on {device}; move them "
                             "to a GPU, set TRITON_INTERPRET=1 before importing linattn to run the kernels "
                             "in Triton's CPU interpreter, or use backend='torch'")
    return backend
