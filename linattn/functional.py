"""Linear attention with RoPE after the feature map (RoFormer Eq. 19): the public functional API.

* `linear_attention`            - the fast path, O(N) time and memory, on a backend of
                                  docs/backends.md: "torch" (any device), "cpp" (CPU), "fla" (CUDA);
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
from .ops.linear_attention.common import (DEFAULT_CHUNK_SIZE, LogProjection, check_chunk_size, check_device,
                                          check_dtypes, check_feature_kind, check_features, check_log_features,
                                          check_not_projection)
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
    so decoding can continue with `linear_attention_step`.  `backend`: "torch", "cpp" (the C++ kernel
    of causal log-space calls on CPU), "fla" (flash-linear-attention's kernels for causal calls on
    CUDA) or "auto" (fla on CUDA where it is installed, cpp on CPU where it builds, torch for float64
    and elsewhere); `ops/linear_attention/dispatch.py` has the table of what runs, docs/backends.md
    the story.  Input values are not read on the host unless debug mode is on (`linattn.set_debug`):
    negative features and log-features out of range give NaN rows instead of an error.  `log_space=True`:
    phi_q and phi_k hold log-features, and the stabilised algorithm of `ops/linear_attention/stable.py`
    runs, on every backend; each
    may also be a `LogProjection` (inputs @ weight^T + shift), which the torch backend's causal pass
    projects chunk by chunk without holding the (B, H, N, M) log-features.
    `nonnegative_features=False` skips the guard that every feature is >= 0, for features whose
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
    return dispatch.compute_linear_attention(phi_q, phi_k, v, **options)
