"""Recurrent decoding: one token at a time with an O(1) state."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...rotary import DEFAULT_BASE, apply_rotary
from .common import check_features, compute_dtype, divide


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention after `position` tokens."""
    kv: torch.Tensor       # (B, H, M, Dv): sum_n (R_n phi_k_n) v_n^T  (rotated iff rotary)
    k_sum: torch.Tensor    # (B, H, M): sum_n phi_k_n, never rotated
    position: int


def initial_state(batch: int, heads: int, num_features: int, value_dim: int, *,
                  device=None, dtype=torch.float32) -> LinearState:
    zeros = torch.zeros(batch, heads, num_features, value_dim, device=device, dtype=dtype)
    return LinearState(zeros, zeros.new_zeros(batch, heads, num_features), 0)


def linear_attention_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                          state: LinearState | None, *, rotary: bool,
                          rope_base: float = DEFAULT_BASE):
    """One token of causal linear attention: (B, H, M) features and (B, H, Dv) values at position
    `state.position`.  O(M * Dv) time and memory, whatever the context length."""
    check_features(phi_q, phi_k, v, rank=3)
    dtype = compute_dtype(phi_q, phi_k, v)
    if state is None:
        b, h, m = phi_q.shape
        state = initial_state(b, h, m, v.shape[-1], device=v.device, dtype=dtype)
    with torch.autocast(phi_q.device.type, enabled=False):
        phi_q, phi_k, v_c = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
        q_num, k_num = phi_q, phi_k
        if rotary:
            q_num, k_num = (apply_rotary(t.unsqueeze(-2), offset=state.position, base=rope_base)
                            .squeeze(-2) for t in (phi_q, phi_k))
        kv = state.kv + k_num.unsqueeze(-1) * v_c.unsqueeze(-2)
        k_sum = state.k_sum + phi_k
        numerator = (q_num.unsqueeze(-2) @ kv).squeeze(-2)
        out = divide(numerator, (phi_q * k_sum).sum(-1))
    return out.to(v.dtype), LinearState(kv, k_sum, state.position + 1)
