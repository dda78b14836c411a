"""The log-space numerics of linear attention: exact Eq. 19 from log-features at any input scale,
still strictly causal (log-features up to 1/eps of the dtype in magnitude: beyond, common's guard
makes them NaN, or in debug mode common.check_log_feature_range refuses them).  Every log-space
implementation shares what is here: the chunked torch algorithm (torch_logspace.py, whose docstring
gives the chunks, the backward and the cost), its C++ kernel (cpp_logspace.py), the mapping onto fla's
gated linear attention (fla_kernels.py) and the recurrent step (recurrent.py); dispatch.py picks one.

Inputs are b = log phi_q and a = log phi_k, (B, H, N, M).  Eq. 19 is

    out_m = sum_{n<=m} (R_m e^{b_m})^T (R_n e^{a_n}) v_n  /  sum_{n<=m} e^{b_m}^T e^{a_n}.

Plain features e^{a} underflow for large keys (FAVOR+'s a = w.x - |x|^2/2 reaches -6000 at |x| = 100)
and overflow for large logits, and a max taken over the whole sequence would leak the future.
Instead every quantity is scaled by running maxima over positions n <= m only:

* per feature   F_{m,j} = max_{n<=m} a_{n,j}                       (denominator's key scale),
* per pair      P_{m,j} = max(F_{m,2i}, F_{m,2i+1}), j in {2i, 2i+1}  (numerator's key scale: a
  pair's two coordinates share it, so the scale commutes with the rotation R),
* per query     Q_m = max_j (b_{m,j} + F_{m,j}).

Multiplying numerator and denominator by the same e^{-Q_m} changes nothing, and then

* denominator terms are e^{b_mj + a_nj - Q_m} <= 1, and the term of the feature and key that reach
  Q_m is exactly 1: the denominator is >= 1, so no row can underflow to zero;
* the numerator pairs a query coordinate s with a key coordinate t of the same pair, with
  e^{b_ms + a_nt - Q_m} <= e^{max(0, b_ms - b_m,partner(s))}: bounded by the query's own spread
  within a pair.  Eq. 19's rotated numerator is not bounded by its unrotated denominator, so the
  exact output itself grows like that (FAVOR+ with rope="post" at |x| = 30 gives about 1e28 * |v|).
  The query factors e^{b + P - Q} are capped at e^NUMERATOR_CAP (e^30): the output is exact below
  that and saturates (finite, with finite gradients) beyond, instead of overflowing float32.

The recurrent state of decoding keeps F (`LinearState.log_scale`): kv is scaled by e^{-P}, k_sum by
e^{-F}, and each step rescales them by the growth of the maxima, as online softmax does.
"""
from __future__ import annotations

import torch

# The margins of every log-space implementation (the C++ kernel reads them from here).
JUMP_LIMIT = 30.0      # a row whose running max grew more than this within its chunk is computed exactly
NUMERATOR_CAP = 30.0   # numerator query factors are capped at e^30 (saturation beyond float32, see above)
PAIR_SPREAD = 20.0     # pairs whose key scales differ by more take their own numerator exponential


def pair_max(x: torch.Tensor) -> torch.Tensor:
    """max over each rotation pair (2i, 2i+1), written back to both coordinates."""
    return x.unflatten(-1, (-1, 2)).amax(-1).repeat_interleave(2, dim=-1)


def numerator_scale(feature_scale: torch.Tensor, rotary: bool) -> torch.Tensor:
    """P from F: the pair's max where the numerator is rotated, else F itself."""
    return pair_max(feature_scale) if rotary else feature_scale


def numerator_query(log_factor: torch.Tensor) -> torch.Tensor:
    """e^(b + P - Q), capped at e^NUMERATOR_CAP."""
    return torch.exp(log_factor.clamp_max(NUMERATOR_CAP))
