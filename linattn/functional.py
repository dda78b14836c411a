"""Linear attention with RoPE after the feature map (RoFormer Eq. 19), three ways:

* `linear_attention`            - the fast path: O(N) time and memory, chunked when causal;
* `linear_attention_reference`  - a plain O(N^2) version of the same maths, for tests;
* `linear_attention_step`       - one token of recurrent decoding with an O(1) state.

With `rotary=True` the numerator uses R_m phi(q_m) and R_n phi(k_n) while the denominator keeps the
unrotated features, so it stays a sum of non-negative terms:

    out_m = sum_n (R_m phi_q_m)^T (R_n phi_k_n) v_n  /  sum_n phi_q_m^T phi_k_n

All sums are accumulated in float32 (float64 stays float64) with autocast turned off, and the
denominator is clamped away from zero only where it underflows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .rotary import DEFAULT_BASE, apply_rotary

DEFAULT_CHUNK_SIZE = 64


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention after `position` tokens."""
    kv: torch.Tensor       # (B, H, M, Dv): sum_n (R_n phi_k_n) v_n^T  (rotated iff rotary)
    k_sum: torch.Tensor    # (B, H, M): sum_n phi_k_n, never rotated
    position: int


def _check_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, rank: int) -> None:
    names = "(B, H, N, M) features and (B, H, N, Dv) values" if rank == 4 else \
        "(B, H, M) features and (B, H, Dv) values for one token"
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}; "
                             f"linear attention takes {names}")
    if phi_q.shape != phi_k.shape:
        raise ValueError(f"phi_q and phi_k must have the same shape, got {tuple(phi_q.shape)} and "
                         f"{tuple(phi_k.shape)}; map queries and keys with the same feature map")
    if phi_q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"features {tuple(phi_q.shape)} and values {tuple(v.shape)} disagree before "
                         f"the last dimension; expected {names}")


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # Features are non-negative, so the denominator is >= 0.  Clamp it only where (nearly) every
    # key feature underflowed; sqrt(tiny) keeps 1/den^2 finite in the backward pass.
    guard = torch.finfo(denominator.dtype).tiny ** 0.5
    return numerator / denominator.clamp_min(guard).unsqueeze(-1)


def _numerator_features(phi_q, phi_k, *, rotary: bool, offset: int, base: float):
    if not rotary:
        return phi_q, phi_k
    return apply_rotary(phi_q, offset=offset, base=base), apply_rotary(phi_k, offset=offset, base=base)


def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, N, X) -> (B, H, C, chunk, X), zero-padded: zero features contribute nothing."""
    pad = -t.shape[-2] % chunk
    return (F.pad(t, (0, 0, 0, pad)) if pad else t).unflatten(-2, (-1, chunk))


def _exclusive_scan(x: torch.Tensor, *, reverse: bool = False) -> torch.Tensor:
    """Sum of the chunks before (or after) each chunk along dim 2.  A loop of in-place adds over
    C chunks: torch.cumsum along a non-last dimension is several times slower on CPU."""
    out = torch.empty_like(x)
    running = torch.zeros_like(x[:, :, 0])
    chunks = range(x.shape[2] - 1, -1, -1) if reverse else range(x.shape[2])
    for j in chunks:
        out[:, :, j] = running
        running += x[:, :, j]
    return out


def _causal_product_forward(q, k, v, chunk: int):
    """Output plus what backward reuses: the masked chunk scores (N x chunk) and the state before
    each chunk (N/chunk x M x Dv), both linear in N; no per-token M x Dv products."""
    n = q.shape[-2]
    q, k, v = (_chunked(t, chunk) for t in (q, k, v))
    earlier = _exclusive_scan(k.transpose(-1, -2) @ v)               # (B, H, C, M, Dv)
    scores = (q @ k.transpose(-1, -2)).tril_()                        # (B, H, C, chunk, chunk)
    out = torch.baddbmm((q @ earlier).flatten(0, 2), scores.flatten(0, 2), v.flatten(0, 2))
    return out.view(q.shape[:-1] + v.shape[-1:]).flatten(2, 3)[:, :, :n], scores, earlier


def _causal_product_backward(q, k, v, scores, earlier, grad, chunk: int):
    n = q.shape[-2]
    q, k, v, grad = (_chunked(t, chunk) for t in (q, k, v, grad))
    later = _exclusive_scan(q.transpose(-1, -2) @ grad, reverse=True)  # sum_{m after} q_m g_m^T
    d_scores = (grad @ v.transpose(-1, -2)).tril_()
    flat = lambda t: t.flatten(0, 2)
    dq = torch.baddbmm(flat(grad @ earlier.transpose(-1, -2)), flat(d_scores), flat(k))
    dk = torch.baddbmm(flat(v @ later.transpose(-1, -2)), flat(d_scores.transpose(-1, -2)), flat(q))
    dv = torch.baddbmm(flat(k @ later), flat(scores.transpose(-1, -2)), flat(grad))
    return [d.view(t.shape).flatten(2, 3)[:, :, :n] for d, t in ((dq, q), (dk, k), (dv, v))]


class _CausalProduct(torch.autograd.Function):
    """sum_{n<=m} (q_m . k_n) v_n, block-parallel: exact products inside chunks of `chunk` tokens
    plus the running M x Dv state of earlier chunks.  Memory stays O(N (M + Dv + chunk))."""

    @staticmethod
    def forward(ctx, q, k, v, chunk):
        out, scores, earlier = _causal_product_forward(q, k, v, chunk)
        ctx.save_for_backward(q, k, v, scores, earlier)
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, scores, earlier = ctx.saved_tensors
        return (*_causal_product_backward(q, k, v, scores, earlier, grad.contiguous(), ctx.chunk), None)


def _scan_tokens(x: torch.Tensor, chunk: int, *, reverse: bool = False) -> torch.Tensor:
    """Inclusive cumulative sum over tokens (dim -2), or suffix sums with reverse=True: a loop over
    the positions inside a chunk, then each chunk's offset from `_exclusive_scan`.  Several times faster on
    CPU than torch.cumsum along a non-last dimension."""
    n = x.shape[-2]
    y = _chunked(x, chunk).clone()                                   # (B, H, C, chunk, M)
    for j in (range(chunk - 2, -1, -1) if reverse else range(1, chunk)):
        y[:, :, :, j] += y[:, :, :, j + 1 if reverse else j - 1]
    totals = y[:, :, :, 0] if reverse else y[:, :, :, -1]             # each chunk's own sum
    y += _exclusive_scan(totals, reverse=reverse).unsqueeze(-2)         # plus the chunks before/after
    return y.flatten(2, 3)[:, :, :n]


class _CausalDenominator(torch.autograd.Function):
    """sum_{n<=m} q_m . k_n = q_m . cumsum(k)_m, in O(N M) work: no chunk scores needed."""

    @staticmethod
    def forward(ctx, q, k, chunk):
        k_prefix = _scan_tokens(k, chunk)
        ctx.save_for_backward(q, k_prefix)
        ctx.chunk = chunk
        return torch.einsum("bhnm,bhnm->bhn", q, k_prefix)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k_prefix = ctx.saved_tensors
        grad = grad.unsqueeze(-1)
        return grad * k_prefix, _scan_tokens(grad * q, ctx.chunk, reverse=True), None


def causal_denominator(q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal sum_{n<=m} q_m . k_n of (B, H, N, M) features, shape (B, H, N)."""
    return _CausalDenominator.apply(q, k, chunk)


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal sum_{n<=m} (q_m . k_n) v_n of (B, H, N, M) features and (B, H, N, Dv) values."""
    return _CausalProduct.apply(q, k, v, chunk)


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     rotary: bool, offset: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     rope_base: float = DEFAULT_BASE, return_state: bool = False):
    """Linear attention of (B, H, N, M) non-negative features and (B, H, N, Dv) values.

    `rotary=True` is Eq. 19 at positions offset..offset+N-1; `causal=True` sums over n <= m only.
    With `return_state=True` (causal only) also returns the `LinearState` after the last token,
    so decoding can continue with `linear_attention_step`.
    """
    _check_features(phi_q, phi_k, v, rank=4)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if return_state and not causal:
        raise ValueError("return_state=True needs causal=True: a non-causal pass has no decoding state")
    out_dtype, dtype = v.dtype, _compute_dtype(phi_q, phi_k, v)
    with torch.autocast(phi_q.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
        q_num, k_num = _numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base)
        if causal and rotary:
            numerator = causal_product(q_num, k_num, v, chunk_size)
            denominator = causal_denominator(phi_q, phi_k, chunk_size)
        elif causal:  # unrotated features serve both: the denominator is a value column of ones
            both = causal_product(phi_q, phi_k, F.pad(v, (0, 1), value=1.0), chunk_size)
            numerator, denominator = both[..., :-1], both[..., -1]
        else:
            numerator = q_num @ (k_num.transpose(-1, -2) @ v)
            denominator = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
            denominator = denominator.squeeze(-1)
        out = _divide(numerator, denominator).to(out_dtype)
        if not return_state:
            return out
        state = LinearState(k_num.transpose(-1, -2) @ v, phi_k.sum(dim=-2), offset + phi_q.shape[-2])
    return out, state


def linear_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool, rotary: bool, offset: int = 0,
                               rope_base: float = DEFAULT_BASE) -> torch.Tensor:
    """The same maths as `linear_attention` with explicit N x N weight matrices."""
    _check_features(phi_q, phi_k, v, rank=4)
    dtype = _compute_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v_c = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    q_num, k_num = _numerator_features(phi_q, phi_k, rotary=rotary, offset=offset, base=rope_base)
    numerator_weights = q_num @ k_num.transpose(-1, -2)
    denominator_weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        numerator_weights = numerator_weights.tril()
        denominator_weights = denominator_weights.tril()
    return _divide(numerator_weights @ v_c, denominator_weights.sum(-1)).to(v.dtype)


def initial_state(batch: int, heads: int, num_features: int, value_dim: int, *,
                  device=None, dtype=torch.float32) -> LinearState:
    zeros = torch.zeros(batch, heads, num_features, value_dim, device=device, dtype=dtype)
    return LinearState(zeros, zeros.new_zeros(batch, heads, num_features), 0)


def linear_attention_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                          state: LinearState | None, *, rotary: bool,
                          rope_base: float = DEFAULT_BASE):
    """One token of causal linear attention: (B, H, M) features and (B, H, Dv) values at position
    `state.position`.  O(M * Dv) time and memory, whatever the context length."""
    _check_features(phi_q, phi_k, v, rank=3)
    dtype = _compute_dtype(phi_q, phi_k, v)
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
        out = _divide(numerator, (phi_q * k_sum).sum(-1))
    return out.to(v.dtype), LinearState(kv, k_sum, state.position + 1)


def softmax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                causal: bool) -> torch.Tensor:
    """Naive softmax attention exp(q.k / sqrt(D)), for tests and as a readable definition."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n, s = scores.shape[-2:]
        future = torch.ones(n, s, dtype=torch.bool, device=q.device).triu(s - n + 1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v
