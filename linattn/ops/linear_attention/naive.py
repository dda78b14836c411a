"""The plain O(N^2) definitions, for tests and as readable specifications."""
from __future__ import annotations

import torch

from ...rotary import DEFAULT_BASE, check_offset
from .common import check_features, check_nonnegative, compute_dtype, divide, numerator_features


def linear_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool, rotary: bool, offset: int = 0,
                               rope_base: float = DEFAULT_BASE) -> torch.Tensor:
    """The same maths as `linear_attention` with explicit N x N weight matrices."""
    check_features(phi_q, phi_k, v, rank=4)
    check_nonnegative(phi_q, phi_k)
    check_offset(offset)
    dtype = compute_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v_c = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    q_num, k_num = numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base)
    numerator_weights = q_num @ k_num.transpose(-1, -2)
    denominator_weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        numerator_weights = numerator_weights.tril()
        denominator_weights = denominator_weights.tril()
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
