"""A sliding window of exact softmax in O(N W) time and memory: query m against the keys n with
0 <= m - n < W, scores s_mn = q_m . k_n / sqrt(D) + (m - n) log gamma (the decay, optional).

Queries go in blocks of L >= W rows against their band of L + W - 1 keys, a group of blocks at a time
(so no (N, N) tensor or mask, and the band's scores stay a few MB whatever N is).  Like flash attention
the pass returns each row's log-normaliser lse_m = log sum_n e^(s_mn) beside the output, keeps only its
inputs, the output and lse for backward, and recomputes the band's weights there.  `merge` combines the
window with any other attention of known log-normaliser (the linear part of docs/gap-closers.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_BLOCK = 32            # the queries' blocks have at least this many rows (fewer, larger products)
GROUP_SCORES = 1 << 20    # scores computed at once, at most (about): 4 MB in float32


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   log_decay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, N, D) queries and keys, (B, H, N, Dv) values, window W >= 1, log_decay (H,) log gamma or None
    -> (the window's softmax-weighted values (B, H, N, Dv), the rows' log-normalisers (B, H, N)), in the
    inputs' dtype.  Gradients flow to q, k and v (log_decay is a constant)."""
    window = min(window, q.shape[-2])
    if q.shape[-2] == 0:
        return v.clone(), v.new_zeros(v.shape[:-1])
    return BandAttention.apply(q, k, v, window, log_decay)


def merge(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor | None,
          other_lse: torch.Tensor | None, start: int = 0) -> torch.Tensor:
    """The attention over the keys of both: (e^lse out + e^other_lse other) / (e^lse + e^other_lse), with
    one stabiliser per row, the larger log-normaliser (so both weights are <= 1, the larger 1); other and
    other_lse cover the rows start.. of out and lse (the rows before: out); other None: out.  Backward keeps
    only the four inputs (out and other are what their own passes keep) and recomputes the weights."""
    if other is None:
        return out
    return Merge.apply(out, lse, other, other_lse, start)


def merge_weights(lse: torch.Tensor, other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's two weights e^lse / (e^lse + e^other_lse) and e^other_lse / (...), (..., 1)."""
    top = torch.maximum(lse, other_lse)   # any constant per row cancels
    mine, theirs = torch.exp(lse - top), torch.exp(other_lse - top)
    den = mine + theirs
    return (mine / den).unsqueeze(-1), (theirs / den).unsqueeze(-1)


class Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, other, other_lse, start: int):
        ctx.save_for_backward(out, lse, other, other_lse)
        ctx.start = start
        mine, theirs = merge_weights(lse[..., start:], other_lse)
        merged = out.clone()
        merged[..., start:, :].mul_(mine).add_(theirs * other)
        return merged

    @staticmethod
    def backward(ctx, grad):
        out, lse, other, other_lse = ctx.saved_tensors
        start = ctx.start
        mine, theirs = merge_weights(lse[..., start:], other_lse)
        own = out[..., start:, :]
        tail = grad[..., start:, :]
        grad_out = grad.clone()
        grad_out[..., start:, :].mul_(mine)
        # d merged / d lse = mine (out - merged), d merged / d other_lse = theirs (other - merged), and
        # merged = mine out + theirs other: both are mine theirs (out - other) . grad, opposite in sign
        grad_lse = mine.squeeze(-1) * theirs.squeeze(-1) * (torch.linalg.vecdot(tail, own)
                                                            - torch.linalg.vecdot(tail, other))
        grad_lse = F.pad(grad_lse, (start, 0))
        return grad_out, grad_lse, tail * theirs, -grad_lse[..., start:], None


class BandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window: int, log_decay):
        layout = Band(q, window, log_decay)
        queries, keys, values = layout.pad(q), layout.pad(k), layout.pad(v)
        out, lse = v.new_empty(*layout.rows_shape, v.shape[-1]), v.new_empty(layout.rows_shape)
        for blocks in layout.groups():
            scores = layout.scores(queries, keys, blocks)
            top = scores.amax(-1, keepdim=True)   # the diagonal is always inside: finite
            weights = torch.exp(scores - top)
            den = weights.sum(-1)
            rows = layout.rows(blocks)
            out[..., rows, :] = (weights @ layout.band(values, blocks) / den.unsqueeze(-1)).flatten(2, 3)
            lse[..., rows] = (top.squeeze(-1) + den.log()).flatten(2, 3)
        out, lse = layout.unpad(out), layout.unpad(lse.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        layout = ctx.layout
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        queries, keys, values, d_outs, out = (layout.pad(t) for t in (q, k, v, grad_out, out))
        lse, grad_lse = (layout.pad(t.unsqueeze(-1)) for t in (lse, grad_lse))
        grad_q, grad_k, grad_v = (torch.zeros_like(t) for t in (queries, keys, values))
        for blocks in layout.groups():
            rows = layout.rows(blocks)
            weights = torch.exp(layout.scores(queries, keys, blocks) - layout.blocked(lse[..., rows, :]))
            d_out = layout.blocked(d_outs[..., rows, :])
            # d lse / d s = p;  d out / d s = p (dO . v - dO . out): together p (dO . v - dO . out + d lse)
            shift = grad_lse[..., rows, :] - (d_outs[..., rows, :] * out[..., rows, :]).sum(-1, keepdim=True)
            d_scores = weights * (d_out @ layout.band(values, blocks).transpose(-1, -2) + layout.blocked(shift))
            d_scores = d_scores * layout.scale
            grad_q[..., rows, :] = (d_scores @ layout.band(keys, blocks)).flatten(2, 3)
            layout.add_band(grad_k, d_scores.transpose(-1, -2) @ layout.blocked(queries[..., rows, :]), blocks)
            layout.add_band(grad_v, weights.transpose(-1, -2) @ d_out, blocks)
        return layout.unpad(grad_q), layout.unpad(grad_k), layout.unpad(grad_v), None, None


class Band:
    """Where the blocks and their bands lie: N rows in K blocks of L (the last padded by `tail` zero rows);
    block b's band is the last W - 1 rows of block b - 1 (none for block 0: masked) and its own L rows."""

    def __init__(self, q: torch.Tensor, window: int, log_decay):
        n, dim = q.shape[-2:]
        self.window, self.n, self.scale = window, n, dim ** -0.5
        self.block = min(n, max(window, MIN_BLOCK))
        self.blocks = -(-n // self.block)
        self.tail = self.blocks * self.block - n
        self.rows_shape = (*q.shape[:-2], self.blocks * self.block)
        width = self.block + window - 1
        per_block = q.shape[:-2].numel() * self.block * width
        self.group = max(1, min(self.blocks, GROUP_SCORES // max(1, per_block)))
        rows = torch.arange(self.block, device=q.device)
        cols = torch.arange(width, device=q.device)
        distance = rows[:, None] - cols[None, :] + window - 1
        inside = (distance >= 0) & (distance < window)
        bias = torch.zeros(inside.shape, dtype=q.dtype, device=q.device)
        if log_decay is not None:   # (H, 1, L, L + W - 1): gamma^(m - n)
            bias = distance.clamp_min(0).to(q.dtype) * log_decay.to(q.dtype)[:, None, None, None]
        self.bias = bias.masked_fill(~inside, float("-inf"))

    def groups(self):
        for start in range(0, self.blocks, self.group):
            yield range(start, min(start + self.group, self.blocks))

    def rows(self, blocks: range) -> slice:
        return slice(blocks.start * self.block, blocks.stop * self.block)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(..., N, .) -> (..., K L, .): zero rows after the last (no copy when N is a multiple of L)."""
        return F.pad(x, (0, 0, 0, self.tail)) if self.tail else x

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :self.n, :]

    def blocked(self, x: torch.Tensor) -> torch.Tensor:
        """(..., G L, .) -> (..., G, L, .)."""
        return x.unflatten(-2, (-1, self.block))

    def band(self, padded: torch.Tensor, blocks: range) -> torch.Tensor:
        """(..., G, W - 1 + L, .): the keys (or values) of each block's band, zero rows before the first."""
        rows, overlap = self.blocked(padded), self.window - 1
        own = rows[..., blocks.start:blocks.stop, :, :]
        before = rows[..., max(blocks.start - 1, 0):blocks.stop - 1, self.block - overlap:, :]
        if blocks.start == 0:
            before = torch.cat((before.new_zeros(*before.shape[:-3], 1, *before.shape[-2:]), before), -3)
        return torch.cat((before, own), -2)

    def scores(self, queries: torch.Tensor, keys: torch.Tensor, blocks: range) -> torch.Tensor:
        """(B, H, G, L, W - 1 + L) scores of the group's blocks from row-padded queries and keys, -inf
        outside the window."""
        queries = self.blocked(queries[..., self.rows(blocks), :])
        scores = queries @ self.band(keys, blocks).transpose(-1, -2) * self.scale + self.bias
        if blocks.start == 0:   # block 0's band starts W - 1 rows before the sequence: no such keys
            scores[..., 0, :, :self.window - 1] = float("-inf")
        return scores

    def add_band(self, grads: torch.Tensor, band_grads: torch.Tensor, blocks: range) -> None:
        """Add (..., G, W - 1 + L, .) gradients of the group's bands into the row-padded keys' gradients:
        each band's first W - 1 rows are the previous block's last ones, its last L rows its own block."""
        rows, overlap = self.blocked(grads), self.window - 1
        rows[..., blocks.start:blocks.stop, :, :].add_(band_grads[..., overlap:, :])
        if overlap:
            first = 1 if blocks.start == 0 else 0   # block 0's overlap lies before the sequence
            rows[..., blocks.start + first - 1:blocks.stop - 1, self.block - overlap:, :].add_(
                band_grads[..., first:, :overlap, :])
