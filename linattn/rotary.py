"""Rotary position embedding (RoPE) over adjacent coordinate pairs (2i, 2i+1).

Pair i at position p is rotated by the angle p * theta_i with theta_i = base^(-2i/dim), so a dot
product of two rotated vectors depends only on their relative position.  This one function is used
for every placement: on q and k (softmax, `pre`) and on feature maps phi(q), phi(k) (`post`, Eq. 19).
Each pair is treated as a complex number and multiplied by e^(i p theta): one pass over memory.
Angles are reduced mod 2 pi exactly at any position below 2^63 (docs/numerics.md derives it).
"""
from __future__ import annotations

import math
from functools import lru_cache

import mpmath
import torch

from .checks import check_real_floating, check_rope_base, is_integer

DEFAULT_BASE = 10000.0
_DIGIT_BITS = 16
_MAX_POSITION = 2 ** 63 - 1          # positions are int64


def check_rotated_dim(dim: int, what: str = "the rotated dimension", fix: str = "an even head_dim / num_features (M)"
                      ) -> None:
    """RoPE rotates pairs (2i, 2i+1): `what`, of size `dim`, must be even (`fix` says how)."""
    if dim % 2:
        raise ValueError(f"rotary embedding rotates pairs (2i, 2i+1), so {what} must be even, got {dim}; "
                         f"use {fix} or turn rotation off")


def rotary_frequencies(dim: int, base: float = DEFAULT_BASE) -> list[float]:
    """theta_i = base^(-2i/dim) in float64, i = 0..dim/2-1."""
    return [base ** (-2 * i / dim) for i in range(dim // 2)]


@lru_cache(maxsize=32)
def _digit_angles(dim: int, base: float) -> tuple[tuple[float, ...], ...]:
    """c_j = 2^(16 j) theta mod 2 pi for the 4 digits of an int64 position, exact to float64."""
    with mpmath.workdps(50):
        two_pi = 2 * mpmath.pi
        return tuple(tuple(float(mpmath.fmod(mpmath.mpf(2) ** (_DIGIT_BITS * j) * theta, two_pi))
                           for theta in rotary_frequencies(dim, base))
                     for j in range(64 // _DIGIT_BITS))


def check_offset(offset) -> None:
    """A position offset is a non-negative integer (bool is not)."""
    if not is_integer(offset) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer position, got {offset!r}")


def check_positions(offset, length: int) -> None:
    """Positions offset..offset+length-1 are int64s: rotations are exact below 2^63."""
    check_offset(offset)
    if int(offset) + length - 1 > _MAX_POSITION:
        raise ValueError(f"rotary positions must stay below 2^63, got offset {offset} with {length} tokens")


def rotary_angles(length: int, dim: int, *, offset: int = 0, base: float = DEFAULT_BASE,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """p * theta_i up to multiples of 2 pi, float64 of shape (length, dim/2) and below 2^21, for
    positions p = offset..offset+length-1 (no final fmod: float64's 2 pi would cost more than it saves)."""
    offset = int(offset)
    positions = torch.arange(length, dtype=torch.int64, device=device) + offset
    angles = torch.zeros(length, dim // 2, dtype=torch.float64, device=device)
    digits = max(1, math.ceil((offset + length).bit_length() / _DIGIT_BITS))
    for j, row in enumerate(_digit_table(dim, float(base), str(device))[:digits]):
        digit = (positions >> (_DIGIT_BITS * j)) & (2 ** _DIGIT_BITS - 1)
        angles += digit.to(torch.float64).unsqueeze(-1) * row
    return angles


@lru_cache(maxsize=32)
def _digit_table(dim: int, base: float, device: str) -> torch.Tensor:
    # _digit_angles on the device, copied there once: a copy from host memory makes the host wait for the
    # device, which decoding (a new offset each step) would otherwise do at every step.
    with torch.inference_mode(False):
        return torch.tensor(_digit_angles(dim, base), dtype=torch.float64, device=device)


@lru_cache(maxsize=8)   # training repeats a few (offset, length) pairs; decoding misses, at O(dim) each
def _phases(length: int, dim: int, offset: int, base: float, device: str, complex_dtype: torch.dtype):
    # A normal tensor even when first asked for under inference_mode: autograd may not save an
    # inference tensor, and the cache hands this one to the training calls that follow.
    with torch.inference_mode(False):
        angles = rotary_angles(length, dim, offset=offset, base=base, device=device)
        return torch.polar(torch.ones_like(angles), angles).to(complex_dtype)


def rotary_phases(length: int, dim: int, *, offset: int = 0, base: float = DEFAULT_BASE,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e^(i p theta_j) of shape (length, dim/2) for positions offset..offset+length-1, complex of
    `dtype`'s precision.  Read-only: the last few are cached."""
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    if torch.compiler.is_compiling():   # a constant of the shapes, computed outside the graph
        return phases_op(length, dim, offset, float(base), torch.device(device), dtype == torch.float64)
    return _phases(length, dim, offset, float(base), str(torch.device(device)), complex_dtype)


@torch.library.custom_op("linattn::rotary_phases", mutates_args=())
def phases_op(length: int, dim: int, offset: int, base: float, device: torch.device, double: bool) -> torch.Tensor:
    """`rotary_phases` as an op for torch.compile: dynamo cannot trace its cache or mpmath.  A copy,
    since an op's output may not be a tensor that lives on (the cache's)."""
    complex_dtype = torch.complex128 if double else torch.complex64
    return _phases(length, dim, offset, base, str(device), complex_dtype).clone()


@phases_op.register_fake
def _(length, dim, offset, base, device, double):
    return torch.empty(length, dim // 2, dtype=torch.complex128 if double else torch.complex64, device=device)


def apply_rotary(x: torch.Tensor, *, offset: int = 0, base: float = DEFAULT_BASE) -> torch.Tensor:
    """Rotate the last dimension of x (..., N, dim) at positions offset..offset+N-1.

    Args:
        x: a real floating tensor (..., N, dim), dim even.
        offset: the position of x's first row, a non-negative integer.
        base: RoPE's base, a finite number > 0.

    Returns:
        the rotated x, in x's dtype.
    """
    check_rotary_input(x)
    check_rotated_dim(x.shape[-1])
    check_positions(offset, x.shape[-2])
    check_rope_base(base)
    return rotate(x, offset=int(offset), base=base)


def rotate(x: torch.Tensor, *, offset: int = 0, base: float = DEFAULT_BASE) -> torch.Tensor:
    """`apply_rotary` for callers that checked its arguments."""
    real_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    phases = rotary_phases(x.shape[-2], x.shape[-1], offset=offset, base=base, device=x.device,
                           dtype=real_dtype)
    return rotate_pairs(x.to(real_dtype).contiguous(), phases).to(x.dtype)


def check_rotary_input(x) -> None:
    """A real floating tensor of at least 2 dimensions (positions, then the pairs): the result comes back
    in x's dtype, so an integer tensor would be rotated and then truncated."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"apply_rotary takes a tensor of shape (..., N, dim), got {type(x).__name__}")
    check_real_floating("x", x)
    if x.device.type == "meta":
        raise ValueError("apply_rotary computes the rotation, so x must be on a device that computes, not meta")
    if x.dim() < 2:
        raise ValueError(f"apply_rotary takes x of shape (..., N, dim): positions, then the pairs to rotate; "
                         f"got shape {tuple(x.shape)}")


def pairs_view(x: torch.Tensor) -> bool:
    """Whether x's rows of pairs can be viewed as complex numbers as they lie (view_as_complex's rule on
    strides; the offsets of heads of an even width, and of whole rows, are even too)."""
    return x.stride(-1) == 1 and all(stride % 2 == 0 for stride in x.stride()[:-1])


def rotate_pairs(x: torch.Tensor, phases: torch.Tensor, *, dense: bool = False) -> torch.Tensor:
    """x (..., N, dim) with each pair (2i, 2i+1) multiplied, as a complex number, by `phases`
    (N, dim/2): one pass over memory.  x's last dimension must be contiguous.  `dense`: the result is
    contiguous, from x of any strides (a view of a projection's heads: still one pass; rows that cannot
    be viewed as pairs are copied first), with no autograd: for tensors that a custom backward handles."""
    if dense and not pairs_view(x):
        x = x.contiguous()
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    if not dense or torch.compiler.is_compiling():   # a traced graph takes no out= (inductor fuses the copy)
        rotated = torch.view_as_real(pairs * phases).flatten(-2)
        return rotated.contiguous() if dense else rotated
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        torch.mul(pairs, phases, out=torch.view_as_complex(out.unflatten(-1, (-1, 2))))
    return out
