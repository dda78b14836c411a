"""Linear attention of log-features in torch ops (the numerics of stable.py), O(N) time and memory on
any device, in dispatch.py's call shape: the `torch` backend's entry for log-features,
`logspace_attention`.

Derivation: docs/derivations.md, "The torch log-space pass (torch_logspace.py)"."""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from ...rotary import rotate_pairs
from .common import (LogProjection, compute_dtype, divide, feature_tensors, first_derivatives_only, log_normalizer,
                     numerator_features, query_key_phases, same_rotation, source_from_parts, source_parts,
                     without_autocast)
from .recurrent import LinearState
from .stable import JUMP_LIMIT, NUMERATOR_CAP, PAIR_SPREAD, numerator_query, numerator_scale
from .torch_plain import nothing_to_attend

STATE_GROUP = 16          # chunks per state saved for backward (cpp_logspace.py saves its states so too)
RUN_ELEMENTS = 2 ** 19    # chunks computed together: at most this many elements per (B, H, G, L, M) tensor


@torch.compiler.disable
def logspace_attention(b, a, v, *, causal: bool, rotary: bool, offset: int, rope_base: float, chunk_size: int,
                       return_state: bool, key_offset: int | None = None, return_log_normalizer: bool = False,
                       log_decay: torch.Tensor | None = None, causal_pass=None):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k, each a tensor or a `LogProjection`
    (the causal op then projects chunk by chunk), in float32 (float64 stays float64) with autocast
    off; outputs in v's dtype.  The queries are rotated at offset.., the keys at key_offset.. (None:
    offset).  The state (if asked) carries F and the keys' next position; with return_log_normalizer
    the rows' log sum_n phi_q . phi_k come last (in the compute dtype).  `log_decay` (H,) log gamma <= 0 (causal
    calls; a constant, no gradient): the pair (m, n) weighted by gamma^(distance in positions), inside the
    chunks' factors (docs/derivations.md, "Decay in the chunks").  Under torch.compile it runs eagerly
    (a graph break): its loop over chunks is Python's, and inductor failed on a ragged
    last chunk ("Exponent must be non-negative").  `causal_pass`: what computes the causal pass, with
    `causal_log_attention`'s arguments and results (None: that function; cpp_logspace.py gives its C++ kernel's)."""
    out_dtype, dtype = v.dtype, compute_dtype(*feature_tensors(b, a), v)
    with torch.autocast(v.device.type, enabled=False):
        b, a = (_to(x, dtype) for x in (b, a))
        out, state, lse = _logspace_attention(b, a, v.to(dtype), causal=causal, rotary=rotary, offset=offset,
                                              key_offset=offset if key_offset is None else key_offset,
                                              base=rope_base, chunk_size=chunk_size,
                                              decay=chunk_decay(log_decay, dtype, offset, key_offset),
                                              causal_pass=causal_pass or causal_log_attention)
    result = (out.to(out_dtype), *((state,) if return_state else ()), *((lse,) if return_log_normalizer else ()))
    return result if len(result) > 1 else result[0]


def _to(x, dtype):
    """In the compute dtype; a projection's inputs in any layout (each chunk's rows are gathered when
    projected), log-feature tensors contiguous."""
    if isinstance(x, LogProjection):
        x = x.to(dtype)
        return x._replace(weight=x.weight.contiguous())
    return x.to(dtype).contiguous()


def chunk_decay(log_decay, dtype: torch.dtype, offset: int, key_offset: int | None):
    """The causal passes' decay: None, or (log gamma (H,) in the compute dtype, detached; the queries' lead
    offset - key_offset, the distance a query has beyond its index's)."""
    if log_decay is None:
        return None
    return log_decay.detach().to(dtype), int(offset) - int(offset if key_offset is None else key_offset)


def _logspace_attention(b, a, v, *, causal, rotary, offset, key_offset, base, chunk_size, causal_pass, decay=None):
    """(out, state, log-normaliser): the state None where the call is not causal."""
    n = v.shape[-2]
    if not causal or n == 0:   # no chunk loop: the log-features themselves
        b, a = (x.materialize() if isinstance(x, LogProjection) else x for x in (b, a))
    m = a.shape[-1]
    if v.shape[:-1].numel() == 0:
        out, state = nothing_to_attend(v, m, v.dtype, position=key_offset + n, return_state=True, log_space=True)
        return out, state, v.new_full(v.shape[:-1], float("-inf"))
    if causal:
        phases = query_key_phases(n, m, offset=offset, key_offset=key_offset, base=base, device=v.device,
                                  dtype=v.dtype) if rotary else None
        out, kv, k_sum, last, lse = causal_pass(b, a, v, phases, chunk_size, base, decay)
        return out, LinearState(kv, k_sum, key_offset + n, last), lse
    with torch.no_grad():   # the scales cancel exactly: no gradient
        feature_scale = a.amax(dim=-2, keepdim=True)
        query_scale = (b + feature_scale).amax(dim=-1, keepdim=True)
    pair_scale = numerator_scale(feature_scale, rotary)
    q_num, k_num = numerator_features(numerator_query(b + pair_scale - query_scale), torch.exp(a - pair_scale),
                                      rotary=rotary, offset=offset, key_offset=key_offset, base=base)
    key_sum = torch.exp(a - feature_scale).sum(-2, keepdim=True)
    denominator = (torch.exp(b + feature_scale - query_scale) * key_sum).sum(-1)
    return (divide(q_num @ (k_num.transpose(-1, -2) @ v), denominator), None,
            log_normalizer(denominator, query_scale.squeeze(-1)))


class _Scales(NamedTuple):
    """The scales of a run of G chunks, (B, H, G, 1, M): F, P at each chunk's first token and at the
    next chunk's, each in its own chunk's frame; with a decay, `step` (H, 1, 1, 1): the chunk's rows times
    log gamma, what a value of one frame gains in the next."""
    feat: torch.Tensor
    pair: torch.Tensor
    feat_next: torch.Tensor
    pair_next: torch.Tensor
    step: torch.Tensor | None = None

    @classmethod
    def of(cls, feat, rotary: bool, step=None):
        """From F (B, H, G + 1, M) at the first token of each chunk of the run and of the chunk after."""
        feat, feat_next = feat[:, :, :-1].unsqueeze(-2), feat[:, :, 1:].unsqueeze(-2)
        return cls(feat, numerator_scale(feat, rotary), feat_next, numerator_scale(feat_next, rotary), step)

    def onward(self, x: torch.Tensor, next_scale: torch.Tensor) -> torch.Tensor:
        """x - next_scale for x in a chunk's frame and next_scale in the next chunk's (+ the step)."""
        return x - next_scale if self.step is None else (x - next_scale) + self.step

    def decays(self):
        """e^(P_k - P_{k+1}) (B, H, G, M, 1) and e^(F_k - F_{k+1}) (B, H, G, M), across frames: both <= 1."""
        return (torch.exp(self.onward(self.pair, self.pair_next)).transpose(-1, -2),
                torch.exp(self.onward(self.feat, self.feat_next)).squeeze(-2))


def _exp(x: torch.Tensor) -> torch.Tensor:
    """e^x with x clamped from below to the smallest normal float's log (exp is ~40x slower where it
    returns subnormals, and such terms are below 1e-37 of a denominator >= 1); in place where no
    gradient is recorded.  Its gradient is e^x's own, also where clamped (a term that small weighs
    nothing), which saves backward a mask."""
    low = math.log(torch.finfo(x.dtype).tiny) + 1
    if torch.is_grad_enabled():
        return _ClampedExp.apply(x, low)
    return x.clamp_min_(low).exp_()


class _ClampedExp(torch.autograd.Function):
    """`_exp` where a gradient is recorded."""

    @staticmethod
    def forward(ctx, x, low):
        y = x.clamp_min(low).exp_()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.saved_tensors[0], None


def _factors(x: torch.Tensor, phases) -> torch.Tensor:
    """e^x, rotated by each row's R where the numerator is rotated."""
    factors = _exp(x)
    return factors if phases is None else rotate_pairs(factors, phases)


class _Chunks(NamedTuple):
    """What `_chunks` computes for a run of G chunks."""
    out: torch.Tensor        # (B, H, G, L, Dv)
    den: torch.Tensor        # (B, H, G, L): denominators
    query_scale: torch.Tensor
    state: torch.Tensor      # the state after the last chunk, (B, H, M, Dv) and (B, H, M)
    key_sum: torch.Tensor


def _chunks(b_j, a_j, v_j, state, key_sum, scales: _Scales, phases, query_scale=None) -> _Chunks:
    """A run of chunks (B, H, G, L, .) given the state before it, with the same ops whatever the data
    (1.-3. of its derivation, docs/derivations.md).  Differentiable: backward is autograd through it.  `query_scale`:
    Q per row if given (it need only be at least the row's own Q minus JUMP_LIMIT), else the row's own.
    phases: the queries' and keys' rotations, (2, G, L, M/2), or None."""
    rotary = phases is not None
    with torch.no_grad():   # the scales cancel exactly: no gradient
        feat_rows = _running_max(torch.maximum(a_j, scales.feat))           # F_m, (B, H, G, L, M)
        pair_rows = numerator_scale(feat_rows, rotary)
        if query_scale is None:
            query_scale = (b_j + feat_rows).amax(-1)
    shifted = b_j - query_scale.unsqueeze(-1)                                # b - Q
    states, key_sums, state, key_sum = _run_states(state, key_sum, a_j, v_j, scales, _keys(phases))
    # 1. the state before each chunk, read at the chunk's first-token scales
    q_den = _exp(shifted + scales.feat)
    q_num = _factors((shifted + scales.pair).clamp_max(NUMERATOR_CAP), phases[0]) if rotary else q_den
    numerator, denominator = _within_chunks(shifted, a_j, v_j, feat_rows, pair_rows, phases)
    numerator = numerator + q_num @ states
    denominator = denominator + (q_den @ key_sums.unsqueeze(-1)).squeeze(-1)
    return _Chunks(divide(numerator, denominator), denominator, query_scale, state, key_sum)


def _within_chunks(shifted, a_j, v_j, feat_rows, pair_rows, phases):
    """3. of the derivation (docs/derivations.md): the sums over n <= m within each chunk, (B, H, G, L, Dv) and
    (B, H, G, L).  The pair (n, m), n < m, is taken at the level of the highest bit in which n and m
    differ (positions within the chunk): n in the left half of a block of 2 x half rows, m in its right
    half, with the scales at the left half's last token as reference, between n and m, so that both
    factors are <= 1 (queries: b + F_e - Q <= b + F_m - Q <= 0; keys: a_n - F_e <= 0).  n = m is its
    own term."""
    rotary = phases is not None
    denominator = _exp(shifted + a_j).sum(-1)
    if rotary and not same_rotation(phases):   # queries and keys at different positions: (R_s x)^T (R_t y)
        own = (_factors((shifted + pair_rows).clamp_max(NUMERATOR_CAP), phases[0])
               * _factors(a_j - pair_rows, phases[1])).sum(-1)
    elif rotary:   # (R_m x)^T (R_m y) = x^T y: the diagonal is unrotated, its query factor capped
        own = _exp((shifted + pair_rows).clamp_max(NUMERATOR_CAP) + a_j - pair_rows).sum(-1)
    else:
        own = denominator
    numerator = own.unsqueeze(-1) * v_j
    length = a_j.shape[-2]
    levels = (length - 1).bit_length()
    if not levels:
        return numerator, denominator
    # Padded to 2^levels rows: keys and queries of factor e^(-inf) (clamped: tiny), zero values, and the
    # last row's scales, so that every factor stays finite and a padded row weighs nothing real.
    padded = [_pad(x, 1 << levels, fill) for x, fill in ((shifted, -math.inf), (a_j, -math.inf), (v_j, 0.0),
                                                          (feat_rows, None), (pair_rows, None))]
    phases = None if not rotary else _pad(phases, 1 << levels, 0.0)
    numerator_levels = torch.zeros_like(padded[2])
    denominator_levels = torch.zeros_like(padded[0][..., 0])
    for level in range(levels):
        half = 1 << level
        (_, q), (k, _), (v_left, _), (feat, _), (pair, _) = (
            x.unflatten(-2, (-1, 2, half)).unbind(-3) for x in padded)
        feat_ref, pair_ref = feat[..., -1:, :], pair[..., -1:, :]     # (..., blocks, 1, M)
        k_den, q_den = _exp(k - feat_ref), _exp(q + feat_ref)
        if rotary:
            left, right = phases.unflatten(-2, (-1, 2, half)).unbind(-3)
            ph_k, ph_q = left[1], right[0]
            k_num = rotate_pairs(_exp(k - pair_ref), ph_k)
            q_num = rotate_pairs(_exp((q + pair_ref).clamp_max(NUMERATOR_CAP)), ph_q)
        else:
            k_num, q_num = k_den, q_den
        # (half 1: the products of 1 x 1 matrices as elementwise ops)
        scores = (q_num * k_num).sum(-1, keepdim=True) if half == 1 else q_num @ k_num.transpose(-1, -2)
        numerator_levels = _add_right(numerator_levels, scores * v_left if half == 1 else scores @ v_left, half)
        denominator_levels = _add_right(denominator_levels.unsqueeze(-1),
                                        (q_den * k_den.sum(-2, keepdim=True)).sum(-1, keepdim=True), half).squeeze(-1)
    return numerator + numerator_levels[..., :length, :], denominator + denominator_levels[..., :length]


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """cummax along the rows of x (..., L, M), by doubling (log2 L maxima over x: torch's cummax along
    a non-last dimension walks the rows one at a time)."""
    step = 1
    while step < x.shape[-2]:
        x = torch.cat([x[..., :step, :], torch.maximum(x[..., step:, :], x[..., :-step, :])], -2)
        step *= 2
    return x


def _pad(x: torch.Tensor, rows: int, fill: float | None) -> torch.Tensor:
    """x (..., L, .) with rows L..rows-1 added: `fill`, or the last row repeated (None)."""
    extra = rows - x.shape[-2]
    if not extra:
        return x
    tail = x[..., -1:, :] if fill is None else x.new_full((*x.shape[:-2], 1, x.shape[-1]), fill)
    return torch.cat([x, tail.expand(*x.shape[:-2], extra, x.shape[-1])], -2)


def _add_right(total: torch.Tensor, right: torch.Tensor, half: int) -> torch.Tensor:
    """total (..., R, .) plus `right` (..., R / (2 half), half, .) on the right half of each block."""
    blocks = total.unflatten(-2, (-1, 2, half))
    return torch.stack([blocks.select(-3, 0), blocks.select(-3, 1) + right], -3).flatten(-4, -2)


def _keys(phases):
    """The keys' rotation of `query_key_phases` (or of its rows), or None."""
    return None if phases is None else phases[1]


def _run_states(state, key_sum, a_j, v_j, scales: _Scales, phases):
    """The states before each chunk of a run, (B, H, G, M, Dv) and (B, H, G, M), and after its last
    (phases: the keys' rotation or None):
    2.'s update as S_{k+1} = e^{P_k - P_{k+1}} S_k + U_k, U_k = sum_n R_n e^{a_n - P_{k+1}} v_n^T
    (key factors <= 1), so that every U_k comes from one batched product and only the decayed sums
    are sequential."""
    pair_decay, feat_decay = scales.decays()
    k_den = _exp(scales.onward(a_j, scales.feat_next))
    k_num = _factors(scales.onward(a_j, scales.pair_next), phases) if phases is not None else k_den
    states, state = _decayed_sums(state, k_num.transpose(-1, -2) @ v_j, pair_decay)
    key_sums, key_sum = _decayed_sums(key_sum, k_den.sum(-2), feat_decay)
    return states, key_sums, state, key_sum


def _decayed_sums(x, updates, decays):
    """x <- decays_k x + updates_k over a run's chunks k (dim 2): x before each chunk's update, stacked
    (B, H, G, ...), and x after the last."""
    befores = []
    for g in range(updates.shape[2]):
        befores.append(x)
        x = torch.addcmul(updates[:, :, g], decays[:, :, g], x)
    return torch.stack(befores, 2), x


class _Run(NamedTuple):
    """`count` chunks of one length from chunk `first` on, computed with batched ops."""
    first: int
    count: int
    tokens: slice

    def part(self, chunks: slice) -> slice:
        """The tokens of some of the run's chunks."""
        length = (self.tokens.stop - self.tokens.start) // self.count
        return slice(self.tokens.start + chunks.start * length, self.tokens.start + chunks.stop * length)


def _runs(v: torch.Tensor, m: int, length: int) -> list[_Run]:
    """The chunks in runs of up to RUN_ELEMENTS per (B, H, G, L, max(M, Dv)) tensor that never straddle
    a group of STATE_GROUP chunks; a ragged last chunk is a run of its own."""
    batch, heads, n, dv = v.shape
    most = max(1, RUN_ELEMENTS // max(1, batch * heads * length * max(m, dv)))   # (an empty batch: any)
    full, runs = n // length, []
    for group in range(0, full, STATE_GROUP):
        end = min(group + STATE_GROUP, full)
        runs += [_Run(first, min(most, end - first), slice(first * length, min(first + most, end) * length))
                 for first in range(group, end, most)]
    return runs + ([_Run(full, 1, slice(full * length, n))] if n % length else [])


def _rows(source, s):
    """Log-features of positions `s` from a log-feature tensor or a `LogProjection` of its rows."""
    return source.rows(s) if isinstance(source, LogProjection) else source[:, :, s]


def _run_inputs(source, run: _Run):
    """A run's log-features (B, H, G, L, M), or its values, contiguous (batched products would
    otherwise copy a slice of the sequence every time they read it)."""
    return _rows(source, run.tokens).contiguous().unflatten(2, (run.count, -1))


def _run_logs(queries, keys, run: _Run, decay):
    """A run's query and key log-features (B, H, G, L, M), each chunk's in its frame (`in_frame`)."""
    return in_frame(_run_inputs(queries, run), decay, True), in_frame(_run_inputs(keys, run), decay, False)


def in_frame(x: torch.Tensor, decay, queries: bool) -> torch.Tensor:
    """Log-features (..., H, G, L, M) of chunks in their chunk's frame, the weights as its first token's
    query sees them (docs/derivations.md, "Decay in the chunks"): a query at row r within its chunk
    + (r + lead) log gamma, a key - r log gamma, so that a pair in the chunk gets (r - c + lead) log gamma
    and every term stays within L |log gamma| of its own; no decay: x itself."""
    if decay is None:
        return x
    log_decay, lead = decay
    rows = torch.arange(x.shape[-2], device=x.device, dtype=x.dtype)
    steps = ((rows + lead) if queries else -rows)[None, :] * log_decay[:, None]    # (H, L)
    return x + steps[:, None, :, None]


def _step(decay, rows: int):
    """The chunk's decay step rows log gamma (H, 1, 1, 1), or None."""
    return None if decay is None else (rows * decay[0])[:, None, None, None]


def _carry_scales(feat, a_r, run: _Run, decay) -> None:
    """F at the first token of each chunk after the run's, frame by frame: F_{k+1} = max(its first key,
    max(F_k, chunk k's keys in its frame) + chunk k's step) (a loop over the run's chunks, as the state's)."""
    ends, step = a_r.amax(-2), _step(decay, a_r.shape[-2])[..., 0, 0]    # (B, H, G, M), (H, 1)
    for g in range(run.count):
        chunk = run.first + g
        feat[:, :, chunk + 1] = torch.maximum(feat[:, :, chunk + 1],
                                              torch.maximum(feat[:, :, chunk], ends[:, :, g]) + step)


def finish_forward(ctx, parts: tuple, length: int, base: float, decay, v, out, den, query_scale, feat, phases, state,
                   key_sum, *extra):
    """The causal function's outputs (out, state, key sum, F after the last token, log-normaliser), with what
    backward needs saved: the sources' parts (numbers such as a constant shift on ctx, tensors through
    autograd), the chunk length, the rotary base, the decay (`chunk_decay`'s), v, out, den, Q, F, the rotation
    and `extra`.  Gradients
    of unused outputs come to backward as None (the log-normaliser's then costs nothing)."""
    ctx.numbers = [None if isinstance(x, torch.Tensor) else x for x in parts]
    ctx.same_rotation = phases is not None and same_rotation(phases)   # then saved once, expanded again
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in parts), v, out, den, query_scale,
                          feat, phases[1] if ctx.same_rotation else phases, *extra)
    ctx.length, ctx.base, ctx.decay = length, base, decay
    last = feat[:, :, -1]
    ctx.mark_non_differentiable(state, key_sum, last)
    ctx.set_materialize_grads(False)
    return out, state, key_sum, last, log_normalizer(den, query_scale)


def saved_sources(ctx):
    """What `finish_forward` saved: the query and key sources, (v, out, den, Q, F, rotation) and `extra`."""
    saved = ctx.saved_tensors
    parts = [x if number is None else number for x, number in zip(saved[:8], ctx.numbers)]
    tensors = saved[8:14]
    if ctx.same_rotation:
        tensors = (*tensors[:5], tensors[5].unsqueeze(0).expand(2, -1, -1))
    return source_from_parts(*parts[:4]), source_from_parts(*parts[4:]), tensors, saved[14:]


class SourceGradients(NamedTuple):
    """Gradients of a source's parts (None where not needed)."""
    inputs: torch.Tensor | None
    weight: torch.Tensor | None
    shift: torch.Tensor | None

    @classmethod
    def of(cls, source, needs):
        """Empty gradients for the parts of `source` that need one (`needs`: inputs, weight, shift)."""
        if not isinstance(source, LogProjection):
            return cls(torch.empty_like(source) if needs[0] else None, None, None)
        return cls(torch.empty_like(source.inputs) if needs[0] else None,
                   torch.zeros_like(source.weight) if needs[1] else None,
                   torch.empty_like(source.shift) if needs[2] else None)

    def write(self, source, d_features, s) -> None:
        """The gradients for positions `s`, given d loss / d log-features there.  For a projection,
        d row shift = the row sums, and the squared norm adds 2 square_scale x d row shift to d x."""
        if not isinstance(source, LogProjection):
            if self.inputs is not None:
                self.inputs[:, :, s] = d_features
            return
        x = source.inputs[:, :, s]
        d_row = d_features.sum(-1, keepdim=True) if self.shift is not None or source.square_scale else None
        if self.inputs is not None:
            d_x = d_features @ source.weight
            self.inputs[:, :, s] = d_x.addcmul_(x, d_row, value=2 * source.square_scale) \
                if source.square_scale else d_x
        if self.shift is not None:
            self.shift[:, :, s] = d_row
        if self.weight is not None:
            self.weight.add_((d_features.transpose(-1, -2) @ x).sum((0, 1)))


class _CausalLogAttention(torch.autograd.Function):
    """Causal Eq. 19 from log-features, each given as a tensor or a `LogProjection` in parts
    (inputs, weight, shift, square_scale; weight None: the inputs are the log-features)."""

    @staticmethod
    def forward(ctx, q_inputs, q_weight, q_shift, q_square, k_inputs, k_weight, k_shift, k_square, v, phases,
                length, base, decay):
        queries = source_from_parts(q_inputs, q_weight, q_shift, q_square)
        keys = source_from_parts(k_inputs, k_weight, k_shift, k_square)
        first_keys = _rows(keys, slice(0, v.shape[-2], length))     # every chunk's first token
        m = first_keys.shape[-1]
        out, den = v.new_empty(v.shape), v.new_empty(v.shape[:-1])
        query_scale = torch.empty_like(den)
        state, key_sum = v.new_zeros(*v.shape[:2], m, v.shape[-1]), v.new_zeros(*v.shape[:2], m)
        # F at every chunk's first token, then after the last (-inf until the runs below fill it in)
        feat = torch.cat([first_keys, torch.full_like(first_keys[:, :, :1], float("-inf"))], 2)
        seen, saved = torch.full_like(key_sum, float("-inf")), []
        for run in _runs(v, m, length):
            if run.first % STATE_GROUP == 0:
                saved += [state, key_sum]
            (b_r, a_r), v_r = _run_logs(queries, keys, run, decay), _run_inputs(v, run)
            # F at the next chunk's first token: the max of every key before it, and of that token
            if decay is None:
                after = torch.maximum(a_r.amax(-2).cummax(2).values, seen.unsqueeze(2))
                seen, nexts = after[:, :, -1], feat[:, :, run.first + 1:run.first + run.count + 1]
                nexts.copy_(torch.maximum(nexts, after))
            else:
                _carry_scales(feat, a_r, run, decay)
            chunks = _chunks(b_r, a_r, v_r, state, key_sum, *_run_scales(feat, run, phases, decay))
            out[:, :, run.tokens], den[:, :, run.tokens], query_scale[:, :, run.tokens] = (
                x.flatten(2, 3) for x in chunks[:3])
            state, key_sum = chunks.state, chunks.key_sum
        return finish_forward(ctx, (q_inputs, q_weight, q_shift, q_square, k_inputs, k_weight, k_shift, k_square),
                              length, base, decay, v, out, den, query_scale, feat, phases, state, key_sum, *saved)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad, _state_grad, _key_sum_grad, _last_grad, lse_grad):
        queries, keys, (v, out, den, query_scale, feat, phases), saved = saved_sources(ctx)
        grad = torch.zeros_like(out) if grad is None else grad
        needs = ctx.needs_input_grad
        q_grads, k_grads = SourceGradients.of(queries, needs[0:3]), SourceGradients.of(keys, needs[4:7])
        dv = torch.empty_like(v)
        later = v.new_zeros(*v.shape[:2], feat.shape[-1], v.shape[-1])    # d loss / d S_{k+1}
        later_sum = v.new_zeros(*v.shape[:2], feat.shape[-1])             # d loss / d Z_{k+1}
        groups = itertools.groupby(_runs(v, feat.shape[-1], ctx.length), lambda run: run.first // STATE_GROUP)
        for group, runs in reversed([(group, list(runs)) for group, runs in groups]):
            state, key_sum = saved[2 * group], saved[2 * group + 1]
            befores = []
            for run in runs:   # this group's states again, as forward took them
                befores.append((state, key_sum))
                scales, ph = _run_scales(feat, run, phases, ctx.decay)
                state, key_sum = _run_states(state, key_sum, in_frame(_run_inputs(keys, run), ctx.decay, False),
                                             _run_inputs(v, run), scales, _keys(ph))[2:]
            for run, (state, key_sum) in reversed(list(zip(runs, befores))):
                chunks = (run.count, -1)
                inputs = (*_run_logs(queries, keys, run, ctx.decay), _run_inputs(v, run))
                qs, g = (x[:, :, run.tokens].unflatten(2, chunks) for x in (query_scale, grad))
                g_lse = None if lse_grad is None else lse_grad[:, :, run.tokens].unflatten(2, chunks)
                (db, da, dv_r), later, later_sum = _chunk_backward(
                    inputs, state, key_sum, *_run_scales(feat, run, phases, ctx.decay), qs, g, later, later_sum,
                    g_lse)
                dv[:, :, run.tokens] = dv_r.flatten(2, 3)
                q_grads.write(queries, db.flatten(2, 3), run.tokens)
                k_grads.write(keys, da.flatten(2, 3), run.tokens)
        return (*q_grads, None, *k_grads, None, dv, None, None, None, None)


def causal_log_attention(b, a, v, phases, chunk_size: int, base: float, decay=None):
    """Causal Eq. 19 from log-features (tensors or `LogProjection`s) in torch ops: (out, state, key sum,
    F after the last token, log-normaliser), the state scaled as docs/derivations.md says (with a decay,
    `chunk_decay`'s, in the frame of the token after the last)."""
    out, kv, k_sum, last, lse = _CausalLogAttention.apply(*source_parts(b), *source_parts(a), v, phases, chunk_size,
                                                          base, decay)
    return first_derivatives_only(out), kv, k_sum, last, first_derivatives_only(lse)


def _run_scales(feat, run: _Run, phases, decay=None):
    """A run's scales, from F (B, H, chunks + 1, M), and the rotations of its tokens (2, G, L, M/2) or None."""
    rows = (run.tokens.stop - run.tokens.start) // run.count
    scales = _Scales.of(feat[:, :, run.first:run.first + run.count + 1], phases is not None, _step(decay, rows))
    return scales, None if phases is None else phases[:, run.tokens].unflatten(1, (run.count, -1))


def _chunk_backward(inputs, state, key_sum, scales, phases, query_scale, grad, later, later_sum, lse_grad=None):
    """4. of the derivation (docs/derivations.md): autograd through a run's recomputed forward, given the state before
    it and d loss / d S, d loss / d Z after it (and d loss / d log-normaliser, or None): the gradients of b,
    a, v, and d loss / d S, d loss / d Z before the run."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (*inputs, state, key_sum)]
        chunks = _chunks(*leaves, scales, phases, query_scale)
        outputs, given = [chunks.out, chunks.state, chunks.key_sum], [grad, later, later_sum]
        if lse_grad is not None:   # Q is a constant of the chunks: the log-normaliser is log(den) + Q
            outputs.append(log_normalizer(chunks.den, query_scale))
            given.append(lse_grad)
        grads = torch.autograd.grad(outputs, leaves, given)
    return grads[:3], grads[3], grads[4]


def _chunk_inputs(chunk: int, queries, keys, v, phases, feat, length: int, decay=None):
    """One chunk's (b, a, v) as (B, H, 1, L, .), its scales and its rotation, for the functions above."""
    s = slice(chunk * length, min((chunk + 1) * length, v.shape[-2]))
    b, a, v_c = (_rows(x, s).contiguous().unsqueeze(2) for x in (queries, keys, v))
    b, a = in_frame(b, decay, True), in_frame(a, decay, False)
    scales = _Scales.of(feat[:, :, chunk:chunk + 2], phases is not None, _step(decay, s.stop - s.start))
    return s, (b, a, v_c), scales, None if phases is None else phases[:, s].unsqueeze(1)


def irregular_chunk_forward(chunk, queries, keys, v, phases, feat, length, base, state, key_sum, out, den,
                            query_scale, decay=None):
    """A kernel's irregular chunk (cpp_logspace.py's: a row's running max jumped past JUMP_LIMIT, or a
    pair's scales spread past PAIR_SPREAD), by `_chunks`: rows before the jump keep the kernel's values in
    `out`, `den`, `query_scale` (unless the chunk is wide, then redone whole; whether it is depends on
    earlier tokens only), so that whether a later token jumps never changes their bits; the state after
    it replaces `state`, `key_sum`."""
    del base
    s, inputs, scales, ph = _chunk_inputs(chunk, queries, keys, v, phases, feat, length, decay)
    alone = _chunks(*inputs, state, key_sum, scales, ph)
    jump = (torch.maximum(inputs[1], scales.feat).cummax(-2).values - scales.feat).amax(-1).squeeze(2)
    redo = (jump > JUMP_LIMIT) | ((scales.pair - scales.feat).amax() > PAIR_SPREAD)
    for target, x in zip((out, den, query_scale), alone[:3]):
        target[:, :, s] = torch.where(redo.unsqueeze(-1) if x.dim() == 5 else redo, x.squeeze(2), target[:, :, s])
    state.copy_(alone.state)
    key_sum.copy_(alone.key_sum)


def irregular_chunk_backward(chunk, queries, keys, v, phases, feat, length, base, state, key_sum, grad, out, den,
                             query_scale, later, later_sum, q_grads: SourceGradients, k_grads: SourceGradients, dv,
                             capped: bool, lse_grad=None, decay=None):
    """The backward of one irregular chunk for a kernel (cpp_logspace.py's), updating `later`, `later_sum`
    and writing the chunk's gradients.  (`base`, `out`, `den` and the kernel's flag `capped` are not
    needed: every chunk takes autograd through `_chunks` with the saved Q.)"""
    del base, out, den, capped
    s, inputs, scales, ph = _chunk_inputs(chunk, queries, keys, v, phases, feat, length, decay)
    qs, g = query_scale[:, :, s].unsqueeze(2), grad[:, :, s].unsqueeze(2)
    g_lse = None if lse_grad is None else lse_grad[:, :, s].unsqueeze(2)
    (db, da, dv_c), after, after_sum = _chunk_backward(inputs, state, key_sum, scales, ph, qs, g, later, later_sum,
                                                       g_lse)
    later.copy_(after)
    later_sum.copy_(after_sum)
    dv[:, :, s] = dv_c.squeeze(2)
    q_grads.write(queries, db.squeeze(2), s)
    k_grads.write(keys, da.squeeze(2), s)
