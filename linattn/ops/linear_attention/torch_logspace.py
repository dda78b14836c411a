"""Linear attention of log-features in torch ops (the numerics of stable.py), O(N) time and memory on
any device, in dispatch.py's call shape: the `torch` backend's entry for log-features,
`logspace_attention`.


Log-features (b = log phi_q, a = log phi_k, with stable.py's running maxima F, P and Q).
Causal, in chunks of L tokens (L = chunk_size), the structure of gated linear attention kernels,
with the decay applied between chunks only.  Chunk k works relative to the scales r_k = F, P at its
first token s_k, a past position for every row of the chunk (1.-3. say how; 4. gives the backward):

1. the scales F_k, P_k (B, H, M) per chunk, and per row Q_m = max_j (b_mj + F_k,j): the scale
   factors cancel exactly in the output, so no gradient flows through them.  The denominator still
   holds the term e^(b_mj* + a_n*j* - Q_m) = 1 of the feature j* reaching Q_m (n* <= s_k <= m);
2. inter-chunk: the state before chunk k+1 is kept scaled to r_{k+1}:
       S_{k+1} = e^{P_k - P_{k+1}} (S_k + sum_{n in k} R_n e^{a_n - P_k} v_n^T)
   (the decay is constant over a rotation pair, so it commutes with R_n), likewise
   Z_{k+1} = e^{F_k - F_{k+1}} (Z_k + sum_{n in k} e^{a_n - F_k}).  Query m in chunk k reads
   (R_m e^{b_m + P_k - Q_m})^T S_k and e^{b_m + F_k - Q_m} . Z_k;
3. intra-chunk (n <= m, both in the chunk), separable with the same scales: query factors
   e^{b_m + r - Q_m} (<= 1 for the denominator) times key factors e^{a_n - r}, which is safe while
   the running max of row m grew by at most JUMP_LIMIT (30) since s_k: no factor overflows, and a
   term lost to underflow is below e^-57 of the denominator.  Rows whose max jumped further (early
   tokens and outliers) take Q_m from their own running max F_m and are recomputed exactly, every
   term exponentiated on its own:
       den(m, n) = sum_j e^{b_mj + a_nj - Q_m}
       num(m, n) = sum_i cos(phi) (e^{b_m,2i + a_n,2i - Q_m} + e^{b_m,2i+1 + a_n,2i+1 - Q_m})
                       + sin(phi) (e^{b_m,2i + a_n,2i+1 - Q_m} - e^{b_m,2i+1 + a_n,2i - Q_m})
   with phi = (m - n) theta_i, since (R_m x)^T (R_n y) = Re((x_1 + i x_2)(y_1 - i y_2) e^{i phi});
   that costs 2 L M exps per such row.  Key factors are capped at e^JUMP_LIMIT, which only touches
   keys that are masked or in rows computed exactly, and such a chunk feeds the next state with
   e^{a_n - P_{k+1}} <= 1 directly instead of through the capped factors of 2.
4. backward (custom autograd, as the plain path's `_CausalAttention` below): the loop runs again in reverse,
   recomputing each chunk's factors rather than saving them.  What is saved is the inputs, the
   output, the denominators, Q, the scales and one state every STATE_GROUP chunks; a group's
   states are recomputed before it is walked in reverse.  With g = d loss / d out, the output
   gives g_num = g / den and g_den = -(g . out) / den per row; then, per chunk, with A the masked
   scores (R q_num)(R k_num)^T and G = d loss / d S_{k+1} carried from the chunk after:
       G~ = e^{P_k - P_{k+1}} G                           (d loss / d (S_k + K^T v))
       d(R q_num) = g_num S_k^T + tril(g_num v^T) (R k_num)
       d(R k_num) = tril(g_num v^T)^T (R q_num) + v G~^T,     dv = A^T g_num + (R k_num) G~
       d q_den = g_den (Z_k + running sums of k_den),    d k_den = suffix sums of g_den q_den + H~
       d S_k = G~ + (R q_num)^T g_num,                    d Z_k = H~ + sum_m g_den_m q_den_m
   (H~ = e^{F_k - F_{k+1}} H for Z), rotated back by R^T, and through the exponentials
   d b = d q_num q_num + d q_den q_den, d a = d k_num k_num + d k_den k_den (zero where capped).
   A chunk with exactly computed rows is rare; its backward is autograd through its recomputed
   forward.
5. cost: per chunk a handful of (L x M) exponentials (numerator factors are the denominator's
   times e^(P - F) while a pair's scales stay within PAIR_SPREAD; exponents below the normal
   range are clamped, since exp is ~40x slower where it returns subnormals) and (L x M) @ (M x Dv)
   products.  Log-features may come as a `LogProjection` (inputs @ W^T + shift, FAVOR+'s form):
   each chunk then projects its own rows, so neither the (B, H, N, M) log-features nor their
   gradients are ever held, and backward hands back the gradients of the (B, H, N, D) inputs.
6. runs: chunks are computed G at a time as (B, H, G, L, .) tensors (up to RUN_ELEMENTS elements
   each, within one group of STATE_GROUP chunks), so that one op serves G chunks: only the state
   sums S_{k+1} = e^{P_k - P_{k+1}} S_k + U_k, and their reverse in backward, run chunk by chunk.
   Every run is first computed whole as if no chunk had exact rows or wide pairs, so that its
   shapes and paths depend on N alone (a batched product or the complex rotation may round a chunk
   differently when the batch differs); from the first chunk that has them on, chunks are redone
   one at a time, and in that chunk the rows before the jump keep the run's values.  So a later
   token that jumps changes no earlier output's bits (test_stable checks shapes where it did).

Nothing at position m reads a position after m (the keys after m in its chunk are masked, and
their factors are capped so that nothing masked is inf), and every reduction has the same shape
whatever comes later, so past outputs are bitwise unchanged when future tokens change.

On CPU the C++ kernel (cpp_logspace.py, stable_cpu.cpp) runs the regular chunks of the causal
log-space pass one (head, chunk) at a time, and hands the chunks with exact rows or wide pairs back to this module
(`irregular_chunk_forward`, `irregular_chunk_backward`).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from ...rotary import rotary_phases, rotate_pairs
from .common import (LogProjection, compute_dtype, divide, feature_tensors, numerator_features, output_gradients,
                     source_from_parts, source_parts, without_autocast)
from .recurrent import LinearState
from .stable import JUMP_LIMIT, NUMERATOR_CAP, PAIR_SPREAD, numerator_query, numerator_scale
from .torch_plain import nothing_to_attend

EXACT_ELEMENTS = 2 ** 22  # exact rows per pass: rows * L * M elements
STATE_GROUP = 16          # chunks per state saved for backward (cpp_logspace.py saves its states so too)
RUN_ELEMENTS = 2 ** 19    # chunks computed together: at most this many elements per (B, H, G, L, M) tensor


@torch.compiler.disable
def logspace_attention(b, a, v, *, causal: bool, rotary: bool, offset: int, rope_base: float, chunk_size: int,
                       return_state: bool, causal_pass=None):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k, each a tensor or a `LogProjection`
    (the causal op then projects chunk by chunk), in float32 (float64 stays float64) with autocast
    off; outputs in v's dtype.  The state (if asked) carries F.  Under torch.compile it runs eagerly
    (a graph break): its chunk loop takes decisions from the data, and inductor failed on a ragged
    last chunk ("Exponent must be non-negative").  `causal_pass`: what computes the causal pass, with
    `causal_log_attention`'s arguments and results (None: that function; cpp_logspace.py gives its C++ kernel's)."""
    out_dtype, dtype = v.dtype, compute_dtype(*feature_tensors(b, a), v)
    with torch.autocast(v.device.type, enabled=False):
        b, a = (_to(x, dtype) for x in (b, a))
        result = _logspace_attention(b, a, v.to(dtype), causal=causal, rotary=rotary, offset=offset,
                                       base=rope_base, chunk_size=chunk_size, return_state=return_state,
                                       causal_pass=causal_pass or causal_log_attention)
    return (result[0].to(out_dtype), result[1]) if return_state else result.to(out_dtype)


def _to(x, dtype):
    """In the compute dtype; a projection's inputs in any layout (each chunk's rows are gathered when
    projected), log-feature tensors contiguous."""
    if isinstance(x, LogProjection):
        return x._replace(inputs=x.inputs.to(dtype), weight=x.weight.to(dtype).contiguous(),
                          shift=x.shift.to(dtype) if isinstance(x.shift, torch.Tensor) else x.shift)
    return x.to(dtype).contiguous()


def _logspace_attention(b, a, v, *, causal, rotary, offset, base, chunk_size, return_state, causal_pass):
    n = v.shape[-2]
    if not causal or n == 0:   # no chunk loop: the log-features themselves
        b, a = (x.materialize() if isinstance(x, LogProjection) else x for x in (b, a))
    m = a.shape[-1]
    if v.shape[:-1].numel() == 0:
        return nothing_to_attend(v, m, v.dtype, position=offset + n, return_state=return_state, log_space=True)
    if causal:
        phases = rotary_phases(n, m, offset=offset, base=base, device=v.device, dtype=v.dtype) \
            if rotary else None
        out, kv, k_sum, last = causal_pass(b, a, v, phases, chunk_size, base)
        return (out, LinearState(kv, k_sum, offset + n, last)) if return_state else out
    with torch.no_grad():   # the scales cancel exactly: no gradient
        feature_scale = a.amax(dim=-2, keepdim=True)
        query_scale = (b + feature_scale).amax(dim=-1, keepdim=True)
    pair_scale = numerator_scale(feature_scale, rotary)
    q_num, k_num = numerator_features(numerator_query(b + pair_scale - query_scale), torch.exp(a - pair_scale),
                                      rotary=rotary, offset=offset, base=base)
    key_sum = torch.exp(a - feature_scale).sum(-2, keepdim=True)
    denominator = (torch.exp(b + feature_scale - query_scale) * key_sum).sum(-1)
    return divide(q_num @ (k_num.transpose(-1, -2) @ v), denominator)


class _Scales(NamedTuple):
    """The scales of a run of G chunks, (B, H, G, 1, M): F, P at each chunk's first token and at the
    next chunk's."""
    feat: torch.Tensor
    pair: torch.Tensor
    feat_next: torch.Tensor
    pair_next: torch.Tensor

    @classmethod
    def of(cls, feat, rotary: bool):
        """From F (B, H, G + 1, M) at the first token of each chunk of the run and of the chunk after."""
        feat, feat_next = feat[:, :, :-1].unsqueeze(-2), feat[:, :, 1:].unsqueeze(-2)
        return cls(feat, numerator_scale(feat, rotary), feat_next, numerator_scale(feat_next, rotary))

    def part(self, chunks: slice) -> "_Scales":
        return _Scales(*(x[:, :, chunks] for x in self))

    def decays(self):
        """e^(P_k - P_{k+1}) (B, H, G, M, 1) and e^(F_k - F_{k+1}) (B, H, G, M): both <= 1."""
        return (torch.exp(self.pair - self.pair_next).transpose(-1, -2),
                torch.exp(self.feat - self.feat_next).squeeze(-2))


class _Factors(NamedTuple):
    """A run's query or key factors (B, H, G, L, M): the denominator's and the (rotated) numerator's."""
    den: torch.Tensor      # keys e^min(a - F, JUMP_LIMIT), queries e^(b + F - Q)
    num: torch.Tensor      # keys e^min(a - P, JUMP_LIMIT), queries e^min(b + P - Q, NUMERATOR_CAP)
    rotated: torch.Tensor  # R num
    ratio: torch.Tensor | None   # num / den, (1, M) per chunk, where num was computed that way
    capped: torch.Tensor | bool  # keys: whether one jumped past JUMP_LIMIT (the chunk has exact rows);
    #                              queries: where the cap acts (False: nowhere)

    def part(self, chunks: slice) -> "_Factors":
        return _Factors(*(x[:, :, chunks] if isinstance(x, torch.Tensor) else x for x in self))


def _exp(x: torch.Tensor, high: float | None = None) -> torch.Tensor:
    """e^x with x clamped from below to the smallest normal float's log (exp is ~40x slower where it
    returns subnormals, and such terms are below 1e-37 of a denominator >= 1), and from above to
    `high` if given; in place where no gradient is recorded."""
    low = math.log(torch.finfo(x.dtype).tiny) + 1
    if torch.is_grad_enabled():
        return x.clamp(low, high).exp()
    return x.clamp_(low, high).exp_()


def _keys(a_j, scales: _Scales, phases, regular: bool = False):
    """The key factors, and how far each row's running max grew since its chunk's first token (None
    where the chunks are taken as `regular`: without exact rows, see `_chunks`)."""
    shifted = a_j - scales.feat
    jump = None if regular else shifted.amax(-1).cummax(-1).values                 # (B, H, G, L)
    capped = not regular and bool(jump[..., -1].amax() > JUMP_LIMIT)
    den = _exp(shifted, JUMP_LIMIT if capped else None)
    if phases is None:
        return jump, _Factors(den, den, den, None, capped)
    # e^(a - P) = e^(a - F) e^(F - P): exact where uncapped, finite where capped (keys that are masked
    # or in exact rows); it underflows only where e^(a - F) e^(F - P) < e^-57 of its pair's max key.
    ratio = torch.exp(scales.feat - scales.pair)
    num = den * ratio
    return jump, _Factors(den, num, rotate_pairs(num, phases), ratio, capped)


def _wide_chunks(scales: _Scales) -> torch.Tensor | None:
    """Per chunk of a run, (G,): whether a pair's partner leads some key scale by more than
    PAIR_SPREAD (positions <= s_k); None without rotation."""
    if scales.pair is scales.feat:
        return None
    return (scales.pair - scales.feat).amax((0, 1, 3, 4)) > PAIR_SPREAD


def _wide(scales: _Scales) -> bool:
    """Whether any chunk of the run has wide pairs."""
    wide = _wide_chunks(scales)
    return wide is not None and bool(wide.any())


def _query_scale(b_j, a_j, scales: _Scales, exact):
    """Q_m = max_j (b_mj + F_k,j), from the scales at the chunk's first token.  Rows computed exactly,
    and every row of a chunk with wide pairs, take F from their own running max F_m instead: the
    numerator cap is then measured against the row's own Q_m, so it acts only where Eq. 19 itself
    is beyond e^NUMERATOR_CAP."""
    wide = _wide(scales)
    if not wide and not exact.any():
        return (b_j + scales.feat).amax(-1)
    own = (b_j + torch.maximum(a_j, scales.feat).cummax(-2).values).amax(-1)
    return own if wide else torch.where(exact, own, (b_j + scales.feat).amax(-1))


def _queries(b_j, query_scale, scales: _Scales, phases, regular: bool = False):
    shifted = b_j - query_scale.unsqueeze(-1)
    den = _exp(shifted + scales.feat)
    if phases is None:
        return _Factors(den, den, den, None, False)
    if regular or not _wide(scales):             # e^(b + P - Q) = e^(b + F - Q) e^(P - F) <= e^PAIR_SPREAD
        ratio = torch.exp(scales.pair - scales.feat)
        num, capped = den * ratio, False
    else:                                        # a wide pair: its own exponential, capped
        logit = shifted + scales.pair
        ratio, capped = None, logit > NUMERATOR_CAP
        num = _exp(logit, NUMERATOR_CAP)   # the mask above is taken first, so logit may be overwritten
    return _Factors(den, num, rotate_pairs(num, phases), ratio, capped)


def _first_irregular(a, scales: _Scales) -> int:
    """The first chunk of a run with exact rows (a key past JUMP_LIMIT) or wide pairs, else G."""
    jumps = (a.amax(-2) - scales.feat.squeeze(-2)).amax((0, 1, 3)) > JUMP_LIMIT                  # (G,)
    if (wide := _wide_chunks(scales)) is not None:
        jumps |= wide
    return int(jumps.int().argmax()) if bool(jumps.any()) else a.shape[2]


class _Chunks(NamedTuple):
    """What `_chunks` computes for a run of G chunks."""
    out: torch.Tensor        # (B, H, G, L, Dv)
    den: torch.Tensor        # (B, H, G, L): denominators
    query_scale: torch.Tensor
    states: torch.Tensor     # (B, H, G, M, Dv) and (B, H, G, M): the states before each chunk
    key_sums: torch.Tensor
    state: torch.Tensor      # and after the last
    key_sum: torch.Tensor
    exact: torch.Tensor | None   # (B, H, G, L): the rows computed exactly


def _chunks(b_j, a_j, v_j, state, key_sum, scales: _Scales, phases, base, query_scale=None,
            regular: bool = False) -> _Chunks:
    """A run of chunks (B, H, G, L, .) given the state before it.  `regular`: every chunk is taken as
    one without exact rows or wide pairs, so that no decision depends on the run's data and each
    chunk's bits depend on its own tokens only (the caller redoes the chunks from the first that is
    not); otherwise such decisions are taken for the whole call (then one chunk).  Differentiable:
    the backward of a chunk with exact rows runs autograd through it."""
    jump, keys = _keys(a_j, scales, phases, regular)
    exact = None if regular else jump > JUMP_LIMIT
    if query_scale is None:
        query_scale = (b_j + scales.feat).amax(-1) if regular else _query_scale(b_j, a_j, scales, exact)
    queries = _queries(b_j, query_scale, scales, phases, regular)
    states, key_sums, state, key_sum = _run_states(state, key_sum, keys, a_j, v_j, scales, phases)
    scores = (queries.rotated @ keys.rotated.transpose(-1, -2)).tril_()
    numerator = _fma(queries.rotated @ states, scores, v_j)
    # the unrotated denominator (rotary: its own L x L scores; else the numerator's)
    den_scores = (queries.den @ keys.den.transpose(-1, -2)).tril_() if phases is not None else scores
    denominator = den_scores.sum(-1) + (queries.den @ key_sums.unsqueeze(-1)).squeeze(-1)
    rows = () if regular else exact.nonzero(as_tuple=True)
    if rows and rows[0].numel():   # these rows' intra-chunk parts are replaced; their state parts stay
        chunk = rows[:-1]
        exact_num, exact_den = _exact_rows(rows, b_j - query_scale.unsqueeze(-1), a_j, v_j, base=base,
                                           rotary=phases is not None)
        numerator = numerator.index_put(rows, (queries.rotated[rows].unsqueeze(-2) @ _per_row(states, chunk))
                                        .squeeze(-2) + exact_num)
        denominator = denominator.index_put(rows, (queries.den[rows] * _per_row(key_sums, chunk)).sum(-1)
                                            + exact_den)
    return _Chunks(divide(numerator, denominator), denominator, query_scale, states, key_sums, state,
                   key_sum, exact)


def _run_forward(b_r, a_r, v_r, state, key_sum, scales: _Scales, phases, base):
    """A run's outputs, denominators and Q, (B, H, G, L, .), and the state after it: the whole run as
    regular, then from its first chunk with exact rows or wide pairs on, one chunk at a time."""
    batched = _chunks(b_r, a_r, v_r, state, key_sum, scales, phases, base, regular=True)
    outs, state, key_sum = [batched.out, batched.den, batched.query_scale], batched.state, batched.key_sum
    first = _first_irregular(a_r, scales)
    if first < a_r.shape[2]:
        state, key_sum = batched.states[:, :, first], batched.key_sums[:, :, first]
    for g in range(first, a_r.shape[2]):
        alone = _irregular_chunk(b_r, a_r, v_r, batched, g, state, key_sum, scales, phases, base,
                                 first=g == first)
        for x, y in zip(outs, alone[:3]):
            x[:, :, g:g + 1] = y
        state, key_sum = alone.state, alone.key_sum
    return outs, state, key_sum


def _irregular_chunk(b_r, a_r, v_r, run: _Chunks, g: int, state, key_sum, scales: _Scales, phases, base,
                     first: bool) -> _Chunks:
    """Chunk g of a run, alone, from the state before it.  In the run's `first` irregular chunk the
    rows before a jump keep the run's values, so that whether later tokens jump never changes their
    bits (whether a chunk is wide depends on earlier tokens only: a wide one is redone whole)."""
    one = slice(g, g + 1)
    alone = _chunks(b_r[:, :, one], a_r[:, :, one], v_r[:, :, one], state, key_sum, scales.part(one),
                    None if phases is None else phases[one], base)
    if not first or _wide(scales.part(one)):
        return alone
    keep = alone.exact.logical_not()
    mixed = [torch.where(keep.unsqueeze(-1) if x.dim() == 5 else keep, x_run[:, :, one], x)
             for x, x_run in ((alone.out, run.out), (alone.den, run.den), (alone.query_scale, run.query_scale))]
    return alone._replace(out=mixed[0], den=mixed[1], query_scale=mixed[2])


def _run_states(state, key_sum, keys: _Factors, a_j, v_j, scales: _Scales, phases):
    """The states before each chunk of a run, (B, H, G, M, Dv) and (B, H, G, M), and after its last:
    2.'s update as S_{k+1} = e^{P_k - P_{k+1}} S_k + U_k, U_k = e^{P_k - P_{k+1}} sum_n R_n k_n v_n^T,
    so that every U_k comes from one batched product and only the decayed sums are sequential."""
    pair_decay, feat_decay = scales.decays()
    if not keys.capped:
        updates = (keys.rotated.transpose(-1, -2) @ v_j).mul_(pair_decay)
        sum_updates = keys.den.sum(-2).mul_(feat_decay)
    else:   # keys past the cap feed the next state with e^(a - r_{k+1}) <= 1 instead
        k_state = torch.exp(a_j - scales.pair_next)
        k_state = k_state if phases is None else rotate_pairs(k_state, phases)
        updates = k_state.transpose(-1, -2) @ v_j
        sum_updates = torch.exp(a_j - scales.feat_next).sum(-2)
    states, state = _decayed_sums(state, updates, pair_decay)
    key_sums, key_sum = _decayed_sums(key_sum, sum_updates, feat_decay)
    return states, key_sums, state, key_sum


def _decayed_sums(x, updates, decays, reverse: bool = False):
    """x <- decays_k x + updates_k over a run's chunks k (dim 2), from the last back with `reverse`:
    x before each chunk's update, stacked (B, H, G, ...) in chunk order, and x after the last."""
    chunks = range(updates.shape[2])
    befores = []
    for g in reversed(chunks) if reverse else chunks:
        befores.append(x)
        x = torch.addcmul(updates[:, :, g], decays[:, :, g], x)
    return torch.stack(befores[::-1] if reverse else befores, 2), x


def _fma(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c + a @ b for (..., ., .) tensors in one BLAS call (no separate pass to add)."""
    batch = c.shape[:-2]
    return torch.baddbmm(c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3)).unflatten(0, batch)


def _past(x: torch.Tensor) -> torch.Tensor:
    """tril(ones(L, L)) for x's chunk length, dtype and device."""
    length = x.shape[-2]
    return torch.ones(length, length, dtype=x.dtype, device=x.device).tril_()


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


def finish_forward(ctx, parts: tuple, length: int, base: float, v, out, den, query_scale, feat, phases, state,
                   key_sum, *extra):
    """The causal function's outputs (out, state, key sum, F after the last token), with what backward
    needs saved: the sources' parts (numbers such as a constant shift on ctx, tensors through
    autograd), the chunk length, the rotary base, v, out, den, Q, F, the rotation and `extra`."""
    ctx.numbers = [None if isinstance(x, torch.Tensor) else x for x in parts]
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in parts), v, out, den, query_scale,
                          feat, phases, *extra)
    ctx.length, ctx.base = length, base
    last = feat[:, :, -1]
    ctx.mark_non_differentiable(state, key_sum, last)
    return out, state, key_sum, last


def saved_sources(ctx):
    """What `finish_forward` saved: the query and key sources, (v, out, den, Q, F, rotation) and `extra`."""
    saved = ctx.saved_tensors
    parts = [x if number is None else number for x, number in zip(saved[:8], ctx.numbers)]
    return source_from_parts(*parts[:4]), source_from_parts(*parts[4:]), saved[8:14], saved[14:]


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
                length, base):
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
            b_r, a_r, v_r = _run_inputs(queries, run), _run_inputs(keys, run), _run_inputs(v, run)
            # F at the next chunk's first token: the max of every key before it, and of that token
            after = torch.maximum(a_r.amax(-2).cummax(2).values, seen.unsqueeze(2))
            seen, nexts = after[:, :, -1], feat[:, :, run.first + 1:run.first + run.count + 1]
            nexts.copy_(torch.maximum(nexts, after))
            outs, state, key_sum = _run_forward(b_r, a_r, v_r, state, key_sum, *_run_scales(feat, run, phases), base)
            out[:, :, run.tokens], den[:, :, run.tokens], query_scale[:, :, run.tokens] = (
                x.flatten(2, 3) for x in outs)
        return finish_forward(ctx, (q_inputs, q_weight, q_shift, q_square, k_inputs, k_weight, k_shift, k_square),
                              length, base, v, out, den, query_scale, feat, phases, state, key_sum, *saved)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad, _state_grad, _key_sum_grad, _last_grad):
        queries, keys, (v, out, den, query_scale, feat, phases), saved = saved_sources(ctx)
        needs = ctx.needs_input_grad
        q_grads, k_grads = SourceGradients.of(queries, needs[0:3]), SourceGradients.of(keys, needs[4:7])
        dv = torch.empty_like(v)
        later = v.new_zeros(*v.shape[:2], feat.shape[-1], v.shape[-1])    # d loss / d S_{k+1}
        later_sum = v.new_zeros(*v.shape[:2], feat.shape[-1])             # d loss / d Z_{k+1}
        groups = itertools.groupby(_runs(v, feat.shape[-1], ctx.length), lambda run: run.first // STATE_GROUP)
        for group, runs in reversed([(group, list(runs)) for group, runs in groups]):
            state, key_sum = saved[2 * group], saved[2 * group + 1]
            walk = []
            for run in runs:   # this group's states again, as forward took them, keeping the key factors
                pieces, state, key_sum = _recomputed_pieces(run, keys, v, feat, phases, state, key_sum)
                walk += pieces
            for s, (a_p, v_p, scales, ph), factors, states, key_sums in reversed(walk):
                chunks = a_p.shape[2:4]
                inputs = (_rows(queries, s).unflatten(2, chunks), a_p, v_p)
                qs = query_scale[:, :, s].unflatten(2, chunks)
                g = grad[:, :, s].unflatten(2, chunks)
                if factors.capped:   # a run of one chunk
                    (db, da, dv_p), later, later_sum = _chunk_backward_autograd(
                        inputs, states[:, :, 0], key_sums[:, :, 0], scales, ph, ctx.base, qs, g, later, later_sum)
                else:
                    g_num, g_den = output_gradients(g, out[:, :, s].unflatten(2, chunks),
                                                    den[:, :, s].unflatten(2, chunks))
                    (db, da, dv_p), later, later_sum = _chunk_backward(
                        inputs, states, key_sums, factors, scales, ph, qs, g_num, g_den, later, later_sum)
                dv[:, :, s] = dv_p.flatten(2, 3)
                q_grads.write(queries, db.flatten(2, 3), s)
                k_grads.write(keys, da.flatten(2, 3), s)
        return (*q_grads, None, *k_grads, None, dv, None, None, None)


def causal_log_attention(b, a, v, phases, chunk_size: int, base: float):
    """Causal Eq. 19 from log-features (tensors or `LogProjection`s) in torch ops: (out, state, key sum,
    F after the last token), the state scaled as the module docstring says."""
    return _CausalLogAttention.apply(*source_parts(b), *source_parts(a), v, phases, chunk_size, base)


def _recomputed_pieces(run: _Run, keys, v, feat, phases, state, key_sum):
    """A run's chunks as forward took them: the ones before its first irregular chunk together, then
    one at a time.  Each piece is (tokens, (a, v, scales, phases), key factors, the states before its
    chunks, their key sums); also returned: the state after the run."""
    scales, ph = _run_scales(feat, run, phases)
    a_r, v_r = _run_inputs(keys, run), _run_inputs(v, run)

    def inputs(part: slice):
        return a_r[:, :, part], v_r[:, :, part], scales.part(part), None if ph is None else ph[part]

    factors = _keys(a_r, scales, ph, regular=True)[1]
    states, key_sums, state_after, key_sum_after = _run_states(state, key_sum, factors, a_r, v_r, scales, ph)
    first = _first_irregular(a_r, scales)
    prefix = slice(0, first)
    pieces = [(run.part(prefix), inputs(prefix), factors.part(prefix), states[:, :, prefix],
               key_sums[:, :, prefix])] if first else []
    if first == run.count:
        return pieces, state_after, key_sum_after
    state, key_sum = states[:, :, first], key_sums[:, :, first]
    for g in range(first, run.count):
        one = inputs(slice(g, g + 1))
        one_factors = _keys(one[0], one[2], one[3])[1]
        one_states, one_sums, state, key_sum = _run_states(state, key_sum, one_factors, *one)
        pieces.append((run.part(slice(g, g + 1)), one, one_factors, one_states, one_sums))
    return pieces, state, key_sum


def _run_scales(feat, run: _Run, phases):
    """A run's scales, from F (B, H, chunks + 1, M), and the rotation of its tokens (G, L, M/2) or None."""
    scales = _Scales.of(feat[:, :, run.first:run.first + run.count + 1], phases is not None)
    return scales, None if phases is None else phases[run.tokens].unflatten(0, (run.count, -1))


def _chunk_backward(inputs, states, key_sums, keys: _Factors, scales: _Scales, phases, query_scale,
                    g_num, g_den, later, later_sum):
    """4. of the module docstring for a run of chunks without exact rows (no key factor capped), given
    the states before each chunk and d loss / d S, d loss / d Z after the run: the gradients of b, a, v,
    and d loss / d S, d loss / d Z before the run."""
    b_j, a_j, v_j = inputs
    queries = _queries(b_j, query_scale, scales, phases)
    pair_decay, feat_decay = scales.decays()
    # d loss / d S_k = e^{P_k - P_{k+1}} d loss / d S_{k+1} + (R q_num)^T g_num of chunk k: only this
    # sum runs chunk by chunk (in reverse); G~ = e^{P_k - P_{k+1}} d loss / d S_{k+1}, and H~ for Z
    reads = queries.rotated.transpose(-1, -2) @ g_num
    read_sums = (queries.den * g_den.unsqueeze(-1)).sum(-2)
    afters, later = _decayed_sums(later, reads, pair_decay, reverse=True)
    after_sums, later_sum = _decayed_sums(later_sum, read_sums, feat_decay, reverse=True)
    decayed, decayed_sum = afters.mul_(pair_decay), after_sums.mul_(feat_decay)   # G~, H~ per chunk
    scores = (queries.rotated @ keys.rotated.transpose(-1, -2)).tril_()
    d_scores = (g_num @ v_j.transpose(-1, -2)).tril_()
    dv = _fma(scores.transpose(-1, -2) @ g_num, keys.rotated, decayed)
    # The denominator's L x L weights: d den_m / d (q_den_m . k_den_n) = g_den_m for n <= m.
    d_den = _past(a_j) * g_den.unsqueeze(-1)
    if phases is None:   # q_num = q_den, k_num = k_den: one set of scores serves both
        d_scores.add_(d_den)
        d_q = _fma(g_num @ states.transpose(-1, -2), d_scores, keys.den)
        d_k = _fma(d_scores.transpose(-1, -2) @ queries.den, v_j, decayed.transpose(-1, -2))
    else:
        d_q_num = _fma(g_num @ states.transpose(-1, -2), d_scores, keys.rotated)
        d_k_num = _fma(d_scores.transpose(-1, -2) @ queries.rotated, v_j, decayed.transpose(-1, -2))
        d_q = _through_numerator(d_den @ keys.den, d_q_num, phases, queries)
        d_k = _through_numerator(d_den.transpose(-1, -2) @ queries.den, d_k_num, phases, keys)
    # d loss / d log-feature: the factors are exponentials, e^x' = e^x
    db = d_q.addcmul_(g_den.unsqueeze(-1), key_sums.unsqueeze(-2)).mul_(queries.den)
    da = d_k.add_(decayed_sum.unsqueeze(-2)).mul_(keys.den)
    if phases is not None and queries.ratio is None:   # a wide pair's queries: their own term
        db.add_(rotate_pairs(d_q_num, phases.conj()).mul_(queries.num).masked_fill_(queries.capped, 0))
    return (db, da, dv), later, later_sum


def _through_numerator(d_den, d_rotated, phases, factors: _Factors):
    """d loss / d den plus d loss / d num * num / den, so that one multiplication by den gives
    d loss / d log-feature; d loss / d num = R^T d loss / d R num.  (Queries without a ratio, from
    wide pairs, take their numerator term separately.)"""
    if factors.ratio is None:
        return d_den
    return d_den.addcmul_(rotate_pairs(d_rotated, phases.conj()), factors.ratio)


def _chunk_backward_autograd(inputs, state, key_sum, scales, phases, base, query_scale, grad, later, later_sum):
    """A chunk with exact rows: autograd through its recomputed forward."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (*inputs, state, key_sum)]
        chunk = _chunks(*leaves, scales, phases, base, query_scale)
        grads = torch.autograd.grad((chunk.out, chunk.state, chunk.key_sum), leaves, (grad, later, later_sum))
    return grads[:3], grads[3], grads[4]


def _per_row(x: torch.Tensor, chunk) -> torch.Tensor:
    """x's (B, H, G, ...) entry for each row, given the rows' (b, h, g) indices.  By index_select:
    rows share entries, and the backward of advanced indexing adds such duplicates with parallel
    atomic adds on CPU (float32, 2+ threads), in an order that varies from run to run; index_select's
    adds them in order."""
    heads, chunks = x.shape[1:3]
    return x.flatten(0, 2).index_select(0, (chunk[0] * heads + chunk[1]) * chunks + chunk[2])


def _exact_rows(rows, b_shifted, a, v, *, rotary, base):
    """The intra-chunk sums of the given rows (index tuples into (B, H, G, L)), exactly per (m, n, j),
    a bounded group of rows at a time.  b_shifted = b - Q."""
    length, m = a.shape[-2:]
    phases = rotary_phases(length, m, base=base, device=a.device, dtype=a.dtype) if rotary else None
    group = max(1, EXACT_ELEMENTS // (length * m))
    num_parts, den_parts = [], []
    for start in range(0, rows[0].numel(), group):
        index = tuple(i[start:start + group] for i in rows)
        num, den = _exact_row_sums(b_shifted[index], _per_row(a, index[:-1]), _per_row(v, index[:-1]),
                                   index[-1], phases)
        num_parts.append(num)
        den_parts.append(den)
    return torch.cat(num_parts), torch.cat(den_parts)


def _exact_row_sums(b_shifted, keys, values, positions, phases):
    """Rows m at `positions` in their chunk: (R, M) b - Q, (R, L, M) the chunk's keys, (R, L, Dv)
    values.  Every term e^(b_ms + a_nt - Q_m) is exponentiated on its own (n <= m only):
        den = sum_n sum_j e^(b_mj + a_nj - Q_m)
        num = sum_n v_n sum_i [cos(phi) (e^(b_m,2i + a_n,2i - Q_m) + e^(b_m,2i+1 + a_n,2i+1 - Q_m))
                               + sin(phi) (e^(b_m,2i + a_n,2i+1 - Q_m) - e^(b_m,2i+1 + a_n,2i - Q_m))]
    with phi = (m - n) theta_i, since (R_m x)^T (R_n y) = Re((x_1 + i x_2)(y_1 - i y_2) e^(i phi))."""
    length = keys.shape[-2]
    distance = positions.unsqueeze(-1) - torch.arange(length, device=keys.device)     # (R, L): m - n
    future = (distance < 0).unsqueeze(-1)
    same = torch.exp((b_shifted.unsqueeze(-2) + keys).masked_fill(future, float("-inf")))
    denominator = same.sum((-1, -2))
    if phases is None:
        return (same.sum(-1).unsqueeze(-2) @ values).squeeze(-2), denominator
    swapped = keys.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)                           # a_2i+1, a_2i
    cross = (b_shifted.unsqueeze(-2) + swapped).clamp_max(NUMERATOR_CAP).masked_fill(future, float("-inf"))
    relative = phases[distance.clamp_min(0)]                                             # (R, L, M/2)
    paired, crossed = same.unflatten(-1, (-1, 2)), cross.exp().unflatten(-1, (-1, 2))
    scores = ((paired[..., 0] + paired[..., 1]) * relative.real).sum(-1) \
        + ((crossed[..., 0] - crossed[..., 1]) * relative.imag).sum(-1)
    return (scores.unsqueeze(-2) @ values).squeeze(-2), denominator


def _chunk_inputs(chunk: int, queries, keys, v, phases, feat, length: int):
    """One chunk's (b, a, v) as (B, H, 1, L, .), its scales and its rotation, for the functions above."""
    s = slice(chunk * length, min((chunk + 1) * length, v.shape[-2]))
    b, a, v_c = (_rows(x, s).contiguous().unsqueeze(2) for x in (queries, keys, v))
    scales = _Scales.of(feat[:, :, chunk:chunk + 2], phases is not None)
    return s, (b, a, v_c), scales, None if phases is None else phases[s].unsqueeze(0)


def irregular_chunk_forward(chunk, queries, keys, v, phases, feat, length, base, state, key_sum, out, den,
                            query_scale):
    """`_irregular_chunk` for a kernel's first irregular chunk (cpp_logspace.py's): rows before a jump keep the
    kernel's regular values in `out`, `den`, `query_scale` (unless the chunk is wide, then redone
    whole); the state after it replaces `state`, `key_sum`."""
    s, inputs, scales, ph = _chunk_inputs(chunk, queries, keys, v, phases, feat, length)
    regular = _Chunks(*(x[:, :, s].unsqueeze(2) for x in (out, den, query_scale)), None, None, None, None, None)
    alone = _irregular_chunk(*inputs, regular, 0, state, key_sum, scales, ph, base, first=True)
    out[:, :, s], den[:, :, s], query_scale[:, :, s] = (x.squeeze(2) for x in (alone.out, alone.den, alone.query_scale))
    state.copy_(alone.state)
    key_sum.copy_(alone.key_sum)


def irregular_chunk_backward(chunk, queries, keys, v, phases, feat, length, base, state, key_sum, grad, out, den,
                             query_scale, later, later_sum, q_grads: SourceGradients, k_grads: SourceGradients, dv,
                             capped: bool):
    """The backward of one irregular chunk for a kernel (cpp_logspace.py's; autograd through it where keys
    passed the cap), updating `later`, `later_sum` and writing the chunk's gradients."""
    s, inputs, scales, ph = _chunk_inputs(chunk, queries, keys, v, phases, feat, length)
    qs, g = query_scale[:, :, s].unsqueeze(2), grad[:, :, s].unsqueeze(2)
    if capped:
        (db, da, dv_c), after, after_sum = _chunk_backward_autograd(
            inputs, state, key_sum, scales, ph, base, qs, g, later, later_sum)
    else:
        g_num, g_den = output_gradients(g, out[:, :, s].unsqueeze(2), den[:, :, s].unsqueeze(2))
        factors = _keys(inputs[1], scales, ph)[1]
        (db, da, dv_c), after, after_sum = _chunk_backward(
            inputs, state.unsqueeze(2), key_sum.unsqueeze(2), factors, scales, ph, qs, g_num, g_den, later, later_sum)
    later.copy_(after)
    later_sum.copy_(after_sum)
    dv[:, :, s] = dv_c.squeeze(2)
    q_grads.write(queries, db.squeeze(2), s)
    k_grads.write(keys, da.squeeze(2), s)
