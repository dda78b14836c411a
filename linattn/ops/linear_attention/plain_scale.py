"""Plain features brought to unit size before any product, so that Eq. 19 does not depend on their
scale (docs/numerics.md, "Plain features at any scale").

The output is a ratio linear in phi(q_m) above and below, and linear in all the keys together, so
dividing each query row by a number of its own and every key of a (batch, head) by one number leaves
it unchanged.  The numbers are powers of two: the largest at most the row's (the keys') largest
finite |feature|, so the largest scaled entry lies in [1, 2).  Dividing by a power of two is exact,
so wherever nothing under- or overflows the result is bit for bit what the unscaled features give,
and the scales are constants to autograd (their derivative cancels).  Nothing is read on the host.
"""
from __future__ import annotations

import torch

# The exponent bits of each floating dtype: x's bits & mask are those of the largest power of two <= x
# (0 for a subnormal x, inf for inf or NaN), for x >= 0.
EXPONENT_BITS = {torch.float64: (torch.int64, 0x7FF0000000000000), torch.float32: (torch.int32, 0x7F800000),
                 torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00)}


def largest_finite(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over `dim` (kept), NaN and inf left out: a non-finite feature stays as it is and does what
    it did before (NaN outputs where it reaches), rather than making its whole row or sequence NaN."""
    return x.detach().abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=dim, keepdim=True)


def power_of_two_below(largest: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= `largest` (>= 0), at least the dtype's smallest normal number (so a
    zero row divides by that and stays zero); inf for inf or NaN."""
    int_dtype, mask = EXPONENT_BITS[largest.dtype]
    power = (largest.view(int_dtype) & mask).view(largest.dtype)
    return power.clamp_min_(torch.finfo(largest.dtype).tiny)


def query_scale(phi_q: torch.Tensor) -> torch.Tensor:
    """One per query row: (..., 1) for (..., M) features."""
    return power_of_two_below(largest_finite(phi_q, -1))


def scale_plain_features(phi_q: torch.Tensor, phi_k: torch.Tensor, *, causal: bool):
    """(phi_q, phi_k, query scale, key scale) for (B, H, N, M) features: both divided by their scales,
    and for causal attention NaN in the query rows whose keys are all lost to underflow beside a much
    larger later key (see `rows_without_keys`; the query scale holds it).  The key scale (B, H, 1, 1)
    multiplies a returned state back to the features' own scale; the logs of both (B, H, N, 1) add
    back to a row's log-denominator."""
    key_rows = largest_finite(phi_k, -1)                                     # (B, H, N, 1)
    k_scale, q_scale = power_of_two_below(key_rows.amax(-2, keepdim=True)), query_scale(phi_q)
    if causal:   # + NaN: the row divides by NaN
        q_scale = q_scale + rows_without_keys(key_rows, k_scale)
    return phi_q / q_scale, phi_k / k_scale, q_scale, k_scale


def rows_without_keys(key_rows: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """(B, H, N, 1), from each key's largest finite |feature| (B, H, N, 1): NaN at causal rows m that
    have a key with a non-zero feature at n <= m but none that stays a normal number once scaled (every
    such key is below tiny times the largest key of the sequence, 2^-126 ~ 1.2e-38 in float32); 0
    elsewhere.  Such a row would read 0 / 0 and come out 0, finite and wrong.  Two reductions over the
    (B, H, N) row maxima find the first of each kind of key, no scan along the sequence."""
    with torch.no_grad():
        rows = key_rows.squeeze(-1)
        position = torch.arange(rows.shape[-1], device=rows.device)
        first_nonzero, first_normal = (first_true(found, rows.shape[-1])
                                       for found in (rows > 0, rows / k_scale.squeeze(-1) >= torch.finfo(rows.dtype).tiny))
        lost = (position >= first_nonzero) & (position < first_normal)
        return torch.where(lost, float("nan"), 0.0).to(rows.dtype).unsqueeze(-1)


def first_true(found: torch.Tensor, none: int) -> torch.Tensor:
    """The first index along the last dimension where `found` holds (kept), `none` where it never does
    (argmax gives the first of equal maxima)."""
    return torch.where(found.any(-1, keepdim=True), found.byte().argmax(-1, keepdim=True), none)
