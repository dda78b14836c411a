"""Linear attention of plain features in torch ops, O(N) time and memory on any device, in
dispatch.py's call shape: the `torch` backend's entry for plain features (features phi >= 0).

Causal, one loop over chunks of L tokens carries the M x Dv state S = sum_n gamma^(i-n) (R_n k_n) v_n^T
and the M-vector z = sum_n gamma^(i-n) k_n of the tokens before the chunk (i: the chunk's last token
before it; gamma = 1 without a decay); inside a chunk the products are exact, with local rows r and
columns c:

    out_r = [gamma^(r+1) (R q_r)^T S + sum_{c<=r} gamma^(r-c) (R q_r . R k_c) v_c]
            / [gamma^(r+1) q_r . z + sum_{c<=r} gamma^(r-c) q_r . k_c]

and the chunk hands on S <- gamma^L S + sum_c gamma^(L-1-c) (R k_c) v_c^T.  Every decay factor is a power
below L + 1 (`ChunkDecay`), so the decay is exact at any position.  Queries are rotated at their
positions, keys at theirs (a key offset puts them apart; causality goes by index, and so does the decay).

Every temporary is per chunk, so nothing N x M is allocated besides the inputs, and the backward
pass recomputes the rotation, the scores and the states (a forward loop for dq, a reverse loop
for dk and dv, as flash-linear-attention's fused_chunk kernels do): it saves q, k, v, the output
and the denominator only.  Per chunk the work is a handful of (L x M) @ (M x Dv) products.
Non-causal: torch's matrix products, q (k^T v) over (k^T 1).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .common import (compute_dtype, divide, first_derivatives_only, numerator_features, output_gradients,
                     plain_log_normalizer, query_key_phases, without_autocast)
from .recurrent import LinearState, initial_state
from ...rotary import rotate_pairs


def plain_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool, rotary: bool,
                    offset: int, rope_base: float, chunk_size: int, return_state: bool,
                    key_offset: int | None = None, return_log_normalizer: bool = False,
                    log_decay: torch.Tensor | None = None):
    """Eq. 19 of plain (B, H, N, M) features: causal chunk by chunk (`causal_attention`), else in one
    product.  Queries rotated at offset.., keys at key_offset.. (None: offset); log_decay (H,) log gamma
    <= 0 (causal only; None: no decay).  In float32 (float64 stays float64) with autocast off; the
    output in v's dtype, then the state (return_state: its position the keys' next one) and the rows'
    log-denominators (return_log_normalizer: (B, H, N) in the compute dtype, -inf where it is 0)."""
    key_offset = offset if key_offset is None else key_offset
    out_dtype, dtype = v.dtype, compute_dtype(phi_q, phi_k, v)
    n, m = phi_q.shape[-2:]
    if n == 0:   # no tokens: an empty output (the chunk loops want one)
        out, state = nothing_to_attend(v, m, dtype, position=key_offset, return_state=True, log_space=False)
        den = v.new_zeros(v.shape[:-1], dtype=dtype)
    else:
        with torch.autocast(phi_q.device.type, enabled=False):
            phi_q, phi_k, v = phi_q.to(dtype).contiguous(), phi_k.to(dtype).contiguous(), v.to(dtype)
            if causal:
                phases = query_key_phases(n, m, offset=offset, key_offset=key_offset, base=rope_base,
                                          device=phi_q.device, dtype=dtype) if rotary else None
                rate = None if log_decay is None else log_decay.to(dtype)
                out, den, kv, k_sum = causal_attention(phi_q, phi_k, v, phases, chunk_size, rate)
                state = LinearState(kv, k_sum, key_offset + n)
            else:
                q_num, k_num = numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base,
                                                  key_offset=key_offset)
                den = (phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)).squeeze(-1)
                out, state = divide(q_num @ (k_num.transpose(-1, -2) @ v), den), None
    result = (out.to(out_dtype), *((state,) if return_state else ()),
              *((plain_log_normalizer(den),) if return_log_normalizer else ()))
    return result if len(result) > 1 else result[0]


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


class ChunkDecay(NamedTuple):
    """The decay's factors for a chunk of L tokens, per head, every one a power of gamma below L + 1."""
    inside: torch.Tensor   # (H, L, L): gamma^(r-c) for r >= c, else 0
    query: torch.Tensor    # (H, L, 1): gamma^(r+1), reading the state before the chunk
    key: torch.Tensor      # (H, L, 1): gamma^(L-1-c), adding key c to the state after it
    carry: torch.Tensor    # (H, 1, 1): gamma^L, carrying the state across the chunk

    @classmethod
    def of(cls, rate: torch.Tensor, length: int) -> ChunkDecay:
        steps = torch.arange(length, device=rate.device, dtype=rate.dtype)
        distance = steps[:, None] - steps[None, :]
        rate = rate[:, None, None]
        inside = torch.exp(distance.clamp_min(0) * rate).masked_fill_(distance < 0, 0)
        return cls(inside, torch.exp((steps[:, None] + 1) * rate), torch.exp((length - 1 - steps[:, None]) * rate),
                   torch.exp(length * rate))


def _chunk_decays(rate: torch.Tensor | None, slices) -> list:
    """One `ChunkDecay` per chunk (None without a decay), the factors made once per chunk length."""
    if rate is None:
        return [None] * len(slices)
    made = {length: ChunkDecay.of(rate, length) for length in {s.stop - s.start for s in slices}}
    return [made[s.stop - s.start] for s in slices]


def _mask(scores: torch.Tensor, decay: ChunkDecay | None) -> torch.Tensor:
    """A chunk's (B, H, L, L) products made causal, in place: lower triangle, times gamma^(r-c)."""
    return scores.tril_() if decay is None else scores.mul_(decay.inside)


def _decayed(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """x times a decay factor, in place (x itself without a decay)."""
    return x if factor is None else x.mul_(factor)


def _key_sums(k: torch.Tensor, carried: torch.Tensor, decay: ChunkDecay | None) -> torch.Tensor:
    """sum_{c<=r} gamma^(r-c) k_c + gamma^(r+1) z per row r of a chunk (B, H, L, M), z (B, H, 1, M) the
    sum carried into the chunk: what each query's denominator reads."""
    if decay is None:
        return k.cumsum(-2).add_(carried)
    return torch.matmul(decay.inside, k).add_(decay.query * carried)


def _query_sums(gq: torch.Tensor, carried: torch.Tensor, decay: ChunkDecay | None) -> torch.Tensor:
    """The transpose of `_key_sums`: sum_{r>=c} gamma^(r-c) gq_r + gamma^(L-1-c) Z per column c, Z the
    (B, H, 1, M) sum carried back from the later chunks."""
    if decay is None:
        return gq.flip(-2).cumsum(-2).flip(-2).add_(carried)
    return torch.matmul(decay.inside.transpose(-1, -2), gq).add_(decay.key * carried)


def _carry(total: torch.Tensor, update: torch.Tensor, decay: ChunkDecay | None) -> None:
    """total <- gamma^L total + update, in place."""
    _decayed(total, None if decay is None else decay.carry).add_(update)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phases, chunk, rate):
        b, h, n, m = q.shape
        out = v.new_empty(v.shape)
        den = q.new_empty(b, h, n)
        state = q.new_zeros(b, h, m, v.shape[-1])
        k_sum = q.new_zeros(b, h, 1, m)
        slices = _chunk_slices(n, chunk)
        for s, decay in zip(slices, _chunk_decays(rate, slices)):
            q_j, k_j, v_j = q[:, :, s], k[:, :, s], v[:, :, s]
            q_r, k_r = _rotations(q_j, k_j, phases, s)
            scores = _mask(q_r @ k_r.transpose(-1, -2), decay)
            num = _decayed(torch.matmul(q_r, state), None if decay is None else decay.query).add_(scores @ v_j)
            if phases is None:     # unrotated scores serve the denominator too
                from_state = _decayed(q_j @ k_sum.transpose(-1, -2), None if decay is None else decay.query)
                den_j = scores.sum(-1).add_(from_state.squeeze(-1))
            else:
                den_j = (q_j * _key_sums(k_j, k_sum, decay)).sum(-1)
            den[:, :, s] = den_j
            out[:, :, s] = divide(num, den_j)
            key_weights = k_j if decay is None else k_j * decay.key
            key_rotated = k_r if decay is None else k_r * decay.key
            _carry(state, key_rotated.transpose(-1, -2) @ v_j, decay)
            _carry(k_sum, key_weights.sum(-2, keepdim=True), decay)
        ctx.save_for_backward(q, k, v, out, den, phases, rate)
        ctx.chunk = chunk
        k_sum = k_sum.squeeze(-2)   # marked as returned: a view of a marked tensor would take a gradient
        ctx.mark_non_differentiable(state, k_sum)
        return out, den, state, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad, grad_den, _state_grad, _k_sum_grad):
        q, k, v, out, den, phases, rate = ctx.saved_tensors
        b, h, n, m = q.shape
        g_num, g_den = output_gradients(grad, out, den)
        g_den = g_den + grad_den
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        slices = _chunk_slices(n, ctx.chunk)
        decays = _chunk_decays(rate, slices)

        state = q.new_zeros(b, h, m, v.shape[-1])          # forward loop: dq
        k_sum = q.new_zeros(b, h, 1, m)
        for s, decay in zip(slices, decays):
            k_j, v_j, g_j = k[:, :, s], v[:, :, s], g_num[:, :, s]
            k_r = _rotate_by(k_j, None if phases is None else phases[1, s])
            d_scores = _mask(g_j @ v_j.transpose(-1, -2), decay)
            dq_r = _decayed(torch.matmul(g_j, state.transpose(-1, -2)), None if decay is None else decay.query)
            dq_r.add_(d_scores @ k_r)
            dq_j = _rotate_by(dq_r, None if phases is None else phases[0, s], inverse=True)
            dq[:, :, s] = dq_j.add_(g_den[:, :, s, None] * _key_sums(k_j, k_sum, decay))
            key_weights = k_j if decay is None else k_j * decay.key
            key_rotated = k_r if decay is None else k_r * decay.key
            _carry(state, key_rotated.transpose(-1, -2) @ v_j, decay)
            _carry(k_sum, key_weights.sum(-2, keepdim=True), decay)

        later = state.zero_()                             # reverse loop: dk, dv
        q_later = k_sum.zero_()
        for s, decay in zip(reversed(slices), reversed(decays)):
            q_j, k_j, v_j, g_j = q[:, :, s], k[:, :, s], v[:, :, s], g_num[:, :, s]
            q_r, k_r = _rotations(q_j, k_j, phases, s)
            scores = _mask(q_r @ k_r.transpose(-1, -2), decay)
            d_scores = _mask(g_j @ v_j.transpose(-1, -2), decay)
            key_factor = None if decay is None else decay.key
            dk_r = _decayed(torch.matmul(v_j, later.transpose(-1, -2)), key_factor).add_(d_scores.transpose(-1, -2) @ q_r)
            gq = g_den[:, :, s, None] * q_j                               # denominator: suffix sums
            dk_j = _rotate_by(dk_r, None if phases is None else phases[1, s], inverse=True)
            dk[:, :, s] = dk_j.add_(_query_sums(gq, q_later, decay))
            dv[:, :, s] = _decayed(torch.matmul(k_r, later), key_factor).add_(scores.transpose(-1, -2) @ g_j)
            query_rotated = q_r if decay is None else q_r * decay.query
            query_weights = gq if decay is None else gq * decay.query
            _carry(later, query_rotated.transpose(-1, -2) @ g_j, decay)
            _carry(q_later, query_weights.sum(-2, keepdim=True), decay)
        return dq, dk, dv, None, None, None


def _rotations(q: torch.Tensor, k: torch.Tensor, phases: torch.Tensor | None, s: slice):
    """A chunk's queries and keys rotated at their positions (`query_key_phases`' rows s)."""
    if phases is None:
        return q, k
    return _rotate_by(q, phases[0, s]), _rotate_by(k, phases[1, s])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor | None,
                     chunk: int, rate: torch.Tensor | None = None):
    """Causal Eq. 19 of (B, H, N, M) non-negative features and (B, H, N, Dv) values, the numerator
    rotated by `phases` (2, N, M/2) (`query_key_phases`: the queries' and the keys' e^(i p theta)) when
    given, each key's weight gamma^(m-n) with log gamma = `rate` (H,) when given.  Returns the output,
    the row denominators (B, H, N) and the state after the last token: sum_n gamma^(N-1-n) (R_n k_n) v_n^T
    (B, H, M, Dv) and sum_n gamma^(N-1-n) k_n (B, H, M)."""
    out, den, state, k_sum = _CausalAttention.apply(q, k, v, phases, chunk, rate)
    return first_derivatives_only(out), first_derivatives_only(den), state, k_sum
