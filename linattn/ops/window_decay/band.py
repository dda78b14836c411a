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
GROUP_SCORES = 1 << 22    # scores computed at once, at most (about): 16 MB in float32


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
          other_lse: torch.Tensor | None) -> torch.Tensor:
    """The attention over the keys of both: (e^lse out + e^other_lse other) / (e^lse + e^other_lse), with
    one stabiliser per row, the larger log-normaliser (so both weights are <= 1, the larger 1); other None:
    out."""
    if other is None:
        return out
    top = torch.maximum(lse, other_lse).detach()   # any constant per row cancels
    mine, theirs = torch.exp(lse - top), torch.exp(other_lse - top)
    return (mine.unsqueeze(-1) * out + theirs.unsqueeze(-1) * other) / (mine + theirs).unsqueeze(-1)


class BandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window: int, log_decay):
        layout = Band(q, window, log_decay)
        queries, keys, values = layout.pad_rows(q), layout.pad(k), layout.pad(v)
        out, lse = v.new_empty(*layout.rows_shape, v.shape[-1]), v.new_empty(layout.rows_shape)
        for blocks in layout.groups():
            scores = layout.scores(queries, keys, blocks)
            top = scores.amax(-1, keepdim=True)   # the diagonal is always inside: finite
            weights = torch.exp(scores - top)
            den = weights.sum(-1)
            rows = layout.rows(blocks)
            out[..., rows, :] = (weights @ layout.band(values, blocks) / den.unsqueeze(-1)).flatten(2, 3)
            lse[..., rows] = (top.squeeze(-1) + den.log()).flatten(2, 3)
        n = q.shape[-2]
        out, lse = out[..., :n, :], lse[..., :n]
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
        keys, values = layout.pad(k), layout.pad(v)
        rows_out = layout.pad_rows(grad_out)
        # d lse / d s = p;  d out / d s = p (dO . v - dO . out): together p (dO . v - dO . out + d lse)
        shift = layout.pad_rows(grad_lse.unsqueeze(-1) - (grad_out * out).sum(-1, keepdim=True))
        queries = layout.pad_rows(q)
        grad_q = torch.zeros_like(queries)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        lse_rows = F.pad(lse, (0, layout.tail))
        for blocks in layout.groups():
            rows = layout.rows(blocks)
            weights = torch.exp(layout.scores(queries, keys, blocks) - layout.blocked(lse_rows[..., rows, None]))
            band_values = layout.band(values, blocks)
            d_out = layout.blocked(rows_out[..., rows, :])
            d_scores = weights * (d_out @ band_values.transpose(-1, -2) + layout.blocked(shift[..., rows, :]))
            d_scores = d_scores * layout.scale
            grad_q[..., rows, :] = (d_scores @ layout.band(keys, blocks)).flatten(2, 3)
            layout.add_band(grad_keys, d_scores.transpose(-1, -2) @ layout.blocked(queries[..., rows, :]), blocks)
            layout.add_band(grad_values, weights.transpose(-1, -2) @ d_out, blocks)
        n = q.shape[-2]
        return grad_q[..., :n, :], layout.unpad(grad_keys), layout.unpad(grad_values), None, None


class Band:
    """Where the blocks and their bands lie: N rows in K blocks of L (the last padded by `tail`), keys
    padded by W - 1 zero rows in front, so that block b's band is padded keys b L .. b L + L + W - 2."""

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
        return F.pad(x, (0, 0, self.window - 1, self.tail))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.window - 1:self.window - 1 + self.n, :]

    def pad_rows(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, self.tail))

    def blocked(self, x: torch.Tensor) -> torch.Tensor:
        """(..., G L, .) -> (..., G, L, .)."""
        return x.unflatten(-2, (-1, self.block))

    def band(self, padded: torch.Tensor, blocks: range) -> torch.Tensor:
        """(..., G, L + W - 1, .): the padded keys (or values) of each block's band."""
        start, stop = blocks.start * self.block, blocks.stop * self.block + self.window - 1
        return padded[..., start:stop, :].unfold(-2, self.block + self.window - 1, self.block).transpose(-1, -2)

    def scores(self, queries: torch.Tensor, keys: torch.Tensor, blocks: range) -> torch.Tensor:
        """(B, H, G, L, L + W - 1) scores of the group's blocks from row-padded queries and padded keys,
        -inf outside the window."""
        queries = self.blocked(queries[..., self.rows(blocks), :])
        scores = queries @ self.band(keys, blocks).transpose(-1, -2) * self.scale + self.bias
        if blocks.start == 0:   # block 0's band starts W - 1 rows before the sequence: no such keys
            scores[..., 0, :, :self.window - 1] = float("-inf")
        return scores

    def add_band(self, padded: torch.Tensor, grads: torch.Tensor, blocks: range) -> None:
        """Add (..., G, L + W - 1, .) gradients of the group's bands into the padded keys' gradients: each
        band's first W - 1 rows overlap the previous block's last ones, its last L rows are its own block."""
        first, overlap = blocks.start * self.block, self.window - 1
        own = padded[..., first + overlap:blocks.stop * self.block + overlap, :]
        own.add_(grads[..., overlap:, :].flatten(-3, -2))
        if overlap:
            before = padded[..., first:blocks.stop * self.block, :].unflatten(-2, (-1, self.block))
            before[..., :overlap, :].add_(grads[..., :overlap, :])
