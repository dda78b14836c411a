"""The torch backend: causal Eq. 19 chunk by chunk with custom autograd, O(N) time and memory.

One loop over chunks of L tokens carries the M x Dv state S = sum_n (R_n k_n) v_n^T and the
M-vector z = sum_n k_n of the tokens before the chunk; inside a chunk the products are exact:

    out_m = [(R_m q_m)^T S + sum_{n<=m in chunk} (R_m q_m . R_n k_n) v_n] / [q_m . (z + sum_{n<=m} k_n)]

Every temporary is per chunk, so nothing N x M is allocated besides the inputs, and the backward
pass recomputes the rotation, the scores and the states (a forward loop for dq, a reverse loop
for dk and dv, as flash-linear-attention's fused_chunk kernels do): it saves q, k, v, the output
and the denominator only.  Per chunk the work is a handful of (L x M) @ (M x Dv) products.
"""
from __future__ import annotations

import torch

from ...checks import is_integer
from ...rotary import rotate_pairs
from .common import divide, output_gradients, without_autocast

DEFAULT_CHUNK_SIZE = 64


def check_chunk_size(chunk_size) -> None:
    if not is_integer(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer number of tokens, got {chunk_size!r}")


def _rotate(x: torch.Tensor, phases: torch.Tensor | None, *, inverse: bool = False) -> torch.Tensor:
    """x (B, H, L, M) times e^(i p theta) per pair (its transpose, e^(-i p theta), with inverse)."""
    if phases is None:
        return x
    return rotate_pairs(x, phases.conj() if inverse else phases)


def _chunks(n: int, chunk: int):
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phases, chunk):
        b, h, n, m = q.shape
        out = v.new_empty(v.shape)
        den = q.new_empty(b, h, n)
        state = q.new_zeros(b, h, m, v.shape[-1])
        k_sum = q.new_zeros(b, h, m)
        for s in _chunks(n, chunk):
            ph = None if phases is None else phases[s]
            q_j, k_j, v_j = q[:, :, s], k[:, :, s], v[:, :, s]
            q_r, k_r = _rotate(q_j, ph), _rotate(k_j, ph)
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
        chunks = _chunks(n, ctx.chunk)

        state = q.new_zeros(b, h, m, v.shape[-1])          # forward loop: dq
        k_sum = q.new_zeros(b, h, 1, m)
        for s in chunks:
            ph = None if phases is None else phases[s]
            k_j, v_j, g_j = k[:, :, s], v[:, :, s], g_num[:, :, s]
            k_r = _rotate(k_j, ph)
            d_scores = (g_j @ v_j.transpose(-1, -2)).tril_()
            dq_r = torch.matmul(g_j, state.transpose(-1, -2)).add_(d_scores @ k_r)
            dq[:, :, s] = _rotate(dq_r, ph, inverse=True).add_(g_den[:, :, s, None] * k_j.cumsum(-2).add_(k_sum))
            state.add_(k_r.transpose(-1, -2) @ v_j)
            k_sum.add_(k_j.sum(-2, keepdim=True))

        later = state.zero_()                             # reverse loop: dk, dv
        q_later = k_sum.zero_()
        for s in reversed(chunks):
            ph = None if phases is None else phases[s]
            q_j, k_j, v_j, g_j = q[:, :, s], k[:, :, s], v[:, :, s], g_num[:, :, s]
            q_r, k_r = _rotate(q_j, ph), _rotate(k_j, ph)
            scores = (q_r @ k_r.transpose(-1, -2)).tril_()
            d_scores = (g_j @ v_j.transpose(-1, -2)).tril_()
            dk_r = torch.matmul(v_j, later.transpose(-1, -2)).add_(d_scores.transpose(-1, -2) @ q_r)
            gq = g_den[:, :, s, None] * q_j                               # denominator: suffix sums
            dk[:, :, s] = _rotate(dk_r, ph, inverse=True).add_(gq.flip(-2).cumsum(-2).flip(-2)).add_(q_later)
            dv[:, :, s] = torch.matmul(k_r, later).add_(scores.transpose(-1, -2) @ g_j)
            later.add_(q_r.transpose(-1, -2) @ g_j)
            q_later.add_(gq.sum(-2, keepdim=True))
        return dq, dk, dv, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor | None,
                     chunk: int):
    """Causal Eq. 19 of (B, H, N, M) non-negative features and (B, H, N, Dv) values, the numerator
    rotated by `phases` (N, M/2) e^(i p theta) when given.  Returns the output and the state after
    the last token: sum_n (R_n k_n) v_n^T (B, H, M, Dv) and sum_n k_n (B, H, M)."""
    return _CausalAttention.apply(q, k, v, phases, chunk)
