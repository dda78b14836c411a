"""The Triton backend: Eq. 19 in two fused kernels (forward, backward), causal or not.

Each program owns one (feature tile of BK, value tile of BV) block of the M x Dv state of one
(batch, head) and walks the sequence in chunks of BT tokens, keeping the state in registers:

    forward, chunk t:   num_t = mask(Rq Rk^T) v + Rq S        S += (Rk)^T v
                        den_t = q . (z + cumsum(k))           z += sum(k)

R rotates the loaded feature tiles in registers (pairs (2i, 2i+1) multiplied by e^{i p theta_i}); the
denominator uses the same tiles unrotated.  Scores and denominators are linear in the feature
dimension, so each feature tile writes a partial numerator and denominator that the host sums.

Backward recomputes the state instead of saving it, so only q, k, v are kept (O(N (M + Dv))).
With G = d num and g = d den, and S_t, Z the states before chunk t:

    d(Rq)_m = sum_{n<=m} (G_m . v_n) Rk_n        = mask(G v^T) Rk + G S_t^T       (forward loop)
    d(Rk)_n = sum_{m>=n} (G_m . v_n) Rq_m        = mask(G v^T)^T Rq + v dS_t^T     (reverse loop)
    dv_n    = sum_{m>=n} (Rq_m . Rk_n) G_m        = mask(Rq Rk^T)^T G + Rk dS_t
    dq_m   += g_m (Z + cumsum(k))_m,  dk_n += sum_{m>=n} g_m q_m
    dS_t    = sum_{m after chunk t} (Rq_m)^T G_m,  and d(feature) = R^T d(rotated feature).

The partial gradients of a program (over its value tile for dq, dk, over its feature tile for dv)
are summed on the host.  Without `causal` the state is the sum over all tokens: a first loop builds
it, the second reads it.

Angles: the offset's turns, offset * theta_i / 2pi mod 1, come from rotary.py's exact reduction
(any offset below 2^63); the kernels add row * theta_i / 2pi in float64 for the rows of the call
and reduce to a fraction of a turn before going to float32, so every position is accurate to ~1e-6
rad.

Log-features (LOG, stable.py's algorithm; the FAVOR+ block's path): the kernels read b = log phi_q,
a = log phi_k and three tensors made in torch by `_log_scales` (F, the running max of a; Q per row;
the exact-row flags), and form the factors in registers: the numerator's and the denominator's
separately, scaled by the running maxima at the chunk's first token, so the loops above carry the
per-feature decay e^{F_k - F_{k+1}} (e^{P_k - P_{k+1}} for the numerator) between chunks, the
gated-linear-attention structure.  Each row takes its own Q, and its numerator cap is measured
against its own pair scale P_m, as `linear_attention_step` does (cap at e^{30 + P_k - P_m}).  A
chunk holding rows whose running max jumped by more than JUMP_LIMIT since its first token writes
those rows, and the state it hands on, from a token pass in which every token has its own scales
(`_tokens_forward`, reversed in `_tokens_backward`); its other rows keep the chunk form, so no
output depends on a later token, bit for bit.  Backward recomputes everything from b, a, v and
hands back d b = d q_num q_num + d q_den q_den (zero where capped), likewise d a.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rotary import DEFAULT_BASE
from . import stable
from .common import LogProjection, divide
from .recurrent import LinearState
from .triton_common import (angle_table, check_grid, check_interpreter_unchanged, common_dtype,
                            dot_settings, launch_fitting, mm, phases, rotate, store, tile, tile_size)

CHUNK = 64            # tokens per step of the scan (BT)
# Tiles measured on an H100 (b=1, h=8, M=256, Dv=64, fp32 fwd+bwd, N=4096 and 65536): BK=32 was
# 1.7-2.4x faster than BK=64 (twice the programs); BV=16 gained nothing over 32 and costs one
# more partial dq/dk each.
FEATURE_TILE = 32     # feature tile (BK): the BK x BV state tile lives in registers
VALUE_TILE = 64       # largest value tile (BV); narrowed to 32 when the grid would leave SMs idle
MIN_VALUE_TILE = 32
# Software-pipelining stages of the causal log-space backward: with triton's default of 3 it needed
# 248-264 KB of shared memory on sm_90, over an H100's 227 KB per block; 2 stages need 206 KB
# (compiled for sm_90 without a GPU by tests/linattn/ops/compile_kernels.py).
LOG_BACKWARD_STAGES = 2
# (largest feature tile, largest value tile, pipelining stages or None for triton's default) per
# level, tried in order until the kernels fit the GPU's shared memory per block (`_launch_fitting`).
# Compiled without a GPU (tests/linattn/ops/compile_kernels.py), the causal log-space backward needs
# the most in every level: level 0 206 KB on sm_90 (H100: 227 KB per block) and 140 KB on sm_86;
# level 1 64 KB on sm_86 (RTX 30xx/40xx, A10, L4: 99 KB) but 68 KB on sm_75; level 2 49 KB on sm_75
# (T4: 64 KB).
TILE_LEVELS = ((FEATURE_TILE, VALUE_TILE, None), (FEATURE_TILE, MIN_VALUE_TILE, 1), (16, 16, 1))
JUMP_LIMIT = tl.constexpr(stable.JUMP_LIMIT)          # the log-space limits of stable.py, for the kernels
NUMERATOR_CAP = tl.constexpr(stable.NUMERATOR_CAP)


@triton.jit
def _pair_max(x, R: tl.constexpr, BK: tl.constexpr):
    """max over each rotation pair (2i, 2i+1) of the (R, BK) tile, written back to both."""
    even, odd = tl.split(tl.reshape(x, (R, BK // 2, 2)))
    top = tl.maximum(even, odd)
    return tl.reshape(tl.join(top, top), (R, BK))


@triton.jit
def _scales(f_ptr, row, k_cols, N, M, BK: tl.constexpr, ROTARY: tl.constexpr):
    """F (the running max of the key log-features) and P (its pair max), (1, BK), at `row`."""
    f = tile(f_ptr, row + tl.arange(0, 1), k_cols, N, M, M)
    p = f
    if ROTARY:
        p = _pair_max(f, 1, BK)
    return f, p


@triton.jit
def _decay(state, k_sum, f_old, p_old, f_new, p_new, BK: tl.constexpr):
    """Rescale a state kept relative to the scales (f_old, p_old) to (f_new, p_new): both are
    running maxima, so the factors are <= 1 (stable.py, 2.)."""
    return (state * tl.trans(tl.exp(p_old - p_new)), k_sum * tl.reshape(tl.exp(f_old - f_new), (BK,)))


@triton.jit
def _exp(x, live):
    """e^x where live, 0 elsewhere (padding rows and columns, whose x means nothing)."""
    return tl.exp(tl.where(live, x, float("-inf")))


@triton.jit
def _factors(q_ptr, k_ptr, f_ptr, qs_ptr, rows, k_cols, f_s, p_s, N, M,
             BT: tl.constexpr, BK: tl.constexpr, ROTARY: tl.constexpr, LOG: tl.constexpr):
    """The (BT, BK) query and key factors of `rows`, numerator's and denominator's, and the
    derivatives of the log-space ones by their log-features (zero where capped).  Plain features
    are their own factors.  Log-features (stable.py) are scaled by (f_s, p_s), the running maxima at
    a past position, and by each row's own Q; the numerator query's cap is measured against the
    row's own pair scale, so it acts at the same place whatever the chunking."""
    q = tile(q_ptr, rows, k_cols, N, M, M)
    k = tile(k_ptr, rows, k_cols, N, M, M)
    if not LOG:
        return q, q, k, k, q, k, k
    live = (rows < N)[:, None] & (k_cols < M)[None, :]
    q_scale = tl.load(qs_ptr + rows, mask=rows < N, other=0.0)[:, None]
    p_own = tile(f_ptr, rows, k_cols, N, M, M)
    if ROTARY:
        p_own = _pair_max(p_own, BT, BK)
    # (b - Q) + F, not (b + F) - Q: at |b|, |F| in the thousands both steps of the former are
    # exact (Sterbenz), while b + F rounds by ~1e-3, an error per term that would not cancel.
    q_shift = q - q_scale
    q_log, q_cap = q_shift + p_s, p_s - p_own + NUMERATOR_CAP
    q_num = _exp(tl.minimum(q_log, q_cap), live)
    q_den = _exp(q_shift + f_s, live)
    k_num = _exp(tl.minimum(k - p_s, JUMP_LIMIT), live)
    k_den = _exp(tl.minimum(k - f_s, JUMP_LIMIT), live)
    return (q_num, q_den, k_num, k_den, tl.where(q_log > q_cap, 0.0, q_num),
            tl.where(k - p_s > JUMP_LIMIT, 0.0, k_num), tl.where(k - f_s > JUMP_LIMIT, 0.0, k_den))


@triton.jit
def _token(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, turns_ptr, row, i_k, k_cols, v_cols, N, M, DV,
           BK: tl.constexpr, ROTARY: tl.constexpr):
    """One token's factors at its own scales (1, BK), rotated, with its value and phases."""
    rows = row + tl.arange(0, 1)
    f, p = _scales(f_ptr, row, k_cols, N, M, BK, ROTARY)
    q_num, q_den, k_num, k_den, q_grad, k_num_grad, k_den_grad = _factors(
        q_ptr, k_ptr, f_ptr, qs_ptr, rows, k_cols, f, p, N, M, 1, BK, ROTARY, True)
    cos = tl.full((1, BK // 2), 1.0, tl.float32)
    sin = tl.zeros((1, BK // 2), tl.float32)
    q_rot, k_rot = q_num, k_num
    if ROTARY:
        cos, sin = phases(turns_ptr, row, i_k, M // 2, 1, BK)
        q_rot, k_rot = rotate(q_num, cos, sin, 1, BK), rotate(k_num, cos, sin, 1, BK)
    v = tile(v_ptr, rows, v_cols, N, DV, DV)
    return rows, f, p, q_rot, q_den, k_rot, k_den, q_grad, k_num_grad, k_den_grad, v, cos, sin


@triton.jit
def _tokens_forward(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, out_ptr, den_ptr,
                    dnum_ptr, dden_ptr, state, k_sum, f_ref, p_ref, first, i_k, i_v, k_cols,
                    v_cols, N, M, DV, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    ROTARY: tl.constexpr, GRAD: tl.constexpr):
    """A chunk with exact rows (stable.py, 3.), token by token, each at its own scales: the state
    is rescaled to every token's running max, so no factor exceeds 1 whatever the jump.  At exact
    rows it writes the numerator and denominator, or with GRAD the log-feature gradient of the
    query (d(R q_num) = S g, d q_den = g_den Z).  Returns the state at the chunk's last scales."""
    for i in range(0, BT):
        row = first + i
        if row < N:
            rows, f, p, q_rot, q_den, k_rot, k_den, q_grad, _kn, _kd, v, cos, sin = _token(
                q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, turns_ptr, row, i_k, k_cols, v_cols, N, M,
                DV, BK, ROTARY)
            state, k_sum = _decay(state, k_sum, f_ref, p_ref, f, p, BK)
            f_ref, p_ref = f, p
            state += tl.trans(k_rot) * v
            k_sum += tl.reshape(k_den, (BK,))
            if tl.load(exact_ptr + row) != 0:
                if GRAD:
                    g = tile(dnum_ptr, rows, v_cols, N, DV, DV)
                    g_den = tl.load(dden_ptr + rows)
                    d_rot = tl.reshape(tl.sum(state * g, axis=1), (1, BK))
                    if ROTARY:
                        d_rot = rotate(d_rot, cos, -sin, 1, BK)
                    dq = d_rot * q_grad
                    if i_v == 0:
                        dq += g_den[:, None] * k_sum[None, :] * q_den
                    store(out_ptr, dq, rows, k_cols, rows < N, M, M)
                else:
                    num = tl.reshape(tl.sum(tl.trans(q_rot) * state, axis=0), (1, BV))
                    store(out_ptr, num, rows, v_cols, rows < N, DV, DV)
                    if i_v == 0:
                        tl.store(den_ptr + rows, tl.sum(q_den * k_sum[None, :], axis=1))
    return state, k_sum, f_ref, p_ref


@triton.jit
def _tokens_backward(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, dnum_ptr, dden_ptr,
                     d_state, dq_sum, first, i_k, i_v, k_cols, v_cols, N, M, DV,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr):
    """The reverse of _tokens_forward for keys and values.  With S_i = e^{P_{i-1} - P_i} S_{i-1}
    + (R k_i) v_i^T and exact rows reading S_i, G_i = d loss / d S_i runs backward as
        G_i = [i exact] (R q_i)^T g_i + e^{P_i - P_{i+1}} G_{i+1},
        d(R k_i) = G_i v_i,   dv_i = G_i^T (R k_i),   d k_den_i = H_i (likewise for Z).
    d_state, dq_sum come in at the chunk's last scales and leave at its first token's (the scales
    the chunk starts from).  Returns the keys' log-feature gradients and dv as (BT, .) tiles."""
    within = tl.arange(0, BT)
    dk_tile = tl.zeros((BT, BK), dtype=tl.float32)
    dv_tile = tl.zeros((BT, BV), dtype=tl.float32)
    for j in range(0, BT):
        i = BT - 1 - j
        row = first + i
        if row < N:
            rows, f, p, q_rot, q_den, k_rot, k_den, _qg, k_num_grad, k_den_grad, v, cos, sin = _token(
                q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, turns_ptr, row, i_k, k_cols, v_cols, N, M,
                DV, BK, ROTARY)
            if tl.load(exact_ptr + row) != 0:
                g = tile(dnum_ptr, rows, v_cols, N, DV, DV)
                d_state += tl.trans(q_rot) * g
                dq_sum += tl.reshape(tl.load(dden_ptr + rows)[:, None] * q_den, (BK,))
            dk_rot = tl.reshape(tl.sum(d_state * v, axis=1), (1, BK))
            if ROTARY:
                dk_rot = rotate(dk_rot, cos, -sin, 1, BK)
            dk = dk_rot * k_num_grad
            if i_v == 0:
                dk += dq_sum[None, :] * k_den_grad
            here = (within == i)[:, None]
            dk_tile = tl.where(here, dk, dk_tile)
            dv_tile = tl.where(here, tl.reshape(tl.sum(tl.trans(k_rot) * d_state, axis=0), (1, BV)), dv_tile)
            f_prev, p_prev = _scales(f_ptr, tl.maximum(row - 1, first), k_cols, N, M, BK, ROTARY)
            d_state, dq_sum = _decay(d_state, dq_sum, f_prev, p_prev, f, p, BK)
    return dk_tile, dv_tile, d_state, dq_sum


@triton.jit
def _chunk_form_rows(exact_ptr, rows, N):
    """The rows (< N) whose outputs the chunk form gives: all but the exact ones, in log-space."""
    return tl.load(exact_ptr + rows, mask=rows < N, other=1) == 0


@triton.jit
def _chunk_is_exact(exact_ptr, first, N, BT: tl.constexpr):
    """Whether chunk rows first.. hold exact rows: the flag grows with the row, so its last says."""
    return tl.load(exact_ptr + tl.minimum(first + BT, N) - 1) != 0


@triton.jit
def _state_after_chunk(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, out_ptr, den_ptr, dnum_ptr,
                       dden_ptr, state, k_sum, f_ref, p_ref, k_rot, v, k_den, first, i_k, i_v, k_cols,
                       v_cols, N, M, DV, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       ROTARY: tl.constexpr, LOG: tl.constexpr, GRAD: tl.constexpr, DOT: tl.constexpr,
                       PRECISION: tl.constexpr):
    """The causal state after chunk `first..`: one product, or the token pass where the chunk has
    exact rows (which also writes those rows' outputs, or with GRAD their query gradients)."""
    exact_chunk = False
    if LOG:
        exact_chunk = _chunk_is_exact(exact_ptr, first, N, BT)
    if exact_chunk:
        state, k_sum, f_ref, p_ref = _tokens_forward(
            q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, out_ptr, den_ptr, dnum_ptr, dden_ptr,
            state, k_sum, f_ref, p_ref, first, i_k, i_v, k_cols, v_cols, N, M, DV, BT, BK, BV,
            ROTARY, GRAD)
    else:
        state += mm(tl.trans(k_rot), v, DOT, PRECISION)
        k_sum += tl.sum(k_den, axis=0)
    return state, k_sum, f_ref, p_ref


@triton.jit(do_not_specialize=["N"])
def _forward_kernel(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, num_ptr, den_ptr, kv_ptr,
                    ksum_ptr, N, M, DV,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr,
                    ROTARY: tl.constexpr, STATE: tl.constexpr, LOG: tl.constexpr, DOT: tl.constexpr,
                    PRECISION: tl.constexpr):
    # int64: the offsets of (B, H, N, M) tensors below pass 2^31 at long contexts (B*H*N*M >= 2^31)
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_bh = tl.num_programs(2)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    f_ptr += i_bh * N * M
    qs_ptr += i_bh * N
    exact_ptr += i_bh * N
    num_ptr += (i_k * n_bh + i_bh) * N * DV
    den_ptr += (i_k * n_bh + i_bh) * N
    k_cols = i_k * BK + tl.arange(0, BK)
    v_cols = i_v * BV + tl.arange(0, BV)
    within = tl.arange(0, BT)
    causal_mask = within[:, None] >= within[None, :]
    state = tl.zeros((BK, BV), dtype=tl.float32)
    k_sum = tl.zeros((BK,), dtype=tl.float32)
    f_ref = tl.zeros((1, BK), dtype=tl.float32)    # log-features: the scales the state is kept at
    p_ref = f_ref
    if LOG:
        f_ref, p_ref = _scales(f_ptr, 0, k_cols, N, M, BK, ROTARY)
    n_chunks = tl.cdiv(N, BT)
    if not CAUSAL:  # every query sees every key: build the whole state first
        for t in range(0, n_chunks):
            rows = t * BT + within
            _qn, _qd, k_num, k_den, _qg, _kng, _kdg = _factors(q_ptr, k_ptr, f_ptr, qs_ptr, rows, k_cols,
                                                              f_ref, p_ref, N, M, BT, BK, ROTARY, LOG)
            v = tile(v_ptr, rows, v_cols, N, DV, DV)
            k_rot = k_num
            if ROTARY:
                cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
                k_rot = rotate(k_num, cos, sin, BT, BK)
            state += mm(tl.trans(k_rot), v, DOT, PRECISION)
            k_sum += tl.sum(k_den, axis=0)
    for t in range(0, n_chunks):
        first = t * BT
        rows = first + within
        if LOG and CAUSAL:   # the chunk works at the scales of its first token
            f_s, p_s = _scales(f_ptr, first, k_cols, N, M, BK, ROTARY)
            state, k_sum = _decay(state, k_sum, f_ref, p_ref, f_s, p_s, BK)
            f_ref, p_ref = f_s, p_s
        q_num, q_den, k_num, k_den, _qg, _kng, _kdg = _factors(q_ptr, k_ptr, f_ptr, qs_ptr, rows, k_cols,
                                                              f_ref, p_ref, N, M, BT, BK, ROTARY, LOG)
        q_rot = q_num
        if ROTARY:
            cos, sin = phases(turns_ptr, first, i_k, M // 2, BT, BK)
            q_rot = rotate(q_num, cos, sin, BT, BK)
        written = rows < N
        if CAUSAL:
            v = tile(v_ptr, rows, v_cols, N, DV, DV)
            k_rot = k_num
            if ROTARY:
                k_rot = rotate(k_num, cos, sin, BT, BK)
            scores = tl.where(causal_mask, mm(q_rot, tl.trans(k_rot), DOT, PRECISION), 0.0)
            num = mm(scores, v, DOT, PRECISION) + mm(q_rot, state, DOT, PRECISION)
            den = tl.sum(q_den * (tl.cumsum(k_den, axis=0) + k_sum[None, :]), axis=1)
            if LOG:
                written = _chunk_form_rows(exact_ptr, rows, N)
        else:
            num = mm(q_rot, state, DOT, PRECISION)
            den = tl.sum(q_den * k_sum[None, :], axis=1)
        store(num_ptr, num, rows, v_cols, written, DV, DV)
        if i_v == 0:
            tl.store(den_ptr + rows, den, mask=written)
        if CAUSAL:
            state, k_sum, f_ref, p_ref = _state_after_chunk(
                q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, num_ptr, den_ptr, num_ptr, den_ptr,
                state, k_sum, f_ref, p_ref, k_rot, v, k_den, first, i_k, i_v, k_cols, v_cols, N, M, DV,
                BT, BK, BV, ROTARY, LOG, False, DOT, PRECISION)
    if STATE:
        if LOG:   # hand the state over at the last token's own scales, as the recurrent step keeps it
            f_last, p_last = _scales(f_ptr, N - 1, k_cols, N, M, BK, ROTARY)
            state, k_sum = _decay(state, k_sum, f_ref, p_ref, f_last, p_last, BK)
        store(kv_ptr + i_bh * M * DV, state, k_cols, v_cols, k_cols < M, DV, DV)
        if i_v == 0:
            tl.store(ksum_ptr + i_bh * M + k_cols, k_sum, mask=k_cols < M)


@triton.jit
def _backward_chunk(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, dnum_ptr, dden_ptr, turns_ptr, first, f_s, p_s,
                    i_k, k_cols, v_cols, N, M, DV, BT: tl.constexpr, BK: tl.constexpr,
                    ROTARY: tl.constexpr, LOG: tl.constexpr):
    """Chunk tiles for backward: factors (and their derivatives), values, output gradients, the
    rotated factors and the phases that rotate back their gradients (identity without rotation)."""
    rows = first + tl.arange(0, BT)
    q_num, q_den, k_num, k_den, q_grad, k_num_grad, k_den_grad = _factors(
        q_ptr, k_ptr, f_ptr, qs_ptr, rows, k_cols, f_s, p_s, N, M, BT, BK, ROTARY, LOG)
    v = tile(v_ptr, rows, v_cols, N, DV, DV)
    g_num = tile(dnum_ptr, rows, v_cols, N, DV, DV)
    g_den = tl.load(dden_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    cos = tl.full((BT, BK // 2), 1.0, tl.float32)
    sin = tl.zeros((BT, BK // 2), tl.float32)
    q_rot, k_rot = q_num, k_num
    if ROTARY:
        cos, sin = phases(turns_ptr, first, i_k, M // 2, BT, BK)
        q_rot, k_rot = rotate(q_num, cos, sin, BT, BK), rotate(k_num, cos, sin, BT, BK)
    return (rows, q_den, k_den, q_grad, k_num_grad, k_den_grad, v, g_num, g_den, q_rot, k_rot, cos, sin)


@triton.jit
def _by_log_feature(d_rot, cos, sin, d_den, factor_grad, den_factor, first_value_tile,
                    BT: tl.constexpr, BK: tl.constexpr, ROTARY: tl.constexpr, LOG: tl.constexpr):
    """The gradient of a feature from those of its rotated numerator factor and of its denominator
    factor (the latter only once, by the first value tile): R^T, then through the exponentials
    for log-features (d x = d factor * factor, zero where capped)."""
    d = d_rot
    if ROTARY:
        d = rotate(d_rot, cos, -sin, BT, BK)
    if LOG:
        d = d * factor_grad
        if first_value_tile:
            d += d_den * den_factor
    elif first_value_tile:
        d += d_den
    return d


@triton.jit(do_not_specialize=["N"])
def _backward_kernel(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, dnum_ptr, dden_ptr, turns_ptr,
                     dq_ptr, dk_ptr, dv_ptr, N, M, DV,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr,
                     ROTARY: tl.constexpr, LOG: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    # int64: the offsets of (B, H, N, M) tensors below pass 2^31 at long contexts (B*H*N*M >= 2^31)
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_bh = tl.num_programs(2)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    f_ptr += i_bh * N * M
    qs_ptr += i_bh * N
    exact_ptr += i_bh * N
    dnum_ptr += i_bh * N * DV
    dden_ptr += i_bh * N
    dq_ptr += (i_v * n_bh + i_bh) * N * M
    dk_ptr += (i_v * n_bh + i_bh) * N * M
    dv_ptr += (i_k * n_bh + i_bh) * N * DV
    k_cols = i_k * BK + tl.arange(0, BK)
    v_cols = i_v * BV + tl.arange(0, BV)
    within = tl.arange(0, BT)
    causal_mask = within[:, None] >= within[None, :]
    first_value_tile = i_v == 0
    n_chunks = tl.cdiv(N, BT)
    f_ref = tl.zeros((1, BK), dtype=tl.float32)
    p_ref = f_ref
    if LOG:
        f_ref, p_ref = _scales(f_ptr, 0, k_cols, N, M, BK, ROTARY)

    # Pass 1, forward in time: d(Rq) needs the state S and key sum z of the chunks before.
    state = tl.zeros((BK, BV), dtype=tl.float32)
    k_sum = tl.zeros((BK,), dtype=tl.float32)
    d_state = tl.zeros((BK, BV), dtype=tl.float32)      # non-causal: sum over all of (Rq)^T G
    dq_sum = tl.zeros((BK,), dtype=tl.float32)          # non-causal: sum over all of g q_den
    for t in range(0, n_chunks):
        first = t * BT
        if LOG and CAUSAL:
            f_s, p_s = _scales(f_ptr, first, k_cols, N, M, BK, ROTARY)
            state, k_sum = _decay(state, k_sum, f_ref, p_ref, f_s, p_s, BK)
            f_ref, p_ref = f_s, p_s
        rows, q_den, k_den, q_grad, _kng, _kdg, v, g_num, g_den, q_rot, k_rot, cos, sin = _backward_chunk(
            q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, dnum_ptr, dden_ptr, turns_ptr, first, f_ref, p_ref,
            i_k, k_cols, v_cols, N, M, DV, BT, BK, ROTARY, LOG)
        if CAUSAL:
            d_scores = tl.where(causal_mask, mm(g_num, tl.trans(v), DOT, PRECISION), 0.0)
            dq_rot = mm(d_scores, k_rot, DOT, PRECISION) + mm(g_num, tl.trans(state), DOT, PRECISION)
            dq = _by_log_feature(dq_rot, cos, sin, g_den[:, None] * (tl.cumsum(k_den, axis=0) + k_sum[None, :]),
                                 q_grad, q_den, first_value_tile, BT, BK, ROTARY, LOG)
            written = rows < N
            if LOG:
                written = _chunk_form_rows(exact_ptr, rows, N)
            store(dq_ptr, dq, rows, k_cols, written, M, M)
            state, k_sum, f_ref, p_ref = _state_after_chunk(
                q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, dq_ptr, dden_ptr, dnum_ptr, dden_ptr,
                state, k_sum, f_ref, p_ref, k_rot, v, k_den, first, i_k, i_v, k_cols, v_cols, N, M, DV,
                BT, BK, BV, ROTARY, LOG, True, DOT, PRECISION)
        else:
            d_state += mm(tl.trans(q_rot), g_num, DOT, PRECISION)
            dq_sum += tl.sum(g_den[:, None] * q_den, axis=0)
            state += mm(tl.trans(k_rot), v, DOT, PRECISION)
            k_sum += tl.sum(k_den, axis=0)

    # Pass 2: backward in time for causal (dS, dz of the chunks after); any order otherwise.
    if CAUSAL:
        d_state = tl.zeros((BK, BV), dtype=tl.float32)
        dq_sum = tl.zeros((BK,), dtype=tl.float32)
        if LOG:   # the scales of the chunk after (for the last chunk, any finite ones will do)
            f_ref, p_ref = _scales(f_ptr, N - 1, k_cols, N, M, BK, ROTARY)
    for i in range(0, n_chunks):
        t = n_chunks - 1 - i
        first = t * BT
        f_s, p_s = f_ref, p_ref
        exact_chunk = False
        if LOG and CAUSAL:   # carry G from the chunk after's scales to those this chunk ends at
            f_s, p_s = _scales(f_ptr, first, k_cols, N, M, BK, ROTARY)
            exact_chunk = _chunk_is_exact(exact_ptr, first, N, BT)
            f_end, p_end = f_s, p_s
            if exact_chunk:
                f_end, p_end = _scales(f_ptr, tl.minimum(first + BT, N) - 1, k_cols, N, M, BK, ROTARY)
            d_state, dq_sum = _decay(d_state, dq_sum, f_end, p_end, f_ref, p_ref, BK)
        rows, q_den, k_den, q_grad, k_num_grad, k_den_grad, v, g_num, g_den, q_rot, k_rot, cos, sin = \
            _backward_chunk(q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, dnum_ptr, dden_ptr, turns_ptr, first, f_s,
                            p_s, i_k, k_cols, v_cols, N, M, DV, BT, BK, ROTARY, LOG)
        if CAUSAL:
            # A chunk with exact rows: they and the state it hands on come from the token pass;
            # the chunk form below covers the other rows' reads only.
            dk_tokens = tl.zeros((BT, BK), dtype=tl.float32)
            dv_tokens = tl.zeros((BT, BV), dtype=tl.float32)
            carried, carried_sum = d_state, dq_sum
            if exact_chunk:
                dk_tokens, dv_tokens, d_state, dq_sum = _tokens_backward(
                    q_ptr, k_ptr, v_ptr, f_ptr, qs_ptr, exact_ptr, turns_ptr, dnum_ptr, dden_ptr, d_state,
                    dq_sum, first, i_k, i_v, k_cols, v_cols, N, M, DV, BT, BK, BV, ROTARY)
                carried = tl.zeros((BK, BV), dtype=tl.float32)
                carried_sum = tl.zeros((BK,), dtype=tl.float32)
                chunk_form = _chunk_form_rows(exact_ptr, rows, N)
                g_num = tl.where(chunk_form[:, None], g_num, 0.0)
                g_den = tl.where(chunk_form, g_den, 0.0)
            scores = tl.where(causal_mask, mm(q_rot, tl.trans(k_rot), DOT, PRECISION), 0.0)
            d_scores = tl.where(causal_mask, mm(g_num, tl.trans(v), DOT, PRECISION), 0.0)
            g_q = g_den[:, None] * q_den
            dk_rot = mm(v, tl.trans(carried), DOT, PRECISION) + mm(tl.trans(d_scores), q_rot, DOT, PRECISION)
            dv = mm(k_rot, carried, DOT, PRECISION) + mm(tl.trans(scores), g_num, DOT, PRECISION) + dv_tokens
            dk = _by_log_feature(dk_rot, cos, sin, tl.cumsum(g_q, axis=0, reverse=True) + carried_sum[None, :],
                                 k_num_grad, k_den_grad, first_value_tile, BT, BK, ROTARY, LOG) + dk_tokens
            d_state += mm(tl.trans(q_rot), g_num, DOT, PRECISION)
            dq_sum += tl.sum(g_q, axis=0)
            f_ref, p_ref = f_s, p_s
        else:
            dq_rot = mm(g_num, tl.trans(state), DOT, PRECISION)
            dq = _by_log_feature(dq_rot, cos, sin, g_den[:, None] * k_sum[None, :], q_grad, q_den,
                                 first_value_tile, BT, BK, ROTARY, LOG)
            store(dq_ptr, dq, rows, k_cols, rows < N, M, M)
            dk = _by_log_feature(mm(v, tl.trans(d_state), DOT, PRECISION), cos, sin,
                                 tl.zeros((BT, BK), dtype=tl.float32) + dq_sum[None, :], k_num_grad, k_den_grad,
                                 first_value_tile, BT, BK, ROTARY, LOG)
            dv = mm(k_rot, d_state, DOT, PRECISION)
        store(dk_ptr, dk, rows, k_cols, rows < N, M, M)
        store(dv_ptr, dv, rows, v_cols, rows < N, DV, DV)


def _valuetile(dv: int, programs_per_value_tile: int, device: torch.device, largest: int) -> int:
    """Each program scans the whole sequence, so a grid of fewer programs than the GPU has SMs
    leaves most of it idle (b=1, h=8, M=256 gives 32): narrow the value tile until it fills them."""
    tile = tile_size(dv, largest)
    if device.type != "cuda":
        return tile
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    while tile > MIN_VALUE_TILE and programs_per_value_tile * triton.cdiv(dv, tile) < processors:
        tile //= 2
    return tile


def _reduce(partials: torch.Tensor) -> torch.Tensor:
    """Sum the per-tile partial results (dim 0); a single tile needs no copy."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)


class _Launch:
    """The shapes, tiles and settings of one kernel launch.  `level` indexes TILE_LEVELS: a GPU with
    less shared memory per block than the tiles of level 0 need takes the next level that fits."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, *, causal: bool, rotary: bool, turns: torch.Tensor,
                 level: int, backward: bool, log: bool):
        feature_tile, value_tile, stages = TILE_LEVELS[level]
        self.level, self.turns = level, turns
        self.batch_heads, self.n, self.m = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        check_grid(q.shape[0], q.shape[1])
        self.dv = v.shape[-1]
        self.bk = tile_size(self.m, feature_tile)
        self.n_k = triton.cdiv(self.m, self.bk)
        self.bv = _valuetile(self.dv, self.batch_heads * self.n_k, q.device, value_tile)
        self.n_v = triton.cdiv(self.dv, self.bv)
        self.causal, self.rotary = causal, rotary
        self.dot, self.precision = dot_settings(q.dtype)
        stages = pipelining_stages(level, backward=backward, log=log, causal=causal)
        self.stages = {} if stages is None else {"num_stages": stages}

    def grid(self):
        return (self.n_v, self.n_k, self.batch_heads)

    def constants(self):
        return dict(BT=CHUNK, BK=self.bk, BV=self.bv, CAUSAL=self.causal, ROTARY=self.rotary,
                    DOT=self.dot, PRECISION=self.precision, **self.stages)


def pipelining_stages(level: int, *, backward: bool, log: bool, causal: bool) -> int | None:
    """The num_stages a launch at `level` passes (None: triton's default, 3)."""
    stages = TILE_LEVELS[level][2]
    return LOG_BACKWARD_STAGES if stages is None and backward and log and causal else stages


_FITTING_LEVEL: dict = {}   # (kernel and mode, device, dtype) -> the first level whose tiles fitted


def _launch_fitting(mode: tuple, q: torch.Tensor, run_at_level):
    """triton_common.launch_fitting for a kernel of `mode` (kernel, causal, rotary, log) on q's device
    and dtype (level 0 needs up to 206 KB, sized for an H100)."""
    return launch_fitting(_FITTING_LEVEL, (mode, q.device, q.dtype), len(TILE_LEVELS), run_at_level, mode[0])


def _log_scales(b: torch.Tensor, a: torch.Tensor, causal: bool):
    """stable.py's scales for log-features (B, H, N, M), which the kernels read: F, the running max
    of the key log-features over positions <= n (over all positions without `causal`); Q, each row's
    max_j (b_j + F_j); and the exact rows, whose F grew by more than JUMP_LIMIT since the first token
    of their chunk of CHUNK tokens (int32, causal only).  They cancel in the output: no gradient."""
    with torch.no_grad():
        if causal:
            feat = a.cummax(-2).values
            chunk_start = feat[..., ::CHUNK, :].repeat_interleave(CHUNK, dim=-2)[..., :a.shape[-2], :]
            exact = ((feat - chunk_start).amax(-1) > stable.JUMP_LIMIT).to(torch.int32)
        else:
            feat = a.amax(-2, keepdim=True).expand_as(a).contiguous()
            exact = a.new_zeros(a.shape[:-1], dtype=torch.int32)
        return feat, (b + feat).amax(-1), exact


class _FusedLinearAttention(torch.autograd.Function):
    """(numerator, denominator) of Eq. 19 from features, or with `log` from log-features scaled as
    in stable.py (the scales are recomputed in backward, not saved); the division happens outside,
    in torch."""

    @staticmethod
    def forward(ctx, q, k, v, causal, rotary, turns, want_state, log):
        scales = _log_scales(q, k, causal) if log else (q, q, q)   # the kernels read them with LOG only

        def at_level(level):
            run = _Launch(q, v, causal=causal, rotary=rotary, turns=turns, level=level, backward=False, log=log)
            num = q.new_empty((run.n_k, *v.shape), dtype=torch.float32)
            den = q.new_empty((run.n_k, *q.shape[:-1]), dtype=torch.float32)
            state_shape = (*q.shape[:2], run.m) if want_state else (0,)   # kernels skip it without STATE
            kv = q.new_empty((*state_shape, run.dv) if want_state else state_shape, dtype=torch.float32)
            k_sum = q.new_empty(state_shape, dtype=torch.float32)
            _forward_kernel[run.grid()](q, k, v, *scales, run.turns, num, den, kv, k_sum, run.n, run.m, run.dv,
                                        STATE=want_state, LOG=log, **run.constants())
            return _reduce(num), _reduce(den), kv, k_sum

        num, den, kv, k_sum = _launch_fitting(("forward", causal, rotary, log), q, at_level)
        ctx.save_for_backward(q, k, v, turns)
        ctx.causal, ctx.rotary, ctx.log = causal, rotary, log
        ctx.mark_non_differentiable(kv, k_sum)
        return num, den, kv, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_num, d_den, _d_kv, _d_k_sum):
        q, k, v, turns = ctx.saved_tensors
        d_num = torch.zeros_like(v, dtype=torch.float32) if d_num is None else d_num.contiguous()
        d_den = q.new_zeros(q.shape[:-1], dtype=torch.float32) if d_den is None else d_den.contiguous()
        scales = _log_scales(q, k, ctx.causal) if ctx.log else (q, q, q)

        def at_level(level):
            run = _Launch(q, v, causal=ctx.causal, rotary=ctx.rotary, turns=turns, level=level, backward=True,
                          log=ctx.log)
            dq = q.new_empty((run.n_v, *q.shape), dtype=torch.float32)
            dk = q.new_empty((run.n_v, *q.shape), dtype=torch.float32)
            dv = q.new_empty((run.n_k, *v.shape), dtype=torch.float32)
            _backward_kernel[run.grid()](q, k, v, *scales, d_num, d_den, run.turns, dq, dk, dv, run.n, run.m,
                                         run.dv, LOG=ctx.log, **run.constants())
            return _reduce(dq).to(q.dtype), _reduce(dk).to(k.dtype), _reduce(dv).to(v.dtype)

        dq, dk, dv = _launch_fitting(("backward", ctx.causal, ctx.rotary, ctx.log), q, at_level)
        return dq, dk, dv, None, None, None, None, None


def _attend(q, k, v, dtype, *, causal, rotary, offset, rope_base, return_state, log):
    check_interpreter_unchanged()
    turns = angle_table(max(q.shape[-1] // 2, 1), float(rope_base), offset if rotary else 0, q.device)
    with torch.autocast(q.device.type, enabled=False):
        q_c, k_c, v_c = (t.to(dtype).contiguous() for t in (q, k, v))
        num, den, kv, k_sum = _FusedLinearAttention.apply(q_c, k_c, v_c, causal, rotary, turns, return_state, log)
        out = divide(num, den).to(v.dtype)
    if not return_state:
        return out
    # From log-features the state is kept at the last token's scales: F is then the max over all keys.
    log_scale = k_c.detach().amax(-2) if log else None
    return out, LinearState(kv, k_sum, int(offset) + q.shape[-2], log_scale)


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     rotary: bool, offset: int = 0, rope_base: float = DEFAULT_BASE,
                     return_state: bool = False):
    """Eq. 19 with the fused kernels; the same call and results as the torch backend.  Called by
    `linattn.functional.linear_attention`, which has checked the inputs."""
    return _attend(phi_q, phi_k, v, common_dtype(phi_q, phi_k, v), causal=causal, rotary=rotary,
                   offset=offset, rope_base=rope_base, return_state=return_state, log=False)


def log_linear_attention(b, a, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int = 0,
                         rope_base: float = DEFAULT_BASE, return_state: bool = False):
    """Eq. 19 from log-features b = log phi_q, a = log phi_k (tensors or `LogProjection`s, which
    are materialised: the kernels read (B, H, N, M) log-features), exact at any input scale as in
    stable.py, in float32 whatever the input dtype: log-features need float32's range and
    precision.  The returned state carries F, as the torch backend's."""
    b, a = (x.materialize() if isinstance(x, LogProjection) else x for x in (b, a))
    common_dtype(b, a, v)
    return _attend(b, a, v, torch.float32, causal=causal, rotary=rotary, offset=offset,
                   rope_base=rope_base, return_state=return_state, log=True)
