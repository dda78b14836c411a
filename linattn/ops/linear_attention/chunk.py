"""The torch backend: causal products in chunks of `chunk` tokens with custom autograd, O(N) memory."""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer number of tokens, got {chunk_size!r}")


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
