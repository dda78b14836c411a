"""A sliding window of exact softmax in O(N W) time and memory: query m against the keys n with
0 <= m - n < W, scores s_mn = q_m . k_n / sqrt(D) + (m - n) log gamma (the decay, optional).

Queries go in blocks of L >= W rows; a block's window lies in its own rows and the previous block's.
Like flash attention the pass returns each row's log-normaliser lse_m = log sum_n e^(s_mn) beside the
output, keeps only its inputs, the output and lse for backward, and recomputes the weights there.  RoPE,
where asked, is applied inside both passes (no rotated copy of q and k is kept), and another attention of
known log-normaliser (the linear part of docs/gap-closers.md) is merged into the same pass as one more key
per row, so that backward needs neither the window's own output nor its weights.  Two kernels:

* CPU: torch's flash-attention kernel, every block a batch entry, called on its own rows and on the
  previous block's (views of the rows as they lie: no band of keys is copied, no scores are kept), the two
  merged by their log-normalisers, and each backward call given the merged output and lse;
* elsewhere: torch's products on each block's band of L + W - 1 keys, a group of blocks at a time (so no
  (N, N) tensor or mask, and the band's scores stay a few MB whatever N is).

`merge` combines two attentions by their log-normalisers outside the pass (a decoding step's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...rotary import DEFAULT_BASE, pairs_view, rotary_phases, rotate_pairs

MIN_BLOCK = 32            # the queries' blocks have at least this many rows (fewer, larger products)
GROUP_SCORES = 1 << 20    # scores computed at once, at most (about): 4 MB in float32
FLASH_DEVICES = ("cpu",)  # where torch's flash-attention kernel runs the blocks (elsewhere torch's products)
FLASH_ROWS = 1 << 14      # rows (batch x heads x N) of a flash backward's group of heads (at least one head)


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   log_decay: torch.Tensor | None = None, *, rotary_offset: int | None = None,
                   rope_base: float = DEFAULT_BASE, other: torch.Tensor | None = None,
                   other_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's softmax, merged with another attention where given.

    Args:
        q, k: (B, H, N, D) what the scores take, before RoPE when `rotary_offset` is given.
        v: (B, H, N, Dv) values.
        window: W >= 1 (W >= N: causal softmax).
        log_decay: (H,) log gamma, or None (a constant: no gradient).
        rotary_offset: rotate q and k at positions rotary_offset.. (RoPE, base `rope_base`) inside the
            pass; None: q and k are used as they are.
        other, other_lse: (B, H, R, Dv) and (B, H, R) another attention's output and log-normaliser for
            the last R rows (its keys apart from the window's), merged in as `merge` merges; None: none.

    Returns:
        (out (B, H, N, Dv), lse (B, H, N)): the output and each row's log-normaliser over all its
        weights (the window's and, where merged, the other's), in the inputs' dtype.  Gradients flow to
        q, k, v, other and other_lse.
    """
    window = min(window, q.shape[-2])
    if q.shape[-2] == 0:
        return v.clone(), v.new_zeros(v.shape[:-1])
    return BandAttention.apply(q, k, v, window, log_decay, rotary_offset, rope_base, other, other_lse)


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
    def forward(ctx, q, k, v, window: int, log_decay, rotary_offset, rope_base, other, other_lse):
        layout = Band(q, window, log_decay, rotary_offset, rope_base, value_dim=v.shape[-1])
        out, lse = (flash_forward if layout.flash else blocked_forward)(layout, q, k, v)
        if other is not None:   # in place, rows N - R..: the two weights of `merge`, one stabiliser per row
            start = out.shape[-2] - other.shape[-2]
            merge_into(out[..., start:, :], lse[..., start:], other, other_lse)
        ctx.save_for_backward(q, k, v, out, lse, other, other_lse)
        ctx.layout = layout
        ctx.set_materialize_grads(False)   # an unused lse (the blocks') takes no pass in backward
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, other, other_lse = ctx.saved_tensors
        layout = ctx.layout
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # d lse / d s = p;  d out / d s = p (dO . v - dO . out): together p (dO . v - dO . out + d lse)
        grads = (flash_backward if layout.flash else blocked_backward)(layout, q, k, v, out, lse, grad_out,
                                                                       grad_lse)
        if other is None:
            return (*grads, None, None, None, None, None, None)
        # the merged attention's one extra key per row: weight e^(other_lse - lse), value `other`
        start = layout.n - other.shape[-2]
        tail = grad_out[..., start:, :]
        weight = torch.exp(other_lse - lse[..., start:])
        shift = torch.linalg.vecdot(tail, other) - torch.linalg.vecdot(tail, out[..., start:, :])
        if grad_lse is not None:
            shift = shift + grad_lse[..., start:]
        return (*grads, None, None, None, None, weight.unsqueeze(-1) * tail, weight * shift)


def blocked_forward(layout: "Band", q, k, v):
    """(out, lse) of the window by torch's products, a group of blocks at a time."""
    queries, keys, values = layout.pad(q), layout.pad(k), layout.pad(v)
    out, lse = v.new_empty(*layout.rows_shape, v.shape[-1]), v.new_empty(layout.rows_shape)
    for blocks in layout.groups():
        group_queries, band_keys, band_values = layout.group(queries, keys, values, blocks)
        scores = layout.scores(group_queries, band_keys, blocks)
        top = scores.amax(-1, keepdim=True)   # the diagonal is always inside: finite
        weights = scores.sub_(top).exp_()     # in place: one (G, L, L + W - 1) tensor at a time
        den = weights.sum(-1)
        rows = layout.rows(blocks)
        out[..., rows, :] = (weights @ band_values).div_(den.unsqueeze(-1)).flatten(2, 3)
        lse[..., rows] = (top.squeeze(-1) + den.log()).flatten(2, 3)
    return layout.unpad(out), layout.unpad(lse.unsqueeze(-1)).squeeze(-1)


def blocked_backward(layout: "Band", q, k, v, out, lse, grad_out, grad_lse):
    """(grad q, grad k, grad v) of the (merged) attention `out`, `lse` by torch's products."""
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    queries, keys, values, d_outs, out = (layout.pad(t) for t in (q, k, v, grad_out, out))
    lse, grad_lse = (layout.pad(t.unsqueeze(-1)) for t in (lse, grad_lse))
    grad_q = torch.empty_like(queries)   # every row written once; keys and values take sums
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    for blocks in layout.groups():
        rows = layout.rows(blocks)
        group_queries, band_keys, band_values = layout.group(queries, keys, values, blocks)
        scores = layout.scores(group_queries, band_keys, blocks)
        weights = scores.sub_(layout.blocked(lse[..., rows, :])).exp_()
        d_out = layout.blocked(d_outs[..., rows, :])
        shift = grad_lse[..., rows, :] - (d_outs[..., rows, :] * out[..., rows, :]).sum(-1, keepdim=True)
        d_scores = (d_out @ band_values.transpose(-1, -2)).add_(layout.blocked(shift)).mul_(weights)
        d_scores.mul_(layout.scale)
        grad_q[..., rows, :] = (d_scores @ band_keys).flatten(2, 3)
        layout.add_band(grad_k, d_scores.transpose(-1, -2) @ group_queries, blocks)
        layout.add_band(grad_v, weights.transpose(-1, -2) @ d_out, blocks)
    layout.unrotate(grad_q)
    layout.unrotate(grad_k)
    return layout.unpad(grad_q), layout.unpad(grad_k), layout.unpad(grad_v)


def flash_forward(layout: "Band", q, k, v):
    """(out, lse) of the window by torch's CPU flash-attention kernel, every block of L rows a batch
    entry: its queries against its own keys, then against the previous block's keys (the rest of the
    window: only the first W - 1 rows reach it), the two merged by their log-normalisers.  Both take
    views of the rows as they lie (no band is copied; one head a batch entry, so the kernel copies none)."""
    queries, keys, values = layout.flash_inputs(q, k, v)
    own_mask, near_mask = layout.flash_masks(q.shape[0], layout.log_decay)
    out, lse = FLASH_FORWARD(queries, keys, values, attn_mask=own_mask, scale=layout.scale)
    if layout.previous:
        near_out, near_lse = FLASH_FORWARD(queries[1:], keys[:-1], values[:-1], attn_mask=near_mask,
                                           scale=layout.scale)
        # rows with no key in the previous block (the kernel's lse is 0 there), and every head's first
        # block (its previous entry is the head before's last): no weight
        near_lse[..., layout.window - 1:] = float("-inf")
        near_lse[layout.blocks - 1::layout.blocks] = float("-inf")
        merge_into(out[1:], lse[1:], near_out, near_lse)
    return layout.from_blocks(out, q.shape[:2]), layout.from_blocks(lse.unsqueeze(-1), q.shape[:2]).squeeze(-1)


def flash_backward(layout: "Band", q, k, v, out, lse, grad_out, grad_lse):
    """`blocked_backward` by torch's CPU flash-attention backward kernel, a group of heads at a time (the
    kernel's inputs and gradients are new tensors: a group's stay a few MB), into the gradients."""
    grads = [torch.empty_like(t) for t in (q, k, v)]
    per_group = max(1, FLASH_ROWS // (q.shape[0] * layout.n))
    for start in range(0, q.shape[1], per_group):
        heads = slice(start, start + per_group)
        parts = (None if t is None else t[:, heads] for t in (q, k, v, out, lse, grad_out, grad_lse))
        log_decay = None if layout.log_decay is None else layout.log_decay[heads]
        for grad, part in zip(grads, flash_backward_heads(layout, log_decay, *parts)):
            grad[:, heads] = part
    return grads


def flash_backward_heads(layout: "Band", log_decay, q, k, v, out, lse, grad_out, grad_lse):
    """`flash_backward` of some heads (log_decay: theirs): `flash_forward`'s two kernel calls, each given
    the merged out and lse (e^(s - lse) is each weight's share of all); every head's first block reads
    its previous entry with lse = +inf (no weight).  A gradient into lse (p for each weight) rides on
    one more value column, 1 for every key, whose output gradient is d lse and whose output is taken as 0
    (so the kernel's dO . out is the same)."""
    extra = grad_lse is not None
    queries, keys, values = layout.flash_inputs(q, k, v, extra=extra)
    d_outs, outs = layout.to_blocks(grad_out, grad_lse), layout.to_blocks(out, 0.0 if extra else None)
    lses = layout.to_blocks(lse.unsqueeze(-1)).squeeze(-1)
    own_mask, near_mask = layout.flash_masks(q.shape[0], log_decay)
    grad_q, grad_k, grad_v = FLASH_BACKWARD(d_outs, queries, keys, values, outs, lses, 0.0, False,
                                            attn_mask=own_mask, scale=layout.scale)
    if layout.previous:
        near_lses = lses[1:].clone()
        near_lses[layout.blocks - 1::layout.blocks] = float("inf")
        near = FLASH_BACKWARD(d_outs[1:], queries[1:], keys[:-1], values[:-1], outs[1:], near_lses, 0.0, False,
                              attn_mask=near_mask, scale=layout.scale)
        grad_q[1:].add_(near[0])   # not `+=` on a slice, which copies the sum back onto itself
        grad_k[:-1].add_(near[1])
        grad_v[:-1].add_(near[2])
        del near
    grad_q, grad_k, grad_v = (layout.from_blocks(g, q.shape[:2]) for g in (grad_q, grad_k, grad_v))
    if extra:
        grad_q, grad_k, grad_v = (g[..., :-1] for g in (grad_q, grad_k, grad_v))
    return layout.rotated_back(grad_q), layout.rotated_back(grad_k), grad_v


def merge_into(out, lse, other, other_lse) -> None:
    """`merge` in place of out (..., R, Dv) and lse (..., R): one stabiliser per row."""
    mine, theirs = merge_weights(lse, other_lse)
    out.mul_(mine).addcmul_(theirs, other)
    lse.copy_(torch.logaddexp(lse, other_lse))


# torch's own CPU kernel behind SDPA, not a public API: where a torch lacks it, the blocked products serve
FLASH_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class Band:
    """Where the blocks and their bands lie: N rows in K blocks of L (the last padded by `tail` zero rows);
    block b's band is the last W - 1 rows of block b - 1 (none for block 0: masked) and its own L rows.
    With a rotary offset, the phases of RoPE for the K L rows, applied to each group's rows as it goes."""

    def __init__(self, q: torch.Tensor, window: int, log_decay, rotary_offset: int | None = None,
                 rope_base: float = DEFAULT_BASE, *, value_dim: int):
        n, dim = q.shape[-2:]
        self.window, self.n, self.scale = window, n, dim ** -0.5
        self.block = min(n, max(window, MIN_BLOCK))
        self.blocks = -(-n // self.block)
        self.tail = self.blocks * self.block - n
        self.rows_shape = (*q.shape[:-2], self.blocks * self.block)
        width = self.block + window - 1
        per_block = q.shape[:-2].numel() * self.block * width
        self.group_blocks = max(1, min(self.blocks, GROUP_SCORES // max(1, per_block)))
        # the kernel takes values as wide as the keys only
        self.flash = q.device.type in FLASH_DEVICES and value_dim == dim and FLASH_BACKWARD is not None
        if self.flash:   # blocks 1.. reach into the previous block
            self.previous, self.log_decay = self.blocks > 1 and window > 1, log_decay
            self.device, self.dtype = q.device, q.dtype
        else:   # (L, L + W - 1), (H, 1, ...) with a decay
            rows, cols = torch.arange(self.block, device=q.device), torch.arange(width, device=q.device)
            self.bias = window_bias(rows[:, None] - cols + window - 1, window, log_decay, q.dtype)
        self.phases = None
        if rotary_offset is not None:   # the padding rows' phases are 1 (their positions may pass 2^63)
            phases = rotary_phases(n, dim, offset=rotary_offset, base=rope_base, device=q.device, dtype=q.dtype)
            self.phases = torch.cat((phases, phases.new_ones(self.tail, phases.shape[-1]))) if self.tail else phases

    def groups(self):
        for start in range(0, self.blocks, self.group_blocks):
            yield range(start, min(start + self.group_blocks, self.blocks))

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

    def rotated(self, padded: torch.Tensor, rows: slice) -> torch.Tensor:
        """Rows of row-padded queries or keys, rotated at their positions where the layout rotates."""
        if self.phases is None:
            return padded[..., rows, :]
        return rotate_pairs(padded[..., rows, :].contiguous(), self.phases[rows])

    def unrotate(self, grads: torch.Tensor) -> None:
        """Gradients with respect to rotated rows -> with respect to the rows before the rotation, in place:
        each pair rotated back (the rotation's transpose)."""
        if self.phases is not None:
            torch.view_as_complex(grads.unflatten(-1, (-1, 2))).mul_(self.phases[:grads.shape[-2]].conj())

    def group(self, queries, keys, values, blocks: range):
        """The group's queries (B, H, G, L, D) and its bands of keys and values (B, H, G, W - 1 + L, .),
        from row-padded inputs (the keys are rotated once for all the group's bands)."""
        first = max(blocks.start - 1, 0)   # the block before the group's first lends its band W - 1 rows
        near = range(first, blocks.stop)
        local = range(blocks.start - first, blocks.stop - first)
        group_queries = self.blocked(self.rotated(queries, self.rows(blocks)))
        band_keys = self.band(self.rotated(keys, self.rows(near)), local)
        return group_queries, band_keys, self.band(values[..., self.rows(near), :], local)

    def band(self, rows: torch.Tensor, blocks: range) -> torch.Tensor:
        """(..., G, W - 1 + L, .): the keys (or values) of each block's band, from the rows of the blocks
        before the last of `blocks` (counted in those rows), zero rows before the first."""
        rows, overlap = self.blocked(rows), self.window - 1
        own = rows[..., blocks.start:blocks.stop, :, :]
        before = rows[..., max(blocks.start - 1, 0):blocks.stop - 1, self.block - overlap:, :]
        if blocks.start == 0:
            before = torch.cat((before.new_zeros(*before.shape[:-3], 1, *before.shape[-2:]), before), -3)
        return torch.cat((before, own), -2)

    def scores(self, group_queries: torch.Tensor, band_keys: torch.Tensor, blocks: range) -> torch.Tensor:
        """(B, H, G, L, W - 1 + L) scores of the group's blocks, -inf outside the window."""
        scores = (group_queries @ band_keys.transpose(-1, -2)).mul_(self.scale).add_(self.bias)
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

    # ---- the flash kernel's blocks: (B H, K, L, .), every block a batch entry --------------------

    def flash_masks(self, batch: int, log_decay) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel's additive masks, (L, L), or (batch H K, 1, L, L) with a decay (per head, one per
        block): a block's queries against its own keys (distance i - j), and (None unless `previous`)
        against the previous block's (distance i - j + L), for blocks 1.."""
        rows = torch.arange(self.block, device=self.device)

        def per_block(bias):   # (H, 1, L, L) -> one per block of every batch entry and head
            if log_decay is None:
                return bias
            return bias.unsqueeze(0).expand(batch, -1, self.blocks, -1, -1).reshape(-1, 1, *bias.shape[-2:])

        own = per_block(window_bias(rows[:, None] - rows, self.window, log_decay, self.dtype))
        if not self.previous:
            return own, None
        near = per_block(window_bias(rows[:, None] - rows + self.block, self.window, log_decay, self.dtype))
        return own, near if log_decay is None else near[1:]

    def flash_inputs(self, q, k, v, extra: bool = False):
        """Queries, keys and values (B H, K, L, .), rotated where the layout rotates; `extra`: one more
        column, 0 in q and k (the scores stay) and 1 in v."""
        if self.phases is not None:   # rotated into dense rows, which the blocks then view
            q, k = (rotate_pairs(x, self.phases[:self.n], dense=True) for x in (q, k))
        if extra:
            q, k, v = F.pad(q, (0, 1)), F.pad(k, (0, 1)), F.pad(v, (0, 1), value=1.0)
        return self.to_blocks(q), self.to_blocks(k), self.to_blocks(v)

    def to_blocks(self, x: torch.Tensor, column=None) -> torch.Tensor:
        """(B, H, N, C) -> (B H K, 1, L, C), zero rows after the last; column (B, H, N) or a number: one
        more column."""
        if isinstance(column, torch.Tensor):
            x = torch.cat((x, column.unsqueeze(-1)), -1)
        elif column is not None:
            x = F.pad(x, (0, 1), value=column)
        blocks = self.pad(x).reshape(-1, 1, self.block, x.shape[-1])
        return blocks if blocks.stride(-1) == 1 else blocks.contiguous()   # the kernel reads rows as dense

    def from_blocks(self, x: torch.Tensor, batch_heads) -> torch.Tensor:
        """(B H K, 1, L, C) -> (B, H, N, C)."""
        return self.unpad(x.reshape(*batch_heads, self.blocks * self.block, x.shape[-1]))

    def rotated_back(self, grads: torch.Tensor) -> torch.Tensor:
        """`unrotate`, of gradients that may be a view of wider rows (then a copy)."""
        if self.phases is None:
            return grads
        grads = grads if pairs_view(grads) else grads.contiguous()
        self.unrotate(grads)
        return grads


def window_bias(distance: torch.Tensor, window: int, log_decay, dtype: torch.dtype) -> torch.Tensor:
    """The scores' additive bias at these query-key distances: -inf outside [0, W), else the decay's
    d log gamma, (H, 1, ...) per head, or 0."""
    inside = (distance >= 0) & (distance < window)
    bias = torch.zeros(distance.shape, dtype=dtype, device=distance.device)
    if log_decay is not None:   # gamma^(m - n)
        bias = distance.clamp_min(0).to(dtype) * log_decay.to(dtype)[:, None, None, None]
    return bias.masked_fill(~inside, float("-inf"))
