"""Chunk-parallel Triton kernels for Eq. 19 from log-features b = log phi_q, a = log phi_k (FAVOR+'s
path), causal or not, in the form of gated linear attention (flash-linear-attention's chunk_gla):
exact at any input scale as stable.py, with no factor above 1 (the numerator's query factor: above
1 only by its own pair spread, capped at e^NUMERATOR_CAP).  The triton backend's path for
log-features (functional.py).

Scales (stable.py; computed in torch, recomputed in backward, no gradient: they cancel exactly):
F_n = max_{n' <= n} a_n' per feature (the max over the whole sequence without `causal`), P_n its max
over each rotation pair (F without rotation), Q_m = max_j (b_mj + F_mj).  With them

    den_m = sum_{n<=m} sum_j e^{b_mj + a_nj - Q_m}
          = sum_{n<=m} sum_j [e^{b_mj + F_mj - Q_m}] [e^{a_nj - F_nj}] [e^{F_nj - F_mj}]
    num_m = sum_{n<=m} sum_j (R_m x_m)_j (R_n y_n)_j e^{P_nj - P_mj} v_n,
            x_m = e^{min(b_m - Q_m + P_m, NUMERATOR_CAP)},  y_n = e^{a_n - P_n}

(the numerator's query factor capped as `linear_attention_step` caps it, against the row's own P_m).
Every bracket is <= 1 for n <= m: gated linear attention with the cumulative log-gate g = -F (-P in
the numerator, constant over a pair, so the decay commutes with R).  A product of factors is
split at a reference row r between n and m, the "frame" r: query part e^{b_m - Q_m + P_r} (<= the
row's own factor), key part e^{a_n - P_r} <= 1.  Nothing overflows, and a term lost to underflow is
below e^-57 of a denominator that is >= 1 (the term of the feature and key reaching Q_m is 1), so
no row is empty whatever the scale.  Differences of log-features are taken where they nearly cancel
(b - Q, then + P_r), so the terms that matter are exact even at |a| in the thousands.

Chunks of BT tokens hold sub-chunks of BC; r(t) = max(t BT - 1, 0) is the frame of the state chunk
t reads, E(t) = min((t+1) BT, N) - 1 the last row of chunk t (= r(t+1)).

Forward:
  * `_states_kernel`, grid (feature tiles, value tiles, B*H), chunks in order:
        S_{t+1} = e^{P_r(t) - P_E(t)} S_t + sum_{n in t} R_n e^{a_n - P_E(t)} v_n^T
    (likewise z with F and no rotation), writing S_t, z_t before every chunk; the state after the
    last token is at the last row's scales, as LinearState keeps it.
  * `_output_kernel`, grid (value tiles, sub-chunks, B*H), every sub-chunk at once, summing over the
    feature tiles: (R x^{r(t)})^T S_t; the keys of the chunk before the sub-chunk in the frame of its
    first row (one tl.dot of BC x BT scores); the sub-chunk's own keys elementwise (n <= m, each
    term at its own decay e^{P_n - P_m}).  Writes out = num / den and den (for backward).

Backward, with G = d num = g / den and gd = d den = -(g . out) / den per row (common.py), recomputes
the states and runs:
  * `_dstate_kernel`, chunks in reverse: dS_t = sum_{m after chunk t} (R x_m^{E(t)})^T G_m and
    dz_t likewise, in frame E(t), the gradients of what chunk t hands on;
  * `_dq_kernel`, `_dk_kernel` (grid: feature tiles, sub-chunks, B*H) and `_dv_kernel` (value tiles):
    every sub-chunk at once.  A factor f = e^{l} of a log-feature l contributes d l = f d f, the same
    in every frame, so each part of the sum (state, earlier keys, own sub-chunk) gives d b += x . dx
    (zero where the cap acts) and d a += y . dy in its own frame.  Formulas where computed.
Memory kept for backward: b, a (float32), v, out and den, O(N (M + Dv)); F, P, Q and the per-chunk
states live only inside forward or backward.

bf16 inputs: the log-features stay float32 (bf16 log-features lose the exponent's precision); the
factors, which are <= 1, multiply in bf16 on tensor cores with the values, float32 accumulation,
and the per-chunk states are kept in bf16, as in chunk_parallel.py.  fp16 and float32 multiply as
float32 (3xTF32, triton_common.dot_settings).

Without `causal` F, P are the whole sequence's (every frame is the same): the states kernel sums one
state, the output reads it (no scores), the reverse pass sums dS, dz over every row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rotary import DEFAULT_BASE
from .common import LogProjection, finite_log_features, output_gradients
from .recurrent import LinearState
from .stable import NUMERATOR_CAP as _NUMERATOR_CAP, pair_max
from .triton_common import (angle_table, check_grid, check_interpreter_unchanged, common_dtype, dot_settings,
                            launch_fitting, mm, phases, rotate, state_offset, store, tile, tile_size, unrotate)

CHUNK = 64          # tokens per chunk (BT): states are written once per chunk
SUB_CHUNK = 16      # rows per sub-chunk (BC), the output and gradient kernels' block; tl.dot's minimum
FEATURE_TILE = 64   # largest feature tile (BK)
VALUE_TILE = 64     # largest value tile (BV)
# Largest (feature, value) tiles per level, tried in order until a call's kernels fit the GPU's shared
# memory per block (triton_common.launch_fitting).  Compiled for sm_90 without a GPU
# (tests/linattn/ops/compile_kernels.py --log-chunk-parallel), level 0 needs at most 165,888 bytes in
# float32 (the causal reverse pass) and 116,736 in bf16 (an H100 gives a block 232,448).
TILE_LEVELS = ((FEATURE_TILE, VALUE_TILE), (32, 32), (16, 16))
NUMERATOR_CAP = tl.constexpr(_NUMERATOR_CAP)
GUARD = tl.constexpr(torch.finfo(torch.float32).tiny ** 0.5)   # common.divide's clamp


@triton.jit
def _exp(x, live):
    """e^x where live, exactly 0 elsewhere (padding, masked or future rows, whose x may be anything)."""
    return tl.exp(tl.where(live, x, float("-inf")))


@triton.jit
def _scale_row(ptr, row, k_cols, M):
    """Row `row` of an (N, M) scale (F or P) over the feature tile, as (1, BK)."""
    return tl.load(ptr + row * M + k_cols, mask=k_cols < M, other=0.0)[None, :]


@triton.jit
def _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M):
    """shift = b - Q, the rows' own P, and where the numerator's cap does not act (shift + P <=
    NUMERATOR_CAP: the same test in every frame, so a row is capped everywhere or nowhere)."""
    shift = tile(b_ptr, rows, k_cols, N, M, M) - tl.load(q_ptr + rows, mask=rows < N, other=0.0)[:, None]
    p_own = tile(p_ptr, rows, k_cols, N, M, M)
    return shift, p_own, shift + p_own <= NUMERATOR_CAP


@triton.jit
def _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, ref, k_cols, keep, M):
    """The query factors in frame `ref` (a row at or before each query): numerator e^{shift + P_ref},
    capped at e^{NUMERATOR_CAP + P_ref - P_m}, and denominator e^{shift + F_ref} <= 1; zero outside
    `keep`."""
    live = keep[:, None] & (k_cols < M)[None, :]
    p_ref = _scale_row(p_ptr, ref, k_cols, M)
    numerator = tl.where(uncapped, shift + p_ref, NUMERATOR_CAP + p_ref - p_own)
    return _exp(numerator, live), _exp(shift + _scale_row(f_ptr, ref, k_cols, M), live)


@triton.jit
def _key_factors(a_ptr, f_ptr, p_ptr, rows, ref, k_cols, keep, N, M):
    """The key factors e^{a_n - P_ref}, e^{a_n - F_ref} (<= 1: the rows kept are at or before ref)."""
    a = tile(a_ptr, rows, k_cols, N, M, M)
    live = keep[:, None] & (k_cols < M)[None, :]
    return _exp(a - _scale_row(p_ptr, ref, k_cols, M), live), _exp(a - _scale_row(f_ptr, ref, k_cols, M), live)


@triton.jit
def _own_factors(shift, p_own, uncapped, a, live):
    """The sub-chunk's factors in their own frames: x_m = e^{min(shift + P_m, cap)}, y_n = e^{a_n - P_n}."""
    return _exp(tl.where(uncapped, shift + p_own, NUMERATOR_CAP), live), _exp(a - p_own, live)


@triton.jit
def _pick(x, within, i):
    """Row i of the (BC, .) tile x, as a vector."""
    return tl.sum(tl.where((within == i)[:, None], x, 0.0), 0)


@triton.jit
def _diagonal_scores(x_rot, y_rot, p_own, live, BC: tl.constexpr):
    """(BC, BC) numerator scores of a sub-chunk with itself, [m, n] = sum_j (R x_m)_j (R y_n)_j
    e^{P_nj - P_mj} for n <= m (0 above the diagonal): each term at its own decay <= 1."""
    within = tl.arange(0, BC)
    scores = tl.zeros((BC, BC), dtype=tl.float32)
    for n in range(BC):
        seen = live & (within >= n)[:, None]
        decay = _exp(_pick(p_own, within, n)[None, :] - p_own, seen)
        # where, not the zero decay alone: 0 * NaN is NaN, and a later key's NaN must not reach row m
        column = tl.sum(tl.where(seen, x_rot * _pick(y_rot, within, n)[None, :] * decay, 0.0), 1)
        scores = tl.where((within == n)[None, :], column[:, None], scores)
    return scores


@triton.jit
def _diagonal_key_sums(shift, a, live, BC: tl.constexpr, BK: tl.constexpr):
    """(BC, BK): [m, j] = sum_{n <= m in the sub-chunk} e^{b_mj - Q_m + a_nj}, the denominator's own
    sub-chunk terms per feature (<= 1 each)."""
    within = tl.arange(0, BC)
    sums = tl.zeros((BC, BK), dtype=tl.float32)
    for n in range(BC):
        sums += _exp(shift + _pick(a, within, n)[None, :], live & (within >= n)[:, None])
    return sums


@triton.jit
def _chunk_frames(t, N, BT: tl.constexpr):
    """r(t), the frame of the state chunk t reads, and E(t), its last row (the frame it hands on)."""
    return tl.maximum(t * BT - 1, 0), tl.minimum(t * BT + BT, N) - 1


@triton.jit
def _head_logs(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, i_bh, N, M):
    """b, a, F, P ([N, M] per head) and Q ([N]) of head i_bh."""
    for_rows = i_bh * N * M
    return b_ptr + for_rows, a_ptr + for_rows, f_ptr + for_rows, p_ptr + for_rows, q_ptr + i_bh * N


@triton.jit
def _sub_chunk(i_s, BT: tl.constexpr, BC: tl.constexpr):
    """Sub-chunk i_s: its first row, its chunk t, its rows and the rows of chunk t."""
    first = i_s * BC
    t = first // BT
    return first, t, first + tl.arange(0, BC), t * BT + tl.arange(0, BT)


@triton.jit
def _states_kernel(a_ptr, v_ptr, f_ptr, p_ptr, turns_ptr, h_ptr, z_ptr, kv_ptr, k_sum_ptr, N, M, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                   CHUNKS: tl.constexpr, STATE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """With CHUNKS, h[t] = S_t (frame r(t)) and z[t] for every chunk; with STATE the state after the
    last token (frame N - 1: LinearState's kv, k_sum; the whole sequence's without `causal`)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    a_ptr += i_bh * N * M
    f_ptr += i_bh * N * M
    p_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    h_ptr += i_bh * n_chunks * M * DV
    z_ptr += i_bh * n_chunks * M
    k_cols = i_k * BK + tl.arange(0, BK)
    v_cols = i_v * BV + tl.arange(0, BV)
    state = tl.zeros((BK, BV), dtype=tl.float32)
    k_sum = tl.zeros((BK,), dtype=tl.float32)
    for t in range(n_chunks):
        if CHUNKS:
            store(h_ptr + t * M * DV, state, k_cols, v_cols, k_cols < M, DV, DV)
            if i_v == 0:
                tl.store(z_ptr + t * M + k_cols, k_sum, mask=k_cols < M)
        ref, end = _chunk_frames(t, N, BT)
        # From frame r(t) to E(t): both running maxima, so the decay is <= 1.
        state *= tl.trans(tl.exp(_scale_row(p_ptr, ref, k_cols, M) - _scale_row(p_ptr, end, k_cols, M)))
        k_sum *= tl.reshape(tl.exp(_scale_row(f_ptr, ref, k_cols, M) - _scale_row(f_ptr, end, k_cols, M)), (BK,))
        rows = t * BT + tl.arange(0, BT)
        k_num, k_den = _key_factors(a_ptr, f_ptr, p_ptr, rows, end, k_cols, rows < N, N, M)
        if ROTARY:
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            k_num = rotate(k_num, cos, sin, BT, BK)
        state += mm(tl.trans(k_num), tile(v_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
        k_sum += tl.sum(k_den, 0)
    if STATE:
        store(kv_ptr + i_bh * M * DV, state, k_cols, v_cols, k_cols < M, DV, DV)
        if i_v == 0:
            tl.store(k_sum_ptr + i_bh * M + k_cols, k_sum, mask=k_cols < M)


@triton.jit
def _output_kernel(b_ptr, a_ptr, v_ptr, f_ptr, p_ptr, q_ptr, turns_ptr, h_ptr, z_ptr, out_ptr, den_ptr, N, M, DV,
                   BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   ROTARY: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """out = num / den for one sub-chunk and value tile; den written by the first value tile."""
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    first, t, rows, chunk_rows = _sub_chunk(i_s, BT, BC)
    b_ptr, a_ptr, f_ptr, p_ptr, q_ptr = _head_logs(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, i_bh, N, M)
    v_ptr += i_bh * N * DV
    h_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    z_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    v_cols = i_v * BV + tl.arange(0, BV)
    ref, _end = _chunk_frames(t, N, BT)
    num = tl.zeros((BC, BV), dtype=tl.float32)
    den = tl.zeros((BC,), dtype=tl.float32)
    earlier = tl.zeros((BC, BT), dtype=tl.float32)    # scores with the chunk's keys before the sub-chunk
    own = tl.zeros((BC, BC), dtype=tl.float32)        # scores within the sub-chunk
    for i_k in range(tl.cdiv(M, BK)):
        k_cols = i_k * BK + tl.arange(0, BK)
        live = (rows < N)[:, None] & (k_cols < M)[None, :]
        shift, p_own, uncapped = _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M)
        if ROTARY:
            cos, sin = phases(turns_ptr, first, i_k, M // 2, BC, BK)
        x_num, x_den = _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, ref, k_cols, rows < N, M)
        if ROTARY:
            x_num = rotate(x_num, cos, sin, BC, BK)
        num += mm(x_num, tile(h_ptr, k_cols, v_cols, M, DV, DV), DOT, PRECISION)
        den += tl.sum(x_den * tl.load(z_ptr + k_cols, mask=k_cols < M, other=0.0)[None, :], 1)
        if CAUSAL:
            x_num, x_den = _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, first, k_cols, rows < N, M)
            y_num, y_den = _key_factors(a_ptr, f_ptr, p_ptr, chunk_rows, first, k_cols, chunk_rows < first, N, M)
            a = tile(a_ptr, rows, k_cols, N, M, M)
            x_own, y_own = _own_factors(shift, p_own, uncapped, a, live)
            if ROTARY:
                x_num = rotate(x_num, cos, sin, BC, BK)
                cos_chunk, sin_chunk = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
                y_num = rotate(y_num, cos_chunk, sin_chunk, BT, BK)
                x_own = rotate(x_own, cos, sin, BC, BK)
                y_own = rotate(y_own, cos, sin, BC, BK)
            earlier += mm(x_num, tl.trans(y_num), DOT, PRECISION)
            den += tl.sum(x_den * tl.sum(y_den, 0)[None, :], 1)
            own += _diagonal_scores(x_own, y_own, p_own, live, BC)
            den += tl.sum(_diagonal_key_sums(shift, a, live, BC, BK), 1)
    if CAUSAL:
        num += mm(earlier, tile(v_ptr, chunk_rows, v_cols, N, DV, DV), DOT, PRECISION)
        num += mm(own, tile(v_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
    # den >= 1 up to rounding (stable.py); the clamp only guards padding rows.
    store(out_ptr + i_bh * N * DV, num / tl.maximum(den, GUARD)[:, None], rows, v_cols, rows < N, DV, DV)
    if i_v == 0:
        tl.store(den_ptr + i_bh * N + rows, den, mask=rows < N)


@triton.jit
def _dstate_kernel(b_ptr, f_ptr, p_ptr, q_ptr, g_ptr, gd_ptr, turns_ptr, dh_ptr, dz_ptr, N, M, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dh[t] = dS_t = sum_{m after chunk t} (R x_m^{E(t)})^T G_m and dz[t] = sum gd_m x_den_m^{E(t)},
    chunks in reverse: dS_{t-1} = e^{P_r(t) - P_E(t)} dS_t + sum_{m in t} (R x_m^{r(t)})^T G_m, since
    chunk t reads S_t in frame r(t) = E(t-1).  Without `causal`, the sums over every row."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    b_ptr += i_bh * N * M
    f_ptr += i_bh * N * M
    p_ptr += i_bh * N * M
    q_ptr += i_bh * N
    g_ptr += i_bh * N * DV
    gd_ptr += i_bh * N
    k_cols = i_k * BK + tl.arange(0, BK)
    v_cols = i_v * BV + tl.arange(0, BV)
    d_state = tl.zeros((BK, BV), dtype=tl.float32)
    d_z = tl.zeros((BK,), dtype=tl.float32)
    for back in range(n_chunks):
        t = n_chunks - 1 - back
        if CAUSAL:
            store(dh_ptr + (i_bh * n_chunks + t) * M * DV, d_state, k_cols, v_cols, k_cols < M, DV, DV)
            if i_v == 0:
                tl.store(dz_ptr + (i_bh * n_chunks + t) * M + k_cols, d_z, mask=k_cols < M)
        ref, end = _chunk_frames(t, N, BT)
        d_state *= tl.trans(tl.exp(_scale_row(p_ptr, ref, k_cols, M) - _scale_row(p_ptr, end, k_cols, M)))
        d_z *= tl.reshape(tl.exp(_scale_row(f_ptr, ref, k_cols, M) - _scale_row(f_ptr, end, k_cols, M)), (BK,))
        rows = t * BT + tl.arange(0, BT)
        shift, p_own, uncapped = _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M)
        x_num, x_den = _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, ref, k_cols, rows < N, M)
        if ROTARY:
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            x_num = rotate(x_num, cos, sin, BT, BK)
        d_state += mm(tl.trans(x_num), tile(g_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
        d_z += tl.sum(tl.load(gd_ptr + rows, mask=rows < N, other=0.0)[:, None] * x_den, 0)
    if not CAUSAL:
        store(dh_ptr + i_bh * M * DV, d_state, k_cols, v_cols, k_cols < M, DV, DV)
        if i_v == 0:
            tl.store(dz_ptr + i_bh * M + k_cols, d_z, mask=k_cols < M)


@triton.jit
def _dq_kernel(b_ptr, a_ptr, v_ptr, f_ptr, p_ptr, q_ptr, g_ptr, gd_ptr, turns_ptr, h_ptr, z_ptr, db_ptr, N, M, DV,
               BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
               CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """d b of one sub-chunk and feature tile.  With dA[m, n] = G_m . v_n (summed over value tiles
    here), each part gives d b = x . R^T d(R x) (zero where capped) + gd x_den . (its key sum):
        state:          d(R x^{r(t)}) = G S_t^T,              key sum z_t
        earlier keys:   d(R x^{first}) = dA (R y^{first}),   key sum sum_{n < first} y_den^{first}
        own sub-chunk:  d(R x_m) = sum_{n <= m} dA[m, n] (R y_n) e^{P_n - P_m},
                        denominator sum_{n <= m} e^{b_m - Q_m + a_n} directly."""
    i_k, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    first, t, rows, chunk_rows = _sub_chunk(i_s, BT, BC)
    b_ptr, a_ptr, f_ptr, p_ptr, q_ptr = _head_logs(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, i_bh, N, M)
    v_ptr += i_bh * N * DV
    g_ptr += i_bh * N * DV
    gd_ptr += i_bh * N
    h_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    z_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    k_cols = i_k * BK + tl.arange(0, BK)
    d_x_state = tl.zeros((BC, BK), dtype=tl.float32)
    d_earlier = tl.zeros((BC, BT), dtype=tl.float32)
    d_own = tl.zeros((BC, BC), dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        v_cols = i_v * BV + tl.arange(0, BV)
        g = tile(g_ptr, rows, v_cols, N, DV, DV)
        d_x_state += mm(g, tl.trans(tile(h_ptr, k_cols, v_cols, M, DV, DV)), DOT, PRECISION)
        if CAUSAL:
            d_earlier += mm(g, tl.trans(tile(v_ptr, chunk_rows, v_cols, N, DV, DV)), DOT, PRECISION)
            d_own += mm(g, tl.trans(tile(v_ptr, rows, v_cols, N, DV, DV)), DOT, PRECISION)
    live = (rows < N)[:, None] & (k_cols < M)[None, :]
    gd = tl.load(gd_ptr + rows, mask=rows < N, other=0.0)[:, None]
    shift, p_own, uncapped = _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M)
    ref, _end = _chunk_frames(t, N, BT)
    x_num, x_den = _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, ref, k_cols, rows < N, M)
    if ROTARY:
        cos, sin = phases(turns_ptr, first, i_k, M // 2, BC, BK)
        d_x_state = unrotate(d_x_state, cos, sin, BC, BK)
    d_b_num = x_num * d_x_state
    d_b_den = gd * x_den * tl.load(z_ptr + k_cols, mask=k_cols < M, other=0.0)[None, :]
    if CAUSAL:
        x_num, x_den = _query_factors(shift, p_own, uncapped, f_ptr, p_ptr, first, k_cols, rows < N, M)
        y_num, y_den = _key_factors(a_ptr, f_ptr, p_ptr, chunk_rows, first, k_cols, chunk_rows < first, N, M)
        a = tile(a_ptr, rows, k_cols, N, M, M)
        x_own, y_own = _own_factors(shift, p_own, uncapped, a, live)
        if ROTARY:
            cos_chunk, sin_chunk = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            y_num = rotate(y_num, cos_chunk, sin_chunk, BT, BK)
            y_own = rotate(y_own, cos, sin, BC, BK)
        d_x = mm(tl.where(chunk_rows[None, :] < first, d_earlier, 0.0), y_num, DOT, PRECISION)
        d_x_own = tl.zeros((BC, BK), dtype=tl.float32)
        within = tl.arange(0, BC)
        for n in range(BC):
            seen = live & (within >= n)[:, None]
            decay = _exp(_pick(p_own, within, n)[None, :] - p_own, seen)
            d_x_own += tl.where(seen, _pick(tl.trans(d_own), within, n)[:, None] * _pick(y_own, within, n)[None, :]
                                * decay, 0.0)
        if ROTARY:
            d_x = unrotate(d_x, cos, sin, BC, BK)
            d_x_own = unrotate(d_x_own, cos, sin, BC, BK)
        d_b_num += x_num * d_x + x_own * d_x_own
        d_b_den += gd * (x_den * tl.sum(y_den, 0)[None, :] + _diagonal_key_sums(shift, a, live, BC, BK))
    # Where the cap acts the numerator's query factor is constant: no gradient through it.
    store(db_ptr + i_bh * N * M, tl.where(uncapped, d_b_num, 0.0) + d_b_den, rows, k_cols, rows < N, M, M)


@triton.jit
def _dk_kernel(b_ptr, a_ptr, v_ptr, f_ptr, p_ptr, q_ptr, g_ptr, gd_ptr, turns_ptr, dh_ptr, dz_ptr, da_ptr,
               N, M, DV, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               ROTARY: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """d a of one sub-chunk of keys and feature tile.  With dA[n, m] = v_n . G_m, d a = y . R^T d(R y)
    + y_den . (its query sum), per part:
        later chunks:   d(R y^{E(t)}) = v dS_t^T,                     query sum dz_t
        later rows of the chunk, frame e = the sub-chunk's last row:
                        d(R y^e) = dA (R x^e) over m > e,             sum_{m > e} gd_m x_den_m^e
        own sub-chunk:  d(R y_n) = sum_{m >= n} dA[n, m] (R x_m) e^{P_n - P_m},
                        denominator sum_{m >= n} gd_m e^{b_m - Q_m + a_n} directly."""
    i_k, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    first, t, rows, chunk_rows = _sub_chunk(i_s, BT, BC)
    b_ptr, a_ptr, f_ptr, p_ptr, q_ptr = _head_logs(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, i_bh, N, M)
    v_ptr += i_bh * N * DV
    g_ptr += i_bh * N * DV
    gd_ptr += i_bh * N
    dh_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    dz_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    k_cols = i_k * BK + tl.arange(0, BK)
    last = tl.minimum(first + BC, N) - 1
    later = (chunk_rows > last) & (chunk_rows < N)
    d_y_state = tl.zeros((BC, BK), dtype=tl.float32)
    d_later = tl.zeros((BC, BT), dtype=tl.float32)
    d_own = tl.zeros((BC, BC), dtype=tl.float32)      # [n, m]
    for i_v in range(tl.cdiv(DV, BV)):
        v_cols = i_v * BV + tl.arange(0, BV)
        v = tile(v_ptr, rows, v_cols, N, DV, DV)
        d_y_state += mm(v, tl.trans(tile(dh_ptr, k_cols, v_cols, M, DV, DV)), DOT, PRECISION)
        if CAUSAL:
            d_later += mm(v, tl.trans(tile(g_ptr, chunk_rows, v_cols, N, DV, DV)), DOT, PRECISION)
            d_own += mm(v, tl.trans(tile(g_ptr, rows, v_cols, N, DV, DV)), DOT, PRECISION)
    _ref, end = _chunk_frames(t, N, BT)
    y_num, y_den = _key_factors(a_ptr, f_ptr, p_ptr, rows, end, k_cols, rows < N, N, M)
    if ROTARY:
        cos, sin = phases(turns_ptr, first, i_k, M // 2, BC, BK)
        d_y_state = unrotate(d_y_state, cos, sin, BC, BK)
    d_a = y_num * d_y_state + y_den * tl.load(dz_ptr + k_cols, mask=k_cols < M, other=0.0)[None, :]
    if CAUSAL:
        y_num, y_den = _key_factors(a_ptr, f_ptr, p_ptr, rows, last, k_cols, rows < N, N, M)
        shift, p_q, uncapped_q = _query_logs(b_ptr, p_ptr, q_ptr, chunk_rows, k_cols, N, M)
        x_num, x_den = _query_factors(shift, p_q, uncapped_q, f_ptr, p_ptr, last, k_cols, later, M)
        if ROTARY:
            cos_chunk, sin_chunk = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            x_num = rotate(x_num, cos_chunk, sin_chunk, BT, BK)
        d_y = mm(tl.where(later[None, :], d_later, 0.0), x_num, DOT, PRECISION)
        gd_later = tl.load(gd_ptr + chunk_rows, mask=later, other=0.0)
        d_a += y_den * tl.sum(gd_later[:, None] * x_den, 0)[None, :]
        # The sub-chunk's own queries, in their own frames.
        live = (rows < N)[:, None] & (k_cols < M)[None, :]
        shift, p_own, uncapped = _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M)
        a = tile(a_ptr, rows, k_cols, N, M, M)
        x_own, y_own = _own_factors(shift, p_own, uncapped, a, live)
        if ROTARY:
            x_own = rotate(x_own, cos, sin, BC, BK)
        gd = tl.load(gd_ptr + rows, mask=rows < N, other=0.0)
        within = tl.arange(0, BC)
        d_y_own = tl.zeros((BC, BK), dtype=tl.float32)
        d_den_own = tl.zeros((BC, BK), dtype=tl.float32)
        for m in range(BC):
            before = live & (within <= m)[:, None] & (first + m < N)
            decay = _exp(p_own - _pick(p_own, within, m)[None, :], before)
            d_y_own += tl.where(before, _pick(tl.trans(d_own), within, m)[:, None] * _pick(x_own, within, m)[None, :]
                                * decay, 0.0)
            gd_m = tl.sum(tl.where(within == m, gd, 0.0), 0)
            d_den_own += gd_m * _exp(_pick(shift, within, m)[None, :] + a, before)
        if ROTARY:
            d_y = unrotate(d_y, cos, sin, BC, BK)
            d_y_own = unrotate(d_y_own, cos, sin, BC, BK)
        d_a += y_num * d_y + y_own * d_y_own + d_den_own
    store(da_ptr + i_bh * N * M, d_a, rows, k_cols, rows < N, M, M)


@triton.jit
def _dv_kernel(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, g_ptr, turns_ptr, dh_ptr, dv_ptr, N, M, DV,
               BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
               CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dv of one sub-chunk and value tile, summed over feature tiles: dv_n = sum_{m >= n} A[m, n] G_m
    = (R y_n^{E(t)}) dS_t + [later rows of the chunk, frame e] + [own sub-chunk], A the scores."""
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    first, t, rows, chunk_rows = _sub_chunk(i_s, BT, BC)
    b_ptr, a_ptr, f_ptr, p_ptr, q_ptr = _head_logs(b_ptr, a_ptr, f_ptr, p_ptr, q_ptr, i_bh, N, M)
    g_ptr += i_bh * N * DV
    dh_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    v_cols = i_v * BV + tl.arange(0, BV)
    last = tl.minimum(first + BC, N) - 1
    later = (chunk_rows > last) & (chunk_rows < N)
    _ref, end = _chunk_frames(t, N, BT)
    dv = tl.zeros((BC, BV), dtype=tl.float32)
    later_scores = tl.zeros((BC, BT), dtype=tl.float32)    # [n, m]
    own_scores = tl.zeros((BC, BC), dtype=tl.float32)      # [m, n]
    for i_k in range(tl.cdiv(M, BK)):
        k_cols = i_k * BK + tl.arange(0, BK)
        y_num, _y_den = _key_factors(a_ptr, f_ptr, p_ptr, rows, end, k_cols, rows < N, N, M)
        if ROTARY:
            cos, sin = phases(turns_ptr, first, i_k, M // 2, BC, BK)
            y_num = rotate(y_num, cos, sin, BC, BK)
        dv += mm(y_num, tile(dh_ptr, k_cols, v_cols, M, DV, DV), DOT, PRECISION)
        if CAUSAL:
            y_num, _y_den = _key_factors(a_ptr, f_ptr, p_ptr, rows, last, k_cols, rows < N, N, M)
            shift, p_q, uncapped_q = _query_logs(b_ptr, p_ptr, q_ptr, chunk_rows, k_cols, N, M)
            x_num, _x_den = _query_factors(shift, p_q, uncapped_q, f_ptr, p_ptr, last, k_cols, later, M)
            live = (rows < N)[:, None] & (k_cols < M)[None, :]
            shift, p_own, uncapped = _query_logs(b_ptr, p_ptr, q_ptr, rows, k_cols, N, M)
            x_own, y_own = _own_factors(shift, p_own, uncapped, tile(a_ptr, rows, k_cols, N, M, M), live)
            if ROTARY:
                y_num = rotate(y_num, cos, sin, BC, BK)
                cos_chunk, sin_chunk = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
                x_num = rotate(x_num, cos_chunk, sin_chunk, BT, BK)
                x_own = rotate(x_own, cos, sin, BC, BK)
                y_own = rotate(y_own, cos, sin, BC, BK)
            later_scores += mm(y_num, tl.trans(x_num), DOT, PRECISION)
            own_scores += _diagonal_scores(x_own, y_own, p_own, live, BC)
    if CAUSAL:
        dv += mm(later_scores, tile(g_ptr, chunk_rows, v_cols, N, DV, DV), DOT, PRECISION)
        dv += mm(tl.trans(own_scores), tile(g_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
    store(dv_ptr + i_bh * N * DV, dv, rows, v_cols, rows < N, DV, DV)


class _Shapes:
    """Sizes, tiles and dot settings of a call on (B, H, N, M) log-features and (B, H, N, Dv) values."""

    def __init__(self, b: torch.Tensor, v: torch.Tensor, level: int = 0):
        self.batch_heads, self.n, self.m, self.dv = b.shape[0] * b.shape[1], b.shape[2], b.shape[3], v.shape[-1]
        check_grid(b.shape[0], b.shape[1], self.n, self.m, self.dv, rows_per_program=SUB_CHUNK, chunk=CHUNK)
        feature_tile, value_tile = TILE_LEVELS[level]
        self.bk, self.bv = tile_size(self.m, feature_tile), tile_size(self.dv, value_tile)
        self.n_t, self.n_s, self.n_k, self.n_v = (triton.cdiv(x, tile) for x, tile in
                                                  ((self.n, CHUNK), (self.n, SUB_CHUNK), (self.m, self.bk),
                                                   (self.dv, self.bv)))
        self.dot, self.precision = dot_settings(v.dtype)
        # Per-chunk states between the passes: bf16 where the dots take bf16, float32 otherwise.
        self.state_dtype = torch.bfloat16 if self.dot == tl.bfloat16 else torch.float32

    def args(self):
        return self.n, self.m, self.dv

    def constants(self, rotary: bool):
        """The constants of every kernel; the causal ones add CAUSAL, those of sub-chunks BC."""
        return dict(BT=CHUNK, BK=self.bk, BV=self.bv, ROTARY=rotary, DOT=self.dot, PRECISION=self.precision)

    def chunk_states(self, like: torch.Tensor, causal: bool):
        """Empty states (B*H, chunks, M, Dv) and key sums (B*H, chunks, M) per chunk when causal, else
        the whole sequence's (B*H, M, Dv) and (B*H, M) in float32."""
        if not causal:
            return (like.new_empty((self.batch_heads, self.m, self.dv), dtype=torch.float32),
                    like.new_empty((self.batch_heads, self.m), dtype=torch.float32))
        h = like.new_empty((self.batch_heads, self.n_t, self.m, self.dv), dtype=self.state_dtype)
        return h, like.new_empty((self.batch_heads, self.n_t, self.m), dtype=torch.float32)


def _scales(b: torch.Tensor, a: torch.Tensor, causal: bool, rotary: bool):
    """F (the running max of a; the whole sequence's without `causal`), P (its pair max when rotary)
    and Q = max_j (b_j + F_j) per row, which the kernels read.  They cancel in the output: no gradient."""
    with torch.no_grad():
        feat = a.cummax(-2).values if causal else a.amax(-2, keepdim=True).expand_as(a).contiguous()
        pair = pair_max(feat).contiguous() if rotary else feat
        return feat, pair, (b + feat).amax(-1).contiguous()


def _states(a, v, scales, turns, shapes: _Shapes, rotary: bool, causal: bool, want_state: bool):
    """The states the output pass reads (per chunk when causal, else the whole sequence's) and, with
    `want_state`, the state after the last token (kv, k_sum at its scales)."""
    kv, k_sum = (a.new_empty((*a.shape[:2], shapes.m, shapes.dv)), a.new_empty(a.shape[:2] + (shapes.m,))) \
        if want_state or not causal else (a.new_empty(0),) * 2
    h, z = shapes.chunk_states(a, True) if causal else (kv, k_sum)
    feat, pair, _ = scales
    _states_kernel[(shapes.n_k, shapes.n_v, shapes.batch_heads)](
        a, v, feat, pair, turns, h, z, kv, k_sum, *shapes.args(), CHUNKS=causal, STATE=want_state or not causal,
        **shapes.constants(rotary))
    return h, z, kv, k_sum


_FITTING_LEVEL: dict = {}   # (pass, rotary, causal, device, dtype) -> the first level whose tiles fitted


def _fitting(key: tuple, run_at_level):
    return launch_fitting(_FITTING_LEVEL, key, len(TILE_LEVELS), run_at_level, "log-space chunk-parallel")


class _LogChunkParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b, a, v, turns, rotary, causal, want_state):
        scales = _scales(b, a, causal, rotary)

        def at_level(level):
            shapes = _Shapes(b, v, level)
            h, z, kv, k_sum = _states(a, v, scales, turns, shapes, rotary, causal, want_state)
            # float32, cast to v's dtype by the caller: backward's gd = -(g . out) / den needs it unrounded
            out = torch.empty(v.shape, device=v.device, dtype=torch.float32)
            den = b.new_empty(b.shape[:-1])
            _output_kernel[(shapes.n_v, shapes.n_s, shapes.batch_heads)](
                b, a, v, *scales, turns, h, z, out, den, *shapes.args(), BC=SUB_CHUNK, CAUSAL=causal,
                **shapes.constants(rotary))
            return out, den, kv, k_sum

        out, den, kv, k_sum = _fitting(("forward", rotary, causal, v.device, v.dtype), at_level)
        ctx.save_for_backward(b, a, v, out, den, turns)
        ctx.rotary, ctx.causal = rotary, causal
        ctx.mark_non_differentiable(kv, k_sum)
        return out, kv, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _d_kv, _d_k_sum):
        b, a, v, out, den, turns = ctx.saved_tensors
        g, gd = (t.contiguous() for t in output_gradients(grad.float(), out.float(), den))
        scales = _scales(b, a, ctx.causal, ctx.rotary)
        feat, pair, query = scales

        def at_level(level):
            shapes = _Shapes(b, v, level)
            constants = dict(BC=SUB_CHUNK, CAUSAL=ctx.causal, **shapes.constants(ctx.rotary))
            h, z, _, _ = _states(a, v, scales, turns, shapes, ctx.rotary, ctx.causal, want_state=False)
            dh, dz = shapes.chunk_states(a, ctx.causal)
            _dstate_kernel[(shapes.n_k, shapes.n_v, shapes.batch_heads)](
                b, feat, pair, query, g, gd, turns, dh, dz, *shapes.args(), CAUSAL=ctx.causal,
                **shapes.constants(ctx.rotary))
            db, da, dv = torch.empty_like(b), torch.empty_like(a), torch.empty_like(v)
            _dq_kernel[(shapes.n_k, shapes.n_s, shapes.batch_heads)](
                b, a, v, *scales, g, gd, turns, h, z, db, *shapes.args(), **constants)
            _dk_kernel[(shapes.n_k, shapes.n_s, shapes.batch_heads)](
                b, a, v, *scales, g, gd, turns, dh, dz, da, *shapes.args(), **constants)
            _dv_kernel[(shapes.n_v, shapes.n_s, shapes.batch_heads)](
                b, a, *scales, g, turns, dh, dv, *shapes.args(), **constants)
            return db, da, dv

        db, da, dv = _fitting(("backward", ctx.rotary, ctx.causal, v.device, v.dtype), at_level)
        return db, da, dv, None, None, None, None


def log_linear_attention(b, a, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int = 0,
                         rope_base: float = DEFAULT_BASE, return_state: bool = False):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k ((B, H, N, M) tensors; a `LogProjection`
    is materialised) and (B, H, N, Dv) values with the chunk-parallel kernels, exact at any input scale
    as stable.py; the same call and results as the torch backend (and its `LinearState`, with F as
    log_scale, with `return_state`, causal only).  Log-features are read in float32 whatever their
    dtype; the values' dtype (the inputs' common one) sets the dots'.  Called by
    `linattn.functional.linear_attention`, which has checked the inputs (N >= 1)."""
    check_interpreter_unchanged()
    if return_state and not causal:
        raise ValueError("return_state=True needs causal=True: a non-causal pass has no decoding state")
    # -inf (a feature exactly 0) raised to a finite floor, as the public call does before it gets here
    b, a = (finite_log_features(x.materialize() if isinstance(x, LogProjection) else x) for x in (b, a))
    dtype = common_dtype(b, a, v)
    turns = angle_table(max(b.shape[-1] // 2, 1), float(rope_base), offset if rotary else 0, b.device)
    with torch.autocast(b.device.type, enabled=False):
        b_c, a_c = (x.float().contiguous() for x in (b, a))
        out, kv, k_sum = _LogChunkParallelAttention.apply(b_c, a_c, v.to(dtype).contiguous(), turns, rotary,
                                                          causal, return_state)
    out = out.to(v.dtype)
    if not return_state:
        return out
    # The state is kept at the last token's scales: F is then the max over all keys.
    return out, LinearState(kv, k_sum, int(offset) + b.shape[-2], a_c.detach().amax(-2))
