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

Angles: position p times theta_i / 2pi is formed in float64 and reduced to a fraction of a turn
before going to float32, so offsets of 1e9 stay accurate to ~1e-6 rad.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...rotary import DEFAULT_BASE
from .backends import interpreting
from .common import divide
from .recurrent import LinearState

INTERPRETED = interpreting()   # fixed when the kernels below are decorated
CHUNK = 64            # tokens per step of the scan (BT)
# Tiles measured on an H100 (b=1, h=8, M=256, Dv=64, fp32 fwd+bwd, N=4096 and 65536): BK=32 was
# 1.7-2.4x faster than BK=64 (twice the programs); BV=16 gained nothing over 32 and costs one
# more partial dq/dk each.
FEATURE_TILE = 32     # feature tile (BK): the BK x BV state tile lives in registers
VALUE_TILE = 64       # largest value tile (BV); narrowed to 32 when the grid would leave SMs idle
MIN_VALUE_TILE = 32
TWO_PI = 2 * math.pi


@triton.jit
def _rotate(x, cos, sin, BT: tl.constexpr, BK: tl.constexpr):
    """Multiply each pair (2i, 2i+1) of the (BT, BK) tile x by cos + i sin, of shape (BT, BK/2)."""
    even, odd = tl.split(tl.reshape(x, (BT, BK // 2, 2)))
    return tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BT, BK))


@triton.jit
def _phases(turns_ptr, first, i_k, HALF, BT: tl.constexpr, BK: tl.constexpr):
    """cos and sin of positions first..first+BT-1 for the feature pairs of tile i_k."""
    pairs = i_k * (BK // 2) + tl.arange(0, BK // 2)
    turns = tl.load(turns_ptr + pairs, mask=pairs < HALF, other=0.0)        # theta / 2pi, float64
    position = (first + tl.arange(0, BT)).to(tl.float64)
    turn = position[:, None] * turns[None, :]
    angle = (turn - tl.floor(turn)).to(tl.float32) * 6.283185307179586
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _tile(ptr, rows, cols, n_rows, n_cols, stride):
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, value, rows, cols, n_rows, n_cols, stride):
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(ptr + rows[:, None] * stride + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit(do_not_specialize=["offset", "N"])
def _forward_kernel(q_ptr, k_ptr, v_ptr, turns_ptr, num_ptr, den_ptr, kv_ptr, ksum_ptr,
                    offset, N, M, DV,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr,
                    ROTARY: tl.constexpr, STATE: tl.constexpr, DOT: tl.constexpr,
                    PRECISION: tl.constexpr):
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_bh = tl.num_programs(2)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
    num_ptr += (i_k * n_bh + i_bh) * N * DV
    den_ptr += (i_k * n_bh + i_bh) * N
    k_cols = i_k * BK + tl.arange(0, BK)
    v_cols = i_v * BV + tl.arange(0, BV)
    within = tl.arange(0, BT)
    causal_mask = within[:, None] >= within[None, :]
    state = tl.zeros((BK, BV), dtype=tl.float32)
    k_sum = tl.zeros((BK,), dtype=tl.float32)
    n_chunks = tl.cdiv(N, BT)
    if not CAUSAL:  # every query sees every key: build the whole state first
        for t in range(0, n_chunks):
            rows = t * BT + within
            k = _tile(k_ptr, rows, k_cols, N, M, M)
            v = _tile(v_ptr, rows, v_cols, N, DV, DV)
            k_rot = k
            if ROTARY:
                cos, sin = _phases(turns_ptr, offset + t * BT, i_k, M // 2, BT, BK)
                k_rot = _rotate(k, cos, sin, BT, BK)
            state += _mm(tl.trans(k_rot), v, DOT, PRECISION)
            k_sum += tl.sum(k, axis=0)
    for t in range(0, n_chunks):
        rows = t * BT + within
        q = _tile(q_ptr, rows, k_cols, N, M, M)
        q_rot = q
        if ROTARY:
            cos, sin = _phases(turns_ptr, offset + t * BT, i_k, M // 2, BT, BK)
            q_rot = _rotate(q, cos, sin, BT, BK)
        if CAUSAL:
            k = _tile(k_ptr, rows, k_cols, N, M, M)
            v = _tile(v_ptr, rows, v_cols, N, DV, DV)
            k_rot = k
            if ROTARY:
                k_rot = _rotate(k, cos, sin, BT, BK)
            scores = tl.where(causal_mask, _mm(q_rot, tl.trans(k_rot), DOT, PRECISION), 0.0)
            num = _mm(scores, v, DOT, PRECISION) + _mm(q_rot, state, DOT, PRECISION)
            den = tl.sum(q * (tl.cumsum(k, axis=0) + k_sum[None, :]), axis=1)
            state += _mm(tl.trans(k_rot), v, DOT, PRECISION)
            k_sum += tl.sum(k, axis=0)
        else:
            num = _mm(q_rot, state, DOT, PRECISION)
            den = tl.sum(q * k_sum[None, :], axis=1)
        _store(num_ptr, num, rows, v_cols, N, DV, DV)
        if i_v == 0:
            tl.store(den_ptr + rows, den, mask=rows < N)
    if STATE:
        _store(kv_ptr + i_bh * M * DV, state, k_cols, v_cols, M, DV, DV)
        if i_v == 0:
            tl.store(ksum_ptr + i_bh * M + k_cols, k_sum, mask=k_cols < M)


@triton.jit
def _backward_chunk(q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, turns_ptr, t, offset, i_k, k_cols, v_cols,
                    N, M, DV, BT: tl.constexpr, BK: tl.constexpr, ROTARY: tl.constexpr):
    """Chunk t's tiles for backward: features, values, output gradients, the rotated features and
    the phases that rotate back their gradients (identity phases without rotation)."""
    rows = t * BT + tl.arange(0, BT)
    q = _tile(q_ptr, rows, k_cols, N, M, M)
    k = _tile(k_ptr, rows, k_cols, N, M, M)
    v = _tile(v_ptr, rows, v_cols, N, DV, DV)
    g_num = _tile(dnum_ptr, rows, v_cols, N, DV, DV)
    g_den = tl.load(dden_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    cos = tl.full((BT, BK // 2), 1.0, tl.float32)
    sin = tl.zeros((BT, BK // 2), tl.float32)
    q_rot, k_rot = q, k
    if ROTARY:
        cos, sin = _phases(turns_ptr, offset + t * BT, i_k, M // 2, BT, BK)
        q_rot, k_rot = _rotate(q, cos, sin, BT, BK), _rotate(k, cos, sin, BT, BK)
    return rows, q, k, v, g_num, g_den, q_rot, k_rot, cos, sin


@triton.jit(do_not_specialize=["offset", "N"])
def _backward_kernel(q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, turns_ptr, dq_ptr, dk_ptr, dv_ptr,
                     offset, N, M, DV,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr,
                     ROTARY: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_bh = tl.num_programs(2)
    q_ptr += i_bh * N * M
    k_ptr += i_bh * N * M
    v_ptr += i_bh * N * DV
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

    # Pass 1, forward in time: d(Rq) needs the state S and key sum z of the chunks before.
    state = tl.zeros((BK, BV), dtype=tl.float32)
    k_sum = tl.zeros((BK,), dtype=tl.float32)
    d_state = tl.zeros((BK, BV), dtype=tl.float32)      # non-causal: sum over all of (Rq)^T G
    dq_sum = tl.zeros((BK,), dtype=tl.float32)          # non-causal: sum over all of g q
    for t in range(0, n_chunks):
        rows, q, k, v, g_num, g_den, q_rot, k_rot, cos, sin = _backward_chunk(
            q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, turns_ptr, t, offset, i_k, k_cols, v_cols, N, M, DV,
            BT, BK, ROTARY)
        if CAUSAL:
            d_scores = tl.where(causal_mask, _mm(g_num, tl.trans(v), DOT, PRECISION), 0.0)
            dq_rot = _mm(d_scores, k_rot, DOT, PRECISION) + _mm(g_num, tl.trans(state), DOT, PRECISION)
            dq = dq_rot
            if ROTARY:
                dq = _rotate(dq_rot, cos, -sin, BT, BK)
            if first_value_tile:
                dq += g_den[:, None] * (tl.cumsum(k, axis=0) + k_sum[None, :])
            _store(dq_ptr, dq, rows, k_cols, N, M, M)
        else:
            d_state += _mm(tl.trans(q_rot), g_num, DOT, PRECISION)
            dq_sum += tl.sum(g_den[:, None] * q, axis=0)
        state += _mm(tl.trans(k_rot), v, DOT, PRECISION)
        k_sum += tl.sum(k, axis=0)

    # Pass 2: backward in time for causal (dS, dz of the chunks after); any order otherwise.
    if CAUSAL:
        d_state = tl.zeros((BK, BV), dtype=tl.float32)
        dq_sum = tl.zeros((BK,), dtype=tl.float32)
    for i in range(0, n_chunks):
        t = n_chunks - 1 - i
        rows, q, k, v, g_num, g_den, q_rot, k_rot, cos, sin = _backward_chunk(
            q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, turns_ptr, t, offset, i_k, k_cols, v_cols, N, M, DV,
            BT, BK, ROTARY)
        dk_rot = _mm(v, tl.trans(d_state), DOT, PRECISION)
        dv = _mm(k_rot, d_state, DOT, PRECISION)
        g_q = g_den[:, None] * q
        if CAUSAL:
            scores = tl.where(causal_mask, _mm(q_rot, tl.trans(k_rot), DOT, PRECISION), 0.0)
            d_scores = tl.where(causal_mask, _mm(g_num, tl.trans(v), DOT, PRECISION), 0.0)
            dk_rot += _mm(tl.trans(d_scores), q_rot, DOT, PRECISION)
            dv += _mm(tl.trans(scores), g_num, DOT, PRECISION)
            dk_den = tl.cumsum(g_q, axis=0, reverse=True) + dq_sum[None, :]
        else:
            dq_rot = _mm(g_num, tl.trans(state), DOT, PRECISION)
            dq = dq_rot
            if ROTARY:
                dq = _rotate(dq_rot, cos, -sin, BT, BK)
            if first_value_tile:
                dq += g_den[:, None] * k_sum[None, :]
            _store(dq_ptr, dq, rows, k_cols, N, M, M)
            dk_den = tl.zeros((BT, BK), dtype=tl.float32) + dq_sum[None, :]
        dk = dk_rot
        if ROTARY:
            dk = _rotate(dk_rot, cos, -sin, BT, BK)
        if first_value_tile:
            dk += dk_den
        _store(dk_ptr, dk, rows, k_cols, N, M, M)
        _store(dv_ptr, dv, rows, v_cols, N, DV, DV)
        if CAUSAL:
            d_state += _mm(tl.trans(q_rot), g_num, DOT, PRECISION)
            dq_sum += tl.sum(g_q, axis=0)


def _tile_size(dim: int, largest: int) -> int:
    """Power-of-two tile of at least 16 (tl.dot's minimum) and at most `largest`."""
    return min(largest, max(16, triton.next_power_of_2(dim)))


def _value_tile(dv: int, programs_per_value_tile: int, device: torch.device) -> int:
    """Each program scans the whole sequence, so a grid of fewer programs than the GPU has SMs
    leaves most of it idle (b=1, h=8, M=256 gives 32): narrow the value tile until it fills them."""
    tile = _tile_size(dv, VALUE_TILE)
    if device.type != "cuda":
        return tile
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    while tile > MIN_VALUE_TILE and programs_per_value_tile * triton.cdiv(dv, tile) < processors:
        tile //= 2
    return tile


def _dot_settings(dtype: torch.dtype):
    """Half-precision inputs multiply in their own type.  float32 multiplies on tensor cores as
    3xTF32 (split operands: about float32 accuracy at a fraction of plain float32's cost).  Plain
    TF32 is not offered: with triton 3.6 on an H100 the backward kernel failed to compile with it
    (TritonGPUOptimizeDotOperands), and 3xTF32 was already 5-13x faster than plain float32 there."""
    if dtype in (torch.bfloat16, torch.float16):
        return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "ieee"
    return tl.float32, "tf32x3"


def _turns(half: int, base: float, device) -> torch.Tensor:
    """theta_i / 2pi = base^(-2i/M) / 2pi in float64: rotations per position of pair i."""
    return base ** (-torch.arange(half, dtype=torch.float64, device=device) / half) / TWO_PI


def _reduce(partials: torch.Tensor) -> torch.Tensor:
    """Sum the per-tile partial results (dim 0); a single tile needs no copy."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)


class _Launch:
    """The shapes, tiles and settings of one call, shared by forward and backward."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int,
                 base: float):
        self.batch_heads, self.n, self.m = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        self.dv = v.shape[-1]
        self.bk = _tile_size(self.m, FEATURE_TILE)
        self.n_k = triton.cdiv(self.m, self.bk)
        self.bv = _value_tile(self.dv, self.batch_heads * self.n_k, q.device)
        self.n_v = triton.cdiv(self.dv, self.bv)
        self.causal, self.rotary, self.offset = causal, rotary, offset
        self.dot, self.precision = _dot_settings(q.dtype)
        # Without rotation the kernels never read the table: any float64 tensor will do.
        self.turns = _turns(max(self.m // 2, 1), base, q.device)

    def grid(self):
        return (self.n_v, self.n_k, self.batch_heads)

    def constants(self):
        return dict(BT=CHUNK, BK=self.bk, BV=self.bv, CAUSAL=self.causal, ROTARY=self.rotary,
                    DOT=self.dot, PRECISION=self.precision)


class _FusedLinearAttention(torch.autograd.Function):
    """(numerator, denominator) of Eq. 19; the division happens outside, in torch."""

    @staticmethod
    def forward(ctx, q, k, v, causal, rotary, offset, base, want_state):
        run = _Launch(q, v, causal=causal, rotary=rotary, offset=offset, base=base)
        num = q.new_empty((run.n_k, *v.shape), dtype=torch.float32)
        den = q.new_empty((run.n_k, *q.shape[:-1]), dtype=torch.float32)
        state_shape = (*q.shape[:2], run.m) if want_state else (0,)   # kernels skip it without STATE
        kv = q.new_empty((*state_shape, run.dv) if want_state else state_shape, dtype=torch.float32)
        k_sum = q.new_empty(state_shape, dtype=torch.float32)
        _forward_kernel[run.grid()](q, k, v, run.turns, num, den, kv, k_sum, offset, run.n, run.m,
                                    run.dv, STATE=want_state, **run.constants())
        ctx.save_for_backward(q, k, v)
        ctx.run = run
        ctx.mark_non_differentiable(kv, k_sum)
        return _reduce(num), _reduce(den), kv, k_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_num, d_den, _d_kv, _d_k_sum):
        q, k, v = ctx.saved_tensors
        run = ctx.run
        d_num = torch.zeros_like(v, dtype=torch.float32) if d_num is None else d_num.contiguous()
        d_den = q.new_zeros(q.shape[:-1], dtype=torch.float32) if d_den is None else d_den.contiguous()
        dq = q.new_empty((run.n_v, *q.shape), dtype=torch.float32)
        dk = q.new_empty((run.n_v, *q.shape), dtype=torch.float32)
        dv = q.new_empty((run.n_k, *v.shape), dtype=torch.float32)
        _backward_kernel[run.grid()](q, k, v, d_num, d_den, run.turns, dq, dk, dv, run.offset,
                                     run.n, run.m, run.dv, **run.constants())
        return (_reduce(dq).to(q.dtype), _reduce(dk).to(k.dtype), _reduce(dv).to(v.dtype),
                None, None, None, None, None)


def _common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if torch.float64 in dtypes:
        raise ValueError("backend='triton' computes in float32 (bf16/fp16 inputs multiply in their own "
                         "type); for float64 use backend='torch'")
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     rotary: bool, offset: int = 0, rope_base: float = DEFAULT_BASE,
                     return_state: bool = False):
    """Eq. 19 with the fused kernels; the same call and results as the torch backend.  Called by
    `linattn.functional.linear_attention`, which has checked the inputs."""
    if interpreting() != INTERPRETED:
        raise RuntimeError(f"TRITON_INTERPRET was {'on' if INTERPRETED else 'off'} when linattn's kernels were "
                           "imported and has changed since; set it before the first triton call")
    if rotary and phi_q.shape[-1] % 2:
        raise ValueError(f"rotary=True rotates pairs of features, so M must be even, got {phi_q.shape[-1]}")
    dtype = _common_dtype(phi_q, phi_k, v)
    with torch.autocast(phi_q.device.type, enabled=False):
        q, k, v_c = (t.to(dtype).contiguous() for t in (phi_q, phi_k, v))
        num, den, kv, k_sum = _FusedLinearAttention.apply(q, k, v_c, causal, rotary, int(offset),
                                                          float(rope_base), return_state)
        out = divide(num, den).to(v.dtype)
    if not return_state:
        return out
    return out, LinearState(kv, k_sum, int(offset) + phi_q.shape[-2])
