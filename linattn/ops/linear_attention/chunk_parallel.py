"""Chunk-parallel Triton kernels for Eq. 19 from plain features, causal or not (flash-linear-attention's
two-pass chunk algorithm, as in fla/ops/common/chunk_h.py and chunk_o.py), with the rotation and
the unrotated denominator fused.  The triton backend's path for plain features (functional.py).

With chunks of BT tokens, S_t = sum_{n before chunk t} (R_n k_n) v_n^T (M x Dv) and
z_t = sum_{n before chunk t} k_n (M), the output of row m of chunk t is

    num_m = (R_m q_m)^T S_t + sum_{n in t, n <= m} (R_m q_m . R_n k_n) v_n
    den_m = q_m . z_t       + sum_{n in t, n <= m} q_m . k_n                      out_m = num_m / den_m

Forward, two kernels:
  * `_states_kernel`, grid (feature tiles, value tiles, B*H): walks the chunks in order, keeping its
    BK x BV tile of S (and BK of z) in float32 registers, and writes S_t, z_t before every chunk t;
  * `_output_kernel`, grid (value tiles, chunks, B*H): every chunk at once; loops over the feature
    tiles with tl.dot on input-dtype tiles (bf16 on tensor cores) and float32 accumulation,
    forming R q S_t, the masked rotated scores and the unrotated ones for the denominator, and
    writes out = num / den (and den, for backward) directly.
R multiplies each pair (2i, 2i+1) of a loaded tile by e^{i p theta_i}, p = offset + row, with the
angles of triton_common.py (the offset reduced exactly on the host, rows added in float64 turns).

Backward (G = d num = g / den, gd = d den = -(g . out) / den, zero where den was clamped), with the
states recomputed by `_states_kernel` rather than saved:
  * `_dstate_kernel`, grid (feature tiles, value tiles, B*H), chunks in reverse: dS_t and dz_t, the
    sums over the rows after chunk t of (R q_m)^T G_m and gd_m q_m;
  * `_dqk_kernel`, grid (feature tiles, chunks, B*H), and `_dv_kernel`, grid (value tiles,
    chunks, B*H): every chunk at once (formulas where they are computed).
Memory kept for backward: q, k, v, out (input dtype) and den (float32), O(N (M + Dv)); the per-chunk
states, N/BT x M x Dv, live only inside forward or backward.

bf16 inputs multiply in bf16 and keep the states in bf16 between the passes, as fla does (when every
input is bf16: a call with mixed dtypes computes in float32; LinearAttention under autocast hands
its plain features over in the autocast dtype for this reason); fp32 and
fp16 inputs multiply as float32 (3xTF32), since the states and scores cast to fp16 could overflow
(triton_common.dot_settings, which also keeps the interpreter in float32).

Without `causal`, the states kernel sums the whole sequence's S and z (one per batch x head), the
output pass reads them in every chunk (num = R q S, den = q . z: no scores), the reverse pass sums
dS and dz over every row, and the gradient kernels read those.  This module covers plain features;
log-space calls take log_chunk_parallel.py's kernels (the same design in gated-linear-attention form).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rotary import DEFAULT_BASE
from .common import output_gradients
from .triton_common import (angle_table, check_grid, common_dtype, dot_settings, launch_fitting, mm, phases, rotate,
                            state_offset, store, tile, tile_size, unrotate)
from .recurrent import LinearState

CHUNK = 64          # tokens per chunk (BT); a power of two of at least 16 (tl.dot's minimum)
FEATURE_TILE = 64   # largest feature tile (BK)
VALUE_TILE = 64     # largest value tile (BV)
# Largest (feature, value) tiles per level, tried in order until a call's kernels fit the GPU's shared
# memory per block (triton_common.launch_fitting); tiles only change the rounding.  Compiled for sm_90
# without a GPU (tests/linattn/ops/compile_kernels.py), level 0 needs at most 164,864 bytes in float32 and
# 106,496 in bf16 (an H100 gives a block 232,448).
TILE_LEVELS = ((FEATURE_TILE, VALUE_TILE), (32, 32), (16, 16))
GUARD = tl.constexpr(torch.finfo(torch.float32).tiny ** 0.5)   # common.divide's clamp


@triton.jit
def _states_kernel(k_ptr, v_ptr, turns_ptr, h_ptr, z_ptr, kv_ptr, k_sum_ptr, N, M, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                   CHUNKS: tl.constexpr, STATE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """With CHUNKS, h[t] = S_t (BK x BV tile) and z[t] = z_t (BK, written by the first value tile's
    programs) for every chunk t; with STATE the state after the last token (LinearState's kv, k_sum,
    and the whole sequence's state without `causal`)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    k_ptr += i_bh * N * M
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
        rows = t * BT + tl.arange(0, BT)
        k = tile(k_ptr, rows, k_cols, N, M, M)
        v = tile(v_ptr, rows, v_cols, N, DV, DV)
        if i_v == 0:
            if CHUNKS:
                tl.store(z_ptr + t * M + k_cols, k_sum, mask=k_cols < M)
            k_sum += tl.sum(k, 0)
        if ROTARY:
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            k = rotate(k, cos, sin, BT, BK)
        state += mm(tl.trans(k), v, DOT, PRECISION)
    if STATE:
        store(kv_ptr + i_bh * M * DV, state, k_cols, v_cols, k_cols < M, DV, DV)
        if i_v == 0:
            tl.store(k_sum_ptr + i_bh * M + k_cols, k_sum, mask=k_cols < M)


@triton.jit
def _output_kernel(q_ptr, k_ptr, v_ptr, turns_ptr, h_ptr, z_ptr, out_ptr, den_ptr, N, M, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """out = num / den for one chunk and value tile; den is written by the first value tile.  Without
    `causal` every row reads the whole sequence's state: num = R q S, den = q . z."""
    i_v, t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    h_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    z_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    rows = t * BT + tl.arange(0, BT)
    v_cols = i_v * BV + tl.arange(0, BV)
    num = tl.zeros((BT, BV), dtype=tl.float32)
    scores = tl.zeros((BT, BT), dtype=tl.float32)       # R q (R k)^T
    den_scores = tl.zeros((BT, BT), dtype=tl.float32)   # q k^T, for the denominator when rotated
    den = tl.zeros((BT,), dtype=tl.float32)
    for i_k in range(tl.cdiv(M, BK)):
        k_cols = i_k * BK + tl.arange(0, BK)
        q = tile(q_ptr, rows, k_cols, N, M, M)
        k = tile(k_ptr, rows, k_cols, N, M, M)
        z = tl.load(z_ptr + k_cols, mask=k_cols < M, other=0.0)
        den += tl.sum(q * z[None, :], 1)
        if ROTARY:
            if CAUSAL:
                den_scores += mm(q, tl.trans(k), DOT, PRECISION)
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            q = rotate(q, cos, sin, BT, BK)
            k = rotate(k, cos, sin, BT, BK)
        num += mm(q, tile(h_ptr, k_cols, v_cols, M, DV, DV), DOT, PRECISION)
        if CAUSAL:
            scores += mm(q, tl.trans(k), DOT, PRECISION)
    if CAUSAL:
        causal = rows[:, None] >= rows[None, :]
        scores = tl.where(causal, scores, 0.0)
        if ROTARY:
            den += tl.sum(tl.where(causal, den_scores, 0.0), 1)
        else:   # unrotated, the numerator's scores are the denominator's
            den += tl.sum(scores, 1)
        num += mm(scores, tile(v_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
    # Features are non-negative, so den >= 0; clamped only where every key feature underflowed.
    store(out_ptr + i_bh * N * DV, num / tl.maximum(den, GUARD)[:, None], rows, v_cols, rows < N, DV, DV)
    if i_v == 0:
        tl.store(den_ptr + i_bh * N + rows, den, mask=rows < N)


@triton.jit
def _dstate_kernel(q_ptr, g_ptr, gd_ptr, turns_ptr, dh_ptr, dz_ptr, N, M, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dh[t] = dS_t = sum_{m after chunk t} (R q_m)^T G_m and dz[t] = sum_{m after chunk t} gd_m q_m,
    the gradients of the state and key sum that chunk t reads: chunks in reverse order.  Without
    `causal`, the sums over every row, the gradients of the one state all rows read (dh, dz: one per
    batch x head)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    q_ptr += i_bh * N * M
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
        rows = t * BT + tl.arange(0, BT)
        q = tile(q_ptr, rows, k_cols, N, M, M)
        if i_v == 0:
            if CAUSAL:
                tl.store(dz_ptr + (i_bh * n_chunks + t) * M + k_cols, d_z, mask=k_cols < M)
            gd = tl.load(gd_ptr + rows, mask=rows < N, other=0.0)
            d_z += tl.sum(q * gd[:, None], 0)
        if ROTARY:
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            q = rotate(q, cos, sin, BT, BK)
        d_state += mm(tl.trans(q), tile(g_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
    if not CAUSAL:
        store(dh_ptr + i_bh * M * DV, d_state, k_cols, v_cols, k_cols < M, DV, DV)
        if i_v == 0:
            tl.store(dz_ptr + i_bh * M + k_cols, d_z, mask=k_cols < M)


@triton.jit
def _dqk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, gd_ptr, turns_ptr, h_ptr, z_ptr, dh_ptr, dz_ptr, dq_ptr, dk_ptr,
                N, M, DV, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
                CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dq and dk of one chunk and feature tile, summed over the value tiles in the loop.

    Numerator (rows m, n of chunk t; mask keeps n <= m):
        d(R q)_m = sum_{n <= m} (G_m . v_n) R k_n = G_m S_t^T + [mask(G v^T) R k]_m
        d(R k)_n = sum_{m >= n} (G_m . v_n) R q_m = v_n dS_t^T + [mask(G v^T)^T R q]_n
    and dq = R^T d(R q), dk = R^T d(R k).  Denominator, den_m = q_m . (z_t + sum_{n in t, n <= m} k_n):
        dq_m += gd_m (z_t + sum_{n in t, n <= m} k_n)
        dk_n += dz_t + sum_{m in t, m >= n} gd_m q_m
    Without `causal` S, z, dS, dz are the whole sequence's and the sums inside the chunk drop out:
        dq = R^T (G S^T) + gd z,  dk = R^T (v dS^T) + dz.
    """
    i_k, t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    g_ptr += i_bh * N * DV
    gd_ptr += i_bh * N
    h_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    dh_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    z_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    dz_ptr += state_offset(i_bh, t, n_chunks, M, CAUSAL)
    rows = t * BT + tl.arange(0, BT)
    k_cols = i_k * BK + tl.arange(0, BK)
    q = tile(q_ptr, rows, k_cols, N, M, M)
    k = tile(k_ptr, rows, k_cols, N, M, M)
    q_rot, k_rot = q, k
    if ROTARY:
        cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
        q_rot = rotate(q, cos, sin, BT, BK)
        k_rot = rotate(k, cos, sin, BT, BK)
    d_q_rot = tl.zeros((BT, BK), dtype=tl.float32)
    d_k_rot = tl.zeros((BT, BK), dtype=tl.float32)
    d_scores = tl.zeros((BT, BT), dtype=tl.float32)     # G v^T, summed over value tiles
    for i_v in range(tl.cdiv(DV, BV)):
        v_cols = i_v * BV + tl.arange(0, BV)
        v = tile(v_ptr, rows, v_cols, N, DV, DV)
        g = tile(g_ptr, rows, v_cols, N, DV, DV)
        d_q_rot += mm(g, tl.trans(tile(h_ptr, k_cols, v_cols, M, DV, DV)), DOT, PRECISION)
        d_k_rot += mm(v, tl.trans(tile(dh_ptr, k_cols, v_cols, M, DV, DV)), DOT, PRECISION)
        if CAUSAL:
            d_scores += mm(g, tl.trans(v), DOT, PRECISION)
    if CAUSAL:
        d_scores = tl.where(rows[:, None] >= rows[None, :], d_scores, 0.0)
        d_q_rot += mm(d_scores, k_rot, DOT, PRECISION)
        d_k_rot += mm(tl.trans(d_scores), q_rot, DOT, PRECISION)
    if ROTARY:
        d_q_rot = unrotate(d_q_rot, cos, sin, BT, BK)
        d_k_rot = unrotate(d_k_rot, cos, sin, BT, BK)
    gd = tl.load(gd_ptr + rows, mask=rows < N, other=0.0)
    z = tl.load(z_ptr + k_cols, mask=k_cols < M, other=0.0)
    d_z = tl.load(dz_ptr + k_cols, mask=k_cols < M, other=0.0)
    if CAUSAL:
        dq = d_q_rot + gd[:, None] * (z[None, :] + tl.cumsum(k, 0))
        dk = d_k_rot + d_z[None, :] + tl.cumsum(gd[:, None] * q, 0, reverse=True)
    else:
        dq = d_q_rot + gd[:, None] * z[None, :]
        dk = d_k_rot + d_z[None, :]
    store(dq_ptr + i_bh * N * M, dq, rows, k_cols, rows < N, M, M)
    store(dk_ptr + i_bh * N * M, dk, rows, k_cols, rows < N, M, M)


@triton.jit
def _dv_kernel(q_ptr, k_ptr, g_ptr, turns_ptr, dh_ptr, dv_ptr, N, M, DV,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROTARY: tl.constexpr,
               CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dv of one chunk and value tile, summed over the feature tiles in the loop:
        dv_n = sum_{m >= n} (R q_m . R k_n) G_m = R k_n dS_t + [mask(R q (R k)^T)^T G]_n,
    and without `causal` dv_n = R k_n dS, dS the whole sequence's."""
    i_v, t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.cdiv(N, BT)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    g_ptr += i_bh * N * DV
    dh_ptr += state_offset(i_bh, t, n_chunks, M * DV, CAUSAL)
    rows = t * BT + tl.arange(0, BT)
    v_cols = i_v * BV + tl.arange(0, BV)
    dv = tl.zeros((BT, BV), dtype=tl.float32)
    scores_t = tl.zeros((BT, BT), dtype=tl.float32)     # R k (R q)^T: [n, m]
    for i_k in range(tl.cdiv(M, BK)):
        k_cols = i_k * BK + tl.arange(0, BK)
        q = tile(q_ptr, rows, k_cols, N, M, M)
        k = tile(k_ptr, rows, k_cols, N, M, M)
        if ROTARY:
            cos, sin = phases(turns_ptr, t * BT, i_k, M // 2, BT, BK)
            q = rotate(q, cos, sin, BT, BK)
            k = rotate(k, cos, sin, BT, BK)
        dv += mm(k, tile(dh_ptr, k_cols, v_cols, M, DV, DV), DOT, PRECISION)
        if CAUSAL:
            scores_t += mm(k, tl.trans(q), DOT, PRECISION)
    if CAUSAL:
        scores_t = tl.where(rows[:, None] <= rows[None, :], scores_t, 0.0)
        dv += mm(scores_t, tile(g_ptr, rows, v_cols, N, DV, DV), DOT, PRECISION)
    store(dv_ptr + i_bh * N * DV, dv, rows, v_cols, rows < N, DV, DV)


class _Shapes:
    """Sizes, tiles and dot settings of a call on (B, H, N, M) features and (B, H, N, Dv) values."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk: int, level: int = 0):
        self.batch_heads, self.n, self.m = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        self.dv = v.shape[-1]
        check_grid(q.shape[0], q.shape[1], self.n, self.m, self.dv, rows_per_program=chunk, chunk=chunk)
        feature_tile, value_tile = TILE_LEVELS[level]
        self.bt, self.bk, self.bv = chunk, tile_size(self.m, feature_tile), tile_size(self.dv, value_tile)
        self.n_t, self.n_k, self.n_v = (triton.cdiv(a, b) for a, b in
                                        ((self.n, self.bt), (self.m, self.bk), (self.dv, self.bv)))
        self.dot, self.precision = dot_settings(q.dtype)
        # Per-chunk states between the passes: bf16 where the dots take bf16, float32 otherwise.
        self.state_dtype = torch.bfloat16 if self.dot == tl.bfloat16 else torch.float32

    def args(self):
        return self.n, self.m, self.dv

    def constants(self, rotary: bool):
        return dict(BT=self.bt, BK=self.bk, BV=self.bv, ROTARY=rotary, DOT=self.dot, PRECISION=self.precision)

    def chunk_states(self, like: torch.Tensor):
        """Empty per-chunk states (B*H, chunks, M, Dv) and key sums (B*H, chunks, M)."""
        h = like.new_empty((self.batch_heads, self.n_t, self.m, self.dv), dtype=self.state_dtype)
        return h, like.new_empty((self.batch_heads, self.n_t, self.m), dtype=torch.float32)


def _whole_sequence_state(like: torch.Tensor, shapes: _Shapes):
    """Empty float32 (B, H, M, Dv) state and (B, H, M) key sum (or their gradients) of a whole sequence."""
    kv = like.new_empty((*like.shape[:2], shapes.m, shapes.dv), dtype=torch.float32)
    return kv, like.new_empty(kv.shape[:-1], dtype=torch.float32)


def _states(q, k, v, turns, shapes: _Shapes, rotary: bool, causal: bool, want_state: bool):
    """The states the output pass reads (h, z: per chunk when causal, else the whole sequence's) and,
    with `want_state`, the state after the last token (kv, k_sum)."""
    kv, k_sum = _whole_sequence_state(q, shapes) if want_state or not causal else (q.new_empty(0),) * 2
    h, z = shapes.chunk_states(q) if causal else (kv, k_sum)
    _states_kernel[(shapes.n_k, shapes.n_v, shapes.batch_heads)](
        k, v, turns, h, z, kv, k_sum, *shapes.args(), CHUNKS=causal, STATE=want_state or not causal,
        **shapes.constants(rotary))
    return h, z, kv, k_sum


_FITTING_LEVEL: dict = {}   # (pass, rotary, causal, device, dtype) -> the first level whose tiles fitted


class _ChunkParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, turns, rotary, causal, chunk, want_state):
        def at_level(level):
            shapes = _Shapes(q, v, chunk, level)
            h, z, kv, k_sum = _states(q, k, v, turns, shapes, rotary, causal, want_state)
            out = torch.empty_like(v)
            den = q.new_empty(q.shape[:-1], dtype=torch.float32)
            _output_kernel[(shapes.n_v, shapes.n_t, shapes.batch_heads)](
                q, k, v, turns, h, z, out, den, *shapes.args(), CAUSAL=causal, **shapes.constants(rotary))
            return out, den, kv, k_sum

        out, den, kv, k_sum = launch_fitting(_FITTING_LEVEL, ("forward", rotary, causal, q.device, q.dtype),
                                             len(TILE_LEVELS), at_level, "chunk-parallel")
        ctx.save_for_backward(q, k, v, out, den, turns)
        ctx.rotary, ctx.causal, ctx.chunk = rotary, causal, chunk
        ctx.mark_non_differentiable(kv, k_sum)
        return out, kv, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _d_kv, _d_k_sum):
        q, k, v, out, den, turns = ctx.saved_tensors
        g, gd = (t.contiguous() for t in output_gradients(grad.float(), out.float(), den))

        def at_level(level):
            shapes = _Shapes(q, v, ctx.chunk, level)
            constants = dict(CAUSAL=ctx.causal, **shapes.constants(ctx.rotary))
            h, z, _, _ = _states(q, k, v, turns, shapes, ctx.rotary, ctx.causal, want_state=False)
            dh, dz = shapes.chunk_states(q) if ctx.causal else _whole_sequence_state(q, shapes)
            _dstate_kernel[(shapes.n_k, shapes.n_v, shapes.batch_heads)](
                q, g, gd, turns, dh, dz, *shapes.args(), **constants)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _dqk_kernel[(shapes.n_k, shapes.n_t, shapes.batch_heads)](
                q, k, v, g, gd, turns, h, z, dh, dz, dq, dk, *shapes.args(), **constants)
            _dv_kernel[(shapes.n_v, shapes.n_t, shapes.batch_heads)](
                q, k, g, turns, dh, dv, *shapes.args(), **constants)
            return dq, dk, dv

        dq, dk, dv = launch_fitting(_FITTING_LEVEL, ("backward", ctx.rotary, ctx.causal, q.device, q.dtype),
                                    len(TILE_LEVELS), at_level, "chunk-parallel")
        return dq, dk, dv, None, None, None, None, None


def check_chunk(chunk) -> None:
    if not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"the chunk-parallel kernels take chunks of a power of two >= 16 tokens (tl.dot's "
                         f"smallest tile), got {chunk!r}")


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool, rotary: bool,
                     offset: int = 0, rope_base: float = DEFAULT_BASE, return_state: bool = False,
                     chunk: int = CHUNK):
    """Eq. 19 of (B, H, N, M) non-negative features and (B, H, N, Dv) values with the chunk-parallel
    kernels; the same call and results as the torch backend (and its `LinearState` with
    `return_state`, causal only).  Called by `linattn.functional.linear_attention`, which has
    checked the inputs (N >= 1)."""
    check_chunk(chunk)
    if return_state and not causal:
        raise ValueError("return_state=True needs causal=True: a non-causal pass has no decoding state")
    dtype = common_dtype(phi_q, phi_k, v)
    turns = angle_table(max(phi_q.shape[-1] // 2, 1), float(rope_base), offset if rotary else 0, phi_q.device)
    with torch.autocast(phi_q.device.type, enabled=False):
        q, k, v_c = (t.to(dtype).contiguous() for t in (phi_q, phi_k, v))
        out, kv, k_sum = _ChunkParallelAttention.apply(q, k, v_c, turns, rotary, causal, chunk, return_state)
    out = out.to(v.dtype)
    return (out, LinearState(kv, k_sum, int(offset) + q.shape[-2])) if return_state else out
