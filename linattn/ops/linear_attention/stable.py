"""Linear attention from log-features: exact Eq. 19 at any input scale, still strictly causal.

Inputs are b = log phi_q and a = log phi_k, (B, H, N, M).  Eq. 19 is

    out_m = sum_{n<=m} (R_m e^{b_m})^T (R_n e^{a_n}) v_n  /  sum_{n<=m} e^{b_m}^T e^{a_n}.

Plain features e^{a} underflow for large keys (FAVOR+'s a = w.x - |x|^2/2 reaches -6000 at |x| = 100)
and overflow for large logits, and a max taken over the whole sequence would leak the future.
Instead every quantity is scaled by running maxima over positions n <= m only:

* per feature   F_{m,j} = max_{n<=m} a_{n,j}                       (denominator's key scale),
* per pair      P_{m,j} = max(F_{m,2i}, F_{m,2i+1}), j in {2i, 2i+1}  (numerator's key scale: a
  pair's two coordinates share it, so the scale commutes with the rotation R),
* per query     Q_m = max_j (b_{m,j} + F_{m,j}).

Multiplying numerator and denominator by the same e^{-Q_m} changes nothing, and then

* denominator terms are e^{b_mj + a_nj - Q_m} <= 1, and the term of the feature and key that reach
  Q_m is exactly 1: the denominator is >= 1, so no row can underflow to zero;
* the numerator pairs a query coordinate s with a key coordinate t of the same pair, with
  e^{b_ms + a_nt - Q_m} <= e^{max(0, b_ms - b_m,partner(s))}: bounded by the query's own spread
  within a pair.  Eq. 19's rotated numerator is not bounded by its unrotated denominator, so the
  exact output itself grows like that (FAVOR+ with rope="post" at |x| = 30 gives about 1e28 * |v|).
  The query factors e^{b + P - Q} are capped at e^NUMERATOR_CAP (e^30): the output is exact below
  that and saturates (finite, with finite gradients) beyond, instead of overflowing float32.

Causal, in chunks of L tokens (L = chunk_size), the structure of gated linear attention kernels.
Each chunk k works relative to the scales r_k = F, P at its first token s_k, a past position for
every row of the chunk:

1. the maxima F, P (a running max over n, detached) and Q: the scale factors cancel exactly in the
   output, so no gradient flows through them;
2. inter-chunk: the state before chunk k+1 is kept scaled to r_{k+1}:
       S_{k+1} = e^{P_{s_k} - P_{s_{k+1}}} S_k + sum_{n in k} R_n e^{a_n - P_{s_{k+1}}} v_n
   (every exponent <= 0), likewise Z_k = sum_{n < s_k} e^{a_n - F_{s_k}} for the denominator.
   Query m in chunk k reads (R_m e^{b_m + P_{s_k} - Q_m})^T S_k and e^{b_m + F_{s_k} - Q_m} . Z_k;
3. intra-chunk (n <= m, both in the chunk), separable with the same scales: query factors
   e^{b_m + r - Q_m} (<= 1 for the denominator) times key factors e^{a_n - r}, which is safe while
   the running max of row m grew by at most JUMP_LIMIT (30) since s_k: no factor overflows, and a
   term lost to underflow is below e^-57 of the denominator.  Rows whose max jumped further (early
   tokens and outliers) are recomputed exactly, every term exponentiated on its own:
       den(m, n) = sum_j e^{b_mj + a_nj - Q_m}
       num(m, n) = sum_i cos(phi) (e^{b_m,2i + a_n,2i - Q_m} + e^{b_m,2i+1 + a_n,2i+1 - Q_m})
                       + sin(phi) (e^{b_m,2i + a_n,2i+1 - Q_m} - e^{b_m,2i+1 + a_n,2i - Q_m})
   with phi = (m - n) theta_i, since (R_m x)^T (R_n y) = Re((x_1 + i x_2)(y_1 - i y_2) e^{i phi});
   that costs 2 L M exps per such row.  Whether a row is recomputed depends on positions <= m only.

Nothing at position m reads a position after m (the keys after m in its chunk are masked, and
their factors are capped so that nothing masked is inf), and every reduction has the same shape
whatever comes later, so past outputs are bitwise unchanged when future tokens change.  Gradients
come from autograd through these torch ops, with groups of chunks (GROUP_TOKENS) under activation
checkpointing: backward recomputes one group at a time, so what stays in memory is the inputs, the
scales and one state per group.

The recurrent state of decoding keeps F (`LinearState.log_scale`): kv is scaled by e^{-P}, k_sum by
e^{-F}, and each step rescales them by the growth of the maxima, as online softmax does.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from ...rotary import apply_rotary, rotary_phases
from .common import compute_dtype, divide

JUMP_LIMIT = 30.0      # a row whose running max grew more than this within its chunk is computed exactly
NUMERATOR_CAP = 30.0   # numerator query factors are capped at e^30 (saturation beyond float32, see above)
GROUP_ELEMENTS = 2 ** 22  # exact rows per group: rows * L * M elements
GROUP_TOKENS = 1024       # tokens per checkpointed group of chunks


def pair_max(x: torch.Tensor) -> torch.Tensor:
    """max over each rotation pair (2i, 2i+1), written back to both coordinates."""
    return x.unflatten(-1, (-1, 2)).amax(-1).repeat_interleave(2, dim=-1)


def numerator_scale(feature_scale: torch.Tensor, rotary: bool) -> torch.Tensor:
    return pair_max(feature_scale) if rotary else feature_scale


def numerator_query(log_factor: torch.Tensor) -> torch.Tensor:
    """e^(b + P - Q), capped at e^NUMERATOR_CAP."""
    return torch.exp(log_factor.clamp_max(NUMERATOR_CAP))


def _rotate(x, rotary: bool, offset: int, base: float):
    return apply_rotary(x, offset=offset, base=base) if rotary else x


def log_linear_attention(b, a, v, *, causal: bool, rotary: bool, offset: int, base: float,
                         chunk_size: int, return_state: bool = False):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k, in float32 (float64 stays float64)
    with autocast off; outputs in v's dtype.  The state (if asked) carries F."""
    out_dtype, dtype = v.dtype, compute_dtype(b, a, v)
    with torch.autocast(v.device.type, enabled=False):
        result = _log_linear_attention(b.to(dtype), a.to(dtype), v.to(dtype), causal=causal,
                                       rotary=rotary, offset=offset, base=base,
                                       chunk_size=chunk_size, return_state=return_state)
    return (result[0].to(out_dtype), result[1]) if return_state else result.to(out_dtype)


def _log_linear_attention(b, a, v, *, causal, rotary, offset, base, chunk_size, return_state):
    from .recurrent import LinearState, initial_state
    n = a.shape[-2]
    if n == 0:
        out = v.new_zeros(v.shape)
        if not return_state:
            return out
        bsz, heads, m = a.shape[0], a.shape[1], a.shape[-1]
        state = initial_state(bsz, heads, m, v.shape[-1], device=v.device, dtype=v.dtype, log_space=True)
        return out, state._replace(position=offset)
    with torch.no_grad():   # 1. the scales (they cancel exactly: no gradient)
        feature_scale = running_max(a, chunk_size) if causal else a.amax(dim=-2, keepdim=True)
        query_scale = (b + feature_scale).amax(dim=-1, keepdim=True)
    if causal:
        out = _causal(b, a, v, feature_scale, query_scale, rotary=rotary, offset=offset, base=base,
                      length=min(chunk_size, n))
    else:
        pair_scale = numerator_scale(feature_scale, rotary)
        q_num = _rotate(numerator_query(b + pair_scale - query_scale), rotary, offset, base)
        k_num = _rotate(torch.exp(a - pair_scale), rotary, offset, base)
        key_sum = torch.exp(a - feature_scale).sum(-2, keepdim=True)
        denominator = (torch.exp(b + feature_scale - query_scale) * key_sum).sum(-1)
        out = divide(q_num @ (k_num.transpose(-1, -2) @ v), denominator)
    if not return_state:
        return out
    last = feature_scale[..., -1, :]
    k_num = _rotate(torch.exp(a - numerator_scale(last, rotary).unsqueeze(-2)), rotary, offset, base)
    state = LinearState(k_num.transpose(-1, -2) @ v, torch.exp(a - last.unsqueeze(-2)).sum(-2),
                        offset + n, last)
    return out, state


def running_max(a: torch.Tensor, length: int) -> torch.Tensor:
    """a.cummax(dim=-2) in a few passes (torch.cummax along a non-last dimension is ~10x slower on
    CPU): maxima up to each chunk's end, then a scan over the L positions of all chunks at once."""
    chunks = _chunks(a, length, float("-inf")).clone()
    carry = chunks.amax(-2).cummax(dim=2).values
    chunks[:, :, 1:, 0] = torch.maximum(chunks[:, :, 1:, 0], carry[:, :, :-1])
    for i in range(1, length):
        torch.maximum(chunks[..., i - 1, :], chunks[..., i, :], out=chunks[..., i, :])
    return chunks.flatten(2, 3)[..., :a.shape[-2], :]


def _chunks(x: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """(B, H, N, X) -> (B, H, K, L, X), padded at the end with `fill`."""
    pad = -x.shape[-2] % length
    if pad:
        x = torch.cat((x, x.new_full((*x.shape[:-2], pad, x.shape[-1]), fill)), dim=-2)
    return x.unflatten(-2, (-1, length))


def _causal(b, a, v, feature_scale, query_scale, *, rotary, offset, base, length):
    n = a.shape[-2]
    pair_scale = numerator_scale(feature_scale, rotary)
    # Padding is -inf in log space: padded keys weigh nothing and padded queries read nothing.
    b_c, a_c = _chunks(b, length, float("-inf")), _chunks(a, length, float("-inf"))
    v_c = _chunks(v, length, 0.0)
    q_scale = _chunks(query_scale, length, 0.0)
    chunks = b_c.shape[2]
    starts = torch.arange(chunks, device=a.device) * length
    # Every chunk works relative to the scales at its first token r (a past position for each row).
    pair_first = pair_scale[..., starts, :].unsqueeze(-2)
    feat_first = feature_scale[..., starts, :].unsqueeze(-2)
    with torch.no_grad():   # how far each row's max grew since its chunk's first token
        jump = (_chunks(feature_scale, length, float("-inf")) - feat_first).amax(-1)    # (B, H, K, L)
    # Groups of chunks run under activation checkpointing, carrying the state from one to the next:
    # backward recomputes one group at a time, so memory holds one group's temporaries.
    group = max(1, GROUP_TOKENS // length)
    state = v.new_zeros(*v.shape[:2], a.shape[-1], v.shape[-1])
    key_sum = v.new_zeros(*v.shape[:2], a.shape[-1])
    outputs = []
    for start in range(0, chunks, group):
        part, end = slice(start, start + group), min(start + group, chunks)
        following = (pair_first[:, :, end:end + 1], feat_first[:, :, end:end + 1]) if end < chunks \
            else (None, None)
        inputs = (*(t[:, :, part] for t in (b_c, a_c, v_c, q_scale, pair_first, feat_first)),
                  *following, jump[:, :, part], state, key_sum)
        run = partial(checkpoint, _chunk_group, use_reentrant=False) if torch.is_grad_enabled() \
            else _chunk_group
        out, state, key_sum = run(*inputs, rotary=rotary, offset=offset + start * length, base=base)
        outputs.append(out)
    return torch.cat(outputs, 2).flatten(2, 3)[..., :n, :]


def _chunk_group(b_c, a_c, v_c, q_scale, pair_first, feat_first, pair_next, feat_next, jump, state, key_sum,
                 *, rotary, offset, base):
    """Chunks (B, H, G, L, .) given the state before the first (scaled to its first token's scales);
    returns their outputs and the state before the next chunk (pair_next/feat_next: its scales,
    None after the last chunk)."""
    length = a_c.shape[-2]

    def rotate(x):
        return _rotate(x.flatten(2, 3), rotary, offset, base).unflatten(2, (-1, length))

    # 2. inter-chunk: the state before chunk k+1 is scaled to its first token, so chunk k's keys are
    # scaled by e^(a_n - r_{k+1}) <= 1 and the state before k by e^(r_k - r_{k+1}) <= 1.
    pair_to = pair_first[:, :, 1:] if pair_next is None else torch.cat((pair_first[:, :, 1:], pair_next), 2)
    feat_to = feat_first[:, :, 1:] if feat_next is None else torch.cat((feat_first[:, :, 1:], feat_next), 2)
    used = pair_to.shape[2]   # every chunk but the very last one feeds a later state
    keys = rotate(torch.exp(a_c[:, :, :used] - pair_to))
    contributions = keys.transpose(-1, -2) @ v_c[:, :, :used]                   # (B, H, used, M, Dv)
    key_sums = torch.exp(a_c[:, :, :used] - feat_to).sum(-2)
    pair_decay = torch.exp(pair_first[:, :, :used] - pair_to).squeeze(-2)
    feat_decay = torch.exp(feat_first[:, :, :used] - feat_to).squeeze(-2)
    states, sums = [state], [key_sum]
    # unbind once: indexing chunk k in the loop would give each step a full-size backward (O(K^2))
    for k, (contribution, chunk_sum) in enumerate(zip(contributions.unbind(2), key_sums.unbind(2))):
        states.append(pair_decay[:, :, k].unsqueeze(-1) * states[-1] + contribution)   # before chunk k+1
        sums.append(feat_decay[:, :, k] * sums[-1] + chunk_sum)
    chunks = a_c.shape[2]
    before = torch.stack(states[:chunks], 2), torch.stack(sums[:chunks], 2)

    # 3. intra-chunk, separable with the same scales r, for rows m whose max grew by at most
    # JUMP_LIMIT since r: then e^(a_n - r) <= e^JUMP_LIMIT for n <= m and e^(b_m + r - Q_m) <= 1
    # (denominator), so nothing overflows and what underflows is below e^-57 of the denominator.
    # The cap on keys only touches keys after m (masked) and the rows computed exactly below.
    b_shifted = b_c - q_scale
    den_queries = torch.exp(b_shifted + feat_first)
    den_keys = torch.exp(a_c - _capped_reference(a_c, feat_first))
    if rotary:
        num_queries = rotate(numerator_query(b_shifted + pair_first))
        num_keys = rotate(torch.exp(a_c - _capped_reference(a_c, pair_first)))
    else:
        num_queries, num_keys = den_queries, den_keys
    past = torch.ones(length, length, dtype=torch.bool, device=a_c.device).tril()
    intra_num = ((num_queries @ num_keys.transpose(-1, -2)) * past) @ v_c
    # The denominator needs no L x L scores: the keys' running sums within the chunk, as a product
    # with the lower-triangular ones (torch.cumsum along a non-last dimension is slow on CPU).
    running_keys = past.to(den_keys.dtype) @ den_keys
    state_sums = before[1].unsqueeze(-2)
    denominator = (den_queries * (running_keys + state_sums)).sum(-1)
    rows = (jump > JUMP_LIMIT).nonzero(as_tuple=True)
    if rows[0].numel():   # these rows' intra-chunk parts are replaced; their state parts stay
        exact_num, exact_den = _exact_rows(rows, b_shifted, a_c, v_c, rotary=rotary, base=base)
        intra_num = intra_num.index_put(rows, exact_num)
        state_part = (den_queries[rows] * state_sums.expand_as(den_queries)[rows]).sum(-1)
        denominator = denominator.index_put(rows, state_part + exact_den)
    numerator = num_queries @ before[0] + intra_num
    return divide(numerator, denominator), states[-1], sums[-1]


def _capped_reference(a, first):
    """The key scale r, raised to a - JUMP_LIMIT where a key exceeds it by more (no gradient: it
    only changes keys that are masked or in rows computed exactly)."""
    with torch.no_grad():
        return torch.maximum(first, a - JUMP_LIMIT)


def _exact_rows(rows, b_shifted, a, v, *, rotary, base):
    """The intra-chunk sums of the given rows (index tuples into (B, H, K, L)), exactly per
    (m, n, j), a bounded group of rows at a time.  b_shifted = b - Q."""
    length, m = a.shape[-2:]
    phases = rotary_phases(length, m, base=base, device=a.device, dtype=a.dtype) if rotary else None
    group = max(1, GROUP_ELEMENTS // (length * m))
    num_parts, den_parts = [], []
    for start in range(0, rows[0].numel(), group):
        index = tuple(i[start:start + group] for i in rows)
        pieces = (b_shifted[index], a[index[:3]], v[index[:3]], index[3])
        num, den = _exact_row_sums(*pieces, phases)
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
