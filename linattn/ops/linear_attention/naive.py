"""The plain O(N^2) definitions, for tests and as readable specifications."""
from __future__ import annotations

import torch

from ...rotary import DEFAULT_BASE, check_offset, rotary_phases
from .common import compute_dtype, divide, numerator_features
from .memory import check_fits
from .plain_scale import scale_plain_features


def reference_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool, rotary: bool, offset: int = 0,
                               rope_base: float = DEFAULT_BASE, nonnegative_features: bool = True,
                               numerator_only: bool = False) -> torch.Tensor:
    """`functional.linear_attention_reference` after its argument checks: the same maths as
    `linear_attention` with explicit N x N weight matrices.
    `nonnegative_features=False`: single features may be negative (see `linear_attention`);
    `numerator_only=True`: the numerator alone, undivided (what normalization="rmsnorm" normalises)."""
    dtype = compute_dtype(phi_q, phi_k, v)
    n = v.shape[-2]
    check_fits(f"linear_attention_reference's two N x N weight matrices at N = {n}",
               2 * v.shape[:-2].numel() * n * n * torch.finfo(dtype).bits // 8, v.device,
               "the reference is O(N^2) in memory: use linear_attention for long sequences")
    phi_q, phi_k, v_c = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    if not numerator_only and v.shape[:-1].numel():   # at unit size, as linear_attention (the ratio allows it)
        phi_q, phi_k, _ = scale_plain_features(phi_q, phi_k, causal=causal)
    q_num, k_num = numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base)
    numerator_weights = q_num @ k_num.transpose(-1, -2)
    denominator_weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        numerator_weights = numerator_weights.tril()
        denominator_weights = denominator_weights.tril()
    if numerator_only:
        return (numerator_weights @ v_c).to(v.dtype)
    return divide(numerator_weights @ v_c, denominator_weights.sum(-1)).to(v.dtype)


def softmax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                causal: bool) -> torch.Tensor:
    """Naive softmax attention exp(q.k / sqrt(D)), for tests and as a readable definition."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n, s = scores.shape[-2:]
        future = torch.ones(n, s, dtype=torch.bool, device=q.device).triu(s - n + 1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


def logspace_attention_reference(b: torch.Tensor, a: torch.Tensor, v: torch.Tensor, *, causal: bool,
                                 rotary: bool, offset: int = 0, rope_base: float = DEFAULT_BASE,
                                 key_offset: int | None = None, return_log_normalizer: bool = False,
                                 log_decay: torch.Tensor | None = None):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k, in float64, never exponentiating more
    than it must: every term e^(b_ms + a_nt) of query m is shifted by the largest exponent of that
    query's numerator and denominator, so nothing overflows and the largest term is 1.  Per pair,
    (R_s x)^T (R_t y) = Re((x1 + i x2)(y1 - i y2) e^(i (s - t) theta)), the query m at s = offset + m and
    the key n at t = key_offset + n (key_offset None: offset).  With `log_decay` (H,) log gamma (causal only),
every term of the pair (m, n), numerator and denominator, is weighted by gamma^(s - t), the distance in
positions.  O(N^2 M) memory: tests only.

    Returns:
        the output (B, H, N, Dv), and with return_log_normalizer also log sum_n phi_q_m . phi_k_n (B, H, N)
        over the keys each query attends to (-inf where it attends to none)."""
    check_offset(offset)
    key_offset = offset if key_offset is None else key_offset
    check_offset(key_offset)
    b, a, v = b.double(), a.double(), v.double()
    n, m = a.shape[-2:]
    pairs = m // 2 if rotary else m
    bq = b.unflatten(-1, (pairs, -1)).unsqueeze(-3)        # (B, H, N, 1, P, s)
    ak = a.unflatten(-1, (pairs, -1)).unsqueeze(-4)        # (B, H, 1, N, P, t)
    terms = bq.unsqueeze(-1) + ak.unsqueeze(-2)            # (B, H, N, N, P, s, t)
    if log_decay is not None:   # gamma^(s - t): + (s - t) log gamma, the distance in positions
        steps = torch.arange(n, dtype=torch.float64, device=b.device)
        distance = (offset + steps)[:, None] - (key_offset + steps)[None, :]
        terms = terms + (distance * log_decay.double()[:, None, None])[:, :, :, None, None, None]
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=b.device).triu(1)
        terms = terms.masked_fill(future[:, :, None, None, None], float("-inf"))
    shift = terms.flatten(-3).amax(dim=(-1, -2))[..., None, None, None, None]
    weights = torch.exp(terms - shift)
    diagonal = weights.diagonal(dim1=-2, dim2=-1)          # (B, H, N, N, P, s): same coordinate
    denominator = diagonal.sum((-1, -2, -3))
    if rotary:
        queries, keys = (rotary_phases(n, m, offset=at, base=rope_base, device=b.device, dtype=torch.float64)
                         for at in (offset, key_offset))
        relative = queries.unsqueeze(1) * keys.conj().unsqueeze(0)     # (N, N, P): e^(i (s - t) theta)
        scores = (diagonal.sum(-1) * relative.real
                  + (weights[..., 0, 1] - weights[..., 1, 0]) * relative.imag).sum(-1)
    else:
        scores = diagonal.sum((-1, -2))
    out = (scores @ v) / denominator.unsqueeze(-1)
    if not return_log_normalizer:
        return out
    return out, denominator.log() + shift.flatten(-5)
