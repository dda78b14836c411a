"""Linear attention with RoPE after the feature map (RoFormer Eq. 19): the public functional API.

* `linear_attention`            - the fast path, O(N) time and memory, on one of two backends:
                                  "torch" (chunked, any device) or "triton" (Triton kernels, CUDA);
* `linear_attention_reference`  - a plain O(N^2) version of the same maths, for tests;
* `linear_attention_step`       - one token of recurrent decoding with an O(1) state.

With `rotary=True` the numerator uses R_m phi(q_m) and R_n phi(k_n) while the denominator keeps the
unrotated features, so it stays a sum of non-negative terms:

    out_m = sum_n (R_m phi_q_m)^T (R_n phi_k_n) v_n  /  sum_n phi_q_m^T phi_k_n

All sums are accumulated in float32 (float64 stays float64) with autocast turned off, and the
denominator is clamped away from zero only where it underflows.  The implementations live in
`linattn.ops.linear_attention`, each beside the naive reference it is tested against; its
dispatch.py holds the one table that picks the implementation of a call.
"""
from __future__ import annotations

import torch

from . import custom_ops
from .ops.linear_attention import dispatch
from .ops.linear_attention.chunk import DEFAULT_CHUNK_SIZE, check_chunk_size
from .ops.linear_attention.common import (LogProjection, check_device, check_dtypes, check_feature_kind, check_features,
                                          check_log_features, check_log_feature_range,
                                          check_nonnegative, check_not_projection, compute_dtype,
                                          feature_tensors, finite_log_features)
from .ops.linear_attention.naive import linear_attention_reference, softmax_attention_reference
from .ops.linear_attention.recurrent import LinearState, initial_state, linear_attention_step
from .checks import check_flags, check_rope_base
from .rotary import DEFAULT_BASE, check_offset, check_positions, check_rotated_dim

BACKENDS = dispatch.BACKENDS

__all__ = ["BACKENDS", "DEFAULT_CHUNK_SIZE", "LinearState", "LogProjection", "initial_state",
           "linear_attention", "linear_attention_reference", "linear_attention_step",
           "softmax_attention_reference"]


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     rotary: bool, offset: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     rope_base: float = DEFAULT_BASE, return_state: bool = False,
                     backend: str = "auto", log_space: bool = False, nonnegative_features: bool = True):
    """Linear attention of (B, H, N, M) non-negative features and (B, H, N, Dv) values.

    `rotary=True` is Eq. 19 at positions offset..offset+N-1; `causal=True` sums over n <= m only.
    With `return_state=True` (causal only) also returns the `LinearState` after the last token,
    so decoding can continue with `linear_attention_step`.  `backend`: "torch", "triton" (Triton
    kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or "auto" (triton on CUDA
    tensors when it is installed, the C++ kernel for causal log-space calls on CPU, torch for float64
    and elsewhere); `ops/linear_attention/dispatch.py` has the table of what runs.  `log_space=True`:
    phi_q and phi_k hold log-features, and the stabilised algorithm of `ops/linear_attention/stable.py`
    runs, on every backend; each
    may also be a `LogProjection` (inputs @ weight^T + shift), which the torch backend's causal pass
    projects chunk by chunk without holding the (B, H, N, M) log-features.
    `nonnegative_features=False` skips the check that every feature is >= 0, for features whose
    kernel phi_q . phi_k is positive though single features are not (a map's own guarantee, such
    as taylor's; the denominator must be positive for the output to mean anything).
    """
    check_flags(causal=causal, rotary=rotary, return_state=return_state, log_space=log_space,
                nonnegative_features=nonnegative_features)
    check_feature_kind(log_space, nonnegative_features)
    if log_space:
        check_log_features(phi_q, phi_k, v)
    else:
        check_not_projection(phi_q, phi_k)
        check_features(phi_q, phi_k, v, rank=4)
    check_device(phi_q, phi_k, v)
    check_dtypes(phi_q, phi_k, v, log_space)
    check_chunk_size(chunk_size)
    check_offset(offset)
    check_rope_base(rope_base)
    offset = int(offset)   # numpy's integers too: the state's position is a plain int
    if rotary:
        check_rotated_dim(phi_k.shape[-1])
        check_positions(offset, v.shape[-2])
    if return_state and not causal:
        raise ValueError("return_state=True needs causal=True: a non-causal pass has no decoding state")
    options = dict(causal=causal, rotary=rotary, offset=offset, chunk_size=chunk_size, rope_base=rope_base,
                   return_state=return_state, backend=backend, log_space=log_space,
                   nonnegative_features=nonnegative_features)
    if torch.compiler.is_compiling():   # one opaque op: the computation below branches on the data
        return custom_ops.linear_attention(phi_q, phi_k, v, **options)
    return compute_linear_attention(phi_q, phi_k, v, **options)


def compute_linear_attention(phi_q, phi_k, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int,
                             chunk_size: int, rope_base: float, return_state: bool, backend: str, log_space: bool,
                             nonnegative_features: bool = True, check_range: bool = True):
    """`linear_attention` after its argument checks: the checks that read the data, then the
    implementation that dispatch.py's table holds for the call.  What the custom op
    `linattn::linear_attention` runs under torch.compile (the range check reads the data, so it is
    here, inside the op).  `check_range=False`: the caller's forward checked these very features
    already (the compiled backward, which runs the computation again under autograd)."""
    if log_space:   # the bound first: -inf (a feature that is exactly 0) is raised to a floor below it
        if check_range:
            check_log_feature_range(phi_q, phi_k, compute_dtype(*feature_tensors(phi_q, phi_k), v))
        phi_q, phi_k = finite_log_features(phi_q), finite_log_features(phi_k)
    float64 = compute_dtype(*feature_tensors(phi_q, phi_k), v) == torch.float64
    resolved = dispatch.resolve(backend, v.device, float64=float64, log_space=log_space, causal=causal)
    if not log_space and nonnegative_features:
        check_nonnegative(phi_q, phi_k)
    tokens = v.shape[-2]
    attend = dispatch.implementation(log_space, resolved, causal, tokens)
    return attend(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=offset, rope_base=rope_base,
                  chunk_size=max(1, min(chunk_size, tokens)),   # a short sequence is one chunk, unpadded
                  return_state=return_state)
