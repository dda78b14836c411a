"""The log factors of fla's call (fla_kernels.py) in one Triton kernel per direction (issue 47): from the
log-features b, a in fla's layout, any strides (a `LogProjection`'s logits with its row shift added where
they are read; for tensors the guard of common.guard_log_features applied there too), the running
maximum F of the keys' log-features and their log-cumulative-sum-exp L (the denominator's per-feature
sums, log sum_{n<=t} e^(a_n), so that the denominator needs no second call of fla; with a decay per head
both decayed, F_t = max(F_{t-1} + log gamma, a_t) and L likewise, into fla's gates), the pair scales P,
the decays, the row scale Q, the denominator and the two exponentials, rotated and cast for fla; the
backward recomputes them from b, a and the saved L, P, Q, with L's reverse scan.  For plain features
(`plain_factors`) the same in linear terms: the keys' running sums S (with a decay per head,
S_t = gamma S_{t-1} + phi_k_t), the denominator phi_q . S, and fla's q = R phi_q / den (the call's
output is then Eq. 19's), k = R phi_k; backward in two kernels (the queries' walking each chunk forward,
the keys' walking it back); their chunks' carries by common.linear_carries.  No torch scan along N
(torch's cummax along a non-last dimension runs on CUDA as one thread per column walking every row).

Each program takes one chunk of CHUNK tokens of one head, token by token, the head's M features as
(even, odd) halves, so that a rotation pair is one lane, and starts from the carry of every earlier
chunk: a torch cummax (and logcumsumexp) over the N / CHUNK chunk summaries, which one read of a
writes (common.chunk_carries; with a decay in float64 frames); backward's reverse scan is chunked the
same way.  Written for a GPU: int64 offsets, the
tensors' own strides, the launch on the tensors' device, NaN kept (a GPU's tl.maximum drops it by
default), the chunks on the grid's first axis (2^31 - 1 programs; heads and batch on the others, 65535
each).  Derivation: docs/derivations.md, "Eq. 19 on fla's kernels (fla_kernels.py)" and "Decay in the
chunks"."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .common import DECAY_FLOOR, chunk_carries, linear_carries, same_rotation
from .stable import NUMERATOR_CAP

CHUNK = 64     # tokens per program (fla's chunk)


@triton.jit
def _maximum(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rescaled(log_ref, total, log_scale):
    """total e^(log_scale - log_ref), 1 where the two are equal (also both -inf)."""
    return tl.where(log_scale == log_ref, total, total * tl.exp(log_scale - log_ref))


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    """L's dtype: float32 (float64 stays float64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@triton.jit
def _minimum(x, y):
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rate(rate_ptr, head, DECAY: tl.constexpr, CT: tl.constexpr):
    """The head's log gamma (0 without a decay)."""
    if DECAY:
        return tl.load(rate_ptr + head).to(CT)
    return tl.zeros([], CT)


@triton.jit
def _gate(before, after, rate):
    """(F_{t-1} - F_t) + log gamma: the difference first, exact for close scales; the decay where both are
    -inf."""
    return tl.where(before == after, rate, (before - after) + rate)


@triton.jit
def _decayed_step(scale, sums, x, rate):
    """One token x of the running maximum F_t = max(F_{t-1} + log gamma, x) and of the sums relative to it,
    s_t = s_{t-1} e^((F_{t-1} - F_t) + log gamma) + e^(x - F_t) (so that L = F + log s): (F_t, s_t)."""
    new_scale = _maximum(scale + rate, x)
    one = tl.full(sums.shape, 1.0, sums.dtype)
    return new_scale, sums * tl.exp(_gate(scale, new_scale, rate)) + _rescaled(new_scale, one, x)


@triton.jit
def _chunk_end(carry_ptr, top_ptr, carry, valid, rate, CHUNK: tl.constexpr):
    """F at a chunk's last token as that chunk's program has it (stepped from its carry, a maximum with
    its own keys' top): the next chunk's first gate steps from it, whatever its own carry's rounding."""
    scale = tl.load(carry_ptr + carry, mask=valid, other=float("-inf"))
    for _ in range(CHUNK):
        scale = scale + rate
    return _maximum(scale, tl.load(top_ptr + carry, mask=valid, other=float("-inf")))


@triton.jit
def _program(PAIRS: tl.constexpr):
    """A program's (chunk, head, batch) and its pairs' indices, with their even features' (int64)."""
    pairs = tl.arange(0, PAIRS)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2), pairs, pairs.to(tl.int64) * 2


@triton.jit
def _token(t, length, batch, heads, head, even, width):
    """Token t of a program: t, whether it exists, its row in (B, T, H) tensors, and which features exist."""
    inside = t < length
    return (t, inside, (batch.to(tl.int64) * length + t) * heads + head, inside & (even < width),
            inside & (even + 1 < width))


@triton.jit
def _row(ptr, shift_ptr, bounds_ptr, offset, row, pairs, width, stride_m, inside,
         SHIFT: tl.constexpr, GUARD: tl.constexpr, CT: tl.constexpr):
    """One token's row as (even, odd) halves in CT, -inf in lanes past the row: its shift added and
    (GUARD) raised to the floor, NaN where the row holds a value beyond the limit (bounds: limit,
    floor); and the lanes whose raw value the floor kept (the gradient's mask)."""
    even = pairs.to(tl.int64) * 2
    valid_e, valid_o = inside & (even < width), inside & (even + 1 < width)
    x_e = tl.load(ptr + offset + even * stride_m, mask=valid_e, other=float("-inf")).to(CT)
    x_o = tl.load(ptr + offset + (even + 1) * stride_m, mask=valid_o, other=float("-inf")).to(CT)
    keep_e, keep_o = valid_e, valid_o
    if GUARD:
        limit, floor = tl.load(bounds_ptr), tl.load(bounds_ptr + 1)
        # -inf and the floor (a tensor guarded before, as the window's) are features of 0
        beyond = tl.max(((tl.abs(x_e) > limit) & (x_e > floor)).to(tl.int32), 0) + \
            tl.max(((tl.abs(x_o) > limit) & (x_o > floor)).to(tl.int32), 0)
        poison = tl.where(beyond > 0, float("nan"), 0.0).to(CT)
        keep_e, keep_o = valid_e & ~(x_e < floor), valid_o & ~(x_o < floor)
        x_e = tl.where(x_e < floor, floor, x_e) + poison
        x_o = tl.where(x_o < floor, floor, x_o) + poison
    if SHIFT:
        shift = tl.load(shift_ptr + row, mask=inside, other=0.0).to(CT)
        x_e, x_o = x_e + shift, x_o + shift
    return tl.where(valid_e, x_e, float("-inf")), tl.where(valid_o, x_o, float("-inf")), keep_e, keep_o


@triton.jit
def _pair_scales(scale_e, scale_o, ROTARY: tl.constexpr):
    """P from F: the pair's maximum where the numerator is rotated."""
    if ROTARY:
        pair = _maximum(scale_e, scale_o)
        return pair, pair
    return scale_e, scale_o


@triton.jit
def _query_factor(b, pair_scale, row_scale, ROTARY: tl.constexpr, CAP: tl.constexpr):
    """e^(b + P - Q), capped at e^CAP where rotated (stable.numerator_query), and where the cap let the
    gradient through."""
    if ROTARY:
        log_factor = b + (pair_scale - row_scale)
        return tl.exp(_minimum(log_factor, CAP)), ~(log_factor > CAP)
    return tl.exp(b + pair_scale - row_scale), b == b


@triton.jit
def _rotated_at(phases_ptr, position, pairs, width, valid, x_e, x_o, INVERSE: tl.constexpr):
    """A row of pairs x_e + i x_o times e^(i theta), or e^(-i theta) (the gradient's), theta from row
    `position` of the (T or 2T, M/2, 2) phases: the queries' at t, the keys' at key_rows + t (key_rows T
    where their rotations differ, else 0)."""
    phase = (position * (width // 2) + pairs) * 2
    cos = tl.load(phases_ptr + phase, mask=valid, other=1.0)
    sin = tl.load(phases_ptr + phase + 1, mask=valid, other=0.0)
    if INVERSE:
        sin = -sin
    return x_e * cos - x_o * sin, x_e * sin + x_o * cos


@triton.jit
def _store_query_and_key(q_ptr, k_ptr, phases_ptr, t, key_rows, pairs, width, row, valid_e, valid_o, q_e, q_o, k_e,
                         k_o, ROTARY: tl.constexpr):
    """fla's q and k of token t at its dense row, rotated (ROTARY) by the queries' and keys' phases; the
    row's dense offset of its even features."""
    if ROTARY:
        q_e, q_o = _rotated_at(phases_ptr, t, pairs, width, valid_e, q_e, q_o, False)
        k_e, k_o = _rotated_at(phases_ptr, key_rows + t, pairs, width, valid_e, k_e, k_o, False)
    dense = row * width + pairs.to(tl.int64) * 2
    tl.store(q_ptr + dense, q_e, mask=valid_e)
    tl.store(q_ptr + dense + 1, q_o, mask=valid_o)
    tl.store(k_ptr + dense, k_e, mask=valid_e)
    tl.store(k_ptr + dense + 1, k_o, mask=valid_o)
    return dense


@triton.jit
def _factor_summary_kernel(a_ptr, a_shift_ptr, bounds_ptr, rate_ptr, top_ptr, lse_ptr, length, width, heads, chunks,
                           sa_b, sa_t, sa_h, sa_m, A_SHIFT: tl.constexpr, GUARD: tl.constexpr, DECAY: tl.constexpr,
                           CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """Each chunk's own (decayed) maximum and log-sum-exp of a per feature at its last token, (B, chunks, H, M)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = lse_ptr.dtype.element_ty
    rate = _rate(rate_ptr, head, DECAY, CT)
    base = batch.to(tl.int64) * sa_b + head.to(tl.int64) * sa_h
    top_e = tl.full([PAIRS], float("-inf"), CT)
    top_o = top_e
    sums_e = tl.full([PAIRS], 1.0, CT)
    sums_o = sums_e
    first = chunk.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        t, inside, row, _, _ = _token(first + i, length, batch, heads, head, even, width)
        a_e, a_o, _, _ = _row(a_ptr, a_shift_ptr, bounds_ptr, base + t * sa_t, row, pairs, width, sa_m, inside,
                              A_SHIFT, GUARD, CT)
        top_e, sums_e = _decayed_step(top_e, sums_e, a_e, rate)
        top_o, sums_o = _decayed_step(top_o, sums_o, a_o, rate)
    out = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    tl.store(top_ptr + out, top_e, mask=even < width)
    tl.store(top_ptr + out + 1, top_o, mask=even + 1 < width)
    tl.store(lse_ptr + out, top_e + tl.log(sums_e), mask=even < width)
    tl.store(lse_ptr + out + 1, top_o + tl.log(sums_o), mask=even + 1 < width)


@triton.jit
def _factors_kernel(b_ptr, b_shift_ptr, a_ptr, a_shift_ptr, bounds_ptr, rate_ptr, phases_ptr, key_rows, top_ptr,
                    carry_max_ptr, carry_lse_ptr, q_ptr, k_ptr, decay_ptr, lse_ptr, scale_ptr, row_scale_ptr, den_ptr,
                    last_ptr, length, width, heads, chunks, sb_b, sb_t, sb_h, sb_m, sa_b, sa_t, sa_h, sa_m,
                    B_SHIFT: tl.constexpr, A_SHIFT: tl.constexpr, GUARD: tl.constexpr, ROTARY: tl.constexpr,
                    DECAY: tl.constexpr, DECAY_FLOOR: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                    PAIRS: tl.constexpr):
    """fla's q, k (rotated, in the dots' dtype) and decays, the denominator, L, P, Q for backward, and F at
    the last token."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = lse_ptr.dtype.element_ty
    rate = _rate(rate_ptr, head, DECAY, CT)
    base_b = batch.to(tl.int64) * sb_b + head.to(tl.int64) * sb_h
    base_a = batch.to(tl.int64) * sa_b + head.to(tl.int64) * sa_h
    carry = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    scale_e = tl.load(carry_max_ptr + carry, mask=even < width, other=float("-inf"))
    scale_o = tl.load(carry_max_ptr + carry + 1, mask=even + 1 < width, other=float("-inf"))
    log_sums_e = tl.load(carry_lse_ptr + carry, mask=even < width, other=float("-inf"))
    log_sums_o = tl.load(carry_lse_ptr + carry + 1, mask=even + 1 < width, other=float("-inf"))
    one = tl.full([PAIRS], 1.0, CT)
    sums_e, sums_o = _rescaled(scale_e, one, log_sums_e), _rescaled(scale_o, one, log_sums_o)   # e^(L - F)
    previous = carry - heads * width   # the chunk before's (B, chunks, H, M) index
    before_e = _chunk_end(carry_max_ptr, top_ptr, previous, (chunk > 0) & (even < width), rate, CHUNK)
    before_o = _chunk_end(carry_max_ptr, top_ptr, previous + 1, (chunk > 0) & (even + 1 < width), rate, CHUNK)
    before_e, before_o = _pair_scales(before_e, before_o, ROTARY)
    first = chunk.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + i, length, batch, heads, head, even, width)
        a_e, a_o, _, _ = _row(a_ptr, a_shift_ptr, bounds_ptr, base_a + t * sa_t, row, pairs, width, sa_m, inside,
                              A_SHIFT, GUARD, CT)
        b_e, b_o, _, _ = _row(b_ptr, b_shift_ptr, bounds_ptr, base_b + t * sb_t, row, pairs, width, sb_m, inside,
                              B_SHIFT, GUARD, CT)
        scale_e, sums_e = _decayed_step(scale_e, sums_e, a_e, rate)
        scale_o, sums_o = _decayed_step(scale_o, sums_o, a_o, rate)
        log_sums_e, log_sums_o = scale_e + tl.log(sums_e), scale_o + tl.log(sums_o)
        pair_e, pair_o = _pair_scales(scale_e, scale_o, ROTARY)
        decay_e = tl.where(t == 0, 0.0, _maximum(_gate(before_e, pair_e, rate), DECAY_FLOOR))
        decay_o = tl.where(t == 0, 0.0, _maximum(_gate(before_o, pair_o, rate), DECAY_FLOOR))
        before_e, before_o = pair_e, pair_o
        row_scale = _maximum(tl.reduce(b_e + scale_e, 0, _maximum), tl.reduce(b_o + scale_o, 0, _maximum))
        den = tl.sum(tl.where(valid_e, tl.exp(b_e + log_sums_e - row_scale), 0.0), 0) + \
            tl.sum(tl.where(valid_o, tl.exp(b_o + log_sums_o - row_scale), 0.0), 0)
        q_e, _ = _query_factor(b_e, pair_e, row_scale, ROTARY, CAP)
        q_o, _ = _query_factor(b_o, pair_o, row_scale, ROTARY, CAP)
        k_e, k_o = tl.exp(a_e - pair_e), tl.exp(a_o - pair_o)
        dense = _store_query_and_key(q_ptr, k_ptr, phases_ptr, t, key_rows, pairs, width, row, valid_e, valid_o,
                                     q_e, q_o, k_e, k_o, ROTARY)
        tl.store(decay_ptr + dense, decay_e, mask=valid_e)
        tl.store(decay_ptr + dense + 1, decay_o, mask=valid_o)
        tl.store(lse_ptr + dense, log_sums_e, mask=valid_e)
        tl.store(lse_ptr + dense + 1, log_sums_o, mask=valid_o)
        if ROTARY:
            tl.store(scale_ptr + row * (width // 2) + pairs, pair_e, mask=valid_e)
        else:
            tl.store(scale_ptr + dense, pair_e, mask=valid_e)
            tl.store(scale_ptr + dense + 1, pair_o, mask=valid_o)
        tl.store(row_scale_ptr + row, row_scale, mask=inside)
        tl.store(den_ptr + row, den, mask=inside)
        last = (batch.to(tl.int64) * heads + head) * width + even   # F at the last token, (B, H, M)
        tl.store(last_ptr + last, scale_e, mask=valid_e & (t == length - 1))
        tl.store(last_ptr + last + 1, scale_o, mask=valid_o & (t == length - 1))


@triton.jit
def _load_pair(ptr, dense, valid_e, valid_o, other, CT: tl.constexpr):
    return (tl.load(ptr + dense, mask=valid_e, other=other).to(CT),
            tl.load(ptr + dense + 1, mask=valid_o, other=other).to(CT))


@triton.jit
def _scales(lse_ptr, scale_ptr, row_scale_ptr, row, pairs, width, valid_e, valid_o, inside, ROTARY: tl.constexpr,
            CT: tl.constexpr):
    """L, P (as (even, odd) halves) and Q of a row, as the forward saved them."""
    dense = row * width + pairs.to(tl.int64) * 2
    log_sums_e, log_sums_o = _load_pair(lse_ptr, dense, valid_e, valid_o, 0.0, CT)
    if ROTARY:
        pair_e = tl.load(scale_ptr + row * (width // 2) + pairs, mask=valid_e, other=0.0)
        pair_o = pair_e
    else:
        pair_e, pair_o = _load_pair(scale_ptr, dense, valid_e, valid_o, 0.0, CT)
    return log_sums_e, log_sums_o, pair_e, pair_o, tl.load(row_scale_ptr + row, mask=inside, other=0.0)


@triton.jit
def _factor_grad_summary_kernel(b_ptr, b_shift_ptr, bounds_ptr, rate_ptr, lse_ptr, row_scale_ptr, grad_den_ptr,
                                out_ptr, length, width, heads, chunks, sb_b, sb_t, sb_h, sb_m, B_SHIFT: tl.constexpr,
                                GUARD: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """Each chunk's sum_m dL_m e^(L_s - L_m + (m - s) log gamma), s its first token, with dL = d den e^(b + L - Q)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = lse_ptr.dtype.element_ty
    rate = _rate(rate_ptr, head, DECAY, CT)
    base_b = batch.to(tl.int64) * sb_b + head.to(tl.int64) * sb_h
    first = chunk.to(tl.int64) * CHUNK
    start = ((batch.to(tl.int64) * length + first) * heads + head) * width + even
    first_e, first_o = _load_pair(lse_ptr, start, even < width, even + 1 < width, 0.0, CT)
    total_e = tl.zeros([PAIRS], CT)
    total_o = total_e
    for i in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + i, length, batch, heads, head, even, width)
        b_e, b_o, _, _ = _row(b_ptr, b_shift_ptr, bounds_ptr, base_b + t * sb_t, row, pairs, width, sb_m, inside,
                              B_SHIFT, GUARD, CT)
        log_sums_e, log_sums_o = _load_pair(lse_ptr, row * width + even, valid_e, valid_o, 0.0, CT)
        row_scale = tl.load(row_scale_ptr + row, mask=inside, other=0.0)
        grad_den = tl.load(grad_den_ptr + row, mask=inside, other=0.0).to(CT)
        grad_e = grad_den * tl.exp(b_e + log_sums_e - row_scale)   # dL
        grad_o = grad_den * tl.exp(b_o + log_sums_o - row_scale)
        ahead = (t - first).to(CT) * rate
        total_e += tl.where(valid_e, grad_e * tl.exp(first_e - log_sums_e + ahead), 0.0)
        total_o += tl.where(valid_o, grad_o * tl.exp(first_o - log_sums_o + ahead), 0.0)
    out = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    tl.store(out_ptr + out, total_e, mask=even < width)
    tl.store(out_ptr + out + 1, total_o, mask=even + 1 < width)


@triton.jit
def _factors_grad_kernel(b_ptr, b_shift_ptr, a_ptr, a_shift_ptr, bounds_ptr, rate_ptr, phases_ptr, key_rows, lse_ptr,
                         scale_ptr,
                         row_scale_ptr, grad_q_ptr, grad_k_ptr, grad_den_ptr, after_pos_ptr, after_neg_ptr,
                         grad_b_ptr, grad_a_ptr, grad_b_shift_ptr, grad_a_shift_ptr, length, width, heads, chunks,
                         sb_b, sb_t, sb_h, sb_m, sa_b, sa_t, sa_h, sa_m, gb_b, gb_t, gb_h, gb_m, ga_b, ga_t, ga_h,
                         ga_m, B_SHIFT: tl.constexpr, A_SHIFT: tl.constexpr, GUARD: tl.constexpr,
                         ROTARY: tl.constexpr, DECAY: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                         PAIRS: tl.constexpr):
    """d b and d a (and their shifts' row sums), token by token from the chunk's last: the two
    exponentials' terms, the denominator's, and L's reverse (decayed) scan, the later chunks' part
    (`after`: log sum_m dL_m e^(-L_m + (m - e) log gamma) over them, e the token after the chunk) from
    the chunk summaries."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = lse_ptr.dtype.element_ty
    rate = _rate(rate_ptr, head, DECAY, CT)
    carry = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    after_pos_e, after_pos_o = _load_pair(after_pos_ptr, carry, even < width, even + 1 < width, float("-inf"), CT)
    after_neg_e, after_neg_o = _load_pair(after_neg_ptr, carry, even < width, even + 1 < width, float("-inf"), CT)
    base_b = batch.to(tl.int64) * sb_b + head.to(tl.int64) * sb_h
    base_a = batch.to(tl.int64) * sa_b + head.to(tl.int64) * sa_h
    base_grad_b = batch.to(tl.int64) * gb_b + head.to(tl.int64) * gb_h
    base_grad_a = batch.to(tl.int64) * ga_b + head.to(tl.int64) * ga_h
    total_e = tl.zeros([PAIRS], CT)   # sum_{m>=n in the chunk} dL_m e^(L_n - L_m + (m - n) log gamma)
    total_o = total_e
    later_e = tl.full([PAIRS], float("inf"), CT)   # L_{n+1}
    later_o = later_e
    first = chunk.to(tl.int64) * CHUNK
    for j in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + (CHUNK - 1 - j), length, batch, heads, head, even, width)
        b_e, b_o, keep_b_e, keep_b_o = _row(b_ptr, b_shift_ptr, bounds_ptr, base_b + t * sb_t, row, pairs, width, sb_m,
                                            inside, B_SHIFT, GUARD, CT)
        a_e, a_o, keep_a_e, keep_a_o = _row(a_ptr, a_shift_ptr, bounds_ptr, base_a + t * sa_t, row, pairs, width, sa_m,
                                            inside, A_SHIFT, GUARD, CT)
        log_sums_e, log_sums_o, pair_e, pair_o, row_scale = _scales(lse_ptr, scale_ptr, row_scale_ptr, row, pairs,
                                                                    width, valid_e, valid_o, inside, ROTARY, CT)
        grad_den = tl.load(grad_den_ptr + row, mask=inside, other=0.0).to(CT)
        dense = row * width + even
        grad_q_e, grad_q_o = _load_pair(grad_q_ptr, dense, valid_e, valid_o, 0.0, CT)
        grad_k_e, grad_k_o = _load_pair(grad_k_ptr, dense, valid_e, valid_o, 0.0, CT)
        if ROTARY:
            grad_q_e, grad_q_o = _rotated_at(phases_ptr, t, pairs, width, valid_e, grad_q_e, grad_q_o, True)
            grad_k_e, grad_k_o = _rotated_at(phases_ptr, key_rows + t, pairs, width, valid_e, grad_k_e, grad_k_o,
                                             True)
        # b: the denominator's e^(b + L - Q) and the query factor's
        grad_l_e = tl.where(valid_e, grad_den * tl.exp(b_e + log_sums_e - row_scale), 0.0)   # dL
        grad_l_o = tl.where(valid_o, grad_den * tl.exp(b_o + log_sums_o - row_scale), 0.0)
        q_e, through_e = _query_factor(b_e, pair_e, row_scale, ROTARY, CAP)
        q_o, through_o = _query_factor(b_o, pair_o, row_scale, ROTARY, CAP)
        grad_b_e = grad_l_e + tl.where(through_e, grad_q_e * q_e, 0.0)
        grad_b_o = grad_l_o + tl.where(through_o, grad_q_o * q_o, 0.0)
        # a: the key factor's e^(a - P) and L's reverse scan
        total_e = grad_l_e + _rescaled(-log_sums_e, total_e, rate - later_e)
        total_o = grad_l_o + _rescaled(-log_sums_o, total_o, rate - later_o)
        later_e = tl.where(valid_e, log_sums_e, float("inf"))   # a lane past the row carries nothing
        later_o = tl.where(valid_o, log_sums_o, float("inf"))
        share_e = tl.where(a_e == float("-inf"), 0.0, tl.exp(a_e - log_sums_e))
        share_o = tl.where(a_o == float("-inf"), 0.0, tl.exp(a_o - log_sums_o))
        to_after = (j + 1) * rate   # from token t to the one after the chunk
        whole_e = total_e + tl.exp(log_sums_e + to_after + after_pos_e) - tl.exp(log_sums_e + to_after + after_neg_e)
        whole_o = total_o + tl.exp(log_sums_o + to_after + after_pos_o) - tl.exp(log_sums_o + to_after + after_neg_o)
        grad_a_e = grad_k_e * tl.exp(a_e - pair_e) + share_e * whole_e
        grad_a_o = grad_k_o * tl.exp(a_o - pair_o) + share_o * whole_o
        grad_b_e, grad_b_o = tl.where(keep_b_e, grad_b_e, 0.0), tl.where(keep_b_o, grad_b_o, 0.0)
        grad_a_e, grad_a_o = tl.where(keep_a_e, grad_a_e, 0.0), tl.where(keep_a_o, grad_a_o, 0.0)
        _store_row(grad_b_ptr, grad_b_shift_ptr, base_grad_b + t * gb_t, row, even, gb_m, grad_b_e, grad_b_o, valid_e,
                   valid_o, inside, B_SHIFT)
        _store_row(grad_a_ptr, grad_a_shift_ptr, base_grad_a + t * ga_t, row, even, ga_m, grad_a_e, grad_a_o, valid_e,
                   valid_o, inside, A_SHIFT)


@triton.jit
def _store_row(ptr, shift_ptr, offset, row, even, stride_m, x_e, x_o, valid_e, valid_o, inside, SHIFT: tl.constexpr):
    """A row's gradient through its strides, and (SHIFT) its sum, the shift's gradient."""
    tl.store(ptr + offset + even * stride_m, x_e, mask=valid_e)
    tl.store(ptr + offset + (even + 1) * stride_m, x_o, mask=valid_o)
    if SHIFT:
        tl.store(shift_ptr + row, tl.sum(tl.where(valid_e, x_e, 0.0), 0) + tl.sum(tl.where(valid_o, x_o, 0.0), 0),
                 mask=inside)


def _factors_launch(kernel, a: torch.Tensor, *args, **constants):
    """kernel[grid](...) over (chunks, heads, batch) programs of a's (B, T, H, M), on a's device."""
    batch, length, heads, width = a.shape
    grid = (triton.cdiv(length, CHUNK), heads, batch)
    guard = torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, length, width, heads, grid[0], *constants.pop("strides"), CHUNK=CHUNK,
                     PAIRS=triton.next_power_of_2(triton.cdiv(width, 2)), **constants)


def log_factors(b, b_shift, a, a_shift, phases, *, dot: torch.dtype, guard: bool, limit: float, floor: float,
                log_decay: torch.Tensor | None = None):
    """fla's inputs from log-features b, a (B, T, H, M) in fla's layout (any strides, any float dtype) and
    their row shifts ((B, T, H) or None), by the fused kernels: q, k (rotated by the queries' and keys'
    `phases` (2, T, M/2) complex, or None; in `dot`), the decays, the denominator sum_j e^(b_j + L_j - Q),
    the row scale Q (B, T, H) (a constant to autograd); F and L at the last token.  `guard`: b and a
    raised to `floor` where below it, and NaN in a row that holds a value beyond `limit`
    (common.guard_log_features' work, in the kernels).  log_decay (H,) log gamma or None: F and L decayed
    (fla_kernels.key_scales), a constant."""
    return LogFactors.apply(b, b_shift, a, a_shift, phases, dot, guard, limit, floor, log_decay)


class LogFactors(torch.autograd.Function):
    """`log_factors`: one pass forward (after the chunk summaries), one backward (after its summaries)."""

    @staticmethod
    def forward(ctx, b, b_shift, a, a_shift, phases, dot, guard, limit, floor, log_decay):
        work = _sums_dtype(a)
        batch, length, heads, width = a.shape
        # filled on the device: a tensor built from host values would make the host wait for the GPU
        bounds = torch.full((2,), floor, dtype=work, device=a.device)
        bounds[0] = limit
        phases, key_rows = _phase_table(phases, length, work)
        rotary = phases is not None
        rate = log_decay.detach().to(work).contiguous() if log_decay is not None else None
        flags = dict(GUARD=guard, DECAY=rate is not None)
        # the kernels read shifts as dense (B, T, H); backward reads the same (saved) tensors
        b_shift, a_shift = (t.contiguous() if t is not None else None for t in (b_shift, a_shift))
        shifts = [t if t is not None else bounds for t in (b_shift, a_shift)]
        chunks = triton.cdiv(length, CHUNK)
        top = a.new_empty(batch, chunks, heads, width, dtype=work)
        lse = torch.empty_like(top)
        _factors_launch(_factor_summary_kernel, a, a, shifts[1], bounds, _or(rate, bounds), top, lse,
                        strides=a.stride(), A_SHIFT=a_shift is not None, **flags)
        carry_max = chunk_carries(top, lambda t: t.cummax(1).values, rate, CHUNK)
        carry_lse = chunk_carries(lse, lambda t: t.logcumsumexp(1), rate, CHUNK)
        q, k = (a.new_empty(a.shape, dtype=dot) for _ in range(2))
        decay, log_sums = (a.new_empty(a.shape, dtype=work) for _ in range(2))
        scale = a.new_empty(batch, length, heads, width // 2 if rotary else width, dtype=work)
        row_scale, den = (a.new_empty(batch, length, heads, dtype=work) for _ in range(2))
        last_scale = a.new_empty(batch, heads, width, dtype=work)
        _factors_launch(_factors_kernel, a, b, shifts[0], a, shifts[1], bounds, _or(rate, bounds),
                        _or(phases, bounds), key_rows, top, carry_max, carry_lse, q, k, decay, log_sums, scale,
                        row_scale, den, last_scale, strides=(*b.stride(), *a.stride()), B_SHIFT=b_shift is not None,
                        A_SHIFT=a_shift is not None, ROTARY=rotary, DECAY_FLOOR=DECAY_FLOOR, CAP=NUMERATOR_CAP,
                        **flags)
        ctx.save_for_backward(b, b_shift, a, a_shift, phases, bounds, rate, log_sums, scale, row_scale)
        ctx.guard, ctx.key_rows = guard, key_rows
        ctx.set_materialize_grads(False)   # no zeros written for the decays' gradient, which is not used
        ctx.mark_non_differentiable(decay, row_scale, last_scale)
        return q, k, decay, den, row_scale, last_scale, log_sums[:, -1]

    @staticmethod
    def backward(ctx, grad_q, grad_k, _, grad_den, __, ___, ____):
        b, b_shift, a, a_shift, phases, bounds, rate, log_sums, scale, row_scale = ctx.saved_tensors
        batch, length, heads, width = a.shape
        chunks = triton.cdiv(length, CHUNK)
        shifts = [t if t is not None else bounds for t in (b_shift, a_shift)]
        grad_q, grad_k, grad_den = (torch.zeros_like(like) if grad is None else grad.contiguous()
                                    for grad, like in ((grad_q, log_sums), (grad_k, log_sums), (grad_den, row_scale)))
        flags = dict(B_SHIFT=b_shift is not None, GUARD=ctx.guard, DECAY=rate is not None)
        chunk_sums = torch.empty(batch, chunks, heads, width, dtype=log_sums.dtype, device=a.device)
        _factors_launch(_factor_grad_summary_kernel, a, b, shifts[0], bounds, _or(rate, bounds), log_sums, row_scale,
                        grad_den, chunk_sums, strides=b.stride(), **flags)
        first = log_sums[:, ::CHUNK]
        after = [chunk_carries(part.log() - first, lambda t: t.logcumsumexp(1), rate, CHUNK, reverse=True)
                 for part in (chunk_sums.clamp_min(0), (-chunk_sums).clamp_min(0))]
        grad_b, grad_a = torch.empty_like(b), torch.empty_like(a)
        grad_shifts = [torch.empty_like(t, dtype=log_sums.dtype) if t is not None else bounds
                       for t in (b_shift, a_shift)]
        _factors_launch(_factors_grad_kernel, a, b, shifts[0], a, shifts[1], bounds, _or(rate, bounds),
                        _or(phases, bounds), ctx.key_rows, log_sums, scale, row_scale, grad_q, grad_k, grad_den,
                        *after, grad_b, grad_a, *grad_shifts,
                        strides=(*b.stride(), *a.stride(), *grad_b.stride(), *grad_a.stride()),
                        A_SHIFT=a_shift is not None, ROTARY=phases is not None, CAP=NUMERATOR_CAP, **flags)
        grad_b_shift = grad_shifts[0].to(b_shift.dtype) if b_shift is not None else None
        grad_a_shift = grad_shifts[1].to(a_shift.dtype) if a_shift is not None else None
        return grad_b, grad_b_shift, grad_a, grad_a_shift, None, None, None, None, None, None


def _or(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A kernel's optional tensor argument: a tensor the kernel does not read where it is None."""
    return stand_in if tensor is None else tensor


# ---- plain features: fla's q, k and the denominator, the queries divided by it (one call of fla) ----

@triton.jit
def _plain_row(ptr, offset, even, stride_m, valid_e, valid_o, CT: tl.constexpr):
    """One token's features (through their strides) as (even, odd) halves in CT, 0 past the row."""
    return (tl.load(ptr + offset + even * stride_m, mask=valid_e, other=0.0).to(CT),
            tl.load(ptr + offset + (even + 1) * stride_m, mask=valid_o, other=0.0).to(CT))


@triton.jit
def _plain_start(carry_ptr, guard_ptr, rate_ptr, chunk, head, batch, even, width, heads, chunks, sq_b, sq_h, sk_b,
                 sk_h, DECAY: tl.constexpr, CT: tl.constexpr):
    """A plain program's keys' sums at the token before its chunk (even, odd halves), the denominator's
    guard, its head's gamma (1 without a decay), and its head's offsets in the queries and keys."""
    carry = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    sums_e, sums_o = _load_pair(carry_ptr, carry, even < width, even + 1 < width, 0.0, CT)
    return (sums_e, sums_o, tl.load(guard_ptr), tl.exp(_rate(rate_ptr, head, DECAY, CT)),
            batch.to(tl.int64) * sq_b + head.to(tl.int64) * sq_h, batch.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h)


@triton.jit
def _plain_token(q_ptr, k_ptr, q_offset, k_offset, even, sq_m, sk_m, valid_e, valid_o, sums_e, sums_o, gamma,
                 CT: tl.constexpr):
    """A token's query and key features, (even, odd) halves each, and the keys' sums with it,
    S_t = gamma S_{t-1} + phi_k_t."""
    q_e, q_o = _plain_row(q_ptr, q_offset, even, sq_m, valid_e, valid_o, CT)
    k_e, k_o = _plain_row(k_ptr, k_offset, even, sk_m, valid_e, valid_o, CT)
    return q_e, q_o, k_e, k_o, sums_e * gamma + k_e, sums_o * gamma + k_o


@triton.jit
def _store_chunk_sums(ptr, chunk, head, batch, even, width, heads, chunks, total_e, total_o):
    """A program's sums over its chunk into (B, chunks, H, M)."""
    out = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    tl.store(ptr + out, total_e, mask=even < width)
    tl.store(ptr + out + 1, total_o, mask=even + 1 < width)


@triton.jit
def _plain_summary_kernel(k_ptr, rate_ptr, out_ptr, length, width, heads, chunks, sk_b, sk_t, sk_h, sk_m,
                          DECAY: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """Each chunk's (decayed) sum of the key features at its last token, (B, chunks, H, M)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = out_ptr.dtype.element_ty
    gamma = tl.exp(_rate(rate_ptr, head, DECAY, CT))
    base = batch.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h
    total_e = tl.zeros([PAIRS], CT)
    total_o = total_e
    first = chunk.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + i, length, batch, heads, head, even, width)
        k_e, k_o = _plain_row(k_ptr, base + t * sk_t, even, sk_m, valid_e, valid_o, CT)
        total_e, total_o = total_e * gamma + k_e, total_o * gamma + k_o
    _store_chunk_sums(out_ptr, chunk, head, batch, even, width, heads, chunks, total_e, total_o)


@triton.jit
def _plain_factors_kernel(q_ptr, k_ptr, phases_ptr, key_rows, carry_ptr, guard_ptr, rate_ptr, q_out_ptr, k_out_ptr,
                          den_ptr, last_ptr, length, width, heads, chunks, sq_b, sq_t, sq_h, sq_m, sk_b, sk_t, sk_h,
                          sk_m, ROTARY: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """fla's q = R phi_q / den and k = R phi_k (in the dots' dtype), den = phi_q . S_t with the keys' sums
    S_t = gamma S_{t-1} + phi_k_t (gamma 1 without a decay), and S at the last token (B, H, M)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = den_ptr.dtype.element_ty
    sums_e, sums_o, guard, gamma, base_q, base_k = _plain_start(carry_ptr, guard_ptr, rate_ptr, chunk, head, batch,
                                                                even, width, heads, chunks, sq_b, sq_h, sk_b, sk_h,
                                                                DECAY, CT)
    first = chunk.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + i, length, batch, heads, head, even, width)
        q_e, q_o, k_e, k_o, sums_e, sums_o = _plain_token(q_ptr, k_ptr, base_q + t * sq_t, base_k + t * sk_t, even,
                                                          sq_m, sk_m, valid_e, valid_o, sums_e, sums_o, gamma, CT)
        den = tl.sum(q_e * sums_e, 0) + tl.sum(q_o * sums_o, 0)
        inverse = 1.0 / _maximum(den, guard)   # common.divide's guard
        _store_query_and_key(q_out_ptr, k_out_ptr, phases_ptr, t, key_rows, pairs, width, row, valid_e, valid_o,
                             q_e * inverse, q_o * inverse, k_e, k_o, ROTARY)
        tl.store(den_ptr + row, den, mask=inside)
        last = (batch.to(tl.int64) * heads + head) * width + even
        tl.store(last_ptr + last, sums_e, mask=valid_e & (t == length - 1))
        tl.store(last_ptr + last + 1, sums_o, mask=valid_o & (t == length - 1))


@triton.jit
def _plain_query_grad_kernel(q_ptr, k_ptr, phases_ptr, carry_ptr, guard_ptr, rate_ptr, den_ptr, grad_q_ptr,
                             grad_den_ptr, grad_phi_q_ptr, weight_ptr, chunk_sums_ptr, length, width, heads, chunks,
                             sq_b, sq_t, sq_h, sq_m, sk_b, sk_t, sk_h, sk_m, gq_b, gq_t, gq_h, gq_m,
                             ROTARY: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """d phi_q = u / d + w S_t with u = R^T d q, d the guarded denominator and w = d loss / d den (its
    own gradient and -u . phi_q / d^2 where unguarded); w per row, and each chunk's sum of
    gamma^(t - first) w phi_q at its first token (what the keys' gradient sums from the later rows; the
    powers below CHUNK, each term's relative to the first row's)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = den_ptr.dtype.element_ty
    sums_e, sums_o, guard, gamma, base_q, base_k = _plain_start(carry_ptr, guard_ptr, rate_ptr, chunk, head, batch,
                                                                even, width, heads, chunks, sq_b, sq_h, sk_b, sk_h,
                                                                DECAY, CT)
    base_grad = batch.to(tl.int64) * gq_b + head.to(tl.int64) * gq_h
    total_e = tl.zeros([PAIRS], CT)
    total_o = total_e
    power = tl.full([], 1.0, CT)
    first = chunk.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + i, length, batch, heads, head, even, width)
        q_e, q_o, k_e, k_o, sums_e, sums_o = _plain_token(q_ptr, k_ptr, base_q + t * sq_t, base_k + t * sk_t, even,
                                                          sq_m, sk_m, valid_e, valid_o, sums_e, sums_o, gamma, CT)
        den = tl.load(den_ptr + row, mask=inside, other=1.0)
        guarded = _maximum(den, guard)
        u_e, u_o = _load_pair(grad_q_ptr, row * width + even, valid_e, valid_o, 0.0, CT)
        if ROTARY:
            u_e, u_o = _rotated_at(phases_ptr, t, pairs, width, valid_e, u_e, u_o, True)
        through = -(tl.sum(u_e * q_e, 0) + tl.sum(u_o * q_o, 0)) / (guarded * guarded)
        weight = tl.load(grad_den_ptr + row, mask=inside, other=0.0).to(CT) + tl.where(den < guard, 0.0, through)
        grad_e, grad_o = u_e / guarded + weight * sums_e, u_o / guarded + weight * sums_o
        offset = base_grad + t * gq_t
        tl.store(grad_phi_q_ptr + offset + even * gq_m, grad_e, mask=valid_e)
        tl.store(grad_phi_q_ptr + offset + (even + 1) * gq_m, grad_o, mask=valid_o)
        tl.store(weight_ptr + row, weight, mask=inside)
        total_e, total_o = total_e + (power * weight) * q_e, total_o + (power * weight) * q_o
        power = power * gamma
    _store_chunk_sums(chunk_sums_ptr, chunk, head, batch, even, width, heads, chunks, total_e, total_o)


@triton.jit
def _plain_key_grad_kernel(q_ptr, phases_ptr, key_rows, rate_ptr, weight_ptr, after_ptr, grad_k_ptr, grad_phi_k_ptr,
                           length, width, heads, chunks, sq_b, sq_t, sq_h, sq_m, gk_b, gk_t, gk_h, gk_m,
                           ROTARY: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr):
    """d phi_k = R^T d k + T_t, T_t = gamma T_{t+1} + w_t phi_q_t (sum_{t' >= t} gamma^(t' - t) w_t' phi_q_t'),
    from the chunk's last token (later chunks' part carried in as `after`, T at the token after it)."""
    chunk, head, batch, pairs, even = _program(PAIRS)
    CT: tl.constexpr = after_ptr.dtype.element_ty
    gamma = tl.exp(_rate(rate_ptr, head, DECAY, CT))
    carry = ((batch.to(tl.int64) * chunks + chunk) * heads + head) * width + even
    total_e, total_o = _load_pair(after_ptr, carry, even < width, even + 1 < width, 0.0, CT)
    base_q = batch.to(tl.int64) * sq_b + head.to(tl.int64) * sq_h
    base_grad = batch.to(tl.int64) * gk_b + head.to(tl.int64) * gk_h
    first = chunk.to(tl.int64) * CHUNK
    for j in range(CHUNK):
        t, inside, row, valid_e, valid_o = _token(first + (CHUNK - 1 - j), length, batch, heads, head, even, width)
        q_e, q_o = _plain_row(q_ptr, base_q + t * sq_t, even, sq_m, valid_e, valid_o, CT)
        weight = tl.load(weight_ptr + row, mask=inside, other=0.0)
        total_e, total_o = total_e * gamma + weight * q_e, total_o * gamma + weight * q_o
        grad_e, grad_o = _load_pair(grad_k_ptr, row * width + even, valid_e, valid_o, 0.0, CT)
        if ROTARY:
            grad_e, grad_o = _rotated_at(phases_ptr, key_rows + t, pairs, width, valid_e, grad_e, grad_o, True)
        offset = base_grad + t * gk_t
        tl.store(grad_phi_k_ptr + offset + even * gk_m, grad_e + total_e, mask=valid_e)
        tl.store(grad_phi_k_ptr + offset + (even + 1) * gk_m, grad_o + total_o, mask=valid_o)


def _phase_table(phases, length: int, work: torch.dtype):
    """(the rotations as the kernels read them, (T or 2T, M/2, 2) flattened: the queries' rows, then the
    keys' where they differ; the keys' first row in it).  None without phases."""
    if phases is None:
        return None, 0
    key_rows = 0 if same_rotation(phases) else length
    return torch.view_as_real(phases[:1] if key_rows == 0 else phases).to(work).flatten(0, 1).contiguous(), key_rows


def plain_factors(phi_q, phi_k, phases, *, dot: torch.dtype, guard: float, log_decay: torch.Tensor | None = None):
    """fla's inputs for Eq. 19 in one call, from plain features phi_q, phi_k (B, T, H, M) in fla's layout
    (any strides, any float dtype): q = R phi_q / den and k = R phi_k in `dot` (rotated by the queries'
    and keys' `phases` (2, T, M/2) complex, or None), the denominator den = phi_q . S (B, T, H) (in
    float32, float64 for float64 features; divided by at least `guard`) with the keys' sums
    S_t = sum_{n<=t} phi_k_n, or with log_decay (H,) log gamma (a constant) gamma S_{t-1} + phi_k_t, and S
    at the last token (B, H, M), by the fused kernels."""
    return PlainFactors.apply(phi_q, phi_k, phases, dot, guard, log_decay)


class PlainFactors(torch.autograd.Function):
    """`plain_factors`: one pass forward (after the keys' chunk sums), two backward (the queries' with
    their chunk sums, the keys' from the last token); the chunks' carries by common.linear_carries."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, phases, dot, guard, log_decay):
        work = _sums_dtype(phi_k)
        batch, length, heads, width = phi_k.shape
        table, key_rows = _phase_table(phases, length, work)
        chunks = triton.cdiv(length, CHUNK)
        guard = torch.full((1,), guard, dtype=work, device=phi_k.device)   # filled there: no wait for the GPU
        rate = log_decay.detach().to(work).contiguous() if log_decay is not None else None
        flags = dict(ROTARY=table is not None, DECAY=rate is not None)
        chunk_sums = phi_k.new_empty(batch, chunks, heads, width, dtype=work)
        _factors_launch(_plain_summary_kernel, phi_k, phi_k, _or(rate, guard), chunk_sums, strides=phi_k.stride(),
                        DECAY=flags["DECAY"])
        carry = linear_carries(chunk_sums, rate, CHUNK)
        q, k = (phi_k.new_empty(phi_k.shape, dtype=dot) for _ in range(2))
        den = phi_k.new_empty(batch, length, heads, dtype=work)
        last_sums = phi_k.new_empty(batch, heads, width, dtype=work)
        _factors_launch(_plain_factors_kernel, phi_k, phi_q, phi_k, _or(table, carry), key_rows, carry, guard,
                        _or(rate, guard), q, k, den, last_sums, strides=(*phi_q.stride(), *phi_k.stride()), **flags)
        ctx.save_for_backward(phi_q, phi_k, table, carry, guard, rate, den)
        ctx.key_rows = key_rows
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(last_sums)
        return q, k, den, last_sums

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_den, _):
        phi_q, phi_k, table, carry, guard, rate, den = ctx.saved_tensors
        grad_q, grad_k = (torch.zeros(phi_k.shape, dtype=den.dtype, device=den.device) if grad is None
                          else grad.contiguous() for grad in (grad_q, grad_k))
        grad_den = torch.zeros_like(den) if grad_den is None else grad_den.contiguous()
        flags = dict(ROTARY=table is not None, DECAY=rate is not None)
        table, gamma = _or(table, carry), _or(rate, guard)
        grad_phi_q, grad_phi_k = torch.empty_like(phi_q), torch.empty_like(phi_k)
        weight = torch.empty_like(den)
        chunk_sums = torch.empty_like(carry)
        _factors_launch(_plain_query_grad_kernel, phi_k, phi_q, phi_k, table, carry, guard, gamma, den, grad_q,
                        grad_den, grad_phi_q, weight, chunk_sums,
                        strides=(*phi_q.stride(), *phi_k.stride(), *grad_phi_q.stride()), **flags)
        after = linear_carries(chunk_sums, rate, CHUNK, reverse=True)
        _factors_launch(_plain_key_grad_kernel, phi_k, phi_q, table, ctx.key_rows, gamma, weight, after,
                        grad_k, grad_phi_k, strides=(*phi_q.stride(), *grad_phi_k.stride()), **flags)
        return grad_phi_q, grad_phi_k, None, None, None, None
