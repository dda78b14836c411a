"""Linear attention of plain features in torch ops, O(N) time and memory on any device, in
dispatch.py's call shape: the `torch` backend's entry for plain features (features phi >= 0).

Causal, one loop over chunks of L tokens carries the M x Dv state S = sum_n (R_n k_n) v_n^T
and the M-vector z = sum_n k_n of the tokens before the chunk; inside a chunk the products are exact:

    out_m = [(R_m q_m)^T S + sum_{n<=m in chunk} (R_m q_m . R_n k_n) v_n] / [q_m . (z + sum_{n<=m} k_n)]

Every temporary is per chunk, so nothing N x M is allocated besides the inputs, and the backward
pass recomputes the rotation, the scores and the states (a forward loop for dq, a reverse loop
for dk and dv, as flash-linear-attention's fused_chunk kernels do): it saves q, k, v, the output
and the denominator only.  Per chunk the work is a handful of (L x M) @ (M x Dv) products.
Non-causal: torch's matrix products, q (k^T v) over (k^T 1).
"""
from __future__ import annotations

import torch

from ...rotary import rotary_phases, rotate_pairs
from .common import (compute_dtype, divide, first_derivatives_only, numerator_features, output_gradients,
                     without_autocast)
from .recurrent import LinearState, initial_state


def plain_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool, rotary: bool,
                    offset: int, rope_base: float, chunk_size: int, return_state: bool):
    """Eq. 19 of plain (B, H, N, M) features: causal chunk by chunk (`causal_attention`), else in one
    product.  In float32 (float64 stays float64) with autocast off; outputs in v's dtype."""
    if phi_q.shape[-2] == 0:   # no tokens: an empty output (the chunk loops want one)
        return nothing_to_attend(v, phi_q.shape[-1], compute_dtype(phi_q, phi_k, v), position=offset,
                                  return_state=return_state, log_space=False)
    out_dtype, dtype = v.dtype, compute_dtype(phi_q, phi_k, v)
    with torch.autocast(phi_q.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(dtype).contiguous(), phi_k.to(dtype).contiguous(), v.to(dtype)
        n, m = phi_q.shape[-2:]
        if causal:
            phases = rotary_phases(n, m, offset=offset, base=rope_base, device=phi_q.device,
                                   dtype=dtype) if rotary else None
            out, kv, k_sum = causal_attention(phi_q, phi_k, v, phases, chunk_size)
            out = out.to(out_dtype)
            return (out, LinearState(kv, k_sum, offset + n)) if return_state else out
        q_num, k_num = numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base)
        numerator = q_num @ (k_num.transpose(-1, -2) @ v)
        denominator = (phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)).squeeze(-1)
        return divide(numerator, denominator).to(out_dtype)


def nothing_to_attend(v: torch.Tensor, num_features: int, dtype: torch.dtype, *, position: int,
                       return_state: bool, log_space: bool):
    """No tokens (or an empty batch): an empty output, in v's graph as a computed one is, and (if asked)
    the state before any token at `position`."""
    out = v.clone()
    if not return_state:
        return out
    state = initial_state(v.shape[0], v.shape[1], num_features, v.shape[-1], device=v.device, dtype=dtype,
                          log_space=log_space)
    return out, state._replace(position=position)


def _rotate_by(x: torch.Tensor, phases: torch.Tensor | None, *, inverse: bool = False) -> torch.Tensor:
    """x (B, H, L, M) times e^(i p theta) per pair (its transpose, e^(-i p theta), with inverse)."""
    if phases is None:
        return x
    return rotate_pairs(x, phases.conj() if inverse else phases)


def _chunk_slices(n: int, chunk: int):
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phases, chunk):
        b, h, n, m = q.shape
        out = v.new_empty(v.shape)
        den = q.new_empty(b, h, n)
        state = q.new_zeros(b, h, m, v.shape[-1])
        k_sum = q.new_zeros(b, h, m)
        for s in _chunk_slices(n, chunk):
            ph = None if phases is None else phases[s]
            q_j, k_j, v_j = q[:, :, s], k[:, :, s], v[:, :, s]
            q_r, k_r = _rotate_by(q_j, ph), _rotate_by(k_j, ph)
            scores = (q_r @ k_r.transpose(-1, -2)).tril_()
            num = torch.matmul(q_r, state).add_(scores @ v_j)
            if phases is None:     # unrotated scores serve the denominator too
                den_j = scores.sum(-1).add_((q_j @ k_sum.unsqueeze(-1)).squeeze(-1))
            else:
                den_j = (q_j * k_j.cumsum(-2).add_(k_sum.unsqueeze(-2))).sum(-1)
            den[:, :, s] = den_j
            out[:, :, s] = divide(num, den_j)
            state.add_(k_r.transpose(-1, -2) @ v_j)
            k_sum.add_(k_j.sum(-2))
        ctx.save_for_backward(q, k, v, out, den, phases)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(state, k_sum)
        return out, state, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad, _state_grad, _k_sum_grad):
        q, k, v, out, den, phases = ctx.saved_tensors
        b, h, n, m = q.shape
        g_num, g_den = output_gradients(grad, out, den)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        chunks = _chunk_slices(n, ctx.chunk)

        state = q.new_zeros(b, h, m, v.shape[-1])          # forward loop: dq
        k_sum = q.new_zeros(b, h, 1, m)
        for s in chunks:
            ph = None if phases is None else phases[s]
            k_j, v_j, g_j = k[:, :, s], v[:, :, s], g_num[:, :, s]
            k_r = _rotate_by(k_j, ph)
            d_scores = (g_j @ v_j.transpose(-1, -2)).tril_()
            dq_r = torch.matmul(g_j, state.transpose(-1, -2)).add_(d_scores @ k_r)
            dq[:, :, s] = _rotate_by(dq_r, ph, inverse=True).add_(g_den[:, :, s, None] * k_j.cumsum(-2).add_(k_sum))
            state.add_(k_r.transpose(-1, -2) @ v_j)
            k_sum.add_(k_j.sum(-2, keepdim=True))

        later = state.zero_()                             # reverse loop: dk, dv
        q_later = k_sum.zero_()
        for s in reversed(chunks):
            ph = None if phases is None else phases[s]
            q_j, k_j, v_j, g_j = q[:, :, s], k[:, :, s], v[:, :, s], g_num[:, :, s]
            q_r, k_r = _rotate_by(q_j, ph), _rotate_by(k_j, ph)
            scores = (q_r @ k_r.transpose(-1, -2)).tril_()
            d_scores = (g_j @ v_j.transpose(-1, -2)).tril_()
            dk_r = torch.matmul(v_j, later.transpose(-1, -2)).add_(d_scores.transpose(-1, -2) @ q_r)
            gq = g_den[:, :, s, None] * q_j                               # denominator: suffix sums
            dk[:, :, s] = _rotate_by(dk_r, ph, inverse=True).add_(gq.flip(-2).cumsum(-2).flip(-2)).add_(q_later)
            dv[:, :, s] = torch.matmul(k_r, later).add_(scores.transpose(-1, -2) @ g_j)
            later.add_(q_r.transpose(-1, -2) @ g_j)
            q_later.add_(gq.sum(-2, keepdim=True))
        return dq, dk, dv, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor | None,
                     chunk: int):
    """Causal Eq. 19 of (B, H, N, M) non-negative features and (B, H, N, Dv) values, the numerator
    rotated by `phases` (N, M/2) e^(i p theta) when given.  Returns the output and the state after
    the last token: sum_n (R_n k_n) v_n^T (B, H, M, Dv) and sum_n k_n (B, H, M)."""
    out, state, k_sum = _CausalAttention.apply(q, k, v, phases, chunk)
    return first_derivatives_only(out), state, k_sum
