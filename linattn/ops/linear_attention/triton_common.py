"""Triton helpers shared by the kernels of chunk_parallel.py (plain features) and
log_chunk_parallel.py (log-features): tiles, rotation, the angle table, dot settings and the
launch that falls back to smaller tiles where a GPU has less shared memory.

Angles: the offset's turns, offset * theta_i / 2pi mod 1, come from rotary.py's exact reduction
(any offset below 2^63); the kernels add row * theta_i / 2pi in float64 for the rows of the call
and reduce to a fraction of a turn before going to float32, so every position is accurate to ~1e-6
rad."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...rotary import rotary_angles
from .backends import interpreting

INTERPRETED = interpreting()   # fixed when the kernels are decorated (dot_settings reads it)
MAX_GRID_Z = 65_535            # CUDA's limit on a grid's third dimension, which holds batch x heads
TWO_PI = 2 * math.pi


@triton.jit
def rotate(x, cos, sin, BT: tl.constexpr, BK: tl.constexpr):
    """Multiply each pair (2i, 2i+1) of the (BT, BK) tile x by cos + i sin, of shape (BT, BK/2)."""
    even, odd = tl.split(tl.reshape(x, (BT, BK // 2, 2)))
    return tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BT, BK))


@triton.jit
def unrotate(x, cos, sin, BT: tl.constexpr, BK: tl.constexpr):
    """R^T x: the rotation by the opposite angles, which carries a gradient back through R."""
    return rotate(x, cos, -sin, BT, BK)


@triton.jit
def phases(turns_ptr, first, i_k, HALF, BT: tl.constexpr, BK: tl.constexpr):
    """cos and sin of rows first..first+BT-1 (positions offset + row) for the feature pairs of tile
    i_k; the table holds theta / 2pi, then offset * theta / 2pi mod 1 (both float64)."""
    pairs = i_k * (BK // 2) + tl.arange(0, BK // 2)
    turns = tl.load(turns_ptr + pairs, mask=pairs < HALF, other=0.0)
    start = tl.load(turns_ptr + HALF + pairs, mask=pairs < HALF, other=0.0)
    row = (first + tl.arange(0, BT)).to(tl.float64)
    turn = start[None, :] + row[:, None] * turns[None, :]
    angle = (turn - tl.floor(turn)).to(tl.float32) * 6.283185307179586
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def tile(ptr, rows, cols, n_rows, n_cols, stride):
    """The (rows, cols) tile of a row-major matrix in float32, zero outside (n_rows, n_cols)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store(ptr, value, rows, cols, row_mask, n_cols, stride):
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    tl.store(ptr + rows[:, None] * stride + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def mm(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PRECISION, out_dtype=tl.float32)


def tile_size(dim: int, largest: int) -> int:
    """Power-of-two tile of at least 16 (tl.dot's minimum) and at most `largest`."""
    return min(largest, max(16, triton.next_power_of_2(dim)))


def dot_settings(dtype: torch.dtype):
    """bf16 inputs multiply in bf16.  Everything else multiplies as float32 on tensor cores, as
    3xTF32 (split operands: about float32 accuracy at a fraction of plain float32's cost): fp16 too,
    since the float32 state and scores cast to fp16 overflow past 65504 (bf16 keeps float32's
    range).  In the interpreter bf16 multiplies as float32 as well: triton 3.7's interpreted bf16
    tl.dot is wrong (off by 1e8 on a 16 x 16 product).  Plain TF32 is not offered: with triton 3.6
    on an H100 a backward kernel failed to compile with it (TritonGPUOptimizeDotOperands), and
    3xTF32 was already 5-13x faster than plain float32 there."""
    if dtype == torch.bfloat16 and not INTERPRETED:
        return tl.bfloat16, "ieee"
    return tl.float32, "tf32x3"


def angle_table(half: int, base: float, offset: int, device) -> torch.Tensor:
    """The kernels' angle table (2 * half,) in float64: theta_i / 2pi = base^(-2i/M) / 2pi, then the
    offset's turns offset * theta_i / 2pi mod 1, reduced exactly by rotary_angles."""
    per_position = base ** (-torch.arange(half, dtype=torch.float64) / half) / TWO_PI
    start = rotary_angles(1, 2 * half, offset=offset, base=base)[0] / TWO_PI
    return torch.cat([per_position, start - start.floor()]).to(device)


def common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the kernels take: the inputs' when they agree, float32 when they differ."""
    dtypes = {t.dtype for t in tensors}
    if torch.float64 in dtypes:
        raise ValueError("backend='triton' computes in float32 (bf16/fp16 inputs multiply in their own "
                         "type); for float64 use backend='torch'")
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def check_interpreter_unchanged() -> None:
    if interpreting() != INTERPRETED:
        raise RuntimeError(f"TRITON_INTERPRET was {'on' if INTERPRETED else 'off'} when linattn's kernels were "
                           "imported and has changed since; set it before the first triton call")


@triton.jit
def state_offset(i_bh, t, n_chunks, size, CAUSAL: tl.constexpr):
    """Where the state that chunk t reads starts: its own S_t when causal, else the one state of the
    whole sequence of (batch, head) i_bh; `size` is one state's."""
    offset = i_bh * size
    if CAUSAL:
        offset = (i_bh * n_chunks + t) * size
    return offset


def check_grid(batch: int, heads: int, n: int, m: int, dv: int, rows_per_program: int, chunk: int) -> None:
    """What one call's launches can address: batch x heads on the grid's z axis and the row blocks on
    its y axis (CUDA allows 65,535 on each), and offsets within one (batch, head) in int32, as the
    kernels compute them (features, values and the per-chunk states)."""
    if batch * heads > MAX_GRID_Z:
        raise ValueError(f"backend='triton' takes at most {MAX_GRID_Z:,} batch x heads per call (CUDA's "
                         f"grid limit), got {batch} x {heads}; split the batch or use backend='torch'")
    most_rows = min(MAX_GRID_Z * rows_per_program,
                    (2 ** 31 - 1) // max(m, dv, 1), (2 ** 31 - 1) // max(m * dv, 1) * chunk)
    if n > most_rows:
        raise ValueError(f"backend='triton' takes at most {most_rows:,} tokens per call with M={m}, Dv={dv} "
                         f"(CUDA's grid limit and 32-bit offsets), got {n:,}; split the sequence (offset= and "
                         "return_state=True carry it on) or use backend='torch'")


def launch_fitting(fitted: dict, key: tuple, levels: int, run_at_level, kernels: str):
    """run_at_level(level) runs a pass's kernels with the tiles of level `level` (of `levels`, largest
    first).  Triton raises OutOfResources when a kernel needs more shared memory per block than the
    GPU has (an RTX 30xx or L4 has 99 KB): the next level is tried, and the one that fits is
    remembered in `fitted` under `key` (which names the pass, its modes, device and dtype)."""
    level = fitted.get(key, 0)
    while True:
        try:
            result = run_at_level(level)
        except OutOfResources as error:
            if level + 1 == levels:
                raise RuntimeError(f"linattn's {kernels} kernels do not fit this GPU even with their "
                                   f"smallest tiles ({error}); use backend='torch'") from None
            level += 1
            continue
        fitted[key] = level
        return result
